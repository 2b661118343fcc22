// Fuzz test of the PkmEmbeddingBag TFLite kernel's Prepare/Invoke on random
// (often malformed) tensors, options and quantisation, through a fake
// TfLiteContext. Built with AddressSanitizer + UBSan by `make asan-tflite`.
// Every call must return kTfLiteOk or kTfLiteError with a message; successful
// float32 runs are checked against pkm::ReferenceForward. Also throws random
// bytes at the flexbuffer reader.
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/shape_rules.h"
#include "tflite_delegate/check_then_tflite.h"
#include "tflite_delegate/embedding_bag_tflite.h"
#include "tflite_delegate/flexbuffer_map.h"

namespace {

std::string g_last_error;
std::mt19937_64 rng(12345);

int Rand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
bool Coin(double p = 0.5) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }

void ReportError(TfLiteContext*, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  g_last_error = buf;
}

TfLiteIntArray* IntArray(const std::vector<int>& v) {
  auto* a = static_cast<TfLiteIntArray*>(std::malloc(sizeof(TfLiteIntArray) + sizeof(int) * (v.size() + 1)));
  a->size = static_cast<int>(v.size());
  for (size_t i = 0; i < v.size(); ++i) a->data[i] = v[i];
  return a;
}

size_t ElemBytes(TfLiteType t) {
  switch (t) {
    case kTfLiteFloat32: case kTfLiteInt32: return 4;
    case kTfLiteInt64: return 8;
    case kTfLiteFloat16: case kTfLiteBFloat16: return 2;
    default: return 1;
  }
}

int64_t Count(const TfLiteIntArray* d) {
  int64_t n = 1;
  for (int i = 0; i < d->size; ++i) n *= d->data[i];
  return n;
}

// Buffers are owned by the fixture (like an arena): the kernel may drop a
// tensor's pointer (making it dynamic) without leaking or double-freeing.
std::vector<void*>* g_buffers = nullptr;

void SetData(TfLiteTensor* t) {
  t->bytes = static_cast<size_t>(Count(t->dims)) * ElemBytes(t->type);
  t->data.raw = static_cast<char*>(std::malloc(t->bytes ? t->bytes : 1));
  g_buffers->push_back(t->data.raw);
}

TfLiteStatus ResizeTensor(TfLiteContext*, TfLiteTensor* t, TfLiteIntArray* dims) {
  std::free(t->dims);
  t->dims = dims;
  SetData(t);
  return kTfLiteOk;
}

struct Fixture {
  TfLiteContext context;
  std::vector<TfLiteTensor> tensors;
  std::vector<void*> owned;  // quantisation arrays and tensor buffers
  Fixture() {
    std::memset(&context, 0, sizeof(context));
    g_buffers = &owned;
  }
  ~Fixture() {
    for (auto& t : tensors) {
      std::free(t.dims);
      delete static_cast<TfLiteAffineQuantization*>(t.quantization.params);
    }
    for (void* p : owned) std::free(p);
  }
};

std::vector<int> RandDims(int max_rank, int max_dim) {
  std::vector<int> d(Rand(0, max_rank));
  for (int& v : d) v = Rand(0, max_dim);
  return d;
}

TfLiteType RandType(TfLiteType usual, double p_usual) {
  static const TfLiteType all[] = {kTfLiteFloat32, kTfLiteFloat16, kTfLiteBFloat16, kTfLiteInt8,
                                   kTfLiteInt32, kTfLiteInt64, kTfLiteBool};
  return Coin(p_usual) ? usual : all[Rand(0, 6)];
}

void FillRandom(TfLiteTensor* t, int64_t num_rows) {
  const int64_t n = Count(t->dims);
  for (int64_t i = 0; i < n; ++i) {
    switch (t->type) {
      case kTfLiteFloat32: reinterpret_cast<float*>(t->data.raw)[i] = Rand(-100, 100) / 37.f; break;
      case kTfLiteInt32: reinterpret_cast<int32_t*>(t->data.raw)[i] = Rand(-3, static_cast<int>(num_rows) + (Coin(0.05) ? 2 : -1)); break;
      case kTfLiteInt64: reinterpret_cast<int64_t*>(t->data.raw)[i] = Coin(0.01) ? (int64_t{1} << 40) : Rand(-3, static_cast<int>(num_rows) - 1); break;
      case kTfLiteFloat16: reinterpret_cast<uint16_t*>(t->data.raw)[i] = pkm::FloatToHalf(Rand(-50, 50) / 13.f); break;
      case kTfLiteBFloat16: reinterpret_cast<uint16_t*>(t->data.raw)[i] = pkm::FloatToBFloat16(Rand(-50, 50) / 13.f); break;
      default: reinterpret_cast<uint8_t*>(t->data.raw)[i] = static_cast<uint8_t>(Rand(0, 255)); break;
    }
  }
}

// Per-row scales in either TfLiteFloatArray layout (old: {int size; float[]},
// new: {float* data; int size; bool owning}).
void Quantise(Fixture* f, TfLiteTensor* t, int rows) {
  const int mode = Rand(0, 4);
  t->quantization.type = kTfLiteAffineQuantization;
  auto* aq = new TfLiteAffineQuantization;
  t->quantization.params = aq;
  const int count = mode == 3 ? rows + 1 : rows;  // mode 3: wrong count
  std::vector<int> zp(count);
  for (int& z : zp) z = Coin(0.8) ? 0 : Rand(-3, 3);
  aq->zero_point = IntArray(zp);
  f->owned.push_back(aq->zero_point);
  aq->quantized_dimension = mode == 4 ? 1 : 0;
  if (Coin()) {
    char* raw = static_cast<char*>(std::malloc(4 + 4 * (count + 1)));
    std::memcpy(raw, &count, 4);
    for (int i = 0; i < count; ++i) {
      float s = Rand(1, 100) / 1000.f;
      std::memcpy(raw + 4 + 4 * i, &s, 4);
    }
    aq->scale = reinterpret_cast<TfLiteFloatArray*>(raw);
    f->owned.push_back(raw);
  } else {
    struct NewFloatArray { float* data; int size; bool owning; };
    auto* arr = static_cast<NewFloatArray*>(std::malloc(sizeof(NewFloatArray)));
    arr->data = static_cast<float*>(std::malloc(4 * (count + 1)));
    for (int i = 0; i < count; ++i) arr->data[i] = Rand(1, 100) / 1000.f;
    arr->size = count;
    arr->owning = true;
    aq->scale = reinterpret_cast<TfLiteFloatArray*>(arr);
    f->owned.push_back(arr->data);
    f->owned.push_back(arr);
  }
  t->params.scale = Coin(0.3) ? 0.01f : 0.f;
}

