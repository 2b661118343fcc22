// Native helper of bench/cpu_embedding_bag.py (bench only, not shipped):
//   bag_bench stream THREADS MIB REPEATS
//       streaming-read bandwidth: THREADS threads each sum their own share of
//       a MIB buffer with 256-bit loads (no writes); prints the best GB/s.
//   bag_bench stream-resident THREADS MIB PASSES REPEATS
//       the same over a MIB buffer on 2 MB pages (a table's size), each thread
//       reading its share PASSES times a repeat; prints the best GB/s a pass.
//   bag_bench forward B K D N DTYPE THREADS REPEATS [COMBINER]
//       pkm::Forward on random bags (no padding) with THREADS std::threads;
//       prints the best ms and the GB/s of gathered rows.
//   bag_bench gather B K D N DTYPE THREADS REPEATS
//       the forward's reads alone, on the same table (2 MB pages, as the
//       core asks for) and bags: each thread reads the rows of its bags with
//       64-byte loads OR-ed into one register (no arithmetic, no output),
//       prefetching the rows AHEAD entries later; every AHEAD in 1..128 and
//       both prefetch hints tried, the fastest kept. Prints its best ms and
//       GB/s: how fast plain loops read those rows here (not a strict bound:
//       a kernel that spreads its prefetches differently can beat it). With
//       AVX-512 also the same reads plus each bag's output row written
//       (with_writes_ms: the forward's whole memory traffic), searched alike.
//       A call's time is its slower thread's own.
//   bag_bench pages-ab B K D N DTYPE THREADS ROUNDS
//       the same forward on two copies of the table, called alternately: one
//       left to the core (which collapses it to huge pages), one marked
//       MADV_NOHUGEPAGE first (the core's collapse is then refused); prints
//       both minima and medians and the process's AnonHugePages.
// Output: one JSON line.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/table_pages.h"

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Splits [0, total) into `threads` contiguous ranges, one per thread.
pkm::ParallelFor Threads(int threads) {
  return [threads](int64_t total, int64_t, const pkm::RangeFn& fn) {
    if (total <= 0) return;
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) {
      const int64_t b = total * t / threads, e = total * (t + 1) / threads;
      if (b < e) pool.emplace_back([&fn, b, e] { fn(b, e); });
    }
    if (total / threads > 0) fn(0, total / threads);
    for (auto& th : pool) th.join();
  };
}

__attribute__((target("avx2"))) float SumRange(const float* p, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

// Each of `threads` threads sums its share of a MIB buffer `passes` times a
// repeat (256-bit loads, no writes); prints the best GB/s a pass. huge_pages:
// the buffer on 2 MB pages, as the core puts tables, for the read rate of a
// buffer a table's size (one that fits the last-level cache is read there).
int StreamRead(int threads, int64_t mib, int passes, int repeats, bool huge_pages) {
  const int64_t n = mib * 1024 * 1024 / 4;
  const size_t align = huge_pages ? size_t{2} << 20 : 64;
  const size_t bytes = (static_cast<size_t>(n) * 4 + align - 1) & ~(align - 1);
  float* buf = static_cast<float*>(std::aligned_alloc(align, bytes));
  if (huge_pages) madvise(buf, bytes, MADV_HUGEPAGE);
  Threads(threads)(n, 1, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) buf[i] = 1.f; });
  double best = 1e30;
  volatile float sink = 0;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = Now();
    Threads(threads)(threads, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int p = 0; p < passes; ++p) sink = sink + SumRange(buf + n * t / threads, n / threads);
    });
    best = std::min(best, (Now() - t0) / passes);
  }
  std::printf("{\"threads\": %d, \"bytes\": %lld, \"passes\": %d, \"best_s\": %.6f, \"gbps\": %.2f}\n", threads,
              static_cast<long long>(n * 4), passes, best, n * 4 / best / 1e9);
  std::free(buf);
  return 0;
}

