// torch.library binding of pipegoose's fused softmax (pipegoose/kernels/csrc/softmax.cu).
//
//   pipegoose::softmax_forward(Tensor input, Tensor? mask, float scale, bool causal) -> Tensor
//   pipegoose::softmax_backward(Tensor grad_output, Tensor output, float scale, bool causal=False) -> Tensor
//
// Semantics: docs/architecture.md ("Ours"). This file checks every assumption of the kernels (device, dtype,
// rank, sizes, broadcast) with an error naming the argument, and brings the tensors to the 4-D form the
// kernels take. Documented fallbacks (copies, never wrong results): an input whose last dim is not contiguous is
// copied with .contiguous(); inputs of rank > 4 whose leading dims cannot be merged are copied by reshape.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include "../csrc/pipegoose_check.h"

namespace pipegoose {
at::Tensor softmax_forward_cuda(const at::Tensor& input, const std::optional<at::Tensor>& mask, double scale,
                                bool causal);
at::Tensor softmax_backward_cuda(const at::Tensor& grad_output, const at::Tensor& output, double scale,
                                 bool causal);
}  // namespace pipegoose

namespace {

bool float_dtype(at::ScalarType s) { return s == at::kFloat || s == at::kHalf || s == at::kBFloat16; }

// [..., sq, sk] -> [d0, d1, sq, sk] with a contiguous last dim (a view whenever possible).
at::Tensor as_rows4(const at::Tensor& t) {
  at::Tensor c = (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
  switch (c.dim()) {
    case 1: return c.unsqueeze(0).unsqueeze(0).unsqueeze(0);
    case 2: return c.unsqueeze(0).unsqueeze(0);
    case 3: return c.unsqueeze(0);
    case 4: return c;
    default: return c.reshape({-1, c.size(-3), c.size(-2), c.size(-1)});
  }
}

void check_scale(double scale, const char* op) {
  PG_CHECK(std::isfinite(scale), op, ": scale must be a finite number, got ", scale);
}

at::Tensor softmax_forward(const at::Tensor& input, const std::optional<at::Tensor>& mask, double scale,
                           bool causal) {
  constexpr const char* op = "pipegoose::softmax_forward";
  PG_CHECK(input.is_cuda(), op, ": input must be a CUDA tensor, got device ", input.device());
  PG_CHECK(float_dtype(input.scalar_type()), op, ": input must be float32, float16 or bfloat16, got ",
              input.scalar_type());
  PG_CHECK(input.dim() >= 1, op, ": input must have at least 1 dimension (the keys), got a 0-d tensor");
  PG_CHECK(!causal || input.dim() >= 2, op, ": causal=True needs input [..., sq, sk], got shape ",
              input.sizes());
  check_scale(scale, op);
  at::Tensor x = as_rows4(input);
  std::optional<at::Tensor> m4;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    PG_CHECK(input.dim() == 4, op, ": a mask needs a 4-D input [b, np, sq, sk], got input shape ", input.sizes());
    PG_CHECK(m.device() == input.device(), op, ": mask must be on the input's device ", input.device(),
                ", got ", m.device());
    PG_CHECK(m.scalar_type() == at::kBool, op, ": mask must be bool (True = masked), got ", m.scalar_type());
    PG_CHECK(m.dim() == 4, op, ": mask must be 4-D [b or 1, np or 1, sq or 1, sk], got shape ", m.sizes());
    PG_CHECK(m.size(3) == input.size(3), op, ": mask's last dim must equal the key length ", input.size(3),
                ", got mask shape ", m.sizes());
    for (int d = 0; d < 3; ++d) {
      PG_CHECK(m.size(d) == 1 || m.size(d) == input.size(d), op, ": mask shape ", m.sizes(),
                  " does not broadcast to input shape ", input.sizes(), " (dim ", d, ")");
    }
    at::Tensor mc = (m.size(3) <= 1 || m.stride(3) == 1) ? m : m.contiguous();
    m4 = mc.expand(input.sizes());
  }
  at::Tensor out = pipegoose::softmax_forward_cuda(x, m4, scale, causal);
  return out.view(input.sizes());
}

at::Tensor softmax_backward(const at::Tensor& grad_output, const at::Tensor& output, double scale, bool causal) {
  constexpr const char* op = "pipegoose::softmax_backward";
  PG_CHECK(output.is_cuda(), op, ": output must be a CUDA tensor, got device ", output.device());
  PG_CHECK(grad_output.device() == output.device(), op, ": grad_output must be on output's device ",
              output.device(), ", got ", grad_output.device());
  PG_CHECK(float_dtype(output.scalar_type()), op, ": output must be float32, float16 or bfloat16, got ",
              output.scalar_type());
  PG_CHECK(grad_output.scalar_type() == output.scalar_type(), op,
              ": grad_output must have output's dtype ", output.scalar_type(), ", got ", grad_output.scalar_type());
  PG_CHECK(grad_output.sizes() == output.sizes(), op, ": grad_output must have output's shape ",
              output.sizes(), ", got ", grad_output.sizes());
  PG_CHECK(output.dim() >= 1, op, ": output must have at least 1 dimension (the keys), got a 0-d tensor");
  PG_CHECK(!causal || output.dim() >= 2, op, ": causal=True needs output [..., sq, sk], got shape ",
              output.sizes());
  check_scale(scale, op);
  at::Tensor out = pipegoose::softmax_backward_cuda(as_rows4(grad_output), as_rows4(output), scale, causal);
  return out.view(output.sizes());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("softmax_forward(Tensor input, Tensor? mask, float scale, bool causal) -> Tensor");
  m.def("softmax_backward(Tensor grad_output, Tensor output, float scale, bool causal=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("softmax_forward", &softmax_forward);
  m.impl("softmax_backward", &softmax_backward);
}
