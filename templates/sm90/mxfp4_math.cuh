// moe_cutlass: the arithmetic the layer's kernels share: the e2m1 -> bf16 converter of our
// prepared weight layout, the E8M0 scale multipliers, the GEMM1 activation and the finalize sum.
// Used by the CUTLASS mainloop/epilogue (moe_gemm_mainloop.hpp, moe_gemm_epilogue.hpp), the
// routing kernels (routing.cuh) and the one-launch decode kernel (moe_decode.cuh), so every path
// computes the same values.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

namespace moe_cutlass {

// ---------------------------------------------------------------------------------------------
// e2m1 -> bf16 converter.
// Input word layout (produced offline by layout.py, CODE_BITS there): the 8 values v = 0..7 of one
// k-block (RS fragment order); output register j holds (v2j, v2j+1) in its low and high 16-bit
// lanes, and the (sign, e1, e0, m) bits of each value sit where that register's shifts and masks
// move them to bf16 bits 15, 8, 7, 6 of its lane: the bf16 of the e2m1 value times 2^-126 (code
// 0.5 becomes the subnormal 2^-127). One bf16x2 multiply by 2^(s-1) then applies the E8M0 scale
// and the bias fix together (mc_scale_pairs); all exact, and bf16 multiplies and WGMMA keep
// subnormals (KERNEL_NOTES H.1).
// Why this layout (2026-12-02): 5 LOP3 + 2 SHF (the ALU pipe, half rate) + 2 IMAD.SHL per 8
// weights, against 6 + 2 + 3 for the TensorRT-LLM layout used before (one mask per register after
// shifts by 0, 3, 6, and three pieces for the fourth). A search over every assignment of the 32
// input bits to the four registers' 8 positions (at most 5 masked pieces) finds no layout with
// fewer ALU-pipe instructions: no 4 shifts or rotations of the mask tile the word, so one register
// takes two pieces; the rotation (SHF.L.W) lets register 3 take its bits from both ends of the word.
// Measured: benchmarks/NOTES.md, 2026-12-02 (26).
// Output: 4 bf16x2 registers (v0,v1) (v2,v3) (v4,v5) (v6,v7), each times 2^-126.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mc_e2m1x8_to_bf16(uint32_t q, uint32_t (&out)[4]) {
  constexpr uint32_t kMask = 0x81C081C0u;   // sign, exponent bits 1..0, mantissa bit 6, per lane
  out[0] = q & kMask;
  out[1] = ((q << 4) & 0x81808180u) | ((q >> 4) & 0x00400040u);
  out[2] = (q << 6) & kMask;
  out[3] = __funnelshift_l(q, q, 10) & kMask;   // rotate left by 10
}

// ---------------------------------------------------------------------------------------------
// Scale words (layout.py, _swizzle_scales). Per 64-row slab and 64-K unit the prepared scales hold
// one 32-bit word per row pair (r, r + 8) of a thread (the rows of its A fragment), with the unit's
// two 32-K groups' bytes stored as t = (s + 126) mod 256 (layout.SCALE_BIAS): the bf16 exponent field
// of 2^(s-1). Group 2u's two fields sit on the bf16x2 exponent bits (7..14: row r, 23..30: row r + 8),
// group 2u+1's on the same bits after a rotation left by 8. A thread's four multipliers of a unit are
// one 32-bit shared load plus LOP3, SHF.L.W, LOP3, and the multiplies take each row's half through
// HMUL2's .H0_H0 / .H1_H1 operand selects (no instruction). Before (2026-12-02), scales were bytes
// [Kp/32][Npad]: per unit 4 LDS.U8 and 4 IMAD (one byte to 2^(s-1) in both halves), 7.6% of qwen3
// M = 256 GEMM2's executed instructions. 2^-126 * 2^(s-1) * value = value * 2^(s-127) exactly for
// s <= kFastScaleMax (t <= 254, a normal bf16).
// ---------------------------------------------------------------------------------------------
constexpr uint32_t kScaleFields = 0x7F807F80u;   // bf16x2 exponent bits

// Any byte: bf16x2 of 2^(s-127) (s=0 -> 0x0040, a subnormal; s=255 -> NaN), applied after a first
// multiply by 2^126 (kUnbias) has made the converted value exact and normal.
__device__ __forceinline__ uint32_t mc_e8m0_to_bf16(uint32_t s) {
  uint32_t b = s << 7;
  b = (s == 0u) ? 0x0040u : b;
  return (s == 255u) ? 0x7FC0u : b;
}
constexpr uint32_t kUnbias = 0x7E807E80u;   // bf16x2 of 2^126
constexpr int kFastScaleMax = 128;          // = layout.FAST_SCALE_MAX

// A pair of the slow path: its two stored fields back to bytes s = t - 126, each as 2^(s-127).
__device__ __forceinline__ uint32_t mc_scale_pair_slow(uint32_t pair) {
  uint32_t const lo = ((pair >> 7) + 130u) & 0xFFu;
  uint32_t const hi = ((pair >> 23) + 130u) & 0xFFu;
  return mc_e8m0_to_bf16(lo) | (mc_e8m0_to_bf16(hi) << 16);
}

