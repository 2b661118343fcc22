// External TFLite delegate: claims PkmEmbeddingBag, PkmRaggedEmbeddingBag and
// PkmCheckThen custom nodes (which stock interpreters keep as unresolved placeholders) and, with
// fuse_composites=true, stock GATHER -> [MUL] -> SUM chains, and runs them on
// the kernel core. Loaded with tflite.load_delegate(path, options).
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "tflite_delegate/check_then_tflite.h"
#include "tflite_delegate/composite_chain.h"
#include "tflite_delegate/embedding_bag_tflite.h"
#include "tflite_delegate/thread_pool.h"

#define PKM_EXPORT extern "C" __attribute__((visibility("default")))

namespace pkm {
namespace tflite {
namespace {

constexpr int kBuiltinDelegate = 51;
constexpr const char kDelegateKernelName[] = "PkmDelegate";

struct DelegateOptions {
  int num_threads = 1;
  bool fuse_composites = false;
};

struct DelegateData {
  DelegateOptions options;
  std::unique_ptr<ThreadPool> pool;
};

DelegateData* GetData(TfLiteDelegate* delegate) {
  return static_cast<DelegateData*>(delegate->data_);
}

// A PkmEmbeddingBag or PkmRaggedEmbeddingBag custom node; *ragged says which.
bool IsCustomBag(const TfLiteRegistration* reg, bool* ragged = nullptr) {
  bool is_ragged = false;
  const bool yes = reg->builtin_code == kTfLiteBuiltinCustom &&
                   IsBagCustomOpName(reg->custom_name, &is_ragged);
  if (ragged != nullptr) *ragged = is_ragged;
  return yes;
}

// A PkmCheckThen custom node (a run-time check the delegate runs beside the bags).
bool IsCheckThen(const TfLiteRegistration* reg) {
  return reg->builtin_code == kTfLiteBuiltinCustom && IsCheckThenCustomOpName(reg->custom_name);
}

// ---- the delegate kernel: one per partition of claimed nodes --------------

// A bag, or (is_check) a PkmCheckThen; units run in plan order, a check before the bag reading it.
struct Unit {
  BagSpec spec;
  BagState state;
  bool is_check = false;
  CheckSpec check;
  int output() const { return is_check ? check.output : spec.output; }
};

struct KernelData {
  DelegateData* delegate = nullptr;
  std::vector<Unit> units;
  // Outputs of units that only later units of the partition read (a bag's output as another's
  // weights or table): no node of the plan names them, so they are the partition node's
  // temporaries, which the arena gives memory for its invoke.
  std::vector<int> internal_outputs;
  std::string error;  // from Init, reported by Prepare
};

void* KernelInit(TfLiteContext* context, const char* buffer, size_t length) {
  auto* kd = new KernelData;
  const auto* params = reinterpret_cast<const TfLiteDelegateParams*>(buffer);
  kd->delegate = GetData(params->delegate);
  Graph g(context);
  if (g.Load(params->nodes_to_replace) != kTfLiteOk) {
    kd->error = "cannot read the partition";
    return kd;
  }
  std::set<int> partition_outputs(params->output_tensors->data,
                                  params->output_tensors->data + params->output_tensors->size);
  std::set<int> used;
  for (int n : g.plan) {
    TfLiteNode* node;
    TfLiteRegistration* reg;
    if (context->GetNodeAndRegistration(context, n, &node, &reg) != kTfLiteOk) {
      kd->error = "cannot read node " + std::to_string(n);
      return kd;
    }
    Unit unit;
    bool ragged = false;
    const size_t options_size = node->custom_initial_data_size < 0 ? 0 : node->custom_initial_data_size;
    if (IsCheckThen(reg)) {
      std::string err;
      if (!CheckSpecFromCustomNode(node, node->custom_initial_data, options_size, &unit.check, &err)) {
        kd->error = "node " + std::to_string(n) + ": " + std::string(kCheckThenCustomOpName) + ": " + err;
        return kd;
      }
      unit.is_check = true;
      used.insert(n);
    } else if (IsCustomBag(reg, &ragged)) {
      OpOptions options;
      std::string err;
      if (!ParseOpOptions(node->custom_initial_data, options_size, &options, &err)) {
        kd->error = "node " + std::to_string(n) + ": " + err;
        return kd;
      }
      if (SpecFromCustomNode(context, node, options, ragged, &unit.spec) != kTfLiteOk) {
        kd->error = "node " + std::to_string(n) + " is malformed (see above)";
        return kd;
      }
      used.insert(n);
    } else if (reg->builtin_code == kTfLiteBuiltinGather) {
      // Consumers are counted within the partition; anything read outside
      // it is listed in output_tensors.
      Chain chain;
      bool whole = MatchChain(g, n, &chain);
      for (int m : chain.nodes()) whole = whole && !used.count(m);
      for (int t : chain.intermediates) whole = whole && !partition_outputs.count(t);
      if (!whole) {
        kd->error = "GATHER node " + std::to_string(n) + " does not start a fusable chain";
        return kd;
      }
      for (int m : chain.nodes()) used.insert(m);
      unit.spec = chain.spec;
    } else {
      continue;  // a weights reshape: checked below to belong to a chain
    }
    if (!partition_outputs.count(unit.output())) kd->internal_outputs.push_back(unit.output());
    kd->units.push_back(std::move(unit));
  }
  for (int n : g.plan) {
    if (!used.count(n)) {
      kd->error = "node " + std::to_string(n) + " was claimed but belongs to no fused unit";
      return kd;
    }
  }
  return kd;
}

void KernelFree(TfLiteContext* context, void* buffer) { delete static_cast<KernelData*>(buffer); }

TfLiteStatus KernelPrepare(TfLiteContext* context, TfLiteNode* node) {
  auto* kd = static_cast<KernelData*>(node->user_data);
  if (kd == nullptr) return kTfLiteError;
  if (!kd->error.empty()) {
    context->ReportError(context, "PkmDelegate: %s", kd->error.c_str());
    return kTfLiteError;
  }
  // Units prepare in plan order, so a unit reading another's output sees its shape. The arena
  // skips one PrepareBag made dynamic (its ResizeTensor allocates it). The runtime frees the array.
  std::free(node->temporaries);
  node->temporaries = NewIntArray(kd->internal_outputs);
  for (Unit& u : kd->units)
    if ((u.is_check ? PrepareCheck(context, u.check) : PrepareBag(context, u.spec, &u.state)) != kTfLiteOk)
      return kTfLiteError;
  return kTfLiteOk;
}

TfLiteStatus KernelInvoke(TfLiteContext* context, TfLiteNode* node) {
  auto* kd = static_cast<KernelData*>(node->user_data);
  if (kd == nullptr || !kd->error.empty()) return kTfLiteError;
  const ParallelFor pf = kd->delegate->pool->AsParallelFor();
  for (const Unit& u : kd->units)
    if ((u.is_check ? InvokeCheck(context, u.check) : InvokeBag(context, u.spec, u.state, pf)) != kTfLiteOk)
      return kTfLiteError;
  return kTfLiteOk;
}

TfLiteRegistration KernelRegistration() {
  return NewRegistration(KernelInit, KernelFree, KernelPrepare, KernelInvoke, kBuiltinDelegate, kDelegateKernelName);
}

// Keeps the chains whose nodes all land in one partition and whose
// intermediates nobody outside needs (graph outputs included: the partition
// preview lists them as partition outputs).
std::vector<int> SelectNodes(TfLiteContext* context, const std::vector<int>& custom_nodes,
                             std::vector<Chain> chains) {
  for (int round = 0; round < 8; ++round) {
    std::vector<int> nodes = custom_nodes;
    for (const Chain& c : chains)
      for (int n : c.nodes()) nodes.push_back(n);
    if (chains.empty() || context->PreviewDelegatePartitioning == nullptr) return nodes;
    TfLiteIntArray* arr = NewIntArray(nodes);
    TfLiteDelegateParams* parts = nullptr;
    int num_parts = 0;
    const TfLiteStatus st =
        context->PreviewDelegatePartitioning(context, arr, &parts, &num_parts);
    std::free(arr);
    if (st != kTfLiteOk) return custom_nodes;
    std::vector<Chain> kept;
    for (const Chain& c : chains) {
      bool ok = false;
      for (int p = 0; p < num_parts && !ok; ++p) {
        const TfLiteIntArray* in = parts[p].nodes_to_replace;
        const TfLiteIntArray* out = parts[p].output_tensors;
        auto has = [](const TfLiteIntArray* a, int v) {
          for (int i = 0; i < a->size; ++i)
            if (a->data[i] == v) return true;
          return false;
        };
        bool all = true;
        for (int n : c.nodes()) all = all && has(in, n);
        for (int t : c.intermediates) all = all && !has(out, t);
        ok = all;
      }
      if (ok) kept.push_back(c);
    }
    if (kept.size() == chains.size()) return nodes;
    chains.swap(kept);
  }
  return custom_nodes;
}

TfLiteStatus DelegatePrepare(TfLiteContext* context, TfLiteDelegate* delegate) {
  DelegateData* data = GetData(delegate);
  Graph g(context);
  if (g.Load() != kTfLiteOk) {
    context->ReportError(context, "PkmDelegate: cannot read the execution plan");
    return kTfLiteError;
  }
  std::vector<int> custom_nodes;
  std::vector<Chain> chains;
  std::set<int> in_chain;
  for (int n : g.plan) {
    TfLiteNode* node;
    TfLiteRegistration* reg;
    if (context->GetNodeAndRegistration(context, n, &node, &reg) != kTfLiteOk) return kTfLiteError;
    if (IsCustomBag(reg) || IsCheckThen(reg)) {
      custom_nodes.push_back(n);
    } else if (data->options.fuse_composites && reg->builtin_code == kTfLiteBuiltinGather &&
               !in_chain.count(n)) {
      Chain c;
      if (MatchChain(g, n, &c)) {
        for (int m : c.nodes()) in_chain.insert(m);
        chains.push_back(c);
      }
    }
  }
  const std::vector<int> nodes = SelectNodes(context, custom_nodes, chains);
  if (nodes.empty()) return kTfLiteOk;
  TfLiteIntArray* arr = NewIntArray(nodes);
  const TfLiteStatus st = context->ReplaceNodeSubsetsWithDelegateKernels(
      context, KernelRegistration(), arr, delegate);
  std::free(arr);
  return st;
}

// An option's value without the spaces around it: TFLite's own delegate flags read numbers
// with an istringstream, which skips leading whitespace and leaves trailing whitespace unread,
// so " 2" and "2 " both mean 2 there.
std::string Trimmed(const std::string& v) {
  const char* space = " \t\n\v\f\r";
  const size_t first = v.find_first_not_of(space);
  if (first == std::string::npos) return "";
  return v.substr(first, v.find_last_not_of(space) - first + 1);
}

bool ParseBool(const std::string& v, bool* out) {
  if (v == "true" || v == "True" || v == "1") return *out = true, true;
  if (v == "false" || v == "False" || v == "0") return *out = false, true;
  return false;
}

}  // namespace
}  // namespace tflite
}  // namespace pkm

