// Multi-tensor apply for the fused steps: one launch walks every tensor of a group in fixed-size
// chunks, the way ATen's MultiTensorApply and apex do, but with the whole per-tensor table passed
// as one __grid_constant__ kernel argument (CUDA >= 12.1 allows 32 KiB of arguments on sm_70+).
// An argument costs no copy to the device, so a launch never synchronises the host and is
// captured by a CUDA graph as it is; the math lives in a functor-like kernel body elsewhere
// (docs/fused_step.md, "CUDA kernels").
//
// Geometry. Tensor t's elements are grouped by four along its stream index offset[t] + j (one
// Philox call per group, see philox.h): group g holds j = 4 g - lead + lane, lane 0..3, with
// lead = offset % 4, so the first and last group of a tensor may be partial. A chunk is
// kChunkGroups consecutive groups of one tensor; chunks are numbered in (tensor, group) order, so
// a lower chunk number always holds lower element indices (tensor order first).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <stdint.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace fgfw::cuda {

// Groups of four elements per chunk: 16 Ki elements, a few hundred KiB of traffic, large enough
// that the per-chunk reduction is noise and small enough to balance 1e8 elements over every SM.
constexpr int64_t kChunkGroups = 4096;
// Per-tensor rows of one launch's table: 256 rows keep the argument under 16 KiB. A group with
// more tensors takes several launches that write disjoint chunk (slot) ranges.
constexpr int kMaxTensorsPerLaunch = 256;

// Addresses of up to kLists companion tensors per row (e.g. params, momentum, grads), plus the
// geometry of the row's stream and one per-row scalar for the kernel body.
template <int kLists>
struct TensorTable {
  void* data[kLists][kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int64_t first_group[kMaxTensorsPerLaunch];  // stream index of the row's group 0, divided by 4
  int64_t first_chunk[kMaxTensorsPerLaunch];  // chunk number of the row's chunk 0 in this launch
  double scalar[kMaxTensorsPerLaunch];
  int8_t lead[kMaxTensorsPerLaunch];          // stream offset % 4
  bool vectorised[kMaxTensorsPerLaunch];      // every list's group starts are 16 B (or 4-element) aligned
  int num_rows;
  int first_row;       // the launch's row 0 is tensor first_row of the group
  int64_t num_chunks;  // in this launch
  int64_t chunk_base;  // chunk number of this launch's chunk 0 within the whole group
};

// Number of groups of a tensor of numel elements whose stream starts at lead (mod 4).
__host__ __device__ inline int64_t num_groups(int64_t numel, int lead) {
  return numel == 0 ? 0 : (lead + numel + 3) / 4;
}

// Number of chunks of a tensor (0 for an empty one).
inline int64_t num_chunks(int64_t numel, int64_t stream_offset) {
  return (num_groups(numel, static_cast<int>(stream_offset % 4)) + kChunkGroups - 1) / kChunkGroups;
}

// The row holding chunk c of the launch: the last row whose first chunk is <= c. Empty rows own
// no chunk and share their first_chunk with the next row, so the search passes over them.
template <int kLists>
__device__ inline int row_of_chunk(const TensorTable<kLists>& table, int64_t c) {
  int lo = 0, hi = table.num_rows - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_chunk[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Four consecutive elements of T, in one or two 16-byte (or one 8-byte) memory transactions.
template <typename T>
struct alignas(sizeof(T) * 4 < 16 ? sizeof(T) * 4 : 16) Quad {
  T x[4];
};

// Bytes of alignment a Quad<T> needs.
template <typename T>
constexpr int64_t quad_alignment() {
  return alignof(Quad<T>);
}

// Whether group starts (element 4 g - lead) of a tensor at `address` are Quad-aligned.
template <typename T>
bool quad_aligned(const void* address, int lead) {
  const auto start = reinterpret_cast<uintptr_t>(address) - static_cast<uintptr_t>(lead) * sizeof(T);
  return start % quad_alignment<T>() == 0;
}

// Blocks of `kernel` (threads each, no dynamic shared memory) that one SM holds at once, at least 1: with the SM
// count, a grid-stride launch's grid. It depends on the kernel and the architecture only, so callers keep it in a
// function-local static (one process drives one kind of GPU).
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  return std::max(blocks, 1);
}

// Splits a group's rows into launches of at most kMaxTensorsPerLaunch rows, fills each launch's
// table and calls launch(table) in row order. row(t, table, r) fills the data pointers, scalar and
// vectorised flag of row r for tensor t; numel and stream offsets come from the vectors.
template <int kLists, typename FillRow, typename Launch>
void for_each_launch(const std::vector<int64_t>& numels, const std::vector<int64_t>& stream_offsets,
                     FillRow&& fill_row, Launch&& launch) {
  const int n = static_cast<int>(numels.size());
  int64_t chunk_base = 0;
  for (int first = 0; first < n; first += kMaxTensorsPerLaunch) {
    TensorTable<kLists> table;
    std::memset(&table, 0, sizeof(table));
    table.num_rows = std::min(kMaxTensorsPerLaunch, n - first);
    table.first_row = first;
    table.chunk_base = chunk_base;
    int64_t chunks = 0;
    for (int r = 0; r < table.num_rows; ++r) {
      const int t = first + r;
      const int lead = static_cast<int>(stream_offsets[t] % 4);
      table.numel[r] = numels[t];
      table.first_group[r] = stream_offsets[t] / 4;
      table.lead[r] = static_cast<int8_t>(lead);
      table.first_chunk[r] = chunks;
      chunks += num_chunks(numels[t], stream_offsets[t]);
      fill_row(t, table, r);
    }
    table.num_chunks = chunks;
    launch(table);
    chunk_base += chunks;
  }
}

}  // namespace fgfw::cuda
