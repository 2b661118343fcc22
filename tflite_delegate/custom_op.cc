// The plain custom-op registration of PkmEmbeddingBag / PkmRaggedEmbeddingBag
// (resolver.AddCustom): per-node options, thread pool and state around the
// shared kernel (embedding_bag_tflite.h).
#include <cstring>
#include <memory>
#include <string>

#include "tflite_delegate/embedding_bag_tflite.h"
#include "tflite_delegate/thread_pool.h"

namespace {

using pkm::tflite::BagSpec;
using pkm::tflite::BagState;
using pkm::tflite::OpOptions;

// Per-node data of the plain custom-op registration.
struct CustomOpData {
  bool ragged = false;
  OpOptions options;
  std::string options_error;
  BagSpec spec;
  BagState state;
  std::shared_ptr<pkm::tflite::ThreadPool> pool;  // shared by all nodes with this thread count
};

void* CustomInit(TfLiteContext* context, const char* buffer, size_t length, bool ragged) {
  auto* data = new CustomOpData;
  data->ragged = ragged;
  if (!pkm::tflite::ParseOpOptions(buffer, length, &data->options, &data->options_error) &&
      data->options_error.empty())
    data->options_error = "invalid custom_options";
  return data;
}
void* CustomInitDense(TfLiteContext* context, const char* buffer, size_t length) {
  return CustomInit(context, buffer, length, false);
}
void* CustomInitRagged(TfLiteContext* context, const char* buffer, size_t length) {
  return CustomInit(context, buffer, length, true);
}

void CustomFree(TfLiteContext* context, void* buffer) { delete static_cast<CustomOpData*>(buffer); }

TfLiteStatus CustomPrepare(TfLiteContext* context, TfLiteNode* node) {
  auto* data = static_cast<CustomOpData*>(node->user_data);
  if (data == nullptr) return kTfLiteError;
  if (!data->options_error.empty()) {
    context->ReportError(context, "%s: %s",
                         data->ragged ? pkm::tflite::kRaggedCustomOpName : pkm::tflite::kCustomOpName,
                         data->options_error.c_str());
    return kTfLiteError;
  }
  if (pkm::tflite::SpecFromCustomNode(context, node, data->options, data->ragged, &data->spec) !=
      kTfLiteOk)
    return kTfLiteError;
  const int threads = context->recommended_num_threads > 0 ? context->recommended_num_threads : 1;
  if (!data->pool || data->pool->num_threads() != threads)
    data->pool = pkm::tflite::SharedThreadPool(threads);
  return pkm::tflite::PrepareBag(context, data->spec, &data->state);
}

TfLiteStatus CustomInvoke(TfLiteContext* context, TfLiteNode* node) {
  auto* data = static_cast<CustomOpData*>(node->user_data);
  if (data == nullptr || !data->pool) return kTfLiteError;
  return pkm::tflite::InvokeBag(context, data->spec, data->state, data->pool->AsParallelFor());
}

}  // namespace

namespace {
TfLiteRegistration MakeRegistration(bool ragged) {
  return pkm::tflite::NewRegistration(ragged ? CustomInitRagged : CustomInitDense, CustomFree, CustomPrepare,
                                      CustomInvoke, kTfLiteBuiltinCustom,
                                      ragged ? pkm::tflite::kRaggedCustomOpName : pkm::tflite::kCustomOpName);
}
}  // namespace

extern "C" TfLiteRegistration* PkmEmbeddingBagRegistration() {
  static TfLiteRegistration registration = MakeRegistration(false);
  return &registration;
}

extern "C" TfLiteRegistration* PkmRaggedEmbeddingBagRegistration() {
  static TfLiteRegistration registration = MakeRegistration(true);
  return &registration;
}
