// Rows with one entry: by bag or in row order? (issue #25, round 34)
// The huge-table backward (B=65536 K=32 D=256 N=4M) writes the ~1.27M rows that exactly one entry
// touches in a pass by bag (SingleEntryRowsKernel, backward_single_rows.cu: a warp reads its bag's
// gradient row once, then reads each such entry's table row for its dot and writes its d_table row),
// 0.55 ms of the bf16 call's 1.45 on an H100: 1.3 GB of random 512-byte row reads and writes at
// ~2.4 TB/s. This standalone A/B moves the same bytes (rows as raw 16-byte words; out = grad ^ table, a
// stand-in for the arithmetic) by bag, as shipped, and in row order (a warp per 32 consecutive such rows,
// each looking up its bag's gradient row, which then comes from L2), against a memset and a plain copy:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I. bench/native/gpu_single_rows_order_ab.cu -o gpu_single_rows_order_ab
//   ./gpu_single_rows_order_ab [row_bytes ...]      (default 512 1024)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench/native/gpu_bench_util.cuh"

namespace {

constexpr int kWarp = 32, kK = 32, kInFlight = 4;

__device__ __forceinline__ uint4 Xor(uint4 a, uint4 b) { return make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w); }

__device__ __forceinline__ void StoreEvictFirst(uint4* p, uint4 v) {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(policy)
               : "memory");
}

// By bag (the shipped order): a warp per bag; its gradient row in registers; the bag's single-entry
// rows kInFlight at a time (table rows loaded first, then stored).
template <int W>  // 16-byte words per lane (row_bytes / 512)
__global__ void ByBag(const int32_t* idx, const uint32_t* count, int64_t num_bags, const uint4* grad,
                      const uint4* table, uint4* d_table) {
  const int64_t bag = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  if (bag >= num_bags) return;
  const int lane = threadIdx.x % kWarp;
  constexpr int64_t kRowWords = W * kWarp;
  uint4 g[W];
#pragma unroll
  for (int w = 0; w < W; ++w) g[w] = grad[bag * kRowWords + w * kWarp + lane];
  const int32_t my_row = idx[bag * kK + lane];
  unsigned pending = __ballot_sync(0xffffffffu, count[my_row] == 1u);
  while (pending) {
    int rows[kInFlight];
    uint4 t[kInFlight][W];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int at = pending ? __ffs(pending) - 1 : -1;
      if (pending) pending &= pending - 1;
      rows[j] = at >= 0 ? __shfl_sync(0xffffffffu, my_row, at) : -1;
#pragma unroll
      for (int w = 0; w < W; ++w)
        t[j][w] = rows[j] >= 0 ? table[rows[j] * kRowWords + w * kWarp + lane] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (rows[j] >= 0)
#pragma unroll
        for (int w = 0; w < W; ++w) StoreEvictFirst(d_table + rows[j] * kRowWords + w * kWarp + lane, Xor(g[w], t[j][w]));
  }
}

