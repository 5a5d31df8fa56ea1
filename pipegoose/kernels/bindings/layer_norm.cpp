// torch.library binding of pipegoose's LayerNorm kernels (pipegoose/kernels/csrc/layer_norm.cu).
// Schemas: docs/architecture.md, "Op schemas", Ours. The entry points check every argument themselves.
//
// layer_norm (the op the Python layer calls): the forward kernel with its autograd formula in C++ (norm_autograd.h),
// registered for the Autograd key; below autograd (inference mode) the forward alone.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "norm_autograd.h"

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, std::optional<at::ScalarType> out_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd, bool weight_grad,
    bool bias_grad);

namespace {

namespace na = pipegoose::norm_autograd;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                                  const std::optional<at::Tensor>&, double,
                                                                  std::optional<at::ScalarType>);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                   const std::optional<at::Tensor>&,
                                                                   const std::optional<at::Tensor>&, const at::Tensor&,
                                                                   const at::Tensor&, bool, bool);

// The kernel's numerics as PyTorch ops: F.layer_norm of x as it is when input, parameters and `out` share its dtype;
// otherwise in fp32 from the uncast x and parameters (upcasts are exact), rounded once to `out`, as the kernel does
// (the Python layer's reference, layer_norm_reference in pipegoose/nn/fusion/ops/layer_norm.py, casts x to `out`
// first; its callers pass x already in `out`, where the two agree). Differentiable (used for a double backward).
at::Tensor reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps, at::ScalarType out) {
  const auto t = x.scalar_type();
  const std::vector<int64_t> shape{x.size(-1)};
  const bool same = out == t && (!w.defined() || w.scalar_type() == t) && (!b.defined() || b.scalar_type() == t);
  if (same) return at::layer_norm(x, shape, w, b, eps);
  auto f32 = [](const at::Tensor& p) { return p.defined() ? p.to(at::kFloat) : p; };
  return at::layer_norm(x.to(at::kFloat), shape, f32(w), f32(b), eps).to(out);
}

}  // namespace

namespace pipegoose {

// The autograd formula of pipegoose::layer_norm (graph node: torch::autograd::CppNode<pipegoose::LayerNormFunction>).
struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, double eps,
                            std::optional<at::ScalarType> out_dtype) {
    static const auto op = na::op_handle<ForwardSig>("pipegoose::layer_norm_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, mean, rstd] = op.call(input, weight, bias, eps, out_dtype);
    // the inputs themselves are saved: a double backward differentiates through them
    ctx->save_for_backward({input, na::or_undefined(weight), na::or_undefined(bias), mean, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["out"] = y.scalar_type();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &b = saved[2];
    const at::Tensor& dy = grads[0];
    // the graph's edges are those of the defined inputs, in order: x, then weight and bias where given
    const bool nw = w.defined() && ctx->needs_input_grad(1);
    const bool nb = b.defined() && ctx->needs_input_grad(w.defined() ? 2 : 1);
    if (at::GradMode::is_enabled()) {  // create_graph=True: gradients that are differentiable again
      const double eps = ctx->saved_data["eps"].toDouble();
      const auto out = ctx->saved_data["out"].toScalarType();
      auto g = na::grads_through([&] { return reference(x, w, b, eps, out); }, {x, w, b},
                                 {ctx->needs_input_grad(0), nw, nb}, dy);
      return {g[0], g[1], g[2], at::Tensor(), at::Tensor()};
    }
    static const auto op = na::op_handle<BackwardSig>("pipegoose::layer_norm_backward");
    at::AutoDispatchBelowADInplaceOrView below;
    // a frozen parameter's gradient is not computed (no partial sums, no column reduction)
    auto [gi, gw, gb] = op.call(dy, x, na::or_none(w), na::or_none(b), saved[3], saved[4], nw, nb);
    return {gi, nw ? gw : at::Tensor(), nb ? gb : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace pipegoose

namespace {

at::Tensor layer_norm_autograd(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps,
                               std::optional<at::ScalarType> out_dtype) {
  return pipegoose::LayerNormFunction::apply(input, weight, bias, eps, out_dtype);
}

at::Tensor layer_norm_cuda(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps, std::optional<at::ScalarType> out_dtype) {
  return std::get<0>(layer_norm_forward_cuda(input, weight, bias, eps, out_dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("layer_norm_forward(Tensor input, Tensor? weight, Tensor? bias, float eps, ScalarType? out_dtype) "
        "-> (Tensor output, Tensor mean, Tensor rstd)");
  m.def("layer_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias, Tensor mean, "
        "Tensor rstd, bool weight_grad=True, bool bias_grad=True) -> (Tensor grad_input, Tensor grad_weight, "
        "Tensor grad_bias)");
  m.def("layer_norm(Tensor input, Tensor? weight, Tensor? bias, float eps, ScalarType? out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_cuda);
  m.impl("layer_norm_backward", &layer_norm_backward_cuda);
  m.impl("layer_norm", &layer_norm_cuda);
}

TORCH_LIBRARY_IMPL(pipegoose, Autograd, m) { m.impl("layer_norm", &layer_norm_autograd); }
