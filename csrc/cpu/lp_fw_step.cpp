// lp_fw_step_ on the CPU: the fused Frank-Wolfe step of the Lp balls, 1 < p < inf (the L2 ball: p = 2), on the
// pass of the L1 step (step_pass.h); docs/set_steps.md, "CPU kernels".
#include "set_step.h"

namespace fgfw {
namespace {

// ---- The Lp step --------------------------------------------------------------------------------
// s_i = -r sign(d_i) (x_i / N)^(q-1) with x = |d| / M, M = max |d| over the ball and N = ||x||_q
// (reference.lp_vertex). Pass 1 makes d (and the momentum) and reduces (M, ||d / M||_q^q) per ball; pass 2
// makes d again (reads the momentum, or regenerates the tangents: no buffer of d) and writes
// theta <- scale theta + alpha (s - scale theta) (dense_update; scale: the ball's norm feedback) with the gap's
// terms d (theta_old - s) and the sums of (|theta| / r)^p of the values stored and of the exact step, from which
// the ball's next scale comes (next_norm_scale). Not bit-exact with the
// reference (the norm is summed in another order, and pow is libm's): within a few float64 ulps before s is
// rounded to the compute type.

// The powers x^q and y^(q-1) of the step: closed forms for the common exponents (std::pow costs ~20 ns and
// does not vectorise), std::pow otherwise.
enum class Exponent { kGeneral, kTwo /* p = 2 */, kThree /* p = 1.5 */, kThreeHalves /* p = 3 */ };

template <Exponent kExp>
struct Powers {
  double q, q_minus_1;  // and p, below
  double to_q(double x) const {
    if constexpr (kExp == Exponent::kTwo) return x * x;
    if constexpr (kExp == Exponent::kThree) return x * x * x;
    if constexpr (kExp == Exponent::kThreeHalves) return x * std::sqrt(x);
    return std::pow(x, q);
  }
  double to_q_minus_1(double y) const {
    if constexpr (kExp == Exponent::kTwo) return y;
    if constexpr (kExp == Exponent::kThree) return y * y;
    if constexpr (kExp == Exponent::kThreeHalves) return std::sqrt(y);
    return std::pow(y, q_minus_1);
  }
  double root(double sum) const {  // sum^(1/q)
    if constexpr (kExp == Exponent::kTwo) return std::sqrt(sum);
    return std::pow(sum, 1.0 / q);
  }
  double to_p(double x) const {  // x^p: the norm feedback's terms
    if constexpr (kExp == Exponent::kTwo) return x * x;
    if constexpr (kExp == Exponent::kThree) return x * std::sqrt(x);
    if constexpr (kExp == Exponent::kThreeHalves) return x * x * x;
    return std::pow(x, p);
  }
  double p;
};

// A ball's max |d| and sum (|d| / max)^q, scaled so that no power overflows or underflows to nothing: the
// block's own max first, then pieces combine as S = S_1 (M_1 / M)^q + S_2 (M_2 / M)^q.
struct ScaledPowerSum {
  double max = 0, sum = 0;
};

template <Exponent kExp>
void combine(ScaledPowerSum& into, const ScaledPowerSum& from, const Powers<kExp>& powers) {
  if (!(from.max > 0)) {
    if (std::isnan(from.max)) into.max = into.sum = from.max;  // a NaN direction: the step's gap says so
    return;
  }
  if (std::isnan(into.max)) return;
  if (from.max > into.max) {
    into.sum = into.sum * powers.to_q(into.max / from.max) + from.sum;
    into.max = from.max;
  } else {
    into.sum += from.sum * powers.to_q(from.max / into.max);
  }
}

template <typename scalar_t, Source kSource, bool kMomentum, Exponent kExp>
ScaledPowerSum lp_reduce_segment(const StepArgs<scalar_t>& args, const Segment& seg, const Powers<kExp>& powers) {
  using acc_t = acc_type<scalar_t>;
  using bits_t = typename AbsBits<acc_t>::type;
  acc_t* const v = kMomentum ? args.momentum[seg.tensor].template data_ptr<acc_t>() : nullptr;
  BlockDirection<scalar_t, kSource> direction(args, seg.tensor);
  ScaledPowerSum total;
  for (int64_t begin = seg.begin; begin < seg.end; begin += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, seg.end - begin));
    const acc_t* d_block = direction.template directions<kMomentum>(begin, n, v);
    // the block's max |d| as an integer max over the bits (vectorises; every NaN is above inf)
    bits_t top = 0;
    for (int e = 0; e < n; ++e) {
      const bits_t a = AbsBits<acc_t>::of(d_block[e]);
      top = a > top ? a : top;
    }
    ScaledPowerSum block;
    block.max = top > AbsBits<acc_t>::kInf ? std::numeric_limits<double>::quiet_NaN()
                                           : static_cast<double>(AbsBits<acc_t>::value(top));
    if (block.max > 0) {
      // |d| / max, a division as the reference's: 1 / max is subnormal above 2^1022 and infinite for a
      // subnormal max, so a product by it loses the terms or makes them infinite
      double lanes[kLanes] = {};
      int e = 0;
      for (; e + kLanes <= n; e += kLanes) {
        for (int l = 0; l < kLanes; ++l) {
          lanes[l] += powers.to_q(std::abs(static_cast<double>(d_block[e + l])) / block.max);
        }
      }
      for (; e < n; ++e) lanes[0] += powers.to_q(std::abs(static_cast<double>(d_block[e])) / block.max);
      for (int l = 0; l < kLanes; ++l) block.sum += lanes[l];
    }
    combine(total, block, powers);
  }
  return total;
}

