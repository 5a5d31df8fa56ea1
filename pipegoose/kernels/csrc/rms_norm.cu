// RMSNorm forward/backward for pipegoose: entry points of the ops rms_norm_forward and rms_norm_backward
// (schemas in docs/architecture.md, registered by pipegoose/kernels/bindings/rms_norm.cpp). Source: written in
// this project (pipegoose/kernels/csrc/rms_norm.cu + norm_kernels.cuh, shared with layer_norm.cu).
//
// rms_norm_forward(input [..., H], weight [H]?, eps, out_dtype?) -> (output [..., H], rstd [rows]);
//     y = x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded once to the output dtype (out_dtype or the
//     input's; one that is neither the input's nor fp32 is rounded from an fp32 result). input fp32/fp16/bf16;
//     weight fp32/fp16/bf16 independent of the input (read in the input's dtype or fp32, else, and for
//     an fp32 output of a 16-bit input, converted to fp32).
// rms_norm_backward(grad_output [..., H], input, weight?, rstd, weight_grad=True) -> (grad_input (input's dtype),
//     grad_weight (weight's shape and dtype, or an empty [0] tensor when weight is None or weight_grad is False: a
//     frozen weight's gradient is not computed)); grad_output in the input's dtype
//     or fp32 (another dtype is converted to fp32); grad_weight summed in fp32 in a fixed order (deterministic).
// Non-contiguous input / grad_output are copied to contiguous first. Errors: RuntimeError naming the argument
// (device, dtype, H >= 1, weight numel == H, rstd fp32 with one element per row, grad_output shape == input
// shape, eps finite and >= 0, out_dtype floating).
#include "norm_kernels.cuh"

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& input,
                                                         const std::optional<at::Tensor>& weight, double eps,
                                                         std::optional<at::ScalarType> out_dtype) {
  auto r = pipegoose::norm::norm_forward</*RMS=*/true>("rms_norm_forward", input, weight.value_or(at::Tensor()),
                                                       at::Tensor(), eps, out_dtype);
  return {r.out, r.rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& rstd, bool weight_grad) {
  auto r = pipegoose::norm::norm_backward</*RMS=*/true>("rms_norm_backward", grad_output, input,
                                                        weight.value_or(at::Tensor()), at::Tensor(), at::Tensor(),
                                                        rstd, weight_grad, false);
  return {r.grad_input, r.grad_weight};
}
