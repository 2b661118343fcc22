// EmbeddingBag backward on the GPU: deterministic, sort-based, no atomics.
//
//  1. key every entry by its table row (padding / out of range -> num_rows,
//     which sorts last) and radix-sort (row, entry) pairs: O(entries) uint32s;
//  2. seg_begin[r] = first sorted position of row r (binary search per row);
//  3. a warp per (4 consecutive rows, 1024-column tile) walks each row's entries, gathering
//     coef * grad[bag] into registers, and writes the d_table row tile exactly
//     once (rows nobody references get zeros). The same pass loads the table
//     row once and forms grad[bag] . table[row] for every entry: the raw dot
//     d_weights needs, so the table is read once per referenced row instead of
//     once per entry;
//  4. a row with more than `long_segment` entries is cut into pieces of
//     `long_segment` sorted positions, summed by separate warps into float
//     scratch; the row's warp then adds the pieces in position order, so hot
//     rows do not serialise one warp and results stay bitwise reproducible;
//  5. a warp per bag turns the raw dots into d_weights with the combiner's
//     correction (mean: (d_k - sum_j w_j d_j / S) / S; sqrtn:
//     (d_k - w_k sum_j w_j d_j / R^2) / R).
//
// The row-sparse variant (pkm_cuda_sparse_backward) runs the same passes; after
// step 2 a flag per row (segment not empty) is prefix-summed into each touched
// row's output slot, the host reads the count, has the caller allocate
// rows [U] / row_grads [U, dim], and step 3 writes touched rows only, to their slot.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <string>

#include "kernels/cuda/common.cuh"

namespace pkm_cuda {
namespace {

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
// The scalar fallback (odd dim / unaligned) keeps 32 columns per lane: it
// would spill under the vector path's register cap, so it gets one block/SM.
__host__ __device__ constexpr int MinBlocks(int vec) { return vec == 1 ? 1 : PKM_BWD_MIN_BLOCKS; }
// Block size of the row passes (PiecesKernel, RowsKernel) for element size.
__host__ __device__ constexpr int RowPassThreads(int elem_bytes) { return elem_bytes == 4 ? PKM_BWD_THREADS_F32 : PKM_BWD_THREADS; }
constexpr int kWarpsPerBlock = kBackwardThreads / kWarp;
constexpr int kEntriesInFlight = PKM_BWD_ENTRIES_IN_FLIGHT;
constexpr int64_t kTileCols = PKM_BWD_TILE_COLS;  // columns one warp owns in the backward
#ifndef PKM_BWD_ROWS_PER_WARP
#define PKM_BWD_ROWS_PER_WARP 4
#endif
constexpr int64_t kRowsPerWarp = PKM_BWD_ROWS_PER_WARP;
constexpr int64_t kDefaultLongSegment = 2048;
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
  int32_t* piece_row;            // [2 * pieces]
  float* piece_sum;              // [2 * pieces, dim]
};

// ---- keys -------------------------------------------------------------------

template <typename IdxT>
__device__ __forceinline__ uint32_t RowKey(const PkmBags& bags, int64_t entry) {
  const int64_t idx = static_cast<int64_t>(static_cast<const IdxT*>(bags.indices)[entry]);
  if (idx >= 0 && idx < bags.num_rows) return static_cast<uint32_t>(idx);
  if (idx >= bags.num_rows && bags.invalid_index_count != nullptr)
    atomicAdd(bags.invalid_index_count, 1);
  return static_cast<uint32_t>(bags.num_rows);
}

template <typename IdxT>
__global__ void InitKeysKernel(PkmBags bags, int64_t num_indices, bool dense, uint32_t* keys,
                               uint32_t* entries) {
  const int64_t entry = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (entry >= num_indices) return;
  keys[entry] = dense ? RowKey<IdxT>(bags, entry) : static_cast<uint32_t>(bags.num_rows);
  entries[entry] = static_cast<uint32_t>(entry);
}

// Ragged: only entries inside a bag take part; records each entry's bag.
template <typename IdxT>
__global__ void RaggedKeysKernel(PkmBags bags, int64_t num_indices, uint32_t* keys,
                                 uint32_t* bag_of_entry) {
  const int64_t bag = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (bag >= bags.num_bags) return;
  int64_t begin, end;
  BagRange(bags, num_indices, bag, &begin, &end);
  for (int64_t entry = begin + threadIdx.x % kWarp; entry < end; entry += kWarp) {
    keys[entry] = RowKey<IdxT>(bags, entry);
    bag_of_entry[entry] = static_cast<uint32_t>(bag);
  }
}

__global__ void SegmentBeginKernel(const uint32_t* sorted_rows, int64_t num_indices,
                                   int64_t num_rows, uint32_t* seg_begin) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row > num_rows) return;
  int64_t lo = 0, hi = num_indices;  // first position whose row >= `row`
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(sorted_rows[mid]) < row) lo = mid + 1; else hi = mid;
  }
  seg_begin[row] = static_cast<uint32_t>(lo);
}

