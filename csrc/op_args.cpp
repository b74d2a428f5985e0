#include "op_args.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "philox.h"

namespace fgfw {
namespace {

bool is_param_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
}

void check_distribution(const char* op, int64_t distribution) {
  TORCH_CHECK(distribution == kGaussian || distribution == kRademacher, op,
              ": distribution must be 0 (gaussian) or 1 (rademacher), got ", distribution);
}

// A per-parameter tensor (momentum[t], grads[t]) must match its parameter's layout.
void check_companion(const char* op, const char* list, size_t t, const at::Tensor& tensor, const at::Tensor& param,
                     at::ScalarType dtype, const char* dtype_reason) {
  TORCH_CHECK(tensor.device() == param.device(), op, ": ", list, "[", t, "] must be on ",
              param.device(), " like params[", t, "], got ", tensor.device());
  TORCH_CHECK(tensor.scalar_type() == dtype, op, ": ", list, "[", t, "] must have dtype ", dtype,
              " (", dtype_reason, "), got ", tensor.scalar_type());
  TORCH_CHECK(tensor.numel() == param.numel(), op, ": ", list, "[", t, "] must have ",
              param.numel(), " elements like params[", t, "], got ", tensor.numel());
  TORCH_CHECK(tensor.is_contiguous(), op, ": ", list, "[", t, "] must be contiguous");
}

// params[t] must share params[0]'s device and dtype (one call per device and dtype) and be contiguous.
void check_param(const char* op, size_t t, const at::Tensor& p, c10::Device device, at::ScalarType dtype) {
  TORCH_CHECK(p.device() == device, op, ": params[", t, "] is on ", p.device(),
              " but params[0] is on ", device, " (one call per device)");
  TORCH_CHECK(p.scalar_type() == dtype, op, ": params[", t, "] has dtype ", p.scalar_type(),
              " but params[0] has ", dtype, " (one call per dtype)");
  TORCH_CHECK(p.is_contiguous(), op, ": params[", t, "] must be contiguous");
}

}  // namespace

void check_fill_tangent_args(const at::Tensor& out, int64_t offset, int64_t distribution) {
  TORCH_CHECK(is_param_dtype(out.scalar_type()),
              "fill_tangent_: out must be float32, float64, bfloat16 or float16, got ", out.scalar_type());
  TORCH_CHECK(offset >= 0, "fill_tangent_: offset must be >= 0, got ", offset);
  check_distribution("fill_tangent_", distribution);
}

void check_step_tensor(const at::Tensor& out, const at::Tensor& step) {
  TORCH_CHECK(step.scalar_type() == at::kLong && step.numel() == 1,
              "fill_tangent_at_step_: step must be an int64 tensor of one element (the step counter), got ",
              step.scalar_type(), " of shape ", step.sizes());
  TORCH_CHECK(step.device() == out.device() || step.is_cpu(), "fill_tangent_at_step_: step must be on ",
              out.device(), " like out, or on the CPU, got ", step.device());
}

void check_tangents_args(at::TensorList likes, c10::IntArrayRef tangent_ids, c10::IntArrayRef offsets) {
  TORCH_CHECK(likes.size() == offsets.size(), "tangents_at_step: one offset per tensor of likes, got ",
              offsets.size(), " offsets for ", likes.size(), " tensors");
  TORCH_CHECK(likes.size() == tangent_ids.size(), "tangents_at_step: one tangent id per tensor of likes, got ",
              tangent_ids.size(), " tangent ids for ", likes.size(), " tensors");
  for (const auto& like : likes) {
    TORCH_CHECK(like.device() == likes[0].device(), "tangents_at_step: every tensor of likes must be on ",
                likes[0].device(), ", got one on ", like.device());
  }
}

