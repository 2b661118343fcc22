// The weighted forward's loop over a block of bags, shared by float and int8
// tables. The valid entries of a window of bags (at least kWindowEntries of
// them, or one bag) are collected first: row addresses and coefficients. The
// loop then knows which rows come next, in this window and the following one,
// and while it sums a row it prefetches the row `ahead` entries later, one
// cache line of that row per line of the current one. Measured on a 2-core
// EPYC (bench/results/cpu_roofline_notes.md): prefetching whole rows ahead in
// one burst was slower than no software prefetch at all for 2 KB rows, and
// spreading the same requests over the summing loop was up to 1.5x faster
// than either for 1 KB bf16 rows.
#ifndef PKM_KERNELS_CORE_BAG_WINDOW_H_
#define PKM_KERNELS_CORE_BAG_WINDOW_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/vector_ops.h"

namespace pkm {
namespace internal {

struct BagWindow {
  int64_t first_bag = 0, end_bag = 0;  // bags [first_bag, end_bag)
  int64_t count = 0;                   // their valid entries; the vectors may be longer
  std::vector<const char*> rows;       // the entries' rows, in order
  std::vector<float> coefs;            // w (for int8 tables, ApplyRowParams multiplies in the row scale)
  std::vector<const char*> ahead_rows; // the row each entry's kernel prefetches (SumBagBlock)
  std::vector<int64_t> row_ids;        // the entries' row numbers (int8 tables only)
  std::vector<int64_t> ends;           // entry end of each bag in rows
  std::vector<float> weight_sums, weight_sq_sums;
  int64_t size() const { return count; }
};

// A thread's accumulator row and two windows, kept from block to block and
// from call to call (thread_local). Allocating and growing them per block
// instead took the TF op 1.09-1.16x the time at B=2048 K=1 D=512 (TF's 8
// blocks; 0.99-1.02x at K=8; bench/results/cpu_roofline_notes.md, round 45).
// Release() frees what a block's long bags or wide rows grew them to.
struct BlockScratch {
  std::vector<float> acc;
  BagWindow windows[2];
  void Release();
};
BlockScratch& ThreadBlockScratch();

// Collects bags from `b` (< b1) on until the window holds kWindowEntries
// entries or reaches b1. For int8 tables the coefficients are the weights
// until ApplyRowParams multiplies in the row scales of entries [k0, k1) and
// adds w * bias of each to *bias_sum, in entry order. The loop below applies
// them a group at a time, just before summing the group, so that the wait
// for a window's scale lines (requested by CollectWindow) overlaps the
// earlier groups' rows.
void CollectWindow(const Table& table, const Bags& bags, int64_t b, int64_t b1, BagWindow* window);
void ApplyRowParams(const Table& table, BagWindow* window, int64_t k0, int64_t k1, float* bias_sum);

// Entries between a row being summed and the row it prefetches: about 64 KB
// of rows, within [8, 128], where the CPU has AVX-512, else about 8 KB within
// [8, 64]. Measured (bench/results/prefetch_distance_ab_xeon_round22.md): on
// the AVX-512 Xeon 64 KB took the TF op 0.80-0.97x the time of 8 KB for 1 KB
// 16-bit rows, 0.60-0.66x for 512-byte ones, 0.94-0.96x for 2 KB float32
// rows; on the Zen 4 EPYC (AVX-512) 8-64 KB ran the same; on the AVX2 Zen 1
// EPYC 4-8 KB ran 2-10% faster than 16 KB. float32 rows of 2-4 KB look
// 128 KB ahead: on the Xeon of round 43 (model 207; 2 threads, B=2048
// N=65536; bench/native/core_vs_loop.cc) D=512 took 0.92-0.97x the time at
// K=128, 0.95-0.96x at K=32, 0.97-0.99x at K=8, 0.98-0.99x from a 4 GB table
// and 1.01x where three other tables took turns with it (288 MB in all, the
// core A/B); D=1024 0.98-1.0x; the TF op alone at K=128 0.92-0.94x. Not for
// others: bfloat16 D=512 and D=2048 (1 and 4 KB rows) were 1.03-1.09x
// slower, float32 D=2048 (8 KB) 1.01-1.05x.
int64_t PrefetchAhead(ElemType type, int64_t row_bytes);

// Kernels the loop calls: Group(coefs, rows, ahead_rows, acc, n) over
// vec::kRowGroup rows, Row(coef, row, ahead_row, acc, n). Assign(coef, row,
// ahead_row, acc, n) may write the first row of a bag shorter than a group
// into acc in place of zeroing acc and adding it; it returns false where it
// cannot. Finish(b, acc, weight_sum, weight_sq_sum, bias_sum) writes bag b's
// output from acc.
// Bag(coefs, rows, ahead_rows, count, acc, n) may sum a whole bag that
// vec::PreferSumBag names into acc (overwriting it) in place of the group and
// row kernels; it returns false where it cannot.
// acc_in_out (float32 outputs only): acc is bag b's output row itself, so
// Finish only scales it in place; one pass of stores over the row fewer, which
// is a large share of a bag of a few rows.
// Single(b, coef, row, ahead_row, weight_sum, weight_sq_sum) may write bag
// b's output from its only entry in place of Assign and Finish; it returns
// false where it cannot.
template <typename Group, typename Row, typename Assign, typename Bag, typename Single, typename Finish>
void SumBagBlock(const Table& table, const Bags& bags, int64_t b0, int64_t b1, Group group, Row row, Assign assign,
                 Bag bag, Single single, char* out, int64_t out_row_bytes, bool acc_in_out, Finish finish) {
  if (b0 >= b1) return;
  const int64_t dim = table.dim;
  const int64_t row_bytes = dim * ElemSize(table.type);
  const int64_t ahead = PrefetchAhead(table.type, row_bytes);
  BlockScratch& scratch = ThreadBlockScratch();
  std::vector<float>& acc = scratch.acc;
  if (!acc_in_out && static_cast<int64_t>(acc.size()) < dim) acc.resize(dim);
  BagWindow* cur = &scratch.windows[0];
  BagWindow* next = &scratch.windows[1];
  CollectWindow(table, bags, b0, b1, cur);
  // The block's first rows have no earlier row to prefetch them.
  for (int64_t k = 0; k < std::min(ahead, cur->size()); ++k)
    for (int64_t off = 0; off < row_bytes; off += 64) vec::PrefetchTableLine(cur->rows[k] + off);
  const bool row_params = table.type == ElemType::kInt8;
  while (true) {
    next->count = 0;
    if (cur->end_bag < b1) CollectWindow(table, bags, cur->end_bag, b1, next);
    const int64_t count = cur->size();
    // The row `ahead` entries after entry k, in this window or the next; the
    // row itself (already cached) where none is left.
    auto later = [&](int64_t k) -> const char* {
      const int64_t a = k + ahead;
      if (a < count) return cur->rows[a];
      if (a - count < next->size()) return next->rows[a - count];
      return cur->rows[k];
    };
    cur->ahead_rows.resize(count);
    for (int64_t k = 0; k < count; ++k) cur->ahead_rows[k] = later(k);
    int64_t begin = 0;
    for (int64_t b = cur->first_bag; b < cur->end_bag; ++b) {
      // The next bag's output row, for writing: its lines are then owned by
      // the time that bag is stored (measured: the stores waited on them at
      // small K, where an output row is a large share of the bytes).
      if (b + 1 < b1)
        for (int64_t off = 0; off < out_row_bytes; off += 64)
          __builtin_prefetch(out + (b + 1) * out_row_bytes + off, 1, 3);
      const int64_t i = b - cur->first_bag, end = cur->ends[i];
      if (end - begin == 1 && single(b, cur->coefs[begin], cur->rows[begin], cur->ahead_rows[begin],
                                     cur->weight_sums[i], cur->weight_sq_sums[i])) {
        begin = end;
        continue;
      }
      float* const sums = acc_in_out ? reinterpret_cast<float*>(out + b * out_row_bytes) : acc.data();
      const char* const* ahead_rows = cur->ahead_rows.data();
      float bias_sum = 0.f;
      int64_t k = begin;
      if (vec::PreferSumBag(table.type, dim, end - k) &&
          bag(cur->coefs.data() + k, cur->rows.data() + k, ahead_rows + k, end - k, sums, dim))
        k = end;
      // (int8 tables have no assign kernel: every entry of theirs gets its scale below)
      else if (k < end && end - k < vec::kRowGroup && assign(cur->coefs[k], cur->rows[k], ahead_rows[k], sums, dim))
        ++k;
      else std::fill(sums, sums + dim, 0.f);
      for (; k + vec::kRowGroup <= end; k += vec::kRowGroup) {
        if (row_params) ApplyRowParams(table, cur, k, k + vec::kRowGroup, &bias_sum);
        group(cur->coefs.data() + k, cur->rows.data() + k, ahead_rows + k, sums, dim);
      }
      if (row_params) ApplyRowParams(table, cur, k, end, &bias_sum);
      for (; k < end; ++k) row(cur->coefs[k], cur->rows[k], ahead_rows[k], sums, dim);
      finish(b, sums, cur->weight_sums[i], cur->weight_sq_sums[i], bias_sum);
      begin = end;
    }
    if (cur->end_bag >= b1) break;
    std::swap(cur, next);
  }
  scratch.Release();
}

}  // namespace internal
}  // namespace pkm

#endif  // PKM_KERNELS_CORE_BAG_WINDOW_H_
