"""fused_moe on an SM90 GPU against the float32 reference (DESIGN.md section 2)."""
import pytest
import torch

import moe_cutlass as mc
from tests.helpers import (assert_close, check_deterministic, check_dropped_ids_and_expert_map,
                           check_graph_replay, random_experts, random_hidden, random_mxfp4, random_routing,
                           run_checked)

pytestmark = pytest.mark.gpu

SHAPES = {  # (E, H, I, top_k), DESIGN.md section 5
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "gpt-oss-120b": (128, 2880, 2880, 4),
    "dsv4-flash": (256, 4096, 2048, 6),
    "dsv3": (256, 7168, 2048, 8),
}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 7, 33, 1000]


@pytest.fixture(scope="module")
def shape_experts():
    """Experts of one DESIGN shape at a time (dsv3's take 6 GB)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            E, H, I, _ = SHAPES[name]
            cache[name] = random_experts(E, H, I, torch.Generator("cuda").manual_seed(len(name)))
        return cache[name]

    return get


@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_design_shapes(shape_experts, name, M):
    E, H, _, k = SHAPES[name]
    gen = torch.Generator("cuda").manual_seed(M)
    run_checked(random_hidden(M, H, gen), shape_experts(name), *random_routing(M, E, k, gen))


@pytest.mark.parametrize("M", [1, 5, 300])
def test_small_e8_k2(M):
    gen = torch.Generator("cuda").manual_seed(1)
    experts = random_experts(8, 256, 128, gen)
    run_checked(random_hidden(M, 256, gen), experts, *random_routing(M, 8, 2, gen))


@pytest.mark.parametrize("M", [3, 130])
def test_gpt_oss_semantics(M):
    """Interleaved gate/up rows, both biases, swiglu_oai with alpha 1.702 and limit 7."""
    gen = torch.Generator("cuda").manual_seed(2)
    experts = random_experts(8, 2880, 2880, gen, bias=True, gate_up="interleaved")
    run_checked(random_hidden(M, 2880, gen) * 4, experts, *random_routing(M, 8, 4, gen),
                activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)


def test_interleaved_order_matters():
    """The same bytes read as concat and as interleaved must give different layers."""
    gen = torch.Generator("cuda").manual_seed(3)
    w13, w2 = random_mxfp4(4, 64, 96, gen), random_mxfp4(4, 96, 32, gen)
    concat = mc.prepare_experts(*w13, *w2, gate_up="concat")
    inter = mc.prepare_experts(*w13, *w2, gate_up="interleaved")
    x = random_hidden(9, 96, gen)
    weights, ids = random_routing(9, 4, 2, gen)
    a = run_checked(x, concat, weights, ids)
    b = run_checked(x, inter, weights, ids)
    assert ((a.float() - b.float()).norm() / a.float().norm()).item() > 0.1


@pytest.mark.parametrize("M", [2, 77])
def test_deepseek_v4_semantics(M):
    """silu with limit 10 and routed_scaling_factor 2.5."""
    gen = torch.Generator("cuda").manual_seed(4)
    experts = random_experts(16, 512, 256, gen)
    run_checked(random_hidden(M, 512, gen) * 8, experts, *random_routing(M, 16, 6, gen),
                swiglu_limit=10.0, routed_scaling_factor=2.5)


@pytest.mark.parametrize("M", [1, 1000])
def test_hot_expert(M):
    gen = torch.Generator("cuda").manual_seed(5)
    experts = random_experts(32, 256, 192, gen)
    weights, ids = random_routing(M, 32, 1, gen)
    run_checked(random_hidden(M, 256, gen), experts, weights, torch.full_like(ids, 17))


@pytest.mark.parametrize("routing", ["zipf", "dirichlet"])
def test_skewed_routing_through_the_skew_part(routing):
    """Large experts (4 M weights per GEMM, SKEW_PART_MIN_WEIGHTS; SKEW_PART_MIN_EXPERTS of them) at 32 rows per
    expert: the plan appends the 128-token part, and busy experts' full 128-row chunks and remainders above 64 rows
    land in it."""
    from benchmarks.routings import route, rows_per_expert
    from moe_cutlass import _gemm

    E, H, I, k, M = 128, 2048, 2048, 4, 1024
    plan = _gemm.plan(M * k, E, ks=(H, I))
    assert _gemm.tile_n(plan.parts[-1][0]) == 128 and plan.parts[-1][3] == plan.chunk == 128
    ids = route(routing, M, E, k, torch.Generator().manual_seed(7))
    rows = rows_per_expert(ids, E)
    assert int(rows.max()) > 128 and int(((rows % 128) > 64).sum()) > 0   # full chunks and remainders for it
    gen = torch.Generator("cuda").manual_seed(8)
    experts = random_experts(E, H, I, gen)
    weights, _ = random_routing(M, E, k, gen)
    run_checked(random_hidden(M, H, gen), experts, weights, ids.to("cuda", torch.int32))


def test_most_experts_empty():
    gen = torch.Generator("cuda").manual_seed(6)
    experts = random_experts(64, 256, 128, gen)
    weights, ids = random_routing(40, 3, 2, gen)  # only experts 0..2 of 64
    run_checked(random_hidden(40, 256, gen), experts, weights, ids * 20)


def test_ids_out_of_range_and_expert_map():
    check_dropped_ids_and_expert_map(50, run_checked)


def test_all_ids_dropped_gives_zeros():
    gen = torch.Generator("cuda").manual_seed(8)
    experts = random_experts(4, 64, 32, gen)
    out = torch.full((6, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    weights, _ = random_routing(6, 4, 2, gen)
    mc.fused_moe(random_hidden(6, 64, gen), experts, weights,
                 torch.full((6, 2), -1, dtype=torch.int32, device="cuda"), out=out)
    assert torch.equal(out, torch.zeros_like(out))


def test_zero_tokens():
    gen = torch.Generator("cuda").manual_seed(9)
    experts = random_experts(4, 64, 32, gen)
    weights, ids = random_routing(0, 4, 2, gen)
    out = mc.fused_moe(random_hidden(0, 64, gen), experts, weights, ids)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_deterministic():
    check_deterministic(700, repeats=3)


def test_cuda_graph_replay_with_new_inputs():
    check_graph_replay(64, 32, 256, 128, 4, torch.Generator("cuda").manual_seed(11))


def test_forward_never_synchronizes():
    gen = torch.Generator("cuda").manual_seed(12)
    experts = random_experts(16, 256, 128, gen)
    x = random_hidden(33, 256, gen)
    weights, ids = random_routing(33, 16, 4, gen)
    out = mc.fused_moe(x, experts, weights, ids)  # first call sizes the buffers
    torch.cuda.set_sync_debug_mode("error")
    try:
        mc.fused_moe(x, experts, weights, ids, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_past_two_to_the_31_elements():
    """dsv3 at M = 131072: 1M routed rows, gathered rows of 7.5e9 elements (64-bit indexing in
    expand, both GEMMs and finalize); every row written, sampled rows against the reference."""
    E, H, I, k = SHAPES["dsv3"]
    M = 131072
    gen = torch.Generator("cuda").manual_seed(31)
    experts = random_experts(E, H, I, gen)
    x = random_hidden(M, H, gen)
    weights, ids = random_routing(M, E, k, gen)
    out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    mc.fused_moe(x, experts, weights, ids, out=out)
    assert torch.isfinite(out).all(dim=1).all(), "unwritten rows"
    rows = torch.tensor([0, 1, 65535, 65536, 77777, 100000, M - 2, M - 1], device="cuda")
    used = torch.unique(ids[rows])  # the reference dequantizes only the experts these rows use
    local = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    local[used] = torch.arange(used.numel(), dtype=torch.int32, device="cuda")
    ref = mc.reference.fused_moe_float(x[rows], experts.select(used.tolist()), weights[rows], local[ids[rows]])
    assert_close(out[rows], ref)
    del experts, x, out
    mc.free_workspaces()
    torch.cuda.empty_cache()


def test_layers_alternating_on_one_config():
    """Two layers of one shape called in turn, as a model's forward does: the launch parameters
    cached per weights must never serve the other layer's call."""
    gen = torch.Generator("cuda").manual_seed(12)
    E, H, I, k = 16, 256, 128, 2
    layers = [random_experts(E, H, I, gen) for _ in range(2)]
    x = random_hidden(8, H, gen)
    weights, ids = random_routing(8, E, k, gen)
    outs = [[mc.fused_moe(x, experts, weights, ids) for experts in layers] for _ in range(3)]
    for experts, first in zip(layers, outs[0]):
        assert_close(first, mc.reference.fused_moe_float(x, experts, weights, ids))
    for later in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(later, outs[0]))
    assert not torch.equal(outs[0][0], outs[0][1])


def test_batch_invariant_rows_do_not_depend_on_the_batch():
    """batch_invariant=True: one token's output bits are the same in batches of 1..4096 tokens (the
    64- and 128-token tiles both serve, and tiles of every fill), each batch against the reference."""
    E, H, I, k = 32, 512, 256, 4
    gen = torch.Generator("cuda").manual_seed(21)
    experts = random_experts(E, H, I, gen, bias=True)
    x0 = random_hidden(1, H, gen)
    w0, ids0 = random_routing(1, E, k, gen)
    rows = []
    for M in (1, 7, 64, 1000, 4096):
        x = random_hidden(M, H, gen)
        weights, ids = random_routing(M, E, k, gen)
        t = M // 2
        x[t], weights[t], ids[t] = x0[0], w0[0], ids0[0]
        out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        mc.fused_moe(x, experts, weights, ids, out=out, batch_invariant=True)
        assert_close(out, mc.reference.fused_moe_float(x, experts, weights, ids))
        rows.append(out[t])
    assert all(torch.equal(row, rows[0]) for row in rows[1:])
