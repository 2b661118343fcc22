#include "kernels/core/vector_ops.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kernels/core/internal.h"

namespace pkm {
namespace vec {

namespace {

// The header's BFloat16ToFloat / FloatToBFloat16 again, always_inline: GCC
// does not inline a default-target function into an arch= clone, and an
// out-of-line call per element keeps the loop scalar.
__attribute__((always_inline)) inline float Bf16ToF32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
__attribute__((always_inline)) inline uint16_t F32ToBf16(float f) {
  uint32_t x;
  __builtin_memcpy(&x, &f, sizeof(x));
  const bool is_nan = (x & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(is_nan ? ((x >> 16) | 0x40u) : rounded);
}

}  // namespace

PKM_MULTIVERSION
void AxpyF32(float a, const float* __restrict row, float* __restrict acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * row[i];
}

namespace {

// Element loaders: the row-group kernels below are one template, inlined into
// each CPU-specific clone (always_inline, for the reason above: without it the
// bf16 forward was a scalar call per element, no faster than fp32).
struct LoadF32 {
  using Elem = float;
  __attribute__((always_inline)) static inline float Get(const float* p, int64_t i) { return p[i]; }
};
struct LoadBF16 {
  using Elem = uint16_t;
  __attribute__((always_inline)) static inline float Get(const uint16_t* p, int64_t i) { return Bf16ToF32(p[i]); }
};
#if defined(PKM_HAS_COMPILER_HALF)
struct LoadF16 {
  using Elem = uint16_t;
  __attribute__((always_inline)) static inline float Get(const uint16_t* p, int64_t i) {
    return static_cast<float>(reinterpret_cast<const CompilerHalf*>(p)[i]);
  }
};
#else
struct LoadF16 {
  using Elem = uint16_t;
  __attribute__((always_inline)) static inline float Get(const uint16_t* p, int64_t i) { return HalfToFloat(p[i]); }
};
#endif
struct LoadI8 {
  using Elem = int8_t;
  __attribute__((always_inline)) static inline float Get(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
};

// Each 64-byte line of the rows also prefetches the same line of the row
// summed `ahead` entries later (bag_window.h says why).
template <typename L>
__attribute__((always_inline)) inline void AxpyGroupImpl(const float* a, const char* const* rows,
                                                          const char* const* ahead, float* __restrict acc,
                                                          int64_t n) {
  using E = typename L::Elem;
  const E* __restrict r0 = reinterpret_cast<const E*>(rows[0]);
  const E* __restrict r1 = reinterpret_cast<const E*>(rows[1]);
  const E* __restrict r2 = reinterpret_cast<const E*>(rows[2]);
  const E* __restrict r3 = reinterpret_cast<const E*>(rows[3]);
  const E* __restrict r4 = reinterpret_cast<const E*>(rows[4]);
  const E* __restrict r5 = reinterpret_cast<const E*>(rows[5]);
  const E* __restrict r6 = reinterpret_cast<const E*>(rows[6]);
  const E* __restrict r7 = reinterpret_cast<const E*>(rows[7]);
  const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5], a6 = a[6], a7 = a[7];
  constexpr int64_t kLine = 64 / sizeof(E);
  int64_t c = 0;
  for (; c + kLine <= n; c += kLine) {
    for (int r = 0; r < kRowGroup; ++r) PrefetchTableLine(ahead[r] + c * sizeof(E));
    for (int64_t i = c; i < c + kLine; ++i)
      acc[i] += a0 * L::Get(r0, i) + a1 * L::Get(r1, i) + a2 * L::Get(r2, i) + a3 * L::Get(r3, i) +
                a4 * L::Get(r4, i) + a5 * L::Get(r5, i) + a6 * L::Get(r6, i) + a7 * L::Get(r7, i);
  }
  // A row of a partial line straddles one more line.
  if (n % kLine != 0)
    for (int r = 0; r < kRowGroup; ++r) PrefetchTableLine(ahead[r] + n * sizeof(E) - 1);
  for (int64_t i = c; i < n; ++i)
    acc[i] += a0 * L::Get(r0, i) + a1 * L::Get(r1, i) + a2 * L::Get(r2, i) + a3 * L::Get(r3, i) +
              a4 * L::Get(r4, i) + a5 * L::Get(r5, i) + a6 * L::Get(r6, i) + a7 * L::Get(r7, i);
}

template <typename L>
__attribute__((always_inline)) inline void AxpyRowImpl(float a, const char* row, const char* ahead,
                                                        float* __restrict acc, int64_t n) {
  using E = typename L::Elem;
  const E* __restrict r = reinterpret_cast<const E*>(row);
  constexpr int64_t kLine = 64 / sizeof(E);
  int64_t c = 0;
  for (; c + kLine <= n; c += kLine) {
    PrefetchTableLine(ahead + c * sizeof(E));
    // Not unrolled: GCC 12 unrolled this 64-byte loop completely and left
    // the result scalar; kept as a loop, its loop vectoriser makes it two
    // 256-bit FMAs in the AVX2 clone (tests/ops/test_kernel_codegen.py).
#pragma GCC unroll 1
    for (int64_t i = c; i < c + kLine; ++i) acc[i] += a * L::Get(r, i);
  }
  if (n % kLine != 0) PrefetchTableLine(ahead + n * sizeof(E) - 1);
  for (int64_t i = c; i < n; ++i) acc[i] += a * L::Get(r, i);
}

PKM_MULTIVERSION
void AxpyGroupF32(const float* a, const char* const* rows, const char* const* ahead, float* acc, int64_t n) {
  AxpyGroupImpl<LoadF32>(a, rows, ahead, acc, n);
}
PKM_MULTIVERSION
void AxpyGroupF16(const float* a, const char* const* rows, const char* const* ahead, float* acc, int64_t n) {
  AxpyGroupImpl<LoadF16>(a, rows, ahead, acc, n);
}
PKM_MULTIVERSION
void AxpyGroupBF16(const float* a, const char* const* rows, const char* const* ahead, float* acc, int64_t n) {
  AxpyGroupImpl<LoadBF16>(a, rows, ahead, acc, n);
}
PKM_MULTIVERSION
void AxpyRowF32(float a, const char* row, const char* ahead, float* acc, int64_t n) {
  AxpyRowImpl<LoadF32>(a, row, ahead, acc, n);
}
PKM_MULTIVERSION
void AxpyRowF16(float a, const char* row, const char* ahead, float* acc, int64_t n) {
  AxpyRowImpl<LoadF16>(a, row, ahead, acc, n);
}
PKM_MULTIVERSION
void AxpyRowBF16(float a, const char* row, const char* ahead, float* acc, int64_t n) {
  AxpyRowImpl<LoadBF16>(a, row, ahead, acc, n);
}

}  // namespace

// acc[i] = a * row[i] over a float32 row, prefetching as AxpyRowImpl does.
PKM_MULTIVERSION
static void ScaleRowF32(float a, const char* row, const char* ahead, float* __restrict acc, int64_t n) {
  const float* __restrict r = reinterpret_cast<const float*>(row);
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    PrefetchTableLine(ahead + c * sizeof(float));
#pragma GCC unroll 1
    for (int64_t i = c; i < c + 16; ++i) acc[i] = a * r[i];
  }
  if (n % 16 != 0) PrefetchTableLine(ahead + n * sizeof(float) - 1);
  for (int64_t i = c; i < n; ++i) acc[i] = a * r[i];
}

bool AssignRow(ElemType type, float a, const char* row, const char* ahead, float* acc, int64_t n) {
  if (type == ElemType::kFloat32) {
    ScaleRowF32(a, row, ahead, acc, n);
    return true;
  }
#if defined(PKM_X86_F16C)
  // In AxpyRow's bfloat16 column order for the CPU (AVX-512's or AVX2's).
  if (type == ElemType::kBFloat16 && f16c::HasAvx512()) {
    f16c::AssignBF16Avx512(a, row, ahead, acc, n);
    return true;
  }
  if (type == ElemType::kBFloat16 && f16c::HasF16C()) {
    f16c::AssignBF16(a, row, ahead, acc, n);
    return true;
  }
#endif
  return false;
}

void AxpyGroup(ElemType type, const float* a, const char* const* rows, const char* const* ahead, float* acc,
               int64_t n) {
  switch (type) {
    case ElemType::kFloat32: AxpyGroupF32(a, rows, ahead, acc, n); break;
    case ElemType::kFloat16:
#if defined(PKM_X86_F16C)
      if (f16c::HasAvx512()) {
        f16c::AxpyGroupF16Avx512(a, rows, ahead, acc, n);
        break;
      }
      if (f16c::HasF16C()) {
        f16c::AxpyGroup(a, rows, ahead, acc, n);
        break;
      }
#endif
      AxpyGroupF16(a, rows, ahead, acc, n);
      break;
    case ElemType::kBFloat16:
#if defined(PKM_X86_F16C)
      if (f16c::HasAvx512()) {
        f16c::AxpyGroupBF16Avx512(a, rows, ahead, acc, n);
        break;
      }
      if (f16c::HasF16C()) {
        f16c::AxpyGroupBF16(a, rows, ahead, acc, n);
        break;
      }
#endif
      AxpyGroupBF16(a, rows, ahead, acc, n);
      break;
    case ElemType::kInt8: break;  // int8 tables: forward_int8.cc
  }
}

void AxpyRow(ElemType type, float a, const char* row, const char* ahead, float* acc, int64_t n) {
  switch (type) {
    case ElemType::kFloat32: AxpyRowF32(a, row, ahead, acc, n); break;
    case ElemType::kFloat16:
#if defined(PKM_X86_F16C)
      if (f16c::HasF16C()) {
        f16c::Axpy(a, row, ahead, acc, n);
        break;
      }
#endif
      AxpyRowF16(a, row, ahead, acc, n);
      break;
    case ElemType::kBFloat16:
#if defined(PKM_X86_F16C)
      if (f16c::HasAvx512()) {
        f16c::AxpyBF16Avx512(a, row, ahead, acc, n);
        break;
      }
      if (f16c::HasF16C()) {
        f16c::AxpyBF16(a, row, ahead, acc, n);
        break;
      }
#endif
      AxpyRowBF16(a, row, ahead, acc, n);
      break;
    case ElemType::kInt8: break;  // int8 tables: forward_int8.cc
  }
}

void RestoreAccOrder(ElemType type, float* acc, int64_t n) {
#if defined(PKM_X86_F16C)
  if (type != ElemType::kBFloat16) return;
  if (f16c::HasAvx512()) f16c::BF16RestoreOrderAvx512(acc, n);
  else if (f16c::HasF16C()) f16c::BF16RestoreOrder(acc, n);
#endif
}

void FromAcc(ElemType type, float* acc, float scale, ElemType out_type, void* dst, int64_t n) {
#if defined(PKM_X86_F16C)
  if (type == ElemType::kBFloat16 && out_type == ElemType::kBFloat16) {
    uint16_t* out = static_cast<uint16_t*>(dst);
    if (f16c::HasAvx512Bf16()) return f16c::ScaleBF16PairsToBF16Avx512Bf16(acc, scale, out, n);
    if (f16c::HasAvx512()) return f16c::ScaleBF16PairsToBF16Avx512(acc, scale, out, n);
    if (f16c::HasF16C()) return f16c::ScaleBF16PairsToBF16(acc, scale, out, n);
  }
#endif
  RestoreAccOrder(type, acc, n);
  FromFloat(acc, scale, out_type, dst, n);
}

PKM_MULTIVERSION
static void ScaleInPlaceF32(float* x, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

void StreamF32(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__x86_64__) || defined(__SSE2__)
  for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0; ++i) dst[i] = src != nullptr ? src[i] : 0.f;
  const __m128 zero = _mm_setzero_ps();
  for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, src != nullptr ? _mm_loadu_ps(src + i) : zero);
#endif
  for (; i < n; ++i) dst[i] = src != nullptr ? src[i] : 0.f;
}

