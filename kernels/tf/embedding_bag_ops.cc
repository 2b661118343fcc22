// Op definitions and shape functions of the fused EmbeddingBag ops.
// Kernels live in embedding_bag_kernels.cc (CPU) and
// embedding_bag_gpu_kernels.cc (GPU).
#include <optional>
#include <string>
#include <vector>

#include "kernels/tf/embedding_bag_common.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace pkm_tf {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

namespace {

// Shape inference through the core's rule set (kernels/core/shape_rules.h):
// the same rules and messages as the kernels, on what is known at graph time.
pkm::MaybeDims DimsOf(InferenceContext* c, ShapeHandle shape) {
  if (!c->RankKnown(shape)) return std::nullopt;
  pkm::Dims dims(c->Rank(shape));
  for (int i = 0; i < c->Rank(shape); ++i) dims[i] = c->Value(c->Dim(shape, i));  // -1 when unknown
  return dims;
}

ShapeHandle HandleOf(InferenceContext* c, const pkm::MaybeDims& dims) {
  if (!dims) return c->UnknownShape();
  std::vector<DimensionHandle> handles;
  for (int64_t d : *dims) handles.push_back(d < 0 ? c->UnknownDim() : c->MakeDim(d));
  return c->MakeShape(handles);
}

// The forward rules on inputs [params, ids, (row_splits,) weights] from
// `first`; *out is the forward output. `params` overrides input `first`
// (the resource ops read it from the variable's handle data).
Status ForwardShapeFrom(InferenceContext* c, int first, bool ragged, pkm::MaybeDims* out,
                        const pkm::MaybeDims* params = nullptr) {
  pkm::BagShapes shapes;
  shapes.ragged = ragged;
  shapes.params = params ? *params : DimsOf(c, c->input(first));
  shapes.indices = DimsOf(c, c->input(first + 1));
  if (ragged) shapes.row_splits = DimsOf(c, c->input(first + 2));
  shapes.weights = DimsOf(c, c->input(first + (ragged ? 3 : 2)));
  TF_RETURN_IF_ERROR(c->GetAttr("has_weights", &shapes.has_weights));
  std::string combiner;
  TF_RETURN_IF_ERROR(c->GetAttr("combiner", &combiner));
  if (!pkm::ParseCombiner(combiner, &shapes.combiner)) shapes.combiner = pkm::Combiner::kSum;  // the kernel reports it
  return ToTf(pkm::ForwardShape(shapes, out));
}

// The table's shape from a resource variable's handle data (unknown without).
pkm::MaybeDims VariableDims(InferenceContext* c, int input) {
  const auto* handle_data = c->input_handle_shapes_and_types(input);
  if (handle_data == nullptr || handle_data->size() != 1) return std::nullopt;
  return DimsOf(c, (*handle_data)[0].shape);
}

Status ForwardShape(InferenceContext* c, bool ragged) {
  pkm::MaybeDims out;
  TF_RETURN_IF_ERROR(ForwardShapeFrom(c, 0, ragged, &out));
  c->set_output(0, HandleOf(c, out));
  return Status();
}

// Gradient ops (grad first): d_params is shaped like params, d_weights like weights.
// Every gradient op's inputs: the forward's rules on params..weights (input 1
// on), and grad (input 0) shaped like the forward output.
Status CheckGradInputs(InferenceContext* c, bool ragged) {
  pkm::MaybeDims out;
  TF_RETURN_IF_ERROR(ForwardShapeFrom(c, 1, ragged, &out));
  return ToTf(pkm::GradShape(DimsOf(c, c->input(0)), out));
}

Status GradShape(InferenceContext* c, bool ragged) {
  TF_RETURN_IF_ERROR(CheckGradInputs(c, ragged));
  c->set_output(0, c->input(1));
  c->set_output(1, c->input(ragged ? 4 : 3));
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
    .SetShapeFn([](InferenceContext* c) { return ForwardShape(c, false); })
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
    .SetShapeFn([](InferenceContext* c) { return GradShape(c, false); })
    .Doc("Gradient of PkmEmbeddingBag: dense d_params [N, D] and d_weights shaped like weights.");

REGISTER_OP("PkmRaggedEmbeddingBag")
    .Input("params: T")
    .Input("values: Tindices")
    .Input("row_splits: Tsplits")
    .Input("weights: T")
    .Output("output: T")
    .PKM_COMMON_ATTRS
    .Attr("Tsplits: {int32, int64} = DT_INT64")
    .SetShapeFn([](InferenceContext* c) { return ForwardShape(c, true); })
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
    .SetShapeFn([](InferenceContext* c) { return GradShape(c, true); })
    .Doc("Gradient of PkmRaggedEmbeddingBag: dense d_params [N, D] and d_weights shaped like weights.");

// ---- row-sparse gradients (sparse_gradient=True) ------------------------------

namespace {

Status SparseGradShape(InferenceContext* c, bool ragged) {
  TF_RETURN_IF_ERROR(CheckGradInputs(c, ragged));
  c->set_output(0, c->Vector(c->UnknownDim()));
  c->set_output(1, c->Matrix(c->UnknownDim(), c->Dim(c->input(1), 1)));
  c->set_output(2, c->input(ragged ? 4 : 3));
  return Status();
}

}  // namespace

REGISTER_OP("PkmEmbeddingBagSparseGrad")
    .Input("grad: T")
    .Input("params: T")
    .Input("indices: Tindices")
    .Input("weights: T")
    .Output("rows: int64")
    .Output("row_grads: T")
    .Output("d_weights: T")
    .PKM_COMMON_ATTRS
    .SetShapeFn([](InferenceContext* c) { return SparseGradShape(c, false); })
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
    .PKM_COMMON_ATTRS
    .Attr("Tsplits: {int32, int64} = DT_INT64")
    .SetShapeFn([](InferenceContext* c) { return SparseGradShape(c, true); })
    .Doc("Row-sparse gradient of PkmRaggedEmbeddingBag (see PkmEmbeddingBagSparseGrad).");

#undef PKM_COMMON_ATTRS

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
      const pkm::MaybeDims params = VariableDims(c, 0);
      pkm::MaybeDims out;
      TF_RETURN_IF_ERROR(ForwardShapeFrom(c, 0, false, &out, &params));
      c->set_output(0, HandleOf(c, out));
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
      const pkm::MaybeDims params = VariableDims(c, 1);
      pkm::MaybeDims out;
      TF_RETURN_IF_ERROR(ForwardShapeFrom(c, 1, false, &out, &params));
      TF_RETURN_IF_ERROR(ToTf(pkm::GradShape(DimsOf(c, c->input(0)), out)));
      c->set_output(0, c->Vector(c->UnknownDim()));
      c->set_output(1, c->Matrix(c->UnknownDim(), params && (*params)[1] >= 0 ? c->MakeDim((*params)[1]) : c->UnknownDim()));
      c->set_output(2, c->input(3));
      return Status();
    })
    .Doc("Row-sparse gradient of PkmResourceEmbeddingBag (see PkmEmbeddingBagSparseGrad).");

#undef PKM_RESOURCE_ATTRS

}  // namespace pkm_tf
