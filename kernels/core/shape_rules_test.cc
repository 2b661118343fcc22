// The shape/dtype rule set (shape_rules.h): every fault gives its one
// message, partly known shapes pass what cannot be decided yet, and the C
// descriptor's rule agrees with the shape rules. Plain asserts, as the core test.
#include <cstdio>
#include <string>

#include "kernels/core/shape_rules.h"

namespace {

int g_failed = 0, g_passed = 0;

void Expect(bool cond, int line, const std::string& what) {
  if (cond) {
    ++g_passed;
    return;
  }
  ++g_failed;
  std::fprintf(stderr, "FAIL shape_rules_test.cc:%d: %s\n", line, what.c_str());
}

// The status fails with exactly `message` ("" = passes).
void ExpectMessage(const pkm::Status& s, const std::string& message, int line) {
  if (message.empty()) {
    Expect(s.ok, line, "expected ok, got: " + s.message);
  } else {
    Expect(!s.ok && s.message == message, line, "expected \"" + message + "\", got " +
                                                    (s.ok ? std::string("ok") : "\"" + s.message + "\""));
  }
}

pkm::BagShapes Dense(pkm::Dims params, pkm::Dims indices, pkm::MaybeDims weights) {
  pkm::BagShapes s;
  s.params = std::move(params);
  s.indices = std::move(indices);
  s.weights = std::move(weights);
  return s;
}

pkm::Status Forward(const pkm::BagShapes& s, pkm::MaybeDims* out = nullptr) {
  pkm::MaybeDims ignored;
  return pkm::ForwardShape(s, out ? out : &ignored);
}

void TestForwardFaults() {
  using pkm::Dims;
  ExpectMessage(Forward(Dense({10, 4, 2}, {1, 2}, Dims{1, 2})), "params must be a [N, D] matrix, got shape [10, 4, 2]",
                __LINE__);
  ExpectMessage(Forward(Dense({10, 4}, {}, Dims{})), "indices must have rank >= 1 ([..., K]), got shape []", __LINE__);
  ExpectMessage(Forward(Dense({10, 4}, {1, 2}, Dims{2, 1})), "weights must have the shape of indices [1, 2], got [2, 1]",
                __LINE__);
  pkm::BagShapes unused = Dense({10, 4}, {1, 2}, Dims{1, 2});
  unused.has_weights = false;
  ExpectMessage(Forward(unused), "weights must be empty (e.g. shape [0]) when has_weights is false, got shape [1, 2]",
                __LINE__);
  unused.weights = Dims{0};
  ExpectMessage(Forward(unused), "", __LINE__);
  pkm::BagShapes composite = Dense({10, 4}, {2, 3}, Dims{6});
  composite.weights_any_shape = true;
  ExpectMessage(Forward(composite), "", __LINE__);
  composite.weights = Dims{5};
  ExpectMessage(Forward(composite), "weights must have as many elements as indices [2, 3], got shape [5]", __LINE__);
  pkm::BagShapes max = Dense({10, 4}, {1, 2}, Dims{1, 2});
  max.combiner = static_cast<pkm::Combiner>(PKM_MAX);
  ExpectMessage(Forward(max), pkm::kMaxWithWeightsError, __LINE__);
  max.has_weights = false;
  max.weights = Dims{0};
  ExpectMessage(Forward(max), "", __LINE__);
}

void TestRaggedFaults() {
  using pkm::Dims;
  pkm::BagShapes s;
  s.ragged = true;
  s.params = Dims{10, 4};
  s.indices = Dims{3};
  s.row_splits = Dims{3};
  s.weights = Dims{3};
  pkm::MaybeDims out;
  ExpectMessage(Forward(s, &out), "", __LINE__);
  Expect(out && *out == Dims({2, 4}), __LINE__, "ragged output " + pkm::DimsString(out));
  s.indices = Dims{1, 3};
  ExpectMessage(Forward(s), "values must be a vector, got shape [1, 3]", __LINE__);
  s.indices = Dims{3};
  s.row_splits = Dims{0};
  ExpectMessage(Forward(s), "row_splits must be a non-empty vector ([num_bags + 1]), got shape [0]", __LINE__);
  s.row_splits = Dims{3};
  s.weights = Dims{2};
  ExpectMessage(Forward(s), "weights must have the shape of values [3], got [2]", __LINE__);
}

void TestUnknownShapesAndOutput() {
  using pkm::Dims;
  pkm::MaybeDims out;
  ExpectMessage(Forward(Dense({10, 4}, {2, 3, 5}, Dims{2, 3, 5}), &out), "", __LINE__);
  Expect(out && *out == Dims({2, 3, 4}), __LINE__, "dense output " + pkm::DimsString(out));
  // Unknown dims match anything; an unknown rank skips its rules.
  ExpectMessage(Forward(Dense({-1, 4}, {-1, 2}, Dims{3, -1}), &out), "", __LINE__);
  Expect(out && *out == Dims({3, 4}), __LINE__, "partial output " + pkm::DimsString(out));
  pkm::BagShapes unknown;
  ExpectMessage(Forward(unknown, &out), "", __LINE__);
  Expect(!out, __LINE__, "unknown indices rank gives an unknown output rank");
  ExpectMessage(pkm::GradShape(Dims{2, 4}, Dims{1, 4}), "grad must have the forward output's shape [1, 4], got [2, 4]",
                __LINE__);
  ExpectMessage(pkm::GradShape(Dims{-1, 4}, Dims{1, 4}), "", __LINE__);
  ExpectMessage(Forward(Dense({10, 4}, {INT64_MAX, 3}, Dims{INT64_MAX, 3})),
                "indices shape too large: [9223372036854775807, 3] (more elements than int64 counts)", __LINE__);
  Expect(pkm::DimsString(Dims{-1, 3}) == "[?, 3]" && pkm::DimsString(pkm::MaybeDims()) == "<unknown>", __LINE__,
         "DimsString");
}

void TestTypesAndInt8() {
  using pkm::DType;
  ExpectMessage(pkm::ParamsType(DType::kFloat64, false), "params must be float32, float16 or bfloat16, got float64",
                __LINE__);
  ExpectMessage(pkm::ParamsType(DType::kInt8, true), "", __LINE__);
  ExpectMessage(pkm::ParamsType(DType::kInt32, true),
                "params must be float32, float16, bfloat16 or int8 (per-row quantised), got int32", __LINE__);
  ExpectMessage(pkm::IndexType("values", DType::kFloat32), "values must be int32 or int64, got float32", __LINE__);
  ExpectMessage(pkm::WeightsType(DType::kInt8), "weights must be float32, float16 or bfloat16, got int8", __LINE__);
  ExpectMessage(pkm::OutputType(DType::kFloat16, DType::kFloat32), "output type float16 differs from params type float32",
                __LINE__);
  ExpectMessage(pkm::OutputType(DType::kFloat16, DType::kInt8), "", __LINE__);
  ExpectMessage(pkm::Int8RowTableShape(pkm::Dims{10, 4}, pkm::Dims{10}, pkm::Dims{10}), "", __LINE__);
  ExpectMessage(pkm::Int8RowTableShape(pkm::Dims{10, 4}, pkm::Dims{9}, pkm::Dims{10}),
                "int8 params: row scales must be a vector of N = 10 (one per row), got shape [9]", __LINE__);
  ExpectMessage(pkm::Int8RowTableShape(pkm::Dims{10, 4}, pkm::Dims{10}, pkm::Dims{10, 1}),
                "int8 params: row biases must be a vector of N = 10 (one per row), got shape [10, 1]", __LINE__);
  ExpectMessage(pkm::ConcreteDims("params", {-2, 4}), "params has a negative dimension: [-2, 4]", __LINE__);
}

void TestDescriptor() {
  const int32_t ids[2] = {0, 1};
  const float table[8] = {};
  const float weights[2] = {1.f, 1.f};
  PkmBags b{};
  b.table = table;
  b.num_rows = 2;
  b.dim = 4;
  b.indices = ids;
  b.num_bags = 1;
  b.bag_size = 2;
  ExpectMessage(pkm::BagProblemRule(b), "", __LINE__);
  PkmBags bad = b;
  bad.elem_type = 7;
  ExpectMessage(pkm::BagProblemRule(bad), "elem_type must be 0 (float32), 1 (float16) or 2 (bfloat16), got 7", __LINE__);
  bad = b;
  bad.combiner = 9;
  ExpectMessage(pkm::BagProblemRule(bad), "combiner must be 0 (sum), 1 (mean), 2 (sqrtn) or 3 (max), got 9", __LINE__);
  bad = b;
  bad.weights = weights;
  bad.combiner = PKM_MAX;
  ExpectMessage(pkm::BagProblemRule(bad), pkm::kMaxWithWeightsError, __LINE__);
  bad = b;
  bad.bag_size = -1;
  ExpectMessage(pkm::BagProblemRule(bad), "indices has a negative dimension: [1, -1]", __LINE__);
  bad = b;
  bad.indices = nullptr;
  ExpectMessage(pkm::BagProblemRule(bad), "indices is null", __LINE__);
  bad = b;
  bad.row_splits = ids;
  bad.num_bags = -1;
  bad.num_indices = 0;
  ExpectMessage(pkm::BagProblemRule(bad), "row_splits must be a non-empty vector ([num_bags + 1]), got shape [0]",
                __LINE__);
}

}  // namespace

int main() {
  TestForwardFaults();
  TestRaggedFaults();
  TestUnknownShapesAndOutput();
  TestTypesAndInt8();
  TestDescriptor();
  std::printf("shape rules: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
