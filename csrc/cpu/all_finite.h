// all_finite_cpu (all_finite.cpp), the CPU kernel of the op all_finite, which nonfinite.cpp negates.
#pragma once

#include <ATen/core/Tensor.h>

namespace fgfw {

// Whether every element of every tensor (on the CPU) is finite; integers and bools are.
bool all_finite_cpu(at::TensorList tensors);

}  // namespace fgfw
