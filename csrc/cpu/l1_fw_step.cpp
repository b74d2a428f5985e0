// l1_fw_step_ on the CPU: one fused Frank-Wolfe step over L1 ball(s) for a group of tensors.
// One pass over each element regenerates u (never stored), updates v, scales theta, and reduces
// the argmax |d| and <d, theta_old>; then only the winning element(s) move to the vertex.
// The arithmetic follows python/fgfw/reference.py operation by operation (same roundings, no FMA).
// Design: docs/fused_step.md, "CPU kernel".
//
// Speed: the pass runs in blocks of kBlock elements through small loops the compiler vectorises
// (no per-element branch on dtype, direction source or momentum: they are template parameters):
// Philox words for the block's calls, tangent values (tangent_block.h: the values fill_tangent_
// gives, bit for bit), the direction, the update, then the block's max |d| and dot product in eight
// lanes. Only a block whose max beats the best so far is scanned again for the first index of that
// max.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "feasibility.h"
#include "op_args.h"
#include "philox.h"
#include "step_variant.h"
#include "tangent_block.h"

namespace fgfw {
namespace {

// The unit of parallel work and of partial results: a piece of at most kSegment elements of one
// ball (a tensor, or one of its rows). The split does not depend on the thread count and the
// partials are combined in index order, so the results (argmax ties, the gap's rounding) are the
// same for any number of threads.
constexpr int64_t kSegment = 1 << 14;
// Below this many elements in the whole group, the step runs on the calling thread.
constexpr int64_t kParallelMin = 1 << 15;
// Elements per block of the vectorised pipeline; its buffers stay in L1.
constexpr int kBlock = 512;
// Philox calls a block can touch: it may start and end in the middle of a call.
constexpr int kBlockCalls = kBlock / 4 + 2;
// Accumulator lanes of the block reductions (the dot product's summation order depends on them,
// never on the thread count).
constexpr int kLanes = 8;

struct Segment {
  size_t tensor;
  int64_t begin, end;
  size_t ball;
};

template <typename acc_t>
struct Partial {
  acc_t best_abs = -1;  // any |d| (>= 0, or NaN) beats it
  int64_t best_index = -1;
  acc_t best_d = 0;
  double dot = 0;  // <d, theta_old>, in float64 as reference.py sums it
  // the norm sums of theta before the step and of the scaled values, in units of the ball's grid (feasibility.h)
  uint64_t old_units = 0, new_units = 0;
};

// Whether |d| = a beats the best so far, b, in argmax |d|: larger, or NaN against a number
// (torch.argmax's rule). Equal values never beat, so visiting candidates in index order makes the
// lowest index win ties.
template <typename T>
bool beats(T a, T b) {
  return (std::isnan(a) && !std::isnan(b)) || a > b;
}

template <typename acc_t>
void take_best(Partial<acc_t>& into, const Partial<acc_t>& from) {
  if (beats(from.best_abs, into.best_abs)) {
    into.best_abs = from.best_abs;
    into.best_index = from.best_index;
    into.best_d = from.best_d;
  }
}

// torch.sign: 0 for 0 and for NaN.
template <typename T>
T sign_of(T x) {
  return static_cast<T>((x > T(0)) - (x < T(0)));
}

// ---- The step -------------------------------------------------------------------------------

// |x| as an unsigned integer: ordered like |x| among numbers and above +inf for every NaN, so one
// integer max (which vectorises, unlike a float max with NaN rules) finds the largest |d| and
// notices any NaN.
template <typename T>
struct AbsBits;

template <>
struct AbsBits<float> {
  using type = uint32_t;
  static constexpr type kInf = 0x7f800000u;
  static type of(float x) { return cpu::bits_of_float(x) & 0x7fffffffu; }
  static float value(type bits) { return cpu::float_of_bits(bits); }
};

template <>
struct AbsBits<double> {
  using type = uint64_t;
  static constexpr type kInf = 0x7ff0000000000000ull;
  static type of(double x) {
    uint64_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    return bits & 0x7fffffffffffffffull;
  }
  static double value(type bits) {
    double x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
  }
};

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
struct StepArgs {
  using acc_t = acc_type<scalar_t>;
  at::TensorList params, momentum, grads;
  c10::IntArrayRef offsets;
  std::vector<TangentStream> streams;
  std::vector<acc_t> coeffs;
  acc_t gamma, keep_v, keep_theta, alpha_c;  // gamma, 1 - gamma, step_factors' keep and alpha
  double alpha;                              // alpha_k as the schedule holds it
};

// The direction estimate g of tensor t, block by block: the gradient, or the forward gradient
// sum_k coeff_k u_k regenerated from the stream. at(begin, n) returns g_at, with g_at[e] the direction at
// element begin + e (it points into the buffers below).
template <typename scalar_t, Source kSource>
struct BlockDirection {
  using acc_t = acc_type<scalar_t>;
  const StepArgs<scalar_t>& args;
  const scalar_t* const grad;
  const uint64_t offset;  // the tensor's first index in the tangent stream
  alignas(64) acc_t g[4 * kBlockCalls];  // the direction estimate, from the block's first call on
  alignas(64) float u[4 * kBlockCalls];
  alignas(64) uint32_t words[4][kBlockCalls];

