// Fast core vs reference on random shapes, every type combination, dense and
// ragged bags, padding and empty bags; plus the error paths. Plain asserts so
// it builds with nothing but the compiler; prints a ctest-like summary.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "kernels/core/embedding_bag.h"
#include "kernels/core/table_pages.h"
#include "kernels/core/vector_ops.h"

namespace {

int g_failed = 0, g_passed = 0;

#define EXPECT(cond, ...)                                   \
  do {                                                      \
    if (!(cond)) {                                          \
      ++g_failed;                                           \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                    \
      std::fprintf(stderr, "\n");                           \
    } else {                                                \
      ++g_passed;                                           \
    }                                                       \
  } while (0)

// A two-thread splitter, so the tests exercise the parallel paths.
pkm::ParallelFor TwoThreads() {
  return [](int64_t total, int64_t, const pkm::RangeFn& fn) {
    if (total <= 0) return;
    const int64_t mid = total / 2;
    std::thread t([&] { if (mid > 0) fn(0, mid); });
    fn(mid, total);
    t.join();
  };
}

float Load(const std::vector<uint8_t>& buf, pkm::ElemType t, int64_t i) {
  switch (t) {
    case pkm::ElemType::kFloat32: { float f; std::memcpy(&f, buf.data() + 4 * i, 4); return f; }
    case pkm::ElemType::kFloat16: { uint16_t h; std::memcpy(&h, buf.data() + 2 * i, 2); return pkm::HalfToFloat(h); }
    case pkm::ElemType::kBFloat16: { uint16_t h; std::memcpy(&h, buf.data() + 2 * i, 2); return pkm::BFloat16ToFloat(h); }
    case pkm::ElemType::kInt8: return static_cast<float>(static_cast<int8_t>(buf[i]));
  }
  return 0;
}

std::vector<uint8_t> RandomBuffer(std::mt19937_64& rng, pkm::ElemType t, int64_t n) {
  std::vector<uint8_t> buf(n * pkm::ElemSize(t));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int64_t i = 0; i < n; ++i) {
    const float v = u(rng);
    switch (t) {
      case pkm::ElemType::kFloat32: std::memcpy(buf.data() + 4 * i, &v, 4); break;
      case pkm::ElemType::kFloat16: { uint16_t h = pkm::FloatToHalf(v); std::memcpy(buf.data() + 2 * i, &h, 2); break; }
      case pkm::ElemType::kBFloat16: { uint16_t h = pkm::FloatToBFloat16(v); std::memcpy(buf.data() + 2 * i, &h, 2); break; }
      case pkm::ElemType::kInt8: buf[i] = static_cast<uint8_t>(static_cast<int8_t>(std::lround(v * 127))); break;
    }
  }
  return buf;
}

// Ragged bags over int64 indices and row splits, weighted by `weights`.
pkm::Bags RaggedBags(const std::vector<int64_t>& idx, const std::vector<int64_t>& splits,
                     const std::vector<uint8_t>& weights, pkm::ElemType weights_type) {
  pkm::Bags bags;
  bags.indices = idx.data();
  bags.indices_int64 = true;
  bags.num_bags = static_cast<int64_t>(splits.size()) - 1;
  bags.row_splits = splits.data();
  bags.row_splits_int64 = true;
  bags.num_values = static_cast<int64_t>(idx.size());
  bags.weights = weights.data();
  bags.weights_type = weights_type;
  return bags;
}

bool Close(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, pkm::ElemType t, int64_t n,
           float rtol, std::string* where) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = Load(a, t, i), y = Load(b, t, i);
    if (!(std::fabs(x - y) <= rtol * (1.f + std::fabs(y)))) {
      *where = "element " + std::to_string(i) + ": " + std::to_string(x) + " vs " + std::to_string(y);
      return false;
    }
  }
  return true;
}

// SparseBackward scattered into a zero table equals the dense reference
// gradient; its rows are exactly the distinct rows of valid indices, ascending.
void SparseCase(const pkm::Table& table, const pkm::Bags& bags, pkm::Combiner combiner,
                const std::vector<uint8_t>& grad, pkm::ElemType value_type, const std::vector<uint8_t>& dt_ref,
                const std::vector<uint8_t>& dw_ref, bool weighted, float rtol, const std::string& what) {
  const int64_t dim = table.dim, nnz = bags.NumIndices(), elem = pkm::ElemSize(table.type);
  std::vector<int64_t> rows;
  std::vector<uint8_t> row_grads;
  auto alloc = [&](int64_t u, int64_t** r, void** g) {
    rows.assign(u, -7);
    row_grads.assign(u * dim * elem, 0xEF);
    *r = rows.data();
    *g = row_grads.data();
    return pkm::Status::Ok();
  };
  std::vector<uint8_t> dw(nnz * pkm::ElemSize(value_type), 0xCD);
  auto s = pkm::SparseBackward(table, bags, combiner, grad.data(), value_type, alloc, table.type,
                               weighted ? dw.data() : nullptr, TwoThreads());
  EXPECT(s.ok, "%s sparse backward failed: %s", what.c_str(), s.message.c_str());
  std::vector<int64_t> expect_rows;
  for (int64_t j = 0; j < nnz; ++j) {
    const int64_t r = bags.indices_int64 ? static_cast<const int64_t*>(bags.indices)[j]
                                         : static_cast<const int32_t*>(bags.indices)[j];
    if (r >= 0) expect_rows.push_back(r);
  }
  std::sort(expect_rows.begin(), expect_rows.end());
  expect_rows.erase(std::unique(expect_rows.begin(), expect_rows.end()), expect_rows.end());
  EXPECT(rows == expect_rows, "%s sparse rows: %zu rows, expected the %zu distinct valid indices", what.c_str(),
         rows.size(), expect_rows.size());
  std::vector<uint8_t> dense(table.num_rows * dim * elem, 0);
  for (size_t k = 0; k < rows.size() && rows == expect_rows; ++k)
    std::memcpy(dense.data() + rows[k] * dim * elem, row_grads.data() + k * dim * elem, dim * elem);
  std::string where;
  EXPECT(Close(dense, dt_ref, table.type, table.num_rows * dim, rtol, &where), "%s sparse d_table: %s",
         what.c_str(), where.c_str());
  if (weighted)
    EXPECT(Close(dw, dw_ref, value_type, nnz, rtol * 4, &where), "%s sparse d_weights: %s", what.c_str(),
           where.c_str());
  // An allocator error is passed on, nothing else happens.
  auto refuse = [](int64_t, int64_t**, void**) { return pkm::Status::Error("no memory for you"); };
  s = pkm::SparseBackward(table, bags, combiner, grad.data(), value_type, refuse, table.type, nullptr, TwoThreads());
  EXPECT(!s.ok && s.message == "no memory for you", "%s: allocator error not passed on", what.c_str());
}

