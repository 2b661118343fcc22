// Tensor -> core-argument translation shared by the CPU and GPU kernels of
// the PkmEmbeddingBag ops: attribute parsing and every shape/dtype check, so
// both devices reject the same inputs with the same messages.
#ifndef PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_
#define PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kernels/core/embedding_bag.h"
#include "tensorflow/core/framework/device_base.h"
#include "kernels/core/shape_rules.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace pkm_tf {

// Attributes common to all four ops.
struct OpAttrs {
  pkm::Combiner combiner = pkm::Combiner::kSum;
  bool has_weights = true;
  bool ragged = false;
};

inline ::tensorflow::Status ReadAttrs(::tensorflow::OpKernelConstruction* ctx, bool ragged,
                                      OpAttrs* attrs) {
  std::string combiner;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiner", &combiner));
  if (!pkm::ParseCombiner(combiner, &attrs->combiner))
    return ::tensorflow::errors::InvalidArgument("combiner must be one of sum, mean, sqrtn, max; got '",
                                                 combiner, "'");
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_weights", &attrs->has_weights));
  attrs->ragged = ragged;
  return ::tensorflow::Status();
}

inline pkm::ElemType ElemTypeOf(::tensorflow::DataType dt) {
  switch (dt) {
    case ::tensorflow::DT_HALF: return pkm::ElemType::kFloat16;
    case ::tensorflow::DT_BFLOAT16: return pkm::ElemType::kBFloat16;
    default: return pkm::ElemType::kFloat32;  // the op's type constraint admits nothing else
  }
}

// The inputs of one op call, as core arguments. Input order:
//   dense : params, indices, weights            (forward)
//   ragged: params, values, row_splits, weights (forward)
// `first` is the position of params (1 in the gradient ops, after grad).
struct CoreArgs {
  pkm::Table table;
  pkm::Bags bags;
  ::tensorflow::TensorShape out_shape;  // forward output: leading dims + [D]
  const ::tensorflow::Tensor* weights = nullptr;
};

inline ::tensorflow::Status ToTf(const pkm::Status& s) {
  return s.ok ? ::tensorflow::Status() : ::tensorflow::errors::InvalidArgument(s.message);
}

inline pkm::Dims DimsOf(const ::tensorflow::TensorShape& shape) {
  pkm::Dims dims(shape.dims());
  for (int i = 0; i < shape.dims(); ++i) dims[i] = shape.dim_size(i);
  return dims;
}

// The core's shape rules (kernels/core/shape_rules.h) on the tensors' shapes,
// so the TF kernels, the shape functions and the XLA lowering (kernels/xla,
// which sees shapes at compile time) reject the same inputs with the same
// messages as every other runtime. `splits` is null for the dense layout.
// Fills out_shape: the forward output.
inline ::tensorflow::Status CheckShapes(const OpAttrs& attrs, const ::tensorflow::TensorShape& params,
                                        const ::tensorflow::TensorShape& indices,
                                        const ::tensorflow::TensorShape* splits,
                                        const ::tensorflow::TensorShape& weights,
                                        ::tensorflow::TensorShape* out_shape) {
  pkm::BagShapes shapes;
  shapes.params = DimsOf(params);
  shapes.indices = DimsOf(indices);
  if (splits != nullptr) shapes.row_splits = DimsOf(*splits);
  shapes.weights = DimsOf(weights);
  shapes.ragged = attrs.ragged;
  shapes.has_weights = attrs.has_weights;
  shapes.combiner = attrs.combiner;
  if (attrs.ragged && splits == nullptr)
    return ::tensorflow::errors::InvalidArgument("row_splits must be a non-empty vector ([num_bags + 1]), got none");
  pkm::MaybeDims out;
  TF_RETURN_IF_ERROR(ToTf(pkm::ForwardShape(shapes, &out)));
  return ::tensorflow::TensorShape::BuildTensorShape(*out, out_shape);
}

// The table fields of params (shape already checked).
inline void FillTable(const ::tensorflow::Tensor& params, pkm::ElemType type, pkm::Table* table) {
  table->data = params.data();
  table->type = type;
  table->num_rows = params.dim_size(0);
  table->dim = params.dim_size(1);
}