template <typename IdxT>
__device__ __forceinline__ bool ValidEntry(const PkmBags& bags, int64_t entry) {
  const int64_t idx = static_cast<int64_t>(static_cast<const IdxT*>(bags.indices)[entry]);
  return idx >= 0 && idx < bags.num_rows;
}

template <typename IdxT>
__global__ void BagScaleKernel(PkmBags bags, int64_t num_indices, float* bag_scale) {
  const int64_t bag = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (bag >= bags.num_bags) return;
  int64_t begin, end;
  BagRange(bags, num_indices, bag, &begin, &end);
  float weight_sum = 0.f, weight_sq_sum = 0.f;
  for (int64_t entry = begin + threadIdx.x % kWarp; entry < end; entry += kWarp) {
    if (!ValidEntry<IdxT>(bags, entry)) continue;
    const float w = bags.weights ? LoadWeight(bags.weights, bags.weights_type, entry) : 1.f;
    weight_sum += w;
    weight_sq_sum += w * w;
  }
  weight_sum = WarpSum(weight_sum);
  weight_sq_sum = WarpSum(weight_sq_sum);
  if (threadIdx.x % kWarp == 0) bag_scale[bag] = CombinerScale(bags.combiner, weight_sum, weight_sq_sum);
}

// ---- the row pass -------------------------------------------------------------

// acc += sum over sorted positions [s0, s1) (all of table row `row`) of
// coef(entry) * grad[bag(entry)] on this lane's columns of `tile`; writes the
// raw dot grad[bag] . table[row] (this tile's part) of every entry to dots.
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