std::vector<uint8_t> RandomOptions(const std::vector<std::vector<uint8_t>>& valid) {
  const int mode = Rand(0, 5);
  if (mode == 0) return {};
  std::vector<uint8_t> b = valid[Rand(0, static_cast<int>(valid.size()) - 1)];
  if (mode <= 2) return b;
  if (mode == 3) {
    for (int i = 0, n = Rand(1, 4); i < n && !b.empty(); ++i) b[Rand(0, static_cast<int>(b.size()) - 1)] = Rand(0, 255);
    return b;
  }
  if (mode == 4) {
    b.resize(Rand(0, static_cast<int>(b.size())));
    return b;
  }
  std::vector<uint8_t> r(Rand(0, 64));
  for (auto& v : r) v = Rand(0, 255);
  return r;
}

bool CheckAgainstReference(Fixture& f, const pkm::tflite::OpOptions& opts, int n_inputs) {
  const TfLiteTensor& table = f.tensors[0];
  const TfLiteTensor& idx = f.tensors[1];
  const TfLiteTensor& out = f.tensors[n_inputs];
  if (table.type != kTfLiteFloat32 || out.type != kTfLiteFloat32) return true;
  pkm::Table t;
  t.data = table.data.raw;
  t.num_rows = table.dims->data[0];
  t.dim = table.dims->data[1];
  pkm::Bags b;
  b.indices = idx.data.raw;
  b.indices_int64 = idx.type == kTfLiteInt64;
  b.bag_size = idx.dims->data[idx.dims->size - 1];
  b.num_bags = b.bag_size ? Count(idx.dims) / b.bag_size : 1;
  if (b.bag_size == 0) {
    b.num_bags = 1;
    for (int i = 0; i + 1 < idx.dims->size; ++i) b.num_bags *= idx.dims->data[i];
  }
  if (n_inputs == 3 && opts.has_weights) {
    b.weights = f.tensors[2].data.raw;
    if (f.tensors[2].type == kTfLiteFloat16) b.weights_type = pkm::ElemType::kFloat16;
    if (f.tensors[2].type == kTfLiteBFloat16) b.weights_type = pkm::ElemType::kBFloat16;
  }
  std::vector<float> expect(static_cast<size_t>(b.num_bags * t.dim) + 1);
  const pkm::Status s = pkm::ReferenceForward(t, b, opts.combiner, expect.data(), pkm::ElemType::kFloat32);
  if (!s.ok) {
    std::fprintf(stderr, "reference failed where the kernel succeeded: %s\n", s.message.c_str());
    return false;
  }
  const float* got = reinterpret_cast<const float*>(out.data.raw);
  for (int64_t i = 0; i < b.num_bags * t.dim; ++i) {
    if (std::fabs(got[i] - expect[i]) > 1e-4f * (1.f + std::fabs(expect[i]))) {
      std::fprintf(stderr, "mismatch at %lld: %g vs %g\n", static_cast<long long>(i), got[i], expect[i]);
      return false;
    }
  }
  return true;
}

// ---- deterministic cases ---------------------------------------------------

