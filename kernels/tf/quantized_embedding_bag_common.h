// Tensor -> core-argument translation of the PkmQuantizedEmbeddingBag ops
// (row-wise int8 tables), shared by their CPU kernels and their XLA lowering:
// the float ops' rules (pkm_tf::CheckShapes) plus the int8 rows' own.
//   dense : params int8 [N, D], row_scales [N], row_biases [N], indices, weights
//   ragged: params, row_scales, row_biases, values, row_splits, weights
#ifndef PKM_KERNELS_TF_QUANTIZED_EMBEDDING_BAG_COMMON_H_
#define PKM_KERNELS_TF_QUANTIZED_EMBEDDING_BAG_COMMON_H_

#include "kernels/tf/embedding_bag_common.h"

namespace pkm_tf {

// Position of the indices/values input: after params and its two row vectors.
constexpr int kQuantizedBagsInput = 3;

// The shape rules on shapes alone (for the XLA lowering too). row_biases may
// be empty ([0]): no biases.
inline ::tensorflow::Status CheckQuantizedShapes(const OpAttrs& attrs, const ::tensorflow::TensorShape& params,
                                                 const ::tensorflow::TensorShape& scales,
                                                 const ::tensorflow::TensorShape& biases,
                                                 const ::tensorflow::TensorShape& indices,
                                                 const ::tensorflow::TensorShape* splits,
                                                 const ::tensorflow::TensorShape& weights,
                                                 ::tensorflow::TensorShape* out_shape) {
  using ::tensorflow::errors::InvalidArgument;
  TF_RETURN_IF_ERROR(CheckShapes(attrs, params, indices, splits, weights, out_shape));
  const int64_t rows = params.dim_size(0);
  if (scales.dims() != 1 || scales.dim_size(0) != rows)
    return InvalidArgument("row_scales must be a [", rows, "] vector (one per table row), got shape ",
                           scales.DebugString());
  if (biases.dims() != 1 || (biases.dim_size(0) != rows && biases.dim_size(0) != 0))
    return InvalidArgument("row_biases must be a [", rows, "] vector (one per table row) or empty, got shape ",
                           biases.DebugString());
  return ::tensorflow::Status();
}

inline ::tensorflow::Status BuildQuantizedCoreArgs(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                                                   CoreArgs* args) {
  const ::tensorflow::Tensor& params = ctx->input(0);
  const ::tensorflow::Tensor& scales = ctx->input(1);
  const ::tensorflow::Tensor& biases = ctx->input(2);
  const int first = kQuantizedBagsInput;
  const ::tensorflow::Tensor& indices = ctx->input(first);
  const ::tensorflow::Tensor* splits = attrs.ragged ? &ctx->input(first + 1) : nullptr;
  const ::tensorflow::Tensor& weights = ctx->input(first + (attrs.ragged ? 2 : 1));
  TF_RETURN_IF_ERROR(CheckQuantizedShapes(attrs, params.shape(), scales.shape(), biases.shape(), indices.shape(),
                                          splits ? &splits->shape() : nullptr, weights.shape(), &args->out_shape));
  FillTable(params, pkm::ElemType::kInt8, &args->table);
  args->table.row_scales = scales.data();
  args->table.row_biases = biases.NumElements() > 0 ? biases.data() : nullptr;
  args->table.row_params_type = ElemTypeOf(scales.dtype());
  FillBags(attrs, indices, splits, weights, args);
  return ::tensorflow::Status();
}

}  // namespace pkm_tf

#endif  // PKM_KERNELS_TF_QUANTIZED_EMBEDDING_BAG_COMMON_H_
