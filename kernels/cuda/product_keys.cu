// Product-key selection of a PKM layer on the GPU (pkm_cuda_product_topk and
// its backward, embedding_bag_cuda.h): per query row, the top knn of each
// half's key scores, then the top knn of the knn x knn sums of those
// (Lample et al. 2019), in one kernel instead of three top-k passes, a sum
// and a gather. One warp per row.
//
// A half's top knn: each lane sorts its n_keys / 32 scores in registers (a
// bitonic network), then knn rounds of a warp argmax over the lanes' heads,
// the winning lane popping its head. The sums: lane i's pairs a_i + b_j are
// already in descending order of j, and only pairs with (i + 1)(j + 1) <= knn
// can be among the knn best (every pair (i' <= i, j' <= j) sums at least as
// high), so knn more rounds over the lanes' heads pick them. Ties go to the
// smaller key (position, or i1 * n_keys + i2) where the order allows:
// results are deterministic. Sums are float32 a + b, as the composite's.
// Candidates are compared as packed uint64 (score order, then key).
#include <string>

#include "kernels/cuda/common.cuh"

namespace pkm_cuda {
namespace {

constexpr int kTopkThreads = 128;
constexpr int kTopkWarps = kTopkThreads / kWarp;

// A (score, key) candidate as one uint64 that orders as "larger score, then
// smaller key": the score's bits mapped to an order-preserving uint32 (-0
// below +0; a NaN above +inf or, sign bit set, below -inf: deterministic, not
// checked) over ~key. 0 is below every candidate (no candidate). One compare
// and one 64-bit shuffle per step.
__device__ __forceinline__ uint64_t Candidate(float score, int32_t key) {
  uint32_t u = __float_as_uint(score);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | static_cast<uint32_t>(~key);
}
__device__ __forceinline__ float CandidateScore(uint64_t c) {
  const uint32_t u = static_cast<uint32_t>(c >> 32);
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}
__device__ __forceinline__ int32_t CandidateKey(uint64_t c) { return static_cast<int32_t>(~static_cast<uint32_t>(c)); }

// The warp's best candidate.
__device__ __forceinline__ uint64_t WarpBest(uint64_t c) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const uint64_t other = __shfl_xor_sync(kFullMask, c, offset);
    c = other > c ? other : c;
  }
  return c;
}

// Sorts c[0..N) best first (a bitonic network: static indices, so the array
// stays in registers).
template <int N>
__device__ __forceinline__ void SortLane(uint64_t (&c)[N]) {
#pragma unroll
  for (int k = 2; k <= N; k *= 2)
#pragma unroll
    for (int j = k / 2; j > 0; j /= 2)
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int l = i ^ j;
        if (l <= i) continue;
        const uint64_t hi = c[i] > c[l] ? c[i] : c[l], lo = c[i] > c[l] ? c[l] : c[i];
        const bool best_first = (i & k) == 0;  // this block of the network sorts best first
        c[i] = best_first ? hi : lo;
        c[l] = best_first ? lo : hi;
      }
}

// Top knn of one half's n_keys scores: lane t ends holding rank t's value and
// position. Lane l owns positions l, l + 32, ..., KPL of them at most.
template <int KPL>
__device__ __forceinline__ void HalfTopk(const float* scores, int n_keys, int knn, int lane, float* top_v,
                                         int32_t* top_pos) {
  uint64_t c[KPL];
#pragma unroll
  for (int i = 0; i < KPL; ++i) {
    const int p = lane + i * kWarp;
    c[i] = p < n_keys ? Candidate(scores[p], p) : 0ull;
  }
  SortLane<KPL>(c);
  for (int t = 0; t < knn; ++t) {
    const uint64_t best = WarpBest(c[0]);
    if (best == c[0]) {  // this lane's head won (candidates are unique): pop it
#pragma unroll
      for (int i = 0; i + 1 < KPL; ++i) c[i] = c[i + 1];
      c[KPL - 1] = 0ull;
    }
    if (lane == t) {
      *top_v = CandidateScore(best);
      *top_pos = CandidateKey(best);
    }
  }
}

template <int KPL>
__global__ void __launch_bounds__(kTopkThreads) ProductTopkKernel(const float* __restrict__ scores, int64_t rows,
                                                                  int n_keys, int knn, float* best, int64_t* index,
                                                                  int32_t* pos) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kTopkWarps + threadIdx.x / kWarp;
  if (row >= rows) return;
  const float* s = scores + row * 2 * n_keys;
  float a_v = 0.f, b_v = 0.f;
  int32_t a_pos = 0, b_pos = 0;
  HalfTopk<KPL>(s, n_keys, knn, lane, &a_v, &a_pos);
  HalfTopk<KPL>(s + n_keys, n_keys, knn, lane, &b_v, &b_pos);
  // Lane i's pairs (i, j), j < knn / (i + 1), in order of j: its head is j = next_j.
  const int pairs = lane < knn ? knn / (lane + 1) : 0;
  int next_j = 0;
  for (int t = 0; t < knn; ++t) {
    const float bj = __shfl_sync(kFullMask, b_v, next_j % kWarp);
    const int32_t bj_pos = __shfl_sync(kFullMask, b_pos, next_j % kWarp);
    const uint64_t head = next_j < pairs ? Candidate(a_v + bj, a_pos * n_keys + bj_pos) : 0ull;
    const uint64_t winner = WarpBest(head);
    if (winner == head) ++next_j;
    if (lane == t) {
      const int32_t key = CandidateKey(winner);
      best[row * knn + t] = CandidateScore(winner);
      index[row * knn + t] = key;
      pos[(row * knn + t) * 2] = key / n_keys;
      pos[(row * knn + t) * 2 + 1] = key % n_keys;
    }
  }
}