  BlockDirection(const StepArgs<scalar_t>& step_args, size_t t)
      : args(step_args),
        grad(kSource == Source::kGrad ? step_args.grads[t].template data_ptr<scalar_t>() : nullptr),
        offset(kSource == Source::kGrad ? 0 : static_cast<uint64_t>(step_args.offsets[t])) {}

  const acc_t* at(int64_t begin, int n) {
    if constexpr (kSource == Source::kGrad) {
      // a gradient in the compute type is read where it is (a copy into g cost a sixth of the step)
      if constexpr (std::is_same_v<scalar_t, acc_t>) return grad + begin;
      for (int e = 0; e < n; ++e) g[e] = static_cast<acc_t>(grad[begin + e]);
      return g;
    } else {
      const uint64_t first = offset + static_cast<uint64_t>(begin);
      const int lead = static_cast<int>(first % 4);
      const int calls = (lead + n + 3) / 4;
      for (size_t k = 0; k < args.streams.size(); ++k) {
        cpu::philox_block(args.streams[k], first / 4, calls, words);
        cpu::tangent_block<kSource == Source::kRademacher ? kRademacher : kGaussian>(words, calls, u);
        const acc_t coeff = args.coeffs[k];
        // g = sum_k coeff_k u_k, accumulated in k order
        if (k == 0) {
          for (int e = 0; e < 4 * calls; ++e) g[e] = coeff * static_cast<acc_t>(u[e]);
        } else {
          for (int e = 0; e < 4 * calls; ++e) g[e] = g[e] + coeff * static_cast<acc_t>(u[e]);
        }
      }
      return g + lead;
    }
  }

