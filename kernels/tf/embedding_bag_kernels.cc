// CPU kernels of the PkmEmbeddingBag ops: translate tensors, run the core on
// TF's intra-op thread pool, turn core errors into InvalidArgument.
#include "kernels/core/embedding_bag.h"
#include "kernels/tf/embedding_bag_common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/util/work_sharder.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace pkm_tf {

using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

namespace {

class EmbeddingBagOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    OP_REQUIRES_OK(ctx, BuildCoreArgs(ctx, attrs_, /*first=*/0, &args));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, args.out_shape, &out));
    OP_REQUIRES_OK(ctx, ToTf(pkm::Forward(args.table, args.bags, attrs_.combiner, out->data(),
                                          args.table.type, TfParallelFor(ctx))));
  }
};

class EmbeddingBagGradOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;

  void Compute(OpKernelContext* ctx) override {
    CoreArgs args;
    Tensor *d_params = nullptr, *d_weights = nullptr;
    OP_REQUIRES_OK(ctx, BuildGradArgs(ctx, attrs_, &args, &d_params, &d_weights));
    const Tensor& grad = ctx->input(0);
    OP_REQUIRES_OK(ctx, ToTf(pkm::Backward(args.table, args.bags, attrs_.combiner, grad.data(),
                                           args.table.type, d_params->data(), args.table.type,
                                           attrs_.has_weights ? d_weights->data() : nullptr,
                                           TfParallelFor(ctx))));
  }
};

}  // namespace

PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagOp, EmbeddingBagGradOp, float);
PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagOp, EmbeddingBagGradOp, ::Eigen::half);
PKM_REGISTER_EMBEDDING_BAG_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagOp, EmbeddingBagGradOp,
                                   ::tensorflow::bfloat16);

}  // namespace pkm_tf

// ---- row-sparse gradient kernels ----------------------------------------------

namespace pkm_tf {
namespace {

// The sparse gradient from the table in input 1; `variable_params` when it
// was read from a resource variable.
void SparseGradCompute(OpKernelContext* ctx, const OpAttrs& attrs, const Tensor* variable_params) {
  {
    CoreArgs args;
    OP_REQUIRES_OK(ctx, BuildGradCoreArgs(ctx, attrs, &args, variable_params));
    const Tensor& grad = ctx->input(0);
    Tensor* d_weights = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, args.weights->shape(), &d_weights));
    const int64_t dim = args.table.dim;
    // The core knows the number of touched rows only after grouping.
    auto alloc = [ctx, dim](int64_t num_rows, int64_t** rows, void** row_grads) {
      Tensor *rows_t = nullptr, *grads_t = nullptr;
      ::tensorflow::Status s = ctx->allocate_output(0, ::tensorflow::TensorShape({num_rows}), &rows_t);
      if (s.ok()) s = ctx->allocate_output(1, ::tensorflow::TensorShape({num_rows, dim}), &grads_t);
      if (!s.ok()) return pkm::Status::Error(std::string(s.message()));
      *rows = reinterpret_cast<int64_t*>(rows_t->data());
      *row_grads = grads_t->data();
      return pkm::Status::Ok();
    };
    OP_REQUIRES_OK(ctx, ToTf(pkm::SparseBackward(args.table, args.bags, attrs.combiner, grad.data(),
                                                 args.table.type, alloc, args.table.type,
                                                 attrs.has_weights ? d_weights->data() : nullptr,
                                                 TfParallelFor(ctx))));
  }
}

class EmbeddingBagSparseGradOp : public EmbeddingBagKernelBase {
 public:
  using EmbeddingBagKernelBase::EmbeddingBagKernelBase;
  void Compute(OpKernelContext* ctx) override { SparseGradCompute(ctx, attrs_, nullptr); }
};