// Row order: a warp per 32 consecutive single-entry rows (ascending), each row's bag looked up.
template <int W>
__global__ void InRowOrder(const int32_t* single_rows, const int32_t* bag_of_single, int64_t num_single,
                           const uint4* grad, const uint4* table, uint4* d_table) {
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t first = group * kWarp;
  if (first >= num_single) return;
  constexpr int64_t kRowWords = W * kWarp;
  const int64_t mine = first + lane;
  const int32_t my_row = mine < num_single ? single_rows[mine] : -1;
  const int32_t my_bag = mine < num_single ? bag_of_single[mine] : -1;
  const int n = static_cast<int>(min(int64_t{kWarp}, num_single - first));
  for (int base = 0; base < n; base += kInFlight) {
    uint4 t[kInFlight][W], g[kInFlight][W];
    int rows[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int at = base + j;
      rows[j] = at < n ? __shfl_sync(0xffffffffu, my_row, at & 31) : -1;
      const int bag = at < n ? __shfl_sync(0xffffffffu, my_bag, at & 31) : -1;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        t[j][w] = rows[j] >= 0 ? table[rows[j] * kRowWords + w * kWarp + lane] : make_uint4(0, 0, 0, 0);
        g[j][w] = bag >= 0 ? grad[bag * kRowWords + w * kWarp + lane] : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (rows[j] >= 0)
#pragma unroll
        for (int w = 0; w < W; ++w) StoreEvictFirst(d_table + rows[j] * kRowWords + w * kWarp + lane, Xor(g[j][w], t[j][w]));
  }
}

__global__ void Copy(const uint4* in, uint4* out, int64_t words) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < words) out[i] = in[i];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t num_rows = int64_t{1} << 22, num_bags = 65536, n = num_bags * kK;
  std::vector<int64_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoll(argv[i]));
  if (sizes.empty()) sizes = {512, 1024};
  std::mt19937_64 rng(0);
  std::vector<int32_t> idx(n);
  std::vector<uint32_t> count(num_rows, 0);
  for (auto& i : idx) ++count[i = static_cast<int32_t>(rng() % num_rows)];
  std::vector<int32_t> single_rows, bag_of_single;
  std::vector<int32_t> bag_of_row(num_rows, -1);
  for (int64_t e = 0; e < n; ++e)
    if (count[idx[e]] == 1) bag_of_row[idx[e]] = static_cast<int32_t>(e / kK);
  for (int64_t r = 0; r < num_rows; ++r)
    if (bag_of_row[r] >= 0) {
      single_rows.push_back(static_cast<int32_t>(r));
      bag_of_single.push_back(bag_of_row[r]);
    }
  const int64_t num_single = static_cast<int64_t>(single_rows.size());
  int32_t *d_idx, *d_single, *d_bag_of_single;
  uint32_t* d_count;
  CHECK(cudaMalloc(&d_idx, n * 4));
  CHECK(cudaMalloc(&d_count, num_rows * 4));
  CHECK(cudaMalloc(&d_single, num_single * 4));
  CHECK(cudaMalloc(&d_bag_of_single, num_single * 4));
  CHECK(cudaMemcpy(d_idx, idx.data(), n * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_count, count.data(), num_rows * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_single, single_rows.data(), num_single * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_bag_of_single, bag_of_single.data(), num_single * 4, cudaMemcpyHostToDevice));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s; %lld rows, %lld entries, %lld rows of one entry\n\n", prop.name, (long long)num_rows,
              (long long)n, (long long)num_single);
  std::printf("| row bytes | variant | ms | TB/s (table rows read + d_table rows written) |\n|---|---|---|---|\n");
  for (int64_t row_bytes : sizes) {
    const int64_t words = row_bytes / 16;
    uint4 *grad, *table, *d_table;
    CHECK(cudaMalloc(&grad, num_bags * row_bytes));
    CHECK(cudaMalloc(&table, num_rows * row_bytes));
    CHECK(cudaMalloc(&d_table, num_rows * row_bytes));
    CHECK(cudaMemset(grad, 1, num_bags * row_bytes));
    CHECK(cudaMemset(table, 2, num_rows * row_bytes));
    const double bytes = 2.0 * num_single * row_bytes;
    auto row = [&](const char* name, float ms, double b) {
      std::printf("| %lld | %s | %.3f | %.2f |\n", (long long)row_bytes, name, ms, b / (ms * 1e-3) / 1e12);
    };
    row("memset of the single rows' bytes",
        MedianMs([&] { CHECK(cudaMemsetAsync(d_table, 0, static_cast<size_t>(bytes))); }), bytes);
    const int64_t half_words = static_cast<int64_t>(bytes / 2 / 16);
    row("plain copy of half those bytes (read + write)",
        MedianMs([&] { Copy<<<static_cast<unsigned>((half_words + 255) / 256), 256>>>(table, d_table, half_words); }),
        bytes);
    const unsigned bag_blocks = static_cast<unsigned>(num_bags * kWarp / 256);
    const unsigned row_blocks = static_cast<unsigned>(((num_single + 31) / 32 * kWarp + 255) / 256);
    if (words == 32) {
      row("by bag (shipped order)",
          MedianMs([&] { ByBag<1><<<bag_blocks, 256>>>(d_idx, d_count, num_bags, grad, table, d_table); }), bytes);
      row("in row order", MedianMs([&] {
            InRowOrder<1><<<row_blocks, 256>>>(d_single, d_bag_of_single, num_single, grad, table, d_table);
          }),
          bytes);
    } else if (words == 64) {
      row("by bag (shipped order)",
          MedianMs([&] { ByBag<2><<<bag_blocks, 256>>>(d_idx, d_count, num_bags, grad, table, d_table); }), bytes);
      row("in row order", MedianMs([&] {
            InRowOrder<2><<<row_blocks, 256>>>(d_single, d_bag_of_single, num_single, grad, table, d_table);
          }),
          bytes);
    }
    CHECK(cudaFree(grad));
    CHECK(cudaFree(table));
    CHECK(cudaFree(d_table));
  }
  return 0;
}
