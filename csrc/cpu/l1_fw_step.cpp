// l1_fw_step_ on the CPU: one fused Frank-Wolfe step over L1 ball(s) for a group of tensors.
// One pass over each element regenerates u (never stored), updates v, scales theta, and reduces
// the argmax |d| and <d, theta_old>; then only the winning element(s) move to the vertex
// (step_pass.h: the pass; docs/fused_step.md, "CPU kernel").
#include "step_pass.h"

namespace fgfw {
namespace {

template <typename scalar_t, Source kSource, bool kMomentum>
void l1_fw_step_kernel(const StepArgs<scalar_t>& args, c10::ArrayRef<double> radii, bool global_ball,
                       c10::IntArrayRef row_numel, double* gap) {
  using acc_t = acc_type<scalar_t>;
  const at::TensorList params = args.params;
  const size_t n = params.size();

  const Layout layout = lay_out(params, row_numel);
  const std::vector<Segment>& segments = layout.segments;
  const std::vector<size_t>& ball_tensor = layout.ball_tensor;
  std::vector<Partial<acc_t>> partials(segments.size());
  run_in_parallel(layout, [&](int64_t s) {
    const Segment& seg = segments[s];
    run_segment<scalar_t, kSource, kMomentum>(args, seg, units_factor(global_ball ? radii[0] : radii[seg.ball]),
                                              partials[s]);
  });

  std::vector<Partial<acc_t>> per_ball(ball_tensor.size());
  std::vector<int64_t> ball_numel(ball_tensor.size(), 0);
  for (size_t s = 0; s < segments.size(); ++s) {
    Partial<acc_t>& best = per_ball[segments[s].ball];
    best.dot += partials[s].dot;
    best.old_units = saturating_add(best.old_units, partials[s].old_units);
    best.new_units = saturating_add(best.new_units, partials[s].new_units);
    take_best(best, partials[s]);
    ball_numel[segments[s].ball] += segments[s].end - segments[s].begin;
  }

  double total_gap = 0;
  for (const Partial<acc_t>& best : per_ball) total_gap += best.dot;

  // theta_i* of the ball's winner (feasibility.h: the exact step, taking back the scaling's roundings, within the
  // room the others leave); returns the vertex's gap term r |d_i*|. The norm sums are the ball's (numel, units).
  auto vertex_update = [&](size_t ball, double radius, int64_t numel, uint64_t old_units, uint64_t new_units) {
    const Partial<acc_t>& best = per_ball[ball];
    scalar_t* theta = params[ball_tensor[ball]].data_ptr<scalar_t>();
    const acc_t x = static_cast<acc_t>(theta[best.best_index]);
    theta[best.best_index] =
        static_cast<scalar_t>(l1_vertex_value<acc_t>(x, best.best_d, args.alpha, radius, numel, old_units, new_units));
    return static_cast<double>(std::abs(best.best_d)) * radius;
  };

  if (global_ball) {
    // One ball per tensor here (row_numel is all 0), in parameter order: the first tensor holding
    // the maximum has the lowest global index. The norm sums are the whole group's.
    size_t winner = n;
    uint64_t old_units = 0, new_units = 0;
    for (size_t t = 0; t < n; ++t) {
      old_units = saturating_add(old_units, per_ball[t].old_units);
      new_units = saturating_add(new_units, per_ball[t].new_units);
      if (per_ball[t].best_index >= 0 && (winner == n || beats(per_ball[t].best_abs, per_ball[winner].best_abs))) {
        winner = t;
      }
    }
    if (winner < n) total_gap += vertex_update(winner, radii[0], layout.total, old_units, new_units);
  } else {
    for (size_t b = 0; b < per_ball.size(); ++b) {
      if (per_ball[b].best_index >= 0) {
        total_gap += vertex_update(b, radii[b], ball_numel[b], per_ball[b].old_units, per_ball[b].new_units);
      }
    }
  }
  *gap = total_gap;
}

void l1_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                    const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                    bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                    const at::Tensor& gap, c10::IntArrayRef row_numel) {
  run_fw_step("l1_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel, {},
              [&](const auto& args, auto source, auto with_momentum, double* gap_out) {
                using scalar_t = typename std::decay_t<decltype(args)>::scalar_type;
                l1_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
                    args, radii, global_ball, row_numel, gap_out);
              });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("l1_fw_step_", &l1_fw_step_cpu);
}

}  // namespace fgfw
