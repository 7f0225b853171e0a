"""Soak: back-to-back fused_moe calls of mixed M, eager and CUDA-graph replay (issue 10, reliability).

usage: python -m benchmarks.soak [--calls 100000] [--window 1000] [--seed 0] [--max-time-growth 1.2] [--out-dir DIR]

Two small layers (LAYERS: gpt-oss-like with biases, swiglu_oai and a limit; qwen-like with int64 ids
and a routed scaling factor) each get a pool of inputs of mixed M: decode and prefill sizes and both
sides of every M where the GEMM tile or the routing kernels' path changes. For every entry the
float32 reference and a first eager output are computed, and every way of calling it (MODES) is run
once and must give that output bitwise: eager with the cached workspace (allocating the output or
into out=), eager with a caller workspace, eager on a side stream, and the replay of a CUDA graph
captured once per entry on its own static tensors (with the capture stream's cached workspace, sized
for the largest M first, or with the caller workspace).

Then --calls calls back to back: eager and graph modes alternate, entries at random. Nothing
synchronizes inside a window of --window calls; at its end the run synchronizes, checks the window's
last output (bitwise equal to the entry's first output, relative error against the reference below
1e-2; the checked calls cycle through MODES) and reads the time per call and the GPU memory.

The run fails (exit 1, "failed" > 0 in the record) on a failed check, or when, after the first
WARMUP_WINDOWS windows (the allocator and the launch caches settle):
- torch.cuda.memory_allocated grows by more than ALLOCATED_SLACK, or memory_reserved by more than
  RESERVED_SLACK (one large-pool segment of the caching allocator), over their values at the end of
  warm-up: the loop keeps nothing from one call to the next, so growth is a leak;
- the time per call relative to the host's own speed grows by more than --max-time-growth (1.2:
  20%) from the first quarter of the windows (at least TIME_WINDOWS) to the last: each quarter's
  fastest time per call over its fastest probe time (load only adds time to either), as a cost that
  grows with the number of calls (a cache that stops hitting, a list that grows) raises every
  window, the fastest too. The host's speed is timed
  after every window by HOST_PROBE_LAUNCHES launches of a one-element torch add (Python, torch's
  dispatch and a kernel launch, as a call is). On the H200 machines the windows switch between
  about 39 us and 45-70 us per call for 10-35 windows at a time, in and out, with the process's
  CPU time equal to its wall time: a median of the last five windows (the check before
  2026-12-02) failed whenever a run ended in a slow stretch
  (raw/soak_20261202T080854Z_time_growth_check_failed.json), and the fastest window of the last
  quarter without the host probe failed when the last 35 windows were slow
  (raw/soak_20261202T094758Z_time_growth_check_failed.json).
At these sizes a call is host-bound (about 30 us of host time on the H200 machines), so 10^5 calls
take seconds. Writes a "soak" record (benchmarks/record.py).
"""
import argparse
import functools
import random
import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

import moe_cutlass as mc
from benchmarks.fuzz import ROUTING_SMALL_SLOTS
from benchmarks.record import record_main
from moe_cutlass import _gemm
from tests.helpers import MAX_RELERR, StandInExperts, random_experts, random_hidden, random_routing, relerr

MODES = ("eager", "eager_out", "eager_workspace", "eager_side_stream", "graph", "graph_workspace")
GRAPH_MODES = tuple(m for m, name in enumerate(MODES) if name.startswith("graph"))
EAGER_MODES = tuple(m for m in range(len(MODES)) if m not in GRAPH_MODES)
BASE_TOKENS = (1, 2, 3, 7, 16, 64, 200, 1000, 2048, 4200)  # decode, odd and prefill sizes; 4200 is the largest M
WARMUP_WINDOWS = 1
TIME_WINDOWS = 5
HOST_PROBE_LAUNCHES = 200
MAX_TIME_GROWTH = 1.2
ALLOCATED_SLACK = 2 << 20  # a leaked tensor per call is >= 512 bytes: 10^5 of them are 51 MB
RESERVED_SLACK = 20 << 20  # the caching allocator's large segment (kLargeBuffer)


@dataclass(frozen=True)
class Layer:
    E: int
    H: int
    I: int  # noqa: E741 (the design's name)
    top_k: int
    bias: bool
    ids_dtype: torch.dtype
    options: dict


