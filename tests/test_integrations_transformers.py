"""transformers swap-in: a tiny random model of each family with MXFP4 experts, patched vs the
unpatched model holding the dequantized weights (same logits within 1e-2, same greedy tokens).
On the CPU the patched layers run the float32 reference; on an SM90 GPU the kernels."""
import copy

import pytest
import torch

import moe_cutlass as mc
from moe_cutlass.integrations.transformers import MoEBlock, swap_moe_blocks

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64)
FAMILIES = {
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, intermediate_size=64, num_key_value_heads=1, head_dim=32,
                                                 num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, intermediate_size=128, moe_intermediate_size=64,
                                                     num_key_value_heads=1, head_dim=32, num_experts=4,
                                                     num_experts_per_tok=2, norm_topk_prob=True),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON, intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=0, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, num_key_value_heads=2, q_lora_rank=None,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, routed_scaling_factor=2.5),
}


def mxfp4_round_trip(w, gen):
    """w [..., K] scaled by a random power of two per 32-block (distinct MX scales), then quantized
    and dequantized: the values the patched model's MXFP4 experts hold exactly."""
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    scaled = blocks * 2.0 ** torch.randint(-2, 3, (*blocks.shape[:-1], 1), generator=gen)
    return mc.dequantize_mxfp4(*mc.quantize_mxfp4(scaled.reshape(w.shape)))


@torch.no_grad()
def tiny_model(family, device):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if type(module).__name__ in ("GptOssMLP", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE"):
            # K is the last axis of gpt-oss' transposed [E, H, 2I] weights only after a transpose.
            transposed = family == "gpt_oss"
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(experts, name)
                w = p.transpose(1, 2) if transposed else p
                w = mxfp4_round_trip(w.float() * 4, gen)
                p.copy_(w.transpose(1, 2) if transposed else w)
            router = module.router if family == "gpt_oss" else module.gate
            router.weight.normal_(0, 0.5, generator=gen)  # routing decided by clear margins
            if family == "deepseek_v3":
                router.e_score_correction_bias.uniform_(-0.1, 0.1, generator=gen)
            if family == "gpt_oss":
                experts.gate_up_proj_bias.normal_(0, 0.1, generator=gen)
                experts.down_proj_bias.normal_(0, 0.1, generator=gen)
    return model.to(device)


def compare(family, device):
    model = tiny_model(family, device)
    patched = copy.deepcopy(model)
    names = swap_moe_blocks(patched)
    assert len(names) == 2 and all(isinstance(patched.get_submodule(n), MoEBlock) for n in names)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want, got = model(ids, attention_mask=mask).logits.float(), patched(ids, attention_mask=mask).logits.float()
    relerr = float((got - want).norm() / want.norm())
    assert relerr < 1e-2, relerr
    assert torch.equal(got[:, -1].argmax(-1), want[:, -1].argmax(-1))
    greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(ids, **greedy), model.generate(ids, **greedy))
    return relerr


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_model_matches_on_cpu(family):
    assert compare(family, "cpu") < 1e-4  # float32 on both sides: only summation order differs


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_model_matches_on_gpu(family):
    # A float32 model on both sides: the kernels' bf16 activations are the only rounding.
    compare(family, "cuda")


def test_a_model_without_moe_blocks_is_an_error():
    with pytest.raises(ValueError, match="model: no GptOssMLP"):
        swap_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))
