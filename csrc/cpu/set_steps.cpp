// linf_fw_step_, lp_fw_step_ and ksparse_fw_step_ on the CPU: the fused Frank-Wolfe steps of the L-infinity, Lp
// and k-sparse sets, on the pass of the L1 step (step_pass.h); docs/set_steps.md, "CPU kernels".
#include "step_pass.h"

namespace fgfw {
namespace {

// ---- The L-infinity step ----------------------------------------------------------------------
// The vertex of a ball of radius r is s = -r sign(d) everywhere: no reduction is needed before the
// update, so the whole step is one pass: theta <- theta + alpha (s - theta) per element, held within +-R
// (feasibility.h: dense_update), and the gap's terms d (theta_old - s) (reference.linf_fw_step_).

// Sums x[e] * y[e] (or x[e] alone, y null) of a block into kLanes running sums: loops the compiler vectorises.
template <typename acc_t>
void add_in_lanes(double (&lanes)[kLanes], const acc_t* x, const acc_t* y, int n) {
  int e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lanes[l] += static_cast<double>(x[e + l]) * (y ? static_cast<double>(y[e + l]) : 1.0);
    }
  }
  for (; e < n; ++e) lanes[0] += static_cast<double>(x[e]) * (y ? static_cast<double>(y[e]) : 1.0);
}

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

// ---- The norm feedback (reference.fw_step_'s scales: the Lp and k-sparse steps) ---------------------
// Each ball's scale as the step reads it (1 without scales) and where its next scale goes: scales[t][row] for
// the rows (or the one ball) of tensor t, scales[0][0] for the global ball; null for an empty ball, whose scale
// is left as it is.
struct BallScales {
  std::vector<double> scale;  // per ball of the layout (one for the global ball)
  std::vector<double*> next;  // empty without scales
};

BallScales read_scales(at::TensorList scales, const Layout& layout, bool global_ball) {
  const size_t num_balls = global_ball ? 1 : layout.ball_tensor.size();
  BallScales out{std::vector<double>(num_balls, 1.0), {}};
  if (scales.empty()) return out;
  if (global_ball) {
    out.next.push_back(scales[0].data_ptr<double>());
  } else {
    std::vector<int64_t> row(scales.size(), 0);
    for (size_t t : layout.ball_tensor) out.next.push_back(scales[t].data_ptr<double>() + row[t]++);
  }
  for (size_t b = 0; b < num_balls; ++b) out.scale[b] = *out.next[b];
  std::vector<bool> has_elements(num_balls, false);
  for (const Segment& seg : layout.segments) has_elements[global_ball ? 0 : seg.ball] = true;
  for (size_t b = 0; b < num_balls; ++b) {
    if (!has_elements[b]) out.next[b] = nullptr;
  }
  return out;
}

// u of the compute type: next_norm_scale's band.
template <typename acc_t>
constexpr double unit_roundoff() {
  return std::is_same_v<acc_t, double> ? 0x1p-53 : 0x1p-24;
}

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

// ---- The k-sparse step ---------------------------------------------------------------------------
// s = -r sign(d) on the k largest |d| of each ball, ties to the lowest index (reference.ksparse_vertex).
// A ball held in one segment (a row, a small tensor) steps whole in one task: d (into the momentum, or a
// scratch block), its keys (|d| as bits: NaN above inf, as the L1 step ranks), the k-th largest key, then
// theta <- scale theta + alpha (s - scale theta) held within +-R (dense_update; scale: the ball's norm feedback
// on ||theta||_1 <= k r) with the gap's terms d (theta_old - s) and the norm sums of the values stored and of the
// exact step (in units of the grid of k r), the ties to the threshold taken in index order. Larger balls: pass 1 makes d into the momentum or a buffer of the group's size;
// then per ball the k-th largest key by a heap, a radix histogram or nth_element on a copy of its keys,
// per segment the number of keys equal to it before the segment, and the update pass.

