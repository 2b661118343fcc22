#include "kernels/core/short_rows.h"

#include <algorithm>
#include <cstring>

#include "kernels/core/internal.h"
#include "kernels/core/vector_ops.h"

#if defined(PKM_X86_F16C)
#include <immintrin.h>
#endif

namespace pkm {
namespace internal {
namespace {

// Eight float lanes in GCC's generic vectors: 256-bit registers in the AVX2
// and AVX-512 clones, pairs of 128-bit ones in the baseline and on aarch64.
typedef float V8 __attribute__((vector_size(32)));
typedef uint16_t V8U16 __attribute__((vector_size(16)));
typedef uint32_t V8U32 __attribute__((vector_size(32)));
// Sixteen lanes for widths of a multiple of 16: one 512-bit register in the
// AVX-512 clone (half the instructions per entry), two 256-bit ones in the
// AVX2 clone. Each column's sum is the same expression in either, so the two
// give bitwise the same result.
typedef float V16 __attribute__((vector_size(64)));
typedef uint32_t V16U32 __attribute__((vector_size(64)));

// U16: the halves LoadLanes widens (bfloat16 rows of 8 columns a vector only;
// wider bfloat16 rows are read as words, in pairs of columns).
template <int kLanes> struct Lanes;
template <> struct Lanes<8> { using F = V8; using U16 = V8U16; using U32 = V8U32; };
template <> struct Lanes<16> { using F = V16; using U32 = V16U32; };

// Up to 64 columns: eight 8-lane accumulators (of AVX2's 16 registers).
// Summing 128 columns in two passes over each bag was 1.4x slower than the
// general loop (measured on the 2-core EPYC). With AVX-512's 32 registers,
// rows of multiples of 16 up to 128 columns: eight 16-lane float32 sums,
// 0.80-0.92x the general loop's time at 96 and 128 on the AVX-512 Xeon, and
// bfloat16 in pairs of columns per word (below), 0.67-0.96x at 80-128.
constexpr int64_t kMaxDim = 64;
constexpr int64_t kMaxWideDim = 128;

// Whether SumShortRows takes the AVX-512 loops (SumShortRowsWide).
bool HasWideRegisters() {
#if defined(PKM_X86_F16C)
  static const bool wide = (__builtin_cpu_init(), __builtin_cpu_supports("x86-64-v4"));
  return wide;
#else
  return false;
#endif
}

// Fewest entries between an entry being summed and the one whose row it
// prefetches into L2 (SumBag: rows about 16 KB ahead, up to 128 entries). 16
// on a Zen 4 EPYC (one thread, B=2048 K=128, N=65536): 16 KB took 0.42-0.46x
// the time of 16 entries at D=32 and for bfloat16 D=64, 0.86x for float32
// D=64, the same for float32 D=128; 32 KB there was no better
// (bench/results/cpu_roofline_notes.md, round 18). 64 with AVX-512: on the
// Xeon of round 22, 64 entries (32 KB) took float32 D=128 0.44-0.60x the time
// of 32 (core, 2 threads); rows of 256 bytes or less already get 64 or more.
int64_t ShortRowMinAhead() { return HasWideRegisters() ? 64 : 16; }

// Whether SumBag prefetches rows into L1 (else L2): with AVX-512, tables of
// at most 16 MB. On the Xeon of round 22 (2 MB L2 a core; 2 threads, B=2048
// K=128, float32 D=64, the core's A/B, round 28; 16 KB ahead either way), into
// L1 took 0.81-0.91x the time of into L2 from a 16 MB table, the same from 32
// MB, and 1.21-1.32x from 64-256 MB (rows from memory: L1's fill buffers wait
// longer there). Round 44, into L1 6 KB ahead against into L2 16 KB ahead
// (scratch builds): float32 D=64 from a 64 MB table 1.06x the time,
// bfloat16 D=128 from 64 MB the same, float32 D=128 from 32 MB 1.3x.
bool PrefetchIntoL1(const Table& table) {
  constexpr int64_t kMaxTableBytes = int64_t{16} << 20;
  return HasWideRegisters() && table.num_rows <= kMaxTableBytes / (table.dim * ElemSize(table.type));
}

// kLanes values of a row as floats (a pointer out, not a return value: GCC
// warns that returning a 256-bit vector changes the ABI of the baseline clone).
template <int kLanes, bool kBf16>
__attribute__((always_inline)) inline void LoadLanes(const char* p, typename Lanes<kLanes>::F* v) {
  if constexpr (kBf16) {
    typename Lanes<kLanes>::U16 h;
    std::memcpy(&h, p, sizeof(h));
    const typename Lanes<kLanes>::U32 bits = __builtin_convertvector(h, typename Lanes<kLanes>::U32) << 16;
    std::memcpy(v, &bits, sizeof(*v));
  } else {
    std::memcpy(v, p, sizeof(*v));
  }
}

// How far ahead the short rows prefetch, in entries: into L1 (rows of at most
// 256 bytes where PrefetchIntoL1 says) about 6 KB ahead, 8-128 entries:
// 0.89-0.95x the time of 16 KB on the Xeon of round 44 (bfloat16 D=64-128,
// float32 D=32-64; 4-8 KB the same; 2 KB slower at float32 D=64). Else into
// L2 about 16 KB ahead, ShortRowMinAhead() to 128 entries.
struct Prefetch {
  bool into_l1;
  int64_t ahead_entries;
};
Prefetch ShortRowPrefetch(const Table& table, int64_t row_bytes) {
  const bool into_l1 = PrefetchIntoL1(table) && row_bytes <= 256;
  return {into_l1, into_l1 ? std::clamp<int64_t>(6144 / row_bytes, 8, 128)
                           : std::clamp<int64_t>(16384 / row_bytes, ShortRowMinAhead(), 128)};
}

// A row of NV vectors of kLanes columns (kPairs: of kLanes words), in bytes.
template <int NV, int kLanes, bool kBf16, bool kPairs>
constexpr int64_t kShortRowBytes = NV * kLanes * (kPairs || !kBf16 ? 4 : 2);

// Bag [begin, end) of `NV` vectors of kLanes columns into sum; its weight sums.
// kPairs (bfloat16 rows): each vector of kLanes 32-bit words holds 2 * kLanes
// columns, and a word's two bfloat16 become floats by a shift (the even
// column) and a mask (the odd one), no widening shuffle; two sums per vector,
// put back in column order at the end. Each column's sum is the same
// expression either way (bitwise the same result). load_weight(j) is the
// entry's weight, a functor chosen once per block of bags (SumBags). Checks
// the indices it prefetches (IndexBound, internal.h): returns the first entry
// of the block whose index the bound rejects, else -1 (the bag summed).
template <int NV, int kLanes, bool kBf16, bool kPairs, typename Index, typename LoadWeight>
__attribute__((always_inline)) inline int64_t SumBag(const char* table, const Index* idx, LoadWeight load_weight,
                                                     Prefetch prefetch, IndexBound bound, int64_t block_end,
                                                     int64_t begin, int64_t end, float* sum, float* weight_sum,
                                                     float* weight_sq_sum) {
  constexpr int64_t kElem = kBf16 ? 2 : 4;
  // The row's size is the template's: constant offsets, and its lines'
  // prefetches unrolled (a loop over them was a fifth of the samples at D=64).
  constexpr int64_t kRowBytes = kShortRowBytes<NV, kLanes, kBf16, kPairs>;
  constexpr int64_t kRowLines = (kRowBytes + 63) / 64;
  const bool into_l1 = prefetch.into_l1;
  const int64_t ahead_entries = prefetch.ahead_entries;
  static_assert(kBf16 || !kPairs, "pairs of columns are bfloat16 words");
  using VF = typename Lanes<kLanes>::F;
  using VU = typename Lanes<kLanes>::U32;
  constexpr int kSums = kPairs ? 2 * NV : NV;
  VF acc[kSums];
  for (int v = 0; v < kSums; ++v) acc[v] = VF{};
  float ws = 0.f, wsq = 0.f;
  auto add_entry = [&](int64_t j) __attribute__((always_inline)) {
    const int64_t r = idx[j];
    if (r < 0) return;  // padding
    const float w = load_weight(j);
    ws += w;
    wsq += w * w;
    const char* row = table + r * kRowBytes;
    // A broadcast: w - 0 is w for every w (0 + w is not, for w = -0), so GCC
    // drops the add (bfloat16 D=32-64 from a cache-resident table: 0.97x the
    // time). Computing ws and wsq only for mean and sqrtn (a branch here) took
    // those 0.91-0.93x but fp32 and bfloat16 D=128 1.01-1.03x.
    const VF c = w - VF{};
    for (int v = 0; v < NV; ++v) {
      if constexpr (kPairs) {
        VU words;
        std::memcpy(&words, row + v * kLanes * 4, sizeof(words));
        const VU even_bits = words << 16, odd_bits = words & 0xffff0000u;
        VF even, odd;
        std::memcpy(&even, &even_bits, sizeof(even));
        std::memcpy(&odd, &odd_bits, sizeof(odd));
        acc[2 * v] += c * even;
        acc[2 * v + 1] += c * odd;
      } else {
        VF x;
        LoadLanes<kLanes, kBf16>(row + v * kLanes * kElem, &x);
        acc[v] += c * x;
      }
    }
  };
  // Entries whose row ahead_entries on is in this block of bags, each checking
  // that index as it prefetches the row, then the rest (checked already). Not
  // past the block: the entries there are another block's to check.
  const int64_t prefetched_end = std::max(begin, std::min(end, block_end - ahead_entries));
  int64_t j = begin;
  for (; j < prefetched_end; ++j) {
    const int64_t ahead = idx[j + ahead_entries];
    // One unsigned compare: a row, or padding or an error (rarely taken).
    if (__builtin_expect(static_cast<uint64_t>(ahead) < bound.rows, 1)) {
      const char* row = table + ahead * kRowBytes;
      if (into_l1)
        for (int64_t l = 0; l < kRowLines; ++l) __builtin_prefetch(row + 64 * l, 0, 3);
      else
        for (int64_t l = 0; l < kRowLines; ++l) vec::PrefetchTableLine(row + 64 * l);
    } else if (EndsBlock(bound, ahead)) {
      return j + ahead_entries;
    }
    add_entry(j);
  }
  for (; j < end; ++j) add_entry(j);
  if constexpr (kPairs) {
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < kLanes; ++i) {
        sum[2 * (v * kLanes + i)] = acc[2 * v][i];
        sum[2 * (v * kLanes + i) + 1] = acc[2 * v + 1][i];
      }
  } else {
    std::memcpy(sum, acc, sizeof(acc));
  }
  *weight_sum = ws;
  *weight_sq_sum = wsq;
  return -1;
}

template <int NV, int kLanes, bool kBf16, typename Index, bool kPairs, typename LoadWeight>
__attribute__((always_inline)) inline int64_t SumBagsWeighted(const Table& table, const Bags& bags,
                                                              LoadWeight load_weight, Combiner combiner, char* out,
                                                              ElemType out_type, int64_t b0, int64_t b1) {
  if (b0 >= b1) return 0;
  const char* data = static_cast<const char*>(table.data);
  const Index* idx = static_cast<const Index*>(bags.indices);
  const int64_t out_row_bytes = table.dim * ElemSize(out_type);
  const int64_t block_begin = bags.Begin(b0), block_end = bags.End(b1 - 1);
  const Prefetch prefetch = ShortRowPrefetch(table, kShortRowBytes<NV, kLanes, kBf16, kPairs>);
  const int64_t head_bad = FirstInvalidInHead(table, bags, block_begin, block_end, prefetch.ahead_entries);
  if (head_bad < block_end) return head_bad;
  const IndexBound bound = IndexBoundOf(table, bags);
  float sum[kLanes * NV * (kPairs ? 2 : 1)];
  for (int64_t b = b0; b < b1; ++b) {
    float ws = 0.f, wsq = 0.f;  // (set where SumBag returns -1; GCC cannot tell)
    const int64_t bad = SumBag<NV, kLanes, kBf16, kPairs>(data, idx, load_weight, prefetch, bound, block_end,
                                                          bags.Begin(b), bags.End(b), sum, &ws, &wsq);
    if (__builtin_expect(bad >= 0, 0)) return bad;
    vec::FromFloat(sum, CombinerScale(combiner, ws, wsq), out_type, out + b * out_row_bytes, table.dim);
  }
  return block_end;
}

// The weight loader, once per block of bags (no type switch per entry). The
// lambda always inlined: it holds the loop, which must take the target of
// SumShortRowsWide or of SumShortRowsNarrow's clones (internal.h).
template <int NV, int kLanes, bool kBf16, typename Index, bool kPairs = false>
__attribute__((always_inline)) inline int64_t SumBags(const Table& table, const Bags& bags, Combiner combiner,
                                                      char* out, ElemType out_type, int64_t b0, int64_t b1) {
  int64_t checked_to;
  WithWeightLoader(bags, [&](auto load_weight) __attribute__((always_inline)) {
    checked_to = SumBagsWeighted<NV, kLanes, kBf16, Index, kPairs>(table, bags, load_weight, combiner, out,
                                                                   out_type, b0, b1);
  });
  return checked_to;
}

template <bool kBf16, bool kWide, typename Index>
__attribute__((always_inline)) inline int64_t SumBagsAnyWidth(const Table& table, const Bags& bags, Combiner combiner,
                                                              char* out, ElemType out_type, int64_t b0, int64_t b1) {
  // bfloat16 rows of a multiple of 16 columns take pairs of columns per word
  // (SumBag): with AVX-512, 16 words a vector where the width allows,
  // 0.47-0.94x the time of 8 widened columns a vector at D=16-64 on the Xeon;
  // float32 rows of 16 and 32 were 1.15x slower with 16 lanes there (and at
  // D=32-64 no faster on the AVX-512 EPYC of 2026-12-03). Without
  // it, 8 words: GCC's AVX2 code for 16-lane vectors goes through the stack
  // (bfloat16 D=64 was 4.2x slower than with 8 lanes on the EPYC).
  constexpr int kLanes = kBf16 && kWide ? 16 : 8;
  constexpr int kPairLanes = 2 * kLanes;  // bfloat16 columns per vector of words
  // float32 rows of 64 with AVX-512: four 16-lane sums, 0.93-0.94x the time of
  // eight 8-lane ones on the Xeon of round 22 (core A/B, 2 threads, B=2048
  // K=128 N=65536, round 28; bitwise the same).
  constexpr int kLanes64 = kBf16 ? kLanes : (kWide ? 16 : 8);
  switch (table.dim / 8) {
    case 1: return SumBags<1, 8, kBf16, Index>(table, bags, combiner, out, out_type, b0, b1);
    case 2: return SumBags<kBf16 ? 1 : 2, 8, kBf16, Index, kBf16>(table, bags, combiner, out, out_type, b0, b1);
    case 3: return SumBags<3, 8, kBf16, Index>(table, bags, combiner, out, out_type, b0, b1);
    case 4: return SumBags<kBf16 ? 32 / kPairLanes : 4, kLanes, kBf16, Index, kBf16>(table, bags, combiner, out,
                                                                                    out_type, b0, b1);
    case 5: return SumBags<5, 8, kBf16, Index>(table, bags, combiner, out, out_type, b0, b1);
    case 6: return SumBags<kBf16 ? 3 : 6, 8, kBf16, Index, kBf16>(table, bags, combiner, out, out_type, b0, b1);
    case 7: return SumBags<7, 8, kBf16, Index>(table, bags, combiner, out, out_type, b0, b1);
    case 8: return SumBags<kBf16 ? 64 / kPairLanes : 64 / kLanes64, kLanes64, kBf16, Index, kBf16>(
        table, bags, combiner, out, out_type, b0, b1);
    default: break;
  }
  // Wider rows, AVX-512 only (IsShortRowTable).
  if constexpr (kWide) {
    switch (table.dim / 8) {
      case 10: return SumBags<5, kBf16 ? 8 : 16, kBf16, Index, kBf16>(table, bags, combiner, out, out_type, b0, b1);
      case 12: return SumBags<kBf16 ? 3 : 6, 16, kBf16, Index, kBf16>(table, bags, combiner, out, out_type, b0, b1);
      case 14: return SumBags<7, kBf16 ? 8 : 16, kBf16, Index, kBf16>(table, bags, combiner, out, out_type, b0, b1);
      default: return SumBags<kBf16 ? 4 : 8, 16, kBf16, Index, kBf16>(table, bags, combiner, out, out_type, b0, b1);
    }
  }
  return 0;  // not reached: IsShortRowTable takes no other width
}

template <bool kWide>
__attribute__((always_inline)) inline int64_t SumShortRowsAnyType(const Table& table, const Bags& bags,
                                                                  Combiner combiner, char* out, ElemType out_type,
                                                                  int64_t b0, int64_t b1) {
  const bool bf16 = table.type == ElemType::kBFloat16;
  if (bags.indices_int64)
    return bf16 ? SumBagsAnyWidth<true, kWide, int64_t>(table, bags, combiner, out, out_type, b0, b1)
                : SumBagsAnyWidth<false, kWide, int64_t>(table, bags, combiner, out, out_type, b0, b1);
  return bf16 ? SumBagsAnyWidth<true, kWide, int32_t>(table, bags, combiner, out, out_type, b0, b1)
              : SumBagsAnyWidth<false, kWide, int32_t>(table, bags, combiner, out, out_type, b0, b1);
}

// The wide loops (32 registers) only where they run, and the others only in
// the clones for CPUs without AVX-512: each loop is compiled once, not once
// per clone (the fuzz test's ASan build of this file took minutes).
#if defined(PKM_X86_F16C)
__attribute__((target("arch=x86-64-v4"))) int64_t SumShortRowsWide(const Table& table, const Bags& bags,
                                                                    Combiner combiner, char* out, ElemType out_type,
                                                                    int64_t b0, int64_t b1) {
  return SumShortRowsAnyType<true>(table, bags, combiner, out, out_type, b0, b1);
}

__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
int64_t SumShortRowsNarrow(const Table& table, const Bags& bags, Combiner combiner, char* out, ElemType out_type,
                           int64_t b0, int64_t b1) {
  return SumShortRowsAnyType<false>(table, bags, combiner, out, out_type, b0, b1);
}

#if defined(PKM_X86_F16C)
// float16 rows of 16-128 columns (a multiple of 16) with AVX-512: the loop of
// SumBag with vcvtph2ps, every level of it compiled for AVX-512 (GCC 12 makes
// a _Float16 vector conversion four-lane ones elsewhere). Before it they took
// the window path and cost 1.0-1.6x float32's time at D=16-32 (bfloat16's,
// short rows: 0.7-0.9x). Per column acc = fma(w, row, acc) from zero in entry
// order, as the whole-bag kernel sums (bag_columns_avx512.cc), and the weight
// sums unfused, as CollectBag takes them: where that kernel took the bags
// (rows of whole 64-byte lines: D = 32, 64, 96, 128), the output is bitwise
// the same; at D = 16, 48, 80 and 112 the group kernels summed eight rows
// apart first, so those round differently.
#define PKM_F16_ROWS_TARGET __attribute__((target("arch=x86-64-v4")))

// Returns as SumBag.
template <int NV, typename Index, typename LoadWeight>
PKM_F16_ROWS_TARGET __attribute__((always_inline)) inline int64_t SumF16Bag(
    const char* table, const Index* idx, LoadWeight load_weight, Prefetch prefetch, IndexBound bound,
    int64_t block_end, int64_t begin, int64_t end, float* sum, float* weight_sum, float* weight_sq_sum) {
  constexpr int64_t kRowBytes = 32 * NV;
  const int64_t ahead_entries = prefetch.ahead_entries;
  __m512 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm512_setzero_ps();
  float ws = 0.f, wsq = 0.f;
  for (int64_t j = begin; j < end; ++j) {
    if (j + ahead_entries < block_end) {
      const int64_t ahead = idx[j + ahead_entries];
      if (__builtin_expect(static_cast<uint64_t>(ahead) < bound.rows, 1)) {
        const char* row = table + ahead * kRowBytes;
        for (int64_t l = 0; l < kRowBytes; l += 64) {
          if (prefetch.into_l1) __builtin_prefetch(row + l, 0, 3);
          else vec::PrefetchTableLine(row + l);
        }
      } else if (EndsBlock(bound, ahead)) {
        return j + ahead_entries;
      }
    }
    const int64_t r = idx[j];
    if (r < 0) continue;  // padding
    const float w = load_weight(j);
    ws += w;
    wsq += Unfused(w * w);
    const __m512 c = _mm512_set1_ps(w);
    const char* row = table + r * kRowBytes;
    for (int v = 0; v < NV; ++v) {  // (the zero-masked form: the plain one draws a GCC 12 warning at each use)
      const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * v));
      acc[v] = _mm512_fmadd_ps(c, _mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xffff), halves), acc[v]);
    }
  }
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sum + 16 * v, acc[v]);
  *weight_sum = ws;
  *weight_sq_sum = wsq;
  return -1;
}

