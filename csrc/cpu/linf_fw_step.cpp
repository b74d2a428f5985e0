// linf_fw_step_ on the CPU: the fused Frank-Wolfe step of the L-infinity balls, on the pass of the L1 step
// (step_pass.h); docs/set_steps.md, "CPU kernels".
#include "set_step.h"

namespace fgfw {
namespace {

// ---- The L-infinity step ----------------------------------------------------------------------
// The vertex of a ball of radius r is s = -r sign(d) everywhere: no reduction is needed before the
// update, so the whole step is one pass: theta <- theta + alpha (s - theta) per element, held within +-R
// (feasibility.h: dense_update), and the gap's terms d (theta_old - s) (reference.linf_fw_step_).

template <typename scalar_t, Source kSource, bool kMomentum>
double linf_segment(const StepArgs<scalar_t>& args, const Segment& seg, double radius) {
  using acc_t = acc_type<scalar_t>;
  scalar_t* const theta = args.params[seg.tensor].template data_ptr<scalar_t>();
  acc_t* const v = kMomentum ? args.momentum[seg.tensor].template data_ptr<acc_t>() : nullptr;
  const acc_t bound = radius_down<acc_t>(radius);
  BlockDirection<scalar_t, kSource> direction(args, seg.tensor);
  alignas(64) double gap_terms[kBlock];
  double gap[kLanes] = {};
  for (int64_t begin = seg.begin; begin < seg.end; begin += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, seg.end - begin));
    const acc_t* d_at = direction.template directions<kMomentum>(begin, n, v);
    scalar_t* const theta_b = theta + begin;
    for (int e = 0; e < n; ++e) {
      const acc_t d = d_at[e];
      const acc_t old = static_cast<acc_t>(theta_b[e]);
      const double s = -radius * static_cast<double>(sign_of(d));
      double exact;
      theta_b[e] = static_cast<scalar_t>(dense_update<true>(old, s, args.alpha, args.alpha_c, 1.0, bound, radius, exact));
      gap_terms[e] = static_cast<double>(d) * (static_cast<double>(old) - s);
    }
    add_in_lanes<double>(gap, gap_terms, nullptr, n);
  }
  double total = 0;
  for (int l = 0; l < kLanes; ++l) total += gap[l];
  return total;
}

template <typename scalar_t, Source kSource, bool kMomentum>
void linf_fw_step_kernel(const StepArgs<scalar_t>& args, c10::ArrayRef<double> radii, bool global_ball,
                         c10::IntArrayRef row_numel, double* gap) {
  const Layout layout = lay_out(args.params, row_numel);
  std::vector<double> shares(layout.segments.size());
  run_in_parallel(layout, [&](int64_t s) {
    const Segment& seg = layout.segments[s];
    shares[s] = linf_segment<scalar_t, kSource, kMomentum>(args, seg, global_ball ? radii[0] : radii[seg.ball]);
  });
  double total_gap = 0;
  for (double share : shares) total_gap += share;  // in segment order: the same for any thread count
  *gap = total_gap;
}

void linf_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                      const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                      bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                      const at::Tensor& gap, c10::IntArrayRef row_numel) {
  run_fw_step("linf_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel, {},
              [&](const auto& args, auto source, auto with_momentum, double* gap_out) {
                using scalar_t = typename std::decay_t<decltype(args)>::scalar_type;
                linf_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
                    args, radii, global_ball, row_numel, gap_out);
              });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("linf_fw_step_", &linf_fw_step_cpu);
}

}  // namespace fgfw