// Up to this k, a ball's k largest keys are found with a heap of k keys (one comparison per key) instead of
// nth_element (several passes over a copy).
constexpr int64_t kHeapSelectMax = 64;
constexpr bool heap_selects(int64_t chosen, int64_t size) { return chosen <= kHeapSelectMax && chosen * 16 <= size; }
// Balls of at least this many elements (and a k too large for the heap) select by a histogram of the keys'
// top kRadixBits bits instead: two passes over d and nth_element on one bin's keys, no copy of the ball.
constexpr int64_t kRadixSelectMin = 1 << 14;
constexpr int kRadixBits = 12;

template <typename acc_t>
struct Selection {
  typename AbsBits<acc_t>::type threshold{};  // the k-th largest key of the ball
  int64_t ties_taken = 0;                      // how many keys equal to it are chosen (the first ones)
};

// The k-th largest of ``keys`` (reordered) and how many keys equal to it the k largest hold.
template <typename acc_t>
Selection<acc_t> select_among(std::vector<typename AbsBits<acc_t>::type>& keys, int64_t chosen) {
  using bits_t = typename AbsBits<acc_t>::type;
  if (heap_selects(chosen, static_cast<int64_t>(keys.size()))) {
    // a small k: the k largest keys in a min-heap; most keys fail the one comparison with its top
    std::vector<bits_t> heap(keys.begin(), keys.begin() + chosen);
    std::make_heap(heap.begin(), heap.end(), std::greater<bits_t>());
    for (size_t i = static_cast<size_t>(chosen); i < keys.size(); ++i) {
      if (keys[i] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<bits_t>());
        heap.back() = keys[i];
        std::push_heap(heap.begin(), heap.end(), std::greater<bits_t>());
      }
    }
    keys.swap(heap);  // the k largest (as a multiset: which equal keys were kept does not matter)
  } else {
    std::nth_element(keys.begin(), keys.begin() + (chosen - 1), keys.end(), std::greater<bits_t>());
    keys.resize(static_cast<size_t>(chosen));
  }
  // the k-th largest key, and how many of the k largest are above it
  const bits_t threshold = *std::min_element(keys.begin(), keys.end());
  const int64_t above = std::count_if(keys.begin(), keys.end(), [&](bits_t key) { return key > threshold; });
  return {threshold, chosen - above};
}

