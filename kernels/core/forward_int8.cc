// Row-wise int8 forward. Per bag, with c_j = w_j * scale[r_j]:
//   sum_j w_j * (scale[r_j] * q[r_j] + bias[r_j]) = sum_j c_j * q[r_j] + sum_j w_j * bias[r_j]
// so the inner loop is a pure int8 multiply-accumulate into float32 (eight rows
// at a time, each row read once), and the bias enters once per bag as a
// constant. Each row is a quarter of a float32 row's bytes.
#include "kernels/core/forward_int8.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(PKM_NO_MULTIVERSION)
#include <immintrin.h>
#endif

#include "kernels/core/bag_window.h"
#include "kernels/core/internal.h"
#include "kernels/core/vector_ops.h"

namespace pkm {
namespace internal {
namespace {

constexpr int kGroup = 8;

// acc[i] += sum_r c[r] * q_r[i] over eight rows; per 64-byte line, the same
// line of each `ahead` row is prefetched (bag_window.h).
PKM_MULTIVERSION
[[maybe_unused]] void AccumulateGroup(const float* c, const char* const* rows, const char* const* ahead,
                                      float* __restrict acc, int64_t n) {
  const int8_t* const* q = reinterpret_cast<const int8_t* const*>(rows);
  const int8_t* __restrict q0 = q[0];
  const int8_t* __restrict q1 = q[1];
  const int8_t* __restrict q2 = q[2];
  const int8_t* __restrict q3 = q[3];
  const int8_t* __restrict q4 = q[4];
  const int8_t* __restrict q5 = q[5];
  const int8_t* __restrict q6 = q[6];
  const int8_t* __restrict q7 = q[7];
  const float c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3], c4 = c[4], c5 = c[5], c6 = c[6], c7 = c[7];
  for (int64_t line = 0; line < n; line += 64) {
    for (int r = 0; r < kGroup; ++r) vec::PrefetchTableLine(ahead[r] + line);
    for (int64_t i = line, end = std::min(n, line + 64); i < end; ++i)
      acc[i] += (c0 * static_cast<float>(q0[i]) + c1 * static_cast<float>(q1[i])) +
                (c2 * static_cast<float>(q2[i]) + c3 * static_cast<float>(q3[i])) +
                (c4 * static_cast<float>(q4[i]) + c5 * static_cast<float>(q5[i])) +
                (c6 * static_cast<float>(q6[i]) + c7 * static_cast<float>(q7[i]));
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(PKM_NO_MULTIVERSION)
// The same for AVX2 + FMA, spelled out: one sign-extending load per eight
// values (vpmovsxbd), a convert and an FMA, two partial sums per eight columns
// so the FMA chain is four rows long. The compiler's own vectorisation of the
// loop above spends most of its time shuffling bytes into lanes (measured
// ~2x slower on cached rows). The eight prefetches of a line are paced one per
// eight columns (row (i / 8) % 8's line of i): on the 2-core EPYC, 5-13%
// faster over 8-128 MB tables than issuing them together; a whole row at once
// was 1.3x slower (bench/results/int8_forward_notes.md).
// Columns [i, i + 8) of the eight rows into acc.
__attribute__((target("avx2,fma"), always_inline)) inline void EightColumnsAvx2(const __m256* coef,
                                                                               const int8_t* const* q, int64_t i,
                                                                               float* __restrict acc) {
  __m256 even = _mm256_loadu_ps(acc + i), odd = _mm256_setzero_ps();
  for (int r = 0; r < kGroup; r += 2) {
    const __m256 x0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(q[r] + i))));
    const __m256 x1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(q[r + 1] + i))));
    even = _mm256_fmadd_ps(coef[r], x0, even);
    odd = _mm256_fmadd_ps(coef[r + 1], x1, odd);
  }
  _mm256_storeu_ps(acc + i, _mm256_add_ps(even, odd));
}

