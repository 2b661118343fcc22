// External TFLite delegate: claims PkmEmbeddingBag and PkmRaggedEmbeddingBag
// custom nodes (which stock interpreters keep as unresolved placeholders) and, with
// fuse_composites=true, stock GATHER -> [MUL] -> SUM chains, and runs them on
// the kernel core. Loaded with tflite.load_delegate(path, options).
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

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

// A stock composite chain found in the graph.
struct Chain {
  int gather = -1, mul = -1, sum = -1;  // node indices (mul = -1: unweighted)
  std::vector<int> weight_reshapes;     // RESHAPE/EXPAND_DIMS/... on the weights path
  BagSpec spec;
  std::vector<int> nodes() const {
    std::vector<int> n = weight_reshapes;
    n.push_back(gather);
    if (mul >= 0) n.push_back(mul);
    n.push_back(sum);
    return n;
  }
  std::vector<int> intermediates;  // tensors only the chain uses
};

struct Graph {
  TfLiteContext* context;
  std::vector<int> plan;
  std::map<int, std::vector<int>> consumers;  // tensor -> nodes reading it
  std::map<int, int> producer;                // tensor -> node writing it

  explicit Graph(TfLiteContext* ctx) : context(ctx) {}
  // The whole execution plan, or only `nodes` (a delegate partition: inside
  // a kernel's Init the plan already shows the partition as one node).
  TfLiteStatus Load(const TfLiteIntArray* nodes = nullptr) {
    if (nodes != nullptr) {
      plan.assign(nodes->data, nodes->data + nodes->size);
    } else {
      TfLiteIntArray* p = nullptr;
      if (context->GetExecutionPlan(context, &p) != kTfLiteOk || p == nullptr) return kTfLiteError;
      plan.assign(p->data, p->data + p->size);
    }
    for (int n : plan) {
      TfLiteNode* node;
      TfLiteRegistration* reg;
      if (context->GetNodeAndRegistration(context, n, &node, &reg) != kTfLiteOk) return kTfLiteError;
      for (int i = 0; node->inputs && i < node->inputs->size; ++i)
        if (node->inputs->data[i] >= 0) consumers[node->inputs->data[i]].push_back(n);
      for (int i = 0; node->outputs && i < node->outputs->size; ++i)
        producer[node->outputs->data[i]] = n;
    }
    return kTfLiteOk;
  }
  const TfLiteTensor* Tensor(int i) const {
    return (i >= 0 && static_cast<size_t>(i) < context->tensors_size) ? &context->tensors[i] : nullptr;
  }
  int Rank(int i) const {
    const TfLiteTensor* t = Tensor(i);
    return (t && t->dims) ? t->dims->size : -1;
  }
  // The single consumer of tensor t, or -1.
  int SoleConsumer(int t) const {
    auto it = consumers.find(t);
    return (it != consumers.end() && it->second.size() == 1) ? it->second[0] : -1;
  }
};

// Reads the constant reduction axis of a SUM node.
bool ConstAxis(const Graph& g, int tensor, int* axis) {
  const TfLiteTensor* t = g.Tensor(tensor);
  if (t == nullptr || t->type != kTfLiteInt32 || t->allocation_type != kTfLiteMmapRo ||
      t->data.data == nullptr || t->bytes != 4)
    return false;
  *axis = t->data.i32[0];
  return true;
}

// Element count of a tensor; false for no shape or one whose count
// overflows (never matched, so the stock ops keep it and report it).
bool NumElements(const TfLiteTensor* t, int64_t* n) {
  if (t->dims == nullptr || t->dims->size < 0) return false;
  const std::vector<int64_t> dims(t->dims->data, t->dims->data + t->dims->size);
  return CheckedNumElements(dims, n);
}

// True if `node` only re-shapes its first input (same elements, same order):
// RESHAPE, EXPAND_DIMS, SQUEEZE, or a STRIDED_SLICE with unit strides that
// keeps every element. The converter emits these for w[..., None].
bool IsReshapeLike(const Graph& g, int node_index, int* source) {
  TfLiteContext* ctx = g.context;
  TfLiteNode* node;
  TfLiteRegistration* reg;
  if (ctx->GetNodeAndRegistration(ctx, node_index, &node, &reg) != kTfLiteOk) return false;
  if (!node->inputs || node->inputs->size < 1 || !node->outputs || node->outputs->size != 1)
    return false;
  const TfLiteTensor* in = g.Tensor(node->inputs->data[0]);
  const TfLiteTensor* out = g.Tensor(node->outputs->data[0]);
  int64_t in_elems, out_elems;
  if (!in || !out || in->type != kTfLiteFloat32 || out->type != kTfLiteFloat32 ||
      !NumElements(in, &in_elems) || !NumElements(out, &out_elems) || in_elems != out_elems)
    return false;
  const int code = reg->builtin_code;
  if (code == kTfLiteBuiltinStridedSlice) {
    if (node->inputs->size != 4) return false;
    const TfLiteTensor* strides = g.Tensor(node->inputs->data[3]);
    if (!strides || strides->type != kTfLiteInt32 || strides->allocation_type != kTfLiteMmapRo ||
        !strides->data.data)
      return false;
    for (size_t i = 0; i < strides->bytes / 4; ++i)
      if (strides->data.i32[i] != 1) return false;
  } else if (code != kTfLiteBuiltinReshape && code != kTfLiteBuiltinExpandDims &&
             code != kTfLiteBuiltinSqueeze) {
    return false;
  }
  *source = node->inputs->data[0];
  return true;
}

