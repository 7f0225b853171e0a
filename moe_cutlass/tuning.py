"""Opt-in tile autotuning: time every built GEMM tile for one layer shape and keep the fastest per batch size.

fused_moe picks its GEMM tiles by a rule measured on an H200 under uniform random routing
(`_gemm.plan`, from the average rows per expert: one tile, or parts among which the device
places each expert's rows). A different GPU, a shape far from the
measured ones, or a skewed routing can prefer another tile (benchmarks/NOTES.md: a tile sized for
the mean re-streams the busy experts' weights), and a layer of few experts the rule's parts with GEMM2 on
128-row tiles (more tiles per launch: mixtral-8x7b -3.6..-8.4% at M = 16-1024, NOTES.md (40)). `autotune`
measures instead:

    table = moe_cutlass.tuning.autotune(experts, top_k=4, num_tokens=(1, 16, 256, 4096))
    moe_cutlass.tuning.save("tiles.json", [table])     # once
    moe_cutlass.tuning.load("tiles.json")               # at start-up: fused_moe now uses it

A table is keyed by the device name and (E, H, I, top_k); a call of M tokens takes the choice of
the tuned batch size nearest M on a log scale. Calls that take the one-launch layer (up to four tokens,
ops.uses_fused) use no GEMM tile and are unaffected. Tuning runs the layer eagerly and synchronizes, so it
refuses to run while a CUDA graph is being captured; calls with batch_invariant=True keep their own
tiles. `clear()` returns to the built-in rule.
"""
import json
import statistics
from pathlib import Path

import torch

from . import _gemm
from ._device import device_index, device_info
from .layer import fused_moe

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
FORMAT = 1


def candidates() -> list:
    """(GEMM1 config, GEMM2 config) pairs of every token tile the built library holds for both GEMMs,
    (PLAN, PLAN): the built-in rule, _gemm.plan, and (PLAN, PLAN_SHORT): the rule with GEMM2 on 128-row tiles."""
    gemm2 = set(_gemm.configs_of(2))
    return [(c1, c1.replace("moe_gemm1_", "moe_gemm2_", 1)) for c1 in sorted(_gemm.configs_of(1))
            if c1.replace("moe_gemm1_", "moe_gemm2_", 1) in gemm2] + [(_gemm.PLAN, _gemm.PLAN),
                                                                       (_gemm.PLAN, _gemm.PLAN_SHORT)]


def key(pair) -> str:
    """A candidate's name in autotune's "us": its GEMM1 config or PLAN, "plan/plan-128rows" for (PLAN, PLAN_SHORT)."""
    return pair[0] if pair[0] not in _gemm.PLANS or pair[1] == pair[0] else f"{pair[0]}/{pair[1]}"


