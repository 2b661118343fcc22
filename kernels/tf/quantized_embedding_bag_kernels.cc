// CPU kernels of the PkmQuantizedEmbeddingBag ops: the float ops' forward
// template and CPU backend (the core dispatches on the int8 table) with the
// int8 ops' argument translation.
#include "kernels/tf/embedding_bag_cpu_backend.h"
#include "kernels/tf/embedding_bag_kernel_template.h"
#include "kernels/tf/quantized_embedding_bag_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"

namespace pkm_tf {
namespace {

class QuantizedEmbeddingBagOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(::tensorflow::OpKernelContext* ctx) override {
    ComputeForward<CpuBackend>(ctx, attrs_, [&](CoreArgs* args) { return BuildQuantizedCoreArgs(ctx, attrs_, args); });
  }
};

}  // namespace

PKM_REGISTER_LAYOUTS("PkmQuantizedEmbeddingBag", "PkmQuantizedRaggedEmbeddingBag", ::tensorflow::DEVICE_CPU,
                     QuantizedEmbeddingBagOp);

}  // namespace pkm_tf
