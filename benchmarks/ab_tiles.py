"""Layer A/B of the GEMM token tiles under real (random top-k) routing: the data behind
moe_cutlass/_gemm.pick_config's thresholds.

usage: python -m benchmarks.ab_tiles [--configs a,b] [--ms 16,64,...] [--tiles n8k256,...] [--reps 30]

For every shape and M, the whole layer runs once per candidate tile (the same tile for both
GEMMs), as CUDA-graph replay with the L2 flushed, next to the tile pick_config chooses. The record
("kind": "bench") holds one row per (shape, M, tile) with "tile" and "picked".
"""
import argparse
from unittest import mock

import torch

import moe_cutlass as mc
from benchmarks.bench_moe import CONFIGS, Timer, floor_us, graph_of, measure_floors, random_batch, random_experts
from benchmarks.record import write_record
from moe_cutlass import _gemm, ops

TILES = ("n8k256", "n16k256", "n32k128", "n64k128", "n128k128")


def time_tiles(name, tokens, tiles, timer, floors, gen):
    E, H, I, k = CONFIGS[name]
    experts = random_experts(E, H, I, gen)
    rows = []
    for M in tokens:
        x, weights, ids = random_batch(M, E, H, k, gen)
        out = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
        floor = floor_us(M, E, H, I, k, ids, floors)
        picked = _gemm.pick_config(1, M * k, E).split("_")[2][4:]
        for tile in tiles:
            def forced(kind, rows_, num_experts, available=None, batch_invariant=False, tile=tile):
                return f"moe_gemm{kind}_m128{tile}_coop"

            ops._gemms.cache_clear()  # the layer caches its pick per batch size
            with mock.patch.object(_gemm, "pick_config", forced):
                graph = graph_of(lambda: mc.fused_moe(x, experts, weights, ids, out=out))
            ops._gemms.cache_clear()
            us = timer.median_us(graph.replay)
            del graph
            rows.append({"impl": "moe_cutlass", "config": name, "M": M, "mode": "graph", "tile": tile,
                         "picked": tile == picked, "us": us, "floor_us": floor, "x_floor": us / floor})
            print(f"{name:14s} M={M:6d} {tile:9s}{'*' if tile == picked else ' '} {us:9.1f} us  x{us / floor:5.2f}",
                  flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default="16,64,256,1024,4096")
    parser.add_argument("--tiles", default=",".join(TILES))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    timer = Timer(args.reps)
    floors = measure_floors(timer)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    for name in args.configs.split(","):
        rows += time_tiles(name, [int(m) for m in args.ms.split(",")], args.tiles.split(","), timer, floors, gen)
        torch.cuda.empty_cache()
    path = write_record("bench", {"floors": floors, "reps": args.reps, "ab": "tiles", "rows": rows}, args.out_dir)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
