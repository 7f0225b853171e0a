"""Plain-torch reference of the fused MoE layer, in float32, on any device.

It follows DESIGN.md section 2 term by term, for every token t:

    out[t] = routed_scaling_factor * sum_j topk_weights[t, j]
             * (W2_e @ act(W13_e @ x_t + b13_e) + b2_e),   e = topk_ids[t, j]

It is what the kernels are tested against, so it favours being obviously right over
being fast: it sorts the (token, slot) pairs by expert, as the expand kernel does, and
runs two float32 matmuls per expert. `finalize` is the finalize kernel in torch, bit for bit (it
only adds bf16 rows in a fixed order): the distributed layers (`parallel`) sum rows with it on CPU.
"""

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_layer_options, check_tensor


def _check_args(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit,
                swiglu_alpha, routed_scaling_factor, expert_map):
    check_tensor("hidden_states", hidden_states, dtype=FLOAT_DTYPES, shape=("M", experts.hidden_size))
    m, device = hidden_states.shape[0], hidden_states.device
    check_tensor("topk_ids", topk_ids, dtype=INDEX_DTYPES, shape=(m, "k"), device=device)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_ids.shape), device=device)
    check_layer_options(activation, swiglu_limit, swiglu_alpha, routed_scaling_factor)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtype=torch.int32, shape=("E_global",), device=device)


def _local_ids(topk_ids, expert_map, num_experts):
    """Local expert id of each (token, slot), or -1 where it contributes nothing."""
    ids = topk_ids.long()
    if expert_map is not None:
        in_map = (ids >= 0) & (ids < expert_map.numel())
        mapped = torch.full_like(ids, -1)
        mapped[in_map] = expert_map.long()[ids[in_map]]
        ids = mapped
    return torch.where((ids >= 0) & (ids < num_experts), ids, -1)


def _activate(gate, up, activation, limit, alpha):
    # Both activations clamp the same way: gate from above only, up on both sides.
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    if activation == "silu":
        return F.silu(gate) * up
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def _compute(hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit,
             swiglu_alpha, routed_scaling_factor, expert_map):
    device = hidden_states.device
    inter = experts.intermediate_size
    x = hidden_states.float()
    out = torch.zeros(x.shape[0], experts.hidden_size, dtype=torch.float32, device=device)

    k = topk_ids.shape[1]
    ids = _local_ids(topk_ids, expert_map, experts.num_experts).flatten()
    used = ids >= 0
    # Flat slots t*k + j grouped by expert, as the expand kernel orders them.
    slots = torch.nonzero(used).flatten()
    slots = slots[torch.argsort(ids[slots], stable=True)]
    counts = torch.bincount(ids[used], minlength=experts.num_experts).tolist()
    for e, expert_slots in enumerate(torch.split(slots, counts)):
        if expert_slots.numel() == 0:
            continue
        # One expert at a time: all of a large layer in float32 would not fit on a GPU.
        w13, w2, b13, b2 = (None if t is None else t[0].to(device, torch.float32)
                            for t in experts.select([e]).dequantized())
        tokens = expert_slots // k
        h = x[tokens] @ w13.T
        if b13 is not None:
            h = h + b13
        y = _activate(h[:, :inter], h[:, inter:], activation, swiglu_limit, swiglu_alpha) @ w2.T
        if b2 is not None:
            y = y + b2
        out.index_add_(0, tokens, y * topk_weights.flatten()[expert_slots, None])
    return out * routed_scaling_factor


def fused_moe_float(hidden_states, experts, topk_weights, topk_ids, activation="silu",
                    swiglu_limit=None, swiglu_alpha=1.702, routed_scaling_factor=1.0, expert_map=None):
    """The MoE layer in float32: returns float32 [M, H]. Arguments as in `fused_moe`."""
    args = (hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit,
            swiglu_alpha, routed_scaling_factor, expert_map)
    _check_args(*args)
    return _compute(*args)


def fused_moe(hidden_states, experts, topk_weights, topk_ids, activation="silu", swiglu_limit=None,
              swiglu_alpha=1.702, routed_scaling_factor=1.0, expert_map=None, out=None):
    """Reference of `moe_cutlass.fused_moe`: float32 math, result rounded to bf16 [M, H].

    hidden_states [M, H] float (bf16 in the real op); experts: PreparedExperts;
    topk_weights float32 [M, k]; topk_ids int32/int64 [M, k]; an id that is negative,
    >= E (the global count when expert_map is given) or mapped to -1 by expert_map
    (int32 [E_global], global id -> local id) contributes nothing. activation "silu"
    (silu(g) * u) or "swiglu_oai" (g * sigmoid(alpha * g) * (u + 1)); swiglu_limit L
    clamps g to <= L and u to [-L, L] first. out: optional bf16 [M, H] to write into.
    """
    args = (hidden_states, experts, topk_weights, topk_ids, activation, swiglu_limit,
            swiglu_alpha, routed_scaling_factor, expert_map)
    _check_args(*args)
    if out is None:
        return _compute(*args).to(torch.bfloat16)
    check_tensor("out", out, dtype=torch.bfloat16, shape=(hidden_states.shape[0], experts.hidden_size),
                 device=hidden_states.device)
    return out.copy_(_compute(*args))


def finalize(rows, slot_to_row, top_k, routed_scaling_factor=1.0):
    """The finalize kernel in torch, bitwise: out[t] = bf16(routed_scaling_factor * sum_j rows[slot_to_row[t*k + j]]),
    summed in float32 with j ascending, slots < 0 skipped (a token without a kept slot gets zeros).
    rows bf16 [R, H]; slot_to_row int [M * top_k]. Returns bf16 [M, H]."""
    M = slot_to_row.numel() // top_k
    index = slot_to_row.view(M, top_k).long()
    acc = torch.zeros(M, rows.shape[1], dtype=torch.float32, device=rows.device)
    for j in range(top_k):  # the kernel's order
        kept = index[:, j] >= 0
        picked = torch.zeros_like(acc)
        picked[kept] = rows[index[kept, j]].float()
        acc = acc + picked
    return (acc * routed_scaling_factor).to(torch.bfloat16)
