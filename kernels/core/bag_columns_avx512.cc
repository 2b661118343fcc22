// The weighted forward's whole-bag kernels for AVX-512 CPUs (SumBag in
// vector_ops.h; bag_window.h calls it for the bags PreferSumBag names;
// without AVX-512, and in builds without PKM_X86_F16C, it returns false).
// A bag's sum is taken a block of 256 columns at a time: the block's sums
// stay in 16 zmm registers across all of the bag's rows and are stored once,
// where the group kernels (AxpyGroup*) load and store acc once per
// eight rows. Per column each kernel computes acc = fma(a[k], row_k, acc)
// from zero in row order, as AxpyGroupBF16Avx512 does from a zeroed acc (so
// bfloat16 bags come out bitwise the same; float32 and float16 rows were
// summed eight at a time and then added, so they differ by rounding).
// Measured against the group kernels, 2 threads, B=2048 N=65536, the core
// alone (bench/results/cpu_bag_kernel_ab_xeon207_round41.md): on the Xeon
// (model 207) K=64-128 D=512 bfloat16 and float16 0.86-0.91x the time, D=256
// bfloat16 0.90-1.0x, float16 D=64-256 0.84-0.96x, float32 0.97-1.05x (no
// gain); a first version on the 2-core Zen 5 EPYC, D=512 float32 0.86x,
// bfloat16 0.9x. SingleRowBag (AVX-512 BF16; its kernel is in
// vector_ops_f16c.cc, beside the rounding it shares) writes a bag of one
// bfloat16 row straight into its bfloat16 output row; against AssignRow +
// FromAcc through a float32 row, B=2048 K=1 D=512 on the Xeon (model 207),
// the core alone: 0.93-0.94x the time (bench/results/cpu_roofline_notes.md,
// round 42).
#include "kernels/core/vector_ops.h"

#if defined(PKM_X86_F16C)
#include <immintrin.h>
#endif

namespace pkm {
namespace vec {

#if defined(PKM_X86_F16C)
namespace {
#define PKM_AVX512_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))

// Row readers: Accumulate<V> adds w times the V vectors of 16 floats at a
// block's start p into sum[0, V), each vector as soon as it is loaded (with
// all V loaded first, GCC spilled two of the 32 registers 16 sums need).
// Vector j of a block belongs at acc + 16 * j: for bfloat16, one 64-byte load
// holds 32 columns, its 16 even columns then its 16 odd ones (the layout of
// AxpyGroupBF16Avx512, which RestoreAccOrder and FromAcc undo).
struct Float32Rows {
  static constexpr int kElemBytes = 4;
  static constexpr int kVectorsPerLoad = 1;
  template <int V>
  PKM_AVX512_TARGET __attribute__((always_inline)) static void Accumulate(const char* p, __m512 w, __m512* sum) {
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) sum[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(p + 64 * j), sum[j]);
  }
};
struct Float16Rows {
  static constexpr int kElemBytes = 2;
  static constexpr int kVectorsPerLoad = 1;
  template <int V>
  PKM_AVX512_TARGET __attribute__((always_inline)) static void Accumulate(const char* p, __m512 w, __m512* sum) {
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) {
      const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
      sum[j] = _mm512_fmadd_ps(w, x, sum[j]);
    }
  }
};
struct BFloat16Rows {
  static constexpr int kElemBytes = 2;
  static constexpr int kVectorsPerLoad = 2;
  template <int V>
  PKM_AVX512_TARGET __attribute__((always_inline)) static void Accumulate(const char* p, __m512 w, __m512* sum) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
#pragma GCC unroll 8
    for (int j = 0; j < V / 2; ++j) {
      const __m512i v = _mm512_loadu_si512(p + 64 * j);
      sum[2 * j] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), sum[2 * j]);
      sum[2 * j + 1] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_and_si512(v, high)), sum[2 * j + 1]);
    }
  }
};