// What the update pass leaves of a segment: its share of the gap and, for the norm feedback, its sums of
// (|theta| / r)^p of the values stored and of the exact step.
struct LpShare {
  double gap = 0, stored = 0, exact = 0;
};

template <typename scalar_t, Source kSource, bool kMomentum, Exponent kExp>
LpShare lp_update_segment(const StepArgs<scalar_t>& args, const Segment& seg, const Powers<kExp>& powers,
                          double radius, const ScaledPowerSum& ball, double scale, bool feedback) {
  using acc_t = acc_type<scalar_t>;
  scalar_t* const theta = args.params[seg.tensor].template data_ptr<scalar_t>();
  const acc_t* const v = kMomentum ? args.momentum[seg.tensor].template data_ptr<acc_t>() : nullptr;
  BlockDirection<scalar_t, kSource> direction(args, seg.tensor);
  // y = (|d| / M) / N with N = ||d / M||_q, divided in that order as the reference does: M N overflows for
  // |d| near the float64 maximum (and 1 / M for a subnormal M). A zero ball (M = 0) has the vertex 0, a NaN one
  // NaN everywhere.
  const bool zero = ball.max == 0;
  const double norm = powers.root(ball.sum);
  const double inverse_radius = 1.0 / radius;
  alignas(64) double gap_terms[kBlock];
  alignas(64) double stored_terms[kBlock];
  alignas(64) double exact_terms[kBlock];
  double gap[kLanes] = {}, stored[kLanes] = {}, exact[kLanes] = {};
  for (int64_t begin = seg.begin; begin < seg.end; begin += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, seg.end - begin));
    const acc_t* d_at = kMomentum ? v + begin : direction.at(begin, n);  // pass 1 left d in the momentum
    scalar_t* const theta_b = theta + begin;
    for (int e = 0; e < n; ++e) {
      const double d = static_cast<double>(d_at[e]);
      const double s = zero ? 0.0 : (-radius * sign_of(d)) * powers.to_q_minus_1(std::abs(d) / ball.max / norm);
      const acc_t old = static_cast<acc_t>(theta_b[e]);
      double exact_e;
      const scalar_t stored_e =
          static_cast<scalar_t>(dense_update<false>(old, s, args.alpha, args.alpha_c, scale, acc_t(0), radius, exact_e));
      theta_b[e] = stored_e;
      gap_terms[e] = d * (static_cast<double>(old) - s);
      stored_terms[e] = std::abs(static_cast<double>(stored_e));
      exact_terms[e] = std::abs(exact_e);
    }
    add_in_lanes<double>(gap, gap_terms, nullptr, n);
    if (feedback) {
      // |x| / r as |x| (1 / r): an ulp off the reference's quotient, a product where a quotient costs 4x
      for (int e = 0; e < n; ++e) stored_terms[e] = powers.to_p(stored_terms[e] * inverse_radius);
      for (int e = 0; e < n; ++e) exact_terms[e] = powers.to_p(exact_terms[e] * inverse_radius);
      add_in_lanes<double>(stored, stored_terms, nullptr, n);
      add_in_lanes<double>(exact, exact_terms, nullptr, n);
    }
  }
  LpShare total;
  for (int l = 0; l < kLanes; ++l) {
    total.gap += gap[l];
    total.stored += stored[l];
    total.exact += exact[l];
  }
  return total;
}

