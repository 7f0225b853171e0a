"""The MoE layer over several GPUs: expert parallel (EP) and tensor parallel (TP) on torch.distributed.

Expert parallel: rank r holds the experts a `Placement` gives it and brings its own batch of tokens
(data-parallel attention in front of the layer). A forward takes every token to the ranks that hold
its experts and brings their outputs back. `ExpertParallel` has three strategies:

- "allgather": every rank gathers every rank's tokens (each rank's batch padded to `max_tokens`) and
  their routing, runs its experts on all of them, and a reduce-scatter sums the ranks' outputs (bf16)
  back on the token's rank. Three collectives, W * max_tokens rows each way whatever the routing:
  for small batches.
- "alltoall": a token travels only to the ranks that hold one of its experts, once per rank (with its
  k ids and weights), and each of those ranks sends back one row, its experts' share. The ranks first
  exchange their counts, which NCCL needs as host lists of split sizes: one host synchronization per
  forward, so this strategy cannot be captured in a CUDA graph.
- "alltoall_padded": the all-to-all in fixed blocks of `max_tokens` rows per pair of ranks (the most a
  rank can send another), so there are no counts to exchange and nothing is read on the host:
  capturable. It then moves as many bytes as "allgather" (W * max_tokens rows each way), and sums
  the ranks' partial outputs in float32 on the token's rank, where the reduce-scatter adds bf16.

exact=True brings back one row per (token, slot) instead of one per (token, rank): bf16(w * expert(x)),
the row the one-GPU layer rounds before its finalize and, with batch_invariant=True, the same bits
whatever batch the token is in. The token's rank sums its k rows with the layer's own finalize, in
slot order, so the output is bitwise `fused_moe(..., batch_invariant=True)` on one GPU. The price: k
rows per token travel back instead of one per token and rank (k times the reduce-scatter of
"allgather", k times the return of the all-to-alls), a received token is copied once per slot, and the
experts run with batch_invariant=True (slower at decode sizes).

Tensor parallel: every rank holds every expert cut along I (`tp_shard`: the cut of
`sharding.intermediate_range`, as vLLM makes it, with the down-projection bias on rank 0 only) and the
same tokens; `TensorParallel` all-reduces the ranks' partial outputs. Not bitwise the one-GPU layer:
the cut changes the order of GEMM2's sum over I (relative error ~1e-3, as any bf16 rounding).

The pieces between `Placement` and the layers are pure (no communication); the layers join them with
collectives, and tests/test_parallel.py runs the pieces with ranks emulated as slices. The layers
take CUDA tensors and an NCCL process group; like MoELayer they run the float32 reference on CPU
tensors (a gloo group), for tests.

Configuration is checked when a layer is built, by one collective that every rank enters before any
other (an all_gather_object of what each rank found): an error found on one rank is raised on every
rank, and no rank is left alone inside a collective. A per-call argument error is raised on its
rank before that rank enters a collective; the other ranks then wait in theirs until the process
group's timeout. NCCL's all_gather_object works on the current CUDA device: call
torch.cuda.set_device(local_rank) before init_process_group.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import layout, reference, sharding
from ._checks import INDEX_DTYPES, check_choice, check_int, check_layer_options, check_tensor
from ._ops_routing import finalize as finalize_kernel
from .experts import PreparedExperts, prepare_experts
from .layer import fused_moe
from .ops import check_experts

STRATEGIES = ("allgather", "alltoall", "alltoall_padded")


def _local_ids(name, row, whose):
    """The local ids of an expert_map row (CPU int32), sorted, checked to be 0..n-1, each once, with -1
    (another rank's expert) everywhere else."""
    local = row[row >= 0].sort().values
    if (row < -1).any() or not torch.equal(local, torch.arange(local.numel(), dtype=torch.int32)):
        raise ValueError(f"{name}: {whose} local ids must be 0..n-1, each once, and the other entries -1; got "
                         f"local ids {local.tolist()[:16]} and smallest entry {int(row.min())}")
    return local


def _check_maps(name, maps):
    """maps int [W, E], row r rank r's expert_map: every expert on exactly one rank, every rank's local ids
    0..n-1 once each, n >= 1. Returns them as int32 on the CPU."""
    check_tensor(name, maps, dtype=INDEX_DTYPES, shape=("W", "E"))
    maps = maps.to("cpu", torch.int32)
    if maps.numel() == 0:
        raise ValueError(f"{name}: expected at least one rank and one expert, got shape {list(maps.shape)}")
    held = maps >= 0
    for e, ranks in enumerate(held.sum(0).tolist()):
        if ranks != 1:
            holders = held[:, e].nonzero().flatten().tolist()
            raise ValueError(f"{name}: expert {e} is held by {'no rank' if not holders else f'ranks {holders}'}; "
                             f"every expert must be held by exactly one rank")
    for r, row in enumerate(maps):
        if _local_ids(name, row, f"rank {r}'s").numel() == 0:
            raise ValueError(f"{name}: rank {r} holds no expert")
    return maps


class Placement:
    """Which rank holds which expert, and under which local id.

    expert_maps: int [W, E], row r rank r's expert_map (global id -> local id on rank r, or -1), the map
    `fused_moe(..., expert_map=)` takes. Every expert is held by exactly one rank; a rank's local ids are
    0..n-1, each once, n >= 1. `linear` and `round_robin` build the usual ones, `from_owners` any other.
    """

    def __init__(self, expert_maps):
        self._maps = _check_maps("expert_maps", expert_maps)

    @classmethod
    def from_owners(cls, owners, world_size):
        """owners int [E]: the rank holding each expert (any number per rank, at least one); a rank's local
        ids follow the global ids."""
        check_int("world_size", world_size, 1)
        owners = torch.as_tensor(owners)
        check_tensor("owners", owners, dtype=INDEX_DTYPES, shape=("E",))
        if owners.numel() == 0 or owners.min() < 0 or owners.max() >= world_size:
            raise ValueError(f"owners: expected ranks in [0, {world_size}) for at least one expert, "
                             f"got {owners.tolist()[:16]}")
        held = owners.cpu().unsqueeze(0) == torch.arange(world_size).unsqueeze(1)
        empty = (~held.any(1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"owners: ranks {empty} of {world_size} hold no expert")
        return cls(torch.where(held, held.cumsum(1) - 1, -1))

    @classmethod
    def linear(cls, num_experts, world_size):
        """Rank r holds the run [r * E/W, (r + 1) * E/W) (as sharding.expert_range when W divides E)."""
        _check_divides(num_experts, world_size)
        return cls.from_owners(torch.arange(num_experts) // (num_experts // world_size), world_size)

    @classmethod
    def round_robin(cls, num_experts, world_size):
        """Rank r holds the experts e with e % W == r (local id e // W): neighbouring ids, which routers
        often pick together, land on different ranks."""
        _check_divides(num_experts, world_size)
        return cls.from_owners(torch.arange(num_experts) % world_size, world_size)

    @property
    def world_size(self) -> int:
        return self._maps.shape[0]

    @property
    def num_experts(self) -> int:
        return self._maps.shape[1]

    @property
    def expert_maps(self) -> torch.Tensor:
        """int32 [W, E] (a copy)."""
        return self._maps.clone()

    @property
    def owners(self) -> torch.Tensor:
        """int64 [E]: the rank holding each expert."""
        return (self._maps >= 0).long().argmax(0)

    def _check_rank(self, rank):
        check_int("rank", rank, 0, self.world_size - 1)

    def expert_map(self, rank, device=None) -> torch.Tensor:
        """int32 [E]: rank `rank`'s expert_map (global id -> local id, -1 for another rank's expert)."""
        self._check_rank(rank)
        return self._maps[rank].to(device)

    def experts_of(self, rank) -> list:
        """The global ids rank `rank` holds, in local-id order."""
        self._check_rank(rank)
        row = self._maps[rank]
        held = (row >= 0).nonzero().flatten()
        return held[row[held].argsort()].tolist()

    def local_experts(self, experts, rank) -> PreparedExperts:
        """Rank `rank`'s share of `experts` (all E of them), in local-id order."""
        check_experts(experts)
        if experts.num_experts != self.num_experts:
            raise ValueError(f"experts: expected all {self.num_experts} experts of the placement, "
                             f"got {experts.num_experts}")
        return experts.select(self.experts_of(rank))

    def __repr__(self):
        return f"Placement(world_size={self.world_size}, num_experts={self.num_experts})"


def _check_divides(num_experts, world_size):
    check_int("num_experts", num_experts, 1)
    check_int("world_size", world_size, 1)
    if num_experts % world_size:
        raise ValueError(f"world_size: {world_size} ranks do not divide num_experts={num_experts}; "
                         f"give the placement explicitly (Placement.from_owners)")


# ---- the pure pieces of a forward ----

def slot_owners(topk_ids, owners):
    """int64 [M, k]: the rank holding each slot's expert, -1 for an id outside [0, E), which contributes
    nothing. owners: int64 [E] (Placement.owners), on topk_ids' device."""
    E = owners.numel()
    ids = topk_ids.long()
    return torch.where((ids >= 0) & (ids < E), owners[ids.clamp(0, E - 1)], -1)


@dataclass(frozen=True)
class DispatchPlan:
    """Where one rank's tokens go in an all-to-all (device tensors: nothing is read on the host)."""

    sent: torch.Tensor  # bool [M, W]: token t goes to rank r (one of its slots is r's)
    position: torch.Tensor  # int64 [M, W]: its row among the tokens going to r (where sent)
    counts: torch.Tensor  # int64 [W]: the tokens going to each rank


def plan_dispatch(owner, world_size) -> DispatchPlan:
    """The plan for tokens whose slots' ranks are `owner` (slot_owners); a token's rows keep token order."""
    ranks = torch.arange(world_size, device=owner.device)
    sent = (owner.unsqueeze(2) == ranks).any(dim=1)
    return DispatchPlan(sent, sent.long().cumsum(0) - 1, sent.sum(0))


def block_starts(counts, capacity=None):
    """int64 [W]: the first row of each rank's block in a send buffer: blocks of `counts` rows back to
    back, or of `capacity` rows each (the padded all-to-all)."""
    if capacity is None:
        return counts.cumsum(0) - counts
    return torch.arange(counts.numel(), device=counts.device) * capacity


def send_index(plan, starts, rows):
    """int64 [rows]: the local token each row of the send buffer carries, -1 for padding."""
    M, W = plan.sent.shape
    dest = torch.where(plan.sent, starts + plan.position, rows)  # unsent pairs land in a scratch row
    tokens = torch.arange(M, device=dest.device).unsqueeze(1).expand(M, W)
    index = torch.full((rows + 1,), -1, dtype=torch.long, device=dest.device)
    return index.scatter_(0, dest.flatten(), tokens.flatten())[:rows]


def padded_index(num_tokens, capacity, device=None):
    """int64 [capacity]: the send rows of "allgather": the tokens in order, then padding (-1)."""
    index = torch.arange(capacity, device=device)
    return torch.where(index < num_tokens, index, -1)


def pack_tokens(hidden_states, topk_weights, topk_ids, owner, index):
    """The send buffers for the rows `index` picks (a local token, or -1 for padding): hidden rows
    [rows, H] and meta int32 [rows, 2k], the k ids (-1 where the slot contributes nothing, and for
    padding) then the bits of the k weights."""
    k = topk_ids.shape[1]
    # An id outside [0, E) becomes -1 here: in int32 a large int64 id could wrap into range.
    ids = torch.where(owner >= 0, topk_ids, -1).to(torch.int32)
    meta = torch.cat((ids, topk_weights.view(torch.int32)), dim=1)
    if hidden_states.shape[0] == 0:  # padding only: read it from one token without a slot
        hidden_states = hidden_states.new_zeros(1, hidden_states.shape[1])
        meta = torch.cat((meta.new_full((1, k), -1), meta.new_zeros(1, k)), dim=1)
    rows = index.clamp(min=0)
    meta = meta.index_select(0, rows)
    meta[:, :k].masked_fill_((index < 0).unsqueeze(1), -1)
    return hidden_states.index_select(0, rows), meta


def unpack_meta(meta):
    """(topk_weights float32 [R, k], topk_ids int32 [R, k]) from pack_tokens' meta."""
    k = meta.shape[1] // 2
    return meta[:, k:].contiguous().view(torch.float32), meta[:, :k].contiguous()


def expert_rows(hidden_states, meta, compute, exact):
    """What a rank sends back for the tokens it got (hidden [R, H], meta from pack_tokens).

    compute(hidden, topk_weights, topk_ids) -> bf16 [n, H]: the layer over this rank's experts
    (`local_layer`). exact=False: [R, H], each token's sum over this rank's slots. exact=True:
    [R * k, H], row t*k + j the slot's own row bf16(w * expert(x)) (zeros for another rank's slot),
    computed as R * k tokens of one slot each: a one-slot token's output is its row, exactly.
    """
    weights, ids = unpack_meta(meta)
    if not exact:
        return compute(hidden_states, weights, ids)
    R, k = ids.shape
    slots = hidden_states.repeat_interleave(k, dim=0)  # a copy: fused_moe takes contiguous rows
    return compute(slots, weights.reshape(R * k, 1), ids.reshape(R * k, 1))


def combine_slots(plan, starts, owner, exact):
    """int32 slot_to_row for `finalize` over the rows that come back (laid out as the send buffer, with
    k rows per token when exact). exact=False: [M * W], top_k W: token t's row from rank r, -1 where t
    did not go to r. exact=True: [M * k], top_k k: slot (t, j)'s row from the rank of its expert, -1 for
    a slot that contributes nothing."""
    if not exact:
        return torch.where(plan.sent, starts + plan.position, -1).to(torch.int32).flatten()
    k = owner.shape[1]
    rank = owner.clamp(min=0)
    row = (starts[rank] + plan.position.gather(1, rank)) * k + torch.arange(k, device=owner.device)
    return torch.where(owner >= 0, row, -1).to(torch.int32).flatten()


def own_slots(owner):
    """int32 [M * k]: slot_to_row over a token-ordered [M * k, H] block of slot rows ("allgather", exact)."""
    M, k = owner.shape
    slots = torch.arange(M * k, device=owner.device).view(M, k)
    return torch.where(owner >= 0, slots, -1).to(torch.int32).flatten()


def finalize(rows, slot_to_row, top_k, routed_scaling_factor, out):
    """out[t] = bf16(routed_scaling_factor * sum_j rows[slot_to_row[t * top_k + j]]), j ascending, in
    float32, -1 skipped: the layer's finalize kernel on CUDA, reference.finalize (the same bits) on the
    CPU. Returns out."""
    if out.is_cuda:
        finalize_kernel(rows, slot_to_row, top_k, float(routed_scaling_factor), out)
        return out
    return out.copy_(reference.finalize(rows, slot_to_row, top_k, routed_scaling_factor))


def local_layer(experts, expert_map, routed_scaling_factor, batch_invariant, **options):
    """compute(hidden, topk_weights, topk_ids, out=None): the layer over one rank's experts, fused_moe on
    CUDA tensors and the float32 reference on CPU ones (as MoELayer). options: activation, swiglu_*."""
    def compute(hidden_states, topk_weights, topk_ids, out=None):
        kw = dict(expert_map=expert_map, routed_scaling_factor=routed_scaling_factor, out=out, **options)
        if hidden_states.is_cuda:
            return fused_moe(hidden_states, experts, topk_weights, topk_ids, batch_invariant=batch_invariant, **kw)
        return reference.fused_moe(hidden_states, experts, topk_weights, topk_ids, **kw)
    return compute


def tp_shard(experts, tp) -> PreparedExperts:
    """Rank tp[0] of tp[1]'s share of `experts` for tensor parallel: every expert, cut to the part of I that
    sharding.intermediate_range gives it; the down-projection bias on rank 0 only (zeros elsewhere), so
    the all-reduce adds it once. Done on the experts' device (undo the layout, cut, prepare again)."""
    check_experts(experts)
    rank, size = sharding.check_rank("tp", tp)
    H, I = experts.hidden_size, experts.intermediate_size
    s, e = sharding.intermediate_range(I, (rank, size))
    w13_blocks, w13_scales, w13_bias = layout.unprepare_w13(experts.w13, H, I)  # gate rows, then up rows
    w2_blocks, w2_scales, w2_bias = layout.unprepare_w2(experts.w2, H, I)
    rows = torch.cat((torch.arange(s, e), torch.arange(I + s, I + e))).to(w13_blocks.device)
    if w2_bias is not None and rank != 0:
        w2_bias = torch.zeros_like(w2_bias)
    return prepare_experts(w13_blocks[:, rows], w13_scales[:, rows], w2_blocks[:, :, s // 2:e // 2],
                           w2_scales[:, :, s // 32:e // 32], w13_bias=None if w13_bias is None else w13_bias[:, rows],
                           w2_bias=w2_bias)


# ---- agreement: configuration errors raised on every rank ----

_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}


def _agree(group, check, share=None):
    """Run check() -> settings {name: value} on this rank, then gather every rank's outcome, settings and
    `share` in one all_gather_object and raise on every rank if a rank's check raised or a setting
    differs between ranks. Returns the ranks' shares."""
    try:
        found, settings = None, check()
    except Exception as exc:  # noqa: BLE001 -- whatever it is, every rank must hear of it
        found, settings = (type(exc).__name__, str(exc)), {}
    views = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, (found, settings, share), group=group)
    for rank, (error, _, _) in enumerate(views):
        if error is not None:
            raise _ERRORS.get(error[0], RuntimeError)(f"{error[1]} (on rank {rank})")
    for name, value in settings.items():
        values = [view[1][name] for view in views]
        if any(v != value for v in values):
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            if len(detail) > 200:
                detail = f"ranks {[r for r, v in enumerate(values) if v != value]} differ from this one"
            raise ValueError(f"{name}: must be the same on every rank, got {detail}")
    return [view[2] for view in views]


def _layer_settings(experts, activation, swiglu_limit, swiglu_alpha, routed_scaling_factor, batch_invariant):
    check_experts(experts)
    check_layer_options(activation, swiglu_limit, swiglu_alpha, routed_scaling_factor)
    if type(batch_invariant) is not bool:
        raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    return {"experts (hidden_size)": experts.hidden_size,
            "experts (biases)": ("bias" in experts.w13, "bias" in experts.w2), "activation": activation,
            "swiglu_limit": swiglu_limit, "swiglu_alpha": swiglu_alpha,
            "routed_scaling_factor": routed_scaling_factor, "batch_invariant": batch_invariant}


def _check_map_row(expert_map, num_local):
    """This rank's expert_map: int32 [E], its non-negative entries the local ids 0..num_local-1, once each."""
    check_tensor("expert_map", expert_map, dtype=torch.int32, shape=("E",))
    if expert_map.numel() == 0:
        raise ValueError("expert_map: expected one entry per expert, got an empty tensor")
    local = _local_ids("expert_map", expert_map.cpu(), "this rank's")
    if local.numel() != num_local:
        raise ValueError(f"expert_map: maps {local.numel()} experts to this rank, experts holds {num_local}")


# ---- the layers ----

class _OverGroup:
    """A layer over the ranks of a process group (None: the default one)."""

    def __init__(self, group):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                               "(the NCCL backend; torchrun sets its environment) before building a parallel layer")
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)


class ExpertParallel(_OverGroup):
    """The MoE layer with its experts spread over the ranks of `group` (see the module docstring).

    experts: this rank's experts in local-id order (`placement.local_experts(all_experts, rank)`).
    top_k: k, the same on every rank. placement: a Placement; or expert_map: this rank's int32 [E]
    map (global id -> local id, -1 elsewhere), the ranks' maps making the placement; with both, the
    map must be the placement's for this rank.
    strategy: "allgather", "alltoall" or "alltoall_padded"; max_tokens: the most tokens a rank passes
    in one call (required by "allgather" and "alltoall_padded", which move blocks of that size; None
    for "alltoall"). exact: bitwise the one-GPU fused_moe(..., batch_invariant=True) (the experts then
    run batch invariant whatever batch_invariant says). activation, swiglu_limit, swiglu_alpha,
    routed_scaling_factor, batch_invariant: as in fused_moe. group: the process group (default WORLD).
    Every argument but experts and expert_map must be the same on every rank; a configuration error on
    any rank is raised on every rank.
    """

    def __init__(self, experts, top_k, placement=None, *, expert_map=None, strategy="allgather", max_tokens=None,
                 exact=False, activation="silu", swiglu_limit=None, swiglu_alpha=1.702, routed_scaling_factor=1.0,
                 batch_invariant=False, group=None):
        super().__init__(group)

        def check():
            settings = _layer_settings(experts, activation, swiglu_limit, swiglu_alpha, routed_scaling_factor,
                                       batch_invariant)
            check_int("top_k", top_k, 1)
            check_choice("strategy", strategy, STRATEGIES)
            if strategy == "alltoall" and max_tokens is not None:
                raise ValueError("max_tokens: the 'alltoall' strategy sizes its buffers per call; pass None")
            if strategy != "alltoall":
                if max_tokens is None:
                    raise ValueError(f"max_tokens: the {strategy!r} strategy moves blocks of max_tokens rows; "
                                     f"give the most tokens a rank passes in one call")
                check_int("max_tokens", max_tokens, 1)
            if type(exact) is not bool:
                raise TypeError(f"exact: expected a bool, got {type(exact).__name__}")
            if placement is None and expert_map is None:
                raise ValueError("placement: give a Placement or this rank's expert_map")
            if placement is not None:
                if not isinstance(placement, Placement):
                    raise TypeError(f"placement: expected a Placement, got {type(placement).__name__}")
                if placement.world_size != self.world_size:
                    raise ValueError(f"placement: made for {placement.world_size} ranks, the group has "
                                     f"{self.world_size}")
                held = len(placement.experts_of(self.rank))
                if held != experts.num_experts:
                    raise ValueError(f"experts: holds {experts.num_experts} experts, the placement gives rank "
                                     f"{self.rank} {held}")
            if expert_map is not None:
                _check_map_row(expert_map, experts.num_experts)
                if placement is not None and expert_map.numel() != placement.num_experts:
                    raise ValueError(f"expert_map: expected {placement.num_experts} entries (the placement's "
                                     f"experts), got {expert_map.numel()}")
                if placement is not None and not torch.equal(expert_map.cpu(), placement.expert_map(self.rank)):
                    raise ValueError(f"expert_map: does not map the experts the placement gives rank {self.rank}")
            return {**settings, "experts (intermediate_size)": experts.intermediate_size, "top_k": top_k,
                    "strategy": strategy, "max_tokens": max_tokens, "exact": exact,
                    "placement": None if placement is None else placement.expert_maps.tolist(),
                    "expert_map (length)": None if expert_map is None else expert_map.numel()}

        maps = _agree(group, check, share=expert_map.tolist() if isinstance(expert_map, torch.Tensor) else None)
        if placement is None:  # then every rank gave its map: the placement is theirs
            placement = Placement(_check_maps("expert_map", torch.tensor(maps)))
        self.experts, self.placement, self.top_k = experts, placement, top_k
        self.strategy, self.max_tokens, self.exact = strategy, max_tokens, exact
        self.routed_scaling_factor = routed_scaling_factor
        device = experts.device
        self._owners = placement.owners.to(device)
        # exact: the rows come back unscaled and the token's rank scales their sum, as the one-GPU finalize does.
        self._compute = local_layer(experts, placement.expert_map(self.rank, device),
                                    1.0 if exact else routed_scaling_factor, exact or batch_invariant,
                                    activation=activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)

    def __call__(self, hidden_states, topk_weights, topk_ids, out=None):
        """This rank's tokens through the layer: hidden_states bf16 [M, H] (M <= max_tokens where set, any M
        on each rank), topk_weights float32 [M, k], topk_ids int32/int64 [M, k] of global expert ids.
        Returns bf16 [M, H] (`out` when given). Every rank of the group must call it."""
        if self.strategy == "alltoall" and hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("strategy 'alltoall' reads the token counts on the host, which a CUDA graph cannot "
                               "capture; use 'alltoall_padded' or 'allgather' in a graph")
        self._check_call(hidden_states, topk_weights, topk_ids, out)
        forward = self._allgather if self.strategy == "allgather" else self._alltoall
        return forward(hidden_states, topk_weights, topk_ids, out)

    def _check_call(self, hidden_states, topk_weights, topk_ids, out):
        H, k, device = self.experts.hidden_size, self.top_k, self.experts.device
        check_tensor("hidden_states", hidden_states, dtype=torch.bfloat16, shape=("M", H), device=device,
                     contiguous=True)
        M = hidden_states.shape[0]
        check_tensor("topk_ids", topk_ids, dtype=INDEX_DTYPES, shape=(M, k), device=device, contiguous=True)
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(M, k), device=device, contiguous=True)
        if out is not None:
            check_tensor("out", out, dtype=torch.bfloat16, shape=(M, H), device=device, contiguous=True)
        if self.max_tokens is not None and M > self.max_tokens:
            raise ValueError(f"hidden_states: {M} tokens, more than max_tokens={self.max_tokens}")

    def _new_out(self, hidden_states, out):
        return torch.empty_like(hidden_states) if out is None else out

    def _allgather(self, hidden_states, topk_weights, topk_ids, out):
        W, H, k, cap = self.world_size, self.experts.hidden_size, self.top_k, self.max_tokens
        M = hidden_states.shape[0]
        owner = slot_owners(topk_ids, self._owners)
        x, meta = pack_tokens(hidden_states, topk_weights, topk_ids, owner,
                              padded_index(M, cap, hidden_states.device))
        all_x, all_meta = x.new_empty(W * cap, H), meta.new_empty(W * cap, 2 * k)
        dist.all_gather_into_tensor(all_x, x, group=self.group)
        dist.all_gather_into_tensor(all_meta, meta, group=self.group)
        rows = expert_rows(all_x, all_meta, self._compute, self.exact)
        # Exact: one nonzero row per slot among the ranks' (the owner's), so this sum adds zeros only.
        mine = rows.new_empty(rows.shape[0] // W, H)
        dist.reduce_scatter_tensor(mine, rows, group=self.group)
        if self.exact:
            return finalize(mine, own_slots(owner), k, self.routed_scaling_factor, self._new_out(hidden_states, out))
        return mine[:M] if out is None else out.copy_(mine[:M])

    def _alltoall(self, hidden_states, topk_weights, topk_ids, out):
        W, H, k = self.world_size, self.experts.hidden_size, self.top_k
        owner = slot_owners(topk_ids, self._owners)
        plan = plan_dispatch(owner, W)
        if self.strategy == "alltoall_padded":
            starts = block_starts(plan.counts, self.max_tokens)
            send_splits = recv_splits = None  # equal blocks
            send_rows = recv_rows = W * self.max_tokens
        else:
            recv_counts = torch.empty_like(plan.counts)
            dist.all_to_all_single(recv_counts, plan.counts, group=self.group)
            counts = torch.cat((plan.counts, recv_counts)).tolist()  # this strategy's host synchronization
            send_splits, recv_splits = counts[:W], counts[W:]
            send_rows, recv_rows = sum(send_splits), sum(recv_splits)
            starts = block_starts(plan.counts)
        x, meta = pack_tokens(hidden_states, topk_weights, topk_ids, owner, send_index(plan, starts, send_rows))
        recv_x, recv_meta = x.new_empty(recv_rows, H), meta.new_empty(recv_rows, 2 * k)
        dist.all_to_all_single(recv_x, x, recv_splits, send_splits, group=self.group)
        dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits, group=self.group)
        rows = expert_rows(recv_x, recv_meta, self._compute, self.exact)
        per_token = k if self.exact else 1
        back = rows.new_empty(send_rows * per_token, H)
        dist.all_to_all_single(back, rows, _times(send_splits, per_token), _times(recv_splits, per_token),
                               group=self.group)
        slots = combine_slots(plan, starts, owner, self.exact)
        top_k, scale = (k, self.routed_scaling_factor) if self.exact else (W, 1.0)
        return finalize(back, slots, top_k, scale, self._new_out(hidden_states, out))


