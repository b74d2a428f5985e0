// ksparse_fw_step_ on the CPU: the fused Frank-Wolfe step of the k-sparse polytopes, on the pass of the L1 step
// (step_pass.h); docs/set_steps.md, "CPU kernels".
#include "set_step.h"

namespace fgfw {
namespace {

// ---- The k-sparse step ---------------------------------------------------------------------------
// s = -r sign(d) on the k largest |d| of each ball, ties to the lowest index (reference.ksparse_vertex).
// A ball held in one segment (a row, a small tensor) steps whole in one task: d (into the momentum, or a
// scratch block), its keys (|d| as bits: NaN above inf, as the L1 step ranks), the k-th largest key, then
// theta <- scale theta + alpha (s - scale theta) held within +-R (dense_update; scale: the ball's norm feedback
// on ||theta||_1 <= k r) with the gap's terms d (theta_old - s) and the norm sums of the values stored and of the
// exact step (in units of the grid of k r), the ties to the threshold taken in index order. Larger balls: pass 1 makes d into the momentum or a buffer of the group's size;
// then per ball the k-th largest key by a heap, a radix histogram or nth_element on a copy of its keys,
// per segment the number of keys equal to it before the segment, and the update pass.

// Up to this k, a ball's k largest keys are found with a heap of k keys (one comparison per key) instead of
// nth_element (several passes over a copy).
constexpr int64_t kHeapSelectMax = 64;
constexpr bool heap_selects(int64_t chosen, int64_t size) { return chosen <= kHeapSelectMax && chosen * 16 <= size; }
// Balls of at least this many elements (and a k too large for the heap) select by a histogram of the keys'
// top kRadixBits bits instead: two passes over d and nth_element on one bin's keys, no copy of the ball.
constexpr int64_t kRadixSelectMin = 1 << 14;
constexpr int kRadixBits = 12;

template <typename acc_t>
struct Selection {
  typename AbsBits<acc_t>::type threshold{};  // the k-th largest key of the ball
  int64_t ties_taken = 0;                      // how many keys equal to it are chosen (the first ones)
};

// The k-th largest of ``keys`` (reordered) and how many keys equal to it the k largest hold.
template <typename acc_t>
Selection<acc_t> select_among(std::vector<typename AbsBits<acc_t>::type>& keys, int64_t chosen) {
  using bits_t = typename AbsBits<acc_t>::type;
  if (heap_selects(chosen, static_cast<int64_t>(keys.size()))) {
    // a small k: the k largest keys in a min-heap; most keys fail the one comparison with its top
    std::vector<bits_t> heap(keys.begin(), keys.begin() + chosen);
    std::make_heap(heap.begin(), heap.end(), std::greater<bits_t>());
    for (size_t i = static_cast<size_t>(chosen); i < keys.size(); ++i) {
      if (keys[i] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<bits_t>());
        heap.back() = keys[i];
        std::push_heap(heap.begin(), heap.end(), std::greater<bits_t>());
      }
    }
    keys.swap(heap);  // the k largest (as a multiset: which equal keys were kept does not matter)
  } else {
    std::nth_element(keys.begin(), keys.begin() + (chosen - 1), keys.end(), std::greater<bits_t>());
    keys.resize(static_cast<size_t>(chosen));
  }
  // the k-th largest key, and how many of the k largest are above it
  const bits_t threshold = *std::min_element(keys.begin(), keys.end());
  const int64_t above = std::count_if(keys.begin(), keys.end(), [&](bits_t key) { return key > threshold; });
  return {threshold, chosen - above};
}

template <typename scalar_t, Source kSource, bool kMomentum>
void ksparse_fw_step_kernel(const StepArgs<scalar_t>& args, c10::ArrayRef<double> radii, bool global_ball,
                            c10::IntArrayRef row_numel, at::TensorList scales, double* gap, int64_t k) {
  using acc_t = acc_type<scalar_t>;
  using bits_t = typename AbsBits<acc_t>::type;
  const at::TensorList params = args.params;
  const Layout layout = lay_out(params, row_numel);
  const BallScales ball_scales = read_scales(scales, layout, global_ball);
  const std::vector<Segment>& segments = layout.segments;

  // The balls as runs of segments (lay_out lists a ball's segments together, in index order).
  const size_t num_balls = global_ball ? 1 : layout.ball_tensor.size();
  auto ball_of = [&](const Segment& seg) { return global_ball ? size_t{0} : seg.ball; };
  std::vector<std::vector<size_t>> ball_segments(num_balls);
  for (size_t s = 0; s < segments.size(); ++s) ball_segments[ball_of(segments[s])].push_back(s);
  // A ball held in one segment (a row, a small tensor) steps in one go on one thread, its d in cache.
  auto alone = [&](const Segment& seg) { return ball_segments[ball_of(seg)].size() == 1; };
  const bool any_shared = std::any_of(ball_segments.begin(), ball_segments.end(),
                                      [](const std::vector<size_t>& runs) { return runs.size() > 1; });

  // d of the segments of larger balls: the momentum itself, or a buffer of the group's size
  std::vector<acc_t> buffer(kMomentum || !any_shared ? 0 : static_cast<size_t>(layout.total));
  std::vector<acc_t*> d_of(params.size());
  int64_t at = 0;
  for (size_t t = 0; t < params.size(); ++t) {
    d_of[t] = kMomentum ? args.momentum[t].template data_ptr<acc_t>() : buffer.empty() ? nullptr : buffer.data() + at;
    at += params[t].numel();
  }
  // d of a segment into d_seg (element i of the segment at d_seg[i - seg.begin]), the momentum updated
  auto make_directions = [&](const Segment& seg, acc_t* d_seg) {
    BlockDirection<scalar_t, kSource> direction(args, seg.tensor);
    acc_t* const momentum = kMomentum ? d_of[seg.tensor] : nullptr;
    for (int64_t begin = seg.begin; begin < seg.end; begin += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, seg.end - begin));
      const acc_t* d_at = direction.template directions<kMomentum>(begin, n, momentum);
      if constexpr (!kMomentum) std::copy(d_at, d_at + n, d_seg + (begin - seg.begin));
    }
  };
  // theta over a segment (see above); returns its share of the gap, sum d (theta_old - s), and its norm sums.
  // tie_rank: the keys equal to the threshold before the segment in its ball (ties go in index order).
  struct Share {
    double gap = 0;
    uint64_t stored = 0, exact = 0;  // in units of the grid of k r
  };
  auto update = [&](const Segment& seg, const acc_t* d_seg, Selection<acc_t> selection, int64_t tie_rank) {
    const size_t b = ball_of(seg);
    const double radius = radii[b];
    const acc_t bound = radius_down<acc_t>(radius);
    const double scale = ball_scales.scale[b];
    const double factor = units_factor(static_cast<double>(k) * radius);
    scalar_t* const theta = params[seg.tensor].template data_ptr<scalar_t>();
    alignas(64) double vertex[kBlock];
    alignas(64) double gap_terms[kBlock];
    double gap[kLanes] = {};
    Share total;
    for (int64_t begin = seg.begin; begin < seg.end; begin += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, seg.end - begin));
      const acc_t* d_b = d_seg + (begin - seg.begin);
      // the vertex, in index order (the ties' rank), apart from the update: that loop then vectorises
      for (int e = 0; e < n; ++e) {
        const bits_t key = AbsBits<acc_t>::of(d_b[e]);
        bool chosen = key > selection.threshold;
        if (key == selection.threshold) chosen = tie_rank++ < selection.ties_taken;
        vertex[e] = chosen ? -radius * sign_of(static_cast<double>(d_b[e])) : 0.0;
      }
      scalar_t* const theta_b = theta + begin;
      // the norm sums: integers, the same in any order; kBlock terms of at most 2^51 stay below 2^62
      uint64_t block_stored = 0, block_exact = 0;
      for (int e = 0; e < n; ++e) {
        const acc_t old = static_cast<acc_t>(theta_b[e]);
        double exact_e;
        const scalar_t stored_e = static_cast<scalar_t>(
            dense_update<true>(old, vertex[e], args.alpha, args.alpha_c, scale, bound, radius, exact_e));
        theta_b[e] = stored_e;
        gap_terms[e] = static_cast<double>(d_b[e]) * (static_cast<double>(old) - vertex[e]);
        block_stored += norm_units(std::abs(static_cast<double>(stored_e)) * factor);
        block_exact += norm_units(std::abs(exact_e) * factor);
      }
      add_in_lanes<double>(gap, gap_terms, nullptr, n);
      total.stored = saturating_add(total.stored, block_stored);
      total.exact = saturating_add(total.exact, block_exact);
    }
    for (int l = 0; l < kLanes; ++l) total.gap += gap[l];
    return total;
  };

  // Pass 1: the balls alone in their segment step whole; the others' segments make their d.
  std::vector<Share> shares(segments.size());
  run_in_parallel(layout, [&](int64_t s) {
    const Segment& seg = segments[s];
    if (!alone(seg)) {
      make_directions(seg, kMomentum ? nullptr : d_of[seg.tensor] + seg.begin);
      return;
    }
    const size_t size = static_cast<size_t>(seg.end - seg.begin);
    std::vector<acc_t> scratch(kMomentum ? 0 : size);
    acc_t* const d_seg = kMomentum ? d_of[seg.tensor] + seg.begin : scratch.data();
    make_directions(seg, d_seg);
    std::vector<bits_t> keys(size);
    for (size_t i = 0; i < size; ++i) keys[i] = AbsBits<acc_t>::of(d_seg[i]);
    const Selection<acc_t> selection = select_among<acc_t>(keys, std::min<int64_t>(k, static_cast<int64_t>(size)));
    shares[s] = update(seg, d_seg, selection, 0);
  });

  if (any_shared) {
    // A big ball's selection (kRadixSelectMin): the runs of segments are split into chunks, one per thread,
    // whose histograms are summed, so the result does not depend on the thread count. Nested in the
    // parallel loop over balls, its own parallel loops run on the calling thread.
    auto radix_select = [&](const std::vector<size_t>& runs, int64_t chosen) {
      constexpr int kShift = static_cast<int>(8 * sizeof(bits_t)) - 1 - kRadixBits;  // a key's top bit is 0
      constexpr int64_t kBins = int64_t{1} << kRadixBits;
      const int64_t num_runs = static_cast<int64_t>(runs.size());
      const int64_t num_chunks = std::min<int64_t>(num_runs, at::get_num_threads());
      auto for_each_key = [&](int64_t chunk, auto&& visit) {
        for (int64_t r = chunk * num_runs / num_chunks; r < (chunk + 1) * num_runs / num_chunks; ++r) {
          const Segment& seg = segments[runs[r]];
          const acc_t* d = d_of[seg.tensor];
          for (int64_t i = seg.begin; i < seg.end; ++i) visit(AbsBits<acc_t>::of(d[i]));
        }
      };
      std::vector<int64_t> counts(static_cast<size_t>(num_chunks * kBins), 0);
      at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          int64_t* count = counts.data() + c * kBins;
          for_each_key(c, [&](bits_t key) { ++count[key >> kShift]; });
        }
      });
      // the bin of the k-th largest key, and how many keys the bins above it hold
      int64_t bin = kBins, above = 0, in_bin = 0;
      while (bin > 0) {
        --bin;
        in_bin = 0;
        for (int64_t c = 0; c < num_chunks; ++c) in_bin += counts[c * kBins + bin];
        if (above + in_bin >= chosen) break;
        above += in_bin;
      }
      std::vector<std::vector<bits_t>> pieces(static_cast<size_t>(num_chunks));
      at::parallel_for(0, num_chunks, 1, [&](int64_t first, int64_t last) {
        for (int64_t c = first; c < last; ++c) {
          pieces[c].reserve(static_cast<size_t>(counts[c * kBins + bin]));
          for_each_key(c, [&](bits_t key) {
            if (static_cast<int64_t>(key >> kShift) == bin) pieces[c].push_back(key);
          });
        }
      });
      std::vector<bits_t> keys;
      keys.reserve(static_cast<size_t>(in_bin));
      for (const std::vector<bits_t>& piece : pieces) keys.insert(keys.end(), piece.begin(), piece.end());
      const int64_t rank = chosen - above;  // the k-th largest is the rank-th largest of its bin
      std::nth_element(keys.begin(), keys.begin() + (rank - 1), keys.end(), std::greater<bits_t>());
      const bits_t threshold = keys[rank - 1];
      above += std::count_if(keys.begin(), keys.end(), [&](bits_t key) { return key > threshold; });
      return Selection<acc_t>{threshold, chosen - above};
    };

    std::vector<Selection<acc_t>> selections(num_balls);
    auto select = [&](int64_t b_begin, int64_t b_end) {
      std::vector<bits_t> keys;
      for (int64_t b = b_begin; b < b_end; ++b) {
        if (ball_segments[b].size() < 2) continue;  // stepped whole in pass 1
        int64_t size = 0;
        for (size_t s : ball_segments[b]) size += segments[s].end - segments[s].begin;
        const int64_t chosen = std::min<int64_t>(k, size);
        if (!heap_selects(chosen, size) && size >= kRadixSelectMin) {
          selections[b] = radix_select(ball_segments[b], chosen);
          continue;
        }
        keys.resize(static_cast<size_t>(size));
        size_t at_key = 0;
        for (size_t s : ball_segments[b]) {
          const acc_t* d = d_of[segments[s].tensor];
          for (int64_t i = segments[s].begin; i < segments[s].end; ++i) keys[at_key++] = AbsBits<acc_t>::of(d[i]);
        }
        selections[b] = select_among<acc_t>(keys, chosen);
      }
    };
    if (layout.total < kParallelMin) {
      select(0, static_cast<int64_t>(num_balls));
    } else {
      at::parallel_for(0, static_cast<int64_t>(num_balls), 1, select);
    }

    // Keys equal to the threshold before each segment of its ball: the ties are taken in index order.
    std::vector<int64_t> ties_before(segments.size());
    run_in_parallel(layout, [&](int64_t s) {
      const Segment& seg = segments[s];
      if (alone(seg)) return;
      const acc_t* d = d_of[seg.tensor];
      const bits_t threshold = selections[ball_of(seg)].threshold;
      int64_t count = 0;
      for (int64_t i = seg.begin; i < seg.end; ++i) count += AbsBits<acc_t>::of(d[i]) == threshold;
      ties_before[s] = count;
    });
    for (const std::vector<size_t>& runs : ball_segments) {
      int64_t before = 0;
      for (size_t s : runs) {
        const int64_t count = ties_before[s];
        ties_before[s] = before;
        before += count;
      }
    }
    run_in_parallel(layout, [&](int64_t s) {
      const Segment& seg = segments[s];
      if (alone(seg)) return;
      shares[s] = update(seg, d_of[seg.tensor] + seg.begin, selections[ball_of(seg)], ties_before[s]);
    });
  }
  double total_gap = 0;
  std::vector<Share> per_ball(num_balls);
  for (size_t s = 0; s < segments.size(); ++s) {  // in segment order: the same for any thread count
    total_gap += shares[s].gap;
    Share& ball = per_ball[ball_of(segments[s])];
    ball.stored = saturating_add(ball.stored, shares[s].stored);
    ball.exact = saturating_add(ball.exact, shares[s].exact);
  }
  *gap = total_gap;
  for (size_t b = 0; b < ball_scales.next.size(); ++b) {
    if (ball_scales.next[b] == nullptr) continue;
    const double bound = static_cast<double>(k) * radii[b];
    *ball_scales.next[b] = next_norm_scale(units_as_double(per_ball[b].stored), units_as_double(per_ball[b].exact),
                                           bound * units_factor(bound), 1.0, unit_roundoff<acc_t>());
  }
}

void ksparse_fw_step_cpu(at::TensorList params, at::TensorList momentum, at::TensorList grads,
                         const at::Tensor& schedule, const at::Tensor& tangent_coeffs, c10::ArrayRef<double> radii,
                         bool global_ball, c10::IntArrayRef offsets, int64_t seed, int64_t distribution,
                         const at::Tensor& gap, c10::IntArrayRef row_numel, int64_t k,
                         at::TensorList scales) {
  check_ksparse_k(k);
  run_fw_step("ksparse_fw_step_", params, momentum, grads, schedule, tangent_coeffs, radii, global_ball, offsets, seed,
              distribution, gap, row_numel, scales,
              [&](const auto& args, auto source, auto with_momentum, double* gap_out) {
                using scalar_t = typename std::decay_t<decltype(args)>::scalar_type;
                ksparse_fw_step_kernel<scalar_t, decltype(source)::value, decltype(with_momentum)::value>(
                    args, radii, global_ball, row_numel, scales, gap_out, k);
              });
}

}  // namespace

TORCH_LIBRARY_IMPL(fgfw, CPU, m) {
  m.impl("ksparse_fw_step_", &ksparse_fw_step_cpu);
}

}  // namespace fgfw
