// Shared by the phases of the CUDA backward (FBGEMM keeps its backward in the
// same phases): backward_sort.cu (keys, radix sort, segments, bag scales,
// sparse slots), backward_rows.cu (the per-row gradient pass),
// backward_weights.cu (d_weights), backward.cu (the host launchers) and
// fused_optimizer.cu (the row pass with the optimizer update as its epilogue).
//
// The algorithm, all deterministic (no atomics on results):
//  1. key every entry by its table row (padding / out of range -> num_rows,
//     which sorts last) and radix-sort (row, entry) pairs: O(entries) uint32s;
//  2. seg_begin[r] = first sorted position of row r (a scatter from each sorted
//     position over the rows since the previous one; a binary search where
//     the gap was long);
//  3. a warp per (4 consecutive rows, 1024-column tile) walks each row's entries, gathering
//     coef * grad[bag] into registers, and hands the row tile's gradient to an
//     epilogue: store it once into d_table (rows nobody references get zeros),
//     or into its sparse slot, or apply an optimizer update to the table. The
//     same pass loads the table row once and forms grad[bag] . table[row] for
//     every entry: the raw dot d_weights needs. Narrow rows of a table
//     gradient walk the sorted positions instead (backward_positions.cu), with
//     the same per-row summation order; where rows outnumber entries, rows
//     with one entry are written by a warp per bag first and the walk skips
//     them;
//  4. a row with more than `long_segment` entries is cut into pieces of
//     `long_segment` sorted positions, summed by separate warps into float
//     scratch; the row's warp then adds the pieces in position order, so hot
//     rows do not serialise one warp and results stay bitwise reproducible;
//  5. a warp per bag turns the raw dots into d_weights with the combiner's
//     correction (mean: (d_k - sum_j w_j d_j / S) / S; sqrtn:
//     (d_k - w_k sum_j w_j d_j / R^2) / R). Sum needs none: under the
//     position pass d_weights is stored there (BackwardArgs::d_weights).
#ifndef PKM_KERNELS_CUDA_BACKWARD_CUH_
#define PKM_KERNELS_CUDA_BACKWARD_CUH_

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace pkm_cuda {
// Tuning (overridable with -D for experiments). Defaults picked on the H200
// (bench/results/gpu_embedding_bag_h200.md): the row pass is latency-bound, so
// more resident warps (one entry in flight per warp) and prefetching the next
// row's entries beat wider unrolling. Measured at the seed shape, backward
// alone: fp32 5.9 ms (256 threads, 2 entries in flight, 1 row/warp) -> 2.3 ms
// (128-thread blocks, 1 entry, 4 rows/warp); bf16 3.0 ms -> 1.4 ms (256-thread
// blocks capped at 128 registers for 2 blocks/SM).
#ifndef PKM_BWD_THREADS
#define PKM_BWD_THREADS 256  // all kernels but the fp32 row passes
#endif
#ifndef PKM_BWD_THREADS_F32
#define PKM_BWD_THREADS_F32 128  // fp32 row passes
#endif
#ifndef PKM_BWD_MIN_BLOCKS
#define PKM_BWD_MIN_BLOCKS 2
#endif
#ifndef PKM_BWD_ENTRIES_IN_FLIGHT
#define PKM_BWD_ENTRIES_IN_FLIGHT 1
#endif
#ifndef PKM_BWD_TILE_COLS
#define PKM_BWD_TILE_COLS 1024
#endif
constexpr int kBackwardThreads = PKM_BWD_THREADS;
// Block size of the row passes (PiecesKernel, RowsKernel) for element size.
__host__ __device__ constexpr int RowPassThreads(int elem_bytes) { return elem_bytes == 4 ? PKM_BWD_THREADS_F32 : PKM_BWD_THREADS; }
// Resident blocks the row passes ask for. The scalar fallback (odd dim /
// unaligned) keeps 32 columns per lane: it would spill under the vector
// path's register cap, so it gets one block/SM. 16-bit rows of one vector per
// lane (dim <= 256) are capped at 64 registers (32 warps per SM): their pass is
// bound by the latency of its dependent loads, so resident warps are what
// counts (H200: 2.93 -> 2.34 ms at N=4M, D=256; two vectors per lane, or fp32,
// spill or slow down under that cap).
__host__ __device__ constexpr int MinBlocks(int vec, int u, int elem_bytes) {
  return vec == 1 ? 1 : (elem_bytes == 2 && u == 1 ? 65536 / (64 * RowPassThreads(elem_bytes)) : PKM_BWD_MIN_BLOCKS);
}
constexpr int kWarpsPerBlock = kBackwardThreads / kWarp;
constexpr int kEntriesInFlight = PKM_BWD_ENTRIES_IN_FLIGHT;
constexpr int64_t kTileCols = PKM_BWD_TILE_COLS;  // columns one warp owns in the backward
#ifndef PKM_BWD_ROWS_PER_WARP
#define PKM_BWD_ROWS_PER_WARP 4
#endif
constexpr int64_t kRowsPerWarp = PKM_BWD_ROWS_PER_WARP;
// The longest piece of a row summed by one warp when the call does not set
// long_segment_entries: about 2 * dim entries, at least 512, at most 2048
// (DefaultLongSegment, backward_sort.cu).
constexpr int64_t kMinDefaultLongSegment = 512, kMaxDefaultLongSegment = 2048;
constexpr size_t kAlign = 256;

struct BackwardArgs {
  PkmBags bags;
  int64_t num_indices;
  int64_t tiles;
  int64_t long_segment;
  const uint32_t* sorted_rows;  // row of each sorted position (num_rows = skipped entry)
  const uint32_t* sorted_entries;
  const uint32_t* seg_begin;     // [num_rows + 1]
  const float* bag_scale;        // [num_bags]; null for sum (scale 1)
  const uint32_t* bag_of_entry;  // ragged only; dense uses entry / bag_size
  const void* grad;
  void* d_table;                 // may be null; row_grads [U, dim] when slot_of_row is set
  const uint32_t* slot_of_row;   // sparse: output row of each touched table row; null = dense
  float* dots;                   // [tiles, num_indices]; null when d_weights is not wanted
  // Sum combiner under the position pass: d_weights itself, which that pass
  // writes (the d_weights kernel is skipped); null otherwise.
  void* d_weights;
  int32_t* piece_row;            // [2 * pieces]
  float* piece_sum;              // [2 * pieces, dim]
  // max combiner: [num_bags, dim], the entry holding each column's maximum
  // (the first on ties; -1 for an empty bag); the gradient goes to it alone.
  const int32_t* max_entry;
  // Fewer entries than table rows (most rows untouched): the narrow row
  // kernels load a row's table row (for the dots) only once its range is known
  // to be non-empty (AccumulateRange).
  bool skip_untouched_table_rows;
  // Position pass only: rows with exactly one entry were written by the pass
  // over the bags (SingleEntryRowsKernel); the walk skips them.
  bool single_entry_rows_done;
};

template <typename IdxT>
__device__ __forceinline__ bool ValidEntry(const PkmBags& bags, int64_t entry) {
  const int64_t idx = static_cast<int64_t>(static_cast<const IdxT*>(bags.indices)[entry]);
  return idx >= 0 && idx < bags.num_rows;
}

// What a lane needs about the entry at one sorted position.
struct EntryMeta {
  uint32_t entry;
  int64_t bag;
  float coef;  // weight * the bag's combiner scale
};

__device__ __forceinline__ EntryMeta LoadEntryMeta(const BackwardArgs& a, int64_t pos, bool in_range) {
  EntryMeta m{0u, 0, 0.f};
  if (!in_range) return m;
  m.entry = a.sorted_entries[pos];
  m.bag = a.bag_of_entry ? static_cast<int64_t>(a.bag_of_entry[m.entry])
                         : static_cast<int64_t>(m.entry) / a.bags.bag_size;
  m.coef = a.bags.weights ? LoadWeight(a.bags.weights, a.bags.weights_type, m.entry) : 1.f;
  if (a.bag_scale) m.coef *= a.bag_scale[m.bag];
  return m;
}

// acc += sum over sorted positions [s0, s1) (all of table row `row`) of
// coef(entry) * grad[bag(entry)] on this lane's columns of `tile`; writes the
// raw dot grad[bag] . table[row] (this tile's part) of every entry to dots.
// `first` is this lane's metadata for sorted position s0 + lane (loaded early
// by the caller, so its latency hides behind the previous row).
// kMax: the max combiner's mask (a.max_entry) applies; a template flag so the
// sum/mean/sqrtn loop carries none of it.
template <typename T, int VEC, int U, bool kMax>
__device__ __forceinline__ void AccumulateRange(const BackwardArgs& a, int64_t row, int64_t s0,
                                                int64_t s1, int64_t tile, int lane,
                                                const EntryMeta& first, float (&acc)[U][VEC]) {
  // A warp owns kTileCols columns, or (a narrow table: one tile) fewer.
  static_assert(VEC * U * kWarp <= kTileCols, "a warp owns at most kTileCols columns");
  const int64_t dim = a.bags.dim;
  const int64_t lane_col = tile * kTileCols + static_cast<int64_t>(lane) * VEC;
  const T* __restrict__ grad = static_cast<const T*>(a.grad);
  const bool want_dots = a.dots != nullptr;
  float x[U][VEC];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
    // Narrow rows over a table with more rows than entries: an untouched row's
    // table row is not read (the wide kernels load it before the range is known).
    const bool skip = U <= 2 && a.skip_untouched_table_rows && s1 == s0;
    if (want_dots && !skip && col < dim) {
      LoadFloats<T, VEC>(static_cast<const T*>(a.bags.table) + row * dim + col, x[u]);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) x[u][v] = 0.f;
    }
  }
  for (int64_t chunk = s0; chunk < s1; chunk += kWarp) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarp), s1 - chunk));
    const EntryMeta meta = chunk == s0 ? first : LoadEntryMeta(a, chunk + lane, lane < count);
    const uint32_t my_entry = meta.entry;
    const int64_t my_bag = meta.bag;
    const float my_coef = meta.coef;
    for (int k = 0; k < count; k += kEntriesInFlight) {
      float g[kEntriesInFlight][U][VEC];
      float coef[kEntriesInFlight];
#pragma unroll
      for (int j = 0; j < kEntriesInFlight; ++j) {
        const bool active = k + j < count;  // warp-uniform
        const int64_t bag = __shfl_sync(kFullMask, my_bag, k + j);
        coef[j] = __shfl_sync(kFullMask, my_coef, k + j);
        const int32_t entry = kMax ? static_cast<int32_t>(__shfl_sync(kFullMask, my_entry, k + j)) : 0;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
          if (active && col < dim) {
            LoadFloats<T, VEC>(grad + bag * dim + col, g[j][u]);
            if (kMax) {
#pragma unroll
              for (int v = 0; v < VEC; ++v)
                if (a.max_entry[bag * dim + col + v] != entry) g[j][u][v] = 0.f;
            }
          } else {
#pragma unroll
            for (int v = 0; v < VEC; ++v) g[j][u][v] = 0.f;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kEntriesInFlight; ++j) {
        float partial_dot = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int v = 0; v < VEC; ++v) {
            acc[u][v] = fmaf(coef[j], g[j][u][v], acc[u][v]);
            partial_dot = fmaf(g[j][u][v], x[u][v], partial_dot);
          }
        if (want_dots && k + j < count) {
          const float dot = WarpSum(partial_dot);
          const uint32_t entry = __shfl_sync(kFullMask, my_entry, k + j);
          if (lane == 0) a.dots[tile * a.num_indices + entry] = dot;
        }
      }
    }
  }
}

