"""benchmarks/fuzz.py without a GPU: the sampler's ranges, the inputs it builds, the judge, the shrinker."""
import dataclasses
import json
import random

import pytest
import torch

import moe_cutlass as mc
from benchmarks import fuzz
from benchmarks.fuzz import Case, build_inputs, check_case, sample_case, shrink

SMALL = dict(weight_mib=0.25, row_melems=0.05)  # caps that keep the CPU reference quick
SMALL_ARGS = ["--device", "cpu", "--impl", "reference", "--max-weight-mib", "0.25", "--max-row-melems", "0.05"]


@pytest.fixture(scope="module")
def cases():
    rng = random.Random(0)
    return [sample_case(rng) for _ in range(3000)]


def test_sampled_cases_stay_in_range_and_under_the_caps(cases):
    for c in cases:
        assert 1 <= c.E <= 512 and 1 <= c.k <= min(c.E, 16), c
        assert c.H % 32 == 0 and c.I % 32 == 0 and 32 <= min(c.H, c.I) and max(c.H, c.I) <= 8192, c
        assert 0 <= c.M <= 20000, c
        assert c.E * 3 * c.H * c.I / 2 <= fuzz.WEIGHT_MIB * 2**20, c
        assert c.M * c.k * max(c.H, c.I) <= fuzz.ROW_MELEMS * 1e6, c
        assert c.expert_map == 0 or c.expert_map >= c.E, c


def test_sampled_cases_cover_every_option(cases):
    coverage = fuzz._coverage(cases)
    assert all(count >= 10 for count in coverage.values()), coverage
    assert {c.activation for c in cases} == {"silu", "swiglu_oai"}
    assert {c.gate_up for c in cases} == {"concat", "interleaved"}
    assert sum(c.routed_scaling_factor != 1.0 for c in cases) > 100
    assert sum(c.signed_weights for c in cases) > 100
    assert {1, 512} <= {c.E for c in cases}
    assert max(max(c.H, c.I) for c in cases) > 4096


def test_tokens_cluster_at_tile_boundaries(cases):
    near = sum(any(abs(c.M - b) <= 1 for b in fuzz.BOUNDARY_M) for c in cases)
    assert near > len(cases) // 4


def test_sampling_is_seeded():
    assert [sample_case(random.Random(7)) for _ in range(3)] == [sample_case(random.Random(7)) for _ in range(3)]


def test_a_case_reads_back_from_its_repr():
    case = sample_case(random.Random(3))
    assert eval(repr(case), {"Case": Case}) == case


def _tensors_equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[key], b[key]) for key in a)
    return a == b


def test_inputs_are_rebuilt_bitwise_from_the_seed():
    case = Case(seed=5, E=6, k=3, H=64, I=32, M=40, invalid_ids=0.3, dead_rows=0.1, expert_map=9, bias=True)
    first, again = build_inputs(case, "cpu"), build_inputs(case, "cpu")
    for a, b in zip(first, again):
        if isinstance(a, mc.PreparedExperts):
            assert _tensors_equal(a.w13, b.w13) and _tensors_equal(a.w2, b.w2)
        else:
            assert _tensors_equal(a, b)


@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_inputs_hold_invalid_ids_and_dead_tokens(id_dtype):
    case = Case(seed=1, E=8, k=4, H=32, I=32, M=400, id_dtype=id_dtype, invalid_ids=0.3, dead_rows=0.2)
    hidden, experts, weights, ids, kwargs, dead = build_inputs(case, "cpu")
    assert hidden.shape == (400, 32) and hidden.dtype == torch.bfloat16
    assert ids.dtype == getattr(torch, id_dtype) and weights.dtype == torch.float32
    assert experts.num_experts == 8 and "expert_map" not in kwargs
    assert (ids < 0).any() and (ids >= 8).any()
    assert (ids == torch.iinfo(ids.dtype).min).any() and (ids == torch.iinfo(ids.dtype).max).any()
    assert 40 < int(dead.sum()) < 160
    assert ((ids[dead] < 0) | (ids[dead] >= 8)).all()


def test_inputs_route_through_an_expert_map():
    case = Case(seed=2, E=4, k=3, H=32, I=32, M=300, expert_map=10)
    _, _, _, ids, kwargs, dead = build_inputs(case, "cpu")
    expert_map = kwargs["expert_map"]
    assert expert_map.dtype == torch.int32 and expert_map.shape == (10,)
    assert sorted(expert_map[expert_map >= 0].tolist()) == [0, 1, 2, 3]
    assert ids.max() >= 4  # global ids beyond the local count
    local = expert_map[ids.long()]
    assert torch.equal(dead, (local < 0).all(dim=1))
    assert dead.any()


def test_distinct_ids_unless_duplicates_are_asked_for():
    distinct = build_inputs(Case(seed=3, E=5, k=5, H=32, I=32, M=50), "cpu")[3]
    assert all(len(set(row)) == 5 for row in distinct.tolist())
    duplicated = build_inputs(Case(seed=3, E=5, k=5, H=32, I=32, M=50, duplicate_ids=True), "cpu")[3]
    assert any(len(set(row)) < 5 for row in duplicated.tolist())