int Forward(int64_t B, int64_t K, int64_t D, int64_t N, const std::string& dtype, int threads, int repeats,
            const std::string& combiner_name) {
  const pkm::ElemType type = dtype == "float16" ? pkm::ElemType::kFloat16
                             : dtype == "bfloat16" ? pkm::ElemType::kBFloat16
                             : dtype == "int8" ? pkm::ElemType::kInt8 : pkm::ElemType::kFloat32;
  const int64_t elem = pkm::ElemSize(type);
  // Values in [0.5, 1): normal numbers in every type (subnormals would time
  // the FPU's slow path, not the memory system).
  // Transparent huge pages on request (PKM_BENCH_THP=1), as numpy asks for
  // its large arrays: random rows then miss the TLB far less often.
  const size_t table_bytes = (static_cast<size_t>(N * D * elem) + (2u << 20) - 1) & ~((size_t{2} << 20) - 1);
  uint8_t* table_mem = static_cast<uint8_t*>(std::aligned_alloc(size_t{2} << 20, table_bytes));
  if (const char* thp = std::getenv("PKM_BENCH_THP"); thp != nullptr && thp[0] == '1') madvise(table_mem, table_bytes, MADV_HUGEPAGE);
  struct Span {
    uint8_t* p;
    uint8_t& operator[](int64_t i) { return p[i]; }
    uint8_t* data() { return p; }
  } table{table_mem};
  uint32_t lcg = 1;
  for (int64_t i = 0; i < N * D; ++i) {
    lcg = lcg * 1664525u + 1013904223u;
    const float v = 0.5f + (lcg >> 9) * (0.5f / (1u << 23));
    if (type == pkm::ElemType::kFloat32) std::memcpy(table.data() + 4 * i, &v, 4);
    else if (type == pkm::ElemType::kInt8) table[i] = static_cast<uint8_t>(lcg >> 24);
    else {
      const uint16_t h = type == pkm::ElemType::kFloat16 ? pkm::FloatToHalf(v) : pkm::FloatToBFloat16(v);
      std::memcpy(table.data() + 2 * i, &h, 2);
    }
  }
  std::mt19937_64 rng(1);
  std::vector<float> scales(N, 0.01f);
  std::vector<int64_t> idx(B * K);
  for (auto& v : idx) v = static_cast<int64_t>(rng() % N);
  std::vector<float> w(B * K, 0.5f);
  pkm::Combiner combiner;
  if (!pkm::ParseCombiner(combiner_name, &combiner)) return 2;
  pkm::Table t{table.data(), type, N, D, type == pkm::ElemType::kInt8 ? scales.data() : nullptr, nullptr};
  pkm::Bags bags;
  bags.indices = idx.data();
  bags.indices_int64 = true;
  bags.num_bags = B;
  bags.bag_size = K;
  const pkm::ElemType out_type = type == pkm::ElemType::kInt8 ? pkm::ElemType::kFloat32 : type;
  bags.weights = combiner == pkm::Combiner::kMax ? nullptr : w.data();
  std::vector<uint8_t> out(B * D * pkm::ElemSize(out_type));
  double best = 1e30;
  for (int r = 0; r < repeats + 1; ++r) {
    const double t0 = Now();
    pkm::Status s = pkm::Forward(t, bags, combiner, out.data(), out_type, Threads(threads));
    if (!s.ok) {
      std::fprintf(stderr, "%s\n", s.message.c_str());
      return 1;
    }
    if (r > 0) best = std::min(best, Now() - t0);
  }
  const double gathered = static_cast<double>(B) * K * D * elem;
  std::printf("{\"B\": %lld, \"K\": %lld, \"D\": %lld, \"N\": %lld, \"dtype\": \"%s\", \"threads\": %d, "
              "\"best_ms\": %.3f, \"gathered_gbps\": %.2f}\n",
              (long long)B, (long long)K, (long long)D, (long long)N, dtype.c_str(), threads, best * 1e3,
              gathered / best / 1e9);
  std::free(table_mem);
  return 0;
}

