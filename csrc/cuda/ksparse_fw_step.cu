// ksparse_fw_step_ on CUDA: the fused Frank-Wolfe step of the k-sparse polytopes (python/fgfw/reference.py is the
// spec). Its design, and the parts it shares with the other sets' steps: set_step.cuh; docs/set_steps.md.
#include "cuda/set_step.cuh"

namespace fgfw {
namespace {

// ---- k-sparse -------------------------------------------------------------------------------------------

// Pass 1: the directions (and the momentum) into the direction workspace.
template <typename scalar_t, Source kSource, bool kMomentum>
__global__ void __launch_bounds__(kSliceThreads, kMinSliceBlocks<scalar_t>)
    ksparse_direction_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule,
                             Tangents tangents, const double* __restrict__ skip) {
  using acc_t = acc_type<scalar_t>;
  if (skipped(skip)) return;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const Entry& entry = table.entry[slice.entry];
    slice_directions<scalar_t, kSource, kMomentum, false>(entry, slice.begin, slice.end, sc, tangents,
                                                          static_cast<acc_t*>(entry.dir) + slice.begin);
  }
}

// A warp per ball: prefix 0, remaining = min(k, ball size), an empty histogram.
__global__ void __launch_bounds__(kBallThreads)
    ksparse_init_kernel(const __grid_constant__ EntryTable table, GlobalBall global, int64_t k,
                        const double* __restrict__ skip, unsigned long long* __restrict__ ball_prefix,
                        unsigned long long* __restrict__ ball_remaining, unsigned long long* __restrict__ ball_hist) {
  if (skipped(skip)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    const BallInfo ball = ball_info(table, global, id);
    if (lane == 0) {
      ball_prefix[id] = 0;
      ball_remaining[id] = static_cast<unsigned long long>(k < ball.numel ? k : ball.numel);  // >= 1
    }
    for (int bin = lane; bin < kBins; bin += 32) ball_hist[id * kBins + bin] = 0;
  }
}

// One digit pass: the histogram of digit (key >> shift) & 0xff over the keys whose bits above the digit
// (high_mask) equal the ball's prefix. Per slice in shared memory, then added to the ball's.
template <typename acc_t>
__global__ void __launch_bounds__(kSliceThreads)
    ksparse_hist_kernel(const __grid_constant__ EntryTable table, int shift, unsigned long long high_mask,
                        const double* __restrict__ skip, const unsigned long long* __restrict__ ball_prefix,
                        unsigned long long* __restrict__ ball_hist) {
  using Key = AbsKey<acc_t>;
  __shared__ unsigned int hist[kBins];  // a slice has at most kSlice elements: no overflow
  if (skipped(skip)) return;
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const acc_t* const dir = static_cast<const acc_t*>(table.entry[slice.entry].dir);
    for (int bin = threadIdx.x; bin < kBins; bin += blockDim.x) hist[bin] = 0u;
    __syncthreads();
    const unsigned long long prefix = ball_prefix[slice.ball_id] & high_mask;
    for (int64_t j = slice.begin + threadIdx.x; j < slice.end; j += blockDim.x) {
      const unsigned long long key = Key::of(dir[j]);
      if ((key & high_mask) == prefix) atomicAdd(&hist[(key >> shift) & (kBins - 1)], 1u);
    }
    __syncthreads();
    unsigned long long* const ball = ball_hist + slice.ball_id * kBins;
    for (int bin = threadIdx.x; bin < kBins; bin += blockDim.x) {
      if (hist[bin] != 0u) atomicAdd(ball + bin, static_cast<unsigned long long>(hist[bin]));
    }
    __syncthreads();  // hist is zeroed for the next slice
  }
}

