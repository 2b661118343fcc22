// C ABI over the kernel core for ctypes callers: hands PkmBags to the core's
// FromBagProblem and its Status back as (return code, message).
#include "kernels/capi/pkm_capi.h"

#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/fused_optimizer.h"

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

// The descriptor -> the core's Table/Bags/Combiner (the core's one
// translation; it checks the enum values).
bool ToCore(const PkmBags* in, pkm::Table* table, pkm::Bags* bags, pkm::Combiner* combiner,
            std::string* error) {
  if (in == nullptr) {
    *error = "bags is null";
    return false;
  }
  const pkm::Status s = pkm::FromBagProblem(*in, table, bags, combiner);
  if (!s.ok) *error = s.message;
  return s.ok;
}

// Splits [0, total) into num_threads contiguous ranges on std::threads.
pkm::ParallelFor ThreadsFor(int num_threads) {
  if (num_threads <= 1) return pkm::SerialFor();
  return [num_threads](int64_t total, int64_t, const pkm::RangeFn& fn) {
    std::vector<std::thread> threads;
    const int64_t chunk = (total + num_threads - 1) / num_threads;
    for (int64_t begin = 0; begin < total; begin += chunk)
      threads.emplace_back([&fn, begin, chunk, total] { fn(begin, begin + chunk < total ? begin + chunk : total); });
    for (auto& t : threads) t.join();
  };
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
  pkm::Combiner combiner;
  std::string error;
  if (!ToCore(in, &table, &bags, &combiner, &error)) return Fail(error, err, err_len);
  // Outputs share the table's type; an int8 table's are float32.
  const pkm::ElemType out_type = table.type == pkm::ElemType::kInt8 ? pkm::ElemType::kFloat32 : table.type;
  return Finish(reference ? pkm::ReferenceForward(table, bags, combiner, out, out_type)
                          : pkm::Forward(table, bags, combiner, out, out_type, pkm::SerialFor()),
                err, err_len);
}

int pkm_cpu_backward(const PkmBags* in, const void* grad_out, void* d_table, void* d_weights,
                     int reference, char* err, size_t err_len) {
  pkm::Table table;
  pkm::Bags bags;
  pkm::Combiner combiner;
  std::string error;
  if (!ToCore(in, &table, &bags, &combiner, &error)) return Fail(error, err, err_len);
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
  pkm::Combiner combiner;
  std::string error;
  if (!ToCore(in, &table, &bags, &combiner, &error)) return Fail(error, err, err_len);
  if (alloc == nullptr) return Fail("alloc is null", err, err_len);
  auto core_alloc = [&](int64_t num_rows, int64_t** rows, void** row_grads) {
    if (alloc(alloc_ctx, num_rows, rows, row_grads) != 0)
      return pkm::Status::Error("the output allocation callback failed for " + std::to_string(num_rows) + " rows");
    return pkm::Status::Ok();
  };
  return Finish(pkm::SparseBackward(table, bags, combiner, grad_out, table.type,
                                    core_alloc, table.type, d_weights, pkm::SerialFor()),
                err, err_len);
}

int pkm_cpu_fused_update(const PkmBags* in, const void* grad_out, const PkmRowOptimizer* opt, void* d_weights,
                         int num_threads, char* err, size_t err_len) {
  pkm::Table table;
  pkm::Bags bags;
  pkm::Combiner combiner;
  std::string error;
  if (!ToCore(in, &table, &bags, &combiner, &error)) return Fail(error, err, err_len);
  if (opt == nullptr) return Fail("opt is null", err, err_len);
  return Finish(pkm::FusedBackwardUpdate(table, bags, combiner, grad_out, table.type, *opt, d_weights,
                                         ThreadsFor(num_threads)),
                err, err_len);
}

size_t pkm_bags_layout(size_t* size, size_t* offsets, size_t num_offsets) {
  const size_t fields[] = {
      offsetof(PkmBags, table),        offsetof(PkmBags, elem_type),
      offsetof(PkmBags, num_rows),     offsetof(PkmBags, dim),
      offsetof(PkmBags, indices),      offsetof(PkmBags, indices_int64),
      offsetof(PkmBags, num_bags),     offsetof(PkmBags, bag_size),
      offsetof(PkmBags, row_splits),   offsetof(PkmBags, row_splits_int64),
      offsetof(PkmBags, num_indices),  offsetof(PkmBags, weights),
      offsetof(PkmBags, weights_type), offsetof(PkmBags, combiner),
      offsetof(PkmBags, invalid_index_count), offsetof(PkmBags, index_policy),
      offsetof(PkmBags, row_scales),   offsetof(PkmBags, row_biases),
      offsetof(PkmBags, row_params_type),
  };
  const size_t count = sizeof(fields) / sizeof(fields[0]);
  if (size != nullptr) *size = sizeof(PkmBags);
  for (size_t i = 0; offsets != nullptr && i < num_offsets && i < count; ++i) offsets[i] = fields[i];
  return count;
}

}  // extern "C"
