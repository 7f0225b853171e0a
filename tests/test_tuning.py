"""moe_cutlass.tuning: the tuned-tile table (lookup, files) on the CPU, autotune on the GPU."""
import json

import pytest
import torch

import moe_cutlass as mc
from moe_cutlass import _gemm, ops, tuning
from moe_cutlass._device import device_info
from tests.helpers import assert_close, random_experts, random_hidden, random_routing

FAKE = {1: ("moe_gemm1_m128n8k256_coop", "moe_gemm1_m128n128k128_coop"),
        2: ("moe_gemm2_m128n8k256_coop", "moe_gemm2_m128n128k128_coop")}


@pytest.fixture(autouse=True)
def no_tables():
    tuning.clear()
    yield
    tuning.clear()


@pytest.fixture
def fake_library(monkeypatch):
    """Two built tiles, without a built library."""
    monkeypatch.setattr(_gemm, "configs_of", lambda kind: FAKE[kind])


def pair(tile):
    return [f"moe_gemm1_m128{tile}_coop", f"moe_gemm2_m128{tile}_coop"]


def table(choices, device="GPU X", shape=(8, 256, 128, 2)):
    E, H, I, k = shape
    return {"device": device, "E": E, "H": H, "I": I, "top_k": k, "choices": choices}


def test_a_call_takes_the_tuned_batch_nearest_on_a_log_scale(fake_library):
    tuning.use(table({1: pair("n8k256"), 16: pair("n128k128"), 256: pair("n8k256")}))
    look = lambda M: _gemm.tuned_configs("GPU X", 8, 256, 128, 2, M)  # noqa: E731
    assert look(1) == look(3) == tuple(pair("n8k256"))          # below sqrt(1 * 16) = 4
    assert look(4) == look(63) == tuple(pair("n128k128"))       # [4, sqrt(16 * 256) = 64)
    assert look(64) == look(10 ** 6) == tuple(pair("n8k256"))
    assert _gemm.tuned_configs("GPU Y", 8, 256, 128, 2, 16) is None      # another device
    assert _gemm.tuned_configs("GPU X", 8, 256, 128, 4, 16) is None      # another top_k
    tuning.clear()
    assert look(16) is None


def test_save_and_load_round_trip(fake_library, tmp_path):
    path = tmp_path / "tiles.json"
    tuning.save(path, [table({4: pair("n8k256"), 512: pair("n128k128")}),
                       table({1: pair("n128k128")}, shape=(16, 512, 256, 4))])
    assert json.loads(path.read_text())["format"] == tuning.FORMAT
    loaded = tuning.load(path)
    assert len(loaded) == 2
    assert _gemm.tuned_configs("GPU X", 8, 256, 128, 2, 600) == tuple(pair("n128k128"))
    assert _gemm.tuned_configs("GPU X", 16, 512, 256, 4, 9) == tuple(pair("n128k128"))
    tuning.clear()
    tuning.load(path, install=False)
    assert _gemm.tuned_configs("GPU X", 8, 256, 128, 2, 600) is None