template <typename scalar_t, Source kSource, bool kMomentum>
void ksparse_fw_step_kernel(const StepArgs<scalar_t>& args, c10::ArrayRef<double> radii, bool global_ball,
                            c10::IntArrayRef row_numel, at::TensorList scales, double* gap, int64_t k) {
  using acc_t = acc_type<scalar_t>;
  using bits_t = typename AbsBits<acc_t>::type;
  const at::TensorList params = args.params;
  const Layout layout = lay_out(params, row_numel);
  const BallScales ball_scales = read_scales(scales, layout, global_ball);
  const std::vector<Segment>& segments = layout.segments;

  // The balls as runs of segments (lay_out lists a ball's segments together, in index order).
  const size_t num_balls = global_ball ? 1 : layout.ball_tensor.size();
  auto ball_of = [&](const Segment& seg) { return global_ball ? size_t{0} : seg.ball; };
  std::vector<std::vector<size_t>> ball_segments(num_balls);
  for (size_t s = 0; s < segments.size(); ++s) ball_segments[ball_of(segments[s])].push_back(s);
  // A ball held in one segment (a row, a small tensor) steps in one go on one thread, its d in cache.
  auto alone = [&](const Segment& seg) { return ball_segments[ball_of(seg)].size() == 1; };
  const bool any_shared = std::any_of(ball_segments.begin(), ball_segments.end(),
                                      [](const std::vector<size_t>& runs) { return runs.size() > 1; });

  // d of the segments of larger balls: the momentum itself, or a buffer of the group's size
  std::vector<acc_t> buffer(kMomentum || !any_shared ? 0 : static_cast<size_t>(layout.total));
  std::vector<acc_t*> d_of(params.size());
  int64_t at = 0;
  for (size_t t = 0; t < params.size(); ++t) {
    d_of[t] = kMomentum ? args.momentum[t].template data_ptr<acc_t>() : buffer.empty() ? nullptr : buffer.data() + at;
    at += params[t].numel();
  }
  // d of a segment into d_seg (element i of the segment at d_seg[i - seg.begin]), the momentum updated
  auto make_directions = [&](const Segment& seg, acc_t* d_seg) {
    BlockDirection<scalar_t, kSource> direction(args, seg.tensor);
    acc_t* const momentum = kMomentum ? d_of[seg.tensor] : nullptr;
    for (int64_t begin = seg.begin; begin < seg.end; begin += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, seg.end - begin));
      const acc_t* d_at = direction.template directions<kMomentum>(begin, n, momentum);
      if constexpr (!kMomentum) std::copy(d_at, d_at + n, d_seg + (begin - seg.begin));
    }
  };
  // theta over a segment (see above); returns its share of the gap, sum d (theta_old - s), and its norm sums.
  // tie_rank: the keys equal to the threshold before the segment in its ball (ties go in index order).
  struct Share {
    double gap = 0;
    uint64_t stored = 0, exact = 0;  // in units of the grid of k r
  };
  auto update = [&](const Segment& seg, const acc_t* d_seg, Selection<acc_t> selection, int64_t tie_rank) {
    const size_t b = ball_of(seg);
    const double radius = radii[b];
    const acc_t bound = radius_down<acc_t>(radius);
    const double scale = ball_scales.scale[b];
    const double factor = units_factor(static_cast<double>(k) * radius);
    scalar_t* const theta = params[seg.tensor].template data_ptr<scalar_t>();
    alignas(64) double vertex[kBlock];
    alignas(64) double gap_terms[kBlock];
    double gap[kLanes] = {};
    Share total;
    for (int64_t begin = seg.begin; begin < seg.end; begin += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, seg.end - begin));
      const acc_t* d_b = d_seg + (begin - seg.begin);
      // the vertex, in index order (the ties' rank), apart from the update: that loop then vectorises
      for (int e = 0; e < n; ++e) {
        const bits_t key = AbsBits<acc_t>::of(d_b[e]);
        bool chosen = key > selection.threshold;
        if (key == selection.threshold) chosen = tie_rank++ < selection.ties_taken;
        vertex[e] = chosen ? -radius * sign_of(static_cast<double>(d_b[e])) : 0.0;
      }
      scalar_t* const theta_b = theta + begin;
      // the norm sums: integers, the same in any order; kBlock terms of at most 2^51 stay below 2^62
      uint64_t block_stored = 0, block_exact = 0;
      for (int e = 0; e < n; ++e) {
        const acc_t old = static_cast<acc_t>(theta_b[e]);
        double exact_e;
        const scalar_t stored_e = static_cast<scalar_t>(
            dense_update<true>(old, vertex[e], args.alpha, args.alpha_c, scale, bound, radius, exact_e));
        theta_b[e] = stored_e;
        gap_terms[e] = static_cast<double>(d_b[e]) * (static_cast<double>(old) - vertex[e]);
        block_stored += norm_units(std::abs(static_cast<double>(stored_e)) * factor);
        block_exact += norm_units(std::abs(exact_e) * factor);
      }
      add_in_lanes<double>(gap, gap_terms, nullptr, n);
      total.stored = saturating_add(total.stored, block_stored);
      total.exact = saturating_add(total.exact, block_exact);
    }
    for (int l = 0; l < kLanes; ++l) total.gap += gap[l];
    return total;
  };

  // Pass 1: the balls alone in their segment step whole; the others' segments make their d.
  std::vector<Share> shares(segments.size());
  run_in_parallel(layout, [&](int64_t s) {
    const Segment& seg = segments[s];
    if (!alone(seg)) {
      make_directions(seg, kMomentum ? nullptr : d_of[seg.tensor] + seg.begin);
      return;
    }
    const size_t size = static_cast<size_t>(seg.end - seg.begin);
    std::vector<acc_t> scratch(kMomentum ? 0 : size);
    acc_t* const d_seg = kMomentum ? d_of[seg.tensor] + seg.begin : scratch.data();
    make_directions(seg, d_seg);
    std::vector<bits_t> keys(size);
    for (size_t i = 0; i < size; ++i) keys[i] = AbsBits<acc_t>::of(d_seg[i]);
    const Selection<acc_t> selection = select_among<acc_t>(keys, std::min<int64_t>(k, static_cast<int64_t>(size)));
    shares[s] = update(seg, d_seg, selection, 0);
  });

  if (any_shared) {
    // A big ball's selection (kRadixSelectMin): the runs of segments are split into chunks, one per thread,
    // whose histograms are summed, so the result does not depend on the thread count. Nested in the
    // parallel loop over balls, its own parallel loops run on the calling thread.
    auto radix_select = [&](const std::vector<size_t>& runs, int64_t chosen) {
      constexpr int kShift = static_cast<int>(8 * sizeof(bits_t)) - 1 - kRadixBits;  // a key's top bit is 0
      constexpr int64_t kBins = int64_t{1} << kRadixBits;
      const int64_t num_runs = static_cast<int64_t>(runs.size());
      const int64_t num_chunks = std::min<int64_t>(num_runs, at::get_num_threads());
      auto for_each_key = [&](int64_t chunk, auto&& visit) {
        for (int64_t r = chunk * num_runs / num_chunks; r < (chunk + 1) * num_runs / num_chunks; ++r) {
          const Segment& seg = segments[runs[r]];
          const acc_t* d = d_of[seg.tensor];
          for (int64_t i = seg.begin; i < seg.end; ++i) visit(AbsBits<acc_t>::of(d[i]));
        }
      };
      std::vector<int64_t> counts(static_cast<size_t>(num_chunks * kBins), 0);
      at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          int64_t* count = counts.data() + c * kBins;
          for_each_key(c, [&](bits_t key) { ++count[key >> kShift]; });
        }
      });
      // the bin of the k-th largest key, and how many keys the bins above it hold
      int64_t bin = kBins, above = 0, in_bin = 0;
      while (bin > 0) {
        --bin;
        in_bin = 0;
        for (int64_t c = 0; c < num_chunks; ++c) in_bin += counts[c * kBins + bin];
        if (above + in_bin >= chosen) break;
        above += in_bin;
      }
      std::vector<std::vector<bits_t>> pieces(static_cast<size_t>(num_chunks));
      at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          pieces[c].reserve(static_cast<size_t>(counts[c * kBins + bin]));
          for_each_key(c, [&](bits_t key) {
            if (static_cast<int64_t>(key >> kShift) == bin) pieces[c].push_back(key);
          });
        }
      });
      std::vector<bits_t> keys;
      keys.reserve(static_cast<size_t>(in_bin));
      for (const std::vector<bits_t>& piece : pieces) keys.insert(keys.end(), piece.begin(), piece.end());
      const int64_t rank = chosen - above;  // the k-th largest is the rank-th largest of its bin
      std::nth_element(keys.begin(), keys.begin() + (rank - 1), keys.end(), std::greater<bits_t>());
      const bits_t threshold = keys[rank - 1];
      above += std::count_if(keys.begin(), keys.end(), [&](bits_t key) { return key > threshold; });
      return Selection<acc_t>{threshold, chosen - above};
    };

    std::vector<Selection<acc_t>> selections(num_balls);
    auto select = [&](int64_t b_begin, int64_t b_end) {
      std::vector<bits_t> keys;
      for (int64_t b = b_begin; b < b_end; ++b) {
        if (ball_segments[b].size() < 2) continue;  // stepped whole in pass 1
        int64_t size = 0;
        for (size_t s : ball_segments[b]) size += segments[s].end - segments[s].begin;
        const int64_t chosen = std::min<int64_t>(k, size);
        if (!heap_selects(chosen, size) && size >= kRadixSelectMin) {
          selections[b] = radix_select(ball_segments[b], chosen);
          continue;
        }
        keys.resize(static_cast<size_t>(size));
        size_t at_key = 0;
        for (size_t s : ball_segments[b]) {
          const acc_t* d = d_of[segments[s].tensor];
          for (int64_t i = segments[s].begin; i < segments[s].end; ++i) keys[at_key++] = AbsBits<acc_t>::of(d[i]);
        }
        selections[b] = select_among<acc_t>(keys, chosen);
      }
    };
    if (layout.total < kParallelMin) {
      select(0, static_cast<int64_t>(num_balls));
    } else {
      at::parallel_for(0, static_cast<int64_t>(num_balls), 1, select);
    }

    // Keys equal to the threshold before each segment of its ball: the ties are taken in index order.
    std::vector<int64_t> ties_before(segments.size());
    run_in_parallel(layout, [&](int64_t s) {
      const Segment& seg = segments[s];
      if (alone(seg)) return;
      const acc_t* d = d_of[seg.tensor];
      const bits_t threshold = selections[ball_of(seg)].threshold;
      int64_t count = 0;
      for (int64_t i = seg.begin; i < seg.end; ++i) count += AbsBits<acc_t>::of(d[i]) == threshold;
      ties_before[s] = count;
    });
    for (const std::vector<size_t>& runs : ball_segments) {
      int64_t before = 0;
      for (size_t s : runs) {
        const int64_t count = ties_before[s];
        ties_before[s] = before;
        before += count;
      }
    }
    run_in_parallel(layout, [&](int64_t s) {
      const Segment& seg = segments[s];
      if (alone(seg)) return;
      shares[s] = update(seg, d_of[seg.tensor] + seg.begin, selections[ball_of(seg)], ties_before[s]);
    });
  }
  double total_gap = 0;
  std::vector<Share> per_ball(num_balls);
  for (size_t s = 0; s < segments.size(); ++s) {  // in segment order: the same for any thread count
    total_gap += shares[s].gap;
    Share& ball = per_ball[ball_of(segments[s])];
    ball.stored = saturating_add(ball.stored, shares[s].stored);
    ball.exact = saturating_add(ball.exact, shares[s].exact);
  }
  *gap = total_gap;
  for (size_t b = 0; b < ball_scales.next.size(); ++b) {
    if (ball_scales.next[b] == nullptr) continue;
    const double bound = static_cast<double>(k) * radii[b];
    *ball_scales.next[b] = next_norm_scale(units_as_double(per_ball[b].stored), units_as_double(per_ball[b].exact),
                                           bound * units_factor(bound), 1.0, unit_roundoff<acc_t>());
  }
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

void ksparse_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                         const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                         bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                         const at::Tensor& gap, c10::IntArrayRef row_numel, int64_t k,
                           at::TensorList scales) {
  check_ksparse_k(k);
  run_fw_step("ksparse_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel, scales,
              [&](const auto& args, auto source, auto with_momentum, double* gap_out) {
                using scalar_t = typename std::decay_t<decltype(args)>::scalar_type;
                ksparse_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
                    args, radii, global_ball, row_numel, scales, gap_out, k);
              });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("linf_fw_step_", &linf_fw_step_cpu);
  m.impl("lp_fw_step_", &lp_fw_step_cpu);
  m.impl("ksparse_fw_step_", &ksparse_fw_step_cpu);
}

}  // namespace fgfw
