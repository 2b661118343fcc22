// CPU EmbeddingBag backward: groups the (index, position) pairs by table row,
// so every table row is read once and its gradient written once, by one
// thread (no atomics, no [B*K, D] buffer). The max combiner first finds, per
// bag and column, the bag position holding the maximum (ties to the first),
// then routes each gradient element to that position's row in the same pass.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/internal.h"
#include "kernels/core/table_pages.h"
#include "kernels/core/vector_ops.h"

namespace pkm {

using internal::IndexAt;
using internal::WeightAt;

namespace {

// Entries with a valid index, grouped by table row: entries of row
// Row(u) are order[starts[u] .. starts[u+1]). With `all_rows`, u == row for
// every table row (empty groups included) — counting sort, used when the table
// is not much larger than the number of entries; otherwise only rows that
// occur are listed (comparison sort), so temporaries stay O(entries).
// Pos is int32_t whenever the entry count allows: half the temporary memory.
template <typename Pos>
struct RowGroups {
  bool all_rows = false;
  std::vector<int64_t> rows;
  std::vector<Pos> starts;
  std::vector<Pos> order;
  int64_t NumGroups() const { return static_cast<int64_t>(starts.size()) - 1; }
  int64_t NumEntries() const { return static_cast<int64_t>(order.size()); }
  int64_t Row(int64_t u) const { return all_rows ? u : rows[u]; }
};

template <typename Pos>
RowGroups<Pos> GroupByRow(const Bags& bags, int64_t num_rows) {
  const int64_t n = bags.NumIndices();
  RowGroups<Pos> g;
  int64_t valid = 0;
  for (int64_t j = 0; j < n; ++j) valid += IndexAt(bags, j) >= 0;
  g.order.resize(valid);
  if (num_rows <= 4 * n + (int64_t{1} << 20)) {
    // Counting sort: count, prefix-sum to group ends, then place entries from
    // the back so each group keeps ascending positions and starts[r] ends up
    // at the group's start.
    g.all_rows = true;
    g.starts.assign(num_rows + 1, 0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t r = IndexAt(bags, j);
      if (r >= 0) ++g.starts[r];
    }
    for (int64_t r = 1; r < num_rows; ++r) g.starts[r] += g.starts[r - 1];
    g.starts[num_rows] = static_cast<Pos>(valid);
    for (int64_t j = n - 1; j >= 0; --j) {
      const int64_t r = IndexAt(bags, j);
      if (r >= 0) g.order[--g.starts[r]] = static_cast<Pos>(j);
    }
    return g;
  }
  std::vector<std::pair<int64_t, Pos>> pairs;
  pairs.reserve(valid);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = IndexAt(bags, j);
    if (r >= 0) pairs.emplace_back(r, static_cast<Pos>(j));
  }
  std::sort(pairs.begin(), pairs.end());
  for (int64_t i = 0; i < valid; ++i) {
    g.order[i] = pairs[i].second;
    if (i == 0 || pairs[i].first != pairs[i - 1].first) {
      g.rows.push_back(pairs[i].first);
      g.starts.push_back(static_cast<Pos>(i));
    }
  }
  g.starts.push_back(static_cast<Pos>(valid));
  return g;
}

}  // namespace

namespace {

// Per-bag combiner scale: 1, 1/sum(w) or 1/sqrt(sum w^2) over valid entries.
std::vector<float> BagScales(const Bags& bags, Combiner combiner, const ParallelFor& pf) {
  const int64_t num_bags = bags.num_bags, n = bags.NumIndices();
  std::vector<float> bag_scale(num_bags);
  pf(num_bags, 8 * (n / std::max<int64_t>(num_bags, 1) + 1), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float ws = 0.f, wq = 0.f;
      for (int64_t j = bags.Begin(b); j < bags.End(b); ++j) {
        if (IndexAt(bags, j) < 0) continue;
        const float w = WeightAt(bags, j);
        ws += w;
        wq += w * w;
      }
      bag_scale[b] = internal::CombinerScale(combiner, ws, wq);
    }
  });
  return bag_scale;
}

