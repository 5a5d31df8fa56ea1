// Autograd in C++ for pipegoose's norm ops (pipegoose::layer_norm, pipegoose::rms_norm; bindings layer_norm.cpp and
// rms_norm.cpp): what the two formulas share. Written in this project (MIT).
//
// Why C++: at the sizes of mid-size models (a LayerNorm of 3-6 M elements) a training step is bound by the host, and
// the Python path (a torch.autograd.Function) cost 22-48 us more host time per forward, and 85-127 us more per
// forward + backward, than nn.LayerNorm on the H200's host (4096-16384 x 768 bf16); with these Functions the excess
// per forward + backward was 56-62 us (benchmarks/results/nvidia_h200_2026-11-30/session21.log, calls 1 and 4). A C++ Function runs its
// backward on the autograd engine's thread without the GIL.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <cstddef>
#include <vector>

namespace pipegoose {
namespace norm_autograd {

// The gradients of ref() with respect to inputs[i] where needs[i] (undefined for the others), for the output
// gradient dy, made with create_graph so that they are differentiable again: what a backward run with grad mode on
// (torch.autograd.grad(..., create_graph=True)) returns. The backward kernels have no derivative of their own, so
// ref() is the op's PyTorch formula on the saved inputs (which connect the result to the forward's graph); it runs
// with autocast off, as the forward did.
template <typename Ref>
std::vector<at::Tensor> grads_through(Ref&& ref, const std::vector<at::Tensor>& inputs, const std::vector<bool>& needs,
                                      const at::Tensor& dy) {
  std::vector<at::Tensor> grads(inputs.size());
  std::vector<at::Tensor> wrt;
  std::vector<size_t> where;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (needs[i] && inputs[i].defined() && inputs[i].requires_grad()) {
      wrt.push_back(inputs[i]);
      where.push_back(i);
    }
  }
  if (wrt.empty()) return grads;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const at::Tensor y = ref();
  auto gs = torch::autograd::grad({y}, wrt, {dy}, /*retain_graph=*/true, /*create_graph=*/true,
                                  /*allow_unused=*/true);
  for (size_t k = 0; k < where.size(); ++k) grads[where[k]] = gs[k];
  return grads;
}

inline at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

inline std::optional<at::Tensor> or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A typed handle of op pipegoose::<name> (found once; the library registers it before any call).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace norm_autograd
}  // namespace pipegoose
