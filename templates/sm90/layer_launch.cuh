// moe_cutlass: the launches of one MoE layer call (mc_layer), made directly or replayed as a
// CUDA graph that this file captures once per argument block and kernel variant.
//
// Why a graph: on the H200 machine's CPU one kernel launch costs ~4-5 us of host time, so the
// layer's four launches (expand, GEMM1, GEMM2, finalize) took 20.8 us of an eager M=1 call's
// ~28 us (gpt-oss shape), while this file's graph launch and node updates take 2.8-4.5 us
// (benchmarks/NOTES.md, 2026-12-01; eager M=1 host time 27.7-30 -> 12.8-14.3 us per call,
// benchmarks/results/bench_20261130T235605Z.json). Only expand and finalize take per-call arguments (the token pointers, the output and
// the batch size, which sets their grids); the GEMMs read everything per call from the
// workspace (expert offsets), so their nodes never change. A call therefore rewrites two kernel
// nodes (cudaGraphExecKernelNodeSetParams: it affects later launches only, so a replay still in
// flight keeps its arguments) and launches the graph.
//
// When not: the first call of a variant launches directly (a one-off call does not pay for a
// capture), and so does every call on a stream that is itself being captured (a CUDA graph of
// the caller's, or torch.compile's cudagraphs): there the launches become the caller's nodes.
// A variant is (the GEMM plan's configs and windows, expand's one-kernel or three-kernel path); a block
// keeps up to kVariants of them and replaces the oldest. Errors while capturing make the variant
// launch directly from then on; the results are the same kernels either way.
//
// With plan.pdl every kernel after the first is a programmatic dependent launch on the one before
// (pdl.cuh): its CTAs take the SMs the previous kernel leaves, and a GEMM loads its first weights
// before it waits. Graph replay with and without, interleaved in one run, two runs
// (benchmarks/NOTES.md 2026-12-01 (8)): -2..-3.4% at qwen3 / gpt-oss M = 4 and M = 1024 and qwen3
// M = 4096, -3.8..-7.4% at dsv3 M = 1, within +-1.5% elsewhere.
#pragma once

#include <cuda_runtime.h>
#include <cstring>

#include "moe_layer_call.h"
#include "routing.cuh"

namespace moe_cutlass {
namespace layer_launch {

namespace routing = moe_cutlass::routing;

constexpr int kMaxNodes = routing::kTiledExpandKernels + 2 * MC_MAX_GEMM_PARTS + 1;  // expand, GEMM parts, finalize
constexpr int kVariants = 4;

enum Stage { kExpand = 0, kGemm1 = 1, kGemm2 = 2, kFinalize = 3, kGraph = 4 };

struct Variant {
  McGemmPlan plan = {};   // a copy: the caller's plan may be freed and its address reused
  bool small = false;     // expand's one-kernel path
  bool direct = false;    // capture failed: launch directly
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t nodes[kMaxNodes] = {};
  int num_nodes = 0;

  bool matches(McLayerCall const* c, bool small_path) const {
    return std::memcmp(&plan, c->plan, sizeof(plan)) == 0 && small == small_path;
  }
  void set(McLayerCall const* c, bool small_path) {
    plan = *c->plan;
    small = small_path;
  }
  void release() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);  // a launch in flight completes first
    if (graph != nullptr) cudaGraphDestroy(graph);
    *this = Variant();
  }
};

struct Graphs {
  Variant variants[kVariants];
  int used = 0;  // variants[0 .. used) hold one; then the oldest goes
  int oldest = 0;
};

// expand -> GEMM1 -> GEMM2 -> finalize on `stream`, or with `update` the new arguments of the
// graph's expand and finalize nodes. Sets c->failed to the stage that failed.
inline int launch_all(McLayerCall* c, cudaStream_t stream, routing::NodeUpdate* update) {
  int32_t const k = int32_t(c->top_k), E = int32_t(c->num_experts);
  int64_t const H = c->hidden_size, I = c->intermediate_size, rows = c->num_tokens * c->top_k;
  McGemmPlan const& plan = *c->plan;
  c->failed = kExpand;
  int status = c->ids_int64
      ? routing::expand(static_cast<const int64_t*>(c->topk_ids), c->topk_weights, c->num_tokens, k, c->expert_map,
                        c->num_global_experts, E, c->hidden, H, H, c->expert_counts, c->expert_offsets,
                        c->sorted_slots, c->slot_to_row, c->gathered, H, c->row_weights, c->expand_workspace,
                        c->expand_workspace_ints, stream, update, plan.pdl != 0)
      : routing::expand(static_cast<const int32_t*>(c->topk_ids), c->topk_weights, c->num_tokens, k, c->expert_map,
                        c->num_global_experts, E, c->hidden, H, H, c->expert_counts, c->expert_offsets,
                        c->sorted_slots, c->slot_to_row, c->gathered, H, c->row_weights, c->expand_workspace,
                        c->expand_workspace_ints, stream, update, plan.pdl != 0);
  if (status) return status;
  if (update != nullptr) {
    update->next += 2 * plan.num_parts;
  } else {
    // The parts of one GEMM write disjoint rows; a part runs one kernel after another on `stream`,
    // so all of them share the GEMM's workspace. Only the GEMM1 right after the one-kernel expand,
    // which writes the offsets, waits before its scheduler reads them.
    bool const small = routing::one_kernel_expand(rows);
    int32_t const first = plan.pdl ? (small ? pdl::kWaitFirst : pdl::kWeightsFirst) : pdl::kOff;
    int32_t const later = plan.pdl ? pdl::kWeightsFirst : pdl::kOff;
    c->failed = kGemm1;
    for (int p = 0; p < plan.num_parts; ++p) {
      status = plan.gemm1[p](c->w13_blocks, c->w13_scales, c->w13_bias, c->gathered, int32_t(c->act_rows),
                             c->expert_offsets, plan.row_chunk, plan.rem_lo[p], plan.rem_hi[p], nullptr, c->inter, E,
                             int32_t(2 * I), int32_t(H), int32_t(c->w13_scale_max), int32_t(c->activation),
                             c->swiglu_alpha, c->swiglu_limit, c->gemm1_workspace, size_t(c->gemm1_workspace_bytes),
                             stream, p == 0 ? first : later);
      if (status) return status;
    }
    // The gathered rows are dead once GEMM1 has read them: GEMM2 writes its rows there. Its
    // activation arguments are unused; fixed values keep its cached launch parameters valid.
    c->failed = kGemm2;
    for (int p = 0; p < plan.num_parts; ++p) {
      status = plan.gemm2[p](c->w2_blocks, c->w2_scales, c->w2_bias, c->inter, int32_t(c->act_rows),
                             c->expert_offsets, plan.row_chunk, plan.rem_lo[p], plan.rem_hi[p], c->row_weights,
                             c->gathered, E, int32_t(H), int32_t(I), int32_t(c->w2_scale_max), 0, 1.702f, INFINITY,
                             c->gemm2_workspace, size_t(c->gemm2_workspace_bytes), stream, later);
      if (status) return status;
    }
  }
  c->failed = kFinalize;
  return routing::finalize(c->gathered, H, rows, c->slot_to_row, c->num_tokens, k, H, c->routed_scaling_factor,
                           c->out, H, stream, update, plan.pdl != 0);
}

