// l1_fw_step_ on CUDA: one fused Frank-Wolfe step over L1 ball(s) for a group of tensors, in a few
// kernels and no host synchronisation (docs/fused_step.md, "CUDA kernels").
//
// A ball is a whole tensor, one row of row_numel elements of a tensor (scope "row"), or every
// tensor at once (the global ball). Balls of at most kMaxWarpBall elements take the rows path,
// longer ones (and the global ball) the chunks path:
// 1. fw_chunks_kernel walks every long ball in chunks (multi_tensor.cuh; a long row is a table row of
//    its own, so no chunk spans two balls). Per group of four elements it regenerates the tangents
//    in registers (one Philox call per tangent) or reads the gradient, updates the momentum,
//    accumulates <d, theta_old> and the norm sums of theta and of theta scaled by keep = RN(1 - alpha)
//    (step_factors; fixed-point units, feasibility.h), and stores the scaled theta. Each chunk's
//    block reduces (|d|, index), the dot product and the norm sums into the chunk's slot. Block 0 also
//    publishes the per-ball table the finalize needs (first slot, address, radius, elements).
// 2. fw_rows_kernel gives each short ball to one warp (blocks of one warp, a grid-stride loop over
//    balls): the same per-element update, then a warp reduction, the vertex move and the ball's
//    share of the gap, with no slot and no finalize. Per launch, a table of up to kMaxRowEntries
//    tensors (each tensor's rows, or the tensor as one row) is a __grid_constant__ argument; radii
//    that differ from row to row live on the device, uploaded once and reused (DeviceRadii).
// 3. fw_finalize_kernel, one block per long ball (or one for the global ball), reduces its slots,
//    sets the winning element (l1_vertex_value: the exact step, taking back what the scaling's roundings
//    moved the norm, within the room that keeps the ball's stored norm at most r) and writes its share
//    of the gap; its last block sums
//    every ball's share (both paths') into `gap` in a fixed order. Without long balls,
//    fw_sum_shares_kernel (one block) does that sum instead. So the step of a model whose balls are
//    all short (rows of matrices, biases, small tensors) is two kernel launches.
// Ties: slots are numbered in (tensor, element) order and every reduction prefers the lower index
// among equal |d|, so the lowest index wins, across tensors too; NaN counts as the largest |d|, as
// torch.argmax counts it. The schedule and coefficients are read by pointer on the device and the
// workspace comes from the caching allocator, so a step can be captured in a CUDA graph (after one
// eager step where rows have radii of their own, so that those are on the device already).
// A skipped step (schedule[3] != 0, direction.cuh: skipped) makes the same launches and every kernel returns at its
// top, the last one (the finalize, or fw_sum_shares_kernel) after writing the NaN gap.
// Arithmetic follows python/fgfw/reference.py operation by operation: every product and sum is an
// explicitly rounded intrinsic, so nvcc cannot contract them into FMAs that round differently.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "cuda/direction.cuh"
#include "cuda/multi_tensor.cuh"
#include "feasibility.h"
#include "op_args.h"
#include "philox.h"
#include "step_variant.h"