void check_fw_step_args(const char* op, at::TensorList params, at::TensorList momentum, at::TensorList grads,
                        const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                        bool global_ball, c10::IntArrayRef offsets, int64_t distribution, const at::Tensor& gap,
                        c10::IntArrayRef row_numel) {
  const size_t n = params.size();
  const c10::Device device = n ? params[0].device() : schedule.device();
  const bool forward_gradient = grads.empty();

  TORCH_CHECK(momentum.empty() || momentum.size() == n,
              op, ": momentum must be empty (no momentum) or hold one tensor per parameter (", n,
              "), got ", momentum.size());
  TORCH_CHECK(grads.empty() || grads.size() == n,
              op, ": grads must be empty (forward gradient) or hold one tensor per parameter (", n,
              "), got ", grads.size());
  TORCH_CHECK(row_numel.empty() || row_numel.size() == n,
              op, ": row_numel must be empty or hold one row length per parameter (", n, "), got ",
              row_numel.size());
  int64_t balls = 0;
  for (size_t t = 0; t < n; ++t) {
    const int64_t length = row_length(row_numel, t), numel = params[t].numel();
    TORCH_CHECK(length >= 0 && (length == 0 || numel % length == 0), op, ": row_numel[", t,
                "] must be 0 (one ball) or a row length that divides the ", numel, " elements of params[", t,
                "], got ", length);
    TORCH_CHECK(!global_ball || length == 0,
                op, ": row_numel must be all 0 for the global ball (one ball over every tensor)");
    balls += num_balls(numel, length);
  }
  if (global_ball) {
    TORCH_CHECK(radii.size() == 1, op, ": radii must hold one radius when global_ball is true, got ",
                radii.size());
  } else {
    TORCH_CHECK(static_cast<int64_t>(radii.size()) == balls, op, ": radii must hold one radius per ball (",
                balls, row_numel.empty() ? ", one per parameter" : ", one per row of each tensor with a row_numel",
                "), got ", radii.size());
  }
  for (size_t r = 0; r < radii.size(); ++r) {
    TORCH_CHECK(std::isfinite(radii[r]) && radii[r] > 0, op, ": radii[", r,
                "] must be a finite radius > 0, got ", radii[r]);
  }
  // Without offsets every tensor would draw the same tangent values: the forward gradient needs them.
  TORCH_CHECK(offsets.size() == n || (!forward_gradient && offsets.empty()),
              op, ": offsets must hold one stream offset per parameter (", n, "), got ", offsets.size(),
              forward_gradient ? "" : " (it may be empty when grads are given)");
  for (size_t t = 0; t < offsets.size(); ++t) {
    TORCH_CHECK(offsets[t] >= 0, op, ": offsets[", t, "] must be >= 0, got ", offsets[t]);
  }

  if (n > 0) {
    const at::ScalarType dtype = params[0].scalar_type();
    TORCH_CHECK(is_param_dtype(dtype), op, ": params must be float32, float64, bfloat16 or float16, got ",
                dtype);
    const at::ScalarType cdt = compute_dtype(dtype);
    for (size_t t = 0; t < n; ++t) {
      const at::Tensor& p = params[t];
      check_param(op, t, p, device, dtype);
      if (!momentum.empty()) {
        check_companion(op, "momentum", t, momentum[t], p, cdt, "the compute dtype of the params");
      }
      if (!forward_gradient) {
        check_companion(op, "grads", t, grads[t], p, dtype, "the params' dtype");
      }
    }
    if (forward_gradient) {
      check_distribution(op, distribution);
      TORCH_CHECK(tangent_coeffs.device() == device, op, ": tangent_coeffs must be on ", device,
                  " like the params, got ", tangent_coeffs.device());
      TORCH_CHECK(tangent_coeffs.scalar_type() == at::kDouble && tangent_coeffs.dim() == 1 &&
                      tangent_coeffs.numel() > 0 && tangent_coeffs.is_contiguous(),
                  op, ": tangent_coeffs must be a non-empty contiguous 1-D float64 tensor when grads "
                  "are empty, got ", tangent_coeffs.scalar_type(), " of shape ", tangent_coeffs.sizes());
    }
  }

  TORCH_CHECK(schedule.device() == device, op, ": schedule must be on ", device,
              " like the params, got ", schedule.device());
  check_schedule(op, schedule);
  TORCH_CHECK(gap.device() == device, op, ": gap must be on ", device, " like the params, got ",
              gap.device());
  TORCH_CHECK(gap.scalar_type() == at::kDouble && gap.numel() == 1,
              op, ": gap must be a float64 tensor of one element, got ", gap.scalar_type(), " of shape ",
              gap.sizes());
}

void check_schedule(const char* op, const at::Tensor& schedule) {
  TORCH_CHECK(schedule.scalar_type() == at::kDouble && (schedule.numel() == 3 || schedule.numel() == 4) &&
                  schedule.is_contiguous(),
              op, ": schedule must be a contiguous float64 tensor (step, alpha, gamma) or (step, alpha, gamma, "
              "skip), got ", schedule.scalar_type(), " of shape ", schedule.sizes());
}

void check_gradient_step_args(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                              const at::Tensor& schedule) {
  const char* const op = "gradient_step_";
  const size_t n = params.size();
  const c10::Device device = n ? params[0].device() : schedule.device();
  TORCH_CHECK(momentum.empty() || momentum.size() == n,
              op, ": momentum must be empty (no momentum) or hold one tensor per parameter (", n,
              "), got ", momentum.size());
  TORCH_CHECK(grads.size() == n, op, ": grads must hold one direction per parameter (", n, "), got ",
              grads.size());
  TORCH_CHECK(schedule.device() == device, op, ": schedule must be on ", device,
              " like the params, got ", schedule.device());
  check_schedule(op, schedule);
  if (n == 0) return;
  const at::ScalarType dtype = params[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              op, ": params must be float32 or float64 (the compute dtype: a half parameter steps its float32 "
              "master copy), got ", dtype);
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    check_param(op, t, p, device, dtype);
    if (!momentum.empty()) {
      check_companion(op, "momentum", t, momentum[t], p, dtype, "the params' dtype");
    }
    check_companion(op, "grads", t, grads[t], p, dtype, "the params' dtype");
  }
}

void check_scales(const char* op, at::TensorList params, at::TensorList scales, bool global_ball,
                  c10::IntArrayRef row_numel) {
  if (scales.empty()) return;
  const size_t want = global_ball ? 1 : params.size();
  TORCH_CHECK(scales.size() == want, op, ": scales must be empty (no norm feedback) or hold ",
              global_ball ? "one tensor for the global ball" : "one tensor per parameter", " (", want, "), got ",
              scales.size());
  for (size_t t = 0; t < scales.size(); ++t) {
    const int64_t balls = global_ball ? 1 : num_balls(params[t].numel(), row_length(row_numel, t));
    const at::Tensor& x = scales[t];
    TORCH_CHECK(x.scalar_type() == at::kDouble && x.numel() == balls && x.is_contiguous(), op, ": scales[", t,
                "] must be a contiguous float64 tensor of ", balls, " element(s) (one per ball), got ",
                x.scalar_type(), " of shape ", x.sizes());
    TORCH_CHECK(params.empty() || x.device() == params[0].device(), op, ": scales[", t, "] must be on ",
                params[0].device(), " like the params, got ", x.device());
  }
}

void check_lp_exponent(double p) {
  TORCH_CHECK(p > 1 && std::isfinite(p), "lp_fw_step_: p must satisfy 1 < p < inf (p = 1 and inf are the L1 and "
              "L-infinity steps), got ", p);
}

void check_ksparse_k(int64_t k) { TORCH_CHECK(k >= 1, "ksparse_fw_step_: k must be >= 1, got ", k); }

}  // namespace fgfw
