// The compile-time variants of the fused step, and the one place that picks a variant from the op's
// runtime arguments: the CPU and CUDA steps must choose the same way.
#pragma once

#include <cstdint>
#include <type_traits>

#include "philox.h"

namespace fgfw {

// Where the direction g comes from: a regenerated tangent (sum_k coeff_k u_k) or the gradient.
enum class Source { kGaussian, kRademacher, kGrad };

// The step's two factors in the compute type (reference.step_factors): keep = RN(1 - alpha), from alpha in float64
// (the L1 step scales every element by it, then sets the vertex element: feasibility.h), and alpha rounded (the
// dense steps' theta + alpha (s - theta)). Neither carries a shrink: what keeps the iterates in their sets is in
// feasibility.h (docs/feasibility.md).
template <typename acc_t>
struct StepFactors {
  acc_t keep, alpha;
};

template <typename acc_t>
FGFW_HOST_DEVICE StepFactors<acc_t> step_factors(double alpha) {
  return {static_cast<acc_t>(1.0 - alpha), static_cast<acc_t>(alpha)};
}

// Calls run(std::integral_constant<Source, ...>, std::bool_constant<momentum>) for the variant that
// (has_grads, distribution, has_momentum) asks for.
template <typename Run>
void dispatch_step_variant(bool has_grads, int64_t distribution, bool has_momentum, Run&& run) {
  auto with_source = [&](auto with_momentum) {
    if (has_grads) {
      run(std::integral_constant<Source, Source::kGrad>{}, with_momentum);
    } else if (distribution == kRademacher) {
      run(std::integral_constant<Source, Source::kRademacher>{}, with_momentum);
    } else {
      run(std::integral_constant<Source, Source::kGaussian>{}, with_momentum);
    }
  };
  if (has_momentum) {
    with_source(std::true_type{});
  } else {
    with_source(std::false_type{});
  }
}

}  // namespace fgfw
