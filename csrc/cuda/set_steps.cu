// linf_fw_step_, lp_fw_step_ and ksparse_fw_step_ on CUDA: the fused Frank-Wolfe steps of the sets
// other than the L1 ball (python/fgfw/reference.py is the spec; docs/set_steps.md, "CUDA kernels").
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
// The direction d of element j is computed as fw_step.cu computes it: the gradient, or the forward
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
// 32 KiB of kernel arguments on sm_70 and newer; fw_step.cu relies on that too).
constexpr int kMaxEntries = 128;
// Radix select: 8-bit digits, a histogram of 256 counts per ball.
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;
static_assert(kBins == 8 * 32, "ksparse_select_kernel gives each lane of a warp 8 bins");
static_assert(kSliceThreads % 32 == 0 && kBallThreads % 32 == 0 && kSumThreads % 32 == 0);

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Blocks per SM that __launch_bounds__ asks of the slice kernels that compute directions: 64 registers a
// thread for float accumulation, 80 for double (fw_step.cu's budget). With that cap ptxas also keeps
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

// ---- L-infinity -----------------------------------------------------------------------------------------

// One pass: s = -r sign(d) per element; slot_gap[s] = the slice's share of the gap.
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kSliceThreads, kMinSliceBlocks<scalar_t>)
    linf_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule, Tangents tangents,
                const double* __restrict__ skip, double* __restrict__ slot_gap) {
  using acc_t = acc_type<scalar_t>;
  __shared__ acc_t d_slice[kSlice];
  if (skipped(skip)) return;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const Entry& entry = table.entry[slice.entry];
    slice_directions<scalar_t, kSource, kMomentum, false>(entry, slice.begin, slice.end, sc, tangents, d_slice);
    __syncthreads();
    scalar_t* const theta = static_cast<scalar_t*>(entry.theta);
    const double minus_r = -entry.radius;
    const acc_t bound = radius_down<acc_t>(entry.radius);
    double gap = 0.0;
    for (int64_t j = slice.begin + threadIdx.x; j < slice.end; j += blockDim.x) {
      const acc_t d = d_slice[j - slice.begin];
      acc_t stored;
      double exact;
      gap = rn_add(gap, update_element<true>(theta, j, d, rn_mul(minus_r, sign_of(static_cast<double>(d))), sc, 1.0,
                                             bound, entry.radius, stored, exact));
    }
    gap = block_reduce<kSliceThreads>(gap, SumOp{}, 0.0);  // also: every read of d_slice is done
    if (threadIdx.x == 0) slot_gap[s] = gap;
  }
}

// ---- Lp -------------------------------------------------------------------------------------------------

// The exponent q = p / (p - 1) and what the kernels derive from it, computed once on the host.
struct LpExponent {
  double q, q_minus_1, inv_q, p;
  bool q_is_2;  // p = 2: y^2 as y * y, the norm as sqrt, and (x / N)^1 as x / N
};

// y^q for y in [0, 1] (or NaN).
__device__ __forceinline__ double pow_q(double y, const LpExponent& lp) { return lp.q_is_2 ? rn_mul(y, y) : pow(y, lp.q); }

// Pass 1: directions (and the momentum), then per slice m = max|d| and S = sum (|d| / m)^q (S = 0 when
// m = 0; NaN when m is, or when some |d| is infinite).
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kSliceThreads, kMinSliceBlocks<scalar_t>)
    lp_reduce_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule, Tangents tangents,
                     LpExponent lp, const double* __restrict__ skip, double* __restrict__ slot_max,
                     double* __restrict__ slot_sum) {
  using acc_t = acc_type<scalar_t>;
  using Key = AbsKey<acc_t>;
  __shared__ acc_t d_slice[kSlice];
  if (skipped(skip)) return;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const int n = static_cast<int>(slice.end - slice.begin);
    slice_directions<scalar_t, kSource, kMomentum, false>(table.entry[slice.entry], slice.begin, slice.end, sc,
                                                          tangents, d_slice);
    __syncthreads();
    typename Key::type max_key = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const typename Key::type key = Key::of(d_slice[i]);
      max_key = key > max_key ? key : max_key;
    }
    max_key = block_reduce<kSliceThreads>(max_key, MaxOp{}, typename Key::type(0));
    const double m = static_cast<double>(Key::value(max_key));  // NaN when some d is NaN
    double sum = 0.0;
    if (m != 0.0) {  // the same for every thread of the block
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        sum = rn_add(sum, pow_q(rn_div(fabs(static_cast<double>(d_slice[i])), m), lp));
      }
    }
    sum = block_reduce<kSliceThreads>(sum, SumOp{}, 0.0);  // also: every read of d_slice is done
    if (threadIdx.x == 0) {
      slot_max[s] = m;
      slot_sum[s] = sum;
    }
  }
}

