// FFI buffers -> core arguments, shared by the CPU ("Host") and GPU ("CUDA")
// custom-call targets. Only XLA's public FFI header: no TF header, no XLA
// internals, so the GPU target compiles without TensorFlow's C++ API.
#ifndef PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_FFI_H_
#define PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_FFI_H_

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/core/embedding_bag.h"
#include "kernels/core/shape_rules.h"
#include "xla/ffi/api/ffi.h"

namespace pkm_xla {

namespace ffi = ::xla::ffi;

inline pkm::DType DTypeOfFfi(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return pkm::DType::kFloat32;
    case ffi::DataType::F16: return pkm::DType::kFloat16;
    case ffi::DataType::BF16: return pkm::DType::kBFloat16;
    case ffi::DataType::S8: return pkm::DType::kInt8;
    case ffi::DataType::S32: return pkm::DType::kInt32;
    case ffi::DataType::S64: return pkm::DType::kInt64;
    case ffi::DataType::F64: return pkm::DType::kFloat64;
    default: return pkm::DType::kOther;
  }
}

inline pkm::ElemType ElemTypeOf(ffi::DataType t) {
  return t == ffi::DataType::F16 ? pkm::ElemType::kFloat16
                                 : t == ffi::DataType::BF16 ? pkm::ElemType::kBFloat16 : pkm::ElemType::kFloat32;
}

// The core's ParallelFor on XLA's intra-op pool (Host targets only; defined in
// embedding_bag_xla_cpu_targets.cc, shared with quantized_xla_cpu_targets.cc).
pkm::ParallelFor PoolParallelFor(ffi::ThreadPool* pool);

inline pkm::Dims DimsOf(const ffi::AnyBuffer& b) {
  const auto d = b.dimensions();
  return pkm::Dims(d.begin(), d.end());
}

// The core's shape and dtype rules on the buffers (the lowering applied the
// same ones at compile time; a direct caller such as JAX gets them here).
inline pkm::Status CheckBuffers(const ffi::AnyBuffer& params, const ffi::AnyBuffer& indices,
                                const ffi::AnyBuffer* splits, const ffi::AnyBuffer& weights, int32_t combiner,
                                int32_t has_weights) {
  const char* ids = splits != nullptr ? "values" : "indices";
  for (const pkm::Status& s :
       {pkm::CombinerValueRule(combiner), pkm::ParamsType(DTypeOfFfi(params.element_type()), false),
        pkm::IndexType(ids, DTypeOfFfi(indices.element_type())),
        splits != nullptr ? pkm::IndexType("row_splits", DTypeOfFfi(splits->element_type())) : pkm::Status::Ok(),
        has_weights ? pkm::WeightsType(DTypeOfFfi(weights.element_type())) : pkm::Status::Ok()})
    if (!s.ok) return s;
  pkm::BagShapes shapes;
  shapes.params = DimsOf(params);
  shapes.indices = DimsOf(indices);
  if (splits != nullptr) shapes.row_splits = DimsOf(*splits);
  shapes.weights = DimsOf(weights);
  shapes.ragged = splits != nullptr;
  shapes.has_weights = has_weights != 0;
  shapes.combiner = static_cast<pkm::Combiner>(combiner);
  pkm::MaybeDims out;
  return pkm::ForwardShape(shapes, &out);
}

inline ffi::Error FromCore(const pkm::Status& s) {
  return s.ok ? ffi::Error::Success() : ffi::Error::InvalidArgument(s.message);
}

// One call's core arguments.
struct CoreCall {
  pkm::Table table;
  pkm::Bags bags;
  pkm::Combiner combiner = pkm::Combiner::kSum;
  bool has_weights = false;
};

// params [N, D]; indices [..., K] (dense; the lowering passes [B, K]) or
// values [V] + row_splits [B+1] (ragged, splits non-null); weights like
// indices, or [0] when has_weights == 0.
inline ffi::Error ToCoreArgs(const ffi::AnyBuffer& params, const ffi::AnyBuffer& indices,
                             const ffi::AnyBuffer* splits, const ffi::AnyBuffer& weights, int32_t combiner,
                             int32_t has_weights, CoreCall* call) {
  const pkm::Status rule = CheckBuffers(params, indices, splits, weights, combiner, has_weights);
  if (!rule.ok) return ffi::Error::InvalidArgument(rule.message);
  const auto idims = indices.dimensions();
  pkm::Table* table = &call->table;
  pkm::Bags* bags = &call->bags;
  call->combiner = static_cast<pkm::Combiner>(combiner);
  call->has_weights = has_weights != 0;
  table->type = ElemTypeOf(params.element_type());
  table->data = params.untyped_data();
  table->num_rows = params.dimensions()[0];
  table->dim = params.dimensions()[1];
  bags->indices = indices.untyped_data();
  bags->indices_int64 = indices.element_type() == ffi::DataType::S64;
  if (splits != nullptr) {
    bags->row_splits = splits->untyped_data();
    bags->row_splits_int64 = splits->element_type() == ffi::DataType::S64;
    bags->num_bags = splits->dimensions()[0] - 1;
    bags->num_values = idims[0];
  } else {
    bags->bag_size = idims[idims.size() - 1];
    bags->num_bags = 1;  // the leading dims' product: within int64, CheckBuffers checked
    for (size_t i = 0; i + 1 < idims.size(); ++i) bags->num_bags *= idims[i];
  }
  bags->weights = has_weights ? weights.untyped_data() : nullptr;
  bags->weights_type = has_weights ? ElemTypeOf(weights.element_type()) : table->type;
  return ffi::Error::Success();
}

