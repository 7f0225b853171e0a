"""Expert weights prepared once, offline, into the layout the SM90 kernels read.

The prepared tensors stay MXFP4 (uint8 blocks and E8M0 scales, rearranged by `layout`), so a
prepared layer costs about 4.25 bits per weight plus padding, never a BF16 copy. `dequantized()`
undoes the arrangement for the float32 reference layer.
"""
from dataclasses import dataclass

import torch

from . import layout
from ._checks import check_tensor
from .mxfp4 import dequantize_mxfp4

GATE_UP_ORDERS = ("concat", "interleaved")


def _map_tensors(fn, prepared: dict) -> dict:
    """fn applied to the tensors of a prepared dict; its plain values (scale_max) are kept."""
    return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in prepared.items()}


@dataclass(frozen=True)
class PreparedExperts:
    """MXFP4 experts in kernel layout. Every tensor in `w13` and `w2` has the expert as dim 0."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    w13: dict
    w2: dict

    @property
    def device(self) -> torch.device:
        return next(iter(self.w13.values())).device

    def _map(self, fn) -> "PreparedExperts":
        return PreparedExperts(
            num_experts=self.num_experts, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            w13=_map_tensors(fn, self.w13), w2=_map_tensors(fn, self.w2))

    def to(self, device) -> "PreparedExperts":
        return self._map(lambda t: t.to(device))

    def select(self, expert_ids) -> "PreparedExperts":
        """A PreparedExperts holding only `expert_ids` (in that order), e.g. one rank's share."""
        ids = torch.as_tensor(expert_ids, dtype=torch.long, device=self.device)
        selected = self._map(lambda t: t.index_select(0, ids).contiguous())
        return PreparedExperts(ids.numel(), self.hidden_size, self.intermediate_size,
                               selected.w13, selected.w2)

    def dequantized(self):
        """(w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I], b13 [E, 2I] | None, b2 [E, H] | None),
        float32, unpadded, on the experts' device."""
        H, I = self.hidden_size, self.intermediate_size
        b13_blocks, b13_scales, b13 = layout.unprepare_w13(self.w13, H, I)
        b2_blocks, b2_scales, b2 = layout.unprepare_w2(self.w2, H, I)
        return (dequantize_mxfp4(b13_blocks, b13_scales), dequantize_mxfp4(b2_blocks, b2_scales),
                None if b13 is None else b13.float(), None if b2 is None else b2.float())


def _as_blocks(name, blocks, rows, k):
    """Accept [E, rows, K/2] or the checkpoint form [E, rows, K/32, 16]."""
    if blocks.dim() == 4 and blocks.shape[-1] == 16:
        blocks = blocks.reshape(*blocks.shape[:2], -1)
    check_tensor(name, blocks, dtype=torch.uint8, shape=("E", rows, k // 2))
    return blocks


def _check_bias(name, bias, shape, device):
    if bias is None:
        return None
    check_tensor(name, bias, dtype=(torch.float32, torch.bfloat16, torch.float16), shape=shape, device=device)
    return bias.float()


def prepare_experts(w13_blocks, w13_scales, w2_blocks, w2_scales, w13_bias=None, w2_bias=None,
                    gate_up="concat") -> PreparedExperts:
    """Rearrange MXFP4 expert weights once into the kernel layout (CPU or CUDA tensors).

    w13_*: uint8 [E, 2I, H/2] (or [E, 2I, H/32, 16]) and [E, 2I, H/32]; w2_*: uint8 [E, H, I/2]
    and [E, H, I/32]; biases [E, 2I] and [E, H]. gate_up: "concat" (rows [0, I) gate, [I, 2I)
    up) or "interleaved" (even rows gate, odd rows up, as in gpt-oss checkpoints).
    """
    if gate_up not in GATE_UP_ORDERS:
        raise ValueError(f"gate_up: expected one of {GATE_UP_ORDERS}, got {gate_up!r}")
    check_tensor("w13_scales", w13_scales, dtype=torch.uint8, ndim=3)
    check_tensor("w2_scales", w2_scales, dtype=torch.uint8, ndim=3)
    E, two_i, h_groups = w13_scales.shape
    H = h_groups * 32
    if two_i % 2:
        raise ValueError(f"w13_scales: expected an even row count 2*I, got {two_i}")
    I = two_i // 2
    check_tensor("w2_scales", w2_scales, shape=(E, H, I // 32), device=w13_scales.device)
    if I % 32:
        raise ValueError(f"w13_scales: intermediate size I={I} must be a multiple of 32 (one MX block)")
    w13_blocks = _as_blocks("w13_blocks", w13_blocks, two_i, H)
    w2_blocks = _as_blocks("w2_blocks", w2_blocks, H, I)
    check_tensor("w13_blocks", w13_blocks, shape=(E, two_i, H // 2), device=w13_scales.device)
    check_tensor("w2_blocks", w2_blocks, shape=(E, H, I // 2), device=w13_scales.device)
    w13_bias = _check_bias("w13_bias", w13_bias, (E, two_i), w13_scales.device)
    w2_bias = _check_bias("w2_bias", w2_bias, (E, H), w13_scales.device)
    return PreparedExperts(
        num_experts=E, hidden_size=H, intermediate_size=I,
        w13=layout.prepare_w13(w13_blocks, w13_scales, w13_bias, gate_up),
        w2=layout.prepare_w2(w2_blocks, w2_scales, w2_bias))
