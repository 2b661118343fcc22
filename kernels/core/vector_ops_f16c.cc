// IEEE half (float16) kernels with F16C intrinsics for x86-64, and the AVX2
// and AVX-512 bfloat16 forward kernels. GCC 12 does not
// vectorise _Float16 <-> float conversions in loops for AVX2 (it converts one
// element at a time, vpinsrw + vcvtph2ps), so the target_clones in
// vector_ops.cc leave the fp16 forward scalar; these convert eight at a time.
// Picked at run time (HasF16C) where the CPU has AVX2, FMA and F16C; on other
// architectures this file is empty and vector_ops.cc's loops are used (aarch64
// vectorises __fp16 conversions itself: FCVTL/FCVTN).
#include "kernels/core/vector_ops.h"

#if defined(PKM_X86_F16C)
#include <immintrin.h>

namespace pkm {
namespace vec {
namespace f16c {

bool HasF16C() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

namespace {
#define PKM_F16C_TARGET __attribute__((target("avx2,fma,f16c")))

PKM_F16C_TARGET inline __m256 Load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
PKM_F16C_TARGET inline float Load1(const uint16_t* p) { return _cvtsh_ss(*p); }

}  // namespace

// Sixteen halves per step as two independent sums of eight (one sum per step
// took 1.15x the time on Zen 1 with the rows in L2; four took 1.4x), and per
// 64-byte line (32 halves) the same line of each `ahead` row prefetched
// (bag_window.h).
PKM_F16C_TARGET void AxpyGroup(const float* a, const char* const* rows, const char* const* ahead, float* acc,
                               int64_t n) {
  const uint16_t* r[kRowGroup];
  __m256 w[kRowGroup];
  for (int k = 0; k < kRowGroup; ++k) {
    r[k] = reinterpret_cast<const uint16_t*>(rows[k]);
    w[k] = _mm256_set1_ps(a[k]);
  }
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (i % 32 == 0)
      for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * i);
    // Same order as the generic loop: the group's sum, then added to acc.
    __m256 lo = _mm256_mul_ps(w[0], Load8(r[0] + i)), hi = _mm256_mul_ps(w[0], Load8(r[0] + i + 8));
    for (int k = 1; k < kRowGroup; ++k) {
      lo = _mm256_fmadd_ps(w[k], Load8(r[k] + i), lo);
      hi = _mm256_fmadd_ps(w[k], Load8(r[k] + i + 8), hi);
    }
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), lo));
    _mm256_storeu_ps(acc + i + 8, _mm256_add_ps(_mm256_loadu_ps(acc + i + 8), hi));
  }
  if (i + 8 <= n) {
    if (i % 32 == 0)
      for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * i);
    __m256 s = _mm256_mul_ps(w[0], Load8(r[0] + i));
    for (int k = 1; k < kRowGroup; ++k) s = _mm256_fmadd_ps(w[k], Load8(r[k] + i), s);
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), s));
    i += 8;
  }
  if (n % 32 != 0)  // a row of a partial line straddles one more line
    for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * n - 1);
  for (; i < n; ++i) {
    float s = a[0] * Load1(r[0] + i);
    for (int k = 1; k < kRowGroup; ++k) s += a[k] * Load1(r[k] + i);
    acc[i] += s;
  }
}

PKM_F16C_TARGET void Axpy(float a, const char* row_bytes, const char* ahead, float* acc, int64_t n) {
  const uint16_t* row = reinterpret_cast<const uint16_t*>(row_bytes);
  const __m256 w = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 32 == 0) PrefetchTableLine(ahead + 2 * i);
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(w, Load8(row + i), _mm256_loadu_ps(acc + i)));
  }
  if (n % 32 != 0) PrefetchTableLine(ahead + 2 * n - 1);
  for (; i < n; ++i) acc[i] += a * Load1(row + i);
}

