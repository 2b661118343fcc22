// The CPU backend of the kernel templates (embedding_bag_kernel_template.h):
// the core on TF's intra-op thread pool, its Status as InvalidArgument. Shared
// by the float kernels and the int8 ones (quantized_embedding_bag_kernels.cc).
#ifndef PKM_KERNELS_TF_EMBEDDING_BAG_CPU_BACKEND_H_
#define PKM_KERNELS_TF_EMBEDDING_BAG_CPU_BACKEND_H_

#include <string>

#include "kernels/core/embedding_bag.h"
#include "kernels/tf/embedding_bag_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace pkm_tf {

struct CpuBackend {
  using Status = ::tensorflow::Status;
  using Tensor = ::tensorflow::Tensor;

  // The output's type is the table's, or (int8 tables) the op's T.
  static Status Forward(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs, const CoreArgs& args,
                        Tensor* out) {
    return ToTf(pkm::Forward(args.table, args.bags, attrs.combiner, out->data(), ElemTypeOf(out->dtype()),
                             TfForwardParallelFor(ctx)));
  }

  static Status Backward(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs, const CoreArgs& args,
                         const Tensor& grad, Tensor* d_params, Tensor* d_weights) {
    return ToTf(pkm::Backward(args.table, args.bags, attrs.combiner, grad.data(), args.table.type,
                              d_params->data(), args.table.type, attrs.has_weights ? d_weights->data() : nullptr,
                              TfParallelFor(ctx)));
  }

  // The core knows the number of touched rows only after grouping: it
  // allocates rows (output 0) and row_grads (output 1) through `alloc`.
  static Status SparseBackward(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs, const CoreArgs& args,
                               const Tensor& grad, Tensor* d_weights) {
    const int64_t dim = args.table.dim;
    auto alloc = [ctx, dim](int64_t num_rows, int64_t** rows, void** row_grads) {
      Tensor *rows_t = nullptr, *grads_t = nullptr;
      Status s = ctx->allocate_output(0, ::tensorflow::TensorShape({num_rows}), &rows_t);
      if (s.ok()) s = ctx->allocate_output(1, ::tensorflow::TensorShape({num_rows, dim}), &grads_t);
      if (!s.ok()) return pkm::Status::Error(std::string(s.message()));
      *rows = reinterpret_cast<int64_t*>(rows_t->data());
      *row_grads = grads_t->data();
      return pkm::Status::Ok();
    };
    return ToTf(pkm::SparseBackward(args.table, args.bags, attrs.combiner, grad.data(), args.table.type, alloc,
                                    args.table.type, attrs.has_weights ? d_weights->data() : nullptr,
                                    TfParallelFor(ctx)));
  }
};

}  // namespace pkm_tf

#endif  // PKM_KERNELS_TF_EMBEDDING_BAG_CPU_BACKEND_H_
