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

// ---- row-sparse gradient kernels ----------------------------------------------

namespace pkm_tf {
namespace {

class EmbeddingBagSparseGradOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    OP_REQUIRES_OK(ctx, BuildCoreArgs(ctx, attrs_, /*first=*/1, &args));
    const Tensor& grad = ctx->input(0);
    OP_REQUIRES(ctx, grad.shape() == args.out_shape,
                ::tensorflow::errors::InvalidArgument("grad must have the forward output's shape ",
                                                      args.out_shape.DebugString(), ", got ",
                                                      grad.shape().DebugString()));
    Tensor* d_weights = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, args.weights->shape(), &d_weights));
    const int64_t dim = args.table.dim;
    // The core knows the number of touched rows only after grouping.
    auto alloc = [ctx, dim](int64_t num_rows, int64_t** rows, void** row_grads) {
      Tensor *rows_t = nullptr, *grads_t = nullptr;
      ::tensorflow::Status s = ctx->allocate_output(0, ::tensorflow::TensorShape({num_rows}), &rows_t);
      if (s.ok()) s = ctx->allocate_output(1, ::tensorflow::TensorShape({num_rows, dim}), &grads_t);
      if (!s.ok()) return pkm::Status::Error(std::string(s.message()));
      *rows = reinterpret_cast<int64_t*>(rows_t->data());
      *row_grads = grads_t->data();
      return pkm::Status::Ok();
    };
    OP_REQUIRES_OK(ctx, ToTf(pkm::SparseBackward(args.table, args.bags, attrs_.combiner, grad.data(),
                                                 args.table.type, alloc, args.table.type,
                                                 attrs_.has_weights ? d_weights->data() : nullptr,
                                                 TfParallelFor(ctx))));
  }
};

}  // namespace

#define PKM_REGISTER_SPARSE_GRAD_KERNELS(DEVICE, KERNEL, T)                                          \
  REGISTER_KERNEL_BUILDER(Name("PkmEmbeddingBagSparseGrad").Device(DEVICE).TypeConstraint<T>("T"),   \
                          ::pkm_tf::WithLayout<KERNEL, false>);                                      \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("PkmRaggedEmbeddingBagSparseGrad").Device(DEVICE).TypeConstraint<T>("T"),                 \
      ::pkm_tf::WithLayout<KERNEL, true>)

PKM_REGISTER_SPARSE_GRAD_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagSparseGradOp, float);
PKM_REGISTER_SPARSE_GRAD_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagSparseGradOp, ::Eigen::half);
PKM_REGISTER_SPARSE_GRAD_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagSparseGradOp, ::tensorflow::bfloat16);

}  // namespace pkm_tf