@pytest.mark.parametrize("content, message", [
    ("not json", "not a moe_cutlass tuning file"),
    ('{"format": 99, "tables": []}', "format 1"),
    ('{"format": 1, "tables": [{"device": "GPU X"}]}', "expected a dict with keys"),
    ('{"format": 1, "tables": [{"device": "GPU X", "E": 8, "H": 256, "I": 128, "top_k": 0, "choices": {"1": []}}]}',
     "ints >= 1"),
    ('{"format": 1, "tables": [{"device": "GPU X", "E": 8, "H": 256, "I": 128, "top_k": 2, "choices": {"x": []}}]}',
     "batch size >= 1"),
    ('{"format": 1, "tables": [{"device": "GPU X", "E": 8, "H": 256, "I": 128, "top_k": 2, '
     '"choices": {"4": ["moe_gemm1_m128n16k256_coop", "moe_gemm2_m128n8k256_coop"]}}]}', "not a GEMM1 config"),
])
def test_a_bad_file_is_a_clear_error(fake_library, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        tuning.load(path)
    assert str(path) in str(info.value)
    assert _gemm._TUNED == {}


def test_plan_choices_load_and_a_mixed_pair_is_refused(fake_library, tmp_path):
    path = tmp_path / "tiles.json"
    tuning.save(path, [table({16: [_gemm.PLAN, _gemm.PLAN_SHORT], 256: [_gemm.PLAN, _gemm.PLAN]})])
    tuning.load(path)
    assert _gemm.tuned_configs("GPU X", 8, 256, 128, 2, 16) == (_gemm.PLAN, _gemm.PLAN_SHORT)
    with pytest.raises(ValueError, match="mixes a config with a plan"):
        tuning.use(table({16: [_gemm.PLAN, "moe_gemm2_m128n8k256_coop"]}))
    assert tuning.key((_gemm.PLAN, _gemm.PLAN_SHORT)) == "plan/plan-128rows"
    assert tuning.key(pair("n8k256")) == pair("n8k256")[0]


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ValueError, match="nope.json"):
        tuning.load(tmp_path / "nope.json")


# ---- GPU ----