// A warp per ball: M = max of its slices' m (NaN if any is), ||x||_q^q = sum S (m / M)^q over its
// slices in slot order (a fixed tree), N = that to the 1/q. M = 0 (d = 0 on the whole ball) gives N = 0.
__global__ void __launch_bounds__(kBallThreads)
    lp_ball_kernel(const __grid_constant__ EntryTable table, GlobalBall global, LpExponent lp,
                   const double* __restrict__ skip, const double* __restrict__ slot_max,
                   const double* __restrict__ slot_sum, double* __restrict__ ball_max, double* __restrict__ ball_norm) {
  using Key = AbsKey<double>;
  if (skipped(skip)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    const BallInfo ball = ball_info(table, global, id);
    Key::type max_key = 0;
    for (int64_t c = ball.slot_begin + lane; c < ball.slot_end; c += 32) {
      const Key::type key = Key::of(slot_max[c]);
      max_key = key > max_key ? key : max_key;
    }
    max_key = warp_reduce(max_key, MaxOp{});
    max_key = __shfl_sync(0xffffffffu, max_key, 0);
    const double big_m = Key::value(max_key);
    double sum = 0.0;
    for (int64_t c = ball.slot_begin + lane; c < ball.slot_end; c += 32) {
      const double m = slot_max[c];
      if (m != 0.0) sum = rn_add(sum, rn_mul(slot_sum[c], pow_q(rn_div(m, big_m), lp)));
    }
    sum = warp_reduce(sum, SumOp{});
    if (lane == 0) {
      ball_max[id] = big_m;
      ball_norm[id] = lp.q_is_2 ? sqrt(sum) : pow(sum, lp.inv_q);
    }
  }
}

// (|x| / r)^p: the Lp norm feedback's terms (y * y for p = 2).
__device__ __forceinline__ double pow_p(double y, const LpExponent& lp) { return lp.q_is_2 ? rn_mul(y, y) : pow(y, lp.p); }