// Columns [col, col + 16 V) of the bag's sum into acc. With each row's block
// it prefetches the same block of ahead[k] (bag_window.h: the row `ahead`
// entries later, in this bag or a later one); the bag's passes over its other
// blocks prefetch ahead[k]'s other blocks.
template <typename Rows, int V>
PKM_AVX512_TARGET __attribute__((always_inline)) inline void SumColumnBlock(const float* a, const char* const* rows,
                                                                            const char* const* ahead, int64_t count,
                                                                            int64_t col, float* acc) {
  constexpr int kBlockBytes = V * 16 * Rows::kElemBytes;
  const int64_t offset = col * Rows::kElemBytes;
  __m512 sum[V];
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) sum[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < count; ++k) {
#pragma GCC unroll 16
    for (int line = 0; line < kBlockBytes; line += 64) PrefetchTableLine(ahead[k] + offset + line);
    Rows::template Accumulate<V>(rows[k] + offset, _mm512_set1_ps(a[k]), sum);
  }
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) _mm512_storeu_ps(acc + col + 16 * j, sum[j]);
}

// The last block, of `vectors` < 16 vectors: one instantiation per width.
template <typename Rows, int V = 15>
PKM_AVX512_TARGET __attribute__((always_inline)) inline void SumLastBlock(int vectors, const float* a,
                                                                          const char* const* rows,
                                                                          const char* const* ahead, int64_t count,
                                                                          int64_t col, float* acc) {
  if constexpr (V > 0) {
    if constexpr (V % Rows::kVectorsPerLoad == 0) {
      if (vectors == V) return SumColumnBlock<Rows, V>(a, rows, ahead, count, col, acc);
    }
    SumLastBlock<Rows, V - 1>(vectors, a, rows, ahead, count, col, acc);
  }
}

template <typename Rows>
PKM_AVX512_TARGET __attribute__((always_inline)) inline void SumBagImpl(const float* a, const char* const* rows,
                                                                        const char* const* ahead, int64_t count,
                                                                        float* acc, int64_t n) {
  int64_t col = 0;
  for (; col + 256 <= n; col += 256) SumColumnBlock<Rows, 16>(a, rows, ahead, count, col, acc);
  if (col < n) SumLastBlock<Rows>(static_cast<int>((n - col) / 16), a, rows, ahead, count, col, acc);
}

PKM_AVX512_TARGET void SumBagF32(const float* a, const char* const* rows, const char* const* ahead, int64_t count,
                                 float* acc, int64_t n) {
  SumBagImpl<Float32Rows>(a, rows, ahead, count, acc, n);
}
PKM_AVX512_TARGET void SumBagF16(const float* a, const char* const* rows, const char* const* ahead, int64_t count,
                                 float* acc, int64_t n) {
  SumBagImpl<Float16Rows>(a, rows, ahead, count, acc, n);
}
PKM_AVX512_TARGET void SumBagBF16(const float* a, const char* const* rows, const char* const* ahead, int64_t count,
                                  float* acc, int64_t n) {
  SumBagImpl<BFloat16Rows>(a, rows, ahead, count, acc, n);
}
#undef PKM_AVX512_TARGET
}  // namespace
#endif  // PKM_X86_F16C

bool SumBag(ElemType type, const float* a, const char* const* rows, const char* const* ahead, int64_t count,
            float* acc, int64_t n) {
#if defined(PKM_X86_F16C)
  if (!f16c::HasAvx512() || n > 512 || n * ElemSize(type) % 64 != 0) return false;
  switch (type) {
    case ElemType::kFloat32: SumBagF32(a, rows, ahead, count, acc, n); return true;
    case ElemType::kFloat16: SumBagF16(a, rows, ahead, count, acc, n); return true;
    case ElemType::kBFloat16: SumBagBF16(a, rows, ahead, count, acc, n); return true;
    case ElemType::kInt8: return false;
  }
#endif
  return false;
}

bool SingleRowBag(ElemType type, float a, float scale, const char* row, const char* ahead, ElemType out_type,
                  void* dst, int64_t n) {
#if defined(PKM_X86_F16C)
  if (type == ElemType::kBFloat16 && out_type == ElemType::kBFloat16 && n % 32 == 0 && f16c::HasAvx512Bf16()) {
    f16c::SingleRowBF16Avx512Bf16(a, scale, row, ahead, static_cast<uint16_t*>(dst), n);
    return true;
  }
#endif
  return false;
}

}  // namespace vec
}  // namespace pkm
