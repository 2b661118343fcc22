// Fast CPU EmbeddingBag: forward accumulates each bag's rows, eight at a
// time, straight into one float32 row (no [K, D] gather); backward groups the
// (index, position) pairs by row so every table row is read once and its
// gradient written once, by one thread (no atomics, no [B*K, D] buffer).
#include "kernels/core/embedding_bag.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/core/forward_int8.h"
#include "kernels/core/internal.h"
#include "kernels/core/shape_rules.h"
#include "kernels/core/vector_ops.h"

namespace pkm {

bool ParseCombiner(const std::string& name, Combiner* out) {
  if (name == "sum") *out = Combiner::kSum;
  else if (name == "mean") *out = Combiner::kMean;
  else if (name == "sqrtn") *out = Combiner::kSqrtn;
  else return false;
  return true;
}

const char* CombinerName(Combiner c) {
  switch (c) {
    case Combiner::kSum: return "sum";
    case Combiner::kMean: return "mean";
    case Combiner::kSqrtn: return "sqrtn";
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

namespace internal {

Status CheckTypes(const Table& t, const Bags& bags, ElemType out_type, bool for_gradient) {
  Status st = ConcreteDims("params", {t.num_rows, t.dim});
  if (!st.ok) return st;
  if (t.data == nullptr && t.num_rows * t.dim > 0) return Status::Error("table data is null");
  if (t.type == ElemType::kInt8) {
    if (for_gradient) return Status::Error("no gradient for int8 (quantised) tables");
    Status s = CheckInt8Table(t);
    if (!s.ok) return s;
  }
  if (out_type == ElemType::kInt8) return Status::Error("output must be float32, float16 or bfloat16, got int8");
  if (bags.weights != nullptr && !(st = WeightsType(DTypeOf(bags.weights_type))).ok) return st;
  if (!(st = ConcreteDims("indices", {bags.num_bags, bags.bag_size})).ok) return st;
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
  }
  return 0.f;
}

}  // namespace internal

using internal::IndexAt;
using internal::WeightAt;

Status ValidateBags(const Table& table, const Bags& bags, const ParallelFor& pf) {
  if (bags.row_splits != nullptr) {
    // Without the values' length, row_splits could point past the buffers.
    if (bags.num_values < 0) return Status::Error("ragged bags need num_values (the length of indices)");
    if (bags.num_bags >= 0 && internal::ReadInt(bags.row_splits, bags.row_splits_int64, 0) != 0)
      return Status::Error("row_splits[0] must be 0, got " +
                           std::to_string(internal::ReadInt(bags.row_splits, bags.row_splits_int64, 0)));
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
  if (bags.index_policy == IndexPolicy::kOutOfRangeIsPadding) return Status::Ok();
  if (bags.index_policy != IndexPolicy::kNegativeIsPadding && bags.index_policy != IndexPolicy::kNoPadding)
    return Status::Error("unknown index policy " + std::to_string(static_cast<int>(bags.index_policy)));
  const bool negative_is_padding = bags.index_policy == IndexPolicy::kNegativeIsPadding;
  const int64_t n = bags.NumIndices();
  std::atomic<int64_t> first_bad{n};
  pf(n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t v = IndexAt(bags, j);
      if (v >= table.num_rows || (v < 0 && !negative_is_padding)) {
        int64_t cur = first_bad.load();
        while (j < cur && !first_bad.compare_exchange_weak(cur, j)) {
        }
        return;  // later entries of this range cannot beat j
      }
    }
  });
  const int64_t j = first_bad.load();
  if (j < n) {
    return Status::Error("indices[" + std::to_string(j) + "] = " + std::to_string(IndexAt(bags, j)) +
                         " is out of range [0, " + std::to_string(table.num_rows) +
                         (negative_is_padding ? ") (negative indices are padding)"
                                              : ") (stock GATHER allows no padding)"));
  }
  return Status::Ok();
}

Status Forward(const Table& table, const Bags& bags, Combiner combiner, void* out,
               ElemType out_type, const ParallelFor& pf) {
  Status s = internal::CheckTypes(table, bags, out_type, /*for_gradient=*/false);
  if (!s.ok) return s;
  s = ValidateBags(table, bags, pf);
  if (!s.ok) return s;
  if (table.type == ElemType::kInt8) return internal::ForwardInt8(table, bags, combiner, out, out_type, pf);
  const int64_t dim = table.dim;
  const int64_t out_row_bytes = dim * ElemSize(out_type);
  const int64_t avg_bag = bags.num_bags > 0 ? std::max<int64_t>(1, bags.NumIndices() / bags.num_bags) : 1;
  pf(bags.num_bags, avg_bag * (dim + 16), [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(dim);
    int64_t group_rows[vec::kRowGroup];
    float group_weights[vec::kRowGroup];
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(acc.begin(), acc.end(), 0.f);
      float weight_sum = 0.f, weight_sq_sum = 0.f;
      int pending = 0;
      for (int64_t j = bags.Begin(b), end = bags.End(b); j < end; ++j) {
        const int64_t idx = IndexAt(bags, j);
        if (idx < 0) continue;  // padding
        const float w = WeightAt(bags, j);
        weight_sum += w;
        weight_sq_sum += w * w;
        group_rows[pending] = idx;
        group_weights[pending] = w;
        if (++pending == vec::kRowGroup) {
          vec::AxpyRowGroup(table, group_rows, group_weights, acc.data());
          pending = 0;
        }
      }
      for (int r = 0; r < pending; ++r) vec::AxpyRow(table, group_rows[r], group_weights[r], acc.data());
      vec::FromFloat(acc.data(), internal::CombinerScale(combiner, weight_sum, weight_sq_sum),
                     out_type, static_cast<char*>(out) + b * out_row_bytes, dim);
    }
  });
  return Status::Ok();
}

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