void RandomCase(std::mt19937_64& rng, int case_id) {
  using pkm::ElemType;
  const ElemType float_types[] = {ElemType::kFloat32, ElemType::kFloat16, ElemType::kBFloat16, ElemType::kInt8};
  const ElemType table_type = float_types[rng() % 4];
  const bool quantised = table_type == ElemType::kInt8;
  const ElemType value_type = quantised ? ElemType::kFloat32 : table_type;  // weights/out/grad
  const pkm::Combiner combiner = static_cast<pkm::Combiner>(rng() % 4);
  const bool ragged = rng() % 3 == 0, idx64 = rng() % 2, splits64 = rng() % 2;
  const bool weighted = rng() % 4 != 0 && combiner != pkm::Combiner::kMax;  // max takes no weights
  const bool large_table = rng() % 8 == 0;  // exercises the comparison-sort backward
  const int64_t num_rows = large_table ? (int64_t{1} << 20) + 5000 + rng() % 100 : 1 + rng() % 300;
  const int64_t dim = 1 + rng() % 70, num_bags = rng() % 40, bag_size = rng() % 12;

  std::vector<int64_t> splits(num_bags + 1, 0);
  for (int64_t b = 0; b < num_bags; ++b) splits[b + 1] = splits[b] + (ragged ? rng() % 15 : bag_size);
  const int64_t nnz = splits[num_bags];
  std::vector<int64_t> idx(nnz);
  // Hot rows (few distinct) half of the time, padding ~10%.
  const int64_t distinct = rng() % 2 ? std::min<int64_t>(num_rows, 3) : num_rows;
  for (auto& v : idx) v = rng() % 10 == 0 ? -1 - static_cast<int64_t>(rng() % 3) : static_cast<int64_t>(rng() % distinct);
  std::vector<int32_t> idx32(idx.begin(), idx.end()), splits32(splits.begin(), splits.end());

  // Large tables are sparse in use: only the used rows need values, but the
  // buffer must exist; keep it small-dim.
  const int64_t table_dim = large_table ? std::min<int64_t>(dim, 2) : dim;
  auto table_buf = RandomBuffer(rng, table_type, num_rows * table_dim);
  // int8 rows: scale and bias per row, float32 or float16 (then the halves'
  // bit patterns), bias absent a quarter of the time.
  const bool half_row_params = rng() % 2, with_biases = rng() % 4 != 0;
  std::vector<float> scales(num_rows), biases(num_rows);
  std::vector<uint16_t> scales16(num_rows), biases16(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    scales[r] = 0.01f + (rng() % 100) / 1000.f;
    biases[r] = (static_cast<float>(rng() % 200) - 100.f) / 256.f;
    scales16[r] = pkm::FloatToHalf(scales[r]);
    biases16[r] = pkm::FloatToHalf(biases[r]);
  }
  auto weights = RandomBuffer(rng, value_type, nnz);
  if (combiner == pkm::Combiner::kMean) {
    // mean divides by sum(w): keep weights positive (softmax-like) so the
    // comparison is not dominated by cancellation in a near-zero sum.
    for (int64_t j = 0; j < nnz; ++j) {
      const float v = 0.05f + std::fabs(Load(weights, value_type, j));
      switch (value_type) {
        case pkm::ElemType::kFloat32: std::memcpy(weights.data() + 4 * j, &v, 4); break;
        case pkm::ElemType::kFloat16: { uint16_t h = pkm::FloatToHalf(v); std::memcpy(weights.data() + 2 * j, &h, 2); break; }
        case pkm::ElemType::kBFloat16: { uint16_t h = pkm::FloatToBFloat16(v); std::memcpy(weights.data() + 2 * j, &h, 2); break; }
        default: break;
      }
    }
  }

  pkm::Table table{table_buf.data(), table_type, num_rows, table_dim};
  if (quantised) {
    table.row_scales = half_row_params ? static_cast<const void*>(scales16.data()) : scales.data();
    table.row_biases = !with_biases ? nullptr : half_row_params ? static_cast<const void*>(biases16.data()) : biases.data();
    table.row_params_type = half_row_params ? ElemType::kFloat16 : ElemType::kFloat32;
  }
  pkm::Bags bags;
  bags.indices = idx64 ? static_cast<const void*>(idx.data()) : idx32.data();
  bags.indices_int64 = idx64;
  bags.num_bags = num_bags;
  bags.bag_size = bag_size;
  if (ragged) {
    bags.row_splits = splits64 ? static_cast<const void*>(splits.data()) : splits32.data();
    bags.row_splits_int64 = splits64;
    bags.num_values = nnz;
  }
  bags.weights = weighted ? weights.data() : nullptr;
  bags.weights_type = value_type;

  const float rtol = value_type == ElemType::kFloat32 ? 1e-5f : 1e-2f;
  const std::string what = "case " + std::to_string(case_id) + " type=" + std::to_string(int(table_type)) +
                           " combiner=" + pkm::CombinerName(combiner) + (ragged ? " ragged" : " dense");
  std::vector<uint8_t> out_fast(num_bags * table_dim * pkm::ElemSize(value_type)), out_ref(out_fast.size());
  auto s1 = pkm::Forward(table, bags, combiner, out_fast.data(), value_type, TwoThreads());
  auto s2 = pkm::ReferenceForward(table, bags, combiner, out_ref.data(), value_type);
  EXPECT(s1.ok && s2.ok, "%s: forward failed: %s %s", what.c_str(), s1.message.c_str(), s2.message.c_str());
  std::string where;
  EXPECT(Close(out_fast, out_ref, value_type, num_bags * table_dim, rtol, &where), "%s forward: %s", what.c_str(), where.c_str());
  if (quantised) return;

  auto grad = RandomBuffer(rng, value_type, num_bags * table_dim);
  std::vector<uint8_t> dt_fast(num_rows * table_dim * pkm::ElemSize(table_type), 0xAB), dt_ref(dt_fast.size());
  std::vector<uint8_t> dw_fast(nnz * pkm::ElemSize(value_type), 0xCD), dw_ref(dw_fast.size());
  s1 = pkm::Backward(table, bags, combiner, grad.data(), value_type, dt_fast.data(), table_type, dw_fast.data(), TwoThreads());
  s2 = pkm::ReferenceBackward(table, bags, combiner, grad.data(), value_type, dt_ref.data(), table_type, dw_ref.data());
  EXPECT(s1.ok && s2.ok, "%s: backward failed: %s %s", what.c_str(), s1.message.c_str(), s2.message.c_str());
  EXPECT(Close(dt_fast, dt_ref, table_type, num_rows * table_dim, rtol, &where), "%s d_table: %s", what.c_str(), where.c_str());
  if (weighted)
    EXPECT(Close(dw_fast, dw_ref, value_type, nnz, rtol * 4, &where), "%s d_weights: %s", what.c_str(), where.c_str());
  SparseCase(table, bags, combiner, grad, value_type, dt_ref, dw_ref, weighted, rtol, what);
  // Weights gradient alone (no d_table) takes another path.
  if (weighted) {
    std::vector<uint8_t> dw_only(dw_fast.size());
    s1 = pkm::Backward(table, bags, combiner, grad.data(), value_type, nullptr, table_type, dw_only.data(), TwoThreads());
    EXPECT(s1.ok && Close(dw_only, dw_ref, value_type, nnz, rtol * 4, &where), "%s d_weights only: %s", what.c_str(), where.c_str());
  }
}

// max: ties go to the first bag position (rows 1 and 2 are equal), padding
// and empty bags, and weights refused with the one core message everywhere.
void MaxCases() {
  const float sentinel = -12345.f;
  std::vector<float> table_buf = {1, -5, 3, 2, 7, -1, 2, 7, -1, -4, -4, -4};  // 4 rows x 3
  pkm::Table table{table_buf.data(), pkm::ElemType::kFloat32, 4, 3};
  std::vector<int32_t> idx = {2, 1, 0, -1, -1, -1, 3, -1, 3};  // 3 bags of 3
  pkm::Bags bags;
  bags.indices = idx.data();
  bags.num_bags = 3;
  bags.bag_size = 3;
  std::vector<float> out(9, sentinel);
  auto s = pkm::Forward(table, bags, pkm::Combiner::kMax, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  const std::vector<float> expect_out = {2, 7, 3, 0, 0, 0, -4, -4, -4};
  EXPECT(s.ok && out == expect_out, "max forward: %s", s.message.c_str());
  std::vector<float> grad = {1, 2, 3, 4, 5, 6, 7, 8, 9}, d_table(12, sentinel);
  s = pkm::Backward(table, bags, pkm::Combiner::kMax, grad.data(), pkm::ElemType::kFloat32, d_table.data(),
                    pkm::ElemType::kFloat32, nullptr, TwoThreads());
  // Bag 0: column 0 and 1 tie between rows 2 (position 0) and 1: row 2 wins;
  // column 2 is row 0's. Bag 2: row 3 twice: the first position takes it all.
  const std::vector<float> expect_dt = {0, 0, 3, 0, 0, 0, 1, 2, 0, 7, 8, 9};
  EXPECT(s.ok && d_table == expect_dt, "max backward (ties to the first): %s", s.message.c_str());
  std::vector<float> w(9, 1.f);
  bags.weights = w.data();
  s = pkm::Forward(table, bags, pkm::Combiner::kMax, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message == pkm::kMaxWithWeightsError, "max with weights (forward): %s", s.message.c_str());
  s = pkm::Backward(table, bags, pkm::Combiner::kMax, grad.data(), pkm::ElemType::kFloat32, d_table.data(),
                    pkm::ElemType::kFloat32, nullptr, pkm::SerialFor());
  EXPECT(!s.ok && s.message == pkm::kMaxWithWeightsError, "max with weights (backward): %s", s.message.c_str());
  PkmBags problem = pkm::ToBagProblem(table, bags, pkm::Combiner::kMax);
  pkm::Combiner parsed;
  s = pkm::FromBagProblem(problem, &table, &bags, &parsed);
  EXPECT(!s.ok && s.message == pkm::kMaxWithWeightsError, "max with weights (C descriptor): %s", s.message.c_str());
  problem.combiner = 4;
  s = pkm::FromBagProblem(problem, &table, &bags, &parsed);
  EXPECT(!s.ok && s.message.find("got 4") != std::string::npos, "bad combiner value: %s", s.message.c_str());
}

// max with NaN: the result is NaN wherever a bag's row holds one, whatever
// the bag's order (np.max's rule), and the gradient goes to the first NaN.
// 19 columns cross the 8-wide vector loops and their tails.
void MaxNaNCases() {
  const int64_t rows = 3, dim = 19;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> values(rows * dim);
  for (int64_t c = 0; c < dim; ++c) {
    values[c] = c % 3 == 0 ? nan : -1.f;
    values[dim + c] = c == 9 || c == 18 ? nan : 2.f;
    values[2 * dim + c] = 0.f;
  }
  const std::vector<std::vector<int32_t>> orders = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1},
                                                    {2, 1, 0}, {-1, 2, 0}, {1, -1, 2}};
  for (pkm::ElemType type : {pkm::ElemType::kFloat32, pkm::ElemType::kFloat16, pkm::ElemType::kBFloat16}) {
    std::vector<uint8_t> buf(rows * dim * pkm::ElemSize(type));
    for (int64_t i = 0; i < rows * dim; ++i) {
      const float v = values[i];
      switch (type) {
        case pkm::ElemType::kFloat32: std::memcpy(buf.data() + 4 * i, &v, 4); break;
        case pkm::ElemType::kFloat16: { uint16_t h = pkm::FloatToHalf(v); std::memcpy(buf.data() + 2 * i, &h, 2); break; }
        default: { uint16_t h = pkm::FloatToBFloat16(v); std::memcpy(buf.data() + 2 * i, &h, 2); break; }
      }
    }
    pkm::Table table{buf.data(), type, rows, dim};
    for (const auto& order : orders) {
      pkm::Bags bags;
      bags.indices = order.data();
      bags.num_bags = 1;
      bags.bag_size = 3;
      std::vector<float> out(dim), grad(dim, 1.f), d_table(rows * dim, -7.f);
      auto s = pkm::Forward(table, bags, pkm::Combiner::kMax, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
      auto b = pkm::Backward(table, bags, pkm::Combiner::kMax, grad.data(), pkm::ElemType::kFloat32, d_table.data(),
                             pkm::ElemType::kFloat32, nullptr, pkm::SerialFor());
      bool ok = s.ok && b.ok;
      for (int64_t c = 0; c < dim && ok; ++c) {
        int32_t winner = -1;  // the first NaN, else the first strictly larger
        for (int32_t r : order) {
          if (r < 0) continue;
          const float v = values[r * dim + c];
          if (winner >= 0 && std::isnan(values[winner * dim + c])) break;
          if (winner < 0 || std::isnan(v) || v > values[winner * dim + c]) winner = r;
        }
        const float want = values[winner * dim + c];
        ok = std::isnan(want) ? std::isnan(out[c]) : out[c] == want;
        for (int64_t r = 0; r < rows && ok; ++r) ok = d_table[r * dim + c] == (r == winner ? 1.f : 0.f);
      }
      EXPECT(ok, "max with NaN, type %d, bag {%d, %d, %d}: %s%s", static_cast<int>(type), order[0], order[1],
             order[2], s.message.c_str(), b.message.c_str());
    }
  }
}

