// moe_cutlass: the whole MoE layer for small batches in ONE kernel launch (decode).
//
// What differs from the layer's other path (expand -> CUTLASS GEMM1 -> CUTLASS GEMM2 -> finalize,
// four launches) and why:
//  1. One cooperative, persistent launch (grid = #SMs) does routing, GEMM1 + activation, GEMM2 x
//     routing weight and the finalize sum, separated by two grid-wide barriers. At M=1 the four
//     launches cost more than the weights take to stream: per kernel, qwen3 GEMM1 11.2 us for
//     3.2 us of weights, GEMM2 8.2 for 1.6, expand 3.3, finalize 2.5, plus ~6 us of gaps between
//     graph nodes (benchmarks/results/profile_20261201T002829Z.json); a one-launch layer pays one
//     launch, one pipeline fill per phase and two barriers.
//  2. Every CTA redoes the routing of <= kMaxSlots slots in shared memory (counts, stable ranks,
//     offsets, the active experts): no global pass, no expand kernel, no gather. GEMM1 reads the
//     token rows straight from hidden_states. Up to 32 slots (the calls ops.uses_fused sends here)
//     one warp does it in registers (match_any, 32 shuffles): per-phase timestamps put the
//     shared-memory version at 2.8-3.7 us of a 24-47 us kernel at M = 1 (dependent shared-memory
//     round trips of one warp's scans), and the layer got 1.4-2.5 us faster without it
//     (benchmarks/NOTES.md 2026-12-01 (11)).
//  3. The GEMMs leave CUTLASS's collectives for a hand-written loop, because the CUTLASS
//     kernel layer is one GEMM per launch and cannot wait inside a launch for another GEMM's
//     output. What it keeps from our CUTLASS mainloop: the prepared weight layout, whose 512-byte
//     slice per warp and 64-K unit is exactly a warp's mma.m16n8k16 A fragments for 16 rows and 4
//     k-blocks (the RS-WGMMA A fragment of a warp is the m16n8k16 one), the bit-placement converter
//     and the folded scale multiply (mxfp4_math.cuh), and the epilogue arithmetic. Tokens are the
//     n = 8 side of mma.sync (at these few rows per expert tensor-core rate is not the limit;
//     the weight stream is).
//  4. A producer warp streams each work item's weights, scales and token rows into a shared-memory
//     ring (item 8: 7 stages of K 512 or 4 of K 1024): weights with ONE 1-D bulk copy per stage (a
//     64-row slab is contiguous over K in the prepared layout; no TMA descriptors, nothing encoded
//     on the host), token rows with one bulk copy each, scales (a slab's 128-byte scale-word
//     blocks, contiguous over K too) with 16-byte cp.async spread over the producer's lanes;
//     sixteen consumer warps convert and multiply. Work items are (expert, 64 weight rows, <= 8
//     tokens), handed to CTAs as contiguous ranges so a CTA's items share experts; each item's K
//     is split over four consumer warps and summed through shared memory in a fixed order.
//     8 tokens (one n8 block) rather than 16: the stage's token rows take half the space, so the
//     ring holds 7 stages instead of 5, and the one launch got 2-5% faster at M = 1-4 and won at
//     M = 2 too (benchmarks/NOTES.md 2026-12-01 (10)); more tokens than that go to the four launches.
//  5. After its GEMM1 loads the producer prefetches its first GEMM2 weight slabs into L2
//     (cp.async.bulk.prefetch.L2, one per slab, up to 64 KB per CTA), so GEMM2's pipeline fills from
//     L2 after the barrier. Timestamps showed the earlier version (256 KB per CTA, each slab split
//     over the 32 lanes) holding the grid barrier 0.8-3.4 us after the last consumer; A/B of the
//     layer (NOTES.md 2026-12-01 (11)): no prefetch is 2-3% slower at one token of qwen3 and
//     gpt-oss and 1.4-3.3% faster at two tokens than 256 KB in whole slabs; 64 KB is within 0.5% of
//     256 KB at one token and takes about half of no prefetch's gain at two to eight; prefetching
//     before GEMM1 is up to 19% slower.
//  6. Measured on an H200 (benchmarks/NOTES.md, 2026-12-01 one-launch section; A/B in one run,
//     benchmarks/results/bench_20261201T011624Z.json): graph replay at M=1 qwen3 29.9 vs 32.0 us,
//     gpt-oss 46.7 vs 49.8, dsv4-flash 57.3 vs 61.1, but dsv3 105.5 vs 87.9 and every shape slower
//     from M=2 on: the launch saves 6-10 us of fixed cost, then streams weights at 0.8-1.6 TB/s at
//     M=1 (profile_20261201T011631Z) where the CUTLASS GEMMs reach 1.6-3.9 at M=4-64. ncu (gpt-oss
//     M=4): issue bound, 0.62 warp instructions per cycle per scheduler, ~190 per 1024 weights; with
//     the consumers' work removed the ring streams 3.8 TB/s (dsv3 M=16). Since then (NOTES.md
//     2026-12-01 (10)): the K-tail path out of the unit loop (141 -> 89 warp instructions per 1024
//     weights) and 8-token items in 7 stages; against the four launches in one process, M=1 qwen3
//     27.8 vs 35.9 us, gpt-oss 41.1 vs 49.9, dsv4-flash 51.6 vs 60.0, dsv3 94.7 vs 89.1; M=2 qwen3
//     39.4 vs 42.4; M=16 1.45-1.48x the four launches' time. ncu at M=1: 15-25% of the warps wait
//     at the grid barriers (uneven items per CTA), issue 0.28-0.37 per scheduler. With items 2 and
//     5 and the batched finalize loads (session 11): M=1 qwen3 24.4 us, gpt-oss 37.7, dsv4-flash
//     46.0, dsv3 86.7 (four launches 35.5 / 50.2 / 59.7 / 88.3), qwen3 M=4 48.9 vs 53.8
//     (benchmarks/results/raw/*_libk1_decode_finalize_batched.json). ops.uses_fused takes this path
//     where it measured faster. A claimed work order with per-expert counters in
//     place of the middle barrier measured 10-24% slower (one global counter's round trip per item
//     on the producer's critical path). What it would take to win everywhere: the consumers on
//     async RS-WGMMA with B from shared memory (the CUTLASS mainloop's two register sets); K split
//     across CTAs where items are under two waves measured no faster (item 8).
//  7. Determinism: no atomics in any sum. The finalize is the finalize kernel's arithmetic (fp32
//     sum over the k choices in slot order, one multiply by routed_scaling_factor, one rounding);
//     a token's bits depend on the batch only through the GEMMs' K-split order, which is fixed.
//     (fused_moe(batch_invariant=True) never takes this path.)
//  8. Two rings, one kernel each (codegen/configs.py SM90_DECODE_RINGS; ops.fused_kernel picks by
//     weights per call): 7 stages of K 512 (16 KB of weights) and 4 stages of K 1024 (32 KB). Per
//     stage the producer waits, issues and arrives once and every consumer warp waits and releases
//     once, whatever its size; with the consumers' work removed the one launch streams close to the
//     four launches (qwen3 M = 16 85 against 91 us), with it 33% slower, and smaller stages (15 x
//     K 256) were up to 17% slower still. The K 1024 ring, same process pool (benchmarks/NOTES.md
//     2026-12-01 (13)): gpt-oss M = 2 / 4 -7 / -10%, dsv4-flash M = 2 -9%, dsv3 M = 1 -5.5%, qwen3 M = 16
//     -7% against the K 512 ring; qwen3 M = 1 / 2 +6 / +5% (one or two items per CTA: the deeper ring
//     of smaller stages fills sooner). Measured and dropped in the same session: K split across CTAs
//     by chunks where items fill under three waves (the imbalance of qwen3's and gpt-oss's one token;
//     no faster before paying for the partial sums), and a barrier per row block with a rotating
//     reducer in place of the sixteen-warp barrier per item (2-3% slower).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "moe_layer_call.h"
#include "mxfp4_math.cuh"