template <int NV, typename Index, typename LoadWeight>
PKM_F16_ROWS_TARGET int64_t SumF16Bags(const Table& table, const Bags& bags, LoadWeight load_weight,
                                       Combiner combiner, char* out, ElemType out_type, int64_t b0, int64_t b1) {
  if (b0 >= b1) return 0;
  const char* data = static_cast<const char*>(table.data);
  const Index* idx = static_cast<const Index*>(bags.indices);
  const int64_t out_row_bytes = table.dim * ElemSize(out_type);
  const int64_t block_begin = bags.Begin(b0), block_end = bags.End(b1 - 1);
  const Prefetch prefetch = ShortRowPrefetch(table, 32 * NV);
  const int64_t head_bad = FirstInvalidInHead(table, bags, block_begin, block_end, prefetch.ahead_entries);
  if (head_bad < block_end) return head_bad;
  const IndexBound bound = IndexBoundOf(table, bags);
  alignas(64) float sum[16 * NV];
  for (int64_t b = b0; b < b1; ++b) {
    float ws = 0.f, wsq = 0.f;  // (set where SumBag returns -1; GCC cannot tell)
    const int64_t bad = SumF16Bag<NV>(data, idx, load_weight, prefetch, bound, block_end, bags.Begin(b),
                                      bags.End(b), sum, &ws, &wsq);
    if (__builtin_expect(bad >= 0, 0)) return bad;
    vec::FromFloat(sum, CombinerScale(combiner, ws, wsq), out_type, out + b * out_row_bytes, table.dim);
  }
  return block_end;
}

