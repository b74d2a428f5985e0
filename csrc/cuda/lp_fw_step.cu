// lp_fw_step_ on CUDA: the fused Frank-Wolfe step of the Lp balls, 1 < p < inf (python/fgfw/reference.py is the
// spec). Its design, and the parts it shares with the other sets' steps: set_step.cuh; docs/set_steps.md.
#include "cuda/set_step.cuh"

namespace fgfw {
namespace {

// ---- Lp -------------------------------------------------------------------------------------------------

// The exponent q = p / (p - 1) and what the kernels derive from it, computed once on the host.
struct LpExponent {
  double q, q_minus_1, inv_q, p;
  bool q_is_2;  // p = 2: y^2 as y * y, the norm as sqrt, and (x / N)^1 as x / N
};

// y^q for y in [0, 1] (or NaN).
__device__ __forceinline__ double pow_q(double y, const LpExponent& lp) { return lp.q_is_2 ? rn_mul(y, y) : pow(y, lp.q); }

// Pass 1: directions (and the momentum), then per slice m = max|d| and S = sum (|d| / m)^q (S = 0 when
// m = 0; NaN when m is, or when some |d| is infinite).
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kSliceThreads, kMinSliceBlocks<scalar_t>)
    lp_reduce_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule, Tangents tangents,
                     LpExponent lp, const double* __restrict__ skip, double* __restrict__ slot_max,
                     double* __restrict__ slot_sum) {
  using acc_t = acc_type<scalar_t>;
  using Key = AbsKey<acc_t>;
  __shared__ acc_t d_slice[kSlice];
  if (skipped(skip)) return;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const int n = static_cast<int>(slice.end - slice.begin);
    slice_directions<scalar_t, kSource, kMomentum, false>(table.entry[slice.entry], slice.begin, slice.end, sc,
                                                          tangents, d_slice);
    __syncthreads();
    typename Key::type max_key = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const typename Key::type key = Key::of(d_slice[i]);
      max_key = key > max_key ? key : max_key;
    }
    max_key = block_reduce<kSliceThreads>(max_key, MaxOp{}, typename Key::type(0));
    const double m = static_cast<double>(Key::value(max_key));  // NaN when some d is NaN
    double sum = 0.0;
    if (m != 0.0) {  // the same for every thread of the block
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        sum = rn_add(sum, pow_q(rn_div(fabs(static_cast<double>(d_slice[i])), m), lp));
      }
    }
    sum = block_reduce<kSliceThreads>(sum, SumOp{}, 0.0);  // also: every read of d_slice is done
    if (threadIdx.x == 0) {
      slot_max[s] = m;
      slot_sum[s] = sum;
    }
  }
}

// A warp per ball: M = max of its slices' m (NaN if any is), ||x||_q^q = sum S (m / M)^q over its
// slices in slot order (a fixed tree), N = that to the 1/q. M = 0 (d = 0 on the whole ball) gives N = 0.
__global__ void __launch_bounds__(kBallThreads)
    lp_ball_kernel(const __grid_constant__ EntryTable table, GlobalBall global, LpExponent lp,
                   const double* __restrict__ skip, const double* __restrict__ slot_max,
                   const double* __restrict__ slot_sum, double* __restrict__ ball_max, double* __restrict__ ball_norm) {
  using Key = AbsKey<double>;
  if (skipped(skip)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    const BallInfo ball = ball_info(table, global, id);
    Key::type max_key = 0;
    for (int64_t c = ball.slot_begin + lane; c < ball.slot_end; c += 32) {
      const Key::type key = Key::of(slot_max[c]);
      max_key = key > max_key ? key : max_key;
    }
    max_key = warp_reduce(max_key, MaxOp{});
    max_key = __shfl_sync(0xffffffffu, max_key, 0);
    const double big_m = Key::value(max_key);
    double sum = 0.0;
    for (int64_t c = ball.slot_begin + lane; c < ball.slot_end; c += 32) {
      const double m = slot_max[c];
      if (m != 0.0) sum = rn_add(sum, rn_mul(slot_sum[c], pow_q(rn_div(m, big_m), lp)));
    }
    sum = warp_reduce(sum, SumOp{});
    if (lane == 0) {
      ball_max[id] = big_m;
      ball_norm[id] = lp.q_is_2 ? sqrt(sum) : pow(sum, lp.inv_q);
    }
  }
}

// (|x| / r)^p: the Lp norm feedback's terms (y * y for p = 2).
__device__ __forceinline__ double pow_p(double y, const LpExponent& lp) { return lp.q_is_2 ? rn_mul(y, y) : pow(y, lp.p); }