// Pass 2: the directions again, s_i = -r sign(d_i) (|d_i| / M / N)^(q-1) (0 when M = 0), the update and
// the slice's share of the gap; with scales, the slice's sums of (|theta| / r)^p of the values stored and of
// the exact step (slot_stored, slot_exact). One block fewer per SM than the other slice kernels: with four,
// the float Gaussian variant spilled around its pow calls (tests/test_kernel_resources.py).
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kSliceThreads, kMinSliceBlocks<scalar_t> - 1)
    lp_update_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule, Tangents tangents,
                     LpExponent lp, const double* __restrict__ skip, const double* __restrict__ ball_max,
                     const double* __restrict__ ball_norm, double* __restrict__ slot_gap,
                     double* __restrict__ slot_stored, double* __restrict__ slot_exact) {
  using acc_t = acc_type<scalar_t>;
  __shared__ acc_t d_slice[kSlice];
  if (skipped(skip)) return;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const Entry& entry = table.entry[slice.entry];
    slice_directions<scalar_t, kSource, kMomentum, true>(entry, slice.begin, slice.end, sc, tangents, d_slice);
    __syncthreads();
    scalar_t* const theta = static_cast<scalar_t*>(entry.theta);
    const double big_m = ball_max[slice.ball_id], norm = ball_norm[slice.ball_id];
    const double minus_r = -entry.radius;
    const double scale = slice_scale(table, slice);
    double gap = 0.0, stored_sum = 0.0, exact_sum = 0.0;
    for (int64_t j = slice.begin + threadIdx.x; j < slice.end; j += blockDim.x) {
      const acc_t d = d_slice[j - slice.begin];
      double vertex = 0.0;  // the reference's zero vertex when d = 0 on the whole ball
      if (big_m != 0.0) {
        const double y = rn_div(rn_div(fabs(static_cast<double>(d)), big_m), norm);
        const double power = lp.q_is_2 ? y : pow(y, lp.q_minus_1);
        vertex = rn_mul(rn_mul(minus_r, sign_of(static_cast<double>(d))), power);
      }
      acc_t stored;
      double exact;
      gap = rn_add(gap, update_element<false>(theta, j, d, vertex, sc, scale, acc_t(0), entry.radius, stored, exact));
      if (entry.scale) {
        stored_sum = rn_add(stored_sum, pow_p(rn_div(fabs(static_cast<double>(stored)), entry.radius), lp));
        exact_sum = rn_add(exact_sum, pow_p(rn_div(fabs(exact), entry.radius), lp));
      }
    }
    gap = block_reduce<kSliceThreads>(gap, SumOp{}, 0.0);  // also: every read of d_slice is done
    if (threadIdx.x == 0) slot_gap[s] = gap;
    if (entry.scale) {
      stored_sum = block_reduce<kSliceThreads>(stored_sum, SumOp{}, 0.0);
      exact_sum = block_reduce<kSliceThreads>(exact_sum, SumOp{}, 0.0);
      if (threadIdx.x == 0) {
        slot_stored[s] = stored_sum;
        slot_exact[s] = exact_sum;
      }
    }
  }
}

// ---- k-sparse -------------------------------------------------------------------------------------------

// Pass 1: the directions (and the momentum) into the direction workspace.
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kSliceThreads, kMinSliceBlocks<scalar_t>)
    ksparse_direction_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule,
                             Tangents tangents, const double* __restrict__ skip) {
  using acc_t = acc_type<scalar_t>;
  if (skipped(skip)) return;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const Entry& entry = table.entry[slice.entry];
    slice_directions<scalar_t, kSource, kMomentum, false>(entry, slice.begin, slice.end, sc, tangents,
                                                          static_cast<acc_t*>(entry.dir) + slice.begin);
  }
}

// A warp per ball: prefix 0, remaining = min(k, ball size), an empty histogram.
__global__ void __launch_bounds__(kBallThreads)
    ksparse_init_kernel(const __grid_constant__ EntryTable table, GlobalBall global, int64_t k,
                        const double* __restrict__ skip, unsigned long long* __restrict__ ball_prefix,
                        unsigned long long* __restrict__ ball_remaining, unsigned long long* __restrict__ ball_hist) {
  if (skipped(skip)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    const BallInfo ball = ball_info(table, global, id);
    if (lane == 0) {
      ball_prefix[id] = 0;
      ball_remaining[id] = static_cast<unsigned long long>(k < ball.numel ? k : ball.numel);  // >= 1
    }
    for (int bin = lane; bin < kBins; bin += 32) ball_hist[id * kBins + bin] = 0;
  }
}

