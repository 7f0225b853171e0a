"""benchmarks/routings.py: the synthetic top-k routings; benchmarks/peers_skewed.py, the anchors' peer benchmark under them."""
import json

import pytest
import torch

from benchmarks import peers_skewed, routings
from benchmarks.bench_moe import CONFIGS


@pytest.mark.parametrize("routing", routings.ROUTINGS)
def test_routings_give_k_distinct_experts_per_token(routing):
    E, k, M = 128, 8, 1000
    ids = routings.route(routing, M, E, k, torch.Generator().manual_seed(3))
    assert ids.shape == (M, k) and int(ids.min()) >= 0 and int(ids.max()) < E
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()


@pytest.mark.parametrize("routing", ["dirichlet", "zipf"])
def test_skewed_routings_load_the_busiest_expert_more(routing):
    E, _, _, k = CONFIGS["gpt-oss-120b"]
    busiest = {}
    for kind in ("uniform", routing):
        ids = routings.route(kind, 4096, E, k, torch.Generator().manual_seed(0))
        busiest[kind] = int(routings.rows_per_expert(ids, E).max())
    assert busiest[routing] > 3 * busiest["uniform"]


def test_dirichlet_is_seeded_by_the_generator_alone():
    before = torch.random.get_rng_state()
    draws = [routings.route("dirichlet", 64, 128, 4, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(torch.random.get_rng_state(), before)


def test_peers_skewed_runs_the_anchor_bench_with_its_routing(tmp_path):
    """peers_skewed swaps the anchors' route and M list and tags the result; a stand-in peers_bench.py
    records what its main() drew (the real one needs the GPU and the peers)."""
    fake = tmp_path / "peers_bench.py"
    fake.write_text(
        "import json, sys\n"
        "import torch\n"
        "CONFIGS = {'dsv3': (256, 7168, 2048, 8)}\n"
        "MS = [1, 4]\n"
        "def route(M, E, topk, g):\n"
        "    raise AssertionError('the uniform route ran')\n"
        "def main():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    rows = []\n"
        "    for M in MS:\n"
        "        tw, ti = route(M, 256, 8, g)\n"
        "        rows.append({'M': M, 'busiest': int(torch.bincount(ti.flatten().long()).max()),\n"
        "                     'wsum': float(tw.sum(-1).mean()), 'dtype': str(ti.dtype)})\n"
        "    json.dump({'rows': rows, 'argv': sys.argv[1:]}, open(sys.argv[1], 'w'))\n")
    out = tmp_path / "out.json"
    peers_skewed.main([str(fake), str(out), "dsv3", "--routing", "zipf", "--ms", "2048,4096"])
    result = json.loads(out.read_text())
    assert result["routing"] == "zipf" and result["zipf_exponent"] == routings.ZIPF_EXPONENT
    assert [r["M"] for r in result["rows"]] == [2048, 4096] and result["argv"] == [str(out), "dsv3"]
    assert all(r["dtype"] == "torch.int32" and r["wsum"] == pytest.approx(1.0) for r in result["rows"])
    assert result["rows"][1]["busiest"] > 3 * 4096 * 8 / 256   # Zipf: far above the uniform mean
    with pytest.raises(SystemExit):
        peers_skewed.main([str(fake), str(out), "qwen9", "--routing", "zipf"])