__attribute__((target("avx2,fma"))) void AccumulateGroupAvx2(const float* c, const char* const* rows,
                                                              const char* const* ahead, float* __restrict acc,
                                                              int64_t n) {
  const int8_t* const* q = reinterpret_cast<const int8_t* const*>(rows);
  __m256 coef[kGroup];
  for (int r = 0; r < kGroup; ++r) coef[r] = _mm256_set1_ps(c[r]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    vec::PrefetchTableLine(ahead[(i / 8) % kGroup] + (i & ~int64_t{63}));
    EightColumnsAvx2(coef, q, i, acc);
  }
  if (n % 64 != 0)  // a row of a partial line straddles one more line
    for (int r = 0; r < kGroup; ++r) vec::PrefetchTableLine(ahead[r] + n - 1);
  for (; i < n; ++i)
    for (int r = 0; r < kGroup; ++r) acc[i] += c[r] * static_cast<float>(q[r][i]);
}

// The same sums for AVX-512, sixteen columns at a time (half the instructions
// per byte of AVX2's, which bound rows in cache), with the AVX2 step's
// arithmetic per column, so both give bitwise the same result. A line's eight
// prefetches go two per sixteen columns.
// Columns [i, i + 16) of the eight rows into acc.
__attribute__((target("avx512f,avx2,fma"), always_inline)) inline void SixteenColumnsAvx512(
    const __m512* coef, const int8_t* const* q, int64_t i, float* __restrict acc) {
  __m512 even = _mm512_loadu_ps(acc + i), odd = _mm512_setzero_ps();
  for (int r = 0; r < kGroup; r += 2) {
    const __m512 x0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q[r] + i))));
    const __m512 x1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q[r + 1] + i))));
    even = _mm512_fmadd_ps(coef[r], x0, even);
    odd = _mm512_fmadd_ps(coef[r + 1], x1, odd);
  }
  _mm512_storeu_ps(acc + i, _mm512_add_ps(even, odd));
}

__attribute__((target("avx512f,avx2,fma"))) void AccumulateGroupAvx512(const float* c, const char* const* rows,
                                                                        const char* const* ahead,
                                                                        float* __restrict acc, int64_t n) {
  const int8_t* const* q = reinterpret_cast<const int8_t* const*>(rows);
  __m512 coef[kGroup];
  for (int r = 0; r < kGroup; ++r) coef[r] = _mm512_set1_ps(c[r]);
  int64_t i = 0;
  // A whole line (64 columns) a step: the k-th sixteen columns of a line
  // prefetch rows 2k and 2k + 1's line, the same pacing as below without its
  // per-step pick arithmetic.
  for (; i + 64 <= n; i += 64) {
    for (int k = 0; k < 4; ++k) {
      vec::PrefetchTableLine(ahead[2 * k] + i);
      vec::PrefetchTableLine(ahead[2 * k + 1] + i);
      SixteenColumnsAvx512(coef, q, i + 16 * k, acc);
    }
  }
  for (; i + 16 <= n; i += 16) {
    const int pick = static_cast<int>((i / 8) % kGroup);
    const int64_t line = i & ~int64_t{63};
    vec::PrefetchTableLine(ahead[pick] + line);
    vec::PrefetchTableLine(ahead[pick + 1] + line);
    SixteenColumnsAvx512(coef, q, i, acc);
  }
  if (i + 8 <= n) {  // eight columns left: AVX2's step
    if (i % 64 == 0)
      for (int r = 0; r < kGroup; ++r) vec::PrefetchTableLine(ahead[r] + i);
    __m256 coef8[kGroup];
    for (int r = 0; r < kGroup; ++r) coef8[r] = _mm512_castps512_ps256(coef[r]);
    EightColumnsAvx2(coef8, q, i, acc);
    i += 8;
  }
  if (n % 64 != 0)  // a row of a partial line straddles one more line
    for (int r = 0; r < kGroup; ++r) vec::PrefetchTableLine(ahead[r] + n - 1);
  for (; i < n; ++i)
    for (int r = 0; r < kGroup; ++r) acc[i] += c[r] * static_cast<float>(q[r][i]);
}

