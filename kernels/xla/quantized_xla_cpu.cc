// tf2xla lowering of the two PkmQuantizedEmbeddingBag ops for XLA_CPU_JIT:
// each becomes one typed-FFI custom call into quantized_xla_cpu_targets.cc (the
// core's int8 forward), with the TF kernels' shape rules applied at compile
// time (CheckQuantizedShapes). Dense indices of any rank are reshaped to
// [B, K] and the output back to [..., D], as for the float ops.
#include <string>
#include <vector>

#include "kernels/tf/quantized_embedding_bag_common.h"
#include "kernels/xla/embedding_bag_xla_lowering.h"
#include "xla/ffi/api/ffi.h"

namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();
}  // namespace xla::ffi

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
    const int weights_input = first + (ragged ? 2 : 1);
    const ::tensorflow::TensorShape params = ctx->InputShape(0), indices = ctx->InputShape(first);
    const ::tensorflow::TensorShape splits = ragged ? ctx->InputShape(first + 1) : ::tensorflow::TensorShape();
    const ::tensorflow::TensorShape weights = ctx->InputShape(weights_input);
    ::tensorflow::TensorShape out_shape;
    OP_REQUIRES_OK(ctx, ::pkm_tf::CheckQuantizedShapes(attrs_, params, ctx->InputShape(1), ctx->InputShape(2),
                                                       indices, ragged ? &splits : nullptr, weights, &out_shape));
    const int64_t dim = params.dim_size(1);
    int64_t num_bags = 0;
    if (ragged) {
      num_bags = splits.dim_size(0) - 1;
    } else {
      ::tensorflow::TensorShape leading = indices;
      leading.RemoveLastDims(1);
      num_bags = leading.num_elements();
    }
    std::vector<xla::XlaOp> operands = {ctx->Input(0), ctx->Input(1), ctx->Input(2)};
    xla::XlaOp index_op = ctx->Input(first), weight_op = ctx->Input(weights_input);
    if (!ragged) {
      const int64_t bag_size = indices.dim_size(indices.dims() - 1);
      index_op = xla::Reshape(index_op, {num_bags, bag_size});
      if (attrs_.has_weights) weight_op = xla::Reshape(weight_op, {num_bags, bag_size});
    }
    operands.push_back(index_op);
    if (ragged) operands.push_back(ctx->Input(first + 1));
    operands.push_back(weight_op);
    std::vector<xla::Shape> operand_shapes;
    for (const xla::XlaOp& op : operands) {
      auto shape = ctx->builder()->GetShape(op);
      OP_REQUIRES_OK(ctx, shape.status());
      operand_shapes.push_back(xla::ShapeUtil::MakeShapeWithDescendingLayout(shape->element_type(),
                                                                             shape->dimensions()));
    }
    const std::string config = "{combiner = " + std::to_string(static_cast<int>(attrs_.combiner)) +
                               " : i32, has_weights = " + std::to_string(attrs_.has_weights ? 1 : 0) + " : i32}";
    const xla::Shape out =
        xla::ShapeUtil::MakeShapeWithDescendingLayout(ctx->output_xla_type(0), {num_bags, dim});
    xla::XlaOp result = xla::CustomCallWithLayout(
        ctx->builder(), ragged ? kQuantizedRaggedForwardTarget : kQuantizedForwardTarget, operands, out,
        operand_shapes, config, /*has_side_effect=*/false, /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
        xla::CustomCallSchedule::SCHEDULE_NONE, xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    ctx->SetOutput(0, xla::Reshape(result, out_shape.dim_sizes()));
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
