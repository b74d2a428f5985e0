// gradient_step_ on the CPU: the step of an unconstrained param group from given directions
// (reference.gradient_step_), every tensor of the call in one op. The arithmetic is the reference's,
// operation by operation in the params' dtype: each product rounded, then the sum (no FMA: the build
// passes -ffp-contract=off).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "op_args.h"

namespace fgfw {
namespace {

// Elements per parallel task: small tensors (biases, norms) run on the calling thread.
constexpr int64_t kGrain = 1 << 15;

template <typename scalar_t, bool kMomentum>
void step_tensor(scalar_t* theta, scalar_t* v, const scalar_t* g, int64_t n, scalar_t alpha, scalar_t gamma) {
  const scalar_t keep = scalar_t(1) - gamma;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      scalar_t d = g[i];
      if constexpr (kMomentum) {
        const scalar_t kept = keep * v[i];
        const scalar_t added = gamma * d;
        d = kept + added;
        v[i] = d;
      }
      const scalar_t moved = alpha * d;
      theta[i] = theta[i] - moved;
    }
  });
}

void gradient_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                       const at::Tensor& schedule) {
  check_gradient_step_args(params, momentum, grads, schedule);
  const double* sched = schedule.data_ptr<double>();
  if (params.empty() || (schedule.numel() == 4 && sched[3] != 0)) return;  // nothing, or a skipped step
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "gradient_step_cpu", [&] {
    const auto alpha = static_cast<scalar_t>(sched[1]);
    const auto gamma = static_cast<scalar_t>(sched[2]);
    for (size_t t = 0; t < params.size(); ++t) {
      scalar_t* theta = params[t].data_ptr<scalar_t>();
      const scalar_t* g = grads[t].const_data_ptr<scalar_t>();
      const int64_t n = params[t].numel();
      if (momentum.empty()) {
        step_tensor<scalar_t, false>(theta, nullptr, g, n, alpha, gamma);
      } else {
        step_tensor<scalar_t, true>(theta, momentum[t].data_ptr<scalar_t>(), g, n, alpha, gamma);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("gradient_step_", &gradient_step_cpu);
}

}  // namespace fgfw