namespace fgfw {
namespace {

using cuda::kChunkGroups;
using cuda::Quad;
using cuda::TensorTable;

constexpr int kThreads = 256;
constexpr int kFinalizeThreads = 512;
// The rows kernel's blocks are one warp each: a warp's ball index is then the block's, which
// ptxas keeps with everything derived from it (the ball's geometry, its table entry) in uniform
// registers. With ball indices that differ between the warps of a block, those move to ordinary
// registers and the Gaussian AFGFW kernel spills at 64 of them.
constexpr int kRowThreads = 32;
// The one-block kernel that sums the balls' shares of the gap when there is no finalize.
constexpr int kSumThreads = 1024;
// Balls of at most this many elements take the rows path, one warp each. A warp moves 256 float
// elements per memory round trip, so a ball of 4 Ki elements costs it 16 round trips: with many
// balls the kernel is bandwidth-bound whatever their length, and with a few the longest one (the
// critical path, some 10-20 us) costs about what a chunk launch and a finalize launch would. Longer
// balls are split over chunks (blocks) and finalized by a second kernel.
constexpr int64_t kMaxWarpBall = 4096;
// Tensors per launch of the rows kernel: 256 entries keep its table argument under 16 KiB.
constexpr int kMaxRowEntries = 256;

// The table's lists.
constexpr int kParamList = 0, kMomentumList = 1, kGradList = 2, kLists = 3;

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Groups a thread loads before it computes: 2 x 32 bytes of params and momentum in flight per
// thread for float AFGFW; one double group already holds 64 bytes.
template <typename scalar_t>
constexpr int kUnroll = std::is_same_v<scalar_t, double> ? 1 : 2;
// Chunk blocks per SM that __launch_bounds__ asks ptxas to make room for: 4 x kThreads caps a
// thread at 64 registers, which every float-accumulating variant fits without spilling; the double
// Gaussian step with momentum spills there and fits 3 (80 registers).
// tests/test_kernel_resources.py holds the kernels to this.
template <typename scalar_t>
constexpr int kMinChunkBlocks = std::is_same_v<scalar_t, double> ? 3 : 4;
// Blocks of kRowThreads per SM that __launch_bounds__ asks for: as many warps as kMinChunkBlocks
// chunk blocks (64 registers a thread for float accumulation, 80 for double).
template <typename scalar_t>
constexpr int kMinRowBlocks = kMinChunkBlocks<scalar_t> * kThreads / kRowThreads;

__device__ __forceinline__ float abs_of(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_of(double x) { return fabs(x); }

// torch.sign: 0 for 0 and for NaN.
template <typename T>
__device__ __forceinline__ T sign_of(T x) {
  return static_cast<T>((x > T(0)) - (x < T(0)));
}

// What a chunk leaves for the finalize: the signed d at its largest |d| and that element's flat
// index in its tensor, the chunk's <d, theta_old>, the tensor's position in the group, and the chunk's
// norm sums of theta before the step and of the scaled values (units of its ball's grid, feasibility.h).
struct alignas(16) Slot {
  double d;
  int64_t index;
  double dot;
  uint64_t old_units, new_units;
  int32_t tensor;
};

// Device memory of one step (one caching-allocator block). The chunks kernel writes the slots and
// the per-ball table of the chunks path, whose balls are the rows of its TensorTables (a tensor, or
// a long row of one): ball_first_slot has num_chunk_balls + 1 entries, ball b owns slots
// [ball_first_slot[b], ball_first_slot[b + 1]). ball_gap holds every ball's share of the gap:
// [0, num_chunk_balls) for the chunks path (written by the finalize), then the rows path's balls in
// order (written by the rows kernel); num_shares in all.
struct Workspace {
  Slot* slots;
  int64_t* ball_first_slot;
  void** ball_param;
  double* ball_radius;
  int64_t* ball_numel;
  double* ball_gap;
  unsigned int* finished_blocks;
  int num_chunk_balls;
  int64_t num_shares;
};

// The rows kernel's per-launch table: entry e is a tensor whose balls are its rows of row_numel[e]
// elements (a whole tensor is one row), balls [first_ball[e], first_ball[e + 1]) of the launch.
template <int kLists>
struct RowTable {
  void* data[kLists][kMaxRowEntries];
  int64_t first_ball[kMaxRowEntries];
  int64_t first_group[kMaxRowEntries];   // the tensor's stream offset / 4
  int64_t first_radius[kMaxRowEntries];  // the entry's row 0 in the device radii, or -1: every row has radius[e]
  double radius[kMaxRowEntries];
  int32_t row_numel[kMaxRowEntries];     // 1 .. kMaxWarpBall
  int8_t lead[kMaxRowEntries];           // the tensor's stream offset % 4
  bool vectorised[kMaxRowEntries];       // every list's group starts are Quad-aligned
  int num_entries;
  int64_t num_balls;    // in this launch
  int64_t first_share;  // index in Workspace::ball_gap of the launch's ball 0
};

// A candidate vertex and a partial gap: d at the best |d| seen (abs_d = |d|), the ordering key of
// that element (lower wins ties; -1 = no element seen), and the running sum <d, theta_old>.
template <typename acc_t>
struct Candidate {
  acc_t abs_d;
  acc_t d;
  int64_t key;
  double dot;
};

template <typename acc_t>
__device__ __forceinline__ Candidate<acc_t> no_candidate() {
  return {acc_t(-1), acc_t(0), -1, 0.0};
}

// into <- the better of (into, from) by |d| (NaN largest, then the lower key), dots summed.
template <typename acc_t>
__device__ __forceinline__ void merge(Candidate<acc_t>& into, const Candidate<acc_t>& from) {
  into.dot = rn_add(into.dot, from.dot);
  if (from.key < 0) return;
  const bool from_nan = isnan(from.abs_d), into_nan = isnan(into.abs_d);
  bool take;
  if (into.key < 0) {
    take = true;
  } else if (from_nan != into_nan) {
    take = from_nan;
  } else if (from_nan || from.abs_d == into.abs_d) {
    take = from.key < into.key;
  } else {
    take = from.abs_d > into.abs_d;
  }
  if (take) {
    into.abs_d = from.abs_d;
    into.d = from.d;
    into.key = from.key;
  }
}

// A thread's running norm sums (of theta before the step, and of the scaled values) and its ball's units_factor
// (its grid, feasibility.h) live in shared memory, three words per thread of a __shared__ array: the element
// loops have no registers to spare for two more 64-bit sums and a double (tests/test_kernel_resources.py), and
// `volatile` keeps ptxas from holding them in registers after all. A thread adds at most 128 terms of at most
// 2^51 per ball or chunk: no overflow before the saturating merge of the threads' sums.
constexpr int kNormWords = 3;

template <int kWords>
__device__ __forceinline__ void start_norm_sums(unsigned long long (&words)[kWords], double radius) {
  volatile unsigned long long* const mine = words + kNormWords * threadIdx.x;
  mine[0] = 0;
  mine[1] = 0;
  mine[2] = static_cast<unsigned long long>(__double_as_longlong(units_factor(radius)));
}

template <int kWords, typename acc_t>
__device__ __forceinline__ void add_norm_sums(unsigned long long (&words)[kWords], acc_t theta_old, acc_t theta_new) {
  volatile unsigned long long* const mine = words + kNormWords * threadIdx.x;
  const double factor = __longlong_as_double(static_cast<long long>(mine[2]));
  mine[0] += norm_units(rn_mul(fabs(static_cast<double>(theta_old)), factor));
  mine[1] += norm_units(rn_mul(fabs(static_cast<double>(theta_new)), factor));
}

template <typename acc_t>
__device__ __forceinline__ Candidate<acc_t> shuffle_down(const Candidate<acc_t>& c, int delta) {
  return {__shfl_down_sync(0xffffffffu, c.abs_d, delta), __shfl_down_sync(0xffffffffu, c.d, delta),
          __shfl_down_sync(0xffffffffu, c.key, delta), __shfl_down_sync(0xffffffffu, c.dot, delta)};
}

// A ball's (or chunk's) norm sums: of theta before the step and of the scaled values, in units of its grid
// (feasibility.h), added stopping at their cap (order-free).
struct NormSums {
  unsigned long long old_units, new_units;
};

__device__ __forceinline__ void merge(NormSums& into, const NormSums& from) {
  into.old_units = saturating_add(into.old_units, from.old_units);
  into.new_units = saturating_add(into.new_units, from.new_units);
}

__device__ __forceinline__ NormSums shuffle_down(const NormSums& sums, int delta) {
  return {__shfl_down_sync(0xffffffffu, sums.old_units, delta), __shfl_down_sync(0xffffffffu, sums.new_units, delta)};
}

template <int kWords>
__device__ __forceinline__ NormSums take_norm_sums(unsigned long long (&words)[kWords]) {
  const volatile unsigned long long* const mine = words + kNormWords * threadIdx.x;
  return {mine[0], mine[1]};
}

// The merge of every thread's candidate (or norm sums), in thread 0. A fixed tree: the same inputs give
// the same sum, run after run. Every thread of the block must call it. none: what merges as nothing.
template <int kBlock, typename T>
__device__ T block_reduce(T c, T none) {
  constexpr int kWarps = kBlock / 32;
  __shared__ T warp_result[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) merge(c, shuffle_down(c, delta));
  if (lane == 0) warp_result[warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = lane < kWarps ? warp_result[lane] : none;
#pragma unroll
    for (int delta = 16; delta > 0; delta /= 2) merge(c, shuffle_down(c, delta));
  }
  __syncthreads();  // warp_result is reused by the next call
  return c;
}

// Four elements of a group, j0 .. j0 + 3; lanes outside [0, numel) are neither read nor written.
template <typename T>
__device__ __forceinline__ Quad<T> load_group(const T* base, int64_t j0, int64_t numel, bool whole_quad) {
  if (whole_quad) return *reinterpret_cast<const Quad<T>*>(base + j0);
  Quad<T> q{};
#pragma unroll
  for (int lane = 0; lane < 4; ++lane) {
    if (j0 + lane >= 0 && j0 + lane < numel) q.x[lane] = base[j0 + lane];
  }
  return q;
}

template <typename T>
__device__ __forceinline__ void store_group(T* base, int64_t j0, int64_t numel, bool whole_quad, const Quad<T>& q) {
  if (whole_quad) {
    *reinterpret_cast<Quad<T>*>(base + j0) = q;
    return;
  }
#pragma unroll
  for (int lane = 0; lane < 4; ++lane) {
    if (j0 + lane >= 0 && j0 + lane < numel) base[j0 + lane] = q.x[lane];
  }
}

// The same for the rows kernel: `group` points at a group's element 0, whose index in its row is
// j0; lanes outside the row [0, numel) are neither read nor written.
template <typename T>
__device__ __forceinline__ Quad<T> load_row_group(const T* group, int j0, int numel, bool whole_quad) {
  if (whole_quad) return *reinterpret_cast<const Quad<T>*>(group);
  Quad<T> q{};
#pragma unroll
  for (int lane = 0; lane < 4; ++lane) {
    if (j0 + lane >= 0 && j0 + lane < numel) q.x[lane] = group[lane];
  }
  return q;
}

template <typename T>
__device__ __forceinline__ void store_row_group(T* group, int j0, int numel, bool whole_quad, const Quad<T>& q) {
  if (whole_quad) {
    *reinterpret_cast<Quad<T>*>(group) = q;
    return;
  }
#pragma unroll
  for (int lane = 0; lane < 4; ++lane) {
    if (j0 + lane >= 0 && j0 + lane < numel) group[lane] = q.x[lane];
  }
}

// Block 0's extra duty: the per-ball facts the finalize needs, for this launch's rows.
__device__ void publish_balls(const TensorTable<kLists>& table, const Workspace& ws) {
  for (int r = threadIdx.x; r < table.num_rows; r += blockDim.x) {
    const int t = table.first_row + r;
    ws.ball_first_slot[t] = table.chunk_base + table.first_chunk[r];
    ws.ball_param[t] = table.data[kParamList][r];
    ws.ball_radius[t] = table.scalar[r];
    ws.ball_numel[t] = table.numel[r];
  }
  if (threadIdx.x == 0) {
    if (table.first_row + table.num_rows == ws.num_chunk_balls) {
      ws.ball_first_slot[ws.num_chunk_balls] = table.chunk_base + table.num_chunks;
    }
    *ws.finished_blocks = 0;
  }
}

template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kThreads, kMinChunkBlocks<scalar_t>)
    fw_chunks_kernel(const __grid_constant__ TensorTable<kLists> table, const double* __restrict__ schedule,
                     const double* __restrict__ coeffs, int num_tangents, int64_t seed,
                     const double* __restrict__ skip, Workspace ws) {
  using acc_t = acc_type<scalar_t>;
  if (skipped(skip)) return;  // the finalize skips too: it needs neither the slots nor the ball table
  if (blockIdx.x == 0) publish_balls(table, ws);
  const int64_t step = static_cast<int64_t>(schedule[0]);
  const acc_t gamma = static_cast<acc_t>(schedule[2]);
  const acc_t keep_theta = step_factors<acc_t>(schedule[1]).keep;
  const acc_t keep_v = acc_t(1) - gamma;

  for (int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    const int r = cuda::row_of_chunk(table, c);
    scalar_t* const theta = static_cast<scalar_t*>(table.data[kParamList][r]);
    acc_t* const v = static_cast<acc_t*>(table.data[kMomentumList][r]);
    const scalar_t* const grad = static_cast<const scalar_t*>(table.data[kGradList][r]);
    const int64_t numel = table.numel[r];
    const int lead = table.lead[r];
    const bool vectorised = table.vectorised[r];
    const int64_t group_begin = (c - table.first_chunk[r]) * kChunkGroups;
    const int64_t groups_left = cuda::num_groups(numel, lead) - group_begin;
    // Groups counted from the chunk's first, in 32 bits: 64-bit loop indices cost the AFGFW kernels
    // registers that __launch_bounds__ leaves them no room for.
    const int chunk_groups = static_cast<int>(groups_left < kChunkGroups ? groups_left : kChunkGroups);
    const int64_t chunk_j0 = 4 * group_begin - lead;
    const int64_t chunk_q = table.first_group[r] + group_begin;
    __shared__ unsigned long long norm_words[kNormWords * kThreads];
    start_norm_sums(norm_words, table.scalar[r]);

    Candidate<acc_t> best = no_candidate<acc_t>();
    for (int l0 = threadIdx.x; l0 < chunk_groups; l0 += kUnroll<scalar_t> * kThreads) {
      // All loads first, then the Philox work, so the memory latency hides behind the arithmetic.
      Quad<scalar_t> theta_q[kUnroll<scalar_t>], grad_q[kUnroll<scalar_t>];
      Quad<acc_t> v_q[kUnroll<scalar_t>];
#pragma unroll
      for (int u = 0; u < kUnroll<scalar_t>; ++u) {
        const int l = l0 + u * kThreads;
        if (l >= chunk_groups) break;
        const int64_t j0 = chunk_j0 + 4 * l;
        const bool whole = vectorised && j0 >= 0 && j0 + 4 <= numel;
        theta_q[u] = load_group(theta, j0, numel, whole);
        if constexpr (kMomentum) v_q[u] = load_group(v, j0, numel, whole);
        if constexpr (kSource == Source::kGrad) grad_q[u] = load_group(grad, j0, numel, whole);
      }
#pragma unroll
      for (int u = 0; u < kUnroll<scalar_t>; ++u) {
        const int l = l0 + u * kThreads;
        if (l >= chunk_groups) break;
        const int64_t j0 = chunk_j0 + 4 * l;
        acc_t dir[4];
        if constexpr (kSource == Source::kGrad) {
#pragma unroll
          for (int lane = 0; lane < 4; ++lane) dir[lane] = static_cast<acc_t>(grad_q[u].x[lane]);
        } else {
          forward_gradient<kSource>(dir, static_cast<uint64_t>(chunk_q + l), seed, step, coeffs, num_tangents);
        }
#pragma unroll
        for (int lane = 0; lane < 4; ++lane) {
          const int64_t j = j0 + lane;
          if (j < 0 || j >= numel) continue;
          acc_t d = dir[lane];
          if constexpr (kMomentum) {
            d = rn_add(rn_mul(keep_v, v_q[u].x[lane]), rn_mul(gamma, d));
            v_q[u].x[lane] = d;
          }
          const acc_t theta_old = static_cast<acc_t>(theta_q[u].x[lane]);
          best.dot = rn_add(best.dot, rn_mul(static_cast<double>(d), static_cast<double>(theta_old)));
          theta_q[u].x[lane] = static_cast<scalar_t>(rn_mul(keep_theta, theta_old));
          add_norm_sums(norm_words, theta_old, static_cast<acc_t>(theta_q[u].x[lane]));
          // Strictly larger (or a first NaN): this thread visits its elements in index order.
          const acc_t abs_d = abs_of(d);
          if ((isnan(abs_d) && !isnan(best.abs_d)) || abs_d > best.abs_d) {
            best.abs_d = abs_d;
            best.d = d;
            best.key = j;
          }
        }
        const bool whole = vectorised && j0 >= 0 && j0 + 4 <= numel;
        store_group(theta, j0, numel, whole, theta_q[u]);
        if constexpr (kMomentum) store_group(v, j0, numel, whole, v_q[u]);
      }
    }

    best = block_reduce<kThreads>(best, no_candidate<acc_t>());
    const NormSums sums = block_reduce<kThreads>(take_norm_sums(norm_words), NormSums{0, 0});
    if (threadIdx.x == 0) {
      ws.slots[table.chunk_base + c] = Slot{static_cast<double>(best.d), best.key, best.dot, sums.old_units,
                                            sums.new_units, table.first_row + r};
    }
  }
}

// *gap = the sum of all num_shares shares of the gap, in a fixed order (thread i takes shares i,
// i + kBlock, ... in turn, then a fixed tree), so the same inputs give the same gap. Every thread of
// the block calls it. The sum rides in a Candidate's dot for block_reduce; the float one, the smallest
// (with the double one, ptxas spilled the finalize kernel).
template <int kBlock>
__device__ void sum_shares(const Workspace& ws, double* gap) {
  constexpr int kLoads = 4;  // loads in flight per thread: the sum is the tail of the step
  Candidate<float> total = no_candidate<float>();
  for (int64_t b = threadIdx.x; b < ws.num_shares; b += kLoads * kBlock) {
    double share[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      share[u] = b + u * kBlock < ws.num_shares ? __ldcg(ws.ball_gap + b + u * kBlock) : 0.0;
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (b + u * kBlock < ws.num_shares) total.dot = rn_add(total.dot, share[u]);
    }
  }
  total = block_reduce<kBlock>(total, no_candidate<float>());
  if (threadIdx.x == 0) *gap = total.dot;
}

// The step's last kernel when the rows kernel wrote every share: one block. A skipped step's gap is NaN (the
// rows kernel wrote no share).
__global__ void __launch_bounds__(kSumThreads)
    fw_sum_shares_kernel(Workspace ws, const double* __restrict__ skip, double* gap) {
  if (skipped(skip)) {
    if (threadIdx.x == 0) *gap = skipped_gap();
    return;
  }
  sum_shares<kSumThreads>(ws, gap);
}

// Block b reduces ball b's slots (all slots for the global ball, global_numel elements), sets theta_i*
// (l1_vertex_value) and computes the ball's gap <d, theta_old> + r |d_i*|. Unless the ball is global, the
// last block sums every ball's share (the rows path's too). A skipped step: block 0 writes the NaN gap, and no
// block reads the slots, the ball table or the block counter, which the chunks kernel left unwritten.
template <typename scalar_t>
__global__ void __launch_bounds__(kFinalizeThreads)
    fw_finalize_kernel(Workspace ws, const double* __restrict__ schedule, const double* __restrict__ skip,
                       bool global_ball, int64_t global_numel, double* gap) {
  using acc_t = acc_type<scalar_t>;
  if (skipped(skip)) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *gap = skipped_gap();
    return;
  }
  const int ball = blockIdx.x;
  const int64_t begin = global_ball ? 0 : ws.ball_first_slot[ball];
  const int64_t end = ws.ball_first_slot[global_ball ? ws.num_chunk_balls : ball + 1];