#define EXPECT(cond, ...)                                  \
  do {                                                     \
    if (!(cond)) {                                         \
      std::fprintf(stderr, "FAILED %s: ", #cond);          \
      std::fprintf(stderr, __VA_ARGS__);                   \
      std::fprintf(stderr, "\n");                          \
      return false;                                        \
    }                                                      \
  } while (0)

// A tensor with the given shape but a small buffer (a huge shape cannot be
// allocated, which is the point: the kernel must not trust it).
void SmallTensor(Fixture* f, int i, TfLiteType type, const std::vector<int>& dims,
                 TfLiteAllocationType alloc = kTfLiteArenaRw) {
  TfLiteTensor& t = f->tensors[i];
  std::memset(&t, 0, sizeof(t));
  t.type = type;
  t.dims = IntArray(dims);
  t.allocation_type = alloc;
  t.bytes = 64;
  t.data.raw = static_cast<char*>(std::calloc(1, t.bytes));
  f->owned.push_back(t.data.raw);
}

// A dense bag node's four tensors: the table (of `table_type`, `table_dims`),
// int32 indices [2, 2], float32 weights [2, 2] and the float32 output.
void DenseBagTensors(Fixture* f, TfLiteType table_type, const std::vector<int>& table_dims) {
  f->tensors.resize(4);
  SmallTensor(f, 0, table_type, table_dims);
  SmallTensor(f, 1, kTfLiteInt32, {2, 2});
  SmallTensor(f, 2, kTfLiteFloat32, {2, 2});
  SmallTensor(f, 3, kTfLiteFloat32, {});
}

// Prepare, then Invoke if Prepare passed, of a custom node on tensors
// 0..num_inputs-1 with output tensor num_inputs; the message in g_last_error.
TfLiteStatus RunCustomNode(Fixture* f, TfLiteRegistration* reg, int num_inputs) {
  f->context.ReportError = ReportError;
  f->context.ResizeTensor = ResizeTensor;
  f->context.recommended_num_threads = 1;
  f->context.tensors = f->tensors.data();
  f->context.tensors_size = f->tensors.size();
  std::vector<int> inputs(num_inputs);
  for (int i = 0; i < num_inputs; ++i) inputs[i] = i;
  TfLiteNode node;
  std::memset(&node, 0, sizeof(node));
  node.inputs = IntArray(inputs);
  node.outputs = IntArray({num_inputs});
  node.user_data = reg->init(&f->context, nullptr, 0);
  g_last_error.clear();
  TfLiteStatus st = reg->prepare(&f->context, &node);
  if (st == kTfLiteOk) st = reg->invoke(&f->context, &node);
  reg->free(&f->context, node.user_data);
  std::free(node.inputs);
  std::free(node.outputs);
  return st;
}

// The dense op with 3 inputs.
TfLiteStatus RunNode(Fixture* f) { return RunCustomNode(f, PkmEmbeddingBagRegistration(), 3); }

bool HugeShapesAreRejected() {
  const int big = 0x7fffffff;
  struct Case {
    const char* what;
    std::vector<int> table, indices;
    bool dynamic;  // shapes known only at Invoke
  };
  const Case cases[] = {
      {"params bytes", {big, big}, {2, 2}, false},
      {"params bytes at Invoke", {big, big}, {2, 2}, true},
      {"indices elements", {4, 2}, {65536, 65536, 65536, 65536, 2}, false},
      {"indices bytes", {4, 2}, {big, big, 4}, false},
      {"output elements", {1, big}, {1 << 30, 1 << 30, 1}, false},
  };
  for (const Case& c : cases) {
    Fixture f;
    f.tensors.resize(4);
    SmallTensor(&f, 0, kTfLiteFloat32, c.table, c.dynamic ? kTfLiteDynamic : kTfLiteArenaRw);
    SmallTensor(&f, 1, kTfLiteInt32, c.indices);
    SmallTensor(&f, 2, kTfLiteFloat32, c.indices);
    SmallTensor(&f, 3, kTfLiteFloat32, {});
    const TfLiteStatus st = RunNode(&f);
    EXPECT(st == kTfLiteError && g_last_error.find("shape too large") != std::string::npos,
           "%s: status %d, message '%s'", c.what, static_cast<int>(st), g_last_error.c_str());
  }
  return true;
}

// int8 table [3, 2] with per-row scales in a chosen layout.
bool BadScalesAreRejected() {
  struct NewFloatArray { float* data; int size; bool owning; };
  const float nan = std::nanf("");
  struct Case {
    const char* what;
    bool legacy;
    std::vector<float> scales;
    const char* message;  // nullptr: must succeed
  };
  float int_bits;  // in the legacy layout, a scale[1] with the bits of the count (3)
  const int three = 3;
  std::memcpy(&int_bits, &three, 4);
  const Case cases[] = {
      {"legacy ok", true, {0.1f, 0.2f, 0.3f}, nullptr},
      {"new ok", false, {0.1f, 0.2f, 0.3f}, nullptr},
      {"legacy negative", true, {0.1f, -0.2f, 0.3f}, "positive and finite"},
      {"legacy zero", true, {0.1f, 0.2f, 0.f}, "positive and finite"},
      {"new nan", false, {nan, 0.2f, 0.3f}, "positive and finite"},
      {"new inf", false, {0.1f, INFINITY, 0.3f}, "positive and finite"},
      {"legacy ambiguous", true, {0.1f, int_bits, 0.3f}, "unrecognised quantisation scale array"},
  };
  for (const Case& c : cases) {
    Fixture f;
    DenseBagTensors(&f, kTfLiteInt8, {3, 2});
    TfLiteTensor& t = f.tensors[0];
    auto* aq = new TfLiteAffineQuantization;
    std::memset(aq, 0, sizeof(*aq));
    t.quantization.type = kTfLiteAffineQuantization;
    t.quantization.params = aq;
    aq->zero_point = IntArray({0, 0, 0});
    f.owned.push_back(aq->zero_point);
    const int count = 3;
    if (c.legacy) {
      char* raw = static_cast<char*>(std::malloc(4 + 4 * count));
      std::memcpy(raw, &count, 4);
      std::memcpy(raw + 4, c.scales.data(), 4 * count);
      aq->scale = reinterpret_cast<TfLiteFloatArray*>(raw);
      f.owned.push_back(raw);
    } else {
      auto* arr = static_cast<NewFloatArray*>(std::calloc(1, sizeof(NewFloatArray)));
      arr->data = static_cast<float*>(std::malloc(4 * count));
      std::memcpy(arr->data, c.scales.data(), 4 * count);
      arr->size = count;
      arr->owning = true;
      aq->scale = reinterpret_cast<TfLiteFloatArray*>(arr);
      f.owned.push_back(arr->data);
      f.owned.push_back(arr);
    }
    const TfLiteStatus st = RunNode(&f);
    if (c.message == nullptr) {
      EXPECT(st == kTfLiteOk, "%s: '%s'", c.what, g_last_error.c_str());
    } else {
      EXPECT(st == kTfLiteError && g_last_error.find(c.message) != std::string::npos,
             "%s: status %d, message '%s'", c.what, static_cast<int>(st), g_last_error.c_str());
    }
  }
  return true;
}

// A fused stock chain must reject what stock GATHER rejects (negative
// indices included); the custom op keeps padding semantics.
bool FusedChainRejectsNegativeIndices() {
  for (bool composite : {false, true}) {
    for (int bad : {-1, 4}) {
      Fixture f;
      f.tensors.resize(4);
      SmallTensor(&f, 0, kTfLiteFloat32, {4, 2});
      SmallTensor(&f, 1, kTfLiteInt32, {2, 2});
      SmallTensor(&f, 2, kTfLiteFloat32, {2, 2, 1});
      SmallTensor(&f, 3, kTfLiteFloat32, {});
      f.tensors[1].data.i32[0] = 1;
      f.tensors[1].data.i32[3] = bad;
      f.context.ReportError = ReportError;
      f.context.ResizeTensor = ResizeTensor;
      f.context.tensors = f.tensors.data();
      f.context.tensors_size = f.tensors.size();
      pkm::tflite::BagSpec spec;
      spec.table = 0;
      spec.indices = 1;
      spec.weights = composite ? 2 : -1;
      spec.output = 3;
      spec.composite = composite;
      pkm::tflite::BagState state;
      g_last_error.clear();
      TfLiteStatus st = pkm::tflite::PrepareBag(&f.context, spec, &state);
      if (st == kTfLiteOk) st = pkm::tflite::InvokeBag(&f.context, spec, state, pkm::SerialFor());
      const std::string want = "indices[3] = " + std::to_string(bad) + " is out of range [0, 4)";
      if (!composite && bad < 0) {
        EXPECT(st == kTfLiteOk, "custom op, padding: '%s'", g_last_error.c_str());
      } else {
        EXPECT(st == kTfLiteError && g_last_error.find(want) != std::string::npos,
               "composite=%d index %d: status %d, message '%s'", composite, bad,
               static_cast<int>(st), g_last_error.c_str());
      }
    }
  }
  return true;
}

std::string DimsOf(const std::vector<int>& d) { return pkm::DimsString(std::vector<int64_t>(d.begin(), d.end())); }

// A fused chain's weights as the stock MUL broadcasts them (random shapes,
// some through a RESHAPE step, some that no longer fit) against a reference
// that maps each position to its weight by division and remainder; under
// ASan this also checks the broadcast copy's reads.
bool CompositeWeightsFuzz(int iterations, int* checked, int* refused) {
  for (int it = 0; it < iterations; ++it) {
    Fixture f;
    f.tensors.resize(4);
    for (auto& t : f.tensors) std::memset(&t, 0, sizeof(t));
    const int rows = 5, dim = 3;
    std::vector<int> ids_dims(Rand(1, 3));
    for (int& d : ids_dims) d = Rand(Coin(0.05) ? 0 : 1, 4);
    std::vector<int> mul_dims;  // the weights as they reach the MUL
    if (Coin(0.8)) {            // a broadcast of ids_dims + [1], maybe of lower rank
      mul_dims = ids_dims;
      mul_dims.push_back(1);
      for (int& d : mul_dims)
        if (Coin(0.3)) d = 1;
      mul_dims.erase(mul_dims.begin(), mul_dims.begin() + Rand(0, static_cast<int>(ids_dims.size())));
    } else {
      mul_dims = RandDims(4, 4);
    }
    pkm::tflite::BagSpec spec;
    spec.table = 0, spec.indices = 1, spec.weights = 2, spec.output = 3, spec.composite = true;
    const int rank = static_cast<int>(ids_dims.size());
    spec.sum_axis = Coin(0.8) ? (Coin() ? -2 : rank - 1) : Rand(-4, 3);
    bool flat = false;
    if (Coin(0.4)) {  // the weights come flat and a RESHAPE gives them mul_dims
      pkm::tflite::ShapeStep step;
      step.kind = pkm::tflite::ShapeStep::Kind::kReshape;
      step.values.assign(mul_dims.begin(), mul_dims.end());
      if (!step.values.empty() && Coin()) step.values[Rand(0, static_cast<int>(step.values.size()) - 1)] = -1;
      spec.weight_steps.push_back(step);
      flat = true;
    }
    int64_t mul_count = 1;
    for (int d : mul_dims) mul_count *= d;
    const std::vector<int> raw_dims = flat ? std::vector<int>{static_cast<int>(mul_count)} : mul_dims;
    const TfLiteType types[4] = {kTfLiteFloat32, kTfLiteInt32, kTfLiteFloat32, kTfLiteFloat32};
    const std::vector<int> dims[4] = {{rows, dim}, ids_dims, raw_dims, {}};
    for (int i = 0; i < 4; ++i) {
      f.tensors[i].type = types[i];
      f.tensors[i].dims = IntArray(dims[i]);
      f.tensors[i].allocation_type = kTfLiteArenaRw;
      SetData(&f.tensors[i]);
    }
    float* table = reinterpret_cast<float*>(f.tensors[0].data.raw);
    for (int i = 0; i < rows * dim; ++i) table[i] = Rand(-100, 100) / 37.f;
    const int64_t positions = Count(f.tensors[1].dims);
    int32_t* idx = f.tensors[1].data.i32;
    for (int64_t i = 0; i < positions; ++i) idx[i] = Rand(0, rows - 1);
    float* w = reinterpret_cast<float*>(f.tensors[2].data.raw);
    for (int64_t i = 0; i < mul_count; ++i) w[i] = Rand(-100, 100) / 29.f;
    f.context.ReportError = ReportError;
    f.context.ResizeTensor = ResizeTensor;
    f.context.tensors = f.tensors.data();
    f.context.tensors_size = f.tensors.size();
    // What the stock ops accept: SUM over the last ids axis, mul_dims broadcast to ids_dims + [1].
    const int axis = spec.sum_axis < 0 ? spec.sum_axis + rank + 1 : spec.sum_axis;
    bool fits = axis == rank - 1 && static_cast<int>(mul_dims.size()) <= rank + 1 &&
                (mul_dims.empty() || mul_dims.back() == 1);
    for (int i = 0; fits && i < rank; ++i) {
      const int mi = static_cast<int>(mul_dims.size()) - 1 - (rank - i);
      const int d = mi >= 0 ? mul_dims[mi] : 1;
      fits = d == 1 || d == ids_dims[i];
    }
    pkm::tflite::BagState state;
    g_last_error.clear();
    TfLiteStatus st = pkm::tflite::PrepareBag(&f.context, spec, &state);
    if (st == kTfLiteOk) st = pkm::tflite::InvokeBag(&f.context, spec, state, pkm::SerialFor());
    if (!fits) {
      EXPECT(st == kTfLiteError && !g_last_error.empty(), "ids %s weights %s axis %d: accepted",
             DimsOf(ids_dims).c_str(),
             DimsOf(mul_dims).c_str(), spec.sum_axis);
      ++*refused;
      continue;
    }
    EXPECT(st == kTfLiteOk, "ids %s weights %s: '%s'",
           DimsOf(ids_dims).c_str(),
           DimsOf(mul_dims).c_str(), g_last_error.c_str());
    const float* out = reinterpret_cast<const float*>(f.tensors[3].data.raw);
    const int bag = ids_dims.back();
    int64_t num_bags = 1;
    for (int i = 0; i + 1 < rank; ++i) num_bags *= ids_dims[i];
    for (int64_t b = 0; b < num_bags; ++b) {
      for (int c = 0; c < dim; ++c) {
        double want = 0;
        for (int k = 0; k < bag; ++k) {
          const int64_t pos = b * bag + k;
          int64_t wi = 0, stride = 1, rest = pos;
          for (int i = rank - 1; i >= 0; --i) {  // ids axis i <-> mul axis aligned from the right
            const int64_t p = rest % ids_dims[i];
            rest /= ids_dims[i];
            const int mi = static_cast<int>(mul_dims.size()) - 1 - (rank - i);
            const int d = mi >= 0 ? mul_dims[mi] : 1;
            if (d != 1) wi += p * stride;
            stride *= d;
          }
          want += static_cast<double>(w[wi]) * table[idx[pos] * dim + c];
        }
        const float got = out[b * dim + c];
        EXPECT(std::fabs(got - want) <= 1e-4 * (1 + std::fabs(want)), "ids %s weights %s: out[%lld, %d] = %g, want %g",
               DimsOf(ids_dims).c_str(),
               DimsOf(mul_dims).c_str(),
               static_cast<long long>(b), c, got, want);
      }
    }
    ++*checked;
  }
  return true;
}

int CountThreads() {
  int n = 0;
  if (FILE* fp = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), fp))
      if (std::sscanf(line, "Threads: %d", &n) == 1) break;
    std::fclose(fp);
  }
  return n;
}