void ErrorCases() {
  std::vector<float> table_buf(10 * 4, 1.f);
  const float sentinel = -12345.f;
  std::vector<float> out(2 * 4, sentinel);
  std::vector<int32_t> idx = {0, 1, 2, 10};
  pkm::Table table{table_buf.data(), pkm::ElemType::kFloat32, 10, 4};
  pkm::Bags bags;
  bags.indices = idx.data();
  bags.num_bags = 2;
  bags.bag_size = 2;
  auto s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("indices[3] = 10") != std::string::npos, "out of range message: %s", s.message.c_str());
  EXPECT(std::all_of(out.begin(), out.end(), [&](float v) { return v == sentinel; }), "forward wrote on error");
  std::vector<float> grad(2 * 4, 1.f), d_table(10 * 4, sentinel);
  s = pkm::Backward(table, bags, pkm::Combiner::kSum, grad.data(), pkm::ElemType::kFloat32, d_table.data(),
                    pkm::ElemType::kFloat32, nullptr, pkm::SerialFor());
  EXPECT(!s.ok && std::all_of(d_table.begin(), d_table.end(), [&](float v) { return v == sentinel; }),
         "backward must fail before writing: %s", s.message.c_str());

  std::vector<int64_t> bad_splits = {0, 3, 2};
  bags.row_splits = bad_splits.data();
  bags.row_splits_int64 = true;
  idx[3] = 1;
  s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("num_values") != std::string::npos, "ragged without num_values: %s", s.message.c_str());
  bags.num_values = 2;
  s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("non-decreasing") != std::string::npos, "splits message: %s", s.message.c_str());
  std::vector<int64_t> nonzero_start = {1, 2, 2};
  bags.row_splits = nonzero_start.data();
  s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("row_splits[0] must be 0") != std::string::npos, "splits start: %s", s.message.c_str());
  std::vector<int64_t> short_splits = {0, 2, 4};
  bags.row_splits = short_splits.data();
  bags.num_values = 3;
  s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("must equal the number of values") != std::string::npos, "nnz message: %s", s.message.c_str());

  // Index policies: the same bags under each, first offending position wins.
  std::vector<int32_t> mixed = {3, -1, 12, 0};  // -1 at [1], 12 (>= 10) at [2]
  pkm::Bags policy_bags;
  policy_bags.indices = mixed.data();
  policy_bags.num_bags = 2;
  policy_bags.bag_size = 2;
  s = pkm::ValidateBags(table, policy_bags, TwoThreads());
  EXPECT(!s.ok && s.message == "indices[2] = 12 is out of range [0, 10) (negative indices are padding)",
         "negative-is-padding message: %s", s.message.c_str());
  policy_bags.index_policy = pkm::IndexPolicy::kNoPadding;
  s = pkm::ValidateBags(table, policy_bags, TwoThreads());
  EXPECT(!s.ok && s.message == "indices[1] = -1 is out of range [0, 10) (stock GATHER allows no padding)",
         "no-padding message: %s", s.message.c_str());
  mixed[1] = 4;
  mixed[2] = 9;
  s = pkm::Forward(table, policy_bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(s.ok && out[0] == 2.f && out[4] == 2.f, "no-padding forward of valid indices: %s", s.message.c_str());
  mixed[2] = 10;
  policy_bags.index_policy = pkm::IndexPolicy::kOutOfRangeIsPadding;
  s = pkm::ValidateBags(table, policy_bags, TwoThreads());
  EXPECT(s.ok, "out-of-range-is-padding checks only the layout: %s", s.message.c_str());
  std::fill(out.begin(), out.end(), sentinel);
  s = pkm::Forward(table, policy_bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("GPU") != std::string::npos &&
             std::all_of(out.begin(), out.end(), [&](float v) { return v == sentinel; }),
         "CPU forward must refuse the GPU policy: %s", s.message.c_str());
  policy_bags.index_policy = static_cast<pkm::IndexPolicy>(7);
  s = pkm::ValidateBags(table, policy_bags, TwoThreads());
  EXPECT(!s.ok && s.message.find("unknown index policy 7") != std::string::npos, "bad policy: %s", s.message.c_str());

  pkm::Combiner c;
  EXPECT(!pkm::ParseCombiner("min", &c) && pkm::ParseCombiner("sqrtn", &c) && c == pkm::Combiner::kSqrtn &&
             pkm::ParseCombiner("max", &c) && c == pkm::Combiner::kMax && std::string(pkm::CombinerName(c)) == "max",
         "combiner parse");
  MaxCases();
  MaxNaNCases();

  std::vector<int8_t> q(40, 1);
  pkm::Table qt{q.data(), pkm::ElemType::kInt8, 10, 4};
  pkm::Bags ok_bags;
  ok_bags.indices = idx.data();
  ok_bags.num_bags = 2;
  ok_bags.bag_size = 2;
  s = pkm::Forward(qt, ok_bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("scales") != std::string::npos, "int8 without scales: %s", s.message.c_str());
  std::vector<float> q_scales(10, 0.5f);
  qt.row_scales = q_scales.data();
  qt.row_params_type = pkm::ElemType::kBFloat16;
  s = pkm::Forward(qt, ok_bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("float32 or float16") != std::string::npos, "int8 bf16 scales: %s", s.message.c_str());
  qt.row_params_type = pkm::ElemType::kFloat32;
  std::vector<float> grad8(2 * 4, 1.f), d8(40);
  s = pkm::Backward(qt, ok_bags, pkm::Combiner::kSum, grad8.data(), pkm::ElemType::kFloat32, d8.data(),
                    pkm::ElemType::kFloat32, nullptr, pkm::SerialFor());
  EXPECT(!s.ok && s.message.find("no gradient for int8") != std::string::npos, "int8 gradient: %s", s.message.c_str());
  // The C descriptor carries the int8 rows: FromBagProblem(ToBagProblem(x)) == x.
  std::vector<float> q_biases(10, -0.25f);
  qt.row_biases = q_biases.data();
  PkmBags problem = pkm::ToBagProblem(qt, ok_bags, pkm::Combiner::kSum);
  pkm::Table back;
  pkm::Bags back_bags;
  pkm::Combiner back_c;
  s = pkm::FromBagProblem(problem, &back, &back_bags, &back_c);
  EXPECT(s.ok && back.type == pkm::ElemType::kInt8 && back.row_scales == q_scales.data() &&
             back.row_biases == q_biases.data() && back.row_params_type == pkm::ElemType::kFloat32,
         "int8 descriptor round trip: %s", s.message.c_str());
  s = pkm::Forward(back, back_bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pkm::SerialFor());
  // Row value 0.5 * 1 - 0.25 = 0.25, two rows per bag.
  EXPECT(s.ok && out[0] == 0.5f && out[7] == 0.5f, "int8 forward through the descriptor: %s %f", s.message.c_str(), out[0]);
  problem.row_scales = nullptr;
  s = pkm::FromBagProblem(problem, &back, &back_bags, &back_c);
  EXPECT(!s.ok && s.message.find("row_scales") != std::string::npos, "descriptor int8 without scales: %s", s.message.c_str());
}

void HalfConversions() {
  // Every half bit pattern survives half -> float -> half.
  int bad = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = pkm::HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    if (pkm::FloatToHalf(f) != h) ++bad;
  }
  EXPECT(bad == 0, "%d half patterns did not round-trip", bad);
