// moe_cutlass: SM90 MXFP4 x BF16 ptr-array mainloop (TMA + RS WGMMA, warp specialized).
//
// A documented fork of CUTLASS 4.2's
//   cutlass/gemm/collective/sm90_mma_array_tma_gmma_rs_warpspecialized_mixed_input.hpp
//   (+ cutlass/detail/collective/mixed_input_utils.hpp)
// It plugs into the stock ptr-array kernels (GemmUniversal with
// KernelPtrArrayTmaWarpSpecializedCooperative / Pingpong), into our fork of the cooperative one
// with three consumer warpgroups for 192-row tiles (moe_gemm_kernel.hpp), and into the grouped
// tile scheduler. A 192-row tile's last M tile may run past Npad: its A slabs and scale rows are
// zero-filled by TMA and the epilogue stores no row past n_real.
//
// What differs from upstream (and why):
//  1. Operand A is MXFP4 weights in OUR prepared layout (moe_cutlass/layout.py): 64-row x 64-K
//     "units" of 2 KB, contiguous along K inside a 64-row slab, so a weight tile is TileM/64
//     contiguous runs (the A TMA uses a (256 B, unit rows, slabs) view, not (M, K)). Inside a unit,
//     thread t of a warpgroup finds its whole RS-WGMMA A fragment for the unit (4 k-blocks x 8
//     values) in the 16 bytes at 16*t: one conflict-free 128-bit ld.shared per unit instead of
//     cute's smem->rmem tiled copy (upstream: swizzled tile, copy_tensors_MK + retiled fragments).
//  2. Scales are per 32 K elements (upstream: one scale per row per K tile, a static_assert, and
//     a silently wrong result when chunk_size=32 is given with device-only shapes), in OUR
//     prepared layout too: per 64-row slab and 64-K unit, 128 bytes holding one 32-bit word per
//     thread row pair (r, r + 8) with the unit's two groups' E8M0 bytes, biased and placed so that a
//     mask, and a rotation and a mask, give a thread its bf16x2 multipliers (mxfp4_math.cuh,
//     mc_scale_pairs; layout.py). The tile's blocks come by TMA with the A/B tiles of the same stage,
//     as A's: a (128 B, unit, slab, E) view. Per unit and thread: one 32-bit ld.shared and 3 ALU
//     instructions, where one byte per (row, group) took 4 LDS.U8 + 4 IMAD (NOTES.md 2026-12-02 (27)).
//  3. Conversion: custom e2m1 -> bf16 by bit placement: the offline layout puts each code's bits
//     where a mask (after a shift) turns them into the bf16 of value * 2^-126, and ONE bf16x2
//     multiply by 2^(s-1) applies the E8M0 scale and fixes the exponent bias (5 LOP3 + 2 SHF +
//     2 IMAD.SHL + 4 HMUL2 per 8 weights, mxfp4_math.cuh says why and NOTES.md 2026-12-02 (26) what
//     it measured; the TensorRT-LLM layout before it took 6 + 2 + 3 + 4, the prmt look-up 12-17 ALU).
//     Exact for scale bytes <= 128; a weight tensor holding a larger byte (known offline:
//     layout.py's scale_max) runs the whole call on a two-multiply path (2^126, then 2^(s-127))
//     that is exact for every byte, 255 giving NaN. No per-byte scale tests in the loop. Upstream
//     has no e2m1 fast path on SM90 (generic ~100 instr/value converter).
//  4. Static TMA descriptors over all experts, encoded once on the host: A as (256 B, unit rows,
//     slabs, E), scales as (Npad, Kp/32, E), B as the whole act buffer (rows, K) with the tile's
//     first row offsets[e] (+ the launch's row window, moe_rows.hpp) + n * TileN (DeepGEMM's
//     "contiguous layout"; the epilogue masks rows past the expert, and a 96/128-token tile that
//     runs past them loads B in 8-row chunks, the chunks wholly past pointed out of bounds so TMA
//     zero-fills them without reading). Upstream rewrites A, B and scale descriptors in smem,
//     fences them and publishes them to global memory on every group change (tensormap.replace;
//     about 5000 cycles per change, KERNEL_NOTES H.2), and with the grouped scheduler's strided
//     tile order nearly every tile of a CTA is a new group. Here the kernel layer's tensormap
//     hooks are no-ops and tensors_perform_update only records (expert, first row). K is the
//     REAL K for B (the weights are padded to Kp = roundup(K, 64) with zeros; TMA zero fills B's
//     K tail, so padding never reads past a token row).
//  5. Consumer schedule: two A register sets; the GMMAs of k tile t (one arrive/commit for the
//     whole tile) run while tile t+1 is read from smem and converted into the other set, then
//     wait<0> and release tile t's stage (upstream converts k-block kb+1 during k-block kb with
//     wait<K-1> across tiles, which ptxas 13 answers with C7513 wgmma serialization). mma()
//     releases every stage itself; mma_tail only waits.
//  6. N tiles <= 32 spread the k-blocks over 2-4 independent accumulator chains (small-N GMMAs
//     are latency bound on the accumulator dependency), summed in a fixed order at the end.
//  7. Zero points, scale look-up tables and swap-AB are removed; multicast is the tokens' only (11.).
//     The Pingpong schedule compiles (TileM 64) but measured slower than Cooperative and is
//     not in the kernel table.
//  8. mma() takes a hook that runs once, after the first k tile's GMMAs are issued and the next k
//     tile converted: the kernel fork issues the epilogue's dependent loads there, in the shadow
//     of the mainloop (moe_gemm_kernel.hpp, 4.).
//  9. load<TokensAfterWait = true> (a programmatic dependent launch's first tile, pdl.cuh and
//     moe_gemm_kernel.hpp, 5.) issues the weights and scales of its first min(k tiles, Stages)
//     stages, waits for the kernel before, then their tokens: GEMM2's weights stream in while
//     GEMM1 still runs. A version that waits at the first tile with no early loads measured, in
//     graph replay, 3.1% slower at gpt-oss M = 4, 0.4-2.2% at dsv4-flash and 0.8-3.5% at dsv3,
//     but 1.3-5.6% faster at qwen3 M = 4-1024; an L2 prefetch of the same weights in their place
//     did no better. Either early path costs the decode GEMMs ~1 us in plain stream order, through
//     ptxas's schedule of the consumer (benchmarks/NOTES.md 2026-12-01 (9)).
// 10. Half-tile register sets (Halves = 2) where two whole ones do not fit the registers: 192-row
//     tiles (three consumer warpgroups, 152 registers each) with TileK 256, whose whole A set is 64
//     registers, or with 96/128 tokens, whose accumulators take 48/64. The GMMAs of half 0 run while
//     half 1 is converted, those of half 1 while the next k tile's half 0 is; stages (barrier waits,
//     releases) stay whole k tiles. With whole sets ptxas spilled (192x8x256: 480 bytes with the
//     producer at 24 registers and the consumers at 160; 192x128x128: 160-460) and serialized the
//     GMMAs (C7512); with half sets 0 spills and no note.
//     192x8x256 against 128x8x256, layer kernel time (profile_stages --tile, two rounds;
//     benchmarks/NOTES.md 2026-12-01 (14)): -1.2..-3.6% from 1.5 rows per expert on (M = 64: qwen3
//     -3.6%, gpt-oss -2.6%, dsv4-flash -2.8%, dsv3 -2.1%), mixed below; since item 13, 0.0..-11.7% below too
//     (NOTES.md 2026-12-04 (41)): _gemm.plan streams every call of up to 4 rows per expert on it.
//     192x96x128 and 192x128x128 against 128 rows in the split plan's prefill parts, GEMM1 device
//     time, each twice in one session (NOTES.md 2026-12-01 (15)), M = 2048-16384: qwen3 -3.7..-7.5%,
//     gpt-oss -2.4..-7.9%, dsv4-flash -5.2% at M = 4096 and within 1% elsewhere, dsv3 -1.8..-2.6%;
//     GEMM2 -2.2..+3.0%, so only GEMM1 takes them (_gemm.TALL_TILES_GEMM1). 192x32x256 and 192x64x256
//     against their TileK 128 versions in the split plan's ridge parts, per GEMM (NOTES.md (15)):
//     -1.7..-2.7% at dsv3 / dsv4-flash M = 1024 and qwen3 M = 256, +0.5..+1.0% at gpt-oss, whose
//     K = 2880 pads to 3072. With the GMMAs over the tile's tokens (12.) gpt-oss gains too (its split
//     plans -0.8..-8.9% at M = 512-2048, NOTES.md 2026-12-04 (41)): they run at any K (_gemm.TALL_TILES).
// 11. Clusters of ClusterM CTAs along the weight rows (the _c2 configs): the grouped scheduler gives
//     a cluster's CTAs consecutive weight-row tiles of one token tile (an expert's weight-row tiles
//     rounded up to the cluster; the extra tile's weights are zero-filled by TMA and not stored), and
//     each CTA loads 1/ClusterM of the token tile for all of them by TMA multicast: cute splits the one
//     box along its outermost mode (the K halves), and a partial tile's 8-row chunks go whole, every
//     ClusterM-th to each CTA (splitting each chunk's box too gave wrong rows in partial tiles:
//     benchmarks/results/raw/tests_20261201T183622Z_cluster_probe_chunk_split_gemm.json). The stage
//     barriers count the consumers of every CTA of the cluster (upstream's PipelineTmaAsync). Half the
//     token bytes from L2 per CTA; per-GEMM device time against the same part without, three rounds
//     interleaved (benchmarks/NOTES.md 2026-12-01 (17)), GEMM1 / GEMM2 at M = 16384: dsv3 -3.4 / -4.6%,
//     dsv4-flash -2.1 / -2.9%, gpt-oss -1.9 / -0.5%, qwen3 -0.2 / -0.7%; at M = 4096 -1.3..+3.3%, so
//     _gemm.plan takes them from CLUSTER_MIN_ROWS rows per expert.
// 12. GMMAs over the tile's tokens (kTokenWidths: the 192-row tiles of 16-128 tokens, the 128-row tile of
//     16). An expert's last token tile holds fewer than TileN tokens; its GMMAs run m64n(8B)k16 with 8B the
//     tokens rounded up to 8, one of up to four widths in the tile's upper half (40, 48, 56, 64 for a
//     64-token tile; 8-32 for a 32-token tile, 8 or 16 for a 16-token one), into a prefix of the same
//     accumulator registers and over the first rows of the same B descriptor (CuTe's extended shapes);
//     tiles with 2-4 accumulator chains (6.) keep their chains, each as narrow. The kernel fork passes
//     the tokens; the width is chosen once per tile, by a copy of the whole mainloop per width. Why: at
//     the M = 1024 ridge, ncu has the tensor pipe 63-70% busy in the 64-token parts (33-64 tokens per
//     tile, most below 48), and a probe build measured the GMMAs and the conversion costing more
//     together than apart (NOTES.md 2026-12-02 (21)): the padded MMA work is paid for. Upstream has one
//     width per kernel. Chosen per k tile, in branches around the GMMAs, ptxas serialized every GMMA of
//     the function (C7520, a fence in a divergent path); the 128-row tiles (two consumer warpgroups,
//     168 registers) got C7520 with four per-tile copies too, so of them only the 16-token tile has it
//     (two copies, no note). Per GEMM in the layer against the full width (NOTES.md (21) and (22)):
//     the one-chain tiles, two rounds: dsv3 M = 1024 GEMM1 / GEMM2 -10.2 / -10.0%, gpt-oss -5.5 / -5.9%,
//     M = 4096 -3.4..+1.5%; qwen3 M = 1024 GEMM2 +4.6% (K = 768: three k tiles a tile, 56 or 64 wide
//     either way). The chained tiles, three rounds: dsv4-flash M = 256 / 1024 -3.8 / -2.5%, -3.0 / -3.3%,
//     dsv3 M = 256 -3.4 / -1.0%, qwen3 M = 256 GEMM1 -4.9%; gpt-oss (K = 2880, its 16-token tile's MMAs
//     hidden behind the conversion: NOTES.md 2026-12-01 (14)) and dsv3 M = 1024 within 1%.
//
// 13. Every GMMA through mc_token_gmmas (the tiles of one token width at their full width, instead of
//     cute::gemm over the TiledMma), with each k-block's B descriptor as one 64-bit add (UIADD3.64) where
//     CuTe's iterator left a UIADD3 and a UMOV of the descriptor's constant upper word per HGMMA: 9 fewer
//     uniform instructions per 8-GMMA k tile, every GEMM kernel 24-168 instructions shorter (SASS:
//     benchmarks/NOTES.md 2026-12-02 (29); the layers on the H200: (30)).
// 14. The tiles of 16-96 tokens load their weights and scales with L2 evict-first (upstream: evict-normal
//     for every load). Such a tile holds its expert's rows of the launch, so each weight byte is read
//     once; evicted first, it leaves L2 to what a next kernel reads (GEMM1's output rows for GEMM2,
//     GEMM2's for the finalize: 12.6 and 33.5 MB at qwen3 M = 1024). Layers, graph replay, three and
//     four rounds both orders (benchmarks/NOTES.md 2026-12-04 (34)): qwen3 M = 256 -5.8 / -5.9%,
//     M = 1024 -1.8 / -1.9%, gpt-oss M = 256-1024 -0.5..-1.0%, the other points within the rounds'
//     spread. On every tile it cost M = 16384 +1.2..+4.7% (where a weight tile serves up to four token
//     tiles), so the 8-token and 128/160-token tiles keep evict-normal.
// 15. A 32-token tile loads the 8-row token chunks that hold its tokens in one box of 8, 16 or 24 rows
//     (two more descriptors, only in these kernels; the whole box of 32 where all four chunks hold
//     tokens), and each stage's barrier expects the weights and scales, plus those rows' bytes, told per
//     tile before the stage's first load (upstream: one box of TileN rows, a fixed transaction count).
//     An expert's last tile of 8 tokens read 32 rows of tokens from L2; the rows past the box keep an
//     earlier tile's values, which only the GMMA columns past the tile's tokens read (no stored output
//     depends on them). One box per chunk (c594193) gained on the streaming tile (layers at 2.7-16 rows
//     per expert: dsv4-flash / kimi-k2 -1.7..-3.0%, dsv3 -2.8% at M = 128) but lost 2.0-2.8% at
//     gpt-oss M = 1024, whose split plan's 32-token part holds remainders of 1-32 rows: two or three boxes
//     a k tile cost more than the rows they spare. The rule's plans, M = 128-2048, three routings, two
//     rounds of five interleaved against the box per chunk (benchmarks/NOTES.md 2026-12-04 (45)): geomean
//     -0.21%, 37 of 60 points faster (a third run, another machine, M = 256-2048: -0.81%, 40 of 48),
//     gpt-oss M = 1024 -3.4 / -3.7% (uniform / Dirichlet); one 8-row box for at most 8 tokens and the
//     whole box otherwise measured the same within the rounds' spread (rows -0.12% against it) but dsv3
//     M = 512 (16 rows per expert) +1.3 / +2.0% against the box per chunk.
//     The 8-row chunks as four boxes, those past the tokens out of bounds (zero-filled without a read),
//     were +1..+18% ((42)).
//
// Measured on an H200 (benchmarks/NOTES.md, 2026-11-30): the bit-placement converter (3.) made the
// decode GEMMs 18-24% faster and prefill-tile GEMMs 12-16% (bench_20261130T221715Z vs
// bench_20261129T133227Z); the static descriptors (4.) another 3-8% at decode
// (bench_20261130T223331Z). Decode GEMMs now stream 2.5 (gpt-oss, K=2880) to 3.4 TB/s (dsv3,
// K=7168) of 4.25 TB/s: short K exposes the per-tile prologue (first conversion before any GMMA)
// and epilogue, and at M=1 too few tiles fill the machine. At the M = 256-1024 ridge (32/64-token
// tiles) ncu finds nothing saturated (DRAM 30-39%, L2 40-51%, tensor or ALU pipe 35-47%, issue
// slots 45-58%): the two consumer warps per scheduler cannot hide their own latencies (stalls
// per issue: fixed-latency 0.8-1.0, long scoreboard 0.75-0.83), and about 40% of their samples
// are the per-k-tile GMMA issue, descriptor and stage-wait code, so TileK 256 (half of that per
// weight) is 3-14% faster than 128 for those tiles (NOTES.md 2026-12-01 (5)); more accumulator
// chains changed nothing.
#pragma once

