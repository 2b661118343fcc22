// How fast can the dense backward zero the rows no entry touched? (issue #25, round 34)
// The huge-table backward (B=65536 K=32 D=256 N=4M) zeroes the ~61% of d_table's rows that no index
// touched in its own launch (UntouchedRowsKernel, backward_positions.cu): on the H100 of round 24 it
// took 454 us for bf16 rows (2.86 TB/s) and 1022 us for fp32 ones (2.55 TB/s) where a cudaMemsetAsync of
// all of d_table writes at 3.27 TB/s. This standalone A/B times ways to write the same zeros on the
// same pattern (2M uniform indices over 4M rows), against memsets of the same bytes:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I. bench/native/gpu_zero_rows_ab.cu -o gpu_zero_rows_ab
//   ./gpu_zero_rows_ab [row_bytes ...]      (default 512 1024)
// Variants: "warp/32 rows" is the shipped kernel's pattern (a warp per 32 rows, 16-byte stores, L2
// evict_first or plain); "all rows" the same writing every row (what the gaps between untouched rows
// cost); "tma runs" a warp per 32 rows whose lane 0 stores each run of consecutive untouched rows with
// bulk copies (cp.async.bulk) from a zeroed shared-memory buffer; "block/256 rows" a block per 256 rows
// writing 16-byte chunks in address order, skipping touched rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench/native/gpu_bench_util.cuh"

namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ void Store16(void* p, bool evict_first) {
  if (evict_first) {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %1, %1, %1}, %2;" ::"l"(p), "r"(0u), "l"(policy)
                 : "memory");
  } else {
    *static_cast<uint4*>(p) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// The untouched rows of [r0, r0 + 32) as a warp's bit mask (lane i: row r0 + i): seg_begin[r] ==
// seg_begin[r + 1], the shipped kernel's test; every row of the window with all_rows.
__device__ __forceinline__ unsigned UntouchedMask(const uint32_t* seg_begin, int64_t num_rows, int64_t r0, int lane,
                                                  bool all_rows) {
  const int64_t r = r0 + lane;
  const uint32_t begin = r <= num_rows ? seg_begin[r] : 0u;
  uint32_t next = __shfl_down_sync(0xffffffffu, begin, 1);
  if (lane == kWarp - 1) next = r + 1 <= num_rows ? seg_begin[r + 1] : 0u;
  return __ballot_sync(0xffffffffu, r < num_rows && (all_rows || next == begin));
}

// A warp per 32 rows; seg_begin[r] == seg_begin[r + 1] marks row r untouched (the shipped test).
__global__ void WarpPer32Rows(const uint32_t* seg_begin, int64_t num_rows, int64_t row_bytes, char* out,
                              bool evict_first, bool all_rows) {
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t r0 = group * kWarp;
  if (r0 >= num_rows) return;
  unsigned untouched = UntouchedMask(seg_begin, num_rows, r0, lane, all_rows);
  while (untouched != 0) {
    const int bit = __ffs(untouched) - 1;
    untouched &= untouched - 1;
    char* row = out + (r0 + bit) * row_bytes;
    for (int64_t b = static_cast<int64_t>(lane) * 16; b < row_bytes; b += kWarp * 16) Store16(row + b, evict_first);
  }
}

// A block of 256 threads per 256 rows: 16-byte chunks in address order over the block's rows,
// each thread skipping chunks of touched rows.
__global__ void BlockPer256Rows(const uint32_t* seg_begin, int64_t num_rows, int64_t row_bytes, char* out,
                                bool evict_first) {
  __shared__ unsigned char untouched[256];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * 256;
  const int64_t r = r0 + threadIdx.x;
  untouched[threadIdx.x] = r < num_rows && seg_begin[r] == seg_begin[r + 1];
  __syncthreads();
  const int64_t rows = min(int64_t{256}, num_rows - r0);
  const int64_t chunks = rows * row_bytes / 16, chunks_per_row = row_bytes / 16;
  char* base = out + r0 * row_bytes;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x)
    if (untouched[c / chunks_per_row]) Store16(base + c * 16, evict_first);
}

