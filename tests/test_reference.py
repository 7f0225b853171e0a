import math

import pytest
import torch

from moe_cutlass.reference import fused_moe, fused_moe_float
from tests.helpers import StandInExperts


def _random_experts(e=3, h=32, i=32, bias=False, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * scale / math.sqrt(h)
    w2 = torch.randn(e, h, i, generator=gen) / math.sqrt(i)
    b13 = torch.randn(e, 2 * i, generator=gen) if bias else None
    b2 = torch.randn(e, h, generator=gen) if bias else None
    return StandInExperts(w13, w2, b13, b2)


def _routing(m, k, e, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).to(torch.int32)
    weights = torch.rand(m, k, generator=gen)
    return weights, ids


def _naive(x, experts, weights, ids, activation="silu", limit=None, alpha=1.702, scale=1.0, expert_map=None):
    """Token by token, slot by slot, in float64, straight from DESIGN.md section 2."""
    w13, w2, b13, b2 = (None if t is None else t.double() for t in experts.dequantized())
    num_e, inter = experts.num_experts, experts.intermediate_size
    out = torch.zeros(x.shape[0], experts.hidden_size, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e]) if 0 <= e < len(expert_map) else -1
            if not 0 <= e < num_e:
                continue
            h = w13[e] @ x[t].double() + (0 if b13 is None else b13[e])
            act = torch.tensor([_act(float(g), float(u), activation, limit, alpha)
                                for g, u in zip(h[:inter], h[inter:])], dtype=torch.float64)
            out[t] += float(weights[t, j]) * (w2[e] @ act + (0 if b2 is None else b2[e]))
    return out * scale


def _act(g, u, activation, limit, alpha):
    if limit is not None:
        g, u = min(g, limit), max(-limit, min(u, limit))
    if activation == "silu":
        return g / (1 + math.exp(-g)) * u
    return g / (1 + math.exp(-alpha * g)) * (u + 1)


def _assert_close(actual, expected, tol=1e-5):
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    err = (actual.double() - expected).norm() / expected.norm().clamp(min=1e-30)
    assert err < tol, err


def test_hand_computed_identity_experts():
    # Expert e: gate = x, up = 1 (bias), down = (e + 1) * identity, so a chosen expert adds
    # weight * (e + 1) * silu(x); silu(1) = 0.7310585786.
    h = 32
    eye = torch.eye(h)
    w13 = torch.stack([torch.cat([eye, torch.zeros(h, h)])] * 2)
    w2 = torch.stack([eye, 2 * eye])
    b13 = torch.cat([torch.zeros(h), torch.ones(h)]).expand(2, -1)
    experts = StandInExperts(w13, w2, b13=b13)
    x = torch.ones(1, h)
    out = fused_moe_float(x, experts, torch.tensor([[0.25, 0.5]]), torch.tensor([[0, 1]], dtype=torch.int32))
    expected = (0.25 * 1 + 0.5 * 2) * 0.7310585786300049
    assert torch.allclose(out, torch.full((1, h), expected), rtol=1e-6)


def test_walk_through_three_tokens_top2_three_experts():
    # Sorted per expert the flat slots are [1, 4 | 0, 2, 3 | 5]; token 1 picks expert 1 twice.
    experts = _random_experts(e=3, h=32, i=32)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[1, 0], [1, 1], [0, 2]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    _assert_close(fused_moe_float(x, experts, weights, ids), _naive(x, experts, weights, ids))


ACTIVATIONS = [
    ("silu", None, 1.702),
    ("silu", 1.5, 1.702),
    ("swiglu_oai", None, 1.702),
    ("swiglu_oai", 1.5, 1.702),
    ("swiglu_oai", 1.5, 0.8),
]


@pytest.mark.parametrize("activation,limit,alpha", ACTIVATIONS)
def test_activations(activation, limit, alpha):
    # Large weights push |gate|, |up| well past the limit, so the clamps matter.
    experts = _random_experts(e=4, h=64, i=32, bias=True, scale=4.0)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
    weights, ids = _routing(6, 2, 4)
    got = fused_moe_float(x, experts, weights, ids, activation, swiglu_limit=limit, swiglu_alpha=alpha)
    _assert_close(got, _naive(x, experts, weights, ids, activation, limit, alpha))
    if limit is not None:
        unclamped = fused_moe_float(x, experts, weights, ids, activation, swiglu_alpha=alpha)
        assert not torch.allclose(got, unclamped)


