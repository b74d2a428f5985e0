// nonfinite on CUDA: whether some element of some tensor is not finite (inf or NaN), as a 0-dim bool tensor on the
// device, for the optimizers' check_finite (the skip flag of a step: no host read). One multi-tensor pass per
// dtype (multi_tensor.cuh) that reads each element once, as integer bits: a value is not finite exactly when all
// its exponent bits are set, as csrc/cpu/all_finite.cpp tests it. Each block ORs its threads' verdicts and the
// blocks that found one write true into the zeroed flag (the same value from any number of blocks: no atomics).
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/multi_tensor.cuh"

namespace fgfw {
namespace {

using cuda::kChunkGroups;
using cuda::Quad;
using cuda::TensorTable;

constexpr int kThreads = 256;

// bits_t: the unsigned integer of the element's width; kExponent: its exponent bits.
template <typename bits_t, bits_t kExponent>
__device__ __forceinline__ bool nonfinite_bits(bits_t bits) {
  return (bits & kExponent) == kExponent;
}

template <typename bits_t, bits_t kExponent>
__global__ void __launch_bounds__(kThreads)
    nonfinite_kernel(const __grid_constant__ TensorTable<1> table, bool* __restrict__ found) {
  bool bad = false;
  for (int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    const int r = cuda::row_of_chunk(table, c);
    const bits_t* const x = static_cast<const bits_t*>(table.data[0][r]);
    const int64_t numel = table.numel[r];
    const bool vectorised = table.vectorised[r];
    const int64_t group_begin = (c - table.first_chunk[r]) * kChunkGroups;
    const int64_t groups_left = cuda::num_groups(numel, 0) - group_begin;
    const int chunk_groups = static_cast<int>(groups_left < kChunkGroups ? groups_left : kChunkGroups);
    for (int l = threadIdx.x; l < chunk_groups; l += kThreads) {
      const int64_t j0 = 4 * (group_begin + l);
      if (vectorised && j0 + 4 <= numel) {
        const Quad<bits_t> q = *reinterpret_cast<const Quad<bits_t>*>(x + j0);
#pragma unroll
        for (int lane = 0; lane < 4; ++lane) bad |= nonfinite_bits<bits_t, kExponent>(q.x[lane]);
      } else {
        for (int64_t j = j0; j < j0 + 4 && j < numel; ++j) bad |= nonfinite_bits<bits_t, kExponent>(x[j]);
      }
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = true;
}

template <typename bits_t, bits_t kExponent>
void launch_nonfinite(const std::vector<at::Tensor>& tensors, bool* found, cudaStream_t stream, int device) {
  const auto kernel = nonfinite_kernel<bits_t, kExponent>;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  static const int per_sm = cuda::blocks_per_sm(kernel, kThreads);
  const int64_t max_blocks = int64_t{sms} * per_sm;
  const int n = static_cast<int>(tensors.size());
  std::vector<int64_t> numels(n), stream_offsets(n, 0);
  for (int t = 0; t < n; ++t) numels[t] = tensors[t].numel();
  cuda::for_each_launch<1>(
      numels, stream_offsets,
      [&](int t, TensorTable<1>& table, int row) {
        const void* const x = tensors[t].const_data_ptr();
        table.data[0][row] = const_cast<void*>(x);
        table.vectorised[row] = cuda::quad_aligned<bits_t>(x, 0);
      },
      [&](const TensorTable<1>& table) {
        if (table.num_chunks == 0) return;
        const int64_t blocks = std::min<int64_t>(table.num_chunks, max_blocks);
        kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(table, found);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

at::Tensor nonfinite_cuda(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "nonfinite: tensors must not be empty (the verdict's device comes from them)");
  const c10::Device device = tensors[0].device();
  TORCH_CHECK(device.is_cuda(), "nonfinite: tensors[0] is on ", device, ", this is the CUDA kernel");
  const c10::cuda::CUDAGuard device_guard(device);
  // by element width; the bits of a non-contiguous tensor are read from its contiguous copy
  std::vector<at::Tensor> by_kind[4];  // float32, float64, float16, bfloat16
  for (size_t t = 0; t < tensors.size(); ++t) {
    TORCH_CHECK(tensors[t].device() == device, "nonfinite: tensors[", t, "] is on ", tensors[t].device(),
                ", tensors[0] on ", device, " (one call per device)");
    switch (tensors[t].scalar_type()) {
      case at::kFloat: by_kind[0].push_back(tensors[t].contiguous()); break;
      case at::kDouble: by_kind[1].push_back(tensors[t].contiguous()); break;
      case at::kHalf: by_kind[2].push_back(tensors[t].contiguous()); break;
      case at::kBFloat16: by_kind[3].push_back(tensors[t].contiguous()); break;
      default:
        TORCH_CHECK(!tensors[t].is_floating_point() && !tensors[t].is_complex(), "nonfinite: tensors[", t,
                    "] has dtype ", tensors[t].scalar_type(), ", which the check does not read");
    }
  }
  at::Tensor found = at::zeros({}, tensors[0].options().dtype(at::kBool));
  bool* const flag = found.data_ptr<bool>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const int index = device.index();
  if (!by_kind[0].empty()) launch_nonfinite<uint32_t, 0x7f800000u>(by_kind[0], flag, stream, index);
  if (!by_kind[1].empty()) launch_nonfinite<uint64_t, 0x7ff0000000000000ull>(by_kind[1], flag, stream, index);
  if (!by_kind[2].empty()) launch_nonfinite<uint16_t, 0x7c00u>(by_kind[2], flag, stream, index);
  if (!by_kind[3].empty()) launch_nonfinite<uint16_t, 0x7f80u>(by_kind[3], flag, stream, index);
  return found;
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("nonfinite", &nonfinite_cuda);
}

}  // namespace fgfw
