// What the standalone GPU A/Bs of bench/native share: a CUDA call checked (exit with the
// failing call named), and the median time of a launch.
#ifndef PKM_BENCH_NATIVE_GPU_BENCH_UTIL_CUH_
#define PKM_BENCH_NATIVE_GPU_BENCH_UTIL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e = (x);                                                                     \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

// Median of `reps` event-timed calls of launch() on the default stream, after two warm-up calls.
template <typename Launch>
float MedianMs(Launch launch, int reps = 21) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();
  launch();
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

#endif  // PKM_BENCH_NATIVE_GPU_BENCH_UTIL_CUH_