// Bulk stores (TMA, sm_90): lane 0 of a warp per 32 rows stores each run of consecutive untouched rows
// from a zeroed shared buffer of kZeroBytes, in pieces of at most that.
constexpr int kZeroBytes = 8192;
__global__ void TmaRuns(const uint32_t* seg_begin, int64_t num_rows, int64_t row_bytes, char* out) {
  __shared__ alignas(128) unsigned char zeros[kZeroBytes];
  for (int i = threadIdx.x * 16; i < kZeroBytes; i += blockDim.x * 16)
    *reinterpret_cast<uint4*>(zeros + i) = make_uint4(0u, 0u, 0u, 0u);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t r0 = group * kWarp;
  if (r0 >= num_rows) return;
  unsigned untouched = UntouchedMask(seg_begin, num_rows, r0, lane, false);
  if (lane != 0) return;
  const uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(zeros));
  while (untouched != 0) {
    const int first = __ffs(untouched) - 1;
    const unsigned from_first = untouched >> first;
    const int run = (~from_first == 0u) ? kWarp - first : __ffs(~from_first) - 1;
    untouched = run + first >= kWarp ? 0u : untouched & ~(((1u << run) - 1u) << first);
    char* dst = out + (r0 + first) * row_bytes;
    for (int64_t left = run * row_bytes; left > 0;) {
      const uint32_t n = static_cast<uint32_t>(min(left, int64_t{kZeroBytes}));
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem), "r"(n)
                   : "memory");
      dst += n;
      left -= n;
    }
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// A plain memset kernel: each thread stores UNROLL 16-byte chunks a grid's width apart, grid-stride.
template <int UNROLL>
__global__ void LinearZeros(char* out, int64_t chunks) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks; c += stride * UNROLL)
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (c + u * stride < chunks) Store16(out + (c + u * stride) * 16, true);
}

