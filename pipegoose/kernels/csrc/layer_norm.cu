// LayerNorm forward/backward for pipegoose: entry points of the ops layer_norm_forward and layer_norm_backward
// (schemas in docs/architecture.md, registered by pipegoose/kernels/bindings/layer_norm.cpp). Source: written in
// this project (pipegoose/kernels/csrc/layer_norm.cu + norm_kernels.cuh, shared with rms_norm.cu).
//
// layer_norm_forward(input [..., H], weight [H]?, bias [H]?, eps, out_dtype?) -> (output [..., H], mean [rows],
//     rstd [rows]); rows = numel / H. input fp32/fp16/bf16; weight/bias fp32/fp16/bf16 independent of the input
//     (read in the input's dtype or fp32; another dtype, or any 16-bit dtype when the output is fp32 for a 16-bit
//     input, is converted to fp32 first); output in out_dtype or the input's dtype (an out_dtype that is neither
//     the input's nor fp32 is rounded from an fp32 result); y = fma((x - mean) * rstd, weight, bias); mean and
//     rstd = 1 / sqrt(var + eps) in fp32, statistics in fp32 (two passes over the row held in registers, or per-chunk
//     moments merged across the block for rows of one 1024-thread block and wider).
// layer_norm_backward(grad_output [..., H], input, weight?, bias?, mean, rstd, weight_grad=True, bias_grad=True) ->
//     (grad_input (input's dtype), grad_weight, grad_bias (the parameter's shape and dtype; empty [0] tensors when
//     it is None or its *_grad flag is False: a frozen parameter's gradient is not computed)); grad_output
//     in the input's dtype or fp32 (another dtype is converted to fp32). Parameter gradients are summed in fp32
//     in a fixed order (deterministic).
// Non-contiguous input / grad_output are copied to contiguous first. Errors: RuntimeError naming the argument
// (device, dtype, H >= 1, weight/bias numel == H, mean/rstd fp32 with one element per row, grad_output shape ==
// input shape, eps finite and >= 0, out_dtype floating).
#include "norm_kernels.cuh"

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, std::optional<at::ScalarType> out_dtype) {
  auto r = pipegoose::norm::norm_forward</*RMS=*/false>(
      "layer_norm_forward", input, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), eps, out_dtype);
  return {r.out, r.mean, r.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd, bool weight_grad,
    bool bias_grad) {
  auto r = pipegoose::norm::norm_backward</*RMS=*/false>("layer_norm_backward", grad_output, input,
                                                         weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                                                         mean, rstd, weight_grad, bias_grad);
  return {r.grad_input, r.grad_weight, r.grad_bias};
}
