// The forward over row-range chunks of a table larger than the cache, against the core's plain forward,
// in one process (bench only, a prototype built on the core's public Forward; not shipped):
//   row_chunks_ab B K D N DTYPE CHUNKS CALLS -- built as
//   g++ -std=c++17 -O2 -I. bench/native/row_chunks_ab.cc CORE.so -Wl,-rpath,DIR -o row_chunks_ab -lpthread
// (CORE.so from bench/build_core.sh). The idea: where every row is used several times (B*K/N of 4 at the
// issue's D=2048 shape) and the table is larger than the last-level cache, one pass per chunk of
// N/CHUNKS rows, each bag's entries in that chunk given to Forward as ragged bags over the chunk's rows,
// should read each row from DRAM once and its re-reads from the cache. The chunked call includes the
// partition (two passes over the ids by bag) and adding each chunk's partial sums into the output.
// Both sum with weights of 0.5 into float32 outputs; 4 index sets of uniform rows in turn, the two
// forms alternating call by call on two threads that claim 8 blocks (as TF's pool does); medians.
#include <algorithm>
#include <atomic>
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

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

pkm::ParallelFor TwoThreadsClaimingBlocks(int blocks) {
  return [blocks](int64_t total, int64_t, const pkm::RangeFn& fn) {
    std::atomic<int> next{0};
    auto work = [&] {
      for (int i; (i = next.fetch_add(1)) < blocks;) {
        const int64_t b0 = total * i / blocks, b1 = total * (i + 1) / blocks;
        if (b1 > b0) fn(b0, b1);
      }
    };
    std::thread helper(work);
    work();
    helper.join();
  };
}

void Check(const pkm::Status& status) {
  if (!status.ok) {
    std::fprintf(stderr, "%s\n", status.message.c_str());
    std::exit(1);
  }
}

// Each chunk's bags: row_splits over all B bags, ids relative to the chunk's first row.
struct Chunks {
  int count = 0;
  int64_t rows_per_chunk = 0;
  std::vector<std::vector<int64_t>> splits, ids;
  std::vector<std::vector<float>> weights;

  Chunks(int n, int64_t num_rows, int64_t num_bags, int64_t num_entries)
      : count(n), rows_per_chunk((num_rows + n - 1) / n), splits(n, std::vector<int64_t>(num_bags + 1)),
        ids(n, std::vector<int64_t>(num_entries)), weights(n, std::vector<float>(num_entries)) {}

