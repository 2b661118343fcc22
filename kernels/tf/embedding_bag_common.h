// Tensor -> core-argument translation shared by the CPU and GPU kernels of
// the PkmEmbeddingBag ops: attribute parsing and every shape/dtype check, so
// both devices reject the same inputs with the same messages.
#ifndef PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_
#define PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_

#include <string>

#include "kernels/core/embedding_bag.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace pkm_tf {

// Attributes common to all four ops.
struct OpAttrs {
  pkm::Combiner combiner = pkm::Combiner::kSum;
  bool has_weights = true;
  bool ragged = false;
};

inline ::tensorflow::Status ReadAttrs(::tensorflow::OpKernelConstruction* ctx, bool ragged,
                                      OpAttrs* attrs) {
  std::string combiner;
  TF_RETURN_IF_ERROR(ctx->GetAttr("combiner", &combiner));
  if (!pkm::ParseCombiner(combiner, &attrs->combiner))
    return ::tensorflow::errors::InvalidArgument("combiner must be one of sum, mean, sqrtn, max; got '",
                                                 combiner, "'");
  TF_RETURN_IF_ERROR(ctx->GetAttr("has_weights", &attrs->has_weights));
  attrs->ragged = ragged;
  return ::tensorflow::Status();
}

inline pkm::ElemType ElemTypeOf(::tensorflow::DataType dt) {
  switch (dt) {
    case ::tensorflow::DT_HALF: return pkm::ElemType::kFloat16;
    case ::tensorflow::DT_BFLOAT16: return pkm::ElemType::kBFloat16;
    default: return pkm::ElemType::kFloat32;  // the op's type constraint admits nothing else
  }
}

// The inputs of one op call, as core arguments. Input order:
//   dense : params, indices, weights            (forward)
//   ragged: params, values, row_splits, weights (forward)
// `first` is the position of params (1 in the gradient ops, after grad).
struct CoreArgs {
  pkm::Table table;
  pkm::Bags bags;
  ::tensorflow::TensorShape out_shape;  // forward output: leading dims + [D]
  const ::tensorflow::Tensor* weights = nullptr;
};

// Every shape rule of the ops, on shapes alone, so the TF kernels and the XLA
// lowering (kernels/xla, which sees shapes at compile time) reject the same
// inputs with the same messages. `splits` is null for the dense layout.
// Fills out_shape: the forward output (leading dims of indices, or the bag
// count of the ragged layout, then D).
inline ::tensorflow::Status CheckShapes(const OpAttrs& attrs, const ::tensorflow::TensorShape& params,
                                        const ::tensorflow::TensorShape& indices,
                                        const ::tensorflow::TensorShape* splits,
                                        const ::tensorflow::TensorShape& weights,
                                        ::tensorflow::TensorShape* out_shape) {
  using ::tensorflow::errors::InvalidArgument;
  const pkm::Status combiner_ok = pkm::CheckCombiner(attrs.combiner, attrs.has_weights);
  if (!combiner_ok.ok) return InvalidArgument(combiner_ok.message);
  if (params.dims() != 2)
    return InvalidArgument("params must be a [N, D] matrix, got shape ", params.DebugString());
  if (attrs.ragged ? indices.dims() != 1 : indices.dims() < 1)
    return InvalidArgument(attrs.ragged ? "values must be a vector" : "indices must have rank >= 1 ([..., K])",
                           ", got shape ", indices.DebugString());
  if (attrs.has_weights && weights != indices)
    return InvalidArgument("weights must have the shape of indices ", indices.DebugString(), ", got ",
                           weights.DebugString());
  // An unused weights input must be empty, so the gradient op's d_weights
  // (shaped like weights) has nothing to leave unwritten.
  if (!attrs.has_weights && weights.num_elements() != 0)
    return InvalidArgument("weights must be empty (e.g. shape [0]) when has_weights is false, got shape ",
                           weights.DebugString());
  *out_shape = ::tensorflow::TensorShape();
  if (attrs.ragged) {
    if (splits == nullptr || splits->dims() != 1 || splits->dim_size(0) < 1)
      return InvalidArgument("row_splits must be a non-empty vector, got shape ",
                             splits ? splits->DebugString() : "none");
    TF_RETURN_IF_ERROR(out_shape->AddDimWithStatus(splits->dim_size(0) - 1));
  } else {
    for (int i = 0; i + 1 < indices.dims(); ++i) TF_RETURN_IF_ERROR(out_shape->AddDimWithStatus(indices.dim_size(i)));
  }
  return out_shape->AddDimWithStatus(params.dim_size(1));
}

