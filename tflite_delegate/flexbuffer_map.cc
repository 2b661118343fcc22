#include "tflite_delegate/flexbuffer_map.h"

#include <cstring>

namespace pkm {
namespace tflite {
namespace {

// Flexbuffer type codes (flexbuffers.h, enum Type).
constexpr int kTypeNull = 0, kTypeInt = 1, kTypeUInt = 2, kTypeFloat = 3,
              kTypeKey = 4, kTypeString = 5, kTypeIndirectInt = 6,
              kTypeIndirectUInt = 7, kTypeIndirectFloat = 8, kTypeMap = 9,
              kTypeBool = 26;

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool InRange(uint64_t pos, uint64_t len) const {
    return pos <= size_ && len <= size_ - pos;
  }
  bool ReadUInt(uint64_t pos, int width, uint64_t* out) const {
    if (!InRange(pos, width)) return false;
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; --i) v = (v << 8) | data_[pos + i];  // little endian
    *out = v;
    return true;
  }
  bool ReadInt(uint64_t pos, int width, int64_t* out) const {
    uint64_t u;
    if (!ReadUInt(pos, width, &u)) return false;
    if (width < 8) {
      const uint64_t sign = uint64_t{1} << (8 * width - 1);
      u = (u ^ sign) - sign;  // sign-extend
    }
    *out = static_cast<int64_t>(u);
    return true;
  }
  bool ReadFloat(uint64_t pos, int width, double* out) const {
    if (width == 4) {
      uint64_t u;
      if (!ReadUInt(pos, 4, &u)) return false;
      uint32_t u32 = static_cast<uint32_t>(u);
      float f;
      std::memcpy(&f, &u32, 4);
      *out = f;
      return true;
    }
    if (width == 8) {
      uint64_t u;
      if (!ReadUInt(pos, 8, &u)) return false;
      std::memcpy(out, &u, 8);
      return true;
    }
    return false;
  }
  // Offsets point backwards from where they are stored.
  bool Deref(uint64_t pos, int width, uint64_t* target) const {
    uint64_t off;
    if (!ReadUInt(pos, width, &off)) return false;
    if (off > pos) return false;
    *target = pos - off;
    return *target < size_;
  }
  bool ReadCString(uint64_t pos, std::string* out) const {
    if (pos >= size_) return false;
    const void* nul = std::memchr(data_ + pos, 0, size_ - pos);
    if (nul == nullptr) return false;
    out->assign(reinterpret_cast<const char*>(data_ + pos),
                static_cast<const uint8_t*>(nul) - (data_ + pos));
    return true;
  }
  const uint8_t* data() const { return data_; }

 private:
  const uint8_t* data_;
  size_t size_;
};

bool ValidWidth(int w) { return w == 1 || w == 2 || w == 4 || w == 8; }

// One map value at `pos` (inline, `width` bytes) with its packed type byte.
bool ReadValue(const Reader& r, const uint8_t* data, uint64_t pos, int width, int packed,
               FlexbufferMap::Entry* e) {
  using Kind = FlexbufferMap::Kind;
  const int type = packed >> 2;
  const int child_width = 1 << (packed & 3);
  bool ok = true;
  switch (type) {
    case kTypeNull:
      e->kind = Kind::kNull;
      break;
    case kTypeInt:
      e->kind = Kind::kInt;
      ok = r.ReadInt(pos, width, &e->int_value);
      break;
    case kTypeUInt:
    case kTypeBool: {
      uint64_t u = 0;
      ok = r.ReadUInt(pos, width, &u);
      e->kind = type == kTypeBool ? Kind::kBool : Kind::kUInt;
      e->int_value = static_cast<int64_t>(u);
      break;
    }
    case kTypeFloat:
      e->kind = Kind::kFloat;
      ok = r.ReadFloat(pos, width, &e->float_value);
      break;
    case kTypeIndirectInt:
    case kTypeIndirectUInt:
    case kTypeIndirectFloat: {
      uint64_t target;
      ok = r.Deref(pos, width, &target);
      if (ok && type == kTypeIndirectFloat) {
        e->kind = Kind::kFloat;
        ok = r.ReadFloat(target, child_width, &e->float_value);
      } else if (ok) {
        e->kind = type == kTypeIndirectInt ? Kind::kInt : Kind::kUInt;
        ok = r.ReadInt(target, child_width, &e->int_value);
      }
      break;
    }
    case kTypeString:
    case kTypeKey: {
      uint64_t target;
      e->kind = Kind::kString;
      ok = r.Deref(pos, width, &target);
      if (ok && type == kTypeKey) {
        ok = r.ReadCString(target, &e->string_value);
      } else if (ok) {
        uint64_t len;
        ok = target >= static_cast<uint64_t>(child_width) &&
             r.ReadUInt(target - child_width, child_width, &len) &&
             r.InRange(target, len);
        if (ok) e->string_value.assign(reinterpret_cast<const char*>(data + target), len);
      }
      break;
    }
    default:
      e->kind = Kind::kOther;  // vectors, maps, blobs: not needed, skipped
      break;
  }
  return ok;
}

}  // namespace