namespace moe_cutlass {
namespace decode {

constexpr int kMaxSlots = 256;        // M * top_k this path takes (the routing lives in shared memory)
constexpr int kMaxExperts = 512;
constexpr int kConsumerWarps = 16;
constexpr int kThreads = (kConsumerWarps + 1) * 32;   // + the producer warp
constexpr int kSlices = 4;            // K split of one item over consumer warps (x 4 row blocks)
constexpr int kItemRows = 64;         // weight rows per item (4 x m16): one slab, contiguous over K
constexpr int kItemTokens = 8;        // token rows per item: one n8 block of mma.sync
constexpr int kRowPad = 128;          // layout.py: weight rows padded to 128, K to 64
constexpr int kKPad = 64;
// The ring: Stages stages of ChunkUnits 64-K units each (codegen/configs.py builds one kernel per
// ring; ops.fused_kernel picks one per call, item 8 of the header). Stage: A [unit][2 KB], scales
// [unit][128 B], B [token][K bf16 + 16 B pad]. The pad makes the B fragment loads conflict free
// (token n's row starts 4 banks after token n-1's).
template <int ChunkUnits, int Stages>
struct RingShape {
  static constexpr int kChunkUnits = ChunkUnits;
  static constexpr int kStages = Stages;
  static constexpr int kBRowBytes = ChunkUnits * 64 * 2 + 16;
  static constexpr int kStageA = ChunkUnits * 2048;
  static constexpr int kStageS = 2 * ChunkUnits * kItemRows;
  static constexpr int kStageB = kItemTokens * kBRowBytes;
  static constexpr int kStageBytes = kStageA + kStageS + kStageB;
  static_assert(kStageBytes % 128 == 0);
  static_assert(ChunkUnits % kSlices == 0, "each K slice takes the same number of units of a full stage");
};
constexpr int kPrefetchBytesPerCta = 64 << 10;   // GEMM2 slabs into L2 per CTA (item 5)

struct Args {
  const __nv_bfloat16* hidden;
  const void* topk_ids;
  const float* topk_weights;
  __nv_bfloat16* out;
  const int32_t* expert_map;
  int64_t num_global_experts;
  int num_tokens, top_k, num_experts, H, I;
  const uint8_t* w13_blocks;
  const uint8_t* w13_scales;
  const float* w13_bias;
  const uint8_t* w2_blocks;
  const uint8_t* w2_scales;
  const float* w2_bias;
  bool w13_slow, w2_slow;
  __nv_bfloat16* inter;     // [slots][I]: GEMM1's output in expert order
  __nv_bfloat16* rows;      // [slots][H]: GEMM2's output in expert order
  int activation;
  float alpha, limit, routed_scaling_factor;
};

// One GEMM's geometry: weights [E][Npad/64][Kp/64][2 KB], scales [E][Npad/64][Kp/64][128 B].
struct Gemm {
  const uint8_t* blocks;
  const uint8_t* scales;
  const float* bias;
  bool slow;
  int n_real, n_pad, k_real, k_pad;
  __device__ int items_per_group() const { return (n_real + kItemRows - 1) / kItemRows; }
  template <class R>
  __device__ int chunks() const { return (k_pad / 64 + R::kChunkUnits - 1) / R::kChunkUnits; }
};

struct Routing {
  int slot_expert[kMaxSlots];
  int slot_row[kMaxSlots];      // rank within the expert, then the row (-1: dropped)
  int row_slot[kMaxSlots];
  int count[kMaxExperts];
  int offset[kMaxExperts];
  int active[kMaxSlots];        // experts with rows, ascending
  int item_base[kMaxSlots + 1]; // first token group of active expert a (groups of <= kItemTokens rows)
  int num_active;
};

template <class R>
struct Smem {
  alignas(128) uint8_t stages[R::kStages][R::kStageBytes];
  float red[2][kSlices - 1][4][32][4];   // K-slice partial sums, double buffered by item parity
  alignas(8) uint64_t full[R::kStages];
  alignas(8) uint64_t empty[R::kStages];
  Routing r;
};

// ---- PTX helpers -----------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// 16 bytes global -> shared (LDGSTS), and this thread's arrival on `bar` once its copies landed:
// one of the barrier's expected arrivals (.noinc; the incrementing form raises the pending count
// above the expected count, which compute-sanitizer's synccheck reports as a barrier overflow).
__device__ __forceinline__ void async_copy16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void async_copies_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Consumer warps only (the producer runs ahead through the ring).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
}

// ---- routing in shared memory -----------------------------------------------------------------
template <typename IdT>
__device__ int local_expert(const Args& a, int slot) {
  int64_t id = static_cast<int64_t>(static_cast<const IdT*>(a.topk_ids)[slot]);
  if (a.expert_map != nullptr) {
    if (id < 0 || id >= a.num_global_experts) return -1;
    id = __ldg(a.expert_map + id);
  }
  return (id >= 0 && id < a.num_experts) ? static_cast<int>(id) : -1;
}

// Exclusive scan of v[0..n) in place by one warp (lane l takes a contiguous run); returns the total.
__device__ inline int warp_exclusive_scan(int* v, int n) {
  int const lane = threadIdx.x % 32;
  int const per = (n + 31) / 32;
  int const lo = min(lane * per, n), hi = min(lo + per, n);
  int sum = 0;
  for (int i = lo; i < hi; ++i) sum += v[i];
  int incl = sum;
  for (int d = 1; d < 32; d *= 2) {
    int const o = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += o;
  }
  int run = incl - sum;
  for (int i = lo; i < hi; ++i) {
    int const c = v[i];
    v[i] = run;
    run += c;
  }
  return __shfl_sync(0xffffffffu, incl, 31);
}

// Up to 32 slots (every call the one launch takes in practice: ops.uses_fused): one warp routes
// them in registers, slot s on lane s. Same results as the general path below for the active
// experts (count, offset, active, item_base; the other experts' entries are never read).
template <typename IdT>
__device__ void route_warp(const Args& a, Routing& r, int slots) {
  int const lane = threadIdx.x;
  int const e = lane < slots ? local_expert<IdT>(a, lane) : -1;
  int const key = e >= 0 ? e : INT_MAX;   // dropped slots and idle lanes sort after every expert
  unsigned const lt = (1u << lane) - 1u;
  unsigned const peers = __match_any_sync(0xffffffffu, key);
  int const rank = __popc(peers & lt), count = __popc(peers);
  bool const leader = e >= 0 && rank == 0;
  int const groups = leader ? (count + kItemTokens - 1) / kItemTokens : 0;
  // Over the other slots: rows of lower experts (the offset), lower active experts (the index into
  // active) and their token groups (item_base).
  int offset = 0, index = 0, base = 0;
#pragma unroll 8
  for (int j = 0; j < 32; ++j) {
    int const kj = __shfl_sync(0xffffffffu, key, j);
    int const gj = __shfl_sync(0xffffffffu, groups, j);
    bool const lower = kj < key;
    offset += lower;
    index += lower && gj > 0;
    base += lower ? gj : 0;
  }
  if (lane < slots) {
    int const row = e >= 0 ? offset + rank : -1;
    r.slot_row[lane] = row;
    if (row >= 0) r.row_slot[row] = lane;
  }
  if (leader) {
    r.count[e] = count;
    r.offset[e] = offset;
    r.active[index] = e;
    r.item_base[index] = base;
  }
  int const n = __popc(__ballot_sync(0xffffffffu, leader));
  int const total = __reduce_add_sync(0xffffffffu, groups);
  if (lane == 0) {
    r.item_base[n] = total;
    r.num_active = n;
  }
}

// Rows in expert order, each expert's slots in slot order (the expand kernel's order).
template <typename IdT>
__device__ void route(const Args& a, Routing& r) {
  int const slots = a.num_tokens * a.top_k;
  if (slots <= 32) {
    if (threadIdx.x < 32) route_warp<IdT>(a, r, slots);
    __syncthreads();
    return;
  }
  for (int e = threadIdx.x; e < a.num_experts; e += kThreads) r.count[e] = 0;
  for (int s = threadIdx.x; s < slots; s += kThreads) r.slot_expert[s] = local_expert<IdT>(a, s);
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += kThreads) {
    int const e = r.slot_expert[s];
    int rank = 0;
    for (int j = 0; j < s; ++j) rank += r.slot_expert[j] == e;
    r.slot_row[s] = rank;
    if (e >= 0 && rank == 0) {
      int n = 0;
      for (int j = s; j < slots; ++j) n += r.slot_expert[j] == e;
      r.count[e] = n;
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    for (int e = threadIdx.x; e < a.num_experts; e += 32) r.offset[e] = r.count[e];
    __syncwarp();
    warp_exclusive_scan(r.offset, a.num_experts);
    // active experts in ascending order: a ballot per 32 experts
    int n = 0;
    for (int e0 = 0; e0 < a.num_experts; e0 += 32) {
      int const e = e0 + int(threadIdx.x);
      bool const has = e < a.num_experts && r.count[e] > 0;
      unsigned const mask = __ballot_sync(0xffffffffu, has);
      if (has) r.active[n + __popc(mask & ((1u << threadIdx.x) - 1u))] = e;
      n += __popc(mask);
    }
    __syncwarp();
    for (int i = threadIdx.x; i < n; i += 32) r.item_base[i] = (r.count[r.active[i]] + kItemTokens - 1) / kItemTokens;
    __syncwarp();
    int const groups = warp_exclusive_scan(r.item_base, n);
    if (threadIdx.x == 0) {
      r.item_base[n] = groups;
      r.num_active = n;
    }
  }
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += kThreads) {
    int const e = r.slot_expert[s];
    int const row = e >= 0 ? r.offset[e] + r.slot_row[s] : -1;
    r.slot_row[s] = row;
    if (row >= 0) r.row_slot[row] = s;
  }
  __syncthreads();
}

