// GPU kernel of PkmEmbeddingBagFusedUpdate (fused_optimizer_ops.cc): the same
// checks (fused_optimizer_common.h), then pkm_cuda_fused_update on TF's stream
// with a TF-allocated workspace. Compiled into _pkm_ops_gpu.so with
// -DGOOGLE_CUDA=1 (make gpu); empty without it. Like the other GPU kernels it
// compiles and links here but has not run inside TF on a GPU (the GPU machine
// has no TF): the launcher it calls is tested there through the C ABI.
#if GOOGLE_CUDA

#include "kernels/cuda/embedding_bag_cuda.h"
#include "kernels/tf/fused_optimizer_common.h"
#include "tensorflow/core/framework/device_base.h"
#include "xla/stream_executor/stream.h"

namespace pkm_tf {
namespace {

class GpuFusedUpdateOp : public FusedUpdateKernelBase {
 public:
  using FusedUpdateKernelBase::FusedUpdateKernelBase;

  void Compute(::tensorflow::OpKernelContext* ctx) override {
    ::tensorflow::DeviceContext* device_context = ctx->op_device_context();
    OP_REQUIRES(ctx, device_context != nullptr && device_context->stream() != nullptr,
                ::tensorflow::errors::Internal("PkmEmbeddingBagFusedUpdate GPU kernel: no GPU stream"));
    auto* se_stream = device_context->stream();
    auto copy = [se_stream](const ::tensorflow::Tensor& from, ::tensorflow::Tensor* to) {
      stream_executor::DeviceMemoryBase dst(to->data(), to->TotalBytes());
      stream_executor::DeviceMemoryBase src(const_cast<void*>(from.data()), from.TotalBytes());
      return se_stream->MemcpyD2D(&dst, src, from.TotalBytes());
    };
    LockedVariables vars;
    CoreArgs args;
    PkmRowOptimizer opt;
    ::tensorflow::Tensor* d_weights = nullptr;
    OP_REQUIRES_OK(ctx, Prepare(ctx, copy, &vars, &args, &opt, &d_weights));
    const PkmBags bags = pkm::ToBagProblem(args.table, args.bags, attrs_.combiner);
    const size_t ws_bytes = pkm_cuda_fused_update_workspace_bytes(&bags, nullptr);
    ::tensorflow::Tensor workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(::tensorflow::DT_UINT8,
                                           ::tensorflow::TensorShape({static_cast<int64_t>(ws_bytes)}), &workspace));
    const auto stream = static_cast<pkm_cuda_stream_t>(se_stream->platform_specific_handle().stream);
    const int code = pkm_cuda_fused_update(&bags, ctx->input(0).data(), &opt,
                                           attrs_.has_weights ? d_weights->data() : nullptr, workspace.data(),
                                           ws_bytes, nullptr, stream);
    OP_REQUIRES(ctx, code == PKM_CUDA_OK,
                code == PKM_CUDA_INVALID_ARGUMENT
                    ? ::tensorflow::errors::InvalidArgument(pkm_cuda_last_error())
                    : ::tensorflow::errors::Internal("PkmEmbeddingBagFusedUpdate CUDA launch failed: ",
                                                     pkm_cuda_last_error()));
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("PkmEmbeddingBagFusedUpdate")
                            .Device(::tensorflow::DEVICE_GPU)
                            .HostMemory("learning_rate")
                            .HostMemory("step"),
                        GpuFusedUpdateOp);

}  // namespace pkm_tf

#endif  // GOOGLE_CUDA
