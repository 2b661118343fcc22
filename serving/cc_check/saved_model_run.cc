// pkm_saved_model_run: loads a SavedModel the way tensorflow_model_server does
// and runs one of its signatures, with pkm_serve's ops linked in.
//
// `make serving-cc-check` links the op's objects into this executable with
// --whole-archive, what cc_library(alwayslink = 1) in SUPPORTED_TENSORFLOW_OPS
// does inside TF Serving: the REGISTER_OP / REGISTER_KERNEL_BUILDER static
// initialisers run at start-up and no op library is ever dlopen'd.
//
//   pkm_saved_model_run --model_dir=DIR [--signature=serving_default] [--tags=serve]
//       --input=NAME=DTYPE:[D0,D1,...]:V0,V1,...   values on the command line
//       --input=NAME=@FILE                           a binary TensorProto
//       [--repeat=N] [--warmup=W]                    time N session runs
//       [--intra_op_parallelism=0] [--inter_op_parallelism=0]
//       [--model_name=NAME] [--model_version=N]      session metadata (default: pkm, the
//                                                    directory's name when it is a number)
//
// Prints one JSON object on stdout: the outputs (dtype, shape, values), the
// pkm ops found in the op registry, and with --repeat the run latencies.
// Exit status: 0 ok; 1 the model failed to load or run (the status on stderr,
// e.g. "INVALID_ARGUMENT: indices[3] = ..."); 2 a bad command line.
#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "tensorflow/cc/saved_model/loader.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor.pb.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/protobuf/config.pb.h"
#include "tensorflow/core/protobuf/meta_graph.pb.h"
#include "tensorflow/core/public/session.h"
#include "tensorflow/core/public/session_options.h"

namespace {

using tensorflow::DataType;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// The ops kernels/tf/embedding_bag_ops.cc registers.
const char* const kPkmOps[] = {"PkmEmbeddingBag", "PkmEmbeddingBagGrad", "PkmRaggedEmbeddingBag",
                               "PkmRaggedEmbeddingBagGrad"};

struct Options {
  std::string model_dir;
  std::string signature = "serving_default";
  std::string tags = "serve";  // tensorflow::kSavedModelTagServe; its header is not in the pip TF
  std::string model_name = "pkm";
  long long model_version = -1;  // -1: the model directory's name if it is a number (TF Serving's layout), else 0
  int intra_op_parallelism = 0;  // 0: TF picks, as tensorflow_model_server's default
  int inter_op_parallelism = 0;
  int repeat = 0;
  int warmup = 3;
  std::vector<std::pair<std::string, std::string>> inputs;  // name, spec
};

class UsageError {
 public:
  explicit UsageError(std::string message) : message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(s);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!s.empty() && s.back() == sep) parts.push_back("");
  return parts;
}

long long ParseInt(const std::string& text, const std::string& what) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE) throw UsageError(what + ": '" + text + "' is not an integer");
  return v;
}

// strtof for float32, so a shortest round-trip float32 string reads back exactly.
template <typename T>
T ParseFloat(const std::string& text, const std::string& what) {
  char* end = nullptr;
  const T v = std::is_same<T, float>::value ? std::strtof(text.c_str(), &end) : std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') throw UsageError(what + ": '" + text + "' is not a number");
  return v;
}

Options ParseFlags(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) throw UsageError("expected --flag=value, got '" + arg + "'");
    const std::string key = arg.substr(2, eq - 2), value = arg.substr(eq + 1);
    if (key == "model_dir") o.model_dir = value;
    else if (key == "signature") o.signature = value;
    else if (key == "tags") o.tags = value;
    else if (key == "model_name") o.model_name = value;
    else if (key == "model_version") o.model_version = ParseInt(value, "--model_version");
    else if (key == "intra_op_parallelism") o.intra_op_parallelism = ParseInt(value, "--intra_op_parallelism");
    else if (key == "inter_op_parallelism") o.inter_op_parallelism = ParseInt(value, "--inter_op_parallelism");
    else if (key == "repeat") o.repeat = ParseInt(value, "--repeat");
    else if (key == "warmup") o.warmup = ParseInt(value, "--warmup");
    else if (key == "input") {
      const size_t sep = value.find('=');
      if (sep == std::string::npos || sep == 0)
        throw UsageError("--input=" + value + ": expected NAME=DTYPE:[SHAPE]:VALUES or NAME=@FILE");
      o.inputs.emplace_back(value.substr(0, sep), value.substr(sep + 1));
    } else {
      throw UsageError("unknown flag --" + key);
    }
  }
  if (o.model_dir.empty()) throw UsageError("--model_dir is required");
  if (o.repeat < 0 || o.warmup < 0) throw UsageError("--repeat and --warmup must be >= 0");
  if (o.model_version < 0) {
    std::string dir = o.model_dir;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    const std::string base = dir.substr(dir.find_last_of('/') + 1);
    const bool numeric = !base.empty() && base.size() < 19 &&
                         std::all_of(base.begin(), base.end(), [](char c) { return c >= '0' && c <= '9'; });
    o.model_version = numeric ? std::stoll(base) : 0;
  }
  return o;
}

