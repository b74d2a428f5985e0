// How much does regenerating the tangent cost on a GPU, next to moving the bytes? (issue 20, item 4)
//
// A standalone program (no torch): the AFGFW update without its LMO (read theta and v, regenerate
// u from the Philox stream, v <- (1 - gamma) v + gamma c u, theta <- keep theta, a running max |v|
// per thread so nothing is dead code), 16 bytes per float32 parameter, for several ways of making
// u from one Philox call (four values per call in every variant):
//   none        no tangent (v <- (1 - gamma) v + gamma theta): the memory roof of this update
//   rademacher  sign of each word (the Rademacher stream)
//   accurate    Box-Muller as the tangent stream defines it (csrc/philox.h: logf, sqrtf, sincosf)
//   fast        __logf, sqrtf and __sincosf (the SFU intrinsics), angle 2 pi u - pi in [-pi, pi)
//   sincospi    __logf and sincospif(2u): a cheap exact range reduction, accurate sin and cos
// and a device-to-device copy of the same 16 bytes per parameter. Each variant's values are also
// compared with the accurate ones over 2^26 Philox calls (max |difference|, and max relative
// difference where |u| > 1e-3): what a faster stream would give up.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I csrc bench/gaussian_roof.cu -o /tmp/gaussian_roof
//   /tmp/gaussian_roof [params=1e8] [tangents=1]
//
// Prints one line per variant: median ms over 30 timed launches (after 3 warm-ups), GB/s, fraction of copy.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "philox.h"

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    cudaError_t err_ = (call);                                                                        \
    if (err_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_));  \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

enum Variant { kNone, kRademacher, kAccurate, kFast, kSinCosPi, kNumVariants };
static const char* kNames[] = {"none", "rademacher", "accurate", "fast", "sincospi"};

template <int kVariant>
__device__ __forceinline__ void tangent(const fgfw::PhiloxWords& w, float u[4]) {
  if constexpr (kVariant == kRademacher) {
#pragma unroll
    for (int i = 0; i < 4; ++i) u[i] = fgfw::rademacher(w.w[i]);
  } else if constexpr (kVariant == kAccurate) {
    fgfw::box_muller(w.w[0], w.w[1], u[0], u[1]);
    fgfw::box_muller(w.w[2], w.w[3], u[2], u[3]);
  } else {
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const float r = sqrtf(-2.0f * __logf(fgfw::uniform_from_word(w.w[2 * pair])));
      const float a = fgfw::uniform_from_word(w.w[2 * pair + 1]);
      float s, c;
      if constexpr (kVariant == kFast) {
        // cos(2 pi a - pi) = -cos(2 pi a): the same values up to sign, with the argument in [-pi, pi)
        __sincosf(fmaf(6.2831853071795864769f, a, -3.14159265358979f), &s, &c);
        s = -s;
        c = -c;
      } else {
        sincospif(2.0f * a, &s, &c);
      }
      u[2 * pair] = r * c;
      u[2 * pair + 1] = r * s;
    }
  }
}

template <int kVariant>
__global__ void __launch_bounds__(256) update_kernel(float4* __restrict__ theta, float4* __restrict__ v, int64_t n4,
                                                     int tangents, float keep, float gamma, float* max_out) {
  float best = 0.0f;
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < n4; q += int64_t(gridDim.x) * blockDim.x) {
    float4 t = theta[q];
    float4 m = v[q];
    float g[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (kVariant == kNone) {
      g[0] = t.x; g[1] = t.y; g[2] = t.z; g[3] = t.w;
    } else {
      for (int k = 0; k < tangents; ++k) {
        float u[4];
        tangent<kVariant>(fgfw::TangentStream(7, 3, k).words(uint64_t(q)), u);
        const float c = 0.5f - 0.25f * k;
#pragma unroll
        for (int i = 0; i < 4; ++i) g[i] += c * u[i];
      }
    }
    m.x = (1.f - gamma) * m.x + gamma * g[0];
    m.y = (1.f - gamma) * m.y + gamma * g[1];
    m.z = (1.f - gamma) * m.z + gamma * g[2];
    m.w = (1.f - gamma) * m.w + gamma * g[3];
    best = fmaxf(best, fmaxf(fmaxf(fabsf(m.x), fabsf(m.y)), fmaxf(fabsf(m.z), fabsf(m.w))));
    t.x *= keep; t.y *= keep; t.z *= keep; t.w *= keep;
    theta[q] = t;
    v[q] = m;
  }
  for (int o = 16; o > 0; o >>= 1) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, o));
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<int*>(max_out), __float_as_int(best));
}

