// torch.library binding of pipegoose's RoPE kernels (pipegoose/kernels/csrc/rope.cu).
// Schemas: docs/architecture.md, "Op schemas", Ours. The entry points check every argument themselves.
//
// rope (the op the Python layer calls): the forward kernel with its autograd formula in C++, registered for the
// Autograd key (no Python in the backward, as for the norms: norm_autograd.h says why); below autograd (inference
// mode) the forward alone. It saves cos and sin only (the rotation is linear in q and k): the backward rotates the
// output gradients back (with partial rotary, cos and sin narrower than a head, the rest passes through both ways);
// interleaved=True: the rotation of neighbouring pairs (GPT-J's, Cohere's, GLM's), both ways.
// cos and sin get no gradient: with grad mode on, a cos or sin that requires grad is an error (the Python layer sends
// those calls to PyTorch's ops).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../csrc/pipegoose_check.h"
#include "norm_autograd.h"

namespace pipegoose {
std::tuple<at::Tensor, at::Tensor> rope_forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                     const at::Tensor& sin, bool interleaved);
std::tuple<at::Tensor, at::Tensor> rope_backward_cuda(const at::Tensor& grad_q_embed, const at::Tensor& grad_k_embed,
                                                      const at::Tensor& cos, const at::Tensor& sin,
                                                      std::optional<at::ScalarType> dtype, bool interleaved);
}  // namespace pipegoose

namespace {

namespace na = pipegoose::norm_autograd;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, bool);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, std::optional<at::ScalarType>, bool);

// The backward's numerics as PyTorch ops, differentiable (a backward with create_graph=True): the transposed rotation
// of dy's first R = cos.size(-1) values in fp32, g1 = dy1 * c1 + dy2 * s2, g2 = dy2 * c2 - dy1 * s1 (interleaved:
// g[2i] = dy[2i] c[2i] + dy[2i+1] s[2i+1], g[2i+1] = dy[2i+1] c[2i+1] - dy[2i] s[2i]), the rest of each head
// (partial rotary) passed through, rounded once to `dtype` (q's).
at::Tensor rotate_back(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin, at::ScalarType dtype,
                       bool interleaved) {
  const int64_t r = cos.size(-1), half = r / 2, rest = dy.size(-1) - r;
  const at::Tensor d = dy.to(at::kFloat), c = cos.to(at::kFloat).unsqueeze(1), s = sin.to(at::kFloat).unsqueeze(1);
  const at::Tensor dr = d.narrow(-1, 0, r);
  const at::Tensor ds = dr * s;
  at::Tensor rot;
  if (interleaved) {   // ds's pairs (a, b) -> (b, -a)
    const at::Tensor pairs = ds.unflatten(-1, {half, 2});
    rot = dr * c + at::stack({pairs.select(-1, 1), -pairs.select(-1, 0)}, -1).flatten(-2);
  } else {
    rot = dr * c + at::cat({ds.narrow(-1, half, half), -ds.narrow(-1, 0, half)}, -1);
  }
  return (rest > 0 ? at::cat({rot, d.narrow(-1, r, rest)}, -1) : rot).to(dtype);
}

}  // namespace

namespace pipegoose {

// The autograd formula of pipegoose::rope (its graph node: torch::autograd::CppNode<pipegoose::RoPEFunction>).
struct RoPEFunction : public torch::autograd::Function<RoPEFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                               const at::Tensor& sin, bool interleaved) {
    static const auto op = na::op_handle<Sig>("pipegoose::rope_forward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [qe, ke] = op.call(q, k, cos, sin, interleaved);
    ctx->saved_data["interleaved"] = interleaved;
    ctx->set_materialize_grads(false);   // an output left out of the loss: its gradient stays undefined (no zeros)
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["q_sizes"] = q.sizes().vec();
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(q.scalar_type());   // the gradients' (cos's may be fp32)
    return {qe, ke};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &cos = saved[0], &sin = saved[1];
    at::Tensor dq = grads[0], dk = grads[1];
    const bool want_q = ctx->needs_input_grad(0) && dq.defined();
    const bool want_k = ctx->needs_input_grad(1) && dk.defined();
    if (!want_q && !want_k) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    if (at::GradMode::is_enabled()) {  // create_graph=True: gradients that are differentiable again
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      return {want_q ? rotate_back(dq, cos, sin, dtype, interleaved) : at::Tensor(),
              want_k ? rotate_back(dk, cos, sin, dtype, interleaved) : at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor()};
    }
    // a side whose input gets no gradient (its output not used in the loss, or its input not requiring one) goes to
    // the kernel with no heads: no work
    auto no_heads = [&](const char* key) {
      std::vector<int64_t> sizes = ctx->saved_data[key].toIntVector();
      sizes[1] = 0;
      return at::empty(sizes, cos.options());
    };
    if (!want_q) dq = no_heads("q_sizes");
    if (!want_k) dk = no_heads("k_sizes");
    static const auto op = na::op_handle<BackwardSig>("pipegoose::rope_backward");
    at::AutoDispatchBelowADInplaceOrView below;
    auto [gq, gk] = op.call(dq, dk, cos, sin, dtype, interleaved);
    return {want_q ? gq : at::Tensor(), want_k ? gk : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace pipegoose

namespace {

std::tuple<at::Tensor, at::Tensor> rope_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                 const at::Tensor& sin, bool interleaved) {
  PG_CHECK(!(at::GradMode::is_enabled() && ((cos.defined() && cos.requires_grad()) ||
                                            (sin.defined() && sin.requires_grad()))),
           "pipegoose::rope: cos and sin must not require grad (the kernel gives them no gradient); use PyTorch's "
           "ops (pipegoose.nn.fusion.functional.apply_rotary_pos_emb sends such calls there)");
  auto out = pipegoose::RoPEFunction::apply(q, k, cos, sin, interleaved);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("rope_forward(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False) -> "
        "(Tensor q_embed, Tensor k_embed)");
  m.def("rope_backward(Tensor grad_q_embed, Tensor grad_k_embed, Tensor cos, Tensor sin, ScalarType? dtype=None, "
        "bool interleaved=False) -> (Tensor grad_q, Tensor grad_k)");
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False) -> (Tensor q_embed, Tensor k_embed)");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("rope_forward", &pipegoose::rope_forward_cuda);
  m.impl("rope_backward", &pipegoose::rope_backward_cuda);
  m.impl("rope", &pipegoose::rope_forward_cuda);
}

TORCH_LIBRARY_IMPL(pipegoose, Autograd, m) { m.impl("rope", &rope_autograd); }
