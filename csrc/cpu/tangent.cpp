// fill_tangent_ on the CPU: materialises the tangent stream (philox.h) for the forward-mode JVP.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "op_args.h"
#include "philox.h"

namespace fgfw {
namespace {

// Philox calls (4 elements each) per parallel task: enough work to pay for a thread hand-off.
constexpr int64_t kCallsPerTask = 2048;

template <typename out_t>
void fill_tangent_kernel(out_t* out, int64_t numel, const TangentStream& stream, int64_t offset,
                         int64_t distribution) {
  const int64_t first_call = offset / 4;
  const int64_t last_call = (offset + numel - 1) / 4;
  at::parallel_for(first_call, last_call + 1, kCallsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      float u[4];
      stream.values(static_cast<uint64_t>(q), distribution, u);
      for (int lane = 0; lane < 4; ++lane) {
        const int64_t j = 4 * q + lane - offset;
        if (j >= 0 && j < numel) out[j] = static_cast<out_t>(u[lane]);
      }
    }
  });
}

void fill_tangent_cpu(const at::Tensor& out, int64_t seed, int64_t step, int64_t tangent_id, int64_t offset,
                      int64_t distribution) {
  check_fill_tangent_args(out, offset, distribution);
  if (out.numel() == 0) return;
  const TangentStream stream(seed, step, tangent_id);
  write_contiguous(out, [&](const at::Tensor& dst) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "fill_tangent_cpu", [&] {
      fill_tangent_kernel(dst.data_ptr<scalar_t>(), dst.numel(), stream, offset, distribution);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("fill_tangent_", &fill_tangent_cpu);
}

}  // namespace fgfw