// ---- work items ------------------------------------------------------------------------------
// Item i of a GEMM = (token group g, 64-row slab q), g-major: a CTA's consecutive items share
// token rows. Token group g = (active expert a, its rows [kItemTokens j, kItemTokens (j + 1))).
struct Item {
  int e, q, row0, rows;
};

__device__ __forceinline__ Item item_at(const Routing& r, int per_group, int i) {
  int const g = i / per_group;
  int lo = 0, hi = r.num_active;   // the last a with item_base[a] <= g
  while (hi - lo > 1) {
    int const mid = (lo + hi) / 2;
    if (r.item_base[mid] <= g) lo = mid; else hi = mid;
  }
  int const e = r.active[lo];
  int const first = (g - r.item_base[lo]) * kItemTokens;
  return {e, i - g * per_group, r.offset[e] + first, min(kItemTokens, r.count[e] - first)};
}

__device__ __forceinline__ void cta_range(int total, int* begin, int* end) {
  *begin = int(int64_t(total) * blockIdx.x / gridDim.x);
  *end = int(int64_t(total) * (blockIdx.x + 1) / gridDim.x);
}

// Pipeline position shared by producer and consumers: both walk the same (item, chunk) sequence.
template <class R>
struct Ring {
  int stage = 0;
  uint32_t round = 0;
  __device__ void next() {
    if (++stage == R::kStages) stage = 0, ++round;
  }
};