// A result buffer the kernels write `elements` values of `like`'s type into: a
// call built by hand (jax.ffi.ffi_call, any registered target is reachable)
// may pass a smaller or other-typed one.
inline ffi::Error CheckResult(const char* name, const ffi::AnyBuffer& result, const ffi::AnyBuffer& like,
                              int64_t elements) {
  if (static_cast<int64_t>(result.element_count()) == elements && result.element_type() == like.element_type())
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must hold " + std::to_string(elements) +
                                     " elements of the operand's type, got " +
                                     std::to_string(result.element_count()) + " elements");
}

// The backward's grad against the forward output's shape (after ToCoreArgs).
inline ffi::Error CheckGrad(const ffi::AnyBuffer& grad, const ffi::AnyBuffer& indices, const ffi::AnyBuffer* splits,
                            const pkm::Table& table) {
  pkm::Dims out = splits != nullptr ? pkm::Dims{splits->dimensions()[0] - 1} : DimsOf(indices);
  if (splits == nullptr) out.pop_back();
  out.push_back(table.dim);
  return FromCore(pkm::GradShape(DimsOf(grad), out));
}

// The custom calls' buffers and attributes (the lowering's contract,
// embedding_bag_xla_lowering.h) appended to a binding that already holds the
// platform's context arguments: kArgs operands, kRets results, then the
// attributes. Operands: forward (params, indices, weights), ragged forward
// (params, values, row_splits, weights); the backward ones have grad first and
// return (d_params, d_weights). (Binding's methods take an rvalue: hence the moves.)
// (Binding has no public move constructor: it is passed on by reference and
// consumed by its rvalue methods, each of which returns a new one.)
template <int kArgs, int kRets, typename Binding>
auto BindOperands(Binding&& binding) {
  if constexpr (kArgs > 0) {
    return BindOperands<kArgs - 1, kRets>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else if constexpr (kRets > 0) {
    return BindOperands<0, kRets - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(binding).template Attr<int32_t>("combiner").template Attr<int32_t>("has_weights");
  }
}

// The context arguments Ctx... (in order), then BindOperands<kArgs, kRets>.
template <typename... Ctx>
struct BindCall;
template <>
struct BindCall<> {
  template <int kArgs, int kRets, typename Binding>
  static auto To(Binding&& binding) {
    return BindOperands<kArgs, kRets>(std::move(binding));
  }
};
template <typename First, typename... Rest>
struct BindCall<First, Rest...> {
  template <int kArgs, int kRets, typename Binding>
  static auto To(Binding&& binding) {
    return BindCall<Rest...>::template To<kArgs, kRets>(std::move(binding).template Ctx<First>());
  }
};

// The four custom-call targets of one platform, written once: each decodes
// and checks its buffers (ToCoreArgs, CheckGrad), then hands the core
// arguments to Platform, which only runs the math:
//   static ffi::Error Forward(const CoreCall&, ffi::AnyBuffer& out, C&... ctx);
//   static ffi::Error Backward(const CoreCall&, const ffi::AnyBuffer& grad, ffi::AnyBuffer& d_params,
//                              ffi::AnyBuffer& d_weights, C&... ctx);
// where C... are the decoded FFI context arguments Ctx... (ffi::ThreadPool on
// the Host; the stream and the scratch allocator on CUDA).
template <class Platform, typename... Ctx>
struct Targets {
  using Buffer = ffi::AnyBuffer;
  using Result = ffi::Result<ffi::AnyBuffer>;

  static ffi::Error DenseForward(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buffer params, Buffer indices,
                                 Buffer weights, Result out, int32_t combiner, int32_t has_weights) {
    return Forward(params, indices, nullptr, weights, *out, combiner, has_weights, ctx...);
  }
  static ffi::Error RaggedForward(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buffer params, Buffer values,
                                  Buffer splits, Buffer weights, Result out, int32_t combiner, int32_t has_weights) {
    return Forward(params, values, &splits, weights, *out, combiner, has_weights, ctx...);
  }
  static ffi::Error DenseBackward(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buffer grad, Buffer params,
                                  Buffer indices, Buffer weights, Result d_params, Result d_weights, int32_t combiner,
                                  int32_t has_weights) {
    return Backward(grad, params, indices, nullptr, weights, *d_params, *d_weights, combiner, has_weights, ctx...);
  }
  static ffi::Error RaggedBackward(typename ffi::CtxDecoding<Ctx>::Type... ctx, Buffer grad, Buffer params,
                                   Buffer values, Buffer splits, Buffer weights, Result d_params, Result d_weights,
                                   int32_t combiner, int32_t has_weights) {
    return Backward(grad, params, values, &splits, weights, *d_params, *d_weights, combiner, has_weights, ctx...);
  }

  // The contexts, then kArgs operands, kRets results and the attributes.
  template <int kArgs, int kRets>
  static auto Binding() {
    return BindCall<Ctx...>::template To<kArgs, kRets>(ffi::Ffi::Bind());
  }

 private:
  template <typename... Decoded>
  static ffi::Error Forward(const Buffer& params, const Buffer& ids, const Buffer* splits, const Buffer& weights,
                            Buffer& out, int32_t combiner, int32_t has_weights, Decoded&... ctx) {
    CoreCall call;
    if (ffi::Error e = ToCoreArgs(params, ids, splits, weights, combiner, has_weights, &call); e.failure()) return e;
    const int64_t out_elements = call.bags.num_bags * call.table.dim;
    if (ffi::Error e = CheckResult("the output", out, params, out_elements); e.failure()) return e;
    return Platform::Forward(call, out, ctx...);
  }
  template <typename... Decoded>
  static ffi::Error Backward(const Buffer& grad, const Buffer& params, const Buffer& ids, const Buffer* splits,
                             const Buffer& weights, Buffer& d_params, Buffer& d_weights, int32_t combiner,
                             int32_t has_weights, Decoded&... ctx) {
    CoreCall call;
    if (ffi::Error e = ToCoreArgs(params, ids, splits, weights, combiner, has_weights, &call); e.failure()) return e;
    if (ffi::Error e = CheckGrad(grad, ids, splits, call.table); e.failure()) return e;
    if (ffi::Error e = CheckResult("d_params", d_params, params, call.table.num_rows * call.table.dim); e.failure())
      return e;
    if (ffi::Error e = CheckResult("d_weights", d_weights, weights, weights.element_count()); e.failure()) return e;
    if (grad.element_type() != params.element_type())
      return ffi::Error::InvalidArgument("grad must have the params' type");
    return Platform::Backward(call, grad, d_params, d_weights, ctx...);
  }
};

}  // namespace pkm_xla

