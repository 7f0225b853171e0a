"""Top-k expert selection from router logits (plain torch, any device).

Modes, as the models define them:
- softmax (Qwen3, Mixtral): softmax over all experts, top-k, optionally renormalized.
- order="topk_then_softmax" (gpt-oss): top-k of the logits, softmax over those k.
- sigmoid (DeepSeek V3): sigmoid scores; correction_bias and expert groups steer WHICH
  experts are chosen, while the weights are the chosen experts' unbiased scores.
"""

import torch

from ._checks import FLOAT_DTYPES, check_choice, check_int, check_tensor

SCORINGS = ("softmax", "sigmoid")
ORDERS = ("softmax_then_topk", "topk_then_softmax")


def _check_args(router_logits, top_k, scoring, num_expert_group, topk_group, correction_bias, order):
    check_tensor("router_logits", router_logits, dtype=FLOAT_DTYPES, shape=("M", "E"))
    num_experts = router_logits.shape[1]
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
    best = group_score.topk(keep, dim=-1).indices
    kept = torch.zeros(m, num_groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(m, num_experts)


def select_experts(router_logits, top_k, scoring="softmax", renormalize=True, num_expert_group=None,
                   topk_group=None, correction_bias=None, order="softmax_then_topk"):
    """Pick top_k experts per token: returns (topk_weights float32 [M, k], topk_ids int32 [M, k]).

    router_logits [M, E] float. scoring "softmax" or "sigmoid". correction_bias [E] is
    added to the scores only to choose experts. num_expert_group/topk_group: split the E
    experts into groups, keep the topk_group best groups, choose among their experts.
    renormalize: scale the k weights to sum to 1. order "topk_then_softmax" (softmax only):
    choose on the logits and softmax the k chosen logits (weights then sum to 1 anyway).
    """
    _check_args(router_logits, top_k, scoring, num_expert_group, topk_group, correction_bias, order)
    logits = router_logits.float()
    if order == "topk_then_softmax":
        scores = logits  # softmax is monotonic, so the logits choose the same experts
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        scores = logits.sigmoid()

    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None:
        choice = _keep_best_groups(choice, num_expert_group, topk_group, by_top2=correction_bias is not None)
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)

    if order == "topk_then_softmax":
        topk_weights = topk_weights.softmax(dim=-1)
    elif renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)
