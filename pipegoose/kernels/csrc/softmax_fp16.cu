// __half instantiation of pipegoose's fused softmax kernels (see softmax.cu).
#include "softmax.cuh"

namespace pipegoose {
namespace softmax_detail {

void launch_forward(const FwdArgs<__half>& a, cudaStream_t st) { run<__half, false>(a, st); }
void launch_backward(const BwdArgs<__half>& a, cudaStream_t st) { run<__half, true>(a, st); }

}  // namespace softmax_detail
}  // namespace pipegoose
