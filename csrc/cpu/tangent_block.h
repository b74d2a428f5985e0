// The tangent stream on the CPU, a block of Philox calls at a time. Both CPU ops that draw tangents
// (fill_tangent_ for the JVP, l1_fw_step_ regenerating u for the update) use these functions, so
// the two see the same float32 values bit for bit, as the CUDA ops do through philox.h.
//
// philox.h's scalar Box-Muller calls libm's logf/sinf/cosf, which do not vectorise and would cost
// more than the whole rest of the fused step. These branch-free float32 versions (Cephes' minimax
// polynomials, within 2 ulp) cover the only arguments Box-Muller produces: u1 in (0, 1] and angles
// in (0, 2 pi]. They agree with philox.h's values (and so with the CUDA ops) to the Gaussian
// tolerance every backend is held to, not bit for bit.
//
// The loops vectorise only with -fno-math-errno -fno-trapping-math (CMakeLists.txt sets them for
// every file that includes this header); neither option changes a value.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "philox.h"

namespace fgfw::cpu {

inline float float_of_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline uint32_t bits_of_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

// ln x for normal x in (0, 1]: x = 2^e m with m in [sqrt(1/2), sqrt(2)), ln x = e ln 2 + ln m.
inline float log_unit(float x) {
  const uint32_t bits = bits_of_float(x);
  const float m_low = float_of_bits((bits & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  const bool high = m_low > 1.41421356f;
  const float m = high ? m_low * 0.5f : m_low;
  const float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127 + (high ? 1 : 0));
  const float f = m - 1.0f;  // exact
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  float y = p * f * z;
  y = y + e * -2.12194440e-4f;  // ln 2 = 0.693359375 - 2.12194440e-4, the first part exact in e
  y = y - 0.5f * z;
  return (f + y) + e * 0.693359375f;
}

// sin x and cos x for x in [0, 2 pi]: x = k pi/2 + r with |r| <= pi/4 (pi/2 in three parts, so r
// is exact to float32 for k <= 4), then the quadrant's sign and swap.
inline void sincos_angle(float x, float& sin_x, float& cos_x) {
  const int k = static_cast<int>(x * 0.636619772f + 0.5f);
  const float kf = static_cast<float>(k);
  const float r = ((x - kf * 1.5703125f) - kf * 4.837512969970703125e-4f) - kf * 7.54978995489188216e-8f;
  const float z = r * r;
  float sp = -1.9515295891e-4f;
  sp = sp * z + 8.3321608736e-3f;
  sp = sp * z - 1.6666654611e-1f;
  const float s = sp * z * r + r;
  float cp = 2.443315711809948e-5f;
  cp = cp * z - 1.388731625493765e-3f;
  cp = cp * z + 4.166664568298827e-2f;
  const float c = (cp * z * z - 0.5f * z) + 1.0f;
  const bool swap = k & 1;
  const float s_swapped = swap ? c : s;
  const float c_swapped = swap ? s : c;
  sin_x = (k & 2) ? -s_swapped : s_swapped;
  cos_x = ((k + 1) & 2) ? -c_swapped : c_swapped;
}

// Words of calls q0 .. q0 + n - 1 (n <= kCalls) of one stream, word lane l of call c in
// words[l][c]: one array per lane, so the loops of tangent_block run over contiguous memory.
template <int kCalls>
void philox_block(const TangentStream& stream, uint64_t q0, int n, uint32_t (&words)[4][kCalls]) {
  for (int c = 0; c < n; ++c) {
    const PhiloxWords w = stream.words(q0 + static_cast<uint64_t>(c));
    words[0][c] = w.w[0];
    words[1][c] = w.w[1];
    words[2][c] = w.w[2];
    words[3][c] = w.w[3];
  }
}

// u for the 4 n elements of those calls, in stream order (docs/tangent_stream.md, "From words to
// values"): u[4 c + l] is element 4 (q0 + c) + l.
template <Distribution kDistribution, int kCalls>
void tangent_block(const uint32_t (&words)[4][kCalls], int n, float* u) {
  if constexpr (kDistribution == kRademacher) {
    for (int c = 0; c < n; ++c) {
      for (int lane = 0; lane < 4; ++lane) u[4 * c + lane] = rademacher(words[lane][c]);
    }
  } else {
    float radius[2][kCalls], sin_a[2][kCalls], cos_a[2][kCalls];
    for (int pair = 0; pair < 2; ++pair) {
      for (int c = 0; c < n; ++c) {
        radius[pair][c] = std::sqrt(-2.0f * log_unit(uniform_from_word(words[2 * pair][c])));
        sincos_angle(philox_detail::kTwoPi * uniform_from_word(words[2 * pair + 1][c]), sin_a[pair][c],
                     cos_a[pair][c]);
      }
    }
    for (int c = 0; c < n; ++c) {
      u[4 * c] = radius[0][c] * cos_a[0][c];
      u[4 * c + 1] = radius[0][c] * sin_a[0][c];
      u[4 * c + 2] = radius[1][c] * cos_a[1][c];
      u[4 * c + 3] = radius[1][c] * sin_a[1][c];
    }
  }
}

}  // namespace fgfw::cpu
