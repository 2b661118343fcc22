// Tensor -> core-argument translation shared by the CPU and GPU kernels of
// the PkmEmbeddingBag ops: attribute parsing and every shape/dtype check, so
// both devices reject the same inputs with the same messages.
#ifndef PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_
#define PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_

#include <string>

#include "kernels/core/embedding_bag.h"
#include "tensorflow/core/framework/device_base.h"
#include "kernels/core/shape_rules.h"
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

inline ::tensorflow::Status ToTf(const pkm::Status& s) {
  return s.ok ? ::tensorflow::Status() : ::tensorflow::errors::InvalidArgument(s.message);
}

inline pkm::Dims DimsOf(const ::tensorflow::TensorShape& shape) {
  pkm::Dims dims(shape.dims());
  for (int i = 0; i < shape.dims(); ++i) dims[i] = shape.dim_size(i);
  return dims;
}

// The core's shape rules (kernels/core/shape_rules.h) on the tensors' shapes,
// so the TF kernels, the shape functions and the XLA lowering (kernels/xla,
// which sees shapes at compile time) reject the same inputs with the same
// messages as every other runtime. `splits` is null for the dense layout.
// Fills out_shape: the forward output.
inline ::tensorflow::Status CheckShapes(const OpAttrs& attrs, const ::tensorflow::TensorShape& params,
                                        const ::tensorflow::TensorShape& indices,
                                        const ::tensorflow::TensorShape* splits,
                                        const ::tensorflow::TensorShape& weights,
                                        ::tensorflow::TensorShape* out_shape) {
  pkm::BagShapes shapes;
  shapes.params = DimsOf(params);
  shapes.indices = DimsOf(indices);
  if (splits != nullptr) shapes.row_splits = DimsOf(*splits);
  shapes.weights = DimsOf(weights);
  shapes.ragged = attrs.ragged;
  shapes.has_weights = attrs.has_weights;
  shapes.combiner = attrs.combiner;
  if (attrs.ragged && splits == nullptr)
    return ::tensorflow::errors::InvalidArgument("row_splits must be a non-empty vector ([num_bags + 1]), got none");
  pkm::MaybeDims out;
  TF_RETURN_IF_ERROR(ToTf(pkm::ForwardShape(shapes, &out)));
  return ::tensorflow::TensorShape::BuildTensorShape(*out, out_shape);
}

// The table fields of params (shape already checked).
inline void FillTable(const ::tensorflow::Tensor& params, pkm::ElemType type, pkm::Table* table) {
  table->data = params.data();
  table->type = type;
  table->num_rows = params.dim_size(0);
  table->dim = params.dim_size(1);
}

// The bag fields of the ids (dense indices, or ragged values + row splits)
// and weights, shapes already checked: shared by the float and the int8 ops.
inline void FillBags(const OpAttrs& attrs, const ::tensorflow::Tensor& indices, const ::tensorflow::Tensor* splits,
                     const ::tensorflow::Tensor& weights, CoreArgs* args) {
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
  FillTable(params, ElemTypeOf(params.dtype()), &args->table);
  FillBags(attrs, indices, splits, weights, args);
  return ::tensorflow::Status();
}

// Every gradient op's arguments (input 0 is grad, params follow): the core
// arguments, and grad shaped like the forward output.
inline ::tensorflow::Status BuildGradCoreArgs(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                                              CoreArgs* args,
                                              const ::tensorflow::Tensor* variable_params = nullptr) {
  TF_RETURN_IF_ERROR(BuildCoreArgs(ctx, attrs, /*first=*/1, args, variable_params));
  return ToTf(pkm::GradShape(DimsOf(ctx->input(0).shape()), DimsOf(args->out_shape)));
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

// The core's ParallelFor on TF's intra-op CPU thread pool.
inline pkm::ParallelFor TfParallelFor(::tensorflow::OpKernelContext* ctx) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [workers](int64_t total, int64_t cost_per_unit, const pkm::RangeFn& fn) {
    if (total <= 0) return;
    workers->ParallelFor(total, cost_per_unit, [&fn](int64_t begin, int64_t end) { fn(begin, end); });
  };
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

}  // namespace pkm_tf

#endif  // PKM_KERNELS_TF_EMBEDDING_BAG_COMMON_H_