#if defined(PKM_HAS_COMPILER_HALF)
  // Against the compiler's own IEEE binary16 conversions, on every half value
  // and on floats between them (round-to-nearest-even ties included).
  int mismatches = 0;
  std::mt19937 rng(5);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    pkm::vec::CompilerHalf x;
    const uint16_t bits = static_cast<uint16_t>(h);
    std::memcpy(&x, &bits, 2);
    const float f = static_cast<float>(x);
    if (std::isnan(f)) continue;
    if (pkm::HalfToFloat(bits) != f) ++mismatches;
    const float between = f * (1.f + (rng() % 2048) / 4096.f / 1024.f);
    const pkm::vec::CompilerHalf rounded = static_cast<pkm::vec::CompilerHalf>(between);
    uint16_t expected;
    std::memcpy(&expected, &rounded, 2);
    if (pkm::FloatToHalf(between) != expected) ++mismatches;
  }
  EXPECT(mismatches == 0, "%d conversions differ from _Float16", mismatches);
#endif
  EXPECT(pkm::FloatToHalf(65520.f) == 0x7c00 && pkm::FloatToHalf(65519.f) == 0x7bff, "half overflow rounding");
  EXPECT(pkm::FloatToBFloat16(1.00390625f) == 0x3f80, "bf16 ties to even");  // 1 + 2^-8 -> 1.0
  EXPECT(pkm::FloatToBFloat16(1.01171875f) == 0x3f82, "bf16 tie rounds to even upward");  // 1 + 3*2^-8
  EXPECT(pkm::BFloat16ToFloat(0x3f81) == 1.0078125f, "bf16 to float");
}


// vec::FromAcc against its definition (RestoreAccOrder, then FromFloat), bit
// for bit, on accumulators of arbitrary bits: rounding ties, overflow to inf,
// NaNs (quiet and signalling), denormals; widths with and without a tail of
// fewer than 16 columns. On AVX2 hosts without AVX-512 this is the fused
// bfloat16 pass (ScaleBF16PairsToBF16); on AVX-512 BF16 hosts, the rounding
// instruction's (which flushes denormals: the blocks holding one must take the
// integer path). FromFloat's bfloat16 output is also checked against the
// scalar FloatToBFloat16.
void FromAccMatchesDefinition() {
  std::mt19937_64 rng(99);
  const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u,
                              0xff800000u, 0x7fc00001u, 0x7f800001u, 0xffbfffffu, 0x00000001u, 0x80008000u,
                              0x00000000u, 0x80000000u, 0x007fffffu, 0x3effffffu};
  int mismatches = 0, cases = 0;
  for (int64_t n : {16, 17, 31, 32, 48, 64, 100, 512, 1000}) {
    for (float scale : {1.f, 0.37f, -3.5f, 1e-30f}) {
      for (pkm::ElemType out_type : {pkm::ElemType::kBFloat16, pkm::ElemType::kFloat32}) {
        std::vector<float> acc(n), copy;
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t bits = i < 16 ? special[(i + n) % 16] : static_cast<uint32_t>(rng());
          std::memcpy(&acc[i], &bits, 4);
        }
        copy = acc;
        const size_t out_bytes = n * (out_type == pkm::ElemType::kFloat32 ? 4 : 2);
        std::vector<char> got(out_bytes), want(out_bytes);
        pkm::vec::FromAcc(pkm::ElemType::kBFloat16, acc.data(), scale, out_type, got.data(), n);
        pkm::vec::RestoreAccOrder(pkm::ElemType::kBFloat16, copy.data(), n);
        pkm::vec::FromFloat(copy.data(), scale, out_type, want.data(), n);
        ++cases;
        if (std::memcmp(got.data(), want.data(), out_bytes) != 0) ++mismatches;
        if (out_type == pkm::ElemType::kBFloat16) {  // both against the scalar rounding, element by element
          std::vector<uint16_t> scalar(n);
          for (int64_t i = 0; i < n; ++i) scalar[i] = pkm::FloatToBFloat16(scale * copy[i]);
          ++cases;
          if (std::memcmp(want.data(), scalar.data(), out_bytes) != 0) ++mismatches;
        }
      }
    }
  }
  EXPECT(mismatches == 0, "FromAcc differs from RestoreAccOrder + FromFloat in %d of %d cases", mismatches, cases);
}

// vec::SumBag, the forward's whole-bag kernel, against a float64 sum of the
// same rows at each width of its last column block (none, 1-15 vectors of
// 16), and for bfloat16 bitwise against the group and row kernels summing
// the same rows into a zeroed acc (the same fma chain per column). Where it
// has no kernel (no AVX-512; rows not whole 64-byte lines or over 512 columns) it
// must return false and leave acc alone.
void SumBagCases() {
  using pkm::ElemType;
#if defined(PKM_X86_F16C)
  const bool avx512 = pkm::vec::f16c::HasAvx512();
#else
  const bool avx512 = false;
#endif
  std::mt19937_64 rng(123);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (ElemType type : {ElemType::kFloat32, ElemType::kFloat16, ElemType::kBFloat16}) {
    for (int64_t n : {16, 32, 100, 224, 256, 288, 480, 512, 544, 1024}) {
      const int64_t count = 77, row_bytes = n * pkm::ElemSize(type);
      const auto data = RandomBuffer(rng, type, count * n);
      std::vector<float> a(count);
      for (auto& v : a) v = u(rng);
      std::vector<const char*> rows(count), ahead(count);
      for (int64_t k = 0; k < count; ++k) rows[k] = reinterpret_cast<const char*>(data.data()) + k * row_bytes;
      for (int64_t k = 0; k < count; ++k) ahead[k] = rows[(k + 5) % count];
      std::vector<float> got(n, 12345.f);
      const bool ran = pkm::vec::SumBag(type, a.data(), rows.data(), ahead.data(), count, got.data(), n);
      const bool eligible = avx512 && row_bytes % 64 == 0 && n <= 512;
      EXPECT(ran == eligible, "SumBag type=%d n=%lld ran=%d, expected %d", int(type), static_cast<long long>(n),
             int(ran), int(eligible));
      if (!ran) {
        EXPECT(std::all_of(got.begin(), got.end(), [](float v) { return v == 12345.f; }),
               "SumBag type=%d n=%lld wrote acc without a kernel", int(type), static_cast<long long>(n));
        continue;
      }
      pkm::vec::RestoreAccOrder(type, got.data(), n);
      int64_t bad = -1;
      for (int64_t i = 0; i < n && bad < 0; ++i) {
        double sum = 0, magnitude = 0;
        for (int64_t k = 0; k < count; ++k) {
          const double term = static_cast<double>(a[k]) * Load(data, type, k * n + i);
          sum += term;
          magnitude += std::fabs(term);
        }
        // A float32 chain of `count` roundings: at most about count * 2^-24 of the terms' magnitude.
        if (!(std::fabs(got[i] - sum) <= count * 1.2e-7 * magnitude + 1e-30)) bad = i;
      }
      EXPECT(bad < 0, "SumBag type=%d n=%lld: column %lld off the float64 sum", int(type),
             static_cast<long long>(n), static_cast<long long>(bad));
      if (type != ElemType::kBFloat16) continue;
      std::vector<float> want(n, 0.f);
      int64_t k = 0;
      for (; k + pkm::vec::kRowGroup <= count; k += pkm::vec::kRowGroup)
        pkm::vec::AxpyGroup(type, a.data() + k, rows.data() + k, ahead.data() + k, want.data(), n);
      for (; k < count; ++k) pkm::vec::AxpyRow(type, a[k], rows[k], ahead[k], want.data(), n);
      pkm::vec::RestoreAccOrder(type, want.data(), n);
      EXPECT(std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0,
             "SumBag bfloat16 n=%lld differs from the group kernels' sums", static_cast<long long>(n));
    }
  }
}

