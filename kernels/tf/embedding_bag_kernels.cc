// CPU kernels of the PkmEmbeddingBag ops: the kernel templates
// (embedding_bag_kernel_template.h) on a backend that runs the core on TF's
// intra-op thread pool; core errors become InvalidArgument. Also the kernels
// that read the table from a resource variable (CPU only).
#include "kernels/core/embedding_bag.h"
#include "kernels/tf/embedding_bag_cpu_backend.h"
#include "kernels/tf/embedding_bag_kernel_template.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace pkm_tf {
namespace {

using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

// Runs fn(table) on the variable behind input `input`, under its shared lock
// (as ResourceGather reads: no copy of the table, whatever its copy-on-read mode).
template <typename Fn>
void WithVariableTable(OpKernelContext* ctx, int input, ::tensorflow::DataType dtype, Fn fn) {
  ::tensorflow::core::RefCountPtr<::tensorflow::Var> var;
  OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, input), &var));
  ::tensorflow::tf_shared_lock lock(*var->mu());
  const Tensor* params = var->tensor();
  OP_REQUIRES(ctx, var->is_initialized && params->IsInitialized(),
              ::tensorflow::errors::FailedPrecondition("the table variable is not initialised"));
  OP_REQUIRES(ctx, params->dtype() == dtype,
              ::tensorflow::errors::InvalidArgument("the table variable holds ",
                                                    ::tensorflow::DataTypeString(params->dtype()),
                                                    ", the op expects ", ::tensorflow::DataTypeString(dtype)));
  fn(params);
}

// A kernel of the dense layout whose table is the resource variable in input
// `kTableInput` (of attr dtype): the forward (input 0) and the row-sparse
// gradient (input 1, after grad).
template <int kTableInput>
class ResourceKernel : public EmbeddingBagKernelBase {
 public:
  explicit ResourceKernel(::tensorflow::OpKernelConstruction* ctx) : EmbeddingBagKernelBase(ctx, /*ragged=*/false) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
  }
  void Compute(OpKernelContext* ctx) override {
    WithVariableTable(ctx, kTableInput, dtype_, [&](const Tensor* params) {
      if constexpr (kTableInput == 0) {
        ComputeForward<CpuBackend>(ctx, attrs_,
                                   [&](CoreArgs* args) { return BuildCoreArgs(ctx, attrs_, 0, args, params); });
      } else {
        ComputeSparseGrad<CpuBackend>(ctx, attrs_, params);
      }
    });
  }

 private:
  ::tensorflow::DataType dtype_;
};

}  // namespace

PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_CPU, CpuBackend);

#define PKM_REGISTER_RESOURCE_KERNELS(T)                                                                     \
  REGISTER_KERNEL_BUILDER(                                                                                   \
      Name("PkmResourceEmbeddingBag").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("dtype"),           \
      ResourceKernel<0>);                                                                                    \
  REGISTER_KERNEL_BUILDER(                                                                                   \
      Name("PkmResourceEmbeddingBagSparseGrad").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("dtype"), \
      ResourceKernel<1>)

PKM_REGISTER_RESOURCE_KERNELS(float);
PKM_REGISTER_RESOURCE_KERNELS(::Eigen::half);
PKM_REGISTER_RESOURCE_KERNELS(::tensorflow::bfloat16);

}  // namespace pkm_tf