// `first` is this lane's metadata for sorted position s0 + lane (loaded early
// by the caller, so its latency hides behind the previous row).
template <typename T, int VEC, int U>
__device__ __forceinline__ void AccumulateRange(const BackwardArgs& a, int64_t row, int64_t s0,
                                                int64_t s1, int64_t tile, int lane,
                                                const EntryMeta& first, float (&acc)[U][VEC]) {
  static_assert(VEC * U * kWarp == kTileCols, "a warp owns kTileCols columns");
  const int64_t dim = a.bags.dim;
  const int64_t lane_col = tile * kTileCols + static_cast<int64_t>(lane) * VEC;
  const T* __restrict__ grad = static_cast<const T*>(a.grad);
  const bool want_dots = a.dots != nullptr;
  float x[U][VEC];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
    if (want_dots && col < dim) {
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
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
          if (active && col < dim) {
            LoadFloats<T, VEC>(grad + bag * dim + col, g[j][u]);
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

// One warp per (piece, tile): the parts of long rows inside sorted positions
// [piece * L, piece * L + L). A range of L positions meets at most two rows
// longer than L: the one at its first position and the one at its last.
template <typename T, int VEC, int U>
__global__ void __launch_bounds__(RowPassThreads(sizeof(T)), MinBlocks(VEC))
    PiecesKernel(BackwardArgs a, int64_t pieces) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (RowPassThreads(sizeof(T)) / kWarp) + threadIdx.x / kWarp;
  if (warp >= pieces * a.tiles) return;
  const int64_t piece = warp / a.tiles;
  const int64_t tile = warp % a.tiles;
  const int64_t L = a.long_segment;
  const int64_t s_begin = piece * L;
  const int64_t s_end = min(a.num_indices, s_begin + L);
  const int64_t dim = a.bags.dim;
  const uint32_t first_row = a.sorted_rows[s_begin];
  for (int slot = 0; slot < 2; ++slot) {
    const uint32_t row = a.sorted_rows[slot == 0 ? s_begin : s_end - 1];
    bool use = row < a.bags.num_rows && (slot == 0 || row != first_row);
    int64_t lo = 0, hi = 0;
    if (use) {
      lo = a.seg_begin[row];
      hi = a.seg_begin[row + 1];
      use = hi - lo > L;
    }
    if (tile == 0 && lane == 0) a.piece_row[2 * piece + slot] = use ? static_cast<int32_t>(row) : -1;
    if (!use) continue;
    float acc[U][VEC];
    ZeroAcc<VEC, U>(acc);
    const int64_t r0 = max(lo, s_begin), r1 = min(hi, s_end);
    AccumulateRange<T, VEC, U>(a, row, r0, r1, tile, lane, LoadEntryMeta(a, r0 + lane, r0 + lane < r1), acc);
    float* out = a.piece_sum + (2 * piece + slot) * dim;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t col = tile * kTileCols + static_cast<int64_t>(lane) * VEC + u * kWarp * VEC;
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        if (col + v < dim) out[col + v] = acc[u][v];
    }
  }
}

// One warp per (kRowsPerWarp consecutive table rows, tile): writes each
// d_table[row, tile] exactly once. While a row is summed, the next row's
// segment bounds and first entries are already being fetched.
template <typename T, int VEC, int U>
__global__ void __launch_bounds__(RowPassThreads(sizeof(T)), MinBlocks(VEC)) RowsKernel(BackwardArgs a) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (RowPassThreads(sizeof(T)) / kWarp) + threadIdx.x / kWarp;
  const int64_t num_rows = a.bags.num_rows;
  const int64_t row_groups = (num_rows + kRowsPerWarp - 1) / kRowsPerWarp;
  if (warp >= row_groups * a.tiles) return;
  const int64_t first_row = (warp / a.tiles) * kRowsPerWarp;
  const int64_t last_row = min(num_rows, first_row + kRowsPerWarp);
  const int64_t tile = warp % a.tiles;
  const int64_t dim = a.bags.dim;
  const int64_t L = a.long_segment;
  const int64_t lane_col = tile * kTileCols + static_cast<int64_t>(lane) * VEC;
  int64_t lo = a.seg_begin[first_row];
  int64_t hi = a.seg_begin[first_row + 1];
  EntryMeta meta = LoadEntryMeta(a, lo + lane, lo + lane < hi);
  for (int64_t row = first_row; row < last_row; ++row) {
    int64_t next_hi = hi;
    EntryMeta next_meta{0u, 0, 0.f};
    if (row + 1 < last_row) {
      next_hi = a.seg_begin[row + 2];
      next_meta = LoadEntryMeta(a, hi + lane, hi + lane < next_hi);
    }
    float acc[U][VEC];
    ZeroAcc<VEC, U>(acc);
    if (hi - lo <= L) {
      AccumulateRange<T, VEC, U>(a, row, lo, hi, tile, lane, meta, acc);
    } else if (a.d_table != nullptr) {
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
    if (a.d_table != nullptr && (a.slot_of_row == nullptr || hi > lo)) {
      T* out = static_cast<T*>(a.d_table) + (a.slot_of_row ? a.slot_of_row[row] : row) * dim;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t col = lane_col + static_cast<int64_t>(u) * kWarp * VEC;
        if (col < dim) StoreFloats<T, VEC>(out + col, acc[u]);
      }
    }
    lo = hi;
    hi = next_hi;
    meta = next_meta;
  }
}