template <typename T, typename Parse>
void FillFlat(Tensor* t, const std::vector<std::string>& values, Parse parse) {
  auto flat = t->flat<T>();
  for (size_t i = 0; i < values.size(); ++i) flat(i) = static_cast<T>(parse(values[i]));
}

// NAME=DTYPE:[D0,D1,...]:V0,V1,... (row-major values; [] is a scalar).
Tensor TensorFromText(const std::string& name, const std::string& spec) {
  const std::string where = "--input " + name;
  const size_t c1 = spec.find(':');
  const size_t c2 = c1 == std::string::npos ? c1 : spec.find(':', c1 + 1);
  if (c2 == std::string::npos) throw UsageError(where + ": expected DTYPE:[SHAPE]:VALUES, got '" + spec + "'");
  const std::string dtype = spec.substr(0, c1), shape_text = spec.substr(c1 + 1, c2 - c1 - 1);
  const std::string values_text = spec.substr(c2 + 1);
  if (shape_text.size() < 2 || shape_text.front() != '[' || shape_text.back() != ']')
    throw UsageError(where + ": shape '" + shape_text + "' must look like [2,3] ([] for a scalar)");
  TensorShape shape;
  const std::string dims = shape_text.substr(1, shape_text.size() - 2);
  if (!dims.empty()) {
    for (const std::string& d : Split(dims, ',')) {
      const long long n = ParseInt(d, where + " shape");
      if (n < 0) throw UsageError(where + ": negative dimension " + d);
      shape.AddDim(n);
    }
  }
  std::vector<std::string> values = values_text.empty() ? std::vector<std::string>{} : Split(values_text, ',');
  if (static_cast<long long>(values.size()) != shape.num_elements())
    throw UsageError(where + ": shape " + shape.DebugString() + " needs " + std::to_string(shape.num_elements()) +
                     " values, got " + std::to_string(values.size()));
  auto as_float = [&](const std::string& v) { return ParseFloat<float>(v, where); };
  auto as_double = [&](const std::string& v) { return ParseFloat<double>(v, where); };
  auto as_int = [&](const std::string& v) { return ParseInt(v, where); };
  if (dtype == "float32") {
    Tensor t(tensorflow::DT_FLOAT, shape);
    FillFlat<float>(&t, values, as_float);
    return t;
  }
  if (dtype == "float64") {
    Tensor t(tensorflow::DT_DOUBLE, shape);
    FillFlat<double>(&t, values, as_double);
    return t;
  }
  if (dtype == "int32") {
    Tensor t(tensorflow::DT_INT32, shape);
    FillFlat<tensorflow::int32>(&t, values, as_int);
    return t;
  }
  if (dtype == "int64") {
    Tensor t(tensorflow::DT_INT64, shape);
    FillFlat<tensorflow::int64>(&t, values, as_int);
    return t;
  }
  throw UsageError(where + ": dtype '" + dtype + "' is not one of float32, float64, int32, int64 "
                   "(other dtypes: pass a TensorProto file, NAME=@FILE)");
}

Tensor TensorFromProtoFile(const std::string& name, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("--input " + name + ": cannot read " + path);
  std::stringstream bytes;
  bytes << in.rdbuf();
  tensorflow::TensorProto proto;
  Tensor t;
  if (!proto.ParseFromString(bytes.str()) || !t.FromProto(proto))
    throw UsageError("--input " + name + ": " + path + " is not a binary TensorProto");
  return t;
}

