// GPU kernels of the PkmEmbeddingBag ops: the same argument translation as
// the CPU kernels (embedding_bag_common.h), then the plain C launchers of
// kernels/cuda on TF's device pointers and TF's CUDA stream. Compiled into
// _pkm_ops_gpu.so with -DGOOGLE_CUDA=1 (make gpu); without it this file is
// empty, so the CPU-only library is unchanged.
//
// GPU behaviour for an index >= num_rows: treated as padding (never read);
// the device cannot raise InvalidArgument without a host round trip per call.
#if GOOGLE_CUDA

#include <string>

#include "kernels/cuda/embedding_bag_cuda.h"
#include "kernels/tf/embedding_bag_common.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "xla/stream_executor/stream.h"

namespace pkm_tf {

using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

namespace {

::tensorflow::Status GpuStream(OpKernelContext* ctx, pkm_cuda_stream_t* stream) {
  ::tensorflow::DeviceContext* device_context = ctx->op_device_context();
  if (device_context == nullptr || device_context->stream() == nullptr)
    return ::tensorflow::errors::Internal("PkmEmbeddingBag GPU kernel: no GPU stream");
  *stream = static_cast<pkm_cuda_stream_t>(
      device_context->stream()->platform_specific_handle().stream);
  return ::tensorflow::Status();
}

::tensorflow::Status FromLauncher(int code) {
  if (code == PKM_CUDA_OK) return ::tensorflow::Status();
  if (code == PKM_CUDA_INVALID_ARGUMENT)
    return ::tensorflow::errors::InvalidArgument(pkm_cuda_last_error());
  return ::tensorflow::errors::Internal("PkmEmbeddingBag CUDA launch failed: ", pkm_cuda_last_error());
}

class GpuEmbeddingBagOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    OP_REQUIRES_OK(ctx, BuildCoreArgs(ctx, attrs_, /*first=*/0, &args));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, args.out_shape, &out));
    if (out->NumElements() == 0) return;
    pkm_cuda_stream_t stream;
    OP_REQUIRES_OK(ctx, GpuStream(ctx, &stream));
    const PkmBags bags = pkm::ToBagProblem(args.table, args.bags, attrs_.combiner);
    OP_REQUIRES_OK(ctx, FromLauncher(pkm_cuda_forward(&bags, out->data(), nullptr, stream)));
  }
};

class GpuEmbeddingBagGradOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    Tensor *d_params = nullptr, *d_weights = nullptr;
    OP_REQUIRES_OK(ctx, BuildGradArgs(ctx, attrs_, &args, &d_params, &d_weights));
    const Tensor& grad = ctx->input(0);
    pkm_cuda_stream_t stream;
    OP_REQUIRES_OK(ctx, GpuStream(ctx, &stream));
    const PkmBags bags = pkm::ToBagProblem(args.table, args.bags, attrs_.combiner);
    const size_t workspace_bytes = pkm_cuda_backward_workspace_bytes(&bags, nullptr);
    Tensor workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8,
                                           ::tensorflow::TensorShape({static_cast<int64_t>(workspace_bytes)}),
                                           &workspace));
    void* d_weights_data = attrs_.has_weights && d_weights->NumElements() > 0 ? d_weights->data() : nullptr;
    void* d_params_data = d_params->NumElements() > 0 ? d_params->data() : nullptr;
    OP_REQUIRES_OK(ctx, FromLauncher(pkm_cuda_backward(&bags, grad.data(), d_params_data, d_weights_data,
                                                       workspace.data(), workspace_bytes, nullptr,
                                                       stream)));
  }
};

// Row-sparse gradient: the launcher reads the touched-row count (one stream
// synchronisation) and allocates rows / row_grads through this callback.
class GpuEmbeddingBagSparseGradOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    OP_REQUIRES_OK(ctx, BuildGradCoreArgs(ctx, attrs_, &args));
    const Tensor& grad = ctx->input(0);
    Tensor* d_weights = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, args.weights->shape(), &d_weights));
    pkm_cuda_stream_t stream;
    OP_REQUIRES_OK(ctx, GpuStream(ctx, &stream));
    const PkmBags bags = pkm::ToBagProblem(args.table, args.bags, attrs_.combiner);
    const size_t workspace_bytes = pkm_cuda_sparse_backward_workspace_bytes(&bags, nullptr);
    Tensor workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_INT8,
                                           ::tensorflow::TensorShape({static_cast<int64_t>(workspace_bytes)}),
                                           &workspace));
    AllocContext alloc_ctx{ctx, args.table.dim, ::tensorflow::Status()};
    void* d_weights_data = attrs_.has_weights && d_weights->NumElements() > 0 ? d_weights->data() : nullptr;
    const int code = pkm_cuda_sparse_backward(&bags, grad.data(), &AllocOutputs, &alloc_ctx, d_weights_data,
                                              workspace.data(), workspace_bytes, nullptr, stream);
    OP_REQUIRES_OK(ctx, alloc_ctx.status);
    OP_REQUIRES_OK(ctx, FromLauncher(code));
  }

 private:
  struct AllocContext {
    OpKernelContext* ctx;
    int64_t dim;
    ::tensorflow::Status status;
  };
  static int AllocOutputs(void* opaque, int64_t num_rows, int64_t** rows, void** row_grads) {
    auto* a = static_cast<AllocContext*>(opaque);
    Tensor *rows_t = nullptr, *grads_t = nullptr;
    a->status = a->ctx->allocate_output(0, ::tensorflow::TensorShape({num_rows}), &rows_t);
    if (a->status.ok())
      a->status = a->ctx->allocate_output(1, ::tensorflow::TensorShape({num_rows, a->dim}), &grads_t);
    if (!a->status.ok()) return 1;
    *rows = num_rows > 0 ? reinterpret_cast<int64_t*>(rows_t->data()) : nullptr;
    *row_grads = grads_t->NumElements() > 0 ? grads_t->data() : nullptr;
    return 0;
  }
};

}  // namespace

#define PKM_REGISTER_GPU_SPARSE_GRAD(T)                                                                \
  REGISTER_KERNEL_BUILDER(                                                                             \
      Name("PkmEmbeddingBagSparseGrad").Device(::tensorflow::DEVICE_GPU).TypeConstraint<T>("T"),       \
      ::pkm_tf::WithLayout<GpuEmbeddingBagSparseGradOp, false>);                                       \
  REGISTER_KERNEL_BUILDER(                                                                             \
      Name("PkmRaggedEmbeddingBagSparseGrad").Device(::tensorflow::DEVICE_GPU).TypeConstraint<T>("T"), \
      ::pkm_tf::WithLayout<GpuEmbeddingBagSparseGradOp, true>)
PKM_REGISTER_GPU_SPARSE_GRAD(float);
PKM_REGISTER_GPU_SPARSE_GRAD(::Eigen::half);
PKM_REGISTER_GPU_SPARSE_GRAD(::tensorflow::bfloat16);

PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_GPU, GpuEmbeddingBagOp, GpuEmbeddingBagGradOp, float);
PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_GPU, GpuEmbeddingBagOp, GpuEmbeddingBagGradOp,
                                   ::Eigen::half);
PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_GPU, GpuEmbeddingBagOp, GpuEmbeddingBagGradOp,
                                   ::tensorflow::bfloat16);

}  // namespace pkm_tf

#endif  // GOOGLE_CUDA