#include <utility>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/detail/collective/mixed_input_utils.hpp"

#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/algorithm/gemm.hpp"

#include "moe_gemm_kernel.hpp"
#include "moe_rows.hpp"
#include "mxfp4_math.cuh"
#include "pdl.cuh"

namespace moe_cutlass {
using namespace cute;

#if !defined(CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
#error "moe_gemm_launch.hpp enables CuTe's extended GMMA shapes (item 12 issues m64n40k16 and the like)"
#endif

// ---------------------------------------------------------------------------------------------
// GMMAs over the tile's tokens only (item 12).
// ---------------------------------------------------------------------------------------------
// The RS GMMA m64n(8B)k16 into the first 4B accumulator values of a wider tile's fragment: the
// accumulator holds 8-token column blocks in order (value c + 2h + 4j is column 8j + ...), so the
// narrower instruction writes a prefix of the same registers and reads the first 8B rows of the
// same B descriptor.
template <int B>
using McRsGmma = decltype(GMMA::rs_op_selector<cutlass::bfloat16_t, cutlass::bfloat16_t, float,
                                               Shape<_64, Int<8 * B>, _16>, GMMA::Major::K, GMMA::Major::K>());

template <int B, class FragA, class Accum, int... I>
CUTLASS_DEVICE void mc_gmma_blocks(FragA const& a, uint64_t desc_b, Accum& acc, std::integer_sequence<int, I...>) {
  McRsGmma<B>::fma(a(0), a(1), a(2), a(3), desc_b, acc(I)..., GMMA::ScaleOut::One);
}

// The arrive and the GMMAs of one register set's k-blocks (fa: its A words, (4, 1, Count); descs: the
// stage's B descriptors, from k-block Kb0 on) over the first 8B tokens, k-block kb into chain kb % NumAcc;
// every tile's GMMAs, at full width where it has one (item 13). Each k-block's descriptor is the first's
// plus its constant layout offset in one 64-bit add, which ptxas issues as one UIADD3.64; CuTe's descriptor
// iterator adds to the low word alone, and ptxas answered that with a UIADD3 and a UMOV of the unchanged
// upper word before every HGMMA.
template <int B, int Kb0, int Count, int NumAcc, class FragA, class DescB, class Accum>
CUTLASS_DEVICE void mc_token_gmmas(FragA const& fa, DescB const& descs, Accum& acc0, Accum& acc1, Accum& acc2,
                                   Accum& acc3) {
  uint64_t const desc0 = uint64_t(descs(Kb0));
  warpgroup_arrive();
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < Count; ++j) {
    int const chain = (Kb0 + j) % NumAcc;
    Accum& acc = chain == 0 ? acc0 : (chain == 1 ? acc1 : (chain == 2 ? acc2 : acc3));
    uint64_t const desc = desc0 + uint64_t(int(descs.layout()(Kb0 + j)) - int(descs.layout()(Kb0)));
    mc_gmma_blocks<B>(fa(_, 0, j), desc, acc, std::make_integer_sequence<int, 4 * B>{});
  }
}

