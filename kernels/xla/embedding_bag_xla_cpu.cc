// The XLA CPU side of the op library: the lowering registered for
// XLA_CPU_JIT, the Host handlers of embedding_bag_xla_cpu_targets.cc
// registered with TF's XLA, and PkmCheckThen (below).
#include <string>
#include <string_view>

#include "kernels/xla/embedding_bag_xla_lowering.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

PKM_REGISTER_XLA_PLATFORM(cpu, "Host", ::tensorflow::DEVICE_CPU_XLA_JIT);

// Marker read by pkm_serve (ctypes): this library lowers the ops for XLA's
// CPU backend. The GPU library also exports pkm_xla_has_gpu_target.
extern "C" __attribute__((visibility("default"))) int pkm_xla_has_cpu_target() { return 1; }

// ---- PkmCheckThen: a run-time check that XLA keeps ----
// XLA drops tf.debugging.Assert: a compiled function cannot fail but through a
// custom call's error. pkm_serve checks what only the run can tell (ragged
// weights' row partition, weights' dynamic sizes) with this op under XLA on
// the CPU: `value`, after an InvalidArgument(message) where `condition` (a
// scalar) is false, outside XLA and (as a side-effecting custom call into
// pkm_check below) inside it.
REGISTER_OP("PkmCheckThen")
    .Input("condition: bool")
    .Input("value: T")
    .Output("output: T")
    .Attr("T: type")
    .Attr("message: string")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return ::tensorflow::Status();
    })
    .Doc("value, after failing with InvalidArgument(message) where condition is false.");

namespace pkm_xla {
namespace {

inline constexpr char kCheckTarget[] = "pkm_check";

class CheckThenKernel : public ::tensorflow::OpKernel {
 public:
  explicit CheckThenKernel(::tensorflow::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("message", &message_));
  }
  void Compute(::tensorflow::OpKernelContext* ctx) override {
    const ::tensorflow::Tensor& condition = ctx->input(0);
    OP_REQUIRES(ctx, condition.NumElements() == 1,
                ::tensorflow::errors::InvalidArgument("PkmCheckThen: condition must be a scalar"));
    OP_REQUIRES(ctx, condition.flat<bool>()(0), ::tensorflow::errors::InvalidArgument(message_));
    ctx->set_output(0, ctx->input(1));
  }

 private:
  std::string message_;
};

// The message as an MLIR string attribute (the typed FFI's backend config).
std::string Quoted(const std::string& text) {
  std::string quoted = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') quoted += '\\';
    quoted += (ch == '\n' ? ' ' : ch);
  }
  return quoted + "\"";
}

class CheckThenLowering : public ::tensorflow::XlaOpKernel {
 public:
  explicit CheckThenLowering(::tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("message", &message_));
  }
  void Compile(::tensorflow::XlaOpKernelContext* ctx) override {
    OP_REQUIRES(ctx, ctx->InputShape(0).num_elements() == 1,
                ::tensorflow::errors::InvalidArgument("PkmCheckThen: condition must be a scalar"));
    const xla::XlaOp condition = xla::Reshape(ctx->Input(0), {});
    // Side-effecting: XLA keeps it though nothing reads its (empty) result.
    xla::CustomCallWithLayout(ctx->builder(), kCheckTarget, {condition},
                              xla::ShapeUtil::MakeShapeWithDescendingLayout(xla::PRED, {0}),
                              {xla::ShapeUtil::MakeShapeWithDescendingLayout(xla::PRED, {})},
                              "{message = " + Quoted(message_) + "}", /*has_side_effect=*/true,
                              /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
                              xla::CustomCallSchedule::SCHEDULE_NONE,
                              xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    ctx->SetOutput(0, ctx->Input(1));
  }

 private:
  std::string message_;
};

// Under XLA for the GPU the check is dropped, as XLA drops tf.debugging.Assert
// (there is no pkm_check target there): a SavedModel traced under jit_compile on
// the CPU, which holds this op, still compiles for the GPU, as before the op.
class CheckDroppedLowering : public ::tensorflow::XlaOpKernel {
 public:
  explicit CheckDroppedLowering(::tensorflow::OpKernelConstruction* ctx) : XlaOpKernel(ctx) {}
  void Compile(::tensorflow::XlaOpKernelContext* ctx) override { ctx->SetOutput(0, ctx->Input(1)); }
};

::xla::ffi::Error Check(::xla::ffi::Buffer<::xla::ffi::PRED> condition, ::xla::ffi::Result<::xla::ffi::AnyBuffer>,
                        std::string_view message) {
  if (condition.typed_data()[0]) return ::xla::ffi::Error::Success();
  return ::xla::ffi::Error::InvalidArgument(std::string(message));
}

}  // namespace
}  // namespace pkm_xla

XLA_FFI_DEFINE_HANDLER(pkm_xla_cpu_check, ::pkm_xla::Check,
                       ::xla::ffi::Ffi::Bind()
                           .Arg<::xla::ffi::Buffer<::xla::ffi::PRED>>()
                           .Ret<::xla::ffi::AnyBuffer>()
                           .Attr<std::string_view>("message"));
XLA_FFI_REGISTER_HANDLER(::xla::ffi::GetXlaFfiApi(), ::pkm_xla::kCheckTarget, "Host", pkm_xla_cpu_check);
REGISTER_KERNEL_BUILDER(Name("PkmCheckThen").Device(::tensorflow::DEVICE_CPU).HostMemory("condition"),
                        ::pkm_xla::CheckThenKernel);
REGISTER_XLA_OP(Name("PkmCheckThen").Device(::tensorflow::DEVICE_CPU_XLA_JIT), ::pkm_xla::CheckThenLowering);
REGISTER_XLA_OP(Name("PkmCheckThen").Device(::tensorflow::DEVICE_GPU_XLA_JIT), ::pkm_xla::CheckDroppedLowering);

// See RegisterLoweringsLate (embedding_bag_xla_lowering.h). Called by
// pkm_serve after tf.load_op_library; returns 1 when it had to add the kernels.
extern "C" __attribute__((visibility("default"))) int pkm_xla_register_late() {
  static const int added = [] {
    const char* device = ::tensorflow::DEVICE_CPU_XLA_JIT;
    const int lookups = pkm_xla::RegisterLoweringsLate(device);
    int added_checks = 0;
    // Lives as long as the process, like every static kernel registrar.
    auto add = [&](const char* jit_device, ::tensorflow::OpKernel* (*factory)(::tensorflow::OpKernelConstruction*)) {
      if (pkm_xla::HasKernelFor("PkmCheckThen", jit_device)) return;
      ::tensorflow::KernelDefBuilder def("PkmCheckThen");
      def.Device(jit_device);
      new ::tensorflow::kernel_factory::OpKernelRegistrar(def.Build(), "PkmXlaLowering", factory);
      added_checks = 1;
    };
    add(device, [](::tensorflow::OpKernelConstruction* ctx) -> ::tensorflow::OpKernel* {
      return new pkm_xla::CheckThenLowering(ctx);
    });
    add(::tensorflow::DEVICE_GPU_XLA_JIT, [](::tensorflow::OpKernelConstruction* ctx) -> ::tensorflow::OpKernel* {
      return new pkm_xla::CheckDroppedLowering(ctx);
    });
    return lookups | added_checks;
  }();
  return added;
}
