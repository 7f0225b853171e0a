// Routing kernels of the MoE layer: expand (sort slots by expert, gather rows) and
// finalize (sum each token's k expert rows back in token order).
//
// A slot is one (token t, choice j) pair, slot = t * top_k + j. "Rows" are slots in
// expert order: row r of expert e lies in [offsets[e], offsets[e + 1]).
//
// Determinism: no floating-point atomics. Experts are counted with shared-memory integer atomics,
// whose totals do not depend on their order, and summed over tiles in a fixed order; rows are ranked
// in slot order by warp-level matching (same_expert_lanes), so results never depend on timing.
//
// Meant for exactly one translation unit (the rendered routing.cu): finalize_kernel has
// external linkage.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "mxfp4_math.cuh"
#include "pdl.cuh"

namespace moe_cutlass {
namespace routing {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxExperts = 512;
// Up to this many slots one launch does everything (expand_small_kernel): every block counts all the
// slots' experts and ranks, publishes and gathers its own part of them. Against the (then four) tiled
// kernels, a standalone probe (benchmarks/results/raw/probe_20261202T*Z_expand_small_*.json): 8192 slots 21.1 ->
// 13.7 us (qwen3 M = 1024), 16384 slots 46.2 -> 44.3 (gpt-oss M = 4096, the gather's bytes dominate); at
// 32768 slots with 1024 threads 54.7 -> 61.5. 512 threads a block: 256 took 19.2 us at 8192 slots, 1024 16.6.
constexpr int kSmallSlots = 16384;
constexpr int kSmallThreads = 512;
// Larger inputs are cut into tiles of this many slots (count, scatter, gather). When a block walked
// its tile serially, per warp, the tile size set count's and scatter's time whatever M: 4096-slot
// tiles 7 and 13 us, 1024-slot tiles 3.5 and 5.8 (benchmarks/results/raw/profile_20261201T0441*_lib*.json,
// one device session).
constexpr int kTileSlots = 1024;
// Tiles whose counts a scatter thread loads at once: one dependent L2 round trip per batch, four
// at M * top_k = 131072.
constexpr int kPrefixBatch = 32;
constexpr int kMaxSmallBlocks = 256;
// A one-launch block's part of the slots (at most): ranked by one warp, 32 slots per round.
constexpr int kMaxSmallPart = (kSmallSlots + kMaxSmallBlocks - 1) / kMaxSmallBlocks;
static_assert(kMaxSmallPart <= kSmallThreads, "a part's weights load one per thread");
constexpr int kMaxStreamBlocks = 4096;
// Rows a block gathers (or a finalize thread sums) per loop trip: independent loads keep
// bytes in flight.
constexpr int kRowsPerTrip = 4;
constexpr int kBf16PerChunk = 8;

static_assert(kMaxExperts % kThreads == 0, "block scan assumes whole experts per thread");

template <typename IdT>
struct ExpandArgs {
  const IdT* topk_ids;
  const float* topk_weights;
  const int32_t* expert_map;  // nullptr: ids are local already
  int64_t num_global_experts;
  int num_slots;
  int top_k;
  int num_experts;
  const __nv_bfloat16* hidden;
  int64_t hidden_stride;
  int64_t chunks_per_row;
  int32_t* expert_counts;
  int32_t* expert_offsets;
  int32_t* sorted_slots;
  int32_t* slot_to_row;
  __nv_bfloat16* gathered;
  int64_t gathered_stride;
  float* row_weights;
  int32_t* tile_counts;  // [num_tiles][num_experts], large path only
};

// Slots a thread loads per batch (load_tile, the one-launch count), every load of a batch issued before
// any is used: a count/scatter tile is one batch. Loaded and stored one at a time, each slot cost a
// dependent memory round trip: count and scatter took 13 and 22 us per call whatever M
// (profile_20261201T032708Z), expand_small 18 us at 2048 slots.
constexpr int kSlotBatch = 8;
static_assert(kTileSlots <= kSlotBatch * kThreads, "a tile is one batch");
// Blocks per tile in the scatter kernel, each ranking and publishing one part of it. When each ranked
// the whole tile and published 1/kScatterSplit of it: with one block per 4096-slot tile its scattered
// 4-byte stores kept scatter at 19.5 us, eight blocks per tile took it to 13.0
// (raw/profile_20261201T0437*_lib*.json, one session).
constexpr int kScatterSplit = 4;

// Local expert of a routing id, or -1 when the slot is dropped. Every index is range-checked
// before it is used, so no id can cause an out-of-bounds access.
template <typename IdT>
__device__ __forceinline__ int local_expert(const ExpandArgs<IdT>& a, int64_t id) {
  if (a.expert_map != nullptr) {
    if (id < 0 || id >= a.num_global_experts) return -1;
    id = __ldg(a.expert_map + id);
  }
  return (id >= 0 && id < a.num_experts) ? static_cast<int>(id) : -1;
}

// The part [lo, hi) of a tile of len slots that block `part` of `parts` publishes.
__device__ __forceinline__ void part_range(int len, int part, int parts, int* lo, int* hi) {
  const int per = (len + parts - 1) / parts;
  *lo = min(part * per, len);
  *hi = min(*lo + per, len);
}

// tile_expert[i] = local expert of slot begin + i for i < len, and tile_weight[i - w_lo] = its
// routing weight for i in [w_lo, w_hi): every load of a batch issued before the first store.
template <typename IdT>
__device__ void load_tile(const ExpandArgs<IdT>& a, int begin, int len, int* tile_expert, int w_lo, int w_hi,
                          float* tile_weight) {
  for (int i0 = threadIdx.x; i0 < len; i0 += kThreads * kSlotBatch) {
    int64_t id[kSlotBatch];
    float w[kSlotBatch];
#pragma unroll
    for (int u = 0; u < kSlotBatch; ++u) {
      const int i = i0 + u * kThreads;
      id[u] = i < len ? static_cast<int64_t>(__ldg(a.topk_ids + begin + i)) : -1;
      w[u] = i >= w_lo && i < w_hi ? __ldg(a.topk_weights + begin + i) : 0.0f;
    }
    int e[kSlotBatch];
#pragma unroll
    for (int u = 0; u < kSlotBatch; ++u) e[u] = local_expert(a, id[u]);
#pragma unroll
    for (int u = 0; u < kSlotBatch; ++u) {
      const int i = i0 + u * kThreads;
      if (i < len) tile_expert[i] = e[u];
      if (i >= w_lo && i < w_hi) tile_weight[i - w_lo] = w[u];
    }
  }
}

// visit(s, e) for every slot s in [begin, end) with its local expert e (-1: dropped), Threads threads
// striding over the slots, kSlotBatch loads of a thread in flight at once.
template <int Threads, typename IdT, typename Visit>
__device__ __forceinline__ void for_each_slot_expert(const ExpandArgs<IdT>& a, int begin, int end, Visit visit) {
  for (int i0 = begin + static_cast<int>(threadIdx.x); i0 < end; i0 += Threads * kSlotBatch) {
    int64_t id[kSlotBatch];
#pragma unroll
    for (int u = 0; u < kSlotBatch; ++u) {
      const int s = i0 + u * Threads;
      id[u] = s < end ? static_cast<int64_t>(__ldg(a.topk_ids + s)) : -1;
    }
#pragma unroll
    for (int u = 0; u < kSlotBatch; ++u) {
      const int s = i0 + u * Threads;
      const int e = local_expert(a, id[u]);  // before the test: inside it, ptxas spilled 12 bytes
      if (s < end) visit(s, e);
    }
  }
}

// Writes the maps and row weights of the slots begin + i, i < len, from part_row[i] (the slot's row,
// -1: dropped) and part_weight[i].
template <int Threads, typename IdT>
__device__ void publish_rows(const ExpandArgs<IdT>& a, int begin, int len, const int* part_row,
                             const float* part_weight) {
  for (int i = threadIdx.x; i < len; i += Threads) {
    const int row = part_row[i];
    a.slot_to_row[begin + i] = row;
    if (row >= 0) {
      a.sorted_slots[row] = begin + i;
      a.row_weights[row] = part_weight[i];
    }
  }
}

__device__ __forceinline__ void zero_warp_hist(int* hist) {
  for (int i = threadIdx.x; i < kWarps * kMaxExperts; i += kThreads) hist[i] = 0;
}

// Each warp owns one contiguous part of the tile; walking it in slot order is what makes
// the ranks stable.
__device__ __forceinline__ void warp_range(int len, int* begin, int* end) {
  const int per_warp = (len + kWarps - 1) / kWarps;
  const int warp = threadIdx.x / 32;
  *begin = min(warp * per_warp, len);
  *end = min(*begin + per_warp, len);
}

// The lanes of the warp whose e equals this lane's (e in [-1, kMaxExperts)): one ballot per bit
// of e, as CUB's MatchAny, in place of __match_any_sync (whose cost grows with the distinct values
// in the warp, 20-32 of 32 under real routing). Measured with other changes, on two machines:
// count 8.1 -> 7.1 us, scatter 21.8 -> 19.6 (raw/profile_20261201T042437Z.json, 042939Z).
constexpr int kExpertBits = 10;
static_assert(kMaxExperts < (1 << kExpertBits) - 1, "-1 (all bits set) must not alias an expert");

__device__ __forceinline__ unsigned same_expert_lanes(int e) {
  unsigned peers = 0xffffffffu;
#pragma unroll
  for (int b = 0; b < kExpertBits; ++b) {
    const bool bit = (e >> b) & 1;
    const unsigned ones = __ballot_sync(0xffffffffu, bit);
    peers &= bit ? ones : ~ones;
  }
  return peers;
}

// hist[w][e] = number of slots of expert e in warp w's part of the tile.
__device__ inline void count_per_warp(const int* tile_expert, int len, int* hist) {
  int begin, end;
  warp_range(len, &begin, &end);
  const int lane = threadIdx.x % 32;
  int* warp_hist = hist + (threadIdx.x / 32) * kMaxExperts;
  for (int base = begin; base < end; base += 32) {  // warp-uniform trip count
    const int s = base + lane;
    const int e = s < end ? tile_expert[s] : -1;
    const unsigned peers = same_expert_lanes(e);
    if (e >= 0 && lane == 31 - __clz(peers)) warp_hist[e] += __popc(peers);
    __syncwarp();
  }
}

// Replaces hist[w][e] by the first row of expert e for warp w: base(e) plus the counts
// of the warps before w.
template <typename BaseFn>
__device__ void warp_counts_to_bases(int* hist, int num_experts, BaseFn base) {
  for (int e = threadIdx.x; e < num_experts; e += kThreads) {
    int running = base(e);
    for (int w = 0; w < kWarps; ++w) {
      const int c = hist[w * kMaxExperts + e];
      hist[w * kMaxExperts + e] = running;
      running += c;
    }
  }
}

// One warp: calls emit(local_slot, row) for every slot in [begin, end), in slot order, row =
// next_row[e] + the slot's rank among the expert's slots there (-1 for dropped slots), after the
// calling lane's last read of tile_expert[local_slot]: emit may overwrite that entry (the expand
// kernels store the row there). next_row[e] ends past the expert's last row.
template <typename Emit>
__device__ __forceinline__ void rank_in_warp(const int* tile_expert, int begin, int end, int* next_row, Emit emit) {
  const int lane = threadIdx.x % 32;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int base = begin; base < end; base += 32) {
    const int s = base + lane;
    const int e = s < end ? tile_expert[s] : -1;
    const unsigned peers = same_expert_lanes(e);
    if (s < end) emit(s, e >= 0 ? next_row[e] + __popc(peers & lanes_below) : -1);
    __syncwarp();  // every lane has read next_row[e] before its leader advances it
    if (e >= 0 && lane == 31 - __clz(peers)) next_row[e] += __popc(peers);
    __syncwarp();
  }
}

// rank_in_warp over the tile, each warp its warp_range of it; hist must hold the bases from
// warp_counts_to_bases.
template <typename Emit>
__device__ void rank_per_warp(const int* tile_expert, int len, int* hist, Emit emit) {
  int begin, end;
  warp_range(len, &begin, &end);
  rank_in_warp(tile_expert, begin, end, hist + (threadIdx.x / 32) * kMaxExperts, emit);
}

// offsets[e] = sum of counts[0..e), offsets[num_experts] = total. counts must be visible
// to the whole block; ends with a barrier.
template <int Threads = kThreads>
__device__ inline void block_exclusive_scan(const int* counts, int* offsets, int num_experts) {
  constexpr int kPerThread = (kMaxExperts + Threads - 1) / Threads;
  __shared__ int warp_totals[Threads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int first = threadIdx.x * kPerThread;
  int local[kPerThread];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    local[i] = first + i < num_experts ? counts[first + i] : 0;
    sum += local[i];
  }
  int inclusive = sum;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int running = inclusive - sum;
  for (int w = 0; w < warp; ++w) running += warp_totals[w];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (first + i < num_experts) offsets[first + i] = running;
    running += local[i];
  }
  if (threadIdx.x == Threads - 1) offsets[num_experts] = running;  // experts past the end count 0
  __syncthreads();
}

