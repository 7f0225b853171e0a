"""Random MXFP4 MoE layers, a float64 dense layer to check against, and safetensors checkpoints
written under the exact names real checkpoints use (spelled out here, not taken from the library)."""
import json
import math
from dataclasses import dataclass

import torch

import moe_cutlass as mc


def random_mxfp4(gen, *shape):
    """MXFP4 (blocks, scales) of random weights with a different power-of-two scale per 32-block."""
    w = torch.randn(*shape[:-1], shape[-1] // 32, 32, generator=gen)
    w = w * 2.0 ** torch.randint(-4, 3, (*shape[:-1], shape[-1] // 32, 1), generator=gen)
    return mc.quantize_mxfp4(w.reshape(shape) / math.sqrt(shape[-1]))


@dataclass
class RawLayer:
    """A MoE layer's tensors as a checkpoint holds them; w13 rows in concat order (gate, then up)."""

    w13_blocks: torch.Tensor   # uint8 [E, 2I, H/2]
    w13_scales: torch.Tensor   # uint8 [E, 2I, H/32]
    w2_blocks: torch.Tensor    # uint8 [E, H, I/2]
    w2_scales: torch.Tensor
    b13: torch.Tensor          # bf16 [E, 2I]
    b2: torch.Tensor           # bf16 [E, H]
    router_weight: torch.Tensor  # bf16 [E, H]
    router_bias: torch.Tensor    # bf16 [E]
    correction_bias: torch.Tensor  # float32 [E]

    @property
    def sizes(self):
        E, two_i, half_h = self.w13_blocks.shape
        return E, 2 * half_h, two_i // 2

    def interleaved(self, t):
        """w13 rows (dim 1) in gpt-oss order: gate row j at 2j, up row j at 2j + 1."""
        I = self.sizes[2]
        return torch.stack((t[:, :I], t[:, I:]), dim=2).flatten(1, 2)

    def dense(self):
        """float64 (w13 [E, 2I, H], w2 [E, H, I], b13, b2)."""
        return (mc.dequantize_mxfp4(self.w13_blocks, self.w13_scales, torch.float64),
                mc.dequantize_mxfp4(self.w2_blocks, self.w2_scales, torch.float64),
                self.b13.double(), self.b2.double())

    def prepared(self, bias=False):
        return mc.prepare_experts(self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales,
                                  w13_bias=self.b13 if bias else None, w2_bias=self.b2 if bias else None)


def random_layer(E, H, I, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = random_mxfp4(gen, E, 2 * I, H), random_mxfp4(gen, E, H, I)
    return RawLayer(*w13, *w2, b13=torch.randn(E, 2 * I, generator=gen).bfloat16(),
                    b2=torch.randn(E, H, generator=gen).bfloat16(),
                    router_weight=torch.randn(E, H, generator=gen).bfloat16(),
                    router_bias=torch.randn(E, generator=gen).bfloat16(),
                    correction_bias=torch.rand(E, generator=gen))


def dense_moe(x, raw, weights, ids, activation="silu", limit=None, alpha=1.702, scale=1.0, bias=False):
    """The layer in float64, straight from DESIGN.md section 2 (ids all valid)."""
    w13, w2, b13, b2 = raw.dense()
    I = raw.sizes[2]
    x = x.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for j in range(ids.shape[1]):
        e = ids[:, j].long()
        h = torch.einsum("th,tnh->tn", x, w13[e]) + (b13[e] if bias else 0)
        gate, up = h[:, :I], h[:, I:]
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        act = gate * torch.sigmoid(gate) * up if activation == "silu" else gate * torch.sigmoid(alpha * gate) * (up + 1)
        y = torch.einsum("ti,thi->th", act, w2[e]) + (b2[e] if bias else 0)
        out += weights[:, j, None].double() * y
    return out * scale


def relative_error(actual, expected):
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


# -- checkpoint names, as the models' checkpoints spell them ------------------------------------

def gpt_oss_hf_tensors(raw, layer):
    p = f"model.layers.{layer}.mlp."
    E, H, I = raw.sizes
    return {
        p + "router.weight": raw.router_weight, p + "router.bias": raw.router_bias,
        p + "experts.gate_up_proj_blocks": raw.interleaved(raw.w13_blocks).reshape(E, 2 * I, H // 32, 16),
        p + "experts.gate_up_proj_scales": raw.interleaved(raw.w13_scales),
        p + "experts.gate_up_proj_bias": raw.interleaved(raw.b13),
        p + "experts.down_proj_blocks": raw.w2_blocks.reshape(E, H, I // 32, 16),
        p + "experts.down_proj_scales": raw.w2_scales, p + "experts.down_proj_bias": raw.b2,
        f"model.layers.{layer}.self_attn.q_proj.weight": torch.zeros(4, H, dtype=torch.bfloat16),
    }


def gpt_oss_original_tensors(raw, layer):
    p = f"block.{layer}.mlp."
    E, H, I = raw.sizes
    return {
        p + "gate.weight": raw.router_weight, p + "gate.bias": raw.router_bias,
        p + "mlp1_weight.blocks": raw.interleaved(raw.w13_blocks).reshape(E, 2 * I, H // 32, 16),
        p + "mlp1_weight.scales": raw.interleaved(raw.w13_scales), p + "mlp1_bias": raw.interleaved(raw.b13),
        p + "mlp2_weight.blocks": raw.w2_blocks.reshape(E, H, I // 32, 16),
        p + "mlp2_weight.scales": raw.w2_scales, p + "mlp2_bias": raw.b2,
        f"block.{layer}.mlp.norm.scale": torch.ones(H, dtype=torch.bfloat16),
    }


def per_expert_tensors(raw, layer, style):
    """style "qwen3": model.layers.L.mlp.experts.j.gate_proj.weight + weight_scale (uint8);
    "deepseek": layers.L.ffn.experts.j.w1.weight (int8) + scale (float8_e8m0fnu), gate.bias the
    correction bias."""
    E, H, I = raw.sizes
    if style == "qwen3":
        p, names, scale = f"model.layers.{layer}.mlp.", ("gate_proj", "up_proj", "down_proj"), "weight_scale"
        blocks_dtype, scale_dtype = torch.uint8, torch.uint8
        out = {p + "gate.weight": raw.router_weight}
    else:
        p, names, scale = f"layers.{layer}.ffn.", ("w1", "w3", "w2"), "scale"
        blocks_dtype, scale_dtype = torch.int8, torch.float8_e8m0fnu
        out = {p + "gate.weight": raw.router_weight, p + "gate.bias": raw.correction_bias,
               p + "shared_experts.w1.weight": torch.zeros(I, H, dtype=torch.bfloat16)}
    for j in range(E):
        parts = {names[0]: (raw.w13_blocks[j, :I], raw.w13_scales[j, :I]),
                 names[1]: (raw.w13_blocks[j, I:], raw.w13_scales[j, I:]),
                 names[2]: (raw.w2_blocks[j], raw.w2_scales[j])}
        for proj, (blocks, scales) in parts.items():
            out[f"{p}experts.{j}.{proj}.weight"] = blocks.clone().view(blocks_dtype)
            out[f"{p}experts.{j}.{proj}.{scale}"] = scales.clone().view(scale_dtype)
    return out


def write_checkpoint(directory, shards, config=None):
    """shards: a list of {name: tensor}, one file each; with more than one, an index json names
    each tensor's file (one file is written as model.safetensors without an index)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file({n: t.contiguous() for n, t in shards[0].items()}, directory / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: t.contiguous() for n, t in shard.items()}, directory / file)
            weight_map.update(dict.fromkeys(shard, file))
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory
