// The PkmEmbeddingBag TFLite kernel: translates TfLiteTensors into the core's
// Table/Bags and its Status into context->ReportError + kTfLiteError. Used by
// the custom-op registration (resolver.AddCustom) and by the delegate kernel,
// which also runs stock GATHER -> (MUL) -> SUM chains through the same code.
#ifndef PKM_TFLITE_DELEGATE_EMBEDDING_BAG_TFLITE_H_
#define PKM_TFLITE_DELEGATE_EMBEDDING_BAG_TFLITE_H_

#include <cstddef>
#include <string>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "tflite_delegate/tflite_abi.h"

namespace pkm {
namespace tflite {

constexpr const char kCustomOpName[] = "PkmEmbeddingBag";

struct OpOptions {
  Combiner combiner = Combiner::kSum;
  bool has_weights = true;
};

// Reads the converter's flexbuffer map of TF attrs (keys "combiner",
// "has_weights"; "T"/"Tindices" are implied by the tensors). An empty buffer
// means the defaults. Returns false with a message for anything malformed.
bool ParseOpOptions(const void* data, size_t size, OpOptions* options,
                    std::string* error);

// One embedding bag bound to tensor indices of a subgraph.
struct BagSpec {
  int table = -1;
  int indices = -1;
  int weights = -1;  // -1: all ones
  int output = -1;
  Combiner combiner = Combiner::kSum;
  // Stock composite: weights are the MUL operand shaped [..., K, 1] and the
  // SUM output may keep the reduced axis ([..., 1, D]).
  bool composite = false;
  bool keep_dims = false;
  const char* what = kCustomOpName;  // names the op in error messages
};

// Per-node state computed in Prepare (int8 row scales).
struct BagState {
  std::vector<float> row_scales;
  std::vector<int32_t> row_zero_points;
};

// Validates tensors and resizes the output. Reports errors through context.
TfLiteStatus PrepareBag(TfLiteContext* context, const BagSpec& spec, BagState* state);
// Re-checks the (possibly dynamic) tensors and runs pkm::Forward.
TfLiteStatus InvokeBag(TfLiteContext* context, const BagSpec& spec,
                       const BagState& state, const ParallelFor& pf);

// Builds the spec of a PkmEmbeddingBag custom node. Errors via context.
TfLiteStatus SpecFromCustomNode(TfLiteContext* context, const TfLiteNode* node,
                                const OpOptions& options, BagSpec* spec);

}  // namespace tflite
}  // namespace pkm

extern "C" {
// For C++ apps: resolver.AddCustom("PkmEmbeddingBag", PkmEmbeddingBagRegistration()).
__attribute__((visibility("default"))) TfLiteRegistration* PkmEmbeddingBagRegistration();
}

#endif  // PKM_TFLITE_DELEGATE_EMBEDDING_BAG_TFLITE_H_
