#include "tflite_delegate/embedding_bag_tflite.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/shape_rules.h"
#include "tflite_delegate/composite_shapes.h"

namespace pkm {
namespace tflite {
namespace {

bool ToElemType(TfLiteType t, ElemType* out) {
  switch (t) {
    case kTfLiteFloat32: *out = ElemType::kFloat32; return true;
    case kTfLiteFloat16: *out = ElemType::kFloat16; return true;
    case kTfLiteBFloat16: *out = ElemType::kBFloat16; return true;
    case kTfLiteInt8: *out = ElemType::kInt8; return true;
    default: return false;
  }
}

DType DTypeOfTfLite(TfLiteType t) {
  switch (t) {
    case kTfLiteFloat32: return DType::kFloat32;
    case kTfLiteFloat16: return DType::kFloat16;
    case kTfLiteBFloat16: return DType::kBFloat16;
    case kTfLiteInt8: return DType::kInt8;
    case kTfLiteInt32: return DType::kInt32;
    case kTfLiteInt64: return DType::kInt64;
    case kTfLiteFloat64: return DType::kFloat64;
    default: return DType::kOther;
  }
}

// The params rank rule alone: BindTable reads N and D before the others.
Status ParamsShape(const Dims& params) {
  BagShapes shapes;
  shapes.params = params;
  shapes.has_weights = false;
  MaybeDims out;
  return ForwardShape(shapes, &out);
}

// The core's call, mapped from the tensors: Table/Bags plus the output.
struct Bound {
  Table table;
  Bags bags;
  ElemType out_type = ElemType::kFloat32;
  std::vector<int64_t> out_dims;
  int64_t out_bytes = 0;
  TfLiteTensor* output = nullptr;
  // A fused composite's weights broadcast to one per index, as the stock MUL
  // would broadcast them (Bind at Invoke, where the weights hold data).
  std::vector<float> broadcast_weights;
};

// Reads tensors of one node and reports what is wrong with them, prefixed by
// the op's name. Buffers are checked only at Invoke (check_buffers): the arena
// is allocated after Prepare.
class Binder {
 public:
  Binder(TfLiteContext* context, const BagSpec& spec, bool check_buffers)
      : context_(context), spec_(spec), check_buffers_(check_buffers) {}
  TfLiteStatus Fail(const std::string& msg) {
    context_->ReportError(context_, "%s: %s", spec_.what, msg.c_str());
    return kTfLiteError;
  }
  // Tensor by index with its shape; error if the index or dims are invalid.
  TfLiteStatus Get(int index, const char* role, TfLiteTensor** t, std::vector<int64_t>* dims) {
    if (index < 0 || static_cast<size_t>(index) >= context_->tensors_size)
      return Fail(std::string(role) + " tensor index " + std::to_string(index) +
                  " is out of range");
    *t = &context_->tensors[index];
    const TfLiteIntArray* d = (*t)->dims;
    if (d == nullptr || d->size < 0) return Fail(std::string(role) + " has no shape");
    dims->assign(d->data, d->data + d->size);
    return Rule(ConcreteDims(role, *dims));
  }
  // The core's rule: ok, or its message as this op's error.
  TfLiteStatus Rule(const Status& s) { return s.ok ? kTfLiteOk : Fail(s.message); }
  // Element count and byte size of a shape; error if either overflows int64
  // (a wrapped product would let the buffer checks pass on a malformed shape).
  TfLiteStatus Size(const std::string& role, const Dims& dims, int64_t elem_size, int64_t* elems, int64_t* bytes) {
    if (Rule(ConcreteDims(role.c_str(), dims, elems)) != kTfLiteOk) return kTfLiteError;
    if (CheckedBytes(*elems, elem_size, bytes)) return kTfLiteOk;
    return Fail(role + " shape too large: " + DimsString(dims) + " (its size in bytes overflows int64)");
  }
  // A tensor whose buffer is smaller than its shape is malformed.
  TfLiteStatus Buffer(const std::string& role, const TfLiteTensor* t, int64_t bytes, const Dims& dims) {
    if (!check_buffers_ || bytes == 0 ||
        (t->data.data != nullptr && t->bytes >= static_cast<size_t>(bytes)))
      return kTfLiteOk;
    return Fail(role + " buffer is smaller than its shape " + DimsString(dims));
  }

