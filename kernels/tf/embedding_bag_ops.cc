// Op definitions and shape functions of the fused EmbeddingBag ops.
// Kernels live in embedding_bag_kernels.cc (CPU) and
// embedding_bag_gpu_kernels.cc (GPU).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace pkm_tf {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

Status DenseForwardShape(InferenceContext* c) {
  ShapeHandle params, indices, leading, out;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &params));
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), 1, &indices));
  bool has_weights;
  TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
  if (has_weights) TF_RETURN_IF_ERROR(c->Merge(indices, c->input(2), &indices));
  TF_RETURN_IF_ERROR(c->Subshape(indices, 0, -1, &leading));
  TF_RETURN_IF_ERROR(c->Concatenate(leading, c->Vector(c->Dim(params, 1)), &out));
  c->set_output(0, out);
  return Status();
}

Status RaggedForwardShape(InferenceContext* c) {
  ShapeHandle params, values, splits;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &params));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &values));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &splits));
  bool has_weights;
  TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
  if (has_weights) TF_RETURN_IF_ERROR(c->Merge(values, c->input(3), &values));
  DimensionHandle num_bags;
  TF_RETURN_IF_ERROR(c->Subtract(c->Dim(splits, 0), 1, &num_bags));
  c->set_output(0, c->Matrix(num_bags, c->Dim(params, 1)));
  return Status();
}

// Gradient ops: d_params is shaped like params, d_weights like weights.
Status GradShape(InferenceContext* c, int params_input, int weights_input) {
  ShapeHandle params;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(params_input), 2, &params));
  c->set_output(0, params);
  c->set_output(1, c->input(weights_input));
  return Status();
}

}  // namespace

#define PKM_COMMON_ATTRS                                     \
  Attr("T: {float, half, bfloat16}")                         \
      .Attr("Tindices: {int32, int64}")                      \
      .Attr("combiner: {'sum', 'mean', 'sqrtn', 'max'} = 'sum'")    \
      .Attr("has_weights: bool = true")

REGISTER_OP("PkmEmbeddingBag")
    .Input("params: T")
    .Input("indices: Tindices")
    .Input("weights: T")
    .Output("output: T")
    .PKM_COMMON_ATTRS
    .SetShapeFn(DenseForwardShape)
    .Doc(R"doc(
Fused gather + weighted reduce: output[..., :] = combine_k weights[..., k] * params[indices[..., k], :].
params: [N, D] table. indices: [..., K]; negative entries are padding (skipped and not counted).
weights: same shape as indices; must be empty (e.g. shape [0]) when has_weights is false.
combiner: sum, mean (divide by sum of weights), sqrtn (divide by sqrt of sum of squared weights) or
max (elementwise max over the bag's valid rows, 0 for an empty bag; no weights; gradient to the row
holding each maximum, ties to the first).
output: [..., D]. Accumulates in float32; never materialises the [..., K, D] gather.
)doc");

REGISTER_OP("PkmEmbeddingBagGrad")
    .Input("grad: T")
    .Input("params: T")
    .Input("indices: Tindices")
    .Input("weights: T")
    .Output("d_params: T")
    .Output("d_weights: T")
    .PKM_COMMON_ATTRS
    .SetShapeFn([](InferenceContext* c) { return GradShape(c, 1, 3); })
    .Doc("Gradient of PkmEmbeddingBag: dense d_params [N, D] and d_weights shaped like weights.");

REGISTER_OP("PkmRaggedEmbeddingBag")
    .Input("params: T")
    .Input("values: Tindices")
    .Input("row_splits: Tsplits")
    .Input("weights: T")
    .Output("output: T")
    .PKM_COMMON_ATTRS
    .Attr("Tsplits: {int32, int64} = DT_INT64")
    .SetShapeFn(RaggedForwardShape)
    .Doc(R"doc(
PkmEmbeddingBag over ragged bags: bag b holds values[row_splits[b]:row_splits[b+1]].
output: [len(row_splits) - 1, D].
)doc");

REGISTER_OP("PkmRaggedEmbeddingBagGrad")
    .Input("grad: T")
    .Input("params: T")
    .Input("values: Tindices")
    .Input("row_splits: Tsplits")
    .Input("weights: T")
    .Output("d_params: T")
    .Output("d_weights: T")
    .PKM_COMMON_ATTRS
    .Attr("Tsplits: {int32, int64} = DT_INT64")
    .SetShapeFn([](InferenceContext* c) { return GradShape(c, 1, 4); })
    .Doc("Gradient of PkmRaggedEmbeddingBag: dense d_params [N, D] and d_weights shaped like weights.");

#undef PKM_COMMON_ATTRS

}  // namespace pkm_tf