// The max combiner's winners: for each bag and column, the in-bag position
// of the first valid entry holding the maximum (only a strictly larger value
// replaces it, as in the forward), -1 where the bag is empty.
std::vector<int32_t> MaxWinners(const Table& table, const Bags& bags, const ParallelFor& pf) {
  const int64_t dim = table.dim, n = bags.NumIndices();
  std::vector<int32_t> winners(bags.num_bags * dim, -1);
  pf(bags.num_bags, (n / std::max<int64_t>(bags.num_bags, 1) + 1) * dim, [&](int64_t b0, int64_t b1) {
    std::vector<float> best(dim), row(dim);
    for (int64_t b = b0; b < b1; ++b) {
      int32_t* win = winners.data() + b * dim;
      bool any = false;
      for (int64_t j = bags.Begin(b); j < bags.End(b); ++j) {
        const int64_t r = IndexAt(bags, j);
        if (r < 0) continue;
        const int32_t k = static_cast<int32_t>(j - bags.Begin(b));
        if (!any) {
          vec::RowToFloat(table, r, best.data());
          std::fill(win, win + dim, k);
          any = true;
          continue;
        }
        vec::RowToFloat(table, r, row.data());
        vec::MaxArgRow(row.data(), k, best.data(), win, dim);
      }
    }
  });
  return winners;
}

// Entries of the row order between the one being summed and the one being
// prefetched, and how many lines of its gradient row are requested (the
// hardware prefetchers follow the rest of a started row).
constexpr int64_t kEntriesAhead = 16;
constexpr int64_t kGradLinesAhead = 4;
// d_table bytes from which a float32 gradient is written with non-temporal stores: twice the
// largest last-level cache of the machines measured (8-32 MB), so the rows would mostly have left
// the cache before anyone read them anyway. A 32 MB d_table gained nothing on the Zen 1 host,
// 128 MB 8-10% (bench/results/backward_stream_ab_round16.md).
constexpr int64_t kStreamGradientBytes = int64_t{64} << 20;

// What both backward passes (dense d_table, row-sparse) need before they walk
// the row groups: the per-bag scale, each entry's bag, the upstream gradient
// as float32 rows, and where grad . row of each entry goes on its way to
// d_weights.
struct BackwardInputs {
  BackwardInputs(const Table& table, const Bags& b, Combiner combiner, const void* grad_out, ElemType grad_type,
                 void* d_weights, const ParallelFor& pf)
      : bags(b), dim(table.dim), bag_scale(BagScales(b, combiner, pf)) {
    if (combiner == Combiner::kMax) max_winners = MaxWinners(table, bags, pf);
    const int64_t num_bags = bags.num_bags, n = bags.NumIndices();
    if (bags.row_splits != nullptr) {  // a division serves dense bags
      ragged_bag_of.resize(n);
      for (int64_t bag = 0; bag < num_bags; ++bag)
        for (int64_t j = bags.Begin(bag); j < bags.End(bag); ++j) ragged_bag_of[j] = bag;
    }
    // grad . row lands in place for float32 weights, else in a scratch.
    if (d_weights != nullptr) {
      if (bags.weights_type == ElemType::kFloat32) {
        grad_dot_row = static_cast<float*>(d_weights);
      } else {
        grad_dot_scratch.assign(n, 0.f);
        grad_dot_row = grad_dot_scratch.data();
      }
    }
    // Gradient rows are read once per entry: convert half-type gradients to
    // float32 once (an output-sized buffer) rather than at every read.
    grad_rows = static_cast<const float*>(grad_out);
    if (grad_type != ElemType::kFloat32) {
      const int64_t grad_row_bytes = dim * ElemSize(grad_type);
      grad_f.resize(num_bags * dim);
      pf(num_bags, dim, [&](int64_t b0, int64_t b1) {
        vec::ToFloat(static_cast<const char*>(grad_out) + b0 * grad_row_bytes, grad_type,
                     grad_f.data() + b0 * dim, (b1 - b0) * dim);
      });
      grad_rows = grad_f.data();
    }
  }

