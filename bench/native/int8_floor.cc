// Where one thread's int8 forward time goes at small batches (issue #27; bench only, x86 with AVX2):
//   g++ -std=c++17 -O2 -mavx2 -mfma -I. bench/native/int8_floor.cc build/core/*.o -o build/bench/int8_floor -lpthread
//   build/bench/int8_floor N B        (N rows of 512 int8 values; B bags of 128 rows)
// Times, in one process, medians of 3000 calls over 8192 index sets (rows from memory when N is
// large, from cache when N is a few hundred): a loop that only loads one byte of every line of the
// bags' rows (the memory floor: every miss independent), the core's int8 forward, and copies of the
// core's AVX2 eight-row summing step with other prefetch schemes or none, and with an exact
// convert-free int8 -> float32 (integer add of 0x4B400000, float subtract of 1.5 * 2^23).
// bench/results/int8_forward_notes.md "Round 16" has one run on the Zen 1 host.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/core/embedding_bag.h"

namespace {

constexpr int kGroup = 8, kBag = 128, kDim = 512, kSets = 8192;

char* HugeTable(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, size_t{2} << 20, bytes) != 0) std::exit(2);
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 1, bytes);
  return static_cast<char*>(p);
}

enum class Prefetch { kPaced, kBurst, kPacedT0PlusFarT1, kPacedT1, kNone };

// acc[i..i+8) += sum_r c[r] * q_r[i..i+8): the core's AVX2 step (forward_int8.cc), or convert-free.
template <bool kConvertFree>
inline void EightColumns(const __m256* coef, const int8_t* const* q, int64_t i, float* acc) {
  const __m256i magic = _mm256_set1_epi32(0x4B400000);
  const __m256 offset = _mm256_set1_ps(12582912.f);
  __m256 even = _mm256_loadu_ps(acc + i), odd = _mm256_setzero_ps();
  for (int r = 0; r < kGroup; r += 2) {
    __m256i w0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[r] + i)));
    __m256i w1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[r + 1] + i)));
    __m256 x0, x1;
    if (kConvertFree) {
      x0 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(magic, w0)), offset);
      x1 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(magic, w1)), offset);
    } else {
      x0 = _mm256_cvtepi32_ps(w0);
      x1 = _mm256_cvtepi32_ps(w1);
    }
    even = _mm256_fmadd_ps(coef[r], x0, even);
    odd = _mm256_fmadd_ps(coef[r + 1], x1, odd);
  }
  _mm256_storeu_ps(acc + i, _mm256_add_ps(even, odd));
}

