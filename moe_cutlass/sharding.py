"""Which part of a MoE layer one rank holds, as vLLM shards it (pure arithmetic, no communication).

- Tensor parallel (tp = (rank, size)): every rank holds every expert, cut along the intermediate
  size I in whole MX blocks of 32: ceil((I / 32) / size) blocks per rank, the last rank takes
  what is left (gpt-oss-120b, I = 2880 = 90 blocks on 4 ranks: 736, 736, 736, 672). Each rank's
  output is a partial sum; the down-projection bias belongs to rank 0 only, so the all-reduce
  adds it once.
- Expert parallel (ep = (rank, size)): rank r holds a contiguous run of experts, the first
  E % size ranks one more than the others, and an ``expert_map`` int32 [E] (global id -> local
  id, or -1 for another rank's expert) that `fused_moe` takes. The ranks' outputs sum to the
  full layer.
"""
import torch

from ._checks import check_int

MX_BLOCK = 32


def check_rank(name, rank_size):
    """(rank, size) with 0 <= rank < size, or None."""
    if rank_size is None:
        return None
    if not isinstance(rank_size, (tuple, list)) or len(rank_size) != 2:
        raise TypeError(f"{name}: expected (rank, size) or None, got {rank_size!r}")
    rank, size = rank_size
    check_int(f"{name} size", size, 1)
    check_int(f"{name} rank", rank, 0, size - 1)
    return int(rank), int(size)


def intermediate_range(intermediate_size, tp):
    """[start, end) of I that rank tp[0] of tp[1] holds (the whole of I for tp None)."""
    if tp is None:
        return 0, intermediate_size
    rank, size = check_rank("tp", tp)
    per_rank = -(-intermediate_size // MX_BLOCK // size) * MX_BLOCK
    start, end = rank * per_rank, min((rank + 1) * per_rank, intermediate_size)
    if start >= end:
        raise ValueError(f"tp: rank {rank} of {size} gets no part of intermediate size {intermediate_size} "
                         f"({intermediate_size // MX_BLOCK} blocks of {MX_BLOCK}); use at most "
                         f"{-(-intermediate_size // per_rank)} ranks")
    return start, end


def expert_range(num_experts, ep):
    """[start, end) of the global expert ids that rank ep[0] of ep[1] holds (all for ep None)."""
    if ep is None:
        return 0, num_experts
    rank, size = check_rank("ep", ep)
    if size > num_experts:
        raise ValueError(f"ep: {size} ranks for {num_experts} experts leaves some rank without one")
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def expert_map(num_experts, ep, device=None):
    """int32 [num_experts]: global id -> local id on rank ep[0], -1 for another rank's expert."""
    start, end = expert_range(num_experts, ep)
    mapping = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    mapping[start:end] = torch.arange(end - start, dtype=torch.int32, device=device)
    return mapping
