// The core's forward against a plain loop that moves the same bytes, in one process (bench only, not
// shipped):
//   core_vs_loop B K D N DTYPE CALLS [sets=S] [outs=M] [blocks=G] [int64] [rolled] [mean|sqrtn] [unweighted]
//                [noloop] -- LIB [LIB_B]
// DTYPE is float32 or bfloat16 (bfloat16 output, as the TF op's). LIB is a core build as bench/core_ab.sh
// makes one (the forward is looked up by its mangled name). Two threads that keep running between calls
// (the second spins, as TF's pool threads are already up when an op starts), each taking half of the
// bags; a call's time is its slower thread's own. The loop reads each bag's rows (up to 1 KB of columns
// at a time OR-ed into registers) and stores its output row once, as bag_bench's reads + writes loop,
// prefetching the row `ahead` entries on with either hint; its best of those 16 settings (by median over
// a short search) then takes turns with the op, call by call, on the same index sets (S of them, uniform
// rows, default 8: the op-alone chain's 8 calls) and the same M output buffers (default 1) in turn.
// As TF runs the op: `blocks=G` hands the op's range out as G blocks the two threads claim (default 2,
// one half each; TF's forward claims 8-32), `int64` gives it int64 indices, `rolled` makes index set s
// set 0 moved by s bags, as the roofline's op-alone chain does (the same rows every call). The op sums
// with weights of 0.5; `mean` or `sqrtn` is its combiner instead, `unweighted` gives it no weights;
// `noloop` times the op alone (no loop, no search); with a second build LIB_B it times the two builds
// in turn, call by call on the same inputs, and prints both (bench/core_sweep.py).
// Prints the medians and minima of both and op / loop (CORE_VS_LOOP_SETTINGS=1: each setting's median too,
// to stderr).
#include <dlfcn.h>
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/core/embedding_bag.h"

namespace {

using ForwardFn = pkm::Status (*)(const pkm::Table&, const pkm::Bags&, pkm::Combiner, void*, pkm::ElemType,
                                  const pkm::ParallelFor&);
constexpr char kForwardSymbol[] =
    "_ZN3pkm7ForwardERKNS_5TableERKNS_4BagsENS_8CombinerEPvNS_8ElemTypeERKSt8functionIFvllRKS9_IFvllEEEE";

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The calling thread and one helper that spins between jobs; Run returns the slower one's own seconds.
class TwoThreads {
 public:
  TwoThreads() : helper_([this] { Serve(); }) {}
  ~TwoThreads() {
    stop_ = true;
    generation_.fetch_add(1);
    helper_.join();
  }
  double Run(const std::function<void(int)>& job) {
    job_ = &job;
    done_ = false;
    generation_.fetch_add(1);
    const double start = Now();
    job(0);
    const double own = Now() - start;
    while (!done_.load()) _mm_pause();
    return std::max(own, helper_seconds_);
  }

 private:
  void Serve() {
    int seen = 0;
    for (;;) {
      while (generation_.load() == seen) _mm_pause();
      seen = generation_.load();
      if (stop_) return;
      const double start = Now();
      (*job_)(1);
      helper_seconds_ = Now() - start;
      done_ = true;
    }
  }
  std::atomic<int> generation_{0};
  std::atomic<bool> done_{false}, stop_{false};
  const std::function<void(int)>* job_ = nullptr;
  double helper_seconds_ = 0;
  std::thread helper_;
};

template <int kHint, int kLines>
__attribute__((target("avx512f"))) void OrBags(const char* table, const int32_t* idx, int64_t b0, int64_t b1,
                                               int64_t K, int64_t count, int64_t ahead, int64_t row_bytes,
                                               char* out) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t off = 0; off < row_bytes; off += 64 * kLines) {
      __m512i acc[kLines];
      for (int l = 0; l < kLines; ++l) acc[l] = _mm512_setzero_si512();
      for (int64_t e = b * K; e < (b + 1) * K; ++e) {
        const char* next = table + idx[std::min(e + ahead, count - 1)] * row_bytes + off;
        const char* row = table + idx[e] * row_bytes + off;
        for (int l = 0; l < kLines; ++l) {
          __builtin_prefetch(next + 64 * l, 0, kHint);
          acc[l] = _mm512_or_si512(acc[l], _mm512_loadu_si512(row + 64 * l));
        }
      }
      for (int l = 0; l < kLines; ++l) _mm512_storeu_si512(out + b * row_bytes + off + 64 * l, acc[l]);
    }
}