void StreamFence() {
#if defined(__x86_64__) || defined(__SSE2__)
  _mm_sfence();
#endif
}

void ScaleInPlace(float* x, float scale, int64_t n) {
  if (scale != 1.f) ScaleInPlaceF32(x, scale, n);
}

void ScaleAccInPlace(ElemType type, float* acc, float scale, int64_t n) {
  RestoreAccOrder(type, acc, n);
  ScaleInPlace(acc, scale, n);
}

PKM_MULTIVERSION
static void F16ToFloat(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
#if defined(PKM_HAS_COMPILER_HALF)
  const CompilerHalf* h = reinterpret_cast<const CompilerHalf*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(h[i]);
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(src[i]);
#endif
}

PKM_MULTIVERSION
static void BF16ToFloatN(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(src[i]);
}

void ToFloat(const void* src, ElemType type, float* dst, int64_t n) {
  switch (type) {
    case ElemType::kFloat32:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case ElemType::kFloat16:
#if defined(PKM_X86_F16C)
      if (f16c::HasF16C()) {
        f16c::ToFloat(static_cast<const uint16_t*>(src), dst, n);
        break;
      }
#endif
      F16ToFloat(static_cast<const uint16_t*>(src), dst, n);
      break;
    case ElemType::kBFloat16:
      BF16ToFloatN(static_cast<const uint16_t*>(src), dst, n);
      break;
    case ElemType::kInt8:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<const int8_t*>(src)[i];
      break;
  }
}

