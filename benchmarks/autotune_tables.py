"""Autotuned tile tables for the four design shapes (or any of bench_moe.SHAPES; moe_cutlass.tuning), beside the
built-in rule.

usage: python -m benchmarks.autotune_tables [--configs a,b] [--ms 1,4,...] [--reps 10] [--routing zipf] [--out-dir DIR]
(--routing: tune on batches of benchmarks/routings.py's routing, through autotune's routing argument)
Writes a "tuning" record that is itself a tuning file: `moe_cutlass.tuning.load(record_path)`
installs its tables. Each table also lists the time of every candidate per batch size, the
built-in rule (_gemm.plan, the candidate "plan") among them, and in "rule" the launches the rule
makes, so the record shows where measuring beats the rule and by how much.
"""
import argparse

import torch

from benchmarks import routings
from benchmarks.bench_moe import CONFIGS, SHAPES, random_experts
from benchmarks.record import record_main
from moe_cutlass import _gemm, tuning


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default=",".join(map(str, tuning.DEFAULT_TOKENS + (16384,))))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--routing", default="uniform", choices=routings.ROUTINGS)
    parser.add_argument("--out-dir", default=None)
    return parser.parse_args(argv)


def run(args):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    ms = [int(m) for m in args.ms.split(",")]
    tables = []
    for name in args.configs.split(","):
        E, H, I, k = SHAPES[name]
        experts = random_experts(E, H, I, gen)
        draw = None if args.routing == "uniform" else lambda M, g, E=E, k=k: routings.batch_like(args.routing, M, E, k, g)
        table = tuning.autotune(experts, k, ms, reps=args.reps, install=False, routing=draw)
        table["config"] = name
        table["rule"] = {M: [part[0] for part in _gemm.plan(M * k, E, _gemm.configs_of(1), ks=(H, I)).parts]
                         for M in ms}
        for M in ms:
            rule_us = table["us"][M][_gemm.PLAN]
            best = tuning.key(table["choices"][M])
            best_us = table["us"][M][best]
            print(f"{name:14s} M={M:6d} rule {'+'.join(table['rule'][M]):28s} {rule_us:9.1f} us  "
                  f"tuned {best:28s} {best_us:9.1f} us  ({rule_us / best_us:.3f}x)", flush=True)
        tables.append(table)
        del experts
        torch.cuda.empty_cache()
    return {"format": tuning.FORMAT, "tables": tables, "routing": args.routing}, 0


def main(argv=None):
    return record_main("tuning", parse_args, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
