// tf2xla lowering of the two PkmQuantizedEmbeddingBag ops for XLA_CPU_JIT:
// each becomes one typed-FFI custom call into quantized_xla_cpu_targets.cc (the
// core's int8 forward), with the TF kernels' shape rules applied at compile
// time (CheckQuantizedShapes). Dense indices of any rank are reshaped to
// [B, K] and the output back to [..., D], as for the float ops.
#include <string>
#include <vector>

#include "kernels/tf/quantized_embedding_bag_common.h"
#include "kernels/xla/embedding_bag_xla_lowering.h"

extern "C" {
XLA_FFI_Error* pkm_xla_cpu_quantized_forward(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* pkm_xla_cpu_quantized_ragged_forward(XLA_FFI_CallFrame* frame);
}

namespace pkm_xla {

inline constexpr char kQuantizedForwardTarget[] = "pkm_quantized_embedding_bag_forward";
inline constexpr char kQuantizedRaggedForwardTarget[] = "pkm_quantized_ragged_embedding_bag_forward";

XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), kQuantizedForwardTarget, "Host",
                         pkm_xla_cpu_quantized_forward);
XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), kQuantizedRaggedForwardTarget, "Host",
                         pkm_xla_cpu_quantized_ragged_forward);

class QuantizedLowering : public ::tensorflow::XlaOpKernel {
 public:
  QuantizedLowering(::tensorflow::OpKernelConstruction* ctx, bool ragged) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ::pkm_tf::ReadAttrs(ctx, ragged, &attrs_));
  }

  void Compile(::tensorflow::XlaOpKernelContext* ctx) override {
    const bool ragged = attrs_.ragged;
    const int first = ::pkm_tf::kQuantizedBagsInput;
    const ::tensorflow::TensorShape params = ctx->InputShape(0), indices = ctx->InputShape(first);
    const ::tensorflow::TensorShape splits = ragged ? ctx->InputShape(first + 1) : ::tensorflow::TensorShape();
    ::tensorflow::TensorShape out_shape;
    std::vector<xla::XlaOp> bag_inputs;  // ids, row splits, weights: maybe sized at run time
    for (int i = first; i < ctx->num_inputs(); ++i) bag_inputs.push_back(ctx->Input(i));
    OP_REQUIRES_OK(ctx, WithRunTimeSizeNote(
                            ::pkm_tf::CheckQuantizedShapes(attrs_, params, ctx->InputShape(1), ctx->InputShape(2),
                                                           indices, ragged ? &splits : nullptr,
                                                           ctx->InputShape(first + (ragged ? 2 : 1)), &out_shape),
                            ctx->builder(), bag_inputs));
    const int64_t num_bags = NumBags(ragged, indices, splits);
    std::vector<xla::XlaOp> operands = {ctx->Input(0), ctx->Input(1), ctx->Input(2)};
    const BagSizes sizes = AppendBagOperands(ctx, attrs_, first, num_bags, &operands);
    std::vector<xla::Shape> operand_shapes;
    OP_REQUIRES_OK(ctx, RowMajorShapes(ctx, operands, &operand_shapes));
    const xla::Shape out =
        xla::ShapeUtil::MakeShapeWithDescendingLayout(ctx->output_xla_type(0), {num_bags, params.dim_size(1)});
    xla::XlaOp result = CallTarget(ctx, ragged ? kQuantizedRaggedForwardTarget : kQuantizedForwardTarget, attrs_,
                                   operands, operand_shapes, out);
    ctx->SetOutput(0, WithSizes(xla::Reshape(result, out_shape.dim_sizes()), sizes.out));
  }

 private:
  ::pkm_tf::OpAttrs attrs_;
};

template <bool kRagged>
class QuantizedLayout : public QuantizedLowering {
 public:
  explicit QuantizedLayout(::tensorflow::OpKernelConstruction* ctx) : QuantizedLowering(ctx, kRagged) {}
};
using QuantizedDenseLowering = QuantizedLayout<false>;
using QuantizedRaggedLowering = QuantizedLayout<true>;

}  // namespace pkm_xla

REGISTER_XLA_OP(Name("PkmQuantizedEmbeddingBag").Device(::tensorflow::DEVICE_CPU_XLA_JIT),
                ::pkm_xla::QuantizedDenseLowering);
REGISTER_XLA_OP(Name("PkmQuantizedRaggedEmbeddingBag").Device(::tensorflow::DEVICE_CPU_XLA_JIT),
                ::pkm_xla::QuantizedRaggedLowering);

// As pkm_xla_register_late (embedding_bag_xla_cpu.cc), for the two quantized
// ops: TF may have turned the XLA op registry into kernels before this library
// loaded. Called by pkm_serve.quantized; returns 1 when it added the kernels.
extern "C" __attribute__((visibility("default"))) int pkm_xla_register_late_quantized() {
  static const int added = [] {
    const char* device = ::tensorflow::DEVICE_CPU_XLA_JIT;
    ::tensorflow::XlaOpRegistry::RegisterCompilationKernels();
    if (::pkm_xla::HasKernelFor("PkmQuantizedEmbeddingBag", device)) return 0;
    ::pkm_xla::RegisterJitKernel<::pkm_xla::QuantizedDenseLowering>("PkmQuantizedEmbeddingBag", device, false);
    ::pkm_xla::RegisterJitKernel<::pkm_xla::QuantizedRaggedLowering>("PkmQuantizedRaggedEmbeddingBag", device,
                                                                     true);
    return 1;
  }();
  return added;
}
