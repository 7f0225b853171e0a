"""MoELayer on the CPU (reference path): routing with its own router or the caller's, buffers
through .to() / state_dict() / load_state_dict() (also from checkpoint names), sharding, bad input."""
import pytest
import torch

import moe_cutlass as mc
from moe_layers import (dense_moe, gpt_oss_hf_tensors, gpt_oss_original_tensors, per_expert_tensors, random_layer,
                        relative_error)
from test_layout import v1_blocks, v2_scales

E, H, I, K = 8, 64, 96, 2
GPT_OSS = dict(router="topk_softmax", router_bias=True, activation="swiglu_oai", swiglu_limit=7.0, expert_bias=True)


def loaded(raw, **options):
    layer = mc.MoELayer(E, H, I, K, **options)
    state = {"router_weight": raw.router_weight, "router_bias": raw.router_bias, "correction_bias": raw.correction_bias}
    state.update(raw.prepared(bias=options.get("expert_bias", False)).tensors())
    layer.load_state_dict({n: t for n, t in state.items() if n in layer.state_dict()})
    return layer


def hidden(M, seed=11):
    return torch.randn(M, H, generator=torch.Generator().manual_seed(seed))


def test_gpt_oss_router_and_activation():
    raw = random_layer(E, H, I, seed=1)
    layer = loaded(raw, **GPT_OSS)
    x = hidden(29)
    logits = x @ raw.router_weight.float().T + raw.router_bias.float()
    top = logits.topk(K, dim=-1)  # gpt-oss: top-k of the logits, softmax over those k
    expected = dense_moe(x, raw, top.values.softmax(-1), top.indices, "swiglu_oai", limit=7.0, bias=True)
    assert relative_error(layer(x), expected) < 1e-5


def test_softmax_router_renormalized():
    raw = random_layer(E, H, I, seed=2)
    layer = loaded(raw, router="softmax", renormalize=True)
    x = hidden(31)
    probs = (x @ raw.router_weight.float().T).softmax(-1)
    top = probs.topk(K, dim=-1)
    expected = dense_moe(x, raw, top.values / top.values.sum(-1, keepdim=True), top.indices)
    assert relative_error(layer(x), expected) < 1e-5


def test_sigmoid_router_with_groups_and_correction_bias():
    raw = random_layer(E, H, I, seed=3)
    options = dict(router="sigmoid", num_expert_group=4, topk_group=2, correction_bias=True,
                   routed_scaling_factor=2.5, swiglu_limit=10.0)
    layer = loaded(raw, **options)
    x = hidden(19)
    weights, ids = mc.select_experts(x @ raw.router_weight.float().T, K, scoring="sigmoid", num_expert_group=4,
                                     topk_group=2, correction_bias=raw.correction_bias)
    expected = dense_moe(x, raw, weights, ids, limit=10.0, scale=2.5)
    assert relative_error(layer(x), expected) < 1e-5


def test_caller_routing_and_leading_dims():
    raw = random_layer(E, H, I, seed=4)
    layer = loaded(raw, router=None)
    x = hidden(12).view(3, 4, H)
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(12)]).view(3, 4, K)
    weights = torch.rand(3, 4, K, generator=gen).bfloat16()
    out = layer(x, topk_weights=weights, topk_ids=ids)
    assert out.shape == x.shape
    expected = dense_moe(x.view(12, H), raw, weights.view(12, K).float(), ids.view(12, K))
    assert relative_error(out.view(12, H), expected) < 1e-5


def test_output_follows_the_input_dtype():
    raw = random_layer(E, H, I, seed=6)
    layer = loaded(raw)
    x = hidden(8)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert relative_error(layer(x.bfloat16()), layer(x.bfloat16().float())) < 1e-2


def test_state_dict_round_trip_and_missing_key():
    raw = random_layer(E, H, I, seed=7)
    layer = loaded(raw, **GPT_OSS)
    copy = mc.MoELayer(E, H, I, K, **GPT_OSS)
    x = hidden(10)
    assert not torch.equal(copy(x), layer(x))
    copy.load_state_dict(layer.state_dict())
    assert torch.equal(copy(x), layer(x))
    state = layer.state_dict()
    del state["w2_scales"]
    with pytest.raises(RuntimeError, match="w2_scales"):
        copy.load_state_dict(state)