// vec::SingleRowBag, a bag of one entry straight into a bfloat16 output row,
// bit for bit against AssignRow then FromAcc (the path it replaces) on rows
// of arbitrary bits: NaNs, infinities, denormal inputs and products that round
// to denormals (the blocks the rounding instruction cannot take). Where it has
// no kernel it must return false and leave the output alone.
void SingleRowCases() {
  using pkm::ElemType;
#if defined(PKM_X86_F16C)
  const bool bf16_kernel = pkm::vec::f16c::HasAvx512Bf16();
#else
  const bool bf16_kernel = false;
#endif
  std::mt19937_64 rng(321);
  const uint16_t special[] = {0x0001, 0x0080, 0x7f80, 0xff80, 0x7fc1, 0x7f81, 0x3f80, 0x8000,
                              0x0000, 0x00ff, 0x3f81, 0x4049, 0xc2f7, 0x7f7f, 0x0100, 0x3c00};
  int mismatches = 0, cases = 0;
  for (ElemType type : {ElemType::kBFloat16, ElemType::kFloat32}) {
    for (ElemType out_type : {ElemType::kBFloat16, ElemType::kFloat32}) {
      for (int64_t n : {16, 32, 48, 64, 100, 512, 1024}) {
        const int64_t row_bytes = n * pkm::ElemSize(type);
        std::vector<char> row(row_bytes);
        for (int64_t i = 0; i < row_bytes / 2; ++i) {
          const uint16_t bits = i < 16 ? special[(i + n) % 16] : static_cast<uint16_t>(rng());
          std::memcpy(row.data() + 2 * i, &bits, 2);
        }
        for (float a : {1.f, -0.7f, 3e-37f}) {
          for (float scale : {1.f, 0.37f, -3.5f, 1e-30f}) {
            const size_t out_bytes = n * pkm::ElemSize(out_type);
            std::vector<char> got(out_bytes, 'x'), want(out_bytes);
            const bool ran = pkm::vec::SingleRowBag(type, a, scale, row.data(), row.data(), out_type, got.data(), n);
            const bool eligible =
                bf16_kernel && type == ElemType::kBFloat16 && out_type == ElemType::kBFloat16 && n % 32 == 0;
            EXPECT(ran == eligible, "SingleRowBag type=%d out=%d n=%lld ran=%d, expected %d", int(type),
                   int(out_type), static_cast<long long>(n), int(ran), int(eligible));
            ++cases;
            if (!ran) {
              if (std::any_of(got.begin(), got.end(), [](char c) { return c != 'x'; })) ++mismatches;
              continue;
            }
            std::vector<float> acc(n);
            EXPECT(pkm::vec::AssignRow(type, a, row.data(), row.data(), acc.data(), n), "AssignRow bfloat16");
            pkm::vec::FromAcc(type, acc.data(), scale, out_type, want.data(), n);
            if (std::memcmp(got.data(), want.data(), out_bytes) != 0) ++mismatches;
          }
        }
      }
    }
  }
  EXPECT(mismatches == 0, "SingleRowBag differs from AssignRow + FromAcc (or wrote without a kernel) in %d of %d "
         "cases", mismatches, cases);
}

// A table over the huge-page threshold (8 MB): the forward asks Linux to
// collapse it to 2 MB pages (table_pages.h) before reading it. The table's
// contents and the results must be those of the reference, on the first call
// (collapse tried) and the second (range remembered).
void LargeTable() {
  const int64_t n = 8192, d = 512, b = 64, k = 16;
  const size_t bytes = static_cast<size_t>(n * d) * sizeof(float);
  float* data = static_cast<float*>(std::aligned_alloc(size_t{2} << 20, bytes + (size_t{4} << 20)));
  float* table_data = data + 1024 + 3;  // not 2 MB aligned: only the interior can be collapsed
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int64_t i = 0; i < n * d; ++i) table_data[i] = u(rng);
  const std::vector<float> copy(table_data, table_data + n * d);
  std::vector<int64_t> idx(b * k);
  for (auto& v : idx) v = static_cast<int64_t>(rng() % n);
  pkm::Table table{table_data, pkm::ElemType::kFloat32, n, d};
  pkm::Bags bags;
  bags.indices = idx.data();
  bags.indices_int64 = true;
  bags.num_bags = b;
  bags.bag_size = k;
  std::vector<uint8_t> out(b * d * 4), ref(b * d * 4);
  pkm::Status s = pkm::ReferenceForward(table, bags, pkm::Combiner::kSum, ref.data(), pkm::ElemType::kFloat32);
  for (int call = 0; call < 2; ++call) {
    pkm::Status f = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, TwoThreads());
    std::string where;
    EXPECT(s.ok && f.ok && Close(out, ref, pkm::ElemType::kFloat32, b * d, 1e-5, &where),
           "large table forward (call %d): %s %s", call, f.message.c_str(), where.c_str());
  }
  EXPECT(std::memcmp(copy.data(), table_data, bytes) == 0, "the huge-page advice changed the table");
  std::free(data);
}

#if defined(__linux__)
// AnonHugePages (kB) of the mapping that holds address p, from /proc/self/smaps; -1 if not found.
long AnonHugeKbAt(const void* p) {
  std::FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return -1;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  char line[512];
  bool inside = false;
  long kb = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long lo, hi;
    if (std::sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && std::strchr(line, '-') < std::strchr(line, ' ')) {
      inside = a >= lo && a < hi;
    } else if (inside && std::sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) {
      break;
    }
  }
  std::fclose(f);
  return kb;
}

// A table freed and another mapped over the same addresses (fresh 4 KB pages)
// is collapsed again once a second has passed since its range was last asked
// (table_pages.h), as a model version swap's new table can land where an old
// one was. Skipped unless the first ask collapses the whole range and fresh
// pages are 4 KB (not so before Linux 6.1, under qemu-user, with THP
// "always", or where memory is too fragmented for 2 MB pages).
void HugePagesAfterReuse() {
  const size_t bytes = size_t{16} << 20, huge = size_t{2} << 20;
  void* region = mmap(nullptr, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED) return;
  char* table = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(region) + huge - 1) & ~(huge - 1));
  const auto start = std::chrono::steady_clock::now();
  std::memset(table, 1, bytes);
  const long before_first = AnonHugeKbAt(table);
  pkm::internal::AdviseTableHugePagesAt(table, bytes, start);
  const long after_first = AnonHugeKbAt(table);
  const long full = static_cast<long>(bytes >> 10);
  if (before_first != 0 || after_first != full) {
    std::printf("huge pages after reuse: skipped (first ask: %ld -> %ld kB of %ld)\n", before_first, after_first,
                full);
    munmap(region, bytes + huge);
    return;
  }
  // The same addresses again, on fresh pages.
  munmap(table, bytes);
  void* again = mmap(table, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (again != table) {
    EXPECT(false, "remapping the table's range failed");
    munmap(region, bytes + huge);
    return;
  }
  std::memset(table, 2, bytes);
  const long fresh = AnonHugeKbAt(table);
  pkm::internal::AdviseTableHugePagesAt(table, bytes, start + std::chrono::milliseconds(100));
  const long within_second = AnonHugeKbAt(table);
  pkm::internal::AdviseTableHugePagesAt(table, bytes, start + std::chrono::seconds(2));
  const long retried = AnonHugeKbAt(table);
  if (fresh != 0) {
    std::printf("huge pages after reuse: skipped (fresh pages already huge: %ld kB)\n", fresh);
  } else {
    EXPECT(within_second == 0, "asked again within a second: %ld kB of huge pages", within_second);
    EXPECT(retried > 0, "a reused range was not collapsed again: %ld kB of huge pages", retried);
  }
  bool same = true;
  for (size_t i = 0; i < bytes; i += 4096) same = same && table[i] == 2;
  EXPECT(same, "collapsing changed the table's contents");
  munmap(region, bytes + huge);
}
#else
void HugePagesAfterReuse() {}
#endif

// float32 table gradients of 64 MB or more go through a scratch row and
// non-temporal stores (backward.cc): both row groupings (every row a group,
// and the comparison sort of a table much larger than its indices, whose
// untouched rows are zeroed by a pass of their own), a d_table that starts
// off a 16-byte boundary and rows of a width that is no multiple of four.
// d_table starts full of 3.4e38 (0x7F bytes); every value must be the reference's.
void StreamedGradientCases() {
  struct Shape { int64_t rows, dim, float_offset; };
  // 576 valid-or-padding entries: the counting sort up to 4 * 576 + 2^20 rows, the comparison sort
  // (and its zero pass) well above.
  const Shape shapes[] = {{32768, 512, 0}, {32768, 513, 1}, {int64_t{1} << 21, 9, 1}};
  // Without streaming stores (aarch64, run under emulation) these are the plain path, which the
  // random cases cover at a fraction of the size.
  if (!pkm::vec::kHasStreamingStores) return;
  std::mt19937_64 rng(99);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (const Shape& sh : shapes) {
    const int64_t b = 48, k = 12;
    std::vector<float> table_data(sh.rows * sh.dim), grad(b * sh.dim), w(b * k);
    for (auto& v : table_data) v = u(rng);
    for (auto& v : grad) v = u(rng);
    for (auto& v : w) v = u(rng);
    std::vector<int32_t> idx(b * k);
    for (auto& v : idx) v = rng() % 10 == 0 ? -1 : static_cast<int32_t>(rng() % sh.rows);
    pkm::Table table{table_data.data(), pkm::ElemType::kFloat32, sh.rows, sh.dim};
    pkm::Bags bags;
    bags.indices = idx.data();
    bags.num_bags = b;
    bags.bag_size = k;
    bags.weights = w.data();
    const int64_t n = sh.rows * sh.dim;
    std::vector<uint8_t> fast_buf((n + sh.float_offset) * 4, 0x7F), ref(n * 4), dw(b * k * 4), dw_ref(b * k * 4);
    uint8_t* fast = fast_buf.data() + 4 * sh.float_offset;
    pkm::Status s1 = pkm::Backward(table, bags, pkm::Combiner::kSum, grad.data(), pkm::ElemType::kFloat32, fast,
                                   pkm::ElemType::kFloat32, dw.data(), TwoThreads());
    pkm::Status s2 = pkm::ReferenceBackward(table, bags, pkm::Combiner::kSum, grad.data(), pkm::ElemType::kFloat32,
                                            ref.data(), pkm::ElemType::kFloat32, dw_ref.data());
    const std::vector<uint8_t> got(fast, fast + n * 4);
    std::string where;
    EXPECT(s1.ok && s2.ok && Close(got, ref, pkm::ElemType::kFloat32, n, 1e-5f, &where),
           "streamed d_table rows=%lld dim=%lld: %s %s", static_cast<long long>(sh.rows),
           static_cast<long long>(sh.dim), s1.message.c_str(), where.c_str());
    EXPECT(Close(dw, dw_ref, pkm::ElemType::kFloat32, b * k, 4e-5f, &where), "streamed d_weights dim=%lld: %s",
           static_cast<long long>(sh.dim), where.c_str());
  }
}

}  // namespace