// Defines the four handlers of TARGETS (a Targets<...>) and exports them as C
// symbols (XLA_FFI_Handler), one per custom-call target:
// pkm_xla_<P>_{forward,backward,ragged_forward,ragged_backward}.
#define PKM_XLA_DEFINE_TARGETS(P, TARGETS)                                                               \
  XLA_FFI_DEFINE_HANDLER(pkm_xla_##P##_forward_handler, TARGETS::DenseForward, (TARGETS::Binding<3, 1>())); \
  XLA_FFI_DEFINE_HANDLER(pkm_xla_##P##_ragged_forward_handler, TARGETS::RaggedForward,                   \
                         (TARGETS::Binding<4, 1>()));                                                    \
  XLA_FFI_DEFINE_HANDLER(pkm_xla_##P##_backward_handler, TARGETS::DenseBackward, (TARGETS::Binding<4, 2>())); \
  XLA_FFI_DEFINE_HANDLER(pkm_xla_##P##_ragged_backward_handler, TARGETS::RaggedBackward,                 \
                         (TARGETS::Binding<5, 2>()));                                                    \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* pkm_xla_##P##_forward(                \
      XLA_FFI_CallFrame* f) { return pkm_xla_##P##_forward_handler(f); }                                 \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* pkm_xla_##P##_backward(               \
      XLA_FFI_CallFrame* f) { return pkm_xla_##P##_backward_handler(f); }                                \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* pkm_xla_##P##_ragged_forward(         \
      XLA_FFI_CallFrame* f) { return pkm_xla_##P##_ragged_forward_handler(f); }                          \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* pkm_xla_##P##_ragged_backward(        \
      XLA_FFI_CallFrame* f) { return pkm_xla_##P##_ragged_backward_handler(f); }

#endif  // PKM_KERNELS_XLA_EMBEDDING_BAG_XLA_FFI_H_