// offsets from counts (block_exclusive_scan); block 0 publishes both.
template <int Threads, typename IdT>
__device__ __forceinline__ void take_offsets(const ExpandArgs<IdT>& a, const int* counts, int* offsets) {
  block_exclusive_scan<Threads>(counts, offsets, a.num_experts);
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < a.num_experts; e += Threads) a.expert_counts[e] = counts[e];
    for (int e = threadIdx.x; e <= a.num_experts; e += Threads) a.expert_offsets[e] = offsets[e];
  }
}

// gathered[row_of_slot[s]] = hidden[s / top_k] for every slot s that has a row, walked in slot
// order: a token's k slots are neighbours, so its row is read from DRAM once and its other copies
// hit in cache. (Walked in row order, a token's k reads lay far apart: qwen3 M = 16384 moved its
// 537 MB of rows in 238 us, profile_20261201T032708Z.) Each trip a block copies kRowsPerTrip
// slots' rows, its threads striding over their 16-byte chunks, kRowsPerTrip loads in flight each.
template <typename IdT>
__device__ void gather_rows(const ExpandArgs<IdT>& a, const int* row_of_slot, int num_slots) {
  for (int s0 = blockIdx.x * kRowsPerTrip; s0 < num_slots; s0 += gridDim.x * kRowsPerTrip) {
    const uint4* src[kRowsPerTrip];
    uint4* dst[kRowsPerTrip];
    unsigned copy = 0;  // bit u: slot s0 + u has a row
#pragma unroll
    for (int u = 0; u < kRowsPerTrip; ++u) {
      const int s = min(s0 + u, num_slots - 1);  // past the end: a harmless read of the last slot's row
      const int row = row_of_slot[s];
      if (s0 + u < num_slots && row >= 0) copy |= 1u << u;
      src[u] = reinterpret_cast<const uint4*>(a.hidden + static_cast<int64_t>(s / a.top_k) * a.hidden_stride);
      dst[u] = reinterpret_cast<uint4*>(a.gathered + static_cast<int64_t>(max(row, 0)) * a.gathered_stride);
    }
    const int chunks = static_cast<int>(a.chunks_per_row);  // hidden_size / 8 < 2^31
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      uint4 v[kRowsPerTrip];
#pragma unroll
      for (int u = 0; u < kRowsPerTrip; ++u) v[u] = __ldg(src[u] + c);
#pragma unroll
      for (int u = 0; u < kRowsPerTrip; ++u) {
        if (copy >> u & 1u) dst[u][c] = v[u];
      }
    }
  }
}