// What both backward passes (dense d_table, row-sparse) need before they walk
// the row groups: the per-bag scale, each entry's bag, the upstream gradient
// as float32 rows, and where grad . row of each entry goes on its way to
// d_weights.
struct BackwardInputs {
  BackwardInputs(const Bags& b, Combiner combiner, const void* grad_out, ElemType grad_type, int64_t dim_,
                 void* d_weights, const ParallelFor& pf)
      : bags(b), dim(dim_), bag_scale(BagScales(b, combiner, pf)) {
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

  const Bags& bags;
  const int64_t dim;
  const std::vector<float> bag_scale;
  std::vector<int64_t> ragged_bag_of;
  std::vector<float> grad_dot_scratch;
  float* grad_dot_row = nullptr;  // null without d_weights
  std::vector<float> grad_f;
  const float* grad_rows = nullptr;
};

// The gradient of table row `row` from its group's entries order[begin, end),
// accumulated into acc[dim] (float32); with d_weights, also grad . row of each
// entry. row_buf[dim] holds the row as float32 for half-type tables.
template <typename Pos>
void AccumulateRowGradient(const Table& table, const BackwardInputs& in, const Pos* order, int64_t begin,
                           int64_t end, int64_t row, float* acc, float* row_buf) {
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
    const int64_t j = order[i];
    const int64_t b = in.BagOf(j);
    const float* g = in.grad_rows + b * dim;
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
          }
        }
        internal::StoreElem(d_weights, bags.weights_type, j, dw);
      }
    }
  });
}

// Checks shared by both backward passes.
Status CheckBackward(const Table& table, const Bags& bags, ElemType grad_type, ElemType out_type,
                     const ParallelFor& pf) {
  Status s = internal::CheckTypes(table, bags, out_type, /*for_gradient=*/true);
  if (!s.ok) return s;
  if (grad_type == ElemType::kInt8) return Status::Error("gradient must be a float type");
  return ValidateBags(table, bags, pf);
}

}  // namespace