  void Partition(const int64_t* x, const float* w, int64_t B, int64_t K, const pkm::ParallelFor& pf) {
    pf(B, 0, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        std::vector<int64_t> in_chunk(count, 0);
        for (int64_t e = b * K; e < (b + 1) * K; ++e) ++in_chunk[x[e] / rows_per_chunk];
        for (int c = 0; c < count; ++c) splits[c][b + 1] = in_chunk[c];
      }
    });
    for (int c = 0; c < count; ++c) {
      splits[c][0] = 0;
      for (int64_t b = 0; b < B; ++b) splits[c][b + 1] += splits[c][b];
    }
    pf(B, 0, [&](int64_t b0, int64_t b1) {
      std::vector<int64_t> next(count);
      for (int64_t b = b0; b < b1; ++b) {
        for (int c = 0; c < count; ++c) next[c] = splits[c][b];
        for (int64_t e = b * K; e < (b + 1) * K; ++e) {
          const int c = static_cast<int>(x[e] / rows_per_chunk);
          const int64_t at = next[c]++;
          ids[c][at] = x[e] - c * rows_per_chunk;
          weights[c][at] = w[e];
        }
      }
    });
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr, "usage: row_chunks_ab B K D N float32|bfloat16 CHUNKS CALLS\n");
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), K = std::atoll(argv[2]), D = std::atoll(argv[3]), N = std::atoll(argv[4]);
  const bool bf16 = std::string(argv[5]) == "bfloat16";
  const int num_chunks = std::atoi(argv[6]), calls = std::atoi(argv[7]), sets = 4;
  const int64_t elem = bf16 ? 2 : 4;
  std::vector<char> table(N * D * elem);
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> value(-1.f, 1.f);
  for (int64_t i = 0; i < N * D; ++i) {
    const float v = value(gen);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if (bf16) reinterpret_cast<uint16_t*>(table.data())[i] = static_cast<uint16_t>(bits >> 16);
    else reinterpret_cast<float*>(table.data())[i] = v;
  }
  std::vector<std::vector<int64_t>> ids(sets, std::vector<int64_t>(B * K));
  std::mt19937_64 pick(7);
  for (auto& set : ids)
    for (auto& id : set) id = static_cast<int64_t>(pick() % N);
  std::vector<float> weights(B * K, 0.5f), plain_out(B * D), chunked_out(B * D), partial(B * D);
  pkm::Table whole;
  whole.data = table.data();
  whole.type = bf16 ? pkm::ElemType::kBFloat16 : pkm::ElemType::kFloat32;
  whole.num_rows = N;
  whole.dim = D;
  const pkm::ParallelFor pf = TwoThreadsClaimingBlocks(8);
  Chunks chunks(num_chunks, N, B, B * K);

  auto plain = [&](int s) {
    pkm::Bags bags;
    bags.indices = ids[s].data();
    bags.indices_int64 = true;
    bags.num_bags = B;
    bags.bag_size = K;
    bags.weights = weights.data();
    Check(pkm::Forward(whole, bags, pkm::Combiner::kSum, plain_out.data(), pkm::ElemType::kFloat32, pf));
  };
  auto chunked = [&](int s) {
    chunks.Partition(ids[s].data(), weights.data(), B, K, pf);
    for (int c = 0; c < num_chunks; ++c) {
      pkm::Table part = whole;
      part.data = table.data() + c * chunks.rows_per_chunk * D * elem;
      part.num_rows = std::min(chunks.rows_per_chunk, N - c * chunks.rows_per_chunk);
      pkm::Bags bags;
      bags.indices = chunks.ids[c].data();
      bags.indices_int64 = true;
      bags.num_bags = B;
      bags.row_splits = chunks.splits[c].data();
      bags.row_splits_int64 = true;
      bags.num_values = chunks.splits[c][B];
      bags.weights = chunks.weights[c].data();
      float* into = c == 0 ? chunked_out.data() : partial.data();
      Check(pkm::Forward(part, bags, pkm::Combiner::kSum, into, pkm::ElemType::kFloat32, pf));
      if (c > 0)
        pf(B, 0, [&](int64_t b0, int64_t b1) {
          for (int64_t i = b0 * D; i < b1 * D; ++i) chunked_out[i] += partial[i];
        });
    }
  };
  plain(0);
  chunked(0);
  double worst = 0;
  for (int64_t i = 0; i < B * D; ++i)
    worst = std::max(worst, std::abs(double(plain_out[i]) - chunked_out[i]) / (1 + std::abs(double(plain_out[i]))));
  std::vector<double> plain_s, chunked_s;
  for (int i = 0; i < calls; ++i) {
    double start = Now();
    plain(i % sets);
    plain_s.push_back(Now() - start);
    start = Now();
    chunked(i % sets);
    chunked_s.push_back(Now() - start);
  }
  std::sort(plain_s.begin(), plain_s.end());
  std::sort(chunked_s.begin(), chunked_s.end());
  std::printf("B=%lld K=%lld D=%lld N=%lld %s chunks=%d: plain %.3f ms, chunked %.3f ms (medians of %d), "
              "chunked/plain %.3f, max relative difference %.2g\n",
              static_cast<long long>(B), static_cast<long long>(K), static_cast<long long>(D),
              static_cast<long long>(N), argv[5], num_chunks, plain_s[calls / 2] * 1e3, chunked_s[calls / 2] * 1e3,
              calls, chunked_s[calls / 2] / plain_s[calls / 2], worst);
}
