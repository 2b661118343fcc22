// XLA CPU ("Host") custom-call targets of the PkmQuantizedEmbeddingBag
// lowering (quantized_xla_cpu.cc): FFI buffers -> a pkm::Table of int8 rows
// and pkm::Bags, then the core's forward on XLA's thread pool. XLA's public
// FFI header only, no TensorFlow, like embedding_bag_xla_cpu_targets.cc.
//   pkm_quantized_embedding_bag_forward
//     (params s8[N,D], row_scales[N], row_biases[N]|[0], indices[B,K], weights[B,K]|[0]) -> out[B,D]
//   pkm_quantized_ragged_embedding_bag_forward
//     (params, row_scales, row_biases, values[V], row_splits[B+1], weights[V]|[0]) -> out[B,D]
// attributes: combiner (i32, pkm::Combiner), has_weights (i32 0/1).
#include <cstdint>

#include "kernels/core/embedding_bag.h"
#include "kernels/xla/embedding_bag_xla_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace pkm_xla {
namespace {

bool IsIndexType(ffi::DataType t) { return t == ffi::DataType::S32 || t == ffi::DataType::S64; }

// The float types of weights and outputs (the float op takes them through CheckBuffers).
bool ToElemType(ffi::DataType t, pkm::ElemType* out) {
  if (t != ffi::DataType::F32 && t != ffi::DataType::F16 && t != ffi::DataType::BF16) return false;
  *out = ElemTypeOf(t);
  return true;
}

// The int8 table's three buffers -> pkm::Table.
ffi::Error ToQuantizedTable(const ffi::AnyBuffer& params, const ffi::AnyBuffer& scales,
                            const ffi::AnyBuffer& biases, pkm::Table* table) {
  const auto pdims = params.dimensions();
  if (params.element_type() != ffi::DataType::S8 || pdims.size() != 2)
    return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: params must be int8 [N, D]");
  const ffi::DataType st = scales.element_type();
  if ((st != ffi::DataType::F32 && st != ffi::DataType::F16) || biases.element_type() != st)
    return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: row_scales and row_biases must both be "
                                       "float32 or float16");
  if (static_cast<int64_t>(scales.element_count()) != pdims[0] ||
      (biases.element_count() != 0 && static_cast<int64_t>(biases.element_count()) != pdims[0]))
    return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: row_scales/row_biases must have one per row");
  table->data = params.untyped_data();
  table->type = pkm::ElemType::kInt8;
  table->num_rows = pdims[0];
  table->dim = pdims[1];
  table->row_scales = scales.untyped_data();
  table->row_biases = biases.element_count() ? biases.untyped_data() : nullptr;
  table->row_params_type = st == ffi::DataType::F16 ? pkm::ElemType::kFloat16 : pkm::ElemType::kFloat32;
  return ffi::Error::Success();
}

// indices (or values + row_splits) and weights -> pkm::Bags, as ToCoreArgs does for the float ops.
ffi::Error ToQuantizedBags(const ffi::AnyBuffer& indices, const ffi::AnyBuffer* splits,
                           const ffi::AnyBuffer& weights, int32_t has_weights, pkm::Bags* bags) {
  if (!IsIndexType(indices.element_type()))
    return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: indices must be int32 or int64");
  bags->indices = indices.untyped_data();
  bags->indices_int64 = indices.element_type() == ffi::DataType::S64;
  const auto idims = indices.dimensions();
  if (splits != nullptr) {
    const auto sdims = splits->dimensions();
    if (idims.size() != 1 || sdims.size() != 1 || sdims[0] < 1 || !IsIndexType(splits->element_type()))
      return ffi::Error::InvalidArgument("PkmQuantizedRaggedEmbeddingBag: values and row_splits must be vectors");
    bags->row_splits = splits->untyped_data();
    bags->row_splits_int64 = splits->element_type() == ffi::DataType::S64;
    bags->num_bags = sdims[0] - 1;
    bags->num_values = idims[0];
  } else {
    if (idims.size() != 2) return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: indices must be [B, K]");
    bags->num_bags = idims[0];
    bags->bag_size = idims[1];
  }
  bags->weights = nullptr;
  if (has_weights) {
    if (!ToElemType(weights.element_type(), &bags->weights_type) ||
        weights.element_count() != indices.element_count())
      return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: weights must be shaped like indices");
    bags->weights = weights.untyped_data();
  }
  return ffi::Error::Success();
}

ffi::Error QuantizedForward(ffi::ThreadPool pool, const ffi::AnyBuffer& params, const ffi::AnyBuffer& scales,
                            const ffi::AnyBuffer& biases, const ffi::AnyBuffer& indices,
                            const ffi::AnyBuffer* splits, const ffi::AnyBuffer& weights, ffi::AnyBuffer* out,
                            int32_t combiner, int32_t has_weights) {
  if (combiner < PKM_SUM || combiner > PKM_SQRTN)
    return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: bad combiner attribute");
  pkm::Table table;
  pkm::Bags bags;
  pkm::ElemType out_type;
  if (!ToElemType(out->element_type(), &out_type))
    return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: output must be a float type");
  if (ffi::Error e = ToQuantizedTable(params, scales, biases, &table); e.failure()) return e;
  if (ffi::Error e = ToQuantizedBags(indices, splits, weights, has_weights, &bags); e.failure()) return e;
  if (static_cast<int64_t>(out->element_count()) != bags.num_bags * table.dim)  // as the float targets' check
    return ffi::Error::InvalidArgument("PkmQuantizedEmbeddingBag: the output must hold " +
                                       std::to_string(bags.num_bags * table.dim) + " elements, got " +
                                       std::to_string(out->element_count()));
  const pkm::Status s = pkm::Forward(table, bags, static_cast<pkm::Combiner>(combiner), out->untyped_data(),
                                     out_type, PoolParallelFor(&pool));
  return s.ok ? ffi::Error::Success() : ffi::Error::InvalidArgument(s.message);
}

XLA_FFI_DEFINE_HANDLER(kQuantizedForwardHandler,
                       [](ffi::ThreadPool pool, ffi::AnyBuffer params, ffi::AnyBuffer scales,
                          ffi::AnyBuffer biases, ffi::AnyBuffer indices, ffi::AnyBuffer weights,
                          ffi::Result<ffi::AnyBuffer> out, int32_t combiner, int32_t has_weights) {
                         return QuantizedForward(pool, params, scales, biases, indices, nullptr, weights, &*out,
                                                 combiner, has_weights);
                       },
                       (BindOperands<5, 1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

XLA_FFI_DEFINE_HANDLER(kQuantizedRaggedForwardHandler,
                       [](ffi::ThreadPool pool, ffi::AnyBuffer params, ffi::AnyBuffer scales,
                          ffi::AnyBuffer biases, ffi::AnyBuffer values, ffi::AnyBuffer splits,
                          ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> out, int32_t combiner,
                          int32_t has_weights) {
                         return QuantizedForward(pool, params, scales, biases, values, &splits, weights, &*out,
                                                 combiner, has_weights);
                       },
                       (BindOperands<6, 1>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

}  // namespace
}  // namespace pkm_xla

#define PKM_EXPORT extern "C" __attribute__((visibility("default")))
PKM_EXPORT XLA_FFI_Error* pkm_xla_cpu_quantized_forward(XLA_FFI_CallFrame* f) {
  return pkm_xla::kQuantizedForwardHandler(f);
}
PKM_EXPORT XLA_FFI_Error* pkm_xla_cpu_quantized_ragged_forward(XLA_FFI_CallFrame* f) {
  return pkm_xla::kQuantizedRaggedForwardHandler(f);
}