template <Prefetch kPrefetch, bool kConvertFree>
void SumGroup(const float* c, const char* const* rows, const char* const* ahead, const char* const* far,
              float* acc) {
  const int8_t* const* q = reinterpret_cast<const int8_t* const*>(rows);
  __m256 coef[kGroup];
  for (int r = 0; r < kGroup; ++r) coef[r] = _mm256_set1_ps(c[r]);
  if (kPrefetch == Prefetch::kBurst)
    for (int r = 0; r < kGroup; ++r)
      for (int l = 0; l < kDim; l += 64) _mm_prefetch(ahead[r] + l, _MM_HINT_T0);
  for (int64_t i = 0; i < kDim; i += 8) {
    const int pick = static_cast<int>((i / 8) % kGroup);
    const int64_t line = i & ~int64_t{63};
    if (kPrefetch == Prefetch::kPaced || kPrefetch == Prefetch::kPacedT0PlusFarT1)
      _mm_prefetch(ahead[pick] + line, _MM_HINT_T0);
    if (kPrefetch == Prefetch::kPacedT0PlusFarT1) _mm_prefetch(far[pick] + line, _MM_HINT_T1);
    if (kPrefetch == Prefetch::kPacedT1) _mm_prefetch(ahead[pick] + line, _MM_HINT_T1);
    EightColumns<kConvertFree>(coef, q, i, acc);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: int8_floor N B\n");
    return 2;
  }
  const int64_t N = std::atoll(argv[1]), B = std::atoll(argv[2]), entries = B * kBag;
  if (N < 1 || B < 1) return 2;
  char* table = HugeTable(static_cast<size_t>(N) * kDim);
  std::mt19937 rng(1);
  std::vector<int32_t> idx(static_cast<size_t>(kSets) * entries);
  for (auto& v : idx) v = static_cast<int32_t>(rng() % N);
  std::vector<float> scales(N, 0.01f), biases(N, 0.001f), weights(entries, 0.5f), out(B * kDim);
  std::vector<const char*> rows(entries);
  std::vector<float> coefs(entries);
  volatile int sink = 0;

  auto timeit = [&](const char* name, auto fn) {
    std::vector<double> us;
    for (int call = 0; call < 3000; ++call) {
      const int32_t* ix = idx.data() + static_cast<size_t>(call % kSets) * entries;
      const auto t0 = std::chrono::steady_clock::now();
      fn(ix);
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    std::printf("  %-40s %9.2f us\n", name, us[us.size() / 2]);
  };
  // The core's window in short: rows and coefficients collected (scales prefetched), the first
  // `ahead` rows requested, the scales applied, then groups of eight rows per bag.
  auto sum = [&](const int32_t* ix, int64_t ahead, int64_t far_ahead, auto group) {
    for (int64_t j = 0; j < entries; ++j) {
      rows[j] = table + static_cast<int64_t>(ix[j]) * kDim;
      coefs[j] = weights[j];
      __builtin_prefetch(&scales[ix[j]]);
    }
    for (int64_t j = 0; j < std::min(ahead, entries); ++j)
      for (int l = 0; l < kDim; l += 64) __builtin_prefetch(rows[j] + l);
    for (int64_t j = 0; j < entries; ++j) coefs[j] *= scales[ix[j]];
    const char* ahead_rows[kGroup];
    const char* far_rows[kGroup];
    for (int64_t b = 0; b < B; ++b) {
      float* acc = out.data() + b * kDim;
      std::fill(acc, acc + kDim, 0.f);
      for (int64_t k = b * kBag; k < (b + 1) * kBag; k += kGroup) {
        for (int r = 0; r < kGroup; ++r) {
          const int64_t a = k + r + ahead, f = a + far_ahead;
          ahead_rows[r] = a < entries ? rows[a] : rows[k + r];
          far_rows[r] = f < entries ? rows[f] : rows[k + r];
        }
        group(coefs.data() + k, rows.data() + k, ahead_rows, far_rows, acc);
      }
    }
  };
  const pkm::ParallelFor inline_for = [](int64_t total, int64_t, const pkm::RangeFn& fn) { fn(0, total); };
  auto core = [&](const int32_t* ix) {
    const pkm::Table t{table, pkm::ElemType::kInt8, N, kDim, scales.data(), biases.data()};
    pkm::Bags bags;
    bags.indices = ix;
    bags.num_bags = B;
    bags.bag_size = kBag;
    bags.weights = weights.data();
    (void)pkm::Forward(t, bags, pkm::Combiner::kSum, out.data(), pkm::ElemType::kFloat32, inline_for);
  };

  std::printf("int8_floor N=%lld B=%lld K=%d D=%d, one thread, medians of 3000 calls\n",
              static_cast<long long>(N), static_cast<long long>(B), kBag, kDim);
  timeit("one byte of every line (memory floor)", [&](const int32_t* ix) {
    int s = 0;
    for (int64_t j = 0; j < entries; ++j)
      for (int l = 0; l < kDim; l += 64) s += table[static_cast<int64_t>(ix[j]) * kDim + l];
    sink = s;
  });
  timeit("core int8 forward (with biases)", core);
  timeit("paced T0, 8 rows ahead", [&](const int32_t* ix) { sum(ix, 8, 0, SumGroup<Prefetch::kPaced, false>); });
  timeit("paced T0, 16 rows ahead", [&](const int32_t* ix) { sum(ix, 16, 0, SumGroup<Prefetch::kPaced, false>); });
  timeit("burst T0, 16 rows ahead", [&](const int32_t* ix) { sum(ix, 16, 0, SumGroup<Prefetch::kBurst, false>); });
  for (int64_t far : {16, 32, 64}) {
    char name[64];
    std::snprintf(name, sizeof(name), "paced T0 8 ahead + T1 %lld further", static_cast<long long>(far));
    timeit(name, [&](const int32_t* ix) { sum(ix, 8, far, SumGroup<Prefetch::kPacedT0PlusFarT1, false>); });
  }
  timeit("paced T1, 16 rows ahead", [&](const int32_t* ix) { sum(ix, 16, 0, SumGroup<Prefetch::kPacedT1, false>); });
  timeit("no prefetch", [&](const int32_t* ix) { sum(ix, 8, 0, SumGroup<Prefetch::kNone, false>); });
  timeit("convert-free, paced T0 8 ahead", [&](const int32_t* ix) { sum(ix, 8, 0, SumGroup<Prefetch::kPaced, true>); });
  return sink == 12345 ? 1 : 0;
}
