// The core's common part: names, layout accessors, type and index validation
// (every entry point calls it), scalar half conversions. The kernels are in
// forward.cc and backward.cc.
#include "kernels/core/embedding_bag.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/core/forward_int8.h"
#include "kernels/core/internal.h"
#include "kernels/core/shape_rules.h"
#include "kernels/core/vector_ops.h"

namespace pkm {

bool ParseCombiner(const std::string& name, Combiner* out) {
  if (name == "sum") *out = Combiner::kSum;
  else if (name == "mean") *out = Combiner::kMean;
  else if (name == "sqrtn") *out = Combiner::kSqrtn;
  else if (name == "max") *out = Combiner::kMax;
  else return false;
  return true;
}

const char* CombinerName(Combiner c) {
  switch (c) {
    case Combiner::kSum: return "sum";
    case Combiner::kMean: return "mean";
    case Combiner::kSqrtn: return "sqrtn";
    case Combiner::kMax: return "max";
  }
  return "?";
}

int64_t ElemSize(ElemType t) {
  switch (t) {
    case ElemType::kFloat32: return 4;
    case ElemType::kFloat16: return 2;
    case ElemType::kBFloat16: return 2;
    case ElemType::kInt8: return 1;
  }
  return 0;
}

ParallelFor SerialFor() {
  return [](int64_t total, int64_t, const RangeFn& fn) {
    if (total > 0) fn(0, total);
  };
}

int64_t Bags::NumIndices() const {
  if (row_splits == nullptr) return num_bags * bag_size;
  return internal::ReadInt(row_splits, row_splits_int64, num_bags);
}

int64_t Bags::Begin(int64_t bag) const {
  if (row_splits == nullptr) return bag * bag_size;
  return internal::ReadInt(row_splits, row_splits_int64, bag);
}

int64_t Bags::End(int64_t bag) const {
  if (row_splits == nullptr) return (bag + 1) * bag_size;
  return internal::ReadInt(row_splits, row_splits_int64, bag + 1);
}

Status CheckCombiner(Combiner combiner, bool has_weights) {
  // The shape rule set's two combiner rules (shape_rules.h), so every runtime words them alike.
  Status s = CombinerValueRule(static_cast<int32_t>(combiner));
  return s.ok ? CombinerWeightsRule(combiner, has_weights) : s;
}

namespace internal {

Status CheckTypes(const Table& t, const Bags& bags, Combiner combiner, ElemType out_type, bool for_gradient) {
  Status s = CheckCombiner(combiner, bags.weights != nullptr);
  if (!s.ok) return s;
  if (!(s = ConcreteDims("params", {t.num_rows, t.dim})).ok) return s;
  if (t.data == nullptr && t.num_rows * t.dim > 0) return Status::Error("table data is null");
  if (t.type == ElemType::kInt8) {
    if (for_gradient) return Status::Error("no gradient for int8 (quantised) tables");
    if (!(s = CheckInt8Table(t)).ok) return s;
  }
  if (out_type == ElemType::kInt8) return Status::Error("output must be float32, float16 or bfloat16, got int8");
  if (bags.weights != nullptr && !(s = WeightsType(DTypeOf(bags.weights_type))).ok) return s;
  if (!(s = ConcreteDims("indices", {bags.num_bags, bags.bag_size})).ok) return s;
  if (bags.index_policy == IndexPolicy::kOutOfRangeIsPadding)
    return Status::Error("index policy 'out of range is padding' is the GPU launchers' only: the CPU "
                         "kernels need indices < num_rows");
  return Status::Ok();
}

float CombinerScale(Combiner c, float weight_sum, float weight_sq_sum) {
  switch (c) {
    case Combiner::kSum: return 1.f;
    case Combiner::kMean: return weight_sum != 0.f ? 1.f / weight_sum : 0.f;
    case Combiner::kSqrtn: return weight_sq_sum > 0.f ? 1.f / std::sqrt(weight_sq_sum) : 0.f;
    case Combiner::kMax: return 1.f;  // max has no denominator (and no weights)
  }
  return 0.f;
}

}  // namespace internal

using internal::IndexAt;
using internal::WeightAt;

namespace {

// The first entry of idx[begin, end) that names no row, or end. Each chunk is
// first checked by its maximum, a reduction the compiler vectorises; only a
// chunk holding a bad entry is searched entry by entry. Negative indices are
// padding or errors: the signed maximum checks the first case, the maximum as
// unsigned (a negative index is then above any bound) the second. (The scalar
// loop with an early exit took 0.07 ms for 262144 int32 indices on the 2-core
// EPYC, a seventh of a D=64 bfloat16 forward's samples; an OR of per-entry
// flags, which GCC narrowed from 64-bit compares, held 12% of a bfloat16 D=64
// forward's samples with int64 indices on the Xeon model 207, the maximum 7%:
// the forward 0.96-0.98x the time.)
template <typename Index>
__attribute__((always_inline)) inline int64_t FirstInvalidIndexOf(const Index* idx, int64_t begin, int64_t end,
                                                                  int64_t num_rows, bool negative_is_padding) {
  using Unsigned = std::make_unsigned_t<Index>;
  // Rows as an unsigned bound, clipped to the index type's range (int32
  // indices of a table of over 2^31 rows).
  const Unsigned limit = static_cast<Unsigned>(
      std::min<uint64_t>(static_cast<uint64_t>(num_rows), uint64_t{std::numeric_limits<Index>::max()} + 1));
  auto bad = [limit, negative_is_padding](Index v) {
    return static_cast<Unsigned>(v) >= limit && (v >= 0 || !negative_is_padding);
  };
  constexpr int64_t kChunk = 1024;
  for (int64_t c = begin; c < end; c += kChunk) {
    const int64_t e = std::min(end, c + kChunk);
    bool any;
    if (negative_is_padding) {
      Index most = 0;
      for (int64_t j = c; j < e; ++j) most = std::max(most, idx[j]);
      any = static_cast<Unsigned>(most) >= limit;
    } else {
      Unsigned most = 0;
      for (int64_t j = c; j < e; ++j) most = std::max(most, static_cast<Unsigned>(idx[j]));
      any = most >= limit;
    }
    if (any)
      for (int64_t j = c; j < e; ++j)
        if (bad(idx[j])) return j;
  }
  return end;
}

PKM_MULTIVERSION
int64_t FirstInvalidIndex32(const int32_t* idx, int64_t begin, int64_t end, int64_t num_rows,
                            bool negative_is_padding) {
  return FirstInvalidIndexOf(idx, begin, end, num_rows, negative_is_padding);
}

PKM_MULTIVERSION
int64_t FirstInvalidIndex64(const int64_t* idx, int64_t begin, int64_t end, int64_t num_rows,
                            bool negative_is_padding) {
  return FirstInvalidIndexOf(idx, begin, end, num_rows, negative_is_padding);
}

}  // namespace

namespace internal {

Status ValidateLayout(const Bags& bags) {
  if (bags.row_splits != nullptr) {
    // Without the values' length, row_splits could point past the buffers.
    if (bags.num_values < 0) return Status::Error("ragged bags need num_values (the length of indices)");
    const int64_t first_split = bags.num_bags >= 0 ? ReadInt(bags.row_splits, bags.row_splits_int64, 0) : 0;
    if (first_split == kMismatchedWeightsSplit)
      return Status::Error(
          "mismatched partitions of ids and weights: weights must share the row partition of the indices "
          "(ragged weights) or hold an entry at each position of the sparse indices (sparse weights); "
          "the graph's own check of that (an Assert) did not run (XLA and the TFLite converter drop it), so "
          "the lookup refuses these bags");
    if (first_split != 0) return Status::Error("row_splits[0] must be 0, got " + std::to_string(first_split));
    for (int64_t b = 0; b < bags.num_bags; ++b) {
      if (bags.End(b) < bags.Begin(b))
        return Status::Error("row_splits must be non-decreasing: row_splits[" + std::to_string(b + 1) +
                             "] = " + std::to_string(bags.End(b)) + " < row_splits[" +
                             std::to_string(b) + "] = " + std::to_string(bags.Begin(b)));
    }
    if (bags.NumIndices() != bags.num_values)
      return Status::Error("row_splits[-1] = " + std::to_string(bags.NumIndices()) +
                           " must equal the number of values (" + std::to_string(bags.num_values) + ")");
  }
  if (bags.index_policy != IndexPolicy::kNegativeIsPadding && bags.index_policy != IndexPolicy::kNoPadding &&
      bags.index_policy != IndexPolicy::kOutOfRangeIsPadding)
    return Status::Error("unknown index policy " + std::to_string(static_cast<int>(bags.index_policy)));
  return Status::Ok();
}

int64_t FirstInvalidEntry(const Table& table, const Bags& bags, int64_t begin, int64_t end) {
  if (bags.index_policy == IndexPolicy::kOutOfRangeIsPadding) return end;
  const bool negative_is_padding = bags.index_policy == IndexPolicy::kNegativeIsPadding;
  return bags.indices_int64 ? FirstInvalidIndex64(static_cast<const int64_t*>(bags.indices), begin, end,
                                                  table.num_rows, negative_is_padding)
                            : FirstInvalidIndex32(static_cast<const int32_t*>(bags.indices), begin, end,
                                                  table.num_rows, negative_is_padding);
}

Status InvalidIndexError(const Table& table, const Bags& bags, int64_t j) {
  const bool negative_is_padding = bags.index_policy == IndexPolicy::kNegativeIsPadding;
  return Status::Error("indices[" + std::to_string(j) + "] = " + std::to_string(IndexAt(bags, j)) +
                       " is out of range [0, " + std::to_string(table.num_rows) +
                       (negative_is_padding ? ") (negative indices are padding)"
                                            : ") (stock GATHER allows no padding)"));
}

void RecordFirstInvalid(std::atomic<int64_t>* first_bad, int64_t j) {
  int64_t cur = first_bad->load();
  while (j < cur && !first_bad->compare_exchange_weak(cur, j)) {
  }
}

ParallelFor CheckedBagsFor(const Table& table, const Bags& bags, const ParallelFor& pf,
                           std::atomic<int64_t>* first_bad) {
  return [&table, &bags, &pf, first_bad](int64_t total, int64_t cost_per_unit, const RangeFn& fn) {
    pf(total, cost_per_unit, [&](int64_t b0, int64_t b1) {
      if (b0 >= b1) return;
      const int64_t end = bags.End(b1 - 1);
      const int64_t j = FirstInvalidEntry(table, bags, bags.Begin(b0), end);
      if (j < end) {
        RecordFirstInvalid(first_bad, j);
        return;
      }
      fn(b0, b1);
    });
  };
}

void ForSelfCheckedBlocks(const Bags& bags, const ParallelFor& pf, int64_t cost_per_bag,
                          std::atomic<int64_t>* first_bad, const std::function<int64_t(int64_t, int64_t)>& fn) {
  pf(bags.num_bags, cost_per_bag, [&](int64_t b0, int64_t b1) {
    if (b0 >= b1) return;
    const int64_t checked_to = fn(b0, b1);
    if (checked_to < bags.End(b1 - 1)) RecordFirstInvalid(first_bad, checked_to);
  });
}

}  // namespace internal

Status ValidateBags(const Table& table, const Bags& bags, const ParallelFor& pf) {
  Status s = internal::ValidateLayout(bags);
  if (!s.ok || bags.index_policy == IndexPolicy::kOutOfRangeIsPadding) return s;
  const int64_t n = bags.NumIndices();
  std::atomic<int64_t> first_bad{n};
  pf(n, 1, [&](int64_t begin, int64_t end) {
    const int64_t j = internal::FirstInvalidEntry(table, bags, begin, end);
    if (j < end) internal::RecordFirstInvalid(&first_bad, j);
  });
  const int64_t j = first_bad.load();
  return j < n ? internal::InvalidIndexError(table, bags, j) : Status::Ok();
}

// ---- scalar conversions -----------------------------------------------------

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0);  // inf / nan
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {                        // below the smallest normal half
    if (abs < 0x33000000u) return sign;           // rounds to zero
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - e;  // 14 + (113 - e): so that m >> shift is the half mantissa
    uint32_t half = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = ((abs >> 13) - ((127 - 15) << 10));
  const uint32_t rem = abs & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return sign | static_cast<uint16_t>(half);
}

}  // namespace pkm
