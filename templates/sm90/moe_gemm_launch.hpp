// moe_cutlass: launcher of one MXFP4 x BF16 MoE grouped GEMM configuration (SM90).
//
// Per call, on the caller's stream, nothing read back to the host (CUDA-graph capturable): ONE
// launch, the CUTLASS ptr-array kernel (persistent, grid = #SMs) with our mainloop
// (moe_gemm_mainloop.hpp) and epilogue (moe_gemm_epilogue.hpp), over the rows of each expert that
// the launch's row window takes (moe_rows.hpp). Its grouped tile scheduler reads
// the per-expert problem shapes through MoeProblemShape, straight from expand's offsets (a setup
// kernel used to write them out first: one launch and ~1.5-3 us per GEMM at decode). Its TMA
// descriptors are static kernel parameters over all experts; the scheduler's workspace is carved
// from the caller's: two launches in flight must not share one.
// Host work per call: argument checks, TMA descriptor encoding when the buffers changed
// (GemmUniversalAdapter::initialize, cached), no device memory is read.
#pragma once

// CuTe's GMMA atoms of every width (m64n40k16 and the like) for the GMMAs over a tile's tokens
// (moe_gemm_mainloop.hpp item 12); before any CUTLASS header.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED

#include <cuda_runtime.h>
#include <cstdint>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <mutex>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/epilogue/collective/detail.hpp"

#include "moe_gemm_kernel.hpp"
#include "moe_gemm_mainloop.hpp"
#include "moe_gemm_epilogue.hpp"
#include "moe_rows.hpp"

namespace moe_cutlass {

// Prepared-layout padding (must match moe_cutlass/layout.py): weight rows to a multiple of 128,
// K to a multiple of 64.
constexpr int kRowPad = 128;
constexpr int kKPad = 64;
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The grouped GEMM's problem shapes, (N rounded up to a 64-row slab, this launch's rows of expert e,
// Kp), computed from expert_offsets and the launch's row window (moe_rows.hpp) where the kernel asks
// for them: the interface of cutlass::gemm::GroupProblemShape with device-only shapes. An expert
// without rows in the window is skipped. M is not Npad (a multiple of 128): at N = 2880 (gpt-oss's
// GEMM2) the 192-row tiles would count 16 per token tile, the 16th all padding that the epilogue does
// not store (benchmarks/NOTES.md 2026-12-04 (32)).
struct MoeProblemShape {
  using UnderlyingProblemShape = Shape<int, int, int>;
  int32_t num_groups = 1;
  int32_t const* offsets = nullptr;
  int32_t m_rows = 0;
  int32_t k_pad = 0;
  MoeRowWindow window;