// Every expand kernel starts so (pdl.cuh): it waits for the kernel before it when mc_layer launched
// it dependent (count and expand_small never are: they follow the caller's work), then lets the next
// one start on the SMs it leaves free. The GEMM1 after expand_small waits before reading anything
// (kWaitFirst); the one after the gather reads the offsets, which come from further back, before.
__device__ __forceinline__ void begin_expand_kernel() {
  pdl::wait();
  pdl::launch_dependents();
}

// Small inputs, one launch (kSmallThreads per block). Every block counts the experts of all the slots
// and of those before its own part of them (shared-memory integer atomics: no per-warp histograms to
// sum, and a thread counts kSlotBatch slots per memory round trip), takes the offsets from the counts,
// ranks its part in slot order in one warp (row = offset + slots of the expert before the part + rank
// in the part), publishes the part's maps and gathers its rows; block 0 publishes counts and offsets.
// It replaced a version in which every block ranked every slot in per-warp rounds of ballots (8 rounds of
// 10 ballots per warp at 2048 slots) and then gathered a grid-strided share: qwen3 M = 256 11.7 -> 6.0 us,
// dsv3 M = 256 15.2 -> 10.9, gpt-oss 8.0 -> 5.4, M = 64 -0.5..-0.9 us; without its gather the kernel takes
// 3.4-4.5 us up to 2048 slots, 6.4 at 8192 and 9.8 at 16384. The gather runs one warp per row; a 4-row part
// of 7168-wide rows (dsv3 M = 16) then takes four round trips per lane, 5.7 -> 7.4 us against the kernel
// before (profile_20261202T050045Z). The part's (row, chunk) items flattened over all threads, eight loads
// in flight each, measured slower everywhere else (raw/probe_20261202T050500Z_expand_small_flat_gather_
// dropped.json against raw/probe_20261202T044700Z_*: qwen3 M = 256 6.2 -> 7.0 us, M = 1024 14.0 -> 16.4,
// dsv3 M = 256 11.0 -> 13.6) and still 0.9 us behind the kernel before at dsv3 M = 16.
// One block per SM is enough (at most 256 blocks of 512 threads, two fit an SM at 56 registers); with the
// default bound ptxas kept 40 registers and spilled the part's weight across the counting loop.
template <typename IdT>
__global__ void __launch_bounds__(kSmallThreads, 1) expand_small_kernel(ExpandArgs<IdT> a) {
  begin_expand_kernel();
  __shared__ int counts[kMaxExperts];
  __shared__ int before[kMaxExperts];  // slots of each expert before the part, then its next row
  __shared__ int offsets[kMaxExperts + 1];
  __shared__ int part_expert[kMaxSmallPart];  // the part's experts, then their rows
  __shared__ float part_weight[kMaxSmallPart];
  const int E = a.num_experts;
  int lo, hi;
  part_range(a.num_slots, blockIdx.x, gridDim.x, &lo, &hi);
  const float weight = threadIdx.x < hi - lo ? __ldg(a.topk_weights + lo + threadIdx.x) : 0.0f;
  for (int e = threadIdx.x; e < E; e += kSmallThreads) {
    counts[e] = 0;
    before[e] = 0;
  }
  __syncthreads();
  for_each_slot_expert<kSmallThreads>(a, 0, a.num_slots, [&](int s, int e) {
    if (e >= 0) {
      atomicAdd(counts + e, 1);
      if (s < lo) atomicAdd(before + e, 1);
    }
    if (s >= lo && s < hi) part_expert[s - lo] = e;
  });
  if (threadIdx.x < hi - lo) part_weight[threadIdx.x] = weight;
  __syncthreads();
  take_offsets<kSmallThreads>(a, counts, offsets);
  for (int e = threadIdx.x; e < E; e += kSmallThreads) before[e] += offsets[e];
  __syncthreads();
  if (threadIdx.x < 32) rank_in_warp(part_expert, 0, hi - lo, before, [&](int s, int row) { part_expert[s] = row; });
  __syncthreads();
  publish_rows<kSmallThreads>(a, lo, hi - lo, part_expert, part_weight);
  // One warp per row, kRowsPerTrip 16-byte chunks in flight per lane.
  const int chunks = static_cast<int>(a.chunks_per_row);
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < hi - lo; r += kSmallThreads / 32) {
    const int row = part_expert[r];
    if (row < 0) continue;
    const uint4* src = reinterpret_cast<const uint4*>(a.hidden + static_cast<int64_t>((lo + r) / a.top_k) * a.hidden_stride);
    uint4* dst = reinterpret_cast<uint4*>(a.gathered + static_cast<int64_t>(row) * a.gathered_stride);
    for (int c0 = lane; c0 < chunks; c0 += 32 * kRowsPerTrip) {
      uint4 v[kRowsPerTrip];
#pragma unroll
      for (int u = 0; u < kRowsPerTrip; ++u) {
        if (c0 + 32 * u < chunks) v[u] = __ldg(src + c0 + 32 * u);
      }
#pragma unroll
      for (int u = 0; u < kRowsPerTrip; ++u) {
        if (c0 + 32 * u < chunks) dst[c0 + 32 * u] = v[u];
      }
    }
  }
}

