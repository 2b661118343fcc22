// PkmEmbeddingBagFusedUpdate: the backward of PkmResourceEmbeddingBag with a
// row-wise optimizer applied to the table variable in place (the core's
// FusedBackwardUpdate; CUDA: pkm_cuda_fused_update), never forming a table
// gradient. Used by pkm_serve.optimizers (LazyAdam, RowwiseAdagrad) for layers
// built with fused_optimizer=True. Op definition and CPU kernel.
#include "kernels/core/fused_optimizer.h"
#include "kernels/tf/fused_optimizer_common.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace pkm_tf {

REGISTER_OP("PkmEmbeddingBagFusedUpdate")
    .Input("grad: float")
    .Input("table: resource")
    .Input("indices: Tindices")
    .Input("weights: float")
    .Input("state: num_state * resource")
    .Input("learning_rate: float")
    .Input("step: int64")
    .Output("d_weights: float")
    .Attr("Tindices: {int32, int64}")
    .Attr("combiner: {'sum', 'mean', 'sqrtn'} = 'sum'")
    .Attr("has_weights: bool = true")
    .Attr("optimizer: {'sgd', 'rowwise_adagrad', 'adam'}")
    .Attr("num_state: int >= 0")
    .Attr("epsilon: float = 1e-7")
    .Attr("beta_1: float = 0.9")
    .Attr("beta_2: float = 0.999")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(3));
      return ::tensorflow::Status();
    })
    .Doc(R"doc(
Backward of PkmResourceEmbeddingBag(table, indices, weights, combiner) for the
upstream gradient `grad`, applied to the table variable in place by a row-wise
optimizer (kernels/core/row_optimizer.h): sgd (no state), rowwise_adagrad
(state: accumulator [N]) or adam (lazy; state: m, v [N, D]); `step` is Adam's
1-based step. Only the rows that indices touch (and their state) change.
Returns d_weights, taken against the table before the update. Float32 table
and state. Deterministic.
)doc");

namespace {

class FusedUpdateOp : public FusedUpdateKernelBase {
 public:
  using FusedUpdateKernelBase::FusedUpdateKernelBase;

  void Compute(::tensorflow::OpKernelContext* ctx) override {
    LockedVariables vars;
    CoreArgs args;
    PkmRowOptimizer opt;
    ::tensorflow::Tensor* d_weights = nullptr;
    auto copy = [](const ::tensorflow::Tensor& from, ::tensorflow::Tensor* to) {
      std::memcpy(to->data(), from.data(), from.TotalBytes());
      return ::tensorflow::Status();
    };
    OP_REQUIRES_OK(ctx, Prepare(ctx, copy, &vars, &args, &opt, &d_weights));
    OP_REQUIRES_OK(ctx, ToTf(pkm::FusedBackwardUpdate(args.table, args.bags, attrs_.combiner, ctx->input(0).data(),
                                                      pkm::ElemType::kFloat32, opt,
                                                      attrs_.has_weights ? d_weights->data() : nullptr,
                                                      TfParallelFor(ctx))));
  }
};

}  // namespace

REGISTER_KERNEL_BUILDER(Name("PkmEmbeddingBagFusedUpdate")
                            .Device(::tensorflow::DEVICE_CPU)
                            .HostMemory("learning_rate")
                            .HostMemory("step"),
                        FusedUpdateOp);

}  // namespace pkm_tf
