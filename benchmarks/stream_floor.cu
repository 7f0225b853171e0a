// Benchmark only (benchmarks/stream_floor.py), not part of the library: the bare stream. One CTA
// per SM reads its contiguous share of a buffer into the layer's 7-stage shared-memory ring, one 16 KB bulk
// copy per stage (as the one-launch layer's producer streams weights, templates/sm90/moe_decode.cuh),
// and does nothing with it: the shortest time one kernel takes to read that many bytes here.
// With `checksum` non-null the consumer also adds up every 32-bit word it received (the test's proof
// that the stream covers the buffer exactly once; the benchmark passes null).
#include <cuda_runtime.h>

#include <cstdint>

#include "moe_decode.cuh"   // the one-launch layer's ring helpers (mbarrier, bulk copy), so the same PTX

namespace {

using namespace moe_cutlass::decode;

// The ring of the one-launch kernel for the smallest calls (moe_decode_k512, codegen/configs.py):
// one stage of its weights is 16 KB, kStages stages.
using LayerRing = RingShape<8, 7>;
constexpr int kStages = LayerRing::kStages;
constexpr int kChunk = LayerRing::kStageA;

__global__ void __launch_bounds__(64, 1) stream_kernel(const uint8_t* src, long long bytes, unsigned long long* checksum) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ alignas(8) uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  long long const per_cta = (bytes + 16LL * gridDim.x - 1) / (16LL * gridDim.x) * 16;   // 16-byte pieces, rounded up
  long long const begin = min(bytes, per_cta * blockIdx.x), end = min(bytes, begin + per_cta);
  int const n = int((end - begin + kChunk - 1) / kChunk);
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) {
    if (lane != 0) return;
    for (int i = 0; i < n; ++i) {
      int const s = i % kStages;
      if (i >= kStages) mbar_wait(&empty[s], (i / kStages - 1) & 1);
      long long const pos = begin + int64_t(i) * kChunk;
      uint32_t const size = uint32_t(min(end - pos, static_cast<long long>(kChunk)));
      mbar_expect_tx(&full[s], size);
      bulk_copy(ring + s * kChunk, src + pos, size, &full[s]);
    }
    return;
  }
  unsigned long long sum = 0;
  for (int i = 0; i < n; ++i) {
    int const s = i % kStages;
    mbar_wait(&full[s], (i / kStages) & 1);
    if (checksum != nullptr) {
      long long const pos = begin + int64_t(i) * kChunk;
      int const words = int(min(end - pos, static_cast<long long>(kChunk))) / 4;
      uint32_t const* w = reinterpret_cast<uint32_t const*>(ring + s * kChunk);
      for (int j = lane; j < words; j += 32) sum += w[j];
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
  }
  if (checksum != nullptr) atomicAdd(checksum, sum);
}

}  // namespace

// Once per process and device, outside CUDA-graph capture: the ring's shared-memory opt-in.
extern "C" int mc_bench_stream_init(void) {
  return int(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStages * kChunk));
}

// Reads bytes (a multiple of 16) from src (16-byte aligned) on `stream` with one CTA per SM of the
// current device. Returns a cudaError_t value.
extern "C" int mc_bench_stream(const void* src, long long bytes, unsigned long long* checksum, cudaStream_t stream) {
  if (src == nullptr || bytes < 0 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    return int(cudaErrorInvalidValue);
  }
  int dev = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return int(err);
  stream_kernel<<<sms, 64, kStages * kChunk, stream>>>(static_cast<const uint8_t*>(src), bytes, checksum);
  return int(cudaGetLastError());
}