// `variable_params`, when set, is the table read from a resource variable
// (input `first` is then the variable's handle).
inline ::tensorflow::Status BuildCoreArgs(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                                          int first, CoreArgs* args,
                                          const ::tensorflow::Tensor* variable_params = nullptr) {
  using ::tensorflow::errors::InvalidArgument;
  const ::tensorflow::Tensor& params = variable_params ? *variable_params : ctx->input(first);
  const ::tensorflow::Tensor& indices = ctx->input(first + 1);
  const ::tensorflow::Tensor& weights = ctx->input(first + (attrs.ragged ? 3 : 2));
  const ::tensorflow::Tensor* splits = attrs.ragged ? &ctx->input(first + 2) : nullptr;
  TF_RETURN_IF_ERROR(CheckShapes(attrs, params.shape(), indices.shape(), splits ? &splits->shape() : nullptr,
                                 weights.shape(), &args->out_shape));
  pkm::Table& t = args->table;
  t.data = params.data();
  t.type = ElemTypeOf(params.dtype());
  t.num_rows = params.dim_size(0);
  t.dim = params.dim_size(1);
  pkm::Bags& b = args->bags;
  b.indices = indices.data();
  b.indices_int64 = indices.dtype() == ::tensorflow::DT_INT64;
  b.weights = attrs.has_weights ? weights.data() : nullptr;
  b.weights_type = ElemTypeOf(weights.dtype());
  args->weights = &weights;
  if (attrs.ragged) {
    b.row_splits = splits->data();
    b.row_splits_int64 = splits->dtype() == ::tensorflow::DT_INT64;
    b.num_bags = splits->dim_size(0) - 1;
    b.num_values = indices.dim_size(0);
  } else {
    ::tensorflow::TensorShape leading = indices.shape();  // a valid shape: no overflow
    leading.RemoveLastDims(1);
    b.num_bags = leading.num_elements();
    b.bag_size = indices.dim_size(indices.dims() - 1);
  }
  return ::tensorflow::Status();
}

// Every gradient op's arguments (input 0 is grad, params follow): the core
// arguments, and grad shaped like the forward output.
inline ::tensorflow::Status BuildGradCoreArgs(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                                              CoreArgs* args,
                                              const ::tensorflow::Tensor* variable_params = nullptr) {
  TF_RETURN_IF_ERROR(BuildCoreArgs(ctx, attrs, /*first=*/1, args, variable_params));
  const ::tensorflow::Tensor& grad = ctx->input(0);
  if (grad.shape() != args->out_shape)
    return ::tensorflow::errors::InvalidArgument("grad must have the forward output's shape ",
                                                 args->out_shape.DebugString(), ", got ",
                                                 grad.shape().DebugString());
  return ::tensorflow::Status();
}

// The dense gradient ops' arguments and outputs, shared by both devices:
// d_params shaped like params and d_weights like weights.
inline ::tensorflow::Status BuildGradArgs(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                                          CoreArgs* args, ::tensorflow::Tensor** d_params,
                                          ::tensorflow::Tensor** d_weights) {
  TF_RETURN_IF_ERROR(BuildGradCoreArgs(ctx, attrs, args));
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, ctx->input(1).shape(), d_params));
  return ctx->allocate_output(1, args->weights->shape(), d_weights);
}

inline ::tensorflow::Status ToTf(const pkm::Status& s) {
  return s.ok ? ::tensorflow::Status() : ::tensorflow::errors::InvalidArgument(s.message);
}

// Base of the forward and gradient kernels on every device: reads the attrs.
class EmbeddingBagKernelBase : public ::tensorflow::OpKernel {
 public:
  EmbeddingBagKernelBase(::tensorflow::OpKernelConstruction* ctx, bool ragged) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadAttrs(ctx, ragged, &attrs_));
  }

 protected:
  OpAttrs attrs_;
};

// A kernel class taking (ctx, ragged) bound to one layout, as
// REGISTER_KERNEL_BUILDER needs a constructor of ctx alone.
template <class Kernel, bool kRagged>
class WithLayout : public Kernel {
 public:
  explicit WithLayout(::tensorflow::OpKernelConstruction* ctx) : Kernel(ctx, kRagged) {}
};

// Registers a device's forward and gradient kernel classes for the dense and
// the ragged ops, for table type T. One class serves every dtype: the core and
// the CUDA launchers dispatch on runtime element types.
#define PKM_REGISTER_EMBEDDING_BAG_KERNELS(DEVICE, FORWARD, GRAD, T)                               \
  REGISTER_KERNEL_BUILDER(Name("PkmEmbeddingBag").Device(DEVICE).TypeConstraint<T>("T"),          \
                          ::pkm_tf::WithLayout<FORWARD, false>);                                  \
  REGISTER_KERNEL_BUILDER(Name("PkmEmbeddingBagGrad").Device(DEVICE).TypeConstraint<T>("T"),      \
                          ::pkm_tf::WithLayout<GRAD, false>);                                     \
  REGISTER_KERNEL_BUILDER(Name("PkmRaggedEmbeddingBag").Device(DEVICE).TypeConstraint<T>("T"),    \
                          ::pkm_tf::WithLayout<FORWARD, true>);                                   \
  REGISTER_KERNEL_BUILDER(Name("PkmRaggedEmbeddingBagGrad").Device(DEVICE).TypeConstraint<T>("T"), \
                          ::pkm_tf::WithLayout<GRAD, true>)

}  // namespace pkm_tf

#endif  // PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_
