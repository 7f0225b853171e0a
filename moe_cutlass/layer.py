"""The fused MoE layer on an SM90 GPU: expand -> GEMM1 (+SwiGLU) -> GEMM2 (x routing weight) -> finalize.

Everything runs on the current stream with sizes known only to the device (expert_offsets),
so a call never waits for the GPU and can be captured in a CUDA graph. Buffers are sized once
per (device, stream, layer shape) for the largest batch seen and reused: a call allocates
nothing but its output. A larger batch than any before grows them (not inside a graph
capture: warm up with the largest batch first).
"""
from dataclasses import dataclass

import torch

from . import _gemm, _lib
from ._checks import INDEX_DTYPES, check_layer_options, check_tensor
from ._device import require_sm90
from ._ops_routing import RoutingBuffers, expand_into, launch_finalize
from .experts import PreparedExperts

GEMM_KINDS = (1, 2)  # GEMM1: gate/up + activation; GEMM2: down x routing weight


def _check_args(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
                routed_scaling_factor, expert_map, out):
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected the PreparedExperts that moe_cutlass.prepare_experts returns, "
                        f"got {type(experts).__name__}")
    H = experts.hidden_size
    check_tensor("hidden_states", hidden_states, dtype=torch.bfloat16, shape=("M", H), contiguous=True)
    M = hidden_states.shape[0]
    check_tensor("topk_ids", topk_ids, dtype=INDEX_DTYPES, shape=(M, "k"), contiguous=True)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_ids.shape), contiguous=True)
    check_layer_options(activation, swiglu_limit, swiglu_alpha, routed_scaling_factor)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtype=torch.int32, shape=("E_global",), contiguous=True)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=(M, H), contiguous=True)
    device = hidden_states.device
    if device.type != "cuda":
        raise ValueError(f"hidden_states: expected a CUDA tensor on an SM90 GPU, got one on {device}")
    named = {"topk_ids": topk_ids, "topk_weights": topk_weights, "expert_map": expert_map, "out": out}
    for name, t in named.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (where hidden_states is), got {t.device}")
    for name, t in (("hidden_states", hidden_states), ("out", out)):
        if t is not None and t.data_ptr() % 16:  # the kernels move rows in 16-byte vectors
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x}")
    if experts.device != device:
        raise ValueError(f"experts: prepared on {experts.device}, hidden_states on {device}; "
                         f"move them with experts.to({str(device)!r})")


def _configs_of(kind: int) -> list:
    configs = [k for k in _lib.library().kernels if k.startswith(f"moe_gemm{kind}_")]
    if not configs:
        raise RuntimeError(f"the kernel library holds no GEMM{kind} instantiation; rebuild it with "
                           f"`python -m codegen --arch sm90`")
    return configs


@dataclass
class _Buffers:
    """Everything a call needs besides its output, for up to max_tokens tokens."""

    max_tokens: int
    routing: RoutingBuffers
    inter: torch.Tensor  # bf16 [max_tokens * k, I]: GEMM1's output, GEMM2's input
    gemm_workspace: tuple  # uint8, one per GEMM kind, large enough for any of its configs

    @classmethod
    def allocate(cls, max_tokens, k, experts, device):
        E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
        workspaces = tuple(
            torch.empty(max(_gemm.workspace_size(c, E, device) for c in _configs_of(kind)), dtype=torch.uint8,
                        device=device)
            for kind in GEMM_KINDS)
        return cls(max_tokens=max_tokens,
                   routing=RoutingBuffers.allocate(max_tokens, k, E, H, device),
                   inter=torch.empty(max_tokens * k, I, dtype=torch.bfloat16, device=device),
                   gemm_workspace=workspaces)


_buffers = {}


def _buffers_for(M, k, experts, device):
    # Per stream: two launches in flight must not share CUTLASS's per-SM workspace.
    key = (device, torch.cuda.current_stream(device).cuda_stream, k, experts.num_experts,
           experts.hidden_size, experts.intermediate_size)
    buffers = _buffers.get(key)
    if buffers is None or buffers.max_tokens < M:
        _buffers.pop(key, None)  # free the old set before allocating the larger one
        buffers = _buffers[key] = _Buffers.allocate(M, k, experts, device)
    return buffers


def fused_moe(hidden_states, experts, topk_weights, topk_ids, activation="silu", swiglu_limit=None,
              swiglu_alpha=1.702, routed_scaling_factor=1.0, expert_map=None, out=None):
    """out[t] = routed_scaling_factor * sum_j topk_weights[t, j] * (W2_e @ act(W13_e @ x_t + b13_e) + b2_e).

    hidden_states bf16 [M, H]; experts from prepare_experts, on the same GPU; topk_weights
    float32 [M, k]; topk_ids int32/int64 [M, k]; ids < 0, >= E, or mapped to -1 by expert_map
    (int32 [E_global]: global id -> local id) contribute nothing. activation "silu" or
    "swiglu_oai" (with swiglu_alpha); swiglu_limit clamps gate (above) and up (both sides).
    Returns bf16 [M, H] (`out` when given). Deterministic; no host synchronization.
    """
    _check_args(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit, swiglu_alpha,
                routed_scaling_factor, expert_map, out)
    M, k = topk_ids.shape
    device = hidden_states.device
    if out is None:
        out = torch.empty(M, experts.hidden_size, dtype=torch.bfloat16, device=device)
    if M == 0:
        return out
    require_sm90(device)
    H, I, E = experts.hidden_size, experts.intermediate_size, experts.num_experts
    # Tile shapes by the average rows per expert: M * k is known on the host, the counts are not.
    gemm1, gemm2 = (_gemm.pick_config(kind, M * k, E, _configs_of(kind)) for kind in GEMM_KINDS)
    with torch.cuda.device(device):
        buffers = _buffers_for(M, k, experts, device)
        routed = expand_into(buffers.routing, hidden_states, topk_ids, topk_weights, E, expert_map, checked=False)
        # The GEMMs get the whole buffers: their TMA descriptors span the buffer (rows past an
        # expert are read and masked), and the same extent every call keeps the host's cached
        # descriptors valid. The gathered rows are dead once GEMM1 has read them: GEMM2 writes there.
        gathered = buffers.routing.gathered
        _gemm.run(gemm1, experts.w13, gathered, routed.expert_offsets, buffers.inter, 2 * I, H,
                  activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                  ws=buffers.gemm_workspace[0])
        _gemm.run(gemm2, experts.w2, buffers.inter, routed.expert_offsets, gathered, H, I,
                  row_weights=routed.row_weights, ws=buffers.gemm_workspace[1])
        launch_finalize(routed.gathered, routed.slot_to_row, k, float(routed_scaling_factor), out)
    return out
