// The op's custom_options (the converter's flexbuffer map of the TF op's
// attrs) parsed into OpOptions, for the custom op and the delegate alike.
#include <cstdio>
#include <string>

#include "kernels/core/embedding_bag.h"
#include "tflite_delegate/embedding_bag_tflite.h"
#include "tflite_delegate/flexbuffer_map.h"

namespace pkm {
namespace tflite {

std::string Printable(const std::string& bytes) {
  std::string text;
  for (unsigned char c : bytes) {
    if (c >= 0x20 && c < 0x7f) {
      text += static_cast<char>(c);
    } else {
      char escaped[5];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
      text += escaped;
    }
  }
  return text;
}

namespace {
// Keys the kernel reads, and keys it accepts without reading: the converter
// writes every TF attr of the node, i.e. the type attrs ("T", "Tindices",
// "Tsplits"; TF names them with a capital) and, for graphs converted without
// the op registered, TF-internal ones such as "_output_shapes".
constexpr const char* kReadOptions[] = {"combiner", "has_weights"};
bool IsReadOption(const std::string& key) {
  for (const char* known : kReadOptions)
    if (key == known) return true;
  return false;
}
bool IsIgnoredTfAttr(const std::string& key) {
  return !key.empty() && ((key[0] >= 'A' && key[0] <= 'Z') || key[0] == '_');
}
}  // namespace

bool ParseOpOptions(const void* data, size_t size, OpOptions* options, std::string* error) {
  *options = OpOptions();
  if (data == nullptr || size == 0) return true;
  FlexbufferMap map;
  if (!map.Parse(static_cast<const uint8_t*>(data), size, error)) return false;
  // A misspelt option (say "combinr") would otherwise run the default silently.
  for (const auto& e : map.entries()) {
    if (IsReadOption(e.key) || IsIgnoredTfAttr(e.key)) continue;
    *error = "unknown custom_options key '" + Printable(e.key) + "'; accepted:";
    for (const char* known : kReadOptions) *error += std::string(" '") + known + "',";
    *error += " and TF attrs (capitalised type attrs such as 'T', 'Tindices', 'Tsplits', "
              "or names starting with '_')";
    return false;
  }
  if (const auto* e = map.Find("combiner")) {
    if (e->kind != FlexbufferMap::Kind::kString) {
      *error = "custom_options 'combiner' must be a string";
      return false;
    }
    if (!ParseCombiner(e->string_value, &options->combiner)) {
      *error = "custom_options 'combiner' must be 'sum', 'mean', 'sqrtn' or 'max', got '" +
               Printable(e->string_value) + "'";
      return false;
    }
  }
  if (const auto* e = map.Find("has_weights")) {
    if (e->kind != FlexbufferMap::Kind::kBool && e->kind != FlexbufferMap::Kind::kInt &&
        e->kind != FlexbufferMap::Kind::kUInt) {
      *error = "custom_options 'has_weights' must be a bool";
      return false;
    }
    options->has_weights = e->int_value != 0;
  }
  return true;
}

}  // namespace tflite
}  // namespace pkm