// ---- producer --------------------------------------------------------------------------------
// Kind 1: token rows from hidden (row -> slot -> token); kind 2: GEMM1's rows of inter.
template <int Kind, class R>
__device__ void produce(const Args& a, const Gemm& G, Smem<R>& sm, Ring<R>& ring) {
  int const lane = threadIdx.x % 32;
  int const total = sm.r.item_base[sm.r.num_active] * G.items_per_group();
  int begin, end;
  cta_range(total, &begin, &end);
  int const units = G.k_pad / 64;
  for (int i = begin; i < end; ++i) {
    Item const it = item_at(sm.r, G.items_per_group(), i);
    // this lane's token row (lanes < it.rows)
    const __nv_bfloat16* src_row = nullptr;
    if (lane < it.rows) {
      int const row = it.row0 + lane;
      src_row = Kind == 1 ? a.hidden + int64_t(sm.r.row_slot[row] / a.top_k) * a.H : a.inter + int64_t(row) * a.I;
    }
    const uint8_t* wa = G.blocks + (int64_t(it.e) * (G.n_pad / 64) + it.q) * units * 2048;
    const uint8_t* ws = G.scales + (int64_t(it.e) * (G.n_pad / 64) + it.q) * units * 128;
    for (int c = 0; c < G.chunks<R>(); ++c) {
      int const u0 = c * R::kChunkUnits;
      int const cu = min(R::kChunkUnits, units - u0);
      int const k0 = u0 * 64;
      uint32_t const b_bytes = uint32_t(min(R::kChunkUnits * 64, G.k_real - k0)) * 2;
      if (ring.round > 0) mbar_wait(&sm.empty[ring.stage], (ring.round - 1) & 1);
      uint8_t* st = sm.stages[ring.stage];
      uint64_t* full = &sm.full[ring.stage];
      // Scales: cu x 128 contiguous bytes, 16 bytes per copy spread over the lanes (as bulk copies
      // of one 64-byte group row each, 16 tiny requests per stage throttled the copy engine:
      // measured 0.5-0.85 TB/s).
      for (int p = lane; p < cu * 8; p += 32) async_copy16(st + R::kStageA + p * 16, ws + u0 * 128 + p * 16);
      async_copies_arrive(full);
      __syncwarp();
      if (lane == 0) {
        mbar_expect_tx(full, cu * 2048 + it.rows * b_bytes);
        bulk_copy(st, wa + int64_t(u0) * 2048, cu * 2048, full);
      }
      if (lane < it.rows) bulk_copy(st + R::kStageA + R::kStageS + lane * R::kBRowBytes, src_row + k0, b_bytes, full);
      ring.next();
    }
  }
}