PKM_MULTIVERSION
static void ScaleF32(const float* __restrict src, float scale, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = scale * src[i];
}

PKM_MULTIVERSION
static void ScaleToF16(const float* __restrict src, float scale, uint16_t* __restrict dst, int64_t n) {
#if defined(PKM_HAS_COMPILER_HALF)
  CompilerHalf* h = reinterpret_cast<CompilerHalf*>(dst);
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<CompilerHalf>(scale * src[i]);
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToHalf(scale * src[i]);
#endif
}

PKM_MULTIVERSION
static void ScaleToBF16(const float* __restrict src, float scale, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = F32ToBf16(scale * src[i]);
}

void FromFloat(const float* src, float scale, ElemType type, void* dst, int64_t n) {
  switch (type) {
    case ElemType::kFloat32:
      ScaleF32(src, scale, static_cast<float*>(dst), n);
      break;
    case ElemType::kFloat16:
#if defined(PKM_X86_F16C)
      if (f16c::HasF16C()) {
        f16c::ScaleTo(src, scale, static_cast<uint16_t*>(dst), n);
        break;
      }
#endif
      ScaleToF16(src, scale, static_cast<uint16_t*>(dst), n);
      break;
    case ElemType::kBFloat16:
#if defined(PKM_X86_F16C)
      if (f16c::HasAvx512Bf16()) {
        f16c::ScaleToBF16Avx512Bf16(src, scale, static_cast<uint16_t*>(dst), n);
        break;
      }
#endif
      ScaleToBF16(src, scale, static_cast<uint16_t*>(dst), n);
      break;
    case ElemType::kInt8:
      break;  // never an output type; rejected by the callers' checks
  }
}

