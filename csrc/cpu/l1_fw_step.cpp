// l1_fw_step_ on the CPU: one fused Frank-Wolfe step over L1 ball(s) for a group of tensors.
// One pass over each element regenerates u (never stored), updates v, scales theta, and reduces
// the argmax |d| and <d, theta_old>; then only the winning element(s) move to the vertex.
// The arithmetic follows python/fgfw/reference.py operation by operation (same roundings, no FMA).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "op_args.h"
#include "philox.h"

namespace fgfw {
namespace {

// The unit of parallel work and of partial results: a piece of at most kSegment elements of one
// tensor. The split does not depend on the thread count and the partials are combined in index
// order, so the results (argmax ties, the gap's rounding) are the same for any number of threads.
constexpr int64_t kSegment = 1 << 14;
// Below this many elements in the whole group, the step runs on the calling thread.
constexpr int64_t kParallelMin = 1 << 15;

struct Segment {
  size_t tensor;
  int64_t begin, end;
};

template <typename acc_t>
struct Partial {
  acc_t best_abs = -1;  // any |d| (>= 0, or NaN) beats it
  int64_t best_index = -1;
  acc_t best_d = 0;
  double dot = 0;  // <d, theta_old>, in float64 as reference.py sums it
};

// Whether |d| = a beats the best so far, b, in argmax |d|: larger, or NaN against a number
// (torch.argmax's rule). Equal values never beat, so visiting candidates in index order makes the
// lowest index win ties.
template <typename T>
bool beats(T a, T b) {
  return (std::isnan(a) && !std::isnan(b)) || a > b;
}

template <typename acc_t>
void take_best(Partial<acc_t>& into, const Partial<acc_t>& from) {
  if (beats(from.best_abs, into.best_abs)) {
    into.best_abs = from.best_abs;
    into.best_index = from.best_index;
    into.best_d = from.best_d;
  }
}

// torch.sign: 0 for 0 and for NaN.
template <typename T>
T sign_of(T x) {
  return static_cast<T>((x > T(0)) - (x < T(0)));
}

template <typename scalar_t>
void l1_fw_step_kernel(at::TensorList params, at::TensorList momentum, at::TensorList grads, const double* schedule,
                       const double* tangent_coeffs, int64_t num_tangents, c10::ArrayRef<double> radii,
                       bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                       double* gap) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const size_t n = params.size();
  const int64_t step = static_cast<int64_t>(schedule[0]);
  const acc_t alpha = static_cast<acc_t>(schedule[1]);
  const acc_t gamma = static_cast<acc_t>(schedule[2]);
  const acc_t one_minus_alpha = acc_t(1) - alpha;
  const acc_t one_minus_gamma = acc_t(1) - gamma;
  const bool forward_gradient = grads.empty();

  std::vector<TangentStream> streams;
  std::vector<acc_t> coeffs;
  if (forward_gradient) {
    for (int64_t k = 0; k < num_tangents; ++k) {
      streams.emplace_back(seed, step, k);
      coeffs.push_back(static_cast<acc_t>(tangent_coeffs[k]));
    }
  }

  std::vector<Segment> segments;
  int64_t total = 0;
  for (size_t t = 0; t < n; ++t) {
    const int64_t numel = params[t].numel();
    total += numel;
    for (int64_t begin = 0; begin < numel; begin += kSegment) {
      segments.push_back({t, begin, std::min(begin + kSegment, numel)});
    }
  }
  std::vector<Partial<acc_t>> partials(segments.size());

