// torch.library binding of pipegoose's gated RMSNorm kernels (pipegoose/kernels/csrc/rms_norm_gated.cu).
// Schemas: docs/architecture.md, "Op schemas", Ours. The entry points check every argument themselves.
//
// rms_norm_gated (the op the Python layer calls): the forward kernel with its autograd formula in C++
// (norm_autograd.h, as rms_norm's), registered for the Autograd key; below autograd (inference mode) the forward alone.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "norm_autograd.h"

std::tuple<at::Tensor, at::Tensor> rms_norm_gated_forward_cuda(const at::Tensor& input, const at::Tensor& gate,
                                                               const std::optional<at::Tensor>& weight, double eps,
                                                               int64_t group_size, bool norm_before_gate,
                                                               std::optional<at::ScalarType> out_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_gated_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& gate,
    const std::optional<at::Tensor>& weight, const at::Tensor& rstd, int64_t group_size, bool norm_before_gate,
    bool weight_grad);

namespace {

namespace na = pipegoose::norm_autograd;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const std::optional<at::Tensor>&, double, int64_t, bool,
                                                      std::optional<at::ScalarType>);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, const std::optional<at::Tensor>&,
                                                                   const at::Tensor&, int64_t, bool, bool);

// The kernel's numerics as PyTorch ops, differentiable (used for a double backward): in fp32, over groups of
// group_size values of the last dimension, x * rstd(x) * w * silu(g) (norm before gate) or z * rstd(z) * w with
// z = x * silu(g), rounded once to `out` (the Python reference of the op's kernel numerics:
// rms_norm_gated_kernel_math in pipegoose/nn/fusion/ops/rms_norm_gated.py).
at::Tensor reference(const at::Tensor& x, const at::Tensor& g, const at::Tensor& w, double eps, int64_t group,
                     bool norm_first, at::ScalarType out) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor s = at::silu(g.to(at::kFloat));
  const at::Tensor v = norm_first ? xf : xf * s;
  const int64_t d = x.size(-1);
  const at::Tensor vg = v.unflatten(-1, {d / group, group});
  at::Tensor n = (vg * at::rsqrt(vg.pow(2).mean({-1}, /*keepdim=*/true) + eps)).flatten(-2);
  if (w.defined()) n = n * w.to(at::kFloat);
  if (norm_first) n = n * s;
  return n.to(out);
}

}  // namespace

namespace pipegoose {

// The autograd formula of pipegoose::rms_norm_gated (its graph node: CppNode<pipegoose::RMSNormGatedFunction>).
struct RMSNormGatedFunction : public torch::autograd::Function<RMSNormGatedFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& gate,
                            const std::optional<at::Tensor>& weight, double eps, int64_t group_size,
                            bool norm_before_gate, std::optional<at::ScalarType> out_dtype) {
    static const auto op = na::op_handle<ForwardSig>("pipegoose::rms_norm_gated_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, rstd] = op.call(input, gate, weight, eps, group_size, norm_before_gate, out_dtype);
    ctx->save_for_backward({input, gate, na::or_undefined(weight), rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["group"] = group_size;
    ctx->saved_data["norm_first"] = norm_before_gate;
    ctx->saved_data["out"] = y.scalar_type();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &g = saved[1], &w = saved[2];
    const at::Tensor& dy = grads[0];
    const int64_t group = ctx->saved_data["group"].toInt();
    const bool norm_first = ctx->saved_data["norm_first"].toBool();
    const bool nw = w.defined() && ctx->needs_input_grad(2);
    const at::Tensor none;
    if (at::GradMode::is_enabled()) {  // create_graph=True: gradients that are differentiable again
      const double eps = ctx->saved_data["eps"].toDouble();
      const auto out = ctx->saved_data["out"].toScalarType();
      auto d = na::grads_through([&] { return reference(x, g, w, eps, group, norm_first, out); }, {x, g, w},
                                 {ctx->needs_input_grad(0), ctx->needs_input_grad(1), nw}, dy);
      return {d[0], d[1], d[2], none, none, none, none};
    }
    static const auto op = na::op_handle<BackwardSig>("pipegoose::rms_norm_gated_backward");
    at::AutoDispatchBelowADInplaceOrView below;
    // one launch gives both grad_input and grad_gate; a frozen weight's gradient is not computed
    auto [gx, gg, gw] = op.call(dy, x, g, na::or_none(w), saved[3], group, norm_first, nw);
    return {ctx->needs_input_grad(0) ? gx : none, ctx->needs_input_grad(1) ? gg : none, nw ? gw : none,
            none, none, none, none};
  }
};

}  // namespace pipegoose

namespace {

at::Tensor rms_norm_gated_autograd(const at::Tensor& input, const at::Tensor& gate,
                                   const std::optional<at::Tensor>& weight, double eps, int64_t group_size,
                                   bool norm_before_gate, std::optional<at::ScalarType> out_dtype) {
  return pipegoose::RMSNormGatedFunction::apply(input, gate, weight, eps, group_size, norm_before_gate, out_dtype);
}

at::Tensor rms_norm_gated_cuda(const at::Tensor& input, const at::Tensor& gate,
                               const std::optional<at::Tensor>& weight, double eps, int64_t group_size,
                               bool norm_before_gate, std::optional<at::ScalarType> out_dtype) {
  return std::get<0>(rms_norm_gated_forward_cuda(input, gate, weight, eps, group_size, norm_before_gate, out_dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("rms_norm_gated_forward(Tensor input, Tensor gate, Tensor? weight, float eps, int group_size, "
        "bool norm_before_gate, ScalarType? out_dtype) -> (Tensor output, Tensor rstd)");
  m.def("rms_norm_gated_backward(Tensor grad_output, Tensor input, Tensor gate, Tensor? weight, Tensor rstd, "
        "int group_size, bool norm_before_gate, bool weight_grad=True) "
        "-> (Tensor grad_input, Tensor grad_gate, Tensor grad_weight)");
  m.def("rms_norm_gated(Tensor input, Tensor gate, Tensor? weight, float eps, int group_size, bool norm_before_gate, "
        "ScalarType? out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("rms_norm_gated_forward", &rms_norm_gated_forward_cuda);
  m.impl("rms_norm_gated_backward", &rms_norm_gated_backward_cuda);
  m.impl("rms_norm_gated", &rms_norm_gated_cuda);
}

TORCH_LIBRARY_IMPL(pipegoose, Autograd, m) { m.impl("rms_norm_gated", &rms_norm_gated_autograd); }
