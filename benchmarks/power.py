"""What the layer draws under sustained load: SM clock, board power and the throttle reasons.

usage: python -m benchmarks.power [--configs a,b] [--ms 64,256,1024] [--seconds 2.5] [--cool-ms 20] [--out-dir DIR]

An engine runs one layer after another for as long as it serves. This replays each shape's layer
(fused_moe as a CUDA graph, back to back, no L2 flush between calls) for --seconds while
`nvidia-smi` samples the SM clock, the board power and the active clock-throttle reasons every
50 ms, and does the same for the two references the floor divides by: a dense BF16 matmul
(8192^3) and a 1 GB device copy. The first third of each window's samples is dropped (the clock
settles). Writes a "power" record: per row the mean microseconds per call over the window, the
median clock (MHz) and power (W), the throttle-reason masks seen (0x4: software power cap), and for
the layer its floor (bench_moe's, measured in the same run) and the sustained time over it.
A layer drawing the board's power limit runs at the clock the limit leaves it, whatever its
instructions' latencies: then its energy per call, not its critical path, sets its time.
Beside the sustained time each layer row holds the same graph replayed after --cool-ms of idle
before every call ("cool_us", the median of 30; 0 leaves it out) and the sum of its kernels' device
times in eager calls ("kernel_sum_us", profile_stages' way): sustained against cool is what the
power limit costs the layer, cool against the kernel sum what launching costs it.
"""
import argparse
import statistics
import subprocess
import time

import torch

import moe_cutlass as mc
from benchmarks.bench_moe import CONFIGS, Timer, floor_us, graph_of, measure_floors, random_batch, random_experts
from benchmarks.profile_stages import kernel_times
from benchmarks.record import record_main
from moe_cutlass import ops

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
SAMPLE_MS = 50


def parse_samples(text: str) -> dict:
    """nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits lines -> medians of the settled
    part (the last two thirds): {"sm_clock_mhz", "power_w", "temperature_c", "throttle"}."""
    rows = [[f.strip() for f in line.split(",")] for line in text.strip().splitlines() if line.strip()]
    rows = [r for r in rows if len(r) == 4]
    if not rows:
        raise RuntimeError("nvidia-smi returned no samples")
    settled = rows[len(rows) // 3:]
    return {"sm_clock_mhz": statistics.median(float(r[0]) for r in settled),
            "power_w": statistics.median(float(r[1]) for r in settled),
            "temperature_c": statistics.median(float(r[2]) for r in settled),
            "throttle": sorted({r[3] for r in settled})}


def sustained(fn, seconds: float) -> dict:
    """Calls fn back to back for `seconds` (synchronizing every 10 calls, so the launch queue stays
    short) while nvidia-smi samples; the mean device microseconds per call and parse_samples' fields."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                            "-lms", str(SAMPLE_MS), "-i", str(torch.cuda.current_device())],
                           stdout=subprocess.PIPE, text=True)
    try:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls = 0
        t0 = time.perf_counter()
        start.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
    finally:
        smi.terminate()
    out, _ = smi.communicate()
    return {"us": start.elapsed_time(end) * 1e3 / calls, "calls": calls, **parse_samples(out)}


def cooled(fn, idle_ms: float, reps: int = 30) -> float:
    """The median device microseconds of fn over reps calls, each after idle_ms of an idle GPU."""
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        torch.cuda.synchronize()
        time.sleep(idle_ms / 1e3)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def eager_kernel_sum(fn, reps: int = 20) -> float:
    """The summed device microseconds of fn's kernels per call, launched in plain stream order."""
    pdl, ops.PROGRAMMATIC_LAUNCH = ops.PROGRAMMATIC_LAUNCH, False
    try:
        return sum(kernel_times(fn, reps).values())
    finally:
        ops.PROGRAMMATIC_LAUNCH = pdl


def run(args):
    seconds, rows = args.seconds, []
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    s = sustained(lambda: a @ a, seconds)
    rows.append({"impl": "matmul_bf16_8192", **s, "tflops": 2 * 8192 ** 3 / s["us"] / 1e6})
    del a
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    s = sustained(lambda: dst.copy_(src), seconds)
    rows.append({"impl": "copy_1GB", **s, "tbps": 2 * src.numel() / s["us"] / 1e6})
    del src, dst
    floors = measure_floors(Timer(20))
    for name in args.configs.split(","):
        E, H, I, k = CONFIGS[name]
        experts = random_experts(E, H, I, gen)
        for M in (int(m) for m in args.ms.split(",")):
            x, weights, ids = random_batch(M, E, H, k, gen)
            out = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
            graph = graph_of(lambda: mc.fused_moe(x, experts, weights, ids, out=out))
            s = sustained(graph.replay, seconds)
            floor = floor_us(M, E, H, I, k, ids, floors)
            row = {"impl": "moe_cutlass", "config": name, "M": M, **s, "floor_us": floor, "x_floor": s["us"] / floor,
                   "kernel_sum_us": eager_kernel_sum(lambda: mc.fused_moe(x, experts, weights, ids, out=out))}
            if args.cool_ms:
                row["cool_us"] = cooled(graph.replay, args.cool_ms)
            rows.append(row)
            cool = f"  cool x{row['cool_us'] / floor:5.2f}" if args.cool_ms else ""
            print(f"{name:14s} M={M:6d} {s['us']:9.1f} us  x{s['us'] / floor:5.2f}{cool}  kernels "
                  f"x{row['kernel_sum_us'] / floor:5.2f}  {s['sm_clock_mhz']:6.0f} MHz {s['power_w']:6.1f} W  "
                  f"{' '.join(s['throttle'])}", flush=True)
        del experts
        torch.cuda.empty_cache()
    return {"floors": floors, "seconds": seconds, "cool_ms": args.cool_ms, "rows": rows}, 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default="64,256,1024,4096,16384")
    parser.add_argument("--seconds", type=float, default=2.5)
    parser.add_argument("--cool-ms", type=float, default=20.0, help="idle before each cool replay (0: none)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    if args.cool_ms < 0:
        parser.error("--cool-ms must not be negative")
    return args


def main(argv=None):
    return record_main("power", parse_args, run, argv)


if __name__ == "__main__":
    main()
