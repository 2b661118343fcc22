// Op definitions of the row-wise int8 EmbeddingBag ops (forward only: they
// serve quantised tables; training uses PkmEmbeddingBag on the float table).
// Kernels: quantized_embedding_bag_kernels.cc (CPU); XLA:
// kernels/xla/quantized_xla_cpu.cc.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace pkm_tf {
namespace {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

// params [N, D], row_scales [N], row_biases [N] or [0]: checked where known.
Status QuantizedTableShape(InferenceContext* c, ShapeHandle* params) {
  ShapeHandle scales, biases;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, params));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &scales));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &biases));
  DimensionHandle rows;
  return c->Merge(c->Dim(*params, 0), c->Dim(scales, 0), &rows);
}

Status QuantizedDenseShape(InferenceContext* c) {
  ShapeHandle params, indices, leading, out;
  TF_RETURN_IF_ERROR(QuantizedTableShape(c, &params));
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(3), 1, &indices));
  bool has_weights;
  TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
  if (has_weights) TF_RETURN_IF_ERROR(c->Merge(indices, c->input(4), &indices));
  TF_RETURN_IF_ERROR(c->Subshape(indices, 0, -1, &leading));
  TF_RETURN_IF_ERROR(c->Concatenate(leading, c->Vector(c->Dim(params, 1)), &out));
  c->set_output(0, out);
  return Status();
}

Status QuantizedRaggedShape(InferenceContext* c) {
  ShapeHandle params, values, splits;
  TF_RETURN_IF_ERROR(QuantizedTableShape(c, &params));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &values));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &splits));
  bool has_weights;
  TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &has_weights));
  if (has_weights) TF_RETURN_IF_ERROR(c->Merge(values, c->input(5), &values));
  DimensionHandle num_bags;
  TF_RETURN_IF_ERROR(c->Subtract(c->Dim(splits, 0), 1, &num_bags));
  c->set_output(0, c->Matrix(num_bags, c->Dim(params, 1)));
  return Status();
}

}  // namespace

#define PKM_QUANTIZED_ATTRS                                  \
  Attr("T: {float, half, bfloat16} = DT_FLOAT")              \
      .Attr("Tscale: {float, half} = DT_FLOAT")              \
      .Attr("Tindices: {int32, int64}")                      \
      .Attr("combiner: {'sum', 'mean', 'sqrtn'} = 'sum'")    \
      .Attr("has_weights: bool = true")

REGISTER_OP("PkmQuantizedEmbeddingBag")
    .Input("params: int8")
    .Input("row_scales: Tscale")
    .Input("row_biases: Tscale")
    .Input("indices: Tindices")
    .Input("weights: T")
    .Output("output: T")
    .PKM_QUANTIZED_ATTRS
    .SetShapeFn(QuantizedDenseShape)
    .Doc(R"doc(
PkmEmbeddingBag over a row-wise int8 table: row r of params is row_scales[r] * params[r] + row_biases[r]
(row_biases may be empty: no biases), dequantised while accumulating in float32. Same indices, weights
and combiner semantics as PkmEmbeddingBag; output [..., D] of T (the weights' type). Forward only.
)doc");

REGISTER_OP("PkmQuantizedRaggedEmbeddingBag")
    .Input("params: int8")
    .Input("row_scales: Tscale")
    .Input("row_biases: Tscale")
    .Input("values: Tindices")
    .Input("row_splits: Tsplits")
    .Input("weights: T")
    .Output("output: T")
    .PKM_QUANTIZED_ATTRS
    .Attr("Tsplits: {int32, int64} = DT_INT64")
    .SetShapeFn(QuantizedRaggedShape)
    .Doc("PkmQuantizedEmbeddingBag over ragged bags (values + row_splits, as PkmRaggedEmbeddingBag).");

#undef PKM_QUANTIZED_ATTRS

}  // namespace pkm_tf
