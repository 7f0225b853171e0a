"""benchmarks/peers_variants.py: the anchors' peer benchmark under a skewed routing or on more model shapes,
run against a stand-in peers_bench.py that records what its main() drew (the real one needs the GPU and the
peers); benchmarks/peers_record.py keeps what the run says of itself."""
import json

import pytest
import torch

from benchmarks import peers_record, peers_variants, routings
from benchmarks.bench_moe import MODELS

STAND_IN = (
    "import json, sys\n"
    "import torch\n"
    "CONFIGS = {'dsv3': (256, 7168, 2048, 8)}\n"
    "MS = [1, 4]\n"
    "def route(M, E, topk, g):\n"
    "    ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(M)]).int()\n"
    "    return torch.full((M, topk), 1.0 / topk), ids\n"
    "def main():\n"
    "    g = torch.Generator().manual_seed(0)\n"
    "    rows = []\n"
    "    for name in sys.argv[2:]:\n"
    "        E, H, I, topk = CONFIGS[name]\n"
    "        for M in MS:\n"
    "            tw, ti = route(M, E, topk, g)\n"
    "            rows.append({'config': name, 'M': M, 'E': E, 'H': H, 'I': I, 'topk': topk,\n"
    "                         'busiest': int(torch.bincount(ti.flatten().long()).max()),\n"
    "                         'wsum': float(tw.sum(-1).mean()), 'dtype': str(ti.dtype),\n"
    "                         'floor_mxfp4_us': 10.0, 'moe_cutlass_us': 12.0})\n"
    "    json.dump({'device': 'stand-in', 'peers': ['moe_cutlass'], 'hbm_bytes_per_s': 4e12,\n"
    "               'bf16_flops_per_s': 7e14, 'rows': rows, 'argv': sys.argv[1:]}, open(sys.argv[1], 'w'))\n")


@pytest.fixture
def stand_in(tmp_path):
    path = tmp_path / "peers_bench.py"
    path.write_text(STAND_IN)
    return path


def test_a_skewed_routing_replaces_the_anchors_draw(stand_in, tmp_path):
    out = tmp_path / "out.json"
    peers_variants.main([str(stand_in), str(out), "dsv3", "--routing", "zipf", "--ms", "2048,4096"])
    result = json.loads(out.read_text())
    assert result["routing"] == "zipf" and result["zipf_exponent"] == routings.ZIPF_EXPONENT
    assert [r["M"] for r in result["rows"]] == [2048, 4096] and result["argv"] == [str(out), "dsv3"]
    assert all(r["dtype"] == "torch.int32" and r["wsum"] == pytest.approx(1.0) for r in result["rows"])
    assert result["rows"][1]["busiest"] > 3 * 4096 * 8 / 256   # Zipf: far above the uniform mean
    assert "model_shapes" not in result


def test_model_shapes_join_the_anchors_configs_under_their_own_routing(stand_in, tmp_path):
    out = tmp_path / "out.json"
    peers_variants.main([str(stand_in), str(out), "dsv3", "--models", "--ms", "64"])
    result = json.loads(out.read_text())
    assert result["routing"] == "uniform" and "zipf_exponent" not in result
    assert [r["config"] for r in result["rows"]] == ["dsv3", *MODELS]
    for r in result["rows"]:
        if r["config"] in MODELS:
            assert (r["E"], r["H"], r["I"], r["topk"]) == MODELS[r["config"]]
            assert result["model_shapes"][r["config"]]["E"] == r["E"]
        assert r["busiest"] <= 64   # the anchors' draw: k distinct experts per token
    assert set(result["model_shapes"]) == set(MODELS)


def test_unknown_configs_are_refused_by_name(stand_in, tmp_path, capsys):
    with pytest.raises(SystemExit):
        peers_variants.main([str(stand_in), str(tmp_path / "out.json"), "qwen9"])
    assert "qwen9" in capsys.readouterr().err


def test_the_record_keeps_the_runs_routing_and_model_shapes(stand_in, tmp_path, monkeypatch):
    runs = []
    for name, routing in (("kimi-k2", "uniform"), ("mixtral-8x7b", "uniform")):
        out = tmp_path / f"{name}.json"
        peers_variants.main([str(stand_in), str(out), name, "--routing", routing, "--ms", "1"])
        runs.append(str(out))
    monkeypatch.setenv("MOE_CUTLASS_COMMIT", "abc123")
    monkeypatch.setattr("sys.argv", ["peers_record", *runs, "--out-dir", str(tmp_path / "rec")])
    peers_record.main()
    record = json.loads(next((tmp_path / "rec").glob("bench_*.json")).read_text())
    assert record["routing"] == "uniform" and set(record["model_shapes"]) == {"kimi-k2", "mixtral-8x7b"}
    assert {r["config"] for r in record["rows"]} == {"kimi-k2", "mixtral-8x7b"}
    assert torch.tensor([r["x_floor"] for r in record["rows"]]).allclose(torch.tensor(1.2))
