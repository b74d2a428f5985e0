// l1_fw_step_ on CUDA: one fused Frank-Wolfe step over L1 ball(s) for a group of tensors, in two
// kernels and no host synchronisation (DESIGN.md "The fused step").
//
// 1. fw_chunks_kernel walks every tensor of the group in chunks (multi_tensor.cuh). Per group of
//    four elements it regenerates the tangents in registers (one Philox call per tangent) or reads
//    the gradient, updates the momentum, accumulates <d, theta_old> and scales theta by (1 - alpha).
//    Each chunk's block reduces (|d|, index) and the dot product into the chunk's slot. Block 0
//    also publishes the per-tensor table the finalize needs (first slot, address, radius).
// 2. fw_finalize_kernel, one block per ball (one per tensor, or one for the global ball), reduces
//    its slots, moves the winning element to the vertex and writes its share of the gap; the last
//    block to finish sums the shares into `gap`.
// Ties: slots are numbered in (tensor, element) order and every reduction prefers the lower index
// among equal |d|, so the lowest index wins, across tensors too; NaN counts as the largest |d|, as
// torch.argmax counts it. The schedule and coefficients are read by pointer on the device and the
// workspace comes from the caching allocator, so a step can be captured in a CUDA graph.
// Arithmetic follows python/fgfw/reference.py operation by operation: every product and sum is an
// explicitly rounded intrinsic, so nvcc cannot contract them into FMAs that round differently.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cuda/multi_tensor.cuh"
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