// One digit pass: the histogram of digit (key >> shift) & 0xff over the keys whose bits above the digit
// (high_mask) equal the ball's prefix. Per slice in shared memory, then added to the ball's.
template <typename acc_t>
__global__ void __launch_bounds__(kSliceThreads)
    ksparse_hist_kernel(const __grid_constant__ EntryTable table, int shift, unsigned long long high_mask,
                        const double* __restrict__ skip, const unsigned long long* __restrict__ ball_prefix,
                        unsigned long long* __restrict__ ball_hist) {
  using Key = AbsKey<acc_t>;
  __shared__ unsigned int hist[kBins];  // a slice has at most kSlice elements: no overflow
  if (skipped(skip)) return;
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const acc_t* const dir = static_cast<const acc_t*>(table.entry[slice.entry].dir);
    for (int bin = threadIdx.x; bin < kBins; bin += blockDim.x) hist[bin] = 0u;
    __syncthreads();
    const unsigned long long prefix = ball_prefix[slice.ball_id] & high_mask;
    for (int64_t j = slice.begin + threadIdx.x; j < slice.end; j += blockDim.x) {
      const unsigned long long key = Key::of(dir[j]);
      if ((key & high_mask) == prefix) atomicAdd(&hist[(key >> shift) & (kBins - 1)], 1u);
    }
    __syncthreads();
    unsigned long long* const ball = ball_hist + slice.ball_id * kBins;
    for (int bin = threadIdx.x; bin < kBins; bin += blockDim.x) {
      if (hist[bin] != 0u) atomicAdd(ball + bin, static_cast<unsigned long long>(hist[bin]));
    }
    __syncthreads();  // hist is zeroed for the next slice
  }
}

// One digit pass, a warp per ball: walking the bins from the largest digit down, the bin where the count
// of keys reaches `remaining` holds the k-th largest key; its digit joins the prefix, and remaining
// drops by the count of larger keys. Then the histogram is zeroed for the next pass. Lane l owns bins
// 8 l .. 8 l + 7. Invariant: at least `remaining` keys match the prefix, so exactly one lane finds it.
__global__ void __launch_bounds__(kBallThreads)
    ksparse_select_kernel(const __grid_constant__ EntryTable table, GlobalBall global, int shift,
                          const double* __restrict__ skip, unsigned long long* __restrict__ ball_prefix,
                          unsigned long long* __restrict__ ball_remaining, unsigned long long* __restrict__ ball_hist) {
  constexpr int kPerLane = kBins / 32;
  if (skipped(skip)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    unsigned long long* const hist = ball_hist + id * kBins + lane * kPerLane;
    unsigned long long count[kPerLane];
    unsigned long long lane_total = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      count[i] = hist[i];
      lane_total += count[i];
    }
    // at_or_above = the keys in this lane's bins and every higher lane's (an inclusive suffix sum).
    unsigned long long at_or_above = lane_total;
#pragma unroll
    for (int delta = 1; delta < 32; delta *= 2) {
      const unsigned long long higher = __shfl_down_sync(0xffffffffu, at_or_above, delta);
      if (lane + delta < 32) at_or_above += higher;
    }
    const unsigned long long above = at_or_above - lane_total;  // keys in higher lanes' bins
    const unsigned long long remaining = ball_remaining[id];
    __syncwarp();  // every lane has read remaining before one of them writes it
    if (above < remaining && remaining <= at_or_above) {
      unsigned long long larger = above;
      for (int i = kPerLane - 1; i >= 0; --i) {
        if (larger + count[i] >= remaining) {
          ball_prefix[id] |= static_cast<unsigned long long>(lane * kPerLane + i) << shift;
          ball_remaining[id] = remaining - larger;
          break;
        }
        larger += count[i];
      }
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) hist[i] = 0;
  }
}

// slot_count[s] = the number of the slice's keys equal to its ball's T (the prefix after every pass).
template <typename acc_t>
__global__ void __launch_bounds__(kSliceThreads)
    ksparse_count_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ skip,
                         const unsigned long long* __restrict__ ball_prefix,
                         unsigned long long* __restrict__ slot_count) {
  using Key = AbsKey<acc_t>;
  if (skipped(skip)) return;
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const acc_t* const dir = static_cast<const acc_t*>(table.entry[slice.entry].dir);
    const unsigned long long threshold = ball_prefix[slice.ball_id];
    unsigned long long count = 0;
    for (int64_t j = slice.begin + threadIdx.x; j < slice.end; j += blockDim.x) {
      count += static_cast<unsigned long long>(Key::of(dir[j])) == threshold ? 1ull : 0ull;
    }
    count = block_reduce<kSliceThreads>(count, SumOp{}, 0ull);
    if (threadIdx.x == 0) slot_count[s] = count;
  }
}