  CUTLASS_HOST_DEVICE int32_t groups() const { return num_groups; }
  CUTLASS_DEVICE UnderlyingProblemShape get_problem_shape(int32_t group) const {
    int32_t first, count;
    window.rows(offsets[group], offsets[group + 1], first, count);
    return {m_rows, count, k_pad};
  }
  CUTLASS_HOST_DEVICE UnderlyingProblemShape get_host_problem_shape(int32_t = 0) const { return {}; }
  CUTLASS_HOST_DEVICE bool is_host_problem_shape_available() const { return false; }
};

template <int Kind, int TileM, int TileN, int TileK, bool Pingpong, int ClusterM_ = 1>
struct MoeGemmConfig {
  static constexpr int ClusterM = ClusterM_;
  using TileShape = Shape<Int<TileM>, Int<TileN>, Int<TileK>>;
  // Our fork of the cooperative kernel (moe_gemm_kernel.hpp): one 64-row slab per consumer
  // warpgroup (three for TileM 192), the epilogue's loads issued with the mainloop.
  using Schedule = cute::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                       KernelMoeCooperative<TileM / 64>>;
  static constexpr int StageBytes = Mxfp4MoeMainloop<2, TileShape, Schedule>::TmaTransactionBytes;
  static constexpr int kSmemBudget = 232448 - 6144;   // 227 KB minus scheduler/pipeline/tensormap storage
  static constexpr int StagesRaw = kSmemBudget / (StageBytes + 32);
  // as many stages as fit: small-N tiles stream weights, and bytes in flight set the bandwidth
  static constexpr int Stages = StagesRaw > 24 ? 24 : StagesRaw;
  static_assert(Stages >= 2);
  using Mainloop = Mxfp4MoeMainloop<Stages, TileShape, Schedule, ClusterM>;
  // The epilogue's staging buffer (moe_gemm_epilogue.hpp) takes what the stages leave: the largest
  // round of tokens (a multiple of 16 for GEMM2, 32 for GEMM1's half-width rows) dividing TileN whose
  // output rows fit; 0 (stores from registers) where none does. A stage given up so that 128x64x128 and
  // 192x96x128 stage too measured -0.4..-2.9% on single GEMMs, once +12% (benchmarks/NOTES.md 2026-12-01 (20)).
  static constexpr int StagingTokens = [] {
    int const left = kSmemBudget - Stages * (StageBytes + 32);
    int const step = Kind == 2 ? 16 : 32, row_bytes = Kind == 2 ? 2 * TileM : TileM;
    int best = 0;
    for (int tc = step; tc <= TileN; tc += step) {
      if (TileN % tc == 0 && row_bytes * tc <= left) best = tc;
    }
    return Pingpong ? 0 : best;
  }();
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<MoeEpilogue<Kind, TileShape, StagingTokens>>;
  using ProblemShape = MoeProblemShape;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

struct MoeWorkspaceLayout {
  size_t cutlass_ws, total;
};

inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// A persistent grid of clusters must fit the machine at once: the count the occupancy API gives
// (per process; one GPU model per process assumed), 0 (unused) without clusters.
template <class Cfg>
inline int max_active_clusters() {
  if constexpr (Cfg::ClusterM == 1) {
    return 0;
  } else {
    static int const n = cutlass::KernelHardwareInfo::query_device_max_active_clusters<typename Cfg::Kernel>();
    return n;
  }
}

template <class Cfg>
inline typename Cfg::Gemm::Arguments make_args(int E, int sm_count, typename Cfg::Mainloop::Arguments const& ml,
                                               MoeEpilogueArguments const& epi) {
  typename Cfg::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {E, ml.offsets, int32_t(round_up(epi.n_real, 64)), ml.k_pad, ml.window};
  args.mainloop = ml;
  args.epilogue = epi;
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = sm_count;
  args.hw_info.max_active_clusters = max_active_clusters<Cfg>();
  return args;
}

template <class Cfg>
inline MoeWorkspaceLayout workspace_layout(int E, int sm_count) {
  MoeWorkspaceLayout L;
  size_t o = 0;
  L.cutlass_ws = o;
  typename Cfg::Mainloop::Arguments ml{};
  MoeEpilogueArguments epi{};
  auto args = make_args<Cfg>(E, sm_count, ml, epi);
  o = align_up(o + Cfg::Gemm::get_workspace_size(args), 128);
  L.total = o;
  return L;
}

inline int device_sm_count() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  static int cached_dev = -1, cached_sms = -1;   // benign race: both writers store the same value
  if (dev == cached_dev && cached_sms > 0) return cached_sms;
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return -1;
  cached_sms = sms;
  cached_dev = dev;
  return sms;
}

template <class Cfg>
inline size_t moe_gemm_workspace_size(int32_t E, int32_t num_sms) {
  if (E <= 0 || num_sms <= 0) return 0;
  return workspace_layout<Cfg>(E, num_sms).total;
}

// Host-side cache of kernel Params per config, by every host value they depend on: a serving loop
// that reuses its buffers skips the TMA descriptor encoding and cudaFuncSetAttribute. Several
// entries, because a model's layers alternate weights on the same config every call (one entry
// re-encoded the descriptors at every layer of an eager forward). A direct-mapped table: a
// colliding key just replaces the entry.
struct MoeParamKey {
  int device;
  const void* ptrs[8];
  int32_t E, N, K, act_rows, scale_max, activation, row_chunk, rem_lo, rem_hi;
  float alpha, limit;
  size_t workspace_bytes;
};

inline uint64_t hash_bytes(void const* data, size_t n) {   // FNV-1a
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint8_t const*>(data)[i]) * 1099511628211ull;
  return h;
}

template <class Cfg>
struct MoeParamCache {
  static constexpr size_t kEntries = 256;
  struct Entry {
    bool valid = false;
    MoeParamKey key;
    typename Cfg::Gemm::Params params;
  };
  std::mutex mutex;
  Entry entries[kEntries];
  static MoeParamCache& get() {
    static MoeParamCache cache;
    return cache;
  }
  Entry& slot(MoeParamKey const& key) { return entries[hash_bytes(&key, sizeof(key)) % kEntries]; }
};