// ---- row-sparse gradients (sparse_gradient=True) ------------------------------

namespace pkm_tf {
namespace {

Status SparseGradShape(InferenceContext* c, int params_input, int weights_input) {
  ShapeHandle params;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(params_input), 2, &params));
  c->set_output(0, c->Vector(c->UnknownDim()));
  c->set_output(1, c->Matrix(c->UnknownDim(), c->Dim(params, 1)));
  c->set_output(2, c->input(weights_input));
  return Status();
}

}  // namespace

#define PKM_SPARSE_GRAD_ATTRS                                \
  Attr("T: {float, half, bfloat16}")                         \
      .Attr("Tindices: {int32, int64}")                      \
      .Attr("combiner: {'sum', 'mean', 'sqrtn', 'max'} = 'sum'")    \
      .Attr("has_weights: bool = true")

REGISTER_OP("PkmEmbeddingBagSparseGrad")
    .Input("grad: T")
    .Input("params: T")
    .Input("indices: Tindices")
    .Input("weights: T")
    .Output("rows: int64")
    .Output("row_grads: T")
    .Output("d_weights: T")
    .PKM_SPARSE_GRAD_ATTRS
    .SetShapeFn([](InferenceContext* c) { return SparseGradShape(c, 1, 3); })
    .Doc(R"doc(
Row-sparse gradient of PkmEmbeddingBag: rows [U] are the distinct rows that valid indices touch
(ascending, U <= min(N, number of indices)), row_grads [U, D] their gradient rows; d_weights as in
PkmEmbeddingBagGrad. Together rows/row_grads form the IndexedSlices of d_params.
)doc");

REGISTER_OP("PkmRaggedEmbeddingBagSparseGrad")
    .Input("grad: T")
    .Input("params: T")
    .Input("values: Tindices")
    .Input("row_splits: Tsplits")
    .Input("weights: T")
    .Output("rows: int64")
    .Output("row_grads: T")
    .Output("d_weights: T")
    .PKM_SPARSE_GRAD_ATTRS
    .Attr("Tsplits: {int32, int64} = DT_INT64")
    .SetShapeFn([](InferenceContext* c) { return SparseGradShape(c, 1, 4); })
    .Doc("Row-sparse gradient of PkmRaggedEmbeddingBag (see PkmEmbeddingBagSparseGrad).");

#undef PKM_SPARSE_GRAD_ATTRS

}  // namespace pkm_tf

// ---- the table as a resource variable (training with sparse_gradient=True) ------
// Reading the variable inside the kernel, under its lock, is a sparse read:
// once a variable has had a sparse update (scatter_*), TF copies the whole
// table on every dense ReadVariableOp, which would cost O(N * D) per step.

namespace pkm_tf {

#define PKM_RESOURCE_ATTRS                                   \
  Attr("dtype: {float, half, bfloat16}")                     \
      .Attr("Tindices: {int32, int64}")                      \
      .Attr("combiner: {'sum', 'mean', 'sqrtn', 'max'} = 'sum'")    \
      .Attr("has_weights: bool = true")

REGISTER_OP("PkmResourceEmbeddingBag")
    .Input("resource: resource")
    .Input("indices: Tindices")
    .Input("weights: dtype")
    .Output("output: dtype")
    .PKM_RESOURCE_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle indices, leading, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), 1, &indices));
      DimensionHandle dim = c->UnknownDim();
      auto* handle_data = c->input_handle_shapes_and_types(0);
      if (handle_data != nullptr && handle_data->size() == 1) {
        ShapeHandle params;
        TF_RETURN_IF_ERROR(c->WithRank((*handle_data)[0].shape, 2, &params));
        dim = c->Dim(params, 1);
      }
      TF_RETURN_IF_ERROR(c->Subshape(indices, 0, -1, &leading));
      TF_RETURN_IF_ERROR(c->Concatenate(leading, c->Vector(dim), &out));
      c->set_output(0, out);
      return Status();
    })
    .Doc("PkmEmbeddingBag reading params from a resource variable (no dense read of the table).");

REGISTER_OP("PkmResourceEmbeddingBagSparseGrad")
    .Input("grad: dtype")
    .Input("resource: resource")
    .Input("indices: Tindices")
    .Input("weights: dtype")
    .Output("rows: int64")
    .Output("row_grads: dtype")
    .Output("d_weights: dtype")
    .PKM_RESOURCE_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grad;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &grad));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Matrix(c->UnknownDim(), c->Dim(grad, -1)));
      c->set_output(2, c->input(3));
      return Status();
    })
    .Doc("Row-sparse gradient of PkmResourceEmbeddingBag (see PkmEmbeddingBagSparseGrad).");

#undef PKM_RESOURCE_ATTRS

}  // namespace pkm_tf
