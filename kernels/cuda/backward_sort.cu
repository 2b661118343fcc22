// Phases 1-2 of the CUDA backward and the small per-bag / per-row tables:
// entry keys, the radix sort of (row, entry) pairs, segment starts, the
// combiner's bag scales, the sparse variant's output slots; and the workspace
// layout that holds them (backward.cuh).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <string>

#include "kernels/cuda/backward.cuh"

namespace pkm_cuda {
namespace {

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

// Segment starts: seg_begin[r] = the first sorted position whose row is >= r,
// for r in [0, num_rows]. A binary search per row costs ~23 dependent loads
// per table row; instead each position p writes the rows in (row[p-1], row[p]]
// (row[-1] = -1, row[n] = num_rows): every row once, a few stores per position
// when the gaps are short. Gaps longer than kScatterRows (few entries over a
// huge table) are left to SegmentCheckKernel.
constexpr int64_t kScatterRows = 32;

__global__ void SegmentScatterKernel(const uint32_t* sorted_rows, int64_t num_indices, int64_t num_rows,
                                     uint32_t* seg_begin) {
  const int64_t pos = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (pos > num_indices) return;
  const int64_t prev = pos == 0 ? -1 : static_cast<int64_t>(sorted_rows[pos - 1]);
  const int64_t row = pos == num_indices ? num_rows : static_cast<int64_t>(sorted_rows[pos]);
  const int64_t last = min(row, prev + kScatterRows);
  for (int64_t r = prev + 1; r <= last; ++r) seg_begin[r] = static_cast<uint32_t>(pos);
}

// Rows the scatter skipped hold whatever the workspace held: a value s is the
// start of row r exactly when s <= n, row[s] >= r (or s = n) and row[s-1] < r
// (or s = 0), so any other value is replaced by a binary search. The result
// does not depend on the workspace's old contents.
__global__ void SegmentCheckKernel(const uint32_t* sorted_rows, int64_t num_indices, int64_t num_rows,
                                   uint32_t* seg_begin) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row > num_rows) return;
  const int64_t s = seg_begin[row];
  if (s <= num_indices && (s == num_indices || static_cast<int64_t>(sorted_rows[s]) >= row) &&
      (s == 0 || static_cast<int64_t>(sorted_rows[s - 1]) < row))
    return;
  int64_t lo = 0, hi = num_indices;  // first position whose row >= `row`
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (static_cast<int64_t>(sorted_rows[mid]) < row) lo = mid + 1; else hi = mid;
  }
  seg_begin[row] = static_cast<uint32_t>(lo);
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

// max combiner: one thread per (bag, column) finds the entry holding the
// column's maximum (the first NaN if any), the first on ties (strict >),
// skipping padding.
template <typename T, typename IdxT>
__global__ void MaxEntryKernel(PkmBags bags, int64_t num_indices, int32_t* max_entry) {
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= bags.num_bags * bags.dim) return;
  const int64_t bag = id / bags.dim, col = id % bags.dim;
  int64_t begin, end;
  BagRange(bags, num_indices, bag, &begin, &end);
  float best = -INFINITY;
  int32_t best_entry = -1;
  for (int64_t entry = begin; entry < end; ++entry) {
    const int64_t row = static_cast<int64_t>(static_cast<const IdxT*>(bags.indices)[entry]);
    if (row < 0 || row >= bags.num_rows) continue;
    const float v = ToFloat<T>(static_cast<const T*>(bags.table)[row * bags.dim + col]);
    if (best_entry < 0 || v > best || (v != v && best == best)) {
      best = v;
      best_entry = static_cast<int32_t>(entry);
    }
  }
  max_entry[id] = best_entry;
}

