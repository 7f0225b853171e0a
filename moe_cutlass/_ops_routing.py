"""torch ops over the routing kernels: moe_cutlass::expand and moe_cutlass::finalize.

Both write into tensors the caller passes (declared in mutates_args), so a caller can
allocate them once for its largest batch and reuse views of them: no memory is allocated
per call, nothing is read back to the host, and both ops can be captured in a CUDA graph.
Arguments are validated before anything is launched. (fused_moe calls the same kernels
without the dispatcher, on buffers carved from its workspace: moe_cutlass/ops.py.)
"""

from typing import Optional

import torch

from . import _lib
from ._checks import check_float, check_int, check_slots, check_tensor
from ._device import require_sm90

MAX_EXPERTS = 512  # routing.cuh kMaxExperts
_VECTOR_BF16 = 8  # bf16 elements per 16-byte vector access


def _check_rows(name: str, t: torch.Tensor) -> None:
    """bf16 rows read/written with 16-byte vectors: unit column stride, aligned rows."""
    if t.stride(1) != 1 or t.stride(0) % _VECTOR_BF16 != 0 or t.stride(0) < t.shape[1]:
        raise ValueError(f"{name}: expected rows with unit column stride and a row stride that is a multiple of "
                         f"{_VECTOR_BF16} elements, got strides {list(t.stride())}")


def _check_bf16_matrix(name: str, t: torch.Tensor) -> tuple:
    """A CUDA bf16 [M, H] matrix whose rows the kernels move in 16-byte vectors; returns (M, H)."""
    check_tensor(name, t, dtype=torch.bfloat16, ndim=2, device="cuda")
    if t.shape[1] == 0 or t.shape[1] % _VECTOR_BF16 != 0:
        raise ValueError(f"{name}: expected a hidden size that is a positive multiple of {_VECTOR_BF16}, "
                         f"got {t.shape[1]}")
    _check_rows(name, t)
    return tuple(t.shape)


def _check_aligned(**tensors) -> None:
    # Real tensors only: fake tensors (torch.compile tracing) have no address.
    for name, t in tensors.items():
        if t.data_ptr() % 16 != 0:
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x}")


def _check_expand(hidden, topk_ids, topk_weights, expert_map, num_experts, expert_counts, expert_offsets,
                  sorted_slots, slot_to_row, gathered, row_weights, workspace):
    M, H = _check_bf16_matrix("hidden", hidden)
    dev = hidden.device
    check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), shape=(M, "k"), device=dev, contiguous=True)
    k = topk_ids.shape[1]
    check_int("topk_ids.shape[1] (top_k)", k, 1)
    check_slots("hidden, topk_ids", M, k)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(M, k), device=dev, contiguous=True)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtype=torch.int32, ndim=1, device=dev, contiguous=True)
        if expert_map.numel() == 0:  # the kernel reads a NULL map as "no map"
            raise ValueError("expert_map: expected at least one entry (global experts), got an empty tensor")
    check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    for name, t, dtype, shape in (
        ("expert_counts", expert_counts, torch.int32, (num_experts,)),
        ("expert_offsets", expert_offsets, torch.int32, (num_experts + 1,)),
        ("sorted_slots", sorted_slots, torch.int32, (M * k,)),
        ("slot_to_row", slot_to_row, torch.int32, (M * k,)),
        ("row_weights", row_weights, torch.float32, (M * k,)),
        ("workspace", workspace, torch.int32, ("n",)),
    ):
        check_tensor(name, t, dtype=dtype, shape=shape, device=dev, contiguous=True)
    check_tensor("gathered", gathered, dtype=torch.bfloat16, shape=(M * k, H), device=dev)
    _check_rows("gathered", gathered)


def expand_workspace_numel(num_tokens: int, top_k: int, num_experts: int) -> int:
    """int32 elements of expand's workspace for this many tokens (0 for small inputs)."""
    return _lib.call("mc_expand_workspace_ints", num_tokens, top_k, num_experts)


