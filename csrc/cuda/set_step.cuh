// What the CUDA steps of the sets other than the L1 ball share (linf_fw_step.cu, lp_fw_step.cu, ksparse_fw_step.cu:
// linf_fw_step_, lp_fw_step_ and ksparse_fw_step_; python/fgfw/reference.py is the spec; docs/set_steps.md, "CUDA
// kernels"): their design, below, and its shared parts: slices, entries, directions, the gap, the norm feedback and
// the host side of a launch.
//
// Written for clarity first: a few simple kernels per step, each a grid-stride loop over "slices"
// (block per slice) or over balls (warp per ball), and no host synchronisation.
//
// Slices. Every ball (a tensor, one row of row_numel elements, or every tensor for the global ball) is
// cut into slices of at most kSlice consecutive elements of one tensor; a slice never spans two balls.
// Slices are numbered step-wide in (tensor, ball, element) order: a lower slice number always holds
// lower element indices, across tensors too. Every per-slice partial (a share of the gap, a max and a
// scaled sum, a count) is written to the slice's slot and combined later in slot order, so the results
// are the same run after run (every floating-point reduction is a fixed tree).
//
// Entries. The host describes the balls as entries: a run of consecutive balls of one tensor that share a
// radius (a whole tensor, all rows of a tensor with one radius, or fewer rows when rows have radii of their
// own; one entry per non-empty tensor for the global ball). Up to kMaxEntries entries travel per launch in
// a __grid_constant__ table argument, so a step copies nothing to the device and can be captured in a
// CUDA graph. Per-ball state (the Lp norms, the k-sparse selections) lives in a workspace from the caching
// allocator, indexed by a step-wide ball id (always 0 for the global ball).
//
// The direction d of element j is computed as l1_fw_step.cu computes it: the gradient, or the forward
// gradient sum_k coeff_k u_k regenerated in registers (one Philox call per group of four stream indices
// per tangent), then the momentum v <- (1 - gamma) v + gamma g, d = v. Every product and sum is an
// explicitly rounded intrinsic (rn_mul, rn_add), so nvcc cannot contract them into FMAs.
//
// The steps (s the vertex, in float64 as the reference computes it; theta <- t + alpha (s - t), t = scale theta,
// with s rounded to the compute type, held within +-R for the L-infinity and k-sparse sets (feasibility.h:
// dense_update); the gap is sum over elements of d (theta_old - s) in float64). The Lp and k-sparse steps also
// sum, per slice, the norms of what they store and of the exact step; feedback_kernel (a warp per ball) turns a
// ball's sums into the scale its next step applies (next_norm_scale), in the op's `scales`:
// * L-infinity: s = -r sign(d). One pass (linf_kernel: directions, update, the slice's gap share), then
//   the gap sum (gap_sum_kernel).
// * Lp: s_i = -r sign(d_i) (x_i / N)^(q-1), x = |d| / max|d|, N = ||x||_q. lp_reduce_kernel computes
//   the directions (and the momentum) and, per slice, m = max|d| and S = sum (|d| / m)^q: each term is at
//   most 1, so nothing overflows. lp_ball_kernel combines a ball's slices into M = max m and
//   ||x||_q^q = sum S (m / M)^q. lp_update_kernel regenerates the directions (from the momentum just
//   written, the gradient, or the tangent stream) and updates theta. Then the gap sum.
// * k-sparse: s = -r sign(d) on the k largest |d| of each ball (ties: the lowest index; NaN above
//   everything), 0 elsewhere. ksparse_direction_kernel writes d to a workspace. The key of an element
//   is the bit pattern of |d| (AbsBits, as the L1 kernels compare: ordered like |d|, NaN above +inf).
//   A most-significant-digit radix select (8-bit digits; 4 passes for float32 keys, 8 for float64) finds
//   T, the k-th largest key of each ball, and `need`, how many elements with key == T are in the top k:
//   per pass, ksparse_hist_kernel counts the digits of the keys that match the ball's prefix so far
//   (shared-memory histogram per slice, added to the ball's with integer atomics: exact and
//   order-independent) and ksparse_select_kernel picks the digit (a warp per ball). Ties at T go to the
//   lowest indices: ksparse_count_kernel counts key == T per slice, ksparse_scan_kernel turns the
//   counts into an exclusive prefix over each ball's slices, and ksparse_update_kernel ranks its slice's
//   key == T elements with a block scan in index order. An element is chosen when key > T, or key == T
//   and its rank < need.
//
// sign() is torch.sign: 0 for 0 and for NaN (the reference's vertex uses torch.sign, which gives 0 for
// NaN), so a NaN direction leaves its element only scaled in the L-infinity and k-sparse steps; the gap
// is NaN then. In the Lp step a NaN (or an infinite) |d| makes M or N NaN, and the whole ball's vertex
// NaN, as in the reference.
//
// A skipped step (schedule[3] != 0, direction.cuh: skipped) makes the same launches and every kernel returns at its
// top, gap_sum_kernel after writing the NaN gap: params, momentum and scales keep their bits.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cuda/direction.cuh"
#include "feasibility.h"
#include "op_args.h"
#include "philox.h"
#include "step_variant.h"

namespace fgfw {
namespace {
// ---- Geometry and launch constants ------------------------------------------------------------------

// Elements per slice: 16 (float) or 32 (double) KiB of directions staged in shared memory per block.
constexpr int64_t kSlice = 4096;
// Threads of the slice kernels (block per slice) and of the ball kernels (warp per ball).
constexpr int kSliceThreads = 256;
constexpr int kBallThreads = 128;
constexpr int kBallsPerBlock = kBallThreads / 32;
// Threads of the one-block gap sum.
constexpr int kSumThreads = 1024;
// Entries per launch: 128 entries of 96 bytes keep the table argument near 12 KiB (CUDA >= 12.1 allows
// 32 KiB of kernel arguments on sm_70 and newer; l1_fw_step.cu relies on that too).
constexpr int kMaxEntries = 128;
// Radix select: 8-bit digits, a histogram of 256 counts per ball.
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;
static_assert(kBins == 8 * 32, "ksparse_select_kernel gives each lane of a warp 8 bins");
static_assert(kSliceThreads % 32 == 0 && kBallThreads % 32 == 0 && kSumThreads % 32 == 0);

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Blocks per SM that __launch_bounds__ asks of the slice kernels that compute directions: 64 registers a
// thread for float accumulation, 80 for double (l1_fw_step.cu's budget). With that cap ptxas also keeps
// sincosf's large-argument reduction buffer (Gaussian tangents) in registers instead of a stack frame.
template <typename scalar_t>
constexpr int kMinSliceBlocks = std::is_same_v<scalar_t, double> ? 3 : 4;

// ---- Rounded arithmetic and signs -------------------------------------------------------------------

// rn_mul, rn_add, rn_sub, rn_div: direction.cuh

// torch.sign: -1, 0 or 1; 0 for +-0 and for NaN.
__device__ __forceinline__ double sign_of(double x) { return static_cast<double>((x > 0.0) - (x < 0.0)); }

// |x| as an unsigned integer key (AbsBits of the L1 kernels): ordered like |x| among numbers and above
// +inf for every NaN, so an integer comparison ranks magnitudes with NaN largest.
template <typename T>
struct AbsKey;

template <>
struct AbsKey<float> {
  using type = uint32_t;
  static constexpr int kBits = 32;
  __device__ static type of(float x) { return __float_as_uint(x) & 0x7fffffffu; }
  __device__ static float value(type key) { return __uint_as_float(key); }
};

template <>
struct AbsKey<double> {
  using type = unsigned long long;
  static constexpr int kBits = 64;
  __device__ static type of(double x) {
    return static_cast<type>(__double_as_longlong(x)) & 0x7fffffffffffffffull;
  }
  __device__ static double value(type key) { return __longlong_as_double(static_cast<long long>(key)); }
};

// ---- Block and warp reductions (fixed trees: the same inputs give the same result) --------------------

struct SumOp {
  __device__ double operator()(double a, double b) const { return rn_add(a, b); }
  __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const { return a + b; }
};
struct SaturatingSumOp {  // norm sums in units: order-free (feasibility.h)
  __device__ unsigned long long operator()(unsigned long long a, unsigned long long b) const {
    return saturating_add(a, b);
  }
};
struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};

// Lane 0 gets op over the warp's values, combined in a fixed tree.
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) x = op(x, __shfl_down_sync(0xffffffffu, x, delta));
  return x;
}