 private:
  TfLiteContext* context_;
  const BagSpec& spec_;
  const bool check_buffers_;
};

// A usable dequantisation scale.
bool ValidScale(float s) { return s > 0.f && std::isfinite(s); }

// Reads per-row (axis 0) scales of an int8 table into the core's layout:
// TFLite's scale * (q - zero_point) is scale * q + bias with
// bias = -scale * zero_point. TfLiteFloatArray changed
// layout across releases ({int size; float data[]} -> {float* data; int size;
// bool owning}), so both are recognised by where the count (known from the
// zero-point TfLiteIntArray, whose layout never changed) is stored.
bool ReadAffineScales(const TfLiteTensor* t, int64_t rows, BagState* state,
                      std::string* error) {
  state->row_scales.clear();
  state->row_biases.clear();
  const auto* aq = t->quantization.type == kTfLiteAffineQuantization
                       ? static_cast<const TfLiteAffineQuantization*>(t->quantization.params)
                       : nullptr;
  const int count = (aq != nullptr && aq->zero_point != nullptr) ? aq->zero_point->size : 0;
  if (aq == nullptr || aq->scale == nullptr || count <= 1) {
    // Per-tensor: the runtime mirrors a single scale into the legacy params.
    if (!ValidScale(t->params.scale)) {
      *error = "int8 params need per-row (axis 0) quantisation scales; the tensor has none";
      return false;
    }
    state->row_scales.assign(rows, t->params.scale);
    state->row_biases.assign(rows, -t->params.scale * static_cast<float>(t->params.zero_point));
    return true;
  }
  if (count != rows || aq->quantized_dimension != 0) {
    *error = "int8 params quantisation must be per row (axis 0) with " +
             std::to_string(rows) + " scales; got " + std::to_string(count) +
             " on axis " + std::to_string(aq->quantized_dimension);
    return false;
  }
  // count >= 2, so both layouts span at least 12 bytes.
  const auto* raw = reinterpret_cast<const uint8_t*>(aq->scale);
  int32_t legacy_size, new_size;
  std::memcpy(&legacy_size, raw, 4);
  std::memcpy(&new_size, raw + 8, 4);
  const float* scales = nullptr;
  if (legacy_size == count && new_size != count) {
    scales = reinterpret_cast<const float*>(raw + 4);
  } else if (new_size == count && legacy_size != count) {
    // A legacy array always has its count at offset 0, so this is the new
    // layout; still, only follow a plausible pointer.
    std::memcpy(&scales, raw, sizeof(scales));
    if (reinterpret_cast<uintptr_t>(scales) % alignof(float) != 0) scales = nullptr;
  }
  // Neither or both counts match: the pointer would be a guess (in the legacy
  // layout, both matching means a scale with the bits of a small integer).
  if (scales == nullptr) {
    *error = "int8 params: unrecognised quantisation scale array layout";
    return false;
  }
  state->row_scales.resize(rows);
  state->row_biases.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    if (!ValidScale(scales[r])) {
      *error = "int8 params: scale of row " + std::to_string(r) + " is " +
               std::to_string(scales[r]) + "; scales must be positive and finite";
      state->row_scales.clear();
      state->row_biases.clear();
      return false;
    }
    state->row_scales[r] = scales[r];
    state->row_biases[r] = -scales[r] * static_cast<float>(aq->zero_point->data[r]);
  }
  return true;
}

// Params -> Table (its type; its shape is ForwardShape's). The int8 row
// scales come from Prepare (state).
TfLiteStatus BindTable(Binder& c, const BagSpec& spec, const BagState* state, Bound* bound, Dims* tdims) {
  TfLiteTensor *table, *output;
  Dims odims;
  Table* t = &bound->table;
  if (c.Get(spec.table, "params", &table, tdims) != kTfLiteOk) return kTfLiteError;
  if (c.Get(spec.output, "output", &output, &odims) != kTfLiteOk) return kTfLiteError;
  if (c.Rule(ParamsType(DTypeOfTfLite(table->type), /*int8_allowed=*/true)) != kTfLiteOk ||
      c.Rule(OutputType(DTypeOfTfLite(output->type), DTypeOfTfLite(table->type))) != kTfLiteOk ||
      c.Rule(ParamsShape(*tdims)) != kTfLiteOk)
    return kTfLiteError;
  ToElemType(table->type, &t->type);
  ToElemType(output->type, &bound->out_type);
  t->data = table->data.data;
  t->num_rows = (*tdims)[0];
  t->dim = (*tdims)[1];
  if (t->type == ElemType::kInt8) {
    if (state == nullptr || static_cast<int64_t>(state->row_scales.size()) != t->num_rows)
      return c.Fail("int8 params: row scales were not prepared for " +
                    std::to_string(t->num_rows) + " rows");
    t->row_scales = state->row_scales.data();
    t->row_biases = state->row_biases.data();
    t->row_params_type = ElemType::kFloat32;
  }
  int64_t elems, bytes;
  if (c.Size("params", *tdims, ElemSize(t->type), &elems, &bytes) != kTfLiteOk) return kTfLiteError;
  bound->output = output;
  return c.Buffer("params", table, bytes, *tdims);
}

// Indices (dense [..., K]) or values + row_splits (ragged) -> Bags. Only the
// layout is read: the core checks the values (indices in range, splits from
// 0, non-decreasing, ending at num_values) before using them (Forward block by
// block of bags; ValidateBags where the output is empty).
TfLiteStatus BindIds(Binder& c, const BagSpec& spec, Bags* b, BagShapes* shapes) {
  const bool ragged = spec.row_splits >= 0;
  const char* role = ragged ? "values" : "indices";
  TfLiteTensor* indices;
  Dims idims;
  MaybeDims ignored;  // the output: Bind works it out once the weights are known
  if (c.Get(spec.indices, role, &indices, &idims) != kTfLiteOk) return kTfLiteError;
  if (c.Rule(IndexType(role, DTypeOfTfLite(indices->type))) != kTfLiteOk) return kTfLiteError;
  shapes->indices = idims;
  b->indices = indices->data.data;
  b->indices_int64 = indices->type == kTfLiteInt64;
  if (ragged) {
    TfLiteTensor* splits;
    Dims sdims;
    if (c.Get(spec.row_splits, "row_splits", &splits, &sdims) != kTfLiteOk ||
        c.Rule(IndexType("row_splits", DTypeOfTfLite(splits->type))) != kTfLiteOk)
      return kTfLiteError;
    shapes->row_splits = sdims;
    if (c.Rule(ForwardShape(*shapes, &ignored)) != kTfLiteOk) return kTfLiteError;  // ids and splits
    b->row_splits = splits->data.data;
    b->row_splits_int64 = splits->type == kTfLiteInt64;
    b->num_bags = sdims[0] - 1;
    b->num_values = idims[0];
    if (c.Buffer("row_splits", splits, sdims[0] * (b->row_splits_int64 ? 8 : 4), sdims) != kTfLiteOk)
      return kTfLiteError;
  } else {
    if (c.Rule(ForwardShape(*shapes, &ignored)) != kTfLiteOk) return kTfLiteError;  // ids alone
    b->bag_size = idims.back();
    CheckedNumElements(idims.data(), idims.size() - 1, &b->num_bags);  // within int64: ForwardShape checked
  }
  int64_t num_indices, index_bytes;
  if (c.Size(role, idims, b->indices_int64 ? 8 : 4, &num_indices, &index_bytes) != kTfLiteOk) return kTfLiteError;
  return c.Buffer(role, indices, index_bytes, idims);
}

// Optional weights -> Bags::weights. A fused composite's weights may be any
// reshape of [..., K] (the delegate checked that the chain only re-shapes them).
TfLiteStatus BindWeights(Binder& c, const BagSpec& spec, Bags* b, BagShapes* shapes) {
  shapes->has_weights = spec.weights >= 0;
  shapes->weights_any_shape = spec.composite;
  if (spec.weights < 0) return kTfLiteOk;  // has_weights=false: the input is a placeholder
  TfLiteTensor* weights;
  Dims wdims;
  if (c.Get(spec.weights, "weights", &weights, &wdims) != kTfLiteOk ||
      c.Rule(WeightsType(DTypeOfTfLite(weights->type))) != kTfLiteOk)
    return kTfLiteError;
  ToElemType(weights->type, &b->weights_type);
  shapes->weights = wdims;
  int64_t weight_elems, weight_bytes;
  if (c.Size("weights", wdims, ElemSize(b->weights_type), &weight_elems, &weight_bytes) != kTfLiteOk)
    return kTfLiteError;
  b->weights = weights->data.data;
  return c.Buffer("weights", weights, weight_bytes, wdims);
}

// A fused stock chain with the shapes of this call (composite_shapes.h):
// broadcast weights become one per index (at Invoke, into
// bound->broadcast_weights); shapes the chain no longer fits are an error.
TfLiteStatus CheckCompositeShapes(Binder& c, const BagSpec& spec, bool check_buffers, Bound* bound,
                                  BagShapes* shapes) {
  const Dims& ids = *shapes->indices;  // Bind has every shape by now
  Dims mul;
  bool broadcast = false;
  std::string error;
  if (!CompositeShapesFit(spec, ids, (*shapes->params)[1], shapes->weights.value_or(Dims()), &mul, &broadcast,
                          &error))
    return c.Fail(error);
  if (!broadcast) return kTfLiteOk;
  if (bound->bags.weights_type != ElemType::kFloat32) return c.Fail("broadcast weights must be float32");
  shapes->weights = ids;
  if (!check_buffers) return kTfLiteOk;
  BroadcastWeights(static_cast<const float*>(bound->bags.weights), mul, ids, &bound->broadcast_weights);
  bound->bags.weights = bound->broadcast_weights.data();
  return kTfLiteOk;
}

// Shared by Prepare and Invoke: maps every tensor onto the core's Table/Bags
// and works out the output shape with the core's shape rules.
TfLiteStatus Bind(TfLiteContext* context, const BagSpec& spec, const BagState* state,
                  bool check_buffers, Bound* bound) {
  Binder c(context, spec, check_buffers);
  BagShapes shapes;
  Dims tdims;
  shapes.ragged = spec.row_splits >= 0;
  shapes.combiner = spec.combiner;
  shapes.has_weights = spec.weights >= 0;  // before BindIds' partial checks (max refuses weights)
  if (BindTable(c, spec, state, bound, &tdims) != kTfLiteOk) return kTfLiteError;
  shapes.params = tdims;
  if (BindIds(c, spec, &bound->bags, &shapes) != kTfLiteOk ||
      BindWeights(c, spec, &bound->bags, &shapes) != kTfLiteOk)
    return kTfLiteError;
  if (spec.composite && CheckCompositeShapes(c, spec, check_buffers, bound, &shapes) != kTfLiteOk)
    return kTfLiteError;
  MaybeDims out;
  if (c.Rule(ForwardShape(shapes, &out)) != kTfLiteOk) return kTfLiteError;
  // Stock GATHER fails on any index outside [0, N) while the op treats
  // negatives as padding: a fused chain must fail where the stock one does.
  if (spec.composite) bound->bags.index_policy = IndexPolicy::kNoPadding;
  bound->out_dims = *out;
  if (spec.composite && spec.keep_dims) bound->out_dims.insert(bound->out_dims.end() - 1, 1);
  int64_t out_elems;
  return c.Size("output", bound->out_dims, ElemSize(bound->out_type), &out_elems, &bound->out_bytes);
}

// The core's status as a TFLite error naming the op.
TfLiteStatus Report(TfLiteContext* context, const BagSpec& spec, const Status& s) {
  if (s.ok) return kTfLiteOk;
  context->ReportError(context, "%s: %s", spec.what, s.message.c_str());
  return kTfLiteError;
}

TfLiteStatus ResizeOutput(TfLiteContext* context, const BagSpec& spec, const Bound& bound) {
  // A dynamic output whose buffer PrepareBag dropped gets one from ResizeTensor even when
  // its stored dims already are the result's (the first invoke of a [1, D] output).
  const bool needs_buffer = bound.output->allocation_type == kTfLiteDynamic && bound.out_bytes > 0 &&
                            (bound.output->data.data == nullptr ||
                             bound.output->bytes < static_cast<size_t>(bound.out_bytes));
  if (SameDims(bound.output->dims, bound.out_dims) && !needs_buffer) return kTfLiteOk;
  for (int64_t d : bound.out_dims) {
    if (d > 0x7fffffff) {
      context->ReportError(context, "%s: output dimension %lld exceeds int32", spec.what,
                           static_cast<long long>(d));
      return kTfLiteError;
    }
  }
  TfLiteIntArray* dims = NewIntArray(std::vector<int>(bound.out_dims.begin(), bound.out_dims.end()));
  if (dims == nullptr) return kTfLiteError;
  return context->ResizeTensor(context, bound.output, dims);
}

}  // namespace

TfLiteIntArray* NewIntArray(const std::vector<int>& values) {
  auto* array = static_cast<TfLiteIntArray*>(std::malloc(sizeof(TfLiteIntArray) + sizeof(int) * (values.size() + 1)));
  if (array == nullptr) return nullptr;
  array->size = static_cast<int>(values.size());
  for (size_t i = 0; i < values.size(); ++i) array->data[i] = values[i];
  return array;
}

bool SameDims(const TfLiteIntArray* dims, const std::vector<int64_t>& want) {
  if (dims == nullptr || dims->size != static_cast<int>(want.size())) return false;
  for (size_t i = 0; i < want.size(); ++i)
    if (dims->data[i] != want[i]) return false;
  return true;
}

void MakeDynamic(TfLiteTensor* tensor) {
  if (tensor->allocation_type == kTfLiteDynamic) return;
  tensor->data.raw = nullptr;
  tensor->bytes = 0;
  tensor->allocation_type = kTfLiteDynamic;
}

bool IsBagCustomOpName(const char* name, bool* ragged) {
  if (name == nullptr) return false;
  *ragged = std::strcmp(name, kRaggedCustomOpName) == 0;
  return *ragged || std::strcmp(name, kCustomOpName) == 0;
}

TfLiteStatus PrepareBag(TfLiteContext* context, const BagSpec& spec, BagState* state) {
  // Scales first: Bind needs them for int8 tables.
  if (spec.table >= 0 && static_cast<size_t>(spec.table) < context->tensors_size) {
    const TfLiteTensor* table = &context->tensors[spec.table];
    if (table->type == kTfLiteInt8 && table->dims != nullptr && table->dims->size == 2) {
      std::string error;
      if (!ReadAffineScales(table, table->dims->data[0] < 0 ? 0 : table->dims->data[0], state,
                            &error)) {
        context->ReportError(context, "%s: %s", spec.what, error.c_str());
        return kTfLiteError;
      }
    }
  }
  // An input produced by an op with data-dependent shape is dynamic: its dims
  // are stale until that op runs, so everything is checked at Invoke and the
  // output is made dynamic.
  bool dynamic_input = false;
  for (int idx : {spec.table, spec.indices, spec.row_splits, spec.weights})
    if (idx >= 0 && static_cast<size_t>(idx) < context->tensors_size &&
        context->tensors[idx].allocation_type == kTfLiteDynamic)
      dynamic_input = true;
  if (dynamic_input && spec.output >= 0 && static_cast<size_t>(spec.output) < context->tensors_size) {
    MakeDynamic(&context->tensors[spec.output]);
    return kTfLiteOk;
  }
  Bound bound;
  if (Bind(context, spec, state, /*check_buffers=*/false, &bound) != kTfLiteOk) return kTfLiteError;
  return ResizeOutput(context, spec, bound);
}

TfLiteStatus InvokeBag(TfLiteContext* context, const BagSpec& spec, const BagState& state,
                       const ParallelFor& pf) {
  Bound bound;
  if (Bind(context, spec, &state, /*check_buffers=*/true, &bound) != kTfLiteOk) return kTfLiteError;
  if (bound.output->allocation_type == kTfLiteDynamic &&
      ResizeOutput(context, spec, bound) != kTfLiteOk)
    return kTfLiteError;
  if (!SameDims(bound.output->dims, bound.out_dims)) {
    context->ReportError(context, "%s: output shape does not match %s (inputs changed after Prepare)",
                         spec.what, DimsString(bound.out_dims).c_str());
    return kTfLiteError;
  }
  // Nothing to write (D == 0 or no bags), but bad indices are still an error.
  if (bound.out_bytes == 0) return Report(context, spec, ValidateBags(bound.table, bound.bags, pf));
  if (bound.output->data.data == nullptr || bound.output->bytes < static_cast<size_t>(bound.out_bytes)) {
    context->ReportError(context, "%s: output buffer is not allocated", spec.what);
    return kTfLiteError;
  }
  return Report(context, spec, Forward(bound.table, bound.bags, spec.combiner, bound.output->data.data,
                                       bound.out_type, pf));
}

TfLiteStatus SpecFromCustomNode(TfLiteContext* context, const TfLiteNode* node,
                                const OpOptions& options, bool ragged, BagSpec* spec) {
  const int num_inputs = node->inputs ? node->inputs->size : 0;
  const int num_outputs = node->outputs ? node->outputs->size : 0;
  // Inputs: params, indices (ragged: values, row_splits)[, weights].
  const int first_optional = ragged ? 3 : 2;
  const char* what = ragged ? kRaggedCustomOpName : kCustomOpName;
  if (num_inputs != first_optional && num_inputs != first_optional + 1) {
    context->ReportError(context, "%s: expects %d or %d inputs (%s), got %d", what, first_optional,
                         first_optional + 1,
                         ragged ? "params, values, row_splits[, weights]" : "params, indices[, weights]",
                         num_inputs);
    return kTfLiteError;
  }
  if (num_outputs != 1) {
    context->ReportError(context, "%s: expects 1 output, got %d", what, num_outputs);
    return kTfLiteError;
  }
  *spec = BagSpec();
  spec->what = what;
  spec->table = node->inputs->data[0];
  spec->indices = node->inputs->data[1];
  if (ragged) spec->row_splits = node->inputs->data[2];
  spec->output = node->outputs->data[0];
  spec->combiner = options.combiner;
  // has_weights=false: the weights input is a placeholder (may be shape [0]).
  if (num_inputs > first_optional && options.has_weights)
    spec->weights = node->inputs->data[first_optional];
  return kTfLiteOk;
}

}  // namespace tflite
}  // namespace pkm