// The bytes of rows [0, count) of `rows` OR-ed together (low 32 bits), 64 bytes a load
// (rows a multiple of 64 bytes long), prefetching row k + ahead with each row k.
template <int kHint>
__attribute__((target("avx512f"))) int OrRowsAvx512(const uint8_t* const* rows, int64_t count, int64_t ahead,
                                                     int64_t row_bytes) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t k = 0; k < count; ++k) {
    const uint8_t* next = rows[std::min(k + ahead, count - 1)];
    for (int64_t off = 0; off < row_bytes; off += 64) {
      __builtin_prefetch(next + off, 0, kHint);
      acc = _mm512_or_si512(acc, _mm512_loadu_si512(rows[k] + off));
    }
  }
  return _mm_cvtsi128_si32(_mm512_castsi512_si128(acc));
}
template <int kHint>
__attribute__((target("avx2"))) int OrRowsAvx2(const uint8_t* const* rows, int64_t count, int64_t ahead,
                                                 int64_t row_bytes) {
  __m256i acc = _mm256_setzero_si256();
  for (int64_t k = 0; k < count; ++k) {
    const uint8_t* next = rows[std::min(k + ahead, count - 1)];
    for (int64_t off = 0; off < row_bytes; off += 64) {
      __builtin_prefetch(next + off, 0, kHint);
      const __m256i* p = reinterpret_cast<const __m256i*>(rows[k] + off);
      acc = _mm256_or_si256(acc, _mm256_or_si256(_mm256_loadu_si256(p), _mm256_loadu_si256(p + 1)));
    }
  }
  return _mm256_cvtsi256_si32(acc);
}

// Bags [0, bags) of K rows each, OR-ed together and stored to out (one row per
// bag): the rows' reads plus the output's writes, a forward's memory traffic.
// Per bag, per block of kLines 64-byte lines: the block of each of its rows is
// OR-ed into kLines registers, prefetching the same block of the row `ahead`
// entries later, and the block is stored once (as the whole-bag kernel,
// kernels/core/bag_columns_avx512.cc, sums a block of columns).
template <int kHint, int kLines>
__attribute__((target("avx512f"))) void OrBagsAvx512(const uint8_t* const* rows, int64_t bags, int64_t K,
                                                      int64_t ahead, int64_t row_bytes, uint8_t* out) {
  const int64_t count = bags * K;
  for (int64_t b = 0; b < bags; ++b)
    for (int64_t off = 0; off < row_bytes; off += 64 * kLines) {
      __m512i acc[kLines];
      for (int l = 0; l < kLines; ++l) acc[l] = _mm512_setzero_si512();
      for (int64_t e = b * K; e < (b + 1) * K; ++e) {
        const uint8_t* next = rows[std::min(e + ahead, count - 1)] + off;
        for (int l = 0; l < kLines; ++l) {
          __builtin_prefetch(next + 64 * l, 0, kHint);
          acc[l] = _mm512_or_si512(acc[l], _mm512_loadu_si512(rows[e] + off + 64 * l));
        }
      }
      for (int l = 0; l < kLines; ++l) _mm512_storeu_si512(out + b * row_bytes + off + 64 * l, acc[l]);
    }
}

template <int kHint>
void OrBags(const uint8_t* const* rows, int64_t bags, int64_t K, int64_t ahead, int64_t row_bytes, uint8_t* out) {
  const int64_t lines = row_bytes / 64;
  if (lines % 16 == 0) OrBagsAvx512<kHint, 16>(rows, bags, K, ahead, row_bytes, out);
  else if (lines % 8 == 0) OrBagsAvx512<kHint, 8>(rows, bags, K, ahead, row_bytes, out);
  else if (lines % 4 == 0) OrBagsAvx512<kHint, 4>(rows, bags, K, ahead, row_bytes, out);
  else if (lines % 2 == 0) OrBagsAvx512<kHint, 2>(rows, bags, K, ahead, row_bytes, out);
  else OrBagsAvx512<kHint, 1>(rows, bags, K, ahead, row_bytes, out);
}

// The fastest of `work`'s 16 prefetch settings (hint x rows ahead), each the
// best of `repeats` calls after one warm-up. A call's time is its slower
// thread's own time: the threads here start per call, where the op's pool
// threads are already running.
struct Fastest {
  double ms = 1e30;
  int ahead = 0, hint = 0;
};
template <typename Work>
Fastest FastestSetting(int64_t B, int threads, int repeats, Work work) {
  Fastest best;
  for (int hint : {2, 3})
    for (int ahead : {1, 2, 4, 8, 16, 32, 64, 128})
      for (int r = 0; r < repeats + 1; ++r) {
        std::mutex mutex;
        double slowest = 0;
        Threads(threads)(B, 1, [&](int64_t b0, int64_t b1) {
          const double t0 = Now();
          work(hint, ahead, b0, b1);
          const double t = Now() - t0;
          std::lock_guard<std::mutex> lock(mutex);
          slowest = std::max(slowest, t);
        });
        if (r > 0 && 1e3 * slowest < best.ms) best = {1e3 * slowest, ahead, hint};
      }
  return best;
}

