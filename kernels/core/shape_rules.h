// The one set of shape and dtype rules of the EmbeddingBag ops, on plain
// int64 dims, so that every runtime rejects the same input with the same
// words: the TF shape functions and kernels, the XLA lowering and its FFI
// targets, the TFLite kernel (Prepare and Invoke), the CUDA launchers' host
// checks and the C ABI. Adapters translate their shapes and types into the
// structs below and their errors out of the returned Status; they add only
// what is theirs (buffer sizes, device limits, the runtime's error type).
//
// Shapes may be partly unknown (TF shape inference): a dim < 0 is unknown and
// a MaybeDims without a value is a shape of unknown rank; a rule that needs
// what is unknown passes. A concrete shape never has a negative dim: adapters
// that can receive one (TFLite, the C descriptor) check it with ConcreteDims.
#ifndef PKM_KERNELS_CORE_SHAPE_RULES_H_
#define PKM_KERNELS_CORE_SHAPE_RULES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/core/embedding_bag.h"

namespace pkm {

using Dims = std::vector<int64_t>;
using MaybeDims = std::optional<Dims>;
inline constexpr int64_t kUnknownDim = -1;

// "[2, 3]"; unknown dims print as "?", an unknown rank as "<unknown>".
std::string DimsString(const Dims& dims);
std::string DimsString(const MaybeDims& dims);

// The shapes of one op call. The dense layout names its ids "indices", the
// ragged one "values" (with row_splits), as the TF op's inputs do.
struct BagShapes {
  MaybeDims params;      // [N, D]
  MaybeDims indices;     // dense [..., K]; ragged [V]
  MaybeDims row_splits;  // ragged only: [num_bags + 1]
  MaybeDims weights;     // shaped like indices; when !has_weights, empty (or unknown)
  bool ragged = false;
  bool has_weights = true;
  // A fused TFLite composite: weights may be any reshape of indices (same
  // number of elements) instead of exactly its shape.
  bool weights_any_shape = false;
  Combiner combiner = Combiner::kSum;
};

// Every forward rule; *out gets the output shape: the leading dims of indices
// (dense) or [num_bags] (ragged), then D (unknown parts stay unknown).
Status ForwardShape(const BagShapes& shapes, MaybeDims* out);

// Gradient ops: grad must have the forward output's shape.
Status GradShape(const MaybeDims& grad, const MaybeDims& forward_out);

// Combiner 'max' picks, it does not weigh: it takes no weights.
Status CombinerWeightsRule(Combiner combiner, bool has_weights);
// A combiner carried as an integer (the C descriptor, the XLA attribute).
Status CombinerValueRule(int32_t value);

// A row-wise int8 table: params [N, D] int8 with per-row scale and bias
// vectors of length N.
Status Int8RowTableShape(const MaybeDims& params, const MaybeDims& scales, const MaybeDims& biases);

// A concrete shape: no negative dim, element count within int64.
Status ConcreteDims(const char* role, const Dims& dims, int64_t* num_elements = nullptr);

// Element types as the rules see them (every runtime maps its own onto these).
enum class DType : int { kFloat32, kFloat16, kBFloat16, kInt8, kInt32, kInt64, kFloat64, kOther };
const char* DTypeName(DType t);
DType DTypeOf(ElemType t);
// Table: a float type; int8 (per-row quantised) where the runtime has it.
Status ParamsType(DType t, bool int8_allowed);
Status WeightsType(DType t);
// Ids and row splits: `role` is "indices", "values" or "row_splits".
Status IndexType(const char* role, DType t);
// Output: a float type, the table's unless the table is int8.
Status OutputType(DType out, DType params);

// The C descriptor (bag_problem.h) as the C ABI and the CUDA launchers get
// it: enum values in range, counts non-negative and within int64, buffers
// present where there is something to read, then ForwardShape on the dims the
// counts describe. The GPU's narrower index policy is the launchers' own check.
Status BagProblemRule(const PkmBags& bags);

}  // namespace pkm

#endif  // PKM_KERNELS_CORE_SHAPE_RULES_H_