  Candidate<acc_t> best = no_candidate<acc_t>();
  NormSums sums{0, 0};
  for (int64_t s = begin + threadIdx.x; s < end; s += kFinalizeThreads) {
    const Slot slot = ws.slots[s];
    const acc_t d = static_cast<acc_t>(slot.d);  // exact: d was an acc_t
    merge(best, Candidate<acc_t>{abs_of(d), d, s, slot.dot});
    merge(sums, NormSums{slot.old_units, slot.new_units});
  }
  best = block_reduce<kFinalizeThreads>(best, no_candidate<acc_t>());
  sums = block_reduce<kFinalizeThreads>(sums, NormSums{0, 0});

  if (threadIdx.x == 0) {
    double share = best.dot;
    if (best.key >= 0) {
      const Slot& winner = ws.slots[best.key];
      const double radius = ws.ball_radius[winner.tensor];
      scalar_t* const theta = static_cast<scalar_t*>(ws.ball_param[winner.tensor]);
      const int64_t numel = global_ball ? global_numel : ws.ball_numel[ball];
      theta[winner.index] = static_cast<scalar_t>(l1_vertex_value<acc_t>(
          static_cast<acc_t>(theta[winner.index]), best.d, schedule[1], radius, numel, sums.old_units,
          sums.new_units));
      share = rn_add(share, rn_mul(static_cast<double>(abs_of(best.d)), radius));
    }
    if (global_ball) {
      *gap = share;
    } else {
      ws.ball_gap[ball] = share;
    }
  }
  if (global_ball) return;