// GEMM2's weight slabs of this CTA's items into L2, up to kPrefetchBytesPerCta: one bulk prefetch
// per slab, lane l taking slabs l, l + 32, ... (with each slab split into 32 requests over the
// lanes, the producer reached the grid barrier up to 3.4 us after the last consumer).
__device__ inline void prefetch_gemm2(const Gemm& G, const Routing& r) {
  int const lane = threadIdx.x % 32;
  int const total = r.item_base[r.num_active] * G.items_per_group();
  int begin, end;
  cta_range(total, &begin, &end);
  int64_t const slab_bytes = int64_t(G.k_pad / 64) * 2048;
  int budget = kPrefetchBytesPerCta;
  int last = -1;
  int n = 0;
  for (int i = begin; i < end && budget > 0; ++i) {
    Item const it = item_at(r, G.items_per_group(), i);
    int const slab = it.e * (G.n_pad / 64) + it.q;
    if (slab == last) continue;
    last = slab;
    if (n++ % 32 == lane) prefetch_l2(G.blocks + int64_t(slab) * slab_bytes, uint32_t(slab_bytes));
    budget -= int(slab_bytes);
  }
}

// ---- consumers -------------------------------------------------------------------------------
// One 64-K unit of this warp's 16 weight rows: KB k-blocks (4, or 2 for a unit half in the K
// padding: K % 64 == 32, whose token bytes are stale), the item's n8 token block. The scale path
// and KB are compile-time: per-k-block tests and selects cost more ALU issue slots than the
// converter itself (ncu, gpt-oss M=4: 0.62 warp instructions/cycle/scheduler, ~190 per 1024
// weights against ~110 counted in the loop).
template <class R, bool Slow, int KB>
__device__ __forceinline__ void unit_mma(uint8_t const* st, int u, int rb, int lane, float (&acc)[4][4]) {
  int const gq = lane / 4;
  uint4 const w = *reinterpret_cast<uint4 const*>(st + u * 2048 + rb * 512 + lane * 16);
  uint32_t const words[4] = {w.x, w.y, w.z, w.w};
  uint32_t pairs[2];   // groups 2u, 2u+1 of rows rb * 16 + gq, +8 (mxfp4_math.cuh)
  mc_scale_pairs<Slow>(*reinterpret_cast<uint32_t const*>(st + R::kStageA + u * 128 + (rb * 8 + gq) * 4), pairs);
  // B fragments, two k-blocks per ldmatrix.x4 (lane i addresses row i % 8 of matrix i / 8 =
  // 8 k-values at k = 8 (i / 8)): token n = lane / 4. Unmasked: a token row past the item holds
  // stale bytes, which reach only its own output column, never stored.
  uint32_t bf[KB][2];
  uint8_t const* brow = st + R::kStageA + R::kStageS + (lane % 8) * R::kBRowBytes + (u * 64 + (lane / 8) * 8) * 2;
#pragma unroll
  for (int kp = 0; kp < KB / 2; ++kp) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(bf[2 * kp][0]), "=r"(bf[2 * kp][1]), "=r"(bf[2 * kp + 1][0]), "=r"(bf[2 * kp + 1][1])
                 : "r"(smem_addr(brow + kp * 64)));
  }
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    uint32_t f[4];
    mc_e2m1x8_to_bf16(words[kb], f);
    uint32_t frag[4];
    mc_scale_fragment<Slow>(f, pairs[kb / 2], frag);
    mma_bf16(acc[kb], frag, bf[kb][0], bf[kb][1]);
  }
}

