// CPU kernels of the PkmEmbeddingBag ops: translate tensors, run the core on
// TF's intra-op thread pool, turn core errors into InvalidArgument.
#include "kernels/core/embedding_bag.h"
#include "kernels/tf/embedding_bag_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/util/work_sharder.h"

namespace pkm_tf {

using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

namespace {

pkm::ParallelFor TfParallelFor(OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers](int64_t total, int64_t cost_per_unit, const pkm::RangeFn& fn) {
    if (total <= 0) return;
    workers->ParallelFor(total, cost_per_unit, [&fn](int64_t begin, int64_t end) { fn(begin, end); });
  };
}

class EmbeddingBagOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    OP_REQUIRES_OK(ctx, BuildCoreArgs(ctx, attrs_, /*first=*/0, &args));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, args.out_shape, &out));
    OP_REQUIRES_OK(ctx, ToTf(pkm::Forward(args.table, args.bags, attrs_.combiner, out->data(),
                                          args.table.type, TfParallelFor(ctx))));
  }
};

class EmbeddingBagGradOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    Tensor *d_params = nullptr, *d_weights = nullptr;
    OP_REQUIRES_OK(ctx, BuildGradArgs(ctx, attrs_, &args, &d_params, &d_weights));
    const Tensor& grad = ctx->input(0);
    OP_REQUIRES_OK(ctx, ToTf(pkm::Backward(args.table, args.bags, attrs_.combiner, grad.data(),
                                           args.table.type, d_params->data(), args.table.type,
                                           attrs_.has_weights ? d_weights->data() : nullptr,
                                           TfParallelFor(ctx))));
  }
};

}  // namespace

PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagOp, EmbeddingBagGradOp, float);
PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagOp, EmbeddingBagGradOp, ::Eigen::half);
PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagOp, EmbeddingBagGradOp,
                                   ::tensorflow::bfloat16);

}  // namespace pkm_tf
