// Host time of pkm_cuda_backward and of the CUDA calls it is made of, for several libpkm_cuda.so
// builds loaded side by side (dlopen) in one process on the same inputs: the huge-table case of
// bench/gpu_kernels_ab.py (B=65536 K=32 D=256 N=4M, per-sample weights, sum), bf16 / fp16 / fp32.
// Each host time is a median over `iters` calls made with the GPU idle (synchronised before), so a
// launch never waits on a full queue. Also, per build: the call event-timed (two events around the
// C call alone, GPU idle before), its device time (the call captured in a CUDA graph, replayed),
// the row-sparse call, and writing d_table once (cudaMemsetAsync, event-timed).
//
//   nvcc -std=c++17 -O2 -I. -o gpu_backward_host_parts bench/gpu_backward_host_parts.cu -ldl
//   ./gpu_backward_host_parts NAME=LIB.so [NAME=LIB.so ...] [--iters 200]  (JSON lines on stdout)
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/native/gpu_bench_util.cuh"
#include "kernels/cuda/embedding_bag_cuda.h"

namespace {

using BackwardFn = int (*)(const PkmBags*, const void*, void*, void*, void*, size_t, const PkmCudaOptions*,
                           pkm_cuda_stream_t);
using WorkspaceFn = size_t (*)(const PkmBags*, const PkmCudaOptions*);
using SparseFn = int (*)(const PkmBags*, const void*, pkm_cuda_sparse_alloc_fn, void*, void*, void*, size_t,
                         const PkmCudaOptions*, pkm_cuda_stream_t);
using ErrorFn = const char* (*)();

struct Lib {
  std::string name;
  BackwardFn backward;
  WorkspaceFn workspace_bytes;
  SparseFn sparse_backward;
  WorkspaceFn sparse_workspace_bytes;
  ErrorFn last_error;
};

__global__ void EmptyKernel() {}

__global__ void FillKernel(uint16_t* bits, size_t n, uint32_t seed, bool fp32) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // A small finite value in [-1, 1) in the element type (bf16 / fp16 bit patterns differ).
    const float v = (h & 0xffffff) / float(1 << 23) - 1.f;
    if (fp32) {
      reinterpret_cast<float*>(bits)[i] = v;
    } else {
      bits[i] = seed & 1 ? __half_as_ushort(__float2half(v)) : __bfloat16_as_ushort(__float2bfloat16(v));
    }
  }
}

__global__ void IndexKernel(int64_t* idx, size_t n, int64_t rows) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    idx[i] = int64_t(h % uint64_t(rows));
  }
}

double HostUs(const std::function<void()>& fn, int iters) {
  fn();
  CHECK(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  CHECK(cudaDeviceSynchronize());
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

double EventMs(const std::function<void()>& fn, cudaStream_t s, int iters) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaEventRecord(a, s));
    fn();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

// Device time of fn() alone: 10 calls captured in one graph (fn must be capturable), replayed.
double GraphMs(const std::function<void()>& fn, cudaStream_t s, int iters) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 10; ++i) fn();
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = EventMs([&] { CHECK(cudaGraphLaunch(exec, s)); }, s, iters) / 10;
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return ms;
}

struct SparseBuffers {
  int64_t* rows;
  void* row_grads;
};

int SparseAlloc(void* ctx, int64_t, int64_t** rows, void** row_grads) {
  auto* b = static_cast<SparseBuffers*>(ctx);
  *rows = b->rows;
  *row_grads = b->row_grads;
  return 0;
}