// The bag fields of the ids (dense indices, or ragged values + row splits)
// and weights, shapes already checked: shared by the float and the int8 ops.
inline void FillBags(const OpAttrs& attrs, const ::tensorflow::Tensor& indices, const ::tensorflow::Tensor* splits,
                     const ::tensorflow::Tensor& weights, CoreArgs* args) {
  pkm::Bags& b = args->bags;
  b.indices = indices.data();
  b.indices_int64 = indices.dtype() == ::tensorflow::DT_INT64;
  b.weights = attrs.has_weights ? weights.data() : nullptr;
  b.weights_type = ElemTypeOf(weights.dtype());
  args->weights = &weights;
  if (attrs.ragged) {
    b.row_splits = splits->data();
    b.row_splits_int64 = splits->dtype() == ::tensorflow::DT_INT64;
    b.num_bags = splits->dim_size(0) - 1;
    b.num_values = indices.dim_size(0);
  } else {
    ::tensorflow::TensorShape leading = indices.shape();  // a valid shape: no overflow
    leading.RemoveLastDims(1);
    b.num_bags = leading.num_elements();
    b.bag_size = indices.dim_size(indices.dims() - 1);
  }
}

// `variable_params`, when set, is the table read from a resource variable
// (input `first` is then the variable's handle).
inline ::tensorflow::Status BuildCoreArgs(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                                          int first, CoreArgs* args,
                                          const ::tensorflow::Tensor* variable_params = nullptr) {
  using ::tensorflow::errors::InvalidArgument;
  const ::tensorflow::Tensor& params = variable_params ? *variable_params : ctx->input(first);
  const ::tensorflow::Tensor& indices = ctx->input(first + 1);
  const ::tensorflow::Tensor& weights = ctx->input(first + (attrs.ragged ? 3 : 2));
  const ::tensorflow::Tensor* splits = attrs.ragged ? &ctx->input(first + 2) : nullptr;
  TF_RETURN_IF_ERROR(CheckShapes(attrs, params.shape(), indices.shape(), splits ? &splits->shape() : nullptr,
                                 weights.shape(), &args->out_shape));
  FillTable(params, ElemTypeOf(params.dtype()), &args->table);
  FillBags(attrs, indices, splits, weights, args);
  return ::tensorflow::Status();
}

// Every gradient op's arguments (input 0 is grad, params follow): the core
// arguments, and grad shaped like the forward output.
inline ::tensorflow::Status BuildGradCoreArgs(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                                              CoreArgs* args,
                                              const ::tensorflow::Tensor* variable_params = nullptr) {
  TF_RETURN_IF_ERROR(BuildCoreArgs(ctx, attrs, /*first=*/1, args, variable_params));
  return ToTf(pkm::GradShape(DimsOf(ctx->input(0).shape()), DimsOf(args->out_shape)));
}

// A large output's buffer kept by its kernel and handed out again on the next
// call (CPU dense table gradients). glibc maps every allocation of 32 MB or
// more afresh and the OS zero-fills those pages on first touch: with a dense
// d_params of a 128 MB table kept, forward+backward took 0.55x the time on the
// 2-core EPYC (bench/results/cpu_gradient_buffer.md). The buffer is reused
// only when this kernel holds its sole reference (the call that returned it is
// over and its consumers have dropped it), so nothing can still read the
// previous values; a kernel keeps at most one buffer, of the last shape it was
// asked for. Outputs in a ScopedAllocator's shared buffer are never kept.
// PKM_KEEP_GRADIENT_BUFFER=0 turns this off.
class KeptOutput {
 public:
  static constexpr int64_t kMinBytes = int64_t{32} << 20;

  ::tensorflow::Status Allocate(::tensorflow::OpKernelContext* ctx, int index, const ::tensorflow::TensorShape& shape,
                                ::tensorflow::Tensor** out) {
    const ::tensorflow::DataType dtype = ctx->expected_output_dtype(index);
    const ::tensorflow::AllocatorAttributes attr = ctx->output_alloc_attr(index);
    if (!Enabled() || attr.scope_id != 0 || shape.num_elements() * ::tensorflow::DataTypeSize(dtype) < kMinBytes)
      return ctx->allocate_output(index, shape, out);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (kept_.IsInitialized() && kept_.RefCountIsOne()) {
        if (kept_.dtype() == dtype && kept_.shape() == shape && kept_attr_ == attr.value) {
          ctx->set_output(index, kept_);
          *out = ctx->mutable_output(index);
          return ::tensorflow::Status();
        }
        kept_ = ::tensorflow::Tensor();  // idle but of another kind: freed before the new one is allocated
      }
    }
    TF_RETURN_IF_ERROR(ctx->allocate_output(index, shape, out));
    std::lock_guard<std::mutex> lock(mu_);
    kept_ = **out;
    kept_attr_ = attr.value;
    return ::tensorflow::Status();
  }

 private:
  static bool Enabled() {
    static const bool enabled = [] {
      const char* v = std::getenv("PKM_KEEP_GRADIENT_BUFFER");
      return v == nullptr || v[0] != '0';
    }();
    return enabled;
  }

  std::mutex mu_;
  ::tensorflow::Tensor kept_;
  uint32_t kept_attr_ = 0;
};

