// PkmCheckThen: value, after kTfLiteError with the op's message where the
// condition does not hold (see check_then_tflite.h). The custom-op
// registration is here too: the op has no options beyond the message.
#include "tflite_delegate/check_then_tflite.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "tflite_delegate/embedding_bag_tflite.h"
#include "tflite_delegate/flexbuffer_map.h"

namespace pkm {
namespace tflite {

namespace {

// The message TF's kernel gives where none was set (the TF op requires the attr).
constexpr const char kDefaultMessage[] = "the run-time check failed";

const TfLiteTensor* TensorAt(const TfLiteContext* context, int index) {
  return index >= 0 && static_cast<size_t>(index) < context->tensors_size ? &context->tensors[index] : nullptr;
}

TfLiteStatus Fail(TfLiteContext* context, const std::string& what) {
  context->ReportError(context, "%s: %s", kCheckThenCustomOpName, what.c_str());
  return kTfLiteError;
}

// Types whose buffer is the tensor's whole value: a byte copy is a copy of the value.
bool IsPlainType(TfLiteType type) {
  return type != kTfLiteNoType && type != kTfLiteString && type != kTfLiteResource && type != kTfLiteVariant;
}

// Resizes the output to the value's dims (the runtime takes ownership of the array).
TfLiteStatus ResizeLikeValue(TfLiteContext* context, const TfLiteTensor* value, TfLiteTensor* output) {
  TfLiteIntArray* dims = NewIntArray(std::vector<int>(value->dims->data, value->dims->data + value->dims->size));
  if (dims == nullptr) return kTfLiteError;
  return context->ResizeTensor(context, output, dims);
}

TfLiteStatus CheckTypes(TfLiteContext* context, const CheckSpec& spec, const TfLiteTensor** condition,
                        const TfLiteTensor** value, TfLiteTensor** output) {
  *condition = TensorAt(context, spec.condition);
  *value = TensorAt(context, spec.value);
  *output = const_cast<TfLiteTensor*>(TensorAt(context, spec.output));
  if (*condition == nullptr || *value == nullptr || *output == nullptr)
    return Fail(context, "a tensor index is out of range");
  if ((*condition)->type != kTfLiteBool) return Fail(context, "condition must be bool");
  if (!IsPlainType((*value)->type)) return Fail(context, "value must be a numeric or bool tensor");
  if ((*output)->type != (*value)->type) return Fail(context, "output type must be the value's");
  if ((*value)->dims == nullptr || (*condition)->dims == nullptr) return Fail(context, "a tensor has no shape");
  return kTfLiteOk;
}

}  // namespace

bool IsCheckThenCustomOpName(const char* name) {
  return name != nullptr && std::strcmp(name, kCheckThenCustomOpName) == 0;
}

bool CheckSpecFromCustomNode(const TfLiteNode* node, const void* options, size_t options_size,
                             CheckSpec* spec, std::string* error) {
  *spec = CheckSpec();
  spec->message = kDefaultMessage;
  if (node->inputs == nullptr || node->inputs->size != 2 || node->outputs == nullptr ||
      node->outputs->size != 1) {
    *error = "expects 2 inputs (condition, value) and 1 output";
    return false;
  }
  spec->condition = node->inputs->data[0];
  spec->value = node->inputs->data[1];
  spec->output = node->outputs->data[0];
  if (options == nullptr || options_size == 0) return true;
  FlexbufferMap map;
  if (!map.Parse(static_cast<const uint8_t*>(options), options_size, error)) return false;
  for (const auto& e : map.entries()) {
    if (e.key == "message") {
      if (e.kind != FlexbufferMap::Kind::kString) {
        *error = "custom_options 'message' must be a string";
        return false;
      }
      spec->message = Printable(e.string_value);
    } else if (e.key != "T" && (e.key.empty() || e.key[0] != '_')) {
      *error = "unknown custom_options key '" + Printable(e.key) + "'; accepted: 'message', 'T', and "
               "names starting with '_'";
      return false;
    }
  }
  return true;
}

TfLiteStatus PrepareCheck(TfLiteContext* context, const CheckSpec& spec) {
  const TfLiteTensor *condition, *value;
  TfLiteTensor* output;
  if (CheckTypes(context, spec, &condition, &value, &output) != kTfLiteOk) return kTfLiteError;
  // A value sized by an op that runs first (a ragged input's flat values under a Shape-dependent
  // op) is dynamic: its dims are known only at Invoke, so the output is made dynamic too.
  if (value->allocation_type == kTfLiteDynamic) {
    MakeDynamic(output);
    return kTfLiteOk;
  }
  return ResizeLikeValue(context, value, output);
}

TfLiteStatus InvokeCheck(TfLiteContext* context, const CheckSpec& spec) {
  const TfLiteTensor *condition, *value;
  TfLiteTensor* output;
  if (CheckTypes(context, spec, &condition, &value, &output) != kTfLiteOk) return kTfLiteError;
  std::vector<int64_t> condition_dims(condition->dims->data, condition->dims->data + condition->dims->size);
  int64_t count = 0;
  if (!CheckedNumElements(condition_dims, &count)) return Fail(context, "condition shape is malformed");
  if (count > 0 && (condition->data.raw_const == nullptr || condition->bytes < static_cast<size_t>(count)))
    return Fail(context, "condition buffer is smaller than its shape");
  // Read as bytes: a bool object holding other than 0 or 1 is undefined behaviour.
  const auto* holds = reinterpret_cast<const uint8_t*>(condition->data.raw_const);
  for (int64_t i = 0; i < count; ++i)
    if (holds[i] == 0) {
      context->ReportError(context, "%s", spec.message.c_str());
      return kTfLiteError;
    }
  const std::vector<int64_t> value_dims(value->dims->data, value->dims->data + value->dims->size);
  if (output->allocation_type == kTfLiteDynamic &&
      (!SameDims(output->dims, value_dims) || (value->bytes > 0 && output->data.raw == nullptr) ||
       output->bytes < value->bytes) &&
      ResizeLikeValue(context, value, output) != kTfLiteOk)
    return kTfLiteError;
  if (!SameDims(output->dims, value_dims)) return Fail(context, "output shape is not the value's");
  if (value->bytes == 0) return kTfLiteOk;
  if (value->data.raw_const == nullptr || output->data.raw == nullptr || output->bytes < value->bytes)
    return Fail(context, "a buffer is not allocated");
  if (output->data.raw != value->data.raw_const) std::memcpy(output->data.raw, value->data.raw_const, value->bytes);
  return kTfLiteOk;
}

}  // namespace tflite
}  // namespace pkm