// One item's k loop over the ring: this warp's units of every chunk, then the stage released.
// Tail: K % 64 == 32, so the last unit is half padding. A compile-time flag, not a per-unit test:
// ptxas if-converted the two unit bodies into one predicated stream that issued both (141 warp
// instructions per 1024 weights where the flag leaves 89; one launch 2-13% faster, NOTES (10)).
template <class R, bool Slow, bool Tail>
__device__ void item_mma(const Gemm& G, Smem<R>& sm, Ring<R>& ring, int rb, int slice, float (&acc)[4][4]) {
  int const lane = threadIdx.x % 32;
  int const units = G.k_pad / 64;
  for (int c = 0; c < G.chunks<R>(); ++c) {
    int const u0 = c * R::kChunkUnits;
    int const cu = min(R::kChunkUnits, units - u0);
    mbar_wait(&sm.full[ring.stage], ring.round & 1);
    uint8_t const* st = sm.stages[ring.stage];
#pragma unroll
    for (int uu = 0; uu < R::kChunkUnits / kSlices; ++uu) {
      int const u = slice + uu * kSlices;
      if (u >= cu) break;
      if (!Tail || (u0 + u) * 64 + 64 <= G.k_real) {
        unit_mma<R, Slow, 4>(st, u, rb, lane, acc);
      } else {
        unit_mma<R, Slow, 2>(st, u, rb, lane, acc);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&sm.empty[ring.stage]);
    ring.next();
  }
}

template <class R>
__device__ __forceinline__ void item_mma_dispatch(const Gemm& G, Smem<R>& sm, Ring<R>& ring, int rb, int slice,
                                                  float (&acc)[4][4]) {
  bool const tail = G.k_real % 64 != 0;
  if (G.slow) {
    tail ? item_mma<R, true, true>(G, sm, ring, rb, slice, acc) : item_mma<R, true, false>(G, sm, ring, rb, slice, acc);
  } else {
    tail ? item_mma<R, false, true>(G, sm, ring, rb, slice, acc)
         : item_mma<R, false, false>(G, sm, ring, rb, slice, acc);
  }
}

template <int Kind, class R>
__device__ void consume(const Args& a, const Gemm& G, Smem<R>& sm, Ring<R>& ring, int& parity) {
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int const rb = warp & 3, slice = warp >> 2;
  int const gq = lane / 4, cq = lane % 4;
  int const total = sm.r.item_base[sm.r.num_active] * G.items_per_group();
  int begin, end;
  cta_range(total, &begin, &end);
  for (int i = begin; i < end; ++i) {
    Item const it = item_at(sm.r, G.items_per_group(), i);
    // one accumulator chain per k-block of a unit: mma.sync's latency is not serialised
    float acc4[4][4] = {};
    item_mma_dispatch(G, sm, ring, rb, slice, acc4);
    float acc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] = (acc4[0][j] + acc4[1][j]) + (acc4[2][j] + acc4[3][j]);
    // K slices 1.. hand their sums to slice 0, which adds them in slice order.
    if (slice > 0) {
      float* dst = sm.red[parity][slice - 1][rb][lane];
#pragma unroll
      for (int j = 0; j < 4; ++j) dst[j] = acc[j];
    }
    consumers_sync();
    parity ^= 1;
    if (slice > 0) continue;
#pragma unroll
    for (int s = 0; s < kSlices - 1; ++s) {
      float const* src = sm.red[parity ^ 1][s][rb][lane];
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[j] += src[j];
    }
    // accumulator (m16n8): c0,c1 row gq, tokens 2cq, 2cq+1; c2,c3 row gq + 8
    int const m = it.q * kItemRows + rb * 16 + gq;   // weight row (prepared order)
    const float* bias = G.bias ? G.bias + int64_t(it.e) * G.n_pad : nullptr;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      int const n = 2 * cq + t;
      if (n >= it.rows) continue;
      int64_t const row = it.row0 + n;
      if constexpr (Kind == 1) {
        // paired rows (layout.py): 16-row block b = gate[8b..8b+7], then up[8b..8b+7]
        int const col = (m >> 4) * 8 + (m & 7);
        float g = acc[t], u = acc[2 + t];
        if (bias) { g += bias[m]; u += bias[m + 8]; }
        if (col < a.I) a.inter[row * a.I + col] = __float2bfloat16_rn(mc_activation(g, u, mc_activation_of(a.activation, a.alpha, a.limit)));
      } else {
        float const w = a.topk_weights[sm.r.row_slot[row]];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int const mm = m + 8 * h;
          float v = acc[2 * h + t];
          if (bias) v += bias[mm];
          v *= w;
          if (mm < a.H) a.rows[row * a.H + mm] = __float2bfloat16_rn(v);
        }
      }
    }
  }
}

