// Row-wise vector primitives of the CPU core. Built by GCC for x86-64, each is
// compiled several times (AVX-512, AVX2+FMA+F16C, baseline) and picked at load
// time by the CPU, so the library is fast on new CPUs and still loads on old
// ones. Clang builds, -DPKM_NO_MULTIVERSION builds and other architectures get
// one baseline copy (x86-64: SSE2 only; aarch64: NEON/ASIMD, which every
// ARMv8-A CPU has).
#ifndef PKM_KERNELS_CORE_VECTOR_OPS_H_
#define PKM_KERNELS_CORE_VECTOR_OPS_H_

#include <cstdint>

#include "kernels/core/embedding_bag.h"

// The compiler's IEEE binary16 type, where it has one: it converts with
// hardware instructions (F16C in the x86 clones; FCVTL/FCVTN, base ARMv8-A, on
// aarch64). GCC 12's C++ front end has no _Float16 on aarch64, so there it is
// __fp16, ARM's IEEE half storage type (arithmetic promotes to float either way).
#if defined(__aarch64__) && defined(__GNUC__)
#define PKM_HAS_COMPILER_HALF 1
namespace pkm::vec { using CompilerHalf = __fp16; }
#elif defined(__FLT16_MAX__)
#define PKM_HAS_COMPILER_HALF 1
namespace pkm::vec { using CompilerHalf = _Float16; }
#endif

// x86-64 GCC builds: fp16 kernels with F16C intrinsics (vector_ops_f16c.cc),
// used by the dispatchers in vector_ops.cc where the CPU has them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(PKM_NO_MULTIVERSION)
#define PKM_X86_F16C 1
#endif

// The core's row loops are compiled once per CPU generation on x86-64 GCC
// builds; the dynamic loader picks the best (ifunc). One copy elsewhere.
#if defined(PKM_X86_F16C)
#define PKM_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PKM_MULTIVERSION
#endif

