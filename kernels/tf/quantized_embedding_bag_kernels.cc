// CPU kernels of the PkmQuantizedEmbeddingBag ops: translate tensors, run the
// core (its int8 forward) on TF's intra-op thread pool.
#include "kernels/core/embedding_bag.h"
#include "kernels/tf/quantized_embedding_bag_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"

namespace pkm_tf {
namespace {

using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

class QuantizedEmbeddingBagOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    OP_REQUIRES_OK(ctx, BuildQuantizedCoreArgs(ctx, attrs_, &args));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, args.out_shape, &out));
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    pkm::ParallelFor pf = [workers](int64_t total, int64_t cost, const pkm::RangeFn& fn) {
      if (total > 0) workers->ParallelFor(total, cost, [&fn](int64_t b, int64_t e) { fn(b, e); });
    };
    OP_REQUIRES_OK(ctx, ToTf(pkm::Forward(args.table, args.bags, attrs_.combiner, out->data(),
                                          ElemTypeOf(out->dtype()), pf)));
  }
};

}  // namespace

#define PKM_REGISTER_QUANTIZED_KERNELS(T)                                                           \
  REGISTER_KERNEL_BUILDER(                                                                          \
      Name("PkmQuantizedEmbeddingBag").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),     \
      ::pkm_tf::WithLayout<QuantizedEmbeddingBagOp, false>);                                        \
  REGISTER_KERNEL_BUILDER(                                                                          \
      Name("PkmQuantizedRaggedEmbeddingBag").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      ::pkm_tf::WithLayout<QuantizedEmbeddingBagOp, true>)

PKM_REGISTER_QUANTIZED_KERNELS(float);
PKM_REGISTER_QUANTIZED_KERNELS(::Eigen::half);
PKM_REGISTER_QUANTIZED_KERNELS(::tensorflow::bfloat16);

}  // namespace pkm_tf