// One digit pass, a warp per ball: walking the bins from the largest digit down, the bin where the count
// of keys reaches `remaining` holds the k-th largest key; its digit joins the prefix, and remaining
// drops by the count of larger keys. Then the histogram is zeroed for the next pass. Lane l owns bins
// 8 l .. 8 l + 7. Invariant: at least `remaining` keys match the prefix, so exactly one lane finds it.
__global__ void __launch_bounds__(kBallThreads)
    ksparse_select_kernel(const __grid_constant__ EntryTable table, GlobalBall global, int shift,
                          const double* __restrict__ skip, unsigned long long* __restrict__ ball_prefix,
                          unsigned long long* __restrict__ ball_remaining, unsigned long long* __restrict__ ball_hist) {
  constexpr int kPerLane = kBins / 32;
  if (skipped(skip)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    unsigned long long* const hist = ball_hist + id * kBins + lane * kPerLane;
    unsigned long long count[kPerLane];
    unsigned long long lane_total = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      count[i] = hist[i];
      lane_total += count[i];
    }
    // at_or_above = the keys in this lane's bins and every higher lane's (an inclusive suffix sum).
    unsigned long long at_or_above = lane_total;
#pragma unroll
    for (int delta = 1; delta < 32; delta *= 2) {
      const unsigned long long higher = __shfl_down_sync(0xffffffffu, at_or_above, delta);
      if (lane + delta < 32) at_or_above += higher;
    }
    const unsigned long long above = at_or_above - lane_total;  // keys in higher lanes' bins
    const unsigned long long remaining = ball_remaining[id];
    __syncwarp();  // every lane has read remaining before one of them writes it
    if (above < remaining && remaining <= at_or_above) {
      unsigned long long larger = above;
      for (int i = kPerLane - 1; i >= 0; --i) {
        if (larger + count[i] >= remaining) {
          ball_prefix[id] |= static_cast<unsigned long long>(lane * kPerLane + i) << shift;
          ball_remaining[id] = remaining - larger;
          break;
        }
        larger += count[i];
      }
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) hist[i] = 0;
  }
}

// slot_count[s] = the number of the slice's keys equal to its ball's T (the prefix after every pass).
template <typename acc_t>
__global__ void __launch_bounds__(kSliceThreads)
    ksparse_count_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ skip,
                         const unsigned long long* __restrict__ ball_prefix,
                         unsigned long long* __restrict__ slot_count) {
  using Key = AbsKey<acc_t>;
  if (skipped(skip)) return;
  for (int64_t s = table.slice_begin + blockIdx.x; s < table.slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const acc_t* const dir = static_cast<const acc_t*>(table.entry[slice.entry].dir);
    const unsigned long long threshold = ball_prefix[slice.ball_id];
    unsigned long long count = 0;
    for (int64_t j = slice.begin + threadIdx.x; j < slice.end; j += blockDim.x) {
      count += static_cast<unsigned long long>(Key::of(dir[j])) == threshold ? 1ull : 0ull;
    }
    count = block_reduce<kSliceThreads>(count, SumOp{}, 0ull);
    if (threadIdx.x == 0) slot_count[s] = count;
  }
}