// Checks the inputs against the signature as TF Serving's Predict does (every
// input given, none unknown, dtypes equal) and maps them to graph tensor names.
Status BindInputs(const tensorflow::SignatureDef& sig, const std::string& sig_name,
                  const std::map<std::string, Tensor>& given, std::vector<std::pair<std::string, Tensor>>* feeds) {
  for (const auto& [key, tensor] : given) {
    auto it = sig.inputs().find(key);
    if (it == sig.inputs().end())
      return tensorflow::errors::InvalidArgument("signature '", sig_name, "' has no input '", key, "'");
    if (it->second.dtype() != tensor.dtype())
      return tensorflow::errors::InvalidArgument("input '", key, "' must be ",
                                                 tensorflow::DataTypeString(it->second.dtype()), ", got ",
                                                 tensorflow::DataTypeString(tensor.dtype()));
    feeds->emplace_back(it->second.name(), tensor);
  }
  for (const auto& [key, info] : sig.inputs()) {
    if (!given.count(key))
      return tensorflow::errors::InvalidArgument("signature '", sig_name, "' needs input '", key, "' (",
                                                 tensorflow::DataTypeString(info.dtype()), ")");
  }
  return Status();
}

void PrintNumber(double v, int digits) {
  if (std::isnan(v)) std::printf("NaN");
  else if (std::isinf(v)) std::printf(v > 0 ? "Infinity" : "-Infinity");
  else std::printf("%.*g", digits, v);
}

template <typename T>
void PrintValues(const Tensor& t, int digits, bool integral) {
  auto flat = t.flat<T>();
  for (tensorflow::int64 i = 0; i < flat.size(); ++i) {
    if (i) std::printf(",");
    if (integral) std::printf("%lld", static_cast<long long>(flat(i)));
    else PrintNumber(static_cast<double>(static_cast<float>(flat(i))), digits);
  }
}

Status PrintTensor(const std::string& key, const Tensor& t) {
  std::printf("\"%s\":{\"dtype\":\"%s\",\"shape\":[", key.c_str(), tensorflow::DataTypeString(t.dtype()).c_str());
  for (int d = 0; d < t.dims(); ++d) std::printf(d ? ",%lld" : "%lld", static_cast<long long>(t.dim_size(d)));
  std::printf("],\"values\":[");
  switch (t.dtype()) {
    case tensorflow::DT_FLOAT: PrintValues<float>(t, 9, false); break;  // 9 digits round-trip a float
    case tensorflow::DT_HALF: PrintValues<Eigen::half>(t, 9, false); break;
    case tensorflow::DT_BFLOAT16: PrintValues<tensorflow::bfloat16>(t, 9, false); break;
    case tensorflow::DT_DOUBLE: {
      auto flat = t.flat<double>();
      for (tensorflow::int64 i = 0; i < flat.size(); ++i) {
        if (i) std::printf(",");
        PrintNumber(flat(i), 17);
      }
      break;
    }
    case tensorflow::DT_INT32: PrintValues<tensorflow::int32>(t, 0, true); break;
    case tensorflow::DT_INT64: PrintValues<tensorflow::int64>(t, 0, true); break;
    case tensorflow::DT_BOOL: PrintValues<bool>(t, 0, true); break;
    default:
      return tensorflow::errors::Unimplemented("output '", key, "' is ", tensorflow::DataTypeString(t.dtype()),
                                               ", which this program does not print");
  }
  std::printf("]}");
  return Status();
}

int Fail(const Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return 1;
}

// Which pkm ops are in the registry before any model loads: linked in, not loaded.
std::vector<std::string> LinkedPkmOps() {
  std::vector<std::string> linked_ops;
  for (const char* op : kPkmOps) {
    const tensorflow::OpRegistrationData* data = nullptr;
    if (tensorflow::OpRegistry::Global()->LookUp(op, &data).ok()) linked_ops.push_back(op);
  }
  return linked_ops;
}

// The options tensorflow_model_server gives SavedModelBundleFactory: its
// session_config (parallelism flags, default 0 = TF picks) with the
// servable's name and version as session metadata.
tensorflow::SessionOptions ServerSessionOptions(const Options& o) {
  tensorflow::SessionOptions session_options;
  session_options.config.set_intra_op_parallelism_threads(o.intra_op_parallelism);
  session_options.config.set_inter_op_parallelism_threads(o.inter_op_parallelism);
  auto* metadata = session_options.config.mutable_experimental()->mutable_session_metadata();
  metadata->set_name(o.model_name);
  metadata->set_version(o.model_version);
  return session_options;
}

