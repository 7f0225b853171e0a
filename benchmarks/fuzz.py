"""Seeded random tester: fused_moe against the float32 reference on random layer configurations.

usage: python -m benchmarks.fuzz [--configs 1000] [--seed 0] [--time-budget S] [--out-dir DIR]
       python -m benchmarks.fuzz --device cpu --impl reference --configs 20   (the harness alone, no GPU)

Each configuration draws E 1..512, k 1..min(E, 16), H and I multiples of 32 up to 8192, M 0..20000
(mostly near tile and routing-path boundaries), int32/int64 ids with negative and too-large ids,
whole tokens of invalid ids, an expert_map, both activations, biases, swiglu_limit and alpha,
routed_scaling_factor, a poisoned `out=`, a side stream. Sizes are capped (weight bytes, rows
times width) so that a configuration takes milliseconds. It passes when the relative Frobenius
error against mc.reference (float32, on up to REF_ROWS sampled tokens) is below 1e-2, the output
is `out` when given, and every token whose ids are all invalid gets exactly zeros.

A failure is shrunk (smaller M, E, k, H, I, options back to defaults, as long as it still fails)
and printed as a `Case(...)` to add to tests/test_fuzz_regressions.py. The run writes a "fuzz"
record (benchmarks/record.py) and exits 1 when any configuration failed.
"""
import argparse
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

import moe_cutlass as mc
from benchmarks.record import record_main
from tests.helpers import MAX_RELERR, StandInExperts, random_experts, random_hidden, relerr

MAX_E, MAX_K, MAX_HI, MAX_M = 512, 16, 8192, 20000
WEIGHT_MIB = 32  # default cap on one configuration's MXFP4 weights
ROW_MELEMS = 4  # default cap on M * k * max(H, I), in millions: the routed rows
REF_ROWS = 256  # tokens compared with the reference (it loops over experts in Python)
ROUTING_SMALL_SLOTS = 16384  # routing.cuh kSmallSlots: M * k past this takes the multi-kernel path
BOUNDARY_M = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PER_EXPERT_BOUNDARIES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # rows per expert where _gemm.plan switches


@dataclass(frozen=True)
class Case:
    """One configuration; with its seed it rebuilds the same tensors on a device."""

    seed: int
    E: int
    k: int
    H: int
    I: int  # noqa: E741 (the design's name)
    M: int
    id_dtype: str = "int32"
    invalid_ids: float = 0.0  # fraction of slots whose id is < 0 or >= the expert count
    dead_rows: float = 0.0  # fraction of tokens whose every id is invalid
    duplicate_ids: bool = False  # ids drawn with replacement: a token may pick an expert twice
    expert_map: int = 0  # global expert count routed through an expert_map, 0 for none
    activation: str = "silu"
    bias: bool = False
    gate_up: str = "concat"
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702
    routed_scaling_factor: float = 1.0
    signed_weights: bool = False
    hidden_scale: float = 1.0
    out: bool = False  # pass a NaN-poisoned out=
    side_stream: bool = False  # launch on a non-default stream (CUDA only)


DEFAULTS = {f.name: f.default for f in dataclasses.fields(Case) if f.default is not dataclasses.MISSING}


