"""Top-k expert selection from router logits (plain torch, any device).

Modes, as the models define them:
- softmax (Qwen3, Mixtral): softmax over all experts, top-k, optionally renormalized.
- order="topk_then_softmax" (gpt-oss): top-k of the logits, softmax over those k.
- sigmoid (DeepSeek V3): sigmoid scores; correction_bias and expert groups steer WHICH
  experts are chosen, while the weights are the chosen experts' unbiased scores.
- sqrtsoftplus (DeepSeek V4): scores sqrt(softplus(logits)), otherwise as sigmoid.
- hash routing (DeepSeek V4's first layers): a table [vocab, k] gives each token id its
  experts; the weights are still those experts' scores of the router logits.

Tie order: on equal choice scores the lower expert id wins, and the k ids come out best
first. torch.topk leaves ties unspecified (on the CPU it returns [1, 5, 4] for the values
[1, 2, 2, 0, 2, 2, 1] and k=3), so experts are ranked with a stable sort instead; a NaN
score ranks above every number, as in torch.topk.
"""

import torch
import torch.nn.functional as F

from ._checks import FLOAT_DTYPES, INDEX_DTYPES, check_choice, check_int, check_tensor

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
ORDERS = ("softmax_then_topk", "topk_then_softmax")


def _check_args(router_logits, top_k, scoring, num_expert_group, topk_group, correction_bias, order,
                token_ids, hash_table):
    check_tensor("router_logits", router_logits, dtype=FLOAT_DTYPES, shape=("M", "E"))
    num_tokens, num_experts = router_logits.shape
    check_choice("scoring", scoring, SCORINGS)
    check_choice("order", order, ORDERS)
    if order == "topk_then_softmax" and scoring != "softmax":
        raise ValueError(f"order: 'topk_then_softmax' needs scoring='softmax', got scoring={scoring!r}")
    check_int("top_k", top_k, 1, num_experts)
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, dtype=FLOAT_DTYPES, shape=(num_experts,),
                     device=router_logits.device)
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError("num_expert_group, topk_group: give both or neither, got "
                         f"num_expert_group={num_expert_group}, topk_group={topk_group}")
    if num_expert_group is not None:
        check_int("num_expert_group", num_expert_group, 1, num_experts)
        if num_experts % num_expert_group != 0:
            raise ValueError(f"num_expert_group: expected a divisor of the expert count {num_experts}, "
                             f"got {num_expert_group}")
        check_int("topk_group", topk_group, 1, num_expert_group)
        kept = topk_group * (num_experts // num_expert_group)
        if top_k > kept:
            raise ValueError(f"top_k: expected at most {kept} (the experts in topk_group={topk_group} "
                             f"groups of {num_experts // num_expert_group}), got {top_k}")
    if (token_ids is None) != (hash_table is None):
        raise ValueError("token_ids, hash_table: hash routing needs both, got "
                         f"token_ids={'a tensor' if token_ids is not None else None}, "
                         f"hash_table={'a tensor' if hash_table is not None else None}")
    if hash_table is not None:
        device = router_logits.device
        check_tensor("hash_table", hash_table, dtype=INDEX_DTYPES, shape=("vocab", top_k), device=device)
        if hash_table.shape[0] == 0:
            raise ValueError(f"hash_table: expected at least one row (token id), got {list(hash_table.shape)}")
        check_tensor("token_ids", token_ids, dtype=INDEX_DTYPES, shape=(num_tokens,), device=device)
        # The table alone chooses the experts: whatever else would steer the choice is a mistake.
        for name, value in (("correction_bias", correction_bias), ("num_expert_group", num_expert_group)):
            if value is not None:
                raise ValueError(f"{name}: hash routing takes its experts from hash_table, so {name} "
                                 f"must be None")
        if order != "softmax_then_topk":
            raise ValueError(f"order: hash routing takes its experts from hash_table, got order={order!r}")


def _rank(scores, k):
    """Indices of the k largest scores along the last dim, best first, lower index first on ties."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def _keep_best_groups(choice, num_groups, keep, by_top2):
    """choice [M, E] with every expert outside the `keep` best groups set to -inf.

    A group's score is the sum of its two best choice scores when `by_top2` (DeepSeek V3,
    which routes with a correction bias), else its best score (DeepSeek V2).
    """
    m, num_experts = choice.shape
    grouped = choice.view(m, num_groups, num_experts // num_groups)
    if by_top2:
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    else:
        group_score = grouped.amax(dim=-1)
    best = _rank(group_score, keep)
    kept = torch.zeros(m, num_groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(m, num_experts)


def _hashed(token_ids, hash_table, num_experts):
    """(ids [M, k] int64, valid [M, k]): the table's row of each token.

    A token id outside the table, or a table entry outside [0, E), gives an invalid slot
    (id -1, weight 0), which fused_moe skips: checking the values here would cost a
    device-to-host synchronization.
    """
    vocab = hash_table.shape[0]
    tokens = token_ids.long()
    known = (tokens >= 0) & (tokens < vocab)
    ids = hash_table[tokens.clamp(0, vocab - 1)].long()
    valid = known.unsqueeze(-1) & (ids >= 0) & (ids < num_experts)
    return torch.where(valid, ids, -1), valid


def select_experts(router_logits, top_k, scoring="softmax", renormalize=True, num_expert_group=None,
                   topk_group=None, correction_bias=None, order="softmax_then_topk", token_ids=None,
                   hash_table=None):
    """Pick top_k experts per token: returns (topk_weights float32 [M, k], topk_ids int32 [M, k]).

    router_logits [M, E] float. scoring "softmax", "sigmoid" or "sqrtsoftplus"
    (sqrt(softplus(logits)), DeepSeek V4). correction_bias [E] is added to the scores only
    to choose experts. num_expert_group/topk_group: split the E experts into groups, keep
    the topk_group best groups, choose among their experts. renormalize: scale the k
    weights to sum to 1 (DeepSeek V4 does, for sigmoid and sqrtsoftplus). order
    "topk_then_softmax" (softmax only): choose on the logits and softmax the k chosen
    logits (weights then sum to 1 anyway). routed_scaling_factor is fused_moe's to apply.

    Hash routing (DeepSeek V4's first layers): token_ids int [M] (the token of each row)
    and hash_table int [vocab, top_k] (the checkpoint's tid2eid) choose the experts, in the
    table's order; the weights are those experts' scores, renormalized as above. A token id
    outside the table or a table entry outside [0, E) gives id -1 and weight 0 in that slot.

    On equal choice scores the lower expert id wins; ids come out best first.
    """
    _check_args(router_logits, top_k, scoring, num_expert_group, topk_group, correction_bias, order,
                token_ids, hash_table)
    logits = router_logits.float()
    if order == "topk_then_softmax":
        scores = logits  # softmax is monotonic, so the logits choose the same experts
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()

    if hash_table is not None:
        topk_ids, valid = _hashed(token_ids, hash_table, logits.shape[1])
        topk_weights = torch.where(valid, scores.gather(1, topk_ids.clamp(min=0)), 0.0)
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if num_expert_group is not None:
            choice = _keep_best_groups(choice, num_expert_group, topk_group, by_top2=correction_bias is not None)
        topk_ids = _rank(choice, top_k)
        topk_weights = scores.gather(1, topk_ids)

    if order == "topk_then_softmax":
        topk_weights = topk_weights.softmax(dim=-1)
    elif renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        if hash_table is not None:  # a token with no valid slot: 0 / 0
            topk_weights = torch.where(valid, topk_weights, 0.0)
    return topk_weights, topk_ids.to(torch.int32)