void RunDtype(const std::vector<Lib>& libs, int elem_type, const char* dtype, int iters) {
  const int64_t B = 65536, K = 32, D = 256, N = 4194304, n = B * K;
  const size_t elem = elem_type == PKM_FLOAT32 ? 4 : 2;
  void *table, *grad, *weights, *d_table, *d_weights, *row_grads;
  int64_t *indices, *rows;
  CHECK(cudaMalloc(&table, N * D * elem));
  CHECK(cudaMalloc(&d_table, N * D * elem));
  CHECK(cudaMalloc(&row_grads, N * D * elem));  // room for every row (at most min(n, N) touched)
  CHECK(cudaMalloc(&rows, N * 8));
  CHECK(cudaMalloc(&grad, B * D * elem));
  CHECK(cudaMalloc(&weights, n * elem));
  CHECK(cudaMalloc(&d_weights, n * elem));
  CHECK(cudaMalloc(&indices, n * 8));
  const bool fp32 = elem_type == PKM_FLOAT32;
  const uint32_t odd = elem_type == PKM_FLOAT16 ? 1 : 0;  // FillKernel: odd seed = fp16 bits
  FillKernel<<<1024, 256>>>(static_cast<uint16_t*>(table), N * D, 100 + odd, fp32);
  FillKernel<<<1024, 256>>>(static_cast<uint16_t*>(grad), B * D, 200 + odd, fp32);
  FillKernel<<<1024, 256>>>(static_cast<uint16_t*>(weights), n, 300 + odd, fp32);
  IndexKernel<<<1024, 256>>>(indices, n, N);
  CHECK(cudaDeviceSynchronize());
  PkmBags bags;
  std::memset(&bags, 0, sizeof(bags));
  bags.table = table;
  bags.elem_type = elem_type;
  bags.num_rows = N;
  bags.dim = D;
  bags.indices = indices;
  bags.indices_int64 = 1;
  bags.num_bags = B;
  bags.bag_size = K;
  bags.num_indices = n;
  bags.weights = weights;
  bags.weights_type = elem_type;
  bags.combiner = PKM_SUM;
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  SparseBuffers sparse{rows, row_grads};

  // What a build's launches are made of, measured in this harness's own runtime.
  const double empty_launch_us = HostUs([&] { EmptyKernel<<<1, 32, 0, s>>>(); }, iters);
  const double memset_us = HostUs([&] { CHECK(cudaMemsetAsync(d_weights, 0, 4096, s)); }, iters);
  const double get_last_error_us = HostUs([&] { (void)cudaGetLastError(); }, iters);
  int occ = 0;
  const double occupancy_us = HostUs(
      [&] { CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, EmptyKernel, 256, 0)); }, iters);
  uint32_t *k0, *k1, *v0, *v1;
  CHECK(cudaMalloc(&k0, n * 4));
  CHECK(cudaMalloc(&k1, n * 4));
  CHECK(cudaMalloc(&v0, n * 4));
  CHECK(cudaMalloc(&v1, n * 4));
  CHECK(cudaMemset(k0, 0, n * 4));
  size_t cub_bytes = 0;
  cub::DoubleBuffer<uint32_t> keys(k0, k1), vals(v0, v1);
  const double cub_query_us = HostUs([&] {
    CHECK(cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, keys, vals, int(n), 0, 23, s));
  }, iters);
  void* cub_temp;
  CHECK(cudaMalloc(&cub_temp, cub_bytes));
  const double cub_sort_us = HostUs([&] {
    cub::DoubleBuffer<uint32_t> kk(k0, k1), vv(v0, v1);
    CHECK(cub::DeviceRadixSort::SortPairs(cub_temp, cub_bytes, kk, vv, int(n), 0, 23, s));
  }, iters);
  std::printf("{\"dtype\": \"%s\", \"harness\": true, \"empty_launch_us\": %.2f, \"memset_us\": %.2f, "
              "\"get_last_error_us\": %.3f, \"occupancy_query_us\": %.2f, \"cub_sort_query_us\": %.2f, "
              "\"cub_sort_pairs_us\": %.2f}\n",
              dtype, empty_launch_us, memset_us, get_last_error_us, occupancy_us, cub_query_us, cub_sort_us);
  std::fflush(stdout);
  CHECK(cudaFree(cub_temp));
  CHECK(cudaFree(k0));
  CHECK(cudaFree(k1));
  CHECK(cudaFree(v0));
  CHECK(cudaFree(v1));

  const double write_ms = EventMs([&] { CHECK(cudaMemsetAsync(d_table, 0, N * D * elem, s)); }, s, iters);
  for (const Lib& lib : libs) {
    const size_t ws_bytes = std::max(lib.workspace_bytes(&bags, nullptr), lib.sparse_workspace_bytes(&bags, nullptr));
    void* ws;
    CHECK(cudaMalloc(&ws, ws_bytes));
    auto call = [&] {
      if (lib.backward(&bags, grad, d_table, d_weights, ws, ws_bytes, nullptr, s) != 0) {
        std::fprintf(stderr, "%s: %s\n", lib.name.c_str(), lib.last_error());
        std::exit(1);
      }
    };
    auto sparse_call = [&] {
      if (lib.sparse_backward(&bags, grad, SparseAlloc, &sparse, d_weights, ws, ws_bytes, nullptr, s) != 0) {
        std::fprintf(stderr, "%s sparse: %s\n", lib.name.c_str(), lib.last_error());
        std::exit(1);
      }
    };
    // The first three calls with this workspace, each timed alone.
    double first_us[3];
    for (double& us : first_us) {
      CHECK(cudaDeviceSynchronize());
      const auto t0 = std::chrono::steady_clock::now();
      call();
      us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    std::printf("{\"dtype\": \"%s\", \"lib\": \"%s\", \"first_calls_us\": [%.1f, %.1f, %.1f]}\n", dtype,
                lib.name.c_str(), first_us[0], first_us[1], first_us[2]);
    const double ws_query_us = HostUs([&] { (void)lib.workspace_bytes(&bags, nullptr); }, iters);
    const double call_us = HostUs(call, iters);
    const double event_ms = EventMs(call, s, iters);
    const double device_ms = GraphMs(call, s, iters);
    const double sparse_event_ms = EventMs(sparse_call, s, iters);
    std::printf("{\"dtype\": \"%s\", \"lib\": \"%s\", \"workspace_query_us\": %.2f, \"c_call_us\": %.2f, "
                "\"c_call_event_ms\": %.4f, \"device_ms\": %.4f, \"sparse_event_ms\": %.4f, "
                "\"write_d_table_ms\": %.4f, \"event_over_write\": %.3f, \"device_over_write\": %.3f}\n",
                dtype, lib.name.c_str(), ws_query_us, call_us, event_ms, device_ms, sparse_event_ms, write_ms,
                event_ms / write_ms, device_ms / write_ms);
    std::fflush(stdout);
    CHECK(cudaFree(ws));
  }
  CHECK(cudaStreamDestroy(s));
  for (void* p : {table, d_table, row_grads, grad, weights, d_weights}) CHECK(cudaFree(p));
  CHECK(cudaFree(rows));
  CHECK(cudaFree(indices));
}