// Nodes asking for the same thread count share one pool.
bool NodesShareOnePool() {
  Fixture f;
  DenseBagTensors(&f, kTfLiteFloat32, {4, 2});
  f.context.ReportError = ReportError;
  f.context.ResizeTensor = ResizeTensor;
  f.context.recommended_num_threads = 3;
  f.context.tensors = f.tensors.data();
  f.context.tensors_size = f.tensors.size();
  TfLiteRegistration* reg = PkmEmbeddingBagRegistration();
  const int before = CountThreads();
  std::vector<TfLiteNode> nodes(8);
  for (TfLiteNode& node : nodes) {
    std::memset(&node, 0, sizeof(node));
    node.inputs = IntArray({0, 1, 2});
    node.outputs = IntArray({3});
    node.user_data = reg->init(&f.context, nullptr, 0);
    EXPECT(reg->prepare(&f.context, &node) == kTfLiteOk, "prepare: '%s'", g_last_error.c_str());
  }
  const int during = CountThreads();
  for (TfLiteNode& node : nodes) {
    EXPECT(reg->invoke(&f.context, &node) == kTfLiteOk, "invoke: '%s'", g_last_error.c_str());
    reg->free(&f.context, node.user_data);
    std::free(node.inputs);
    std::free(node.outputs);
  }
  const int after = CountThreads();
  EXPECT(during - before == 2 && after == before,
         "threads: %d before, %d with 8 nodes of 3 threads, %d after", before, during, after);
  return true;
}

}  // namespace

