// The one pass shared by the CPU Frank-Wolfe steps of every set (l1_fw_step.cpp: the L1 ball; linf_fw_step.cpp,
// lp_fw_step.cpp, ksparse_fw_step.cpp with set_step.h: the L-infinity, Lp and k-sparse sets): the step's arguments
// unpacked (StepArgs, run_fw_step), the direction regenerated block by block (BlockDirection), the momentum and the
// scaling of theta, the reductions in fixed segments whatever the thread count (Segment, Layout). The arithmetic follows python/fgfw/reference.py operation
// by operation (same roundings, no FMA). Design: docs/fused_step.md, "CPU kernel".
//
// Speed: the pass runs in blocks of kBlock elements through small loops the compiler vectorises
// (no per-element branch on dtype, direction source or momentum: they are template parameters):
// Philox words for the block's calls, tangent values (tangent_block.h: the values fill_tangent_
// gives, bit for bit), the direction, the update, then the block's max |d| and dot product in eight
// lanes. Only a block whose max beats the best so far is scanned again for the first index of that
// max.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FGFW_AVX2_DISPATCH 1
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
  using scalar_type = scalar_t;
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
#if defined(FGFW_AVX2_DISPATCH)
// The float32 loop of scale_and_sum eight elements at a time, where the CPU has AVX2 (chosen at run time: the build
// targets every x86-64). The same operations per element as the SSE2 loop below (no FMA: the target enables none),
// so the same bits; integer sums in any order give the same. Returns how many elements it did.
// The four lanes' sums of the bits of min(|x| factor, 2^51) + 2^52 for eight floats x.
__attribute__((target("avx2"), always_inline)) inline __m256i units_bits_avx2(__m256 x, __m256d factor) {
  const __m256 magnitude = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  const __m256d cap = _mm256_set1_pd(kUnitsCap), magic = _mm256_set1_pd(kMagic);
  const __m256d low = _mm256_min_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(magnitude)), factor), cap);
  const __m256d high = _mm256_min_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(magnitude, 1)), factor), cap);
  return _mm256_add_epi64(_mm256_castpd_si256(_mm256_add_pd(low, magic)), _mm256_castpd_si256(_mm256_add_pd(high, magic)));
}

__attribute__((target("avx2"))) inline int scale_and_sum_avx2(float* theta_b, float* theta_old, int n, float keep,
                                                               double units_factor, uint64_t& old_units,
                                                               uint64_t& new_units) {
  const __m256 keep8 = _mm256_set1_ps(keep);
  const __m256d factor = _mm256_set1_pd(units_factor);
  __m256i old_bits = _mm256_setzero_si256(), new_bits = _mm256_setzero_si256();
  int e = 0;
  for (; e + 8 <= n; e += 8) {
    const __m256 old = _mm256_loadu_ps(theta_b + e);
    _mm256_storeu_ps(theta_old + e, old);
    const __m256 stored = _mm256_mul_ps(keep8, old);
    _mm256_storeu_ps(theta_b + e, stored);
    old_bits = _mm256_add_epi64(old_bits, units_bits_avx2(old, factor));
    new_bits = _mm256_add_epi64(new_bits, units_bits_avx2(stored, factor));
  }
  alignas(32) uint64_t old_lanes[4], new_lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(old_lanes), old_bits);
  _mm256_store_si256(reinterpret_cast<__m256i*>(new_lanes), new_bits);
  uint64_t magic_bits;
  std::memcpy(&magic_bits, &kMagic, sizeof(magic_bits));
  old_units += old_lanes[0] + old_lanes[1] + old_lanes[2] + old_lanes[3] - static_cast<uint64_t>(e) * magic_bits;
  new_units += new_lanes[0] + new_lanes[1] + new_lanes[2] + new_lanes[3] - static_cast<uint64_t>(e) * magic_bits;
  return e;
}

// FGFW_CPU_BASELINE=1 keeps the baseline (SSE2) loops on an AVX2 CPU: the tests compare the two paths' bits.
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && std::getenv("FGFW_CPU_BASELINE") == nullptr;
  return has;
}
#endif

template <typename scalar_t, typename acc_t>
void scale_and_sum(scalar_t* theta_b, acc_t* theta_old, int n, acc_t keep, double units_factor, uint64_t& old_units,
                   uint64_t& new_units) {
  int e = 0;
#if defined(FGFW_AVX2_DISPATCH)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (cpu_has_avx2()) e = scale_and_sum_avx2(theta_b, theta_old, n, keep, units_factor, old_units, new_units);
  }
#endif
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
    const int sse_begin = e;
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
    old_units += old_lanes[0] + old_lanes[1] - static_cast<uint64_t>(e - sse_begin) * magic_bits;
    new_units += new_lanes[0] + new_lanes[1] - static_cast<uint64_t>(e - sse_begin) * magic_bits;
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
__attribute__((always_inline)) inline void run_segment_body(const StepArgs<scalar_t>& args, const Segment& seg,
                                                            double units_factor, Partial<acc_type<scalar_t>>& part) {
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

#if defined(FGFW_AVX2_DISPATCH)
// The pass compiled once more for CPUs with AVX2 (the build targets every x86-64): its loops vectorised 8 floats / 4
// doubles wide. Per-lane sums keep their order and AVX2 brings no FMA (nothing contracts), so the bits are the same.
template <typename scalar_t, Source kSource, bool kMomentum>
__attribute__((target("avx2"))) void run_segment_avx2(const StepArgs<scalar_t>& args, const Segment& seg,
                                                      double units_factor, Partial<acc_type<scalar_t>>& part) {
  run_segment_body<scalar_t, kSource, kMomentum>(args, seg, units_factor, part);
}
#endif

template <typename scalar_t, Source kSource, bool kMomentum>
void run_segment(const StepArgs<scalar_t>& args, const Segment& seg, double units_factor,
                 Partial<acc_type<scalar_t>>& part) {
#if defined(FGFW_AVX2_DISPATCH)
  if (cpu_has_avx2()) return run_segment_avx2<scalar_t, kSource, kMomentum>(args, seg, units_factor, part);
#endif
  run_segment_body<scalar_t, kSource, kMomentum>(args, seg, units_factor, part);
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

// Checks and unpacks the arguments of a step over the balls of some set (op names it in the errors), then calls
// kernel(args, source, with_momentum, gap_out) in the variant they ask for (dispatch_step_variant): the set's
// kernel, a generic lambda. An empty call writes a gap of 0, a skipped step (reference.schedule_values) NaN.
template <typename Kernel>
void run_fw_step(const char* op, at::TensorList params, at::TensorList momentum, at::TensorList grads,
                 const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                 bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                 c10::IntArrayRef row_numel, at::TensorList scales, Kernel&& kernel) {
  check_fw_step_args(op, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                     distribution, gap, row_numel);
  check_scales(op, params, scales, global_ball, row_numel);
  double* gap_out = gap.data_ptr<double>();
  const double* sched = schedule.data_ptr<double>();
  if (schedule.numel() == 4 && sched[3] != 0) {  // a skipped step (reference.schedule_values)
    *gap_out = std::numeric_limits<double>::quiet_NaN();
    return;
  }
  if (params.empty()) {
    *gap_out = 0;
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "fw_step_cpu", [&] {
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
    dispatch_step_variant(!grads.empty(), distribution, !momentum.empty(), [&](auto source, auto with_momentum) {
      kernel(args, source, with_momentum, gap_out);
    });
  });
}

}  // namespace
}  // namespace fgfw