__device__ __forceinline__ float rn_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double rn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float rn_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double rn_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float abs_of(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_of(double x) { return fabs(x); }

// torch.sign: 0 for 0 and for NaN.
template <typename T>
__device__ __forceinline__ T sign_of(T x) {
  return static_cast<T>((x > T(0)) - (x < T(0)));
}

// What a chunk leaves for the finalize: the signed d at its largest |d| and that element's flat
// index in its tensor, the chunk's <d, theta_old>, and the tensor's position in the group.
struct alignas(16) Slot {
  double d;
  int64_t index;
  double dot;
  int32_t tensor;
};

// Device memory of one step (one caching-allocator block), written by the chunks kernel and read
// by the finalize. ball_first_slot has num_tensors + 1 entries: tensor t owns slots
// [ball_first_slot[t], ball_first_slot[t + 1]).
struct Workspace {
  Slot* slots;
  int64_t* ball_first_slot;
  void** ball_param;
  double* ball_radius;
  double* ball_gap;
  unsigned int* finished_blocks;
  int num_tensors;
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

template <typename acc_t>
__device__ __forceinline__ Candidate<acc_t> shuffle_down(const Candidate<acc_t>& c, int delta) {
  return {__shfl_down_sync(0xffffffffu, c.abs_d, delta), __shfl_down_sync(0xffffffffu, c.d, delta),
          __shfl_down_sync(0xffffffffu, c.key, delta), __shfl_down_sync(0xffffffffu, c.dot, delta)};
}

// The merge of every thread's candidate, in thread 0. A fixed tree: the same inputs give the same
// sum, run after run. Every thread of the block must call it.
template <int kBlock, typename acc_t>
__device__ Candidate<acc_t> block_reduce(Candidate<acc_t> c) {
  constexpr int kWarps = kBlock / 32;
  __shared__ Candidate<acc_t> warp_result[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) merge(c, shuffle_down(c, delta));
  if (lane == 0) warp_result[warp] = c;
  __syncthreads();
  if (warp == 0) {
    c = lane < kWarps ? warp_result[lane] : no_candidate<acc_t>();
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

// g = sum_k coeff_k u_k for the four elements of Philox call q, accumulated in k order.
template <Source kSource, typename acc_t>
__device__ __forceinline__ void forward_gradient(acc_t g[4], uint64_t q, int64_t seed, int64_t step,
                                                 const double* __restrict__ coeffs, int num_tangents) {
  for (int k = 0; k < num_tangents; ++k) {
    const PhiloxWords w = TangentStream(seed, step, k).words(q);
    float u[4];
    if constexpr (kSource == Source::kRademacher) {
#pragma unroll
      for (int lane = 0; lane < 4; ++lane) u[lane] = rademacher(w.w[lane]);
    } else {
      box_muller(w.w[0], w.w[1], u[0], u[1]);
      box_muller(w.w[2], w.w[3], u[2], u[3]);
    }
    const acc_t coeff = static_cast<acc_t>(__ldg(coeffs + k));
#pragma unroll
    for (int lane = 0; lane < 4; ++lane) {
      const acc_t term = rn_mul(coeff, static_cast<acc_t>(u[lane]));
      g[lane] = k == 0 ? term : rn_add(g[lane], term);
    }
  }
}

// Block 0's extra duty: the per-tensor facts the finalize needs, for this launch's rows.
__device__ void publish_balls(const TensorTable<kLists>& table, const Workspace& ws) {
  for (int r = threadIdx.x; r < table.num_rows; r += blockDim.x) {
    const int t = table.first_row + r;
    ws.ball_first_slot[t] = table.chunk_base + table.first_chunk[r];
    ws.ball_param[t] = table.data[kParamList][r];
    ws.ball_radius[t] = table.scalar[r];
  }
  if (threadIdx.x == 0) {
    if (table.first_row + table.num_rows == ws.num_tensors) {
      ws.ball_first_slot[ws.num_tensors] = table.chunk_base + table.num_chunks;
    }
    *ws.finished_blocks = 0;
  }
}

template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kThreads, kMinChunkBlocks<scalar_t>)
    fw_chunks_kernel(const __grid_constant__ TensorTable<kLists> table, const double* __restrict__ schedule,
                     const double* __restrict__ coeffs, int num_tangents, int64_t seed, Workspace ws) {
  using acc_t = acc_type<scalar_t>;
  if (blockIdx.x == 0) publish_balls(table, ws);
  const int64_t step = static_cast<int64_t>(schedule[0]);
  const acc_t alpha = static_cast<acc_t>(schedule[1]);
  const acc_t gamma = static_cast<acc_t>(schedule[2]);
  const acc_t keep_theta = acc_t(1) - alpha;
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

    best = block_reduce<kThreads>(best);
    if (threadIdx.x == 0) {
      ws.slots[table.chunk_base + c] =
          Slot{static_cast<double>(best.d), best.key, best.dot, table.first_row + r};
    }
  }
}

// Block b reduces ball b's slots (all slots for the global ball), applies
// theta_i* += alpha * (-r sign(d_i*)) and computes the ball's gap <d, theta_old> + r |d_i*|.
template <typename scalar_t>
__global__ void __launch_bounds__(kFinalizeThreads)
    fw_finalize_kernel(Workspace ws, const double* __restrict__ schedule, bool global_ball, double* gap) {
  using acc_t = acc_type<scalar_t>;
  const int ball = blockIdx.x;
  const int64_t begin = global_ball ? 0 : ws.ball_first_slot[ball];
  const int64_t end = ws.ball_first_slot[global_ball ? ws.num_tensors : ball + 1];

  Candidate<acc_t> best = no_candidate<acc_t>();
  for (int64_t s = begin + threadIdx.x; s < end; s += kFinalizeThreads) {
    const Slot slot = ws.slots[s];
    const acc_t d = static_cast<acc_t>(slot.d);  // exact: d was an acc_t
    merge(best, Candidate<acc_t>{abs_of(d), d, s, slot.dot});
  }
  best = block_reduce<kFinalizeThreads>(best);

  if (threadIdx.x == 0) {
    double share = best.dot;
    if (best.key >= 0) {
      const Slot& winner = ws.slots[best.key];
      const double radius = ws.ball_radius[winner.tensor];
      scalar_t* const theta = static_cast<scalar_t*>(ws.ball_param[winner.tensor]);
      const acc_t alpha = static_cast<acc_t>(schedule[1]);
      const acc_t vertex = rn_mul(-static_cast<acc_t>(radius), sign_of(best.d));
      theta[winner.index] =
          static_cast<scalar_t>(rn_add(static_cast<acc_t>(theta[winner.index]), rn_mul(alpha, vertex)));
      share = rn_add(share, rn_mul(static_cast<double>(abs_of(best.d)), radius));
    }
    if (global_ball) {
      *gap = share;
    } else {
      ws.ball_gap[ball] = share;
    }
  }
  if (global_ball) return;

  // The last block to finish sums every ball's share, in a fixed order.
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    __threadfence();
    last_block = atomicAdd(ws.finished_blocks, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  Candidate<acc_t> total = no_candidate<acc_t>();
  for (int b = threadIdx.x; b < ws.num_tensors; b += kFinalizeThreads) {
    total.dot = rn_add(total.dot, __ldcg(ws.ball_gap + b));
  }
  total = block_reduce<kFinalizeThreads>(total);
  if (threadIdx.x == 0) *gap = total.dot;
}

// Offsets of the workspace's arrays in one allocation, each 16-byte aligned.
struct WorkspaceLayout {
  size_t slots, ball_first_slot, ball_param, ball_radius, ball_gap, finished_blocks, bytes;

  WorkspaceLayout(int64_t num_slots, int64_t num_tensors) {
    size_t at = 0;
    auto take = [&at](size_t size) {
      const size_t offset = at;
      at = (at + size + 15) / 16 * 16;
      return offset;
    };
    slots = take(sizeof(Slot) * num_slots);
    ball_first_slot = take(sizeof(int64_t) * (num_tensors + 1));
    ball_param = take(sizeof(void*) * num_tensors);
    ball_radius = take(sizeof(double) * num_tensors);
    ball_gap = take(sizeof(double) * num_tensors);
    finished_blocks = take(sizeof(unsigned int));
    bytes = at;
  }
};

template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  return std::max(blocks, 1);
}

template <typename scalar_t, Source kSource, bool kMomentum>
void launch_step(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                 const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                 c10::IntArrayRef offsets, int64_t seed, const at::Tensor& gap) {
  using acc_t = acc_type<scalar_t>;
  const int n = static_cast<int>(params.size());
  const int device = params[0].get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();

  std::vector<int64_t> numels(n), stream_offsets(n);
  int64_t num_slots = 0;
  for (int t = 0; t < n; ++t) {
    numels[t] = params[t].numel();
    stream_offsets[t] = offsets.empty() ? 0 : offsets[t];
    num_slots += cuda::num_chunks(numels[t], stream_offsets[t]);
  }

  const WorkspaceLayout layout(num_slots, n);
  const c10::DataPtr buffer = c10::cuda::CUDACachingAllocator::get()->allocate(layout.bytes);
  char* const base = static_cast<char*>(buffer.get());
  const Workspace ws{reinterpret_cast<Slot*>(base + layout.slots),
                     reinterpret_cast<int64_t*>(base + layout.ball_first_slot),
                     reinterpret_cast<void**>(base + layout.ball_param),
                     reinterpret_cast<double*>(base + layout.ball_radius),
                     reinterpret_cast<double*>(base + layout.ball_gap),
                     reinterpret_cast<unsigned int*>(base + layout.finished_blocks),
                     n};

  const auto chunks_kernel = fw_chunks_kernel<scalar_t, kSource, kMomentum>;
  // Occupancy depends on the kernel and the architecture only; one process drives one kind of GPU.
  static const int chunk_blocks_per_sm = blocks_per_sm(chunks_kernel, kThreads);
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t max_blocks = int64_t{sms} * chunk_blocks_per_sm;

  const double* const schedule_ptr = schedule.data_ptr<double>();
  const double* const coeffs_ptr = kSource == Source::kGrad ? nullptr : tangent_coeffs.data_ptr<double>();
  const int num_tangents = kSource == Source::kGrad ? 0 : static_cast<int>(tangent_coeffs.numel());

  cuda::for_each_launch<kLists>(
      numels, stream_offsets,
      [&](int t, TensorTable<kLists>& table, int row) {
        void* const theta = params[t].data_ptr();
        void* const v = kMomentum ? momentum[t].data_ptr() : nullptr;
        void* const grad = kSource == Source::kGrad ? grads[t].data_ptr() : nullptr;
        const int lead = table.lead[row];
        table.data[kParamList][row] = theta;
        table.data[kMomentumList][row] = v;
        table.data[kGradList][row] = grad;
        table.scalar[row] = global_ball ? radii[0] : radii[t];
        table.vectorised[row] = cuda::quad_aligned<scalar_t>(theta, lead) &&
                                (!v || cuda::quad_aligned<acc_t>(v, lead)) &&
                                (!grad || cuda::quad_aligned<scalar_t>(grad, lead));
      },
      [&](const TensorTable<kLists>& table) {
        // Block 0 publishes the table even when every tensor is empty.
        const int64_t blocks = std::clamp<int64_t>(table.num_chunks, 1, max_blocks);
        chunks_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(table, schedule_ptr, coeffs_ptr,
                                                                             num_tangents, seed, ws);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });

  fw_finalize_kernel<scalar_t><<<global_ball ? 1u : static_cast<unsigned>(n), kFinalizeThreads, 0, stream>>>(
      ws, schedule_ptr, global_ball, gap.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void l1_fw_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                     const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                     c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                     c10::IntArrayRef row_numel) {
  check_l1_fw_step_args(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, distribution,
                        gap, row_numel);
  TORCH_CHECK(std::all_of(row_numel.begin(), row_numel.end(), [](int64_t n) { return n == 0; }),
              "l1_fw_step_: row balls (row_numel) are not implemented on CUDA yet");
  const c10::cuda::CUDAGuard device_guard(params.empty() ? schedule.device() : params[0].device());
  if (params.empty()) {
    gap.zero_();
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "l1_fw_step_cuda", [&] {
    auto run = [&](auto source, auto with_momentum) {
      launch_step<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
          params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, gap);
    };
    dispatch_step_variant(!grads.empty(), distribution, !momentum.empty(), run);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("l1_fw_step_", &l1_fw_step_cuda);
}

}  // namespace fgfw