// One warp per bag: d_weights from the raw dots and the combiner.
template <typename IdxT>
__global__ void WeightsGradKernel(PkmBags bags, int64_t num_indices, int64_t tiles,
                                  const float* dots, void* d_weights) {
  const int64_t bag = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  if (bag >= bags.num_bags) return;
  const int lane = threadIdx.x % kWarp;
  int64_t begin, end;
  BagRange(bags, num_indices, bag, &begin, &end);
  auto raw_dot = [&](int64_t entry) {
    float d = 0.f;
    for (int64_t t = 0; t < tiles; ++t) d += dots[t * num_indices + entry];
    return d;
  };
  float weighted_dots = 0.f, weight_sum = 0.f, weight_sq_sum = 0.f;
  if (bags.combiner != PKM_SUM) {
    for (int64_t entry = begin + lane; entry < end; entry += kWarp) {
      if (!ValidEntry<IdxT>(bags, entry)) continue;
      const float w = LoadWeight(bags.weights, bags.weights_type, entry);
      weighted_dots += w * raw_dot(entry);
      weight_sum += w;
      weight_sq_sum += w * w;
    }
    weighted_dots = WarpSum(weighted_dots);
    weight_sum = WarpSum(weight_sum);
    weight_sq_sum = WarpSum(weight_sq_sum);
  }
  for (int64_t entry = begin + lane; entry < end; entry += kWarp) {
    float dw = 0.f;
    if (ValidEntry<IdxT>(bags, entry)) {
      const float d = raw_dot(entry);
      if (bags.combiner == PKM_SUM) {
        dw = d;
      } else if (bags.combiner == PKM_MEAN) {
        dw = weight_sum != 0.f ? (d - weighted_dots / weight_sum) / weight_sum : 0.f;
      } else {
        const float w = LoadWeight(bags.weights, bags.weights_type, entry);
        dw = weight_sq_sum > 0.f
                 ? (d - w * weighted_dots / weight_sq_sum) * rsqrtf(weight_sq_sum)
                 : 0.f;
      }
    }
    StoreWeight(d_weights, bags.weights_type, entry, dw);
  }
}

// Sparse: flags[row] = 1 when the row has entries (flags[num_rows] = 0), to
// be prefix-summed into output slots.
__global__ void TouchedFlagsKernel(const uint32_t* seg_begin, int64_t num_rows, uint32_t* flags) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row > num_rows) return;
  flags[row] = row < num_rows && seg_begin[row + 1] > seg_begin[row] ? 1u : 0u;
}

__global__ void TouchedRowsKernel(const uint32_t* seg_begin, const uint32_t* slot_of_row, int64_t num_rows,
                                  int64_t* rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row < num_rows && seg_begin[row + 1] > seg_begin[row]) rows[slot_of_row[row]] = row;
}

// ---- workspace ------------------------------------------------------------

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int KeyBits(int64_t num_rows) {  // bits to hold 0..num_rows (num_rows is the skip key)
  int bits = 1;
  while (bits < 32 && (static_cast<uint64_t>(num_rows) >> bits) != 0) ++bits;
  return bits;
}

struct Layout {
  int64_t num_indices = 0, tiles = 0, long_segment = 0, pieces = 0;
  size_t keys[2] = {0, 0}, entries[2] = {0, 0}, cub_temp = 0, cub_bytes = 0, seg_begin = 0,
         bag_scale = 0, bag_of_entry = 0, dots = 0, piece_row = 0, piece_sum = 0, total = 0;
  // Sparse only: touched flags, their exclusive scan (output slots), scan scratch.
  size_t flags = 0, slot_of_row = 0, scan_temp = 0, scan_bytes = 0;
  bool dots_in_spare_keys = false, pieces_in_spare_entries = false;
};