// ---------------------------------------------------------------------------------------------
// The mainloop collective.
// ---------------------------------------------------------------------------------------------
// The dispatch policy for our own kernel schedules (upstream's mixed-input policy admits only its two).
template <int Stages_, class KernelSchedule_, int ClusterM_ = 1>
struct MoeMainloopPolicy {
  static constexpr int Stages = Stages_;
  using ClusterShape = Shape<Int<ClusterM_>, _1, _1>;
  using ArchTag = cutlass::arch::Sm90;
  using Schedule = KernelSchedule_;
};

template <int Stages_, class TileShape_, class KernelSchedule_, int ClusterM_ = 1>
struct Mxfp4MoeMainloop {
  // ClusterM CTAs on consecutive weight-row tiles of the same token tile: each loads 1/ClusterM
  // of the token tile, multicast to all of them (item 11).
  static constexpr int ClusterM = ClusterM_;
  static_assert(ClusterM == 1 || is_moe_cooperative<KernelSchedule_>::value, "clusters on our cooperative kernel only");
  using DispatchPolicy = cute::conditional_t<is_moe_cooperative<KernelSchedule_>::value,
      MoeMainloopPolicy<Stages_, KernelSchedule_, ClusterM>,
      cutlass::gemm::MainloopSm90ArrayTmaGmmaWarpSpecializedMixedInput<Stages_, Shape<_1, _1, _1>, KernelSchedule_>>;
  using TileShape = TileShape_;
  using KernelSchedule = KernelSchedule_;
  using ClusterShape = Shape<Int<ClusterM>, _1, _1>;
  using ArchTag = cutlass::arch::Sm90;
  static constexpr int Stages = Stages_;

