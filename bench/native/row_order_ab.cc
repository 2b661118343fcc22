// Prototype of a forward in row order, against the core's gather, in one process (bench only, not
// shipped; issue #22's next lever, bench/results/cpu_roofline_notes.md "Round 13" and "Round 14"):
//   g++ -std=c++17 -O3 -I. bench/native/row_order_ab.cc build/core/*.o -o build/bench/row_order_ab -lpthread
//   build/bench/row_order_ab B K D N SLAB [shared]
// Where B*K indices repeat rows (B*K / N = 4 at the roofline's main shape), the gather reads each row
// once per entry; here the entries are counting-sorted by row, so a row's bytes come from memory once
// and in address order, and each entry adds into its bag's sums of one column slab (SLAB columns of
// every bag: L2-sized). Per thread a half of the bags with their own sort, or with `shared` one sort
// of all entries and the slabs split between the threads. float32 rows, sum; the slab loop is
// compiled for AVX-512, AVX2 and baseline x86-64 and picked by the CPU (rounds 13 and 14). Prints
// the best of 12 calls of each (2 threads each, std::thread per call on both sides) and the largest
// difference from the gather's output.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/core/embedding_bag.h"

namespace {

double NowMs() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One entry in row order: its row's offset in the table, its bag's offset in the slab sums, its weight.
struct Entry {
  int64_t row_offset;
  int32_t sums_offset;
  float weight;
};

// Entries [b0 * K, b1 * K) sorted by row (counting sort: a histogram over the N rows).
std::vector<Entry> SortByRow(const int32_t* idx, const float* w, int64_t N, int64_t D, int64_t K, int64_t b0,
                             int64_t b1, int64_t slab) {
  const int64_t n = (b1 - b0) * K;
  const int32_t* ib = idx + b0 * K;
  const float* wb = w + b0 * K;
  std::vector<int64_t> start(N + 1, 0);
  for (int64_t j = 0; j < n; ++j) ++start[ib[j] + 1];
  for (int64_t r = 0; r < N; ++r) start[r + 1] += start[r];
  std::vector<Entry> order(n);
  for (int64_t j = 0; j < n; ++j)
    order[start[ib[j]]++] = Entry{int64_t{ib[j]} * D, static_cast<int32_t>((j / K) * slab), wb[j]};
  return order;
}

// Slabs [s0, s1) of bags [b0, b0 + num_bags): each a pass over the sorted entries into L2-sized sums,
// prefetching the row and the sums of the entry 16 on.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void SumSlabs(
    const float* table, const std::vector<Entry>& order, int64_t D, int64_t b0, int64_t num_bags, int64_t slab,
    int64_t s0, int64_t s1, float* out) {
  constexpr int64_t kAhead = 16;
  std::vector<float> sums(num_bags * slab);
  const int64_t n = static_cast<int64_t>(order.size());
  for (int64_t c0 = s0 * slab; c0 < s1 * slab; c0 += slab) {
    std::fill(sums.begin(), sums.end(), 0.f);
    const float* base = table + c0;
    for (int64_t p = 0; p < n; ++p) {
      if (p + kAhead < n) {
        const char* row = reinterpret_cast<const char*>(base + order[p + kAhead].row_offset);
        const char* acc = reinterpret_cast<const char*>(sums.data() + order[p + kAhead].sums_offset);
        for (int64_t off = 0; off < slab * 4; off += 64) {
          __builtin_prefetch(row + off, 0, 3);
          __builtin_prefetch(acc + off, 0, 3);
        }
      }
      const Entry e = order[p];
      const float* __restrict row = base + e.row_offset;
      float* __restrict acc = sums.data() + e.sums_offset;
      for (int64_t i = 0; i < slab; ++i) acc[i] += e.weight * row[i];  // vectorised per clone at -O3
    }
    for (int64_t b = 0; b < num_bags; ++b)
      std::memcpy(out + (b0 + b) * D + c0, sums.data() + b * slab, slab * sizeof(float));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: row_order_ab B K D N SLAB [shared]\n");
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), K = std::atoll(argv[2]), D = std::atoll(argv[3]), N = std::atoll(argv[4]);
  const int64_t slab = std::atoll(argv[5]);
  const bool shared = argc > 6 && std::string(argv[6]) == "shared";
  if (B < 2 || K < 1 || N < 1 || slab < 16 || slab % 16 != 0 || D % (2 * slab) != 0) {
    std::fprintf(stderr, "row_order_ab: need B >= 2, SLAB a multiple of 16 and D a multiple of 2 * SLAB\n");
    return 2;
  }
  std::mt19937_64 rng(1);
  std::vector<float> table(N * D);
  for (auto& v : table) v = static_cast<float>(rng() % 1000) * 0.001f;
  std::vector<int32_t> idx(B * K);
  for (auto& v : idx) v = static_cast<int32_t>(rng() % N);
  std::vector<float> w(B * K), gathered(B * D), row_order(B * D);
  for (auto& v : w) v = static_cast<float>(rng() % 1000) * 0.001f;
  const pkm::Table t{table.data(), pkm::ElemType::kFloat32, N, D};
  pkm::Bags bags;
  bags.indices = idx.data();
  bags.num_bags = B;
  bags.bag_size = K;
  bags.weights = w.data();
  const pkm::ParallelFor two_threads = [](int64_t total, int64_t, const pkm::RangeFn& fn) {
    std::thread other([&] { fn(total / 2, total); });
    fn(0, total / 2);
    other.join();
  };
  double best_gather = 1e30, best_rows = 1e30;
  for (int call = 0; call < 12; ++call) {
    double t0 = NowMs();
    const pkm::Status s = pkm::Forward(t, bags, pkm::Combiner::kSum, gathered.data(), pkm::ElemType::kFloat32,
                                       two_threads);
    best_gather = std::min(best_gather, NowMs() - t0);
    if (!s.ok) {
      std::fprintf(stderr, "%s\n", s.message.c_str());
      return 1;
    }
    t0 = NowMs();
    const int64_t slabs = D / slab;
    if (shared) {
      const std::vector<Entry> order = SortByRow(idx.data(), w.data(), N, D, K, 0, B, slab);
      std::thread other([&] { SumSlabs(table.data(), order, D, 0, B, slab, slabs / 2, slabs, row_order.data()); });
      SumSlabs(table.data(), order, D, 0, B, slab, 0, slabs / 2, row_order.data());
      other.join();
    } else {
      auto half = [&](int64_t b0, int64_t b1) {
        const std::vector<Entry> order = SortByRow(idx.data(), w.data(), N, D, K, b0, b1, slab);
        SumSlabs(table.data(), order, D, b0, b1 - b0, slab, 0, slabs, row_order.data());
      };
      std::thread other([&] { half(B / 2, B); });
      half(0, B / 2);
      other.join();
    }
    best_rows = std::min(best_rows, NowMs() - t0);
  }
  double max_diff = 0;
  for (int64_t i = 0; i < B * D; ++i) max_diff = std::max(max_diff, double{std::fabs(gathered[i] - row_order[i])});
  std::printf("B=%lld K=%lld D=%lld N=%lld slab=%lld%s: gather %.3f ms, row order %.3f ms (%.2fx), max diff %g\n",
              static_cast<long long>(B), static_cast<long long>(K), static_cast<long long>(D),
              static_cast<long long>(N), static_cast<long long>(slab), shared ? " shared sort" : "", best_gather,
              best_rows, best_rows / best_gather, max_diff);
  return 0;
}
