// The shape and dtype rules of shape_rules.h: one message per fault.
#include "kernels/core/shape_rules.h"

#include <string>
#include <tuple>
#include <utility>

namespace pkm {
namespace {

bool Known(int64_t d) { return d >= 0; }

// Same shape where both are known (an unknown dim or rank matches anything).
bool Compatible(const MaybeDims& a, const MaybeDims& b) {
  if (!a || !b) return true;
  if (a->size() != b->size()) return false;
  for (size_t i = 0; i < a->size(); ++i)
    if (Known((*a)[i]) && Known((*b)[i]) && (*a)[i] != (*b)[i]) return false;
  return true;
}

// Product of dims [begin, end); kUnknownDim if one is unknown; false on overflow.
bool Product(const Dims& dims, size_t begin, size_t end, int64_t* out) {
  int64_t n = 1;
  bool unknown = false;
  for (size_t i = begin; i < end; ++i) {
    if (!Known(dims[i])) {
      unknown = true;
      continue;
    }
    if (dims[i] != 0 && n > INT64_MAX / dims[i]) return false;
    n *= dims[i];
  }
  *out = unknown && n != 0 ? kUnknownDim : n;
  return true;
}

Status TooLarge(const char* role, const Dims& dims) {
  return Status::Error(std::string(role) + " shape too large: " + DimsString(dims) +
                       " (more elements than int64 counts)");
}

Status ParamsRule(const MaybeDims& params) {
  if (params && params->size() != 2)
    return Status::Error("params must be a [N, D] matrix, got shape " + DimsString(params));
  return Status::Ok();
}

Status IdsRule(const BagShapes& s) {
  if (!s.indices) return Status::Ok();
  if (s.ragged && s.indices->size() != 1)
    return Status::Error("values must be a vector, got shape " + DimsString(s.indices));
  if (!s.ragged && s.indices->empty())
    return Status::Error("indices must have rank >= 1 ([..., K]), got shape " + DimsString(s.indices));
  int64_t n;
  if (!Product(*s.indices, 0, s.indices->size(), &n)) return TooLarge(s.ragged ? "values" : "indices", *s.indices);
  return Status::Ok();
}

Status WeightsRule(const BagShapes& s) {
  const char* ids = s.ragged ? "values" : "indices";
  if (!s.has_weights) {
    int64_t n = 0;
    // An unused weights input must be empty, so a gradient op's d_weights
    // (shaped like weights) has nothing left unwritten.
    if (s.weights && Product(*s.weights, 0, s.weights->size(), &n) && n != 0)
      return Status::Error("weights must be empty (e.g. shape [0]) when has_weights is false, got shape " +
                           DimsString(s.weights));
    return Status::Ok();
  }
  if (!s.weights_any_shape) {
    if (!Compatible(s.weights, s.indices))
      return Status::Error(std::string("weights must have the shape of ") + ids + " " + DimsString(s.indices) +
                           ", got " + DimsString(s.weights));
    return Status::Ok();
  }
  if (!s.weights || !s.indices) return Status::Ok();
  int64_t w = 0, i = 0;
  if (!Product(*s.weights, 0, s.weights->size(), &w)) return TooLarge("weights", *s.weights);
  Product(*s.indices, 0, s.indices->size(), &i);  // checked by IdsRule
  if (Known(w) && Known(i) && w != i)
    return Status::Error(std::string("weights must have as many elements as ") + ids + " " +
                         DimsString(s.indices) + ", got shape " + DimsString(s.weights));
  return Status::Ok();
}

Status SplitsRule(const BagShapes& s) {
  if (!s.ragged || !s.row_splits) return Status::Ok();
  if (s.row_splits->size() != 1 || (Known((*s.row_splits)[0]) && (*s.row_splits)[0] < 1))
    return Status::Error("row_splits must be a non-empty vector ([num_bags + 1]), got shape " +
                         DimsString(s.row_splits));
  return Status::Ok();
}

Status FloatType(const char* role, DType t, const char* allowed) {
  if (t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16) return Status::Ok();
  return Status::Error(std::string(role) + " must be " + allowed + ", got " + DTypeName(t));
}

}  // namespace

std::string DimsString(const Dims& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + (Known(dims[i]) ? std::to_string(dims[i]) : "?");
  return s + "]";
}

std::string DimsString(const MaybeDims& dims) { return dims ? DimsString(*dims) : "<unknown>"; }

Status CombinerWeightsRule(Combiner combiner, bool has_weights) {
  if (static_cast<int>(combiner) == PKM_MAX && has_weights)
    return Status::Error(kMaxWithWeightsError);
  return Status::Ok();
}

Status CombinerValueRule(int32_t value) {
  if (value < PKM_SUM || value > PKM_MAX)
    return Status::Error("combiner must be 0 (sum), 1 (mean), 2 (sqrtn) or 3 (max), got " + std::to_string(value));
  return Status::Ok();
}

Status ForwardShape(const BagShapes& s, MaybeDims* out) {
  for (Status st : {ParamsRule(s.params), IdsRule(s), SplitsRule(s), WeightsRule(s),
                    CombinerWeightsRule(s.combiner, s.has_weights)})
    if (!st.ok) return st;
  out->reset();
  const int64_t dim = s.params ? (*s.params)[1] : kUnknownDim;
  if (s.ragged) {
    const int64_t splits = s.row_splits ? (*s.row_splits)[0] : kUnknownDim;
    *out = Dims{Known(splits) ? splits - 1 : kUnknownDim, dim};
    return Status::Ok();
  }
  if (!s.indices) return Status::Ok();
  Dims result(s.indices->begin(), s.indices->end() - 1);
  // Shape inference: weights shaped like indices may know a dim indices does not.
  if (s.has_weights && !s.weights_any_shape && s.weights)
    for (size_t i = 0; i < result.size(); ++i)
      if (!Known(result[i])) result[i] = (*s.weights)[i];
  result.push_back(dim);
  int64_t n;
  if (!Product(result, 0, result.size(), &n)) return TooLarge("output", result);
  *out = std::move(result);
  return Status::Ok();
}

Status GradShape(const MaybeDims& grad, const MaybeDims& forward_out) {
  if (!Compatible(grad, forward_out))
    return Status::Error("grad must have the forward output's shape " + DimsString(forward_out) + ", got " +
                         DimsString(grad));
  return Status::Ok();
}

Status Int8RowTableShape(const MaybeDims& params, const MaybeDims& scales, const MaybeDims& biases) {
  Status st = ParamsRule(params);
  if (!st.ok) return st;
  const int64_t rows = params ? (*params)[0] : kUnknownDim;
  const MaybeDims want = Dims{rows};
  for (auto [role, dims] : {std::pair<const char*, const MaybeDims*>{"scales", &scales}, {"biases", &biases}}) {
    if (!Compatible(*dims, want))
      return Status::Error(std::string("int8 params: row ") + role + " must be a vector of N = " +
                           (Known(rows) ? std::to_string(rows) : "?") + " (one per row), got shape " +
                           DimsString(*dims));
  }
  return Status::Ok();
}

Status ConcreteDims(const char* role, const Dims& dims, int64_t* num_elements) {
  for (int64_t d : dims)
    if (d < 0) {
      std::string shape = "[";  // the dims as given: here a negative dim is no unknown one
      for (size_t i = 0; i < dims.size(); ++i) shape += (i ? ", " : "") + std::to_string(dims[i]);
      return Status::Error(std::string(role) + " has a negative dimension: " + shape + "]");
    }
  int64_t n;
  if (!Product(dims, 0, dims.size(), &n)) return TooLarge(role, dims);
  if (num_elements != nullptr) *num_elements = n;
  return Status::Ok();
}

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt8: return "int8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
    case DType::kOther: break;
  }
  return "an unsupported type";
}