// PkmRaggedEmbeddingBag (params, values, row_splits, weights) on random,
// mostly well-formed ragged bags: runs must match the core's reference, and
// every rejection (bad splits, types, shapes) must carry a message.
bool RaggedFuzz(int iterations, int* ok_runs, int* checked, int* errors) {
  TfLiteRegistration* reg = PkmRaggedEmbeddingBagRegistration();
  for (int it = 0; it < iterations; ++it) {
    Fixture f;
    f.context.ReportError = ReportError;
    f.context.ResizeTensor = ResizeTensor;
    f.context.recommended_num_threads = Rand(1, 3);
    f.tensors.resize(5);
    for (auto& t : f.tensors) std::memset(&t, 0, sizeof(t));
    const int rows = Rand(0, 30), dim = Rand(0, 7), bags = Rand(0, 6);
    std::vector<int64_t> splits(1, 0);
    for (int b = 0; b < bags; ++b) splits.push_back(splits.back() + Rand(0, 4));
    int nnz = static_cast<int>(splits.back());
    const int corrupt = Rand(0, 9);  // 0..3: malformed in one way; else well formed
    if (corrupt == 0 && splits.size() > 1) splits[0] = 1;
    if (corrupt == 1 && splits.size() > 2) std::swap(splits[1], splits.back());
    if (corrupt == 2) nnz += 1;  // values longer than the splits say
    const bool splits64 = Coin();
    const TfLiteType types[5] = {RandType(kTfLiteFloat32, 0.9),
                                 RandType(Coin() ? kTfLiteInt32 : kTfLiteInt64, 0.9),
                                 splits64 ? kTfLiteInt64 : RandType(kTfLiteInt32, 0.95),
                                 RandType(kTfLiteFloat32, 0.9), kTfLiteFloat32};
    const std::vector<int> dims[5] = {
        Coin(0.95) ? std::vector<int>{rows, dim} : RandDims(3, 4),
        corrupt == 3 ? std::vector<int>{nnz, 1} : std::vector<int>{nnz},
        Coin(0.97) ? std::vector<int>{static_cast<int>(splits.size())} : RandDims(2, 3),
        Coin(0.95) ? std::vector<int>{nnz} : RandDims(2, 4), {}};
    for (int i = 0; i < 5; ++i) {
      f.tensors[i].type = types[i];
      f.tensors[i].dims = IntArray(dims[i]);
      f.tensors[i].allocation_type = (i < 4 && Coin(0.1)) ? kTfLiteDynamic : kTfLiteArenaRw;
      SetData(&f.tensors[i]);
      FillRandom(&f.tensors[i], rows);
    }
    TfLiteTensor& st_splits = f.tensors[2];
    for (int64_t i = 0; i < Count(st_splits.dims) && i < static_cast<int64_t>(splits.size()); ++i) {
      if (st_splits.type == kTfLiteInt64) reinterpret_cast<int64_t*>(st_splits.data.raw)[i] = splits[i];
      if (st_splits.type == kTfLiteInt32) reinterpret_cast<int32_t*>(st_splits.data.raw)[i] = static_cast<int32_t>(splits[i]);
    }
    f.context.tensors = f.tensors.data();
    f.context.tensors_size = f.tensors.size();
    TfLiteNode node;
    std::memset(&node, 0, sizeof(node));
    node.inputs = IntArray(Coin(0.95) ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0, 1, 2});
    node.outputs = IntArray({4});
    node.user_data = reg->init(&f.context, nullptr, 0);
    g_last_error.clear();
    TfLiteStatus st = reg->prepare(&f.context, &node);
    if (st == kTfLiteOk) st = reg->invoke(&f.context, &node);
    if (st == kTfLiteOk) {
      ++*ok_runs;
      const bool reference_checkable = types[0] == kTfLiteFloat32 && dims[0].size() == 2 &&
                                       f.tensors[4].type == kTfLiteFloat32;
      if (reference_checkable) {
        ++*checked;
        pkm::Table t;
        t.data = f.tensors[0].data.raw;
        t.num_rows = dims[0][0];
        t.dim = dims[0][1];
        pkm::Bags b;
        b.indices = f.tensors[1].data.raw;
        b.indices_int64 = types[1] == kTfLiteInt64;
        b.row_splits = st_splits.data.raw;
        b.row_splits_int64 = st_splits.type == kTfLiteInt64;
        b.num_bags = Count(st_splits.dims) - 1;
        b.num_values = Count(f.tensors[1].dims);
        if (node.inputs->size == 4) {
          b.weights = f.tensors[3].data.raw;
          if (types[3] == kTfLiteFloat16) b.weights_type = pkm::ElemType::kFloat16;
          if (types[3] == kTfLiteBFloat16) b.weights_type = pkm::ElemType::kBFloat16;
        }
        std::vector<float> expect(static_cast<size_t>(b.num_bags * t.dim) + 1);
        const pkm::Status s = pkm::ReferenceForward(t, b, pkm::Combiner::kSum, expect.data(),
                                                    pkm::ElemType::kFloat32);
        EXPECT(s.ok, "ragged reference failed where the kernel succeeded: %s", s.message.c_str());
        const float* got = reinterpret_cast<const float*>(f.tensors[4].data.raw);
        for (int64_t i = 0; i < b.num_bags * t.dim; ++i)
          EXPECT(std::fabs(got[i] - expect[i]) <= 1e-4f * (1.f + std::fabs(expect[i])),
                 "ragged mismatch at %lld: %g vs %g", static_cast<long long>(i), got[i], expect[i]);
      }
    } else {
      ++*errors;
      EXPECT(!g_last_error.empty(), "ragged iteration %d: kTfLiteError without a message", it);
    }
    reg->free(&f.context, node.user_data);
    std::free(node.inputs);
    std::free(node.outputs);
  }
  return true;
}