  // The step's direction d at elements begin .. begin + n - 1: g, or with momentum v <- (1 - gamma) v + gamma g
  // written back to v (v points at the tensor's momentum) and d = v. Returns d_at, d_at[e] the direction at
  // element begin + e (into the gradient itself, or into g: a forward gradient is overwritten in place).
  template <bool kMomentum>
  const acc_t* directions(int64_t begin, int n, acc_t* v) {
    const acc_t* const estimate = at(begin, n);
    if constexpr (kMomentum) {
      acc_t* const d = kSource == Source::kGrad ? g : const_cast<acc_t*>(estimate);
      const acc_t keep_v = args.keep_v, gamma = args.gamma;  // locals: the stores to v cannot change them
      acc_t* const v_b = v + begin;
      for (int e = 0; e < n; ++e) {
        d[e] = keep_v * v_b[e] + gamma * estimate[e];
        v_b[e] = d[e];
      }
      return d;
    }
    return estimate;
  }
};

// The L1 step's scaling of a block: theta_b[e] <- RN(keep theta_b[e]) for e < n, theta_old[e] the value before, and
// the block's norm sums (feasibility.h: norm_units of |old| and of |stored|; units_factor = 2^(51 - E) of the ball)
// added to old_units and new_units. Integer sums: any order gives the same. A block's kBlock terms of at most 2^51
// stay below 2^62.
template <typename scalar_t, typename acc_t>
void scale_and_sum(scalar_t* theta_b, acc_t* theta_old, int n, acc_t keep, double units_factor, uint64_t& old_units,
                   uint64_t& new_units) {
  int e = 0;
#if defined(__SSE2__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    // Four elements at a time in SSE2 (every x86-64 CPU has it), where gcc's own vectorisation of the loop below took
    // half the step: |x| on the floats, then in float64 min(|x| factor, 2^51) + 2^52 (minpd keeps the second operand
    // for a NaN, as norm_units's cap), whose bits are 2^52's plus the units. Those bits are summed as they are,
    // wrapping around in uint64, and e times 2^52's bits come off once at the end: the true sum is below 2^64.
    const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    const __m128 keep4 = _mm_set1_ps(keep);
    const __m128d factor = _mm_set1_pd(units_factor), cap = _mm_set1_pd(kUnitsCap), magic = _mm_set1_pd(kMagic);
    __m128i old_bits = _mm_setzero_si128(), new_bits = _mm_setzero_si128();
    auto units_bits = [&](__m128 x) {  // the two lanes' sums of the bits of min(|x| factor, 2^51) + 2^52
      const __m128 magnitude = _mm_and_ps(x, abs_mask);
      const __m128d low = _mm_min_pd(_mm_mul_pd(_mm_cvtps_pd(magnitude), factor), cap);
      const __m128d high = _mm_min_pd(_mm_mul_pd(_mm_cvtps_pd(_mm_movehl_ps(magnitude, magnitude)), factor), cap);
      return _mm_add_epi64(_mm_castpd_si128(_mm_add_pd(low, magic)), _mm_castpd_si128(_mm_add_pd(high, magic)));
    };
    for (; e + 4 <= n; e += 4) {
      const __m128 old = _mm_loadu_ps(theta_b + e);
      _mm_storeu_ps(theta_old + e, old);
      const __m128 stored = _mm_mul_ps(keep4, old);
      _mm_storeu_ps(theta_b + e, stored);
      old_bits = _mm_add_epi64(old_bits, units_bits(old));
      new_bits = _mm_add_epi64(new_bits, units_bits(stored));
    }
    alignas(16) uint64_t old_lanes[2], new_lanes[2];
    _mm_store_si128(reinterpret_cast<__m128i*>(old_lanes), old_bits);
    _mm_store_si128(reinterpret_cast<__m128i*>(new_lanes), new_bits);
    uint64_t magic_bits;
    std::memcpy(&magic_bits, &kMagic, sizeof(magic_bits));
    old_units += old_lanes[0] + old_lanes[1] - static_cast<uint64_t>(e) * magic_bits;
    new_units += new_lanes[0] + new_lanes[1] - static_cast<uint64_t>(e) * magic_bits;
  }
#endif
  for (; e < n; ++e) {
    const acc_t old = static_cast<acc_t>(theta_b[e]);
    theta_old[e] = old;
    const scalar_t stored = static_cast<scalar_t>(keep * old);
    theta_b[e] = stored;
    old_units += norm_units(std::abs(static_cast<double>(old)) * units_factor);
    new_units += norm_units(std::abs(static_cast<double>(stored)) * units_factor);
  }
}

// units_factor: 2^(51 - E) of the segment's ball (feasibility.h): |theta| times it is |theta| in grid units.
template <typename scalar_t, Source kSource, bool kMomentum>
void run_segment(const StepArgs<scalar_t>& args, const Segment& seg, double units_factor,
                 Partial<acc_type<scalar_t>>& part) {
  using acc_t = acc_type<scalar_t>;
  scalar_t* const theta = args.params[seg.tensor].template data_ptr<scalar_t>();
  acc_t* const v = kMomentum ? args.momentum[seg.tensor].template data_ptr<acc_t>() : nullptr;

  BlockDirection<scalar_t, kSource> direction(args, seg.tensor);
  alignas(64) acc_t theta_old[kBlock];
  double dot[kLanes] = {};

  for (int64_t begin = seg.begin; begin < seg.end; begin += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, seg.end - begin));
    const acc_t* d_at = direction.template directions<kMomentum>(begin, n, v);