// The same address order as LinearZeros<1> (a thread per 16-byte chunk, consecutive warps on
// consecutive 512 bytes), storing only the chunks of untouched rows.
__global__ void LinearUntouched(const uint32_t* seg_begin, int64_t row_chunks, int64_t chunks, char* out,
                                bool evict_first) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  const int64_t r = c / row_chunks;
  if (__ldg(seg_begin + r) == __ldg(seg_begin + r + 1)) Store16(out + c * 16, evict_first);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t num_rows = int64_t{1} << 22, num_indices = int64_t{1} << 21;
  std::vector<int64_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoll(argv[i]));
  if (sizes.empty()) sizes = {512, 1024};
  std::mt19937_64 rng(0);
  std::vector<uint32_t> count(num_rows + 1, 0), seg(num_rows + 1, 0);
  for (int64_t i = 0; i < num_indices; ++i) ++count[rng() % num_rows];
  int64_t untouched_rows = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    seg[r + 1] = seg[r] + count[r];
    untouched_rows += count[r] == 0;
  }
  uint32_t* d_seg;
  CHECK(cudaMalloc(&d_seg, (num_rows + 1) * sizeof(uint32_t)));
  CHECK(cudaMemcpy(d_seg, seg.data(), (num_rows + 1) * sizeof(uint32_t), cudaMemcpyHostToDevice));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s; %lld rows, %lld untouched (%.1f%%)\n\n", prop.name, (long long)num_rows,
              (long long)untouched_rows, 100.0 * untouched_rows / num_rows);
  std::printf("| row bytes | variant | ms | TB/s of untouched rows' bytes | of memset rate |\n|---|---|---|---|---|\n");
  for (int64_t row_bytes : sizes) {
    char* out;
    const size_t total = static_cast<size_t>(num_rows * row_bytes);
    CHECK(cudaMalloc(&out, total));
    const double zero_bytes = static_cast<double>(untouched_rows) * row_bytes;
    const float memset_all = MedianMs([&] { CHECK(cudaMemsetAsync(out, 0, total)); });
    const double memset_rate = total / (memset_all * 1e-3) / 1e12;
    auto row = [&](const char* name, float ms, double bytes) {
      const double rate = bytes / (ms * 1e-3) / 1e12;
      std::printf("| %lld | %s | %.3f | %.2f | %.3f |\n", (long long)row_bytes, name, ms, rate, rate / memset_rate);
    };
    row("cudaMemsetAsync, all of d_table", memset_all, total);
    const size_t share = static_cast<size_t>(zero_bytes) / 256 * 256;
    row("cudaMemsetAsync, the untouched bytes' size", MedianMs([&] { CHECK(cudaMemsetAsync(out, 0, share)); }),
        share);
    const unsigned warp_blocks = static_cast<unsigned>((num_rows / kWarp + 7) / 8);
    for (bool hint : {true, false}) {
      row(hint ? "warp/32 rows, evict_first (shipped)" : "warp/32 rows, plain stores", MedianMs([&] {
            WarpPer32Rows<<<warp_blocks, 256>>>(d_seg, num_rows, row_bytes, out, hint, false);
          }),
          zero_bytes);
    }
    row("warp/32 rows, all rows (no gaps), evict_first",
        MedianMs([&] { WarpPer32Rows<<<warp_blocks, 256>>>(d_seg, num_rows, row_bytes, out, true, true); }), total);
    const int64_t all_chunks = static_cast<int64_t>(total / 16);
    row("linear kernel, all of d_table, 1 chunk a thread",
        MedianMs([&] { LinearZeros<1><<<static_cast<unsigned>(all_chunks / 256), 256>>>(out, all_chunks); }), total);
    row("linear kernel, all of d_table, 4 chunks a thread, grid 132x16 blocks",
        MedianMs([&] { LinearZeros<4><<<132 * 16, 256>>>(out, all_chunks); }), total);
    for (bool hint : {true, false}) {
      row(hint ? "linear untouched, evict_first" : "linear untouched, plain", MedianMs([&] {
            LinearUntouched<<<static_cast<unsigned>(all_chunks / 256), 256>>>(d_seg, row_bytes / 16, all_chunks, out,
                                                                             hint);
          }),
          zero_bytes);
    }
    for (bool hint : {true, false}) {
      row(hint ? "block/256 rows, evict_first" : "block/256 rows, plain", MedianMs([&] {
            BlockPer256Rows<<<static_cast<unsigned>(num_rows / 256), 256>>>(d_seg, num_rows, row_bytes, out, hint);
          }),
          zero_bytes);
    }
    row("tma runs", MedianMs([&] { TmaRuns<<<warp_blocks, 256>>>(d_seg, num_rows, row_bytes, out); }), zero_bytes);
    // Correctness of each variant's pattern: fill with 0xff, run, count zero rows.
    std::vector<unsigned char> host(total);
    auto check = [&](const char* name, auto launch) {
      CHECK(cudaMemset(out, 0xff, total));
      launch();
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(host.data(), out, total, cudaMemcpyDeviceToHost));
      int64_t bad = 0;
      for (int64_t r = 0; r < num_rows; ++r) {
        const unsigned char want = count[r] == 0 ? 0x00 : 0xff;
        for (int64_t b = 0; b < row_bytes; b += 61) bad += host[r * row_bytes + b] != want;
      }
      if (bad) std::printf("CHECK FAILED %s row_bytes %lld: %lld bytes\n", name, (long long)row_bytes, (long long)bad);
    };
    check("warp", [&] { WarpPer32Rows<<<warp_blocks, 256>>>(d_seg, num_rows, row_bytes, out, true, false); });
    check("block", [&] {
      BlockPer256Rows<<<static_cast<unsigned>(num_rows / 256), 256>>>(d_seg, num_rows, row_bytes, out, true);
    });
    check("linear", [&] {
      LinearUntouched<<<static_cast<unsigned>(total / 16 / 256), 256>>>(d_seg, row_bytes / 16, total / 16, out, true);
    });
    check("tma", [&] { TmaRuns<<<warp_blocks, 256>>>(d_seg, num_rows, row_bytes, out); });
    CHECK(cudaFree(out));
  }
  return 0;
}
