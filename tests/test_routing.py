import math

import pytest
import torch

from moe_cutlass.routing import select_experts


def _sigmoid(v):
    return 1 / (1 + math.exp(-v))


def _logit(p):
    return math.log(p / (1 - p))


def _check(weights, ids, expected_ids, expected_weights):
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert ids.tolist() == expected_ids
    assert torch.allclose(weights, torch.tensor(expected_weights, dtype=torch.float32), rtol=1e-6, atol=0)


LOGITS = torch.tensor([[1.0, 2.0, 3.0, 0.0]])


def test_softmax_renormalized():
    # exp(3) / (exp(3) + exp(2)) = sigmoid(1)
    _check(*select_experts(LOGITS, 2), [[2, 1]], [[_sigmoid(1), _sigmoid(-1)]])


def test_softmax_not_renormalized():
    total = sum(math.exp(v) for v in (1, 2, 3, 0))
    _check(*select_experts(LOGITS, 2, renormalize=False), [[2, 1]],
           [[math.exp(3) / total, math.exp(2) / total]])


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_then_softmax(renormalize):
    # gpt-oss: the two best logits, softmaxed over themselves; the weights sum to 1 either way.
    got = select_experts(LOGITS, 2, renormalize=renormalize, order="topk_then_softmax")
    _check(*got, [[2, 1]], [[_sigmoid(1), _sigmoid(-1)]])


def test_softmax_rows_are_independent_and_bf16_logits_work():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 3.0]], dtype=torch.bfloat16)
    weights, ids = select_experts(logits, 1)
    _check(weights, ids, [[1], [0]], [[1.0], [1.0]])


SIGMOID_LOGITS = torch.tensor([[0.0, 1.0, -1.0, 2.0]])


def test_sigmoid():
    _check(*select_experts(SIGMOID_LOGITS, 2, scoring="sigmoid", renormalize=False), [[3, 1]],
           [[_sigmoid(2), _sigmoid(1)]])
    total = _sigmoid(2) + _sigmoid(1)
    _check(*select_experts(SIGMOID_LOGITS, 2, scoring="sigmoid"), [[3, 1]],
           [[_sigmoid(2) / total, _sigmoid(1) / total]])


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_correction_bias_changes_choice_not_weights(scoring):
    # The bias lifts expert 2 (the worst score) to the top; its weight stays its own score.
    bias = torch.tensor([0.0, 0.0, 2.0, 0.0])
    weights, ids = select_experts(SIGMOID_LOGITS, 2, scoring=scoring, renormalize=False, correction_bias=bias)
    scores = SIGMOID_LOGITS.sigmoid() if scoring == "sigmoid" else SIGMOID_LOGITS.softmax(-1)
    _check(weights, ids, [[2, 3]], [[scores[0, 2].item(), scores[0, 3].item()]])


# Sigmoid scores of 8 experts in 4 groups of 2. Expert 0 is the best single expert, but
# its group's top-2 sum (1.0) is below those of groups 1 (1.22) and 2 (1.11).
GROUP_SCORES = [0.95, 0.05, 0.60, 0.62, 0.55, 0.56, 0.10, 0.10]
GROUP_LOGITS = torch.tensor([[_logit(p) for p in GROUP_SCORES]])


def test_groups_with_bias_rank_by_top2_sum_and_can_drop_the_best_expert():
    weights, ids = select_experts(GROUP_LOGITS, 2, scoring="sigmoid", renormalize=False, num_expert_group=4,
                                  topk_group=2, correction_bias=torch.zeros(8))
    _check(weights, ids, [[3, 2]], [[0.62, 0.60]])


def test_groups_with_bias_choose_by_biased_scores():
    # The bias lifts group 3 (top-2 sum 0.2 + 2 * 0.6) above group 2, and expert 7 within it.
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.6, 0.7])
    weights, ids = select_experts(GROUP_LOGITS, 3, scoring="sigmoid", num_expert_group=4, topk_group=2,
                                  correction_bias=bias)
    _check(weights, ids, [[7, 6, 3]], [[0.10 / 0.82, 0.10 / 0.82, 0.62 / 0.82]])


def test_groups_without_bias_rank_by_best_expert():
    # DeepSeek V2 / vLLM without a bias: a group scores its best expert, so groups 0 and 1 stay.
    weights, ids = select_experts(GROUP_LOGITS, 2, scoring="sigmoid", renormalize=False, num_expert_group=4,
                                  topk_group=2)
    _check(weights, ids, [[0, 3]], [[0.95, 0.62]])


def test_groups_are_per_token():
    logits = torch.cat([GROUP_LOGITS, GROUP_LOGITS.flip(-1)])
    _, ids = select_experts(logits, 2, scoring="sigmoid", num_expert_group=4, topk_group=2,
                            correction_bias=torch.zeros(8))
    assert ids.tolist() == [[3, 2], [4, 5]]


def test_empty_batch():
    weights, ids = select_experts(torch.zeros(0, 8), 2, scoring="sigmoid", num_expert_group=4, topk_group=2)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("logits,kwargs,error,message", [
    (torch.zeros(8), {}, ValueError, "router_logits: expected .* of shape \\[M, E\\], got float32 \\[8\\]"),
    (torch.zeros(2, 8, dtype=torch.int32), {}, TypeError, "router_logits: "),
    (torch.zeros(2, 8), dict(top_k=0), ValueError, "top_k: expected an int in \\[1, 8\\], got 0"),
    (torch.zeros(2, 8), dict(top_k=9), ValueError, "top_k: expected an int in \\[1, 8\\], got 9"),
    (torch.zeros(2, 8), dict(top_k=2.0), TypeError, "top_k: "),
    (torch.zeros(2, 8), dict(scoring="relu"), ValueError, "scoring: expected one of 'softmax', 'sigmoid'"),
    (torch.zeros(2, 8), dict(order="random"), ValueError, "order: "),
    (torch.zeros(2, 8), dict(scoring="sigmoid", order="topk_then_softmax"), ValueError, "order: "),
    (torch.zeros(2, 8), dict(num_expert_group=3, topk_group=1), ValueError, "num_expert_group: .*divisor"),
    (torch.zeros(2, 8), dict(num_expert_group=4, topk_group=5), ValueError, "topk_group: "),
    (torch.zeros(2, 8), dict(num_expert_group=4), ValueError, "topk_group"),
    (torch.zeros(2, 8), dict(top_k=5, num_expert_group=4, topk_group=2), ValueError, "top_k: expected at most 4"),
    (torch.zeros(2, 8), dict(correction_bias=torch.zeros(7)), ValueError, "correction_bias: .*shape \\[8\\]"),
])
def test_bad_arguments_raise_naming_them(logits, kwargs, error, message):
    kwargs = {"top_k": 2, **kwargs}
    with pytest.raises(error, match=message):
        select_experts(logits, **kwargs)