Status Backward(const Table& table, const Bags& bags, Combiner combiner, const void* grad_out,
                ElemType grad_type, void* d_table, ElemType d_table_type, void* d_weights,
                const ParallelFor& pf) {
  Status s = CheckBackward(table, bags, grad_type, d_table_type, pf);
  if (!s.ok) return s;
  if (bags.weights == nullptr) d_weights = nullptr;  // nothing to differentiate
  const int64_t dim = table.dim, num_bags = bags.num_bags, n = bags.NumIndices();
  const int64_t table_row_bytes = dim * ElemSize(table.type);
  const int64_t d_row_bytes = dim * ElemSize(d_table_type);
  const BackwardInputs in(bags, combiner, grad_out, grad_type, dim, d_weights, pf);

  // Rows of the table in group order: each row read once, its gradient row
  // written once, by one thread.
  auto table_gradient = [&](const auto& groups) {
    if (!groups.all_rows) {  // rows nobody looked up get zero gradient
      pf(table.num_rows, dim, [&](int64_t r0, int64_t r1) {
        std::vector<float> zeros(dim, 0.f);
        for (int64_t r = r0; r < r1; ++r)
          vec::FromFloat(zeros.data(), 1.f, d_table_type, static_cast<char*>(d_table) + r * d_row_bytes, dim);
      });
    }
    const int64_t groups_n = groups.NumGroups();
    const int64_t cost = (groups.order.size() / std::max<int64_t>(groups_n, 1) + 1) * dim * 3;
    // float32 tables accumulate straight into d_table; half types go through
    // a float scratch row.
    const bool direct = table.type == ElemType::kFloat32 && d_table_type == ElemType::kFloat32;
    pf(groups_n, cost, [&](int64_t u0, int64_t u1) {
      std::vector<float> acc_buf(direct ? 0 : dim), row_buf(table.type == ElemType::kFloat32 ? 0 : dim);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t r = groups.Row(u);
        char* d_row = static_cast<char*>(d_table) + r * d_row_bytes;
        float* acc = direct ? reinterpret_cast<float*>(d_row) : acc_buf.data();
        AccumulateRowGradient(table, in, groups.order.data(), groups.starts[u], groups.starts[u + 1], r, acc,
                              row_buf.data());
        if (!direct) vec::FromFloat(acc, 1.f, d_table_type, d_row, dim);
      }
    });
  };
  if (d_table != nullptr) {
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
  Status s = CheckBackward(table, bags, grad_type, row_grads_type, pf);
  if (!s.ok) return s;
  if (bags.weights == nullptr) d_weights = nullptr;
  const int64_t dim = table.dim, n = bags.NumIndices();
  const int64_t out_row_bytes = dim * ElemSize(row_grads_type);
  const BackwardInputs in(bags, combiner, grad_out, grad_type, dim, d_weights, pf);

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
        AccumulateRowGradient(table, in, groups.order.data(), groups.starts[u], groups.starts[u + 1], r, acc,
                              row_buf.data());
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
  Status s = CheckBackward(table, bags, grad_type, ElemType::kFloat32, pf);
  if (!s.ok) return s;
  if (bags.weights == nullptr) d_weights = nullptr;
  const int64_t dim = table.dim, n = bags.NumIndices();
  const BackwardInputs in(bags, combiner, grad_out, grad_type, dim, d_weights, pf);
  auto visit = [&](const auto& groups) {
    const int64_t groups_n = groups.NumGroups();
    const int64_t cost = (static_cast<int64_t>(groups.order.size()) / std::max<int64_t>(groups_n, 1) + 1) * dim * 4;
    pf(groups_n, cost, [&](int64_t u0, int64_t u1) {
      std::vector<float> acc(dim), row_buf(table.type == ElemType::kFloat32 ? 0 : dim);
      for (int64_t u = u0; u < u1; ++u) {
        if (groups.starts[u] == groups.starts[u + 1]) continue;  // counting sort lists every row
        const int64_t r = groups.Row(u);
        AccumulateRowGradient(table, in, groups.order.data(), groups.starts[u], groups.starts[u + 1], r,
                              acc.data(), row_buf.data());
        fn(r, acc.data());
      }
    });
  };
  if (n <= std::numeric_limits<int32_t>::max()) visit(GroupByRow<int32_t>(bags, table.num_rows));
  else visit(GroupByRow<int64_t>(bags, table.num_rows));
  if (d_weights != nullptr) WeightGradFromDots(bags, combiner, in.bag_scale, in.grad_dot_row, d_weights, pf);
  return Status::Ok();
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