using GroupFn = void (*)(const float*, const char* const*, const char* const*, float*, int64_t);
GroupFn PickGroupFn() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return AccumulateGroupAvx512;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? AccumulateGroupAvx2 : AccumulateGroup;
}
const GroupFn kAccumulateGroup = PickGroupFn();
#elif defined(__aarch64__)
// NEON, spelled out as the AVX2 one (GCC 12 leaves the loop above scalar here):
// SXTL to int16 and int32, a convert, and a fused multiply-add per four columns.
void AccumulateGroupNeon(const float* c, const char* const* rows, const char* const* ahead, float* __restrict acc,
                         int64_t n) {
  const int8_t* const* q = reinterpret_cast<const int8_t* const*>(rows);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 64 == 0)
      for (int r = 0; r < kGroup; ++r) vec::PrefetchTableLine(ahead[r] + i);
    float32x4_t lo = vld1q_f32(acc + i), hi = vld1q_f32(acc + i + 4);
    for (int r = 0; r < kGroup; ++r) {
      const int16x8_t wide = vmovl_s8(vld1_s8(q[r] + i));
      lo = vfmaq_n_f32(lo, vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))), c[r]);
      hi = vfmaq_n_f32(hi, vcvtq_f32_s32(vmovl_high_s16(wide)), c[r]);
    }
    vst1q_f32(acc + i, lo);
    vst1q_f32(acc + i + 4, hi);
  }
  if (n % 64 != 0)  // a row of a partial line straddles one more line
    for (int r = 0; r < kGroup; ++r) vec::PrefetchTableLine(ahead[r] + n - 1);
  for (; i < n; ++i)
    for (int r = 0; r < kGroup; ++r) acc[i] += c[r] * static_cast<float>(q[r][i]);
}
constexpr void (*kAccumulateGroup)(const float*, const char* const*, const char* const*, float*, int64_t) =
    AccumulateGroupNeon;
#else
constexpr void (*kAccumulateGroup)(const float*, const char* const*, const char* const*, float*, int64_t) =
    AccumulateGroup;
#endif

// acc[i] += c * q[i]: the rows left over after the groups of eight.
PKM_MULTIVERSION
void AccumulateRow(float c, const char* row, const char* ahead, float* __restrict acc, int64_t n) {
  const int8_t* __restrict q = reinterpret_cast<const int8_t*>(row);
  for (int64_t i = 0; i < n; i += 64) vec::PrefetchTableLine(ahead + i);
  if (n % 64 != 0) vec::PrefetchTableLine(ahead + n - 1);
  for (int64_t i = 0; i < n; ++i) acc[i] += c * static_cast<float>(q[i]);
}

// acc[i] = (acc[i] + bias) * scale, written as out_type.
void Finish(float* acc, float bias, float scale, ElemType out_type, void* out, int64_t n) {
  if (bias != 0.f)
    for (int64_t i = 0; i < n; ++i) acc[i] += bias;
  vec::FromFloat(acc, scale, out_type, out, n);
}