  static constexpr int TileM = size<0>(TileShape{});
  static constexpr int TileN = size<1>(TileShape{});
  static constexpr int TileK = size<2>(TileShape{});
  static_assert(TileM % 64 == 0 && TileK % 64 == 0 && TileK <= 256 && TileN % 8 == 0 && TileN <= 256);
  static constexpr int UnitsPerTile = TileK / 64;     // 64-K units per k tile (one 16B load each)
  static constexpr int KBlocks = TileK / 16;          // m64nNk16 k-blocks per k tile
  static constexpr int Groups = TileK / 32;           // MX scale groups per k tile
  // accumulator chains per warpgroup (registers allow it for small N)
  static constexpr int NumAcc = TileN <= 16 ? 4 : (TileN <= 32 ? 2 : 1);
  // GMMAs over the tile's tokens rounded up to 8, not TileN (item 12). The widths built, in 8-token
  // blocks: the kTokenWidths last of TileN / 8 - kWidthStep * k (_gemm.gmma_widths). Each is a copy of the mainloop (the width is
  // chosen once per tile: chosen per k tile, in branches around the GMMAs, ptxas fenced them in a
  // divergent path and serialized them, C7520). A part's tiles hold more than half of TileN tokens
  // unless a smaller part was left out of the plan (_gemm.split_plan): four widths cover the part's
  // upper half (33..64 tokens of a 64-token tile in 40, 48, 56, 64) and every width of the 32-token
  // tile, the smallest part. The 128-row tiles (two consumer warpgroups) got C7520 with four copies;
  // their 16-token tile (an autotune candidate: _gemm.pick_config streams 4-12 rows per expert on the
  // 192-row 32-token tile now) takes two, and the 160-token tile two
  // 16 apart, 144 and 160 (its part holds 129-160 tokens; four widths 136-160 got C7520 here too).
#ifdef MC_PROBE_NO_MMA
  static constexpr int kTokenWidths = 1;   // the probe's sink lives in the TileN-wide loops
#else
  static constexpr int kTokenWidths = TileM == 192 ? cute::min(4, TileN / 8) : (TileN == 16 || TileN == 160 ? 2 : 1);
#endif
  static constexpr int kWidthStep = TileN == 160 ? 2 : 1;
  // A register sets hold half a k tile where two whole ones do not fit: three consumer warpgroups
  // (152 registers each) with TileK 256 (64 registers per whole set) or 96/128 tokens (48/64
  // accumulator registers).
  static constexpr int Halves = (TileM == 192 && (TileK == 256 || TileN >= 96)) ? 2 : 1;
  static constexpr int KSet = KBlocks / Halves;       // k-blocks per register set

  // Element types. A: 4-bit container (our permuted e2m1 words); B: bf16 tokens.
  using ElementA = cutlass::uint4b_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementScale = uint8_t;
  using ElementMma = cutlass::bfloat16_t;
  using StrideA = cute::Stride<int64_t, _1, _0>*;     // per group (kernel layer wants pointers)
  using StrideB = cute::Stride<int64_t, _1, _0>*;
  using InternalStrideA = cute::remove_pointer_t<StrideA>;
  using InternalStrideB = cute::remove_pointer_t<StrideB>;

  using AtomLayoutMNK = Layout<Shape<Int<TileM / 64>, _1, _1>>;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<ElementMma, ElementMma, float, Shape<_64, Int<TileN>, _16>,
                           GMMA::Major::K, GMMA::Major::K>(),
      AtomLayoutMNK{}));
  using ElementAccumulator = float;

  using GmemTiledCopyA = SM90_TMA_LOAD;
  using GmemTiledCopyB = cute::conditional_t<(ClusterM > 1), SM90_TMA_LOAD_MULTICAST, SM90_TMA_LOAD>;
  static constexpr uint16_t kTokenMcastMask = ClusterM > 1 ? uint16_t((1u << ClusterM) - 1) : uint16_t(0);
  using GmemTiledCopyScale = SM90_TMA_LOAD;

  // smem layouts: A is plain K-major (no swizzle: our own addressing), B uses the GMMA 128B
  // swizzle, scales are the tile's 128-byte scale-word blocks ([slab][unit][128 B], as in gmem).
  // A as raw bytes: (256 B, 8 rows x TileK/64 units, TileM/64 slabs) per stage, i.e. the tile's
  // 2 KB units back to back ([slab][unit][2048 B]), exactly as they lie in global memory.
  static constexpr int SlabsPerTile = TileM / 64;
  using SmemLayoutA = Layout<Shape<_256, Int<8 * UnitsPerTile>, Int<SlabsPerTile>, Int<Stages>>,
                             Stride<_1, _256, Int<2048 * UnitsPerTile>, Int<TileM * TileK / 2>>>;
  using TileShapeA = Shape<_256, Int<8 * UnitsPerTile>, Int<SlabsPerTile>>;
  using SmemLayoutAtomB = GMMA::Layout_K_SW128_Atom<ElementMma>;
  using SmemLayoutB = decltype(tile_to_shape(SmemLayoutAtomB{},
      make_shape(Int<TileN>{}, Int<TileK>{}, Int<Stages>{}), Step<_1, _2, _3>{}));
  // The first Rows rows of the B tile (Rows / 8 swizzle atoms per 64 K): 8 rows are the box of the
  // partial-tile loads, 8, 16 or 24 the 32-token tiles' (item 15).
  template <int Rows>
  using SmemLayoutBRows = decltype(tile_to_shape(SmemLayoutAtomB{}, make_shape(Int<Rows>{}, Int<TileK>{})));
  using SmemLayoutScale = Layout<Shape<_128, Int<UnitsPerTile>, Int<SlabsPerTile>, Int<Stages>>,
                                 Stride<_1, _128, Int<128 * UnitsPerTile>, Int<TileM * Groups>>>;
  using TileShapeS = Shape<_128, Int<UnitsPerTile>, Int<SlabsPerTile>>;

  using MainloopPipeline = cutlass::PipelineTmaAsync<Stages>;
  using PipelineState = cutlass::PipelineState<Stages>;
  using PipelineParams = typename MainloopPipeline::Params;
  static constexpr int NumProducerThreadEvents = 1;

  static constexpr uint32_t TmaBytesA = TileM * TileK / 2;
  static constexpr uint32_t TmaBytesB = TileN * TileK * 2;
  static constexpr uint32_t TmaBytesS = TileM * Groups;
  static constexpr uint32_t TmaTransactionBytes = TmaBytesA + TmaBytesB + TmaBytesS;
#ifdef MC_PROBE_NO_LOADS   // development probe only: nothing loads (the consumers convert and multiply whatever the stages hold)
  static constexpr bool kProbeNoLoads = true;
#else
  static constexpr bool kProbeNoLoads = false;
#endif
#ifdef MC_PROBE_NO_TOKENS   // development probe only: the tokens never load (the GMMAs read whatever B holds)
  static constexpr bool kProbeNoTokens = true;
#else
  static constexpr bool kProbeNoTokens = kProbeNoLoads;
