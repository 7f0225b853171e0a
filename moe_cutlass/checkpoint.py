"""One MoE layer's weights, read from a safetensors checkpoint or a state dict in the layouts real
checkpoints use, sharded for tensor / expert parallelism while reading (see `sharding`).

Layouts, by the names under the layer's prefix P (e.g. ``model.layers.3.mlp.``):

- ``gpt_oss`` (transformers' gpt-oss): ``P router.weight`` [E, H], ``router.bias`` [E];
  ``experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16], ``_scales`` uint8 [E, 2I, H/32],
  ``_bias`` [E, 2I], gate and up rows interleaved; ``experts.down_proj_blocks`` [E, H, I/32, 16],
  ``_scales`` [E, H, I/32], ``_bias`` [E, H].
- ``gpt_oss_original`` (OpenAI's ``original/`` checkpoint, P = ``block.L.mlp.``): ``gate.weight``,
  ``gate.bias``, ``mlp1_weight.blocks``, ``mlp1_weight.scales``, ``mlp1_bias``, ``mlp2_weight.*``,
  ``mlp2_bias``, shaped as above.
- ``per_expert`` (Quark's Qwen3, DeepSeek): ``gate.weight`` [E, H], a score correction bias
  ``gate.e_score_correction_bias`` (transformers' DeepSeek) or ``gate.bias`` (DeepSeek's own
  names), and per expert j ``experts.j.gate_proj|up_proj|down_proj.weight`` + ``weight_scale``
  or ``experts.j.w1|w3|w2.weight`` + ``scale`` (as `experts.stack_experts` reads them).

A safetensors directory is read through its ``model.safetensors.index.json``; a shard is opened
only when one of its tensors is needed, and only the slices a rank holds are read from it.
"""
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import sharding
from .experts import stack_experts

LAYOUTS = ("gpt_oss", "gpt_oss_original", "per_expert")

# A name (after the layer prefix) that only its layout has.
_LAYOUT_NAMES = {
    "gpt_oss": r"experts\.(?:gate_up|down)_proj_(?:blocks|scales|bias)",
    "gpt_oss_original": r"mlp[12]_(?:weight\.blocks|weight\.scales|bias)",
    "per_expert": r"experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w3|w2)\.(?:weight|weight_scale|scale)",
}

# The stacked layouts' tensors: router weight and bias, then W13 and W2 blocks, scales, bias.
_STACKED_NAMES = {
    "gpt_oss": dict(router_weight="router.weight", router_bias="router.bias",
                    w13_blocks="experts.gate_up_proj_blocks", w13_scales="experts.gate_up_proj_scales",
                    w13_bias="experts.gate_up_proj_bias", w2_blocks="experts.down_proj_blocks",
                    w2_scales="experts.down_proj_scales", w2_bias="experts.down_proj_bias"),
    "gpt_oss_original": dict(router_weight="gate.weight", router_bias="gate.bias",
                             w13_blocks="mlp1_weight.blocks", w13_scales="mlp1_weight.scales", w13_bias="mlp1_bias",
                             w2_blocks="mlp2_weight.blocks", w2_scales="mlp2_weight.scales", w2_bias="mlp2_bias"),
}
_CORRECTION_BIAS_NAMES = ("gate.e_score_correction_bias", "gate.bias")


class _Over(Mapping):
    """A mapping over the names of another one, ``self._tensors``."""

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self):
        return len(self._tensors)

    def __contains__(self, name):
        return name in self._tensors


class Tensors(_Over):
    """Name -> tensor, with reads of a slice: ``read(name, index)`` is ``self[name][index]``
    without materialising the rest where the storage allows it. Over a dict by default."""

    def __init__(self, tensors, where="the state dict"):
        self._tensors = tensors
        self.where = where

    def __getitem__(self, name):
        return self.read(name)


    def _missing(self, name):
        return KeyError(f"{name!r}: no such tensor in {self.where}")

    def shape(self, name):
        if name not in self:
            raise self._missing(name)
        return tuple(self._tensors[name].shape)

    def read(self, name, index=()):
        if name not in self:
            raise self._missing(name)
        return self._tensors[name][index]


