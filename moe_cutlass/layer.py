"""The fused MoE layer on an SM90 GPU: expand -> GEMM1 (+SwiGLU) -> GEMM2 (x routing weight) -> finalize
(calls of up to four tokens on small enough experts: all of it in one kernel launch, ops.uses_fused).

Everything runs on the current stream with sizes known only to the device (expert_offsets),
so a call never waits for the GPU and can be captured in a CUDA graph. A call allocates nothing
but its output: its buffers live in a workspace, the caller's (`workspace=`) or one cached per
(device, stream, layer shape) and sized for the largest batch seen. A larger batch than any
before grows the cached one (not inside a graph capture: warm up with the largest batch first).

An eager call checks its arguments and launches the kernels itself, without the torch
dispatcher (host time matters at decode sizes); traced code goes through torch.ops.moe_cutlass.
"""
import torch

from .ops import call, check_args, empty_out, launch


def _is_traced(hidden_states) -> bool:
    # Dynamo, or a tensor without data (FakeTensor, FunctionalTensor: make_fx, export, FakeTensorMode).
    return torch.compiler.is_compiling() or (
        isinstance(hidden_states, torch.Tensor) and type(hidden_states) is not torch.Tensor)


def fused_moe(hidden_states, experts, topk_weights, topk_ids, activation="silu", swiglu_limit=None,
              swiglu_alpha=1.702, routed_scaling_factor=1.0, expert_map=None, out=None, workspace=None,
              batch_invariant=False):
    """out[t] = routed_scaling_factor * sum_j topk_weights[t, j] * (W2_e @ act(W13_e @ x_t + b13_e) + b2_e).

    hidden_states bf16 [M, H]; experts from prepare_experts, on the same GPU; topk_weights
    float32 [M, k]; topk_ids int32/int64 [M, k]; ids < 0, >= E, or mapped to -1 by expert_map
    (int32 [E_global]: global id -> local id) contribute nothing. activation "silu" or
    "swiglu_oai" (with swiglu_alpha); swiglu_limit clamps gate (above) and up (both sides).
    workspace: a Workspace from allocate_workspace(max_tokens >= M, k, experts), or None for
    the cached one. batch_invariant=True: each token's output bits do not depend on M or on the
    other tokens (one accumulation order for every batch size: the 64/128-token tiles only,
    slower at decode sizes). Returns bf16 [M, H] (`out` when given). Deterministic; no host
    synchronization.
    """
    if _is_traced(hidden_states):
        return call(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
                    routed_scaling_factor, expert_map, out, workspace, batch_invariant)
    check_args(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
               routed_scaling_factor, expert_map, out, workspace, batch_invariant)
    if out is None:
        out = empty_out(hidden_states, experts, topk_ids)
    launch(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
           routed_scaling_factor, expert_map, out, workspace, batch_invariant)
    return out