// The GATHER a chain starts with: rows of a rank-2 float32 table on axis 0.
struct ChainGather {
  int params = -1, indices = -1, gathered = -1;
  int bag_axis = 0;       // axis of K in the gathered [..., K, D]
  int gathered_rank = 0;
};

bool MatchGather(const Graph& g, int gather_node, ChainGather* out) {
  TfLiteContext* ctx = g.context;
  TfLiteNode* gn;
  TfLiteRegistration* greg;
  if (ctx->GetNodeAndRegistration(ctx, gather_node, &gn, &greg) != kTfLiteOk) return false;
  if (greg->builtin_code != kTfLiteBuiltinGather || !gn->inputs || gn->inputs->size != 2 ||
      !gn->outputs || gn->outputs->size != 1 || gn->builtin_data == nullptr)
    return false;
  const auto* gp = static_cast<const TfLiteGatherParams*>(gn->builtin_data);
  if (gp->axis != 0 || gp->batch_dims != 0) return false;
  out->params = gn->inputs->data[0];
  out->indices = gn->inputs->data[1];
  out->gathered = gn->outputs->data[0];
  const TfLiteTensor* pt = g.Tensor(out->params);
  const TfLiteTensor* it = g.Tensor(out->indices);
  if (!pt || !it || pt->type != kTfLiteFloat32 || g.Rank(out->params) != 2 ||
      (it->type != kTfLiteInt32 && it->type != kTfLiteInt64) || g.Rank(out->indices) < 1)
    return false;
  out->bag_axis = g.Rank(out->indices) - 1;
  out->gathered_rank = g.Rank(out->indices) + 1;
  return true;
}

// MUL node `mul` of the gathered rows by per-index weights [..., K, 1]:
// records it (and the reshape-likes the weights come through) in the chain;
// *weights is the tensor the kernel reads, *product the MUL's output.
bool MatchWeightMul(const Graph& g, const ChainGather& gather, int mul, Chain* chain,
                    int* weights, int* product) {
  TfLiteNode* nn;
  TfLiteRegistration* nreg;
  if (g.context->GetNodeAndRegistration(g.context, mul, &nn, &nreg) != kTfLiteOk) return false;
  if (!nn->inputs || nn->inputs->size != 2 || !nn->outputs || nn->outputs->size != 1 ||
      nn->builtin_data == nullptr ||
      static_cast<const TfLiteMulParams*>(nn->builtin_data)->activation != kTfLiteActNone)
    return false;
  const int gathered = gather.gathered;
  int w = nn->inputs->data[0] == gathered ? nn->inputs->data[1] : nn->inputs->data[0];
  if (w == gathered) return false;  // x * x is not a bag
  const TfLiteTensor* wt = g.Tensor(w);
  const TfLiteTensor* it = g.Tensor(gather.indices);
  const int rank = gather.gathered_rank;
  if (!wt || wt->type != kTfLiteFloat32 || g.Rank(w) != rank || wt->dims->data[rank - 1] != 1)
    return false;
  for (int d = 0; d < rank - 1; ++d)
    if (wt->dims->data[d] != it->dims->data[d]) return false;
  chain->mul = mul;
  // Walk back over reshape-likes of the weights so the partition holds the
  // whole chain (else the partitioner splits GATHER from MUL).
  for (int depth = 0; depth < 4; ++depth) {
    auto p = g.producer.find(w);
    int source;
    if (p == g.producer.end() || g.SoleConsumer(w) < 0 || !IsReshapeLike(g, p->second, &source))
      break;
    chain->weight_reshapes.insert(chain->weight_reshapes.begin(), p->second);
    chain->intermediates.push_back(w);
    w = source;
  }
  *weights = w;
  *product = nn->outputs->data[0];
  chain->intermediates.push_back(*product);
  return true;
}

// SUM node `sum` of `reduced` over the bag axis; returns its keep_dims.
bool MatchBagSum(const Graph& g, const ChainGather& gather, int sum, int reduced,
                 bool* keep_dims, int* output) {
  TfLiteNode* nn;
  TfLiteRegistration* nreg;
  if (g.context->GetNodeAndRegistration(g.context, sum, &nn, &nreg) != kTfLiteOk) return false;
  if (nreg->builtin_code != kTfLiteBuiltinSum || !nn->inputs || nn->inputs->size != 2 ||
      nn->inputs->data[0] != reduced || !nn->outputs || nn->outputs->size != 1 ||
      nn->builtin_data == nullptr)
    return false;
  int axis;
  if (!ConstAxis(g, nn->inputs->data[1], &axis)) return false;
  if (axis < 0) axis += gather.gathered_rank;
  if (axis != gather.bag_axis) return false;
  *keep_dims = static_cast<const TfLiteReducerParams*>(nn->builtin_data)->keep_dims;
  *output = nn->outputs->data[0];
  return true;
}