    scalar_t* const theta_b = theta + begin;
    uint64_t block_old = 0, block_new = 0;
    scale_and_sum(theta_b, theta_old, n, args.keep_theta, units_factor, block_old, block_new);
    part.old_units = saturating_add(part.old_units, block_old);
    part.new_units = saturating_add(part.new_units, block_new);

    // The block's dot product in kLanes running sums, and its largest |d| as an integer.
    int e = 0;
    for (; e + kLanes <= n; e += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        dot[l] += static_cast<double>(d_at[e + l]) * static_cast<double>(theta_old[e + l]);
      }
    }
    for (; e < n; ++e) dot[0] += static_cast<double>(d_at[e]) * static_cast<double>(theta_old[e]);
    using bits_t = typename AbsBits<acc_t>::type;
    // compared as signed integers (|x|'s bits have the sign bit clear): SSE2 has a signed 32-bit compare only
    using signed_bits_t = std::make_signed_t<bits_t>;
    signed_bits_t top_signed = 0;
    for (int i = 0; i < n; ++i) {
      const auto a = static_cast<signed_bits_t>(AbsBits<acc_t>::of(d_at[i]));
      top_signed = a > top_signed ? a : top_signed;
    }
    const bits_t top = static_cast<bits_t>(top_signed);
    const bool block_nan = top > AbsBits<acc_t>::kInf;
    // The first element holding the block's best, if it beats the best of the earlier blocks.
    if (beats(block_nan ? std::numeric_limits<acc_t>::quiet_NaN() : AbsBits<acc_t>::value(top), part.best_abs)) {
      // The first a >= target: the first NaN, else the first |d| = top (none is above it). Sixteen elements
      // at a time in a loop the compiler vectorises (with a ball per row a block starts almost every ball, so a
      // plain scan ran over a quarter of all elements).
      const auto target = static_cast<signed_bits_t>(block_nan ? AbsBits<acc_t>::kInf + 1 : top);
      auto at_target = [&](int i) { return static_cast<signed_bits_t>(AbsBits<acc_t>::of(d_at[i])) >= target; };
      int i = 0;
      for (; i + 16 <= n; i += 16) {
        bool hit = false;
        for (int l = 0; l < 16; ++l) hit |= at_target(i + l);
        if (hit) break;
      }
      for (; i < n; ++i) {
        if (at_target(i)) {
          part.best_abs = std::abs(d_at[i]);
          part.best_index = begin + i;
          part.best_d = d_at[i];
          break;
        }
      }
    }
  }
  for (int l = 0; l < kLanes; ++l) part.dot += dot[l];
}

// The balls of a step in the order of their radii (tensors in order, rows in order within a tensor), cut
// into segments of at most kSegment elements.
struct Layout {
  std::vector<Segment> segments;
  std::vector<size_t> ball_tensor;  // the tensor of each ball
  int64_t total = 0;                // elements in all
};

Layout lay_out(at::TensorList params, c10::IntArrayRef row_numel) {
  Layout out;
  for (size_t t = 0; t < params.size(); ++t) {
    const int64_t numel = params[t].numel();
    const int64_t length = row_length(row_numel, t) == 0 ? numel : row_length(row_numel, t);
    out.total += numel;
    for (int64_t row = 0; row < num_balls(numel, row_length(row_numel, t)); ++row) {
      const size_t ball = out.ball_tensor.size();
      out.ball_tensor.push_back(t);
      const int64_t row_end = row * length + length;
      for (int64_t begin = row * length; begin < row_end; begin += kSegment) {
        out.segments.push_back({t, begin, std::min(begin + kSegment, row_end), ball});
      }
    }
  }
  return out;
}

// run(s) for every segment s: on the calling thread below kParallelMin elements, else in parallel.
template <typename Run>
void run_in_parallel(const Layout& layout, Run&& run) {
  auto run_segments = [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) run(s);
  };
  const int64_t num_segments = static_cast<int64_t>(layout.segments.size());
  if (layout.total < kParallelMin) {
    run_segments(0, num_segments);
  } else {
    at::parallel_for(0, num_segments, 1, run_segments);
  }
}

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