// The launches captured into v's graph, its kernel nodes in launch order; false if anything
// about it fails (v then launches directly).
inline bool capture(McLayerCall* c, Variant& v) {
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return false;
  bool ok = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
  if (ok) {
    ok = launch_all(c, stream, nullptr) == cudaSuccess;
    cudaGraph_t graph = nullptr;
    ok = cudaStreamEndCapture(stream, &graph) == cudaSuccess && ok;
    v.graph = graph;
  }
  cudaStreamDestroy(stream);
  size_t n = 1;
  ok = ok && v.graph != nullptr && cudaGraphGetRootNodes(v.graph, v.nodes, &n) == cudaSuccess && n == 1;
  int count = ok ? 1 : 0;
  while (ok) {  // a chain: each node has one successor, the last none
    cudaGraphNodeType type;
    ok = cudaGraphNodeGetType(v.nodes[count - 1], &type) == cudaSuccess && type == cudaGraphNodeTypeKernel;
    // The edges into dependent launches are programmatic: a query without edge data would fail as lossy.
    cudaGraphEdgeData edge[2] = {};
    cudaGraphNode_t next_node[2] = {};
    size_t next = 2;
    ok = ok && cudaGraphNodeGetDependentNodes(v.nodes[count - 1], next_node, edge, &next) == cudaSuccess &&
         next <= 1;
    if (!ok || next == 0) break;
    ok = count < kMaxNodes;
    if (ok) v.nodes[count++] = next_node[0];
  }
  v.num_nodes = count;
  ok = ok && count == (v.small ? 1 : routing::kTiledExpandKernels) + 2 * v.plan.num_parts + 1 &&
       cudaGraphInstantiate(&v.exec, v.graph, 0) == cudaSuccess;
  cudaGetLastError();  // a failed capture leaves its error behind; the direct launches must not see it
  return ok;
}

// The graph of c's variant: nullptr to launch directly (first sight, or capture failed).
inline Variant* variant(McLayerCall* c) {
  if (c->graphs == nullptr) c->graphs = new Graphs();
  Graphs& g = *static_cast<Graphs*>(c->graphs);
  bool const small = routing::one_kernel_expand(c->num_tokens * c->top_k);
  for (int i = 0; i < g.used; ++i) {
    Variant& v = g.variants[i];
    if (!v.matches(c, small)) continue;
    if (v.direct) return nullptr;
    if (v.exec == nullptr && !capture(c, v)) {
      v.release();
      v.set(c, small);
      v.direct = true;
      return nullptr;
    }
    return &v;
  }
  Variant& v = g.used < kVariants ? g.variants[g.used++] : g.variants[g.oldest++ % kVariants];
  v.release();
  v.set(c, small);  // captured at its next call
  return nullptr;
}

inline int run(McLayerCall* c) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(c->stream, &capturing) != cudaSuccess) {
    cudaGetLastError();  // e.g. the legacy stream while another thread captures: the launches will say
    capturing = cudaStreamCaptureStatusActive;
  }
  Variant* v = capturing == cudaStreamCaptureStatusNone && c->num_tokens > 0 ? variant(c) : nullptr;
  if (v == nullptr) return launch_all(c, c->stream, nullptr);
  routing::NodeUpdate update{v->exec, v->nodes, 0};
  int const status = launch_all(c, c->stream, &update);
  if (status) return status;
  c->failed = kGraph;
  return int(cudaGraphLaunch(v->exec, c->stream));
}

inline int graph_count(McLayerCall const* c) {
  if (c == nullptr || c->graphs == nullptr) return 0;
  Graphs const& g = *static_cast<Graphs const*>(c->graphs);
  int n = 0;
  for (int i = 0; i < g.used; ++i) n += g.variants[i].exec != nullptr;
  return n;
}

inline void release(McLayerCall* c) {
  if (c == nullptr || c->graphs == nullptr) return;
  Graphs* g = static_cast<Graphs*>(c->graphs);
  for (Variant& v : g->variants) v.release();
  delete g;
  c->graphs = nullptr;
}

}  // namespace layer_launch
}  // namespace moe_cutlass
