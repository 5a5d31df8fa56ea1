// torch.library binding of pipegoose's SwiGLU kernels (pipegoose/kernels/csrc/swiglu.cu).
// Schemas: docs/architecture.md, "Op schemas", Ours. The entry points check every argument themselves.
//
// swiglu (the op the Python layer calls): the forward kernel with its autograd formula in C++, registered for the
// Autograd key (no Python in the backward, as for the norms: norm_autograd.h says why); below autograd (inference
// mode) the forward alone. It saves gate and up, not the product: the backward recomputes sigmoid(gate).
// silu_and_mul (gate and up as the two halves of x's last dimension): the same, saving x; its backward returns the
// gradient of x in one tensor.
// geglu (GELU for SiLU, Gemma's MLP; approximate "tanh" or "none" as F.gelu): as swiglu, saving gate, up and the
// approximation.
// gelu_and_mul (geglu's activation, gate and up as the two halves of x; Gemma 4's MoE experts): as silu_and_mul,
// saving x and the approximation.
// gelu (GELU alone: the MLPs without a gate, GPT-2's gelu_new, Bloom's BloomGelu): the forward kernel, saving x and
// the approximation (as F.gelu's autograd does).
// squared_relu (relu(x)^2 alone: transformers' relu2, Nemotron's, Persimmon's, Arcee's MLPs): as silu_and_mul, saving
// x (eager PyTorch saves relu(x), of the same size).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "norm_autograd.h"

namespace pipegoose {
at::Tensor swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                        const at::Tensor& up);
at::Tensor silu_and_mul_forward_cuda(const at::Tensor& x);
at::Tensor silu_and_mul_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x);
at::Tensor geglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate);
std::tuple<at::Tensor, at::Tensor> geglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up, c10::string_view approximate);
at::Tensor gelu_and_mul_forward_cuda(const at::Tensor& x, c10::string_view approximate);
at::Tensor gelu_and_mul_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x,
                                      c10::string_view approximate);
at::Tensor gelu_forward_cuda(const at::Tensor& x, c10::string_view approximate);
at::Tensor gelu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x, c10::string_view approximate);
at::Tensor squared_relu_forward_cuda(const at::Tensor& x);
at::Tensor squared_relu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x);
}  // namespace pipegoose

namespace {

namespace na = pipegoose::norm_autograd;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using PackedForwardSig = at::Tensor(const at::Tensor&);
using PackedBackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using GegluForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view);
using GegluBackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                            c10::string_view);
using GeluPackedForwardSig = at::Tensor(const at::Tensor&, c10::string_view);
using GeluPackedBackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view);

// The kernel's numerics as PyTorch ops: silu(gate) * up in fp32, rounded once to gate's dtype (the Python reference,
// swiglu_reference in pipegoose/nn/fusion/ops/swiglu.py). Differentiable (used for a double backward).
at::Tensor reference(const at::Tensor& gate, const at::Tensor& up) {
  return (at::silu(gate.to(at::kFloat)) * up.to(at::kFloat)).to(gate.scalar_type());
}

// silu_and_mul's numerics as PyTorch ops: the reference above of x's two halves (silu_and_mul_reference in
// pipegoose/nn/fusion/ops/swiglu.py).
at::Tensor packed_reference(const at::Tensor& x) {
  const auto halves = x.chunk(2, -1);
  return reference(halves[0], halves[1]);
}

// squared_relu's numerics as PyTorch ops: relu(x) squared in x's dtype (one rounding, as the kernel's; the Python
// reference, squared_relu_reference). Differentiable (used for a double backward).
at::Tensor squared_relu_reference(const at::Tensor& x) { return at::square(at::relu(x)); }

// geglu's numerics as PyTorch ops: gelu(gate, approximate) * up in fp32, rounded once to gate's dtype (the Python
// reference of op geglu's kernel numerics). Differentiable (used for a double backward).
at::Tensor geglu_reference(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  return (at::gelu(gate.to(at::kFloat), approximate) * up.to(at::kFloat)).to(gate.scalar_type());
}

// gelu's numerics as PyTorch ops: gelu(x, approximate) in fp32, rounded once to x's dtype (the Python reference of
// op gelu's kernel numerics). Differentiable (used for a double backward).
at::Tensor gelu_reference(const at::Tensor& x, c10::string_view approximate) {
  return at::gelu(x.to(at::kFloat), approximate).to(x.scalar_type());
}

// gelu_and_mul's numerics as PyTorch ops: geglu's reference of x's two halves.
at::Tensor gelu_packed_reference(const at::Tensor& x, c10::string_view approximate) {
  const auto halves = x.chunk(2, -1);
  return geglu_reference(halves[0], halves[1], approximate);
}

}  // namespace

