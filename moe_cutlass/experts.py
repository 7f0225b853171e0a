"""Expert weights prepared once, offline, into the layout the SM90 kernels read.

The prepared tensors stay MXFP4 (uint8 blocks and E8M0 scales, rearranged by `layout`), so a
prepared layer costs about 4.25 bits per weight plus padding, never a BF16 copy. `dequantized()`
undoes the arrangement for the float32 reference layer.
"""
import re
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

    def tensors(self) -> dict:
        """The prepared tensors by flat name (``w13_blocks``, ``w2_scales``, ...), as `MoELayer`
        holds them; `from_tensors` is the inverse."""
        return {f"{part}_{key}": t for part, d in (("w13", self.w13), ("w2", self.w2))
                for key, t in d.items() if isinstance(t, torch.Tensor)}

    @classmethod
    def from_tensors(cls, num_experts, hidden_size, intermediate_size, tensors, like=None) -> "PreparedExperts":
        """Inverse of `tensors`. The plain values (scale_max) come from `like`, experts holding the
        same values (before a move), or else from the scales (a read back to the host)."""
        parts = {"w13": {}, "w2": {}}
        for name, t in tensors.items():
            part, key = name.split("_", 1)
            parts[part][key] = t
        for part, d in parts.items():
            d["scale_max"] = layout.prepared_scale_max(d["scales"]) if like is None else getattr(like, part)["scale_max"]
        return cls(num_experts, hidden_size, intermediate_size, parts["w13"], parts["w2"])

    @classmethod
    def zeros(cls, num_experts, hidden_size, intermediate_size, bias=False, device=None) -> "PreparedExperts":
        """Experts whose weights (and biases) are all zero: a layer's buffers before it loads weights."""
        E, H, I = num_experts, hidden_size, intermediate_size
        # Every expert is the same: one prepared expert, repeated (zero scale bytes are not zero
        # bytes once prepared, layout.SCALE_BIAS).
        one = prepare_experts(
            torch.zeros(1, 2 * I, H // 2, dtype=torch.uint8), torch.zeros(1, 2 * I, H // 32, dtype=torch.uint8),
            torch.zeros(1, H, I // 2, dtype=torch.uint8), torch.zeros(1, H, I // 32, dtype=torch.uint8),
            w13_bias=torch.zeros(1, 2 * I) if bias else None, w2_bias=torch.zeros(1, H) if bias else None)
        return cls.from_tensors(E, H, I, {name: t.to(device).expand(E, *t.shape[1:]).contiguous()
                                          for name, t in one.tensors().items()})

    def dequantized(self):
        """(w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I], b13 [E, 2I] | None, b2 [E, H] | None),
        float32, unpadded, on the experts' device."""
        H, I = self.hidden_size, self.intermediate_size
        b13_blocks, b13_scales, b13 = layout.unprepare_w13(self.w13, H, I)
        b2_blocks, b2_scales, b2 = layout.unprepare_w2(self.w2, H, I)
        return (dequantize_mxfp4(b13_blocks, b13_scales), dequantize_mxfp4(b2_blocks, b2_scales),
                None if b13 is None else b13.float(), None if b2 is None else b2.float())


# How checkpoints store the same bytes: DeepSeek-V4 keeps blocks as int8 and scales as
# float8_e8m0fnu; torch's float4_e2m1fn_x2 packs two codes per byte, low nibble first, as we do.
BLOCK_DTYPES = tuple(getattr(torch, name) for name in ("uint8", "int8", "float4_e2m1fn_x2") if hasattr(torch, name))
SCALE_DTYPES = tuple(getattr(torch, name) for name in ("uint8", "float8_e8m0fnu") if hasattr(torch, name))


def as_mxfp4_bytes(name, t, kind):
    """`t` (MXFP4 blocks or scales, kind "blocks" or "scales", in any dtype checkpoints use)
    reinterpreted as uint8, without a copy."""
    check_tensor(name, t, dtype=BLOCK_DTYPES if kind == "blocks" else SCALE_DTYPES)
    return t.view(torch.uint8)


def _as_blocks(name, blocks, rows, k):
    """Accept [E, rows, K/2] or the checkpoint form [E, rows, K/32, 16]."""
    blocks = as_mxfp4_bytes(name, blocks, "blocks")
    if blocks.dim() == 4 and blocks.shape[-1] == 16:
        blocks = blocks.reshape(*blocks.shape[:2], -1)
    check_tensor(name, blocks, shape=("E", rows, k // 2))
    return blocks


def _check_bias(name, bias, shape, device):
    if bias is None:
        return None
    check_tensor(name, bias, dtype=(torch.float32, torch.bfloat16, torch.float16), shape=shape, device=device)
    return bias


def prepare_experts(w13_blocks, w13_scales, w2_blocks, w2_scales, w13_bias=None, w2_bias=None,
                    gate_up="concat", device=None) -> PreparedExperts:
    """Rearrange MXFP4 expert weights once into the kernel layout (CPU or CUDA tensors).

    w13_*: [E, 2I, H/2] (or [E, 2I, H/32, 16]) blocks and [E, 2I, H/32] scales; w2_*: [E, H, I/2]
    blocks and [E, H, I/32] scales; biases [E, 2I] and [E, H]. Blocks are uint8, int8 or
    float4_e2m1fn_x2, scales uint8 or float8_e8m0fnu (the bytes are what counts). gate_up:
    "concat" (rows [0, I) gate, [I, 2I) up) or "interleaved" (even rows gate, odd rows up, as in
    gpt-oss checkpoints). device: where the prepared experts go (default: the inputs' device);
    the inputs are converted a chunk of experts at a time, so preparing CPU weights for a GPU
    takes the output plus one chunk of GPU memory.
    """
    if gate_up not in GATE_UP_ORDERS:
        raise ValueError(f"gate_up: expected one of {GATE_UP_ORDERS}, got {gate_up!r}")
    w13_scales = as_mxfp4_bytes("w13_scales", w13_scales, "scales")
    w2_scales = as_mxfp4_bytes("w2_scales", w2_scales, "scales")
    check_tensor("w13_scales", w13_scales, ndim=3)
    check_tensor("w2_scales", w2_scales, ndim=3)
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
        w13=layout.prepare_w13(w13_blocks, w13_scales, w13_bias, gate_up, device),
        w2=layout.prepare_w2(w2_blocks, w2_scales, w2_bias, device))


# Per-expert checkpoint names: (gate, up, down) projections and the scale's suffix, as Quark
# (Qwen3, gpt-oss re-exports) and DeepSeek store them.
_PROJ_NAMES = (("gate_proj", "up_proj", "down_proj", "weight_scale"), ("w1", "w3", "w2", "scale"))


def _expert_ids(tensors, prefix):
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.(?:gate_proj|w1)\.weight")
    return sorted(int(m.group(1)) for m in map(pattern.fullmatch, tensors) if m)


def stack_experts(tensors, prefix="", experts=None) -> dict:
    """Stack per-expert MXFP4 tensors into the [E, ...] arguments of `prepare_experts`.

    tensors: a mapping (a state dict, or any Mapping that reads on access) holding, for each
    expert j, ``{prefix}{j}.gate_proj.weight`` [I, H/2] and ``.weight_scale`` [I, H/32],
    ``up_proj`` likewise and ``down_proj`` [H, I/2], [H, I/32] (Quark, Qwen3); or
    ``{prefix}{j}.w1|w3|w2.weight`` and ``.scale`` (DeepSeek: int8 blocks, float8_e8m0fnu scales).
    experts: the expert ids to stack, in that order (default: every id found under prefix).
    Returns dict(w13_blocks, w13_scales, w2_blocks, w2_scales), uint8, gate rows then up rows:
    ``prepare_experts(**stack_experts(...))`` (gate_up="concat"), on the first tensor's device.
    One expert is read at a time into the preallocated result, so a lazy mapping never holds
    more than the result plus one expert.
    """
    experts = _expert_ids(tensors, prefix) if experts is None else list(experts)
    if not experts:
        raise ValueError(f"tensors: no per-expert weights named {prefix}<j>.gate_proj.weight or "
                         f"{prefix}<j>.w1.weight")
    gate, up, down, scale = next((names for names in _PROJ_NAMES
                                  if f"{prefix}{experts[0]}.{names[0]}.weight" in tensors), _PROJ_NAMES[0])

    def read(j, proj, suffix, shape):
        name = f"{prefix}{j}.{proj}.{suffix}"
        if name not in tensors:
            raise KeyError(f"tensors: missing {name!r}")
        t = as_mxfp4_bytes(name, tensors[name], "blocks" if suffix == "weight" else "scales")
        check_tensor(name, t, shape=shape)
        return t

    first = read(experts[0], gate, "weight", ("I", "H/2"))
    I, H, E = first.shape[0], 2 * first.shape[1], len(experts)
    shapes = {"w13_blocks": (2 * I, H // 2), "w13_scales": (2 * I, H // 32), "w2_blocks": (H, I // 2),
              "w2_scales": (H, I // 32)}
    out = {key: torch.empty(E, *shape, dtype=torch.uint8, device=first.device) for key, shape in shapes.items()}
    for i, j in enumerate(experts):
        for half, proj in enumerate((gate, up)):
            out["w13_blocks"][i, half * I:(half + 1) * I] = read(j, proj, "weight", (I, H // 2))
            out["w13_scales"][i, half * I:(half + 1) * I] = read(j, proj, scale, (I, H // 32))
        out["w2_blocks"][i] = read(j, down, "weight", (H, I // 2))
        out["w2_scales"][i] = read(j, down, scale, (H, I // 32))
    return out
