// moe_cutlass: programmatic dependent launch (PTX griddepcontrol) for the layer's kernel chain.
//
// Why: mc_layer runs expand -> GEMM1 -> GEMM2 -> finalize on one stream. Launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, a kernel's CTAs may start as soon as every CTA
// of the kernel before it has executed launch_dependents() (or exited), on the SMs that kernel
// leaves free, and its wait() blocks until that kernel has completed with its writes visible.
// Without the attribute both are no-ops, so a kernel launched the ordinary way (every standalone op)
// keeps plain stream order.
//
// The rule that keeps such a chain correct: a kernel launched with the attribute triggers only after
// its own wait(); then a kernel that has started knows that every kernel two or more launches back
// has completed. Before its wait() it reads only those kernels' outputs and constant data (weights),
// and writes nothing. Every grid waits in at least one CTA before it completes, so that its
// completion implies its predecessor's.
#pragma once

namespace moe_cutlass {
namespace pdl {

__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// What a GEMM launch of the layer may do before its wait() (the `pdl` argument of the GEMM ABI).
enum Mode : int {
  kOff = 0,           // launched the ordinary way
  kWaitFirst = 1,     // launched dependent; waits before reading anything (it follows the kernel
                      // that wrote the expert offsets)
  kWeightsFirst = 2,  // launched dependent; the scheduler reads the offsets and the producer loads
                      // the first tile's weights and scales before the wait, the tokens after it
};

}  // namespace pdl
}  // namespace moe_cutlass