// bfloat16 rows, AVX2: one 32-byte load holds 16 values; a shift (even
// columns) and a mask (odd columns) make them two float vectors, with no
// widening shuffle (measured 1.1-1.2x the bandwidth of vpmovzxwd + shift on
// 1 KB rows). acc then holds each block of 16 columns as its 8 even columns
// and then its 8 odd ones; BF16RestoreOrder puts it back in column order.
namespace {
PKM_F16C_TARGET inline __m256 Bf16Even(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
PKM_F16C_TARGET inline __m256 Bf16Odd(__m256i x) {
  return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
PKM_F16C_TARGET inline __m256i Load16(const char* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline float Bf16(const char* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return BFloat16ToFloat(h);
}
// Columns [i, i + 16) of the group's rows into acc (8 even, then 8 odd).
PKM_F16C_TARGET __attribute__((always_inline)) inline void SixteenColumnsBF16(const __m256* w, const char* const* rows,
                                                                               int64_t i, float* acc) {
  __m256 even = _mm256_loadu_ps(acc + i), odd = _mm256_loadu_ps(acc + i + 8);
  for (int k = 0; k < kRowGroup; ++k) {
    const __m256i x = Load16(rows[k] + 2 * i);
    even = _mm256_fmadd_ps(w[k], Bf16Even(x), even);
    odd = _mm256_fmadd_ps(w[k], Bf16Odd(x), odd);
  }
  _mm256_storeu_ps(acc + i, even);
  _mm256_storeu_ps(acc + i + 8, odd);
}
// The same for one row.
PKM_F16C_TARGET __attribute__((always_inline)) inline void SixteenColumnsRowBF16(__m256 w, const char* row, int64_t i,
                                                                                  float* acc) {
  const __m256i x = Load16(row + 2 * i);
  _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(w, Bf16Even(x), _mm256_loadu_ps(acc + i)));
  _mm256_storeu_ps(acc + i + 8, _mm256_fmadd_ps(w, Bf16Odd(x), _mm256_loadu_ps(acc + i + 8)));
}
}  // namespace

PKM_F16C_TARGET void AxpyGroupBF16(const float* a, const char* const* rows, const char* const* ahead, float* acc,
                                   int64_t n) {
  __m256 w[kRowGroup];
  for (int k = 0; k < kRowGroup; ++k) w[k] = _mm256_set1_ps(a[k]);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (i % 32 == 0)
      for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * i);
    SixteenColumnsBF16(w, rows, i, acc);
  }
  if (n % 32 != 0)  // a row of a partial line straddles one more line
    for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * n - 1);
  for (; i < n; ++i)
    for (int k = 0; k < kRowGroup; ++k) acc[i] += a[k] * Bf16(rows[k] + 2 * i);
}

PKM_F16C_TARGET void AxpyBF16(float a, const char* row, const char* ahead, float* acc, int64_t n) {
  const __m256 w = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (i % 32 == 0) PrefetchTableLine(ahead + 2 * i);
    SixteenColumnsRowBF16(w, row, i, acc);
  }
  if (n % 32 != 0) PrefetchTableLine(ahead + 2 * n - 1);
  for (; i < n; ++i) acc[i] += a * Bf16(row + 2 * i);
}

// acc = a * row in AxpyBF16's column order: a bag's first row without
// zeroing acc first.
PKM_F16C_TARGET void AssignBF16(float a, const char* row, const char* ahead, float* acc, int64_t n) {
  const __m256 w = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (i % 32 == 0) PrefetchTableLine(ahead + 2 * i);
    const __m256i x = Load16(row + 2 * i);
    _mm256_storeu_ps(acc + i, _mm256_mul_ps(w, Bf16Even(x)));
    _mm256_storeu_ps(acc + i + 8, _mm256_mul_ps(w, Bf16Odd(x)));
  }
  if (n % 32 != 0) PrefetchTableLine(ahead + 2 * n - 1);
  for (; i < n; ++i) acc[i] = a * Bf16(row + 2 * i);
}

// BF16RestoreOrder, scale * acc and FloatToBFloat16 in one pass: output word
// i of a block holds columns 2i (low half) and 2i + 1, that is the rounded top
// halves of even[i] and odd[i], so no shuffle puts the columns back in order.
// Measured at K=1 D=512 on the 2-core EPYC: the two passes it replaces were
// 47% of the forward's samples.
namespace {
// FloatToBFloat16 of each lane, left in the top half: rounded to nearest even;
// a NaN keeps its top half, made quiet.
PKM_F16C_TARGET inline __m256i RoundedBF16Bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x), high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(_mm256_and_si256(sum, high),
                            _mm256_or_si256(_mm256_and_si256(bits, high), _mm256_set1_epi32(0x400000)), nan);
}
}  // namespace

