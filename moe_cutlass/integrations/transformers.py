"""Swap the MoE blocks of a transformers model (5.x) for MoELayer.

``swap_moe_blocks(model)`` replaces, in place, every ``GptOssMLP``, ``Qwen3MoeSparseMoeBlock``
and ``DeepseekV3MoE`` with a `MoEBlock` that keeps the block's router semantics and returns
what the block returned (gpt-oss: ``(out, router_scores)``; DeepSeek: routed experts plus the
block's own shared experts, kept as they are). Float expert weights are quantized to MXFP4
(`quantize_mxfp4`; MXFP4 weights that were dequantized quantize back to the same values); experts
that hold MXFP4 tensors under checkpoint names (``gate_up_proj_blocks`` / ``_scales``, gpt-oss)
are taken as they are. The blocks are recognised by class name, so importing this module does
not import transformers.

The MoELayer runs the kernels on CUDA (bf16 inside, the model's dtype outside) and the float32
reference on the CPU. Router logits are not recorded (``output_router_logits`` has no router
module to hook).
"""
import torch
from torch import nn

from ..experts import prepare_experts
from ..module import MoELayer
from ..mxfp4 import quantize_mxfp4


class MoEBlock(nn.Module):
    """A transformers MoE block's stand-in: `moe` (a MoELayer), plus the block's shared experts
    (added to the output), returning ``(out, router_scores)`` where the block did."""

    def __init__(self, moe, shared_experts=None, returns_router_scores=False):
        super().__init__()
        self.moe = moe
        self.shared_experts = shared_experts
        self.returns_router_scores = returns_router_scores

    def forward(self, hidden_states):
        if not self.returns_router_scores:
            out = self.moe(hidden_states)
        else:
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            router_scores, topk_ids = self.moe.route(flat)
            out = self.moe(flat, topk_weights=router_scores, topk_ids=topk_ids).reshape(hidden_states.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return (out, router_scores) if self.returns_router_scores else out


def _mxfp4(experts, name, float_weight):
    """(blocks, scales) of an experts module's `name` projection, [E, rows, K]: its MXFP4
    tensors if it holds them, else its float weight [E, rows, K] quantized."""
    blocks, scales = getattr(experts, f"{name}_blocks", None), getattr(experts, f"{name}_scales", None)
    if blocks is not None and scales is not None:
        return blocks.detach(), scales.detach()
    return quantize_mxfp4(float_weight().detach())


def _gpt_oss(block):
    router, experts = block.router, block.experts
    # transformers keeps gpt-oss' float experts transposed: gate_up_proj [E, H, 2I], down_proj [E, I, H].
    w13 = _mxfp4(experts, "gate_up_proj", lambda: experts.gate_up_proj.transpose(1, 2))
    w2 = _mxfp4(experts, "down_proj", lambda: experts.down_proj.transpose(1, 2))
    prepared = prepare_experts(*w13, *w2, w13_bias=experts.gate_up_proj_bias.detach(),
                               w2_bias=experts.down_proj_bias.detach(), gate_up="interleaved")
    options = dict(router="topk_softmax", router_bias=True, activation="swiglu_oai", swiglu_limit=float(experts.limit),
                   swiglu_alpha=float(experts.alpha), expert_bias=True)
    state = {"router_weight": router.weight, "router_bias": router.bias}
    return _layer(prepared, router.top_k, options, state), dict(returns_router_scores=True)


def _qwen3(block):
    gate, experts = block.gate, block.experts
    w13 = _mxfp4(experts, "gate_up_proj", lambda: experts.gate_up_proj)
    w2 = _mxfp4(experts, "down_proj", lambda: experts.down_proj)
    options = dict(router="softmax", renormalize=bool(gate.norm_topk_prob))
    return _layer(prepare_experts(*w13, *w2), gate.top_k, options, {"router_weight": gate.weight}), {}


def _deepseek_v3(block):
    gate, experts = block.gate, block.experts
    w13 = _mxfp4(experts, "gate_up_proj", lambda: experts.gate_up_proj)
    w2 = _mxfp4(experts, "down_proj", lambda: experts.down_proj)
    groups = dict(num_expert_group=gate.num_group, topk_group=gate.topk_group) if gate.num_group > 1 else {}
    # transformers scores DeepSeek's router in float32 whatever the model's dtype.
    options = dict(router="sigmoid", renormalize=bool(gate.norm_topk_prob), correction_bias=True,
                   routed_scaling_factor=float(gate.routed_scaling_factor), router_dtype=torch.float32, **groups)
    state = {"router_weight": gate.weight, "correction_bias": gate.e_score_correction_bias}
    return (_layer(prepare_experts(*w13, *w2), gate.top_k, options, state),
            dict(shared_experts=block.shared_experts))


def _layer(prepared, top_k, options, router_state):
    layer = MoELayer(prepared.num_experts, prepared.hidden_size, prepared.intermediate_size, top_k,
                     experts=prepared, **options)
    layer.load_state_dict(prepared.tensors() | {n: t.detach() for n, t in router_state.items()})
    return layer


BLOCKS = {"GptOssMLP": _gpt_oss, "Qwen3MoeSparseMoeBlock": _qwen3, "DeepseekV3MoE": _deepseek_v3}


def _check_activation(block):
    act = getattr(block.experts, "act_fn", None)
    if act is not None and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise ValueError(f"model: {type(block).__name__} uses {type(act).__name__}; MoELayer runs SiLU")


@torch.no_grad()
def swap_moe_blocks(model):
    """Replace every MoE block of `model` (see the module docstring) with a MoEBlock on the
    block's device; returns the replaced modules' names. The model's own weights of those blocks
    are dropped (DeepSeek's shared experts stay)."""
    found = [(name, module) for name, module in model.named_modules() if type(module).__name__ in BLOCKS]
    if not found:
        raise ValueError(f"model: no {', '.join(BLOCKS)} block in {type(model).__name__}")
    for name, block in found:
        if type(block).__name__ != "GptOssMLP":
            _check_activation(block)
        layer, extras = BLOCKS[type(block).__name__](block)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, MoEBlock(layer, **extras))
    return [name for name, _ in found]
