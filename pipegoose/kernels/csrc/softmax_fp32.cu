// float instantiation of pipegoose's fused softmax kernels (see softmax.cu).
#include "softmax.cuh"

namespace pipegoose {
namespace softmax_detail {

void launch_forward(const FwdArgs<float>& a, cudaStream_t st) { run<float, false>(a, st); }
void launch_backward(const BwdArgs<float>& a, cudaStream_t st) { run<float, true>(a, st); }

}  // namespace softmax_detail
}  // namespace pipegoose