// The same where acc is the float32 output row itself.
PKM_MULTIVERSION
void FinishInPlace(float* acc, float bias, float scale, int64_t n) {
  if (bias == 0.f) {
    vec::ScaleInPlace(acc, scale, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) acc[i] = scale * (acc[i] + bias);
}

#if defined(PKM_X86_F16C)
// Rows of 16-128 columns with AVX-512: a bag's sums stay in registers and each
// entry's scale (and bias) is read where its row is, with no window of
// collected entries (at D=32 from a 2 MB table, CollectWindow and
// ApplyRowParams took a third of the time, the group kernel a tenth). Every
// sum is the one the window path forms, in the same order: the weight sums
// and w * bias unfused, as CollectBag and ApplyRowParams (compiled without
// FMA) round them; each group of eight rows as SixteenColumnsAvx512, the rows
// after the last group as AccumulateRow; then Finish or FinishInPlace. So
// the output is bitwise the same (but for the payload of a NaN from a NaN
// float16 row parameter, converted here by the CPU's instruction).
bool HasShortInt8Rows(const Table& table) {
  return vec::f16c::HasAvx512() && table.dim >= 16 && table.dim <= 128 && table.dim % 16 == 0;
}

struct ShortInt8Params {
  const char* scales;
  const char* biases;  // may be null
  bool fp16;
};

__attribute__((target("avx512f,f16c,avx2,fma"), always_inline)) inline float LoadParam(const char* params, bool fp16,
                                                                                      int64_t r) {
  if (fp16) return _cvtsh_ss(reinterpret_cast<const uint16_t*>(params)[r]);
  return reinterpret_cast<const float*>(params)[r];
}

// Columns [16 * v, 16 * v + 16) of an int8 row as floats: vpmovsxbd and
// vcvtdq2ps (the zero-masked forms; the plain intrinsics' undefined
// pass-through operand draws a GCC 12 warning at every use).
__attribute__((target("avx512f"), always_inline)) inline __m512 Int8Vector(const int8_t* row, int v) {
  const __m512i wide = _mm512_maskz_cvtepi8_epi32(
      static_cast<__mmask16>(0xffff), _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v)));
  return _mm512_maskz_cvtepi32_ps(static_cast<__mmask16>(0xffff), wide);
}

// Bag [begin, end) of NV vectors of 16 columns into acc; its weight sums and
// bias sum. Checks the indices it prefetches (IndexBound, internal.h): returns
// the first entry of the block whose index the bound rejects, else -1.
template <int NV, typename Index, typename LoadWeight>
__attribute__((target("avx512f,f16c,avx2,fma"), always_inline)) inline int64_t SumInt8Bag(
    const int8_t* data, const Index* idx, LoadWeight load_weight, const ShortInt8Params& p, int64_t ahead_entries,
    bool into_l1, IndexBound bound, int64_t block_end, int64_t begin, int64_t end, __m512* acc, float* weight_sum,
    float* weight_sq_sum, float* bias_total) {
  constexpr int64_t kRowBytes = 16 * NV;
  // Locals: read once, not after every store of the loop.
  const char* const scales = p.scales;
  const char* const biases = p.biases;
  const bool fp16 = p.fp16;
  const int64_t param_bytes = fp16 ? 2 : 4;
  for (int v = 0; v < NV; ++v) acc[v] = _mm512_setzero_ps();
  float ws = 0.f, wsq = 0.f, bias_sum = 0.f;
  const int8_t* rows[kGroup];
  float coefs[kGroup];
  int pending = 0;
  for (int64_t j = begin; j < end; ++j) {
    if (j + ahead_entries < block_end) {  // the row, scale and bias of the entry ahead_entries on
      const int64_t a = idx[j + ahead_entries];
      if (__builtin_expect(static_cast<uint64_t>(a) < bound.rows, 1)) {
        const char* row = reinterpret_cast<const char*>(data) + a * kRowBytes;
        if (into_l1) {
          __builtin_prefetch(row, 0, 3);
          if (kRowBytes > 64) __builtin_prefetch(row + 64, 0, 3);
        } else {
          __builtin_prefetch(row, 0, 2);
          if (kRowBytes > 64) __builtin_prefetch(row + 64, 0, 2);
        }
        __builtin_prefetch(scales + a * param_bytes, 0, 2);
        if (biases != nullptr) __builtin_prefetch(biases + a * param_bytes, 0, 2);
      } else if (EndsBlock(bound, a)) {
        return j + ahead_entries;
      }
    }
    const int64_t r = idx[j];
    if (r < 0) continue;  // padding
    const float w = load_weight(j);
    ws += w;
    wsq += Unfused(w * w);
    if (biases != nullptr) bias_sum += Unfused(w * LoadParam(biases, fp16, r));
    coefs[pending] = w * LoadParam(scales, fp16, r);
    rows[pending] = data + r * kRowBytes;
    if (++pending < kGroup) continue;
    pending = 0;
    for (int v = 0; v < NV; ++v) {  // SixteenColumnsAvx512's sums
      __m512 even = acc[v], odd = _mm512_setzero_ps();
      for (int g = 0; g < kGroup; g += 2) {
        even = _mm512_fmadd_ps(_mm512_set1_ps(coefs[g]), Int8Vector(rows[g], v), even);
        odd = _mm512_fmadd_ps(_mm512_set1_ps(coefs[g + 1]), Int8Vector(rows[g + 1], v), odd);
      }
      acc[v] = _mm512_add_ps(even, odd);
    }
  }
  for (int g = 0; g < pending; ++g)  // AccumulateRow's
    for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(coefs[g]), Int8Vector(rows[g], v), acc[v]);
  *weight_sum = ws;
  *weight_sq_sum = wsq;
  *bias_total = bias_sum;
  return -1;
}