// Bags longer than the forward's window of collected entries (bag_window.h,
// 256), a window ending mid-way through many short bags, padding, dims around
// the bf16 kernels' 16-column blocks and the short-row widths (short_rows.h:
// multiples of 8 up to 64, and of 16 up to 128 on AVX-512, whose prefetch
// reads 16 entries ahead across bag ends), every weighted combiner, for every table type (fp32 tolerance 1e-4:
// sums of up to 700 signed terms in float32).
void WindowCases() {
  using pkm::ElemType;
  std::mt19937_64 rng(77);
  for (ElemType type : {ElemType::kFloat32, ElemType::kFloat16, ElemType::kBFloat16, ElemType::kInt8}) {
    for (int64_t dim : {1, 8, 15, 16, 24, 33, 48, 64, 72, 80, 96, 112, 120, 128, 144, 256, 288, 512}) {
      const int64_t num_rows = 997;
      std::vector<int64_t> sizes = {700, 1, 0, 300};
      for (int b = 0; b < 200; ++b) sizes.push_back(rng() % 5);
      for (int b = 0; b < 40; ++b) sizes.push_back(5 + rng() % 60);  // the whole-bag kernel's smaller bags
      std::vector<int64_t> splits(1, 0);
      for (int64_t n : sizes) splits.push_back(splits.back() + n);
      std::vector<int64_t> idx(splits.back());
      for (auto& v : idx) v = rng() % 9 == 0 ? -1 : static_cast<int64_t>(rng() % num_rows);
      const ElemType value_type = type == ElemType::kInt8 ? ElemType::kFloat32 : type;
      auto table_buf = RandomBuffer(rng, type, num_rows * dim);
      auto weights = RandomBuffer(rng, value_type, static_cast<int64_t>(idx.size()));
      std::vector<float> scales(num_rows, 0.02f), biases(num_rows, -0.1f);
      pkm::Table table{table_buf.data(), type, num_rows, dim};
      if (type == ElemType::kInt8) {
        table.row_scales = scales.data();
        table.row_biases = biases.data();
      }
      pkm::Bags bags = RaggedBags(idx, splits, weights, value_type);
      const int64_t n_out = bags.num_bags * dim;
      const std::vector<int32_t> idx32(idx.begin(), idx.end());
      for (pkm::Combiner combiner : {pkm::Combiner::kSum, pkm::Combiner::kMean, pkm::Combiner::kSqrtn}) {
        for (bool int64 : {true, false}) {
          bags.indices = int64 ? static_cast<const void*>(idx.data()) : idx32.data();
          bags.indices_int64 = int64;
          std::vector<uint8_t> fast(n_out * pkm::ElemSize(value_type)), ref(fast.size());
          auto s1 = pkm::Forward(table, bags, combiner, fast.data(), value_type, TwoThreads());
          auto s2 = pkm::ReferenceForward(table, bags, combiner, ref.data(), value_type);
          std::string where;
          EXPECT(s1.ok && s2.ok &&
                     Close(fast, ref, value_type, n_out, value_type == ElemType::kFloat32 ? 1e-4f : 2e-2f, &where),
                 "window case type=%d dim=%lld combiner=%d int64=%d: %s %s %s", int(type),
                 static_cast<long long>(dim), int(combiner), int(int64), s1.message.c_str(), s2.message.c_str(),
                 where.c_str());
        }
      }
    }
  }
}

// One thread runs every block (in several blocks a call) of a sequence of
// forwards whose shapes grow and shrink, so each reuses the accumulator row
// and windows the previous ones left on the thread (bag_window.h,
// BlockScratch): a 6000-entry bag and 70000-column rows grow them past what
// Release keeps; every output against the reference.
void ScratchReuseCases() {
  using pkm::ElemType;
  std::mt19937_64 rng(45);
  const pkm::ParallelFor blocks_on_this_thread = [](int64_t total, int64_t, const pkm::RangeFn& fn) {
    const int64_t size = std::max<int64_t>(1, total / 5);
    for (int64_t b = 0; b < total; b += size) fn(b, std::min(total, b + size));
  };
  struct Shape { ElemType type; int64_t dim; int64_t long_bag; };
  const Shape shapes[] = {{ElemType::kFloat32, 520, 0},  {ElemType::kInt8, 200, 0},     {ElemType::kBFloat16, 520, 6000},
                          {ElemType::kFloat32, 24, 0},   {ElemType::kInt8, 200, 6000},  {ElemType::kFloat32, 70000, 3},
                          {ElemType::kBFloat16, 300, 0}, {ElemType::kFloat16, 1040, 0}, {ElemType::kInt8, 40, 0}};
  for (const Shape& shape : shapes) {
    const int64_t num_rows = 97;
    std::vector<int64_t> sizes = {shape.long_bag, 0, 9, 1};
    for (int b = 0; b < 60; ++b) sizes.push_back(rng() % 20);
    std::vector<int64_t> splits(1, 0);
    for (int64_t n : sizes) splits.push_back(splits.back() + n);
    std::vector<int64_t> idx(splits.back());
    for (auto& v : idx) v = rng() % 11 == 0 ? -1 : static_cast<int64_t>(rng() % num_rows);
    const ElemType value_type = shape.type == ElemType::kInt8 ? ElemType::kFloat32 : shape.type;
    auto table_buf = RandomBuffer(rng, shape.type, num_rows * shape.dim);
    auto weights = RandomBuffer(rng, value_type, static_cast<int64_t>(idx.size()));
    std::vector<float> scales(num_rows, 0.03f);
    pkm::Table table{table_buf.data(), shape.type, num_rows, shape.dim};
    if (shape.type == ElemType::kInt8) table.row_scales = scales.data();
    const pkm::Bags bags = RaggedBags(idx, splits, weights, value_type);
    const int64_t n_out = bags.num_bags * shape.dim;
    for (pkm::Combiner combiner : {pkm::Combiner::kSum, pkm::Combiner::kSqrtn}) {
      std::vector<uint8_t> fast(n_out * pkm::ElemSize(value_type)), ref(fast.size());
      auto s1 = pkm::Forward(table, bags, combiner, fast.data(), value_type, blocks_on_this_thread);
      auto s2 = pkm::ReferenceForward(table, bags, combiner, ref.data(), value_type);
      std::string where;
      EXPECT(s1.ok && s2.ok &&
                 Close(fast, ref, value_type, n_out, value_type == ElemType::kFloat32 ? 1e-4f : 2e-2f, &where),
             "scratch reuse type=%d dim=%lld long bag=%lld combiner=%d: %s %s %s", int(shape.type),
             static_cast<long long>(shape.dim), static_cast<long long>(shape.long_bag), int(combiner),
             s1.message.c_str(), s2.message.c_str(), where.c_str());
    }
  }
}

// Weights of every float type (and none) on float32, bfloat16 and float16 tables, at
// the short-row widths and one general width: the forward picks its weight
// loader once per block of bags (short_rows.cc), so each type is its own code.
void WeightTypeCases() {
  using pkm::ElemType;
  std::mt19937_64 rng(31);
  int cases = 0, failures = 0;
  for (ElemType type : {ElemType::kFloat32, ElemType::kBFloat16, ElemType::kFloat16}) {
    for (int64_t dim : {8, 16, 32, 48, 64, 96, 128, 512}) {
      const int64_t num_rows = 500, num_bags = 37, bag_size = 40;
      std::vector<int64_t> idx(num_bags * bag_size);
      for (auto& v : idx) v = rng() % 11 == 0 ? -1 : static_cast<int64_t>(rng() % num_rows);
      auto table_buf = RandomBuffer(rng, type, num_rows * dim);
      pkm::Table table{table_buf.data(), type, num_rows, dim};
      for (int wt = 0; wt < 4; ++wt) {
        const ElemType weight_type = wt == 3 ? ElemType::kFloat32 : static_cast<ElemType>(wt);
        auto weights = RandomBuffer(rng, weight_type, static_cast<int64_t>(idx.size()));
        pkm::Bags bags;
        bags.indices = idx.data();
        bags.indices_int64 = true;
        bags.num_bags = num_bags;
        bags.bag_size = bag_size;
        bags.weights = wt == 3 ? nullptr : weights.data();
        bags.weights_type = weight_type;
        for (pkm::Combiner combiner : {pkm::Combiner::kSum, pkm::Combiner::kSqrtn}) {
          std::vector<uint8_t> fast(num_bags * dim * pkm::ElemSize(type)), ref(fast.size());
          auto s1 = pkm::Forward(table, bags, combiner, fast.data(), type, TwoThreads());
          auto s2 = pkm::ReferenceForward(table, bags, combiner, ref.data(), type);
          std::string where;
          ++cases;
          const float rtol = type == ElemType::kFloat32 ? 1e-4f : type == ElemType::kFloat16 ? 4e-3f : 2e-2f;
          if (!(s1.ok && s2.ok && Close(fast, ref, type, num_bags * dim, rtol, &where))) {
            ++failures;
            std::printf("weight type case type=%d dim=%lld weights=%d combiner=%d: %s %s %s\n", int(type),
                        static_cast<long long>(dim), wt, int(combiner), s1.message.c_str(), s2.message.c_str(),
                        where.c_str());
          }
        }
      }
    }
  }
  EXPECT(failures == 0, "weight type cases: %d of %d differ from the reference", failures, cases);
}

