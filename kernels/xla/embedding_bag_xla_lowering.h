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
#include "xla/ffi/api/ffi.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/shape_util.h"

// Exported by libtensorflow_framework (declared in XLA's internal ffi_api.h,
// which would pull in XLA's internals for one declaration).
namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();
}  // namespace xla::ffi

namespace pkm_xla {

inline constexpr char kForwardTarget[] = "pkm_embedding_bag_forward";
inline constexpr char kBackwardTarget[] = "pkm_embedding_bag_backward";
inline constexpr char kRaggedForwardTarget[] = "pkm_ragged_embedding_bag_forward";
inline constexpr char kRaggedBackwardTarget[] = "pkm_ragged_embedding_bag_backward";

// The pieces every lowering (float and int8) builds its custom call from.

// Number of bags: the product of the leading dims of indices (dense) or
// len(row_splits) - 1 (ragged); both already validated by the shape rules.
inline int64_t NumBags(bool ragged, const ::tensorflow::TensorShape& indices,
                       const ::tensorflow::TensorShape& splits) {
  if (ragged) return splits.dim_size(0) - 1;
  ::tensorflow::TensorShape leading = indices;
  leading.RemoveLastDims(1);
  return leading.num_elements();
}

// ---- bounded dynamic dimensions ----
// Ids made under jit_compile by tf.boolean_mask, tf.unique or tf.where have a
// dimension of bounded dynamic size, which XLA refuses in a custom call's
// operand ("is not supported to have a dynamic dimension"). The call gets the
// operand at its bound instead, every entry past the size made padding (id -1,
// weight and grad 0), and the results get the sizes back.

struct DynamicDim {
  int64_t dim;
  xla::XlaOp size;  // s32 scalar
};

inline std::vector<DynamicDim> DynamicDims(xla::XlaBuilder* b, xla::XlaOp op) {
  std::vector<DynamicDim> dims;
  absl::StatusOr<xla::Shape> shape = b->GetShape(op);
  if (!shape.ok() || !shape->IsArray()) return dims;  // the builder reports the error
  for (int64_t d = 0; d < static_cast<int64_t>(shape->dimensions().size()); ++d)
    if (shape->is_dynamic_dimension(d)) dims.push_back({d, xla::GetDimensionSize(op, d)});
  return dims;
}

// A shape check's error where an input holds a dimension XLA sizes at run
// time: TF shows it at its bound, and XLA cannot pair it with a static size
// even where the two agree when the graph runs (stock XLA ops refuse the same
// pairing), so the message says both.
inline ::tensorflow::Status WithRunTimeSizeNote(::tensorflow::Status status, xla::XlaBuilder* b,
                                                const std::vector<xla::XlaOp>& inputs) {
  if (status.ok()) return status;
  for (const xla::XlaOp& op : inputs) {
    absl::StatusOr<xla::Shape> shape = b->GetShape(op);
    if (!shape.ok() || !shape->IsArray() || shape->is_static()) continue;
    return ::tensorflow::errors::InvalidArgument(
        status.message(),
        " (under XLA: a dimension sized only at run time, e.g. by tf.boolean_mask, is shown at its bound, "
        "and XLA cannot pair it with a static size even where the sizes agree when the graph runs: make "
        "the weights through the same mask as the ids, or call without jit_compile)");
  }
  return status;
}

// s32 positions along `dim` of an array shaped like `shape`.
inline xla::XlaOp Positions(xla::XlaBuilder* b, const xla::Shape& shape, int64_t dim) {
  return xla::Iota(b, xla::ShapeUtil::ChangeElementType(shape, xla::S32), dim);
}

inline xla::XlaOp Filled(xla::XlaBuilder* b, const xla::Shape& shape, double value) {
  return xla::Broadcast(xla::ConvertElementType(xla::ConstantR0<double>(b, value), shape.element_type()),
                        shape.dimensions());
}

// `op` static at its bounds, the entries past any dynamic size set to `fill`.
inline xla::XlaOp AtBounds(xla::XlaBuilder* b, xla::XlaOp op, const std::vector<DynamicDim>& dims, double fill) {
  if (dims.empty()) return op;
  for (const DynamicDim& d : dims) op = xla::RemoveDynamicDimension(op, d.dim);
  absl::StatusOr<xla::Shape> shape = b->GetShape(op);
  if (!shape.ok()) return op;
  xla::XlaOp inside;
  for (const DynamicDim& d : dims) {
    xla::XlaOp in_dim = xla::Lt(Positions(b, *shape, d.dim), d.size);
    inside = inside.valid() ? xla::And(inside, in_dim) : in_dim;
  }
  return xla::Select(inside, op, Filled(b, *shape, fill));
}

inline xla::XlaOp WithSizes(xla::XlaOp op, const std::vector<DynamicDim>& dims) {
  for (const DynamicDim& d : dims) op = xla::SetDimensionSize(op, d.size, d.dim);
  return op;
}

// Ragged row_splits at their bound when they or the values have a dynamic
// size: splits past their size repeat the last one (empty bags), and splits
// (but the first) equal to the number of values move to the values' bound, so
// the padding ids past the values join the last bag, where they count for
// nothing. Splits that break the rules still fail the kernel's checks.
inline xla::XlaOp SplitsAtBounds(xla::XlaBuilder* b, xla::XlaOp splits, const std::vector<DynamicDim>& split_dims,
                                 const std::vector<DynamicDim>& value_dims, int64_t values_bound) {
  if (split_dims.empty() && value_dims.empty()) return splits;
  if (!split_dims.empty()) splits = xla::RemoveDynamicDimension(splits, 0);
  absl::StatusOr<xla::Shape> shape = b->GetShape(splits);
  if (!shape.ok()) return splits;
  const xla::XlaOp position = Positions(b, *shape, 0);
  if (!split_dims.empty()) {
    const xla::XlaOp size = split_dims[0].size;
    const xla::XlaOp last_index = xla::Max(xla::Sub(size, xla::ConstantR0<int32_t>(b, 1)),
                                           xla::ConstantR0<int32_t>(b, 0));
    const xla::XlaOp last = xla::Reshape(xla::DynamicSlice(splits, {last_index}, {1}), {});
    splits = xla::Select(xla::Lt(position, size), splits, xla::Broadcast(last, shape->dimensions()));
  }
  if (!value_dims.empty()) {
    const xla::XlaOp count = xla::ConvertElementType(value_dims[0].size, shape->element_type());
    const xla::XlaOp at_end = xla::And(xla::Eq(splits, count), xla::Gt(position, xla::ConstantR0<int32_t>(b, 0)));
    splits = xla::Select(at_end, Filled(b, *shape, static_cast<double>(values_bound)), splits);
  }
  return splits;
}

// The dynamic sizes a call's results get back.
struct BagSizes {
  std::vector<DynamicDim> out;      // of the [..., D] output (dense: the ids' leading dims; ragged: bags)
  std::vector<DynamicDim> weights;  // of the weights (d_weights is shaped like them)
};

// Appends the ids (input `ids_input`; dense ones reshaped to [B, K], a bitcast
// in XLA), the ragged row splits and the weights in the custom call's order,
// each static at its bound (see above).
inline BagSizes AppendBagOperands(::tensorflow::XlaOpKernelContext* ctx, const ::pkm_tf::OpAttrs& attrs,
                                  int ids_input, int64_t num_bags, std::vector<xla::XlaOp>* operands) {
  xla::XlaBuilder* b = ctx->builder();
  const ::tensorflow::TensorShape indices = ctx->InputShape(ids_input);
  xla::XlaOp index_op = ctx->Input(ids_input);
  xla::XlaOp weight_op = ctx->Input(ids_input + (attrs.ragged ? 2 : 1));
  BagSizes sizes;
  const std::vector<DynamicDim> id_dims = DynamicDims(b, index_op);
  if (attrs.has_weights) sizes.weights = DynamicDims(b, weight_op);
  index_op = AtBounds(b, index_op, id_dims, -1.0);
  weight_op = AtBounds(b, weight_op, sizes.weights, 0.0);
  if (!attrs.ragged) {
    for (const DynamicDim& d : id_dims)
      if (d.dim + 1 < indices.dims()) sizes.out.push_back(d);
    const int64_t bag_size = indices.dim_size(indices.dims() - 1);
    index_op = xla::Reshape(index_op, {num_bags, bag_size});
    if (attrs.has_weights) weight_op = xla::Reshape(weight_op, {num_bags, bag_size});
  }
  operands->push_back(index_op);
  if (attrs.ragged) {
    xla::XlaOp splits = ctx->Input(ids_input + 1);
    const std::vector<DynamicDim> split_dims = DynamicDims(b, splits);
    if (!split_dims.empty())
      sizes.out.push_back({0, xla::Sub(split_dims[0].size, xla::ConstantR0<int32_t>(b, 1))});
    operands->push_back(SplitsAtBounds(b, splits, split_dims, id_dims, indices.dim_size(0)));
  }
  operands->push_back(weight_op);
  return sizes;
}

inline xla::Shape RowMajor(const xla::Shape& shape) {
  return xla::ShapeUtil::MakeShapeWithDescendingLayout(shape.element_type(), shape.dimensions());
}

// The operands' shapes, row-major: every buffer of the contract is.
inline ::tensorflow::Status RowMajorShapes(::tensorflow::XlaOpKernelContext* ctx,
                                           const std::vector<xla::XlaOp>& operands, std::vector<xla::Shape>* shapes) {
  for (const xla::XlaOp& op : operands) {
    auto shape = ctx->builder()->GetShape(op);
    TF_RETURN_IF_ERROR(shape.status());
    shapes->push_back(RowMajor(*shape));
  }
  return ::tensorflow::Status();
}

// True when every array in `shape` has no elements.
inline bool AllZeroSized(const xla::Shape& shape) {
  if (!shape.IsTuple()) return xla::ShapeUtil::IsZeroElementArray(shape);
  for (const xla::Shape& element : shape.tuple_shapes())
    if (!AllZeroSized(element)) return false;
  return true;
}

// One typed-FFI custom call of `target` with the op's attributes. XLA replaces
// a call whose results are all zero-sized (a [N, 0] table, no bags) by
// constants, which would skip the kernel's index and row_splits checks; such a
// call is marked side-effecting so that it runs and fails as at any other size.
inline xla::XlaOp CallTarget(::tensorflow::XlaOpKernelContext* ctx, const char* target, const ::pkm_tf::OpAttrs& attrs,
                             const std::vector<xla::XlaOp>& operands, const std::vector<xla::Shape>& operand_shapes,
                             const xla::Shape& result) {
  const std::string config = "{combiner = " + std::to_string(static_cast<int>(attrs.combiner)) +
                             " : i32, has_weights = " + std::to_string(attrs.has_weights ? 1 : 0) + " : i32}";
  return xla::CustomCallWithLayout(ctx->builder(), target, operands, result, operand_shapes, config,
                                   /*has_side_effect=*/AllZeroSized(result), /*output_operand_aliasing=*/{},
                                   /*literal=*/nullptr,
                                   xla::CustomCallSchedule::SCHEDULE_NONE,
                                   xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
}

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
    const ::tensorflow::TensorShape weights = ctx->InputShape(first + (ragged ? 3 : 2));
    ::tensorflow::TensorShape out_shape;
    std::vector<xla::XlaOp> bag_inputs;  // ids, row splits, weights: maybe sized at run time
    for (int i = first + 1; i < ctx->num_inputs(); ++i) bag_inputs.push_back(ctx->Input(i));
    OP_REQUIRES_OK(ctx, WithRunTimeSizeNote(::pkm_tf::CheckShapes(attrs_, params, indices, ragged ? &splits : nullptr,
                                                                  weights, &out_shape),
                                            ctx->builder(), bag_inputs));
    if (grad_)
      OP_REQUIRES_OK(ctx, ::pkm_tf::ToTf(pkm::GradShape(::pkm_tf::DimsOf(ctx->InputShape(0)),
                                                         ::pkm_tf::DimsOf(out_shape))));
    const int64_t dim = params.dim_size(1);
    const int64_t num_bags = NumBags(ragged, indices, splits);

    OP_REQUIRES(ctx, DynamicDims(ctx->builder(), ctx->Input(first)).empty(),
                ::tensorflow::errors::Unimplemented(
                    "embedding_bag under XLA: params has a dimension of dynamic size (e.g. rows picked by "
                    "tf.boolean_mask); pass a table of static shape"));
    std::vector<xla::XlaOp> operands;
    if (grad_) {
      const xla::XlaOp grad = ctx->Input(0);  // [..., D]: the output's dynamic dims, padding past them
      operands.push_back(xla::Reshape(AtBounds(ctx->builder(), grad, DynamicDims(ctx->builder(), grad), 0.0),
                                      {num_bags, dim}));
    }
    operands.push_back(ctx->Input(first));
    const BagSizes sizes = AppendBagOperands(ctx, attrs_, first + 1, num_bags, &operands);
    std::vector<xla::Shape> operand_shapes;
    OP_REQUIRES_OK(ctx, RowMajorShapes(ctx, operands, &operand_shapes));
    if (!grad_) {
      const xla::Shape out =
          xla::ShapeUtil::MakeShapeWithDescendingLayout(ctx->input_xla_type(first), {num_bags, dim});
      xla::XlaOp result = CallTarget(ctx, ragged ? kRaggedForwardTarget : kForwardTarget, attrs_, operands,
                                     operand_shapes, out);
      ctx->SetOutput(0, WithSizes(xla::Reshape(result, out_shape.dim_sizes()), sizes.out));
      return;
    }
    // (d_params like params, d_weights like the weights operand)
    const xla::Shape grads = xla::ShapeUtil::MakeTupleShape({operand_shapes[1], operand_shapes.back()});
    xla::XlaOp result =
        CallTarget(ctx, ragged ? kRaggedBackwardTarget : kBackwardTarget, attrs_, operands, operand_shapes, grads);
    ctx->SetOutput(0, xla::GetTupleElement(result, 0));
    ctx->SetOutput(1, WithSizes(xla::Reshape(xla::GetTupleElement(result, 1), weights.dim_sizes()), sizes.weights));
  }

