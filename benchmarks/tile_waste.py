"""Token-tile waste of the grouped GEMMs under uniform and skewed routing, simulated on the CPU
(issue 8 item 1): how much MMA work the per-expert token tiles pad, and how often an expert's
weights are streamed.

usage: python -m benchmarks.tile_waste [--ms 1,4,16,...] [--configs a,b] [--seeds 5] [--out-dir DIR]

For every shape of bench_moe.CONFIGS (or --configs, any of bench_moe.SHAPES), every M and the three
routings of benchmarks/routings.py (uniform, Dirichlet, Zipf), --seeds batches are drawn and the rows
per expert r_e counted. A scheme gives expert e tiles that cover padded_e >= r_e rows. Per scheme the record holds
waste = sum padded_e / sum r_e (padded MMA work over useful work) and re-stream = tiles over
active experts (how many times each active expert's weights are streamed; 1 is ideal). Schemes:
- "pick": one TileN for all experts, the one moe_cutlass._gemm.pick_config takes for M * k rows
  (fused_moe's launches before the split plans);
- "plan": what fused_moe launches, moe_cutlass._gemm.plan: one tile, or parts whose row windows
  put each expert's full 128-row chunks and its remainder in tiles the device picks per expert;
- "gmma": the plan's MMA work, an expert's last tile in each part only as wide as the GMMA width its
  config runs there (moe_cutlass._gemm.gmma_widths; the re-stream is the plan's);
- "rem128": full 128-row tiles, then the remainder in one tile rounded up to a multiple of 32;
- "oracle": per expert the built TileN (TILES) with the fewest padded rows, ties to the larger.
Both GEMMs see the same r_e and the same tiles, so one number covers both.
Values are means over the seeds. Writes a "tile_waste" record (benchmarks/record.py), one row
per (config, M, routing).
"""
import argparse
import time

import torch

from benchmarks.bench_moe import CONFIGS, SHAPES, TOKENS
from benchmarks.record import record_main
from benchmarks.routings import DIRICHLET_ALPHA, ROUTINGS, ZIPF_EXPONENT, route, rows_per_expert
from moe_cutlass import _gemm

TILES = (8, 16, 32, 64, 128)  # the TileN of the built GEMM configs
REM_TILE, REM_QUANTUM = 128, 32


def one_tile(rows, n):
    """(padded rows, tiles) per expert with TileN n for all."""
    tiles = (rows + n - 1) // n
    return tiles * n, tiles


def planned(rows, plan, gmma=False):
    """(padded rows, tiles) per expert under a _gemm.Plan: each part pads the rows its window takes to
    whole tiles, or with gmma to the GMMA widths its GEMM1 config runs (_gemm.gmma_widths: an expert's
    last tile only as wide as the narrowest width that covers its tokens)."""
    padded, tiles = torch.zeros_like(rows), torch.zeros_like(rows)
    for config1, _, lo, hi in plan.parts:
        n = _gemm.tile_n(config1)
        widths = _gemm.gmma_widths(config1) if gmma else (n,)
        count = torch.tensor([_gemm.window_rows(int(r), plan.chunk, lo, hi)[1] for r in rows])
        last = torch.tensor([0 if c % n == 0 else next(w for w in widths if w >= c % n) for c in count.tolist()])
        padded += count // n * n + last
        tiles += (count + n - 1) // n
    return padded, tiles


def rem128(rows):
    """(padded rows, tiles) per expert with full REM_TILE tiles and the rest rounded up to REM_QUANTUM."""
    rest = rows % REM_TILE
    padded = rows - rest + (rest + REM_QUANTUM - 1) // REM_QUANTUM * REM_QUANTUM
    return padded, (rows + REM_TILE - 1) // REM_TILE


def oracle(rows):
    """(padded rows, tiles) per expert with its best TILES entry: fewest padded rows, ties to the
    larger tile (fewer weight re-streams)."""
    padded, tiles = zip(*(one_tile(rows, n) for n in TILES))
    padded, tiles = torch.stack(padded), torch.stack(tiles)
    # Larger tiles come last in TILES: on a tie, the flipped argmin finds the last, largest, one.
    best = padded.size(0) - 1 - padded.flip(0).argmin(dim=0)
    return padded.gather(0, best[None])[0], tiles.gather(0, best[None])[0]


def factors(rows, scheme):
    """(waste, re-stream) of one batch's rows per expert under (padded, tiles) = scheme(rows)."""
    padded, tiles = scheme(rows)
    active = int((rows > 0).sum())
    return int(padded.sum()) / int(rows.sum()), int(tiles.sum()) / active


def measure(name, M, routing, seeds):
    E, H, I, k = SHAPES[name]
    picked = _gemm.tile_n(_gemm.pick_config(1, M * k, E))
    plan = _gemm.plan(M * k, E, ks=(H, I))
    schemes = {"pick": lambda rows: one_tile(rows, picked), "plan": lambda rows: planned(rows, plan),
               "gmma": lambda rows: planned(rows, plan, gmma=True), "rem128": rem128, "oracle": oracle}
    sums = {}
    for seed in range(seeds):
        rows = rows_per_expert(route(routing, M, E, k, torch.Generator().manual_seed(seed)), E)
        values = {"rows_max": int(rows.max()), "active": int((rows > 0).sum())}
        for scheme, fn in schemes.items():
            values[f"{scheme}_waste"], values[f"{scheme}_restream"] = factors(rows, fn)
        for key, value in values.items():
            sums[key] = sums.get(key, 0) + value
    return {"config": name, "M": M, "routing": routing, "E": E, "top_k": k, "rows_mean": M * k / E,
            "pick_tile_n": picked, "plan_tiles_n": [_gemm.tile_n(part[0]) for part in plan.parts], **{key: round(value / seeds, 4) for key, value in sums.items()}}


def run(args):
    started = time.monotonic()
    rows = []
    for name in args.configs:
        for M in args.ms:
            for routing in ROUTINGS:
                row = measure(name, M, routing, args.seeds)
                rows.append(row)
                print(f"{name:14s} M={M:6d} {routing:9s} rows/expert {row['rows_mean']:7.1f} (max "
                      f"{row['rows_max']:7.1f})  waste pick(n{row['pick_tile_n']}) {row['pick_waste']:.3f} "
                      f"plan {row['plan_waste']:.3f} (GMMAs {row['gmma_waste']:.3f}) rem128 {row['rem128_waste']:.3f} oracle "
                      f"{row['oracle_waste']:.3f}  re-stream {row['pick_restream']:.2f} / {row['plan_restream']:.2f} / "
                      f"{row['rem128_restream']:.2f} / {row['oracle_restream']:.2f}",
                      flush=True)
    payload = {"device": "cpu (simulation)", "seeds": args.seeds, "tiles": list(TILES),
               "dirichlet_alpha": DIRICHLET_ALPHA, "zipf_exponent": ZIPF_EXPONENT,
               "seconds": round(time.monotonic() - started, 2), "rows": rows}
    return payload, 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", type=lambda s: [int(m) for m in s.split(",")], default=TOKENS)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out-dir", default=None, help="where the record goes (default benchmarks/results)")
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = [n for n in args.configs if n not in SHAPES]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(SHAPES)}")
    return args


def main(argv=None):
    return record_main("tile_waste", parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