template <typename IdT>
__device__ __forceinline__ int tile_len(const ExpandArgs<IdT>& a, int tile) {
  return min(kTileSlots, a.num_slots - tile * kTileSlots);
}

// Large path 1/3: tile_counts[b][e] = slots of expert e in tile b (shared-memory integer atomics).
template <typename IdT>
__global__ void __launch_bounds__(kThreads) expand_count_kernel(ExpandArgs<IdT> a) {
  begin_expand_kernel();
  __shared__ int counts[kMaxExperts];
  const int begin = blockIdx.x * kTileSlots;
  for (int e = threadIdx.x; e < a.num_experts; e += kThreads) counts[e] = 0;
  __syncthreads();
  for_each_slot_expert<kThreads>(a, begin, begin + tile_len(a, blockIdx.x), [&](int, int e) {
    if (e >= 0) atomicAdd(counts + e, 1);
  });
  __syncthreads();
  int32_t* tile_counts = a.tile_counts + static_cast<int64_t>(blockIdx.x) * a.num_experts;
  for (int e = threadIdx.x; e < a.num_experts; e += kThreads) tile_counts[e] = counts[e];
}

// Large path 2/3 (kScatterSplit blocks per tile, each one part of it): the counts and offsets from every
// tile's counts (block 0 publishes them), the first row of each expert in the part from the tiles before
// and the tile's slots before the part, then the part's rows in slot order (one round of 32 slots per
// warp), maps and row weights. It replaced a prefix kernel between count and scatter (one block: the
// offsets, and the tile counts rewritten as prefixes) and a scatter that ranked the whole tile in every
// block, with a count kernel that summed per-warp ballot histograms. Per-kernel device time in the layer,
// count + prefix + scatter -> count + scatter (raw/profile_20261202T0450*Z_{base,new}_routing_ab.json, min of
// two): qwen3 M = 4096 12.7 -> 8.2 us; at M = 16384, where each scatter block sums 128 tiles' counts,
// qwen3 20.7 -> 16.8, dsv3 (256 experts) 25.5 -> 25.9.
template <typename IdT>
__global__ void __launch_bounds__(kThreads) expand_scatter_kernel(ExpandArgs<IdT> a, int num_tiles) {
  begin_expand_kernel();
  constexpr int kPartSlots = kTileSlots / kScatterSplit;
  static_assert(kPartSlots == kThreads, "a part is one round of 32 slots per warp");
  __shared__ int part_expert[kPartSlots];  // then the rows
  __shared__ float part_weight[kPartSlots];
  __shared__ int hist[kWarps * kMaxExperts];
  __shared__ int counts[kMaxExperts];
  __shared__ int before[kMaxExperts];  // slots of each expert before the part
  __shared__ int offsets[kMaxExperts + 1];
  const int tile = blockIdx.x / kScatterSplit;
  const int begin = tile * kTileSlots;
  const int E = a.num_experts;
  int lo, hi;
  part_range(tile_len(a, tile), blockIdx.x % kScatterSplit, kScatterSplit, &lo, &hi);
  for (int e = threadIdx.x; e < E; e += kThreads) {
    int total = 0;
    int prior = 0;
    for (int b0 = 0; b0 < num_tiles; b0 += kPrefixBatch) {
      int c[kPrefixBatch];
#pragma unroll
      for (int u = 0; u < kPrefixBatch; ++u) {
        c[u] = b0 + u < num_tiles ? __ldg(a.tile_counts + static_cast<int64_t>(b0 + u) * E + e) : 0;
      }
#pragma unroll
      for (int u = 0; u < kPrefixBatch; ++u) {
        total += c[u];
        prior += b0 + u < tile ? c[u] : 0;
      }
    }
    counts[e] = total;
    before[e] = prior;
  }
  zero_warp_hist(hist);
  __syncthreads();
  for_each_slot_expert<kThreads>(a, begin, begin + lo, [&](int, int e) {
    if (e >= 0) atomicAdd(before + e, 1);
  });
  load_tile(a, begin + lo, hi - lo, part_expert, 0, hi - lo, part_weight);
  __syncthreads();
  take_offsets<kThreads>(a, counts, offsets);
  count_per_warp(part_expert, hi - lo, hist);
  __syncthreads();
  warp_counts_to_bases(hist, E, [&](int e) { return offsets[e] + before[e]; });
  __syncthreads();
  rank_per_warp(part_expert, hi - lo, hist, [&](int s, int row) { part_expert[s] = row; });
  __syncthreads();
  publish_rows<kThreads>(a, begin + lo, hi - lo, part_expert, part_weight);
}