// Every thread gets op over the block's values (kThreads threads, all of which must call it). A fixed
// tree. Its __syncthreads also order any shared-memory use before the call against any after it.
template <int kThreads, typename T, typename Op>
__device__ T block_reduce(T x, Op op, T identity) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kWarps <= 32, "one warp combines the warps' results");
  __shared__ T warp_result[kWarps];
  __shared__ T result;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = warp_reduce(x, op);
  if (lane == 0) warp_result[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = warp_reduce(lane < kWarps ? warp_result[lane] : identity, op);
    if (lane == 0) result = x;
  }
  __syncthreads();
  const T out = result;
  __syncthreads();  // warp_result and result are reused by the next call
  return out;
}

// The exclusive prefix sum of `flag` over the block's threads in thread order, and the block's total.
// Every thread of the block must call it.
template <int kThreads>
__device__ void block_exclusive_scan(unsigned int flag, unsigned int& before, unsigned int& total) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kWarps <= 32, "one warp scans the warps' totals");
  __shared__ unsigned int warp_inclusive[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned int x = flag;  // inclusive scan within the warp
#pragma unroll
  for (int delta = 1; delta < 32; delta *= 2) {
    const unsigned int y = __shfl_up_sync(0xffffffffu, x, delta);
    if (lane >= delta) x += y;
  }
  if (lane == 31) warp_inclusive[warp] = x;
  __syncthreads();
  if (warp == 0) {
    unsigned int w = lane < kWarps ? warp_inclusive[lane] : 0u;
#pragma unroll
    for (int delta = 1; delta < 32; delta *= 2) {
      const unsigned int y = __shfl_up_sync(0xffffffffu, w, delta);
      if (lane >= delta) w += y;
    }
    if (lane < kWarps) warp_inclusive[lane] = w;  // now inclusive over warps
  }
  __syncthreads();
  before = x - flag + (warp > 0 ? warp_inclusive[warp - 1] : 0u);
  total = warp_inclusive[kWarps - 1];
  __syncthreads();  // warp_inclusive is reused by the next call
}

// ---- The step's description: entries and their slices and balls ---------------------------------------

// A run of consecutive balls of one tensor with one radius. Pointers are to the tensor's element 0.
struct Entry {
  void* theta;            // params[t]
  void* v;                // momentum[t] (compute dtype), or null without momentum
  const void* grad;       // grads[t], or null for the forward gradient
  void* dir;              // k-sparse: the direction workspace of tensor t (compute dtype), else null
  int64_t stream_offset;  // element j of the tensor has stream index stream_offset + j
  int64_t ball_numel;     // n >= 1: elements per ball (the tensor's numel for a whole-tensor ball)
  int64_t first_ball;     // the entry's first ball in its tensor: its elements start at first_ball * n
  int64_t num_balls;      // >= 1
  int64_t slices_per_ball;
  int64_t first_slice;    // step-wide slot of the entry's first slice
  int64_t first_ball_id;  // step-wide id of the entry's first ball (0 for every entry of the global ball)
  double radius;
  double* scale;          // the norm feedback's scale of the entry's first ball (the global ball's), or null
};

struct EntryTable {
  Entry entry[kMaxEntries];
  int num_entries;
  int64_t slice_begin, slice_end;  // the launch's slices, [entry[0].first_slice, end of the last entry)
  int64_t ball_begin, ball_end;    // the launch's ball ids (ball kernels; [0, 1) for the global ball)
};

// The global ball for the ball kernels: one ball over every slot of the step (is_global), or none.
struct GlobalBall {
  bool is_global;
  int64_t num_slices;  // every slice of the step
  int64_t numel;       // every element of the step
  double radius;
  double* scale;       // its norm feedback's scale, or null
};

