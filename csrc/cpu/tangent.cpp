// fill_tangent_ on the CPU: materialises the tangent stream for the forward-mode JVP, with the
// block generator of tangent_block.h, so its values are bit for bit the u that l1_fw_step_
// regenerates for the update.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "op_args.h"
#include "philox.h"
#include "tangent_block.h"

namespace fgfw {
namespace {

// Philox calls (4 elements each) per parallel task: enough work to pay for a thread hand-off.
constexpr int64_t kCallsPerTask = 2048;
// Philox calls per block of the generator; its buffers stay in L1.
constexpr int kBlockCalls = 128;

template <Distribution kDistribution, typename out_t>
void fill_tangent_kernel(out_t* out, int64_t numel, const TangentStream& stream, int64_t offset) {
  const int64_t first_call = offset / 4;
  const int64_t last_call = (offset + numel - 1) / 4;
  at::parallel_for(first_call, last_call + 1, kCallsPerTask, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t words[4][kBlockCalls];
    alignas(64) float u[4 * kBlockCalls];
    for (int64_t q0 = begin; q0 < end; q0 += kBlockCalls) {
      const int n = static_cast<int>(std::min<int64_t>(kBlockCalls, end - q0));
      cpu::philox_block(stream, static_cast<uint64_t>(q0), n, words);
      cpu::tangent_block<kDistribution>(words, n, u);
      // u[e] is element 4 q0 + e of the stream, out[4 q0 + e - offset]; the first and the last call
      // of the stream's range reach outside out when offset or offset + numel is not a multiple of 4.
      const int64_t base = 4 * q0 - offset;
      const int64_t lo = std::max<int64_t>(base, 0);
      const int64_t hi = std::min<int64_t>(base + 4 * n, numel);
      for (int64_t j = lo; j < hi; ++j) out[j] = static_cast<out_t>(u[j - base]);
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
      scalar_t* const data = dst.data_ptr<scalar_t>();
      if (distribution == kRademacher) {
        fill_tangent_kernel<kRademacher>(data, dst.numel(), stream, offset);
      } else {
        fill_tangent_kernel<kGaussian>(data, dst.numel(), stream, offset);
      }
    });
  });
}

void fill_tangent_at_step_cpu(const at::Tensor& out, int64_t seed, const at::Tensor& step, int64_t tangent_id,
                              int64_t offset, int64_t distribution) {
  check_step_tensor(out, step);
  fill_tangent_cpu(out, seed, step.item<int64_t>(), tangent_id, offset, distribution);
}

std::vector<at::Tensor> tangents_at_step_cpu(at::TensorList likes, int64_t seed, const at::Tensor& step,
                                             at::IntArrayRef tangent_ids, at::IntArrayRef offsets,
                                             int64_t distribution) {
  check_tangents_args(likes, tangent_ids, offsets);
  std::vector<at::Tensor> out;
  out.reserve(likes.size());
  if (likes.empty()) return out;
  check_step_tensor(likes[0], step);
  const int64_t at_step = step.item<int64_t>();
  for (size_t i = 0; i < likes.size(); ++i) {
    out.push_back(at::empty_like(likes[i]));
    fill_tangent_cpu(out.back(), seed, at_step, tangent_ids[i], offsets[i], distribution);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("fill_tangent_", &fill_tangent_cpu);
  m.impl("fill_tangent_at_step_", &fill_tangent_at_step_cpu);
  m.impl("tangents_at_step", &tangents_at_step_cpu);
}

}  // namespace fgfw
