"""Where one layer's time goes: device time of every kernel of a fused_moe call (torch.profiler).

usage: python -m benchmarks.profile_stages [--configs a,b] [--ms 1,64,4096] [--reps 20]
                                           [--tall XY | --tile T | --tall-gemm2-min-k K] [--out-dir DIR]
Writes a "profile" record: per config and M, the mean device microseconds of each kernel (the GEMMs
named GEMM1 / GEMM2, the launches of a split plan summed, the one-launch layer of small batches LAYER), and each GEMM's achieved bandwidth: the MXFP4 bytes of the active experts'
weights (4.25 bits per weight) over its time ("gemm_tbps"), the number to hold against the copy rate,
and its achieved rate in useful FLOPs ("gemm_tflops": 2 * M * k * N * K over its time; padded tile
work not counted) beside the dense BF16 matmul rate measured in the same run ("bf16_tflops").
--tall XY runs GEMM1's / GEMM2's tiles of up to 64 tokens in their 192-row versions where X / Y is 1
(_gemm.plan's tall_tiles; the record keeps "tall"): per-GEMM device times of the two kernels, free
of the layer benchmark's run-to-run spread. --tile T runs every call on one tile instead of the
plan (an ab_tiles candidate: n8k256, or a whole config suffix such as m192n16k128_coop; the record
keeps "tile"), for the same per-GEMM A/B of two tiles. --tall-gemm2-min-k K runs GEMM2's 96/128-token parts on
192 rows from that K on instead of _gemm.TALL_GEMM2_MIN_K (a K above every shape's keeps them on 128 rows). The layer's kernels launch in plain stream
order here (ops.PROGRAMMATIC_LAUNCH off): launched dependent, a kernel's device time would include its
wait on the kernel before.
"""
import argparse
import functools
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import moe_cutlass as mc
from moe_cutlass import _gemm, ops
from benchmarks.ab_tiles import exact_tiles, one_tile, split_tiles
from benchmarks.bench_moe import CONFIGS, SHAPES, Timer, floor_bytes, measure_floors, random_batch, random_experts
from benchmarks.record import write_record


def kernel_times(fn, reps):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[_short_name(event.name)] += event.device_time / reps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _short_name(kernel):
    for kind in (1, 2):  # the GEMMs' names differ only deep in their template arguments
        if f"MoeEpilogue<{kind}," in kernel:
            return f"GEMM{kind}"
    if "decode::layer_kernel" in kernel:
        return "LAYER"  # the one-launch layer (templates/sm90/moe_decode.cuh): both GEMMs inside
    return kernel[:90]


def gemm_tbps(times, ids, E, H, I):
    """TB/s of each GEMM (and of the one-launch layer, both GEMMs' weights): its active experts'
    MXFP4 weight bytes over its device time."""
    w1, w2, _ = floor_bytes(0, E, H, I, ids)
    weight_bytes = {"GEMM1": w1, "GEMM2": w2, "LAYER": w1 + w2}
    return {g: b / (times[g] * 1e-6) / 1e12 for g, b in weight_bytes.items() if times.get(g)}


def gemm_tflops(times, ids, E, H, I):
    """Useful TFLOP/s of each GEMM: 2 * (routed rows) * N * K over its device time."""
    rows = int(((ids >= 0) & (ids < E)).sum())
    flops = {"GEMM1": 2 * rows * 2 * I * H, "GEMM2": 2 * rows * H * I}
    return {g: f / (times[g] * 1e-6) / 1e12 for g, f in flops.items() if times.get(g)}


def profile_config(name, tokens, reps, gen):
    """Rows of one shape, its experts freed on return."""
    E, H, I, k = SHAPES[name]
    experts = random_experts(E, H, I, gen)
    rows = []
    for M in tokens:
        x, weights, ids = random_batch(M, E, H, k, gen)
        times = kernel_times(lambda: mc.fused_moe(x, experts, weights, ids), reps)
        tbps = gemm_tbps(times, ids, E, H, I)
        tflops = gemm_tflops(times, ids, E, H, I)
        rows.append({"config": name, "M": M, "kernels_us": times, "gemm_tbps": tbps, "gemm_tflops": tflops})
        print(f"{name} M={M}: total {sum(times.values()):.1f} us, GEMM TB/s "
              + ", ".join(f"{g} {v:.2f}" for g, v in tbps.items()) + ", TFLOP/s "
              + ", ".join(f"{g} {v:.0f}" for g, v in tflops.items()))
        for kernel, us in times.items():
            print(f"    {us:9.1f} us  {kernel}")
    return rows


def plan_override(tall=None, tile=None, gemm2_min_k=None):
    """What replaces _gemm.plan for --tall XY (the rule with its tiles of up to 64 tokens on 192 rows
    where X / Y is 1) or --tile T (one tile for every call, or a "split-128+96+64+32+16" candidate: the
    rule with split_plan combining those token tiles, or an "exact-m192n128k128+..." one: the split
    plan of exactly those tiles), or --tall-gemm2-min-k K (the rule with GEMM2's 96/128-token parts on
    192 rows from that K on: _gemm.TALL_GEMM2_MIN_K's A/B), or None for the rule itself."""
    if sum(v is not None for v in (tall, tile, gemm2_min_k)) > 1:
        raise ValueError("--tall, --tile and --tall-gemm2-min-k exclude each other")
    if gemm2_min_k is not None:
        return functools.partial(_gemm.plan, tall_gemm2_min_k=gemm2_min_k)
    if tall is not None:
        if len(tall) != 2 or set(tall) - {"0", "1"}:
            raise ValueError(f"--tall takes two digits 0/1, got {tall!r}")
        return functools.partial(_gemm.plan, tall_tiles=(tall[0] == "1", tall[1] == "1"))
    if tile is not None and tile.startswith("split-"):
        return functools.partial(_gemm.plan, split_tiles=split_tiles(tile))
    if tile is not None and tile.startswith("exact-"):
        return functools.partial(_gemm.plan, tall_tiles=(False, False), split_tiles=exact_tiles(tile))
    if tile is not None:
        forced = one_tile(tile)
        return lambda *a, **kw: forced
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default="1,16,256,4096")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tall", default=None, help="XY: 192-row tiles for GEMM1 (X=1) / GEMM2 (Y=1)")
    parser.add_argument("--tile", default=None, help="one tile for every call (an ab_tiles candidate)")
    parser.add_argument("--tall-gemm2-min-k", type=int, default=None,
                        help="GEMM2's K from which its 96/128-token parts run on 192 rows (rule: _gemm.TALL_GEMM2_MIN_K)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    try:
        override = plan_override(args.tall, args.tile, args.tall_gemm2_min_k)
    except ValueError as ex:
        parser.error(str(ex))
    if override is not None:
        _gemm.plan = override
    ops.PROGRAMMATIC_LAUNCH = False
    floors = measure_floors(Timer(20))
    torch.cuda.empty_cache()
    print(f"dense BF16 matmul {floors['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, copy "
          f"{floors['hbm_bytes_per_s'] / 1e12:.2f} TB/s")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    for name in args.configs.split(","):
        rows += profile_config(name, [int(m) for m in args.ms.split(",")], args.reps, gen)
        torch.cuda.empty_cache()  # the next shape's weights get this one's memory
    write_record("profile", {"rows": rows, "bf16_tflops": floors["bf16_flops_per_s"] / 1e12,
                             "copy_tbps": floors["hbm_bytes_per_s"] / 1e12, "tall": args.tall, "tile": args.tile,
                             "tall_gemm2_min_k": args.tall_gemm2_min_k},
                 args.out_dir)


if __name__ == "__main__":
    main()