// The last entry whose key(entry) <= x; entries are sorted by key and x >= key(entry[0]).
template <typename Key>
__device__ int find_entry(const EntryTable& table, int64_t x, Key key) {
  int lo = 0, hi = table.num_entries - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (key(table.entry[mid]) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

struct FirstSlice {
  __device__ int64_t operator()(const Entry& e) const { return e.first_slice; }
};
struct FirstBallId {
  __device__ int64_t operator()(const Entry& e) const { return e.first_ball_id; }
};

// Slice s of the step: elements [begin, end) of its entry's tensor, in ball ball_id.
struct SliceInfo {
  int entry;
  int64_t ball_id, begin, end;
};

__device__ SliceInfo slice_info(const EntryTable& table, int64_t s) {
  const int e = find_entry(table, s, FirstSlice{});
  const Entry& entry = table.entry[e];
  const int64_t in_entry = s - entry.first_slice;
  const int64_t ball = in_entry / entry.slices_per_ball;     // within the entry
  const int64_t piece = in_entry % entry.slices_per_ball;    // within the ball
  const int64_t ball_start = (entry.first_ball + ball) * entry.ball_numel;
  const int64_t begin = ball_start + piece * kSlice;
  const int64_t end = begin + kSlice < ball_start + entry.ball_numel ? begin + kSlice : ball_start + entry.ball_numel;
  return {e, entry.first_ball_id + ball, begin, end};
}

// Ball `id` of the step: its slots [slot_begin, slot_end), its number of elements, its radius, and where its
// norm feedback's scale lives (null without scales).
struct BallInfo {
  int64_t slot_begin, slot_end, numel;
  double radius;
  double* scale;
};

__device__ BallInfo ball_info(const EntryTable& table, const GlobalBall& global, int64_t id) {
  if (global.is_global) return {0, global.num_slices, global.numel, global.radius, global.scale};
  const Entry& entry = table.entry[find_entry(table, id, FirstBallId{})];
  const int64_t begin = entry.first_slice + (id - entry.first_ball_id) * entry.slices_per_ball;
  return {begin, begin + entry.slices_per_ball, entry.ball_numel, entry.radius,
          entry.scale ? entry.scale + (id - entry.first_ball_id) : nullptr};
}

// The norm feedback's scale of a slice's ball (1 without scales): the global ball's for every slice of it.
__device__ __forceinline__ double slice_scale(const EntryTable& table, const SliceInfo& slice) {
  const Entry& entry = table.entry[slice.entry];
  return entry.scale ? entry.scale[slice.ball_id - entry.first_ball_id] : 1.0;
}

// ---- Directions ---------------------------------------------------------------------------------------

// The schedule as the kernels use it (read on the device: the host never reads it).
template <typename acc_t>
struct StepScalars {
  int64_t step;
  acc_t gamma, keep_v;  // momentum: v <- keep_v v + gamma g, keep_v = 1 - gamma
  double alpha;         // alpha_k as the schedule holds it (the exact step's)
  acc_t alpha_c;        // step_factors: alpha rounded
};

template <typename acc_t>
__device__ StepScalars<acc_t> read_schedule(const double* __restrict__ schedule) {
  StepScalars<acc_t> sc;
  sc.step = static_cast<int64_t>(schedule[0]);
  sc.alpha = schedule[1];
  sc.alpha_c = step_factors<acc_t>(schedule[1]).alpha;
  sc.gamma = static_cast<acc_t>(schedule[2]);
  sc.keep_v = acc_t(1) - sc.gamma;
  return sc;
}

// What the forward gradient needs (unused for backprop gradients).
struct Tangents {
  const double* coeffs;  // [num_tangents] float64 on the device
  int num_tangents;
  int64_t seed;
};

// out[j - begin] = d_j for the slice's elements j in [begin, end), computed by the block's threads.
// kReplay = false: the step's first look at the directions: g from its source, and with momentum
// v_j <- (1 - gamma) v_j + gamma g_j written back, d = v. kReplay = true: the same d again in a later
// pass (the momentum already holds it; else g is read or regenerated, bit for bit the same).
// Callers synchronise the block before reading out[] written by other threads.
template <typename scalar_t, Source kSource, bool kMomentum, bool kReplay>
__device__ void slice_directions(const Entry& entry, int64_t begin, int64_t end, const StepScalars<acc_type<scalar_t>>& sc,
                                 const Tangents& tangents, acc_type<scalar_t>* out) {
  using acc_t = acc_type<scalar_t>;
  acc_t* const v = static_cast<acc_t*>(entry.v);
  const scalar_t* const grad = static_cast<const scalar_t*>(entry.grad);
  constexpr bool kNeedsG = !(kReplay && kMomentum);  // a replay with momentum reads d from v
  auto finish = [&](acc_t g, int64_t j) -> acc_t {
    if constexpr (kMomentum) {
      if constexpr (kReplay) {
        return v[j];
      } else {
        const acc_t d = rn_add(rn_mul(sc.keep_v, v[j]), rn_mul(sc.gamma, g));
        v[j] = d;
        return d;
      }
    } else {
      return g;
    }
  };
  if constexpr (kNeedsG && kSource != Source::kGrad) {
    // One Philox call per group of four stream indices: call q holds stream indices 4q .. 4q + 3, i.e.
    // elements j = 4q + lane - stream_offset; the slice may start and end in the middle of a call.
    const int64_t offset = entry.stream_offset;
    const int64_t q_first = (offset + begin) / 4, q_last = (offset + end - 1) / 4;
    for (int64_t q = q_first + threadIdx.x; q <= q_last; q += blockDim.x) {
      acc_t g[4];
      forward_gradient<kSource>(g, static_cast<uint64_t>(q), tangents.seed, sc.step, tangents.coeffs,
                                tangents.num_tangents);
#pragma unroll
      for (int lane = 0; lane < 4; ++lane) {
        const int64_t j = 4 * q + lane - offset;
        if (j < begin || j >= end) continue;
        out[j - begin] = finish(g[lane], j);
      }
    }
  } else {
    for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
      acc_t g = acc_t(0);
      if constexpr (kNeedsG) g = static_cast<acc_t>(grad[j]);
      out[j - begin] = finish(g, j);
    }
  }
}

// theta_j <- dense_update (feasibility.h: scale theta_j + alpha (s_j - scale theta_j), s_j in float64 rounded to
// the compute type, held within +-bound under kClamp); returns d_j (theta_old - s_j), the element's term of the
// gap, in float64 (reference.fw_step_). stored, exact: the value stored (in the compute type) and the exact step,
// for the norm feedback.
template <bool kClamp, typename scalar_t>
__device__ __forceinline__ double update_element(scalar_t* theta, int64_t j, acc_type<scalar_t> d, double s,
                                                 const StepScalars<acc_type<scalar_t>>& sc, double scale,
                                                 acc_type<scalar_t> bound, double radius, acc_type<scalar_t>& stored,
                                                 double& exact) {
  using acc_t = acc_type<scalar_t>;
  const acc_t theta_old = static_cast<acc_t>(theta[j]);
  const scalar_t next = static_cast<scalar_t>(dense_update<kClamp>(theta_old, s, sc.alpha, sc.alpha_c, scale, bound,
                                                                   radius, exact));
  theta[j] = next;
  stored = static_cast<acc_t>(next);
  return rn_mul(static_cast<double>(d), rn_sub(static_cast<double>(theta_old), s));
}

// ---- The gap ------------------------------------------------------------------------------------------

// *gap = the sum of the slices' shares, in a fixed order (thread i sums slots i, i + kSumThreads, ...,
// then a fixed tree). One block. A skipped step's gap is NaN (no kernel before wrote a share).
__global__ void __launch_bounds__(kSumThreads)
    gap_sum_kernel(const double* __restrict__ slot_gap, int64_t num_slices, const double* __restrict__ skip,
                   double* __restrict__ gap) {
  if (skipped(skip)) {
    if (threadIdx.x == 0) *gap = skipped_gap();
    return;
  }
  double sum = 0.0;
  for (int64_t s = threadIdx.x; s < num_slices; s += kSumThreads) sum = rn_add(sum, slot_gap[s]);
  sum = block_reduce<kSumThreads>(sum, SumOp{}, 0.0);
  if (threadIdx.x == 0) *gap = sum;
}

// ---- The norm feedback -----------------------------------------------------------------------------------

// A warp per ball: the ball's norm sums over its slots (fixed trees; k-sparse: integer units added stopping at
// their cap, a capped sum counting as infinite) and its next scale, written where its scale lives
// (next_norm_scale): the Lp step's bound is 1 (sums of (|x| / r)^p), the k-sparse step's k r in units of its
// grid. kInteger: k-sparse. unit_roundoff: u of the compute type.
template <bool kInteger>
__global__ void __launch_bounds__(kBallThreads)
    feedback_kernel(const __grid_constant__ EntryTable table, GlobalBall global, double p, int64_t k,
                    double unit_roundoff, const double* __restrict__ skip, const double* __restrict__ slot_stored,
                    const double* __restrict__ slot_exact, const unsigned long long* __restrict__ slot_stored_units,
                    const unsigned long long* __restrict__ slot_exact_units) {
  if (skipped(skip)) return;  // the scales keep their bits
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    const BallInfo ball = ball_info(table, global, id);
    double stored, exact, bound;
    if constexpr (kInteger) {
      unsigned long long stored_units = 0, exact_units = 0;
      for (int64_t c = ball.slot_begin + lane; c < ball.slot_end; c += 32) {
        stored_units = saturating_add(stored_units, slot_stored_units[c]);
        exact_units = saturating_add(exact_units, slot_exact_units[c]);
      }
      stored = units_as_double(warp_reduce(stored_units, SaturatingSumOp{}));
      exact = units_as_double(warp_reduce(exact_units, SaturatingSumOp{}));
      const double k_r = rn_mul(static_cast<double>(k), ball.radius);
      bound = rn_mul(k_r, units_factor(k_r));
    } else {
      stored = exact = 0.0;
      for (int64_t c = ball.slot_begin + lane; c < ball.slot_end; c += 32) {
        stored = rn_add(stored, slot_stored[c]);
        exact = rn_add(exact, slot_exact[c]);
      }
      stored = warp_reduce(stored, SumOp{});
      exact = warp_reduce(exact, SumOp{});
      bound = 1.0;
    }
    if (lane == 0 && ball.scale != nullptr && ball.numel > 0) {
      *ball.scale = next_norm_scale(stored, exact, bound, kInteger ? 1.0 : p, unit_roundoff);
    }
  }
}