// Bags [b0, b1) (a block); returns as SumShortRows.
template <int NV, typename Index, typename LoadWeight>
__attribute__((target("avx512f,f16c,avx2,fma"))) int64_t SumInt8Bags(const Table& table, const Bags& bags,
                                                                      LoadWeight load_weight, Combiner combiner,
                                                                      char* out, ElemType out_type, int64_t b0,
                                                                      int64_t b1) {
  if (b0 >= b1) return 0;
  constexpr int64_t kRowBytes = 16 * NV;
  const ShortInt8Params p{static_cast<const char*>(table.row_scales), static_cast<const char*>(table.row_biases),
                          table.row_params_type == ElemType::kFloat16};
  const int8_t* data = static_cast<const int8_t*>(table.data);
  const Index* idx = static_cast<const Index*>(bags.indices);
  const int64_t out_row_bytes = table.dim * ElemSize(out_type);
  const int64_t block_begin = bags.Begin(b0), block_end = bags.End(b1 - 1);
  // As the float short rows (short_rows.cc): from a table of at most 16 MB
  // into L1 about 6 KB ahead, else into L2 about 16 KB ahead.
  const bool into_l1 = table.num_rows <= (int64_t{16} << 20) / kRowBytes;
  const int64_t ahead_entries = std::clamp<int64_t>((into_l1 ? 6144 : 16384) / kRowBytes, 8, 128);
  const int64_t head_bad = FirstInvalidInHead(table, bags, block_begin, block_end, ahead_entries);
  if (head_bad < block_end) return head_bad;
  const IndexBound bound = IndexBoundOf(table, bags);
  alignas(64) float sums[16 * NV];
  for (int64_t b = b0; b < b1; ++b) {
    __m512 acc[NV];
    float ws = 0.f, wsq = 0.f, bias_sum = 0.f;  // (set where SumInt8Bag returns -1; GCC cannot tell)
    const int64_t bad = SumInt8Bag<NV>(data, idx, load_weight, p, ahead_entries, into_l1, bound, block_end,
                                       bags.Begin(b), bags.End(b), acc, &ws, &wsq, &bias_sum);
    if (__builtin_expect(bad >= 0, 0)) return bad;
    const float scale = CombinerScale(combiner, ws, wsq);
    float* row = out_type == ElemType::kFloat32 ? reinterpret_cast<float*>(out + b * out_row_bytes) : sums;
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(row + 16 * v, acc[v]);
    if (row != sums) FinishInPlace(row, bias_sum, scale, table.dim);
    else Finish(sums, bias_sum, scale, out_type, out + b * out_row_bytes, table.dim);
  }
  return block_end;
}

