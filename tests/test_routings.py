"""benchmarks/routings.py: the synthetic top-k routings."""
import pytest
import torch

from benchmarks import routings
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


def test_batch_like_gives_weights_summing_to_one_beside_the_ids():
    gen = torch.Generator().manual_seed(9)
    weights, ids = routings.batch_like("zipf", 300, 64, 6, gen)
    assert weights.shape == ids.shape == (300, 6) and weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.allclose(weights.sum(-1), torch.ones(300)) and bool((weights > 0).all())
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()