template <int kHint>
void OrBagsAnyWidth(const char* table, const int32_t* idx, int64_t b0, int64_t b1, int64_t K, int64_t count,
                    int64_t ahead, int64_t row_bytes, char* out) {
  const int64_t lines = row_bytes / 64;
  auto run = [&](auto lines_tag) {
    OrBags<kHint, decltype(lines_tag)::value>(table, idx, b0, b1, K, count, ahead, row_bytes, out);
  };
  if (lines % 16 == 0) run(std::integral_constant<int, 16>{});
  else if (lines % 8 == 0) run(std::integral_constant<int, 8>{});
  else if (lines % 4 == 0) run(std::integral_constant<int, 4>{});
  else if (lines % 2 == 0) run(std::integral_constant<int, 2>{});
  else run(std::integral_constant<int, 1>{});
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 9 || !__builtin_cpu_supports("avx512f")) {
    std::fprintf(stderr,
                 "usage: core_vs_loop B K D N float32|bfloat16 CALLS [sets=S] [outs=M] [blocks=G] [int64] [rolled] "
                 "[mean|sqrtn] [unweighted] [noloop] -- LIB [LIB_B, with noloop] (AVX-512)\n");
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), K = std::atoll(argv[2]), D = std::atoll(argv[3]), N = std::atoll(argv[4]);
  const std::string dtype = argv[5];
  const int calls = std::atoi(argv[6]);
  int64_t sets = 8, outs = 1, blocks = 2;
  bool int64_indices = false, rolled = false, weighted = true, with_loop = true;
  pkm::Combiner combiner = pkm::Combiner::kSum;
  const char* lib = nullptr;
  const char* lib_b = nullptr;
  for (int i = 7; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--" && i + 1 < argc) {
      lib = argv[++i];
      if (i + 1 < argc) lib_b = argv[++i];
    }
    else if (a.rfind("sets=", 0) == 0 && std::atoll(a.c_str() + 5) > 0) sets = std::atoll(a.c_str() + 5);
    else if (a.rfind("outs=", 0) == 0 && std::atoll(a.c_str() + 5) > 0) outs = std::atoll(a.c_str() + 5);
    else if (a.rfind("blocks=", 0) == 0 && std::atoll(a.c_str() + 7) > 0) blocks = std::atoll(a.c_str() + 7);
    else if (a == "int64") int64_indices = true;
    else if (a == "rolled") rolled = true;
    else if (a == "mean") combiner = pkm::Combiner::kMean;
    else if (a == "sqrtn") combiner = pkm::Combiner::kSqrtn;
    else if (a == "unweighted") weighted = false;
    else if (a == "noloop") with_loop = false;
    else { std::fprintf(stderr, "unknown argument %s\n", a.c_str()); return 2; }
  }
  const bool bf16 = dtype == "bfloat16";
  const int64_t row_bytes = D * (bf16 ? 2 : 4);
  if (lib == nullptr || (!bf16 && dtype != "float32") || row_bytes % 64 != 0 || B < 2 || K < 1 || calls < 1 ||
      (lib_b != nullptr && with_loop)) {
    std::fprintf(stderr, "core_vs_loop: need -- LIB (a second build only with noloop), float32 or bfloat16, rows "
                         "of a multiple of 64 bytes\n");
    return 2;
  }
  auto load = [](const char* path) -> ForwardFn {
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    const ForwardFn fn = handle != nullptr ? reinterpret_cast<ForwardFn>(dlsym(handle, kForwardSymbol)) : nullptr;
    if (fn == nullptr) std::fprintf(stderr, "%s: %s\n", path, dlerror());
    return fn;
  };
  const ForwardFn forward_a = load(lib), forward_b = lib_b != nullptr ? load(lib_b) : forward_a;
  if (forward_a == nullptr || forward_b == nullptr) return 2;
  ForwardFn forward = forward_a;

  const size_t page = size_t{2} << 20, table_bytes = (N * row_bytes + page - 1) / page * page;
  char* table = static_cast<char*>(std::aligned_alloc(page, table_bytes));
  madvise(table, table_bytes, MADV_HUGEPAGE);
  std::mt19937_64 rng(1);
  for (int64_t i = 0; i < N * D; ++i) {  // small values, exact in bfloat16
    const float v = (static_cast<int>(rng() % 255) - 127) * (1.f / 128);
    if (bf16) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      const uint16_t half = static_cast<uint16_t>(bits >> 16);
      std::memcpy(table + 2 * i, &half, 2);
    } else {
      std::memcpy(table + 4 * i, &v, 4);
    }
  }
  const int64_t count = B * K;
  std::vector<int32_t> indices(sets * count);
  for (auto& v : indices) v = static_cast<int32_t>(rng() % N);
  if (rolled)
    for (int64_t set = 1; set < sets; ++set)
      for (int64_t e = 0; e < count; ++e) indices[set * count + e] = indices[(e + set * K) % count];
  std::vector<int64_t> indices64;
  if (int64_indices) indices64.assign(indices.begin(), indices.end());
  std::vector<float> weights(count, 0.5f);
  // Output rows of the table's type (bfloat16 out of bfloat16), as wide as the rows.
  std::vector<std::vector<char>> out_buffers(outs, std::vector<char>(B * row_bytes + 64));
  const pkm::Table t{table, bf16 ? pkm::ElemType::kBFloat16 : pkm::ElemType::kFloat32, N, D};
  TwoThreads threads;

  auto op_call = [&](int c) {
    pkm::Bags bags;
    if (int64_indices) bags.indices = indices64.data() + (c % sets) * count;
    else bags.indices = indices.data() + (c % sets) * count;
    bags.indices_int64 = int64_indices;
    bags.num_bags = B;
    bags.bag_size = K;
    bags.weights = weighted ? weights.data() : nullptr;
    char* out = out_buffers[c % outs].data();
    double seconds = 0;
    const pkm::ParallelFor pf = [&](int64_t total, int64_t, const pkm::RangeFn& fn) {
      std::atomic<int64_t> next{0};
      const int64_t size = (total + blocks - 1) / blocks;
      seconds = threads.Run([&](int) {
        for (int64_t b; (b = next.fetch_add(1)) * size < total;) fn(b * size, std::min(total, (b + 1) * size));
      });
    };
    const pkm::Status s = forward(t, bags, combiner, out, t.type, pf);
    if (!s.ok) { std::fprintf(stderr, "%s\n", s.message.c_str()); std::exit(1); }
    return 1e3 * seconds;
  };
  auto loop_call = [&](int c, int hint, int64_t ahead) {
    const int32_t* idx = indices.data() + (c % sets) * count;
    char* out = out_buffers[c % outs].data();
    return 1e3 * threads.Run([&](int id) {
      const int64_t b0 = B * id / 2, b1 = B * (id + 1) / 2;
      (hint == 3 ? OrBagsAnyWidth<3> : OrBagsAnyWidth<2>)(table, idx, b0, b1, K, count, ahead, row_bytes, out);
    });
  };

  for (int c = 0; c < 8; ++c) op_call(c);
  if (!with_loop) {  // the op alone; with LIB_B, the two builds in turn (bench/core_sweep.py)
    forward = forward_b;
    for (int c = 0; c < 8; ++c) op_call(c);
    std::vector<double> a_ms, b_ms;
    for (int c = 0; c < calls; ++c) {
      forward = forward_a;
      a_ms.push_back(op_call(c));
      if (lib_b == nullptr) continue;
      forward = forward_b;
      b_ms.push_back(op_call(c));
    }
    std::printf("{\"op_median_ms\": %.4f, \"op_min_ms\": %.4f", Median(a_ms),
                *std::min_element(a_ms.begin(), a_ms.end()));
    if (lib_b != nullptr)
      std::printf(", \"b_median_ms\": %.4f, \"b_min_ms\": %.4f", Median(b_ms),
                  *std::min_element(b_ms.begin(), b_ms.end()));
    std::printf("}\n");
    return 0;
  }
  // The loop's best setting: 16 settings, a short run of each (after the op's own warm-up).
  int best_hint = 2;
  int64_t best_ahead = 1;
  double best = 1e30;
  const int search = std::max(8, calls / 8);
  for (int hint : {2, 3})
    for (int64_t ahead : {1, 2, 4, 8, 16, 32, 64, 128}) {
      std::vector<double> ms;
      for (int c = 0; c < search; ++c) ms.push_back(loop_call(c, hint, ahead));
      if (std::getenv("CORE_VS_LOOP_SETTINGS") != nullptr)
        std::fprintf(stderr, "loop %3lld rows ahead, %s: median %.4f ms\n", (long long)ahead, hint == 3 ? "t0" : "t1",
                     Median(ms));
      if (Median(ms) < best) { best = Median(ms); best_hint = hint; best_ahead = ahead; }
    }
  std::vector<double> op_ms, loop_ms;
  for (int c = 0; c < calls; ++c) {
    op_ms.push_back(op_call(c));
    loop_ms.push_back(loop_call(c, best_hint, best_ahead));
  }
  const double op_med = Median(op_ms), loop_med = Median(loop_ms);
  std::printf("{\"B\": %lld, \"K\": %lld, \"D\": %lld, \"N\": %lld, \"dtype\": \"%s\", \"sets\": %lld, "
              "\"outs\": %lld, \"blocks\": %lld, \"int64\": %s, \"rolled\": %s, \"combiner\": \"%s\", "
              "\"weighted\": %s, \"calls\": %d, "
              "\"op_median_ms\": %.4f, \"op_min_ms\": %.4f, \"loop_median_ms\": %.4f, \"loop_min_ms\": %.4f, "
              "\"loop_setting\": \"%lld rows ahead, %s\", \"op_over_loop\": %.3f}\n",
              (long long)B, (long long)K, (long long)D, (long long)N, dtype.c_str(), (long long)sets,
              (long long)outs, (long long)blocks, int64_indices ? "true" : "false", rolled ? "true" : "false",
              combiner == pkm::Combiner::kSum ? "sum" : combiner == pkm::Combiner::kMean ? "mean" : "sqrtn",
              weighted ? "true" : "false", calls, op_med, *std::min_element(op_ms.begin(), op_ms.end()), loop_med,
              *std::min_element(loop_ms.begin(), loop_ms.end()), (long long)best_ahead, best_hint == 3 ? "t0" : "t1",
              op_med / loop_med);
  return 0;
}
