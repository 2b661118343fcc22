// A small fixed-size thread pool implementing pkm::ParallelFor for the TFLite
// kernel (TFLite gives custom kernels no thread pool of their own).
#ifndef PKM_TFLITE_DELEGATE_THREAD_POOL_H_
#define PKM_TFLITE_DELEGATE_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/core/embedding_bag.h"

namespace pkm {
namespace tflite {

class ThreadPool {
 public:
  // num_threads counts the calling thread: 1 means everything runs inline.
  // inline_when_busy: a caller finding the pool running another caller's job
  // runs its job alone instead of waiting (for pools shared between
  // interpreters that may run concurrently).
  explicit ThreadPool(int num_threads, bool inline_when_busy = false);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Splits [0, total) into chunks and runs them on the pool and the caller.
  void Run(int64_t total, int64_t cost_per_unit, const RangeFn& fn);
  ParallelFor AsParallelFor();

 private:
  void WorkerLoop();
  void RunChunks();

  std::vector<std::thread> workers_;
  std::mutex job_mutex_;  // one job at a time (a delegate may serve several interpreters)
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const bool inline_when_busy_;
  bool stop_ = false;
  uint64_t generation_ = 0;
  int busy_workers_ = 0;
  // The current job.
  const RangeFn* fn_ = nullptr;
  int64_t total_ = 0;
  int64_t chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

// The process-wide pool of num_threads threads, created on first use and
// shared by all its users (one pool per node would start threads per node);
// it is destroyed, and its threads joined, when the last user drops it.
// Thread-safe. Jobs run inline while another user's job holds the pool.
std::shared_ptr<ThreadPool> SharedThreadPool(int num_threads);

}  // namespace tflite
}  // namespace pkm

#endif  // PKM_TFLITE_DELEGATE_THREAD_POOL_H_