DType DTypeOf(ElemType t) {
  switch (t) {
    case ElemType::kFloat32: return DType::kFloat32;
    case ElemType::kFloat16: return DType::kFloat16;
    case ElemType::kBFloat16: return DType::kBFloat16;
    case ElemType::kInt8: return DType::kInt8;
  }
  return DType::kOther;
}

Status ParamsType(DType t, bool int8_allowed) {
  if (int8_allowed && t == DType::kInt8) return Status::Ok();
  return FloatType("params", t, int8_allowed ? "float32, float16, bfloat16 or int8 (per-row quantised)"
                                             : "float32, float16 or bfloat16");
}

Status WeightsType(DType t) { return FloatType("weights", t, "float32, float16 or bfloat16"); }

Status IndexType(const char* role, DType t) {
  if (t == DType::kInt32 || t == DType::kInt64) return Status::Ok();
  return Status::Error(std::string(role) + " must be int32 or int64, got " + DTypeName(t));
}

Status OutputType(DType out, DType params) {
  Status st = FloatType("output", out, "float32, float16 or bfloat16");
  if (!st.ok) return st;
  if (params != DType::kInt8 && out != params)
    return Status::Error(std::string("output type ") + DTypeName(out) + " differs from params type " +
                         DTypeName(params));
  return Status::Ok();
}