// ---- finalize --------------------------------------------------------------------------------
// The finalize kernel's arithmetic (routing.cuh): per 8 outputs, fp32 sum over j = 0..k-1, then
// one multiply by the scaling factor and one rounding. The k row loads of a thread go out together:
// one at a time (a dependent L2 round trip each) they kept the finalizing CTA 2.4 us past the second
// grid barrier at qwen3 M = 1 (timestamps, NOTES.md 2026-12-01 (11)).
__device__ inline void finalize(const Args& a, const Routing& r) {
  int64_t const chunks = a.H / 8;
  int64_t const n = int64_t(a.num_tokens) * chunks;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    int64_t const t = i / chunks, c = i - t * chunks;
    float acc[8] = {};
    mc_sum_rows<8>(acc, a.top_k, [&](int j) { return r.slot_row[t * a.top_k + j]; },
                   [&](int row) { return __ldcg(reinterpret_cast<const uint4*>(a.rows + int64_t(row) * a.H) + c); });
    uint4 const packed = mc_scaled_bf16x8(acc, a.routed_scaling_factor);
    *(reinterpret_cast<uint4*>(a.out + t * a.H) + c) = packed;
  }
}

// Generic-proxy stores of one phase become visible to the next phase's bulk copies (async proxy)
// and loads in other CTAs: proxy fence, then the grid barrier (which fences at gpu scope).
__device__ __forceinline__ void phase_barrier() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  cooperative_groups::this_grid().sync();
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

template <typename IdT, class R>
__global__ void __launch_bounds__(kThreads, 1) layer_kernel(Args a) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem<R>& sm = *reinterpret_cast<Smem<R>*>(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < R::kStages; ++s) {
      mbar_init(&sm.full[s], 1 + 32);   // the producer's expect-tx arrival + each lane's cp.async arrival
      mbar_init(&sm.empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  route<IdT>(a, sm.r);   // ends with __syncthreads: the barriers are initialised too

  Gemm const g1{a.w13_blocks, a.w13_scales, a.w13_bias, a.w13_slow,
                2 * a.I, (2 * a.I + kRowPad - 1) / kRowPad * kRowPad, a.H, (a.H + kKPad - 1) / kKPad * kKPad};
  Gemm const g2{a.w2_blocks, a.w2_scales, a.w2_bias, a.w2_slow,
                a.H, (a.H + kRowPad - 1) / kRowPad * kRowPad, a.I, (a.I + kKPad - 1) / kKPad * kKPad};
  Ring<R> ring;
  int parity = 0;
  bool const producer = threadIdx.x / 32 == kConsumerWarps;
  if (producer) {
    produce<1>(a, g1, sm, ring);
    prefetch_gemm2(g2, sm.r);
  } else {
    consume<1>(a, g1, sm, ring, parity);
  }
  phase_barrier();
  if (producer) {
    produce<2>(a, g2, sm, ring);
  } else {
    consume<2>(a, g2, sm, ring, parity);
  }
  phase_barrier();
  finalize(a, sm.r);
}

// ---- host ------------------------------------------------------------------------------------
inline bool misaligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a != 0; }