// ---- Host side -----------------------------------------------------------------------------------------
// The entries, slices and balls of a step (see the file comment).
struct Plan {
  std::vector<Entry> entries;
  std::vector<int> entry_tensor;       // the tensor of each entry
  std::vector<int64_t> tensor_first;   // each tensor's first element in the step's flat order
  int64_t num_slices = 0;
  int64_t num_balls = 0;   // ball states: one per non-empty ball, or 1 for a non-empty global ball
  int64_t numel = 0;       // every element of the step
};

// scales: the norm feedback's state (empty: none); every entry of the global ball points at its one scale.
Plan plan_step(at::TensorList params, at::TensorList momentum, at::TensorList grads, c10::ArrayRef<double> radii,
               bool global_ball, c10::IntArrayRef offsets, c10::IntArrayRef row_numel, at::TensorList scales) {
  Plan plan;
  const int n = static_cast<int>(params.size());
  auto add_entry = [&](int t, int64_t ball_numel, int64_t first_ball, int64_t num_balls, double radius) {
    Entry e;
    std::memset(&e, 0, sizeof(e));
    e.theta = params[t].data_ptr();
    e.v = momentum.empty() ? nullptr : momentum[t].data_ptr();
    e.grad = grads.empty() ? nullptr : grads[t].data_ptr();
    e.dir = nullptr;
    e.stream_offset = offsets.empty() ? 0 : offsets[t];
    e.ball_numel = ball_numel;
    e.first_ball = first_ball;
    e.num_balls = num_balls;
    e.slices_per_ball = (ball_numel + kSlice - 1) / kSlice;
    e.first_slice = plan.num_slices;
    e.first_ball_id = global_ball ? 0 : plan.num_balls;
    e.radius = radius;
    e.scale = scales.empty() ? nullptr
                             : global_ball ? scales[0].data_ptr<double>() : scales[t].data_ptr<double>() + first_ball;
    plan.num_slices += num_balls * e.slices_per_ball;
    if (!global_ball) plan.num_balls += num_balls;
    plan.entries.push_back(e);
    plan.entry_tensor.push_back(t);
  };
  int64_t radius_index = 0;  // the op's index of tensor t's first ball
  for (int t = 0; t < n; ++t) {
    const int64_t numel = params[t].numel(), length = row_length(row_numel, t);
    const int64_t balls = num_balls(numel, length);
    plan.tensor_first.push_back(plan.numel);
    plan.numel += numel;
    if (numel > 0) {
      if (global_ball) {
        add_entry(t, numel, 0, 1, radii[0]);
      } else {
        const int64_t ball_numel = length == 0 ? numel : length;
        // runs of balls with one radius (bitwise equal), each an entry
        for (int64_t b = 0; b < balls;) {
          int64_t end = b + 1;
          while (end < balls && radii[radius_index + end] == radii[radius_index + b]) ++end;
          add_entry(t, ball_numel, b, end - b, radii[radius_index + b]);
          b = end;
        }
      }
    }
    radius_index += balls;
  }
  if (global_ball && plan.numel > 0) plan.num_balls = 1;
  return plan;
}