LAYERS = {
    "gpt-oss-like": Layer(32, 512, 256, 4, True, torch.int32, dict(activation="swiglu_oai", swiglu_limit=7.0)),
    "qwen-like": Layer(64, 256, 128, 8, False, torch.int64, dict(routed_scaling_factor=2.5)),
}


def token_pool(E, top_k, largest=BASE_TOKENS[-1]):
    """Mixed M up to `largest`: BASE_TOKENS, and both sides of every M where the GEMM launches change
    (_gemm.plan, by rows per expert) or expand leaves its one-kernel path (M * k > ROUTING_SMALL_SLOTS)."""
    tiles = [_gemm.plan(M * top_k, E) for M in range(largest + 1)]
    edges = {M for M in range(1, largest + 1) if tiles[M] != tiles[M - 1]} | {ROUTING_SMALL_SLOTS // top_k + 1}
    return sorted({*BASE_TOKENS, *edges, *(M - 1 for M in edges)})


def make_schedule(calls, window, entries, seed):
    """Every call's entry * len(MODES) + mode: eager and graph modes alternate, entries at random; the
    last call of window w, the one checked, has mode w % len(MODES), so that the checks visit every mode."""
    rng = random.Random(seed)
    schedule = []
    for i in range(calls):
        if (i + 1) % window == 0:
            mode = (i // window) % len(MODES)
        else:
            mode = rng.choice(GRAPH_MODES if i % 2 else EAGER_MODES)
        schedule.append(rng.randrange(entries) * len(MODES) + mode)
    return schedule


def judge(windows, max_time_growth=MAX_TIME_GROWTH):
    """(summary, failure messages) of the windows' series (dicts with us_per_call, allocated, reserved,
    in order). A run of no more than WARMUP_WINDOWS windows judges its last window against itself."""
    warmup = min(WARMUP_WINDOWS, len(windows) - 1)
    baseline, steady = windows[max(warmup - 1, 0)], windows[warmup:]
    us = [w["us_per_call"] for w in windows]
    span = max(TIME_WINDOWS, len(steady) // 4)

    def fastest(series, key):
        return min(w[key] for w in series[:span]), min(w[key] for w in series[-span:])

    first, last = fastest(steady, "us_per_call")
    summary = {"windows": len(windows), "warmup_windows": warmup,
               "us_per_call": {"first": first, "last": last, "growth": last / first,
                               "statistic": f"fastest of the first and of the last {span} windows after warm-up",
                               "min": min(us), "max": max(us), "median": statistics.median(us)}}
    judged, what = summary["us_per_call"], "time per call (us)"
    if all("host_probe_us" in w for w in steady):
        # Noise only adds time to either, so each quarter's fastest call over its fastest probe.
        probe_first, probe_last = fastest(steady, "host_probe_us")
        first, last = first / probe_first, last / probe_last
        summary["relative_to_host_probe"] = judged = {
            "first": first, "last": last, "growth": last / first,
            "host_probe_us": {"first": probe_first, "last": probe_last, "growth": probe_last / probe_first}}
        what = "time per call over the host probe's launch time"
    judged["allowed"] = max_time_growth
    failures = []
    if judged["last"] > judged["first"] * max_time_growth:
        failures.append(f"{what} grew from {judged['first']:.2f} (fastest of the first {span} windows after "
                        f"warm-up) to {judged['last']:.2f} (fastest of the last {span}): "
                        f"x{judged['last'] / judged['first']:.2f}, allowed x{max_time_growth}")
    for key, slack in (("allocated", ALLOCATED_SLACK), ("reserved", RESERVED_SLACK)):
        values = [w[key] for w in windows]
        growth = max(w[key] for w in steady) - baseline[key]
        summary[key] = {"first": values[0], "warmup_end": baseline[key], "last": values[-1], "min": min(values),
                        "max": max(values), "growth": growth, "allowed": slack}
        if growth > slack:
            failures.append(f"memory_{key} grew by {growth} bytes after warm-up (from {baseline[key]}), "
                            f"allowed {slack}")
    return summary, failures


@dataclass
class Entry:
    """One input of the pool: its tensors, its reference, its first output, and a function per mode."""

    layer: str
    M: int
    inputs: tuple  # (hidden_states, experts, topk_weights, topk_ids)
    options: dict
    reference: torch.Tensor  # float32 [M, H]
    first: torch.Tensor
    calls: list = field(default_factory=list)  # calls[mode]() runs the call that way and returns its output

    def check(self, out):
        """Failure messages for an output of this entry (synchronizes), and its relative error."""
        err = relerr(out, self.reference)
        failures = [] if torch.equal(out, self.first) else ["differs from the first output (bitwise)"]
        if not err < MAX_RELERR:  # also catches NaN
            failures.append(f"relative error {err:.3e} against the reference")
        return [f"{self.layer} M={self.M}: {f}" for f in failures], err


def _capture(call, stream):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    return graph


def _replay(graph, out):
    graph.replay()
    return out


def _on_side_stream(call, side, main, out):
    side.wait_stream(main)  # the inputs and `out` were last touched there
    with torch.cuda.stream(side):
        call(out=out)
    main.wait_stream(side)
    return out


def _mode_calls(entry, workspace, side, capture):
    """One function per mode of MODES, each running the entry's call that way."""
    main = torch.cuda.current_stream()
    call = functools.partial(mc.fused_moe, *entry.inputs, **entry.options)
    outs = {mode: torch.empty_like(entry.first) for mode in MODES[1:]}  # every mode but "eager" writes into out=
    graph = _capture(functools.partial(call, out=outs["graph"]), capture)
    graph_workspace = _capture(functools.partial(call, out=outs["graph_workspace"], workspace=workspace), capture)
    calls = {"eager": call,
             "eager_out": functools.partial(call, out=outs["eager_out"]),
             "eager_workspace": functools.partial(call, out=outs["eager_workspace"], workspace=workspace),
             "eager_side_stream": functools.partial(_on_side_stream, call, side, main, outs["eager_side_stream"]),
             "graph": functools.partial(_replay, graph, outs["graph"]),
             "graph_workspace": functools.partial(_replay, graph_workspace, outs["graph_workspace"])}
    return [calls[mode] for mode in MODES]


def build_entries(seed):
    """The pool of every layer, its graphs captured."""
    main, side, capture = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    entries = []
    for n, (name, layer) in enumerate(LAYERS.items()):
        gen = torch.Generator("cuda").manual_seed(seed * len(LAYERS) + n)
        experts = random_experts(layer.E, layer.H, layer.I, gen, bias=layer.bias)
        dequantized = StandInExperts(*experts.dequantized())  # once, not once per reference call
        pool = token_pool(layer.E, layer.top_k)
        layer_entries = []
        for M in pool:
            weights, ids = random_routing(M, layer.E, layer.top_k, gen)
            inputs = (random_hidden(M, layer.H, gen), experts, weights, ids.to(layer.ids_dtype))
            reference = mc.reference.fused_moe_float(inputs[0], dequantized, *inputs[2:], **layer.options)
            layer_entries.append(Entry(name, M, inputs, layer.options, reference,
                                       mc.fused_moe(*inputs, **layer.options)))
        # The graphs of the "graph" mode use the capture stream's cached workspace: sized for the
        # largest M before the first capture, it never grows (which would free what they captured).
        capture.wait_stream(main)
        with torch.cuda.stream(capture):
            mc.fused_moe(*layer_entries[-1].inputs, **layer.options)
        main.wait_stream(capture)
        workspace = mc.allocate_workspace(pool[-1], layer.top_k, experts)
        for entry in layer_entries:
            entry.calls = _mode_calls(entry, workspace, side, capture)
        entries += layer_entries
    return entries


def soak(entries, schedule, window, log=print):
    """Run the schedule; returns (windows, failures, checked modes, worst relative error)."""
    calls = [call for entry in entries for call in entry.calls]
    windows, failures, checked, worst = [], [], Counter(), 0.0
    probe = torch.zeros(1, device=entries[0].first.device)   # where the calls run
    for start in range(0, len(schedule), window):
        chunk = schedule[start:start + window]
        began = time.perf_counter()
        for index in chunk:
            out = calls[index]()
        torch.cuda.synchronize()
        us_per_call = (time.perf_counter() - began) / len(chunk) * 1e6
        began = time.perf_counter()
        for _ in range(HOST_PROBE_LAUNCHES):
            probe.add_(1)
        torch.cuda.synchronize()
        host_probe_us = (time.perf_counter() - began) / HOST_PROBE_LAUNCHES * 1e6
        entry, mode = divmod(chunk[-1], len(MODES))
        found, err = entries[entry].check(out)
        del out  # before reading the memory: an "eager" output is the only tensor a call leaves
        worst = max(worst, err)
        checked[MODES[mode]] += 1
        failures += [f"call {start + len(chunk) - 1} ({MODES[mode]}): {f}" for f in found]
        windows.append({"us_per_call": round(us_per_call, 3), "host_probe_us": round(host_probe_us, 3),
                        "allocated": torch.cuda.memory_allocated(),
                        "reserved": torch.cuda.memory_reserved(),
                        "host_max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
        if len(windows) % 10 == 0:
            w = windows[-1]
            log(f"{start + len(chunk)} calls: {w['us_per_call']:.1f} us/call, allocated {w['allocated'] >> 20} MiB, "
                f"reserved {w['reserved'] >> 20} MiB, {len(failures)} failed checks", flush=True)
    return windows, failures, checked, worst


def run(args, log=print):
    """Set up, soak and judge; returns (record payload, exit status)."""
    started = time.monotonic()
    entries = build_entries(args.seed)
    failures, worst = [], 0.0
    for entry in entries:  # every mode once: each must give the first output's bits
        for mode, call in zip(MODES, entry.calls):
            found, err = entry.check(call())
            failures += [f"setup ({mode}): {f}" for f in found]
            worst = max(worst, err)
    setup_seconds = time.monotonic() - started
    log(f"{len(entries)} entries x {len(MODES)} modes set up and checked in {setup_seconds:.1f} s", flush=True)
    schedule = make_schedule(args.calls, args.window, len(entries), args.seed)
    windows, soak_failures, checked, soak_worst = soak(entries, schedule, args.window, log)
    summary, flatness = judge(windows, args.max_time_growth)
    failures += soak_failures + flatness
    mc.free_workspaces()  # the side and capture streams' cached workspaces would outlive their streams
    for failure in failures:
        log(f"FAIL {failure}")
    us, rel = summary["us_per_call"], summary["relative_to_host_probe"]
    log(f"{args.calls} calls, {sum(checked.values())} checked, {len(failures)} failed, worst relerr "
        f"{max(worst, soak_worst):.3e}; {us['first']:.1f} -> {us['last']:.1f} us/call (x{rel['growth']:.2f} over the "
        f"host probe, whose launch took {rel['host_probe_us']['first']:.2f} -> {rel['host_probe_us']['last']:.2f} us); allocated growth "
        f"{summary['allocated']['growth']} bytes, reserved growth {summary['reserved']['growth']} bytes")
    payload = {
        "calls": args.calls, "window": args.window, "seed": args.seed, "modes": list(MODES),
        "layers": {name: dict(E=layer.E, H=layer.H, I=layer.I, top_k=layer.top_k, bias=layer.bias,
                              ids_dtype=str(layer.ids_dtype).removeprefix("torch."), **layer.options)
                   for name, layer in LAYERS.items()},
        "tokens": {name: token_pool(layer.E, layer.top_k) for name, layer in LAYERS.items()},
        "setup_checked": len(entries) * len(MODES), "checked": sum(checked.values()), "checked_by_mode": dict(checked),
        "failed": len(failures), "failures": failures[:50],
        "worst_relerr": max(worst, soak_worst), "max_relerr": MAX_RELERR,
        "setup_seconds": round(setup_seconds, 2), "seconds": round(time.monotonic() - started, 2),
        **summary, "series": windows,
    }
    return payload, 1 if failures else 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=1000, help="calls between synchronizations and checks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-time-growth", type=float, default=MAX_TIME_GROWTH,
                        help="allowed ratio of the last windows' time per call to the first windows'")
    parser.add_argument("--out-dir", default=None, help="where the record goes (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.window < 1 or args.calls < args.window or args.calls % args.window:
        parser.error(f"--calls ({args.calls}) must be a positive multiple of --window ({args.window})")
    return args


def main(argv=None):
    return record_main("soak", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