namespace {

// The node's custom_initial_data holds the options; its tensors are read in Prepare.
struct CustomCheckData {
  pkm::tflite::CheckSpec spec;
};

void* CheckInit(TfLiteContext*, const char*, size_t) { return new CustomCheckData; }

void CheckFree(TfLiteContext*, void* buffer) { delete static_cast<CustomCheckData*>(buffer); }

TfLiteStatus CheckPrepare(TfLiteContext* context, TfLiteNode* node) {
  auto* data = static_cast<CustomCheckData*>(node->user_data);
  if (data == nullptr) return kTfLiteError;
  std::string error;
  if (!pkm::tflite::CheckSpecFromCustomNode(
          node, node->custom_initial_data,
          node->custom_initial_data_size < 0 ? 0 : static_cast<size_t>(node->custom_initial_data_size),
          &data->spec, &error)) {
    context->ReportError(context, "%s: %s", pkm::tflite::kCheckThenCustomOpName, error.c_str());
    return kTfLiteError;
  }
  return pkm::tflite::PrepareCheck(context, data->spec);
}

TfLiteStatus CheckInvoke(TfLiteContext* context, TfLiteNode* node) {
  auto* data = static_cast<CustomCheckData*>(node->user_data);
  if (data == nullptr) return kTfLiteError;
  return pkm::tflite::InvokeCheck(context, data->spec);
}

}  // namespace

extern "C" TfLiteRegistration* PkmCheckThenRegistration() {
  static TfLiteRegistration registration = pkm::tflite::NewRegistration(
      CheckInit, CheckFree, CheckPrepare, CheckInvoke, kTfLiteBuiltinCustom, pkm::tflite::kCheckThenCustomOpName);
  return &registration;
}