// Malformed row_splits are errors that name the problem.
bool BadRowSplitsAreRejected() {
  struct Case { std::vector<int64_t> splits; int nnz; const char* message; };
  const Case cases[] = {
      {{0, 2, 3}, 3, nullptr},
      {{1, 2, 3}, 3, "row_splits"},
      {{0, 3, 2}, 3, "row_splits"},
      {{0, 1, 2}, 3, "row_splits"},
      {{}, 3, "row_splits must be a non-empty vector ([num_bags + 1]), got shape [0]"},
  };
  TfLiteRegistration* reg = PkmRaggedEmbeddingBagRegistration();
  for (const Case& c : cases) {
    Fixture f;
    f.tensors.resize(5);
    SmallTensor(&f, 0, kTfLiteFloat32, {4, 2});
    SmallTensor(&f, 1, kTfLiteInt64, {c.nnz});
    SmallTensor(&f, 2, kTfLiteInt64, {static_cast<int>(c.splits.size())});
    SmallTensor(&f, 3, kTfLiteFloat32, {c.nnz});
    SmallTensor(&f, 4, kTfLiteFloat32, {});
    for (size_t i = 0; i < c.splits.size(); ++i) f.tensors[2].data.i64[i] = c.splits[i];
    const TfLiteStatus st = RunCustomNode(&f, reg, 4);
    if (c.message == nullptr) {
      EXPECT(st == kTfLiteOk, "ragged splits ok: '%s'", g_last_error.c_str());
    } else {
      EXPECT(st == kTfLiteError && g_last_error.find(c.message) != std::string::npos &&
                 g_last_error.find("PkmRaggedEmbeddingBag") != std::string::npos,
             "bad splits: status %d, message '%s'", static_cast<int>(st), g_last_error.c_str());
    }
  }
  return true;
}

// An input whose buffer is one byte short of its shape is an error naming
// that input, for every input of both ops; the same node with full buffers runs.
bool ShortBuffersAreRejected() {
  struct Case { bool ragged; int input; const char* message; };
  const Case cases[] = {
      {false, -1, nullptr},
      {false, 0, "PkmEmbeddingBag: params buffer is smaller than its shape [4, 2]"},
      {false, 1, "PkmEmbeddingBag: indices buffer is smaller than its shape [2, 2]"},
      {false, 2, "PkmEmbeddingBag: weights buffer is smaller than its shape [2, 2]"},
      {true, -1, nullptr},
      {true, 0, "PkmRaggedEmbeddingBag: params buffer is smaller than its shape [4, 2]"},
      {true, 1, "PkmRaggedEmbeddingBag: values buffer is smaller than its shape [3]"},
      {true, 2, "PkmRaggedEmbeddingBag: row_splits buffer is smaller than its shape [3]"},
      {true, 3, "PkmRaggedEmbeddingBag: weights buffer is smaller than its shape [3]"},
  };
  for (const Case& c : cases) {
    Fixture f;
    const int num_inputs = c.ragged ? 4 : 3;
    f.tensors.resize(num_inputs + 1);
    SmallTensor(&f, 0, kTfLiteFloat32, {4, 2});
    if (c.ragged) {
      SmallTensor(&f, 1, kTfLiteInt64, {3});  // values (zeros: row 0)
      SmallTensor(&f, 2, kTfLiteInt64, {3});  // row_splits {0, 2, 3}
      f.tensors[2].data.i64[1] = 2;
      f.tensors[2].data.i64[2] = 3;
      SmallTensor(&f, 3, kTfLiteFloat32, {3});
    } else {
      SmallTensor(&f, 1, kTfLiteInt32, {2, 2});
      SmallTensor(&f, 2, kTfLiteFloat32, {2, 2});
    }
    SmallTensor(&f, num_inputs, kTfLiteFloat32, {});
    for (int i = 0; i < num_inputs; ++i)  // exact sizes, so one byte less is short
      f.tensors[i].bytes = Count(f.tensors[i].dims) * ElemBytes(f.tensors[i].type);
    if (c.input >= 0) f.tensors[c.input].bytes -= 1;
    TfLiteRegistration* reg =
        c.ragged ? PkmRaggedEmbeddingBagRegistration() : PkmEmbeddingBagRegistration();
    const TfLiteStatus st = RunCustomNode(&f, reg, num_inputs);
    if (c.message == nullptr) {
      EXPECT(st == kTfLiteOk, "full buffers (ragged=%d): '%s'", c.ragged, g_last_error.c_str());
    } else {
      EXPECT(st == kTfLiteError && g_last_error == c.message, "input %d short (ragged=%d): status %d, message '%s'",
             c.input, c.ragged, static_cast<int>(st), g_last_error.c_str());
    }
  }
  return true;
}