#endif
  // A 32-token tile loads its tokens' 8-row chunks in one box of 8, 16 or 24 rows (item 15); each k
  // tile's barrier is told the token bytes per tile.
  static constexpr bool kTokenBoxByRows = TileN == 32 && ClusterM == 1;
  // what a stage's barrier expects; the stage count stays TmaTransactionBytes' (moe_gemm_launch.hpp)
  static constexpr uint32_t TmaExpectBytes =
      kProbeNoLoads ? 0 : TmaTransactionBytes - (kProbeNoTokens || kTokenBoxByRows ? TmaBytesB : 0);
  static_assert(TmaBytesS % 128 == 0, "scale stage must be a multiple of 128 bytes");

  struct SharedStorage {
    struct TensorStorage {
      alignas(1024) cute::array_aligned<uint8_t, cosize_v<SmemLayoutA>, 1024> smem_A;
      alignas(1024) cute::array_aligned<ElementMma, cosize_v<SmemLayoutB>, 1024> smem_B;
      alignas(128) cute::array_aligned<uint8_t, TmaBytesS * Stages, 128> smem_scale;
    } tensors;
    struct TensorMapStorage {};   // the descriptors are static kernel parameters
    using PipelineStorage = typename MainloopPipeline::SharedStorage;
    PipelineStorage pipeline;
  };
  using TensorStorage = typename SharedStorage::TensorStorage;
  using TensorMapStorage = typename SharedStorage::TensorMapStorage;
  using PipelineStorage = typename SharedStorage::PipelineStorage;

  static constexpr bool IsGroupedGemmKernel = true;

  struct Arguments {
    uint8_t const* w_blocks;       // [E][Npad/64][Kp/64][2048 B] prepared weights
    ElementScale const* w_scales;  // [E][Npad/64][Kp/64][128 B] scale words (layout.py)
    ElementB const* act;           // [act_rows][K] tokens in expert order
    int32_t const* offsets;        // [E+1] expert row offsets into act (device)
    MoeRowWindow window;           // which of each expert's rows this launch takes
    int num_experts = 0;
    int act_rows = 0;              // rows the act buffer holds (>= offsets[E])
    int m_pad = 0;                 // Npad: weight rows (and scale row stride), multiple of 128
    int k_pad = 0;                 // Kp: padded K of the weights (multiple of 64)
    int k_real = 0;                // K of the activations
    int scale_max = 255;           // largest scale byte of the weights (layout.py's scale_max)
  };

  // Static descriptors over ALL experts (no per-group tensormap.replace, KERNEL_NOTES H.2):
  //   A: (256 B, 8 * Kp/64 unit rows, Npad/64 slabs, E), slab stride 2048 * Kp/64 B;
  //   scales: (128 B, Kp/64 units, Npad/64 slabs, E), slab stride 2 * Kp B;
  //   B: the whole act buffer (act_rows, K); an expert's tile starts at row offsets[e] + n * TileN,
  //      rows past the expert belong to the next one (or are zero-filled past act_rows) and are
  //      masked by the epilogue (n < rows_e).
  using GmemLayoutB = Layout<Shape<int32_t, int32_t, int32_t>, Stride<int64_t, _1, _0>>;
  using GmemLayoutUnits = Layout<Shape<int32_t, int32_t, int32_t, int32_t>, Stride<_1, _256, int64_t, int64_t>>;
  using GmemLayoutS = Layout<Shape<int32_t, int32_t, int32_t, int32_t>, Stride<_1, _128, int64_t, int64_t>>;

  struct Params {
    using TMA_A = decltype(make_tma_copy(
        GmemTiledCopyA{},
        make_tensor(static_cast<uint8_t const*>(nullptr), GmemLayoutUnits{}),
        SmemLayoutA{}(_, _, _, Int<0>{}), TileShapeA{}, _1{}));
    using TMA_B = decltype(make_tma_copy(
        GmemTiledCopyB{},
        make_tensor(static_cast<ElementB const*>(nullptr), GmemLayoutB{}),
        SmemLayoutB{}(_, _, Int<0>{}), make_shape(Int<TileN>{}, Int<TileK>{}), Int<ClusterM>{}));
    template <int Rows>
    using TMA_BRows = decltype(make_tma_copy(
        GmemTiledCopyB{},
        make_tensor(static_cast<ElementB const*>(nullptr), GmemLayoutB{}),
        SmemLayoutBRows<Rows>{}, make_shape(Int<Rows>{}, Int<TileK>{}), _1{}));
    struct NoTma {};
    // (the 16- and 24-row boxes only where item 15 reads them)
    template <int Rows>
    using TMA_BTokens = cute::conditional_t<kTokenBoxByRows, TMA_BRows<Rows>, NoTma>;
    using TMA_S = decltype(make_tma_copy(
        GmemTiledCopyScale{},
        make_tensor(static_cast<ElementScale const*>(nullptr), GmemLayoutS{}),
        SmemLayoutScale{}(_, _, _, Int<0>{}), TileShapeS{}, _1{}));
    TMA_A tma_load_a;
    TMA_B tma_load_b;
    TMA_BRows<8> tma_load_b8;
    TMA_S tma_load_scale;
    uint32_t tma_transaction_bytes = TmaExpectBytes;
    int32_t const* offsets;
    MoeRowWindow window;
    int num_experts;
    int act_rows;
    int m_pad;
    int k_pad;
    int k_real;
    int slow_scales;               // some scale byte > kFastScaleMax: the two-multiply conversion
    int pdl_mode = pdl::kOff;      // set per launch (moe_gemm_run), not cached with the rest
    // (last: the other tiles' parameters stay where they were)
    TMA_BTokens<16> tma_load_b16{};
    TMA_BTokens<24> tma_load_b24{};
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape, Arguments const& args, void*) {
    Tensor tA = make_tensor(args.w_blocks,
        make_layout(make_shape(int32_t(256), int32_t(args.k_pad / 8), int32_t(args.m_pad / 64), int32_t(args.num_experts)),
                    make_stride(_1{}, _256{}, int64_t(args.k_pad) * 32, int64_t(args.m_pad) * args.k_pad / 2)));
    Tensor tB = make_tensor(args.act,
        make_layout(make_shape(int32_t(args.act_rows), int32_t(args.k_real), int32_t(1)),
                    make_stride(int64_t(args.k_real), _1{}, _0{})));
    Tensor tS = make_tensor(args.w_scales,
        make_layout(make_shape(int32_t(128), int32_t(args.k_pad / 64), int32_t(args.m_pad / 64), int32_t(args.num_experts)),
                    make_stride(_1{}, _128{}, int64_t(args.k_pad) * 2, int64_t(args.m_pad) * args.k_pad / 32)));
    Params p{
      make_tma_copy(GmemTiledCopyA{}, tA, SmemLayoutA{}(_, _, _, Int<0>{}), TileShapeA{}, _1{}),
      make_tma_copy(GmemTiledCopyB{}, tB, SmemLayoutB{}(_, _, Int<0>{}),
                    make_shape(Int<TileN>{}, Int<TileK>{}), Int<ClusterM>{}),
      make_tma_copy(GmemTiledCopyB{}, tB, SmemLayoutBRows<8>{}, make_shape(_8{}, Int<TileK>{}), _1{}),
      make_tma_copy(GmemTiledCopyScale{}, tS, SmemLayoutScale{}(_, _, _, Int<0>{}), TileShapeS{}, _1{}),
      TmaExpectBytes,
      args.offsets, args.window, args.num_experts, args.act_rows,
      args.m_pad, args.k_pad, args.k_real, int(args.scale_max > kFastScaleMax)};
    if constexpr (kTokenBoxByRows) {
      p.tma_load_b16 = make_tma_copy(GmemTiledCopyB{}, tB, SmemLayoutBRows<16>{}, make_shape(_16{}, Int<TileK>{}), _1{});
      p.tma_load_b24 = make_tma_copy(GmemTiledCopyB{}, tB, SmemLayoutBRows<24>{}, make_shape(Int<24>{}, Int<TileK>{}), _1{});
    }
    return p;
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape, Arguments const& args) {
    return args.m_pad > 0 && args.m_pad % 64 == 0 && args.k_pad > 0 && args.k_pad % 64 == 0 &&
           args.k_real > 0 && args.k_real % 32 == 0 && args.k_real <= args.k_pad &&
           args.k_pad - args.k_real < 64 && args.w_blocks && args.w_scales && args.act && args.offsets &&
           args.num_experts > 0 && args.act_rows > 0;
  }

  // ----------------------------------------------------------------------------------------
  // Producer side
  // ----------------------------------------------------------------------------------------
  // load_inputs: (gA, gB) carry the tile counts the kernel layer reads (shapes only; K and the
  // weight rows are the same for every expert), then the three static TMA coordinate tensors and
  // the current expert, its first act row and its end row, which tensors_perform_update sets.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& p) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    Tensor mA = make_identity_tensor(make_shape(int32_t(p.m_pad), int32_t(p.k_pad), int32_t(1)));
    Tensor mB = make_identity_tensor(make_shape(int32_t(N), int32_t(p.k_real), int32_t(1)));
    Tensor gA = local_tile(mA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});   // (BM,BK,m,k,l)
    Tensor gB = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});   // (BN,BK,n,k,l)
    Tensor mAu = p.tma_load_a.get_tma_tensor(
        make_shape(int32_t(256), int32_t(p.k_pad / 8), int32_t(p.m_pad / 64), int32_t(p.num_experts)));
    Tensor mS = p.tma_load_scale.get_tma_tensor(
        make_shape(int32_t(128), int32_t(p.k_pad / 64), int32_t(p.m_pad / 64), int32_t(p.num_experts)));
    Tensor mAct = p.tma_load_b.get_tma_tensor(make_shape(int32_t(p.act_rows), int32_t(p.k_real), int32_t(1)));
    return cute::make_tuple(gA, gB, mAu, mS, mAct, int32_t(0), int32_t(0), int32_t(0));
  }

  // TokensAfterWait (PDL, pdl.cuh kWeightsFirst): the kernel's first tile only, see below; every
  // other tile (and every tile of an ordinary launch) takes the plain loop.
  template <bool TokensAfterWait = false, class... Ts, class... TMs, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<Ts...> const& load_inputs, cute::tuple<TMs...> const&,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB_ = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    Tensor sB = as_position_independent_swizzle_tensor(sB_);
    Tensor sS = make_tensor(make_smem_ptr(shared_tensors.smem_scale.data()), SmemLayoutScale{});

    int32_t const e = get<5>(load_inputs);
    int32_t const row0 = get<6>(load_inputs);
    int32_t const row_end = get<7>(load_inputs);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    // A 96/128-token tile that runs past its expert's rows loads B in 8-row chunks, and a chunk
    // wholly past them from row act_rows: out of bounds, so TMA zero-fills it without reading
    // memory. (One box over the tile would read the next expert's rows: at M=4096 the nearly empty
    // second 128-token tile of half the experts made gpt-oss 7% slower.) Tiles of up to 64 tokens
    // take the one box: the next expert's few extra rows cost less than 4-8 TMA issues per k tile
    // (layer 1-4% faster at M = 256-1024, benchmarks/NOTES.md 2026-12-01 (5)).
    int32_t const b_row = row0 + int32_t(n_coord) * TileN;
    bool const b_partial = TileN > 64 && b_row + TileN > row_end;
    Tensor mAct = get<4>(load_inputs)(_, _, 0);                                                  // (rows,K)
    Tensor gA = local_tile(get<2>(load_inputs)(_, _, _, e), TileShapeA{}, make_coord(_0{}, _, m_coord));  // (256,8U,S,k)
    Tensor gS = local_tile(get<3>(load_inputs)(_, _, _, e), TileShapeS{}, make_coord(_0{}, _, m_coord));  // (128,U,S,k)
    Tensor mB = domain_offset(make_coord(row0 + int32_t(n_coord) * TileN, 0, 0), get<4>(load_inputs));
    Tensor gB = local_tile(mB(_, _, 0), make_shape(Int<TileN>{}, Int<TileK>{}), make_coord(0, _));  // (BN,BK,k)
    auto block_tma_a = p.tma_load_a.get_slice(0);
    // (a cluster's CTAs share the token tile: each loads 1/ClusterM of the one box, or every
    // ClusterM-th 8-row chunk, for all of them)
    auto block_tma_b = p.tma_load_b.get_slice(block_rank_in_cluster);
    auto block_tma_s = p.tma_load_scale.get_slice(0);
    Tensor tAgA = block_tma_a.partition_S(gA);
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);
    Tensor tSgS = block_tma_s.partition_S(gS);
    Tensor tSsS = block_tma_s.partition_D(sS);

    using BarrierType = typename MainloopPipeline::ProducerBarrierType;
    // Item 14: weights and scales read once per call go out of L2 first.
    constexpr auto kWeightHint = TileN >= 16 && TileN <= 96 ? TMA::CacheHintSm90::EVICT_FIRST
                                                            : TMA::CacheHintSm90::EVICT_NORMAL;
    uint16_t const mcast_mask = kTokenMcastMask;   // with() takes it by reference
    // item 15: a 32-token tile reads its tokens' 8-row chunks in one box (8, 16 or 24 rows, or the whole
    // box); one box each per chunk cost more than the rows they spared
    int const token_rows = kTokenBoxByRows ? cute::min(int(TileN), (cute::max(int(row_end - b_row), 1) + 7) / 8 * 8)
                                            : int(TileN);
    uint32_t const token_bytes = uint32_t(token_rows) * TileK * uint32_t(sizeof(ElementB));
    // (before the stage's first load: the barrier must not complete on the weights alone)
    auto expect_tokens = [&](BarrierType* tma_barrier) {
      if constexpr (kTokenBoxByRows && !kProbeNoTokens) {
        cutlass::arch::ClusterTransactionBarrier::expect_transaction(tma_barrier, token_bytes);
      }
    };
    // token rows [row, row + rows) into the stage's rows [j * rows, ...), for every CTA of the cluster
    auto load_rows = [&](auto const& tma, auto rows, int j, int32_t row, int kt, int write_stage, BarrierType* tma_barrier) {
      auto box = make_shape(rows, Int<TileK>{});
      Tensor gBj = local_tile(domain_offset(make_coord(row, 0), mAct), box, make_coord(0, kt));
      Tensor sBj = local_tile(sB(_, _, write_stage), box, make_coord(j, 0));
      auto block_tma = tma.get_slice(0);
      copy(tma.with(*tma_barrier, mcast_mask), block_tma.partition_S(gBj), block_tma.partition_D(sBj));
    };
    auto load_tokens = [&](int kt, int write_stage, BarrierType* tma_barrier) {
      if constexpr (kProbeNoTokens) return;
      if constexpr (kTokenBoxByRows) {
        switch (token_rows) {
          case 8: load_rows(p.tma_load_b8, _8{}, 0, b_row, kt, write_stage, tma_barrier); return;
          case 16: load_rows(p.tma_load_b16, _16{}, 0, b_row, kt, write_stage, tma_barrier); return;
          case 24: load_rows(p.tma_load_b24, Int<24>{}, 0, b_row, kt, write_stage, tma_barrier); return;
          default: break;
        }
      }
      if (!b_partial) {
        copy(p.tma_load_b.with(*tma_barrier, mcast_mask), tBgB(_, _, _, kt), tBsB(_, _, _, write_stage));
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < TileN / 8; ++j) {
          if (ClusterM > 1 && j % ClusterM != int(block_rank_in_cluster)) continue;
          load_rows(p.tma_load_b8, _8{}, j, b_row + 8 * j < row_end ? b_row + 8 * j : p.act_rows, kt, write_stage, tma_barrier);
        }
      }
    };

    // (PDL, pdl.cuh kWeightsFirst) The tokens were written by the kernel before this one, the
    // weights and the expert offsets long before: the first tile's first stages take their weights
    // and scales now, the wait comes next, then their tokens. Each stage's barrier already expects
    // all three, so no consumer reads a stage before its tokens land.
    if constexpr (TokensAfterWait) {
      int const early = cute::min(k_tile_count, int(Stages));
      auto write = smem_pipe_write;
      auto kit = k_tile_iter;
      for (int j = 0; j < early; ++j, ++kit, ++write) {
        pipeline.producer_acquire(write);
        if (!kProbeNoLoads && cute::elect_one_sync()) {
          BarrierType* tma_barrier = pipeline.producer_get_barrier(write);
          expect_tokens(tma_barrier);
          copy(p.tma_load_a.with(*tma_barrier, 0, kWeightHint), tAgA(_, _, _, _, *kit), tAsA(_, _, _, _, write.index()));
          copy(p.tma_load_scale.with(*tma_barrier, 0, kWeightHint), tSgS(_, _, _, _, *kit), tSsS(_, _, _, _, write.index()));
        }
      }
      pdl::wait();
      pdl::launch_dependents();
      for (int j = 0; j < early; ++j, ++k_tile_iter, ++smem_pipe_write) {
        if (cute::elect_one_sync()) {
          load_tokens(*k_tile_iter, smem_pipe_write.index(), pipeline.producer_get_barrier(smem_pipe_write));
        }
      }
      k_tile_count -= early;
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      BarrierType* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      int write_stage = smem_pipe_write.index();
      if (!kProbeNoLoads && cute::elect_one_sync()) {
        int kt = *k_tile_iter;
        expect_tokens(tma_barrier);
        copy(p.tma_load_a.with(*tma_barrier, 0, kWeightHint), tAgA(_, _, _, _, kt), tAsA(_, _, _, _, write_stage));
        load_tokens(kt, write_stage, tma_barrier);
        copy(p.tma_load_scale.with(*tma_barrier, 0, kWeightHint), tSgS(_, _, _, _, kt), tSsS(_, _, _, _, write_stage));
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    if (cute::elect_one_sync()) {
      pipeline.producer_tail(smem_pipe_write);
    }
  }

  // ----------------------------------------------------------------------------------------
  // Consumer side
  // ----------------------------------------------------------------------------------------
  // after_first_tile runs once, after the first k tile's GMMAs were issued and the second k tile
  // converted (or after the only k tile): the kernel fork issues its epilogue's dependent loads there.
  struct NoHook {
    CUTLASS_DEVICE void operator()() const {}
  };
  // tokens: the tile's token rows (the last token tile of an expert has fewer than TileN); where
  // kTokenWidths > 1, its GMMAs cover them rounded up to 8 (item 12).
  template <class FrgTensorC, class Hook = NoHook>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors, Params const& p,
                          Hook const& after_first_tile = Hook{}, int tokens = TileN) {
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    static_assert(MmaWarpGroups * 64 == TileM, "one 64-row slab per consumer warpgroup");

    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});   // (BN,BK,PIPE)
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    int wg_thread = thread_idx % cutlass::NumThreadsPerWarpGroup;

    TiledMma tiled_mma;
    auto mma_warpgroup_slice = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    auto mma_thread_slice = tiled_mma.get_thread_slice(thread_idx);
    Tensor sA_dummy = make_tensor(make_smem_ptr(static_cast<ElementMma*>(nullptr)),
                                  make_layout(make_shape(Int<TileM>{}, Int<TileK / Halves>{}), LayoutRight{}));
    Tensor tCrA0 = mma_thread_slice.partition_fragment_A(sA_dummy);    // (MMA,MMA_M,MMA_K) bf16 regs, set 0
    Tensor tCrA1 = mma_thread_slice.partition_fragment_A(sA_dummy);    // set 1
    Tensor tCsB = mma_warpgroup_slice.partition_B(sB);                   // (MMA,MMA_N,MMA_K,PIPE)
    Tensor tCrB = mma_warpgroup_slice.make_fragment_B(tCsB);
    static_assert(size<1>(decltype(tCrA0){}) == 1, "one M atom per warpgroup");
    static_assert(size<2>(decltype(tCrA0){}) == KSet);

    // This thread's smem addresses: 16 bytes of A and one scale word per 64-K unit.
    uint8_t const* sA_bytes = shared_tensors.smem_A.data();
    uint8_t const* sS_bytes = shared_tensors.smem_scale.data();
    int const slab = warp_group_idx;                                      // 64-row slab of the tile
    int const a_off = slab * 2048 * UnitsPerTile + wg_thread * 16;         // conflict-free 128-bit loads
    int const s_off = slab * 128 * UnitsPerTile + (wg_thread / 4) * 4;     // rows 16 (t / 32) + (t % 32) / 4, +8

    // Loads stage `stage` (A words + scales) and converts half `half` of the k tile (the whole
    // tile when Halves is 1) into `frag`. The scale path is fixed per weight tensor (one branch
    // per call, around the whole k loop; no per-byte tests): kSlow multiplies twice.
    auto convert_tile = [&](auto slow, int stage, auto& frag, auto half) {
      constexpr bool kSlow = decltype(slow)::value;
      constexpr int kU0 = decltype(half)::value * UnitsPerTile / Halves;
      uint32_t words[KSet];
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < UnitsPerTile / Halves; ++u) {
        uint4 v = *reinterpret_cast<uint4 const*>(sA_bytes + stage * TmaBytesA + a_off + (kU0 + u) * 2048);
        words[4 * u + 0] = v.x; words[4 * u + 1] = v.y; words[4 * u + 2] = v.z; words[4 * u + 3] = v.w;
      }
      uint32_t pairs[UnitsPerTile / Halves][2];   // per unit: groups 2u, 2u+1 (mxfp4_math.cuh)
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < UnitsPerTile / Halves; ++u) {
        mc_scale_pairs<kSlow>(*reinterpret_cast<uint32_t const*>(sS_bytes + stage * TmaBytesS + s_off + (kU0 + u) * 128),
                              pairs[u]);
      }
      Tensor frag_u32 = recast<uint32_t>(frag);                          // (4,1,KSet)
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < KSet; ++kb) {
#ifdef MC_PROBE_NO_CONVERT   // development probe only: measures the pipeline without the converter
        frag_u32(0, 0, kb) = words[kb];
        frag_u32(1, 0, kb) = words[kb] ^ pairs[kb / 4][0];
        frag_u32(2, 0, kb) = words[kb] ^ pairs[kb / 4][1];
        frag_u32(3, 0, kb) = words[kb];
#else
        uint32_t f[4];
        mc_e2m1x8_to_bf16(words[kb], f);
        uint32_t a[4];
        mc_scale_fragment<kSlow>(f, pairs[kb / 4][(kb / 2) % 2], a);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 4; ++i) frag_u32(i, 0, kb) = a[i];