  // The last block to finish sums every ball's share (the rows kernel's too).
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    __threadfence();
    last_block = atomicAdd(ws.finished_blocks, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  sum_shares<kFinalizeThreads>(ws, gap);
}

// The rows kernel's candidate, in fewer registers than Candidate (the ptxas budget of the rows
// kernel is tight): |d| is recomputed from d, the key is the element's index in its row (an int),
// and key < 0 means no element yet. theta is the element's theta as written, keep * theta_old
// rounded to the parameter dtype, so that the vertex move needs no load.
template <typename acc_t>
struct RowCandidate {
  acc_t d;
  acc_t theta;
  int key;
  double dot;
};

// Whether (d, key) beats `best` in argmax |d| (NaN largest, then the lower key).
template <typename acc_t>
__device__ __forceinline__ bool beats(acc_t d, int key, const RowCandidate<acc_t>& best) {
  if (key < 0) return false;
  if (best.key < 0) return true;
  const acc_t a = abs_of(d), b = abs_of(best.d);
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (a_nan || a == b) return key < best.key;
  return a > b;
}

// The launch's entry holding ball b: the last entry whose first ball is <= b.
template <int kLists>
__device__ __forceinline__ int entry_of_ball(const RowTable<kLists>& table, int64_t b) {
  int lo = 0, hi = table.num_entries - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_ball[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The rows path: block (one warp) w takes balls w, w + gridDim.x, ... of the launch. Per ball it
// runs the element update of the chunks kernel over the ball's groups (a row may start and end in
// the middle of a Philox call), reduces (|d|, index) and <d, theta_old> over its lanes in a fixed
// tree, and lane 0 moves the winner to the vertex and writes the ball's share of the gap.
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kRowThreads, kMinRowBlocks<scalar_t>)
    fw_rows_kernel(const __grid_constant__ RowTable<kLists> table, const double* __restrict__ schedule,
                   const double* __restrict__ coeffs, int num_tangents, int64_t seed,
                   const double* __restrict__ radii, const double* __restrict__ skip, Workspace ws) {
  using acc_t = acc_type<scalar_t>;
  if (skipped(skip)) return;  // no share written: the kernel that sums them writes the NaN gap instead
  const int64_t step = static_cast<int64_t>(schedule[0]);
  const acc_t gamma = static_cast<acc_t>(schedule[2]);
  const acc_t keep_theta = step_factors<acc_t>(schedule[1]).keep;
  const acc_t keep_v = acc_t(1) - gamma;
  const int warp_lane = threadIdx.x;

  for (int64_t b = blockIdx.x; b < table.num_balls; b += gridDim.x) {
    const int e = entry_of_ball(table, b);
    const int64_t row = b - table.first_ball[e];
    const int numel = table.row_numel[e];
    const int lead = table.lead[e];
    // Groups follow the tensor's stream: tensor group g holds its elements 4 g - lead .. 4 g - lead + 3
    // and draws Philox call first_group + g. The row's element 0 sits at place `lo` of group
    // row_group, so group l of the row holds its elements 4 l - lo .. 4 l - lo + 3 (the row's groups
    // are the tensor's, which is why the tensor's alignment flag serves every row).
    const int64_t from_group0 = row * numel + lead;
    const int64_t row_group = from_group0 / 4;
    const int lo = static_cast<int>(from_group0 % 4);
    const int groups = (lo + numel + 3) / 4;
    const bool vectorised = table.vectorised[e];
    const int64_t first_radius = table.first_radius[e];
    const double radius = first_radius < 0 ? table.radius[e] : radii[first_radius + row];
    __shared__ unsigned long long norm_words[kNormWords * kRowThreads];
    start_norm_sums(norm_words, radius);

    RowCandidate<acc_t> best{acc_t(0), acc_t(0), -1, 0.0};
    for (int l0 = warp_lane; l0 < groups; l0 += kUnroll<scalar_t> * 32) {
      // All loads first, then the Philox work, so the memory latency hides behind the arithmetic.
      Quad<scalar_t> theta_q[kUnroll<scalar_t>], grad_q[kUnroll<scalar_t>];
      Quad<acc_t> v_q[kUnroll<scalar_t>];
#pragma unroll
      for (int u = 0; u < kUnroll<scalar_t>; ++u) {
        const int l = l0 + u * 32;
        if (l >= groups) break;
        const int j0 = 4 * l - lo;
        const int64_t at = 4 * (row_group + l) - lead;  // the group's element 0 in the tensor
        const bool whole = vectorised && j0 >= 0 && j0 + 4 <= numel;
        theta_q[u] = load_row_group(static_cast<const scalar_t*>(table.data[kParamList][e]) + at, j0, numel, whole);
        if constexpr (kMomentum) {
          v_q[u] = load_row_group(static_cast<const acc_t*>(table.data[kMomentumList][e]) + at, j0, numel, whole);
        }
        if constexpr (kSource == Source::kGrad) {
          grad_q[u] = load_row_group(static_cast<const scalar_t*>(table.data[kGradList][e]) + at, j0, numel, whole);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll<scalar_t>; ++u) {
        const int l = l0 + u * 32;
        if (l >= groups) break;
        const int j0 = 4 * l - lo;
        acc_t dir[4];
        if constexpr (kSource == Source::kGrad) {
#pragma unroll
          for (int lane = 0; lane < 4; ++lane) dir[lane] = static_cast<acc_t>(grad_q[u].x[lane]);
        } else {
          forward_gradient<kSource>(dir, static_cast<uint64_t>(table.first_group[e] + row_group + l), seed, step,
                                    coeffs, num_tangents);
        }
#pragma unroll
        for (int lane = 0; lane < 4; ++lane) {
          const int j = j0 + lane;
          if (j < 0 || j >= numel) continue;
          acc_t d = dir[lane];
          if constexpr (kMomentum) {
            d = rn_add(rn_mul(keep_v, v_q[u].x[lane]), rn_mul(gamma, d));
            v_q[u].x[lane] = d;
          }
          const acc_t theta_old = static_cast<acc_t>(theta_q[u].x[lane]);
          best.dot = rn_add(best.dot, rn_mul(static_cast<double>(d), static_cast<double>(theta_old)));
          theta_q[u].x[lane] = static_cast<scalar_t>(rn_mul(keep_theta, theta_old));
          add_norm_sums(norm_words, theta_old, static_cast<acc_t>(theta_q[u].x[lane]));
          // Strictly larger (or a first NaN): this lane visits its elements in index order.
          const acc_t abs_d = abs_of(d), best_abs_d = abs_of(best.d);
          if (best.key < 0 || (isnan(abs_d) && !isnan(best_abs_d)) || abs_d > best_abs_d) {
            best.d = d;
            best.theta = static_cast<acc_t>(theta_q[u].x[lane]);
            best.key = j;
          }
        }
        const int64_t at = 4 * (row_group + l) - lead;
        const bool whole = vectorised && j0 >= 0 && j0 + 4 <= numel;
        store_row_group(static_cast<scalar_t*>(table.data[kParamList][e]) + at, j0, numel, whole, theta_q[u]);
        if constexpr (kMomentum) {
          store_row_group(static_cast<acc_t*>(table.data[kMomentumList][e]) + at, j0, numel, whole, v_q[u]);
        }
      }
    }

    // The lanes' candidates, dots and norm sums in a fixed tree: lane 0 ends with the ball's.
    NormSums sums = take_norm_sums(norm_words);
#pragma unroll
    for (int delta = 16; delta > 0; delta /= 2) {
      const acc_t d = __shfl_down_sync(0xffffffffu, best.d, delta);
      const acc_t theta = __shfl_down_sync(0xffffffffu, best.theta, delta);
      const int key = __shfl_down_sync(0xffffffffu, best.key, delta);
      best.dot = rn_add(best.dot, __shfl_down_sync(0xffffffffu, best.dot, delta));
      merge(sums, shuffle_down(sums, delta));
      if (beats(d, key, best)) {
        best.d = d;
        best.theta = theta;
        best.key = key;
      }
    }
    __syncwarp();  // lane 0 overwrites theta[i*], which another lane of the warp may have written
    if (warp_lane == 0) {
      double share = best.dot;
      if (best.key >= 0) {  // always: a row has at least one element
        scalar_t* const theta = static_cast<scalar_t*>(table.data[kParamList][e]) + row * numel;
        theta[best.key] = static_cast<scalar_t>(
            l1_vertex_value<acc_t>(best.theta, best.d, schedule[1], radius, numel, sums.old_units, sums.new_units));
        share = rn_add(share, rn_mul(static_cast<double>(abs_of(best.d)), radius));
      }
      ws.ball_gap[table.first_share + b] = share;
    }
  }
}

// Offsets of the workspace's arrays in one allocation, each 16-byte aligned.
struct WorkspaceLayout {
  size_t slots, ball_first_slot, ball_param, ball_radius, ball_numel, ball_gap, finished_blocks, bytes;

  WorkspaceLayout(int64_t num_slots, int64_t num_chunk_balls, int64_t num_shares) {
    size_t at = 0;
    auto take = [&at](size_t size) {
      const size_t offset = at;
      at = (at + size + 15) / 16 * 16;
      return offset;
    };
    slots = take(sizeof(Slot) * num_slots);
    ball_first_slot = take(sizeof(int64_t) * (num_chunk_balls + 1));
    ball_param = take(sizeof(void*) * num_chunk_balls);
    ball_radius = take(sizeof(double) * num_chunk_balls);
    ball_numel = take(sizeof(int64_t) * num_chunk_balls);
    ball_gap = take(sizeof(double) * num_shares);
    finished_blocks = take(sizeof(unsigned int));
    bytes = at;
  }
};

// The balls of a step, sorted into the two paths, in the order of their radii within each.
struct BallPlan {
  // A ball of the chunks path: elements [start, start + numel) of tensor `tensor`.
  struct ChunkBall {
    int tensor;
    int64_t start, numel;
    double radius;
  };
  // A tensor of the rows path: its `rows` rows of row_numel elements are balls, whose radii are
  // radii[first_radius, first_radius + rows) of the op (all equal when `uniform`) and, when not
  // uniform, device_radii[device_radius, device_radius + rows) on the device.
  struct RowEntry {
    int tensor;
    int64_t rows;
    int row_numel;
    int64_t first_radius;
    bool uniform;
    int64_t device_radius;
  };
  std::vector<ChunkBall> chunk_balls;
  std::vector<RowEntry> row_entries;
  int64_t row_balls = 0;
};

BallPlan plan_balls(at::TensorList params, c10::ArrayRef<double> radii, bool global_ball, c10::IntArrayRef row_numel) {
  BallPlan plan;
  const int n = static_cast<int>(params.size());
  if (global_ball) {
    // Every tensor on the chunks path, empty ones too: the finalize reduces all their slots at once.
    for (int t = 0; t < n; ++t) plan.chunk_balls.push_back({t, 0, params[t].numel(), radii[0]});
    return plan;
  }
  int64_t radius = 0;  // the op's index of tensor t's first ball
  for (int t = 0; t < n; ++t) {
    const int64_t numel = params[t].numel(), length = row_length(row_numel, t);
    const int64_t ball_numel = length == 0 ? numel : length;
    const int64_t balls = num_balls(numel, length);
    if (numel == 0) {
      // nothing moves and the gap share is 0: no work on either path
    } else if (ball_numel <= kMaxWarpBall) {
      const double* first = radii.data() + radius;
      const bool uniform = std::all_of(first, first + balls, [first](double r) { return r == *first; });
      plan.row_entries.push_back({t, balls, static_cast<int>(ball_numel), radius, uniform, -1});
      plan.row_balls += balls;
    } else {
      for (int64_t b = 0; b < balls; ++b) {
        plan.chunk_balls.push_back({t, b * ball_numel, ball_numel, radii[radius + b]});
      }
    }
    radius += balls;
  }
  return plan;
}

// Radii of row balls whose rows have radii of their own, on the device. The op gets its radii as
// host numbers every step, but they rarely change: each distinct array is uploaded once (from
// pinned memory, asynchronously on the step's stream) and found again by its contents, so a step
// normally copies nothing to the device, never synchronises and can be captured in a CUDA graph.
// Up to kCapacity arrays per device are kept (least recently used goes first), except that an
// array used during a graph capture is kept for good: the graph holds its address.
class DeviceRadii {
 public:
  // The radii (the concatenated pieces, count in all) on stream's device. The tensor returned keeps
  // them alive until the caller has launched its kernels, even if another thread evicts them.
  static at::Tensor get(const c10::cuda::CUDAStream& stream, const std::vector<c10::ArrayRef<double>>& pieces,
                        int64_t count) {
    static State* const state = new State();  // never destroyed: no CUDA calls at process exit
    const std::lock_guard<std::mutex> lock(state->mutex);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    const c10::DeviceIndex device = stream.device_index();

    for (Entry& entry : state->entries) {
      if (entry.device != device || static_cast<int64_t>(entry.values.size()) != count || !same(entry, pieces)) {
        continue;
      }
      entry.last_use = ++state->clock;
      if (capturing) {
        entry.captured = true;  // never freed from now on: nothing to tell the allocator
      } else if (std::find(entry.streams.begin(), entry.streams.end(), stream.stream()) == entry.streams.end()) {
        // another stream reads it now: it must not run ahead of the upload (queued on the first stream),
        // and should the entry be evicted, the allocator must not hand its memory out before that
        // stream's work is done
        C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), entry.uploaded.get(), 0));
        c10::cuda::CUDACachingAllocator::recordStream(entry.on_device.storage().data_ptr(), stream);
        entry.streams.push_back(stream.stream());
      }
      return entry.on_device;
    }
    TORCH_CHECK(!capturing,
                "l1_fw_step_: row balls whose rows have different radii need one step with these radii before "
                "a CUDA graph capture (it uploads them to the device, which a capture cannot do)");

    size_t kept = 0;
    auto oldest = state->entries.end();
    for (auto it = state->entries.begin(); it != state->entries.end(); ++it) {
      if (it->device != device || it->captured) continue;
      ++kept;
      if (oldest == state->entries.end() || it->last_use < oldest->last_use) oldest = it;
    }
    if (kept >= kCapacity) state->entries.erase(oldest);

    Entry entry;
    entry.device = device;
    entry.values.reserve(count);
    for (const c10::ArrayRef<double>& piece : pieces) {
      entry.values.insert(entry.values.end(), piece.begin(), piece.end());
    }
    const at::Tensor pinned = at::empty({count}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
    std::memcpy(pinned.data_ptr<double>(), entry.values.data(), sizeof(double) * count);
    entry.on_device = at::empty({count}, at::TensorOptions().dtype(at::kDouble).device(at::kCUDA, device));
    entry.on_device.copy_(pinned, /*non_blocking=*/true);
    cudaEvent_t uploaded;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming));
    entry.uploaded.reset(uploaded);
    C10_CUDA_CHECK(cudaEventRecord(uploaded, stream.stream()));
    entry.streams.push_back(stream.stream());
    entry.captured = false;
    entry.last_use = ++state->clock;
    state->entries.push_back(std::move(entry));
    return state->entries.back().on_device;
  }