PKM_F16C_TARGET void ScaleBF16PairsToBF16(const float* acc, float scale, uint16_t* dst, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i even = RoundedBF16Bits(_mm256_mul_ps(s, _mm256_loadu_ps(acc + i)));
    const __m256i odd = RoundedBF16Bits(_mm256_mul_ps(s, _mm256_loadu_ps(acc + i + 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_or_si256(_mm256_srli_epi32(even, 16), odd));
  }
  for (; i < n; ++i) dst[i] = FloatToBFloat16(scale * acc[i]);  // the tail is in column order (AxpyBF16)
}

PKM_F16C_TARGET void BF16RestoreOrder(float* acc, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) {
    const __m256 even = _mm256_loadu_ps(acc + i), odd = _mm256_loadu_ps(acc + i + 8);
    const __m256 lo = _mm256_unpacklo_ps(even, odd);  // e0 o0 e1 o1 | e4 o4 e5 o5
    const __m256 hi = _mm256_unpackhi_ps(even, odd);  // e2 o2 e3 o3 | e6 o6 e7 o7
    _mm256_storeu_ps(acc + i, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(acc + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

// The same for AVX-512: one 64-byte load holds 32 values, so acc holds each
// block of 32 columns as its 16 even columns and then its 16 odd ones, and a
// last block of 16 as the AVX2 kernels do (BF16RestoreOrderAvx512 puts both
// back). Each column's sum is the AVX2 kernels' expression: bitwise the same.
#define PKM_AVX512_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))

bool HasAvx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && HasF16C();
  return has;
}

namespace {
PKM_AVX512_TARGET inline __m512 Bf16Even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
PKM_AVX512_TARGET inline __m512 Bf16Odd(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
PKM_AVX512_TARGET inline __m512i Load32(const char* p) { return _mm512_loadu_si512(p); }
PKM_AVX512_TARGET inline __m512 Load16Halves(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
}  // namespace

PKM_AVX512_TARGET void AxpyGroupBF16Avx512(const float* a, const char* const* rows, const char* const* ahead,
                                           float* acc, int64_t n) {
  __m512 w[kRowGroup];
  for (int k = 0; k < kRowGroup; ++k) w[k] = _mm512_set1_ps(a[k]);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * i);
    __m512 even = _mm512_loadu_ps(acc + i), odd = _mm512_loadu_ps(acc + i + 16);
    for (int k = 0; k < kRowGroup; ++k) {
      const __m512i x = Load32(rows[k] + 2 * i);
      even = _mm512_fmadd_ps(w[k], Bf16Even(x), even);
      odd = _mm512_fmadd_ps(w[k], Bf16Odd(x), odd);
    }
    _mm512_storeu_ps(acc + i, even);
    _mm512_storeu_ps(acc + i + 16, odd);
  }
  if (i + 16 <= n) {  // a last block of 16 columns: the AVX2 step
    for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * i);
    __m256 w8[kRowGroup];
    for (int k = 0; k < kRowGroup; ++k) w8[k] = _mm512_castps512_ps256(w[k]);
    SixteenColumnsBF16(w8, rows, i, acc);
    i += 16;
  }
  if (n % 32 != 0)  // a row of a partial line straddles one more line
    for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * n - 1);
  for (; i < n; ++i)
    for (int k = 0; k < kRowGroup; ++k) acc[i] += a[k] * Bf16(rows[k] + 2 * i);
}

// float16 rows: sixteen halves per zmm conversion (vcvtph2ps), half the
// instructions per byte of AxpyGroup's two 8-wide sums, with the same
// expression per column (the group's sum, then added to acc): bitwise the same.
PKM_AVX512_TARGET void AxpyGroupF16Avx512(const float* a, const char* const* rows, const char* const* ahead,
                                          float* acc, int64_t n) {
  __m512 w[kRowGroup];
  for (int k = 0; k < kRowGroup; ++k) w[k] = _mm512_set1_ps(a[k]);
  int64_t i = 0;
  // A line (32 halves) of each row a step: two independent sums.
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * i);
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(rows[0]) + i;
    __m512 lo = _mm512_mul_ps(w[0], Load16Halves(r0)), hi = _mm512_mul_ps(w[0], Load16Halves(r0 + 16));
    for (int k = 1; k < kRowGroup; ++k) {
      const uint16_t* r = reinterpret_cast<const uint16_t*>(rows[k]) + i;
      lo = _mm512_fmadd_ps(w[k], Load16Halves(r), lo);
      hi = _mm512_fmadd_ps(w[k], Load16Halves(r + 16), hi);
    }
    _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), lo));
    _mm512_storeu_ps(acc + i + 16, _mm512_add_ps(_mm512_loadu_ps(acc + i + 16), hi));
  }
  for (; i + 16 <= n; i += 16) {
    if (i % 32 == 0)
      for (int k = 0; k < kRowGroup; ++k) PrefetchTableLine(ahead[k] + 2 * i);
    __m512 s = _mm512_mul_ps(w[0], Load16Halves(reinterpret_cast<const uint16_t*>(rows[0]) + i));
    for (int k = 1; k < kRowGroup; ++k)
      s = _mm512_fmadd_ps(w[k], Load16Halves(reinterpret_cast<const uint16_t*>(rows[k]) + i), s);
    _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), s));
  }
  if (i == n) return;
  // Under 16 columns left: AxpyGroup's steps on the rest of the rows.
  const char* rest[kRowGroup];
  const char* rest_ahead[kRowGroup];
  for (int k = 0; k < kRowGroup; ++k) {
    rest[k] = rows[k] + 2 * i;
    rest_ahead[k] = ahead[k] + 2 * i;
  }
  AxpyGroup(a, rest, rest_ahead, acc + i, n - i);
}