def _times(splits, factor):
    return None if splits is None else [s * factor for s in splits]


class TensorParallel(_OverGroup):
    """The MoE layer with every expert cut along I over the ranks of `group` (see the module docstring).

    experts: this rank's cut (`tp_shard(all_experts, (rank, size))`). Every rank passes the same tokens
    and routing; the output is the sum of the ranks' partial outputs (an all-reduce), the same on every
    rank. Options as in fused_moe, the same on every rank; group: the process group (default WORLD).
    """

    def __init__(self, experts, *, activation="silu", swiglu_limit=None, swiglu_alpha=1.702, routed_scaling_factor=1.0,
                 batch_invariant=False, group=None):
        super().__init__(group)

        def check():
            settings = _layer_settings(experts, activation, swiglu_limit, swiglu_alpha, routed_scaling_factor,
                                       batch_invariant)
            return {**settings, "experts (num_experts)": experts.num_experts}

        _agree(group, check)
        self.experts = experts
        self._compute = local_layer(experts, None, routed_scaling_factor, batch_invariant, activation=activation,
                                    swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)

    def __call__(self, hidden_states, topk_weights, topk_ids, out=None):
        """hidden_states bf16 [M, H], topk_weights float32 [M, k], topk_ids [M, k], the same on every rank.
        Returns bf16 [M, H] (`out` when given). Every rank of the group must call it."""
        out = self._compute(hidden_states, topk_weights, topk_ids, out)
        dist.all_reduce(out, group=self.group)
        return out
