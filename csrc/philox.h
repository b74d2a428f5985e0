// The tangent stream (docs/tangent_stream.md): Philox4x32-10 and its mapping to Gaussian
// and Rademacher values, for host and device code. Bit-for-bit the mapping of
// python/fgfw/reference.py; never change it without bumping TANGENT_STREAM_VERSION there, since
// saved runs depend on it.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define FGFW_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FGFW_HOST_DEVICE inline
#endif

namespace fgfw {

// The op argument `distribution`.
enum Distribution : int64_t { kGaussian = 0, kRademacher = 1 };

struct PhiloxWords {
  uint32_t w[4];
};

namespace philox_detail {

constexpr uint32_t kM0 = 0xD2511F53u;
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;  // key schedule (Weyl sequence)
constexpr uint32_t kW1 = 0xBB67AE85u;
// 2 pi rounded to float32, as reference.py rounds it.
constexpr float kTwoPi = 6.2831853071795864769f;

FGFW_HOST_DEVICE void mulhilo32(uint32_t a, uint32_t m, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * m;
  hi = __umulhi(a, m);
#else
  const uint64_t product = static_cast<uint64_t>(a) * m;
  lo = static_cast<uint32_t>(product);
  hi = static_cast<uint32_t>(product >> 32);
#endif
}

// Float operations that are rounded one at a time: nvcc would otherwise be free to fuse a
// multiply and an add into an FMA (a different rounding), whatever the build flags of the file
// that includes this header. Host builds use -ffp-contract=off for the same reason.
FGFW_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FGFW_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

}  // namespace philox_detail

// Philox4x32-10 (Salmon et al., SC'11): ten rounds on a 128-bit counter under a 64-bit key.
FGFW_HOST_DEVICE PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                           uint32_t k0, uint32_t k1) {
  using namespace philox_detail;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(c0, kM0, hi0, lo0);
    mulhilo32(c2, kM1, hi1, lo1);
    const uint32_t next0 = hi1 ^ c1 ^ k0;
    const uint32_t next2 = hi0 ^ c3 ^ k1;
    c0 = next0;
    c1 = lo1;
    c2 = next2;
    c3 = lo0;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// Uniform in (0, 1] from the word's top 24 bits: ((w >> 8) + 0.5) * 2^-24 in float32. Never 0, so
// the Box-Muller logarithm is finite.
FGFW_HOST_DEVICE float uniform_from_word(uint32_t w) {
  using namespace philox_detail;
  return mul_rn(add_rn(static_cast<float>(w >> 8), 0.5f), 0x1p-24f);
}

// Box-Muller on one pair of words: the first gives the radius sqrt(-2 ln u1), the second the
// angle 2 pi u2; r cos goes to the even element, r sin to the odd one.
FGFW_HOST_DEVICE void box_muller(uint32_t radius_word, uint32_t angle_word, float& even, float& odd) {
  using namespace philox_detail;
  const float radius = sqrtf(mul_rn(-2.0f, logf(uniform_from_word(radius_word))));
  const float angle = mul_rn(kTwoPi, uniform_from_word(angle_word));
  float sin_angle, cos_angle;
#if defined(__CUDA_ARCH__)
  // One range reduction for both. CUDA's sincosf (libdevice __nv_sincosf) runs sinf's and cosf's
  // reduction and polynomials, so for angles in (0, 2 pi] its values are theirs bit for bit.
  sincosf(angle, &sin_angle, &cos_angle);
#else
  // sincosf is a GNU extension on the host.
  sin_angle = sinf(angle);
  cos_angle = cosf(angle);
#endif
  even = mul_rn(radius, cos_angle);
  odd = mul_rn(radius, sin_angle);
}

// +1 when the word's top bit is 0, else -1.
FGFW_HOST_DEVICE float rademacher(uint32_t w) {
  return (w >> 31) ? -1.0f : 1.0f;
}

// The stream of one (seed, step, tangent id). Element i of the flat parameter index space comes
// from call q = i / 4 (counter (q lo, q hi, step, tangent id), key = seed as (lo, hi)), word i % 4.
// Step, tangent id and seed are taken modulo 2^32, 2^32 and 2^64 (two's complement), as in
// reference.py.
struct TangentStream {
  uint32_t key_lo, key_hi, step, tangent_id;

  FGFW_HOST_DEVICE TangentStream(int64_t seed, int64_t step_, int64_t tangent_id_)
      : key_lo(static_cast<uint32_t>(static_cast<uint64_t>(seed))),
        key_hi(static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32)),
        step(static_cast<uint32_t>(step_)),
        tangent_id(static_cast<uint32_t>(tangent_id_)) {}

  FGFW_HOST_DEVICE PhiloxWords words(uint64_t q) const {
    return philox4x32_10(static_cast<uint32_t>(q), static_cast<uint32_t>(q >> 32), step, tangent_id,
                         key_lo, key_hi);
  }

  // The float32 tangent values of elements 4q .. 4q + 3.
  FGFW_HOST_DEVICE void values(uint64_t q, int64_t distribution, float out[4]) const {
    const PhiloxWords r = words(q);
    if (distribution == kRademacher) {
      for (int lane = 0; lane < 4; ++lane) out[lane] = rademacher(r.w[lane]);
    } else {
      box_muller(r.w[0], r.w[1], out[0], out[1]);
      box_muller(r.w[2], r.w[3], out[2], out[3]);
    }
  }
};

}  // namespace fgfw