  auto run_segment = [&](const Segment& seg, Partial<acc_t>& part) {
    scalar_t* theta = params[seg.tensor].data_ptr<scalar_t>();
    acc_t* v = momentum.empty() ? nullptr : momentum[seg.tensor].data_ptr<acc_t>();
    // Element j with direction estimate g: d = g or the updated momentum, then theta's scaling.
    auto update = [&](int64_t j, acc_t g) {
      acc_t d = g;
      if (v) {
        d = one_minus_gamma * v[j] + gamma * g;
        v[j] = d;
      }
      const acc_t theta_old = static_cast<acc_t>(theta[j]);
      part.dot += static_cast<double>(d) * static_cast<double>(theta_old);
      theta[j] = static_cast<scalar_t>(one_minus_alpha * theta_old);
      const acc_t abs_d = std::abs(d);
      if (beats(abs_d, part.best_abs)) {
        part.best_abs = abs_d;
        part.best_index = j;
        part.best_d = d;
      }
    };

    if (!forward_gradient) {
      const scalar_t* grad = grads[seg.tensor].data_ptr<scalar_t>();
      for (int64_t j = seg.begin; j < seg.end; ++j) update(j, static_cast<acc_t>(grad[j]));
      return;
    }
    // g = sum_k coeff_k u_k, accumulated in k order; one Philox call per tangent serves the
    // (up to) four elements of the call that lie in this segment.
    const uint64_t offset = static_cast<uint64_t>(offsets[seg.tensor]);
    for (int64_t j = seg.begin; j < seg.end;) {
      const uint64_t i = offset + static_cast<uint64_t>(j);
      const int first_lane = static_cast<int>(i % 4);
      const int lanes = static_cast<int>(std::min<int64_t>(4 - first_lane, seg.end - j));
      acc_t g[4];
      for (size_t k = 0; k < streams.size(); ++k) {
        float u[4];
        streams[k].values(i / 4, distribution, u);
        for (int lane = first_lane; lane < first_lane + lanes; ++lane) {
          const acc_t term = coeffs[k] * static_cast<acc_t>(u[lane]);
          g[lane] = k == 0 ? term : g[lane] + term;
        }
      }
      for (int l = 0; l < lanes; ++l) update(j + l, g[first_lane + l]);
      j += lanes;
    }
  };

  auto run_segments = [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) run_segment(segments[s], partials[s]);
  };
  const int64_t num_segments = static_cast<int64_t>(segments.size());
  if (total < kParallelMin) {
    run_segments(0, num_segments);
  } else {
    at::parallel_for(0, num_segments, 1, run_segments);
  }

  std::vector<Partial<acc_t>> per_tensor(n);
  for (size_t s = 0; s < segments.size(); ++s) {
    Partial<acc_t>& best = per_tensor[segments[s].tensor];
    best.dot += partials[s].dot;
    take_best(best, partials[s]);
  }

  double total_gap = 0;
  for (const Partial<acc_t>& best : per_tensor) total_gap += best.dot;

  // theta_i* += alpha * s_i* with s = -r sign(d_i*) e_i*; returns the vertex's gap term r |d_i*|.
  auto vertex_update = [&](size_t t, double radius) {
    const Partial<acc_t>& best = per_tensor[t];
    scalar_t* theta = params[t].data_ptr<scalar_t>();
    const acc_t s = -static_cast<acc_t>(radius) * sign_of(best.best_d);
    theta[best.best_index] = static_cast<scalar_t>(static_cast<acc_t>(theta[best.best_index]) + alpha * s);
    return static_cast<double>(std::abs(best.best_d)) * radius;
  };

  if (global_ball) {
    // Tensors in parameter order: the first tensor holding the maximum has the lowest global index.
    size_t winner = n;
    for (size_t t = 0; t < n; ++t) {
      if (per_tensor[t].best_index >= 0 && (winner == n || beats(per_tensor[t].best_abs, per_tensor[winner].best_abs))) {
        winner = t;
      }
    }
    if (winner < n) total_gap += vertex_update(winner, radii[0]);
  } else {
    for (size_t t = 0; t < n; ++t) {
      if (per_tensor[t].best_index >= 0) total_gap += vertex_update(t, radii[t]);
    }
  }
  *gap = total_gap;
}

void l1_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                    const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                    c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap) {
  check_l1_fw_step_args(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, distribution,
                        gap);
  double* gap_out = gap.data_ptr<double>();
  if (params.empty()) {
    *gap_out = 0;
    return;
  }
  const bool forward_gradient = grads.empty();
  const double* coeffs = forward_gradient ? tangent_coeffs.data_ptr<double>() : nullptr;
  const int64_t num_tangents = forward_gradient ? tangent_coeffs.numel() : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[0].scalar_type(), "l1_fw_step_cpu", [&] {
    l1_fw_step_kernel<scalar_t>(params, momentum, grads, schedule.data_ptr<double>(), coeffs, num_tangents, radii,
                                global_ball, offsets, seed, distribution, gap_out);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("l1_fw_step_", &l1_fw_step_cpu);
}

}  // namespace fgfw
