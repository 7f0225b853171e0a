"""Time moe_cutlass.fused_moe on the DESIGN.md section 5 shapes, as multiples of the floor.

usage: python -m benchmarks.bench_moe [--configs a,b] [--ms 1,4,...] [--reps 100] [--routing uniform] [--out-dir DIR]

The floor of one layer = max(MXFP4 bytes of the active experts' weights (4.25 bits/weight) plus
activations in and out / copy bandwidth, 2*M*k*3*H*I / BF16 matmul rate), both ceilings
measured in this run. Decode-size and prefill-size calls are timed as CUDA-graph replay and
eagerly; the L2 is flushed before every rep; the median of --reps reps is reported. Eager rows
up to HOST_MAX_TOKENS also give the host time of one call ("host_us": a plain call that allocates
its output, "host_us_out": with out=), the Python and launch cost an engine pays per layer.
"""
import argparse
import statistics
import time

import torch

import moe_cutlass as mc
from moe_cutlass import ops
from benchmarks import routings
from benchmarks.record import write_record

CONFIGS = {
    # name: (E, H, I, top_k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "gpt-oss-120b": (128, 2880, 2880, 4),
    "dsv4-flash": (256, 4096, 2048, 6),
    "dsv3": (256, 7168, 2048, 8),
}
# Other public MoE models' expert shapes (config.json: num experts, hidden, moe intermediate, top-k), not
# issue targets: the same layer beside the peers off the four shapes that the plan rule and the tile
# tables were measured on (benchmarks/peers_variants.py --models; --configs takes them too).
MODELS = {
    "gpt-oss-20b": (32, 2880, 2880, 4),
    "qwen3-235b-a22b": (128, 4096, 1536, 8),
    "glm-4.5-air": (128, 4096, 1408, 8),
    "qwen2-57b-a14b": (64, 3584, 2560, 8),
    "kimi-k2": (384, 7168, 2048, 8),
    "llama4-scout": (16, 5120, 8192, 1),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
SHAPES = {**CONFIGS, **MODELS}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
RELERR_MAX_TOKENS = 1024  # the float32 reference is slow past this
HOST_MAX_TOKENS = 64  # host time matters where the GPU time is small: decode
HOST_BURST, HOST_BURSTS = 50, 4


class Timer:
    """Median device time of fn over reps, with the L2 flushed before each rep."""

    def __init__(self, reps, flush_buf=None):
        self.reps = reps
        if flush_buf is None:   # > 60 MB L2; a Timer may share another's
            flush_buf = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        self.flush_buf = flush_buf

    def median_us(self, fn, warmup=10):
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            self.flush_buf.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def host_us(fn):
    """Median host time of one call (time.perf_counter around it) in a tight loop without
    synchronization. Bursts of HOST_BURST calls, with an untimed sync between them, keep the launch
    queue from filling up, which would make a call wait for the GPU and time the GPU instead."""
    fn()
    times = []
    for _ in range(HOST_BURSTS):
        torch.cuda.synchronize()
        for _ in range(HOST_BURST):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def measure_floors(timer):
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_us = timer.median_us(lambda: dst.copy_(src))
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_us = timer.median_us(lambda: m @ m)
    return {"hbm_bytes_per_s": 2 * src.numel() / (copy_us * 1e-6),
            "bf16_flops_per_s": 2 * 8192 ** 3 / (mm_us * 1e-6)}


def random_mxfp4(E, N, K, gen):
    blocks = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda", generator=gen)
    scales = torch.randint(119, 124, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=gen)
    return blocks, scales


def random_routing(M, E, k, gen, routing="uniform"):
    """(weights, int32 ids) of M tokens under `routing` (benchmarks/routings.py; the skewed ones are drawn
    on the CPU from a seed that gen gives)."""
    if routing == "uniform":
        ids = torch.rand(M, E, device="cuda", generator=gen).topk(k, dim=1).indices.to(torch.int32)
    else:
        ids = routings.route_like(routing, M, E, k, gen)
    weights = torch.randn(M, k, device="cuda", generator=gen).softmax(dim=1)
    return weights, ids


def random_experts(E, H, I, gen):
    """PreparedExperts of random MXFP4 weights (no biases) on the GPU."""
    return mc.prepare_experts(*random_mxfp4(E, 2 * I, H, gen), *random_mxfp4(E, H, I, gen))


def random_batch(M, E, H, k, gen, routing="uniform"):
    """(hidden_states, topk_weights, topk_ids) of M tokens under random top-k routing."""
    x = torch.randn(M, H, dtype=torch.bfloat16, device="cuda", generator=gen)
    return (x, *random_routing(M, E, k, gen, routing))


def floor_bytes(M, E, H, I, ids):
    """(GEMM1's weight bytes, GEMM2's, the activations in and out) that the floor counts: the active
    experts' MXFP4 weights at 4.25 bits per weight, the bf16 tokens read and the output written."""
    active = int(torch.unique(ids[(ids >= 0) & (ids < E)]).numel())
    per_weight = 0.5 + 1 / 32
    return active * 2 * H * I * per_weight, active * H * I * per_weight, 2 * M * H * 2


def floor_us(M, E, H, I, k, ids, floors):
    flops = 2.0 * M * k * 3 * H * I
    return max(sum(floor_bytes(M, E, H, I, ids)) / floors["hbm_bytes_per_s"],
               flops / floors["bf16_flops_per_s"]) * 1e6


def relerr_vs_reference(x, experts, weights, ids, out):
    ref = mc.reference.fused_moe_float(x, experts, weights, ids)
    return ((out.float() - ref).norm() / ref.norm()).item()


def graph_of(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def paths_of(M, k, H, I, compare_paths):
    """(path name, (ops.FUSED_MAX_TOKENS, ops.FUSED_MAX_WEIGHTS) for it): the library's
    choice, or with compare_paths both the one-launch layer and the four launches wherever the
    former can take M."""
    if compare_paths and M * k <= ops.fused_max_slots():
        return (("fused", (1 << 30, 1 << 62)), ("launches", (0, 0)))
    path = "fused" if ops.uses_fused(M, k, H, I) else "launches"
    return ((path, (ops.FUSED_MAX_TOKENS, ops.FUSED_MAX_WEIGHTS)),)


def compare_pdl(name, M, run, timer, floor, rounds=3):
    """Graph replay of `run` captured with and without programmatic dependent launches
    (ops.PROGRAMMATIC_LAUNCH), timed in alternating order over `rounds` rounds: the median of each
    variant's per-round medians. Two rows, "pdl" True / False."""
    graphs = {}
    for pdl in (True, False):
        ops.PROGRAMMATIC_LAUNCH = pdl
        graphs[pdl] = graph_of(run)
    ops.PROGRAMMATIC_LAUNCH = True
    times = {pdl: [] for pdl in graphs}
    for r in range(rounds):
        for pdl in (True, False) if r % 2 == 0 else (False, True):
            times[pdl].append(timer.median_us(graphs[pdl].replay))
    rows = []
    for pdl, ts in times.items():
        us = statistics.median(ts)
        rows.append({"impl": "moe_cutlass", "config": name, "M": M, "mode": "graph", "us": us, "floor_us": floor,
                     "x_floor": us / floor, "pdl": pdl, "rounds_us": ts})
        print(f"{name:14s} M={M:6d} pdl={int(pdl)} graph {us:9.1f} us  floor {floor:8.1f} us  x{us / floor:5.2f}  "
              f"rounds {' '.join(f'{t:.1f}' for t in ts)}", flush=True)
    return rows


def bench_config(name, tokens, timer, floors, gen, batch_invariant=False, compare_paths=False, pdl_ab=False,
                 routing="uniform"):
    E, H, I, k = SHAPES[name]
    experts = random_experts(E, H, I, gen)
    rows = []
    defaults = ops.FUSED_MAX_TOKENS, ops.FUSED_MAX_WEIGHTS
    for M, (path, limits) in ((M, p) for M in tokens for p in paths_of(M, k, H, I, compare_paths)):
        ops.FUSED_MAX_TOKENS, ops.FUSED_MAX_WEIGHTS = limits
        x, weights, ids = random_batch(M, E, H, k, gen, routing)
        out = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")

        def run():
            mc.fused_moe(x, experts, weights, ids, out=out, batch_invariant=batch_invariant)

        out.fill_(float("nan"))
        run()
        relerr = relerr_vs_reference(x, experts, weights, ids, out) if M <= RELERR_MAX_TOKENS else None
        floor = floor_us(M, E, H, I, k, ids, floors)
        if pdl_ab:
            rows += compare_pdl(name, M, run, timer, floor)
            continue
        graph = graph_of(run)
        for mode, fn in (("graph", graph.replay), ("eager", run)):
            us = timer.median_us(fn)
            row = {"impl": "moe_cutlass", "config": name, "M": M, "mode": mode, "us": us,
                   "floor_us": floor, "x_floor": us / floor, "relerr": relerr, "batch_invariant": batch_invariant,
                   "path": "launches" if batch_invariant else path}
            if mode == "eager" and M <= HOST_MAX_TOKENS:
                row["host_us"] = host_us(lambda: mc.fused_moe(x, experts, weights, ids))
                row["host_us_out"] = host_us(run)
            rows.append(row)
            host = f"  host {row['host_us']:.1f} us (out= {row['host_us_out']:.1f})" if "host_us" in row else ""
            print(f"{name:14s} M={M:6d} {row['path']:8s} {mode:5s} {us:9.1f} us  floor {floor:8.1f} us  "
                  f"x{us / floor:5.2f}  relerr {relerr if relerr is None else f'{relerr:.1e}'}{host}", flush=True)
        del graph
    ops.FUSED_MAX_TOKENS, ops.FUSED_MAX_WEIGHTS = defaults
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ms", default=",".join(map(str, TOKENS)))
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--batch-invariant", action="store_true", help="time fused_moe(batch_invariant=True)")
    parser.add_argument("--compare-paths", action="store_true",
                        help="time both the one-launch layer and the four launches wherever the former can run")
    parser.add_argument("--compare-pdl", action="store_true",
                        help="graph replay only, with and without programmatic dependent launches, interleaved")
    parser.add_argument("--routing", default="uniform", choices=routings.ROUTINGS,
                        help="the top-k routing of the batches (benchmarks/routings.py)")
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(SHAPES)}")
    tokens = [int(m) for m in args.ms.split(",")]
    timer = Timer(args.reps)
    floors = measure_floors(timer)
    print(f"floors: copy {floors['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 {floors['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    for name in names:
        rows += bench_config(name, tokens, timer, floors, gen, args.batch_invariant, args.compare_paths,
                             args.compare_pdl, args.routing)
        torch.cuda.empty_cache()
    path = write_record("bench", {"floors": floors, "reps": args.reps, "routing": args.routing, "rows": rows},
                        args.out_dir)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