int MakeLayout(const PkmBags& bags, const PkmCudaOptions* options, Layout* layout, bool sparse = false) {
  Layout& l = *layout;
  l.num_indices = NumIndices(bags);
  if (l.num_indices > INT32_MAX)
    return SetInvalid("backward: at most 2^31-1 indices per call on the GPU, got " +
                      std::to_string(l.num_indices));
  if (bags.num_rows >= static_cast<int64_t>(UINT32_MAX))
    return SetInvalid("backward: at most 2^32-2 table rows on the GPU, got " +
                      std::to_string(bags.num_rows));
  l.long_segment = kDefaultLongSegment;
  if (options != nullptr && options->long_segment_entries != 0) {
    if (options->long_segment_entries < 1)
      return SetInvalid("long_segment_entries must be >= 1, got " +
                        std::to_string(options->long_segment_entries));
    l.long_segment = options->long_segment_entries;
  }
  l.tiles = (bags.dim + kTileCols - 1) / kTileCols;
  l.pieces = (l.num_indices + l.long_segment - 1) / l.long_segment;
  const size_t n = static_cast<size_t>(l.num_indices);
  cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr), entries(nullptr, nullptr);
  cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, l.cub_bytes, keys, entries,
                                                    static_cast<int>(n), 0, KeyBits(bags.num_rows));
  if (err != cudaSuccess) return CheckCuda(err, "cub::DeviceRadixSort size query");
  size_t offset = 0;
  auto take = [&](size_t bytes) { const size_t at = offset; offset += AlignUp(bytes); return at; };
  l.keys[0] = take(n * 4);
  l.keys[1] = take(n * 4);
  l.entries[0] = take(n * 4);
  l.entries[1] = take(n * 4);
  l.cub_temp = take(l.cub_bytes);
  l.seg_begin = take((static_cast<size_t>(bags.num_rows) + 1) * 4);
  if (bags.combiner != PKM_SUM) l.bag_scale = take(static_cast<size_t>(bags.num_bags) * 4);
  if (bags.row_splits != nullptr) l.bag_of_entry = take(n * 4);
  // After the sort the spare halves of the double buffers are free: the dots
  // and the piece sums live there when they fit.
  if (bags.weights != nullptr) {
    l.dots_in_spare_keys = l.tiles == 1;
    if (!l.dots_in_spare_keys) l.dots = take(static_cast<size_t>(l.tiles) * n * 4);
  }
  l.piece_row = take(static_cast<size_t>(2 * l.pieces) * 4);
  const size_t piece_floats = static_cast<size_t>(2 * l.pieces) * static_cast<size_t>(bags.dim);
  l.pieces_in_spare_entries = piece_floats <= n;
  if (!l.pieces_in_spare_entries) l.piece_sum = take(piece_floats * 4);
  if (sparse) {
    const size_t slots = static_cast<size_t>(bags.num_rows) + 1;
    if (slots > static_cast<size_t>(INT32_MAX))
      return SetInvalid("sparse backward: at most 2^31-2 table rows on the GPU, got " +
                        std::to_string(bags.num_rows));
    err = cub::DeviceScan::ExclusiveSum(nullptr, l.scan_bytes, static_cast<const uint32_t*>(nullptr),
                                        static_cast<uint32_t*>(nullptr), static_cast<int>(slots));
    if (err != cudaSuccess) return CheckCuda(err, "cub::DeviceScan size query");
    l.flags = take(slots * 4);
    l.slot_of_row = take(slots * 4);
    l.scan_temp = take(l.scan_bytes);
  }
  l.total = offset;
  return PKM_CUDA_OK;
}

// Where the sparse backward gets its outputs once it knows how many rows.
struct SparseOutputs {
  pkm_cuda_sparse_alloc_fn alloc = nullptr;
  void* alloc_ctx = nullptr;
};