template <typename Index>
int64_t SumShortInt8Rows(const Table& table, const Bags& bags, Combiner combiner, char* out, ElemType out_type,
                         int64_t b0, int64_t b1) {
  int64_t checked_to;
  WithVectorsAndWeights(table.dim, bags, [&](auto vectors, auto load_weight) {
    checked_to = SumInt8Bags<decltype(vectors)::value, Index>(table, bags, load_weight, combiner, out, out_type,
                                                              b0, b1);
  });
  return checked_to;
}
#else
bool HasShortInt8Rows(const Table&) { return false; }
template <typename Index>
int64_t SumShortInt8Rows(const Table&, const Bags&, Combiner, char*, ElemType, int64_t, int64_t) { return 0; }
#endif

}  // namespace

Status CheckInt8Table(const Table& t) {
  if (t.row_scales == nullptr) return Status::Error("int8 table needs per-row scales");
  if (t.row_params_type != ElemType::kFloat32 && t.row_params_type != ElemType::kFloat16)
    return Status::Error("int8 table: row scales and biases must be float32 or float16");
  return Status::Ok();
}

Status ForwardInt8(const Table& table, const Bags& bags, Combiner combiner, void* out, ElemType out_type,
                   const ParallelFor& unchecked_pf, std::atomic<int64_t>* first_bad) {
  if (combiner != Combiner::kSum && combiner != Combiner::kMean && combiner != Combiner::kSqrtn)
    return Status::Error(std::string("combiner ") + CombinerName(combiner) +
                         " is not supported for int8 tables (sum, mean, sqrtn)");
  const int64_t dim = table.dim;
  const int64_t out_row_bytes = dim * ElemSize(out_type);
  const int64_t avg_bag = bags.num_bags > 0 ? std::max<int64_t>(1, bags.NumIndices() / bags.num_bags) : 1;
  char* out_bytes = static_cast<char*>(out);
  const bool acc_in_out = out_type == ElemType::kFloat32;
  const int64_t cost_per_bag = avg_bag * (dim / 4 + 16);
  if (HasShortInt8Rows(table)) {  // they check their own indices
    ForSelfCheckedBlocks(bags, unchecked_pf, cost_per_bag, first_bad, [&](int64_t b0, int64_t b1) {
      return bags.indices_int64 ? SumShortInt8Rows<int64_t>(table, bags, combiner, out_bytes, out_type, b0, b1)
                                : SumShortInt8Rows<int32_t>(table, bags, combiner, out_bytes, out_type, b0, b1);
    });
    return Status::Ok();
  }
  CheckedBagsFor(table, bags, unchecked_pf, first_bad)(bags.num_bags, cost_per_bag, [&](int64_t b0, int64_t b1) {
    // No Assign or whole-bag kernel for int8 rows: every bag starts from zeroed
    // sums, and each group's row scales are applied just before it is summed.
    const auto no_assign = [](float, const char*, const char*, float*, int64_t) { return false; };
    const auto no_bag = [](const float*, const char* const*, const char* const*, int64_t, float*, int64_t) {
      return false;
    };
    const auto no_single = [](int64_t, float, const char*, const char*, float, float) { return false; };
    SumBagBlock(table, bags, b0, b1, kAccumulateGroup, AccumulateRow, no_assign, no_bag, no_single, out_bytes,
                out_row_bytes, acc_in_out,
                [&](int64_t b, float* acc, float weight_sum, float weight_sq_sum, float bias_sum) {
                  const float scale = CombinerScale(combiner, weight_sum, weight_sq_sum);
                  if (acc_in_out) FinishInPlace(acc, bias_sum, scale, dim);
                  else Finish(acc, bias_sum, scale, out_type, out_bytes + b * out_row_bytes, dim);
                });
  });
  return Status::Ok();
}

}  // namespace internal
}  // namespace pkm