 private:
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

// Registers with TF's XLA the four handlers a targets file exports
// (PKM_XLA_DEFINE_TARGETS(P, ...), linked into the same library) for the FFI
// platform PLATFORM ("Host", "CUDA"), and the lowerings for DEVICE.
#define PKM_REGISTER_XLA_PLATFORM(P, PLATFORM, DEVICE)                                                        \
  extern "C" XLA_FFI_Error* pkm_xla_##P##_forward(XLA_FFI_CallFrame*);                                        \
  extern "C" XLA_FFI_Error* pkm_xla_##P##_backward(XLA_FFI_CallFrame*);                                       \
  extern "C" XLA_FFI_Error* pkm_xla_##P##_ragged_forward(XLA_FFI_CallFrame*);                                 \
  extern "C" XLA_FFI_Error* pkm_xla_##P##_ragged_backward(XLA_FFI_CallFrame*);                                \
  XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), ::pkm_xla::kForwardTarget, PLATFORM, pkm_xla_##P##_forward); \
  XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), ::pkm_xla::kBackwardTarget, PLATFORM,                  \
                           pkm_xla_##P##_backward);                                                            \
  XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), ::pkm_xla::kRaggedForwardTarget, PLATFORM,             \
                           pkm_xla_##P##_ragged_forward);                                                      \
  XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), ::pkm_xla::kRaggedBackwardTarget, PLATFORM,            \
                           pkm_xla_##P##_ragged_backward);                                                     \
  PKM_REGISTER_XLA_LOWERINGS(DEVICE)

#endif  // PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_LOWERING_H_