// The unit's multiplier pairs (low half: row r, high half: row r + 8) of groups 2u and 2u+1, from the
// thread's scale word w; Slow: the slow path's (the scale path is fixed per weight tensor).
template <bool Slow>
__device__ __forceinline__ void mc_scale_pairs(uint32_t w, uint32_t (&pair)[2]) {
  pair[0] = w & kScaleFields;
  pair[1] = __funnelshift_l(w, w, 8) & kScaleFields;
  if constexpr (Slow) {
    pair[0] = mc_scale_pair_slow(pair[0]);
    pair[1] = mc_scale_pair_slow(pair[1]);
  }
}

__device__ __forceinline__ uint32_t mc_mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// a times the low (high) half of b in both lanes; ptxas folds the broadcast into the multiply's
// operand select.
__device__ __forceinline__ uint32_t mc_mul_bf16x2_lo(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("{.reg .b16 l, h; .reg .b32 m; mov.b32 {l, h}, %2; mov.b32 m, {l, l}; mul.rn.bf16x2 %0, %1, m;}"
      : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t mc_mul_bf16x2_hi(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("{.reg .b16 l, h; .reg .b32 m; mov.b32 {l, h}, %2; mov.b32 m, {h, h}; mul.rn.bf16x2 %0, %1, m;}"
      : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// One k-block's A fragment: the converter's registers f (rows r, r + 8, r, r + 8) times their rows'
// multipliers from `pair` (mc_scale_pairs<Slow>); Slow: after the multiply by 2^126.
template <bool Slow>
__device__ __forceinline__ void mc_scale_fragment(uint32_t (&f)[4], uint32_t pair, uint32_t (&a)[4]) {
  if constexpr (Slow) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = mc_mul_bf16x2(f[i], kUnbias);
  }
  a[0] = mc_mul_bf16x2_lo(f[0], pair);
  a[1] = mc_mul_bf16x2_hi(f[1], pair);
  a[2] = mc_mul_bf16x2_lo(f[2], pair);
  a[3] = mc_mul_bf16x2_hi(f[3], pair);
}

// GEMM1's activation of one (gate, up) pair, bias already added: g * sigmoid(alpha g) * (u + beta),
// silu(g) * u as (alpha 1, beta 0) and swiglu_oai as (alpha, beta 1), so both are one instruction
// stream with the launch's constants folded once (McActivation). The clamps use min/max.NaN: a
// NaN gate or up stays NaN (numerics policy), where fminf/fmaxf would return the finite limit.
// sigmoid = 1 / (1 + 2^(g * -alpha log2 e)) by ex2.approx.ftz and rcp.approx (__fdividef): no
// subnormal range fix-up and no IEEE division subroutine; where 1 + 2^x passes 2^126 (g about
// -87 and below) the reciprocal flushes to 0, as the quotient is below 1.1e-36 there. GEMM1 -0.1..-3.3%
// from __fdividef alone, -0.6..-10% with the epilogue's other changes (moe_gemm_epilogue.hpp).
struct McActivation {
  float neg_alpha_log2e;
  float beta;
  float limit;
};

__host__ __device__ inline McActivation mc_activation_of(int activation, float alpha, float limit) {
  constexpr float kLog2e = 1.4426950408889634f;
  return activation == 0 ? McActivation{-kLog2e, 0.f, limit} : McActivation{-alpha * kLog2e, 1.f, limit};
}

__device__ __forceinline__ float mc_min_nan(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float mc_max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float mc_exp2_ftz(float x) {
  float d;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(d) : "f"(x));
  return d;
}

__device__ __forceinline__ float mc_activation(float g, float u, McActivation const& a) {
  g = mc_min_nan(g, a.limit);
  u = mc_max_nan(mc_min_nan(u, a.limit), -a.limit);
  return __fdividef(g, 1.0f + mc_exp2_ftz(g * a.neg_alpha_log2e)) * (u + a.beta);
}

// Finalize, per 8 outputs: acc += one expert row's 8 bf16 values (called for j = 0..k-1 in
// order), then one multiply by the scaling factor and one rounding each.
__device__ __forceinline__ void mc_add_bf16x8(float (&acc)[8], uint4 v) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float2 const f = __bfloat1622float2(p[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}
// A token's k expert rows into acc in slot order, Trip rows per trip: every row index of a trip
// first, then all its loads, then the adds (one round trip per trip instead of one per row; the
// add order, and so the bits, as one row at a time). row_of(j): slot j's row, or < 0 for none.
template <int Trip, typename RowOf, typename Load>
__device__ __forceinline__ void mc_sum_rows(float (&acc)[8], int top_k, RowOf row_of, Load load) {
  for (int j0 = 0; j0 < top_k; j0 += Trip) {
    int row[Trip];
    uint4 v[Trip];
#pragma unroll
    for (int u = 0; u < Trip; ++u) row[u] = j0 + u < top_k ? row_of(j0 + u) : -1;
#pragma unroll
    for (int u = 0; u < Trip; ++u) {
      if (row[u] >= 0) v[u] = load(row[u]);
    }
#pragma unroll
    for (int u = 0; u < Trip; ++u) {
      if (row[u] >= 0) mc_add_bf16x8(acc, v[u]);
    }
  }
}

__device__ __forceinline__ uint4 mc_scaled_bf16x8(const float (&acc)[8], float scale) {
  uint4 packed;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    o[q] = __floats2bfloat162_rn(__fmul_rn(acc[2 * q], scale), __fmul_rn(acc[2 * q + 1], scale));
  }
  return packed;
}

}  // namespace moe_cutlass
