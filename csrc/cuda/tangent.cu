// fill_tangent_ on CUDA: materialises the tangent stream (philox.h) for the forward-mode JVP.
// Only c10/cuda and ATen core headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE
// headers and double the compile time.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cuda/multi_tensor.cuh"
#include "op_args.h"
#include "philox.h"

namespace fgfw {
namespace {

constexpr int kThreads = 256;
// Resident blocks per SM to aim for; the grid-stride loop covers the rest. __launch_bounds__ holds
// the kernel to it (32 registers a thread), where ptxas also keeps sincosf's large-argument
// reduction buffer in registers rather than a local-memory stack frame.
constexpr int kBlocksPerSm = 8;

// Thread c computes Philox call q = first_call + c (grid-stride) and writes its (up to) four
// elements j = 4 q + lane - offset: as one Quad (one 16-byte store; 8 bytes for 2-byte types, two
// stores for double) when all four are in range and `vectorised` says groups start Quad-aligned,
// else one by one. A non-null step_in_memory (the optimizers' counter) replaces the stream's step.
template <typename out_t>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    fill_tangent_kernel(out_t* __restrict__ out, int64_t numel, TangentStream stream, int64_t offset,
                        int64_t first_call, int64_t num_calls, int64_t distribution, bool vectorised,
                        const int64_t* __restrict__ step_in_memory) {
  if (step_in_memory != nullptr) stream.step = static_cast<uint32_t>(*step_in_memory);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < num_calls; c += stride) {
    const int64_t q = first_call + c;
    float u[4];
    stream.values(static_cast<uint64_t>(q), distribution, u);
    const int64_t j0 = 4 * q - offset;
    if (vectorised && j0 >= 0 && j0 + 4 <= numel) {
      cuda::Quad<out_t> group;
#pragma unroll
      for (int lane = 0; lane < 4; ++lane) group.x[lane] = static_cast<out_t>(u[lane]);
      *reinterpret_cast<cuda::Quad<out_t>*>(out + j0) = group;
      continue;
    }
#pragma unroll
    for (int lane = 0; lane < 4; ++lane) {
      const int64_t j = j0 + lane;
      if (j >= 0 && j < numel) out[j] = static_cast<out_t>(u[lane]);
    }
  }
}

// step_in_memory: null, or the step counter on out's device (read by the kernel, so no host sync).
void launch_fill(const at::Tensor& out, int64_t seed, int64_t step, const int64_t* step_in_memory, int64_t tangent_id,
                 int64_t offset, int64_t distribution) {
  check_fill_tangent_args(out, offset, distribution);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(out.device());
  const TangentStream stream(seed, step, tangent_id);
  write_contiguous(out, [&](const at::Tensor& dst) {
    const int64_t numel = dst.numel();
    const int64_t first_call = offset / 4;
    const int64_t num_calls = (offset + numel - 1) / 4 - first_call + 1;
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dst.get_device()));
    const int64_t blocks = std::min<int64_t>((num_calls + kThreads - 1) / kThreads, int64_t{sms} * kBlocksPerSm);
    const cudaStream_t cuda_stream = c10::cuda::getCurrentCUDAStream(dst.get_device()).stream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "fill_tangent_cuda", [&] {
      scalar_t* const data = dst.data_ptr<scalar_t>();
      const bool vectorised = cuda::quad_aligned<scalar_t>(data, static_cast<int>(offset % 4));
      fill_tangent_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, cuda_stream>>>(
          data, numel, stream, offset, first_call, num_calls, distribution, vectorised, step_in_memory);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void fill_tangent_cuda(const at::Tensor& out, int64_t seed, int64_t step, int64_t tangent_id, int64_t offset,
                       int64_t distribution) {
  launch_fill(out, seed, step, nullptr, tangent_id, offset, distribution);
}

void fill_tangent_at_step_cuda(const at::Tensor& out, int64_t seed, const at::Tensor& step, int64_t tangent_id,
                               int64_t offset, int64_t distribution) {
  check_step_tensor(out, step);
  if (step.is_cpu()) {
    launch_fill(out, seed, step.item<int64_t>(), nullptr, tangent_id, offset, distribution);
  } else {
    launch_fill(out, seed, 0, step.data_ptr<int64_t>(), tangent_id, offset, distribution);
  }
}

std::vector<at::Tensor> tangents_at_step_cuda(at::TensorList likes, int64_t seed, const at::Tensor& step,
                                              at::IntArrayRef tangent_ids, at::IntArrayRef offsets,
                                              int64_t distribution) {
  check_tangents_args(likes, tangent_ids, offsets);
  std::vector<at::Tensor> out;
  out.reserve(likes.size());
  for (size_t i = 0; i < likes.size(); ++i) {
    out.push_back(at::empty_like(likes[i]));
    fill_tangent_at_step_cuda(out.back(), seed, step, tangent_ids[i], offsets[i], distribution);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("fill_tangent_", &fill_tangent_cuda);
  m.impl("fill_tangent_at_step_", &fill_tangent_at_step_cuda);
  m.impl("tangents_at_step", &tangents_at_step_cuda);
}

}  // namespace fgfw
