// In-process A/B of the core's dense backward across builds (bench only; driven by
// `bench/core_ab.sh backward_core_ab`, which builds each tree's kernels/core as its own shared library):
//   backward_core_ab B K D N CALLS [fresh] -- LIB...
// float32 table of N x D, B bags of K uniform rows, per-sample weights, sum; d_table and
// d_weights wanted, two threads (std::thread per call, as TF's pool splits the groups). Each call
// runs every build once, the order rotating; by default each build writes into one d_table
// buffer kept across calls (what the TF kernel does from 32 MB up), with `fresh` into one
// allocated for the call and freed after it. Prints each build's median and min and the ratio of
// medians to the first build, and whether the last call's d_table and d_weights are bitwise the
// first build's.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/core/embedding_bag.h"

namespace {

using BackwardFn = pkm::Status (*)(const pkm::Table&, const pkm::Bags&, pkm::Combiner, const void*, pkm::ElemType,
                                   void*, pkm::ElemType, void*, const pkm::ParallelFor&);
constexpr char kBackwardSymbol[] =
    "_ZN3pkm8BackwardERKNS_5TableERKNS_4BagsENS_8CombinerEPKvNS_8ElemTypeEPvS9_SA_RKSt8functionIFvllRKSB_IFvllEEEE";

double NowMs() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr, "usage: backward_core_ab B K D N CALLS [fresh] -- LIB...\n");
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), K = std::atoll(argv[2]), D = std::atoll(argv[3]), N = std::atoll(argv[4]);
  const int calls = std::atoi(argv[5]);
  bool fresh = false, libs = false;
  std::vector<BackwardFn> builds;
  std::vector<std::string> names;
  for (int i = 6; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") { libs = true; continue; }
    if (!libs) {
      if (a == "fresh") fresh = true;
      else { std::fprintf(stderr, "unknown option %s\n", a.c_str()); return 2; }
      continue;
    }
    void* h = dlopen(a.c_str(), RTLD_NOW | RTLD_LOCAL);
    void* f = h != nullptr ? dlsym(h, kBackwardSymbol) : nullptr;
    if (f == nullptr) { std::fprintf(stderr, "%s: %s\n", a.c_str(), dlerror()); return 2; }
    builds.push_back(reinterpret_cast<BackwardFn>(f));
    names.push_back(a.substr(a.find_last_of('/') + 1));
  }
  if (builds.empty() || B < 1 || K < 1 || D < 1 || N < 1 || calls < 1) {
    std::fprintf(stderr, "give positive sizes, CALLS and at least one LIB\n");
    return 2;
  }
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> table(N * D), grad(B * D), w(B * K);
  for (auto& v : table) v = u(rng);
  for (auto& v : grad) v = u(rng);
  for (auto& v : w) v = u(rng);
  std::vector<int32_t> idx(B * K);
  for (auto& v : idx) v = static_cast<int32_t>(rng() % N);
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
  const size_t d_bytes = static_cast<size_t>(N * D) * sizeof(float);
  std::vector<float*> kept(builds.size(), nullptr);
  std::vector<std::vector<float>> last_dt(builds.size()), last_dw(builds.size(), std::vector<float>(B * K));
  std::vector<std::vector<double>> ms(builds.size());
  const int warmup = 2;
  for (int c = 0; c < calls + warmup; ++c)
    for (size_t l = 0; l < builds.size(); ++l) {
      const size_t b = (l + c) % builds.size();
      float* d_table = kept[b];
      if (fresh || d_table == nullptr) d_table = static_cast<float*>(std::aligned_alloc(64, d_bytes));
      const double t0 = NowMs();
      const pkm::Status s = builds[b](t, bags, pkm::Combiner::kSum, grad.data(), pkm::ElemType::kFloat32, d_table,
                                      pkm::ElemType::kFloat32, last_dw[b].data(), two_threads);
      const double elapsed = NowMs() - t0;
      if (!s.ok) { std::fprintf(stderr, "%s\n", s.message.c_str()); return 1; }
      if (c >= warmup) ms[b].push_back(elapsed);
      if (c == calls + warmup - 1) last_dt[b].assign(d_table, d_table + N * D);
      if (fresh) std::free(d_table);
      else kept[b] = d_table;
    }
  std::printf("backward B=%lld K=%lld D=%lld N=%lld float32, d_table %s, 2 threads, %d calls\n",
              static_cast<long long>(B), static_cast<long long>(K), static_cast<long long>(D),
              static_cast<long long>(N), fresh ? "fresh each call" : "kept across calls", calls);
  double first = 0;
  for (size_t b = 0; b < builds.size(); ++b) {
    std::sort(ms[b].begin(), ms[b].end());
    const double med = ms[b][ms[b].size() / 2];
    if (b == 0) first = med;
    std::printf("  %-12s median %.2f ms  min %.2f ms  / first %.3f\n", names[b].c_str(), med, ms[b][0], med / first);
  }
  for (size_t b = 1; b < builds.size(); ++b)
    std::printf("  %s against the first: d_table %s, d_weights %s\n", names[b].c_str(),
                last_dt[b] == last_dt[0] ? "bitwise equal" : "differs",
                last_dw[b] == last_dw[0] ? "bitwise equal" : "differs");
  for (float* p : kept) std::free(p);
  return 0;
}