namespace pipegoose {

// The autograd formula of pipegoose::swiglu (its graph node: torch::autograd::CppNode<pipegoose::SwiGLUFunction>).
struct SwiGLUFunction : public torch::autograd::Function<SwiGLUFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    static const auto op = na::op_handle<ForwardSig>("pipegoose::swiglu_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor y = op.call(gate, up);
    ctx->save_for_backward({gate, up});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1];
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor(), at::Tensor()};
    if (at::GradMode::is_enabled()) {  // create_graph=True: gradients that are differentiable again
      return na::grads_through([&] { return reference(g, u); }, {g, u},
                               {ctx->needs_input_grad(0), ctx->needs_input_grad(1)}, dy);
    }
    static const auto op = na::op_handle<BackwardSig>("pipegoose::swiglu_backward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [dg, du] = op.call(dy, g, u);
    return {ctx->needs_input_grad(0) ? dg : at::Tensor(), ctx->needs_input_grad(1) ? du : at::Tensor()};
  }
};

// The autograd formula of the ops of one input and no other argument, silu_and_mul and squared_relu (graph nodes
// torch::autograd::CppNode<pipegoose::SiluAndMulFunction>, CppNode<pipegoose::SquaredReluFunction>): Derived names its
// forward and backward ops (kForward, kBackward) and its PyTorch reference (reference, for a double backward).
template <typename Derived>
struct OneInputFunction : public torch::autograd::Function<Derived> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    static const auto op = na::op_handle<PackedForwardSig>(Derived::kForward);
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor y = op.call(x);
    ctx->save_for_backward({x});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor()};
    if (at::GradMode::is_enabled()) {  // create_graph=True: a gradient that is differentiable again
      return na::grads_through([&] { return Derived::reference(x); }, {x}, {ctx->needs_input_grad(0)}, dy);
    }
    static const auto op = na::op_handle<PackedBackwardSig>(Derived::kBackward);
    at::AutoDispatchBelowADInplaceOrView below;
    return {op.call(dy, x)};
  }
};

struct SiluAndMulFunction : public OneInputFunction<SiluAndMulFunction> {
  static constexpr const char* kForward = "pipegoose::silu_and_mul_forward";
  static constexpr const char* kBackward = "pipegoose::silu_and_mul_backward";
  static at::Tensor reference(const at::Tensor& x) { return packed_reference(x); }
};

struct SquaredReluFunction : public OneInputFunction<SquaredReluFunction> {
  static constexpr const char* kForward = "pipegoose::squared_relu_forward";
  static constexpr const char* kBackward = "pipegoose::squared_relu_backward";
  static at::Tensor reference(const at::Tensor& x) { return squared_relu_reference(x); }
};

// The autograd formula of pipegoose::geglu (graph node torch::autograd::CppNode<pipegoose::GeGLUFunction>).
struct GeGLUFunction : public torch::autograd::Function<GeGLUFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            c10::string_view approximate) {
    static const auto op = na::op_handle<GegluForwardSig>("pipegoose::geglu_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor y = op.call(gate, up, approximate);   // (checks approximate before anything is saved)
    ctx->save_for_backward({gate, up});
    ctx->saved_data["approximate"] = std::string(approximate);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1];
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    if (at::GradMode::is_enabled()) {  // create_graph=True: gradients that are differentiable again
      auto gs = na::grads_through([&] { return geglu_reference(g, u, approximate); }, {g, u},
                                  {ctx->needs_input_grad(0), ctx->needs_input_grad(1)}, dy);
      return {gs[0], gs[1], at::Tensor()};
    }
    static const auto op = na::op_handle<GegluBackwardSig>("pipegoose::geglu_backward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [dg, du] = op.call(dy, g, u, approximate);
    return {ctx->needs_input_grad(0) ? dg : at::Tensor(), ctx->needs_input_grad(1) ? du : at::Tensor(), at::Tensor()};
  }
};

// The autograd formula of the ops of one input and an approximation, gelu_and_mul and gelu (graph nodes
// torch::autograd::CppNode<pipegoose::GeluAndMulFunction>, CppNode<pipegoose::GeluFunction>): Derived names its
// forward and backward ops (kForward, kBackward) and its PyTorch reference (reference, for a double backward).
template <typename Derived>
struct OneInputGeluFunction : public torch::autograd::Function<Derived> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::string_view approximate) {
    static const auto op = na::op_handle<GeluPackedForwardSig>(Derived::kForward);
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor y = op.call(x, approximate);   // (checks approximate before anything is saved)
    ctx->save_for_backward({x});
    ctx->saved_data["approximate"] = std::string(approximate);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor(), at::Tensor()};
    if (at::GradMode::is_enabled()) {  // create_graph=True: a gradient that is differentiable again
      auto gs = na::grads_through([&] { return Derived::reference(x, approximate); }, {x},
                                  {ctx->needs_input_grad(0)}, dy);
      return {gs[0], at::Tensor()};
    }
    static const auto op = na::op_handle<GeluPackedBackwardSig>(Derived::kBackward);
    at::AutoDispatchBelowADInplaceOrView below;
    return {op.call(dy, x, approximate), at::Tensor()};
  }
};

