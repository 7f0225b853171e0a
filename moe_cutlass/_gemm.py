"""Thin Python wrapper of the MoE grouped-GEMM C ABI (templates/sm90/moe_gemm.h.j2), for tests
and benchmarks. The layer itself calls the library through the same functions.

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


def bench(configs=None, shapes=None, reps=50):
    """Times single grouped GEMMs (L2 flushed before every launch, median of `reps`) and prints one
    line per (config, shape) with the time and its multiple of the MXFP4-bytes / BF16-FLOP floor.
    Returns a list of dict rows. GPU only; for development."""
    from . import layout

    lib = _lib.library()
    configs = configs or [k for k in lib.kernels if k.startswith("moe_gemm")]
    # (label, E, active experts, rows per active expert, H, I)
    shapes = shapes or [
        ("gptoss_decode_m4", 128, 16, 1, 2880, 2880),
        ("gptoss_m64", 128, 128, 2, 2880, 2880),
        ("gptoss_m1024", 128, 128, 32, 2880, 2880),
        ("gptoss_m16384", 128, 128, 512, 2880, 2880),
        ("qwen3_decode_m4", 128, 32, 1, 2048, 768),
        ("dsv3_decode_m4", 256, 32, 1, 7168, 2048),
    ]
    dev = torch.device("cuda")
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    rows_out = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for label, E, active, per, H, I in shapes:
        counts = torch.zeros(E, dtype=torch.int64)
        counts[torch.randperm(E, generator=torch.Generator().manual_seed(1))[:active]] = per
        off = torch.cat((torch.zeros(1, dtype=torch.int64), counts.cumsum(0))).to(torch.int32).to(dev)
        total = int(counts.sum())
        for kind in (1, 2):
            N, K = (2 * I, H) if kind == 1 else (H, I)
            Np, Kp = layout.round_up(N, layout.ROW_PAD), layout.round_up(K, layout.K_PAD)
            prepared = {
                "blocks": torch.randint(0, 256, (E, Np, Kp // 2), dtype=torch.uint8, device=dev, generator=gen),
                "scales": torch.randint(118, 126, (E, Kp // 32, Np), dtype=torch.uint8, device=dev, generator=gen),
            }
            act = torch.randn(total, K, device=dev, generator=gen).to(torch.bfloat16)
            out = torch.empty(total, N // 2 if kind == 1 else N, dtype=torch.bfloat16, device=dev)
            rw = torch.ones(total, device=dev)
            bytes_ = active * N * K * 4.25 / 8
            flops = 2.0 * total * N * K
            floor_us = max(bytes_ / 4.25e12, flops / 7.0e14) * 1e6
            for cfg in configs:
                if not cfg.startswith(f"moe_gemm{kind}_"):
                    continue
                ws = workspace(cfg, E, dev)
                stream = torch.cuda.Stream(dev)
                with torch.cuda.stream(stream):
                    run(cfg, prepared, act, off, out, N, K, row_weights=rw, ws=ws)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        run(cfg, prepared, act, off, out, N, K, row_weights=rw, ws=ws)
                    res = {}
                    for mode in ("graph", "eager"):
                        times = []
                        for _ in range(reps + 3):
                            flush.zero_()
                            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            a.record()
                            if mode == "graph":
                                graph.replay()
                            else:
                                run(cfg, prepared, act, off, out, N, K, row_weights=rw, ws=ws)
                            b.record()
                            b.synchronize()
                            times.append(a.elapsed_time(b) * 1e3)
                        res[mode] = sorted(times[3:])[len(times[3:]) // 2]
                us = res["graph"]
                row = {"config": cfg, "shape": label, "M_rows": total, "N": N, "K": K, "us": round(us, 2),
                       "eager_us": round(res["eager"], 2), "floor_us": round(floor_us, 2),
                       "x_floor": round(us / floor_us, 2), "TBps": round(bytes_ / us / 1e6, 2)}
                print(row, flush=True)
                rows_out.append(row)
    return rows_out


if __name__ == "__main__":
    import json
    import sys

    rows = bench()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