// Runs fn(table) on the variable behind input `input`, under its shared lock
// (as ResourceGather reads: no copy of the table, whatever its copy-on-read mode).
template <typename Fn>
void WithVariableTable(OpKernelContext* ctx, int input, ::tensorflow::DataType dtype, Fn fn) {
  ::tensorflow::core::RefCountPtr<::tensorflow::Var> var;
  OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, input), &var));
  ::tensorflow::tf_shared_lock lock(*var->mu());
  const Tensor* params = var->tensor();
  OP_REQUIRES(ctx, var->is_initialized && params->IsInitialized(),
              ::tensorflow::errors::FailedPrecondition("the table variable is not initialised"));
  OP_REQUIRES(ctx, params->dtype() == dtype,
              ::tensorflow::errors::InvalidArgument("the table variable holds ",
                                                    ::tensorflow::DataTypeString(params->dtype()),
                                                    ", the op expects ", ::tensorflow::DataTypeString(dtype)));
  fn(params);
}

class ResourceEmbeddingBagOp : public EmbeddingBagKernelBase {
 public:
  explicit ResourceEmbeddingBagOp(::tensorflow::OpKernelConstruction* ctx)
      : EmbeddingBagKernelBase(ctx, /*ragged=*/false) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
  }
  void Compute(OpKernelContext* ctx) override {
    WithVariableTable(ctx, 0, dtype_, [&](const Tensor* params) {
      CoreArgs args;
      OP_REQUIRES_OK(ctx, BuildCoreArgs(ctx, attrs_, /*first=*/0, &args, params));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, args.out_shape, &out));
      OP_REQUIRES_OK(ctx, ToTf(pkm::Forward(args.table, args.bags, attrs_.combiner, out->data(),
                                            args.table.type, TfParallelFor(ctx))));
    });
  }

 private:
  ::tensorflow::DataType dtype_;
};

class ResourceEmbeddingBagSparseGradOp : public EmbeddingBagKernelBase {
 public:
  explicit ResourceEmbeddingBagSparseGradOp(::tensorflow::OpKernelConstruction* ctx)
      : EmbeddingBagKernelBase(ctx, /*ragged=*/false) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
  }
  void Compute(OpKernelContext* ctx) override {
    WithVariableTable(ctx, 1, dtype_, [&](const Tensor* params) { SparseGradCompute(ctx, attrs_, params); });
  }

 private:
  ::tensorflow::DataType dtype_;
};

}  // namespace

#define PKM_REGISTER_SPARSE_GRAD_KERNELS(DEVICE, KERNEL, T)                                          \
  REGISTER_KERNEL_BUILDER(Name("PkmEmbeddingBagSparseGrad").Device(DEVICE).TypeConstraint<T>("T"),   \
                          ::pkm_tf::WithLayout<KERNEL, false>);                                      \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("PkmRaggedEmbeddingBagSparseGrad").Device(DEVICE).TypeConstraint<T>("T"),                 \
      ::pkm_tf::WithLayout<KERNEL, true>)

PKM_REGISTER_SPARSE_GRAD_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagSparseGradOp, float);
PKM_REGISTER_SPARSE_GRAD_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagSparseGradOp, ::Eigen::half);
PKM_REGISTER_SPARSE_GRAD_KERNELS(::tensorflow::DEVICE_CPU, EmbeddingBagSparseGradOp, ::tensorflow::bfloat16);

#define PKM_REGISTER_RESOURCE_KERNELS(T)                                                             \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("PkmResourceEmbeddingBag").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("dtype"),   \
      ResourceEmbeddingBagOp);                                                                       \
  REGISTER_KERNEL_BUILDER(Name("PkmResourceEmbeddingBagSparseGrad")                                  \
                              .Device(::tensorflow::DEVICE_CPU)                                      \
                              .TypeConstraint<T>("dtype"),                                           \
                          ResourceEmbeddingBagSparseGradOp)

PKM_REGISTER_RESOURCE_KERNELS(float);
PKM_REGISTER_RESOURCE_KERNELS(::Eigen::half);
PKM_REGISTER_RESOURCE_KERNELS(::tensorflow::bfloat16);

}  // namespace pkm_tf