template <typename IdxT>
int LaunchMaxEntry(const PkmBags& bags, int64_t n, int32_t* max_entry, cudaStream_t stream) {
  const int64_t items = bags.num_bags * bags.dim;
  if (items == 0) return PKM_CUDA_OK;
  if (items / 256 >= INT32_MAX) return SetInvalid("backward: too many bags for the max combiner's launch");
  switch (bags.elem_type) {
    case PKM_FLOAT16: MaxEntryKernel<__half, IdxT><<<Blocks(items, 256), 256, 0, stream>>>(bags, n, max_entry); break;
    case PKM_BFLOAT16:
      MaxEntryKernel<__nv_bfloat16, IdxT><<<Blocks(items, 256), 256, 0, stream>>>(bags, n, max_entry);
      break;
    default: MaxEntryKernel<float, IdxT><<<Blocks(items, 256), 256, 0, stream>>>(bags, n, max_entry);
  }
  return CheckLaunch("backward max entries");
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

// Shorter pieces spread a hot row over more warps (the row's own warp then
// only adds them up): Zipf(1.1) indices at B=65536 K=32 D=256 N=4M on an H100
// (round 33, bench/results/gpu_round33_h100_notes.md) took 3.15 ms (bf16) and
// 4.33 ms (fp32) with pieces of 2048 entries, 1.70 / 2.81 with 512; uniform
// indices, where no row is that long, the same. Each piece keeps two float
// rows of sums, in the sort's spare buffer (a float per entry): 2 * dim
// entries a piece, at least 512, at most 2048, and at least what keeps
// 2 * pieces * dim <= entries where that can hold, so the workspace does not grow.
int64_t DefaultLongSegment(int64_t num_indices, int64_t dim) {
  int64_t entries = 2 * dim < kMinDefaultLongSegment ? kMinDefaultLongSegment : 2 * dim;
  const int64_t pieces_that_fit = dim > 0 ? num_indices / (2 * dim) : 0;
  if (pieces_that_fit >= 1) {
    const int64_t fitting = (num_indices + pieces_that_fit - 1) / pieces_that_fit;
    if (fitting > entries) entries = fitting;
  }
  return entries > kMaxDefaultLongSegment ? kMaxDefaultLongSegment : entries;
}

int KeyBits(int64_t num_rows) {  // bits to hold 0..num_rows (num_rows is the skip key)
  int bits = 1;
  while (bits < 32 && (static_cast<uint64_t>(num_rows) >> bits) != 0) ++bits;
  return bits;
}

}  // namespace