// A warp per ball: slot_before[c] = the ball's keys equal to T in its slices before slice c (an exclusive
// prefix sum over the ball's slots, in slot order).
__global__ void __launch_bounds__(kBallThreads)
    ksparse_scan_kernel(const __grid_constant__ EntryTable table, GlobalBall global, const double* __restrict__ skip,
                        const unsigned long long* __restrict__ slot_count, unsigned long long* __restrict__ slot_before) {
  if (skipped(skip)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    const BallInfo ball = ball_info(table, global, id);
    unsigned long long carry = 0;  // the counts of the slots before this round's 32
    for (int64_t first = ball.slot_begin; first < ball.slot_end; first += 32) {
      const int64_t c = first + lane;
      const unsigned long long count = c < ball.slot_end ? slot_count[c] : 0ull;
      unsigned long long inclusive = count;
#pragma unroll
      for (int delta = 1; delta < 32; delta *= 2) {
        const unsigned long long lower = __shfl_up_sync(0xffffffffu, inclusive, delta);
        if (lane >= delta) inclusive += lower;
      }
      if (c < ball.slot_end) slot_before[c] = carry + inclusive - count;
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
  }
}

// The update: an element is chosen when its key > T, or key == T and fewer than `need` keys equal to T
// come before it in the ball (lower indices: earlier slices, then earlier in this slice, ranked by a block
// scan over tiles of kSliceThreads elements in index order). s = -r sign(d) there, 0 elsewhere. With scales,
// the slice's norm sums (units of the grid of k r) of the values stored and of the exact step.
template <typename scalar_t>
__global__ void __launch_bounds__(kSliceThreads)
    ksparse_update_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule, int64_t k,
                          const double* __restrict__ skip, const unsigned long long* __restrict__ ball_prefix,
                          const unsigned long long* __restrict__ ball_remaining,
                          const unsigned long long* __restrict__ slot_before, double* __restrict__ slot_gap,
                          unsigned long long* __restrict__ slot_stored_units,
                          unsigned long long* __restrict__ slot_exact_units) {
  using acc_t = acc_type<scalar_t>;
  using Key = AbsKey<acc_t>;
  // A skipped step runs no slice: with a return here instead, ptxas spilled the double variant.
  const int64_t slice_end = skipped(skip) ? table.slice_begin : table.slice_end;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const Entry& entry = table.entry[slice.entry];
    const acc_t* const dir = static_cast<const acc_t*>(entry.dir);
    scalar_t* const theta = static_cast<scalar_t*>(entry.theta);
    const unsigned long long threshold = ball_prefix[slice.ball_id];
    const unsigned long long need = ball_remaining[slice.ball_id];
    const double minus_r = -entry.radius;
    const acc_t bound = radius_down<acc_t>(entry.radius);
    const double scale = slice_scale(table, slice);
    const double factor = units_factor(rn_mul(static_cast<double>(k), entry.radius));  // the grid of k r
    unsigned long long equal_before = slot_before[s];  // keys == T before this tile, in the ball
    double gap = 0.0;
    unsigned long long stored_units = 0, exact_units = 0;  // a thread adds at most 16 terms of at most 2^51
    // Every thread runs the same number of tiles: the scan needs the whole block.
    for (int64_t tile = slice.begin; tile < slice.end; tile += kSliceThreads) {
      const int64_t j = tile + threadIdx.x;
      const bool valid = j < slice.end;
      const acc_t d = valid ? dir[j] : acc_t(0);
      const unsigned long long key = Key::of(d);
      const bool equal = valid && key == threshold;
      unsigned int rank_in_tile, equal_in_tile;
      block_exclusive_scan<kSliceThreads>(equal ? 1u : 0u, rank_in_tile, equal_in_tile);
      if (valid) {
        const bool chosen = key > threshold || (equal && equal_before + rank_in_tile < need);
        const double vertex = chosen ? rn_mul(minus_r, sign_of(static_cast<double>(d))) : 0.0;
        acc_t stored;
        double exact;
        gap = rn_add(gap, update_element<true>(theta, j, d, vertex, sc, scale, bound, entry.radius, stored, exact));
        stored_units += norm_units(rn_mul(fabs(static_cast<double>(stored)), factor));
        exact_units += norm_units(rn_mul(fabs(exact), factor));
      }
      equal_before += equal_in_tile;
    }
    gap = block_reduce<kSliceThreads>(gap, SumOp{}, 0.0);
    if (threadIdx.x == 0) slot_gap[s] = gap;
    if (entry.scale) {
      stored_units = block_reduce<kSliceThreads>(stored_units, SaturatingSumOp{}, 0ull);
      exact_units = block_reduce<kSliceThreads>(exact_units, SaturatingSumOp{}, 0ull);
      if (threadIdx.x == 0) {
        slot_stored_units[s] = stored_units;
        slot_exact_units[s] = exact_units;
      }
    }
  }
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