// The int8 forward's short rows (16-128 columns with AVX-512,
// forward_int8.cc) against the reference at each width they take: ragged
// bags of 0-20 entries (groups of eight and the rows after them) with
// padding, no / float32 / float16 / bfloat16 weights, float32 and float16 row
// parameters with and without biases, each weighted combiner, both index
// types, float32 and bfloat16 outputs.
void Int8ShortRowCases() {
  using pkm::ElemType;
  std::mt19937_64 rng(77);
  int cases = 0, failures = 0;
  for (int64_t dim = 16; dim <= 128; dim += 16) {
    const int64_t num_rows = 300, num_bags = 40;
    std::vector<int64_t> splits(num_bags + 1, 0);
    for (int64_t b = 0; b < num_bags; ++b) splits[b + 1] = splits[b] + static_cast<int64_t>(rng() % 21);
    const int64_t nnz = splits[num_bags];
    std::vector<int64_t> idx(nnz);
    for (auto& v : idx) v = rng() % 9 == 0 ? -1 : static_cast<int64_t>(rng() % num_rows);
    std::vector<int32_t> idx32(idx.begin(), idx.end());
    auto q = RandomBuffer(rng, ElemType::kInt8, num_rows * dim);
    std::vector<float> params(2 * num_rows);  // scales, then biases
    std::vector<uint16_t> params16(2 * num_rows);
    for (int64_t r = 0; r < num_rows; ++r) {
      params[r] = 0.01f + (rng() % 100) / 1000.f;
      params[num_rows + r] = (static_cast<float>(rng() % 200) - 100.f) / 256.f;
    }
    for (int64_t i = 0; i < 2 * num_rows; ++i) params16[i] = pkm::FloatToHalf(params[i]);
    for (int variant = 0; variant < 16; ++variant) {  // weights (4) x parameter type (2) x biases (2)
      const int wt = variant % 4;
      const bool half = variant / 4 % 2, biased = variant / 8;
      const ElemType weight_type = wt == 0 ? ElemType::kFloat32 : static_cast<ElemType>(wt - 1);
      // Positive weights: mean divides by their sum.
      std::vector<float> w(nnz);
      for (auto& v : w) v = 0.05f + (rng() % 1000) / 1000.f;
      std::vector<uint8_t> weights(nnz * pkm::ElemSize(weight_type));
      for (int64_t j = 0; j < nnz; ++j) {
        if (weight_type == ElemType::kFloat32) std::memcpy(weights.data() + 4 * j, &w[j], 4);
        const uint16_t h = weight_type == ElemType::kFloat16 ? pkm::FloatToHalf(w[j]) : pkm::FloatToBFloat16(w[j]);
        if (weight_type != ElemType::kFloat32) std::memcpy(weights.data() + 2 * j, &h, 2);
      }
      pkm::Table table{q.data(), ElemType::kInt8, num_rows, dim};
      table.row_params_type = half ? ElemType::kFloat16 : ElemType::kFloat32;
      table.row_scales = half ? static_cast<const void*>(params16.data()) : params.data();
      if (biased) table.row_biases = half ? static_cast<const void*>(params16.data() + num_rows) : params.data() + num_rows;
      for (const bool idx64 : {false, true}) {
        pkm::Bags bags;
        bags.indices = idx64 ? static_cast<const void*>(idx.data()) : idx32.data();
        bags.indices_int64 = idx64;
        bags.num_bags = num_bags;
        bags.row_splits = splits.data();
        bags.row_splits_int64 = true;
        bags.num_values = nnz;
        bags.weights = wt == 0 ? nullptr : weights.data();
        bags.weights_type = weight_type;
        for (pkm::Combiner combiner : {pkm::Combiner::kSum, pkm::Combiner::kMean, pkm::Combiner::kSqrtn}) {
          for (ElemType out_type : {ElemType::kFloat32, ElemType::kBFloat16}) {
            std::vector<uint8_t> fast(num_bags * dim * pkm::ElemSize(out_type), 0xAB), ref(fast.size());
            auto s1 = pkm::Forward(table, bags, combiner, fast.data(), out_type, TwoThreads());
            auto s2 = pkm::ReferenceForward(table, bags, combiner, ref.data(), out_type);
            std::string where;
            ++cases;
            if (!(s1.ok && s2.ok && Close(fast, ref, out_type, num_bags * dim,
                                          out_type == ElemType::kFloat32 ? 1e-5f : 1e-2f, &where))) {
              ++failures;
              std::printf("int8 short row case dim=%lld variant=%d idx64=%d combiner=%d out=%d: %s %s %s\n",
                          static_cast<long long>(dim), variant, int(idx64), int(combiner), int(out_type),
                          s1.message.c_str(), s2.message.c_str(), where.c_str());
            }
          }
        }
      }
    }
  }
  EXPECT(failures == 0, "int8 short row cases: %d of %d differ from the reference", failures, cases);
}

// ValidateBags against the definition: the first entry that is >= num_rows,
// or negative where negatives are not padding, across the check's chunks of
// 1024, both index types and policies, one and two threads; int32 indices of
// a table of over 2^31 rows have no bad non-negative value. Forward, which
// makes the checks block by block, reports the same entry.
template <typename Index>
void IndexCheckCasesOf(std::mt19937_64& rng, bool int64, int* cases, int* failures) {
  std::vector<float> row(4), forward_rows(1000 * 8, 0.5f);
  for (const int64_t num_rows : {int64_t{1}, int64_t{1000}, int64_t{3} << 30}) {
    pkm::Table table{row.data(), pkm::ElemType::kFloat32, num_rows, 4};
    for (const int64_t n : {1, 1023, 1024, 1025, 5000}) {
      for (const bool negative_is_padding : {true, false}) {
        for (int trial = 0; trial < 12; ++trial) {
          std::vector<Index> idx(n);
          const int64_t top = std::min<int64_t>(num_rows, std::numeric_limits<Index>::max());
          for (auto& v : idx) v = static_cast<Index>(rng() % top);
          // Up to two bad or padding entries at chunk edges or anywhere.
          const int64_t spots[] = {0, 1023, 1024, n - 1, static_cast<int64_t>(rng() % n)};
          const Index values[] = {static_cast<Index>(std::min<int64_t>(num_rows, std::numeric_limits<Index>::max())),
                                  Index{-1}, std::numeric_limits<Index>::min(), std::numeric_limits<Index>::max()};
          for (int k = 0; k < trial % 3; ++k) {
            const int64_t at = spots[rng() % 5];
            if (at < n) idx[at] = values[rng() % 4];
          }
          int64_t first = n;
          for (int64_t j = 0; j < n && first == n; ++j) {
            const int64_t v = idx[j];
            if (v >= num_rows || (v < 0 && !negative_is_padding)) first = j;
          }
          pkm::Bags bags;
          bags.indices = idx.data();
          bags.indices_int64 = int64;
          bags.num_bags = n;
          bags.bag_size = 1;
          bags.index_policy = negative_is_padding ? pkm::IndexPolicy::kNegativeIsPadding : pkm::IndexPolicy::kNoPadding;
          const std::string want = first == n ? "" : "indices[" + std::to_string(first) + "] = " +
                                                         std::to_string(static_cast<int64_t>(idx[first])) + " ";
          auto check = [&](const pkm::Status& s, const char* what) {
            ++*cases;
            if (first == n ? !s.ok : (s.ok || s.message.rfind(want, 0) != 0)) {
              ++*failures;
              std::printf("index check (%s) int64=%d rows=%lld n=%lld padding=%d: want '%s', got '%s'\n", what,
                          int64, static_cast<long long>(num_rows), static_cast<long long>(n), negative_is_padding,
                          want.c_str(), s.message.c_str());
            }
          };
          for (int threads = 1; threads <= 2; ++threads) {
            const pkm::ParallelFor pf = threads == 1 ? pkm::SerialFor() : TwoThreads();
            check(pkm::ValidateBags(table, bags, pf), "ValidateBags");
            // Forward checks each block of bags as it goes (internal::CheckedBagsFor):
            // the same first entry, through the short-row (dim 8), general (dim 4)
            // and max loops.
            if (num_rows > 1000) continue;
            for (const int64_t dim : {4, 8}) {
              const pkm::Table rows{forward_rows.data(), pkm::ElemType::kFloat32, num_rows, dim};
              std::vector<float> out(n * dim);
              check(pkm::Forward(rows, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pf),
                    dim == 4 ? "Forward, general loop" : "Forward, short rows");
            }
            const pkm::Table rows{forward_rows.data(), pkm::ElemType::kFloat32, num_rows, 4};
            std::vector<float> out(n * 4);
            check(pkm::Forward(rows, bags, pkm::Combiner::kMax, out.data(), pkm::ElemType::kFloat32, pf),
                  "Forward, max");
          }
        }
      }
    }
  }
}

