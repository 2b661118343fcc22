// The PkmEmbeddingBag TFLite kernel: translates TfLiteTensors into the core's
// Table/Bags and its Status into context->ReportError + kTfLiteError. Used by
// the custom-op registration (resolver.AddCustom) and by the delegate kernel,
// which also runs stock GATHER -> (MUL) -> SUM chains through the same code.
#ifndef PKM_TFLITE_DELEGATE_EMBEDDING_BAG_TFLITE_H_
#define PKM_TFLITE_DELEGATE_EMBEDDING_BAG_TFLITE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "tflite_delegate/tflite_abi.h"

namespace pkm {
namespace tflite {

constexpr const char kCustomOpName[] = "PkmEmbeddingBag";
// Ragged bags (values + row_splits), as fused from embedding_lookup_sparse.
constexpr const char kRaggedCustomOpName[] = "PkmRaggedEmbeddingBag";

// True if `name` is one of the two custom ops; *ragged says which.
bool IsBagCustomOpName(const char* name, bool* ragged);

struct OpOptions {
  Combiner combiner = Combiner::kSum;
  bool has_weights = true;
};

// Reads the converter's flexbuffer map of TF attrs (keys "combiner",
// "has_weights"; type attrs such as "T"/"Tindices" are implied by the tensors
// and skipped, as are "_"-prefixed TF attrs). An empty buffer means the
// defaults. Returns false with a message for anything malformed, including
// any other key (a misspelt option).
bool ParseOpOptions(const void* data, size_t size, OpOptions* options,
                    std::string* error);

// A model's bytes echoed in an error: other than printable ASCII as \xNN (the
// Python runtimes decode the message as UTF-8 and raise on invalid bytes).
std::string Printable(const std::string& bytes);

// A TfLiteIntArray of `values`, malloc()ed as TfLiteIntArrayCreate does: the runtime frees
// what it is handed (ResizeTensor's dims, a node's temporaries) with free(). nullptr when out
// of memory.
TfLiteIntArray* NewIntArray(const std::vector<int>& values);
// Whether `dims` are `want`.
bool SameDims(const TfLiteIntArray* dims, const std::vector<int64_t>& want);
// The tensor made dynamic, as TFLite's SetTensorToDynamic does: the arena keeps its memory,
// so the pointer is dropped rather than realloc()ed later.
void MakeDynamic(TfLiteTensor* tensor);

// Product of dims (each must be >= 0), or false if it exceeds int64: a
// wrapped count would let buffer-size checks pass on a malformed shape.
inline bool CheckedNumElements(const int64_t* dims, size_t rank, int64_t* out) {
  int64_t n = 1;
  for (size_t i = 0; i < rank; ++i)
    if (dims[i] < 0 || __builtin_mul_overflow(n, dims[i], &n)) return false;
  *out = n;
  return true;
}
inline bool CheckedNumElements(const std::vector<int64_t>& dims, int64_t* out) {
  return CheckedNumElements(dims.data(), dims.size(), out);
}
// num_elements * elem_size bytes, or false on int64 overflow.
inline bool CheckedBytes(int64_t num_elements, int64_t elem_size, int64_t* out) {
  return !__builtin_mul_overflow(num_elements, elem_size, out);
}

// A kernel registration (version 1) with every other field zeroed: a newer
// runtime reads fields this ABI does not set.
inline TfLiteRegistration NewRegistration(decltype(TfLiteRegistration::init) init,
                                          decltype(TfLiteRegistration::free) free_fn,
                                          decltype(TfLiteRegistration::prepare) prepare,
                                          decltype(TfLiteRegistration::invoke) invoke, int32_t builtin_code,
                                          const char* custom_name) {
  TfLiteRegistration r;
  std::memset(&r, 0, sizeof(r));
  r.init = init;
  r.free = free_fn;
  r.prepare = prepare;
  r.invoke = invoke;
  r.builtin_code = builtin_code;
  r.custom_name = custom_name;
  r.version = 1;
  return r;
}

// One stock op on a fused composite's weights path (RESHAPE, EXPAND_DIMS,
// SQUEEZE, or a STRIDED_SLICE that keeps every element): how it shapes its
// input, so that Bind can work out the shape the stock MUL would see for the
// current inputs. The delegate matches a chain once, with the shapes of that
// moment; resize_tensor_input may change them later.
struct ShapeStep {
  enum class Kind { kIdentity, kReshape, kExpandDims, kSqueeze };
  Kind kind = Kind::kIdentity;
  // kReshape: the new shape (-1 at most once); kExpandDims: {axis};
  // kSqueeze: the axes to drop (none: every axis of size 1).
  std::vector<int64_t> values;
};

// One embedding bag bound to tensor indices of a subgraph.
struct BagSpec {
  int table = -1;
  int indices = -1;     // dense: [..., K]; ragged: the flat values [num_values]
  int row_splits = -1;  // ragged layout when >= 0: [num_bags + 1], int32 or int64
  int weights = -1;     // -1: all ones; else shaped like indices
  int output = -1;
  Combiner combiner = Combiner::kSum;
  // Stock composite: weights reach the MUL through weight_steps, which the
  // MUL broadcasts against the gathered [..., K, D]; the SUM reduces sum_axis
  // (as written in the model: may be negative) and may keep it ([..., 1, D]).
  bool composite = false;
  bool keep_dims = false;
  std::vector<ShapeStep> weight_steps;
  int sum_axis = -2;
  const char* what = kCustomOpName;  // names the op in error messages
};

// Per-node state computed in Prepare: an int8 table's row scales and biases
// (pkm::Table's layout, from the tensor's scales and zero points).
struct BagState {
  std::vector<float> row_scales;
  std::vector<float> row_biases;
};

// Validates tensors and resizes the output. Reports errors through context.
TfLiteStatus PrepareBag(TfLiteContext* context, const BagSpec& spec, BagState* state);
// Re-checks the (possibly dynamic) tensors and runs pkm::Forward.
TfLiteStatus InvokeBag(TfLiteContext* context, const BagSpec& spec,
                       const BagState& state, const ParallelFor& pf);

// Builds the spec of a PkmEmbeddingBag (ragged: PkmRaggedEmbeddingBag)
// custom node. Errors via context.
TfLiteStatus SpecFromCustomNode(TfLiteContext* context, const TfLiteNode* node,
                                const OpOptions& options, bool ragged, BagSpec* spec);

}  // namespace tflite
}  // namespace pkm

extern "C" {
// For C++ apps: resolver.AddCustom("PkmEmbeddingBag", PkmEmbeddingBagRegistration()).
__attribute__((visibility("default"))) TfLiteRegistration* PkmEmbeddingBagRegistration();
// resolver.AddCustom("PkmRaggedEmbeddingBag", PkmRaggedEmbeddingBagRegistration()).
__attribute__((visibility("default"))) TfLiteRegistration* PkmRaggedEmbeddingBagRegistration();
}

#endif  // PKM_TFLITE_DELEGATE_EMBEDDING_BAG_TFLITE_H_