// errors[0] = max |u_variant - u_accurate|, errors[1] = max of that over |u_accurate| where |u| > 1e-3
template <int kVariant>
__global__ void error_kernel(int64_t calls, float* errors) {
  float worst_abs = 0.f, worst_rel = 0.f;
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < calls; q += int64_t(gridDim.x) * blockDim.x) {
    const fgfw::PhiloxWords w = fgfw::TangentStream(11, 5, 0).words(uint64_t(q));
    float ref[4], u[4];
    tangent<kAccurate>(w, ref);
    tangent<kVariant>(w, u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float diff = fabsf(u[i] - ref[i]);
      worst_abs = fmaxf(worst_abs, diff);
      if (fabsf(ref[i]) > 1e-3f) worst_rel = fmaxf(worst_rel, diff / fabsf(ref[i]));
    }
  }
  atomicMax(reinterpret_cast<int*>(errors), __float_as_int(worst_abs));
  atomicMax(reinterpret_cast<int*>(errors + 1), __float_as_int(worst_rel));
}

template <typename Launch>
static float median_ms(Launch launch) {
  cudaEvent_t begin, end;
  CHECK(cudaEventCreate(&begin));
  CHECK(cudaEventCreate(&end));
  for (int i = 0; i < 3; ++i) launch();
  CHECK(cudaGetLastError());
  std::vector<float> ms;
  for (int i = 0; i < 30; ++i) {
    CHECK(cudaEventRecord(begin));
    launch();
    CHECK(cudaEventRecord(end));
    CHECK(cudaEventSynchronize(end));
    float t;
    CHECK(cudaEventElapsedTime(&t, begin, end));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(begin));
  CHECK(cudaEventDestroy(end));
  return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? static_cast<int64_t>(std::atof(argv[1])) / 4 * 4 : 100000000;
  const int tangents = argc > 2 ? std::atoi(argv[2]) : 1;
  const int64_t n4 = n / 4;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  float4 *theta, *v, *theta2, *v2;
  float* scratch;
  CHECK(cudaMalloc(&theta, n * 4));
  CHECK(cudaMalloc(&v, n * 4));
  CHECK(cudaMalloc(&theta2, n * 4));
  CHECK(cudaMalloc(&v2, n * 4));
  CHECK(cudaMalloc(&scratch, 16));
  CHECK(cudaMemset(theta, 0x3c, n * 4));  // 0.0115 in every float: finite, not zero
  CHECK(cudaMemset(v, 0x3c, n * 4));
  const int blocks = prop.multiProcessorCount * 8;
  const double bytes = 16.0 * n;
  const float copy = median_ms([&] {
    CHECK(cudaMemcpyAsync(theta2, theta, n * 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpyAsync(v2, v, n * 4, cudaMemcpyDeviceToDevice));
  });
  std::printf("# %s, %d SMs; %lld float32 params, K = %d tangents, 16 B/param\n", prop.name,
              prop.multiProcessorCount, static_cast<long long>(n), tangents);
  std::printf("| variant | K | median ms | GB/s | of copy | max abs diff vs accurate | max rel diff (|u| > 1e-3) |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| copy | | %.4f | %.0f | 100%% | | |\n", copy, bytes / copy / 1e6);
  auto run = [&](auto variant_tag) {
    constexpr int kVariant = decltype(variant_tag)::value;
    const float ms = median_ms([&] {
      update_kernel<kVariant><<<blocks, 256>>>(theta, v, n4, tangents, 0.999f, 0.1f, scratch);
    });
    float errors[2] = {0.f, 0.f};
    if (kVariant != kNone && kVariant != kRademacher) {
      CHECK(cudaMemset(scratch + 2, 0, 8));
      error_kernel<kVariant><<<blocks, 256>>>(int64_t(1) << 26, scratch + 2);
      CHECK(cudaGetLastError());
      CHECK(cudaMemcpy(errors, scratch + 2, 8, cudaMemcpyDeviceToHost));
    }
    std::printf("| %s | %d | %.4f | %.0f | %.0f%% | %.3g | %.3g |\n", kNames[kVariant], tangents, ms,
                bytes / ms / 1e6, 100.0 * copy / ms, errors[0], errors[1]);
    std::fflush(stdout);
  };
  run(std::integral_constant<int, kNone>{});
  run(std::integral_constant<int, kRademacher>{});
  run(std::integral_constant<int, kAccurate>{});
  run(std::integral_constant<int, kFast>{});
  run(std::integral_constant<int, kSinCosPi>{});
  CHECK(cudaDeviceSynchronize());
  return 0;
}