unsigned Blocks(int64_t items, int per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

template <typename T, int VEC, int U>
int LaunchRowPassesAs(const BackwardArgs& args, int64_t pieces, cudaStream_t stream) {
  constexpr int kThreads = RowPassThreads(sizeof(T));
  if (pieces > 0) {
    const int64_t warps = pieces * args.tiles;
    if (warps / (kThreads / kWarp) >= INT32_MAX) return SetInvalid("backward: too many pieces for one launch");
    PiecesKernel<T, VEC, U><<<Blocks(warps, kThreads / kWarp), kThreads, 0, stream>>>(args, pieces);
    if (int status = CheckLaunch("backward pieces pass")) return status;
  }
  const int64_t warps = (args.bags.num_rows + kRowsPerWarp - 1) / kRowsPerWarp * args.tiles;
  if (warps / (kThreads / kWarp) >= INT32_MAX) return SetInvalid("backward: too many table rows for one launch");
  if (warps > 0) {
    RowsKernel<T, VEC, U><<<Blocks(warps, kThreads / kWarp), kThreads, 0, stream>>>(args);
    if (int status = CheckLaunch("backward row pass")) return status;
  }
  return PKM_CUDA_OK;
}

template <typename T>
int LaunchRowPasses(const BackwardArgs& args, int64_t pieces, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vector_ok = args.bags.dim % kVec == 0 && Aligned16(args.bags.table) &&
                         Aligned16(args.grad) && (args.d_table == nullptr || Aligned16(args.d_table));
  if (vector_ok) return LaunchRowPassesAs<T, kVec, kTileCols / (kWarp * kVec)>(args, pieces, stream);
  return LaunchRowPassesAs<T, 1, kTileCols / kWarp>(args, pieces, stream);
}

template <typename IdxT>
int LaunchBackward(const PkmBags& bags, const Layout& l, const void* grad_out, void* d_table,
                   void* d_weights, char* ws, cudaStream_t stream, const SparseOutputs* sparse = nullptr) {
  const int64_t n = l.num_indices;
  const bool ragged = bags.row_splits != nullptr;
  uint32_t* keys0 = reinterpret_cast<uint32_t*>(ws + l.keys[0]);
  uint32_t* entries0 = reinterpret_cast<uint32_t*>(ws + l.entries[0]);
  uint32_t* bag_of_entry = ragged ? reinterpret_cast<uint32_t*>(ws + l.bag_of_entry) : nullptr;
  if (n > 0) {
    InitKeysKernel<IdxT><<<Blocks(n, 256), 256, 0, stream>>>(bags, n, !ragged, keys0, entries0);
    if (int status = CheckLaunch("backward keys")) return status;
  }
  if (ragged && bags.num_bags > 0) {
    RaggedKeysKernel<IdxT><<<Blocks(bags.num_bags, kWarpsPerBlock), kBackwardThreads, 0, stream>>>(
        bags, n, keys0, bag_of_entry);
    if (int status = CheckLaunch("backward ragged keys")) return status;
    // Entries outside every bag (malformed splits) still get a defined d_weight.
    if (d_weights != nullptr) {
      const size_t wsize = bags.weights_type == PKM_FLOAT32 ? 4 : 2;
      if (int status = CheckCuda(cudaMemsetAsync(d_weights, 0, n * wsize, stream), "memset d_weights"))
        return status;
    }
  }
  cub::DoubleBuffer<uint32_t> keys(keys0, reinterpret_cast<uint32_t*>(ws + l.keys[1]));
  cub::DoubleBuffer<uint32_t> entries(entries0, reinterpret_cast<uint32_t*>(ws + l.entries[1]));
  if (n > 0) {
    size_t cub_bytes = l.cub_bytes;
    cudaError_t err = cub::DeviceRadixSort::SortPairs(ws + l.cub_temp, cub_bytes, keys, entries,
                                                      static_cast<int>(n), 0, KeyBits(bags.num_rows),
                                                      stream);
    if (int status = CheckCuda(err, "cub::DeviceRadixSort::SortPairs")) return status;
  }
  uint32_t* seg_begin = reinterpret_cast<uint32_t*>(ws + l.seg_begin);
  SegmentBeginKernel<<<Blocks(bags.num_rows + 1, 256), 256, 0, stream>>>(keys.Current(), n,
                                                                         bags.num_rows, seg_begin);
  if (int status = CheckLaunch("backward segments")) return status;
  const uint32_t* slot_of_row = nullptr;
  if (sparse != nullptr) {
    uint32_t* flags = reinterpret_cast<uint32_t*>(ws + l.flags);
    uint32_t* slots = reinterpret_cast<uint32_t*>(ws + l.slot_of_row);
    TouchedFlagsKernel<<<Blocks(bags.num_rows + 1, 256), 256, 0, stream>>>(seg_begin, bags.num_rows, flags);
    if (int status = CheckLaunch("sparse backward flags")) return status;
    size_t scan_bytes = l.scan_bytes;
    if (int status = CheckCuda(cub::DeviceScan::ExclusiveSum(ws + l.scan_temp, scan_bytes, flags, slots,
                                                             static_cast<int>(bags.num_rows + 1), stream),
                               "cub::DeviceScan::ExclusiveSum"))
      return status;
    // The caller sizes its outputs by the count: one device-to-host read.
    uint32_t touched = 0;
    if (int status = CheckCuda(cudaMemcpyAsync(&touched, slots + bags.num_rows, sizeof(touched),
                                               cudaMemcpyDeviceToHost, stream),
                               "read the touched-row count"))
      return status;
    if (int status = CheckCuda(cudaStreamSynchronize(stream), "synchronise for the touched-row count"))
      return status;
    int64_t* rows = nullptr;
    void* row_grads = nullptr;
    if (sparse->alloc(sparse->alloc_ctx, touched, &rows, &row_grads) != 0)
      return SetInvalid("sparse backward: the output allocation callback failed for " +
                        std::to_string(touched) + " rows");
    if (touched > 0 && (rows == nullptr || (row_grads == nullptr && bags.dim > 0)))
      return SetInvalid("sparse backward: the allocation callback returned null outputs");
    if (touched > 0) {
      TouchedRowsKernel<<<Blocks(bags.num_rows, 256), 256, 0, stream>>>(seg_begin, slots, bags.num_rows, rows);
      if (int status = CheckLaunch("sparse backward rows")) return status;
    }
    d_table = touched > 0 ? row_grads : nullptr;
    slot_of_row = slots;
  }
  float* bag_scale = nullptr;
  if (bags.combiner != PKM_SUM && bags.num_bags > 0) {
    bag_scale = reinterpret_cast<float*>(ws + l.bag_scale);
    BagScaleKernel<IdxT><<<Blocks(bags.num_bags, kWarpsPerBlock), kBackwardThreads, 0, stream>>>(
        bags, n, bag_scale);
    if (int status = CheckLaunch("backward bag scales")) return status;
  }
  float* dots = nullptr;
  if (d_weights != nullptr)
    dots = reinterpret_cast<float*>(l.dots_in_spare_keys ? reinterpret_cast<char*>(keys.Alternate())
                                                         : ws + l.dots);
  BackwardArgs args;
  args.bags = bags;
  args.num_indices = n;
  args.tiles = l.tiles;
  args.long_segment = l.long_segment;
  args.sorted_rows = keys.Current();
  args.sorted_entries = entries.Current();
  args.seg_begin = seg_begin;
  args.bag_scale = bag_scale;
  args.bag_of_entry = bag_of_entry;
  args.grad = grad_out;
  args.d_table = d_table;
  args.slot_of_row = slot_of_row;
  args.dots = dots;
  args.piece_row = reinterpret_cast<int32_t*>(ws + l.piece_row);
  args.piece_sum = reinterpret_cast<float*>(
      l.pieces_in_spare_entries ? reinterpret_cast<char*>(entries.Alternate()) : ws + l.piece_sum);
  int status;
  switch (bags.elem_type) {
    case PKM_FLOAT16: status = LaunchRowPasses<__half>(args, l.pieces, stream); break;
    case PKM_BFLOAT16: status = LaunchRowPasses<__nv_bfloat16>(args, l.pieces, stream); break;
    default: status = LaunchRowPasses<float>(args, l.pieces, stream);
  }
  if (status != PKM_CUDA_OK) return status;
  if (d_weights != nullptr && bags.num_bags > 0) {
    WeightsGradKernel<IdxT><<<Blocks(bags.num_bags, kWarpsPerBlock), kBackwardThreads, 0, stream>>>(
        bags, n, l.tiles, dots, d_weights);
    if (int status2 = CheckLaunch("backward d_weights")) return status2;
  }
  return PKM_CUDA_OK;
}

}  // namespace
}  // namespace pkm_cuda

