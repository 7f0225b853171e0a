"""Thin Python wrapper of the MoE grouped-GEMM C ABI (templates/sm90/moe_gemm.h.j2): the layer,
the tests and benchmarks/bench_gemm.py call the kernels through it.

    mc_sm90_<config>(w_blocks, w_scales, bias, act, expert_offsets, row_weights, out,
                     E, N, K, scale_max, activation, swiglu_alpha, swiglu_limit, workspace, workspace_bytes, stream)
"""

import bisect
import functools
import math

import torch

from . import _lib

ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}
MAX_SCALE_BYTE = 255   # a prepared dict without scale_max takes the conversion exact for every byte
GEMM1_CONFIG = "moe_gemm1_m128n32k128_coop"
GEMM2_CONFIG = "moe_gemm2_m128n32k128_coop"


def pick_config(kind: int, rows: int, num_experts: int, available=None, batch_invariant=False) -> str:
    """A config for GEMM<kind> given the host-known number of rows (M * top_k) and E.

    With few rows per expert the kernels stream weights, and the 8/16-token tiles with TileK 256
    win even when a busy expert needs a second tile; from ~24 rows per expert on, routing's
    unevenness decides: a tile sized for the average makes many experts re-stream their weights
    for a second tile, so the next larger tile wins. Layer A/B on an H200 with random routing
    (benchmarks/results/bench_20261129T133320Z.json vs bench_20261129T133334Z.json): at 32 rows
    per expert the 64-token tile beats the 32-token one (gpt-oss M=1024 1138 vs 1346 us, dsv3
    3656 vs 4401 us), at 64 the 128-token tile beats the 64-token one (qwen3 411 vs 458 us), at
    24 the 32-token tile still wins (dsv4 1918 vs 2122 us), at 8 the 16-token one (gpt-oss 738
    vs 909 us). The real per-expert counts live on the device only.

    batch_invariant: only tiles that sum a token's products in one order. A tile's order depends
    on its number of accumulator chains alone (moe_gemm_mainloop.hpp, NumAcc: 4 for N <= 16, 2
    for N = 32, 1 above; the chain of k-block g is g % NumAcc whatever TileK is), so the 64- and
    128-token tiles agree bit for bit and the others differ.
    """
    per_expert = rows / max(1, num_experts)
    tiles = ((48, "n64k128"),) if batch_invariant else (
        (4, "n8k256"), (12, "n16k256"), (24, "n32k128"), (48, "n64k128"))
    for limit, tile in tiles:
        if per_expert <= limit:
            break
    else:
        tile = "n128k128"
    name = f"moe_gemm{kind}_m128{tile}_coop"
    if available is not None and name not in available:
        name = f"moe_gemm{kind}_m128n32k128_coop"
    return name


# Tile choices that moe_cutlass.tuning measured for a layer shape on a device, in force for fused_moe
# (tuning.use / tuning.load): {(device name, E, H, I, top_k): (bounds, choices)}. A call of M tokens
# takes choices[bisect(bounds, M)]: the tuned batch nearest to M on a log scale.
_TUNED = {}


def set_tuned(device_name: str, E: int, H: int, I: int, top_k: int, choices: dict) -> None:
    """Installs {M: (gemm1 config, gemm2 config)} for one shape on devices named device_name."""
    ms = sorted(choices)
    bounds = [math.sqrt(a * b) for a, b in zip(ms, ms[1:])]   # log-scale midpoints
    _TUNED[(device_name, E, H, I, top_k)] = (bounds, [tuple(choices[m]) for m in ms])


def clear_tuned() -> None:
    _TUNED.clear()


def tuned_configs(device_name: str, E: int, H: int, I: int, top_k: int, num_tokens: int):
    """(gemm1 config, gemm2 config) tuned for the batch nearest num_tokens, or None for an untuned shape."""
    entry = _TUNED.get((device_name, E, H, I, top_k))
    if entry is None:
        return None
    bounds, choices = entry
    return choices[bisect.bisect(bounds, num_tokens)]


@functools.lru_cache(maxsize=None)
def configs_of(kind: int) -> tuple:
    """The GEMM<kind> configs the built library holds."""
    configs = tuple(k for k in _lib.library().kernels if k.startswith(f"moe_gemm{kind}_"))
    if not configs:
        raise RuntimeError(f"the kernel library holds no GEMM{kind} instantiation; rebuild it with "
                           f"`python -m codegen --arch sm90`")
    return configs


def function(config: str):
    """The ctypes function that launches `config`."""
    return _lib.library().function(f"mc_sm90_{config}")


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
    act_code = ACTIVATIONS[activation] if isinstance(activation, str) else int(activation)
    status = launch(function(config), prepared, act.data_ptr(), act.shape[0], expert_offsets.data_ptr(), _ptr(row_weights),
                    out.data_ptr(), E, N, K, ws.data_ptr(), ws.numel(), stream, act_code, swiglu_alpha, swiglu_limit)
    if check and status != 0:
        raise RuntimeError(f"mc_sm90_{config} failed: {_lib.library().error_string(status)} ({status})")
    return status


def launch(fn, prepared: dict, act: int, act_rows: int, expert_offsets: int, row_weights, out: int, E: int, N: int,
           K: int, ws: int, ws_bytes: int, stream: int, activation=0, swiglu_alpha=1.702, swiglu_limit=None) -> int:
    """`run` on data pointers (fn from `function`), for the layer: nothing but the C call; returns its status.
    act_rows: the rows the act buffer holds (its TMA descriptor's extent; the same value every call
    keeps the host's cached descriptors)."""
    limit = math.inf if swiglu_limit is None else float(swiglu_limit)
    return fn(prepared["blocks"].data_ptr(), prepared["scales"].data_ptr(), _ptr(prepared.get("bias")), act, act_rows,
              expert_offsets, row_weights, out, E, N, K, prepared.get("scale_max", MAX_SCALE_BYTE), activation,
              float(swiglu_alpha), limit, ws, ws_bytes, stream)