// Large path 3/3: gather the rows.
template <typename IdT>
__global__ void __launch_bounds__(kThreads) expand_gather_kernel(ExpandArgs<IdT> a) {
  begin_expand_kernel();
  gather_rows(a, a.slot_to_row, a.num_slots);
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Where a launch goes: onto the stream, or (mc_layer replaying the CUDA graph it captured from
// these same launches, templates/sm90/layer_graph.cuh) into the next kernel node of that graph,
// with this call's arguments and grid. The same code path decides both, so the node sequence
// of a graph always matches the launches it stands for.
struct NodeUpdate {
  cudaGraphExec_t exec;
  const cudaGraphNode_t* nodes;
  int next;
};

template <class T>
struct Same {
  using type = T;
};

// dependent: a programmatic dependent launch on the kernel before it (pdl.cuh); the kernel waits.
template <class... P>
inline cudaError_t launch(void (*kernel)(P...), int grid, int threads, cudaStream_t stream, NodeUpdate* update,
                          bool dependent, typename Same<P>::type... args) {
  if (update == nullptr) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = dependent ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, args...);
  }
  void* params[] = {static_cast<void*>(&args)...};
  cudaKernelNodeParams node = {};
  node.func = reinterpret_cast<void*>(kernel);
  node.gridDim = dim3(grid);
  node.blockDim = dim3(threads);
  node.kernelParams = params;
  return cudaGraphExecKernelNodeSetParams(update->exec, update->nodes[update->next++], &node);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Grid for `items` of grid-strided work, `per_block` items per block and trip.
inline int grid_blocks(int64_t items, int64_t per_block, int max_blocks) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, max_blocks)));
}