// The --input tensors by name (text specs, or @file for a TensorProto).
std::map<std::string, Tensor> GivenInputs(const Options& o) {
  std::map<std::string, Tensor> given;
  for (const auto& [name, spec] : o.inputs) {
    if (given.count(name)) throw UsageError("--input " + name + " given twice");
    given[name] = spec.rfind("@", 0) == 0 ? TensorFromProtoFile(name, spec.substr(1)) : TensorFromText(name, spec);
  }
  return given;
}

void PrintLatencies(std::vector<double> sorted) {
  if (sorted.empty()) return;
  std::sort(sorted.begin(), sorted.end());
  double sum = 0;
  for (double v : sorted) sum += v;
  std::printf(",\"latency_us\":{\"runs\":%zu,\"median\":%.2f,\"p90\":%.2f,\"min\":%.2f,\"mean\":%.2f}",
              sorted.size(), sorted[sorted.size() / 2], sorted[(sorted.size() * 9) / 10], sorted.front(),
              sum / sorted.size());
}

int Run(const Options& o) {
  const std::vector<std::string> linked_ops = LinkedPkmOps();
  const tensorflow::SessionOptions session_options = ServerSessionOptions(o);
  tensorflow::RunOptions run_options;  // default RunOptions, as the server's
  std::unordered_set<std::string> tags;  // --saved_model_tags (default "serve")
  for (const std::string& tag : Split(o.tags, ','))
    if (!tag.empty()) tags.insert(tag);
  const std::map<std::string, Tensor> given = GivenInputs(o);

  const auto t_load = std::chrono::steady_clock::now();
  tensorflow::SavedModelBundle bundle;
  Status status = tensorflow::LoadSavedModel(session_options, run_options, o.model_dir, tags, &bundle);
  if (!status.ok()) return Fail(status);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();

  const auto& sigs = bundle.meta_graph_def.signature_def();
  auto sig_it = sigs.find(o.signature);
  if (sig_it == sigs.end()) {
    std::string names;
    for (const auto& [name, sig] : sigs) names += (names.empty() ? "" : ", ") + name;
    return Fail(tensorflow::errors::NotFound("no signature '", o.signature, "' in ", o.model_dir,
                                             " (it has: ", names, ")"));
  }
  const tensorflow::SignatureDef& sig = sig_it->second;
  std::vector<std::pair<std::string, Tensor>> feeds;
  status = BindInputs(sig, o.signature, given, &feeds);
  if (!status.ok()) return Fail(status);
  std::vector<std::string> output_keys, fetches;
  for (const auto& [key, info] : sig.outputs()) output_keys.push_back(key);
  std::sort(output_keys.begin(), output_keys.end());
  for (const std::string& key : output_keys) fetches.push_back(sig.outputs().at(key).name());

  std::vector<Tensor> outputs;
  auto run_once = [&]() {
    outputs.clear();
    tensorflow::RunMetadata run_metadata;
    return bundle.session->Run(run_options, feeds, fetches, {}, &outputs, &run_metadata);
  };
  status = run_once();
  if (!status.ok()) return Fail(status);

  std::vector<double> latencies_us;
  if (o.repeat > 0) {
    for (int i = 0; i < o.warmup; ++i)
      if (!(status = run_once()).ok()) return Fail(status);
    for (int i = 0; i < o.repeat; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!(status = run_once()).ok()) return Fail(status);
      latencies_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
  }

  std::printf("{\"signature\":\"%s\",\"session_metadata\":{\"name\":\"%s\",\"version\":%lld},"
              "\"load_seconds\":%.3f,\"linked_ops\":[",
              o.signature.c_str(), o.model_name.c_str(), static_cast<long long>(o.model_version), load_s);
  for (size_t i = 0; i < linked_ops.size(); ++i) std::printf(i ? ",\"%s\"" : "\"%s\"", linked_ops[i].c_str());
  std::printf("],\"outputs\":{");
  for (size_t i = 0; i < output_keys.size(); ++i) {
    if (i) std::printf(",");
    status = PrintTensor(output_keys[i], outputs[i]);
    if (!status.ok()) {
      std::printf("}}\n");
      return Fail(status);
    }
  }
  std::printf("}");
  PrintLatencies(latencies_us);
  std::printf("}\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(ParseFlags(argc, argv));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "error: %s\n(usage: see the header of serving/cc_check/saved_model_run.cc)\n",
                 e.message().c_str());
    return 2;
  }
}