template <typename IdT, class R>
int launch(McLayerCall const* c) {
  int64_t const slots = c->num_tokens * c->top_k;
  if (c->num_tokens < 0 || c->top_k < 1 || slots > kMaxSlots || c->num_experts < 1 ||
      c->num_experts > kMaxExperts || c->hidden_size <= 0 || c->hidden_size % 32 != 0 ||
      c->intermediate_size <= 0 || c->intermediate_size % 32 != 0 || c->hidden_size > INT_MAX / 2 ||
      c->intermediate_size > INT_MAX / 4 || (c->expert_map != nullptr && c->num_global_experts < 0)) {
    return int(cudaErrorInvalidValue);
  }
  if (slots == 0) return int(cudaSuccess);
  if (!c->hidden || !c->topk_ids || !c->topk_weights || !c->out || !c->w13_blocks || !c->w13_scales ||
      !c->w2_blocks || !c->w2_scales || !c->gathered || !c->inter || c->act_rows < slots) {
    return int(cudaErrorInvalidValue);
  }
  if (misaligned(c->hidden, 16) || misaligned(c->out, 16) || misaligned(c->w13_blocks, 16) ||
      misaligned(c->w13_scales, 16) || misaligned(c->w2_blocks, 16) || misaligned(c->w2_scales, 16) ||
      misaligned(c->gathered, 16) || misaligned(c->inter, 16)) {
    return int(cudaErrorInvalidValue);
  }
  Args a;
  a.hidden = static_cast<const __nv_bfloat16*>(c->hidden);
  a.topk_ids = c->topk_ids;
  a.topk_weights = c->topk_weights;
  a.out = static_cast<__nv_bfloat16*>(c->out);
  a.expert_map = c->expert_map;
  a.num_global_experts = c->num_global_experts;
  a.num_tokens = int(c->num_tokens);
  a.top_k = int(c->top_k);
  a.num_experts = int(c->num_experts);
  a.H = int(c->hidden_size);
  a.I = int(c->intermediate_size);
  a.w13_blocks = static_cast<const uint8_t*>(c->w13_blocks);
  a.w13_scales = static_cast<const uint8_t*>(c->w13_scales);
  a.w13_bias = c->w13_bias;
  a.w2_blocks = static_cast<const uint8_t*>(c->w2_blocks);
  a.w2_scales = static_cast<const uint8_t*>(c->w2_scales);
  a.w2_bias = c->w2_bias;
  a.w13_slow = c->w13_scale_max > kFastScaleMax;
  a.w2_slow = c->w2_scale_max > kFastScaleMax;
  a.inter = static_cast<__nv_bfloat16*>(c->inter);
  a.rows = static_cast<__nv_bfloat16*>(c->gathered);
  a.activation = int(c->activation);
  a.alpha = c->swiglu_alpha;
  a.limit = c->swiglu_limit;
  a.routed_scaling_factor = c->routed_scaling_factor;

  // Per device: the shared-memory opt-in and the co-resident grid (one CTA per SM).
  constexpr int kMaxDevices = 64;
  static int grid_of[kMaxDevices] = {};   // benign race: every writer stores the same value
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return int(err);
  if (dev < 0 || dev >= kMaxDevices) return int(cudaErrorInvalidDevice);
  static_assert(sizeof(Smem<R>) <= 227 * 1024, "one CTA per SM: the ring must fit the SM's 227 KB of shared memory");
  auto kernel = layer_kernel<IdT, R>;
  if (grid_of[dev] == 0) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(Smem<R>)));
    if (err != cudaSuccess) return int(err);
    int per_sm = 0, sms = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, sizeof(Smem<R>));
    if (err != cudaSuccess) return int(err);
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return int(err);
    if (per_sm < 1) return int(cudaErrorCooperativeLaunchTooLarge);
    grid_of[dev] = sms;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid_of[dev]);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = sizeof(Smem<R>);
  cfg.stream = c->stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  err = cudaLaunchKernelEx(&cfg, kernel, a);
  return int(err != cudaSuccess ? err : cudaGetLastError());
}

}  // namespace decode
}  // namespace moe_cutlass

