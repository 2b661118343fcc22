// CPU EmbeddingBag forward: each bag's rows are combined straight into one
// float32 row per thread (no [K, D] gather, no per-bag allocation).
// sum/mean/sqrtn accumulate kRowGroup rows at a time; max keeps a running
// elementwise maximum. The rows a bag will read are known from its indices, so
// the loop prefetches rows a few entries ahead (RowPrefetcher).
#include <algorithm>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/forward_int8.h"
#include "kernels/core/internal.h"
#include "kernels/core/table_pages.h"
#include "kernels/core/vector_ops.h"

namespace pkm {

using internal::IndexAt;
using internal::WeightAt;

namespace {

// Runs ahead of the kernels over the flat index stream of a block of bags
// (the entries of bags [b0, b1) are contiguous in both layouts) and prefetches
// the row `distance` valid entries ahead of the one being read.
class RowPrefetcher {
 public:
  RowPrefetcher(const Table& table, const Bags& bags, int64_t begin, int64_t end)
      : bags_(bags), base_(static_cast<const char*>(table.data)), row_bytes_(table.dim * ElemSize(table.type)),
        next_(begin), end_(end) {
    // About 8 KB of rows ahead (measured on a 2-core EPYC: further ahead
    // evicts rows before they are summed, and the hardware prefetchers
    // already follow each row once it is started).
    const int64_t distance = std::clamp<int64_t>(8192 / std::max<int64_t>(row_bytes_, 1), 1, 8);
    for (int64_t i = 0; i < distance; ++i) Advance();
  }
  // Call once per valid entry consumed.
  void Advance() {
    while (next_ < end_) {
      const int64_t idx = IndexAt(bags_, next_++);
      if (idx >= 0) {
        const char* row = base_ + idx * row_bytes_;
        for (int64_t off = 0; off < row_bytes_; off += 64) __builtin_prefetch(row + off, 0, 3);
        return;
      }
    }
  }

 private:
  const Bags& bags_;
  const char* base_;
  int64_t row_bytes_;
  int64_t next_, end_;
};

// sum / mean / sqrtn of bag b into acc, returning the combiner's scale.
float WeightedBag(const Table& table, const Bags& bags, Combiner combiner, int64_t b, float* acc,
                  RowPrefetcher* prefetch) {
  std::fill(acc, acc + table.dim, 0.f);
  int64_t group_rows[vec::kRowGroup];
  float group_weights[vec::kRowGroup];
  float weight_sum = 0.f, weight_sq_sum = 0.f;
  int pending = 0;
  for (int64_t j = bags.Begin(b), end = bags.End(b); j < end; ++j) {
    const int64_t idx = IndexAt(bags, j);
    if (idx < 0) continue;  // padding
    prefetch->Advance();
    const float w = WeightAt(bags, j);
    weight_sum += w;
    weight_sq_sum += w * w;
    group_rows[pending] = idx;
    group_weights[pending] = w;
    if (++pending == vec::kRowGroup) {
      vec::AxpyRowGroup(table, group_rows, group_weights, acc);
      pending = 0;
    }
  }
  for (int r = 0; r < pending; ++r) vec::AxpyRow(table, group_rows[r], group_weights[r], acc);
  return internal::CombinerScale(combiner, weight_sum, weight_sq_sum);
}

// max of bag b into acc: the first valid row, then a running maximum that only
// a strictly larger value replaces (as the backward's choice of winner).
// Returns 0 for an empty bag (acc is then zeros), else 1.
float MaxBag(const Table& table, const Bags& bags, int64_t b, float* acc, RowPrefetcher* prefetch) {
  bool any = false;
  for (int64_t j = bags.Begin(b), end = bags.End(b); j < end; ++j) {
    const int64_t idx = IndexAt(bags, j);
    if (idx < 0) continue;
    prefetch->Advance();
    if (any) {
      vec::MaxRow(table, idx, acc);
    } else {
      vec::RowToFloat(table, idx, acc);
      any = true;
    }
  }
  if (!any) std::fill(acc, acc + table.dim, 0.f);
  return 1.f;
}

}  // namespace

Status Forward(const Table& table, const Bags& bags, Combiner combiner, void* out,
               ElemType out_type, const ParallelFor& pf) {
  Status s = internal::CheckTypes(table, bags, combiner, out_type, /*for_gradient=*/false);
  if (!s.ok) return s;
  s = ValidateBags(table, bags, pf);
  if (!s.ok) return s;
  internal::AdviseTableHugePages(table.data, static_cast<size_t>(table.num_rows * table.dim * ElemSize(table.type)));
  // int8 rows: the weighted combiners have their own loop; max dequantises row by row below.
  if (table.type == ElemType::kInt8 && combiner != Combiner::kMax)
    return internal::ForwardInt8(table, bags, combiner, out, out_type, pf);
  const int64_t dim = table.dim;
  const int64_t out_row_bytes = dim * ElemSize(out_type);
  const int64_t avg_bag = bags.num_bags > 0 ? std::max<int64_t>(1, bags.NumIndices() / bags.num_bags) : 1;
  pf(bags.num_bags, avg_bag * (dim + 16), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(dim);  // one per block of bags, not per bag
    RowPrefetcher prefetch(table, bags, bags.Begin(b0), bags.End(b1 - 1));
    for (int64_t b = b0; b < b1; ++b) {
      // The next bag's output row, for writing: its lines are then owned by
      // the time that bag is stored (measured: the stores waited on them at
      // small K, where an output row is a large share of the bytes).
      if (b + 1 < b1) {
        const char* next_out = static_cast<const char*>(out) + (b + 1) * out_row_bytes;
        for (int64_t off = 0; off < out_row_bytes; off += 64) __builtin_prefetch(next_out + off, 1, 3);
      }
      const float scale = combiner == Combiner::kMax ? MaxBag(table, bags, b, acc.data(), &prefetch)
                                                     : WeightedBag(table, bags, combiner, b, acc.data(), &prefetch);
      vec::FromFloat(acc.data(), scale, out_type, static_cast<char*>(out) + b * out_row_bytes, dim);
    }
  });
  return Status::Ok();
}

}  // namespace pkm
