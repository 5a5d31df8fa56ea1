// __nv_bfloat16 instantiation of pipegoose's fused softmax kernels (see softmax.cu).
#include "softmax.cuh"

namespace pipegoose {
namespace softmax_detail {

void launch_forward(const FwdArgs<__nv_bfloat16>& a, cudaStream_t st) { run<__nv_bfloat16, false>(a, st); }
void launch_backward(const BwdArgs<__nv_bfloat16>& a, cudaStream_t st) { run<__nv_bfloat16, true>(a, st); }

}  // namespace softmax_detail
}  // namespace pipegoose
