// FFI buffers -> core arguments, shared by the CPU ("Host") and GPU ("CUDA")
// custom-call targets. Only XLA's public FFI header: no TF header, no XLA
// internals, so the GPU target compiles without TensorFlow's C++ API.
#ifndef PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_FFI_H_
#define PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_FFI_H_

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/core/embedding_bag.h"
#include "xla/ffi/api/ffi.h"

namespace pkm_xla {

namespace ffi = ::xla::ffi;

// The lowering only emits these element types; anything else is a bug in the
// caller, reported rather than misread.
inline bool ToElemType(ffi::DataType t, pkm::ElemType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = pkm::ElemType::kFloat32; return true;
    case ffi::DataType::F16: *out = pkm::ElemType::kFloat16; return true;
    case ffi::DataType::BF16: *out = pkm::ElemType::kBFloat16; return true;
    default: return false;
  }
}

inline bool IsIndexType(ffi::DataType t) { return t == ffi::DataType::S32 || t == ffi::DataType::S64; }

// params [N, D]; indices [B, K] (dense) or values [V] + row_splits [B+1]
// (ragged, splits non-null); weights like indices, or [0] when has_weights == 0.
inline ffi::Error ToCoreArgs(const ffi::AnyBuffer& params, const ffi::AnyBuffer& indices,
                             const ffi::AnyBuffer* splits, const ffi::AnyBuffer& weights, int32_t combiner,
                             int32_t has_weights, pkm::Table* table, pkm::Bags* bags, pkm::Combiner* comb) {
  // The attribute carries pkm::Combiner's value, i.e. PKM_SUM..PKM_MAX (bag_problem.h).
  if (combiner < PKM_SUM || combiner > PKM_MAX)
    return ffi::Error::InvalidArgument("PkmEmbeddingBag: bad combiner attribute");
  *comb = static_cast<pkm::Combiner>(combiner);
  if (const pkm::Status s = pkm::CheckCombiner(*comb, has_weights != 0); !s.ok)
    return ffi::Error::InvalidArgument(s.message);
  const auto pdims = params.dimensions();
  if (pdims.size() != 2) return ffi::Error::InvalidArgument("PkmEmbeddingBag: params must be [N, D]");
  if (!ToElemType(params.element_type(), &table->type) || !IsIndexType(indices.element_type()))
    return ffi::Error::InvalidArgument("PkmEmbeddingBag: unsupported element type");
  table->data = params.untyped_data();
  table->num_rows = pdims[0];
  table->dim = pdims[1];
  bags->indices = indices.untyped_data();
  bags->indices_int64 = indices.element_type() == ffi::DataType::S64;
  const auto idims = indices.dimensions();
  if (splits != nullptr) {
    const auto sdims = splits->dimensions();
    if (idims.size() != 1 || sdims.size() != 1 || sdims[0] < 1 || !IsIndexType(splits->element_type()))
      return ffi::Error::InvalidArgument("PkmRaggedEmbeddingBag: values and row_splits must be vectors");
    bags->row_splits = splits->untyped_data();
    bags->row_splits_int64 = splits->element_type() == ffi::DataType::S64;
    bags->num_bags = sdims[0] - 1;
    bags->num_values = idims[0];
  } else {
    if (idims.size() != 2) return ffi::Error::InvalidArgument("PkmEmbeddingBag: indices must be [B, K]");
    bags->num_bags = idims[0];
    bags->bag_size = idims[1];
  }
  if (has_weights) {
    if (!ToElemType(weights.element_type(), &bags->weights_type) ||
        weights.element_count() != indices.element_count())
      return ffi::Error::InvalidArgument("PkmEmbeddingBag: weights must be shaped like indices");
    bags->weights = weights.untyped_data();
  } else {
    bags->weights = nullptr;
    bags->weights_type = table->type;
  }
  return ffi::Error::Success();
}

// The custom calls' buffers and attributes (the lowering's contract,
// embedding_bag_xla_lowering.h) appended to a binding that already holds the
// platform's context arguments: kArgs operands, kRets results, then the
// attributes. Operands: forward (params, indices, weights), ragged forward
// (params, values, row_splits, weights); the backward ones have grad first and
// return (d_params, d_weights). (Binding's methods take an rvalue: hence the moves.)
template <int kArgs, int kRets, typename Binding>
auto BindOperands(Binding binding) {
  if constexpr (kArgs > 0) {
    return BindOperands<kArgs - 1, kRets>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else if constexpr (kRets > 0) {
    return BindOperands<0, kRets - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(binding).template Attr<int32_t>("combiner").template Attr<int32_t>("has_weights");
  }
}

}  // namespace pkm_xla

#endif  // PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_FFI_H_
