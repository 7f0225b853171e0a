"""`MoELayer`: a MoE block as an nn.Module, a linear router plus MXFP4 experts held as buffers.

Every tensor is a registered buffer, so `.to()`, `state_dict()` and `load_state_dict()` work as
for any module. The state dict holds the router (``router_weight`` [E, H], and as configured
``router_bias`` [E] and ``correction_bias`` [E]) and the experts in kernel layout
(`PreparedExperts.tensors()`: ``w13_blocks``, ``w13_scales``, ``w13_bias``, ``w2_*``).
`load_state_dict` also takes the layer under checkpoint names (see `checkpoint`: transformers'
and OpenAI's gpt-oss names, per-expert Qwen3 / DeepSeek names) and prepares it, sharded as the
layer is. `MoELayer.from_checkpoint` reads one layer from a safetensors checkpoint.

The forward runs `moe_cutlass.fused_moe` on CUDA tensors and the float32 reference
(`moe_cutlass.reference.fused_moe_float`) on CPU tensors: the CPU path is for tests and checks,
and slow at real sizes.
"""
import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint, layout, sharding
from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_choice, check_int, check_layer_options, check_tensor
from .experts import PreparedExperts, prepare_experts
from .layer import fused_moe
from .reference import fused_moe_float
from .routing import SCORINGS, select_experts

# "topk_softmax" (gpt-oss): top-k of the logits, softmax over those k; the others are
# select_experts' scorings (softmax over all experts then top-k: Qwen3, Mixtral; sigmoid: DeepSeek).
ROUTERS = ("topk_softmax", *SCORINGS)


