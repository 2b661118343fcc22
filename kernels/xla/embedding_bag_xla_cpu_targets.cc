// XLA CPU ("Host") custom-call targets of the PkmEmbeddingBag lowering. They
// only translate: FFI buffers -> pkm::Table/Bags, XLA's intra-op thread pool
// -> the core's ParallelFor, a core error -> an FFI InvalidArgument error
// (which fails the XLA executable with the core's message, e.g. an index out
// of range). Only XLA's public FFI header, no TensorFlow: the TF op library
// registers these handlers with TF's XLA (embedding_bag_xla_cpu.cc), and any
// other XLA runtime can register the exported symbols below.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "kernels/core/embedding_bag.h"
#include "kernels/xla/embedding_bag_xla_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace pkm_xla {

// Splits [0, total) into blocks that the calling thread and XLA's intra-op
// pool claim from a shared counter. The caller claims blocks too, so it only
// ever waits for blocks another thread has already started: no deadlock when
// the pool is busy (or is the very pool running this call), and a task the
// pool starts late finds nothing left and touches only the shared state.
pkm::ParallelFor PoolParallelFor(ffi::ThreadPool* pool) {
  return [pool](int64_t total, int64_t cost_per_unit, const pkm::RangeFn& fn) {
    if (total <= 0) return;
    const int64_t threads = pool->num_threads();
    constexpr int64_t kMinBlockCost = 100000;  // cycles; below this a task costs more than it saves
    const int64_t units_per_block = std::max<int64_t>(1, kMinBlockCost / std::max<int64_t>(cost_per_unit, 1));
    const int64_t blocks = std::min<int64_t>({(total + units_per_block - 1) / units_per_block,
                                              std::max<int64_t>(1, threads + 1) * 4});
    if (threads <= 0 || blocks <= 1) {
      fn(0, total);
      return;
    }
    struct State {
      std::atomic<int64_t> next{0};
      int64_t blocks = 0, total = 0;
      std::mutex mu;
      std::condition_variable cv;
      int64_t done = 0;
      const pkm::RangeFn* fn = nullptr;
    };
    auto state = std::make_shared<State>();
    state->blocks = blocks;
    state->total = total;
    state->fn = &fn;
    auto work = [](State* s) {
      for (int64_t i; (i = s->next.fetch_add(1)) < s->blocks;) {
        (*s->fn)(s->total * i / s->blocks, s->total * (i + 1) / s->blocks);
        std::lock_guard<std::mutex> lock(s->mu);
        if (++s->done == s->blocks) s->cv.notify_all();
      }
    };
    const int64_t helpers = std::min<int64_t>(threads, blocks - 1);
    for (int64_t t = 0; t < helpers; ++t) pool->Schedule([state, work] { work(state.get()); });
    work(state.get());
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done == state->blocks; });
  };
}

namespace {

// The Host platform of Targets: the core on XLA's intra-op pool.
struct HostPlatform {
  static ffi::Error Forward(const CoreCall& call, ffi::AnyBuffer& out, ffi::ThreadPool& pool) {
    return FromCore(pkm::Forward(call.table, call.bags, call.combiner, out.untyped_data(), call.table.type,
                                 PoolParallelFor(&pool)));
  }
  static ffi::Error Backward(const CoreCall& call, const ffi::AnyBuffer& grad, ffi::AnyBuffer& d_params,
                             ffi::AnyBuffer& d_weights, ffi::ThreadPool& pool) {
    return FromCore(pkm::Backward(call.table, call.bags, call.combiner, grad.untyped_data(), call.table.type,
                                  d_params.untyped_data(), call.table.type,
                                  call.has_weights ? d_weights.untyped_data() : nullptr, PoolParallelFor(&pool)));
  }
};
using HostTargets = Targets<HostPlatform, ffi::ThreadPool>;

}  // namespace
}  // namespace pkm_xla

PKM_XLA_DEFINE_TARGETS(cpu, ::pkm_xla::HostTargets)
