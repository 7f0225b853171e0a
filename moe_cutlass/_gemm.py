"""Thin Python wrapper of the MoE grouped-GEMM C ABI (templates/sm90/moe_gemm.h.j2): the layer,
the tests and benchmarks/bench_gemm.py call the kernels through it.

    mc_sm90_<config>(w_blocks, w_scales, bias, act, expert_offsets, row_weights, out,
                     E, N, K, activation, swiglu_alpha, swiglu_limit, workspace, workspace_bytes, stream)
"""

import math

import torch

from . import _lib

ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}
GEMM1_CONFIG = "moe_gemm1_m128n32k128_coop"
GEMM2_CONFIG = "moe_gemm2_m128n32k128_coop"


def pick_config(kind: int, rows: int, num_experts: int, available=None) -> str:
    """A config for GEMM<kind> given the host-known upper bound of rows (M * top_k) and E.

    Measured on an H200 (benchmarks/results/bench_20261129T124329Z_gemm.json and
    bench_20261129T131109Z_gemm.json, balanced rows): with few rows per expert the kernels stream
    weights (N tile 8/16 with TileK 256 best); at 32 rows per expert the 32-token tile wins, at
    64 the 64-token tile (753 vs 915 us for the 128-token one and 1190 for the 32-token one on
    gpt-oss GEMM1), at 128 and above the 128-token tile (958 vs 1491 us for the 64-token one).
    `rows` is an upper bound known on the host (M * top_k); the real per-expert counts live on
    the device only.
    """
    per_expert = rows / max(1, num_experts)
    if per_expert <= 4:
        name = f"moe_gemm{kind}_m128n8k256_coop"
    elif per_expert <= 12:
        name = f"moe_gemm{kind}_m128n16k256_coop"
    elif per_expert <= 32:
        name = f"moe_gemm{kind}_m128n32k128_coop"
    elif per_expert <= 64:
        name = f"moe_gemm{kind}_m128n64k128_coop"
    else:
        name = f"moe_gemm{kind}_m128n128k128_coop"
    if available is not None and name not in available:
        name = f"moe_gemm{kind}_m128n32k128_coop"
    return name


def workspace_size(config: str, num_experts: int, device=None) -> int:
    device = torch.device(device if device is not None else "cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return int(_lib.library().function(f"mc_sm90_{config}_workspace_size")(num_experts, sms))


def workspace(config: str, num_experts: int, device=None) -> torch.Tensor:
    return torch.empty(workspace_size(config, num_experts, device), dtype=torch.uint8,
                       device=device if device is not None else "cuda")


def _ptr(t):
    return None if t is None else t.data_ptr()


def run(config: str, prepared: dict, act: torch.Tensor, expert_offsets: torch.Tensor, out: torch.Tensor,
        N: int, K: int, row_weights=None, activation="silu", swiglu_alpha=1.702, swiglu_limit=None,
        ws=None, stream=None, check=True) -> int:
    """Launch one grouped GEMM. `prepared` is layout.prepare_w13/prepare_w2's dict (on the GPU).
    Returns the status code (raises on non-zero when check=True)."""
    E = prepared["blocks"].shape[0]
    if ws is None:
        ws = workspace(config, E, act.device)
    if stream is None:
        stream = torch.cuda.current_stream(act.device).cuda_stream
    limit = math.inf if swiglu_limit is None else float(swiglu_limit)
    act_code = ACTIVATIONS[activation] if isinstance(activation, str) else int(activation)
    fn = _lib.library().function(f"mc_sm90_{config}")
    status = fn(_ptr(prepared["blocks"]), _ptr(prepared["scales"]), _ptr(prepared.get("bias")), _ptr(act),
                _ptr(expert_offsets), _ptr(row_weights), _ptr(out), E, N, K, act_code, float(swiglu_alpha),
                limit, _ptr(ws), ws.numel(), stream)
    if check and status != 0:
        raise RuntimeError(f"mc_sm90_{config} failed: {_lib.library().error_string(status)} ({status})")
    return status
