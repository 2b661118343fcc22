// The PkmCheckThen TFLite kernel: the run-time check pkm_serve adds where XLA
// may compile a function for the CPU (pkm_serve._xla.checked_when_compiled),
// kept by the stock converter as a custom op. Output = value; where any
// element of `condition` is false, kTfLiteError with the op's `message` attr.
// Used by its custom-op registration and by the delegate kernel.
#ifndef PKM_TFLITE_DELEGATE_CHECK_THEN_TFLITE_H_
#define PKM_TFLITE_DELEGATE_CHECK_THEN_TFLITE_H_

#include <cstddef>
#include <string>

#include "tflite_delegate/tflite_abi.h"

namespace pkm {
namespace tflite {

constexpr const char kCheckThenCustomOpName[] = "PkmCheckThen";

bool IsCheckThenCustomOpName(const char* name);

// One check bound to tensor indices of a subgraph.
struct CheckSpec {
  int condition = -1;  // bool, any shape: every element must be true
  int value = -1;
  int output = -1;
  std::string message;  // the TF attr `message`, made printable
};

// Reads the converter's flexbuffer map of the TF attrs ("message"; "T" and
// "_"-prefixed attrs skipped, any other key refused) and the node's tensors.
// Returns false with *error set.
bool CheckSpecFromCustomNode(const TfLiteNode* node, const void* options, size_t options_size,
                             CheckSpec* spec, std::string* error);
// Validates the tensors and resizes the output (dynamic where the value is).
TfLiteStatus PrepareCheck(TfLiteContext* context, const CheckSpec& spec);
// Fails with the message where the condition has a false element, else copies value to output.
TfLiteStatus InvokeCheck(TfLiteContext* context, const CheckSpec& spec);

}  // namespace tflite
}  // namespace pkm

extern "C" {
// resolver.AddCustom("PkmCheckThen", PkmCheckThenRegistration()).
__attribute__((visibility("default"))) TfLiteRegistration* PkmCheckThenRegistration();
}

#endif  // PKM_TFLITE_DELEGATE_CHECK_THEN_TFLITE_H_