#endif
      }
    };
    // Software pipeline over k tiles with two A register sets: the GMMAs of tile t (set t%2)
    // run while tile t+1 is loaded and converted into the other set; then wait<0> and release
    // tile t's stage. In-flight GMMAs never read registers being written (no C7513
    // serialization), and the tensor cores see back-to-back tiles.
    PipelineState smem_pipe_release = smem_pipe_read;
    // Independent accumulator chains (k-block kb feeds chain kb % NumAcc): small-N GMMAs are
    // latency bound on their accumulator dependency; summed in a fixed order at the end.
    auto acc1 = make_fragment_like(accum);
    auto acc2 = make_fragment_like(accum);
    auto acc3 = make_fragment_like(accum);
    clear(accum);
    if constexpr (NumAcc > 1) clear(acc1);
    if constexpr (NumAcc > 2) { clear(acc2); clear(acc3); }
    warpgroup_fence_operand(accum);
    if constexpr (NumAcc > 1) warpgroup_fence_operand(acc1);
    if constexpr (NumAcc > 2) { warpgroup_fence_operand(acc2); warpgroup_fence_operand(acc3); }
    bool first = true;
#ifdef MC_PROBE_NO_MMA
    uint32_t probe_sink = 0;
#endif
    using H0 = cute::integral_constant<int, 0>;
    using H1 = cute::integral_constant<int, 1>;
    // Tokens of the tile in 8-token blocks, for the GMMAs over them (item 12).
    int const token_blocks = (tokens + 7) / 8;
    // The GMMAs of half `half` of the k tile in `stage` on `frag`, one arrive and one commit (the
    // half-tile schedule; the whole-set step below writes the same loop out).
    auto issue = [&](auto& frag, int stage, auto half, auto blocks) {
      warpgroup_fence_operand(frag);
      warpgroup_fence_operand(accum);
      if constexpr (NumAcc > 1) warpgroup_fence_operand(acc1);
      if constexpr (NumAcc > 2) { warpgroup_fence_operand(acc2); warpgroup_fence_operand(acc3); }
#ifdef MC_PROBE_NO_MMA   // development probe only: the pipeline without tensor-core work; the converted
                         // fragments feed a sink instead, or the compiler drops the conversion as well
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < KSet; ++j) {
        Tensor f = recast<uint32_t>(frag);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 4; ++i) probe_sink ^= f(i, 0, j);
      }