class SafetensorsCheckpoint(Tensors):
    """The tensors of a safetensors checkpoint: a directory with ``model.safetensors.index.json``
    (its weight_map names each tensor's shard), a directory holding .safetensors files without
    an index, or one .safetensors file. Shards open on first use; close() (or ``with``) closes them."""

    def __init__(self, path):
        from safetensors import safe_open  # only checkpoint reading needs the package

        self._safe_open = safe_open
        self._files = {}
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if path.is_dir() and index.exists():
            weight_map = {name: path / shard for name, shard in json.loads(index.read_text())["weight_map"].items()}
        elif path.is_dir() or path.suffix == ".safetensors" and path.is_file():
            files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
            if not files:
                raise ValueError(f"path: {path} holds no .safetensors file")
            weight_map = {}
            for file in files:
                weight_map.update(dict.fromkeys(self._open(file).keys(), file))
        else:
            raise ValueError(f"path: expected a safetensors checkpoint directory or file, got {path}")
        super().__init__(weight_map, where=str(path))

    def _open(self, file):
        if file not in self._files:
            self._files[file] = self._safe_open(str(file), framework="pt", device="cpu")
        return self._files[file]

    def shape(self, name):
        if name not in self:
            raise self._missing(name)
        return tuple(self._open(self._tensors[name]).get_slice(name).get_shape())

    def read(self, name, index=()):
        if name not in self:
            raise self._missing(name)
        handle = self._open(self._tensors[name])
        return handle.get_slice(name)[index] if index else handle.get_tensor(name)

    @property
    def opened(self):
        """The shard files opened so far."""
        return sorted(self._files)

    def close(self):
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def detect_layout(tensors, prefix=""):
    """The layout of the layer whose names start with `prefix`, or None if none of them has one."""
    names = [name[len(prefix):] for name in tensors if name.startswith(prefix)]
    found = [layout for layout, pattern in _LAYOUT_NAMES.items()
             if any(re.fullmatch(pattern, name) for name in names)]
    if len(found) > 1:
        raise ValueError(f"tensors: names under {prefix!r} fit more than one layout: {found}")
    return found[0] if found else None


def find_layer(tensors, layer_index):
    """(prefix, layout) of MoE layer `layer_index`: the names ``...layers.L.<block>.`` or
    ``block.L.<block>.`` followed by a name only one layout has."""
    layer = re.compile(rf"((?:.*\.)?(?:layers|block)\.{int(layer_index)}\.[A-Za-z_]+\.)(.*)")
    prefixes = set()
    for name in tensors:
        match = layer.fullmatch(name)
        if match and any(re.fullmatch(p, match.group(2)) for p in _LAYOUT_NAMES.values()):
            prefixes.add(match.group(1))
    if not prefixes:
        raise ValueError(f"layer_index: no MoE layer {layer_index} in {getattr(tensors, 'where', 'the tensors')} "
                         f"(looked for layers.{layer_index}.*. or block.{layer_index}.*. followed by "
                         f"experts.gate_up_proj_blocks, mlp1_weight.blocks or experts.<j>.gate_proj|w1.weight)")
    if len(prefixes) > 1:
        raise ValueError(f"layer_index: layer {layer_index} matches several prefixes {sorted(prefixes)}; "
                         f"pass prefix= to choose one")
    prefix = prefixes.pop()
    return prefix, detect_layout(tensors, prefix)


@dataclass
class LayerWeights:
    """One rank's share of a MoE layer as read from a checkpoint, before preparation."""

    layout: str
    num_experts: int            # all experts (the router's outputs)
    hidden_size: int
    intermediate_size: int      # the whole layer's I (this rank holds `sharding.intermediate_range`)
    experts: dict               # prepare_experts' keyword arguments for this rank's experts and I
    router_weight: torch.Tensor
    router_bias: torch.Tensor | None
    correction_bias: torch.Tensor | None
    names: tuple                # every name read