int MakeLayout(const PkmBags& bags, const PkmCudaOptions* options, Layout* layout, Extra extra) {
  Layout& l = *layout;
  l.num_indices = NumIndices(bags);
  if (l.num_indices > INT32_MAX)
    return SetInvalid("backward: at most 2^31-1 indices per call on the GPU, got " +
                      std::to_string(l.num_indices));
  if (bags.num_rows >= static_cast<int64_t>(UINT32_MAX))
    return SetInvalid("backward: at most 2^32-2 table rows on the GPU, got " +
                      std::to_string(bags.num_rows));
  l.long_segment = DefaultLongSegment(l.num_indices, bags.dim);
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
  if (bags.combiner == PKM_MEAN || bags.combiner == PKM_SQRTN)
    l.bag_scale = take(static_cast<size_t>(bags.num_bags) * 4);
  if (bags.combiner == PKM_MAX)
    l.max_entry = take(static_cast<size_t>(bags.num_bags) * static_cast<size_t>(bags.dim) * 4);
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
  if (extra == Extra::kRowPartials)
    l.row_partials = take(static_cast<size_t>(bags.num_rows) * static_cast<size_t>(l.tiles) * 4);
  if (extra == Extra::kSparseSlots) {
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


unsigned Blocks(int64_t items, int per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

float* DotsBuffer(const Layout& l, char* ws, const BackwardArgs& args, const void* d_weights) {
  if (d_weights == nullptr) return nullptr;
  // The spare half of the keys' double buffer is the one sorted_rows is not in.
  uint32_t* keys0 = reinterpret_cast<uint32_t*>(ws + l.keys[0]);
  uint32_t* keys1 = reinterpret_cast<uint32_t*>(ws + l.keys[1]);
  if (l.dots_in_spare_keys) return reinterpret_cast<float*>(args.sorted_rows == keys0 ? keys1 : keys0);
  return reinterpret_cast<float*>(ws + l.dots);
}

namespace {

// Step 1: keys (and, ragged, each entry's bag), then the radix sort.
template <typename IdxT>
int SortPairs(const PkmBags& bags, const Layout& l, void* d_weights, char* ws, cudaStream_t stream,
              cub::DoubleBuffer<uint32_t>* keys, cub::DoubleBuffer<uint32_t>* entries, uint32_t* bag_of_entry) {
  const int64_t n = l.num_indices;
  if (n > 0) {
    InitKeysKernel<IdxT><<<Blocks(n, 256), 256, 0, stream>>>(bags, n, bag_of_entry == nullptr, keys->Current(),
                                                             entries->Current());
    if (int status = CheckLaunch("backward keys")) return status;
  }
  if (bag_of_entry != nullptr && bags.num_bags > 0) {
    RaggedKeysKernel<IdxT><<<Blocks(bags.num_bags, kWarpsPerBlock), kBackwardThreads, 0, stream>>>(
        bags, n, keys->Current(), bag_of_entry);
    if (int status = CheckLaunch("backward ragged keys")) return status;
    // Entries outside every bag (malformed splits) still get a defined d_weight.
    if (d_weights != nullptr) {
      const size_t wsize = bags.weights_type == PKM_FLOAT32 ? 4 : 2;
      if (int status = CheckCuda(cudaMemsetAsync(d_weights, 0, n * wsize, stream), "memset d_weights"))
        return status;
    }
  }
  if (n == 0) return PKM_CUDA_OK;
  size_t cub_bytes = l.cub_bytes;
  return CheckCuda(cub::DeviceRadixSort::SortPairs(ws + l.cub_temp, cub_bytes, *keys, *entries, static_cast<int>(n),
                                                   0, KeyBits(bags.num_rows), stream),
                   "cub::DeviceRadixSort::SortPairs");
}

}  // namespace

template <typename IdxT>
int SortEntriesByRow(const PkmBags& bags, const Layout& l, void* d_weights, char* ws, cudaStream_t stream,
                     BackwardArgs* args) {
  const int64_t n = l.num_indices;
  uint32_t* bag_of_entry = bags.row_splits != nullptr ? reinterpret_cast<uint32_t*>(ws + l.bag_of_entry) : nullptr;
  cub::DoubleBuffer<uint32_t> keys(reinterpret_cast<uint32_t*>(ws + l.keys[0]),
                                   reinterpret_cast<uint32_t*>(ws + l.keys[1]));
  cub::DoubleBuffer<uint32_t> entries(reinterpret_cast<uint32_t*>(ws + l.entries[0]),
                                      reinterpret_cast<uint32_t*>(ws + l.entries[1]));
  if (int status = SortPairs<IdxT>(bags, l, d_weights, ws, stream, &keys, &entries, bag_of_entry)) return status;
  // Step 2: segment starts.
  uint32_t* seg_begin = reinterpret_cast<uint32_t*>(ws + l.seg_begin);
  SegmentScatterKernel<<<Blocks(n + 1, 256), 256, 0, stream>>>(keys.Current(), n, bags.num_rows, seg_begin);
  if (int status = CheckLaunch("backward segment scatter")) return status;
  SegmentCheckKernel<<<Blocks(bags.num_rows + 1, 256), 256, 0, stream>>>(keys.Current(), n, bags.num_rows, seg_begin);
  if (int status = CheckLaunch("backward segment check")) return status;
  int32_t* max_entry = nullptr;
  if (bags.combiner == PKM_MAX) {
    max_entry = reinterpret_cast<int32_t*>(ws + l.max_entry);
    if (int status = LaunchMaxEntry<IdxT>(bags, n, max_entry, stream)) return status;
  }
  float* bag_scale = nullptr;
  if ((bags.combiner == PKM_MEAN || bags.combiner == PKM_SQRTN) && bags.num_bags > 0) {
    bag_scale = reinterpret_cast<float*>(ws + l.bag_scale);
    BagScaleKernel<IdxT><<<Blocks(bags.num_bags, kWarpsPerBlock), kBackwardThreads, 0, stream>>>(bags, n, bag_scale);
    if (int status = CheckLaunch("backward bag scales")) return status;
  }
  BackwardArgs& a = *args;
  a = BackwardArgs{};
  a.bags = bags;
  a.num_indices = n;
  a.tiles = l.tiles;
  a.long_segment = l.long_segment;
  a.sorted_rows = keys.Current();
  a.sorted_entries = entries.Current();
  a.seg_begin = seg_begin;
  a.skip_untouched_table_rows = n < bags.num_rows;
  a.bag_scale = bag_scale;
  a.bag_of_entry = bag_of_entry;
  a.max_entry = max_entry;
  a.piece_row = reinterpret_cast<int32_t*>(ws + l.piece_row);
  a.piece_sum = reinterpret_cast<float*>(l.pieces_in_spare_entries ? reinterpret_cast<char*>(entries.Alternate())
                                                                   : ws + l.piece_sum);
  return PKM_CUDA_OK;
}

template int SortEntriesByRow<int32_t>(const PkmBags&, const Layout&, void*, char*, cudaStream_t, BackwardArgs*);
template int SortEntriesByRow<int64_t>(const PkmBags&, const Layout&, void*, char*, cudaStream_t, BackwardArgs*);

int AssignSparseSlots(const Layout& l, char* ws, const SparseOutputs& sparse, cudaStream_t stream,
                      BackwardArgs* args) {
  const int64_t num_rows = args->bags.num_rows;
  uint32_t* flags = reinterpret_cast<uint32_t*>(ws + l.flags);
  uint32_t* slots = reinterpret_cast<uint32_t*>(ws + l.slot_of_row);
  TouchedFlagsKernel<<<Blocks(num_rows + 1, 256), 256, 0, stream>>>(args->seg_begin, num_rows, flags);
  if (int status = CheckLaunch("sparse backward flags")) return status;
  size_t scan_bytes = l.scan_bytes;
  if (int status = CheckCuda(cub::DeviceScan::ExclusiveSum(ws + l.scan_temp, scan_bytes, flags, slots,
                                                           static_cast<int>(num_rows + 1), stream),
                             "cub::DeviceScan::ExclusiveSum"))
    return status;
  // The caller sizes its outputs by the count: one device-to-host read.
  uint32_t touched = 0;
  if (int status = CheckCuda(cudaMemcpyAsync(&touched, slots + num_rows, sizeof(touched), cudaMemcpyDeviceToHost,
                                             stream), "read the touched-row count"))
    return status;
  if (int status = CheckCuda(cudaStreamSynchronize(stream), "synchronise for the touched-row count")) return status;
  int64_t* rows = nullptr;
  void* row_grads = nullptr;
  if (sparse.alloc(sparse.alloc_ctx, touched, &rows, &row_grads) != 0)
    return SetInvalid("sparse backward: the output allocation callback failed for " + std::to_string(touched) +
                      " rows");
  if (touched > 0 && (rows == nullptr || (row_grads == nullptr && args->bags.dim > 0)))
    return SetInvalid("sparse backward: the allocation callback returned null outputs");
  if (touched > 0) {
    TouchedRowsKernel<<<Blocks(num_rows, 256), 256, 0, stream>>>(args->seg_begin, slots, num_rows, rows);
    if (int status = CheckLaunch("sparse backward rows")) return status;
  }
  args->d_table = touched > 0 ? row_grads : nullptr;
  args->slot_of_row = slots;
  return PKM_CUDA_OK;
}

}  // namespace pkm_cuda