// The tiled path's launches: count, scatter, gather.
constexpr int kTiledExpandKernels = 3;

// Whether expand runs as the one expand_small launch for this many slots (M * top_k), or as the
// kTiledExpandKernels.
// mc_layer's graph variants and the first GEMM1's launch mode (pdl.cuh) follow the same decision.
inline bool one_kernel_expand(int64_t slots) { return slots <= kSmallSlots; }

inline int64_t expand_workspace_ints(int64_t num_tokens, int top_k, int num_experts) {
  const int64_t slots = num_tokens * top_k;
  if (one_kernel_expand(slots)) return 0;
  return ((slots + kTileSlots - 1) / kTileSlots) * num_experts;
}

template <typename IdT>
int expand(const IdT* topk_ids, const float* topk_weights, int64_t num_tokens, int top_k,
           const int32_t* expert_map, int64_t num_global_experts, int num_experts,
           const void* hidden, int64_t hidden_stride, int64_t hidden_size, int32_t* expert_counts,
           int32_t* expert_offsets, int32_t* sorted_slots, int32_t* slot_to_row, void* gathered,
           int64_t gathered_stride, float* row_weights, int32_t* workspace, int64_t workspace_ints,
           cudaStream_t stream, NodeUpdate* update = nullptr, bool dependent = false) {
  const bool bad_sizes = num_tokens < 0 || top_k < 1 || num_experts < 1 || num_experts > kMaxExperts ||
                         hidden_size <= 0 || hidden_size % kBf16PerChunk != 0 ||
                         hidden_size / kBf16PerChunk > INT_MAX || num_tokens * top_k > INT_MAX || (expert_map != nullptr && num_global_experts < 0);
  const bool bad_rows = hidden_stride < hidden_size || gathered_stride < hidden_size ||
                        hidden_stride % kBf16PerChunk != 0 || gathered_stride % kBf16PerChunk != 0 ||
                        !aligned16(hidden) || !aligned16(gathered);
  const bool missing = expert_counts == nullptr || expert_offsets == nullptr ||
                       (num_tokens > 0 && (topk_ids == nullptr || topk_weights == nullptr || hidden == nullptr ||
                                           sorted_slots == nullptr || slot_to_row == nullptr ||
                                           gathered == nullptr || row_weights == nullptr));
  if (bad_sizes || bad_rows || missing) {
    return cudaErrorInvalidValue;
  }
  ExpandArgs<IdT> a{topk_ids, topk_weights, expert_map, num_global_experts,
                    static_cast<int>(num_tokens * top_k), top_k, num_experts,
                    static_cast<const __nv_bfloat16*>(hidden), hidden_stride,
                    hidden_size / kBf16PerChunk, expert_counts, expert_offsets, sorted_slots,
                    slot_to_row, static_cast<__nv_bfloat16*>(gathered), gathered_stride,
                    row_weights, workspace};
  if (one_kernel_expand(a.num_slots)) {
    return launch(expand_small_kernel<IdT>, grid_blocks(a.num_slots, kRowsPerTrip, kMaxSmallBlocks), kSmallThreads,
                  stream, update, false, a);
  }
  const int num_tiles = ceil_div(a.num_slots, kTileSlots);
  if (workspace == nullptr || workspace_ints < expand_workspace_ints(num_tokens, top_k, num_experts)) {
    return cudaErrorInvalidValue;
  }
  cudaError_t err = launch(expand_count_kernel<IdT>, num_tiles, kThreads, stream, update, false, a);
  if (err != cudaSuccess) return err;
  err = launch(expand_scatter_kernel<IdT>, num_tiles * kScatterSplit, kThreads, stream, update, dependent, a,
               num_tiles);
  if (err != cudaSuccess) return err;
  return launch(expand_gather_kernel<IdT>, grid_blocks(a.num_slots, kRowsPerTrip, kMaxStreamBlocks), kThreads, stream,
                update, dependent, a);
}

