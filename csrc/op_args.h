// Argument checks and conventions shared by every backend's kernels (cpu/, cuda/), so that all
// backends accept and reject the same inputs with the same messages.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

namespace fgfw {

// Arithmetic and momentum dtype for a parameter dtype: float64 stays, everything else is float32.
inline at::ScalarType compute_dtype(at::ScalarType param_dtype) {
  return param_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// Throws c10::Error (RuntimeError in Python) naming the offending argument.
void check_fill_tangent_args(const at::Tensor& out, int64_t offset, int64_t distribution);

// The step tensor of fill_tangent_at_step_: a 0-dim int64 tensor on out's device or on the CPU.
void check_step_tensor(const at::Tensor& out, const at::Tensor& step);

// tangents_at_step: one tangent id and one offset per tensor of likes, all of them on one device.
void check_tangents_args(at::TensorList likes, c10::IntArrayRef tangent_ids, c10::IntArrayRef offsets);

// Same for the steps (op: l1_fw_step_, linf_fw_step_, lp_fw_step_ or ksparse_fw_step_, named in the
// messages); every tensor must be on the device of params[0] (of schedule when params is empty). Does
// not read any tensor's data, so it never synchronises a device.
void check_fw_step_args(const char* op, at::TensorList params, at::TensorList momentum, at::TensorList grads,
                        const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                        bool global_ball, c10::IntArrayRef offsets, int64_t distribution, const at::Tensor& gap,
                        c10::IntArrayRef row_numel);

// The schedule of every step: a contiguous float64 tensor (step, alpha, gamma) or (step, alpha, gamma, skip);
// a step whose skip is not 0 writes nothing but NaN into its gap (reference.schedule_values).
void check_schedule(const char* op, const at::Tensor& schedule);

// gradient_step_'s arguments: float32 or float64 params (the compute dtype), momentum empty or one per param,
// one direction per param, all of the params' dtype, device and numel, contiguous.
void check_gradient_step_args(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                              const at::Tensor& schedule);

// The norm feedback's state of lp_fw_step_ and ksparse_fw_step_: empty, or float64 tensors on the params' device,
// contiguous, one per parameter with one element per ball of it (one tensor of one element for the global ball).
void check_scales(const char* op, at::TensorList params, at::TensorList scales, bool global_ball,
                  c10::IntArrayRef row_numel);

// The set parameters of lp_fw_step_ (1 < p < inf) and ksparse_fw_step_ (k >= 1).
void check_lp_exponent(double p);
void check_ksparse_k(int64_t k);

// The row length of tensor t's balls: 0 when the tensor is one ball (row_numel empty or 0).
inline int64_t row_length(c10::IntArrayRef row_numel, size_t t) {
  return row_numel.empty() ? 0 : row_numel[t];
}

// The number of balls of a tensor of numel elements whose balls are rows of row_length elements.
inline int64_t num_balls(int64_t numel, int64_t row_length) {
  return row_length == 0 ? 1 : numel / row_length;
}

// Runs write(dst) on out itself when it is contiguous, else on a contiguous copy that is copied
// back: kernels address elements by flat index, while the op's contract is out's logical order.
template <typename Write>
void write_contiguous(const at::Tensor& out, Write&& write) {
  if (out.is_contiguous()) {
    write(out);
    return;
  }
  const at::Tensor dst = out.contiguous();
  write(dst);
  out.copy_(dst);
}

}  // namespace fgfw
