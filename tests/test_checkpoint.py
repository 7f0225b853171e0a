"""MoELayer.from_checkpoint on checkpoints synthesized in the real layouts (CPU, reference path):
the loaded layer equals one built from the same tensors, TP and EP shares sum to the whole layer,
only the needed shards are opened, and a missing tensor is named."""
import pytest
import torch

import moe_cutlass as mc
from moe_cutlass import checkpoint
from moe_layers import (dense_moe, gpt_oss_hf_tensors, gpt_oss_original_tensors, per_expert_tensors, random_layer,
                        relative_error, write_checkpoint)

pytest.importorskip("safetensors")

TOP_K = 2
LAYOUTS = {
    # name: (tensors of one layer, config.json, options of the equivalent directly built layer)
    "gpt_oss": (gpt_oss_hf_tensors, {"model_type": "gpt_oss", "num_experts_per_tok": TOP_K, "swiglu_limit": 7.0},
                dict(router="topk_softmax", router_bias=True, activation="swiglu_oai", swiglu_limit=7.0,
                     expert_bias=True)),
    "gpt_oss_original": (gpt_oss_original_tensors, {"experts_per_token": TOP_K, "swiglu_limit": 7.0},
                         dict(router="topk_softmax", router_bias=True, activation="swiglu_oai", swiglu_limit=7.0,
                              expert_bias=True)),
    "qwen3": (lambda raw, layer: per_expert_tensors(raw, layer, "qwen3"),
              {"model_type": "qwen3_moe", "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "hidden_act": "silu"},
              dict(router="softmax", renormalize=True)),
    "deepseek": (lambda raw, layer: per_expert_tensors(raw, layer, "deepseek"),
                 {"n_activated_experts": TOP_K, "n_expert_groups": 2, "n_limited_groups": 1, "score_func": "sigmoid",
                  "route_scale": 2.5, "swiglu_limit": 10.0},
                 dict(router="sigmoid", renormalize=True, num_expert_group=2, topk_group=1, correction_bias=True,
                      routed_scaling_factor=2.5, swiglu_limit=10.0)),
}


def direct_layer(raw, options):
    """The layer built straight from the raw tensors, with the options the checkpoint implies."""
    E, H, I = raw.sizes
    layer = mc.MoELayer(E, H, I, TOP_K, **options)
    state = {"router_weight": raw.router_weight, "router_bias": raw.router_bias,
             "correction_bias": raw.correction_bias}
    state.update(raw.prepared(bias=options.get("expert_bias", False)).tensors())
    layer.load_state_dict({n: t for n, t in state.items() if n in layer.state_dict()})
    return layer


def synthesize(tmp_path, layout, E=8, H=64, I=96, seed=0):
    """A two-layer checkpoint in `layout` (each layer in its own shard) and layer 1's raw tensors."""
    tensors, config, _ = LAYOUTS[layout]
    raws = [random_layer(E, H, I, seed=seed + layer) for layer in (0, 1)]
    write_checkpoint(tmp_path / layout, [tensors(raw, layer) for layer, raw in enumerate(raws)], config)
    return tmp_path / layout, raws[1]


def hidden(M, H, seed=7):
    return torch.randn(M, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loaded_layer_equals_the_layer_built_from_the_same_tensors(tmp_path, layout):
    path, raw = synthesize(tmp_path, layout)
    options = LAYOUTS[layout][2]
    loaded = mc.MoELayer.from_checkpoint(path, 1, device="cpu")
    direct = direct_layer(raw, options)
    x = hidden(33, raw.sizes[1])
    out = loaded(x)
    assert torch.equal(out, direct(x))
    assert loaded.state_dict().keys() == direct.state_dict().keys()
    assert all(torch.equal(t, direct.state_dict()[n]) for n, t in loaded.state_dict().items())
    # and against the float64 layer on the dense weights, with the layer's own routing
    weights, ids = loaded.route(x)
    expected = dense_moe(x, raw, weights, ids, activation=options.get("activation", "silu"),
                         limit=options.get("swiglu_limit"), scale=options.get("routed_scaling_factor", 1.0),
                         bias=options.get("expert_bias", False))
    assert relative_error(out, expected) < 1e-5


def test_single_file_without_index(tmp_path):
    raw = random_layer(4, 64, 64, seed=3)
    write_checkpoint(tmp_path, [gpt_oss_original_tensors(raw, 0)], {"experts_per_token": TOP_K})
    assert not (tmp_path / "model.safetensors.index.json").exists()
    layer = mc.MoELayer.from_checkpoint(tmp_path, 0, device="cpu")
    direct = direct_layer(raw, LAYOUTS["gpt_oss_original"][2])
    x = hidden(9, 64)
    assert torch.equal(layer(x), direct(x))


def test_only_the_shards_holding_the_layer_are_opened(tmp_path):
    path, raw = synthesize(tmp_path, "gpt_oss")
    (path / "model-00001-of-00002.safetensors").write_bytes(b"not a safetensors file")  # layer 0's shard
    layer = mc.MoELayer.from_checkpoint(path, 1, device="cpu")
    with checkpoint.SafetensorsCheckpoint(path) as tensors:
        checkpoint.read_layer(tensors, *checkpoint.find_layer(tensors, 1))
        assert [f.name for f in tensors.opened] == ["model-00002-of-00002.safetensors"]
    x = hidden(5, 64)
    assert torch.equal(layer(x), direct_layer(raw, LAYOUTS["gpt_oss"][2])(x))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("size", [2, 3])
def test_tensor_parallel_shares_sum_to_the_layer(tmp_path, layout, size):
    path, raw = synthesize(tmp_path, layout, I=160)  # 5 blocks of 32: uneven on 2 and 3 ranks
    full = mc.MoELayer.from_checkpoint(path, 1, device="cpu")
    shares = [mc.MoELayer.from_checkpoint(path, 1, tp=(rank, size), device="cpu") for rank in range(size)]
    assert [s.local_intermediate_size for s in shares] == {2: [96, 64], 3: [64, 64, 32]}[size]
    x = hidden(17, 64)
    total = sum(s(x).double() for s in shares)
    assert relative_error(total, full(x)) < 1e-6
    if "bias" in full.experts.w2:  # the down bias is rank 0's alone
        assert all(not s.w2_bias.any() for s in shares[1:]) and shares[0].w2_bias.any()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_shares_cover_every_expert(tmp_path, layout):
    path, raw = synthesize(tmp_path, layout, E=8)
    full = mc.MoELayer.from_checkpoint(path, 1, device="cpu")
    shares = [mc.MoELayer.from_checkpoint(path, 1, ep=(rank, 3), device="cpu") for rank in range(3)]
    assert [s.num_local_experts for s in shares] == [3, 3, 2]
    maps = torch.stack([s.expert_map for s in shares])
    assert ((maps >= 0).sum(0) == 1).all()
    for s, m in zip(shares, maps):
        assert sorted(m[m >= 0].tolist()) == list(range(s.num_local_experts))
        for local, e in ((int(m[e]), e) for e in range(8) if m[e] >= 0):
            part, whole = s.experts.select([local]).dequantized(), full.experts.select([e]).dequantized()
            assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(part, whole))
    x = hidden(21, 64)
    assert relative_error(sum(s(x).double() for s in shares), full(x)) < 1e-6


@pytest.mark.parametrize("layout, missing", [
    ("gpt_oss", "model.layers.1.mlp.experts.down_proj_scales"),
    ("gpt_oss_original", "block.1.mlp.mlp1_bias"),
    ("qwen3", "model.layers.1.mlp.experts.5.up_proj.weight_scale"),
    ("deepseek", "layers.1.ffn.experts.7.w2.weight"),
])
def test_a_missing_tensor_is_named(tmp_path, layout, missing):
    tensors, config, _ = LAYOUTS[layout]
    layer = tensors(random_layer(8, 64, 64), 1)
    del layer[missing]
    write_checkpoint(tmp_path, [layer, {"lm_head.weight": torch.zeros(2, 2)}], config)
    with pytest.raises(KeyError, match=missing.replace(".", r"\.")):
        mc.MoELayer.from_checkpoint(tmp_path, 1, device="cpu")


def test_absent_layer_and_missing_top_k_are_named(tmp_path):
    path, _ = synthesize(tmp_path, "qwen3")
    with pytest.raises(ValueError, match="layer_index"):
        mc.MoELayer.from_checkpoint(path, 5, device="cpu")
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="top_k"):
        mc.MoELayer.from_checkpoint(path, 1, device="cpu")
    assert mc.MoELayer.from_checkpoint(path, 1, device="cpu", top_k=3).top_k == 3


def test_options_override_the_config(tmp_path):
    path, _ = synthesize(tmp_path, "deepseek")
    layer = mc.MoELayer.from_checkpoint(path, 1, device="cpu", routed_scaling_factor=1.0, router_dtype=torch.float32)
    assert layer.routed_scaling_factor == 1.0 and layer.router_dtype == torch.float32
    assert layer.num_expert_group == 2 and layer.correction_bias is not None


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loaded_layer_on_gpu_matches_the_reference(tmp_path, layout):
    path, raw = synthesize(tmp_path, layout, E=8, H=128, I=96)
    gpu = mc.MoELayer.from_checkpoint(path, 1, device="cuda")
    cpu = mc.MoELayer.from_checkpoint(path, 1, device="cpu")
    x = hidden(40, 128).bfloat16()
    weights, ids = cpu.route(x.float())
    out = gpu(x.cuda(), topk_weights=weights.cuda(), topk_ids=ids.cuda())
    assert out.dtype == torch.bfloat16
    assert relative_error(out.cpu(), cpu(x.float(), topk_weights=weights, topk_ids=ids)) < 1e-2