struct FinalizeArgs {
  const __nv_bfloat16* rows;
  int64_t rows_stride;
  int64_t num_rows;
  const int32_t* slot_to_row;
  int64_t num_tokens;
  int top_k;
  int64_t chunks_per_row;
  float routed_scaling_factor;
  __nv_bfloat16* out;
  int64_t out_stride;
};

// One thread per 16-byte chunk of an output row: fp32 sum over j in order 0..k-1, then
// one multiply by the scaling factor and one rounding to bf16.
__global__ void __launch_bounds__(kThreads) finalize_kernel(FinalizeArgs a) {
  pdl::wait();  // launched dependent on GEMM2 by mc_layer (pdl.cuh); a no-op otherwise
  const int64_t n = a.num_tokens * a.chunks_per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = i / a.chunks_per_row;
    const int64_t c = i - t * a.chunks_per_row;
    float acc[kBf16PerChunk];
#pragma unroll
    for (int q = 0; q < kBf16PerChunk; ++q) acc[q] = 0.0f;
    mc_sum_rows<kRowsPerTrip>(
        acc, a.top_k,
        [&](int j) {
          int const row = __ldg(a.slot_to_row + t * a.top_k + j);
          return row >= a.num_rows ? -1 : row;
        },
        [&](int row) { return __ldg(reinterpret_cast<const uint4*>(a.rows + row * a.rows_stride) + c); });
    uint4 const packed = mc_scaled_bf16x8(acc, a.routed_scaling_factor);
    *(reinterpret_cast<uint4*>(a.out + t * a.out_stride) + c) = packed;
  }
}