def _log_uniform(rng, low, high):
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def _width(rng):
    """H or I: mostly small (fast), sometimes medium, rarely up to 8192; any multiple of 32."""
    r = rng.random()
    top = 512 if r < 0.75 else 2048 if r < 0.95 else MAX_HI
    return 32 * rng.randint(1, top // 32)


def _tokens(rng, E, k):
    r = rng.random()
    if r < 0.1:
        return rng.choice((0, 1, 2))
    if r < 0.45:
        return rng.choice(BOUNDARY_M) + rng.choice((-1, 0, 1))
    if r < 0.65:
        return max(1, round(rng.choice(PER_EXPERT_BOUNDARIES) * E / k) + rng.choice((-1, 0, 1)))
    if r < 0.75:
        return ROUTING_SMALL_SLOTS // k + rng.choice((-1, 0, 1))
    return _log_uniform(rng, 1, MAX_M)


def sample_case(rng, weight_mib=WEIGHT_MIB, row_melems=ROW_MELEMS):
    """A random Case within the caps, from a random.Random."""
    E = rng.choice((1, 2, 511, 512)) if rng.random() < 0.05 else _log_uniform(rng, 1, MAX_E)
    H, I = _width(rng), _width(rng)  # noqa: E741
    while E * 3 * H * I / 2 > weight_mib * 2**20:  # halve the wider side, then E, until the weights fit
        if max(H, I) == 32:
            E = max(1, E // 2)
        elif H >= I:
            H = max(32, H // 64 * 32)
        else:
            I = max(32, I // 64 * 32)  # noqa: E741
    k = rng.randint(1, min(E, MAX_K))
    M = min(MAX_M, _tokens(rng, E, k), int(row_melems * 1e6) // (k * max(H, I)))
    limit = rng.choice((7.0, 10.0, round(rng.uniform(0.5, 20), 3))) if rng.random() < 0.4 else None
    return Case(
        seed=rng.getrandbits(31), E=E, k=k, H=H, I=I, M=max(0, M),
        id_dtype=rng.choice(("int32", "int64")),
        invalid_ids=rng.choice((0.05, 0.3, 1.0)) if rng.random() < 0.3 else 0.0,
        dead_rows=rng.choice((0.1, 0.5, 1.0)) if rng.random() < 0.25 else 0.0,
        duplicate_ids=rng.random() < 0.1,
        expert_map=E + rng.randint(0, E) if rng.random() < 0.25 else 0,
        activation=rng.choice(("silu", "swiglu_oai")),
        bias=rng.random() < 0.4,
        gate_up="interleaved" if rng.random() < 0.3 else "concat",
        swiglu_limit=limit,
        swiglu_alpha=1.702 if rng.random() < 0.8 else round(rng.uniform(0.5, 3.0), 3),
        routed_scaling_factor=1.0 if rng.random() < 0.5 else rng.choice((2.5, 1.5, round(rng.uniform(0.1, 4), 3))),
        signed_weights=rng.random() < 0.1,
        hidden_scale=rng.choice((1.0, 1.0, 4.0, 16.0)),
        out=rng.random() < 0.5,
        side_stream=rng.random() < 0.3,
    )


def _bad_ids(n_ids, dtype):
    """Ids no expert has: negative, just past the end, and the dtype's extremes."""
    info = torch.iinfo(dtype)
    return torch.tensor([-1, -2, info.min, n_ids, n_ids + 1, info.max], dtype=dtype)


def build_inputs(case, device):
    """(hidden, experts, topk_weights, topk_ids, layer kwargs, dead [M] bool) for `case` on `device`."""
    gen = torch.Generator(device).manual_seed(case.seed)
    experts = random_experts(case.E, case.H, case.I, gen, bias=case.bias, gate_up=case.gate_up)
    hidden = random_hidden(case.M, case.H, gen) * case.hidden_scale
    M, k, n_ids = case.M, case.k, case.expert_map or case.E
    dtype = getattr(torch, case.id_dtype)
    if case.duplicate_ids:
        ids = torch.randint(0, n_ids, (M, k), device=device, generator=gen)
    else:
        ids = torch.rand(M, n_ids, device=device, generator=gen).topk(k, dim=1).indices
    ids = ids.to(dtype)
    bad = _bad_ids(n_ids, dtype).to(device)
    pick = torch.randint(0, bad.numel(), (M, k), device=device, generator=gen)
    invalid = torch.rand(M, k, device=device, generator=gen) < case.invalid_ids
    invalid |= (torch.rand(M, device=device, generator=gen) < case.dead_rows).unsqueeze(1)
    ids = torch.where(invalid, bad[pick], ids)
    weights = (torch.randn if case.signed_weights else torch.rand)(M, k, device=device, generator=gen)

    valid = (ids >= 0) & (ids < n_ids)
    kwargs = dict(activation=case.activation, swiglu_limit=case.swiglu_limit, swiglu_alpha=case.swiglu_alpha,
                  routed_scaling_factor=case.routed_scaling_factor)
    if case.expert_map:
        # This rank holds E of the global experts, in a random order; the rest map to -1.
        expert_map = torch.full((n_ids,), -1, dtype=torch.int32, device=device)
        held = torch.randperm(n_ids, device=device, generator=gen)[: case.E]
        expert_map[held] = torch.arange(case.E, dtype=torch.int32, device=device)
        valid &= expert_map[ids.clamp(0, n_ids - 1).long()] >= 0
        kwargs["expert_map"] = expert_map
    return hidden, experts, weights, ids, kwargs, ~valid.any(dim=1)


@dataclass
class Result:
    ok: bool
    relerr: float
    message: str = ""


def check_case(case, device="cuda", impl=None):
    """Run `impl` (default mc.fused_moe) on the case and judge it against the float32 reference."""
    impl = impl or mc.fused_moe
    hidden, experts, weights, ids, kwargs, dead = build_inputs(case, device)
    out = None
    if case.out:
        out = torch.full((case.M, case.H), float("nan"), dtype=torch.bfloat16, device=device)
    use_side = case.side_stream and torch.device(device).type == "cuda"
    try:
        if use_side:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                got = impl(hidden, experts, weights, ids, out=out, **kwargs)
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            got = impl(hidden, experts, weights, ids, out=out, **kwargs)
    except Exception as exc:  # any exception on valid input is a finding
        return Result(False, float("inf"), f"{type(exc).__name__}: {exc}")
    if out is not None and got.data_ptr() != out.data_ptr():
        return Result(False, float("inf"), "returned a tensor other than out=")
    if case.M > REF_ROWS:  # the reference on a sample of tokens, the first and last among them
        picked = torch.randperm(case.M - 2, generator=torch.Generator().manual_seed(case.seed))[: REF_ROWS - 2] + 1
        rows = torch.cat([torch.tensor([0, case.M - 1]), picked]).sort().values.to(device)
    else:
        rows = torch.arange(case.M, device=device)
    # Dequantized once: the reference would unpack every expert it meets again, a hundred launches each.
    dequantized = StandInExperts(*experts.dequantized())
    ref = mc.reference.fused_moe_float(hidden[rows], dequantized, weights[rows], ids[rows], **kwargs)
    err = relerr(got[rows], ref)
    if not err < MAX_RELERR:  # also catches NaN
        return Result(False, err, f"relative error {err:.3e} on {rows.numel()} tokens")
    if dead.any() and (got[dead] != 0).any():
        return Result(False, err, f"{int((got[dead] != 0).any(dim=1).sum())} of {int(dead.sum())} tokens "
                                  f"without a valid id got a non-zero row")
    return Result(True, err)


def _smaller(case):
    """Candidate simplifications of a failing case, most aggressive first."""
    for name, low in (("M", 1), ("E", 1), ("k", 1), ("H", 32), ("I", 32)):
        value = getattr(case, name)
        step = 32 if name in ("H", "I") else 1
        for smaller in (low, value // 2 // step * step, value - step):
            if low <= smaller < value:
                changes = {name: smaller}
                if name == "E":
                    changes["k"] = min(case.k, smaller)
                yield dataclasses.replace(case, **changes)
    for name, default in DEFAULTS.items():
        if getattr(case, name) != default:
            yield dataclasses.replace(case, **{name: default})


def shrink(case, fails, max_runs=100):
    """The smallest case found that still fails (greedy), and how many runs it took."""
    runs, improved = 0, True
    while improved and runs < max_runs:
        improved = False
        for smaller in _smaller(case):
            runs += 1
            if fails(smaller):
                case, improved = smaller, True
                break
            if runs >= max_runs:
                break
    return case, runs


def _impl(name):
    return {"kernel": mc.fused_moe, "reference": mc.reference.fused_moe}[name]


def _coverage(cases):
    counts = {
        "M=0": sum(c.M == 0 for c in cases),
        "M*k>routing small path": sum(c.M * c.k > ROUTING_SMALL_SLOTS for c in cases),
        "E>=256": sum(c.E >= 256 for c in cases),
        "max(H,I)>2048": sum(max(c.H, c.I) > 2048 for c in cases),
        "int64 ids": sum(c.id_dtype == "int64" for c in cases),
        "invalid ids": sum(c.invalid_ids > 0 for c in cases),
        "dead rows": sum(c.dead_rows > 0 for c in cases),
        "duplicate ids": sum(c.duplicate_ids for c in cases),
        "expert_map": sum(c.expert_map > 0 for c in cases),
        "swiglu_oai": sum(c.activation == "swiglu_oai" for c in cases),
        "bias": sum(c.bias for c in cases),
        "swiglu_limit": sum(c.swiglu_limit is not None for c in cases),
        "out=": sum(c.out for c in cases),
        "side stream": sum(c.side_stream for c in cases),
    }
    return counts


def run(args, impl=None):
    """The fuzz loop; returns (record payload, exit status). `impl` overrides --impl (tests)."""
    impl = impl or _impl(args.impl)
    rng = random.Random(args.seed)
    started = time.monotonic()
    cases, failures, worst = [], [], 0.0
    for i in range(args.configs):
        if args.time_budget is not None and time.monotonic() - started > args.time_budget:
            print(f"time budget of {args.time_budget} s reached after {i} configurations")
            break
        case = sample_case(rng, args.max_weight_mib, args.max_row_melems)
        result = check_case(case, args.device, impl)
        cases.append(case)
        if math.isfinite(result.relerr):
            worst = max(worst, result.relerr)
        if not result.ok:
            failures.append({"case": dataclasses.asdict(case), "relerr": result.relerr, "message": result.message})
            print(f"FAIL {case!r}: {result.message}", flush=True)
        if (i + 1) % 100 == 0:
            mc.free_workspaces()  # one cached workspace per layer shape: 1000 shapes would pile up
            print(f"{i + 1} configurations, {len(failures)} failed, worst relerr {worst:.3e}", flush=True)
    seconds = time.monotonic() - started
    for failure in failures[: args.shrink]:
        case = Case(**failure["case"])
        small, runs = shrink(case, lambda c: not check_case(c, args.device, impl).ok, args.shrink_runs)
        failure["reproducer"] = repr(small)
        print(f"reproducer ({runs} runs; add it to REGRESSIONS in tests/test_fuzz_regressions.py):\n  {small!r}")
    if args.device != "cpu":
        torch.cuda.synchronize()
    print(f"{len(cases)} configurations in {seconds:.1f} s, {len(failures)} failed, worst relerr {worst:.3e}")
    payload = {"configs": len(cases), "failed": len(failures), "worst_relerr": worst, "seed": args.seed,
               "impl": args.impl, "seconds": round(seconds, 2), "max_relerr": MAX_RELERR,
               "coverage": _coverage(cases), "failures": failures}
    return payload, 1 if failures else 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=float, default=None,
                        help="stop drawing new configurations after this many seconds")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--impl", choices=("kernel", "reference"), default="kernel",
                        help="'reference': check mc.reference.fused_moe (bf16) instead, e.g. on a CPU")
    parser.add_argument("--max-weight-mib", type=float, default=WEIGHT_MIB)
    parser.add_argument("--max-row-melems", type=float, default=ROW_MELEMS)
    parser.add_argument("--shrink", type=int, default=3, help="shrink this many failures to reproducers")
    parser.add_argument("--shrink-runs", type=int, default=100)
    parser.add_argument("--out-dir", default=None, help="where the record goes (default benchmarks/results)")
    return parser.parse_args(argv)


def main(argv=None):
    return record_main("fuzz", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
