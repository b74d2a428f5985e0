// gradient_step_ on CUDA: the step of an unconstrained param group from given directions (reference.gradient_step_):
// with momentum v <- (1 - gamma) v + gamma g and d = v, else d = g; then theta <- theta - alpha d, every product and
// sum rounded in the params' dtype (float32 or float64) as the reference rounds it.
//
// One multi-tensor pass (multi_tensor.cuh): a launch covers up to kMaxTensorsPerLaunch tensors, its blocks walking
// their chunks in a grid-stride loop, four elements (a Quad) at a time. The stream offsets are all 0, so group g of a
// tensor is its elements 4 g .. 4 g + 3. The schedule is read by pointer on the device, so a step never synchronises
// the host and can be captured in a CUDA graph; a skipped step (schedule[3] != 0, direction.cuh: skipped) writes
// nothing.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/direction.cuh"
#include "cuda/multi_tensor.cuh"
#include "op_args.h"

namespace fgfw {
namespace {

using cuda::kChunkGroups;
using cuda::Quad;
using cuda::TensorTable;

constexpr int kThreads = 256;

// The table's lists.
constexpr int kParamList = 0, kMomentumList = 1, kGradList = 2, kLists = 3;

// One element: v <- RN(RN(keep v) + RN(gamma g)) and d = v with momentum, else d = g; returns RN(theta - RN(alpha d)).
template <bool kMomentum, typename T>
__device__ __forceinline__ T step_element(T theta, T& v, T g, T alpha, T gamma, T keep) {
  T d = g;
  if constexpr (kMomentum) {
    d = rn_add(rn_mul(keep, v), rn_mul(gamma, g));
    v = d;
  }
  return rn_sub(theta, rn_mul(alpha, d));
}

template <typename scalar_t, bool kMomentum>
__global__ void __launch_bounds__(kThreads)
    gradient_step_kernel(const __grid_constant__ TensorTable<kLists> table, const double* __restrict__ schedule,
                         const double* __restrict__ skip) {
  if (skipped(skip)) return;
  // the reference's torch.tensor(alpha, dtype) and torch.tensor(gamma, dtype): rounded to nearest
  const scalar_t alpha = static_cast<scalar_t>(schedule[1]);
  const scalar_t gamma = static_cast<scalar_t>(schedule[2]);
  const scalar_t keep = rn_sub(scalar_t(1), gamma);

  for (int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    const int r = cuda::row_of_chunk(table, c);
    scalar_t* const theta = static_cast<scalar_t*>(table.data[kParamList][r]);
    scalar_t* const v = static_cast<scalar_t*>(table.data[kMomentumList][r]);
    const scalar_t* const grad = static_cast<const scalar_t*>(table.data[kGradList][r]);
    const int64_t numel = table.numel[r];
    const bool vectorised = table.vectorised[r];
    const int64_t group_begin = (c - table.first_chunk[r]) * kChunkGroups;
    const int64_t groups_left = cuda::num_groups(numel, 0) - group_begin;
    const int chunk_groups = static_cast<int>(groups_left < kChunkGroups ? groups_left : kChunkGroups);
    for (int l = threadIdx.x; l < chunk_groups; l += kThreads) {
      const int64_t j0 = 4 * (group_begin + l);
      if (vectorised && j0 + 4 <= numel) {
        Quad<scalar_t> theta_q = *reinterpret_cast<const Quad<scalar_t>*>(theta + j0);
        const Quad<scalar_t> grad_q = *reinterpret_cast<const Quad<scalar_t>*>(grad + j0);
        Quad<scalar_t> v_q{};
        if constexpr (kMomentum) v_q = *reinterpret_cast<const Quad<scalar_t>*>(v + j0);
#pragma unroll
        for (int lane = 0; lane < 4; ++lane) {
          theta_q.x[lane] = step_element<kMomentum>(theta_q.x[lane], v_q.x[lane], grad_q.x[lane], alpha, gamma, keep);
        }
        if constexpr (kMomentum) *reinterpret_cast<Quad<scalar_t>*>(v + j0) = v_q;
        *reinterpret_cast<Quad<scalar_t>*>(theta + j0) = theta_q;
      } else {
        // the tensor's last, partial group, or a tensor whose groups are not Quad-aligned
        for (int64_t j = j0; j < j0 + 4 && j < numel; ++j) {
          scalar_t v_j = scalar_t(0);
          if constexpr (kMomentum) v_j = v[j];
          theta[j] = step_element<kMomentum>(theta[j], v_j, grad[j], alpha, gamma, keep);
          if constexpr (kMomentum) v[j] = v_j;
        }
      }
    }
  }
}

template <typename scalar_t, bool kMomentum>
void launch_gradient_step(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                          const at::Tensor& schedule) {
  const int device = params[0].get_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const auto kernel = gradient_step_kernel<scalar_t, kMomentum>;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  static const int per_sm = cuda::blocks_per_sm(kernel, kThreads);
  const int64_t max_blocks = int64_t{sms} * per_sm;

  const double* const schedule_ptr = schedule.data_ptr<double>();
  // read by the kernel on the device (a skipped step writes nothing)
  const double* const skip = schedule.numel() == 4 ? schedule_ptr + 3 : nullptr;
  const int n = static_cast<int>(params.size());
  std::vector<int64_t> numels(n), stream_offsets(n, 0);
  for (int t = 0; t < n; ++t) numels[t] = params[t].numel();
  cuda::for_each_launch<kLists>(
      numels, stream_offsets,
      [&](int t, TensorTable<kLists>& table, int row) {
        void* const theta = params[t].data_ptr();
        void* const v = kMomentum ? momentum[t].data_ptr() : nullptr;
        void* const grad = grads[t].data_ptr();
        table.data[kParamList][row] = theta;
        table.data[kMomentumList][row] = v;
        table.data[kGradList][row] = grad;
        table.vectorised[row] = cuda::quad_aligned<scalar_t>(theta, 0) && (!v || cuda::quad_aligned<scalar_t>(v, 0)) &&
                                cuda::quad_aligned<scalar_t>(grad, 0);
      },
      [&](const TensorTable<kLists>& table) {
        if (table.num_chunks == 0) return;  // every tensor of the launch is empty
        const int64_t blocks = std::min<int64_t>(table.num_chunks, max_blocks);
        kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(table, schedule_ptr, skip);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

void gradient_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                        const at::Tensor& schedule) {
  check_gradient_step_args(params, momentum, grads, schedule);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard device_guard(params[0].device());
  AT_DISPATCH_FLOATING_TYPES(params[0].scalar_type(), "gradient_step_cuda", [&] {
    if (momentum.empty()) {
      launch_gradient_step<scalar_t, false>(params, momentum, grads, schedule);
    } else {
      launch_gradient_step<scalar_t, true>(params, momentum, grads, schedule);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("gradient_step_", &gradient_step_cuda);
}

}  // namespace fgfw
