"""Layer A/B of the GEMM token tiles under real (random top-k) routing: the data behind
moe_cutlass/_gemm.pick_config's thresholds and _gemm.plan's split into per-expert parts.

usage: python -m benchmarks.ab_tiles [--configs a,b] [--ms 16,64,...] [--tiles n8k256,...,plan] [--reps 30] [--rounds 5]
                                    [--routing uniform|dirichlet|zipf]
(a tile is a 128-row cooperative tile such as n64k128, or a whole config suffix such as m64n128k128_pingpong)

For every shape and M, the whole layer runs once per candidate, as CUDA-graph replay with the L2
flushed, the candidates interleaved: --rounds rounds, each timing every candidate for reps/rounds
reps in a rotated order, and a candidate's time is the median of its rounds. (Timed one after
another, the candidate in first place came out up to 14% faster than the same config in later
places, bench_20261201T033808Z: the GPU's clocks drift within a row.) A candidate is a tile (one
launch per GEMM over every row, the same tile for both GEMMs), "plan", what fused_moe runs
(_gemm.plan: one tile, or parts whose tile the device picks per expert), or "plan-tXY", the plan
with GEMM1's / GEMM2's tiles of up to 64 tokens in their 192-row versions where X / Y is 1, or
"split-128+96+64+32+16", the plan with split_plan combining those token tiles instead of SPLIT_TILES, or
"plan@SKEW_PART_MIN_WEIGHTS=inf", the rule with moe_cutlass._gemm's named constants set so, or
"exact-m192n128k128+m128n96k128+...", the split plan of exactly those tiles (no 192-row mapping). The
record ("kind": "bench") holds one row per (shape, M, candidate) with "tile" (for "plan", the
plan's tiles, e.g. "plan:n128+n64+n32") and "picked" (the candidate fused_moe runs).
"""
import argparse
import statistics
from unittest import mock

import torch

import moe_cutlass as mc
from benchmarks import routings
from benchmarks.bench_moe import (CONFIGS, SHAPES, Timer, floor_us, graph_of, measure_floors, random_batch,
                                  random_experts)
from benchmarks.record import write_record
from moe_cutlass import _gemm, ops

TILES = ("n8k256", "n16k256", "n32k256", "n64k256", "n128k128", "plan")


def short(config: str) -> str:
    """A config's tile, the 128-row tiles by their token tile alone (m128n64k256 -> n64k256)."""
    tile = config.split("_")[2]
    return tile[4:] if tile.startswith("m128") else tile


def label(plan) -> str:
    """One tile ("n64k256"), or GEMM1/GEMM2 tiles where they differ, or the plan's parts ("plan:n64+n32",
    a 192-row part "n64t", "n64t/n64": GEMM1 tall, GEMM2 not)."""
    def part(c1, c2, name):
        return name(c1) if short(c1) == short(c2) else f"{name(c1)}/{name(c2)}"
    if len(plan.parts) == 1 and plan.chunk == _gemm.ALL_ROWS[0]:
        return part(*plan.parts[0][:2], short)
    return "plan:" + "+".join(part(*p[:2], lambda c: f"n{_gemm.tile_n(c)}" + ("t" if "_m192" in c else ""))
                              for p in plan.parts)


def candidate(tile, M, k, E, available=None, ks=None):
    """(name, plan, picked) of a --tiles entry: a tile, "plan" (what fused_moe runs) or "plan-tXY"
    (the rule's tiles with GEMM1 / GEMM2 192 rows tall where X / Y is 1); ks = (H, I), the GEMMs' K,
    as fused_moe passes them to the rule."""
    rule = _gemm.plan(M * k, E, available, ks=ks)
    if tile == "plan":
        return label(rule), rule, True
    if tile.startswith("plan@"):
        with mock.patch.multiple(_gemm, **plan_constants(tile)):
            forced = _gemm.plan(M * k, E, available, ks=ks)
        return f"{tile}:{label(forced)}", forced, label(forced) == label(rule)
    if tile.startswith("plan-t"):
        forced = _gemm.plan(M * k, E, available, tall_tiles=(tile[-2] == "1", tile[-1] == "1"), ks=ks)
        return f"{tile}:{label(forced)}", forced, False
    if tile.startswith("split-") or tile.startswith("exact-"):
        exact = tile.startswith("exact-")
        forced = _gemm.plan(M * k, E, available, tall_tiles=(False, False) if exact else None,
                            split_tiles=exact_tiles(tile) if exact else split_tiles(tile), ks=ks)
        return f"{'exact' if exact else tile}:{label(forced)}", forced, label(forced) == label(rule)
    forced = one_tile(tile)
    return tile, forced, label(forced) == label(rule)


