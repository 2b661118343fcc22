// In-process A/B of the core's forward over float32 and int8 tables holding the same rows
// (bench only, not shipped): bench/int8_core_ab.sh builds the core trees given to it as shared
// libraries and runs this.
//   int8_core_ab B K D N CALLS [fp16-params] [no-biases] [bf16] [bf16-out] [fp16] [int64] [sets=S] [outs=M]
//                [threads=T] -- LIB...
// Each call draws one of S (default 64) prepared index sets (uniform rows), one thread (threads=T: T), builds and
// table types taking turns call by call. Prints the median ms per build and table type and
// int8 / float32; with `bf16` (`fp16`), a bfloat16 (float16) table of the same rows takes its turn too. The builds'
// outputs of the last call of each table type are compared bitwise with the first build's (a
// difference is reported, not an error: another summation order rounds differently). At small B
// the 64 default sets' rows stay in a large last-level cache between calls; a few thousand sets
// take them from memory, as a served model's fresh queries do. `outs=M` writes each call into one of M
// output buffers in turn (default 1): with several, the output rows' lines come from memory too, as
// in a served graph whose ops each get a fresh output. `bf16-out`: the bfloat16 table's output is
// bfloat16 (as the TF op's is) instead of float32. `int64`: int64 indices (as TF's ids usually are), not
// int32.
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

double NowMs() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename T>
T* HugeBuffer(size_t count) {
  const size_t page = size_t{2} << 20, bytes = (count * sizeof(T) + page - 1) / page * page;
  void* p = std::aligned_alloc(page, bytes);
  if (p == nullptr) std::exit(2);
  madvise(p, bytes, MADV_HUGEPAGE);
  return static_cast<T*>(p);
}

