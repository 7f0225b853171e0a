"""The numerics policy (README "Numerics", DESIGN.md section 6) on an SM90 GPU.

Non-finite values stay where they come from: the output is non-finite exactly where the float32
reference is (per token row, or per element where one weight block is NaN), and every other
row matches the reference. Tokens without a valid expert get exact zeros whatever they carry.
"""
import pytest
import torch

import moe_cutlass as mc
from tests.helpers import MAX_RELERR, random_experts, random_hidden, random_mxfp4, random_routing, relerr

pytestmark = pytest.mark.gpu

E, H, I, M, K = 8, 256, 128, 40, 3  # noqa: E741
LAYERS = [dict(activation="silu"), dict(activation="silu", swiglu_limit=10.0),
          dict(activation="swiglu_oai"), dict(activation="swiglu_oai", swiglu_limit=7.0)]
LAYER_IDS = ["silu", "silu-limit10", "swiglu_oai", "swiglu_oai-limit7"]


def _inputs(seed, **experts_kw):
    gen = torch.Generator("cuda").manual_seed(seed)
    experts = random_experts(E, H, I, gen, **experts_kw)
    weights, ids = random_routing(M, E, K, gen)
    return gen, experts, random_hidden(M, H, gen), weights, ids


def _assert_policy(out, ref, by_row=True):
    """out non-finite exactly where ref is (whole rows, or elements); close to ref elsewhere."""
    bad_out, bad_ref = ~torch.isfinite(out.float()), ~torch.isfinite(ref)
    if by_row:
        bad_out, bad_ref = bad_out.any(dim=1, keepdim=True), bad_ref.any(dim=1, keepdim=True)
    where = torch.nonzero(bad_out != bad_ref)[:5].tolist()
    assert torch.equal(bad_out, bad_ref), f"non-finite in one and not the other at (row, col) {where}"
    good = ~bad_ref.expand_as(ref)
    err = relerr(out.float()[good], ref[good])
    assert err < MAX_RELERR, f"relative error {err:.3e} where the reference is finite"


def _run(x, experts, weights, ids, **kw):
    out = mc.fused_moe(x, experts, weights, ids, **kw)
    return out, mc.reference.fused_moe_float(x, experts, weights, ids, **kw)


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_nan_and_inf_in_hidden_states_reach_only_their_rows(layer):
    _, experts, x, weights, ids = _inputs(1, bias=True)
    x[3, 5] = float("nan")
    x[10, 7] = float("inf")
    x[20] = float("-inf")
    x[30, 0] = float("nan")
    ids[30] = -1  # a token with no expert: its NaN is never read
    out, ref = _run(x, experts, weights, ids, **layer)
    bad_rows = (~torch.isfinite(ref)).any(dim=1).nonzero().flatten().tolist()
    assert bad_rows == [3, 10, 20]  # the test's premise: the reference propagates them
    assert (out[30] == 0).all()
    _assert_policy(out, ref)


def test_weights_are_used_as_given_negative_zero_and_nan():
    _, experts, x, _, ids = _inputs(2, bias=True)
    weights = torch.randn(M, K, device="cuda")  # signed, unnormalized
    weights[4, 1] = float("nan")
    weights[6] = 0.0
    out, ref = _run(x, experts, weights, ids, routed_scaling_factor=2.5)
    assert (~torch.isfinite(ref)).any(dim=1).nonzero().flatten().tolist() == [4]
    assert (out[6] == 0).all()
    _assert_policy(out, ref)


def _experts_with(gen, w13_scales_at=None, w2_scales_at=None, zero_experts=()):
    """Random experts whose scale byte at the given (expert, row, block) is 255 (NaN), or whose
    `zero_experts` hold only zero weights (their scales stay random)."""
    w13, w2 = random_mxfp4(E, 2 * I, H, gen), random_mxfp4(E, H, I, gen)
    for (blocks, scales), at in ((w13, w13_scales_at), (w2, w2_scales_at)):
        if at is not None:
            scales[at] = 255
        for e in zero_experts:
            blocks[e] = 0
    return mc.prepare_experts(*w13, *w2)


@pytest.mark.parametrize("layer", [LAYERS[0], LAYERS[1]], ids=LAYER_IDS[:2])
@pytest.mark.parametrize("half", ["gate", "up"])
def test_nan_scale_in_w13_poisons_the_rows_of_its_experts_tokens(layer, half):
    gen = torch.Generator("cuda").manual_seed(3)
    row = 5 if half == "gate" else I + 5  # concat order: gate rows, then up rows
    experts = _experts_with(gen, w13_scales_at=(2, row, 1))
    weights, ids = random_routing(M, E, K, gen)
    out, ref = _run(random_hidden(M, H, gen), experts, weights, ids, **layer)
    users = (ids == 2).any(dim=1)
    assert torch.equal((~torch.isfinite(ref)).any(dim=1), users) and 0 < int(users.sum()) < M
    _assert_policy(out, ref)


def test_nan_scale_in_w2_poisons_one_output_column_of_its_experts_tokens():
    gen = torch.Generator("cuda").manual_seed(4)
    experts = _experts_with(gen, w2_scales_at=(6, 17, 2))  # expert 6, output column 17, I block 2
    weights, ids = random_routing(M, E, K, gen)
    out, ref = _run(random_hidden(M, H, gen), experts, weights, ids)
    users = (ids == 6).any(dim=1)
    expected = torch.zeros(M, H, dtype=torch.bool, device="cuda")
    expected[users, 17] = True
    assert torch.equal(~torch.isfinite(ref), expected) and users.any()
    _assert_policy(out, ref, by_row=False)


def test_all_zero_experts_contribute_exact_zeros():
    gen = torch.Generator("cuda").manual_seed(5)
    experts = _experts_with(gen, zero_experts=(0, 7))
    weights, ids = random_routing(M, E, 2, gen)
    ids[:10, 0], ids[:10, 1] = 0, 7  # these tokens see only the zero experts
    out, ref = _run(random_hidden(M, H, gen), experts, weights, ids)
    assert (out[:10] == 0).all() and (ref[:10] == 0).all()
    live = ((ids != 0) & (ids != 7)).any(dim=1)     # random routing can pick both zero experts too
    assert (out[live] != 0).any(dim=1).all() and (out[~live] == 0).all()
    _assert_policy(out, ref)


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_huge_activations(layer):
    _, experts, x, weights, ids = _inputs(6)
    x[:8] *= 2.0**16  # large, finite all the way through
    x[8] *= 2.0**100  # overflows float32 unless swiglu_limit bounds the intermediate
    out, ref = _run(x, experts, weights, ids, **layer)
    finite_rows = torch.isfinite(ref).all(dim=1)
    assert finite_rows[:8].all() and finite_rows[9:].all()
    assert bool(finite_rows[8]) == ("swiglu_limit" in layer)
    _assert_policy(out, ref)
    assert relerr(out[9:], ref[9:]) < MAX_RELERR  # the ordinary rows on their own scale
