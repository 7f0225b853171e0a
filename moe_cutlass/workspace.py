"""The workspace of fused_moe: every buffer a call needs besides its output, in one uint8 tensor.

An engine that budgets memory up front asks `workspace_size(max_tokens, top_k, experts)`,
allocates it (or lets `allocate_workspace` do so) and passes `fused_moe(..., workspace=ws)`;
one workspace serves every layer of that shape, since the calls of one stream run in order.
Without one, fused_moe keeps a workspace per (device, stream, layer shape), grown for the
largest batch seen; `free_workspaces()` drops them (not while a CUDA graph that captured a
call is still to be replayed: the graph keeps writing to the memory it captured). A workspace
that does not fit in the GPU's memory is a torch.OutOfMemoryError that names it and the call.

The pieces sit at byte offsets fixed by (max_tokens, top_k, E, H, I) and the SM count, not by
the batch: a smaller batch uses the front of each piece, so the kernels see the same pointers
call after call (the GEMM launcher then reuses its encoded TMA descriptors).
"""
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _gemm
from ._checks import check_int, check_slots
from ._device import device_index
from ._ops_routing import expand_workspace_numel
from .experts import PreparedExperts

ALIGNMENT = 256  # bytes at which every piece starts (the kernels need 16)
GEMM_KINDS = (1, 2)  # GEMM1: gate/up + activation; GEMM2: down x routing weight


class Pieces(NamedTuple):
    """Byte offsets of the pieces in a workspace, and the sizes the kernels are told."""

    gemm1_workspace: int  # uint8, CUTLASS's per-SM state of GEMM1 (large enough for any GEMM1 config)
    gemm2_workspace: int  # the same for GEMM2
    expert_counts: int  # int32 [E]
    expert_offsets: int  # int32 [E + 1]
    expand_workspace: int  # int32 [expand_workspace_ints]
    sorted_slots: int  # int32 [max_tokens * k]
    slot_to_row: int  # int32 [max_tokens * k]
    row_weights: int  # float32 [max_tokens * k]
    gathered: int  # bf16 [max_tokens * k, H]: the rows in expert order, then GEMM2's output
    inter: int  # bf16 [max_tokens * k, I]: GEMM1's output, GEMM2's input
    gemm_workspace_bytes: tuple  # (GEMM1, GEMM2)
    expand_workspace_ints: int
    total: int  # bytes of the whole workspace


def carve(max_tokens, top_k, E, H, I, gemm_workspace_bytes, expand_workspace_ints) -> Pieces:
    """Pieces of a workspace for up to max_tokens tokens (pure arithmetic)."""
    slots = max_tokens * top_k
    sizes = (*gemm_workspace_bytes, 4 * E, 4 * (E + 1), 4 * max(1, expand_workspace_ints), 4 * slots, 4 * slots,
             4 * slots, 2 * slots * H, 2 * slots * I)
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGNMENT) * ALIGNMENT
    return Pieces(*offsets, gemm_workspace_bytes=tuple(gemm_workspace_bytes),
                  expand_workspace_ints=expand_workspace_ints, total=end)


@functools.lru_cache(maxsize=256)
def pieces(max_tokens: int, top_k: int, E: int, H: int, I: int, index: int) -> Pieces:
    """carve() with the sizes the built library asks for on CUDA device `index` (cached: every call needs it)."""
    device = torch.device("cuda", index)
    gemm_bytes = tuple(max(_gemm.workspace_size(c, E, device) for c in _gemm.configs_of(kind)) for kind in GEMM_KINDS)
    return carve(max_tokens, top_k, E, H, I, gemm_bytes, expand_workspace_numel(max_tokens, top_k, E))


@dataclass(frozen=True)
class Workspace:
    """A caller-owned workspace: `buffer`, a uint8 CUDA tensor of at least
    workspace_size(max_tokens, ...) bytes, serves calls of up to `max_tokens` tokens.
    Wrap an engine's own buffer as Workspace(buffer, max_tokens)."""

    buffer: torch.Tensor
    max_tokens: int


def _check_sizes(max_tokens, top_k, experts):
    check_int("max_tokens", max_tokens, 0)
    check_int("top_k", top_k, 1)
    check_slots("max_tokens, top_k", max_tokens, top_k)
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts: expected the PreparedExperts that moe_cutlass.prepare_experts returns, "
                        f"got {type(experts).__name__}")


def workspace_size(max_tokens: int, top_k: int, experts: PreparedExperts, device=None) -> int:
    """Bytes of a workspace for fused_moe calls of up to max_tokens tokens with top_k experts per
    token on `experts` (on `device`, by default the experts' device; the size depends on its SM count)."""
    _check_sizes(max_tokens, top_k, experts)
    index = device_index(experts.device if device is None else device)
    return pieces(max_tokens, top_k, experts.num_experts, experts.hidden_size, experts.intermediate_size, index).total


def out_of_memory(buffer: str, nbytes: int, device, sizes: dict, remedy: str) -> torch.OutOfMemoryError:
    """The error for an allocation that did not fit (raise it from torch's): which buffer, how large,
    for which call, and what to do instead. Still an OutOfMemoryError, the type engines catch to
    retry with a smaller batch. Built only on failure: a call never asks the driver for its free
    memory, which would cost host time every time."""
    named = ", ".join(f"{name}={value}" for name, value in sizes.items())
    return torch.OutOfMemoryError(f"{buffer}: {nbytes} bytes ({nbytes / 2**30:.2f} GiB) for {named} do not fit in "
                                  f"the free memory of {device}; {remedy}")


def _allocate(size, device, sizes, remedy) -> torch.Tensor:
    try:
        return torch.empty(size, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as e:
        raise out_of_memory("workspace", size, device, sizes, remedy) from e


def allocate_workspace(max_tokens: int, top_k: int, experts: PreparedExperts, device=None) -> Workspace:
    """A Workspace for fused_moe calls of up to max_tokens tokens (see workspace_size)."""
    device = experts.device if device is None else torch.device(device)
    sizes = dict(max_tokens=max_tokens, top_k=top_k, E=experts.num_experts, H=experts.hidden_size,
                 I=experts.intermediate_size)
    return Workspace(_allocate(workspace_size(max_tokens, top_k, experts, device), device, sizes,
                               "ask for fewer max_tokens"), max_tokens)


_cache = {}


def cached_workspace(num_tokens, top_k, E, H, I, index, stream) -> Workspace:
    """The workspace fused_moe uses on CUDA device `index` and `stream` when the caller gives none,
    grown to num_tokens if smaller."""
    # Per stream: two launches in flight must not share CUTLASS's per-SM workspace.
    key = (index, stream, top_k, E, H, I)
    workspace = _cache.get(key)
    if workspace is None or workspace.max_tokens < num_tokens:
        # Free the old one before allocating the larger one; if that fails, the key holds nothing
        # and the next call allocates what it needs afresh.
        _cache.pop(key, None)
        buffer = _allocate(pieces(num_tokens, top_k, E, H, I, index).total, torch.device("cuda", index),
                           dict(M=num_tokens, top_k=top_k, E=E, H=H, I=I),
                           "call with fewer tokens (split the batch), or budget the memory up front: a workspace "
                           "for the largest batch (moe_cutlass.allocate_workspace) passed as workspace=")
        workspace = _cache[key] = Workspace(buffer, num_tokens)
    return workspace


def free_workspaces() -> None:
    """Drop the workspaces fused_moe allocated for calls without one (caller-owned ones stay)."""
    _cache.clear()