// Forward's block-wise checks on ragged bags with empty ones, for float32
// (short rows) and int8 tables: the first invalid entry is named whichever
// block holds it, and valid bags still give the reference's output.
void RaggedForwardIndexErrors() {
  const int64_t num_rows = 20, dim = 16;
  const std::vector<int64_t> splits = {0, 3, 3, 5, 5, 9, 10};
  std::vector<float> rows(num_rows * dim, 0.25f), scales(num_rows, 0.5f);
  std::vector<int8_t> q(num_rows * dim, 3);
  for (const bool int8 : {false, true}) {
    pkm::Table table{int8 ? static_cast<const void*>(q.data()) : rows.data(),
                     int8 ? pkm::ElemType::kInt8 : pkm::ElemType::kFloat32, num_rows, dim};
    if (int8) table.row_scales = scales.data();
    for (const pkm::ParallelFor& pf : {pkm::SerialFor(), TwoThreads()}) {
      std::vector<int64_t> idx = {1, 2, 3, 4, 5, 6, 7, 25, 8, -1};
      pkm::Bags bags;
      bags.indices = idx.data();
      bags.indices_int64 = true;
      bags.num_bags = 6;
      bags.row_splits = splits.data();
      bags.row_splits_int64 = true;
      bags.num_values = 10;
      std::vector<float> out(6 * dim), ref(6 * dim);
      pkm::Status s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pf);
      EXPECT(!s.ok && s.message == "indices[7] = 25 is out of range [0, 20) (negative indices are padding)",
             "ragged forward error (int8=%d): %s", int8, s.message.c_str());
      idx[3] = 20;  // now an earlier bag holds the first invalid entry as well
      s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pf);
      EXPECT(!s.ok && s.message.rfind("indices[3] = 20 ", 0) == 0, "ragged forward error (int8=%d): %s", int8,
             s.message.c_str());
      idx[3] = 4;
      idx[7] = 9;
      s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, pf);
      pkm::Status r = pkm::ReferenceForward(table, bags, pkm::Combiner::kSum, ref.data(), pkm::ElemType::kFloat32);
      std::vector<uint8_t> out_bytes(reinterpret_cast<uint8_t*>(out.data()),
                                     reinterpret_cast<uint8_t*>(out.data()) + out.size() * 4);
      std::vector<uint8_t> ref_bytes(reinterpret_cast<uint8_t*>(ref.data()),
                                     reinterpret_cast<uint8_t*>(ref.data()) + ref.size() * 4);
      std::string where;
      EXPECT(s.ok && r.ok && Close(out_bytes, ref_bytes, pkm::ElemType::kFloat32, 6 * dim, 1e-5f, &where),
             "ragged forward (int8=%d): %s %s", int8, s.message.c_str(), where.c_str());
    }
  }
}

// The short rows check their block's indices as they prefetch (SumShortRows):
// one invalid entry at every position of a few hundred, with padding about
// and sometimes a second invalid entry after it, through each short-row loop
// (float32 narrow and 128-column rows, bfloat16 in pairs of columns and 8
// columns a vector, float16, int8), dense and ragged bags, blocks claimed in
// any order: the error names the first invalid entry; without one, the
// output is the reference's.
template <typename Index>
void ShortRowIndexCheckCasesOf(std::mt19937_64& rng, int* cases, int* failures) {
  const int64_t num_rows = 300, n = 400;
  struct Kind { pkm::ElemType type; int64_t dim; };
  const Kind kinds[] = {{pkm::ElemType::kFloat32, 8}, {pkm::ElemType::kFloat32, 64}, {pkm::ElemType::kFloat32, 128},
                        {pkm::ElemType::kBFloat16, 8}, {pkm::ElemType::kBFloat16, 64},
                        {pkm::ElemType::kFloat16, 32}, {pkm::ElemType::kInt8, 32}, {pkm::ElemType::kInt8, 128}};
  std::vector<float> row_scales(num_rows, 0.02f);
  // G blocks, run last first (the least recorded entry must win).
  auto blocks = [](int64_t g) {
    return pkm::ParallelFor([g](int64_t total, int64_t, const pkm::RangeFn& fn) {
      for (int64_t k = g - 1; k >= 0; --k) fn(total * k / g, total * (k + 1) / g);
    });
  };
  for (const Kind& kind : kinds) {
    const std::vector<uint8_t> data = RandomBuffer(rng, kind.type, num_rows * kind.dim);
    pkm::Table table{data.data(), kind.type, num_rows, kind.dim};
    if (kind.type == pkm::ElemType::kInt8) table.row_scales = row_scales.data();
    for (const int64_t bag_size : {1, 3, 7, 0}) {  // 0: ragged, bags of 0-9
      std::vector<int64_t> splits{0};
      while (bag_size == 0 && splits.back() < n) splits.push_back(std::min<int64_t>(n, splits.back() + rng() % 10));
      const int64_t num_bags = bag_size == 0 ? static_cast<int64_t>(splits.size()) - 1 : n / bag_size;
      const int64_t entries = bag_size == 0 ? n : num_bags * bag_size;
      for (const bool negative_is_padding : {true, false}) {
        for (int64_t bad_at = -1; bad_at < entries; ++bad_at) {
          std::vector<Index> idx(entries);
          for (auto& v : idx) v = static_cast<Index>(rng() % 20 == 0 && negative_is_padding ? -1 : rng() % num_rows);
          const Index bad_values[] = {static_cast<Index>(num_rows), std::numeric_limits<Index>::max(),
                                      negative_is_padding ? static_cast<Index>(num_rows + 1) : Index{-1},
                                      std::numeric_limits<Index>::min()};
          if (bad_at >= 0) {
            idx[bad_at] = bad_values[rng() % (negative_is_padding ? 3 : 4)];
            const int64_t second = bad_at + static_cast<int64_t>(rng() % 200);
            if (rng() % 2 && second < entries) idx[second] = static_cast<Index>(num_rows);
          }
          pkm::Bags bags;
          bags.indices = idx.data();
          bags.indices_int64 = sizeof(Index) == 8;
          bags.num_bags = num_bags;
          bags.bag_size = bag_size;
          if (bag_size == 0) {
            bags.row_splits = splits.data();
            bags.row_splits_int64 = true;
            bags.num_values = entries;
          }
          bags.index_policy = negative_is_padding ? pkm::IndexPolicy::kNegativeIsPadding : pkm::IndexPolicy::kNoPadding;
          const int64_t out_size = num_bags * kind.dim;
          std::vector<uint8_t> out(out_size * 4), ref(out_size * 4);
          const int64_t g = 1 + static_cast<int64_t>(rng() % 8);
          const pkm::Status s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32,
                                             blocks(g));
          ++*cases;
          std::string where;
          bool ok;
          if (bad_at >= 0) {
            const std::string want = "indices[" + std::to_string(bad_at) + "] = " +
                                     std::to_string(static_cast<int64_t>(idx[bad_at])) + " ";
            ok = !s.ok && s.message.rfind(want, 0) == 0;
            where = "want '" + want + "', got '" + s.message + "'";
          } else {
            const pkm::Status r = pkm::ReferenceForward(table, bags, pkm::Combiner::kSum, ref.data(),
                                                        pkm::ElemType::kFloat32);
            ok = s.ok && r.ok && Close(out, ref, pkm::ElemType::kFloat32, out_size, 1e-5f, &where);
            where += s.message;
          }
          if (!ok && ++*failures <= 10)
            std::printf("short-row index check: type %d dim %lld bag_size %lld padding %d blocks %lld int64 %d: %s\n",
                        static_cast<int>(kind.type), static_cast<long long>(kind.dim),
                        static_cast<long long>(bag_size), negative_is_padding, static_cast<long long>(g),
                        bags.indices_int64, where.c_str());
        }
      }
    }
  }
}

void IndexCheckCases() {
  std::mt19937_64 rng(99);
  int cases = 0, failures = 0;
  IndexCheckCasesOf<int32_t>(rng, false, &cases, &failures);
  IndexCheckCasesOf<int64_t>(rng, true, &cases, &failures);
  EXPECT(failures == 0, "index checks: %d of %d differ from the definition", failures, cases);
  cases = failures = 0;
  ShortRowIndexCheckCasesOf<int32_t>(rng, &cases, &failures);
  ShortRowIndexCheckCasesOf<int64_t>(rng, &cases, &failures);
  EXPECT(failures == 0, "short-row index checks: %d of %d differ from the definition or the reference", failures,
         cases);
}

int main() {
  std::mt19937_64 rng(1234);
  for (int i = 0; i < 400; ++i) RandomCase(rng, i);
  WindowCases();
  ScratchReuseCases();
  WeightTypeCases();
  Int8ShortRowCases();
  ErrorCases();
  IndexCheckCases();
  RaggedForwardIndexErrors();
  LargeTable();
  HugePagesAfterReuse();
  StreamedGradientCases();
  HalfConversions();
  FromAccMatchesDefinition();
  SumBagCases();
  SingleRowCases();
  std::printf("core tests: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