def test_biases_and_routed_scaling_factor():
    experts = _random_experts(e=3, h=32, i=64, bias=True)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(7))
    weights, ids = _routing(5, 2, 3)
    got = fused_moe_float(x, experts, weights, ids, routed_scaling_factor=2.5)
    _assert_close(got, _naive(x, experts, weights, ids, scale=2.5))
    w13, w2, _, _ = experts.dequantized()
    without_bias = fused_moe_float(x, StandInExperts(w13, w2), weights, ids, routed_scaling_factor=2.5)
    assert not torch.allclose(got, without_bias)


def test_expert_map_and_dropped_ids():
    experts = _random_experts(e=3, h=32, i=32, bias=True)
    expert_map = torch.tensor([-1, 0, 2, -1, 1], dtype=torch.int32)  # 5 global experts, 3 local
    ids = torch.tensor([[1, 0], [4, 3], [2, 5], [-1, 1], [3, 0]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(8))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(9))
    got = fused_moe_float(x, experts, weights, ids, expert_map=expert_map)
    _assert_close(got, _naive(x, experts, weights, ids, expert_map=expert_map))
    assert not got[4].any()  # both ids map to -1


def test_out_of_range_ids_contribute_nothing():
    experts = _random_experts(e=3, h=32, i=32, bias=True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10))
    ids = torch.tensor([[0, -1], [3, 2], [100, -7], [1, 1]], dtype=torch.int64)
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(11))
    got = fused_moe_float(x, experts, weights, ids)
    _assert_close(got, _naive(x, experts, weights, ids))
    assert not got[2].any()
    only_valid = fused_moe_float(x[:1], experts, weights[:1, :1], ids[:1, :1])
    assert torch.equal(got[0], only_valid[0])


def test_int32_and_int64_ids_agree():
    experts = _random_experts()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(12))
    weights, ids = _routing(4, 2, 3)
    assert torch.equal(fused_moe_float(x, experts, weights, ids), fused_moe_float(x, experts, weights, ids.long()))


def test_empty_batch():
    experts = _random_experts()
    out = fused_moe(torch.zeros(0, 32, dtype=torch.bfloat16), experts, torch.zeros(0, 2),
                    torch.zeros(0, 2, dtype=torch.int32))
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


def test_bf16_result_and_out_argument():
    experts = _random_experts(bias=True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(13)).bfloat16()
    weights, ids = _routing(4, 2, 3)
    expected = fused_moe_float(x, experts, weights, ids, "swiglu_oai", 7.0).bfloat16()
    got = fused_moe(x, experts, weights, ids, "swiglu_oai", 7.0)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    out = torch.full((4, 32), float("nan"), dtype=torch.bfloat16)
    assert fused_moe(x, experts, weights, ids, "swiglu_oai", 7.0, out=out) is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("change,error,message", [
    (dict(topk_ids=torch.zeros(4, 2)), TypeError, "topk_ids: expected int32 or int64 tensor of shape \\[4, k\\]"),
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int32)), ValueError, "topk_ids: .*got int32 \\[3, 2\\]"),
    (dict(topk_weights=torch.zeros(4, 3)), ValueError, "topk_weights: expected float32 tensor of shape \\[4, 2\\]"),
    (dict(topk_weights=torch.zeros(4, 2, dtype=torch.float64)), TypeError, "topk_weights: "),
    (dict(hidden_states=torch.zeros(4, 64)), ValueError, "hidden_states: .*shape \\[M, 32\\]"),
    (dict(hidden_states=torch.zeros(4, 32, dtype=torch.int32)), TypeError, "hidden_states: "),
    (dict(activation="gelu"), ValueError, "activation: expected one of 'silu', 'swiglu_oai', got 'gelu'"),
    (dict(swiglu_limit=-1.0), ValueError, "swiglu_limit: "),
    (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor: "),
    (dict(expert_map=torch.zeros(3, dtype=torch.int64)), TypeError, "expert_map: expected int32"),
    (dict(out=torch.zeros(4, 32)), TypeError, "out: expected bfloat16 tensor of shape \\[4, 32\\]"),
    (dict(out=torch.zeros(2, 32, dtype=torch.bfloat16)), ValueError, "out: "),
])
def test_bad_arguments_raise_naming_them(change, error, message):
    weights, ids = _routing(4, 2, 3)
    args = dict(hidden_states=torch.zeros(4, 32, dtype=torch.bfloat16), experts=_random_experts(),
                topk_weights=weights, topk_ids=ids)
    args.update(change)
    with pytest.raises(error, match=message):
        fused_moe(**args)