template <typename Index>
int64_t SumF16RowsAnyWidth(const Table& table, const Bags& bags, Combiner combiner, char* out, ElemType out_type,
                           int64_t b0, int64_t b1) {
  int64_t checked_to;
  WithVectorsAndWeights(table.dim, bags, [&](auto vectors, auto load_weight) {
    checked_to = SumF16Bags<decltype(vectors)::value, Index>(table, bags, load_weight, combiner, out, out_type,
                                                             b0, b1);
  });
  return checked_to;
}
#endif

}  // namespace

bool IsShortRowTable(const Table& table, Combiner combiner) {
  if (combiner == Combiner::kMax || table.dim <= 0) return false;
  if (table.type == ElemType::kFloat16)  // AVX-512 only (SumF16Bags)
    return table.dim <= kMaxWideDim && table.dim % 16 == 0 && HasWideRegisters();
  return (table.type == ElemType::kFloat32 || table.type == ElemType::kBFloat16) && table.dim % 8 == 0 &&
         (table.dim <= kMaxDim || (table.dim <= kMaxWideDim && table.dim % 16 == 0 && HasWideRegisters()));
}

int64_t SumShortRows(const Table& table, const Bags& bags, Combiner combiner, char* out, ElemType out_type,
                     int64_t b0, int64_t b1) {
#if defined(PKM_X86_F16C)
  if (table.type == ElemType::kFloat16)  // IsShortRowTable: AVX-512
    return bags.indices_int64 ? SumF16RowsAnyWidth<int64_t>(table, bags, combiner, out, out_type, b0, b1)
                              : SumF16RowsAnyWidth<int32_t>(table, bags, combiner, out, out_type, b0, b1);
  if (HasWideRegisters()) return SumShortRowsWide(table, bags, combiner, out, out_type, b0, b1);
#endif
  return SumShortRowsNarrow(table, bags, combiner, out, out_type, b0, b1);
}

}  // namespace internal
}  // namespace pkm