#else
      mc_token_gmmas<decltype(blocks)::value, decltype(half)::value * KSet, KSet, NumAcc>(
          recast<uint32_t>(frag), tCrB(_0{}, _0{}, _, stage), accum, acc1, acc2, acc3);
#endif
      warpgroup_commit_batch();
    };
    auto wait_gmmas = [&]() {
      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      if constexpr (NumAcc > 1) warpgroup_fence_operand(acc1);
      if constexpr (NumAcc > 2) { warpgroup_fence_operand(acc2); warpgroup_fence_operand(acc3); }
    };
    // One copy of the mainloop per scale path and GMMA width (always inlined: a call would end the
    // GMMAs' pipeline at its boundary, C7510).
    auto run = [&](auto slow, auto blocks) __attribute__((always_inline)) {
      {
        auto token = pipeline.consumer_try_wait(smem_pipe_read);
        pipeline.consumer_wait(smem_pipe_read, token);
        convert_tile(slow, smem_pipe_read.index(), tCrA0, H0{});
      }
      if constexpr (Halves == 1) {
        auto step = [&](auto& frag_now, auto& frag_next) {
          int const stage = smem_pipe_read.index();
          warpgroup_fence_operand(frag_now);
          warpgroup_fence_operand(accum);
          if constexpr (NumAcc > 1) warpgroup_fence_operand(acc1);
          if constexpr (NumAcc > 2) { warpgroup_fence_operand(acc2); warpgroup_fence_operand(acc3); }
          // issue() above, written out: called through a lambda, this loop got other schedules from
          // ptxas for 128x16x256 and 128x32x256; written out, every whole-set tile's SASS is the one
          // measured before half sets existed
#ifdef MC_PROBE_NO_MMA
          warpgroup_arrive();
          CUTLASS_PRAGMA_UNROLL
          for (int kb = 0; kb < KBlocks; ++kb) {
            Tensor f = recast<uint32_t>(frag_now);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < 4; ++i) probe_sink ^= f(i, 0, kb);
          }
#else
          mc_token_gmmas<decltype(blocks)::value, 0, KBlocks, NumAcc>(
              recast<uint32_t>(frag_now), tCrB(_0{}, _0{}, _, stage), accum, acc1, acc2, acc3);
#endif
          warpgroup_commit_batch();
          ++smem_pipe_read;
          if (k_tile_count > 1) {
            auto token = pipeline.consumer_try_wait(smem_pipe_read);
            pipeline.consumer_wait(smem_pipe_read, token);
            convert_tile(slow, smem_pipe_read.index(), frag_next, H0{});
          }
          if (first) {
            after_first_tile();
            first = false;
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(accum);
          if constexpr (NumAcc > 1) warpgroup_fence_operand(acc1);
          if constexpr (NumAcc > 2) { warpgroup_fence_operand(acc2); warpgroup_fence_operand(acc3); }
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
          --k_tile_count;
        };
        CUTLASS_PRAGMA_NO_UNROLL
        while (true) {
          step(tCrA0, tCrA1);
          if (k_tile_count == 0) break;
          step(tCrA1, tCrA0);
          if (k_tile_count == 0) break;
        }
      } else {
        // Half tiles: the GMMAs of half 0 (set 0) run while half 1 is converted into set 1, those
        // of half 1 while the next tile's half 0 is converted into set 0.
        CUTLASS_PRAGMA_NO_UNROLL
        while (true) {
          int const stage = smem_pipe_read.index();
          issue(tCrA0, stage, H0{}, blocks);
          convert_tile(slow, stage, tCrA1, H1{});
          if (first) {
            after_first_tile();
            first = false;
          }
          wait_gmmas();
          issue(tCrA1, stage, H1{}, blocks);
          ++smem_pipe_read;
          if (k_tile_count > 1) {
            auto token = pipeline.consumer_try_wait(smem_pipe_read);
            pipeline.consumer_wait(smem_pipe_read, token);
            convert_tile(slow, smem_pipe_read.index(), tCrA0, H0{});
          }
          wait_gmmas();
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
          if (--k_tile_count == 0) break;
        }
      }
    };
    // The slow scale path (rare: a scale byte above 128) keeps the full width.
    constexpr int kFull = TileN / 8;
    if (p.slow_scales) {
      run(cute::true_type{}, Int<kFull>{});
    } else if constexpr (kTokenWidths == 4) {
      if (token_blocks <= kFull - 3) {
        run(cute::false_type{}, Int<kFull - 3>{});
      } else if (token_blocks == kFull - 2) {
        run(cute::false_type{}, Int<kFull - 2>{});
      } else if (token_blocks == kFull - 1) {
        run(cute::false_type{}, Int<kFull - 1>{});
      } else {
        run(cute::false_type{}, Int<kFull>{});
      }
    } else if constexpr (kTokenWidths == 2) {
      if (token_blocks <= kFull - kWidthStep) {
        run(cute::false_type{}, Int<kFull - kWidthStep>{});
      } else {
        run(cute::false_type{}, Int<kFull>{});
      }
    } else {
      run(cute::false_type{}, Int<kFull>{});
    }
