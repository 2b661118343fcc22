// Matching of stock GATHER -> [MUL] -> SUM chains (composite_chain.h).
#include "tflite_delegate/composite_chain.h"

#include <cstdint>
#include <string>
#include <vector>

#include "tflite_delegate/composite_shapes.h"

namespace pkm {
namespace tflite {
namespace {

// Reads the constant reduction axis of a SUM node.
bool ConstAxis(const Graph& g, int tensor, int* axis) {
  const TfLiteTensor* t = g.Tensor(tensor);
  if (t == nullptr || t->type != kTfLiteInt32 || t->allocation_type != kTfLiteMmapRo ||
      t->data.data == nullptr || t->bytes != 4)
    return false;
  *axis = t->data.i32[0];
  return true;
}

// Element count of a tensor; false for no shape or one whose count
// overflows (never matched, so the stock ops keep it and report it).
bool NumElements(const TfLiteTensor* t, int64_t* n) {
  if (t->dims == nullptr || t->dims->size < 0) return false;
  const std::vector<int64_t> dims(t->dims->data, t->dims->data + t->dims->size);
  return CheckedNumElements(dims, n);
}

// The values of a constant int32/int64 tensor of rank 0 or 1.
bool ConstInts(const Graph& g, int tensor, std::vector<int64_t>* values) {
  const TfLiteTensor* t = g.Tensor(tensor);
  if (t == nullptr || t->allocation_type != kTfLiteMmapRo || t->data.data == nullptr || t->dims == nullptr ||
      t->dims->size > 1)
    return false;
  values->clear();
  if (t->type == kTfLiteInt32) {
    for (size_t i = 0; i < t->bytes / 4; ++i) values->push_back(t->data.i32[i]);
  } else if (t->type == kTfLiteInt64) {
    for (size_t i = 0; i < t->bytes / 8; ++i) values->push_back(t->data.i64[i]);
  } else {
    return false;
  }
  return true;
}

// True if `node` only re-shapes its first input (same elements, same order)
// in a way whose result for other input shapes is known (*step): RESHAPE to
// a constant shape, EXPAND_DIMS on a constant axis, SQUEEZE, or a
// STRIDED_SLICE that takes every element of every axis it names. The
// converter emits these for w[..., None] and expand_dims(w, -1).
bool IsReshapeLike(const Graph& g, int node_index, int* source, ShapeStep* step) {
  TfLiteContext* ctx = g.context;
  TfLiteNode* node;
  TfLiteRegistration* reg;
  if (ctx->GetNodeAndRegistration(ctx, node_index, &node, &reg) != kTfLiteOk) return false;
  if (!node->inputs || node->inputs->size < 1 || !node->outputs || node->outputs->size != 1)
    return false;
  const TfLiteTensor* in = g.Tensor(node->inputs->data[0]);
  const TfLiteTensor* out = g.Tensor(node->outputs->data[0]);
  int64_t in_elems, out_elems;
  if (!in || !out || in->type != kTfLiteFloat32 || out->type != kTfLiteFloat32 ||
      !NumElements(in, &in_elems) || !NumElements(out, &out_elems) || in_elems != out_elems)
    return false;
  *step = ShapeStep();
  const int code = reg->builtin_code;
  const int rank = in->dims->size;
  if (code == kTfLiteBuiltinStridedSlice) {
    std::vector<int64_t> begin, end, strides;
    if (node->inputs->size != 4 || node->builtin_data == nullptr || !ConstInts(g, node->inputs->data[1], &begin) ||
        !ConstInts(g, node->inputs->data[2], &end) || !ConstInts(g, node->inputs->data[3], &strides) ||
        begin.size() != end.size() || begin.size() != strides.size() || static_cast<int>(begin.size()) > rank)
      return false;
    // Masks only (the `offset` field is newer than some runtimes we load in):
    // every named axis from its start (begin 0 or masked) to its end (masked),
    // step 1, no axes added or dropped: the slice is its input, whatever its
    // shape.
    const auto* p = static_cast<const TfLiteStridedSliceParams*>(node->builtin_data);
    if (p->ellipsis_mask != 0 || p->new_axis_mask != 0 || p->shrink_axis_mask != 0) return false;
    for (size_t i = 0; i < begin.size(); ++i)
      if (strides[i] != 1 || !((p->begin_mask >> i) & 1 || begin[i] == 0) || !((p->end_mask >> i) & 1))
        return false;
    step->kind = ShapeStep::Kind::kIdentity;
    step->values = {static_cast<int64_t>(begin.size())};
  } else if (code == kTfLiteBuiltinReshape) {
    if (node->inputs->size < 2 || !ConstInts(g, node->inputs->data[1], &step->values)) return false;
    step->kind = ShapeStep::Kind::kReshape;
  } else if (code == kTfLiteBuiltinExpandDims) {
    if (node->inputs->size != 2 || !ConstInts(g, node->inputs->data[1], &step->values) || step->values.size() != 1)
      return false;
    step->kind = ShapeStep::Kind::kExpandDims;
  } else if (code == kTfLiteBuiltinSqueeze) {
    const auto* p = static_cast<const TfLiteSqueezeParams*>(node->builtin_data);
    if (p == nullptr || p->num_squeeze_dims < 0 || p->num_squeeze_dims > 8) return false;
    step->values.assign(p->squeeze_dims, p->squeeze_dims + p->num_squeeze_dims);
    step->kind = ShapeStep::Kind::kSqueeze;
  } else {
    return false;
  }
  // The step must give the shape the converter gave the output.
  std::vector<int64_t> dims(in->dims->data, in->dims->data + rank);
  std::string error;
  if (!ApplyShapeStep(*step, &dims, &error) || dims.size() != static_cast<size_t>(out->dims->size)) return false;
  for (size_t i = 0; i < dims.size(); ++i)
    if (dims[i] != out->dims->data[i]) return false;
  *source = node->inputs->data[0];
  return true;
}

// The GATHER a chain starts with: rows of a rank-2 float32 table on axis 0.
struct ChainGather {
  int params = -1, indices = -1, gathered = -1;
  int bag_axis = 0;       // axis of K in the gathered [..., K, D]
  int gathered_rank = 0;
};

bool MatchGather(const Graph& g, int gather_node, ChainGather* out) {
  TfLiteContext* ctx = g.context;
  TfLiteNode* gn;
  TfLiteRegistration* greg;
  if (ctx->GetNodeAndRegistration(ctx, gather_node, &gn, &greg) != kTfLiteOk) return false;
  if (greg->builtin_code != kTfLiteBuiltinGather || !gn->inputs || gn->inputs->size != 2 ||
      !gn->outputs || gn->outputs->size != 1 || gn->builtin_data == nullptr)
    return false;
  const auto* gp = static_cast<const TfLiteGatherParams*>(gn->builtin_data);
  if (gp->axis != 0 || gp->batch_dims != 0) return false;
  out->params = gn->inputs->data[0];
  out->indices = gn->inputs->data[1];
  out->gathered = gn->outputs->data[0];
  const TfLiteTensor* pt = g.Tensor(out->params);
  const TfLiteTensor* it = g.Tensor(out->indices);
  if (!pt || !it || pt->type != kTfLiteFloat32 || g.Rank(out->params) != 2 ||
      (it->type != kTfLiteInt32 && it->type != kTfLiteInt64) || g.Rank(out->indices) < 1)
    return false;
  out->bag_axis = g.Rank(out->indices) - 1;
  out->gathered_rank = g.Rank(out->indices) + 1;
  return true;
}

// MUL node `mul` of the gathered rows by per-index weights [..., K, 1]:
// records it (and the reshape-likes the weights come through) in the chain;
// *weights is the tensor the kernel reads, *product the MUL's output.
bool MatchWeightMul(const Graph& g, const ChainGather& gather, int mul, Chain* chain,
                    int* weights, int* product) {
  TfLiteNode* nn;
  TfLiteRegistration* nreg;
  if (g.context->GetNodeAndRegistration(g.context, mul, &nn, &nreg) != kTfLiteOk) return false;
  if (!nn->inputs || nn->inputs->size != 2 || !nn->outputs || nn->outputs->size != 1 ||
      nn->builtin_data == nullptr ||
      static_cast<const TfLiteMulParams*>(nn->builtin_data)->activation != kTfLiteActNone)
    return false;
  const int gathered = gather.gathered;
  int w = nn->inputs->data[0] == gathered ? nn->inputs->data[1] : nn->inputs->data[0];
  if (w == gathered) return false;  // x * x is not a bag
  const TfLiteTensor* wt = g.Tensor(w);
  const TfLiteTensor* it = g.Tensor(gather.indices);
  const int rank = gather.gathered_rank;
  if (!wt || wt->type != kTfLiteFloat32 || g.Rank(w) != rank || wt->dims->data[rank - 1] != 1)
    return false;
  for (int d = 0; d < rank - 1; ++d)
    if (wt->dims->data[d] != it->dims->data[d]) return false;
  chain->mul = mul;
  // Walk back over reshape-likes of the weights so the partition holds the
  // whole chain (else the partitioner splits GATHER from MUL).
  for (int depth = 0; depth < 4; ++depth) {
    auto p = g.producer.find(w);
    int source;
    ShapeStep step;
    if (p == g.producer.end() || g.SoleConsumer(w) < 0 || !IsReshapeLike(g, p->second, &source, &step))
      break;
    chain->weight_reshapes.insert(chain->weight_reshapes.begin(), p->second);
    chain->spec.weight_steps.insert(chain->spec.weight_steps.begin(), step);
    chain->intermediates.push_back(w);
    w = source;
  }
  *weights = w;
  *product = nn->outputs->data[0];
  chain->intermediates.push_back(*product);
  return true;
}

// SUM node `sum` of `reduced` over the bag axis; returns its keep_dims and
// its axis as written (*written_axis).
bool MatchBagSum(const Graph& g, const ChainGather& gather, int sum, int reduced,
                 bool* keep_dims, int* output, int* written_axis) {
  TfLiteNode* nn;
  TfLiteRegistration* nreg;
  if (g.context->GetNodeAndRegistration(g.context, sum, &nn, &nreg) != kTfLiteOk) return false;
  if (nreg->builtin_code != kTfLiteBuiltinSum || !nn->inputs || nn->inputs->size != 2 ||
      nn->inputs->data[0] != reduced || !nn->outputs || nn->outputs->size != 1 ||
      nn->builtin_data == nullptr)
    return false;
  int axis;
  if (!ConstAxis(g, nn->inputs->data[1], &axis)) return false;
  *written_axis = axis;
  if (axis < 0) axis += gather.gathered_rank;
  if (axis != gather.bag_axis) return false;
  *keep_dims = static_cast<const TfLiteReducerParams*>(nn->builtin_data)->keep_dims;
  *output = nn->outputs->data[0];
  return true;
}

}  // namespace

// Matches GATHER(params[N,D] float32, indices) -> [MUL(x, w[...,K,1])] ->
// SUM(axis = bag axis), the sequence the converter emits for
// reduce_sum(gather(table, idx) * w[..., None], axis=-2).
bool MatchChain(const Graph& g, int gather_node, Chain* chain) {
  ChainGather gather;
  if (!MatchGather(g, gather_node, &gather)) return false;
  *chain = Chain();
  chain->gather = gather_node;
  chain->intermediates.push_back(gather.gathered);
  int next = g.SoleConsumer(gather.gathered);
  TfLiteNode* nn;
  TfLiteRegistration* nreg;
  if (next < 0 || g.context->GetNodeAndRegistration(g.context, next, &nn, &nreg) != kTfLiteOk)
    return false;
  int reduced = gather.gathered, weights = -1;
  if (nreg->builtin_code == kTfLiteBuiltinMul) {
    if (!MatchWeightMul(g, gather, next, chain, &weights, &reduced)) return false;
    next = g.SoleConsumer(reduced);
    if (next < 0) return false;
  }
  bool keep_dims;
  int output, sum_axis;
  if (!MatchBagSum(g, gather, next, reduced, &keep_dims, &output, &sum_axis)) return false;
  chain->sum = next;
  BagSpec& s = chain->spec;
  s.table = gather.params;
  s.indices = gather.indices;
  s.weights = weights;
  s.output = output;
  s.combiner = Combiner::kSum;
  s.composite = true;
  s.keep_dims = keep_dims;
  s.sum_axis = sum_axis;
  s.what = "PkmEmbeddingBag (fused GATHER/MUL/SUM)";
  return true;
}

}  // namespace tflite
}  // namespace pkm