int Gather(int64_t B, int64_t K, int64_t D, int64_t N, const std::string& dtype, int threads, int repeats) {
  const int64_t elem = dtype == "float32" ? 4 : dtype == "int8" ? 1 : 2;
  const int64_t row_bytes = D * elem;
  if (row_bytes % 64 != 0) {
    std::fprintf(stderr, "gather: rows must be a multiple of 64 bytes (D * element size = %lld)\n",
                 static_cast<long long>(row_bytes));
    return 2;
  }
  const size_t table_bytes = (static_cast<size_t>(N * row_bytes) + (2u << 20) - 1) & ~((size_t{2} << 20) - 1);
  uint8_t* table = static_cast<uint8_t*>(std::aligned_alloc(size_t{2} << 20, table_bytes));
  std::memset(table, 0x3c, table_bytes);
  pkm::internal::AdviseTableHugePages(table, table_bytes);
  std::mt19937_64 rng(1);  // the indices Forward draws
  std::vector<const uint8_t*> rows(B * K);
  for (auto& r : rows) r = table + static_cast<int64_t>(rng() % N) * row_bytes;
  const bool avx512 = __builtin_cpu_supports("avx512f");
  std::atomic<int> sink{0};  // keeps the loads
  const Fastest reads = FastestSetting(B, threads, repeats, [&](int hint, int ahead, int64_t b0, int64_t b1) {
    const uint8_t* const* first = rows.data() + b0 * K;
    const int64_t count = (b1 - b0) * K;
    const int bits = avx512 ? (hint == 3 ? OrRowsAvx512<3> : OrRowsAvx512<2>)(first, count, ahead, row_bytes)
                            : (hint == 3 ? OrRowsAvx2<3> : OrRowsAvx2<2>)(first, count, ahead, row_bytes);
    sink.fetch_xor(bits);
  });
  // With the outputs' writes (AVX-512 only): an output row per bag, on 4 KB pages as TF's outputs are.
  std::vector<uint8_t> out(avx512 ? B * row_bytes + 64 : 0);
  uint8_t* out_rows = out.data() + (64 - reinterpret_cast<uintptr_t>(out.data()) % 64) % 64;
  const Fastest writes = !avx512 ? Fastest{} : FastestSetting(B, threads, repeats, [&](int hint, int ahead,
                                                                                      int64_t b0, int64_t b1) {
    (hint == 3 ? OrBags<3> : OrBags<2>)(rows.data() + b0 * K, b1 - b0, K, ahead, row_bytes,
                                        out_rows + b0 * row_bytes);
  });
  const double gathered = static_cast<double>(B) * K * row_bytes;
  std::printf("{\"B\": %lld, \"K\": %lld, \"D\": %lld, \"N\": %lld, \"dtype\": \"%s\", \"threads\": %d, "
              "\"best_ms\": %.3f, \"gathered_gbps\": %.2f, \"ahead\": %d, \"prefetch\": \"%s\", "
              "\"loads\": \"%s\"",
              (long long)B, (long long)K, (long long)D, (long long)N, dtype.c_str(), threads, reads.ms,
              gathered / reads.ms / 1e6, reads.ahead, reads.hint == 3 ? "t0" : "t1", avx512 ? "avx512" : "avx2");
  if (avx512)
    std::printf(", \"with_writes_ms\": %.3f, \"with_writes_ahead\": %d, \"with_writes_prefetch\": \"%s\"",
                writes.ms, writes.ahead, writes.hint == 3 ? "t0" : "t1");
  std::printf("}\n");
  std::free(table);
  return 0;
}

long AnonHugeKb() {
  FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return -1;
  char line[256];
  long kb = -1;
  while (std::fgets(line, sizeof(line), f))
    if (std::sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) break;
  std::fclose(f);
  return kb;
}