  int64_t BagOf(int64_t j) const { return bags.row_splits ? ragged_bag_of[j] : j / bags.bag_size; }
  // Entry j's weight, its d_weights slot and the first lines of its gradient
  // row, requested ahead of use: in row order the entries' positions are
  // random, so each of these is a cache miss (perf: most of the loop's time
  // sat on the weight load).
  void Prefetch(int64_t j) const {
    if (bags.weights != nullptr)
      __builtin_prefetch(static_cast<const char*>(bags.weights) + j * ElemSize(bags.weights_type), 0, 3);
    if (grad_dot_row != nullptr) __builtin_prefetch(grad_dot_row + j, 1, 3);
    const char* g = reinterpret_cast<const char*>(grad_rows + BagOf(j) * dim);
    for (int64_t off = 0; off < std::min<int64_t>(dim * 4, kGradLinesAhead * 64); off += 64)
      __builtin_prefetch(g + off, 0, 3);
  }
  bool IsMax() const { return !max_winners.empty(); }

  const Bags& bags;
  const int64_t dim;
  const std::vector<float> bag_scale;
  std::vector<int64_t> ragged_bag_of;
  std::vector<float> grad_dot_scratch;
  float* grad_dot_row = nullptr;  // null without d_weights
  std::vector<float> grad_f;
  const float* grad_rows = nullptr;
  // max only: [num_bags, dim], the in-bag position of each output element's
  // maximum (-1 for an empty bag).
  std::vector<int32_t> max_winners;
};

// The gradient of table row `row` from its group's entries order[begin, end),
// accumulated into acc[dim] (float32); with d_weights, also grad . row of each
// entry. row_buf[dim] holds the row as float32 for half-type tables.
template <typename Pos>
void AccumulateRowGradient(const Table& table, const BackwardInputs& in, const Pos* order, int64_t total,
                           int64_t begin, int64_t end, int64_t row, float* acc, float* row_buf) {
  const int64_t dim = in.dim;
  const char* row_ptr = static_cast<const char*>(table.data) + row * dim * ElemSize(table.type);
  const float* row_f = reinterpret_cast<const float*>(row_ptr);
  const bool with_dots = in.grad_dot_row != nullptr;
  if (with_dots && table.type != ElemType::kFloat32 && begin < end) {
    vec::ToFloat(row_ptr, table.type, row_buf, dim);
    row_f = row_buf;
  }
  std::fill(acc, acc + dim, 0.f);
  for (int64_t i = begin; i < end; ++i) {
    if (i + kEntriesAhead < total) in.Prefetch(order[i + kEntriesAhead]);
    const int64_t j = order[i];
    const int64_t b = in.BagOf(j);
    const float* g = in.grad_rows + b * dim;
    if (in.IsMax()) {  // no weights, so no dots
      vec::AddWhereWinner(g, in.max_winners.data() + b * dim, static_cast<int32_t>(j - in.bags.Begin(b)), acc, dim);
      continue;
    }
    const float c = WeightAt(in.bags, j) * in.bag_scale[b];
    if (with_dots) in.grad_dot_row[j] = vec::AxpyDot(c, g, row_f, acc, dim);
    else vec::AxpyF32(c, g, acc, dim);
  }
}