namespace pkm {
namespace vec {

// acc[i] += a * row[i] (float32 rows: the backward's accumulation).
void AxpyF32(float a, const float* row, float* acc, int64_t n);

// The weighted forward's kernels over rows of a float storage type `type`:
// acc[i] += sum_r a[r] * rows[r][i] over kRowGroup rows, and acc[i] += a *
// row[i]. While summing a row they prefetch the same lines of its `ahead` row
// (bag_window.h). Eight independent row streams keep enough cache misses in
// flight, and acc is loaded and stored once per eight rows.
constexpr int kRowGroup = 8;

// The forward's software prefetch of a line of the table (a row, or an int8
// row's scale and bias) that a later step reads: into L2 rather than L1
// (locality 2: prefetcht1 on x86, PLDL2KEEP on aarch64). Measured on a Zen 4
// EPYC, one thread, rows from memory: the same prefetches into L1 took 1.34x
// the time (float32, B=2048 K=128 D=512) and 1.63x (bfloat16); int8 scales
// and biases into L1, 1.26x (B=16 K=128 D=512)
// (bench/results/cpu_roofline_notes.md, round 18).
inline void PrefetchTableLine(const void* p) { __builtin_prefetch(p, 0, 2); }
void AxpyGroup(ElemType type, const float* a, const char* const* rows, const char* const* ahead, float* acc,
               int64_t n);
void AxpyRow(ElemType type, float a, const char* row, const char* ahead, float* acc, int64_t n);
// A bag's first row: the same as zeroing acc and AxpyRow(type, ...), where a
// kernel for it exists (float32 rows; bfloat16 rows with AVX2 or AVX-512);
// returns false, touching nothing, elsewhere.
bool AssignRow(ElemType type, float a, const char* row, const char* ahead, float* acc, int64_t n);
// A whole bag in one call: acc[i] = sum_k a[k] * rows[k][i] over `count`
// rows, a block of columns at a time with the block's sums in registers
// (bag_columns_avx512.cc), prefetching as AxpyGroup does with ahead[k] for
// rows[k]. acc gets AxpyGroup's column order. Returns false, touching
// nothing, where it has no kernel: CPUs without AVX-512, int8 rows, rows that
// are not whole 64-byte lines or wider than 512 columns. Meant for the bags
// PreferSumBag names.
bool SumBag(ElemType type, const float* a, const char* const* rows, const char* const* ahead, int64_t count,
            float* acc, int64_t n);
// Whether the forward tries SumBag for a bag of `count` rows of n columns
// before the group and row kernels. Measured against those (2 threads,
// B=2048 N=65536, the core alone, on the Xeon model 207; rounds 41 and 42 in
// bench/results/cpu_bag_kernel_ab_xeon207_round41.md and _round42.md): bags
// of kSumBagMinRows rows or more 0.84-1.05x the time; float16 bags of 1-7
// rows, which have no AssignRow kernel, 0.62-1.0x; 16-bit rows of at most
// 256 columns in bags of kRowGroup rows or more 0.92-0.98x. Slower where it
// is not used: bfloat16 bags of 2-4 rows of 256 columns 1.01-1.07x; 16-bit
// bags of 8-32 rows of 512 columns 1.02-1.13x; float32 bags of 8-32 rows of
// 256 columns 1.02-1.06x, of 1024-2048 columns 1.01-1.08x.
constexpr int64_t kSumBagMinRows = 64;
inline bool PreferSumBag(ElemType type, int64_t n, int64_t count) {
  if (count >= kSumBagMinRows) return true;
  if (type == ElemType::kFloat16 && count >= 1 && count < kRowGroup) return true;
  return (type == ElemType::kFloat16 || type == ElemType::kBFloat16) && n <= 256 && count >= kRowGroup;
}
// A bag of one entry straight into its output row: dst = FromAcc(scale, a *
// row) in out_type, bitwise as AssignRow then FromAcc give it, without the
// float32 row between them. Returns false, touching nothing, where it has no
// kernel (all but bfloat16 rows and outputs of a multiple of 32 columns on
// CPUs with AVX-512 BF16).
bool SingleRowBag(ElemType type, float a, float scale, const char* row, const char* ahead, ElemType out_type,
                  void* dst, int64_t n);
// After the last AxpyGroup/AxpyRow into acc: puts acc in column order (some
// kernels accumulate columns permuted within blocks; a no-op for the others).
void RestoreAccOrder(ElemType type, float* acc, int64_t n);
// RestoreAccOrder(type, acc, n), then FromFloat(acc, scale, out_type, dst, n);
// acc may be left in either order.
void FromAcc(ElemType type, float* acc, float scale, ElemType out_type, void* dst, int64_t n);

// acc[i] = table[row, i] if it is strictly greater than acc[i] or NaN
// (dequantised for int8): the max combiner's running maximum. NaN propagates,
// as in np.max and TF's reduce_max, so a bag's result does not depend on its order.
void MaxRow(const Table& table, int64_t row, float* acc);
// dst[i] = table[row, i] as float32 (dequantised for int8).
void RowToFloat(const Table& table, int64_t row, float* dst);

// The max combiner's backward. MaxArgRow: where row[i] > best[i], or row[i]
// is the first NaN, best[i] = row[i] and winner[i] = k. AddWhereWinner: acc[i] += g[i] where winner[i] == k.
void MaxArgRow(const float* row, int32_t k, float* best, int32_t* winner, int64_t n);
void AddWhereWinner(const float* g, const int32_t* winner, int32_t k, float* acc, int64_t n);

// x[i] *= scale (nothing to do for a scale of 1).
void ScaleInPlace(float* x, float scale, int64_t n);
// FromAcc into acc itself, for float32 outputs: column order restored, then
// ScaleInPlace.
void ScaleAccInPlace(ElemType type, float* acc, float scale, int64_t n);

// dst[i] = float(src[i]) for a float storage type.
void ToFloat(const void* src, ElemType type, float* dst, int64_t n);
// dst[i] = scale * src[i] converted to a float storage type.
void FromFloat(const float* src, float scale, ElemType type, void* dst, int64_t n);

// dst[i] = src[i] (src null: 0) with non-temporal stores where the CPU has
// them (x86 SSE): dst's lines are written without being read first and bypass
// the caches. StreamFence() after the last one, before dst is read elsewhere.
// Elsewhere plain stores, and kHasStreamingStores is false.
#if defined(__x86_64__) || defined(__SSE2__)
constexpr bool kHasStreamingStores = true;
#else
constexpr bool kHasStreamingStores = false;
#endif
void StreamF32(const float* src, float* dst, int64_t n);
void StreamFence();

float Dot(const float* x, const float* y, int64_t n);

// acc[i] += a * g[i], returning dot(g, row): the backward's two uses of a
// gradient row in one pass over it.
float AxpyDot(float a, const float* g, const float* row, float* acc, int64_t n);

// Scalar element read (float storage types only). Inline: it sits in the
// per-index loops.
inline float LoadElem(const void* base, ElemType type, int64_t i) {
  switch (type) {
    case ElemType::kFloat32:
      return static_cast<const float*>(base)[i];
    case ElemType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case ElemType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case ElemType::kInt8:
      return static_cast<const int8_t*>(base)[i];
  }
  return 0.f;
}

#if defined(PKM_X86_F16C)
namespace f16c {
bool HasF16C();  // AVX2 + FMA + F16C
void AxpyGroup(const float* a, const char* const* rows, const char* const* ahead, float* acc, int64_t n);
void Axpy(float a, const char* row, const char* ahead, float* acc, int64_t n);
// bfloat16, accumulating each 16 columns as 8 even then 8 odd (see the .cc).
void AxpyGroupBF16(const float* a, const char* const* rows, const char* const* ahead, float* acc, int64_t n);
void AxpyBF16(float a, const char* row, const char* ahead, float* acc, int64_t n);
void AssignBF16(float a, const char* row, const char* ahead, float* acc, int64_t n);  // acc = a * row, same order
void BF16RestoreOrder(float* acc, int64_t n);
// BF16RestoreOrder then FromFloat(acc, scale, kBFloat16, dst, n) in one pass.
void ScaleBF16PairsToBF16(const float* acc, float scale, uint16_t* dst, int64_t n);
// The same for AVX-512 (32 columns as 16 even then 16 odd; see the .cc).
bool HasAvx512();  // AVX-512F, and HasF16C
void AxpyGroupBF16Avx512(const float* a, const char* const* rows, const char* const* ahead, float* acc, int64_t n);
// float16 rows with AVX-512: AxpyGroup's sums, 16 columns a step (bitwise the same).
void AxpyGroupF16Avx512(const float* a, const char* const* rows, const char* const* ahead, float* acc, int64_t n);
void AxpyBF16Avx512(float a, const char* row, const char* ahead, float* acc, int64_t n);
void AssignBF16Avx512(float a, const char* row, const char* ahead, float* acc, int64_t n);
void BF16RestoreOrderAvx512(float* acc, int64_t n);
void ScaleBF16PairsToBF16Avx512(const float* acc, float scale, uint16_t* dst, int64_t n);
// The same and FromFloat's bfloat16 conversion with AVX-512 BF16's rounding instruction (bitwise the same).
bool HasAvx512Bf16();  // AVX-512 BW, DQ and BF16, and HasAvx512
void ScaleBF16PairsToBF16Avx512Bf16(const float* acc, float scale, uint16_t* dst, int64_t n);
void ScaleToBF16Avx512Bf16(const float* src, float scale, uint16_t* dst, int64_t n);
// SingleRowBag's bfloat16 kernel (n a multiple of 32).
void SingleRowBF16Avx512Bf16(float a, float scale, const char* row, const char* ahead, uint16_t* dst, int64_t n);
void Max(const uint16_t* row, float* acc, int64_t n);
void ToFloat(const uint16_t* src, float* dst, int64_t n);
void ScaleTo(const float* src, float scale, uint16_t* dst, int64_t n);
}  // namespace f16c
#endif

}  // namespace vec
}  // namespace pkm

#endif  // PKM_KERNELS_CORE_VECTOR_OPS_H_