template <class Cfg, int Kind>
inline int moe_gemm_run(const void* w_blocks, const void* w_scales, const float* bias, const void* act,
                        int32_t act_rows, const int32_t* expert_offsets, int32_t row_chunk, int32_t rem_lo,
                        int32_t rem_hi, const float* row_weights, void* out,
                        int32_t E, int32_t N, int32_t K, int32_t scale_max, int32_t activation, float swiglu_alpha, float swiglu_limit, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream, int32_t pdl_mode) {
  constexpr int kInvalid = int(cudaErrorInvalidValue);
  if (pdl_mode < pdl::kOff || pdl_mode > pdl::kWeightsFirst) return kInvalid;
  if (E <= 0 || N <= 0 || K <= 0 || (K % 32) != 0 || (N % 32) != 0 || act_rows <= 0) return kInvalid;
  if (int64_t(N) * 2 >= (int64_t(1) << 31) || int64_t(K) >= (int64_t(1) << 24)) return kInvalid;
  if (!w_blocks || !w_scales || !act || !expert_offsets || !out) return kInvalid;
  if (!MoeRowWindow::valid(row_chunk, rem_lo, rem_hi)) return kInvalid;
  MoeRowWindow const window = MoeRowWindow::make(row_chunk, rem_lo, rem_hi);
  if (Kind == 2 && !row_weights) return kInvalid;
  if (scale_max < 0 || scale_max > 255) return kInvalid;
  if (Kind == 1 && (activation < 0 || activation > 1)) return kInvalid;
  if (Kind == 1 && (N % 64) != 0) return kInvalid;     // N = 2I, I a multiple of 32
  if (std::isnan(swiglu_limit) || std::isnan(swiglu_alpha)) return kInvalid;
  if ((reinterpret_cast<uintptr_t>(w_blocks) | reinterpret_cast<uintptr_t>(w_scales) |
       reinterpret_cast<uintptr_t>(act) | reinterpret_cast<uintptr_t>(workspace)) & 15) return kInvalid;
  int const sms = device_sm_count();
  if (sms <= 0) return int(cudaErrorNoDevice);
  int const m_pad = int(round_up(N, kRowPad));
  int const k_pad = int(round_up(K, kKPad));
  MoeWorkspaceLayout L = workspace_layout<Cfg>(E, sms);
  // The scheduler's share only, 0 bytes for the grouped scheduler: no per-launch device state
  // is left (static descriptors, shapes from the offsets), so a NULL workspace is fine then.
  if (workspace_bytes < L.total || (L.total > 0 && !workspace)) return kInvalid;
  uint8_t* ws = reinterpret_cast<uint8_t*>(workspace);

  MoeEpilogueArguments epi;
  epi.out = out;
  epi.bias = bias;
  epi.row_weights = row_weights;
  epi.offsets = expert_offsets;
  epi.window = window;
  epi.n_real = N;
  epi.m_pad = m_pad;
  epi.activation = activation;
  epi.alpha = swiglu_alpha;
  epi.limit = swiglu_limit;
  MoeParamKey key;
  std::memset(&key, 0, sizeof(key));
  cudaGetDevice(&key.device);
  key.ptrs[0] = w_blocks; key.ptrs[1] = w_scales; key.ptrs[2] = bias; key.ptrs[3] = act;
  key.ptrs[4] = expert_offsets; key.ptrs[5] = row_weights; key.ptrs[6] = out; key.ptrs[7] = workspace;
  key.E = E; key.N = N; key.K = K; key.act_rows = act_rows; key.scale_max = scale_max; key.activation = activation;
  key.row_chunk = row_chunk; key.rem_lo = rem_lo; key.rem_hi = rem_hi;
  key.alpha = swiglu_alpha; key.limit = swiglu_limit; key.workspace_bytes = workspace_bytes;

  auto& cache = MoeParamCache<Cfg>::get();
  typename Cfg::Gemm::Params params;
  bool hit = false;
  auto& entry = cache.slot(key);
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    if (entry.valid && std::memcmp(&entry.key, &key, sizeof(key)) == 0) {
      params = entry.params;
      hit = true;
    }
  }
  if (!hit) {
    typename Cfg::Mainloop::Arguments ml;
    ml.w_blocks = reinterpret_cast<uint8_t const*>(w_blocks);
    ml.w_scales = reinterpret_cast<uint8_t const*>(w_scales);
    ml.act = reinterpret_cast<cutlass::bfloat16_t const*>(act);
    ml.offsets = expert_offsets;
    ml.window = window;
    ml.num_experts = E;
    ml.act_rows = act_rows;
    ml.m_pad = m_pad;
    ml.k_pad = k_pad;
    ml.k_real = K;
    ml.scale_max = scale_max;
    auto args = make_args<Cfg>(E, sms, ml, epi);
    typename Cfg::Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return kInvalid;
    if (gemm.initialize(args, ws + L.cutlass_ws, stream) != cutlass::Status::kSuccess) return int(cudaErrorLaunchFailure);
    params = gemm.params();
    std::lock_guard<std::mutex> lock(cache.mutex);
    entry.key = key;
    entry.params = params;
    entry.valid = true;
  }
  params.mainloop.pdl_mode = pdl_mode;
  if (Cfg::Gemm::run(params, stream, nullptr, pdl_mode != pdl::kOff) != cutlass::Status::kSuccess) {
    cudaError_t const err = cudaGetLastError();
    return err != cudaSuccess ? int(err) : int(cudaErrorLaunchFailure);
  }
  return int(cudaGetLastError());
}

}  // namespace moe_cutlass
