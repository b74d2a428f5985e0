// linf_fw_step_ on CUDA: the fused Frank-Wolfe step of the L-infinity balls (python/fgfw/reference.py is the
// spec). Its design, and the parts it shares with the other sets' steps: set_step.cuh; docs/set_steps.md.
#include "cuda/set_step.cuh"

namespace fgfw {
namespace {

// ---- L-infinity -----------------------------------------------------------------------------------------

// One pass: s = -r sign(d) per element; slot_gap[s] = the slice's share of the gap.
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kSliceThreads, kMinSliceBlocks<scalar_t>)
    linf_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule, Tangents tangents,
                const double* __restrict__ skip, double* __restrict__ slot_gap) {
  using acc_t = acc_type<scalar_t>;
  __shared__ acc_t d_slice[kSlice];
  if (skipped(skip)) return;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const Entry& entry = table.entry[slice.entry];
    slice_directions<scalar_t, kSource, kMomentum, false>(entry, slice.begin, slice.end, sc, tangents, d_slice);
    __syncthreads();
    scalar_t* const theta = static_cast<scalar_t*>(entry.theta);
    const double minus_r = -entry.radius;
    const acc_t bound = radius_down<acc_t>(entry.radius);
    double gap = 0.0;
    for (int64_t j = slice.begin + threadIdx.x; j < slice.end; j += blockDim.x) {
      const acc_t d = d_slice[j - slice.begin];
      acc_t stored;
      double exact;
      gap = rn_add(gap, update_element<true>(theta, j, d, rn_mul(minus_r, sign_of(static_cast<double>(d))), sc, 1.0,
                                             bound, entry.radius, stored, exact));
    }
    gap = block_reduce<kSliceThreads>(gap, SumOp{}, 0.0);  // also: every read of d_slice is done
    if (threadIdx.x == 0) slot_gap[s] = gap;
  }
}

// ---- Host side -----------------------------------------------------------------------------------------

template <typename scalar_t, Source kSource, bool kMomentum>
void launch_linf_step(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                      const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                      c10::IntArrayRef offsets, int64_t seed, const at::Tensor& gap, c10::IntArrayRef row_numel) {
  SetStepLaunch<scalar_t, kSource> step(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                                        seed, row_numel, at::TensorList());
  if (step.empty()) {  // every tensor is empty
    write_empty_gap(gap, schedule);
    return;
  }
  step.allocate(params[0]);
  for_each_table(step.plan, [&](const EntryTable& table) {
    linf_kernel<scalar_t, kSource, kMomentum><<<step.launcher.slice_grid(table), kSliceThreads, 0, step.stream>>>(
        table, step.schedule, step.tangents, step.skip, step.slot_gap);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  step.template finish<false>(global_ball, 0.0, 0, gap);
}

void linf_fw_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                       const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                       c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                       c10::IntArrayRef row_numel) {
  check_set_step_args("linf_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                      distribution, gap, row_numel, {});
  dispatch_set_step(params, momentum, grads, schedule, distribution, gap,
                    [&](auto* tag, auto source, auto with_momentum) {
    launch_linf_step<std::remove_pointer_t<decltype(tag)>, decltype(source)::value, decltype(with_momentum)::value>(
        params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, gap, row_numel);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("linf_fw_step_", &linf_fw_step_cuda);
}

}  // namespace fgfw