bool FlexbufferMap::Parse(const uint8_t* data, size_t size, std::string* error) {
  entries_.clear();
  auto fail = [&](const std::string& why) {
    *error = "malformed flexbuffer custom_options (" + std::to_string(size) +
             " bytes): " + why;
    entries_.clear();
    return false;
  };
  if (data == nullptr || size < 3) return fail("too short for a flexbuffer");
  Reader r(data, size);
  const int root_width = data[size - 1];
  const int root_packed = data[size - 2];
  if (!ValidWidth(root_width) || static_cast<size_t>(root_width) + 2 > size)
    return fail("bad root byte width");
  const uint64_t root_pos = size - 2 - root_width;
  if ((root_packed >> 2) != kTypeMap)
    return fail("root is not a map (type " + std::to_string(root_packed >> 2) + ")");
  const int width = 1 << (root_packed & 3);
  uint64_t values;
  if (!r.Deref(root_pos, root_width, &values)) return fail("root offset out of range");
  if (values < 3u * width) return fail("map header out of range");
  uint64_t count, keys_width_u, keys;
  if (!r.ReadUInt(values - width, width, &count)) return fail("map size unreadable");
  if (!r.ReadUInt(values - 2 * width, width, &keys_width_u))
    return fail("key width unreadable");
  if (!r.Deref(values - 3 * width, width, &keys)) return fail("keys offset out of range");
  const int keys_width = static_cast<int>(keys_width_u);
  if (!ValidWidth(keys_width) || keys_width_u > 8) return fail("bad key width");
  // Values, then one packed type byte per value.
  if (count > size || !r.InRange(values, count * width + count))
    return fail("map of " + std::to_string(count) + " entries exceeds the buffer");
  uint64_t key_count;
  if (keys < static_cast<uint64_t>(keys_width) ||
      !r.ReadUInt(keys - keys_width, keys_width, &key_count) || key_count != count ||
      !r.InRange(keys, count * keys_width))
    return fail("keys vector does not match the map");
  entries_.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    Entry e;
    uint64_t key_pos;
    if (!r.Deref(keys + i * keys_width, keys_width, &key_pos) ||
        !r.ReadCString(key_pos, &e.key))
      return fail("key " + std::to_string(i) + " out of range");
    const uint64_t pos = values + i * width;
    const int packed = data[values + count * width + i];
    const bool ok = ReadValue(r, data, pos, width, packed, &e);
    if (!ok) return fail("value of key '" + e.key + "' out of range");
    entries_.push_back(std::move(e));
  }
  return true;
}

const FlexbufferMap::Entry* FlexbufferMap::Find(const std::string& key) const {
  for (const Entry& e : entries_)
    if (e.key == key) return &e;
  return nullptr;
}

}  // namespace tflite
}  // namespace pkm