@torch.library.custom_op(
    "moe_cutlass::expand",
    mutates_args=("expert_counts", "expert_offsets", "sorted_slots", "slot_to_row", "gathered", "row_weights",
                  "workspace"),
)
def expand(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
           expert_map: Optional[torch.Tensor], num_experts: int, expert_counts: torch.Tensor,
           expert_offsets: torch.Tensor, sorted_slots: torch.Tensor, slot_to_row: torch.Tensor,
           gathered: torch.Tensor, row_weights: torch.Tensor, workspace: torch.Tensor) -> None:
    """Sorts the M*k slots (t*k + j) by local expert, stably, and gathers hidden rows in that order.

    Writes expert_counts [E], expert_offsets [E+1] (offsets[E] = kept slots), sorted_slots
    and slot_to_row [M*k] (-1 for dropped slots), gathered [M*k, H] (rows >= offsets[E]
    untouched) and row_weights [M*k]. Ids < 0 or >= E, or mapped to -1 / out of range of
    expert_map (global id -> local id), are dropped.
    """
    _check_expand(hidden, topk_ids, topk_weights, expert_map, num_experts, expert_counts, expert_offsets,
                  sorted_slots, slot_to_row, gathered, row_weights, workspace)
    _check_aligned(hidden=hidden, gathered=gathered)
    M, k = topk_ids.shape
    if M == 0:  # nothing to sort: the counts and offsets are zeros
        expert_counts.zero_()
        expert_offsets.zero_()
        return
    require_sm90(hidden.device)
    needed = expand_workspace_numel(M, k, num_experts)
    if workspace.numel() < needed:
        raise ValueError(f"workspace: expected at least {needed} int32 elements for M={M}, k={k}, "
                         f"E={num_experts}, got {workspace.numel()}")
    symbol = "mc_expand_i32" if topk_ids.dtype == torch.int32 else "mc_expand_i64"
    with torch.cuda.device(hidden.device):
        _lib.call(
            symbol,
            topk_ids.data_ptr(), topk_weights.data_ptr(), M, k,
            None if expert_map is None else expert_map.data_ptr(),
            0 if expert_map is None else expert_map.numel(), num_experts,
            hidden.data_ptr(), hidden.stride(0), hidden.shape[1],
            expert_counts.data_ptr(), expert_offsets.data_ptr(), sorted_slots.data_ptr(), slot_to_row.data_ptr(),
            gathered.data_ptr(), gathered.stride(0), row_weights.data_ptr(),
            workspace.data_ptr(), workspace.numel(),
            torch.cuda.current_stream().cuda_stream,
        )


@expand.register_fake
def _(hidden, topk_ids, topk_weights, expert_map, num_experts, expert_counts, expert_offsets, sorted_slots,
      slot_to_row, gathered, row_weights, workspace):
    _check_expand(hidden, topk_ids, topk_weights, expert_map, num_experts, expert_counts, expert_offsets,
                  sorted_slots, slot_to_row, gathered, row_weights, workspace)


def _check_finalize(rows, slot_to_row, top_k, routed_scaling_factor, out):
    M, H = _check_bf16_matrix("out", out)
    dev = out.device
    check_tensor("rows", rows, dtype=torch.bfloat16, shape=("R", H), device=dev)
    _check_rows("rows", rows)
    check_int("top_k", top_k, 1)
    check_float("routed_scaling_factor", routed_scaling_factor)
    check_tensor("slot_to_row", slot_to_row, dtype=torch.int32, shape=(M * top_k,), device=dev, contiguous=True)


@torch.library.custom_op("moe_cutlass::finalize", mutates_args=("out",))
def finalize(rows: torch.Tensor, slot_to_row: torch.Tensor, top_k: int, routed_scaling_factor: float,
             out: torch.Tensor) -> None:
    """out[t] = routed_scaling_factor * sum_j rows[slot_to_row[t*k + j]] (j ascending, float32,
    slots < 0 skipped; a token with no kept slot gets zeros), out [M, H] bf16, rows [R, H] bf16."""
    _check_finalize(rows, slot_to_row, top_k, routed_scaling_factor, out)
    _check_aligned(rows=rows, out=out)
    M = out.shape[0]
    if M == 0:
        return
    require_sm90(out.device)
    with torch.cuda.device(out.device):
        _lib.call(
            "mc_finalize",
            rows.data_ptr(), rows.stride(0), rows.shape[0], slot_to_row.data_ptr(), M, top_k, out.shape[1],
            float(routed_scaling_factor), out.data_ptr(), out.stride(0),
            torch.cuda.current_stream().cuda_stream,
        )


@finalize.register_fake
def _(rows, slot_to_row, top_k, routed_scaling_factor, out):
    _check_finalize(rows, slot_to_row, top_k, routed_scaling_factor, out)
