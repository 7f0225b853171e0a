"""Time single grouped GEMMs (one kernel, not the layer) for every config the library holds.

usage: python -m benchmarks.bench_gemm [--configs a,b] [--shapes a,b] [--reps 50] [--out-dir DIR]

Each shape fixes how many experts are active and how many rows each gets, so a config's
streaming (decode) and compute (prefill) behaviour can be compared without routing noise.
floor = max(active MXFP4 weight bytes / copy bandwidth, 2 * rows * N * K / BF16 rate), both
measured in the run. Writes a "bench" record with kind-of-row "gemm".
"""
import argparse

import torch

from benchmarks.bench_moe import Timer, graph_of, measure_floors, random_mxfp4
from benchmarks.record import write_record
from moe_cutlass import _gemm, _lib, layout

SHAPES = {  # label: (E, active experts, rows per active expert, H, I)
    "gptoss_decode_m4": (128, 16, 1, 2880, 2880),
    "gptoss_m64": (128, 128, 2, 2880, 2880),
    "gptoss_m1024": (128, 128, 32, 2880, 2880),
    "gptoss_m2048": (128, 128, 64, 2880, 2880),
    "gptoss_m16384": (128, 128, 512, 2880, 2880),
    "qwen3_decode_m4": (128, 32, 1, 2048, 768),
    "dsv3_decode_m4": (256, 32, 1, 7168, 2048),
    "qwen3_m1024": (128, 128, 64, 2048, 768),
    "qwen3_m4096": (128, 128, 256, 2048, 768),
    "qwen3_m16384": (128, 128, 1024, 2048, 768),
    "dsv4_m4096": (256, 256, 96, 4096, 2048),
    "dsv3_m256": (256, 256, 8, 7168, 2048),
    "dsv3_m1024": (256, 256, 32, 7168, 2048),
    "dsv3_m16384": (256, 256, 512, 7168, 2048),
}


def expert_offsets(E, active, per_expert, device):
    counts = torch.zeros(E, dtype=torch.int64)
    counts[torch.randperm(E, generator=torch.Generator().manual_seed(1))[:active]] = per_expert
    return torch.cat((counts.new_zeros(1), counts.cumsum(0))).to(torch.int32).to(device), int(counts.sum())


def bench_shape(label, configs, timer, floors, gen):
    E, active, per_expert, H, I = SHAPES[label]
    offsets, rows = expert_offsets(E, active, per_expert, "cuda")
    results = []
    for kind, (N, K) in ((1, (2 * I, H)), (2, (H, I))):
        blocks, scales = random_mxfp4(E, N, K, gen)
        weights = layout.prepare_w13(blocks, scales) if kind == 1 else layout.prepare_w2(blocks, scales)
        del blocks, scales
        act = torch.randn(rows, K, device="cuda", generator=gen).to(torch.bfloat16)
        out = torch.empty(rows, N // 2 if kind == 1 else N, dtype=torch.bfloat16, device="cuda")
        row_weights = torch.rand(rows, device="cuda", generator=gen)
        weight_bytes = active * N * K * 4.25 / 8
        floor = max(weight_bytes / floors["hbm_bytes_per_s"], 2.0 * rows * N * K / floors["bf16_flops_per_s"]) * 1e6
        for config in (c for c in configs if c.startswith(f"moe_gemm{kind}_")):
            ws = _gemm.workspace(config, E)

            def run():
                _gemm.run(config, weights, act, offsets, out, N, K, row_weights=row_weights, ws=ws)

            for mode, fn in (("graph", graph_of(run).replay), ("eager", run)):
                us = timer.median_us(fn)
                results.append({"impl": "moe_cutlass_gemm", "config": config, "shape": label, "rows": rows, "N": N,
                                "K": K, "mode": mode, "us": us, "floor_us": floor, "x_floor": us / floor,
                                "TBps": weight_bytes / us / 1e6})
            print(f"{label:18s} {config:30s} {results[-2]['us']:9.1f} us  x{results[-2]['x_floor']:5.2f}  "
                  f"{results[-2]['TBps']:.2f} TB/s", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=None, help="default: every GEMM config in the library")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    available = [k for k in _lib.library().kernels if k.startswith("moe_gemm")]
    configs = args.configs.split(",") if args.configs else available
    unknown = [c for c in configs if c not in available] + [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown configs/shapes {unknown}; configs: {available}; shapes: {list(SHAPES)}")
    timer = Timer(args.reps)
    floors = measure_floors(timer)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = [r for label in args.shapes.split(",") for r in bench_shape(label, configs, timer, floors, gen)]
    print(f"record: {write_record('bench', {'level': 'gemm', 'floors': floors, 'rows': rows}, args.out_dir)}")


if __name__ == "__main__":
    main()
