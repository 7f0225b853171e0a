"""ExpertParallel and TensorParallel over a real process group on the CPU: two processes, the gloo
backend, the float32 reference as each rank's experts (as MoELayer runs on the CPU). Checks the
collectives between the pure pieces, and that a configuration error on one rank is raised on both
without a hang. The same over NCCL on two GPUs: test_parallel_nccl.py."""
import datetime
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_cutlass as mc
from moe_cutlass import parallel as par
from tests.helpers import random_experts, random_hidden, random_routing, relerr

E, H, I, K, W = 8, 64, 96, 3, 2
OPTIONS = dict(activation="swiglu_oai", swiglu_limit=7.0, routed_scaling_factor=1.5)
TIMEOUT_S = 60


def _errors(make):
    """The error make() raised, as (type name, message), or None."""
    try:
        make()
    except Exception as exc:  # noqa: BLE001 -- the parent checks the kind
        return type(exc).__name__, str(exc)
    return None


def _forwards(rank, experts):
    """relerr against the reference of every strategy and mode, and of TP; rank 1 brings no token."""
    placement = par.Placement.round_robin(E, W)
    local = placement.local_experts(experts, rank)
    gen = torch.Generator().manual_seed(10 + rank)
    M = (13, 0)[rank]
    x = random_hidden(M, H, gen)
    weights, ids = random_routing(M, E, K, gen)
    ref = mc.reference.fused_moe(x, experts, weights, ids, **OPTIONS)
    errors = {}
    for strategy in par.STRATEGIES:
        for exact in (False, True):
            layer = par.ExpertParallel(local, K, placement, strategy=strategy, exact=exact,
                                       max_tokens=None if strategy == "alltoall" else 13, **OPTIONS)
            out = layer(x, weights, ids)
            errors[strategy, exact] = relerr(out, ref) if M else float(out.numel())
    gen = torch.Generator().manual_seed(20)  # the same tokens on both ranks
    x = random_hidden(17, H, gen)
    weights, ids = random_routing(17, E, K, gen)
    tp = par.TensorParallel(par.tp_shard(experts, (rank, W)), **OPTIONS)
    errors["tp"] = relerr(tp(x, weights, ids), mc.reference.fused_moe(x, experts, weights, ids, **OPTIONS))
    return errors


def _bad_configurations(rank, experts):
    """Each bad configuration is bad on one rank only; both ranks must raise."""
    placement = par.Placement.linear(E, W)
    local = placement.local_experts(experts, rank)
    own_map = placement.expert_map(rank)
    short_map = own_map[:-1] if rank == 1 else own_map
    return {
        "world size does not divide E": _errors(lambda: par.Placement.linear(E - 1, W)),
        "map of the wrong length": _errors(
            lambda: par.ExpertParallel(local, K, expert_map=short_map, strategy="alltoall")),
        "map against the placement": _errors(
            lambda: par.ExpertParallel(local, K, placement, expert_map=own_map.flip(0) if rank else own_map,
                                       strategy="alltoall")),
        "experts count": _errors(
            lambda: par.ExpertParallel(experts if rank else local, K, placement, strategy="alltoall")),
        "settings differ": _errors(
            lambda: par.ExpertParallel(local, K, placement, strategy="alltoall", exact=rank == 1)),
        # the group still works after the errors: the maps of both ranks make the placement
        "good after bad": _errors(
            lambda: par.ExpertParallel(local, K, expert_map=own_map, strategy="alltoall")(
                random_hidden(3, H, torch.Generator().manual_seed(1)), torch.rand(3, K),
                torch.randint(0, E, (3, K))))
    }


def _rank_main(rank, store_path, results):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=W,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        experts = random_experts(E, H, I, torch.Generator().manual_seed(0), bias=True)
        results.put((rank, _forwards(rank, experts), _bad_configurations(rank, experts)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- reported to the parent, which fails the test
        results.put((rank, traceback.format_exc(), None))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    context = mp.get_context("spawn")
    results = context.Queue()
    store = tmp_path_factory.mktemp("gloo") / "store"
    processes = [context.Process(target=_rank_main, args=(rank, str(store), results)) for rank in range(W)]
    for p in processes:
        p.start()
    try:
        got = dict((rank, (forwards, bad)) for rank, forwards, bad in
                   (results.get(timeout=2 * TIMEOUT_S) for _ in range(W)))
    finally:
        for p in processes:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
    for rank, (forwards, bad) in got.items():
        assert bad is not None, f"rank {rank} failed:\n{forwards}"
    return got


@pytest.mark.parametrize("case", [(s, e) for s in par.STRATEGIES for e in (False, True)] + ["tp"])
def test_forward_over_gloo_matches_the_reference(ranks, case):
    rank0, rank1 = ranks[0][0][case], ranks[1][0][case]
    assert rank0 < 1e-2
    assert rank1 < 1e-2 if case == "tp" else rank1 == 0  # EP: rank 1 brings no token, its output is empty


@pytest.mark.parametrize("case, error, words", [
    ("world size does not divide E", "ValueError", "world_size: 2 ranks do not divide num_experts=7"),
    ("map of the wrong length", "ValueError", "expert_map"),
    ("map against the placement", "ValueError", "expert_map: does not map the experts"),
    ("experts count", "ValueError", "experts: holds 8 experts"),
    ("settings differ", "ValueError", "exact: must be the same on every rank"),
])
def test_a_bad_configuration_on_one_rank_raises_on_both(ranks, case, error, words):
    for rank in range(W):
        got = ranks[rank][1][case]
        assert got is not None and got[0] == error and words in got[1], (rank, got)


def test_the_group_works_after_the_errors(ranks):
    assert ranks[0][1]["good after bad"] is None and ranks[1][1]["good after bad"] is None