// PkmCheckThen on random tensors and options: a run that passes had every condition element true
// and copied the value bytewise; a false condition on a well-formed node fails with the message.
bool CheckThenFuzz(int iterations, int* passed, int* failed_checks, int* rejected) {
  const std::vector<std::vector<uint8_t>> valid = {  // flexbuffers.Dumps({"T": 0, "message": "sizes differ"})
      {84, 0, 109, 101, 115, 115, 97, 103, 101, 0, 12, 115, 105, 122, 101, 115, 32, 100, 105, 102, 102, 101,
       114, 0, 2, 25, 24, 2, 1, 2, 0, 20, 4, 20, 4, 36, 1}};
  static const TfLiteType value_types[] = {kTfLiteFloat32, kTfLiteFloat16, kTfLiteBFloat16, kTfLiteInt32,
                                           kTfLiteInt64, kTfLiteBool, kTfLiteString};
  TfLiteRegistration* reg = PkmCheckThenRegistration();
  for (int it = 0; it < iterations; ++it) {
    Fixture f;
    f.tensors.resize(3);
    for (auto& t : f.tensors) std::memset(&t, 0, sizeof(t));
    const TfLiteType value_type = Coin(0.8) ? kTfLiteFloat32 : value_types[Rand(0, 6)];
    const TfLiteType types[] = {Coin(0.95) ? kTfLiteBool : kTfLiteInt32, value_type,
                                Coin(0.95) ? value_type : value_types[Rand(0, 6)]};
    for (int i = 0; i < 3; ++i) {
      TfLiteTensor& t = f.tensors[i];
      t.type = types[i];
      t.dims = IntArray(RandDims(i == 0 ? 2 : 3, i == 0 ? 3 : 5));
      t.allocation_type = (i == 1 && Coin(0.2)) ? kTfLiteDynamic : kTfLiteArenaRw;
      SetData(&t);
      for (size_t b = 0; b < t.bytes; ++b)
        t.data.raw[b] = static_cast<char>(i == 0 ? (Coin(0.97) ? (Coin(0.1) ? 2 : 1) : 0) : Rand(0, 255));
    }
    f.context.ReportError = ReportError;
    f.context.ResizeTensor = ResizeTensor;
    f.context.tensors = f.tensors.data();
    f.context.tensors_size = f.tensors.size();
    const int value_index = Coin(0.95) ? 1 : Rand(-1, 4);
    const bool well_formed_node = value_index == 1;
    TfLiteNode node;
    std::memset(&node, 0, sizeof(node));
    node.inputs = IntArray({0, value_index});
    node.outputs = IntArray({2});
    const std::vector<uint8_t> options = RandomOptions(valid);
    node.custom_initial_data = options.empty() ? nullptr : options.data();
    node.custom_initial_data_size = static_cast<int>(options.size());
    node.user_data = reg->init(&f.context, nullptr, 0);
    g_last_error.clear();
    TfLiteStatus st = reg->prepare(&f.context, &node);
    if (st == kTfLiteOk) st = reg->invoke(&f.context, &node);
    const TfLiteTensor& condition = f.tensors[0];
    const TfLiteTensor& value = f.tensors[1];
    const TfLiteTensor& output = f.tensors[2];
    bool holds = true;
    for (int64_t i = 0; i < Count(condition.dims); ++i) holds = holds && condition.data.raw[i] != 0;
    const bool well_formed = well_formed_node && options == valid[0] && types[0] == kTfLiteBool &&
                             value_type != kTfLiteString && types[2] == value_type;
    if (st == kTfLiteOk) {
      ++*passed;
      EXPECT(holds, "iteration %d passed a false condition", it);
      EXPECT(!well_formed_node || output.dims->size == value.dims->size && output.bytes >= value.bytes &&
                 std::memcmp(output.dims->data, value.dims->data, sizeof(int) * value.dims->size) == 0 &&
                 (value.bytes == 0 || std::memcmp(output.data.raw, value.data.raw, value.bytes) == 0),
             "iteration %d: the output is not the value", it);
    } else {
      EXPECT(!g_last_error.empty(), "iteration %d: kTfLiteError without a message", it);
      if (well_formed && !holds) {
        ++*failed_checks;
        EXPECT(g_last_error == "sizes differ", "iteration %d: got '%s'", it, g_last_error.c_str());
      } else {
        ++*rejected;
      }
      EXPECT(!well_formed || !holds, "iteration %d: a well-formed passing check failed: %s", it,
             g_last_error.c_str());
    }
    reg->free(&f.context, node.user_data);
    std::free(node.inputs);
    std::free(node.outputs);
  }
  return true;
}

