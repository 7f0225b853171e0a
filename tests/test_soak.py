"""benchmarks/soak.py: the token pools, the schedule, the loop's checks and the flatness judgement on the
CPU; a short soak on the GPU."""
import pytest
import torch

from benchmarks import soak
from benchmarks.fuzz import ROUTING_SMALL_SLOTS
from benchmarks.soak import MODES, judge, make_schedule, token_pool
from moe_cutlass import _gemm

ALLOCATED, RESERVED = 1 << 30, 2 << 30


def windows(us, allocated=(), reserved=()):
    """A series of windows: time per call `us`, memory flat unless given."""
    return [{"us_per_call": t, "allocated": a, "reserved": r}
            for t, a, r in zip(us, list(allocated) or [ALLOCATED] * len(us), list(reserved) or [RESERVED] * len(us))]


@pytest.mark.parametrize("layer", list(soak.LAYERS))
def test_the_pool_spans_every_tile_and_both_routing_paths(layer):
    E, k = soak.LAYERS[layer].E, soak.LAYERS[layer].top_k
    pool = token_pool(E, k)
    assert pool == sorted(set(pool)) and pool[0] == 1 and pool[-1] == soak.BASE_TOKENS[-1]
    tiles = {part[0] for M in pool for part in _gemm.plan(M * k, E).parts}
    assert len(tiles) == 7  # n8, n32 .. n160, and n128 in clusters: every tile the plans use
    for M in range(2, pool[-1] + 1):  # both sides of every change
        if _gemm.plan(M * k, E) != _gemm.plan((M - 1) * k, E):
            assert {M - 1, M} <= set(pool), M
    assert {ROUTING_SMALL_SLOTS // k, ROUTING_SMALL_SLOTS // k + 1} <= set(pool)


def test_the_schedule_alternates_eager_and_graph_and_checks_every_mode():
    schedule = make_schedule(6000, 100, 7, seed=3)
    assert schedule == make_schedule(6000, 100, 7, seed=3) and len(schedule) == 6000
    entries, modes = zip(*(divmod(s, len(MODES)) for s in schedule))
    assert set(entries) == set(range(7))
    checked = modes[99::100]
    assert list(checked) == [w % len(MODES) for w in range(60)]
    unchecked = [m for i, m in enumerate(modes) if (i + 1) % 100]
    graph = [MODES[m].startswith("graph") for m in unchecked]
    assert graph == [i % 2 == 1 for i, m in enumerate(modes) if (i + 1) % 100]
    assert set(unchecked) == set(range(len(MODES)))


def test_a_flat_run_passes():
    summary, failures = judge(windows([30.0, 31.0, 29.5, 30.2, 30.1, 29.9, 30.4, 30.0, 30.3, 35.5]))
    assert failures == []
    assert summary["allocated"]["growth"] == 0 and summary["us_per_call"]["max"] == 35.5


def test_the_warm_up_window_may_be_slow_and_its_end_is_the_memory_baseline():
    summary, failures = judge(windows([90.0] + [30.0] * 9, [ALLOCATED + (50 << 20)] + [ALLOCATED] * 9))
    assert failures == [] and summary["us_per_call"]["first"] == 30.0 and summary["allocated"]["growth"] < 0
    _, failures = judge(windows([30.0] * 10, [ALLOCATED] + [ALLOCATED + (3 << 20)] * 9))
    assert len(failures) == 1 and "memory_allocated grew by 3145728 bytes" in failures[0]


def test_memory_that_grows_after_warm_up_fails():
    allocated = [ALLOCATED + n * (1 << 20) for n in range(10)]  # 1 MiB a window
    _, failures = judge(windows([30.0] * 10, allocated))
    assert len(failures) == 1 and "memory_allocated grew by 9437184 bytes" in failures[0]
    reserved = [RESERVED] * 9 + [RESERVED + (20 << 20) + 1]
    _, failures = judge(windows([30.0] * 10, reserved=reserved))
    assert len(failures) == 1 and "memory_reserved" in failures[0]


def test_time_per_call_that_grows_fails_and_one_slow_window_does_not():
    _, failures = judge(windows([30.0] * 6 + [37.0] * 5))
    assert len(failures) == 1 and "x1.23" in failures[0]
    assert judge(windows([30.0] * 6 + [37.0] * 5), max_time_growth=1.3)[1] == []
    assert judge(windows([30.0] * 10 + [90.0] + [30.0] * 4))[1] == []


def test_runs_of_slow_windows_pass_and_a_cost_that_grows_per_call_fails():
    """The machine's other load comes in runs of slow windows (a run may end the soak); a cost that
    grows with the calls raises every window, the fastest of the last quarter too."""
    regimes = [39.0 + (n % 3) * 0.5 for n in range(100)]
    for start, stop in ((15, 43), (61, 73), (89, 100)):
        regimes[start:stop] = [52.0 + (n % 7) for n in range(stop - start)]
    summary, failures = judge(windows(regimes))
    assert failures == [] and summary["us_per_call"]["growth"] < 1.02
    growing = [39.0 + 0.12 * n for n in range(100)]   # +0.3% of the first a window
    _, failures = judge(windows(growing))
    assert len(failures) == 1 and "fastest of the last 24" in failures[0]


def test_with_the_host_probe_a_slow_host_passes_and_a_slow_call_fails():
    """Windows that are slow because the host is (its probe launches slow too) pass, however long
    the slow stretch; a call that grows against an unchanged probe fails."""
    us = [39.0] * 60 + [48.0] * 40
    slow_host = [dict(w, host_probe_us=4.0 * t / 39.0) for w, t in zip(windows(us), us)]
    summary, failures = judge(slow_host)
    assert failures == [] and summary["us_per_call"]["growth"] > 1.2
    assert abs(summary["relative_to_host_probe"]["growth"] - 1.0) < 1e-9
    slow_call = [dict(w, host_probe_us=4.0) for w in windows(us)]
    summary, failures = judge(slow_call)
    assert len(failures) == 1 and "over the host probe's launch time grew" in failures[0]
    assert summary["relative_to_host_probe"]["host_probe_us"]["growth"] == 1.0


def test_a_run_of_one_window_judges_it_against_itself():
    summary, failures = judge(windows([30.0]))
    assert failures == [] and summary["warmup_windows"] == 0 and summary["us_per_call"]["growth"] == 1.0


def test_the_loop_checks_the_last_call_of_every_window(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: ALLOCATED)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: RESERVED)
    reference = torch.arange(-12.0, 12.0).reshape(3, 8)  # exact in bf16: twice it is off by exactly 1
    first = reference.to(torch.bfloat16)
    entry = soak.Entry("layer", 3, (), {}, reference, first)
    wrong = MODES.index("eager_side_stream")
    entry.calls = [(lambda: first * 2) if mode == wrong else (lambda: first.clone()) for mode in range(len(MODES))]
    series, failures, checked, worst = soak.soak([entry], make_schedule(120, 10, 1, seed=0), 10,
                                                 log=lambda *args, **kwargs: None)
    assert len(series) == 12 and all(w["allocated"] == ALLOCATED for w in series)
    assert checked == {mode: 2 for mode in MODES}
    assert failures == [f"call {c} (eager_side_stream): layer M=3: {what}" for c in (39, 99)
                        for what in ("differs from the first output (bitwise)", "relative error 1.000e+00 against "
                                     "the reference")]
    assert worst == pytest.approx(1.0, rel=1e-2)


@pytest.mark.parametrize("argv", [["--calls", "1500"], ["--calls", "500"], ["--window", "0"]])
def test_calls_must_be_whole_windows(argv):
    with pytest.raises(SystemExit):
        soak.parse_args(argv)


@pytest.mark.gpu
def test_a_short_soak_passes():
    # The time tolerance is loose here: 100-call windows are short enough for the machine's other load
    # to show. The judgement itself is tested above.
    payload, status = soak.run(soak.parse_args(["--calls", "2400", "--window", "100", "--max-time-growth", "2"]),
                               log=lambda *args, **kwargs: None)
    assert status == 0, payload["failures"]
    assert payload["checked"] == 24 and payload["checked_by_mode"] == {mode: 4 for mode in MODES}
    assert payload["failed"] == 0 and payload["worst_relerr"] < payload["max_relerr"]
    assert payload["allocated"]["growth"] <= soak.ALLOCATED_SLACK and len(payload["series"]) == 24
