// PkmEmbeddingBagFusedUpdate kernels, shared by both devices: the attrs, the
// locked variables (table and optimizer state), their checks, and the
// descriptor (PkmRowOptimizer) the core and the CUDA launcher take. A device
// kernel supplies only the buffer copy (for a variable whose buffer is still
// shared) and the launch.
#ifndef PKM_KERNELS_TF_FUSED_OPTIMIZER_COMMON_H_
#define PKM_KERNELS_TF_FUSED_OPTIMIZER_COMMON_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/core/row_optimizer.h"
#include "kernels/tf/embedding_bag_common.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace pkm_tf {

// Inputs: grad 0, table 1, indices 2, weights 3, state 4 .. 4+num_state-1,
// then learning_rate and step.
constexpr int kFusedTableInput = 1;
constexpr int kFusedFirstStateInput = 4;

// The variables of one update, locked exclusively in address order (as TF's
// training ops lock theirs) for the kernel's lifetime, each switched to
// copy-on-read mode with a buffer of its own first (as a sparse update of
// TF's needs: EnsureSparseVariableAccess), so the update is in place.
class LockedVariables {
 public:
  using CopyFn = std::function<::tensorflow::Status(const ::tensorflow::Tensor& from, ::tensorflow::Tensor* to)>;

  ::tensorflow::Status Lock(::tensorflow::OpKernelContext* ctx, const std::vector<int>& inputs, const CopyFn& copy) {
    for (int input : inputs) {
      ::tensorflow::core::RefCountPtr<::tensorflow::Var> var;
      TF_RETURN_IF_ERROR(::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, input), &var));
      for (size_t i = 0; i < vars_.size(); ++i)  // the update reads and writes each in place
        if (vars_[i].get() == var.get())
          return ::tensorflow::errors::InvalidArgument("inputs ", inputs[i], " and ", input,
                                                       " are the same variable: the table and each optimizer "
                                                       "state need their own");
      vars_.push_back(std::move(var));
    }
    std::vector<::tensorflow::mutex*> order;
    for (auto& var : vars_)
      if (std::find(order.begin(), order.end(), var->mu()) == order.end()) order.push_back(var->mu());
    std::sort(order.begin(), order.end());
    for (auto* mu : order) locks_.push_back(std::make_unique<::tensorflow::mutex_lock>(*mu));
    for (size_t i = 0; i < vars_.size(); ++i) {
      ::tensorflow::Var* var = vars_[i].get();
      if (!var->is_initialized || !var->tensor()->IsInitialized())
        return ::tensorflow::errors::FailedPrecondition("variable of input ", inputs[i], " is not initialised");
      if (var->copy_on_read_mode.load()) continue;
      if (!var->tensor()->RefCountIsOne()) {
        ::tensorflow::Tensor own;
        TF_RETURN_IF_ERROR(ctx->allocate_temp(var->tensor()->dtype(), var->tensor()->shape(), &own));
        TF_RETURN_IF_ERROR(copy(*var->tensor(), &own));
        *var->tensor() = own;
      }
      var->copy_on_read_mode.store(true);
    }
    return ::tensorflow::Status();
  }
  ::tensorflow::Tensor* tensor(size_t i) { return vars_[i]->tensor(); }

 private:
  std::vector<::tensorflow::core::RefCountPtr<::tensorflow::Var>> vars_;
  std::vector<std::unique_ptr<::tensorflow::mutex_lock>> locks_;
};

class FusedUpdateKernelBase : public EmbeddingBagKernelBase {
 public:
  explicit FusedUpdateKernelBase(::tensorflow::OpKernelConstruction* ctx) : EmbeddingBagKernelBase(ctx, false) {
    std::string optimizer;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("optimizer", &optimizer));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_state", &num_state_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &opt_.epsilon));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("beta_1", &opt_.beta_1));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("beta_2", &opt_.beta_2));
    const int want = optimizer == "adam" ? 2 : optimizer == "rowwise_adagrad" ? 1 : 0;
    opt_.kind = optimizer == "adam" ? PKM_OPT_ADAM : optimizer == "rowwise_adagrad" ? PKM_OPT_ROWWISE_ADAGRAD : PKM_OPT_SGD;
    OP_REQUIRES(ctx, num_state_ == want,
                ::tensorflow::errors::InvalidArgument(optimizer, " takes ", want, " state variables, got ", num_state_));
  }

 protected:
  // Locks the variables, checks every shape, and fills the core arguments
  // (table = the variable's buffer) and the optimizer descriptor.
  ::tensorflow::Status Prepare(::tensorflow::OpKernelContext* ctx, const LockedVariables::CopyFn& copy,
                               LockedVariables* vars, CoreArgs* args, PkmRowOptimizer* opt,
                               ::tensorflow::Tensor** d_weights) {
    using ::tensorflow::errors::InvalidArgument;
    std::vector<int> inputs = {kFusedTableInput};
    for (int i = 0; i < num_state_; ++i) inputs.push_back(kFusedFirstStateInput + i);
    TF_RETURN_IF_ERROR(vars->Lock(ctx, inputs, copy));
    const ::tensorflow::Tensor* table = vars->tensor(0);
    if (table->dtype() != ::tensorflow::DT_FLOAT)
      return InvalidArgument("the table variable must be float32, got ", ::tensorflow::DataTypeString(table->dtype()));
    TF_RETURN_IF_ERROR(BuildGradCoreArgs(ctx, attrs_, args, table));
    const int64_t rows = table->dim_size(0), dim = table->dim_size(1);
    *opt = opt_;
    for (int i = 0; i < num_state_; ++i) {
      ::tensorflow::Tensor* s = vars->tensor(1 + i);
      const ::tensorflow::TensorShape want = opt_.kind == PKM_OPT_ADAM ? ::tensorflow::TensorShape({rows, dim})
                                                                       : ::tensorflow::TensorShape({rows});
      if (s->dtype() != ::tensorflow::DT_FLOAT || s->shape() != want)
        return InvalidArgument("optimizer state ", i, " must be float32 ", want.DebugString(), ", got ",
                               ::tensorflow::DataTypeString(s->dtype()), " ", s->shape().DebugString());
      (i == 0 ? opt->state0 : opt->state1) = static_cast<float*>(s->data());
    }
    const int lr_input = kFusedFirstStateInput + num_state_;
    const ::tensorflow::Tensor& lr = ctx->input(lr_input);
    const ::tensorflow::Tensor& step = ctx->input(lr_input + 1);
    if (lr.NumElements() != 1 || step.NumElements() != 1)
      return InvalidArgument("learning_rate and step must be scalars");
    opt->learning_rate = lr.flat<float>()(0);
    opt->step = step.flat<int64_t>()(0);
    return ctx->allocate_output(0, args->weights->shape(), d_weights);
  }

 private:
  PkmRowOptimizer opt_{};
  int num_state_ = 0;
};

}  // namespace pkm_tf

#endif  // PKM_KERNELS_TF_FUSED_OPTIMIZER_COMMON_H_