enum class Set { kL1, kLInf, kLp, kKSparse };

// Both steps' arguments, checked and unpacked; runs the set's kernel in the variant they ask for.
// set_param: p for the Lp step, k for the k-sparse step, unused otherwise.
template <Set kSet>
void fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                 const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                 c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                 c10::IntArrayRef row_numel, double set_param = 0, at::TensorList scales = {}) {
  constexpr const char* kOp = kSet == Set::kL1     ? "l1_fw_step_"
                             : kSet == Set::kLInf ? "linf_fw_step_"
                             : kSet == Set::kLp   ? "lp_fw_step_"
                                                  : "ksparse_fw_step_";
  check_fw_step_args(kOp, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                     distribution, gap, row_numel);
  check_scales(kOp, params, scales, global_ball, row_numel);
  double* gap_out = gap.data_ptr<double>();
  if (params.empty()) {
    *gap_out = 0;
    return;
  }
  const double* sched = schedule.data_ptr<double>();
  if (schedule.numel() == 4 && sched[3] != 0) {  // a skipped step (reference.schedule_values)
    *gap_out = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "l1_fw_step_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    StepArgs<scalar_t> args{params, momentum, grads, offsets, {}, {}, 0, 0, 0, 0, sched[1]};
    args.gamma = static_cast<acc_t>(sched[2]);
    args.keep_v = acc_t(1) - args.gamma;
    args.keep_theta = step_factors<acc_t>(sched[1]).keep;
    args.alpha_c = step_factors<acc_t>(sched[1]).alpha;
    if (grads.empty()) {
      const int64_t step = static_cast<int64_t>(sched[0]);
      const double* coeffs = tangent_coeffs.data_ptr<double>();
      for (int64_t k = 0; k < tangent_coeffs.numel(); ++k) {
        args.streams.emplace_back(seed, step, k);
        args.coeffs.push_back(static_cast<acc_t>(coeffs[k]));
      }
    }
    auto run = [&](auto source, auto with_momentum) {
      if constexpr (kSet == Set::kL1) {
        l1_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
            args, radii, global_ball, row_numel, gap_out);
      } else if constexpr (kSet == Set::kLInf) {
        linf_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
            args, radii, global_ball, row_numel, gap_out);
      } else if constexpr (kSet == Set::kLp) {
        lp_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
            args, radii, global_ball, row_numel, scales, gap_out, set_param);
      } else {
        ksparse_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
            args, radii, global_ball, row_numel, scales, gap_out, static_cast<int64_t>(set_param));
      }
    };
    dispatch_step_variant(!grads.empty(), distribution, !momentum.empty(), run);
  });
}

void l1_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                    const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                    c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                    c10::IntArrayRef row_numel) {
  fw_step_cpu<Set::kL1>(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                        distribution, gap, row_numel);
}

void linf_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                      const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                      c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                      c10::IntArrayRef row_numel) {
  fw_step_cpu<Set::kLInf>(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                          distribution, gap, row_numel);
}

void lp_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                    const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                    c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                    c10::IntArrayRef row_numel, double p, at::TensorList scales) {
  check_lp_exponent(p);
  fw_step_cpu<Set::kLp>(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                        distribution, gap, row_numel, p, scales);
}

void ksparse_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                         const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                         bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                         const at::Tensor& gap, c10::IntArrayRef row_numel, int64_t k, at::TensorList scales) {
  check_ksparse_k(k);
  fw_step_cpu<Set::kKSparse>(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                             distribution, gap, row_numel, static_cast<double>(k), scales);
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("l1_fw_step_", &l1_fw_step_cpu);
  m.impl("linf_fw_step_", &linf_fw_step_cpu);
  m.impl("lp_fw_step_", &lp_fw_step_cpu);
  m.impl("ksparse_fw_step_", &ksparse_fw_step_cpu);
}

}  // namespace fgfw
