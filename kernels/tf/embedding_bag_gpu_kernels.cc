// GPU kernels of the PkmEmbeddingBag ops: the kernel templates
// (embedding_bag_kernel_template.h) on a backend that calls the plain C
// launchers of kernels/cuda on TF's device pointers and TF's CUDA stream.
// Compiled into _pkm_ops_gpu.so with -DGOOGLE_CUDA=1 (make gpu); without it
// this file is empty, so the CPU-only library is unchanged.
//
// GPU behaviour for an index >= num_rows: treated as padding (never read);
// the device cannot raise InvalidArgument without a host round trip per call.
#if GOOGLE_CUDA

#include <string>

#include "kernels/cuda/embedding_bag_cuda.h"
#include "kernels/tf/embedding_bag_common.h"
#include "kernels/tf/embedding_bag_kernel_template.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "xla/stream_executor/stream.h"

namespace pkm_tf {
namespace {

using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;

Status FromLauncher(int code) {
  if (code == PKM_CUDA_OK) return Status();
  if (code == PKM_CUDA_INVALID_ARGUMENT) return ::tensorflow::errors::InvalidArgument(pkm_cuda_last_error());
  return ::tensorflow::errors::Internal("PkmEmbeddingBag CUDA launch failed: ", pkm_cuda_last_error());
}

// What every launcher call takes: the C descriptor of the bags and TF's stream.
struct Launch {
  PkmBags bags;
  pkm_cuda_stream_t stream = nullptr;
};

Status PrepareLaunch(OpKernelContext* ctx, const OpAttrs& attrs, const CoreArgs& args, Launch* launch) {
  ::tensorflow::DeviceContext* device_context = ctx->op_device_context();
  if (device_context == nullptr || device_context->stream() == nullptr)
    return ::tensorflow::errors::Internal("PkmEmbeddingBag GPU kernel: no GPU stream");
  launch->stream = static_cast<pkm_cuda_stream_t>(device_context->stream()->platform_specific_handle().stream);
  launch->bags = pkm::ToBagProblem(args.table, args.bags, attrs.combiner);
  return Status();
}

// The launchers' scratch space as a TF temporary on the device.
Status AllocateWorkspace(OpKernelContext* ctx, size_t bytes, Tensor* workspace) {
  return ctx->allocate_temp(::tensorflow::DT_INT8, ::tensorflow::TensorShape({static_cast<int64_t>(bytes)}),
                            workspace);
}

// Launchers take null for an empty or absent buffer.
void* DataOrNull(Tensor* t, bool wanted = true) { return wanted && t->NumElements() > 0 ? t->data() : nullptr; }

struct GpuBackend {
  static Status Forward(OpKernelContext* ctx, const OpAttrs& attrs, const CoreArgs& args, Tensor* out) {
    if (out->NumElements() == 0) return Status();
    Launch l;
    TF_RETURN_IF_ERROR(PrepareLaunch(ctx, attrs, args, &l));
    return FromLauncher(pkm_cuda_forward(&l.bags, out->data(), nullptr, l.stream));
  }

  static Status Backward(OpKernelContext* ctx, const OpAttrs& attrs, const CoreArgs& args, const Tensor& grad,
                         Tensor* d_params, Tensor* d_weights) {
    Launch l;
    TF_RETURN_IF_ERROR(PrepareLaunch(ctx, attrs, args, &l));
    const size_t workspace_bytes = pkm_cuda_backward_workspace_bytes(&l.bags, nullptr);
    Tensor workspace;
    TF_RETURN_IF_ERROR(AllocateWorkspace(ctx, workspace_bytes, &workspace));
    return FromLauncher(pkm_cuda_backward(&l.bags, grad.data(), DataOrNull(d_params),
                                          DataOrNull(d_weights, attrs.has_weights), workspace.data(),
                                          workspace_bytes, nullptr, l.stream));
  }

  // The launcher reads the touched-row count (one stream synchronisation)
  // and allocates rows / row_grads through AllocOutputs.
  static Status SparseBackward(OpKernelContext* ctx, const OpAttrs& attrs, const CoreArgs& args, const Tensor& grad,
                               Tensor* d_weights) {
    Launch l;
    TF_RETURN_IF_ERROR(PrepareLaunch(ctx, attrs, args, &l));
    const size_t workspace_bytes = pkm_cuda_sparse_backward_workspace_bytes(&l.bags, nullptr);
    Tensor workspace;
    TF_RETURN_IF_ERROR(AllocateWorkspace(ctx, workspace_bytes, &workspace));
    AllocContext alloc_ctx{ctx, args.table.dim, Status()};
    const int code = pkm_cuda_sparse_backward(&l.bags, grad.data(), &AllocOutputs, &alloc_ctx,
                                              DataOrNull(d_weights, attrs.has_weights), workspace.data(),
                                              workspace_bytes, nullptr, l.stream);
    TF_RETURN_IF_ERROR(alloc_ctx.status);
    return FromLauncher(code);
  }

 private:
  struct AllocContext {
    OpKernelContext* ctx;
    int64_t dim;
    Status status;
  };
  static int AllocOutputs(void* opaque, int64_t num_rows, int64_t** rows, void** row_grads) {
    auto* a = static_cast<AllocContext*>(opaque);
    Tensor *rows_t = nullptr, *grads_t = nullptr;
    a->status = a->ctx->allocate_output(0, ::tensorflow::TensorShape({num_rows}), &rows_t);
    if (a->status.ok())
      a->status = a->ctx->allocate_output(1, ::tensorflow::TensorShape({num_rows, a->dim}), &grads_t);
    if (!a->status.ok()) return 1;
    *rows = num_rows > 0 ? reinterpret_cast<int64_t*>(rows_t->data()) : nullptr;
    *row_grads = DataOrNull(grads_t);
    return 0;
  }
};

}  // namespace

PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_GPU, GpuBackend);

}  // namespace pkm_tf

#endif  // GOOGLE_CUDA