// d_scores[row] = 0, then each half position picked by some best gets the sum
// of their d_best (in rank order: deterministic). One warp per row.
__global__ void __launch_bounds__(kTopkThreads) ProductTopkBackwardKernel(const float* __restrict__ d_best,
                                                                          const int32_t* __restrict__ pos,
                                                                          int64_t rows, int n_keys, int knn,
                                                                          float* d_scores) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kTopkWarps + threadIdx.x / kWarp;
  if (row >= rows) return;
  float* out = d_scores + row * 2 * n_keys;
  for (int i = lane; i < 2 * n_keys; i += kWarp) out[i] = 0.f;
  __syncwarp();
  const float d = lane < knn ? d_best[row * knn + lane] : 0.f;
  const int32_t my_pos[2] = {lane < knn ? pos[(row * knn + lane) * 2] : -1,
                             lane < knn ? pos[(row * knn + lane) * 2 + 1] : -1};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = 0.f;
    bool first = lane < knn;  // the lowest rank with this position writes
    for (int t = 0; t < knn; ++t) {
      const int32_t p = __shfl_sync(kFullMask, my_pos[h], t);
      const float dt = __shfl_sync(kFullMask, d, t);
      if (p == my_pos[h]) {
        sum += dt;
        if (t < lane) first = false;
      }
    }
    if (first) out[h * n_keys + my_pos[h]] = sum;
  }
}

unsigned RowBlocks(int64_t rows) { return static_cast<unsigned>((rows + kTopkWarps - 1) / kTopkWarps); }

template <int KPL>
void LaunchTopk(const float* scores, int64_t rows, int n_keys, int knn, float* best, int64_t* index, int32_t* pos,
                cudaStream_t stream) {
  ProductTopkKernel<KPL><<<RowBlocks(rows), kTopkThreads, 0, stream>>>(scores, rows, n_keys, knn, best, index, pos);
}

int CheckShape(int64_t rows, int64_t n_keys, int knn) {
  if (rows < 0) return SetInvalid("product top-k: rows must be >= 0, got " + std::to_string(rows));
  if (n_keys < 1 || n_keys > 1024)
    return SetInvalid("product top-k: n_keys must be in [1, 1024], got " + std::to_string(n_keys));
  if (knn < 1 || knn > kWarp || knn > n_keys)
    return SetInvalid("product top-k: knn must be in [1, min(32, n_keys)], got " + std::to_string(knn));
  if (rows / kTopkWarps >= INT32_MAX) return SetInvalid("product top-k: too many rows for one launch");
  return PKM_CUDA_OK;
}

}  // namespace
}  // namespace pkm_cuda

extern "C" int pkm_cuda_product_topk(const float* scores, int64_t rows, int64_t n_keys, int knn, float* best,
                                     int64_t* index, int32_t* pos, pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  if (int status = CheckShape(rows, n_keys, knn)) return status;
  if (rows == 0) return PKM_CUDA_OK;
  if (scores == nullptr || best == nullptr || index == nullptr || pos == nullptr)
    return SetInvalid("product top-k: null buffer");
  const int n = static_cast<int>(n_keys);
  if (n_keys <= 8 * kWarp) LaunchTopk<8>(scores, rows, n, knn, best, index, pos, stream);
  else if (n_keys <= 16 * kWarp) LaunchTopk<16>(scores, rows, n, knn, best, index, pos, stream);
  else LaunchTopk<32>(scores, rows, n, knn, best, index, pos, stream);
  return CheckLaunch("pkm_cuda_product_topk");
}

extern "C" int pkm_cuda_product_topk_backward(const float* d_best, const int32_t* pos, int64_t rows, int64_t n_keys,
                                              int knn, float* d_scores, pkm_cuda_stream_t stream) {
  using namespace pkm_cuda;
  if (int status = CheckShape(rows, n_keys, knn)) return status;
  if (rows == 0) return PKM_CUDA_OK;
  if (d_best == nullptr || pos == nullptr || d_scores == nullptr)
    return SetInvalid("product top-k backward: null buffer");
  ProductTopkBackwardKernel<<<RowBlocks(rows), kTopkThreads, 0, stream>>>(
      d_best, pos, rows, static_cast<int>(n_keys), knn, d_scores);
  return CheckLaunch("pkm_cuda_product_topk_backward");
}