// The dense gradient ops' arguments and outputs, shared by both devices:
// d_params shaped like params (through `kept` where given) and d_weights like
// weights.
inline ::tensorflow::Status BuildGradArgs(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                                          CoreArgs* args, ::tensorflow::Tensor** d_params,
                                          ::tensorflow::Tensor** d_weights, KeptOutput* kept) {
  TF_RETURN_IF_ERROR(BuildGradCoreArgs(ctx, attrs, args));
  if (kept != nullptr) TF_RETURN_IF_ERROR(kept->Allocate(ctx, 0, ctx->input(1).shape(), d_params));
  else TF_RETURN_IF_ERROR(ctx->allocate_output(0, ctx->input(1).shape(), d_params));
  return ctx->allocate_output(1, args->weights->shape(), d_weights);
}

namespace internal {

// Blocks of one ParallelFor call, claimed one at a time by whichever thread is
// free. Shared with the pool's tasks, which may start after the call returned.
struct ClaimedBlocks {
  std::atomic<int64_t> next{0}, done{0};
  int64_t count = 0, size = 0, total = 0;
  const pkm::RangeFn* fn = nullptr;  // read only by a thread holding an unfinished block
};

inline void RunClaimedBlocks(ClaimedBlocks* blocks) {
  for (int64_t b; (b = blocks->next.fetch_add(1, std::memory_order_relaxed)) < blocks->count;) {
    const int64_t begin = b * blocks->size;
    (*blocks->fn)(begin, std::min(blocks->total, begin + blocks->size));
    blocks->done.fetch_add(1, std::memory_order_release);
  }
}

// Pool threads that, having helped a forward, stay awake a while (spinning,
// yielding the CPU at each turn) and join the next forward's blocks as soon as
// it publishes them, as an OpenMP runtime's threads spin after a parallel region. Waking a parked pool
// thread costs the caller the wake-up call and then the wake-up latency; on
// the 2-core Xeon VM of round 23, Schedule() took ~40 us of the calling
// thread's CPU and the helper started ~60 us after it, against ~30 us of
// work per block of a 64-bag int8 forward (bench/results/tf_forward_linger_notes.md).
// One set for every pool: a helper may run another pool's caller's blocks,
// which is only a matter of which thread does them.
class LingeringHelpers {
 public:
  static LingeringHelpers& Get() {
    static LingeringHelpers* helpers = new LingeringHelpers;  // never destroyed: pool threads may outlive statics
    return *helpers;
  }

  // Makes `blocks` the job lingering helpers join; returns how many linger now.
  int64_t Publish(const std::shared_ptr<ClaimedBlocks>& blocks) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = blocks;
      seq_.fetch_add(1, std::memory_order_release);
    }
    return lingering_.load(std::memory_order_acquire);
  }

  // Called by the publisher once every block is done.
  void Withdraw(const ClaimedBlocks* blocks) {
    std::lock_guard<std::mutex> lock(mu_);
    if (job_.get() == blocks) job_.reset();
  }

  // A pool task: helps with `blocks`, then lingers up to `linger_us` for the
  // next published job (the wait restarts after each job it helps with).
  void HelpThenLinger(std::shared_ptr<ClaimedBlocks> blocks, int64_t linger_us) {
    RunClaimedBlocks(blocks.get());
    blocks.reset();
    if (linger_us <= 0) return;
    uint64_t seen = seq_.load(std::memory_order_acquire);
    lingering_.fetch_add(1, std::memory_order_acq_rel);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(linger_us);
    for (int spins = 0;; ++spins) {
      if (seq_.load(std::memory_order_acquire) != seen) {
        std::shared_ptr<ClaimedBlocks> job;
        {
          std::lock_guard<std::mutex> lock(mu_);
          job = job_;
          seen = seq_.load(std::memory_order_relaxed);
        }
        if (job != nullptr) {
          lingering_.fetch_sub(1, std::memory_order_acq_rel);
          RunClaimedBlocks(job.get());
          job.reset();
          lingering_.fetch_add(1, std::memory_order_acq_rel);
          deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(linger_us);
        }
        continue;
      }
      if (spins % 8 == 0 && std::chrono::steady_clock::now() >= deadline) break;
      // Yield, not pause: under a served load the other threads of a saturated
      // CPU run in the spinner's place (with pause, gRPC QPS at batch 64 fell
      // 0-10% against no lingering; with yield it was 0-9% above it).
      std::this_thread::yield();
    }
    lingering_.fetch_sub(1, std::memory_order_acq_rel);
  }

 private:
  std::mutex mu_;
  std::shared_ptr<ClaimedBlocks> job_;  // guarded by mu_
  std::atomic<uint64_t> seq_{0};        // bumped at each Publish
  std::atomic<int64_t> lingering_{0};
};