@pytest.mark.gpu
def test_autotune_picks_a_measured_tile_per_batch_and_the_layer_uses_it():
    gen = torch.Generator("cuda").manual_seed(3)
    E, H, I, k = 16, 256, 128, 4
    experts = random_experts(E, H, I, gen)
    result = tuning.autotune(experts, k, num_tokens=(4, 256), reps=3)
    pairs = tuning.candidates()
    assert set(result["choices"]) == {4, 256}
    for M, choice in result["choices"].items():
        assert tuple(choice) in pairs
        assert set(result["us"][M]) == {tuning.key(p) for p in pairs} and len(result["us"][M]) == len(pairs)
        assert min(result["us"][M].values()) == result["us"][M][tuning.key(choice)]
        assert _gemm.tuned_configs(result["device"], E, H, I, k, M) == tuple(choice)
    for M in (4, 300):
        x = random_hidden(M, H, gen)
        weights, ids = random_routing(M, E, k, gen)
        assert_close(mc.fused_moe(x, experts, weights, ids), mc.reference.fused_moe_float(x, experts, weights, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["n8k256", "n128k128", "plan-128rows"])
def test_a_forced_tile_is_used_and_right(tile, monkeypatch):
    """A table naming a tile far from the rule's pick (the 8-token tile at 1000 tokens, the 128-token
    one at 3), or the rule's plan with GEMM2 on 128-row tiles, is what the layer launches, and still gives
    the reference's result."""
    gen = torch.Generator("cuda").manual_seed(4)
    E, H, I, k = 16, 256, 128, 4
    experts = random_experts(E, H, I, gen)
    name = device_info(torch.cuda.current_device()).name
    choice = [_gemm.PLAN, _gemm.PLAN_SHORT] if tile == _gemm.PLAN_SHORT else pair(tile)
    tuning.use(table({3: choice, 1000: choice}, device=name, shape=(E, H, I, k)))
    ops._gemms.cache_clear()   # the plan is built, not taken from a call before
    looked_up, plans = [], []
    lookup, tuned_plan = _gemm.tuned_configs, _gemm.tuned_plan
    monkeypatch.setattr(_gemm, "tuned_configs", lambda *a: looked_up.append(lookup(*a)) or looked_up[-1])
    monkeypatch.setattr(_gemm, "tuned_plan", lambda *a, **kw: plans.append(tuned_plan(*a, **kw)) or plans[-1])
    for M in (3, 1000):
        looked_up.clear()
        plans.clear()
        x = random_hidden(M, H, gen)
        weights, ids = random_routing(M, E, k, gen)
        assert_close(mc.fused_moe(x, experts, weights, ids), mc.reference.fused_moe_float(x, experts, weights, ids))
        assert looked_up == [tuple(choice)]
        if tile == _gemm.PLAN_SHORT:   # at 1000 tokens the rule's split parts, GEMM2's on 128 rows, GEMM1's as the rule
            rule = _gemm.plan(M * k, E, _gemm.configs_of(1), ks=(H, I))
            assert len(plans) == 1 and [p[0] for p in plans[0].parts] == [p[0] for p in rule.parts]
            assert all(p[1].startswith("moe_gemm2_m128") for p in plans[0].parts)
            assert M == 3 or any(p[1].startswith("moe_gemm2_m192") for p in rule.parts)


@pytest.mark.gpu
def test_autotune_tunes_on_the_callers_routing():
    """A routing callable draws every batch that autotune times (each candidate's each repetition), and the
    table says so; the layer is still right on such a batch."""
    gen = torch.Generator("cuda").manual_seed(6)
    E, H, I, k = 16, 256, 128, 4
    experts = random_experts(E, H, I, gen)
    calls = []

    def hot(M, g):   # every token on experts 0..k-1: a few busy experts, the rest idle
        calls.append(M)
        ids = torch.arange(k, device="cuda", dtype=torch.int32).expand(M, k).contiguous()
        return torch.rand(M, k, device="cuda", generator=g).softmax(dim=1), ids

    result = tuning.autotune(experts, k, num_tokens=(8, 200), reps=2, routing=hot)
    n = 2 * len(tuning.candidates())
    assert result["routing"] == "caller" and calls == [8] * n + [200] * n
    assert tuning.autotune(experts, k, num_tokens=(8,), reps=1, install=False)["routing"] == "uniform"
    x = random_hidden(200, H, gen)
    weights, ids = hot(200, gen)
    assert_close(mc.fused_moe(x, experts, weights, ids), mc.reference.fused_moe_float(x, experts, weights, ids))


def _raises(error):
    raise error


@pytest.mark.gpu
@pytest.mark.parametrize("bad, message", [
    (3, "routing: expected None or a callable"),
    (lambda M, g: _raises(KeyError("boom")), "routing: calling it with"),
    (lambda M, g: (torch.ones(M, 3, device="cuda") / 3, torch.zeros(M, 3, dtype=torch.int32, device="cuda")),
     r"routing: its topk_weights must be a \[4, 2\]"),
    (lambda M, g: (torch.full((M, 2), 0.5), torch.zeros(M, 2, dtype=torch.int32)), "on cuda"),
    (lambda M, g: (torch.full((M, 2), 0.5, device="cuda"), torch.zeros(M, 2, device="cuda")), "topk_ids must be"),
    (lambda M, g: (torch.full((M, 2), 0.5, device="cuda"), torch.full((M, 2), 8, dtype=torch.int32, device="cuda")),
     r"must lie in \[0, 8\)"),
])
def test_a_bad_routing_is_refused_by_name(bad, message):
    gen = torch.Generator("cuda").manual_seed(7)
    experts = random_experts(8, 128, 64, gen)
    with pytest.raises(ValueError, match=message):
        tuning.autotune(experts, 2, num_tokens=(4,), reps=1, routing=bad)
    assert _gemm._TUNED == {}


@pytest.mark.gpu
def test_autotune_refuses_inside_a_graph_capture():
    gen = torch.Generator("cuda").manual_seed(5)
    experts = random_experts(8, 128, 64, gen)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="cannot run while a CUDA graph is being captured"):
                tuning.autotune(experts, 2, num_tokens=(4,), reps=1)
        finally:
            graph.capture_end()  # the capture ends here whatever happened, leaving no stream capturing
    assert not torch.cuda.is_current_stream_capturing()


def test_committed_tuning_records_load_against_the_kernel_table(monkeypatch):
    """Every tuning record under benchmarks/results is a tuning file naming configs of the kernel
    table (codegen/configs.py), checked without a built library."""
    from pathlib import Path

    from codegen.configs import KERNELS
    names = [k.name for k in KERNELS["sm90"]]
    monkeypatch.setattr(_gemm, "configs_of", lambda kind: tuple(n for n in names if n.startswith(f"moe_gemm{kind}_")))
    records = sorted((Path(__file__).resolve().parent.parent / "benchmarks" / "results").glob("tuning_*.json"))
    assert records
    for path in records:
        assert tuning.load(path, install=False)
