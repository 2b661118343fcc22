// The PkmEmbeddingBag kernels, written once for every device (as TF Text's
// kernel templates are): each kernel builds and checks its arguments
// (embedding_bag_common.h), allocates its outputs and hands both to a device
// backend that only runs the math. A backend is a struct of three statics:
//   Forward(ctx, attrs, args, out)
//   Backward(ctx, attrs, args, grad, d_params, d_weights)
//   SparseBackward(ctx, attrs, args, grad, d_weights)   (allocates rows / row_grads)
// returning a TF Status: the CPU one runs the core (embedding_bag_kernels.cc),
// the GPU one the CUDA launchers (embedding_bag_gpu_kernels.cc).
#ifndef PKM_KERNELS_TF_EMBEDDING_BAG_KERNEL_TEMPLATE_H_
#define PKM_KERNELS_TF_EMBEDDING_BAG_KERNEL_TEMPLATE_H_

#include "kernels/tf/embedding_bag_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace pkm_tf {

// A forward: `build(&args)` fills and checks the core arguments (the float
// op's BuildCoreArgs, the int8 op's BuildQuantizedCoreArgs, a variable's table).
template <class Backend, class Build>
void ComputeForward(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs, Build build) {
  CoreArgs args;
  OP_REQUIRES_OK(ctx, build(&args));
  ::tensorflow::Tensor* out = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, args.out_shape, &out));
  OP_REQUIRES_OK(ctx, Backend::Forward(ctx, attrs, args, out));
}

// The row-sparse gradient of the table in input 1, or of `variable_params`
// when it was read from a resource variable.
template <class Backend>
void ComputeSparseGrad(::tensorflow::OpKernelContext* ctx, const OpAttrs& attrs,
                       const ::tensorflow::Tensor* variable_params) {
  CoreArgs args;
  OP_REQUIRES_OK(ctx, BuildGradCoreArgs(ctx, attrs, &args, variable_params));
  ::tensorflow::Tensor* d_weights = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(2, args.weights->shape(), &d_weights));
  OP_REQUIRES_OK(ctx, Backend::SparseBackward(ctx, attrs, args, ctx->input(0), d_weights));
}

template <class Backend>
class ForwardKernel : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;
  void Compute(::tensorflow::OpKernelContext* ctx) override {
    ComputeForward<Backend>(ctx, attrs_, [&](CoreArgs* args) { return BuildCoreArgs(ctx, attrs_, 0, args); });
  }
};

// On CPU the dense d_params buffer is kept for the next call (KeptOutput); a
// GPU allocator already pools its memory.
template <class Backend>
class GradKernel : public EmbeddingBagKernelBase {
 public:
  GradKernel(::tensorflow::OpKernelConstruction* ctx, bool ragged)
      : EmbeddingBagKernelBase(ctx, ragged), keep_d_params_(ctx->device_type() == ::tensorflow::DeviceType(::tensorflow::DEVICE_CPU)) {}
  void Compute(::tensorflow::OpKernelContext* ctx) override {
    CoreArgs args;
    ::tensorflow::Tensor *d_params = nullptr, *d_weights = nullptr;
    OP_REQUIRES_OK(ctx, BuildGradArgs(ctx, attrs_, &args, &d_params, &d_weights, keep_d_params_ ? &kept_ : nullptr));
    OP_REQUIRES_OK(ctx, Backend::Backward(ctx, attrs_, args, ctx->input(0), d_params, d_weights));
  }

 private:
  const bool keep_d_params_;
  KeptOutput kept_;
};

template <class Backend>
class SparseGradKernel : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;
  void Compute(::tensorflow::OpKernelContext* ctx) override { ComputeSparseGrad<Backend>(ctx, attrs_, nullptr); }
};

}  // namespace pkm_tf

// Registers KERNEL for an op's dense and ragged forms (DENSE_OP, RAGGED_OP)
// on DEVICE, for each table type; one class serves every dtype, as the core
// and the CUDA launchers dispatch on runtime element types.
#define PKM_REGISTER_LAYOUTS_FOR_TYPE(DENSE_OP, RAGGED_OP, DEVICE, KERNEL, T)                  \
  REGISTER_KERNEL_BUILDER(Name(DENSE_OP).Device(DEVICE).TypeConstraint<T>("T"),                \
                          ::pkm_tf::WithLayout<KERNEL, false>);                               \
  REGISTER_KERNEL_BUILDER(Name(RAGGED_OP).Device(DEVICE).TypeConstraint<T>("T"),               \
                          ::pkm_tf::WithLayout<KERNEL, true>)
#define PKM_REGISTER_LAYOUTS(DENSE_OP, RAGGED_OP, DEVICE, KERNEL)                              \
  PKM_REGISTER_LAYOUTS_FOR_TYPE(DENSE_OP, RAGGED_OP, DEVICE, KERNEL, float);                   \
  PKM_REGISTER_LAYOUTS_FOR_TYPE(DENSE_OP, RAGGED_OP, DEVICE, KERNEL, ::Eigen::half);           \
  PKM_REGISTER_LAYOUTS_FOR_TYPE(DENSE_OP, RAGGED_OP, DEVICE, KERNEL, ::tensorflow::bfloat16)

// The forward, gradient and row-sparse gradient kernels of a device backend.
#define PKM_REGISTER_EMBEDDING_BAG_KERNELS(DEVICE, BACKEND)                                                  \
  PKM_REGISTER_LAYOUTS("PkmEmbeddingBag", "PkmRaggedEmbeddingBag", DEVICE, ::pkm_tf::ForwardKernel<BACKEND>); \
  PKM_REGISTER_LAYOUTS("PkmEmbeddingBagGrad", "PkmRaggedEmbeddingBagGrad", DEVICE,                           \
                       ::pkm_tf::GradKernel<BACKEND>);                                                       \
  PKM_REGISTER_LAYOUTS("PkmEmbeddingBagSparseGrad", "PkmRaggedEmbeddingBagSparseGrad", DEVICE,               \
                       ::pkm_tf::SparseGradKernel<BACKEND>)

#endif  // PKM_KERNELS_TF_EMBEDDING_BAG_KERNEL_TEMPLATE_H_