// How long a forward's helpers linger (PKM_FORWARD_LINGER_US, read at each
// call; 0 parks them at once as before).
inline int64_t ForwardLingerMicros() {
  const char* value = std::getenv("PKM_FORWARD_LINGER_US");
  return value != nullptr ? std::max<int64_t>(0, std::atoll(value)) : 200;
}

}  // namespace internal

// The core's ParallelFor on TF's intra-op CPU thread pool.
inline pkm::ParallelFor TfParallelFor(::tensorflow::OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers](int64_t total, int64_t cost_per_unit, const pkm::RangeFn& fn) {
    if (total <= 0) return;
    workers->ParallelFor(total, cost_per_unit, [&fn](int64_t begin, int64_t end) { fn(begin, end); });
  };
}

// The forward's ParallelFor: the range is cut into blocks that the calling
// thread claims from the start and the pool's threads join as they come; the
// caller waits only for blocks already running elsewhere. TF's ParallelFor
// hands a share of the range to a pool thread and waits for that thread to
// get to it, so a late wake-up was on every forward's path (on the 2-core EPYC
// VM, bench/results/tf_parallel_for_ab.md: claimed blocks 5-25% faster at
// 16-64 bags of 128 rows). Helpers linger after their blocks
// (LingeringHelpers), so a forward that follows closely is joined at once.
// Blocks: at least 4 a thread (a block left to a late thread is short), up
// to 16 a thread for long calls (about a million cost units each), none under
// kBlockCost. The backward keeps TfParallelFor (a forward + backward at 64
// bags measured 0.94-1.14x TF's time with claimed blocks there too: no gain
// shown). PKM_TF_PARALLEL_FOR=tf (read at each call) uses TfParallelFor here too.
inline pkm::ParallelFor TfForwardParallelFor(::tensorflow::OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers, tf_pool = TfParallelFor(ctx)](int64_t total, int64_t cost_per_unit, const pkm::RangeFn& fn) {
    if (total <= 0) return;
    const char* choice = std::getenv("PKM_TF_PARALLEL_FOR");
    if (choice != nullptr && std::strcmp(choice, "tf") == 0) {
      tf_pool(total, cost_per_unit, fn);
      return;
    }
    constexpr int64_t kBlockCost = 40000, kLongBlockCost = 1000000;
    const int64_t cost = total * std::max<int64_t>(cost_per_unit, 1);
    const int64_t threads = workers->NumThreads();
    const int64_t per_long_call = std::clamp<int64_t>(cost / kLongBlockCost, 4 * threads, 16 * threads);
    const int64_t wanted = std::min({total, std::max<int64_t>(1, cost / kBlockCost), per_long_call});
    if (wanted <= 1 || threads <= 1) {
      fn(0, total);
      return;
    }
    auto blocks = std::make_shared<internal::ClaimedBlocks>();
    blocks->size = (total + wanted - 1) / wanted;
    blocks->count = (total + blocks->size - 1) / blocks->size;
    blocks->total = total;
    blocks->fn = &fn;
    auto& helpers = internal::LingeringHelpers::Get();
    const int64_t linger_us = internal::ForwardLingerMicros();
    const int64_t lingering = linger_us > 0 ? helpers.Publish(blocks) : 0;
    for (int64_t h = lingering; h < std::min(threads - 1, blocks->count - 1); ++h)
      workers->Schedule([blocks, linger_us] { internal::LingeringHelpers::Get().HelpThenLinger(blocks, linger_us); });
    internal::RunClaimedBlocks(blocks.get());
    // Every block is claimed now; at most one per other thread is still running.
    while (blocks->done.load(std::memory_order_acquire) < blocks->count) std::this_thread::yield();
    if (linger_us > 0) helpers.Withdraw(blocks.get());
  };
}

// Base of the forward and gradient kernels on every device: reads the attrs.
class EmbeddingBagKernelBase : public ::tensorflow::OpKernel {
 public:
  EmbeddingBagKernelBase(::tensorflow::OpKernelConstruction* ctx, bool ragged) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadAttrs(ctx, ragged, &attrs_));
  }

 protected:
  OpAttrs attrs_;
};

// A kernel class taking (ctx, ragged) bound to one layout, as
// REGISTER_KERNEL_BUILDER needs a constructor of ctx alone.
template <class Kernel, bool kRagged>
class WithLayout : public Kernel {
 public:
  explicit WithLayout(::tensorflow::OpKernelConstruction* ctx) : Kernel(ctx, kRagged) {}
};

}  // namespace pkm_tf

#endif  // PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_