// Turns grad . row of each valid entry into d out / d w:
//   sum: x_k;  mean: (x_k - out) / S;  sqrtn: (x_k - out * w_k / R) / R,
// where out . g = sum_j w_j (g . x_j) * scale.
void WeightGradFromDots(const Bags& bags, Combiner combiner, const std::vector<float>& bag_scale,
                        const float* grad_dot_row, void* d_weights, const ParallelFor& pf) {
  const int64_t num_bags = bags.num_bags, n = bags.NumIndices();
  pf(num_bags, 8 * (n / std::max<int64_t>(num_bags, 1) + 1), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = bags.Begin(b), end = bags.End(b);
      float weighted = 0.f;
      if (combiner != Combiner::kSum)
        for (int64_t j = begin; j < end; ++j)
          if (IndexAt(bags, j) >= 0) weighted += WeightAt(bags, j) * grad_dot_row[j];
      const float scale = bag_scale[b];
      for (int64_t j = begin; j < end; ++j) {
        float dw = 0.f;
        if (IndexAt(bags, j) >= 0 && scale != 0.f) {
          const float gx = grad_dot_row[j];
          switch (combiner) {
            case Combiner::kSum: dw = gx; break;
            case Combiner::kMean: dw = (gx - weighted * scale) * scale; break;
            case Combiner::kSqrtn: dw = (gx - WeightAt(bags, j) * weighted * scale * scale) * scale; break;
            case Combiner::kMax: break;  // max takes no weights
          }
        }
        internal::StoreElem(d_weights, bags.weights_type, j, dw);
      }
    }
  });
}

// Checks shared by both backward passes.
Status CheckBackward(const Table& table, const Bags& bags, Combiner combiner, ElemType grad_type,
                     ElemType out_type, const ParallelFor& pf) {
  Status s = internal::CheckTypes(table, bags, combiner, out_type, /*for_gradient=*/true);
  if (!s.ok) return s;
  if (grad_type == ElemType::kInt8) return Status::Error("gradient must be a float type");
  if (combiner == Combiner::kMax) {  // winners are stored as int32 in-bag positions
    for (int64_t b = 0; b < bags.num_bags; ++b)
      if (bags.End(b) - bags.Begin(b) > std::numeric_limits<int32_t>::max())
        return Status::Error("combiner 'max': a bag of more than 2^31 - 1 entries has no gradient");
  }
  return ValidateBags(table, bags, pf);
}

}  // namespace