def _everything(**changes):
    case = Case(seed=11, E=5, k=3, H=64, I=96, M=300, id_dtype="int64", invalid_ids=0.05, dead_rows=0.1,
                duplicate_ids=True, expert_map=7, activation="swiglu_oai", bias=True, gate_up="interleaved",
                swiglu_limit=7.0, swiglu_alpha=1.5, routed_scaling_factor=2.5, signed_weights=True,
                hidden_scale=4.0, out=True, side_stream=True)
    return dataclasses.replace(case, **changes)


@pytest.mark.parametrize("case", [_everything(), _everything(M=0), _everything(M=1, dead_rows=1.0),
                                  Case(seed=4, E=1, k=1, H=32, I=32, M=3)])
def test_the_reference_passes_its_own_judge(case):
    result = check_case(case, "cpu", mc.reference.fused_moe)
    assert result.ok, result.message
    assert result.relerr < 5e-3


def _shifted(hidden, experts, weights, ids, out=None, **kwargs):
    """A wrong layer: every token gets its neighbour's result."""
    got = mc.reference.fused_moe(hidden, experts, weights, ids, **kwargs).roll(1, dims=0)
    return got if out is None else out.copy_(got)


def _leaky(hidden, experts, weights, ids, out=None, **kwargs):
    """A layer that writes a bias-like constant into every row, tokens without an expert too."""
    got = mc.reference.fused_moe(hidden, experts, weights, ids, **kwargs) + 1e-4
    return got if out is None else out.copy_(got)


def _fresh(hidden, experts, weights, ids, out=None, **kwargs):
    return mc.reference.fused_moe(hidden, experts, weights, ids, **kwargs)  # ignores out=


def _raises(*args, **kwargs):
    raise RuntimeError("kernel failed")


@pytest.mark.parametrize("impl,case,words", [
    (_shifted, Case(seed=6, E=4, k=2, H=64, I=32, M=20), "relative error"),
    (_leaky, Case(seed=6, E=4, k=2, H=64, I=32, M=20, dead_rows=0.5), "without a valid id got a non-zero row"),
    (_fresh, Case(seed=6, E=4, k=2, H=64, I=32, M=20, out=True), "other than out="),
    (_raises, Case(seed=6, E=4, k=2, H=64, I=32, M=20), "RuntimeError: kernel failed"),
])
def test_the_judge_catches_wrong_layers(impl, case, words):
    result = check_case(case, "cpu", impl)
    assert not result.ok and words in result.message


def test_the_judge_samples_rows_of_large_batches_including_the_last():
    def last_row_wrong(hidden, experts, weights, ids, out=None, **kwargs):
        got = mc.reference.fused_moe(hidden, experts, weights, ids, **kwargs)
        got[-1] = float("nan")
        return got

    case = Case(seed=8, E=2, k=1, H=32, I=32, M=fuzz.REF_ROWS * 4)
    assert check_case(case, "cpu", mc.reference.fused_moe).ok
    assert not check_case(case, "cpu", last_row_wrong).ok


def test_shrink_finds_the_smallest_failing_case():
    # A bug that needs H >= 128 and a bias: everything else must shrink away.
    big = _everything(E=40, k=7, H=1024, I=512, M=5000)
    small, runs = shrink(big, lambda c: c.H >= 128 and c.bias)
    assert small == Case(seed=11, E=1, k=1, H=128, I=32, M=1, bias=True)
    assert runs < 100


def test_shrink_keeps_a_case_that_fails_only_as_it_is():
    case = Case(seed=1, E=3, k=2, H=64, I=64, M=9)
    assert shrink(case, lambda c: c == case) == (case, len(list(fuzz._smaller(case))))


def test_shrink_stops_at_its_run_budget():
    calls = []
    shrink(_everything(M=20000), lambda c: calls.append(c) or True, max_runs=5)
    assert len(calls) == 5


def test_cpu_run_writes_a_fuzz_record(tmp_path):
    status = fuzz.main(SMALL_ARGS + ["--configs", "12", "--seed", "3", "--out-dir", str(tmp_path)])
    assert status == 0
    (path,) = tmp_path.glob("fuzz_*.json")
    record = json.loads(path.read_text())
    for key in ("commit", "date", "device", "command"):
        assert record[key]
    assert record["kind"] == "fuzz" and record["configs"] == 12 and record["failed"] == 0
    assert 0 < record["worst_relerr"] < 1e-2 and record["failures"] == []


def test_a_failing_run_records_the_case_and_a_reproducer():
    args = fuzz.parse_args(SMALL_ARGS + ["--configs", "6", "--seed", "1", "--shrink", "1", "--shrink-runs", "30"])
    payload, status = fuzz.run(args, impl=_shifted)
    assert status == 1 and payload["configs"] == 6
    failing = payload["failures"]
    assert 0 < payload["failed"] == len(failing) <= 6
    assert "relative error" in failing[0]["message"]
    assert sum("reproducer" in f for f in failing) == 1  # --shrink 1
    reproducer = eval(failing[0]["reproducer"], {"Case": Case})
    assert isinstance(reproducer, Case) and not check_case(reproducer, "cpu", _shifted).ok
    assert reproducer.M <= Case(**failing[0]["case"]).M


def test_sampler_caps_follow_the_arguments():
    rng = random.Random(2)
    for _ in range(300):
        c = sample_case(rng, **SMALL)
        assert c.E * 3 * c.H * c.I / 2 <= SMALL["weight_mib"] * 2**20
        assert c.M * c.k * max(c.H, c.I) <= SMALL["row_melems"] * 1e6