PKM_MULTIVERSION
float AxpyDot(float a, const float* __restrict g, const float* __restrict row, float* __restrict acc,
              int64_t n) {
  float s[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      acc[i + j] += a * g[i + j];
      s[j] += g[i + j] * row[i + j];
    }
  float total = 0.f;
  for (int j = 0; j < 16; ++j) total += s[j];
  for (; i < n; ++i) {
    acc[i] += a * g[i];
    total += g[i] * row[i];
  }
  return total;
}

PKM_MULTIVERSION
float Dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  // Eight partial sums let the compiler vectorise without -ffast-math.
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += x[i + j] * y[i + j];
  float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) total += x[i] * y[i];
  return total;
}

}  // namespace vec
}  // namespace pkm

namespace pkm {
namespace vec {

namespace {

template <typename L>
__attribute__((always_inline)) inline void MaxImpl(const typename L::Elem* __restrict row, float scale, float bias,
                                                    float* __restrict acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = scale * L::Get(row, i) + bias;
    acc[i] = v > acc[i] || v != v ? v : acc[i];
  }
}

PKM_MULTIVERSION
void MaxF32(const float* row, float* acc, int64_t n) { MaxImpl<LoadF32>(row, 1.f, 0.f, acc, n); }
PKM_MULTIVERSION
void MaxF16(const uint16_t* row, float* acc, int64_t n) { MaxImpl<LoadF16>(row, 1.f, 0.f, acc, n); }
PKM_MULTIVERSION
void MaxBF16(const uint16_t* row, float* acc, int64_t n) { MaxImpl<LoadBF16>(row, 1.f, 0.f, acc, n); }
PKM_MULTIVERSION
void MaxI8(const int8_t* row, float scale, float bias, float* acc, int64_t n) {
  MaxImpl<LoadI8>(row, scale, bias, acc, n);
}

}  // namespace

void MaxRow(const Table& t, int64_t r, float* acc) {
  const int64_t off = r * t.dim;
  switch (t.type) {
    case ElemType::kFloat32: MaxF32(static_cast<const float*>(t.data) + off, acc, t.dim); break;
    case ElemType::kFloat16:
#if defined(PKM_X86_F16C)
      if (f16c::HasF16C()) {
        f16c::Max(static_cast<const uint16_t*>(t.data) + off, acc, t.dim);
        break;
      }
#endif
      MaxF16(static_cast<const uint16_t*>(t.data) + off, acc, t.dim);
      break;
    case ElemType::kBFloat16: MaxBF16(static_cast<const uint16_t*>(t.data) + off, acc, t.dim); break;
    case ElemType::kInt8:
      MaxI8(static_cast<const int8_t*>(t.data) + off, internal::RowParam(t.row_scales, t.row_params_type, r),
            internal::RowParam(t.row_biases, t.row_params_type, r), acc, t.dim);
      break;
  }
}

void RowToFloat(const Table& t, int64_t r, float* dst) {
  const int64_t off = r * t.dim;
  if (t.type != ElemType::kInt8) {
    ToFloat(static_cast<const char*>(t.data) + off * ElemSize(t.type), t.type, dst, t.dim);
    return;
  }
  const int8_t* q = static_cast<const int8_t*>(t.data) + off;
  const float scale = internal::RowParam(t.row_scales, t.row_params_type, r);
  const float bias = internal::RowParam(t.row_biases, t.row_params_type, r);
  for (int64_t i = 0; i < t.dim; ++i) dst[i] = scale * static_cast<float>(q[i]) + bias;
}

PKM_MULTIVERSION
void MaxArgRow(const float* __restrict row, int32_t k, float* __restrict best, int32_t* __restrict winner,
               int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const bool larger = row[i] > best[i] || (row[i] != row[i] && best[i] == best[i]);
    best[i] = larger ? row[i] : best[i];
    winner[i] = larger ? k : winner[i];
  }
}

PKM_MULTIVERSION
void AddWhereWinner(const float* __restrict g, const int32_t* __restrict winner, int32_t k, float* __restrict acc,
                    int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += winner[i] == k ? g[i] : 0.f;
}

}  // namespace vec
}  // namespace pkm