class MoELayer(nn.Module):
    """A MoE layer: ``out = layer(hidden_states)`` routes with its own router,
    ``layer(hidden_states, topk_weights=w, topk_ids=ids)`` with the caller's routing.

    num_experts: all experts E (the router's outputs); hidden_size H and intermediate_size I
    (multiples of 32) of the whole layer; top_k: experts per token.
    router: how router logits ``hidden @ router_weight.T (+ router_bias)`` become the k weights
    and ids: "softmax", "sigmoid" (as `select_experts` scores), "topk_softmax" (gpt-oss), or None
    for a layer without router (every call passes topk_weights and topk_ids). renormalize,
    num_expert_group, topk_group: as in `select_experts`; correction_bias: the layer holds
    DeepSeek's score correction bias [E]; router_bias: the router linear has a bias (gpt-oss).
    router_dtype: the dtype the router computes in, None for the hidden states' dtype
    (transformers computes DeepSeek's router in float32, gpt-oss' and Qwen3's in the model dtype).
    The router's buffers are float32 and follow the module's dtype casts (``.to(torch.bfloat16)``);
    the experts' buffers keep their dtypes, which the kernels fix.
    activation, swiglu_limit, swiglu_alpha, routed_scaling_factor: as in `fused_moe`.
    expert_bias: the experts have gate/up [E, 2I] and down [E, H] biases (gpt-oss).
    tp, ep: (rank, size) or None; this rank holds the share `sharding` describes (tensor
    parallel: a slice of I, output a partial sum; expert parallel: a run of experts and the
    ``expert_map`` buffer, output this rank's experts' part). The caller sums the ranks' outputs.
    experts: a PreparedExperts holding this rank's share (default: zeros, for load_state_dict).
    device: where the buffers live (default: the experts', else torch's default device).
    """

    # State dict format: 2 since the prepared blocks' bit layout changed (layout.CODE_BITS), 3 since
    # the prepared scales became words (layout.SCALE_BIAS); an older state dict's tensors are
    # rewritten on load (_migrate_old_layouts).
    _version = 3

    def __init__(self, num_experts, hidden_size, intermediate_size, top_k, router="softmax", activation="silu", *,
                 swiglu_limit=None, swiglu_alpha=1.702, routed_scaling_factor=1.0, renormalize=True,
                 num_expert_group=None, topk_group=None, router_bias=False, correction_bias=False,
                 router_dtype=None, expert_bias=False, tp=None, ep=None, experts=None, device=None):
        super().__init__()
        check_int("num_experts", num_experts, 1)
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            check_int(name, size, 32)
            if size % 32:
                raise ValueError(f"{name}: expected a multiple of 32 (one MX block), got {size}")
        check_int("top_k", top_k, 1, num_experts)
        if router is not None:
            check_choice("router", router, ROUTERS)
        check_layer_options(activation, swiglu_limit, swiglu_alpha, routed_scaling_factor)
        if router_dtype is not None and router_dtype not in FLOAT_DTYPES:
            raise TypeError(f"router_dtype: expected None or one of {FLOAT_DTYPES}, got {router_dtype}")
        self.num_experts, self.hidden_size, self.intermediate_size, self.top_k = (
            num_experts, hidden_size, intermediate_size, top_k)
        self.router, self.router_dtype, self.renormalize = router, router_dtype, renormalize
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.activation, self.swiglu_limit, self.swiglu_alpha = activation, swiglu_limit, swiglu_alpha
        self.routed_scaling_factor = routed_scaling_factor
        self.tp, self.ep = sharding.check_rank("tp", tp), sharding.check_rank("ep", ep)
        e0, e1 = sharding.expert_range(num_experts, self.ep)
        i0, i1 = sharding.intermediate_range(intermediate_size, self.tp)
        self.num_local_experts, self.local_intermediate_size = e1 - e0, i1 - i0

        if experts is None:
            experts = PreparedExperts.zeros(self.num_local_experts, hidden_size, self.local_intermediate_size,
                                            bias=expert_bias, device=device)
        self._check_experts(experts, expert_bias)
        device = experts.device if device is None else torch.device(device)
        experts = experts.to(device)
        self._expert_names = tuple(experts.tensors())
        for name, t in experts.tensors().items():
            self.register_buffer(name, t)
        self._experts = experts  # rebuilt over the buffers after .to() and load_state_dict

        def buffer(present, *shape):
            return torch.zeros(*shape, device=device) if present and router is not None else None

        self.register_buffer("router_weight", buffer(True, num_experts, hidden_size))
        self.register_buffer("router_bias", buffer(router_bias, num_experts))
        self.register_buffer("correction_bias", buffer(correction_bias, num_experts))
        self.register_buffer("expert_map", None if ep is None else sharding.expert_map(num_experts, self.ep, device),
                             persistent=False)
        if router is not None:
            # Route one zero token: select_experts' checks of top_k, groups and scoring, once.
            self.route(torch.zeros(1, hidden_size, device=device))
        self.register_load_state_dict_pre_hook(MoELayer._migrate_old_layouts)
        self.register_load_state_dict_pre_hook(MoELayer._load_checkpoint_names)
        self.register_load_state_dict_post_hook(MoELayer._reload_experts)

    def _check_experts(self, experts, expert_bias):
        if not isinstance(experts, PreparedExperts):
            raise TypeError(f"experts: expected a PreparedExperts or None, got {type(experts).__name__}")
        want = (self.num_local_experts, self.hidden_size, self.local_intermediate_size, expert_bias)
        got = (experts.num_experts, experts.hidden_size, experts.intermediate_size, "bias" in experts.w13)
        if got != want:
            raise ValueError(f"experts: expected (experts, H, I, biases) = {want} for this rank, got {got}")

    @property
    def experts(self) -> PreparedExperts:
        """The PreparedExperts the layer holds (this rank's share), over its buffers."""
        return self._experts

    def _rebuild_experts(self, like=None):
        # Built here, not per call: deriving scale_max reads the scales back to the host.
        self._experts = PreparedExperts.from_tensors(
            self.num_local_experts, self.hidden_size, self.local_intermediate_size,
            {name: getattr(self, name) for name in self._expert_names}, like=like)

    def _apply(self, fn, recurse=True):
        # A model-wide cast (model.half(), model.to(torch.bfloat16)) must leave the prepared
        # experts' dtypes as the kernels read them; moves apply to them as to any buffer.
        dtypes = {name: getattr(self, name).dtype for name in self._expert_names}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            self._buffers[name] = self._buffers[name].to(dtype)
        self._rebuild_experts(like=self._experts)  # moved and cast, the same values
        return self

    def _reload_experts(self, incompatible_keys):
        self._rebuild_experts()

    def route(self, hidden_states):
        """(topk_weights float32 [M, k], topk_ids int32 [M, k]) for hidden_states [M, H]."""
        if self.router is None:
            raise ValueError("topk_ids: this layer has no router (router=None); pass topk_weights and topk_ids")
        dtype = hidden_states.dtype if self.router_dtype is None else self.router_dtype
        bias = None if self.router_bias is None else self.router_bias.to(dtype)
        logits = F.linear(hidden_states.to(dtype), self.router_weight.to(dtype), bias)
        if self.router == "topk_softmax":
            scoring, order = "softmax", "topk_then_softmax"
        else:
            scoring, order = self.router, "softmax_then_topk"
        return select_experts(logits, self.top_k, scoring=scoring, renormalize=self.renormalize,
                              num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                              correction_bias=self.correction_bias, order=order)

    def forward(self, hidden_states, topk_weights=None, topk_ids=None):
        """hidden_states [..., H] float; topk_weights [..., k] float and topk_ids [..., k] int32/int64
        (both or neither). Returns [..., H] in hidden_states' dtype (bf16 inside the kernels)."""
        check_tensor("hidden_states", hidden_states, dtype=FLOAT_DTYPES)
        if hidden_states.ndim == 0 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected a tensor [..., {self.hidden_size}], "
                             f"got {list(hidden_states.shape)}")
        x = hidden_states.reshape(-1, self.hidden_size)
        if (topk_weights is None) != (topk_ids is None):
            raise ValueError("topk_weights, topk_ids: give both or neither")
        if topk_ids is None:
            topk_weights, topk_ids = self.route(x)
        else:
            lead = tuple(hidden_states.shape[:-1])
            check_tensor("topk_ids", topk_ids, dtype=INDEX_DTYPES, shape=(*lead, "k"))
            check_tensor("topk_weights", topk_weights, dtype=FLOAT_DTYPES, shape=tuple(topk_ids.shape))
            topk_ids = topk_ids.reshape(x.shape[0], -1)
            topk_weights = topk_weights.reshape(x.shape[0], -1).float()
        options = dict(activation=self.activation, swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha,
                       routed_scaling_factor=self.routed_scaling_factor, expert_map=self.expert_map)
        if x.device.type == "cuda":
            out = fused_moe(x.to(torch.bfloat16).contiguous(), self.experts, topk_weights.contiguous(),
                            topk_ids.contiguous(), **options)
        else:
            out = fused_moe_float(x, self.experts, topk_weights, topk_ids, **options)
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)

    @staticmethod
    def _router_state(weights):
        """The state dict entries of the router tensors read from a checkpoint."""
        routing = {"router_weight": weights.router_weight, "router_bias": weights.router_bias,
                   "correction_bias": weights.correction_bias}
        return {name: t for name, t in routing.items() if t is not None}

    def _migrate_old_layouts(self, state_dict, prefix, local_metadata, *args):
        """load_state_dict pre-hook: the prepared tensors of a state dict saved before a layout
        changed (blocks' bits: version 1; scales' words: versions 1 and 2) in today's layouts, so that
        they do not load as other weights."""
        version = local_metadata.get("version", MoELayer._version)
        migrations = (("blocks", 2, layout.migrate_blocks_v1), ("scales", 3, layout.migrate_scales_v2))
        for key, since, migrate in migrations:
            for name in (f"w13_{key}", f"w2_{key}"):
                if version < since and prefix + name in state_dict:
                    state_dict[prefix + name] = migrate(state_dict[prefix + name])

    def _load_checkpoint_names(self, state_dict, prefix, *args):
        """load_state_dict pre-hook: a layer under checkpoint names becomes this layer's entries."""
        ours = {name[len(prefix):]: t for name, t in state_dict.items() if name.startswith(prefix)}
        layout = checkpoint.detect_layout(ours)
        if layout is None:
            return
        weights = checkpoint.read_layer(checkpoint.Tensors(ours), "", layout, self.tp, self.ep)
        got = (weights.num_experts, weights.hidden_size, weights.intermediate_size)
        want = (self.num_experts, self.hidden_size, self.intermediate_size)
        if got != want:
            raise ValueError(f"state_dict: holds a layer of (experts, H, I) = {got}, this layer is {want}")
        for name in set(weights.names):
            del state_dict[prefix + name]
        device = getattr(self, self._expert_names[0]).device
        state = prepare_experts(**weights.experts, device=device).tensors() | self._router_state(weights)
        state_dict.update({prefix + name: t for name, t in state.items()})

    @classmethod
    def from_checkpoint(cls, path, layer_index, tp=None, ep=None, device="cuda", prefix=None, **options):
        """MoE layer `layer_index` of a safetensors checkpoint (a directory with
        model.safetensors.index.json, or one file), this rank's share for tp / ep = (rank, size).

        The layout (gpt-oss HF names, original gpt-oss names, per-expert names) is found from the
        tensor names; only the shards holding the layer are opened and only this rank's slices
        read. The layer's options come from the layout and the config.json beside the weights
        (`checkpoint.layer_options`); `options` (any MoELayer keyword) override them. prefix:
        the layer's name prefix, where more than one fits layer_index (e.g. "model.layers.3.mlp.").
        """
        with checkpoint.SafetensorsCheckpoint(path) as tensors:
            if prefix is None:
                prefix, layout = checkpoint.find_layer(tensors, layer_index)
            else:
                layout = checkpoint.detect_layout(tensors, prefix)
                if layout is None:
                    raise ValueError(f"prefix: no MoE layer tensors under {prefix!r} in {path}")
            weights = checkpoint.read_layer(tensors, prefix, layout, tp, ep)
        kwargs = {**checkpoint.layer_options(weights, checkpoint.read_config(path)), **options}
        if "top_k" not in kwargs:
            raise ValueError(f"top_k: {path} has no config.json giving num_experts_per_tok; pass top_k=")
        experts = prepare_experts(**weights.experts, device=device)
        layer = cls(weights.num_experts, weights.hidden_size, weights.intermediate_size, experts=experts,
                    tp=tp, ep=ep, device=device, **kwargs)
        layer.load_state_dict(experts.tensors() | layer._router_state(weights))
        return layer

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, top_k={self.top_k}, router={self.router!r}, "
                f"activation={self.activation!r}, tp={self.tp}, ep={self.ep}")
