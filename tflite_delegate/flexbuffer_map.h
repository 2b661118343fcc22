// A small, bounds-checked reader for the one flexbuffer shape TFLite custom
// ops use: a root map from string keys to scalars or strings (the converter
// writes the TF node's attrs this way). Anything malformed is reported as an
// error, never read past the buffer.
#ifndef PKM_TFLITE_DELEGATE_FLEXBUFFER_MAP_H_
#define PKM_TFLITE_DELEGATE_FLEXBUFFER_MAP_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pkm {
namespace tflite {

class FlexbufferMap {
 public:
  enum class Kind { kNull, kInt, kUInt, kFloat, kBool, kString, kOther };
  struct Entry {
    std::string key;
    Kind kind = Kind::kNull;
    int64_t int_value = 0;   // kInt, kUInt, kBool
    double float_value = 0;  // kFloat
    std::string string_value;
  };

  // Parses `size` bytes; returns false with *error set when the buffer is not
  // a well-formed flexbuffer whose root is a map.
  bool Parse(const uint8_t* data, size_t size, std::string* error);

  const Entry* Find(const std::string& key) const;
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  std::vector<Entry> entries_;
};

}  // namespace tflite
}  // namespace pkm

#endif  // PKM_TFLITE_DELEGATE_FLEXBUFFER_MAP_H_
