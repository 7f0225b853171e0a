"""The one-launch layer for small batches (templates/sm90/moe_decode.cuh, ops.uses_fused) against the
float32 reference, row by row, and against the four-launch path it replaces."""
import pytest
import torch

import moe_cutlass as mc
from moe_cutlass import _lib, ops
from tests.helpers import (assert_close, assert_rows_close, check_deterministic,
                           check_dropped_ids_and_expert_map, check_graph_replay, random_experts,
                           random_hidden, random_mxfp4, random_routing, relerr)


def _library_or_skip():
    try:
        return _lib.library()
    except _lib.LibraryNotFound:
        pytest.skip("the kernel library is not built")


def test_which_calls_take_one_launch(monkeypatch):
    """Small batches within the kernel's slot limit and the weight limit, never batch_invariant ones."""
    _library_or_skip()
    limit = ops.fused_max_slots()
    assert limit >= 128
    H, I = 2880, 2880
    # the built-in rule: up to four tokens of qwen3 and gpt-oss, two of dsv4-flash, one of dsv3
    assert ops.uses_fused(4, 8, 2048, 768) and ops.uses_fused(4, 4, H, I) and ops.uses_fused(2, 6, 4096, 2048)
    assert ops.uses_fused(1, 8, 7168, 2048)
    assert not ops.uses_fused(8, 8, 2048, 768) and not ops.uses_fused(5, 4, H, I)
    assert not ops.uses_fused(4, 6, 4096, 2048) and not ops.uses_fused(2, 8, 7168, 2048)
    # the ring: K 512 stages for qwen3's one token (12.6M weights), K 1024 from gpt-oss's (33M) on
    assert ops.fused_kernel(1, 8, 2048, 768) == "moe_decode_k512" == ops.fused_kernel(2, 8, 2048, 768)
    assert ops.fused_kernel(1, 4, H, I) == "moe_decode_k1024" == ops.fused_kernel(4, 8, 2048, 768)
    monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 16)
    monkeypatch.setattr(ops, "FUSED_MAX_WEIGHTS", 16 * 8 * H * I)
    assert ops.uses_fused(1, 8, H, I) and ops.uses_fused(16, 8, H, I)
    assert not ops.uses_fused(17, 1, H, I)
    assert not ops.uses_fused(16, 8, H, I + 32)
    assert not ops.uses_fused(1, 8, H, I, batch_invariant=True)
    monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 1 << 20)
    monkeypatch.setattr(ops, "FUSED_MAX_WEIGHTS", 1 << 62)
    assert ops.uses_fused(limit, 1, H, I) and not ops.uses_fused(limit + 1, 1, H, I)
    assert ops.uses_fused(limit // 8, 8, H, I) and not ops.uses_fused(limit // 8 + 1, 8, H, I)


# ---- GPU ----

@pytest.fixture(params=ops.FUSED_KERNELS)
def fused(request, monkeypatch):
    """Every call within the slot limit takes the one-launch layer, with each of its kernels (rings)."""
    monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 1 << 20)
    monkeypatch.setattr(ops, "FUSED_MAX_WEIGHTS", 1 << 62)
    monkeypatch.setattr(ops, "fused_kernel", lambda *shape: request.param)


@pytest.fixture
def launches(monkeypatch):
    """Every call takes the four-launch path."""
    monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 0)


def run_fused(x, experts, weights, ids, **kw):
    M, k = ids.shape
    assert ops.uses_fused(M, k, experts.hidden_size, experts.intermediate_size), "the test meant the one-launch layer"
    out = torch.full((M, experts.hidden_size), float("nan"), dtype=torch.bfloat16, device=x.device)
    mc.fused_moe(x, experts, weights, ids, out=out, **kw)
    assert_rows_close(out, mc.reference.fused_moe_float(x, experts, weights, ids, **kw))
    return out


SHAPES = {  # (E, H, I, top_k)
    "small": (8, 256, 128, 2),
    "k-tails": (16, 96, 160, 3),          # K % 64 == 32 in both GEMMs; 2I, H not multiples of 128
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "gpt-oss-120b": (128, 2880, 2880, 4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 5, 16, 32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_reference(fused, name, M):
    E, H, I, k = SHAPES[name]
    if M * k > ops.fused_max_slots():
        pytest.skip("past the slot limit")
    gen = torch.Generator("cuda").manual_seed(100 + M)
    experts = random_experts(E, H, I, gen)
    run_fused(random_hidden(M, H, gen), experts, *random_routing(M, E, k, gen))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 7])
def test_gpt_oss_semantics(fused, M):
    """Interleaved gate/up rows, both biases, swiglu_oai with alpha 1.702 and limit 7, int64 ids."""
    gen = torch.Generator("cuda").manual_seed(2)
    experts = random_experts(8, 2880, 2880, gen, bias=True, gate_up="interleaved")
    weights, ids = random_routing(M, 8, 4, gen)
    run_fused(random_hidden(M, 2880, gen) * 4, experts, weights, ids.long(),
              activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)