// Calls launch(table) for the plan's entries, kMaxEntries at a time, in order.
template <typename Launch>
void for_each_table(const Plan& plan, Launch&& launch) {
  const int num = static_cast<int>(plan.entries.size());
  for (int first = 0; first < num; first += kMaxEntries) {
    EntryTable table;
    std::memset(&table, 0, sizeof(table));
    table.num_entries = std::min(kMaxEntries, num - first);
    for (int e = 0; e < table.num_entries; ++e) table.entry[e] = plan.entries[first + e];
    const Entry& last = table.entry[table.num_entries - 1];
    table.slice_begin = table.entry[0].first_slice;
    table.slice_end = last.first_slice + last.num_balls * last.slices_per_ball;
    table.ball_begin = table.entry[0].first_ball_id;
    table.ball_end = last.first_ball_id + last.num_balls;
    launch(table);
  }
}

// Calls launch(table, global) for the ball kernels: the plan's tables, or one table with ball [0, 1) for
// the global ball (whose slots are every slot of the step).
template <typename Launch>
void for_each_ball_table(const Plan& plan, bool global_ball, Launch&& launch) {
  if (global_ball) {
    EntryTable table;
    std::memset(&table, 0, sizeof(table));
    table.ball_begin = 0;
    table.ball_end = 1;
    const Entry& any = plan.entries.front();  // the global ball's radius and scale, in every entry
    launch(table, GlobalBall{true, plan.num_slices, plan.numel, any.radius, any.scale});
  } else {
    for_each_table(plan, [&](const EntryTable& table) { launch(table, GlobalBall{false, 0, 0, 0.0, nullptr}); });
  }
}