@pytest.mark.parametrize("version", [1, 2])
def test_old_state_dicts_are_migrated(version):
    """A state dict saved before the blocks' bit layout changed (module version 1) or the scales'
    (versions 1 and 2) loads as the same weights; without its version it would load as other weights
    (or, for the scales' old shape, not at all)."""
    raw = random_layer(E, H, I, seed=9)
    layer = loaded(raw, **GPT_OSS)
    state = layer.state_dict()
    for part in ("w13", "w2"):
        if version == 1:
            state[f"{part}_blocks"] = v1_blocks(state[f"{part}_blocks"])
        state[f"{part}_scales"] = v2_scales(state[f"{part}_scales"])
    x = hidden(10)
    copy = mc.MoELayer(E, H, I, K, **GPT_OSS)
    with pytest.raises(RuntimeError, match="w13_scales"):
        copy.load_state_dict(state)
    state._metadata[""]["version"] = version
    copy.load_state_dict(state)
    assert torch.equal(copy(x), layer(x))
    if version == 1:
        state = layer.state_dict()
        state["w13_blocks"] = v1_blocks(state["w13_blocks"])
        copy.load_state_dict(state)
        assert not torch.equal(copy(x), layer(x))


@pytest.mark.parametrize("names", [gpt_oss_hf_tensors, gpt_oss_original_tensors])
def test_load_state_dict_from_gpt_oss_checkpoint_names(names):
    raw = random_layer(E, H, I, seed=8)
    prefix = "model.layers.0.mlp." if names is gpt_oss_hf_tensors else "block.0.mlp."
    state = {n[len(prefix):]: t for n, t in names(raw, 0).items() if n.startswith(prefix) and "norm" not in n}
    layer = mc.MoELayer(E, H, I, K, **GPT_OSS)
    layer.load_state_dict(state)
    x = hidden(13)
    assert torch.equal(layer(x), loaded(raw, **GPT_OSS)(x))
    key = next(n for n in state if "down" in n or "mlp2" in n)
    del state[key]
    with pytest.raises(KeyError, match=key):
        mc.MoELayer(E, H, I, K, **GPT_OSS).load_state_dict(state)


def test_load_state_dict_from_per_expert_names_inside_a_parent_module():
    raw = random_layer(E, H, I, seed=9)
    options = dict(router="sigmoid", correction_bias=True)
    parent = torch.nn.ModuleDict({"ffn": mc.MoELayer(E, H, I, K, **options)})
    state = {n.removeprefix("layers.0."): t for n, t in per_expert_tensors(raw, 0, "deepseek").items()
             if "shared" not in n}
    parent.load_state_dict(state)
    x = hidden(14)
    assert torch.equal(parent["ffn"](x), loaded(raw, **options)(x))


def test_load_state_dict_shards_checkpoint_names_as_the_layer():
    raw = random_layer(E, H, I, seed=10)
    state = {n.removeprefix("model.layers.0.mlp."): t for n, t in gpt_oss_hf_tensors(raw, 0).items() if "mlp" in n}
    x = hidden(15)
    total = 0
    for tp, ep in (((0, 2), (0, 2)), ((1, 2), (0, 2)), ((0, 2), (1, 2)), ((1, 2), (1, 2))):
        share = mc.MoELayer(E, H, I, K, **GPT_OSS, tp=tp, ep=ep)
        share.load_state_dict(state)
        assert (share.num_local_experts, share.local_intermediate_size) == (4, 64 if tp[0] == 0 else 32)
        total = total + share(x).double()
    assert relative_error(total, loaded(raw, **GPT_OSS)(x)) < 1e-6


