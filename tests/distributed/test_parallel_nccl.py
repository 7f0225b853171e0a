"""ExpertParallel and TensorParallel on two GPUs over NCCL, against the one-GPU layer.

Run by `python -m benchmarks.run_dist_tests`, which starts this file's tests under
`torchrun --nproc-per-node 2` and writes a tests record; under a plain pytest (no WORLD_SIZE=2)
every test here skips. Both ranks run the same tests in the same order, so their collectives pair up.

Every rank also holds all the experts and checks its own tokens against fused_moe on its own GPU:
bitwise in exact mode (both sides batch invariant), relative error < 1e-2 otherwise and for TP.
"""
import os
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import moe_cutlass as mc
from benchmarks.bench_moe import graph_of
from moe_cutlass import parallel as par
from tests.helpers import random_experts, random_hidden, random_routing, relerr

W = 2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("WORLD_SIZE") != str(W),
                       reason="runs under torchrun --nproc-per-node 2: python -m benchmarks.run_dist_tests"),
]

SHAPES = {
    "gpt-oss": dict(E=128, H=2880, I=2880, k=4, bias=True, options=dict(activation="swiglu_oai", swiglu_limit=7.0)),
    "dsv3": dict(E=256, H=7168, I=2048, k=8, bias=False, options=dict(activation="silu", routed_scaling_factor=2.5)),
}
TOKENS = [(1, 1), (64, 64), (4096, 4096), (333, 77)]  # per rank; the last odd and unequal


@pytest.fixture(scope="session")
def rank():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    # The timeout bounds a rank left alone in a collective (the runner also bounds the whole run).
    dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=torch.device("cuda", local))
    yield dist.get_rank()
    dist.destroy_process_group()


@dataclass
class Layer:
    E: int
    H: int
    k: int
    options: dict
    experts: mc.PreparedExperts  # all of them, for the one-GPU layer
    placement: par.Placement
    local: mc.PreparedExperts  # this rank's under the linear placement
    tp: mc.PreparedExperts  # this rank's cut of I


@pytest.fixture(scope="module", params=list(SHAPES))
def layer(request, rank):
    s = SHAPES[request.param]
    experts = random_experts(s["E"], s["H"], s["I"], torch.Generator("cuda").manual_seed(0), bias=s["bias"])
    for t in experts.tensors().values():
        dist.broadcast(t, 0)  # the same weights on both ranks, whatever their generators gave
    placement = par.Placement.linear(s["E"], W)
    return Layer(s["E"], s["H"], s["k"], s["options"], experts, placement, placement.local_experts(experts, rank),
                 par.tp_shard(experts, (rank, W)))


def tokens(layer, M, seed, same_on_every_rank=False):
    gen = torch.Generator("cuda").manual_seed(seed)
    x = random_hidden(M, layer.H, gen)
    weights, ids = random_routing(M, layer.E, layer.k, gen)
    if same_on_every_rank:
        for t in (x, weights, ids):
            dist.broadcast(t, 0)
    return x, weights, ids


def one_gpu(layer, x, weights, ids, batch_invariant):
    return mc.fused_moe(x, layer.experts, weights, ids, batch_invariant=batch_invariant, **layer.options)


def expert_parallel(layer, strategy, exact, max_tokens):
    return par.ExpertParallel(layer.local, layer.k, layer.placement, strategy=strategy, exact=exact,
                              max_tokens=None if strategy == "alltoall" else max_tokens, **layer.options)


def assert_matches(out, ref, exact):
    if exact:
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), f"not bitwise: relerr {relerr(out, ref):.2e}"
    else:
        assert relerr(out, ref) < 1e-2


@pytest.mark.parametrize("exact", [False, True], ids=["approx", "exact"])
@pytest.mark.parametrize("strategy", par.STRATEGIES)
@pytest.mark.parametrize("sizes", TOKENS, ids=[f"M{a}+{b}" for a, b in TOKENS])
def test_ep_matches_one_gpu(layer, rank, sizes, strategy, exact):
    x, weights, ids = tokens(layer, sizes[rank], seed=100 + rank)
    out = expert_parallel(layer, strategy, exact, max(sizes))(x, weights, ids)
    assert_matches(out, one_gpu(layer, x, weights, ids, exact), exact)