template <int VEC, int U>
__device__ __forceinline__ void ZeroAcc(float (&acc)[U][VEC]) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[u][v] = 0.f;
}

// acc += the piece sums of a long row (in position order).
template <int VEC, int U>
__device__ __forceinline__ void AddPieces(const BackwardArgs& a, int64_t row, int64_t lo, int64_t hi,
                                          int64_t lane_col, float (&acc)[U][VEC]) {
  const int64_t L = a.long_segment, dim = a.bags.dim;
  for (int64_t piece = lo / L; piece <= (hi - 1) / L; ++piece) {
    const int slot = a.piece_row[2 * piece] == static_cast<int32_t>(row) ? 0 : 1;
    const float* part = a.piece_sum + (2 * piece + slot) * dim;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        if (col + v < dim) acc[u][v] += part[col + v];
    }
  }
}

// ---- workspace and host steps ----------------------------------------------

struct Layout {
  int64_t num_indices = 0, tiles = 0, long_segment = 0, pieces = 0;
  size_t keys[2] = {0, 0}, entries[2] = {0, 0}, cub_temp = 0, cub_bytes = 0, seg_begin = 0,
         bag_scale = 0, bag_of_entry = 0, dots = 0, piece_row = 0, piece_sum = 0, total = 0;
  // Sparse only: touched flags, their exclusive scan (output slots), scan scratch.
  size_t flags = 0, slot_of_row = 0, scan_temp = 0, scan_bytes = 0;
  // Fused row-wise Adagrad over several tiles: per (row, tile) sums of squares.
  size_t row_partials = 0;
  // max combiner: the max_entry table.
  size_t max_entry = 0;
  bool dots_in_spare_keys = false, pieces_in_spare_entries = false;
};