struct GeluAndMulFunction : public OneInputGeluFunction<GeluAndMulFunction> {
  static constexpr const char* kForward = "pipegoose::gelu_and_mul_forward";
  static constexpr const char* kBackward = "pipegoose::gelu_and_mul_backward";
  static at::Tensor reference(const at::Tensor& x, c10::string_view a) { return gelu_packed_reference(x, a); }
};

struct GeluFunction : public OneInputGeluFunction<GeluFunction> {
  static constexpr const char* kForward = "pipegoose::gelu_forward";
  static constexpr const char* kBackward = "pipegoose::gelu_backward";
  static at::Tensor reference(const at::Tensor& x, c10::string_view a) { return gelu_reference(x, a); }
};

}  // namespace pipegoose

namespace {

at::Tensor gelu_autograd(const at::Tensor& x, c10::string_view approximate) {
  return pipegoose::GeluFunction::apply(x, approximate);
}

at::Tensor swiglu_autograd(const at::Tensor& gate, const at::Tensor& up) {
  return pipegoose::SwiGLUFunction::apply(gate, up);
}

at::Tensor silu_and_mul_autograd(const at::Tensor& x) { return pipegoose::SiluAndMulFunction::apply(x); }

at::Tensor squared_relu_autograd(const at::Tensor& x) { return pipegoose::SquaredReluFunction::apply(x); }

at::Tensor geglu_autograd(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  return pipegoose::GeGLUFunction::apply(gate, up, approximate);
}

at::Tensor gelu_and_mul_autograd(const at::Tensor& x, c10::string_view approximate) {
  return pipegoose::GeluAndMulFunction::apply(x, approximate);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("swiglu_forward(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad_output, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_and_mul_forward(Tensor x) -> Tensor");
  m.def("silu_and_mul_backward(Tensor grad_output, Tensor x) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("geglu_forward(Tensor gate, Tensor up, str approximate='tanh') -> Tensor");
  m.def("geglu_backward(Tensor grad_output, Tensor gate, Tensor up, str approximate='tanh') -> "
        "(Tensor grad_gate, Tensor grad_up)");
  m.def("geglu(Tensor gate, Tensor up, str approximate='tanh') -> Tensor");
  m.def("gelu_and_mul_forward(Tensor x, str approximate='tanh') -> Tensor");
  m.def("gelu_and_mul_backward(Tensor grad_output, Tensor x, str approximate='tanh') -> Tensor");
  m.def("gelu_and_mul(Tensor x, str approximate='tanh') -> Tensor");
  m.def("gelu_forward(Tensor x, str approximate='none') -> Tensor");
  m.def("gelu_backward(Tensor grad_output, Tensor x, str approximate='none') -> Tensor");
  m.def("gelu(Tensor x, str approximate='none') -> Tensor");
  m.def("squared_relu_forward(Tensor x) -> Tensor");
  m.def("squared_relu_backward(Tensor grad_output, Tensor x) -> Tensor");
  m.def("squared_relu(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("swiglu_forward", &pipegoose::swiglu_forward_cuda);
  m.impl("swiglu_backward", &pipegoose::swiglu_backward_cuda);
  m.impl("swiglu", &pipegoose::swiglu_forward_cuda);
  m.impl("silu_and_mul_forward", &pipegoose::silu_and_mul_forward_cuda);
  m.impl("silu_and_mul_backward", &pipegoose::silu_and_mul_backward_cuda);
  m.impl("silu_and_mul", &pipegoose::silu_and_mul_forward_cuda);
  m.impl("geglu_forward", &pipegoose::geglu_forward_cuda);
  m.impl("geglu_backward", &pipegoose::geglu_backward_cuda);
  m.impl("geglu", &pipegoose::geglu_forward_cuda);
  m.impl("gelu_and_mul_forward", &pipegoose::gelu_and_mul_forward_cuda);
  m.impl("gelu_and_mul_backward", &pipegoose::gelu_and_mul_backward_cuda);
  m.impl("gelu_and_mul", &pipegoose::gelu_and_mul_forward_cuda);
  m.impl("gelu_forward", &pipegoose::gelu_forward_cuda);
  m.impl("gelu_backward", &pipegoose::gelu_backward_cuda);
  m.impl("gelu", &pipegoose::gelu_forward_cuda);
  m.impl("squared_relu_forward", &pipegoose::squared_relu_forward_cuda);
  m.impl("squared_relu_backward", &pipegoose::squared_relu_backward_cuda);
  m.impl("squared_relu", &pipegoose::squared_relu_forward_cuda);
}

TORCH_LIBRARY_IMPL(pipegoose, Autograd, m) {
  m.impl("swiglu", &swiglu_autograd);
  m.impl("silu_and_mul", &silu_and_mul_autograd);
  m.impl("geglu", &geglu_autograd);
  m.impl("gelu_and_mul", &gelu_and_mul_autograd);
  m.impl("gelu", &gelu_autograd);
  m.impl("squared_relu", &squared_relu_autograd);
}