extern "C" size_t pkm_cuda_backward_workspace_bytes(const PkmBags* bags,
                                                    const PkmCudaOptions* options) {
  using namespace pkm_cuda;
  if (ValidateCommon(bags) != PKM_CUDA_OK) return 0;
  Layout layout;
  if (MakeLayout(*bags, options, &layout) != PKM_CUDA_OK) return 0;
  return layout.total;
}

extern "C" int pkm_cuda_backward(const PkmBags* bags, const void* grad_out, void* d_table,
                                 void* d_weights, void* workspace, size_t workspace_bytes,
                                 const PkmCudaOptions* options, pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  int status = ValidateCommon(bags);
  if (status != PKM_CUDA_OK) return status;
  if (d_weights != nullptr && bags->weights == nullptr)
    return SetInvalid("backward: d_weights requested but the bags have no weights");
  if (d_table == nullptr && d_weights == nullptr) return PKM_CUDA_OK;
  Layout layout;
  status = MakeLayout(*bags, options, &layout);
  if (status != PKM_CUDA_OK) return status;
  const int64_t n = layout.num_indices;
  if (bags->dim == 0 || n == 0 || bags->num_rows == 0) {
    // Nothing is gathered: every gradient is zero (all-zero bits are 0.0 in
    // each element type).
    const size_t elem = bags->elem_type == PKM_FLOAT32 ? 4 : 2;
    if (d_table != nullptr && bags->num_rows * bags->dim > 0) {
      status = CheckCuda(cudaMemsetAsync(d_table, 0, bags->num_rows * bags->dim * elem, stream),
                         "memset d_table");
      if (status != PKM_CUDA_OK) return status;
    }
    if (d_weights != nullptr && n > 0) {
      const size_t wsize = bags->weights_type == PKM_FLOAT32 ? 4 : 2;
      status = CheckCuda(cudaMemsetAsync(d_weights, 0, n * wsize, stream), "memset d_weights");
    }
    return status;
  }
  if (grad_out == nullptr) return SetInvalid("backward: grad_out is null");
  if (workspace_bytes < layout.total || (layout.total > 0 && workspace == nullptr))
    return SetInvalid("backward: workspace of " + std::to_string(workspace_bytes) +
                      " bytes is too small, need " + std::to_string(layout.total) +
                      " (pkm_cuda_backward_workspace_bytes)");
  char* ws = static_cast<char*>(workspace);
  return bags->indices_int64
             ? LaunchBackward<int64_t>(*bags, layout, grad_out, d_table, d_weights, ws, stream)
             : LaunchBackward<int32_t>(*bags, layout, grad_out, d_table, d_weights, ws, stream);
}