@pytest.mark.parametrize("sizes", TOKENS, ids=[f"M{a}" for a, _ in TOKENS])
def test_tp_matches_one_gpu(layer, rank, sizes):
    x, weights, ids = tokens(layer, sizes[0], seed=200, same_on_every_rank=True)
    out = par.TensorParallel(layer.tp, **layer.options)(x, weights, ids)
    assert relerr(out, one_gpu(layer, x, weights, ids, False)) < 1e-2


@pytest.mark.parametrize("strategy", par.STRATEGIES)
def test_hot_experts_all_tokens_to_one_rank(layer, rank, strategy):
    """Every token of both ranks routed to rank 1's experts: rank 0 gets nothing to compute."""
    gen = torch.Generator("cuda").manual_seed(300 + rank)
    M, half = 256, layer.E // 2
    x = random_hidden(M, layer.H, gen)
    ids = (half + torch.rand(M, half, device="cuda", generator=gen).topk(layer.k, dim=1).indices).int()
    weights = torch.rand(M, layer.k, device="cuda", generator=gen).softmax(dim=1)
    out = expert_parallel(layer, strategy, True, M)(x, weights, ids)
    assert_matches(out, one_gpu(layer, x, weights, ids, True), exact=True)


@pytest.mark.parametrize("mode", ["allgather", "alltoall_padded", "tp"])
def test_captured_in_a_cuda_graph_and_replayed_on_new_inputs(layer, rank, mode):
    M = 64
    x, weights, ids = tokens(layer, M, seed=400 + rank, same_on_every_rank=mode == "tp")
    if mode == "tp":
        forward, exact = par.TensorParallel(layer.tp, **layer.options), False
    else:
        forward, exact = expert_parallel(layer, mode, True, M), True
    out = torch.empty_like(x)
    graph = graph_of(lambda: forward(x, weights, ids, out=out))  # a warm-up on a side stream, then the capture
    for seed in (401, 402):
        new = tokens(layer, M, seed=seed + 10 * rank, same_on_every_rank=mode == "tp")
        for static, value in zip((x, weights, ids), new):
            static.copy_(value)
        out.fill_(float("nan"))
        graph.replay()
        assert_matches(out, one_gpu(layer, *new, exact), exact)


def test_variable_alltoall_refuses_capture(layer, rank):
    x, weights, ids = tokens(layer, 8, seed=500 + rank)
    forward = expert_parallel(layer, "alltoall", False, None)
    with pytest.raises(RuntimeError, match="'alltoall' reads the token counts on the host"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            forward(x, weights, ids)


def test_world_size_not_dividing_the_experts_raises_on_every_rank(rank):
    with pytest.raises(ValueError, match="world_size: 2 ranks do not divide num_experts=127"):
        par.Placement.linear(127, dist.get_world_size())


def test_bad_configurations_on_one_rank_raise_on_every_rank(layer, rank):
    own = layer.placement.expert_map(rank, "cuda")
    cases = [  # (keyword arguments, words of the error), each bad on one rank only
        (dict(expert_map=own[:-1] if rank == 1 else own), "expert_map"),
        (dict(placement=layer.placement, expert_map=own.flip(0) if rank == 0 else own),
         "expert_map: does not map the experts the placement gives rank 0"),
        (dict(placement=layer.placement, experts=layer.experts if rank == 1 else layer.local),
         f"experts: holds {layer.E} experts, the placement gives rank 1 {layer.E // 2}"),
        (dict(placement=layer.placement, exact=rank == 1), "exact: must be the same on every rank"),
    ]
    for kwargs, words in cases:
        kwargs = {"experts": layer.local, "strategy": "alltoall", **kwargs}
        with pytest.raises(ValueError, match=words):
            par.ExpertParallel(kwargs.pop("experts"), layer.k, **kwargs)
    # The ranks are still in step: a forward works.
    x, weights, ids = tokens(layer, 16, seed=600 + rank)
    forward = par.ExpertParallel(layer.local, layer.k, expert_map=own, strategy="alltoall", **layer.options)
    out = forward(x, weights, ids)
    assert_matches(out, one_gpu(layer, x, weights, ids, False), exact=False)
