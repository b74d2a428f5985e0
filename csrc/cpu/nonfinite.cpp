// nonfinite on the CPU: whether some element of some tensor is not finite, as a 0-dim bool tensor (the skip flag of
// a step): all_finite's verdict (all_finite.cpp), negated.
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "all_finite.h"

namespace fgfw {
namespace {

at::Tensor nonfinite_cpu(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "nonfinite: tensors must not be empty (the verdict's device comes from them)");
  return at::scalar_tensor(!all_finite_cpu(tensors), at::TensorOptions().dtype(at::kBool));
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("nonfinite", &nonfinite_cpu);
}

}  // namespace fgfw