extern "C" size_t pkm_cuda_sparse_backward_workspace_bytes(const PkmBags* bags,
                                                           const PkmCudaOptions* options) {
  using namespace pkm_cuda;
  if (ValidateCommon(bags) != PKM_CUDA_OK) return 0;
  Layout layout;
  if (MakeLayout(*bags, options, &layout, /*sparse=*/true) != PKM_CUDA_OK) return 0;
  return layout.total;
}

extern "C" int pkm_cuda_sparse_backward(const PkmBags* bags, const void* grad_out,
                                        pkm_cuda_sparse_alloc_fn alloc, void* alloc_ctx, void* d_weights,
                                        void* workspace, size_t workspace_bytes,
                                        const PkmCudaOptions* options, pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  int status = ValidateCommon(bags);
  if (status != PKM_CUDA_OK) return status;
  if (alloc == nullptr) return SetInvalid("sparse backward: alloc is null");
  if (d_weights != nullptr && bags->weights == nullptr)
    return SetInvalid("sparse backward: d_weights requested but the bags have no weights");
  Layout layout;
  status = MakeLayout(*bags, options, &layout, /*sparse=*/true);
  if (status != PKM_CUDA_OK) return status;
  const int64_t n = layout.num_indices;
  if (n == 0 || bags->num_rows == 0) {  // nothing touched
    int64_t* rows = nullptr;
    void* row_grads = nullptr;
    if (alloc(alloc_ctx, 0, &rows, &row_grads) != 0)
      return SetInvalid("sparse backward: the output allocation callback failed for 0 rows");
    if (d_weights != nullptr && n > 0) {
      const size_t wsize = bags->weights_type == PKM_FLOAT32 ? 4 : 2;
      return CheckCuda(cudaMemsetAsync(d_weights, 0, n * wsize, stream), "memset d_weights");
    }
    return PKM_CUDA_OK;
  }
  if (grad_out == nullptr && bags->dim > 0) return SetInvalid("sparse backward: grad_out is null");
  if (workspace_bytes < layout.total || (layout.total > 0 && workspace == nullptr))
    return SetInvalid("sparse backward: workspace of " + std::to_string(workspace_bytes) +
                      " bytes is too small, need " + std::to_string(layout.total) +
                      " (pkm_cuda_sparse_backward_workspace_bytes)");
  SparseOutputs out;
  out.alloc = alloc;
  out.alloc_ctx = alloc_ctx;
  char* ws = static_cast<char*>(workspace);
  return bags->indices_int64
             ? LaunchBackward<int64_t>(*bags, layout, grad_out, nullptr, d_weights, ws, stream, &out)
             : LaunchBackward<int32_t>(*bags, layout, grad_out, nullptr, d_weights, ws, stream, &out);
}