Status Backward(const Table& table, const Bags& bags, Combiner combiner, const void* grad_out,
                ElemType grad_type, void* d_table, ElemType d_table_type, void* d_weights,
                const ParallelFor& pf) {
  Status s = CheckBackward(table, bags, combiner, grad_type, d_table_type, pf);
  if (!s.ok) return s;
  if (bags.weights == nullptr) d_weights = nullptr;  // nothing to differentiate
  const int64_t dim = table.dim, num_bags = bags.num_bags, n = bags.NumIndices();
  const int64_t table_row_bytes = dim * ElemSize(table.type);
  const int64_t d_row_bytes = dim * ElemSize(d_table_type);
  const BackwardInputs in(table, bags, combiner, grad_out, grad_type, d_weights, pf);

  // Rows of the table in group order: each row read once, its gradient row
  // written once, by one thread.
  // A float32 d_table much larger than a last-level cache is written with
  // non-temporal stores from a scratch row: accumulating in d_table itself
  // first reads each of its lines from memory (write-allocate), as many bytes
  // again as the table; the core backward at the roofline's main shape took
  // 0.90-0.92x the time on the 2-core EPYC, a 1 GB table of few touched rows
  // 0.47x (bench/results/backward_stream_ab_round16.md).
  // The values are the same either way.
  const bool stream = vec::kHasStreamingStores && d_table_type == ElemType::kFloat32 &&
                      table.num_rows * d_row_bytes >= kStreamGradientBytes;
  auto table_gradient = [&](const auto& groups) {
    if (!groups.all_rows) {  // rows nobody looked up get zero gradient
      pf(table.num_rows, dim, [&](int64_t r0, int64_t r1) {
        if (stream) {
          vec::StreamF32(nullptr, reinterpret_cast<float*>(static_cast<char*>(d_table) + r0 * d_row_bytes),
                         (r1 - r0) * dim);
          vec::StreamFence();
          return;
        }
        std::vector<float> zeros(dim, 0.f);
        for (int64_t r = r0; r < r1; ++r)
          vec::FromFloat(zeros.data(), 1.f, d_table_type, static_cast<char*>(d_table) + r * d_row_bytes, dim);
      });
    }
    const int64_t groups_n = groups.NumGroups();
    const int64_t cost = (groups.order.size() / std::max<int64_t>(groups_n, 1) + 1) * dim * 3;
    // Other float32 gradients accumulate straight into d_table; half types go
    // through the scratch row too.
    const bool direct = !stream && table.type == ElemType::kFloat32 && d_table_type == ElemType::kFloat32;
    pf(groups_n, cost, [&](int64_t u0, int64_t u1) {
      std::vector<float> acc_buf(direct ? 0 : dim), row_buf(table.type == ElemType::kFloat32 ? 0 : dim);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t r = groups.Row(u);
        char* d_row = static_cast<char*>(d_table) + r * d_row_bytes;
        float* acc = direct ? reinterpret_cast<float*>(d_row) : acc_buf.data();
        AccumulateRowGradient(table, in, groups.order.data(), groups.NumEntries(), groups.starts[u],
                              groups.starts[u + 1], r, acc, row_buf.data());
        if (stream) vec::StreamF32(acc, reinterpret_cast<float*>(d_row), dim);
        else if (!direct) vec::FromFloat(acc, 1.f, d_table_type, d_row, dim);
      }
      if (stream) vec::StreamFence();
    });
  };
  if (d_table != nullptr) {
    internal::AdviseOutputHugePages(d_table, static_cast<size_t>(table.num_rows * d_row_bytes));
    if (n <= std::numeric_limits<int32_t>::max())
      table_gradient(GroupByRow<int32_t>(bags, table.num_rows));
    else
      table_gradient(GroupByRow<int64_t>(bags, table.num_rows));
  } else if (d_weights != nullptr) {  // d_weights alone: bag order, no grouping
    pf(num_bags, (n / std::max<int64_t>(num_bags, 1) + 1) * dim * 2, [&](int64_t b0, int64_t b1) {
      std::vector<float> row_f(dim);
      for (int64_t b = b0; b < b1; ++b) {
        const float* g = in.grad_rows + b * dim;
        for (int64_t j = bags.Begin(b); j < bags.End(b); ++j) {
          const int64_t r = IndexAt(bags, j);
          if (r < 0) continue;
          vec::ToFloat(static_cast<const char*>(table.data) + r * table_row_bytes, table.type, row_f.data(), dim);
          in.grad_dot_row[j] = vec::Dot(g, row_f.data(), dim);
        }
      }
    });
  }
  if (d_weights != nullptr) WeightGradFromDots(bags, combiner, in.bag_scale, in.grad_dot_row, d_weights, pf);
  return Status::Ok();
}

// ---- row-sparse backward ------------------------------------------------------