def plan_constants(candidate):
    """{name: value} of a "plan@SKEW_PART_MIN_WEIGHTS=inf@ALL_PARTS_ROWS=64" candidate: the rule run with those
    moe_cutlass._gemm constants (numbers; inf switches a from-this-much rule off)."""
    constants = {}
    for item in candidate.split("@")[1:]:
        name, _, value = item.partition("=")
        if not hasattr(_gemm, name) or not isinstance(getattr(_gemm, name), (int, float)):
            raise ValueError(f"{candidate!r}: {name!r} is not a numeric constant of moe_cutlass._gemm")
        constants[name] = float(value) if value in ("inf", "-inf") or "." in value else int(value)
    return constants


def split_tiles(candidate):
    """The split plan's tiles of a "split-128c2+96+64+32+16" candidate: 128-row tiles, TileK 128 from
    96 tokens up and 256 below (as SPLIT_TILES; plan() moves GEMM1's to 192 rows, those of up to 64
    tokens GEMM2's too), "c2" a cluster of two (the _c2 configs)."""
    def tile(part):
        n, c2 = (int(part[:-2]), "_c2") if part.endswith("c2") else (int(part), "")
        return f"m128n{n}k{128 if n >= 96 else 256}_coop{c2}"
    return tuple(tile(part) for part in candidate[len("split-"):].split("+"))


def exact_tiles(candidate):
    """The split plan's tiles of an "exact-m192n128k128+m128n96k128" candidate, as named."""
    return tuple(f"{t}_coop" for t in candidate[len("exact-"):].split("+"))


def one_tile(tile):
    """The plan that runs every call on one tile: a 128-row cooperative tile (n64k256) or a whole
    config suffix (m192n16k128_coop), the same for both GEMMs."""
    return _gemm.single(f"moe_gemm1_{tile}" if "_" in tile else f"moe_gemm1_m128{tile}_coop")


def time_tiles(name, tokens, tiles, timer, floors, gen, rounds, routing="uniform"):
    E, H, I, k = SHAPES[name]
    experts = random_experts(E, H, I, gen)
    rows = []
    for M in tokens:
        x, weights, ids = random_batch(M, E, H, k, gen, routing)
        out = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
        floor = floor_us(M, E, H, I, k, ids, floors)
        graphs, names, picked = [], [], []
        for tile in tiles:
            label_, forced, is_rule = candidate(tile, M, k, E, _gemm.configs_of(1), ks=(H, I))
            names.append(label_)
            picked.append(is_rule)
            ops._gemms.cache_clear()  # the layer caches its plan per batch size
            with mock.patch.object(_gemm, "plan", lambda *a, forced=forced, **kw: forced):
                graphs.append(graph_of(lambda: mc.fused_moe(x, experts, weights, ids, out=out)))
            ops._gemms.cache_clear()
        per_round = Timer(max(5, timer.reps // rounds), timer.flush_buf)
        times = interleaved_us([g.replay for g in graphs], lambda fn: per_round.median_us(fn, warmup=2), rounds)
        for tile, is_rule, us in zip(names, picked, times):
            rows.append({"impl": "moe_cutlass", "config": name, "M": M, "mode": "graph", "routing": routing,
                         "tile": tile, "picked": is_rule, "us": us, "floor_us": floor, "x_floor": us / floor})
            print(f"{name:14s} M={M:6d} {tile:30s}{'*' if is_rule else ' '} {us:9.1f} us  x{us / floor:5.2f}",
                  flush=True)
        del graphs
    return rows


def interleaved_us(fns, time_us, rounds):
    """Each fn's median over `rounds` rounds of time_us(fn), the fns timed in a rotated order each
    round so that none always runs first."""
    times = [[] for _ in fns]
    for r in range(rounds):
        for i in [(r + j) % len(fns) for j in range(len(fns))]:
            times[i].append(time_us(fns[i]))
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default="16,64,256,1024,4096")
    parser.add_argument("--tiles", default=",".join(TILES))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--routing", default="uniform", choices=routings.ROUTINGS,
                        help="the top-k routing of the batches (benchmarks/routings.py)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    timer = Timer(args.reps)
    floors = measure_floors(timer)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    for name in args.configs.split(","):
        rows += time_tiles(name, [int(m) for m in args.ms.split(",")], args.tiles.split(","), timer, floors, gen,
                           args.rounds, args.routing)
        torch.cuda.empty_cache()
    run = {"floors": floors, "reps": args.reps, "rounds": args.rounds, "ab": "tiles", "routing": args.routing,
           "rows": rows}
    path = write_record("bench", run, args.out_dir)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
