// A TensorFlow custom op for tests/compat/test_compat_tensorflow.py: y = x * 2 + 3 (float32, any shape).
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"

using namespace tensorflow;

REGISTER_OP("CompatDoublePlusThree")
    .Input("x: float")
    .Output("y: float")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);

class CompatDoublePlusThreeOp : public OpKernel {
 public:
  explicit CompatDoublePlusThreeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    auto in = x.flat<float>();
    auto out = y->flat<float>();
    for (int64_t i = 0; i < in.size(); ++i) out(i) = in(i) * 2.0f + 3.0f;
  }
};

REGISTER_KERNEL_BUILDER(Name("CompatDoublePlusThree").Device(DEVICE_CPU), CompatDoublePlusThreeOp);