// Offsets of the workspace's arrays in one allocation, each 256-byte aligned.
class WorkspaceLayout {
 public:
  size_t take(size_t bytes) {
    const size_t at = bytes_;
    bytes_ = (bytes_ + bytes + 255) / 256 * 256;
    return at;
  }
  size_t bytes() const { return std::max<size_t>(bytes_, 1); }

 private:
  size_t bytes_ = 0;
};

// Grid sizes: grid-stride loops, so enough blocks to fill the GPU a few times over, never more than the work.
struct Launcher {
  int64_t max_slice_blocks, max_ball_blocks;

  unsigned slice_grid(const EntryTable& table) const {
    return static_cast<unsigned>(std::clamp<int64_t>(table.slice_end - table.slice_begin, 1, max_slice_blocks));
  }
  unsigned ball_grid(const EntryTable& table) const {
    const int64_t balls = table.ball_end - table.ball_begin;
    return static_cast<unsigned>(std::clamp<int64_t>((balls + kBallsPerBlock - 1) / kBallsPerBlock, 1, max_ball_blocks));
  }
};

// The launch of one set step, from its plan to its gap. An op's launcher builds one (empty(): every tensor is empty,
// the gap is written alone), reserves its own workspace arrays from `layout`, calls allocate(), launches its
// kernels, then finish(): the norm feedback's kernel where the step has scales, and the gap sum.
template <typename scalar_t, Source kSource>
struct SetStepLaunch {
  using acc_t = acc_type<scalar_t>;

  Plan plan;
  bool feedback;
  int device;
  cudaStream_t stream;
  const double* schedule;
  const double* skip;  // read by every kernel on the device (a skipped step writes nothing but its NaN gap)
  Tangents tangents;
  // The workspace: one block from the caching allocator (stream-ordered on the current stream, so it is safe to
  // reuse after the step's kernels and fine inside a CUDA graph capture), its arrays laid out by `layout`.
  WorkspaceLayout layout;
  size_t slot_gap_at = 0, slot_stored_at = 0, slot_exact_at = 0;
  at::Tensor workspace;
  Launcher launcher{0, 0};
  double* slot_gap = nullptr;
  double* slot_stored = nullptr;
  double* slot_exact = nullptr;
  unsigned long long* slot_stored_units = nullptr;
  unsigned long long* slot_exact_units = nullptr;

