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

// Same for l1_fw_step_; every tensor must be on the device of params[0] (of schedule when params
// is empty). Does not read any tensor's data, so it never synchronises a device.
void check_l1_fw_step_args(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                           const at::Tensor& schedule, const at::Tensor& tangent_coeffs,
                           c10::ArrayRef<double> radii, bool global_ball, c10::IntArrayRef offsets,
                           int64_t distribution, const at::Tensor& gap);

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
