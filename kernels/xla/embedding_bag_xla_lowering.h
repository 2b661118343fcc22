// tf2xla lowering of the four PkmEmbeddingBag ops: each becomes one XLA custom
// call (typed FFI) into our kernels, so a jit-compiled graph runs the same
// forward/backward as the TF kernels and never holds a [..., K, D] gather.
//
// The shape rules are the TF kernels' (pkm_tf::CheckShapes), applied at
// compile time; the index range is checked inside the call by the kernel
// (CPU: pkm::Forward/Backward), which returns an FFI error that XLA turns into
// the executable's InvalidArgument. See docs/XLA.md for why typed FFI.
//
// Custom-call contract (targets registered by embedding_bag_xla_cpu.cc for
// "Host" and embedding_bag_xla_gpu.cc for "CUDA"):
//   pkm_embedding_bag_forward          (params[N,D], indices[B,K], weights[B,K]|[0]) -> out[B,D]
//   pkm_embedding_bag_backward         (grad[B,D], params, indices[B,K], weights)
//                                      -> (d_params[N,D], d_weights like weights)
//   pkm_ragged_embedding_bag_forward   (params, values[V], row_splits[B+1], weights[V]|[0]) -> out[B,D]
//   pkm_ragged_embedding_bag_backward  (grad[B,D], params, values, row_splits, weights) -> (d_params, d_weights)
// attributes: combiner (i32, pkm::Combiner), has_weights (i32 0/1). Every
// buffer is row-major. Dense indices of any rank are reshaped to [B, K] here
// (a bitcast in XLA) and the output back to [..., D].
#ifndef PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_LOWERING_H_
#define PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_LOWERING_H_

#include <string>
#include <vector>

#include "kernels/tf/embedding_bag_common.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/kernel_def_builder.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

namespace pkm_xla {

inline constexpr char kForwardTarget[] = "pkm_embedding_bag_forward";
inline constexpr char kBackwardTarget[] = "pkm_embedding_bag_backward";
inline constexpr char kRaggedForwardTarget[] = "pkm_ragged_embedding_bag_forward";
inline constexpr char kRaggedBackwardTarget[] = "pkm_ragged_embedding_bag_backward";

class EmbeddingBagLowering : public ::tensorflow::XlaOpKernel {
 public:
  EmbeddingBagLowering(::tensorflow::OpKernelConstruction* ctx, bool ragged, bool grad)
      : XlaOpKernel(ctx), grad_(grad) {
    OP_REQUIRES_OK(ctx, ::pkm_tf::ReadAttrs(ctx, ragged, &attrs_));
  }