def _read_stacked(tensors, prefix, layout, tp, ep):
    names = {key: prefix + name for key, name in _STACKED_NAMES[layout].items()}
    E, two_i, h_blocks = tensors.shape(names["w13_scales"])
    I, H = two_i // 2, 32 * h_blocks
    e0, e1 = sharding.expert_range(E, ep)
    s, t = sharding.intermediate_range(I, tp)
    experts, rows = slice(e0, e1), slice(2 * s, 2 * t)  # interleaved: the pairs of I's [s, t)
    down_k = slice(s // 32, t // 32)
    down_bytes = down_k if len(tensors.shape(names["w2_blocks"])) == 4 else slice(s // 2, t // 2)
    w2_bias = tensors.read(names["w2_bias"], (experts,))
    if tp is not None and tp[0] != 0:
        w2_bias = torch.zeros_like(w2_bias)  # the all-reduce over the TP ranks adds rank 0's
    return LayerWeights(
        layout=layout, num_experts=E, hidden_size=H, intermediate_size=I,
        experts=dict(w13_blocks=tensors.read(names["w13_blocks"], (experts, rows)),
                     w13_scales=tensors.read(names["w13_scales"], (experts, rows)),
                     w13_bias=tensors.read(names["w13_bias"], (experts, rows)),
                     w2_blocks=tensors.read(names["w2_blocks"], (experts, slice(None), down_bytes)),
                     w2_scales=tensors.read(names["w2_scales"], (experts, slice(None), down_k)),
                     w2_bias=w2_bias, gate_up="interleaved"),
        router_weight=tensors.read(names["router_weight"]), router_bias=tensors.read(names["router_bias"]),
        correction_bias=None, names=tuple(names.values()))


class _IntermediateSlice(_Over):
    """Per-expert tensors cut to the intermediate range [s, t): gate/up rows, down columns."""

    def __init__(self, tensors, s, t):
        self._tensors, self._s, self._t = tensors, s, t
        self.read_names = []

    def __getitem__(self, name):
        s, t = self._s, self._t
        if re.search(r"\.(?:down_proj|w2)\.weight$", name):
            index = (slice(None), slice(s // 2, t // 2))
        elif re.search(r"\.(?:down_proj|w2)\.", name):
            index = (slice(None), slice(s // 32, t // 32))
        else:
            index = (slice(s, t),)
        self.read_names.append(name)
        return self._tensors.read(name, index)



def _read_per_expert(tensors, prefix, tp, ep):
    router = prefix + "gate.weight"
    E, H = tensors.shape(router)
    gate = next((prefix + f"experts.0.{proj}.weight" for proj in ("gate_proj", "w1")
                 if prefix + f"experts.0.{proj}.weight" in tensors), prefix + "experts.0.gate_proj.weight")
    I = tensors.shape(gate)[0]
    e0, e1 = sharding.expert_range(E, ep)
    sliced = _IntermediateSlice(tensors, *sharding.intermediate_range(I, tp))
    experts = stack_experts(sliced, prefix + "experts.", range(e0, e1))
    correction = next((prefix + name for name in _CORRECTION_BIAS_NAMES if prefix + name in tensors), None)
    return LayerWeights(
        layout="per_expert", num_experts=E, hidden_size=H, intermediate_size=I, experts=experts,
        router_weight=tensors.read(router), router_bias=None,
        correction_bias=None if correction is None else tensors.read(correction),
        names=(router, *sliced.read_names, *([correction] if correction else [])))


def read_layer(tensors, prefix, layout, tp=None, ep=None) -> LayerWeights:
    """Rank (tp, ep)'s share of the layer under `prefix` in `layout` (see the module docstring);
    tp, ep: (rank, size) or None. A missing tensor raises KeyError naming it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    tp, ep = sharding.check_rank("tp", tp), sharding.check_rank("ep", ep)
    if layout == "per_expert":
        return _read_per_expert(tensors, prefix, tp, ep)
    return _read_stacked(tensors, prefix, layout, tp, ep)


def read_config(path):
    """The model config beside a checkpoint (config.json; a multimodal model's text_config), or {}."""
    path = Path(path)
    file = (path if path.is_dir() else path.parent) / "config.json"
    if not file.exists():
        return {}
    config = json.loads(file.read_text())
    return config.get("text_config", config)


def _first(config, *names, default=None):
    return next((config[name] for name in names if config.get(name) is not None), default)


def layer_options(weights: LayerWeights, config: dict) -> dict:
    """The MoELayer keyword arguments that a layer's layout and its model config imply (config keys
    of transformers' configs and of the models' own: DeepSeek's n_activated_experts, score_func...)."""
    options = {}
    top_k = _first(config, "num_experts_per_tok", "experts_per_token", "n_activated_experts")
    if top_k is not None:
        options["top_k"] = top_k
    if weights.layout in ("gpt_oss", "gpt_oss_original"):
        return dict(options, router="topk_softmax", router_bias=True, activation="swiglu_oai",
                    swiglu_limit=_first(config, "swiglu_limit", default=7.0), swiglu_alpha=1.702, expert_bias=True)
    scoring = _first(config, "scoring_func", "score_func", default="softmax")
    groups = _first(config, "n_group", "n_expert_groups", default=1)
    if groups > 1:
        options.update(num_expert_group=groups, topk_group=_first(config, "topk_group", "n_limited_groups"))
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config: hidden_act {hidden_act!r} is not supported (the layer's activation is silu)")
    return dict(options, router=scoring, activation="silu", swiglu_limit=config.get("swiglu_limit"),
                renormalize=_first(config, "norm_topk_prob", default=scoring != "softmax"),
                routed_scaling_factor=float(_first(config, "routed_scaling_factor", "route_scale", default=1.0)),
                correction_bias=weights.correction_bias is not None)
