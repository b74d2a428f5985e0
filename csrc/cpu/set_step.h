// What the CPU steps of the L-infinity, Lp and k-sparse sets (linf_fw_step.cpp, lp_fw_step.cpp, ksparse_fw_step.cpp)
// share beyond the pass of every set (step_pass.h): a block's sums in lanes, and the norm feedback's scales of the Lp
// and k-sparse steps. docs/set_steps.md, "CPU kernels".
#pragma once

#include "step_pass.h"

namespace fgfw {
namespace {

// Sums x[e] * y[e] (or x[e] alone, y null) of a block into kLanes running sums: loops the compiler vectorises.
template <typename acc_t>
void add_in_lanes(double (&lanes)[kLanes], const acc_t* x, const acc_t* y, int n) {
  int e = 0;
  for (; e + kLanes <= n; e += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      lanes[l] += static_cast<double>(x[e + l]) * (y ? static_cast<double>(y[e + l]) : 1.0);
    }
  }
  for (; e < n; ++e) lanes[0] += static_cast<double>(x[e]) * (y ? static_cast<double>(y[e]) : 1.0);
}

// ---- The norm feedback (reference.fw_step_'s scales: the Lp and k-sparse steps) ---------------------
// Each ball's scale as the step reads it (1 without scales) and where its next scale goes: scales[t][row] for
// the rows (or the one ball) of tensor t, scales[0][0] for the global ball; null for an empty ball, whose scale
// is left as it is.
struct BallScales {
  std::vector<double> scale;  // per ball of the layout (one for the global ball)
  std::vector<double*> next;  // empty without scales
};

inline BallScales read_scales(at::TensorList scales, const Layout& layout, bool global_ball) {
  const size_t num_balls = global_ball ? 1 : layout.ball_tensor.size();
  BallScales out{std::vector<double>(num_balls, 1.0), {}};
  if (scales.empty()) return out;
  if (global_ball) {
    out.next.push_back(scales[0].data_ptr<double>());
  } else {
    std::vector<int64_t> row(scales.size(), 0);
    for (size_t t : layout.ball_tensor) out.next.push_back(scales[t].data_ptr<double>() + row[t]++);
  }
  for (size_t b = 0; b < num_balls; ++b) out.scale[b] = *out.next[b];
  std::vector<bool> has_elements(num_balls, false);
  for (const Segment& seg : layout.segments) has_elements[global_ball ? 0 : seg.ball] = true;
  for (size_t b = 0; b < num_balls; ++b) {
    if (!has_elements[b]) out.next[b] = nullptr;
  }
  return out;
}

// u of the compute type: next_norm_scale's band.
template <typename acc_t>
constexpr double unit_roundoff() {
  return std::is_same_v<acc_t, double> ? 0x1p-53 : 0x1p-24;
}

}  // namespace
}  // namespace fgfw
