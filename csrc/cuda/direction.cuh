// What the CUDA steps (l1_fw_step.cu, set_step.cuh) share to compute a direction: explicitly rounded
// arithmetic (nvcc must not contract a product and a sum into an FMA: the kernels mirror reference.py's
// roundings) and the forward gradient of one Philox call, regenerated in registers.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/where.h>

#include <cstdint>
#include <limits>

#include "philox.h"
#include "step_variant.h"

namespace fgfw {

__device__ __forceinline__ float rn_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double rn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float rn_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double rn_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float rn_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double rn_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double rn_div(double a, double b) { return __ddiv_rn(a, b); }

// A skipped step (schedule (step, alpha, gamma, skip), skip != 0) writes nothing but NaN into its gap. The launchers
// pass skip = schedule + 3 for a schedule of 4 elements, null for 3; every kernel of a step reads it on the device
// at its top, so the host never waits for it and no kernel reads workspace that a skipped kernel left unwritten.
__device__ __forceinline__ bool skipped(const double* skip) { return skip != nullptr && *skip != 0.0; }

// The gap of a skipped step: a quiet NaN.
__device__ __forceinline__ double skipped_gap() { return __longlong_as_double(0x7ff8000000000000LL); }

// The gap of a step with no element (no kernel runs): 0, or NaN when the schedule has a skip that is not 0, decided
// on the device by a where over the schedule's 4th element: no host read.
inline void write_empty_gap(const at::Tensor& gap, const at::Tensor& schedule) {
  if (schedule.numel() == 4) {
    gap.copy_(at::where(schedule.select(0, 3).ne(0), std::numeric_limits<double>::quiet_NaN(), 0.0));
  } else {
    gap.zero_();
  }
}

// g = sum_k coeff_k u_k for the four elements of Philox call q, accumulated in k order from the k = 0 term.
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

}  // namespace fgfw
