// The compile-time variants of the fused step, and the one place that picks a variant from the op's
// runtime arguments: the CPU and CUDA steps must choose the same way.
#pragma once

#include <cstdint>
#include <type_traits>

#include "philox.h"

namespace fgfw {

// Where the direction g comes from: a regenerated tangent (sum_k coeff_k u_k) or the gradient.
enum class Source { kGaussian, kRademacher, kGrad };

// The step's two factors in the compute type (reference.step_factors): theta_i <- keep theta_i, then
// theta_i* <- theta_i* + alpha_vertex s_i*. Both carry kappa = 1 - 4u (u the unit roundoff of acc_t):
// with every operation rounded to nearest, each stored |theta_i| stays at most its exact convex-
// combination value, so the iterate never leaves its ball (reference.feasibility_shrink). A subtraction
// then a product, and a lone product: nothing a compiler could contract into an FMA.
template <typename acc_t>
struct StepFactors {
  acc_t keep, alpha_vertex;
};

template <typename acc_t>
FGFW_HOST_DEVICE StepFactors<acc_t> step_factors(double alpha) {
  constexpr acc_t kappa = acc_t(1) - acc_t(4) * (std::is_same_v<acc_t, double> ? 0x1p-53 : 0x1p-24);
  const acc_t a = static_cast<acc_t>(alpha);
  return {(acc_t(1) - a) * kappa, a * kappa};
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