PKM_AVX512_TARGET void AxpyBF16Avx512(float a, const char* row, const char* ahead, float* acc, int64_t n) {
  const __m512 w = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    PrefetchTableLine(ahead + 2 * i);
    const __m512i x = Load32(row + 2 * i);
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(w, Bf16Even(x), _mm512_loadu_ps(acc + i)));
    _mm512_storeu_ps(acc + i + 16, _mm512_fmadd_ps(w, Bf16Odd(x), _mm512_loadu_ps(acc + i + 16)));
  }
  if (i + 16 <= n) {  // a last block of 16 columns: the AVX2 step
    PrefetchTableLine(ahead + 2 * i);
    SixteenColumnsRowBF16(_mm512_castps512_ps256(w), row, i, acc);
    i += 16;
  }
  if (n % 32 != 0) PrefetchTableLine(ahead + 2 * n - 1);
  for (; i < n; ++i) acc[i] += a * Bf16(row + 2 * i);
}

// acc = a * row in AxpyBF16Avx512's column order: a bag's first row without
// zeroing acc first.
PKM_AVX512_TARGET void AssignBF16Avx512(float a, const char* row, const char* ahead, float* acc, int64_t n) {
  const __m512 w = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    PrefetchTableLine(ahead + 2 * i);
    const __m512i x = Load32(row + 2 * i);
    _mm512_storeu_ps(acc + i, _mm512_mul_ps(w, Bf16Even(x)));
    _mm512_storeu_ps(acc + i + 16, _mm512_mul_ps(w, Bf16Odd(x)));
  }
  // A last block of 16 columns and the tail in AVX2's order, as AxpyBF16Avx512 leaves them.
  AssignBF16(a, row + 2 * i, ahead + 2 * i, acc + i, n - i);
}

PKM_AVX512_TARGET void BF16RestoreOrderAvx512(float* acc, int64_t n) {
  // Lane j of the result: even[j / 2] or odd[j / 2] (index bit 4 picks odd).
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 even = _mm512_loadu_ps(acc + i), odd = _mm512_loadu_ps(acc + i + 16);
    _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(even, first, odd));
    _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(even, second, odd));
  }
  if (i + 16 <= n) BF16RestoreOrder(acc + i, 16);
}
namespace {
// RoundedBF16Bits for sixteen lanes.
PKM_AVX512_TARGET inline __m512i RoundedBF16BitsAvx512(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_blend_epi32(nan, _mm512_and_si512(sum, high),
                                 _mm512_or_si512(_mm512_and_si512(bits, high), _mm512_set1_epi32(0x400000)));
}
}  // namespace

// BF16RestoreOrderAvx512, scale * acc and FloatToBFloat16 in one pass, as
// ScaleBF16PairsToBF16 does for AVX2's blocks: output word i of a block of 32
// columns is the rounded top halves of even[i] (low) and odd[i] (high). The
// trailing block of 16 and the tail have AVX2's layout: ScaleBF16PairsToBF16.
PKM_AVX512_TARGET void ScaleBF16PairsToBF16Avx512(const float* acc, float scale, uint16_t* dst, int64_t n) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i even = RoundedBF16BitsAvx512(_mm512_mul_ps(s, _mm512_loadu_ps(acc + i)));
    const __m512i odd = RoundedBF16BitsAvx512(_mm512_mul_ps(s, _mm512_loadu_ps(acc + i + 16)));
    _mm512_storeu_si512(dst + i, _mm512_or_si512(_mm512_srli_epi32(even, 16), odd));
  }
  ScaleBF16PairsToBF16(acc + i, scale, dst + i, n - i);
}
#undef PKM_AVX512_TARGET

// AVX-512 BF16's VCVTNE2PS2BF16 rounds 32 floats to nearest even and quiets
// NaNs in one instruction, as FloatToBFloat16 does, but it flushes denormal
// inputs to zero: a block holding one is converted by the integer path above
// instead, so the results stay bitwise the same. On the 2-core Zen 4 EPYC the
// integer path was 41% of a one-row bfloat16 bag's time (B=2048 K=1 D=512).
#define PKM_AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")))