template <typename F>
F Sym(void* handle, const char* name) {
  void* f = dlsym(handle, name);
  if (f == nullptr) {
    std::fprintf(stderr, "missing %s\n", name);
    std::exit(1);
  }
  return reinterpret_cast<F>(f);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Lib> libs;
  int iters = 200;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
      continue;
    }
    const char* eq = std::strchr(argv[i], '=');
    if (eq == nullptr) {
      std::fprintf(stderr, "usage: %s NAME=LIB.so ... [--iters N]\n", argv[0]);
      return 2;
    }
    void* h = dlopen(eq + 1, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      std::fprintf(stderr, "%s\n", dlerror());
      return 1;
    }
    libs.push_back({std::string(argv[i], size_t(eq - argv[i])), Sym<BackwardFn>(h, "pkm_cuda_backward"),
                    Sym<WorkspaceFn>(h, "pkm_cuda_backward_workspace_bytes"),
                    Sym<SparseFn>(h, "pkm_cuda_sparse_backward"),
                    Sym<WorkspaceFn>(h, "pkm_cuda_sparse_backward_workspace_bytes"),
                    Sym<ErrorFn>(h, "pkm_cuda_last_error")});
  }
  CHECK(cudaSetDevice(0));
  RunDtype(libs, PKM_BFLOAT16, "bf16", iters);
  RunDtype(libs, PKM_FLOAT16, "fp16", iters);
  RunDtype(libs, PKM_FLOAT32, "fp32", iters);
  return 0;
}
