#include "kernels/core/vector_ops.h"

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(PKM_NO_MULTIVERSION)
// One clone per CPU generation; the dynamic loader picks the best (ifunc).
#define PKM_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=haswell", "default")))
#else
#define PKM_MULTIVERSION
#endif

namespace pkm {
namespace vec {
namespace {

inline float BF16Bits(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

PKM_MULTIVERSION
void AxpyF32(float a, const float* __restrict row, float* __restrict acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * row[i];
}

#if defined(__FLT16_MAX__)
// _Float16 lets the compiler use F16C (vcvtph2ps) in the AVX2/AVX-512 clones.
PKM_MULTIVERSION
void AxpyF16(float a, const uint16_t* __restrict row, float* __restrict acc, int64_t n) {
  const _Float16* h = reinterpret_cast<const _Float16*>(row);
  for (int64_t i = 0; i < n; ++i) acc[i] += a * static_cast<float>(h[i]);
}
#else
void AxpyF16(float a, const uint16_t* row, float* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * HalfToFloat(row[i]);
}
#endif

PKM_MULTIVERSION
void AxpyBF16(float a, const uint16_t* __restrict row, float* __restrict acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * BF16Bits(row[i]);
}

PKM_MULTIVERSION
void AxpyI8(float a, const int8_t* __restrict q, int32_t zero_point, float* __restrict acc,
            int64_t n) {
  const float bias = static_cast<float>(zero_point);
  for (int64_t i = 0; i < n; ++i) acc[i] += a * (static_cast<float>(q[i]) - bias);
}

void AxpyRow(const Table& t, int64_t r, float a, float* acc) {
  const int64_t off = r * t.dim;  // 64-bit: tables may exceed 2^31 elements
  switch (t.type) {
    case ElemType::kFloat32:
      AxpyF32(a, static_cast<const float*>(t.data) + off, acc, t.dim);
      break;
    case ElemType::kFloat16:
      AxpyF16(a, static_cast<const uint16_t*>(t.data) + off, acc, t.dim);
      break;
    case ElemType::kBFloat16:
      AxpyBF16(a, static_cast<const uint16_t*>(t.data) + off, acc, t.dim);
      break;
    case ElemType::kInt8:
      AxpyI8(a * t.row_scales[r], static_cast<const int8_t*>(t.data) + off,
             t.row_zero_points ? t.row_zero_points[r] : 0, acc, t.dim);
      break;
  }
}

PKM_MULTIVERSION
static void F16ToFloat(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
#if defined(__FLT16_MAX__)
  const _Float16* h = reinterpret_cast<const _Float16*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(h[i]);
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(src[i]);
#endif
}

PKM_MULTIVERSION
static void BF16ToFloatN(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = BF16Bits(src[i]);
}

void ToFloat(const void* src, ElemType type, float* dst, int64_t n) {
  switch (type) {
    case ElemType::kFloat32:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case ElemType::kFloat16:
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
#if defined(__FLT16_MAX__)
  _Float16* h = reinterpret_cast<_Float16*>(dst);
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<_Float16>(scale * src[i]);
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToHalf(scale * src[i]);
#endif
}

// Round to nearest even on the bit pattern; written branch-free so it vectorises.
PKM_MULTIVERSION
static void ScaleToBF16(const float* __restrict src, float scale, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = scale * src[i];
    uint32_t x;
    std::memcpy(&x, &v, 4);
    const bool is_nan = (x & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>(is_nan ? ((x >> 16) | 0x40u) : rounded);
  }
}

void FromFloat(const float* src, float scale, ElemType type, void* dst, int64_t n) {
  switch (type) {
    case ElemType::kFloat32:
      ScaleF32(src, scale, static_cast<float*>(dst), n);
      break;
    case ElemType::kFloat16:
      ScaleToF16(src, scale, static_cast<uint16_t*>(dst), n);
      break;
    case ElemType::kBFloat16:
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