 private:
  static constexpr size_t kCapacity = 8;

  struct EventDestroyer {
    void operator()(cudaEvent_t event) const { cudaEventDestroy(event); }  // safe with work pending
  };

  struct Entry {
    c10::DeviceIndex device;
    std::vector<double> values;
    at::Tensor on_device;
    std::unique_ptr<CUevent_st, EventDestroyer> uploaded;  // recorded after the upload, on the first stream
    std::vector<cudaStream_t> streams;  // those that used it, each recorded with the allocator
    bool captured;
    uint64_t last_use;
  };

  struct State {
    std::mutex mutex;
    std::vector<Entry> entries;
    uint64_t clock = 0;
  };

  static bool same(const Entry& entry, const std::vector<c10::ArrayRef<double>>& pieces) {
    const double* at = entry.values.data();
    for (const c10::ArrayRef<double>& piece : pieces) {
      if (std::memcmp(at, piece.data(), sizeof(double) * piece.size()) != 0) return false;
      at += piece.size();
    }
    return true;
  }
};

template <typename scalar_t, Source kSource, bool kMomentum>
void launch_step(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                 const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                 c10::IntArrayRef offsets, int64_t seed, const at::Tensor& gap, c10::IntArrayRef row_numel) {
  using acc_t = acc_type<scalar_t>;
  const int device = params[0].get_device();
  const c10::cuda::CUDAStream cuda_stream = c10::cuda::getCurrentCUDAStream(device);
  const cudaStream_t stream = cuda_stream.stream();

  BallPlan plan = plan_balls(params, radii, global_ball, row_numel);
  const int num_chunk_balls = static_cast<int>(plan.chunk_balls.size());
  if (num_chunk_balls == 0 && plan.row_balls == 0) {  // every tensor is empty
    write_empty_gap(gap, schedule);
    return;
  }
  auto stream_offset = [&](int t) { return offsets.empty() ? int64_t{0} : offsets[t]; };
  auto address = [](const at::Tensor& tensor, auto element_type, int64_t start) -> void* {
    return static_cast<decltype(element_type)*>(tensor.data_ptr()) + start;
  };

  std::vector<int64_t> chunk_numels(num_chunk_balls), chunk_offsets(num_chunk_balls);
  int64_t num_slots = 0;
  for (int b = 0; b < num_chunk_balls; ++b) {
    const BallPlan::ChunkBall& ball = plan.chunk_balls[b];
    chunk_numels[b] = ball.numel;
    chunk_offsets[b] = stream_offset(ball.tensor) + ball.start;
    num_slots += cuda::num_chunks(chunk_numels[b], chunk_offsets[b]);
  }
  const int64_t num_shares = num_chunk_balls + plan.row_balls;

  const WorkspaceLayout layout(num_slots, num_chunk_balls, num_shares);
  const c10::DataPtr buffer = c10::cuda::CUDACachingAllocator::get()->allocate(layout.bytes);
  char* const base = static_cast<char*>(buffer.get());
  const Workspace ws{reinterpret_cast<Slot*>(base + layout.slots),
                     reinterpret_cast<int64_t*>(base + layout.ball_first_slot),
                     reinterpret_cast<void**>(base + layout.ball_param),
                     reinterpret_cast<double*>(base + layout.ball_radius),
                     reinterpret_cast<int64_t*>(base + layout.ball_numel),
                     reinterpret_cast<double*>(base + layout.ball_gap),
                     reinterpret_cast<unsigned int*>(base + layout.finished_blocks),
                     num_chunk_balls,
                     num_shares};

  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const double* const schedule_ptr = schedule.data_ptr<double>();
  // read by every kernel on the device (a skipped step writes nothing but its NaN gap)
  const double* const skip = schedule.numel() == 4 ? schedule_ptr + 3 : nullptr;
  const double* const coeffs_ptr = kSource == Source::kGrad ? nullptr : tangent_coeffs.data_ptr<double>();
  const int num_tangents = kSource == Source::kGrad ? 0 : static_cast<int>(tangent_coeffs.numel());
  double* const gap_ptr = gap.data_ptr<double>();

  // 1. The chunks of the long balls (block 0 of each launch publishes its balls and zeroes the
  //    block counter of the finalize).
  if (num_chunk_balls > 0) {
    const auto chunks_kernel = fw_chunks_kernel<scalar_t, kSource, kMomentum>;
    // Occupancy depends on the kernel and the architecture only; one process drives one kind of GPU.
    static const int chunk_blocks_per_sm = cuda::blocks_per_sm(chunks_kernel, kThreads);
    const int64_t max_blocks = int64_t{sms} * chunk_blocks_per_sm;
    cuda::for_each_launch<kLists>(
        chunk_numels, chunk_offsets,
        [&](int b, TensorTable<kLists>& table, int row) {
          const BallPlan::ChunkBall& ball = plan.chunk_balls[b];
          const int t = ball.tensor;
          void* const theta = address(params[t], scalar_t{}, ball.start);
          void* const v = kMomentum ? address(momentum[t], acc_t{}, ball.start) : nullptr;
          void* const grad = kSource == Source::kGrad ? address(grads[t], scalar_t{}, ball.start) : nullptr;
          const int lead = table.lead[row];
          table.data[kParamList][row] = theta;
          table.data[kMomentumList][row] = v;
          table.data[kGradList][row] = grad;
          table.scalar[row] = ball.radius;
          table.vectorised[row] = cuda::quad_aligned<scalar_t>(theta, lead) &&
                                  (!v || cuda::quad_aligned<acc_t>(v, lead)) &&
                                  (!grad || cuda::quad_aligned<scalar_t>(grad, lead));
        },
        [&](const TensorTable<kLists>& table) {
          // Block 0 publishes the table even when every tensor is empty.
          const int64_t blocks = std::clamp<int64_t>(table.num_chunks, 1, max_blocks);
          chunks_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(table, schedule_ptr, coeffs_ptr,
                                                                               num_tangents, seed, skip, ws);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  }

  // 2. The short balls, a warp each; without a finalize a one-block kernel sums the gap.
  if (plan.row_balls > 0) {
    std::vector<c10::ArrayRef<double>> pieces;
    int64_t device_radii = 0;
    for (BallPlan::RowEntry& entry : plan.row_entries) {
      if (entry.uniform) continue;
      pieces.push_back(radii.slice(entry.first_radius, entry.rows));
      entry.device_radius = device_radii;
      device_radii += entry.rows;
    }
    // held until the launches are made
    const at::Tensor on_device = device_radii ? DeviceRadii::get(cuda_stream, pieces, device_radii) : at::Tensor();
    const double* const radii_ptr = device_radii ? on_device.data_ptr<double>() : nullptr;
    const auto rows_kernel = fw_rows_kernel<scalar_t, kSource, kMomentum>;
    static const int row_blocks_per_sm = cuda::blocks_per_sm(rows_kernel, kRowThreads);
    const int64_t max_blocks = int64_t{sms} * row_blocks_per_sm;
    const int num_entries = static_cast<int>(plan.row_entries.size());
    int64_t first_share = num_chunk_balls;
    for (int first = 0; first < num_entries; first += kMaxRowEntries) {
      RowTable<kLists> table;
      std::memset(&table, 0, sizeof(table));
      table.num_entries = std::min(kMaxRowEntries, num_entries - first);
      table.first_share = first_share;
      int64_t balls = 0;
      for (int e = 0; e < table.num_entries; ++e) {
        const BallPlan::RowEntry& entry = plan.row_entries[first + e];
        const int t = entry.tensor;
        const int64_t offset = stream_offset(t);
        const int lead = static_cast<int>(offset % 4);
        void* const theta = params[t].data_ptr();
        void* const v = kMomentum ? momentum[t].data_ptr() : nullptr;
        void* const grad = kSource == Source::kGrad ? grads[t].data_ptr() : nullptr;
        table.data[kParamList][e] = theta;
        table.data[kMomentumList][e] = v;
        table.data[kGradList][e] = grad;
        table.first_ball[e] = balls;
        table.first_group[e] = offset / 4;
        table.first_radius[e] = entry.uniform ? -1 : entry.device_radius;
        table.radius[e] = radii[entry.first_radius];
        table.row_numel[e] = entry.row_numel;
        table.lead[e] = static_cast<int8_t>(lead);
        // A row's groups are the tensor's groups (both follow the stream), so one flag serves all rows.
        table.vectorised[e] = cuda::quad_aligned<scalar_t>(theta, lead) &&
                              (!v || cuda::quad_aligned<acc_t>(v, lead)) &&
                              (!grad || cuda::quad_aligned<scalar_t>(grad, lead));
        balls += entry.rows;
      }
      table.num_balls = balls;
      first_share += balls;
      const int64_t blocks = std::clamp<int64_t>(balls, 1, max_blocks);
      rows_kernel<<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(table, schedule_ptr, coeffs_ptr,
                                                                            num_tangents, seed, radii_ptr, skip, ws);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (num_chunk_balls == 0) {
      fw_sum_shares_kernel<<<1, kSumThreads, 0, stream>>>(ws, skip, gap_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  // 3. The long balls' vertices and, unless the rows kernel did, the gap.
  if (num_chunk_balls > 0) {
    int64_t global_numel = 0;
    for (const int64_t numel : chunk_numels) global_numel += numel;
    fw_finalize_kernel<scalar_t><<<global_ball ? 1u : static_cast<unsigned>(num_chunk_balls), kFinalizeThreads, 0,
                                   stream>>>(ws, schedule_ptr, skip, global_ball, global_numel, gap_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void l1_fw_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                     const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                     c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                     c10::IntArrayRef row_numel) {
  check_fw_step_args("l1_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                     distribution, gap, row_numel);
  const c10::cuda::CUDAGuard device_guard(params.empty() ? schedule.device() : params[0].device());
  if (params.empty()) {
    write_empty_gap(gap, schedule);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "l1_fw_step_cuda", [&] {
    auto run = [&](auto source, auto with_momentum) {
      launch_step<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
          params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, gap, row_numel);
    };
    dispatch_step_variant(!grads.empty(), distribution, !momentum.empty(), run);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("l1_fw_step_", &l1_fw_step_cuda);
}

}  // namespace fgfw