// Pass 2: the directions again, s_i = -r sign(d_i) (|d_i| / M / N)^(q-1) (0 when M = 0), the update and
// the slice's share of the gap; with scales, the slice's sums of (|theta| / r)^p of the values stored and of
// the exact step (slot_stored, slot_exact). One block fewer per SM than the other slice kernels: with four,
// the float Gaussian variant spilled around its pow calls (tests/test_kernel_resources.py).
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kSliceThreads, kMinSliceBlocks<scalar_t> - 1)
    lp_update_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule, Tangents tangents,
                     LpExponent lp, const double* __restrict__ skip, const double* __restrict__ ball_max,
                     const double* __restrict__ ball_norm, double* __restrict__ slot_gap,
                     double* __restrict__ slot_stored, double* __restrict__ slot_exact) {
  using acc_t = acc_type<scalar_t>;
  __shared__ acc_t d_slice[kSlice];
  if (skipped(skip)) return;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const Entry& entry = table.entry[slice.entry];
    slice_directions<scalar_t, kSource, kMomentum, true>(entry, slice.begin, slice.end, sc, tangents, d_slice);
    __syncthreads();
    scalar_t* const theta = static_cast<scalar_t*>(entry.theta);
    const double big_m = ball_max[slice.ball_id], norm = ball_norm[slice.ball_id];
    const double minus_r = -entry.radius;
    const double scale = slice_scale(table, slice);
    double gap = 0.0, stored_sum = 0.0, exact_sum = 0.0;
    for (int64_t j = slice.begin + threadIdx.x; j < slice.end; j += blockDim.x) {
      const acc_t d = d_slice[j - slice.begin];
      double vertex = 0.0;  // the reference's zero vertex when d = 0 on the whole ball
      if (big_m != 0.0) {
        const double y = rn_div(rn_div(fabs(static_cast<double>(d)), big_m), norm);
        const double power = lp.q_is_2 ? y : pow(y, lp.q_minus_1);
        vertex = rn_mul(rn_mul(minus_r, sign_of(static_cast<double>(d))), power);
      }
      acc_t stored;
      double exact;
      gap = rn_add(gap, update_element<false>(theta, j, d, vertex, sc, scale, acc_t(0), entry.radius, stored, exact));
      if (entry.scale) {
        stored_sum = rn_add(stored_sum, pow_p(rn_div(fabs(static_cast<double>(stored)), entry.radius), lp));
        exact_sum = rn_add(exact_sum, pow_p(rn_div(fabs(exact), entry.radius), lp));
      }
    }
    gap = block_reduce<kSliceThreads>(gap, SumOp{}, 0.0);  // also: every read of d_slice is done
    if (threadIdx.x == 0) slot_gap[s] = gap;
    if (entry.scale) {
      stored_sum = block_reduce<kSliceThreads>(stored_sum, SumOp{}, 0.0);
      exact_sum = block_reduce<kSliceThreads>(exact_sum, SumOp{}, 0.0);
      if (threadIdx.x == 0) {
        slot_stored[s] = stored_sum;
        slot_exact[s] = exact_sum;
      }
    }
  }
}

// ---- Host side -----------------------------------------------------------------------------------------

template <typename scalar_t, Source kSource, bool kMomentum>
void launch_lp_step(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                    const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                    c10::IntArrayRef offsets, int64_t seed, const at::Tensor& gap, c10::IntArrayRef row_numel, double p,
                    at::TensorList scales) {
  SetStepLaunch<scalar_t, kSource> step(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                                        seed, row_numel, scales);
  if (step.empty()) {  // every tensor is empty
    write_empty_gap(gap, schedule);
    return;
  }
  const Plan& plan = step.plan;
  const size_t slot_max_at = step.layout.take(sizeof(double) * plan.num_slices);
  const size_t slot_sum_at = step.layout.take(sizeof(double) * plan.num_slices);
  const size_t ball_max_at = step.layout.take(sizeof(double) * plan.num_balls);
  const size_t ball_norm_at = step.layout.take(sizeof(double) * plan.num_balls);
  step.allocate(params[0]);
  double* const slot_max = step.template at<double>(slot_max_at);
  double* const slot_sum = step.template at<double>(slot_sum_at);
  double* const ball_max = step.template at<double>(ball_max_at);
  double* const ball_norm = step.template at<double>(ball_norm_at);
  const Launcher& launcher = step.launcher;
  const cudaStream_t stream = step.stream;

  const double q = p / (p - 1);  // as reference.lp_vertex computes it: 2.0 exactly for p = 2
  const LpExponent lp{q, q - 1, 1.0 / q, p, q == 2.0};
  for_each_table(plan, [&](const EntryTable& table) {
    lp_reduce_kernel<scalar_t, kSource, kMomentum>
        <<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, step.schedule, step.tangents, lp, step.skip,
                                                                   slot_max, slot_sum);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
    lp_ball_kernel<<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(table, global, lp, step.skip, slot_max,
                                                                          slot_sum, ball_max, ball_norm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  for_each_table(plan, [&](const EntryTable& table) {
    lp_update_kernel<scalar_t, kSource, kMomentum>
        <<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, step.schedule, step.tangents, lp, step.skip,
                                                                   ball_max, ball_norm, step.slot_gap,
                                                                   step.slot_stored, step.slot_exact);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  step.template finish<false>(global_ball, p, 0, gap);
}

void lp_fw_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads, const at::Tensor& schedule,
                     const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii, bool global_ball,
                     c10::IntArrayRef offsets, int64_t seed, int64_t distribution, const at::Tensor& gap,
                     c10::IntArrayRef row_numel, double p, at::TensorList scales) {
  check_set_step_args("lp_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                      distribution, gap, row_numel, scales);
  check_lp_exponent(p);
  dispatch_set_step(params, momentum, grads, schedule, distribution, gap,
                    [&](auto* tag, auto source, auto with_momentum) {
    launch_lp_step<std::remove_pointer_t<decltype(tag)>, decltype(source)::value, decltype(with_momentum)::value>(
        params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, gap, row_numel, p,
        scales);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("lp_fw_step_", &lp_fw_step_cuda);
}

}  // namespace fgfw
