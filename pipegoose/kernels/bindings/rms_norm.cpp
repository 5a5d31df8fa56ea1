// torch.library binding of pipegoose's RMSNorm kernels (pipegoose/kernels/csrc/rms_norm.cu).
// Schemas: docs/architecture.md, "Op schemas", Ours. The entry points check every argument themselves.
//
// rms_norm (the op the Python layer calls): the forward kernel with its autograd formula in C++ (norm_autograd.h),
// registered for the Autograd key; below autograd (inference mode) the forward alone.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "norm_autograd.h"

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& input,
                                                         const std::optional<at::Tensor>& weight, double eps,
                                                         std::optional<at::ScalarType> out_dtype);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& rstd, bool weight_grad);

namespace {

namespace na = pipegoose::norm_autograd;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&, double,
                                                      std::optional<at::ScalarType>);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const std::optional<at::Tensor>&, const at::Tensor&, bool);

// The kernel's numerics as PyTorch ops: x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded once to `out` (the
// Python reference, rms_norm_reference(..., cast_before_weight=False) in pipegoose/nn/fusion/ops/rms_norm.py, for
// the dtypes the kernels take). Differentiable (used for a double backward).
at::Tensor reference(const at::Tensor& x, const at::Tensor& w, double eps, at::ScalarType out) {
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor xn = xf * at::rsqrt(xf.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  if (w.defined()) xn = xn * w.to(at::kFloat);
  return xn.to(out);
}

}  // namespace

namespace pipegoose {

// The autograd formula of pipegoose::rms_norm (its graph node: torch::autograd::CppNode<pipegoose::RMSNormFunction>).
struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            double eps, std::optional<at::ScalarType> out_dtype) {
    static const auto op = na::op_handle<ForwardSig>("pipegoose::rms_norm_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, rstd] = op.call(input, weight, eps, out_dtype);
    // the inputs themselves are saved: a double backward differentiates through them
    ctx->save_for_backward({input, na::or_undefined(weight), rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["out"] = y.scalar_type();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor& dy = grads[0];
    const bool nw = w.defined() && ctx->needs_input_grad(1);
    if (at::GradMode::is_enabled()) {  // create_graph=True: gradients that are differentiable again
      const double eps = ctx->saved_data["eps"].toDouble();
      const auto out = ctx->saved_data["out"].toScalarType();
      // the graph's edges are those of the defined inputs, in order: x, then the weight where given
      auto g = na::grads_through([&] { return reference(x, w, eps, out); }, {x, w},
                                 {ctx->needs_input_grad(0), nw}, dy);
      return {g[0], g[1], at::Tensor(), at::Tensor()};
    }
    static const auto op = na::op_handle<BackwardSig>("pipegoose::rms_norm_backward");
    at::AutoDispatchBelowADInplaceOrView below;
    // a frozen weight's gradient is not computed (no partial sums, no column reduction)
    auto [gi, gw] = op.call(dy, x, na::or_none(w), saved[2], nw);
    return {gi, nw ? gw : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace pipegoose

namespace {

at::Tensor rms_norm_autograd(const at::Tensor& input, const std::optional<at::Tensor>& weight, double eps,
                             std::optional<at::ScalarType> out_dtype) {
  return pipegoose::RMSNormFunction::apply(input, weight, eps, out_dtype);
}

at::Tensor rms_norm_cuda(const at::Tensor& input, const std::optional<at::Tensor>& weight, double eps,
                         std::optional<at::ScalarType> out_dtype) {
  return std::get<0>(rms_norm_forward_cuda(input, weight, eps, out_dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("rms_norm_forward(Tensor input, Tensor? weight, float eps, ScalarType? out_dtype) "
        "-> (Tensor output, Tensor rstd)");
  m.def("rms_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor rstd, bool weight_grad=True) "
        "-> (Tensor grad_input, Tensor grad_weight)");
  m.def("rms_norm(Tensor input, Tensor? weight, float eps, ScalarType? out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
  m.impl("rms_norm", &rms_norm_cuda);
}

TORCH_LIBRARY_IMPL(pipegoose, Autograd, m) { m.impl("rms_norm", &rms_norm_autograd); }