// Matches GATHER(params[N,D] float32, indices) -> [MUL(x, w[...,K,1])] ->
// SUM(axis = bag axis), the sequence the converter emits for
// reduce_sum(gather(table, idx) * w[..., None], axis=-2).
bool MatchChain(const Graph& g, int gather_node, Chain* chain) {
  ChainGather gather;
  if (!MatchGather(g, gather_node, &gather)) return false;
  *chain = Chain();
  chain->gather = gather_node;
  chain->intermediates.push_back(gather.gathered);
  int next = g.SoleConsumer(gather.gathered);
  TfLiteNode* nn;
  TfLiteRegistration* nreg;
  if (next < 0 || g.context->GetNodeAndRegistration(g.context, next, &nn, &nreg) != kTfLiteOk)
    return false;
  int reduced = gather.gathered, weights = -1;
  if (nreg->builtin_code == kTfLiteBuiltinMul) {
    if (!MatchWeightMul(g, gather, next, chain, &weights, &reduced)) return false;
    next = g.SoleConsumer(reduced);
    if (next < 0) return false;
  }
  bool keep_dims;
  int output;
  if (!MatchBagSum(g, gather, next, reduced, &keep_dims, &output)) return false;
  chain->sum = next;
  BagSpec& s = chain->spec;
  s.table = gather.params;
  s.indices = gather.indices;
  s.weights = weights;
  s.output = output;
  s.combiner = Combiner::kSum;
  s.composite = true;
  s.keep_dims = keep_dims;
  s.what = "PkmEmbeddingBag (fused GATHER/MUL/SUM)";
  return true;
}

TfLiteIntArray* NewIntArray(const std::vector<int>& v) {
  auto* a = static_cast<TfLiteIntArray*>(std::malloc(sizeof(TfLiteIntArray) + sizeof(int) * (v.size() + 1)));
  a->size = static_cast<int>(v.size());
  for (size_t i = 0; i < v.size(); ++i) a->data[i] = v[i];
  return a;
}

// ---- the delegate kernel: one per partition of claimed nodes --------------

struct Unit {
  BagSpec spec;
  BagState state;
};

struct KernelData {
  DelegateData* delegate = nullptr;
  std::vector<Unit> units;
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
    if (IsCustomBag(reg, &ragged)) {
      OpOptions options;
      std::string err;
      if (!ParseOpOptions(node->custom_initial_data,
                          node->custom_initial_data_size < 0 ? 0 : node->custom_initial_data_size,
                          &options, &err)) {
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
  for (Unit& u : kd->units)
    if (PrepareBag(context, u.spec, &u.state) != kTfLiteOk) return kTfLiteError;
  return kTfLiteOk;
}

TfLiteStatus KernelInvoke(TfLiteContext* context, TfLiteNode* node) {
  auto* kd = static_cast<KernelData*>(node->user_data);
  if (kd == nullptr || !kd->error.empty()) return kTfLiteError;
  const ParallelFor pf = kd->delegate->pool->AsParallelFor();
  for (const Unit& u : kd->units)
    if (InvokeBag(context, u.spec, u.state, pf) != kTfLiteOk) return kTfLiteError;
  return kTfLiteOk;
}

TfLiteRegistration KernelRegistration() {
  TfLiteRegistration r;
  std::memset(&r, 0, sizeof(r));  // newer runtimes read fields we do not set
  r.init = KernelInit;
  r.free = KernelFree;
  r.prepare = KernelPrepare;
  r.invoke = KernelInvoke;
  r.builtin_code = kBuiltinDelegate;
  r.custom_name = kDelegateKernelName;
  r.version = 1;
  return r;
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
    if (IsCustomBag(reg)) {
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

bool ParseBool(const std::string& v, bool* out) {
  if (v == "true" || v == "True" || v == "1") return *out = true, true;
  if (v == "false" || v == "False" || v == "0") return *out = false, true;
  return false;
}

}  // namespace
}  // namespace tflite
}  // namespace pkm

using pkm::tflite::DelegateData;

// Creates the delegate. Options (all strings): num_threads (>= 1, default 1),
// fuse_composites (true/false, default false). Unknown keys or bad values are
// reported through report_error and give nullptr.
PKM_EXPORT TfLiteDelegate* tflite_plugin_create_delegate(char** options_keys,
                                                         char** options_values,
                                                         size_t num_options,
                                                         void (*report_error)(const char*)) {
  auto data = std::make_unique<DelegateData>();
  for (size_t i = 0; i < num_options; ++i) {
    const std::string key = options_keys[i] ? options_keys[i] : "";
    const std::string value = options_values[i] ? options_values[i] : "";
    std::string error;
    if (key == "num_threads") {
      char* end = nullptr;
      const long n = std::strtol(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || n < 1 || n > 256)
        error = "num_threads must be an integer in [1, 256], got '" + value + "'";
      else
        data->options.num_threads = static_cast<int>(n);
    } else if (key == "fuse_composites") {
      if (!pkm::tflite::ParseBool(value, &data->options.fuse_composites))
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