template <typename scalar_t, Source kSource, bool kMomentum>
void lp_fw_step_kernel(const StepArgs<scalar_t>& args, c10::ArrayRef<double> radii, bool global_ball,
                       c10::IntArrayRef row_numel, at::TensorList scales, double* gap, double p) {
  using acc_t = acc_type<scalar_t>;
  const double q = p / (p - 1);
  const Layout layout = lay_out(args.params, row_numel);
  const size_t num_balls = global_ball ? 1 : layout.ball_tensor.size();
  auto ball_of = [&](const Segment& seg) { return global_ball ? size_t{0} : seg.ball; };
  const BallScales ball_scales = read_scales(scales, layout, global_ball);
  const bool feedback = !ball_scales.next.empty();

  auto run = [&](auto exponent) {
    constexpr Exponent kExp = decltype(exponent)::value;
    const Powers<kExp> powers{q, q - 1, p};
    std::vector<ScaledPowerSum> pieces(layout.segments.size());
    run_in_parallel(layout, [&](int64_t s) {
      pieces[s] = lp_reduce_segment<scalar_t, kSource, kMomentum, kExp>(args, layout.segments[s], powers);
    });
    std::vector<ScaledPowerSum> balls(num_balls);
    for (size_t s = 0; s < pieces.size(); ++s) combine(balls[ball_of(layout.segments[s])], pieces[s], powers);
    std::vector<LpShare> shares(layout.segments.size());
    run_in_parallel(layout, [&](int64_t s) {
      const size_t b = ball_of(layout.segments[s]);
      shares[s] = lp_update_segment<scalar_t, kSource, kMomentum, kExp>(args, layout.segments[s], powers, radii[b],
                                                                        balls[b], ball_scales.scale[b], feedback);
    });
    double total_gap = 0;
    std::vector<LpShare> per_ball(num_balls);
    for (size_t s = 0; s < shares.size(); ++s) {  // in segment order: the same for any thread count
      total_gap += shares[s].gap;
      LpShare& ball = per_ball[ball_of(layout.segments[s])];
      ball.stored += shares[s].stored;
      ball.exact += shares[s].exact;
    }
    *gap = total_gap;
    if (feedback) {
      for (size_t b = 0; b < num_balls; ++b) {
        if (ball_scales.next[b] == nullptr) continue;
        *ball_scales.next[b] = next_norm_scale(per_ball[b].stored, per_ball[b].exact, 1.0, p, unit_roundoff<acc_t>());
      }
    }
  };
  if (p == 2.0) {
    run(std::integral_constant<Exponent, Exponent::kTwo>{});
  } else if (p == 1.5) {
    run(std::integral_constant<Exponent, Exponent::kThree>{});
  } else if (p == 3.0) {
    run(std::integral_constant<Exponent, Exponent::kThreeHalves>{});
  } else {
    run(std::integral_constant<Exponent, Exponent::kGeneral>{});
  }
}

void lp_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                    const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                    bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                    const at::Tensor& gap, c10::IntArrayRef row_numel, double p,
                    at::TensorList scales) {
  check_lp_exponent(p);
  run_fw_step("lp_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel, scales,
              [&](const auto& args, auto source, auto with_momentum, double* gap_out) {
                using scalar_t = typename std::decay_t<decltype(args)>::scalar_type;
                lp_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
                    args, radii, global_ball, row_numel, scales, gap_out, p);
              });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("lp_fw_step_", &lp_fw_step_cpu);
}

}  // namespace fgfw
