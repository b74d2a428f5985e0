// What keeps the rounded iterates of the fused steps in their sets (docs/feasibility.md), for host and device
// code: the norm sums' fixed-point units, the L1 vertex element's value, the dense update and the norm feedback's
// next scale. Each mirrors its python/fgfw/reference.py function (norm_units, l1_vertex_value, dense_update,
// next_norm_scale) operation by operation; on the device every product and sum is an explicitly rounded
// intrinsic, so nvcc cannot contract them into FMAs.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "philox.h"  // FGFW_HOST_DEVICE

namespace fgfw {
namespace feasibility_detail {

FGFW_HOST_DEVICE double add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
FGFW_HOST_DEVICE double sub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
FGFW_HOST_DEVICE double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
FGFW_HOST_DEVICE double div(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
FGFW_HOST_DEVICE float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FGFW_HOST_DEVICE float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FGFW_HOST_DEVICE float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

template <typename T>
FGFW_HOST_DEVICE T toward_zero(T x) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return nextafterf(x, 0.0f);
  } else {
    return nextafter(x, 0.0);
  }
}

FGFW_HOST_DEVICE uint64_t bits_of(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

// torch.sign: 0 for 0 and for NaN.
template <typename T>
FGFW_HOST_DEVICE double sign(T x) {
  return static_cast<double>((x > T(0)) - (x < T(0)));
}

}  // namespace feasibility_detail

// ---- Fixed-point norm sums (reference.norm_grid_exponent, norm_units) ----------------------------------------
// A ball's norm sums count |x| in units of 2^(E - 51), 2^E the smallest power of two >= its radius (at least
// 2^-970): integer sums, exact in any order, so every backend gets the same sums however it splits the ball.
// An element counts at most 2^51 units (|x| >= 2^E >= r: outside its ball; inf and NaN too) and a ball's sums stop
// at 2^61 (a norm of 2^10 2^E or more): no partial sum of at most 2^11 elements, and no sum of two capped sums,
// overflows, and sums that stop at a cap are still order-free (saturating_add). Either cap is reached only by a
// ball already outside, which then steps plainly (reference.NORM_SUM_CAP, l1_vertex_value).
constexpr int kNormGridBits = 51;
constexpr double kUnitsCap = 2251799813685248.0;  // 2^51
constexpr double kMagic = 4503599627370496.0;     // 2^52
constexpr uint64_t kNormSumCap = uint64_t{1} << 61;

// a + b stopped at the cap, for a, b <= 2^62 (no uint64 overflow): the same for any order of the terms.
FGFW_HOST_DEVICE uint64_t saturating_add(uint64_t a, uint64_t b) {
  const uint64_t sum = a + b;
  return sum < kNormSumCap ? sum : kNormSumCap;
}

// From the bits of r (> 0, finite): its exponent field, plus 1 unless r is a power of two. A subnormal r, and any
// r below 2^-970, gives -970. (Bit arithmetic rather than frexp, whose pointer argument costs device code a
// stack frame.)
FGFW_HOST_DEVICE int norm_grid_exponent(double radius) {
  const uint64_t bits = feasibility_detail::bits_of(radius);
  const int field = static_cast<int>((bits >> 52) & 0x7ff);
  const int e = field - 1023 + ((bits & ((uint64_t{1} << 52) - 1)) != 0 ? 1 : 0);
  return field != 0 && e > -970 ? e : -970;
}

// 2^k for k in [-1022, 1023], from its bits.
FGFW_HOST_DEVICE double power_of_two(int k) {
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
  double x;
#if defined(__CUDA_ARCH__)
  x = __longlong_as_double(static_cast<long long>(bits));
#else
  memcpy(&x, &bits, sizeof(x));
#endif
  return x;
}

// 2^(51 - E): |x| times this is |x| in units (a power of two: the product is exact).
FGFW_HOST_DEVICE double units_factor(double radius) { return power_of_two(kNormGridBits - norm_grid_exponent(radius)); }

// The unit 2^(E - 51).
FGFW_HOST_DEVICE double norm_unit(double radius) { return power_of_two(norm_grid_exponent(radius) - kNormGridBits); }

// round(v) for v = |x| units_factor (>= 0 or NaN), ties to even, at most 2^51: v + 2^52 rounds v to an integer
// (the float64 spacing there is 1), whose bit pattern counts up from 2^52's.
FGFW_HOST_DEVICE uint64_t norm_units(double v) {
  using namespace feasibility_detail;
  const double capped = v < kUnitsCap ? v : kUnitsCap;
  return bits_of(add(capped, kMagic)) - bits_of(kMagic);
}

// A units sum as next_norm_scale takes it: a capped one counts as infinite (the ball keeps the scale 1).
FGFW_HOST_DEVICE double units_as_double(uint64_t units) {
  return units < kNormSumCap ? static_cast<double>(units) : INFINITY;
}

// ---- The L1 step's vertex element (reference.l1_vertex_value) -------------------------------------------------
// x: the scaled value stored at i*; d = d_i*; numel: the ball's elements; old_units, new_units: the ball's sums of
// norm_units of theta before the step and of the scaled values. Returns theta_i* in the compute type.
template <typename acc_t>
FGFW_HOST_DEVICE acc_t l1_vertex_value(acc_t x, acc_t d, double alpha, double radius, int64_t numel,
                                       uint64_t old_units, uint64_t new_units) {
  using namespace feasibility_detail;
  const double unit = norm_unit(radius);
  const double s = mul(-radius, sign(d));
  const double x64 = static_cast<double>(x);
  const double w = add(x64, mul(alpha, s));
  // a ball whose old norm provably exceeds r (a start outside it): the plain step
  if (mul(static_cast<double>(static_cast<int64_t>(old_units) - numel), unit) > radius) return static_cast<acc_t>(w);
  // what rounding the scaling of every element moved the ball's norm: the vertex element takes it back
  const double excess = sub(mul(sub(1.0, alpha), mul(static_cast<double>(old_units), unit)),
                            mul(static_cast<double>(new_units), unit));
  const double target = add(fabs(w), excess);
  // the most it may hold: r less the others' stored norm bounded from above
  const double room =
      add(sub(radius, mul(static_cast<double>(new_units + static_cast<uint64_t>(numel) + 2u), unit)), fabs(x64));
  double magnitude = target > room ? room : target;
  if (magnitude < 0.0) magnitude = 0.0;
  acc_t y = static_cast<acc_t>(copysign(magnitude, w));
  if (fabs(static_cast<double>(y)) > room) y = toward_zero(y);
  return y;
}

// ---- The dense steps (reference.dense_update, radius_down, next_norm_scale) -------------------------------------

// The radius rounded down to the compute type.
template <typename acc_t>
FGFW_HOST_DEVICE acc_t radius_down(double radius) {
  const acc_t rounded = static_cast<acc_t>(radius);
  return static_cast<double>(rounded) > radius ? feasibility_detail::toward_zero(rounded) : rounded;
}

// x held within [-bound, bound] (bound >= 0; NaN stays NaN). Written as a min then a max whose second operand
// wins ties and NaN: each is one SSE minps / maxps.
template <typename T>
FGFW_HOST_DEVICE T at_most(T x, T bound) {
  const T below = bound < x ? bound : x;
  return -bound > below ? -bound : below;
}

// One element of a dense step: theta_new = RN(t + RN(RN(alpha) RN(s' - t))) with t = RN(scale theta) and
// s' = RN(s), both held within +-R (= bound_c) under kClamp; `exact` receives scale theta + alpha (s - scale theta)
// in float64 (held within +-radius under kClamp). alpha_c is alpha rounded to the compute type.
template <bool kClamp, typename acc_t>
FGFW_HOST_DEVICE acc_t dense_update(acc_t theta, double s, double alpha, acc_t alpha_c, double scale, acc_t bound_c,
                                    double radius, double& exact) {
  using namespace feasibility_detail;
  const double scaled_exact = mul(scale, static_cast<double>(theta));
  const acc_t scaled = static_cast<acc_t>(scaled_exact);
  acc_t vertex = static_cast<acc_t>(s);
  exact = add(scaled_exact, mul(alpha, sub(s, scaled_exact)));
  if (kClamp) vertex = at_most(vertex, bound_c);
  acc_t next = add(scaled, mul(alpha_c, sub(vertex, scaled)));
  if (kClamp) {
    next = at_most(next, bound_c);
    exact = at_most(exact, radius);
  }
  return next;
}

// The next step's scale stays within 1 +- kNormScaleBand u (reference.NORM_SCALE_BAND).
constexpr double kNormScaleBand = 16;

// The scale the next step applies to a ball's theta: (min(exact, bound) / stored)^(1/p) within 1 +- 16 u; 1 when
// stored is 0 or a sum is not finite. stored, exact: the ball's sums in units (p = 1, bound in units) or of
// (|x| / r)^p (p > 1, bound 1). unit_roundoff: u of the compute type.
FGFW_HOST_DEVICE double next_norm_scale(double stored, double exact, double bound, double p, double unit_roundoff) {
  using namespace feasibility_detail;
  if (!(isfinite(stored) && isfinite(exact) && stored > 0.0)) return 1.0;
  const double ratio = div(bound < exact ? bound : exact, stored);
  const double scale = p == 1.0 ? ratio : pow(ratio, div(1.0, p));
  const double band = mul(kNormScaleBand, unit_roundoff);
  const double low = sub(1.0, band), high = add(1.0, band);
  const double above_low = scale < low ? low : scale;
  return high < above_low ? high : above_low;
}

}  // namespace fgfw