enum class SetKind { kLInf, kLp, kKSparse };

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

template <typename scalar_t, Source kSource, bool kMomentum>
void launch_set_step(SetKind set, at::TensorList params, at::TensorList momentum, at::TensorList grads,
                     const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                     bool global_ball, c10::IntArrayRef offsets, int64_t seed, const at::Tensor& gap,
                     c10::IntArrayRef row_numel, double p, int64_t k, at::TensorList scales) {
  using acc_t = acc_type<scalar_t>;
  const int device = params[0].get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();

  // the L-infinity step has no norm feedback: its clamp keeps it in the ball
  Plan plan = plan_step(params, momentum, grads, radii, global_ball, offsets, row_numel,
                        set == SetKind::kLInf ? at::TensorList() : scales);
  const bool feedback = set != SetKind::kLInf && !scales.empty();
  if (plan.num_slices == 0) {  // every tensor is empty
    write_empty_gap(gap, schedule);
    return;
  }

  // The workspace: one block from the caching allocator (stream-ordered on the current stream, so it
  // is safe to reuse after the step's kernels and fine inside a CUDA graph capture).
  WorkspaceLayout layout;
  const size_t slot_gap_at = layout.take(sizeof(double) * plan.num_slices);
  size_t slot_max_at = 0, slot_sum_at = 0, ball_max_at = 0, ball_norm_at = 0;
  size_t dir_at = 0, slot_count_at = 0, slot_before_at = 0, ball_prefix_at = 0, ball_remaining_at = 0, ball_hist_at = 0;
  // the norm feedback's per-slice sums (float64 for Lp, units for k-sparse: 8 bytes either way)
  const size_t slot_stored_at = feedback ? layout.take(8 * plan.num_slices) : 0;
  const size_t slot_exact_at = feedback ? layout.take(8 * plan.num_slices) : 0;
  if (set == SetKind::kLp) {
    slot_max_at = layout.take(sizeof(double) * plan.num_slices);
    slot_sum_at = layout.take(sizeof(double) * plan.num_slices);
    ball_max_at = layout.take(sizeof(double) * plan.num_balls);
    ball_norm_at = layout.take(sizeof(double) * plan.num_balls);
  } else if (set == SetKind::kKSparse) {
    dir_at = layout.take(sizeof(acc_t) * plan.numel);
    slot_count_at = layout.take(sizeof(unsigned long long) * plan.num_slices);
    slot_before_at = layout.take(sizeof(unsigned long long) * plan.num_slices);
    ball_prefix_at = layout.take(sizeof(unsigned long long) * plan.num_balls);
    ball_remaining_at = layout.take(sizeof(unsigned long long) * plan.num_balls);
    ball_hist_at = layout.take(sizeof(unsigned long long) * kBins * plan.num_balls);
  }
  const at::Tensor workspace = at::empty({static_cast<int64_t>(layout.bytes())},
                                         at::TensorOptions().dtype(at::kByte).device(params[0].device()));
  char* const base = static_cast<char*>(workspace.data_ptr());
  auto at_offset = [base](size_t offset, auto* type_tag) { return reinterpret_cast<decltype(type_tag)>(base + offset); };
  double* const slot_gap = at_offset(slot_gap_at, static_cast<double*>(nullptr));
  double* const slot_stored = feedback ? at_offset(slot_stored_at, static_cast<double*>(nullptr)) : nullptr;
  double* const slot_exact = feedback ? at_offset(slot_exact_at, static_cast<double*>(nullptr)) : nullptr;
  auto* const slot_stored_units =
      feedback ? at_offset(slot_stored_at, static_cast<unsigned long long*>(nullptr)) : nullptr;
  auto* const slot_exact_units = feedback ? at_offset(slot_exact_at, static_cast<unsigned long long*>(nullptr)) : nullptr;

  if (set == SetKind::kKSparse) {
    acc_t* const dir = at_offset(dir_at, static_cast<acc_t*>(nullptr));
    for (size_t e = 0; e < plan.entries.size(); ++e) {
      plan.entries[e].dir = dir + plan.tensor_first[plan.entry_tensor[e]];
    }
  }

  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const Launcher launcher{int64_t{sms} * 8, int64_t{sms} * 16};

  const double* const schedule_ptr = schedule.data_ptr<double>();
  // read by every kernel on the device (a skipped step writes nothing but its NaN gap)
  const double* const skip = schedule.numel() == 4 ? schedule_ptr + 3 : nullptr;
  const Tangents tangents{kSource == Source::kGrad ? nullptr : tangent_coeffs.data_ptr<double>(),
                          kSource == Source::kGrad ? 0 : static_cast<int>(tangent_coeffs.numel()), seed};

  if (set == SetKind::kLInf) {
    for_each_table(plan, [&](const EntryTable& table) {
      linf_kernel<scalar_t, kSource, kMomentum>
          <<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, schedule_ptr, tangents, skip, slot_gap);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else if (set == SetKind::kLp) {
    const double q = p / (p - 1);  // as reference.lp_vertex computes it: 2.0 exactly for p = 2
    const LpExponent lp{q, q - 1, 1.0 / q, p, q == 2.0};
    double* const slot_max = at_offset(slot_max_at, static_cast<double*>(nullptr));
    double* const slot_sum = at_offset(slot_sum_at, static_cast<double*>(nullptr));
    double* const ball_max = at_offset(ball_max_at, static_cast<double*>(nullptr));
    double* const ball_norm = at_offset(ball_norm_at, static_cast<double*>(nullptr));
    for_each_table(plan, [&](const EntryTable& table) {
      lp_reduce_kernel<scalar_t, kSource, kMomentum>
          <<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, schedule_ptr, tangents, lp, skip,
                                                                     slot_max, slot_sum);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
      lp_ball_kernel<<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(table, global, lp, skip, slot_max,
                                                                            slot_sum, ball_max, ball_norm);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    for_each_table(plan, [&](const EntryTable& table) {
      lp_update_kernel<scalar_t, kSource, kMomentum>
          <<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, schedule_ptr, tangents, lp, skip,
                                                                     ball_max, ball_norm, slot_gap, slot_stored,
                                                                     slot_exact);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else {
    using Key = AbsKey<acc_t>;
    auto* const slot_count = at_offset(slot_count_at, static_cast<unsigned long long*>(nullptr));
    auto* const slot_before = at_offset(slot_before_at, static_cast<unsigned long long*>(nullptr));
    auto* const ball_prefix = at_offset(ball_prefix_at, static_cast<unsigned long long*>(nullptr));
    auto* const ball_remaining = at_offset(ball_remaining_at, static_cast<unsigned long long*>(nullptr));
    auto* const ball_hist = at_offset(ball_hist_at, static_cast<unsigned long long*>(nullptr));
    for_each_table(plan, [&](const EntryTable& table) {
      ksparse_direction_kernel<scalar_t, kSource, kMomentum>
          <<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, schedule_ptr, tangents, skip);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
      ksparse_init_kernel<<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(table, global, k, skip,
                                                                                 ball_prefix, ball_remaining,
                                                                                 ball_hist);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    // Most significant digit first. high_mask keeps the key bits above the digit (none in the first pass).
    constexpr int kPasses = Key::kBits / kDigitBits;
    for (int pass = 0; pass < kPasses; ++pass) {
      const int shift = kDigitBits * (kPasses - 1 - pass);
      const unsigned long long high_mask = pass == 0 ? 0ull : ~((1ull << (shift + kDigitBits)) - 1ull);
      for_each_table(plan, [&](const EntryTable& table) {
        ksparse_hist_kernel<acc_t><<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, shift, high_mask,
                                                                                            skip, ball_prefix,
                                                                                            ball_hist);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
        ksparse_select_kernel<<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(table, global, shift, skip,
                                                                                     ball_prefix, ball_remaining,
                                                                                     ball_hist);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    for_each_table(plan, [&](const EntryTable& table) {
      ksparse_count_kernel<acc_t><<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, skip, ball_prefix,
                                                                                           slot_count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
      ksparse_scan_kernel<<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(table, global, skip, slot_count,
                                                                                 slot_before);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    for_each_table(plan, [&](const EntryTable& table) {
      ksparse_update_kernel<scalar_t><<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(
          table, schedule_ptr, k, skip, ball_prefix, ball_remaining, slot_before, slot_gap, slot_stored_units,
          slot_exact_units);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  if (feedback) {
    // each ball's next scale, from its slices' sums: after the update kernels, on the same stream
    const double unit_roundoff = std::is_same_v<acc_t, double> ? 0x1p-53 : 0x1p-24;
    for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
      if (set == SetKind::kKSparse) {
        feedback_kernel<true><<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(
            table, global, p, k, unit_roundoff, skip, slot_stored, slot_exact, slot_stored_units, slot_exact_units);
      } else {
        feedback_kernel<false><<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(
            table, global, p, k, unit_roundoff, skip, slot_stored, slot_exact, slot_stored_units, slot_exact_units);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  gap_sum_kernel<<<1, kSumThreads, 0, stream>>>(slot_gap, plan.num_slices, skip, gap.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void set_step_cuda(SetKind set, at::TensorList params, at::TensorList momentum, at::TensorList grads,
                   const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                   bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                   c10::IntArrayRef row_numel, double p, int64_t k, at::TensorList scales) {
  const char* const op = set == SetKind::kLInf ? "linf_fw_step_"
                         : set == SetKind::kLp ? "lp_fw_step_"
                                               : "ksparse_fw_step_";
  check_fw_step_args(op, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, distribution,
                     gap, row_numel);
  check_scales(op, params, scales, global_ball, row_numel);
  if (set == SetKind::kLp) check_lp_exponent(p);
  if (set == SetKind::kKSparse) check_ksparse_k(k);
  const c10::cuda::CUDAGuard device_guard(params.empty() ? schedule.device() : params[0].device());
  if (params.empty()) {
    write_empty_gap(gap, schedule);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "set_fw_step_cuda", [&] {
    auto run = [&](auto source, auto with_momentum) {
      launch_set_step<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
          set, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, gap, row_numel, p,
          k, scales);
    };
    dispatch_step_variant(!grads.empty(), distribution, !momentum.empty(), run);
  });
}

void linf_fw_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                       const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                       c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                       c10::IntArrayRef row_numel) {
  set_step_cuda(SetKind::kLInf, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                distribution, gap, row_numel, 0.0, 0, {});
}

void lp_fw_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                     const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                     c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                     c10::IntArrayRef row_numel, double p, at::TensorList scales) {
  set_step_cuda(SetKind::kLp, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                distribution, gap, row_numel, p, 0, scales);
}

void ksparse_fw_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                          const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                          bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                          const at::Tensor& gap, c10::IntArrayRef row_numel, int64_t k, at::TensorList scales) {
  set_step_cuda(SetKind::kKSparse, params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
                distribution, gap, row_numel, 0.0, k, scales);
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("linf_fw_step_", &linf_fw_step_cuda);
  m.impl("lp_fw_step_", &lp_fw_step_cuda);
  m.impl("ksparse_fw_step_", &ksparse_fw_step_cuda);
}

}  // namespace fgfw