def test_to_moves_buffers_and_keeps_expert_dtypes():
    layer = loaded(random_layer(E, H, I, seed=12), **GPT_OSS)
    dtypes = {n: t.dtype for n, t in layer.experts.tensors().items()}
    layer = layer.to(torch.bfloat16)
    assert layer.router_weight.dtype == torch.bfloat16
    assert {n: t.dtype for n, t in layer.experts.tensors().items()} == dtypes
    layer = layer.to("meta")
    assert layer.experts.device == torch.device("meta") and layer.router_bias.device == torch.device("meta")


def test_experts_are_the_buffers():
    raw = random_layer(E, H, I, seed=13)
    experts = raw.prepared()
    layer = mc.MoELayer(E, H, I, K, experts=experts)
    assert all(t is getattr(layer, n) for n, t in experts.tensors().items())
    assert isinstance(layer.experts, mc.PreparedExperts) and layer.experts.num_experts == E


@pytest.mark.parametrize("change, error, words", [
    (dict(router="random"), ValueError, "router"),
    (dict(top_k=9), ValueError, "top_k"),
    (dict(intermediate_size=80), ValueError, "intermediate_size"),
    (dict(activation="gelu"), ValueError, "activation"),
    (dict(num_expert_group=3, topk_group=1), ValueError, "num_expert_group"),
    (dict(tp=(2, 2)), ValueError, "tp rank"),
    (dict(tp=(3, 4)), ValueError, "tp: rank 3 of 4 gets no part"),
    (dict(experts="weights"), TypeError, "experts"),
    (dict(expert_bias=True, experts=random_layer(E, H, I).prepared()), ValueError, "experts"),
    (dict(router_dtype=torch.int32), TypeError, "router_dtype"),
])
def test_bad_construction_names_the_argument(change, error, words):
    kwargs = dict(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K)
    kwargs.update(change)
    with pytest.raises(error, match=words):
        mc.MoELayer(**kwargs)


def test_bad_call_names_the_argument():
    layer = mc.MoELayer(E, H, I, K)
    x = hidden(4)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[:, :32])
    with pytest.raises(ValueError, match="topk_weights, topk_ids"):
        layer(x, topk_ids=torch.zeros(4, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_ids"):
        layer(x, topk_weights=torch.ones(4, K), topk_ids=torch.zeros(5, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_ids"):
        mc.MoELayer(E, H, I, K, router=None)(x)


@pytest.mark.gpu
def test_module_on_gpu_runs_the_kernels():
    raw = random_layer(E, 128, I, seed=14)
    cpu = mc.MoELayer(E, 128, I, K, **GPT_OSS)
    state = {n.removeprefix("model.layers.0.mlp."): t for n, t in gpt_oss_hf_tensors(raw, 0).items() if "mlp" in n}
    cpu.load_state_dict(state)
    gpu = mc.MoELayer(E, 128, I, K, **GPT_OSS, device="cuda")
    gpu.load_state_dict(state)
    x = torch.randn(37, 128, generator=torch.Generator().manual_seed(15)).bfloat16()
    weights, ids = cpu.route(x.float())
    out = gpu(x.cuda(), topk_weights=weights.cuda(), topk_ids=ids.cuda())
    assert out.dtype == torch.bfloat16 and out.device.type == "cuda"
    assert relative_error(out.cpu(), cpu(x.float(), topk_weights=weights, topk_ids=ids)) < 1e-2
    moved = cpu.to("cuda")
    assert torch.equal(moved(x.cuda(), topk_weights=weights.cuda(), topk_ids=ids.cuda()), out)


def test_scale_max_follows_the_loaded_weights():
    raw = random_layer(E, H, I, seed=16)
    layer = mc.MoELayer(E, H, I, K)
    assert layer.experts.w13["scale_max"] == 0
    layer.load_state_dict({"router_weight": raw.router_weight} | raw.prepared().tensors())
    assert layer.experts.w13["scale_max"] == int(raw.w13_scales.max())
    assert layer.experts.w2["scale_max"] == int(raw.w2_scales.max())
    assert layer.to(torch.bfloat16).experts.w2["scale_max"] == int(raw.w2_scales.max())