@pytest.mark.gpu
def test_silu_limit_and_routed_scaling(fused):
    gen = torch.Generator("cuda").manual_seed(4)
    experts = random_experts(16, 512, 256, gen)
    run_fused(random_hidden(3, 512, gen) * 8, experts, *random_routing(3, 16, 6, gen),
              swiglu_limit=10.0, routed_scaling_factor=2.5)


@pytest.mark.gpu
def test_scale_bytes_above_128_take_the_exact_slow_path(fused):
    """Scale bytes 120..135 (some above layout.FAST_SCALE_MAX): the two-multiply conversion."""
    gen = torch.Generator("cuda").manual_seed(5)
    E, H, I = 8, 320, 192
    (b13, _), (b2, _) = random_mxfp4(E, 2 * I, H, gen), random_mxfp4(E, H, I, gen)
    s13 = torch.randint(120, 136, (E, 2 * I, H // 32), dtype=torch.uint8, device="cuda", generator=gen)
    s2 = torch.randint(120, 136, (E, H, I // 32), dtype=torch.uint8, device="cuda", generator=gen)
    experts = mc.prepare_experts(b13, s13, b2, s2)
    assert experts.w13["scale_max"] > 128 and experts.w2["scale_max"] > 128
    run_fused(random_hidden(4, H, gen) * 0.01, experts, *random_routing(4, E, 2, gen))


@pytest.mark.gpu
def test_many_rows_on_one_expert(fused):
    """64 and 32 rows on one expert (the general routing and the one-warp routing of up to 32 slots),
    a token choosing it several times, and one token on an expert alone: items of 1, 8 and 9 tokens."""
    gen = torch.Generator("cuda").manual_seed(6)
    E, H, I = 8, 256, 192
    experts = random_experts(E, H, I, gen)
    for M in (16, 8):
        weights, ids = random_routing(M, E, 4, gen)
        ids[:, :] = 3
        run_fused(random_hidden(M, H, gen), experts, weights, ids)
    weights, ids = random_routing(25, E, 1, gen)
    ids[:16] = 0
    ids[16:] = 5
    ids[24] = 7
    run_fused(random_hidden(25, H, gen), experts, weights, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [5, 12])   # 20 slots (the one-warp routing), 48 (the general one)
def test_dropped_ids_and_expert_map(fused, M):
    experts, gen = check_dropped_ids_and_expert_map(M, run_fused)
    weights, _ = random_routing(5, 8, 4, gen)
    out = torch.full((5, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    mc.fused_moe(random_hidden(5, 128, gen), experts, weights[:5],
                 torch.full((5, 4), -1, dtype=torch.int32, device="cuda"), out=out)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16])
def test_close_to_the_four_launch_path(monkeypatch, M):
    """Same arithmetic but the GEMMs' accumulation order: the two paths agree far inside the tolerance."""
    gen = torch.Generator("cuda").manual_seed(8)
    E, H, I, k = SHAPES["qwen3-30b-a3b"]
    experts = random_experts(E, H, I, gen)
    x = random_hidden(M, H, gen)
    weights, ids = random_routing(M, E, k, gen)
    monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 0)
    four = mc.fused_moe(x, experts, weights, ids)
    monkeypatch.setattr(ops, "FUSED_MAX_TOKENS", 16)
    monkeypatch.setattr(ops, "FUSED_MAX_WEIGHTS", 1 << 62)
    assert ops.uses_fused(M, k, H, I)
    one = mc.fused_moe(x, experts, weights, ids)
    assert relerr(one, four) < 2e-3
    assert_close(one, mc.reference.fused_moe_float(x, experts, weights, ids))


@pytest.mark.gpu
def test_deterministic(fused):
    check_deterministic(16, repeats=5)


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_inputs(fused):
    check_graph_replay(8, 32, 256, 128, 4, torch.Generator("cuda").manual_seed(11), assert_rows_close)


@pytest.mark.gpu
def test_back_to_back_calls_without_sync(fused):
    """Calls queued on one stream, each with its own inputs and output: no state leaks between launches."""
    gen = torch.Generator("cuda").manual_seed(12)
    E, H, I, k = 16, 256, 128, 4
    experts = random_experts(E, H, I, gen)
    calls = []
    for M in (1, 9, 3, 16, 2):
        x = random_hidden(M, H, gen)
        weights, ids = random_routing(M, E, k, gen)
        calls.append((x, weights, ids, mc.fused_moe(x, experts, weights, ids)))
    for x, weights, ids, out in calls:
        assert_rows_close(out, mc.reference.fused_moe_float(x, experts, weights, ids))


@pytest.mark.gpu
def test_launch_path_still_right_at_small_batches(launches):
    gen = torch.Generator("cuda").manual_seed(13)
    E, H, I, k = SHAPES["k-tails"]
    experts = random_experts(E, H, I, gen)
    for M in (1, 5):
        assert not ops.uses_fused(M, k, H, I)
        x = random_hidden(M, H, gen)
        weights, ids = random_routing(M, E, k, gen)
        assert_rows_close(mc.fused_moe(x, experts, weights, ids), mc.reference.fused_moe_float(x, experts, weights, ids))