namespace {

DType DescriptorType(int32_t t) {
  switch (t) {
    case PKM_FLOAT32: return DType::kFloat32;
    case PKM_FLOAT16: return DType::kFloat16;
    case PKM_BFLOAT16: return DType::kBFloat16;
    default: return DType::kOther;  // int8 tables need scales, which the descriptor lacks
  }
}

Status DescriptorEnums(const PkmBags& b) {
  if (DescriptorType(b.elem_type) == DType::kOther)
    return Status::Error("elem_type must be 0 (float32), 1 (float16) or 2 (bfloat16), got " +
                         std::to_string(b.elem_type));
  if (b.weights != nullptr && DescriptorType(b.weights_type) == DType::kOther)
    return Status::Error("weights_type must be 0 (float32), 1 (float16) or 2 (bfloat16), got " +
                         std::to_string(b.weights_type));
  Status st = CombinerWeightsRule(static_cast<Combiner>(b.combiner), b.weights != nullptr);
  if (!st.ok) return st;
  st = CombinerValueRule(b.combiner);
  if (!st.ok) return st;
  if (b.index_policy < PKM_NEGATIVE_IS_PADDING || b.index_policy > PKM_OUT_OF_RANGE_IS_PADDING)
    return Status::Error("index_policy must be 0 (negative is padding), 1 (no padding) or 2 (out of range is "
                         "padding), got " + std::to_string(b.index_policy));
  return Status::Ok();
}

}  // namespace

Status BagProblemRule(const PkmBags& b) {
  Status st = DescriptorEnums(b);
  if (!st.ok) return st;
  BagShapes shapes;
  shapes.params = Dims{b.num_rows, b.dim};
  shapes.ragged = b.row_splits != nullptr;
  if (shapes.ragged) {
    shapes.indices = Dims{b.num_indices};
    shapes.row_splits = Dims{b.num_bags < INT64_MAX ? b.num_bags + 1 : b.num_bags};
  } else {
    shapes.indices = Dims{b.num_bags, b.bag_size};
  }
  shapes.has_weights = b.weights != nullptr;
  shapes.weights = shapes.has_weights ? shapes.indices : Dims{0};
  shapes.combiner = static_cast<Combiner>(b.combiner);
  int64_t num_indices = 0, table_elems = 0;
  for (auto [role, dims, count] : {std::tuple<const char*, const MaybeDims*, int64_t*>{"params", &shapes.params, &table_elems},
                                   {shapes.ragged ? "values" : "indices", &shapes.indices, &num_indices},
                                   {"row_splits", &shapes.row_splits, nullptr}}) {
    if (!*dims) continue;
    st = ConcreteDims(role, **dims, count);
    if (!st.ok) return st;
  }
  MaybeDims out;
  st = ForwardShape(shapes, &out);
  if (!st.ok) return st;
  if (num_indices > 0 && b.indices == nullptr) return Status::Error("indices is null");
  if (table_elems > 0 && b.table == nullptr) return Status::Error("table is null");
  return Status::Ok();
}

}  // namespace pkm