// Which scratch the launch needs besides the dense backward's.
enum class Extra { kNone, kSparseSlots, kRowPartials };

// Offsets of every scratch buffer in the workspace; checks the GPU's limits.
int MakeLayout(const PkmBags& bags, const PkmCudaOptions* options, Layout* layout, Extra extra = Extra::kNone);

unsigned Blocks(int64_t items, int per_block);

// Where the sparse backward gets its outputs once it knows how many rows.
struct SparseOutputs {
  pkm_cuda_sparse_alloc_fn alloc = nullptr;
  void* alloc_ctx = nullptr;
};

// Steps 1-2 and the bag scales: sorts the entries by row and fills every
// field of *args but grad, d_table, slot_of_row and dots (backward_sort.cu).
// Zeroes d_weights first for ragged bags (entries outside every bag).
template <typename IdxT>
int SortEntriesByRow(const PkmBags& bags, const Layout& l, void* d_weights, char* ws, cudaStream_t stream,
                     BackwardArgs* args);

// Sparse only: output slots of the touched rows, their count read back (one
// host synchronisation), the caller's allocation, the rows output; sets
// args->d_table to the row_grads (null when nothing is touched) and
// args->slot_of_row (backward_sort.cu).
int AssignSparseSlots(const Layout& l, char* ws, const SparseOutputs& sparse, cudaStream_t stream,
                      BackwardArgs* args);

// Step 3-4 storing the gradient (d_table or sparse slots), for the table type
// (backward_rows.cu).
int LaunchGradientRowPasses(const BackwardArgs& args, int64_t pieces, cudaStream_t stream);

// Steps 3-4 storing the gradient walked by sorted position, for narrow
// vector rows and every combiner but max (backward_positions.cu).
bool PositionPassApplies(const BackwardArgs& args);
int LaunchPositionPass(const BackwardArgs& args, int64_t pieces, cudaStream_t stream);

// Step 5 (backward_weights.cu).
int LaunchWeightsGrad(const PkmBags& bags, int64_t num_indices, int64_t tiles, const float* dots,
                      void* d_weights, cudaStream_t stream);

// Where the dots live (the spare keys buffer when they fit); null without d_weights.
float* DotsBuffer(const Layout& l, char* ws, const BackwardArgs& args, const void* d_weights);

}  // namespace pkm_cuda

#endif  // PKM_KERNELS_CUDA_BACKWARD_CUH_