#ifdef MC_PROBE_NO_MMA
    if (probe_sink == 0x9E3779B9u) accum(0) += 1.0f;
#endif
    if constexpr (NumAcc == 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += acc1(i);
    } else if constexpr (NumAcc == 4) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) = (accum(i) + acc1(i)) + (acc2(i) + acc3(i));
    }
    warpgroup_fence_operand(accum);
  }

  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {
    // mma() already waited for its GMMAs and released every stage it consumed.
    warpgroup_wait<0>();
  }

  // ----------------------------------------------------------------------------------------
  // Kernel-layer hooks of the ptr-array kernels. The descriptors never change (static, over all
  // experts), so there is nothing to copy, replace or fence per group: only the expert index and
  // its first act row, which load() reads from load_inputs.
  // ----------------------------------------------------------------------------------------
  CUTLASS_DEVICE auto tensormaps_init(Params const&, TensorMapStorage&, int32_t, int32_t) {
    return cute::make_tuple(nullptr);
  }

  template <class... TMs, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, Params const&, cute::tuple<TMs...> const&,
                                                ProblemShape_MNKL, int32_t) {}

  template <class... TMs>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, cute::tuple<TMs...> const&) {}

  template <class... TMs>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::tuple<TMs...> const&) {}

  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& input_tensors, Params const& p,
                                                     ProblemShape_MNKL, int32_t next_group) {
    InputTensors updated = input_tensors;
    int32_t first, count;
    p.window.rows(p.offsets[next_group], p.offsets[next_group + 1], first, count);
    get<5>(updated) = next_group;
    get<6>(updated) = first;
    get<7>(updated) = first + count;
    return updated;
  }
};

}  // namespace moe_cutlass
