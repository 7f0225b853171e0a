/* moe_cutlass: the argument block of mc_layer, the one C call that launches a whole MoE layer
 * (expand -> GEMM1 -> GEMM2 -> finalize) on one stream. Plain C, mirrored field by field by
 * moe_cutlass/ops.py (LayerCall, a ctypes Structure): change both together.
 *
 * Why one call with a block: an eager layer call made four ctypes calls with 11-20 arguments each,
 * about half of its ~35 us of host time on the H200 machine's CPU (cProfile). The block lives on the
 * Python side per (experts, workspace, options); a call rewrites only the per-call fields. The
 * GEMM configs are chosen by the caller and passed as function pointers, so this translation unit
 * depends on no GEMM instantiation (a partial build still links). Repeated calls on one block replay
 * a CUDA graph of the launches (templates/sm90/layer_launch.cuh). */
#pragma once

#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The signature of every mc_sm90_moe_gemm* entry point (each GEMM instantiation checks it). */
typedef int (*McGemmFn)(const void* w_blocks, const void* w_scales, const float* bias, const void* act,
                        int32_t act_rows, const int32_t* expert_offsets, int32_t row_chunk, int32_t rem_lo,
                        int32_t rem_hi, const float* row_weights, void* out,
                        int32_t E, int32_t N, int32_t K, int32_t scale_max, int32_t activation,
                        float swiglu_alpha, float swiglu_limit, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, int32_t pdl);
/* The GEMM launches of a call: each GEMM as num_parts launches, part p with configs gemm1[p] / gemm2[p]
 * over the rows that the window (row_chunk, rem_lo[p], rem_hi[p]) takes of every expert (moe_rows.hpp):
 * the device decides which part, so which token tile, each expert's rows go to. Unused entries are 0.
 * pdl: 1 launches every kernel of the layer after the first as a programmatic dependent launch on the one
 * before (templates/sm90/pdl.cuh), 0 in plain stream order (per-kernel profiles: a dependent kernel's time
 * would include its wait). */
#define MC_MAX_GEMM_PARTS 5
struct McGemmPlan {
  McGemmFn gemm1[MC_MAX_GEMM_PARTS];
  McGemmFn gemm2[MC_MAX_GEMM_PARTS];
  int32_t rem_lo[MC_MAX_GEMM_PARTS];
  int32_t rem_hi[MC_MAX_GEMM_PARTS];
  int32_t row_chunk;
  int32_t num_parts;
  int32_t pdl;
};

/* The signature of the one-launch layer (mc_sm90_moe_decode): the whole call from its argument block. */
typedef int (*McFusedFn)(void* call);

struct McLayerCall {
  /* per call */
  const void* hidden;              /* bf16 [num_tokens, hidden_size] */
  const void* topk_ids;            /* int32 or int64 [num_tokens, top_k] */
  const float* topk_weights;       /* [num_tokens, top_k] */
  void* out;                       /* bf16 [num_tokens, hidden_size] */
  int64_t num_tokens;
  cudaStream_t stream;
  const struct McGemmPlan* plan;   /* the GEMM launches for this many rows per expert (read during the call only) */
  McFusedFn fused;                 /* non-NULL: the whole layer in this one launch instead (small batches) */
  /* per layer, workspace and options */
  int64_t ids_int64;
  int64_t top_k;
  int64_t num_experts;
  int64_t hidden_size;
  int64_t intermediate_size;
  const int32_t* expert_map;       /* NULL, or int32 [num_global_experts] */
  int64_t num_global_experts;
  const void* w13_blocks;
  const void* w13_scales;
  const float* w13_bias;
  int64_t w13_scale_max;
  const void* w2_blocks;
  const void* w2_scales;
  const float* w2_bias;
  int64_t w2_scale_max;
  int32_t* expert_counts;          /* the workspace pieces (moe_cutlass/workspace.py) */
  int32_t* expert_offsets;
  int32_t* sorted_slots;
  int32_t* slot_to_row;
  void* gathered;
  float* row_weights;
  int32_t* expand_workspace;
  int64_t expand_workspace_ints;
  void* inter;
  int64_t act_rows;                /* rows of gathered and inter (max_tokens * top_k) */
  void* gemm1_workspace;
  int64_t gemm1_workspace_bytes;
  void* gemm2_workspace;
  int64_t gemm2_workspace_bytes;
  int64_t activation;              /* 0 silu, 1 swiglu_oai */
  float swiglu_alpha;
  float swiglu_limit;              /* +inf for none */
  float routed_scaling_factor;
  int32_t failed;                  /* out: the launch that failed, 0 expand .. 3 finalize, 4 graph launch, 5 fused */
  void* graphs;                    /* mc_layer's CUDA graphs of this block: NULL at first, freed by mc_layer_release */
};

#ifdef __cplusplus
}
#endif
