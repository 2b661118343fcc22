// CPU EmbeddingBag forward: each bag's rows are combined straight into one
// float32 row per thread (no [K, D] gather, no per-bag allocation).
// sum/mean/sqrtn over short rows keep each bag's sum in registers
// (short_rows.h); over longer rows they accumulate kRowGroup rows at a time,
// prefetching rows ahead as they go (bag_window.h); max keeps a running elementwise maximum, with
// rows prefetched a few entries ahead (RowPrefetcher).
#include <algorithm>
#include <atomic>
#include <vector>

#include "kernels/core/bag_window.h"
#include "kernels/core/embedding_bag.h"
#include "kernels/core/forward_int8.h"
#include "kernels/core/internal.h"
#include "kernels/core/short_rows.h"
#include "kernels/core/table_pages.h"
#include "kernels/core/vector_ops.h"

namespace pkm {

using internal::IndexAt;

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
        for (int64_t off = 0; off < row_bytes_; off += 64) vec::PrefetchTableLine(row + off);
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

// max of bag b into acc: the first valid row, then a running maximum that a
// strictly larger value or a NaN replaces (as the backward's choice of winner).
// An empty bag gives zeros.
void MaxBag(const Table& table, const Bags& bags, int64_t b, float* acc, RowPrefetcher* prefetch) {
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
}

// The combiners' loops over every bag, each block of bags checking its
// indices (the short rows as they go, the others through CheckedBagsFor
// first); the first invalid entry found goes to *first_bad.
Status SumBags(const Table& table, const Bags& bags, Combiner combiner, void* out, ElemType out_type,
               const ParallelFor& unchecked_pf, std::atomic<int64_t>* first_bad) {
  const int64_t dim = table.dim;
  const int64_t avg_bag = bags.num_bags > 0 ? std::max<int64_t>(1, bags.NumIndices() / bags.num_bags) : 1;
  char* out_bytes = static_cast<char*>(out);
  if (internal::IsShortRowTable(table, combiner)) {
    internal::ForSelfCheckedBlocks(bags, unchecked_pf, avg_bag * (dim + 16), first_bad, [&](int64_t b0, int64_t b1) {
      return internal::SumShortRows(table, bags, combiner, out_bytes, out_type, b0, b1);
    });
    return Status::Ok();
  }
  // int8 rows: the weighted combiners have their own loop; max dequantises row by row below.
  if (table.type == ElemType::kInt8 && combiner != Combiner::kMax)
    return internal::ForwardInt8(table, bags, combiner, out, out_type, unchecked_pf, first_bad);
  const ParallelFor pf = internal::CheckedBagsFor(table, bags, unchecked_pf, first_bad);
  const int64_t out_row_bytes = dim * ElemSize(out_type);
  if (combiner != Combiner::kMax) {
    const ElemType type = table.type;
    const bool acc_in_out = out_type == ElemType::kFloat32;
    pf(bags.num_bags, avg_bag * (dim + 16), [&](int64_t b0, int64_t b1) {
      internal::SumBagBlock(
          table, bags, b0, b1,
          [type](const float* a, const char* const* rows, const char* const* ahead, float* acc, int64_t n) {
            vec::AxpyGroup(type, a, rows, ahead, acc, n);
          },
          [type](float a, const char* row, const char* ahead, float* acc, int64_t n) {
            vec::AxpyRow(type, a, row, ahead, acc, n);
          },
          [type](float a, const char* row, const char* ahead, float* acc, int64_t n) {
            return vec::AssignRow(type, a, row, ahead, acc, n);
          },
          [type](const float* a, const char* const* rows, const char* const* ahead, int64_t count, float* acc,
                 int64_t n) { return vec::SumBag(type, a, rows, ahead, count, acc, n); },
          [&](int64_t b, float a, const char* row, const char* ahead, float weight_sum, float weight_sq_sum) {
            const float scale = internal::CombinerScale(combiner, weight_sum, weight_sq_sum);
            return vec::SingleRowBag(type, a, scale, row, ahead, out_type, out_bytes + b * out_row_bytes, dim);
          },
          out_bytes, out_row_bytes, acc_in_out,
          [&](int64_t b, float* acc, float weight_sum, float weight_sq_sum, float) {
            const float scale = internal::CombinerScale(combiner, weight_sum, weight_sq_sum);
            if (acc_in_out) vec::ScaleAccInPlace(type, acc, scale, dim);
            else vec::FromAcc(type, acc, scale, out_type, out_bytes + b * out_row_bytes, dim);
          });
    });
    return Status::Ok();
  }
  pf(bags.num_bags, avg_bag * (dim + 16), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(dim);  // one per block of bags, not per bag
    RowPrefetcher prefetch(table, bags, bags.Begin(b0), bags.End(b1 - 1));
    for (int64_t b = b0; b < b1; ++b) {
      MaxBag(table, bags, b, acc.data(), &prefetch);
      vec::FromFloat(acc.data(), 1.f, out_type, out_bytes + b * out_row_bytes, dim);
    }
  });
  return Status::Ok();
}

}  // namespace

Status Forward(const Table& table, const Bags& bags, Combiner combiner, void* out,
               ElemType out_type, const ParallelFor& pf) {
  Status s = internal::CheckTypes(table, bags, combiner, out_type, /*for_gradient=*/false);
  if (!s.ok) return s;
  s = internal::ValidateLayout(bags);
  if (!s.ok) return s;
  internal::AdviseTableHugePages(table.data, static_cast<size_t>(table.num_rows * table.dim * ElemSize(table.type)));
  // Each block of bags checks its own indices; an invalid one fails the call
  // after the blocks have run.
  const int64_t num_indices = bags.NumIndices();
  std::atomic<int64_t> first_bad{num_indices};
  s = SumBags(table, bags, combiner, out, out_type, pf, &first_bad);
  if (s.ok && first_bad.load() < num_indices) return internal::InvalidIndexError(table, bags, first_bad.load());
  return s;
}

}  // namespace pkm
