// C ABI over the kernel core for ctypes callers: hands PkmBags to the core's
// FromBagProblem and its Status back as (return code, message).
#include "kernels/capi/pkm_capi.h"

#include <cstddef>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/fused_optimizer.h"
#include "kernels/core/shape_rules.h"

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
// translation; it checks the enum values), then run(table, bags, combiner)'s
// Status as (return code, message).
template <class Run>
int OnCore(const PkmBags* in, char* err, size_t err_len, Run run) {
  if (in == nullptr) return Fail("bags is null", err, err_len);
  pkm::Table table;
  pkm::Bags bags;
  pkm::Combiner combiner;
  const pkm::Status s = pkm::FromBagProblem(*in, &table, &bags, &combiner);
  if (!s.ok) return Fail(s.message, err, err_len);
  return Finish(run(table, bags, combiner), err, err_len);
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
  return OnCore(in, err, err_len, [&](const pkm::Table& table, const pkm::Bags& bags, pkm::Combiner combiner) {
    // An output of no elements may be null (an empty torch tensor's data_ptr): nothing is written to it.
    if (out == nullptr && bags.num_bags > 0 && table.dim > 0)
      return pkm::Status::Error("forward: out is null");  // the CUDA entry points' messages
    // Outputs share the table's type; an int8 table's are float32.
    const pkm::ElemType out_type = table.type == pkm::ElemType::kInt8 ? pkm::ElemType::kFloat32 : table.type;
    return reference ? pkm::ReferenceForward(table, bags, combiner, out, out_type)
                     : pkm::Forward(table, bags, combiner, out, out_type, pkm::SerialFor());
  });
}

int pkm_cpu_backward(const PkmBags* in, const void* grad_out, void* d_table, void* d_weights,
                     int reference, char* err, size_t err_len) {
  return OnCore(in, err, err_len, [&](const pkm::Table& table, const pkm::Bags& bags, pkm::Combiner combiner) {
    if (grad_out == nullptr && bags.num_bags > 0 && table.dim > 0)
      return pkm::Status::Error("backward: grad_out is null");
    return reference ? pkm::ReferenceBackward(table, bags, combiner, grad_out, table.type, d_table, table.type,
                                              d_weights)
                     : pkm::Backward(table, bags, combiner, grad_out, table.type, d_table, table.type, d_weights,
                                     pkm::SerialFor());
  });
}

int pkm_cpu_sparse_backward(const PkmBags* in, const void* grad_out, pkm_cuda_sparse_alloc_fn alloc,
                            void* alloc_ctx, void* d_weights, char* err, size_t err_len) {
  return OnCore(in, err, err_len, [&](const pkm::Table& table, const pkm::Bags& bags, pkm::Combiner combiner) {
    if (alloc == nullptr) return pkm::Status::Error("alloc is null");
    if (grad_out == nullptr && table.dim > 0) return pkm::Status::Error("sparse backward: grad_out is null");
    auto core_alloc = [&](int64_t num_rows, int64_t** rows, void** row_grads) {
      if (alloc(alloc_ctx, num_rows, rows, row_grads) != 0)
        return pkm::Status::Error("the output allocation callback failed for " + std::to_string(num_rows) +
                                  " rows");
      return pkm::Status::Ok();
    };
    return pkm::SparseBackward(table, bags, combiner, grad_out, table.type, core_alloc, table.type, d_weights,
                               pkm::SerialFor());
  });
}

int pkm_cpu_fused_update(const PkmBags* in, const void* grad_out, const PkmRowOptimizer* opt, void* d_weights,
                         int num_threads, char* err, size_t err_len) {
  return OnCore(in, err, err_len, [&](const pkm::Table& table, const pkm::Bags& bags, pkm::Combiner combiner) {
    if (opt == nullptr) return pkm::Status::Error("opt is null");
    if (grad_out == nullptr) return pkm::Status::Error("fused update: grad_out is null");
    return pkm::FusedBackwardUpdate(table, bags, combiner, grad_out, table.type, *opt, d_weights,
                                    ThreadsFor(num_threads));
  });
}

int pkm_check_shapes(const int64_t* params_dims, int params_rank, const int64_t* indices_dims, int indices_rank,
                     const int64_t* row_splits_dims, int row_splits_rank, const int64_t* weights_dims,
                     int weights_rank, int32_t combiner, int64_t* out_dims, int* out_rank, char* err,
                     size_t err_len) {
  auto dims = [](const int64_t* d, int rank) { return pkm::Dims(d, d + (d != nullptr && rank > 0 ? rank : 0)); };
  pkm::BagShapes shapes;
  shapes.params = dims(params_dims, params_rank);
  shapes.indices = dims(indices_dims, indices_rank);
  shapes.ragged = row_splits_dims != nullptr;
  if (shapes.ragged) shapes.row_splits = dims(row_splits_dims, row_splits_rank);
  shapes.has_weights = weights_dims != nullptr;
  shapes.weights = shapes.has_weights ? dims(weights_dims, weights_rank) : pkm::Dims{0};
  shapes.combiner = static_cast<pkm::Combiner>(combiner);
  pkm::Status s;
  for (const auto& [role, d] : {std::pair<const char*, const pkm::MaybeDims*>{"params", &shapes.params},
                                {shapes.ragged ? "values" : "indices", &shapes.indices},
                                {"row_splits", &shapes.row_splits}, {"weights", &shapes.weights}})
    if (s.ok && *d) s = pkm::ConcreteDims(role, **d);
  pkm::MaybeDims out;
  if (s.ok) s = pkm::ForwardShape(shapes, &out);
  if (s.ok) s = pkm::CombinerValueRule(combiner);
  if (!s.ok) return Fail(s.message, err, err_len);
  if (out_rank != nullptr) *out_rank = static_cast<int>(out->size());
  for (size_t i = 0; out_dims != nullptr && i < out->size(); ++i) out_dims[i] = (*out)[i];
  return 0;
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