bool HasAvx512Bf16() {
  static const bool has = HasAvx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

namespace {
constexpr int kDenormalClass = 0x20;  // VFPCLASSPS: denormal

// 32 columns held as 16 even then 16 odd sums, scaled, rounded and stored
// in column order as ScaleBF16PairsToBF16Avx512 writes them.
PKM_AVX512_BF16_TARGET inline void ScalePairBlockToBF16(__m512 even_sum, __m512 odd_sum, float scale,
                                                        uint16_t* dst) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512 even = _mm512_mul_ps(s, even_sum), odd = _mm512_mul_ps(s, odd_sum);
  if ((_mm512_fpclass_ps_mask(even, kDenormalClass) | _mm512_fpclass_ps_mask(odd, kDenormalClass)) != 0) {
    alignas(64) float sums[32];
    _mm512_store_ps(sums, even_sum);
    _mm512_store_ps(sums + 16, odd_sum);
    ScaleBF16PairsToBF16Avx512(sums, scale, dst, 32);
    return;
  }
  // bf16 lane 2j takes even column j (converted lane j), lane 2j + 1 odd column j (lane 16 + j).
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));  // even in lanes 0-15
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, both));
}
}  // namespace

// ScaleBF16PairsToBF16Avx512's output, 32 columns per conversion.
PKM_AVX512_BF16_TARGET void ScaleBF16PairsToBF16Avx512Bf16(const float* acc, float scale, uint16_t* dst,
                                                           int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    ScalePairBlockToBF16(_mm512_loadu_ps(acc + i), _mm512_loadu_ps(acc + i + 16), scale, dst + i);
  ScaleBF16PairsToBF16(acc + i, scale, dst + i, n - i);
}

// AssignBF16Avx512's products, then ScaleBF16PairsToBF16Avx512Bf16's scaling
// and rounding, 32 columns at a time without the float32 row between them
// (n a multiple of 32).
PKM_AVX512_BF16_TARGET void SingleRowBF16Avx512Bf16(float a, float scale, const char* row, const char* ahead,
                                                    uint16_t* dst, int64_t n) {
  const __m512 w = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 32) {
    PrefetchTableLine(ahead + 2 * i);
    const __m512i x = Load32(row + 2 * i);
    ScalePairBlockToBF16(_mm512_mul_ps(w, Bf16Even(x)), _mm512_mul_ps(w, Bf16Odd(x)), scale, dst + i);
  }
}

// FromFloat's bfloat16 conversion (column order), 16 columns per conversion.
PKM_AVX512_BF16_TARGET void ScaleToBF16Avx512Bf16(const float* src, float scale, uint16_t* dst, int64_t n) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_mul_ps(s, _mm512_loadu_ps(src + i));
    if (_mm512_fpclass_ps_mask(x, kDenormalClass) != 0) {
      for (int64_t j = i; j < i + 16; ++j) dst[j] = FloatToBFloat16(scale * src[j]);
      continue;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
  }
  for (; i < n; ++i) dst[i] = FloatToBFloat16(scale * src[i]);
}
#undef PKM_AVX512_BF16_TARGET

PKM_F16C_TARGET void Max(const uint16_t* row, float* acc, int64_t n) {
  int64_t i = 0;
  // max_ps(v, acc) is v > acc ? v : acc (a NaN acc stays); a NaN v is blended in: the generic loop's rule.
  for (; i + 8 <= n; i += 8) {
    const __m256 v = Load8(row + i);
    const __m256 larger = _mm256_max_ps(v, _mm256_loadu_ps(acc + i));
    _mm256_storeu_ps(acc + i, _mm256_blendv_ps(larger, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  for (; i < n; ++i) {
    const float v = Load1(row + i);
    acc[i] = v > acc[i] || v != v ? v : acc[i];
  }
}

PKM_F16C_TARGET void ToFloat(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, Load8(src + i));
  for (; i < n; ++i) dst[i] = Load1(src + i);
}

PKM_F16C_TARGET void ScaleTo(const float* src, float scale, uint16_t* dst, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(s, _mm256_loadu_ps(src + i)), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = _cvtss_sh(scale * src[i], _MM_FROUND_TO_NEAREST_INT);
}

#undef PKM_F16C_TARGET
}  // namespace f16c
}  // namespace vec
}  // namespace pkm

#endif  // PKM_X86_F16C
