// C ABI over the kernel core for ctypes callers: translates PkmBags into the
// core's Table/Bags and its Status into (return code, message).
#include "kernels/capi/pkm_capi.h"

#include <cstring>
#include <string>

#include "kernels/core/embedding_bag.h"

namespace {

int Fail(const std::string& message, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    const size_t n = message.size() < err_len - 1 ? message.size() : err_len - 1;
    std::memcpy(err, message.data(), n);
    err[n] = '\0';
  }
  return -1;
}

int Finish(const pkm::Status& status, char* err, size_t err_len) {
  return status.ok ? 0 : Fail(status.message, err, err_len);
}

bool ToCore(const PkmBags* in, pkm::Table* table, pkm::Bags* bags, std::string* error) {
  if (in == nullptr) {
    *error = "bags is null";
    return false;
  }
  if (in->elem_type < PKM_FLOAT32 || in->elem_type > PKM_BFLOAT16 ||
      (in->weights != nullptr && (in->weights_type < PKM_FLOAT32 || in->weights_type > PKM_BFLOAT16))) {
    *error = "elem_type and weights_type must be 0 (float32), 1 (float16) or 2 (bfloat16)";
    return false;
  }
  if (in->combiner < PKM_SUM || in->combiner > PKM_SQRTN) {
    *error = "combiner must be 0 (sum), 1 (mean) or 2 (sqrtn), got " + std::to_string(in->combiner);
    return false;
  }
  table->data = in->table;
  table->type = static_cast<pkm::ElemType>(in->elem_type);
  table->num_rows = in->num_rows;
  table->dim = in->dim;
  bags->indices = in->indices;
  bags->indices_int64 = in->indices_int64 != 0;
  bags->num_bags = in->num_bags;
  bags->bag_size = in->bag_size;
  bags->row_splits = in->row_splits;
  bags->row_splits_int64 = in->row_splits_int64 != 0;
  if (in->row_splits != nullptr) bags->num_values = in->num_indices;
  bags->weights = in->weights;
  bags->weights_type = static_cast<pkm::ElemType>(in->weights_type);
  return true;
}

}  // namespace

extern "C" {

int pkm_capi_has_cuda(void) {
#ifdef PKM_CAPI_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

int pkm_cpu_forward(const PkmBags* in, void* out, int reference, char* err, size_t err_len) {
  pkm::Table table;
  pkm::Bags bags;
  std::string error;
  if (!ToCore(in, &table, &bags, &error)) return Fail(error, err, err_len);
  const auto combiner = static_cast<pkm::Combiner>(in->combiner);
  return Finish(reference ? pkm::ReferenceForward(table, bags, combiner, out, table.type)
                          : pkm::Forward(table, bags, combiner, out, table.type, pkm::SerialFor()),
                err, err_len);
}

int pkm_cpu_backward(const PkmBags* in, const void* grad_out, void* d_table, void* d_weights,
                     int reference, char* err, size_t err_len) {
  pkm::Table table;
  pkm::Bags bags;
  std::string error;
  if (!ToCore(in, &table, &bags, &error)) return Fail(error, err, err_len);
  const auto combiner = static_cast<pkm::Combiner>(in->combiner);
  return Finish(reference ? pkm::ReferenceBackward(table, bags, combiner, grad_out, table.type,
                                                   d_table, table.type, d_weights)
                          : pkm::Backward(table, bags, combiner, grad_out, table.type, d_table,
                                          table.type, d_weights, pkm::SerialFor()),
                err, err_len);
}

int pkm_cpu_sparse_backward(const PkmBags* in, const void* grad_out, pkm_cuda_sparse_alloc_fn alloc,
                            void* alloc_ctx, void* d_weights, char* err, size_t err_len) {
  pkm::Table table;
  pkm::Bags bags;
  std::string error;
  if (!ToCore(in, &table, &bags, &error)) return Fail(error, err, err_len);
  if (alloc == nullptr) return Fail("alloc is null", err, err_len);
  auto core_alloc = [&](int64_t num_rows, int64_t** rows, void** row_grads) {
    if (alloc(alloc_ctx, num_rows, rows, row_grads) != 0)
      return pkm::Status::Error("the output allocation callback failed for " + std::to_string(num_rows) + " rows");
    return pkm::Status::Ok();
  };
  return Finish(pkm::SparseBackward(table, bags, static_cast<pkm::Combiner>(in->combiner), grad_out, table.type,
                                    core_alloc, table.type, d_weights, pkm::SerialFor()),
                err, err_len);
}

}  // extern "C"