// IEEE half of a float in the normal half range (or 0), rounded to nearest even.
uint16_t ToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  if ((x & 0x7fffffff) == 0) return sign;
  const uint32_t exp = ((x >> 23) & 0xff) - 127 + 15, mant = x & 0x7fffff, rest = mant & 0x1fff;
  uint32_t h = (exp << 10) | (mant >> 13);
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr, "usage: int8_core_ab B K D N CALLS [fp16-params] [no-biases] [bf16] [bf16-out] [fp16] "
                         "[int64] [sets=S] [outs=M] [threads=T] -- LIB...\n");
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), K = std::atoll(argv[2]), D = std::atoll(argv[3]), N = std::atoll(argv[4]);
  const int calls = std::atoi(argv[5]);
  int64_t index_sets = 64, out_buffers = 1, threads = 1;
  bool fp16_params = false, no_biases = false, bf16 = false, bf16_out = false, fp16 = false, int64 = false;
  std::vector<ForwardFn> builds;
  std::vector<std::string> names;
  bool libs = false;
  for (int i = 6; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") { libs = true; continue; }
    if (!libs) {
      if (a == "fp16-params") fp16_params = true;
      else if (a == "no-biases") no_biases = true;
      else if (a == "bf16") bf16 = true;
      else if (a == "bf16-out") bf16_out = true;
      else if (a == "fp16") fp16 = true;
      else if (a == "int64") int64 = true;
      else if (a.rfind("outs=", 0) == 0 && std::atoll(a.c_str() + 5) > 0) out_buffers = std::atoll(a.c_str() + 5);
      else if (a.rfind("threads=", 0) == 0 && std::atoll(a.c_str() + 8) > 0) threads = std::atoll(a.c_str() + 8);
      else if (a.rfind("sets=", 0) == 0 && std::atoll(a.c_str() + 5) > 0) index_sets = std::atoll(a.c_str() + 5);
      else { std::fprintf(stderr, "unknown option %s\n", a.c_str()); return 2; }
      continue;
    }
    void* h = dlopen(a.c_str(), RTLD_NOW | RTLD_LOCAL);
    void* f = h != nullptr ? dlsym(h, kForwardSymbol) : nullptr;
    if (f == nullptr) { std::fprintf(stderr, "%s: %s\n", a.c_str(), dlerror()); return 2; }
    builds.push_back(reinterpret_cast<ForwardFn>(f));
    names.push_back(a.substr(a.find_last_of('/') + 1));
  }
  if (builds.empty() || builds.size() > 16) { std::fprintf(stderr, "give 1 to 16 LIBs\n"); return 2; }

  std::mt19937_64 rng(1);
  float* f32 = HugeBuffer<float>(N * D);
  int8_t* q = HugeBuffer<int8_t>(N * D);
  uint16_t* b16 = bf16 ? HugeBuffer<uint16_t>(N * D) : nullptr;
  uint16_t* h16 = fp16 ? HugeBuffer<uint16_t>(N * D) : nullptr;
  for (int64_t i = 0; i < N * D; ++i) {
    q[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    f32[i] = q[i] * 0.01f;
    if (bf16) {  // the float's top half, rounded to nearest
      uint32_t bits;
      std::memcpy(&bits, &f32[i], 4);
      b16[i] = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
    if (fp16) h16[i] = ToHalf(f32[i]);
  }
  std::vector<float> scales(N, 0.01f), biases(N, 0.001f);
  std::vector<uint16_t> scales16(N, 0x211f), biases16(N, 0x1419);  // ~0.01 and ~0.001 as float16
  std::vector<int32_t> indices(static_cast<size_t>(index_sets) * B * K);
  for (auto& v : indices) v = static_cast<int32_t>(rng() % N);
  const std::vector<int64_t> indices64(indices.begin(), indices.end());
  std::vector<float> weights(B * K, 0.5f);
  std::vector<std::vector<float>> outs(out_buffers, std::vector<float>(B * D));
  pkm::Table t32{f32, pkm::ElemType::kFloat32, N, D};
  pkm::Table t8{q, pkm::ElemType::kInt8, N, D, scales.data(), no_biases ? nullptr : biases.data()};
  if (fp16_params) {
    t8.row_scales = scales16.data();
    t8.row_biases = no_biases ? nullptr : biases16.data();
    t8.row_params_type = pkm::ElemType::kFloat16;
  }
  const pkm::Table tb16{b16, pkm::ElemType::kBFloat16, N, D};
  const pkm::Table th16{h16, pkm::ElemType::kFloat16, N, D};
  const pkm::Table* tables[4] = {&t32, &t8, nullptr, nullptr};
  const char* type_names[4] = {"float32", "int8", nullptr, nullptr};
  int types = 2;
  if (bf16) { tables[types] = &tb16; type_names[types++] = "bfloat16"; }
  if (fp16) { tables[types] = &th16; type_names[types++] = "float16"; }
  const int bf16_type = bf16 ? 2 : -1;
  std::vector<float> last_out[4 * 16];  // [4 * build + table type]: the last call's output
  // threads=T: T threads started per parallel loop, each taking an equal contiguous range (the
  // same for every build, so the thread start-up is part of each call alike).
  const pkm::ParallelFor inline_for = [threads](int64_t total, int64_t, const pkm::RangeFn& fn) {
    if (threads <= 1 || total < 2) { fn(0, total); return; }
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads; ++t)
      pool.emplace_back([&fn, t, total, threads] { fn(total * t / threads, total * (t + 1) / threads); });
    fn(0, total / threads);
    for (auto& th : pool) th.join();
  };

  std::vector<double> ms[4 * 16];  // [4 * build + table type]
  const int warmup = 4;
  for (int c = 0; c < calls + warmup; ++c)
    for (size_t l = 0; l < builds.size(); ++l)
      for (int t = 0; t < types; ++t) {
        const size_t build = (l + c) % builds.size();
        const int type = (t + c) % types;
        pkm::Bags bags;
        // The last call's index set is the same for every build, for the bitwise comparison.
        const size_t set = c == calls + warmup - 1 ? type : (c * 7 + l * 3 + type) % index_sets;
        bags.indices = int64 ? static_cast<const void*>(indices64.data() + set * B * K)
                             : static_cast<const void*>(indices.data() + set * B * K);
        bags.indices_int64 = int64;
        bags.num_bags = B;
        bags.bag_size = K;
        bags.weights = weights.data();
        std::vector<float>& out = outs[(c * builds.size() * types + l * types + t) % out_buffers];
        const pkm::ElemType out_type = type == bf16_type && bf16_out ? pkm::ElemType::kBFloat16 : pkm::ElemType::kFloat32;
        const double t0 = NowMs();
        const pkm::Status s = builds[build](*tables[type], bags, pkm::Combiner::kSum, out.data(), out_type, inline_for);
        const double elapsed = NowMs() - t0;
        if (!s.ok) { std::fprintf(stderr, "%s\n", s.message.c_str()); return 1; }
        if (c >= warmup) ms[4 * build + type].push_back(elapsed);
        if (c == calls + warmup - 1) last_out[4 * build + type] = out;
      }
  std::printf("B=%lld K=%lld D=%lld N=%lld%s%s%s%s, %lld index sets, %lld output buffers, %lld thread(s), "
              "medians of %d calls\n",
              static_cast<long long>(B), static_cast<long long>(K), static_cast<long long>(D),
              static_cast<long long>(N), fp16_params ? ", float16 row parameters" : "",
              no_biases ? ", no biases" : "", bf16_out ? ", bfloat16 output of the bfloat16 table" : "",
              int64 ? ", int64 indices" : "",
              static_cast<long long>(index_sets), static_cast<long long>(out_buffers), static_cast<long long>(threads), calls);
  for (size_t b = 0; b < builds.size(); ++b) {
    double med[4];
    std::printf("  %-12s", names[b].c_str());
    for (int t = 0; t < types; ++t) {
      std::vector<double>& v = ms[4 * b + t];
      std::sort(v.begin(), v.end());
      med[t] = v[v.size() / 2];
      std::printf(" %s %.4f ms ", type_names[t], med[t]);
    }
    std::printf(" int8/float32 %.3f", med[1] / med[0]);
    if (fp16) std::printf(" float16/float32 %.3f", med[types - 1] / med[0]);
    std::printf("\n");
  }
  // A kernel that sums in another order differs in rounding: reported, not an error.
  std::string differ;
  for (int t = 0; t < types; ++t)
    for (size_t b = 1; b < builds.size(); ++b)
      if (std::memcmp(last_out[t].data(), last_out[4 * b + t].data(), B * D * (t == bf16_type && bf16_out ? 2 : 4)) !=
          0) {
        differ += std::string(differ.empty() ? "" : ", ") + type_names[t] + " (" + names[b] + ")";
        break;
      }
  if (builds.size() > 1)
    std::printf("  outputs of the last call, builds against the first: %s\n",
                differ.empty() ? "bitwise equal" : ("differ for " + differ).c_str());
  return 0;
}