  void Compile(::tensorflow::XlaOpKernelContext* ctx) override {
    const int first = grad_ ? 1 : 0;  // position of params
    const bool ragged = attrs_.ragged;
    const ::tensorflow::TensorShape params = ctx->InputShape(first);
    const ::tensorflow::TensorShape indices = ctx->InputShape(first + 1);
    const ::tensorflow::TensorShape splits = ragged ? ctx->InputShape(first + 2) : ::tensorflow::TensorShape();
    const int weights_input = first + (ragged ? 3 : 2);
    const ::tensorflow::TensorShape weights = ctx->InputShape(weights_input);
    ::tensorflow::TensorShape out_shape;
    OP_REQUIRES_OK(ctx, ::pkm_tf::CheckShapes(attrs_, params, indices, ragged ? &splits : nullptr, weights,
                                              &out_shape));
    if (grad_) {
      OP_REQUIRES(ctx, ctx->InputShape(0) == out_shape,
                  ::tensorflow::errors::InvalidArgument("grad must have the forward output's shape ",
                                                        out_shape.DebugString(), ", got ",
                                                        ctx->InputShape(0).DebugString()));
    }
    const int64_t dim = params.dim_size(1);
    const int64_t num_bags = LeadingCount(ragged, indices, splits);
    const xla::PrimitiveType table_type = ctx->input_xla_type(first);

    // Operands in the custom call's layout.
    std::vector<xla::XlaOp> operands;
    if (grad_) operands.push_back(xla::Reshape(ctx->Input(0), {num_bags, dim}));
    operands.push_back(ctx->Input(first));
    xla::XlaOp index_op = ctx->Input(first + 1);
    xla::XlaOp weight_op = ctx->Input(weights_input);
    if (!ragged) {
      const int64_t bag_size = indices.dim_size(indices.dims() - 1);
      index_op = xla::Reshape(index_op, {num_bags, bag_size});
      if (attrs_.has_weights) weight_op = xla::Reshape(weight_op, {num_bags, bag_size});
    }
    operands.push_back(index_op);
    if (ragged) operands.push_back(ctx->Input(first + 2));
    operands.push_back(weight_op);

    std::vector<xla::Shape> operand_shapes;
    for (const xla::XlaOp& op : operands) {
      auto shape = ctx->builder()->GetShape(op);
      OP_REQUIRES_OK(ctx, shape.status());
      operand_shapes.push_back(RowMajor(*shape));
    }
    const std::string config = "{combiner = " + std::to_string(static_cast<int>(attrs_.combiner)) +
                               " : i32, has_weights = " + std::to_string(attrs_.has_weights ? 1 : 0) + " : i32}";
    const xla::Shape out = xla::ShapeUtil::MakeShapeWithDescendingLayout(table_type, {num_bags, dim});
    if (!grad_) {
      xla::XlaOp result = xla::CustomCallWithLayout(
          ctx->builder(), ragged ? kRaggedForwardTarget : kForwardTarget, operands, out, operand_shapes, config,
          /*has_side_effect=*/false, /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
          xla::CustomCallSchedule::SCHEDULE_NONE, xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
      ctx->SetOutput(0, xla::Reshape(result, out_shape.dim_sizes()));
      return;
    }
    const xla::Shape d_params = RowMajor(operand_shapes[1]);
    const xla::Shape d_weights = RowMajor(operand_shapes.back());
    xla::XlaOp result = xla::CustomCallWithLayout(
        ctx->builder(), ragged ? kRaggedBackwardTarget : kBackwardTarget, operands,
        xla::ShapeUtil::MakeTupleShape({d_params, d_weights}), operand_shapes, config,
        /*has_side_effect=*/false, /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
        xla::CustomCallSchedule::SCHEDULE_NONE, xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    ctx->SetOutput(0, xla::GetTupleElement(result, 0));
    ctx->SetOutput(1, xla::Reshape(xla::GetTupleElement(result, 1), weights.dim_sizes()));
  }

 private:
  // Number of bags: the product of the leading dims of indices (dense) or
  // len(row_splits) - 1 (ragged); both already validated by CheckShapes.
  static int64_t LeadingCount(bool ragged, const ::tensorflow::TensorShape& indices,
                              const ::tensorflow::TensorShape& splits) {
    if (ragged) return splits.dim_size(0) - 1;
    ::tensorflow::TensorShape leading = indices;
    leading.RemoveLastDims(1);
    return leading.num_elements();
  }

  static xla::Shape RowMajor(const xla::Shape& shape) {
    return xla::ShapeUtil::MakeShapeWithDescendingLayout(shape.element_type(), shape.dimensions());
  }

  ::pkm_tf::OpAttrs attrs_;
  bool grad_;
};

template <bool kRagged, bool kGrad>
class Lowering : public EmbeddingBagLowering {
 public:
  explicit Lowering(::tensorflow::OpKernelConstruction* ctx) : EmbeddingBagLowering(ctx, kRagged, kGrad) {}
};
// Named so the registration macro below gets no template commas.
using ForwardLowering = Lowering<false, false>;
using GradLowering = Lowering<false, true>;
using RaggedForwardLowering = Lowering<true, false>;
using RaggedGradLowering = Lowering<true, true>;

// From TF's human-readable kernel list ("  device='XLA_CPU_JIT'; T in [...]"),
// which needs no protobuf code of ours.
inline bool HasKernelFor(const char* op, const char* device) {
  return ::tensorflow::KernelsRegisteredForOp(op).find("device='" + std::string(device) + "'") !=
         std::string::npos;
}

template <class L>
void RegisterJitKernel(const char* op, const char* device, bool ragged) {
  ::tensorflow::KernelDefBuilder def(op);
  def.Device(device)
      .TypeConstraint("T", {::tensorflow::DT_FLOAT, ::tensorflow::DT_HALF, ::tensorflow::DT_BFLOAT16})
      .TypeConstraint("Tindices", {::tensorflow::DT_INT32, ::tensorflow::DT_INT64});
  if (ragged) def.TypeConstraint("Tsplits", {::tensorflow::DT_INT32, ::tensorflow::DT_INT64});
  // Lives as long as the process, like every static kernel registrar.
  new ::tensorflow::kernel_factory::OpKernelRegistrar(
      def.Build(), "PkmXlaLowering",
      [](::tensorflow::OpKernelConstruction* ctx) -> ::tensorflow::OpKernel* { return new L(ctx); });
}

// TF turns the XLA op registry into JIT-device kernels once per process
// (XlaOpRegistry::RegisterCompilationKernels). A library loaded after that
// (e.g. `import pkm_serve` after TF already compiled something) would have its
// REGISTER_XLA_OPs ignored: "No registered 'PkmEmbeddingBag' OpKernel for
// XLA_CPU_JIT devices". Must run after the op defs are registered (not from a
// static initialiser): runs TF's registration if it has not run yet, else adds
// our four kernels for `device` itself. Returns 1 when it added them.
inline int RegisterLoweringsLate(const char* device) {
  ::tensorflow::XlaOpRegistry::RegisterCompilationKernels();
  if (HasKernelFor("PkmEmbeddingBag", device)) return 0;
  RegisterJitKernel<ForwardLowering>("PkmEmbeddingBag", device, false);
  RegisterJitKernel<GradLowering>("PkmEmbeddingBagGrad", device, false);
  RegisterJitKernel<RaggedForwardLowering>("PkmRaggedEmbeddingBag", device, true);
  RegisterJitKernel<RaggedGradLowering>("PkmRaggedEmbeddingBagGrad", device, true);
  return 1;
}

}  // namespace pkm_xla

// Registers the lowering of all four ops for one XLA JIT device
// (DEVICE_CPU_XLA_JIT, DEVICE_GPU_XLA_JIT). Register a device only where its
// custom-call targets are linked into the same library.
#define PKM_REGISTER_XLA_LOWERINGS(DEVICE)                                                             \
  REGISTER_XLA_OP(Name("PkmEmbeddingBag").Device(DEVICE), ::pkm_xla::ForwardLowering);        \
  REGISTER_XLA_OP(Name("PkmEmbeddingBagGrad").Device(DEVICE), ::pkm_xla::GradLowering);    \
  REGISTER_XLA_OP(Name("PkmRaggedEmbeddingBag").Device(DEVICE), ::pkm_xla::RaggedForwardLowering);    \
  REGISTER_XLA_OP(Name("PkmRaggedEmbeddingBagGrad").Device(DEVICE), ::pkm_xla::RaggedGradLowering)

#endif  // PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_LOWERING_H_