Status SparseBackward(const Table& table, const Bags& bags, Combiner combiner, const void* grad_out,
                      ElemType grad_type, const SparseRowsAlloc& alloc, ElemType row_grads_type,
                      void* d_weights, const ParallelFor& pf) {
  Status s = CheckBackward(table, bags, combiner, grad_type, row_grads_type, pf);
  if (!s.ok) return s;
  if (bags.weights == nullptr) d_weights = nullptr;
  const int64_t dim = table.dim, n = bags.NumIndices();
  const int64_t out_row_bytes = dim * ElemSize(row_grads_type);
  const BackwardInputs in(table, bags, combiner, grad_out, grad_type, d_weights, pf);

  auto row_gradients = [&](const auto& groups) -> Status {
    // Counting-sort groups cover every table row: keep the non-empty ones.
    std::vector<int64_t> touched;
    if (groups.all_rows) {
      for (int64_t r = 0; r < groups.NumGroups(); ++r)
        if (groups.starts[r] < groups.starts[r + 1]) touched.push_back(r);
    }
    const int64_t num_touched = groups.all_rows ? static_cast<int64_t>(touched.size()) : groups.NumGroups();
    int64_t* rows = nullptr;
    void* row_grads = nullptr;
    Status st = alloc(num_touched, &rows, &row_grads);
    if (!st.ok) return st;
    if (num_touched > 0 && (rows == nullptr || (row_grads == nullptr && dim > 0)))
      return Status::Error("SparseBackward: the allocator returned null outputs");
    const int64_t cost = (static_cast<int64_t>(groups.order.size()) / std::max<int64_t>(num_touched, 1) + 1) * dim * 3;
    const bool direct = table.type == ElemType::kFloat32 && row_grads_type == ElemType::kFloat32;
    pf(num_touched, cost, [&](int64_t k0, int64_t k1) {
      std::vector<float> acc_buf(direct ? 0 : dim), row_buf(table.type == ElemType::kFloat32 ? 0 : dim);
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t u = groups.all_rows ? touched[k] : k;
        const int64_t r = groups.Row(u);
        rows[k] = r;
        char* out_row = static_cast<char*>(row_grads) + k * out_row_bytes;
        float* acc = direct ? reinterpret_cast<float*>(out_row) : acc_buf.data();
        AccumulateRowGradient(table, in, groups.order.data(), groups.NumEntries(), groups.starts[u],
                              groups.starts[u + 1], r, acc, row_buf.data());
        if (!direct) vec::FromFloat(acc, 1.f, row_grads_type, out_row, dim);
      }
    });
    return Status::Ok();
  };
  s = n <= std::numeric_limits<int32_t>::max() ? row_gradients(GroupByRow<int32_t>(bags, table.num_rows))
                                               : row_gradients(GroupByRow<int64_t>(bags, table.num_rows));
  if (!s.ok) return s;
  if (d_weights != nullptr) WeightGradFromDots(bags, combiner, in.bag_scale, in.grad_dot_row, d_weights, pf);
  return Status::Ok();
}

// ---- row gradients handed to a callback (the fused optimizer) ------------------

Status RowGradients(const Table& table, const Bags& bags, Combiner combiner, const void* grad_out,
                    ElemType grad_type, void* d_weights, const ParallelFor& pf, const RowGradientFn& fn) {
  Status s = CheckBackward(table, bags, combiner, grad_type, ElemType::kFloat32, pf);
  if (!s.ok) return s;
  if (bags.weights == nullptr) d_weights = nullptr;
  const int64_t dim = table.dim, n = bags.NumIndices();
  const BackwardInputs in(table, bags, combiner, grad_out, grad_type, d_weights, pf);
  auto visit = [&](const auto& groups) {
    const int64_t groups_n = groups.NumGroups();
    const int64_t cost = (static_cast<int64_t>(groups.order.size()) / std::max<int64_t>(groups_n, 1) + 1) * dim * 4;
    pf(groups_n, cost, [&](int64_t u0, int64_t u1) {
      std::vector<float> acc(dim), row_buf(table.type == ElemType::kFloat32 ? 0 : dim);
      for (int64_t u = u0; u < u1; ++u) {
        if (groups.starts[u] == groups.starts[u + 1]) continue;  // counting sort lists every row
        const int64_t r = groups.Row(u);
        AccumulateRowGradient(table, in, groups.order.data(), groups.NumEntries(), groups.starts[u],
                              groups.starts[u + 1], r, acc.data(), row_buf.data());
        fn(r, acc.data());
      }
    });
  };
  if (n <= std::numeric_limits<int32_t>::max()) visit(GroupByRow<int32_t>(bags, table.num_rows));
  else visit(GroupByRow<int64_t>(bags, table.num_rows));
  if (d_weights != nullptr) WeightGradFromDots(bags, combiner, in.bag_scale, in.grad_dot_row, d_weights, pf);
  return Status::Ok();
}

}  // namespace pkm
