#include "tflite_delegate/thread_pool.h"

#include <algorithm>
#include <map>

namespace pkm {
namespace tflite {

// Below this many estimated cycles a job runs inline: waking threads costs more.
constexpr int64_t kMinParallelCost = 200000;

ThreadPool::ThreadPool(int num_threads, bool inline_when_busy)
    : inline_when_busy_(inline_when_busy) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunChunks() {
  for (;;) {
    const int64_t begin = next_.fetch_add(chunk_);
    if (begin >= total_) return;
    (*fn_)(begin, std::min(total_, begin + chunk_));
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunChunks();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_workers_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::Run(int64_t total, int64_t cost_per_unit, const RangeFn& fn) {
  if (total <= 0) return;
  const int threads = num_threads();
  const double cost = static_cast<double>(total) * std::max<int64_t>(cost_per_unit, 1);
  if (threads == 1 || total == 1 || cost < kMinParallelCost) {
    fn(0, total);
    return;
  }
  std::unique_lock<std::mutex> job_lock(job_mutex_, std::defer_lock);
  if (!inline_when_busy_) {
    job_lock.lock();
  } else if (!job_lock.try_lock()) {
    fn(0, total);
    return;
  }
  fn_ = &fn;
  total_ = total;
  // A few chunks per thread balance uneven bags without much overhead.
  chunk_ = std::max<int64_t>(1, (total + 4 * threads - 1) / (4 * threads));
  next_.store(0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_workers_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  RunChunks();
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return busy_workers_ == 0; });
  fn_ = nullptr;
}

ParallelFor ThreadPool::AsParallelFor() {
  return [this](int64_t total, int64_t cost_per_unit, const RangeFn& fn) {
    Run(total, cost_per_unit, fn);
  };
}

std::shared_ptr<ThreadPool> SharedThreadPool(int num_threads) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<ThreadPool>> pools;  // weak: no threads outlive their users
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<ThreadPool> pool = pools[num_threads].lock();
  if (!pool) {
    pool = std::make_shared<ThreadPool>(num_threads, /*inline_when_busy=*/true);
    pools[num_threads] = pool;
  }
  return pool;
}

}  // namespace tflite
}  // namespace pkm