using pkm::tflite::DelegateData;

// Creates the delegate. Options (all strings, spaces around a value ignored): num_threads
// (1..256, default 1), fuse_composites (true/false, default false). Unknown keys or bad
// values are reported through report_error and give nullptr.
PKM_EXPORT TfLiteDelegate* tflite_plugin_create_delegate(char** options_keys,
                                                         char** options_values,
                                                         size_t num_options,
                                                         void (*report_error)(const char*)) {
  auto data = std::make_unique<DelegateData>();
  for (size_t i = 0; i < num_options; ++i) {
    const std::string key = options_keys[i] ? options_keys[i] : "";
    const std::string value = options_values[i] ? options_values[i] : "";
    std::string error;
    const std::string trimmed = pkm::tflite::Trimmed(value);
    if (key == "num_threads") {
      char* end = nullptr;
      // strtol skips only leading spaces, which Trimmed removed: a space left inside ("2 2",
      // "+ 2") stops it there, and "" converts nothing (end == start).
      const long n = std::strtol(trimmed.c_str(), &end, 10);
      if (end == trimmed.c_str() || *end != '\0' || n < 1 || n > 256)
        error = "num_threads must be an integer in [1, 256], got '" + value + "'";
      else
        data->options.num_threads = static_cast<int>(n);
    } else if (key == "fuse_composites") {
      if (!pkm::tflite::ParseBool(trimmed, &data->options.fuse_composites))
        error = "fuse_composites must be true or false, got '" + value + "'";
    } else {
      error = "unknown option '" + key + "' (known: num_threads, fuse_composites)";
    }
    if (!error.empty()) {
      error = "libpkm_tflite: " + error;
      if (report_error) report_error(error.c_str());
      return nullptr;
    }
  }
  data->pool = std::make_unique<pkm::tflite::ThreadPool>(data->options.num_threads);
  auto* delegate = new TfLiteDelegate;
  std::memset(delegate, 0, sizeof(*delegate));  // newer runtimes read fields we do not set
  delegate->data_ = data.release();
  delegate->Prepare = pkm::tflite::DelegatePrepare;
  delegate->flags = kTfLiteDelegateFlagsAllowDynamicTensors;
  return delegate;
}

PKM_EXPORT void tflite_plugin_destroy_delegate(TfLiteDelegate* delegate) {
  if (delegate == nullptr) return;
  delete static_cast<DelegateData*>(delegate->data_);
  delete delegate;
}