inline int finalize(const void* rows, int64_t rows_stride, int64_t num_rows, const int32_t* slot_to_row,
                    int64_t num_tokens, int top_k, int64_t hidden_size, float routed_scaling_factor,
                    void* out, int64_t out_stride, cudaStream_t stream, NodeUpdate* update = nullptr,
                    bool dependent = false) {
  if (num_tokens < 0 || top_k < 1 || num_rows < 0 || hidden_size <= 0 ||
      hidden_size % kBf16PerChunk != 0 || rows_stride < hidden_size || out_stride < hidden_size ||
      rows_stride % kBf16PerChunk != 0 || out_stride % kBf16PerChunk != 0 || !aligned16(rows) ||
      !aligned16(out)) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  if (rows == nullptr || slot_to_row == nullptr || out == nullptr) return cudaErrorInvalidValue;
  FinalizeArgs a{static_cast<const __nv_bfloat16*>(rows), rows_stride, num_rows, slot_to_row,
                 num_tokens, top_k, hidden_size / kBf16PerChunk, routed_scaling_factor,
                 static_cast<__nv_bfloat16*>(out), out_stride};
  return launch(finalize_kernel, grid_blocks(num_tokens * a.chunks_per_row, kThreads, kMaxStreamBlocks), kThreads,
                stream, update, dependent, a);
}

}  // namespace routing
}  // namespace moe_cutlass