int PagesAb(int64_t B, int64_t K, int64_t D, int64_t N, const std::string& dtype, int threads, int rounds) {
  const pkm::ElemType type = dtype == "float16" ? pkm::ElemType::kFloat16
                             : dtype == "bfloat16" ? pkm::ElemType::kBFloat16
                             : dtype == "int8" ? pkm::ElemType::kInt8 : pkm::ElemType::kFloat32;
  const size_t bytes = static_cast<size_t>(N * D * pkm::ElemSize(type));
  const size_t alloc = (bytes + (2u << 20) - 1) & ~((size_t{2} << 20) - 1);
  uint8_t* mem[2];
  for (int t = 0; t < 2; ++t) {
    mem[t] = static_cast<uint8_t*>(std::aligned_alloc(size_t{2} << 20, alloc));
    madvise(mem[t], alloc, MADV_NOHUGEPAGE);  // both start on 4 KB pages, as TF's tables do
    for (size_t i = 0; i < bytes; ++i) mem[t][i] = static_cast<uint8_t>(0x3c + (i & 3));  // normal halves/floats
  }
  madvise(mem[0], alloc, MADV_HUGEPAGE);  // table 0: the core's collapse may act; table 1 stays NOHUGEPAGE
  std::vector<float> scales(N, 0.01f);
  std::mt19937_64 rng(1);
  std::vector<int64_t> idx(B * K);
  for (auto& v : idx) v = static_cast<int64_t>(rng() % N);
  std::vector<float> w(B * K, 0.5f);
  pkm::Bags bags;
  bags.indices = idx.data();
  bags.indices_int64 = true;
  bags.num_bags = B;
  bags.bag_size = K;
  bags.weights = w.data();
  const pkm::ElemType out_type = type == pkm::ElemType::kInt8 ? pkm::ElemType::kFloat32 : type;
  std::vector<uint8_t> out(B * D * pkm::ElemSize(out_type));
  std::vector<double> ms[2];
  for (int r = 0; r < rounds + 1; ++r)
    for (int k = 0; k < 2; ++k) {
      const int t = (r + k) % 2;
      pkm::Table table{mem[t], type, N, D, type == pkm::ElemType::kInt8 ? scales.data() : nullptr, nullptr};
      const double t0 = Now();
      pkm::Status s = pkm::Forward(table, bags, pkm::Combiner::kSum, out.data(), out_type, Threads(threads));
      if (!s.ok) return 1;
      if (r > 0) ms[t].push_back(1e3 * (Now() - t0));
    }
  for (auto& v : ms) std::sort(v.begin(), v.end());
  const double gathered = static_cast<double>(B) * K * D * pkm::ElemSize(type);
  std::printf("{\"B\": %lld, \"K\": %lld, \"D\": %lld, \"N\": %lld, \"dtype\": \"%s\", \"threads\": %d, "
              "\"huge_min_ms\": %.3f, \"huge_median_ms\": %.3f, \"small_min_ms\": %.3f, \"small_median_ms\": %.3f, "
              "\"huge_gbps\": %.2f, \"small_gbps\": %.2f, \"anon_huge_kb\": %ld}\n",
              (long long)B, (long long)K, (long long)D, (long long)N, dtype.c_str(), threads, ms[0][0],
              ms[0][ms[0].size() / 2], ms[1][0], ms[1][ms[1].size() / 2], gathered / ms[0][0] / 1e6,
              gathered / ms[1][0] / 1e6, AnonHugeKb());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 5 && std::strcmp(argv[1], "stream") == 0)
    return StreamRead(std::atoi(argv[2]), std::atoll(argv[3]), 1, std::atoi(argv[4]), false);
  if (argc >= 6 && std::strcmp(argv[1], "stream-resident") == 0)
    return StreamRead(std::atoi(argv[2]), std::atoll(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), true);
  if (argc >= 9 && std::strcmp(argv[1], "forward") == 0)
    return Forward(std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]), argv[6],
                   std::atoi(argv[7]), std::atoi(argv[8]), argc > 9 ? argv[9] : "sum");
  if (argc >= 9 && std::strcmp(argv[1], "gather") == 0)
    return Gather(std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]), argv[6],
                  std::atoi(argv[7]), std::atoi(argv[8]));
  if (argc >= 9 && std::strcmp(argv[1], "pages-ab") == 0)
    return PagesAb(std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]), argv[6],
                   std::atoi(argv[7]), std::atoi(argv[8]));
  std::fprintf(stderr, "usage: bag_bench stream THREADS MIB REPEATS | stream-resident THREADS MIB PASSES REPEATS | forward B K D N DTYPE THREADS REPEATS [COMBINER] | gather B K D N DTYPE THREADS REPEATS | pages-ab B K D N DTYPE THREADS ROUNDS\n");
  return 2;
}