  // scales: the norm feedback's state, empty for none (the L-infinity step passes none: its clamp keeps it in the
  // ball)
  SetStepLaunch(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule_t,
                const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                c10::IntArrayRef offsets, int64_t seed, c10::IntArrayRef row_numel, at::TensorList scales)
      : plan(plan_step(params, momentum, grads, radii, global_ball, offsets, row_numel, scales)),
        feedback(!scales.empty()),
        device(params[0].get_device()),
        stream(c10::cuda::getCurrentCUDAStream(device).stream()),
        schedule(schedule_t.data_ptr<double>()),
        skip(schedule_t.numel() == 4 ? schedule + 3 : nullptr),
        tangents{kSource == Source::kGrad ? nullptr : tangent_coeffs.data_ptr<double>(),
                 kSource == Source::kGrad ? 0 : static_cast<int>(tangent_coeffs.numel()), seed} {
    if (empty()) return;
    slot_gap_at = layout.take(sizeof(double) * plan.num_slices);
    // the norm feedback's per-slice sums (float64 for Lp, units for k-sparse: 8 bytes either way)
    if (feedback) {
      slot_stored_at = layout.take(8 * plan.num_slices);
      slot_exact_at = layout.take(8 * plan.num_slices);
    }
  }

  bool empty() const { return plan.num_slices == 0; }

  // The array at `offset` of the workspace (after allocate()).
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(workspace.data_ptr()) + offset);
  }

  // Allocates the workspace, every array reserved, and sizes the grids.
  void allocate(const at::Tensor& like) {
    workspace = at::empty({static_cast<int64_t>(layout.bytes())},
                          at::TensorOptions().dtype(at::kByte).device(like.device()));
    slot_gap = at<double>(slot_gap_at);
    if (feedback) {
      slot_stored = at<double>(slot_stored_at);
      slot_exact = at<double>(slot_exact_at);
      slot_stored_units = at<unsigned long long>(slot_stored_at);
      slot_exact_units = at<unsigned long long>(slot_exact_at);
    }
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    launcher = Launcher{int64_t{sms} * 8, int64_t{sms} * 16};
  }

  // After the op's kernels, on the same stream: each ball's next scale from its slices' sums (where the step has
  // scales; kInteger: the k-sparse step's units, p and k as feedback_kernel takes them), then the gap.
  template <bool kInteger>
  void finish(bool global_ball, double p, int64_t k, const at::Tensor& gap) {
    if (feedback) {
      const double unit_roundoff = std::is_same_v<acc_t, double> ? 0x1p-53 : 0x1p-24;
      for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
        feedback_kernel<kInteger><<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(
            table, global, p, k, unit_roundoff, skip, slot_stored, slot_exact, slot_stored_units, slot_exact_units);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    gap_sum_kernel<<<1, kSumThreads, 0, stream>>>(slot_gap, plan.num_slices, skip, gap.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// The checks every set step's op makes first.
void check_set_step_args(const char* op, at::TensorList params, at::TensorList momentum, at::TensorList grads,
                         const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                         bool global_ball, c10::IntArrayRef offsets, int64_t distribution, const at::Tensor& gap,
                         c10::IntArrayRef row_numel, at::TensorList scales) {
  check_fw_step_args(op, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, distribution,
                     gap, row_numel);
  check_scales(op, params, scales, global_ball, row_numel);
}

// The op's launch on the params' device, dtype and direction variant: launch(scalar_t* tag, source, with_momentum)
// with the constants of step_variant.h; no params: the gap alone.
template <typename Launch>
void dispatch_set_step(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                       const at::Tensor& schedule, int64_t distribution, const at::Tensor& gap, Launch&& launch) {
  const c10::cuda::CUDAGuard device_guard(params.empty() ? schedule.device() : params[0].device());
  if (params.empty()) {
    write_empty_gap(gap, schedule);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "set_fw_step_cuda", [&] {
    dispatch_step_variant(!grads.empty(), distribution, !momentum.empty(), [&](auto source, auto with_momentum) {
      launch(static_cast<scalar_t*>(nullptr), source, with_momentum);
    });
  });
}

}  // namespace
}  // namespace fgfw