int main(int argc, char** argv) {
  if (!HugeShapesAreRejected() || !BadScalesAreRejected() || !FusedChainRejectsNegativeIndices() ||
      !NodesShareOnePool() || !BadRowSplitsAreRejected() || !ShortBuffersAreRejected())
    return 1;
  std::printf("deterministic cases passed\n");
  int composite_checked = 0, composite_refused = 0;
  if (!CompositeWeightsFuzz(2000, &composite_checked, &composite_refused)) return 1;
  std::printf("fused-chain weights: %d checked against the broadcast reference, %d refused\n", composite_checked,
              composite_refused);
  if (composite_checked < 500 || composite_refused < 100) return 1;
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 2000;
  // Options as the converter writes them (flexbuffers maps of the TF attrs).
  const std::vector<std::vector<uint8_t>> valid = {
      {'T', 0, 'T', 'i', 'n', 'd', 'i', 'c', 'e', 's', 0, 'c', 'o', 'm', 'b', 'i', 'n', 'e', 'r', 0, 4, 'm', 'e', 'a', 'n', 0,
       'h', 'a', 's', '_', 'w', 'e', 'i', 'g', 'h', 't', 's', 0, 4, 39, 38, 30, 16, 4, 1, 4, 0, 2, 27, 1, 4, 4, 20, 104, 8, 36, 1},
  };
  TfLiteRegistration* reg = PkmEmbeddingBagRegistration();
  int ok_runs = 0, errors = 0, checked = 0;
  for (int it = 0; it < iterations; ++it) {
    Fixture f;
    f.context.ReportError = ReportError;
    f.context.ResizeTensor = ResizeTensor;
    f.context.recommended_num_threads = Rand(1, 3);
    const int n_inputs = Coin(0.9) ? Rand(2, 3) : Rand(0, 5);
    const int n_outputs = Coin(0.95) ? 1 : Rand(0, 2);
    f.tensors.resize(n_inputs + n_outputs);
    for (auto& t : f.tensors) std::memset(&t, 0, sizeof(t));
    int rows = 0;
    for (int i = 0; i < n_inputs + n_outputs; ++i) {
      TfLiteTensor& t = f.tensors[i];
      std::vector<int> dims;
      if (i == 0) {
        t.type = RandType(Coin(0.3) ? kTfLiteInt8 : kTfLiteFloat32, 0.85);
        dims = Coin(0.9) ? std::vector<int>{Rand(0, 40), Rand(0, 9)} : RandDims(3, 5);
        rows = dims.size() == 2 ? dims[0] : 0;
      } else if (i == 1) {
        t.type = RandType(Coin() ? kTfLiteInt32 : kTfLiteInt64, 0.9);
        dims = Coin(0.9) ? std::vector<int>{Rand(0, 6), Rand(0, 7)} : RandDims(3, 4);
      } else if (i == 2 && i < n_inputs) {
        t.type = RandType(kTfLiteFloat32, 0.85);
        dims = Coin(0.85) ? std::vector<int>(f.tensors[1].dims->data, f.tensors[1].dims->data + f.tensors[1].dims->size)
                          : RandDims(3, 6);
      } else {
        t.type = RandType(f.tensors[0].type == kTfLiteInt8 ? kTfLiteFloat32 : f.tensors[0].type, 0.9);
        dims = RandDims(3, 3);
      }
      t.dims = IntArray(dims);
      // Inputs are sometimes dynamic (shape known only at Invoke).
      t.allocation_type = (i < n_inputs && Coin(0.1)) ? kTfLiteDynamic : kTfLiteArenaRw;
      SetData(&t);
      FillRandom(&t, rows);
      if (i == 0 && t.type == kTfLiteInt8 && Coin(0.9)) Quantise(&f, &t, rows);
    }
    f.context.tensors = f.tensors.data();
    f.context.tensors_size = f.tensors.size();
    std::vector<int> in_idx(n_inputs), out_idx(n_outputs);
    for (int i = 0; i < n_inputs; ++i) in_idx[i] = Coin(0.98) ? i : (Coin() ? -1 : 99);
    for (int i = 0; i < n_outputs; ++i) out_idx[i] = Coin(0.98) ? n_inputs + i : 77;
    TfLiteNode node;
    std::memset(&node, 0, sizeof(node));
    node.inputs = IntArray(in_idx);
    node.outputs = IntArray(out_idx);
    const std::vector<uint8_t> options = RandomOptions(valid);
    node.custom_initial_data = options.empty() ? nullptr : options.data();
    node.custom_initial_data_size = static_cast<int>(options.size());
    node.user_data = reg->init(&f.context, reinterpret_cast<const char*>(node.custom_initial_data), options.size());
    g_last_error.clear();
    TfLiteStatus st = reg->prepare(&f.context, &node);
    if (st == kTfLiteOk) {
      if (Coin(0.05) && !f.tensors.empty()) {  // a buffer shrunk behind the kernel's back
        TfLiteTensor& t = f.tensors[Rand(0, static_cast<int>(f.tensors.size()) - 1)];
        if (t.bytes) t.bytes -= 1;
      }
      st = reg->invoke(&f.context, &node);
      if (st == kTfLiteOk) {
        ++ok_runs;
        pkm::tflite::OpOptions opts;
        std::string err;
        pkm::tflite::ParseOpOptions(options.data(), options.size(), &opts, &err);
        if (n_outputs == 1 && out_idx[0] == n_inputs && in_idx[0] == 0 && in_idx[1] == 1 &&
            (n_inputs < 3 || in_idx[2] == 2)) {
          if (!CheckAgainstReference(f, opts, n_inputs)) return 1;
          ++checked;
        }
      }
    }
    if (st != kTfLiteOk) {
      ++errors;
      if (g_last_error.empty()) {
        std::fprintf(stderr, "iteration %d: kTfLiteError without a message\n", it);
        return 1;
      }
    } else if (st != kTfLiteOk && st != kTfLiteError) {
      return 1;
    }
    reg->free(&f.context, node.user_data);
    std::free(node.inputs);
    std::free(node.outputs);
  }
  // The flexbuffer reader on random bytes and mutations of a valid buffer.
  int parsed = 0;
  for (int it = 0; it < iterations * 5; ++it) {
    std::vector<uint8_t> b = RandomOptions(valid);
    pkm::tflite::FlexbufferMap map;
    std::string err;
    parsed += map.Parse(b.data(), b.size(), &err);
  }
  std::printf("fuzz: %d iterations, %d ran ok (%d checked against the reference), %d rejected "
              "with a message; flexbuffer: %d/%d parsed\n",
              iterations, ok_runs, checked, errors, parsed, iterations * 5);
  int check_passed = 0, check_failed = 0, check_rejected = 0;
  if (!CheckThenFuzz(iterations, &check_passed, &check_failed, &check_rejected)) return 1;
  std::printf("PkmCheckThen fuzz: %d passed, %d failed with the message, %d rejected\n", check_passed,
              check_failed, check_rejected);
  if (check_passed == 0 || check_failed == 0 || check_rejected == 0) return 1;
  int ragged_ok = 0, ragged_checked = 0, ragged_errors = 0;
  if (!RaggedFuzz(iterations, &ragged_ok, &ragged_checked, &ragged_errors)) return 1;
  std::printf("ragged fuzz: %d iterations, %d ran ok (%d checked against the reference), %d "
              "rejected with a message\n", iterations, ragged_ok, ragged_checked, ragged_errors);
  return ok_runs > 0 && errors > 0 && checked > 0 && ragged_checked > 0 && ragged_errors > 0
             ? 0 : 1;
}
