// The delegate's view of a subgraph (producers, consumers) and the matcher of
// stock GATHER -> [MUL] -> SUM chains that fuse_composites=true runs on the
// kernel core (as one PkmEmbeddingBag with stock GATHER's index rule).
#ifndef PKM_TFLITE_DELEGATE_COMPOSITE_CHAIN_H_
#define PKM_TFLITE_DELEGATE_COMPOSITE_CHAIN_H_

#include <map>
#include <vector>

#include "tflite_delegate/embedding_bag_tflite.h"
#include "tflite_delegate/tflite_abi.h"

namespace pkm {
namespace tflite {

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

// Matches GATHER(params[N,D] float32, indices) -> [MUL(x, w[...,K,1])] ->
// SUM(axis = bag axis) starting at `gather_node`; fills *chain on a match.
bool MatchChain(const Graph& g, int gather_node, Chain* chain);

}  // namespace tflite
}  // namespace pkm

#endif  // PKM_TFLITE_DELEGATE_COMPOSITE_CHAIN_H_