def _routing(M, E, k, gen, device):
    """k distinct experts per token from uniform scores, softmax weights (the benchmarks' routing)."""
    ids = torch.rand(M, E, device=device, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    return torch.rand(M, k, device=device, generator=gen).softmax(dim=1), ids


def _checked_routing(routing, M, E, k, gen, device):
    """A caller's routing(M, gen) -> (topk_weights, topk_ids), checked: a wrong draw would tune the tiles for
    another batch than the layer will see, or fail inside the timed calls."""
    try:
        weights, ids = routing(M, gen)
    except Exception as e:
        raise ValueError(f"routing: calling it with ({M}, generator) failed: {e!r}") from e
    for name, t, dtypes in (("topk_weights", weights, (torch.float32,)), ("topk_ids", ids, (torch.int32, torch.int64))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (M, k) or t.dtype not in dtypes or t.device != device:
            got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"routing: its {name} must be a [{M}, {k}] {' or '.join(map(str, dtypes))} tensor on "
                             f"{device}, got {got}")
    if int(ids.min()) < 0 or int(ids.max()) >= E:   # tuning synchronizes anyway
        raise ValueError(f"routing: its topk_ids must lie in [0, {E}), got [{int(ids.min())}, {int(ids.max())}]")
    return weights, ids


# Device cycles the GPU sleeps before each timed call, while the host enqueues it: the events then
# time the call's kernels, not its host time (~12 us eager at M = 1 on the H200 machines).
_SLEEP_CYCLES = 200_000


def _time_interleaved(fns, reps) -> list:
    """Median device microseconds of each fn(r) (r < reps * len(fns): the routing it runs), the candidates interleaved call by call (in an order
    rotated per repetition) so that a drift of the GPU's clocks during tuning (a long run heats it)
    reaches every candidate alike; timing them one after another favoured the first ones by up to 10%
    (benchmarks/NOTES.md)."""
    for fn in fns:
        fn(0)
    events = []
    for i in range(reps):
        for k in range(len(fns)):
            j = (i + k) % len(fns)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(_SLEEP_CYCLES)
            start.record()
            fns[j](i * len(fns) + j)   # a routing of its own: no candidate finds another's weights in L2
            stop.record()
            events.append((j, start, stop))
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for j, start, stop in events:
        times[j].append(start.elapsed_time(stop) * 1000.0)
    return [statistics.median(t) for t in times]


def autotune(experts, top_k: int, num_tokens=DEFAULT_TOKENS, reps: int = 20, seed: int = 0, install: bool = True,
             routing=None) -> dict:
    """Times every candidate tile pair for each batch size in num_tokens on experts' GPU (device
    time, median of reps, the candidates interleaved; each repetition on a fresh random routing, so
    the weights do not sit in L2) and returns the table
    {"device", "E", "H", "I", "top_k", "choices": {M: [gemm1, gemm2]}, "us": {M: {key(candidate): us}}, "routing"};
    with install=True fused_moe uses it from now on. routing: None for uniform random scores (the
    benchmarks' routing), or a callable (num_tokens, generator) -> (topk_weights float32, topk_ids int32 / int64),
    both [num_tokens, top_k] on the experts' device, drawing the batches to tune on (say, from the model's own
    router statistics: busy experts change which tiles pay, benchmarks/NOTES.md (39)); the table's "routing"
    says "uniform" or "caller"."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("autotune: cannot run while a CUDA graph is being captured (it times eager calls "
                           "and synchronizes); tune before capturing")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
    ms = sorted({int(m) for m in num_tokens})
    if not ms or ms[0] < 1:
        raise ValueError(f"num_tokens: expected batch sizes >= 1, got {num_tokens!r}")
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps: expected an int >= 1, got {reps!r}")
    if routing is not None and not callable(routing):
        raise ValueError(f"routing: expected None or a callable (num_tokens, generator) -> (topk_weights, topk_ids), "
                         f"got {type(routing).__name__}")
    device = experts.device
    name = device_info(device_index(device)).name
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    pairs = candidates()
    choices, times = {}, {}
    saved = _gemm._TUNED.get((name, E, H, I, top_k))
    try:
        for M in ms:
            x = torch.randn(M, H, device=device, generator=gen).to(torch.bfloat16)
            routings = [_routing(M, E, top_k, gen, device) if routing is None else
                        _checked_routing(routing, M, E, top_k, gen, device) for _ in range(reps * len(pairs))]
            out = torch.empty(M, H, dtype=torch.bfloat16, device=device)
            def call(pair):
                def run(i):
                    _gemm.set_tuned(name, E, H, I, top_k, {M: pair})   # force this pair for the timing
                    fused_moe(x, experts, *routings[i], out=out)
                return run

            times[M] = dict(zip(map(key, pairs), _time_interleaved([call(p) for p in pairs], reps)))
            best = min(pairs, key=lambda p: times[M][key(p)])
            choices[M] = list(best)
    finally:
        _gemm._TUNED.pop((name, E, H, I, top_k), None)
        if saved is not None:
            _gemm._TUNED[(name, E, H, I, top_k)] = saved
    table = {"device": name, "E": E, "H": H, "I": I, "top_k": top_k, "choices": choices, "us": times,
             "routing": "uniform" if routing is None else "caller"}
    if install:
        use(table)
    return table


def use(table: dict) -> None:
    """Makes fused_moe take `table`'s tiles for its device name and shape (replacing an earlier table
    of the same key)."""
    _check_table(table, "table")
    _gemm.set_tuned(table["device"], table["E"], table["H"], table["I"], table["top_k"],
                    {int(m): tuple(pair) for m, pair in table["choices"].items()})


def clear() -> None:
    """Back to the built-in tile rule for every shape."""
    _gemm.clear_tuned()


def save(path, tables) -> None:
    """Writes tables (from autotune) as JSON."""
    tables = list(tables)
    for i, table in enumerate(tables):
        _check_table(table, f"tables[{i}]")
    Path(path).write_text(json.dumps({"format": FORMAT, "tables": tables}, indent=1, sort_keys=True))


def load(path, install: bool = True) -> list:
    """Reads tables written by save (and with install=True uses them); a file that is not such a
    table, or names a tile this library does not hold, is a ValueError naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a moe_cutlass tuning file ({e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("tables"), list):
        raise ValueError(f"{path}: not a moe_cutlass tuning file of format {FORMAT} "
                         f"(expected {{'format': {FORMAT}, 'tables': [...]}})")
    for i, table in enumerate(data["tables"]):
        _check_table(table, f"{path}: tables[{i}]")
    if install:
        for table in data["tables"]:
            use(table)
    return data["tables"]


def _check_table(table, where) -> None:
    keys = ("device", "E", "H", "I", "top_k", "choices")
    if not isinstance(table, dict) or any(k not in table for k in keys):
        raise ValueError(f"{where}: expected a dict with keys {', '.join(keys)}")
    if not isinstance(table["device"], str) or any(
            not isinstance(table[k], int) or isinstance(table[k], bool) or table[k] < 1 for k in keys[1:5]):
        raise ValueError(f"{where}: device must be a str and E, H, I, top_k ints >= 1")
    choices = table["choices"]
    if not isinstance(choices, dict) or not choices:
        raise ValueError(f"{where}: choices must map batch sizes to [gemm1 config, gemm2 config]")
    built = {1: set(_gemm.configs_of(1)), 2: set(_gemm.configs_of(2))}
    for m, pair in choices.items():
        try:
            ok = int(m) >= 1 and str(int(m)) == str(m).strip()
        except (TypeError, ValueError):
            ok = False
        if not ok or not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"{where}: choices[{m!r}] must be a batch size >= 1 -> [gemm1 config, gemm2 config]")
        if (pair[0] in _gemm.PLANS) != (pair[1] in _gemm.PLANS):
            raise ValueError(f"{where}: choices[{m!r}] = {list(pair)!r} mixes a config with a plan: two configs, or "
                             f"two of {list(_gemm.PLANS)}")
        for kind, config in zip((1, 2), pair):
            if config not in built[kind] and config not in _gemm.PLANS:
                raise ValueError(f"{where}: choices[{m!r}] names {config!r}, not a GEMM{kind} config of the built "
                                 f"library ({', '.join(sorted(built[kind]))}) or one of {list(_gemm.PLANS)}")