// A warp per ball: slot_before[c] = the ball's keys equal to T in its slices before slice c (an exclusive
// prefix sum over the ball's slots, in slot order).
__global__ void __launch_bounds__(kBallThreads)
    ksparse_scan_kernel(const __grid_constant__ EntryTable table, GlobalBall global, const double* __restrict__ skip,
                        const unsigned long long* __restrict__ slot_count, unsigned long long* __restrict__ slot_before) {
  if (skipped(skip)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t id = table.ball_begin + static_cast<int64_t>(blockIdx.x) * kBallsPerBlock + warp; id < table.ball_end;
       id += static_cast<int64_t>(gridDim.x) * kBallsPerBlock) {
    const BallInfo ball = ball_info(table, global, id);
    unsigned long long carry = 0;  // the counts of the slots before this round's 32
    for (int64_t first = ball.slot_begin; first < ball.slot_end; first += 32) {
      const int64_t c = first + lane;
      const unsigned long long count = c < ball.slot_end ? slot_count[c] : 0ull;
      unsigned long long inclusive = count;
#pragma unroll
      for (int delta = 1; delta < 32; delta *= 2) {
        const unsigned long long lower = __shfl_up_sync(0xffffffffu, inclusive, delta);
        if (lane >= delta) inclusive += lower;
      }
      if (c < ball.slot_end) slot_before[c] = carry + inclusive - count;
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
  }
}

// The update: an element is chosen when its key > T, or key == T and fewer than `need` keys equal to T
// come before it in the ball (lower indices: earlier slices, then earlier in this slice, ranked by a block
// scan over tiles of kSliceThreads elements in index order). s = -r sign(d) there, 0 elsewhere. With scales,
// the slice's norm sums (units of the grid of k r) of the values stored and of the exact step.
template <typename scalar_t>
__global__ void __launch_bounds__(kSliceThreads)
    ksparse_update_kernel(const __grid_constant__ EntryTable table, const double* __restrict__ schedule, int64_t k,
                          const double* __restrict__ skip, const unsigned long long* __restrict__ ball_prefix,
                          const unsigned long long* __restrict__ ball_remaining,
                          const unsigned long long* __restrict__ slot_before, double* __restrict__ slot_gap,
                          unsigned long long* __restrict__ slot_stored_units,
                          unsigned long long* __restrict__ slot_exact_units) {
  using acc_t = acc_type<scalar_t>;
  using Key = AbsKey<acc_t>;
  // A skipped step runs no slice: with a return here instead, ptxas spilled the double variant.
  const int64_t slice_end = skipped(skip) ? table.slice_begin : table.slice_end;
  const StepScalars<acc_t> sc = read_schedule<acc_t>(schedule);
  for (int64_t s = table.slice_begin + blockIdx.x; s < slice_end; s += gridDim.x) {
    const SliceInfo slice = slice_info(table, s);
    const Entry& entry = table.entry[slice.entry];
    const acc_t* const dir = static_cast<const acc_t*>(entry.dir);
    scalar_t* const theta = static_cast<scalar_t*>(entry.theta);
    const unsigned long long threshold = ball_prefix[slice.ball_id];
    const unsigned long long need = ball_remaining[slice.ball_id];
    const double minus_r = -entry.radius;
    const acc_t bound = radius_down<acc_t>(entry.radius);
    const double scale = slice_scale(table, slice);
    const double factor = units_factor(rn_mul(static_cast<double>(k), entry.radius));  // the grid of k r
    unsigned long long equal_before = slot_before[s];  // keys == T before this tile, in the ball
    double gap = 0.0;
    unsigned long long stored_units = 0, exact_units = 0;  // a thread adds at most 16 terms of at most 2^51
    // Every thread runs the same number of tiles: the scan needs the whole block.
    for (int64_t tile = slice.begin; tile < slice.end; tile += kSliceThreads) {
      const int64_t j = tile + threadIdx.x;
      const bool valid = j < slice.end;
      const acc_t d = valid ? dir[j] : acc_t(0);
      const unsigned long long key = Key::of(d);
      const bool equal = valid && key == threshold;
      unsigned int rank_in_tile, equal_in_tile;
      block_exclusive_scan<kSliceThreads>(equal ? 1u : 0u, rank_in_tile, equal_in_tile);
      if (valid) {
        const bool chosen = key > threshold || (equal && equal_before + rank_in_tile < need);
        const double vertex = chosen ? rn_mul(minus_r, sign_of(static_cast<double>(d))) : 0.0;
        acc_t stored;
        double exact;
        gap = rn_add(gap, update_element<true>(theta, j, d, vertex, sc, scale, bound, entry.radius, stored, exact));
        stored_units += norm_units(rn_mul(fabs(static_cast<double>(stored)), factor));
        exact_units += norm_units(rn_mul(fabs(exact), factor));
      }
      equal_before += equal_in_tile;
    }
    gap = block_reduce<kSliceThreads>(gap, SumOp{}, 0.0);
    if (threadIdx.x == 0) slot_gap[s] = gap;
    if (entry.scale) {
      stored_units = block_reduce<kSliceThreads>(stored_units, SaturatingSumOp{}, 0ull);
      exact_units = block_reduce<kSliceThreads>(exact_units, SaturatingSumOp{}, 0ull);
      if (threadIdx.x == 0) {
        slot_stored_units[s] = stored_units;
        slot_exact_units[s] = exact_units;
      }
    }
  }
}

// ---- Host side -----------------------------------------------------------------------------------------

template <typename scalar_t, Source kSource, bool kMomentum>
void launch_ksparse_step(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                         const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                         bool global_ball, c10::IntArrayRef offsets, int64_t seed, const at::Tensor& gap,
                         c10::IntArrayRef row_numel, int64_t k, at::TensorList scales) {
  using acc_t = acc_type<scalar_t>;
  using Key = AbsKey<acc_t>;
  SetStepLaunch<scalar_t, kSource> step(params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets,
                                        seed, row_numel, scales);
  if (step.empty()) {  // every tensor is empty
    write_empty_gap(gap, schedule);
    return;
  }
  Plan& plan = step.plan;
  const size_t dir_at = step.layout.take(sizeof(acc_t) * plan.numel);
  const size_t slot_count_at = step.layout.take(sizeof(unsigned long long) * plan.num_slices);
  const size_t slot_before_at = step.layout.take(sizeof(unsigned long long) * plan.num_slices);
  const size_t ball_prefix_at = step.layout.take(sizeof(unsigned long long) * plan.num_balls);
  const size_t ball_remaining_at = step.layout.take(sizeof(unsigned long long) * plan.num_balls);
  const size_t ball_hist_at = step.layout.take(sizeof(unsigned long long) * kBins * plan.num_balls);
  step.allocate(params[0]);
  acc_t* const dir = step.template at<acc_t>(dir_at);
  for (size_t e = 0; e < plan.entries.size(); ++e) {
    plan.entries[e].dir = dir + plan.tensor_first[plan.entry_tensor[e]];
  }
  auto* const slot_count = step.template at<unsigned long long>(slot_count_at);
  auto* const slot_before = step.template at<unsigned long long>(slot_before_at);
  auto* const ball_prefix = step.template at<unsigned long long>(ball_prefix_at);
  auto* const ball_remaining = step.template at<unsigned long long>(ball_remaining_at);
  auto* const ball_hist = step.template at<unsigned long long>(ball_hist_at);
  const Launcher& launcher = step.launcher;
  const cudaStream_t stream = step.stream;
  const double* const skip = step.skip;

  for_each_table(plan, [&](const EntryTable& table) {
    ksparse_direction_kernel<scalar_t, kSource, kMomentum>
        <<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, step.schedule, step.tangents, skip);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
    ksparse_init_kernel<<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(table, global, k, skip, ball_prefix,
                                                                               ball_remaining, ball_hist);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  // Most significant digit first. high_mask keeps the key bits above the digit (none in the first pass).
  constexpr int kPasses = Key::kBits / kDigitBits;
  for (int pass = 0; pass < kPasses; ++pass) {
    const int shift = kDigitBits * (kPasses - 1 - pass);
    const unsigned long long high_mask = pass == 0 ? 0ull : ~((1ull << (shift + kDigitBits)) - 1ull);
    for_each_table(plan, [&](const EntryTable& table) {
      ksparse_hist_kernel<acc_t><<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, shift, high_mask,
                                                                                          skip, ball_prefix,
                                                                                          ball_hist);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
      ksparse_select_kernel<<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(table, global, shift, skip,
                                                                                   ball_prefix, ball_remaining,
                                                                                   ball_hist);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  for_each_table(plan, [&](const EntryTable& table) {
    ksparse_count_kernel<acc_t><<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(table, skip, ball_prefix,
                                                                                         slot_count);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  for_each_ball_table(plan, global_ball, [&](const EntryTable& table, const GlobalBall& global) {
    ksparse_scan_kernel<<<launcher.ball_grid(table), kBallThreads, 0, stream>>>(table, global, skip, slot_count,
                                                                               slot_before);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  for_each_table(plan, [&](const EntryTable& table) {
    ksparse_update_kernel<scalar_t><<<launcher.slice_grid(table), kSliceThreads, 0, stream>>>(
        table, step.schedule, k, skip, ball_prefix, ball_remaining, slot_before, step.slot_gap, step.slot_stored_units,
        step.slot_exact_units);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  step.template finish<true>(global_ball, 0.0, k, gap);
}

void ksparse_fw_step_cuda(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                          const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                          bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                          const at::Tensor& gap, c10::IntArrayRef row_numel, int64_t k, at::TensorList scales) {
  check_set_step_args("ksparse_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball,
                      offsets, distribution, gap, row_numel, scales);
  check_ksparse_k(k);
  dispatch_set_step(params, momentum, grads, schedule, distribution, gap,
                    [&](auto* tag, auto source, auto with_momentum) {
    launch_ksparse_step<std::remove_pointer_t<decltype(tag)>, decltype(source)::value, decltype(with_momentum)::value>(
        params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed, gap, row_numel, k,
        scales);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CUDA, m) {
  m.impl("ksparse_fw_step_", &ksparse_fw_step_cuda);
}

}  // namespace fgfw
