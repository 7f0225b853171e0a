"""Layer A/B of built libraries (a kernel change against the library before it): the rule's plans timed as
benchmarks.ab_tiles times them (`--tiles plan`, graph replay, L2 flushed, five interleaved rounds a process), one
process per library, the libraries rotating (their order reversed every other round, so that none always runs
first), the same batches for each (ab_tiles seeds its generator alike); then each point's mean over the rounds,
against the first library.

usage (on the GPU machine):
    python -m benchmarks.ab_libs run --libs base=A.so,new=B.so [--commits base=SHA,new=SHA] --tag TAG --out-dir DIR
        [--rounds 2] [--routings uniform,zipf,dirichlet] [--configs a,b] [--ms 256,1024] [--reps 300]
then (anywhere):
    python -m benchmarks.ab_libs summary DIR/bench_*_TAG_*.json

`run` names each record bench_<UTC time>_<tag>_<lib>_r<round>_<routing>.json (benchmarks/results/raw's convention);
`summary` reads the library, round and routing back from those names. Library names take no underscore.
"""
import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

NAME = re.compile(r"_(?P<lib>[^_/]+)_r(?P<round>\d+)_(?P<routing>[a-z]+)\.json$")


def pairs(text, what):
    """{name: value} of "a=x,b=y" (in order)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{what}: {item!r} is not name=value")
        if "_" in name:
            raise ValueError(f"{what}: library name {name!r} holds an underscore (record names split on them)")
        out[name] = value
    return out


def rotation(libs, rounds):
    """[(round, [lib, ...])]: the libraries in their order on odd rounds, reversed on even ones."""
    return [(r, libs if r % 2 else libs[::-1]) for r in range(1, rounds + 1)]


def run(args, call=subprocess.run):
    libs = pairs(args.libs, "--libs")
    commits = pairs(args.commits, "--commits")
    if len(libs) < 2:
        raise ValueError("--libs: name two libraries or more")
    for name, path in libs.items():
        if not Path(path).is_file():
            raise FileNotFoundError(f"--libs: {name}'s library {path} does not exist")
    out_dir = Path(args.out_dir)
    scratch = out_dir / f".ab_libs_{args.tag}"
    written = []
    for r, order in rotation(list(libs), args.rounds):
        for routing in args.routings.split(","):
            for lib in order:
                env = dict(os.environ, MOE_CUTLASS_LIB=str(Path(libs[lib]).resolve()))
                if lib in commits:
                    env["MOE_CUTLASS_COMMIT"] = commits[lib]
                cmd = [sys.executable, "-m", "benchmarks.ab_tiles", "--tiles", "plan", "--configs", args.configs,
                       "--ms", args.ms, "--reps", str(args.reps), "--rounds", "5", "--routing", routing,
                       "--out-dir", str(scratch)]
                call(cmd, env=env, check=True)
                made = sorted(scratch.glob("bench_*.json"))
                if len(made) != 1:
                    raise RuntimeError(f"ab_tiles left {len(made)} records in {scratch}, expected one")
                target = out_dir / f"{made[0].stem}_{args.tag}_{lib}_r{r}_{routing}.json"
                made[0].rename(target)
                written.append(target)
                print(f"{lib} round {r} {routing}: {target}", flush=True)
    scratch.rmdir()
    return written


def load(paths):
    """{(lib, routing, config, M): [us of each round]} of the plan rows of ab_libs' records."""
    times = defaultdict(list)
    for path in paths:
        m = NAME.search(str(path))
        if not m:
            raise ValueError(f"{path}: not an ab_libs record name (..._<lib>_r<round>_<routing>.json)")
        record = json.loads(Path(path).read_text())
        for row in record["rows"]:
            if row.get("picked"):
                times[m["lib"], row.get("routing", m["routing"]), row["config"], row["M"]].append(row["us"])
    return times


def summarize(times, base=None):
    """(points, totals): points = [(routing, config, M, {lib: mean us}, {lib: % against base})], totals = {lib:
    (geomean % against base, points faster, points)} over the points every library ran."""
    libs = list(dict.fromkeys(lib for lib, *_ in times))
    base = base or libs[0]
    if base not in libs:
        raise ValueError(f"base {base!r} is not among the records' libraries {libs}")
    keys = sorted({key[1:] for key in times})
    points, logs = [], defaultdict(list)
    for routing, config, M in keys:
        mean = {lib: statistics.fmean(times[lib, routing, config, M]) for lib in libs
                if (lib, routing, config, M) in times}
        if len(mean) < len(libs):
            continue
        delta = {lib: 100.0 * (mean[lib] / mean[base] - 1.0) for lib in libs if lib != base}
        for lib in delta:
            logs[lib].append(math.log(mean[lib] / mean[base]))
        points.append((routing, config, M, mean, delta))
    totals = {lib: (100.0 * (math.exp(statistics.fmean(v)) - 1.0), sum(x < 0 for x in v), len(v))
              for lib, v in logs.items()}
    return points, totals


def summary(args):
    points, totals = summarize(load(args.records), args.base)
    for routing, config, M, mean, delta in points:
        times = " ".join(f"{lib} {us:9.1f}" for lib, us in mean.items())
        deltas = " ".join(f"{lib} {d:+6.2f}%" for lib, d in delta.items())
        print(f"{routing:9s} {config:16s} M={M:6d}  {times}  {deltas}")
    for lib, (geo, faster, n) in totals.items():
        print(f"{lib}: geomean {geo:+.2f}% against the base, faster at {faster} of {n} points")
    return points, totals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time the libraries in rotation (GPU)")
    r.add_argument("--libs", required=True, help="name=path.so,... (the first is the base)")
    r.add_argument("--commits", default="", help="name=sha,...: each record's commit")
    r.add_argument("--tag", required=True)
    r.add_argument("--out-dir", required=True)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--routings", default="uniform")
    r.add_argument("--configs", default="qwen3-30b-a3b,gpt-oss-120b,dsv4-flash,dsv3")
    r.add_argument("--ms", default="256,512,1024,2048,4096,16384")
    r.add_argument("--reps", type=int, default=300)
    s = sub.add_parser("summary", help="means over the rounds, against the base library")
    s.add_argument("records", nargs="+")
    s.add_argument("--base", default=None, help="the library the others are measured against (default: the first)")
    args = parser.parse_args(argv)
    return run(args) if args.cmd == "run" else summary(args)


if __name__ == "__main__":
    main()
