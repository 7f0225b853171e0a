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


def _sqrtsoftplus(v):
    return math.sqrt(math.log1p(math.exp(v)))


def _deepseek_v4_gate(logits, top_k, bias=None, token_ids=None, tid2eid=None):
    """DeepSeek-V4's Gate.forward (inference/model.py) without route_scale, for comparison."""
    scores = torch.nn.functional.softplus(logits.float()).sqrt()
    choice = scores if bias is None else scores + bias
    ids = tid2eid[token_ids] if tid2eid is not None else choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids.long())
    return weights / weights.sum(dim=-1, keepdim=True), ids


def test_sqrtsoftplus():
    expected = [_sqrtsoftplus(2), _sqrtsoftplus(1)]
    _check(*select_experts(SIGMOID_LOGITS, 2, scoring="sqrtsoftplus", renormalize=False), [[3, 1]], [expected])
    _check(*select_experts(SIGMOID_LOGITS, 2, scoring="sqrtsoftplus"), [[3, 1]],
           [[v / sum(expected) for v in expected]])


def test_sqrtsoftplus_is_finite_for_extreme_logits():
    weights, ids = select_experts(torch.tensor([[-200.0, 200.0, -1e4, 1e4]]), 4, scoring="sqrtsoftplus",
                                  renormalize=False)
    assert ids.tolist() == [[3, 1, 0, 2]]
    assert torch.isfinite(weights).all() and (weights >= 0).all()
    assert weights[0, 0].item() == pytest.approx(100.0) and weights[0, 1].item() == pytest.approx(200 ** 0.5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_sqrtsoftplus_matches_deepseek_v4_gate(with_bias):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 256, generator=gen) * 3
    bias = torch.randn(256, generator=gen) * 0.5 if with_bias else None
    weights, ids = select_experts(logits, 6, scoring="sqrtsoftplus", correction_bias=bias)
    want_weights, want_ids = _deepseek_v4_gate(logits, 6, bias)
    assert torch.equal(ids, want_ids.to(torch.int32))
    assert torch.allclose(weights, want_weights, rtol=1e-6, atol=0)


def test_sqrtsoftplus_bias_changes_choice_not_weights():
    bias = torch.tensor([0.0, 0.0, 3.0, 0.0])
    weights, ids = select_experts(SIGMOID_LOGITS, 2, scoring="sqrtsoftplus", renormalize=False,
                                  correction_bias=bias)
    _check(weights, ids, [[2, 3]], [[_sqrtsoftplus(-1), _sqrtsoftplus(2)]])


TID2EID = torch.tensor([[3, 0], [1, 2], [2, 1]], dtype=torch.int32)  # vocab 3, top_k 2


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_hash_routing_takes_ids_from_the_table_and_weights_from_the_scores(scoring):
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0], [0.5, -0.5, 1.5, 0.0], [0.0, 1.0, -1.0, 2.0]])
    token_ids = torch.tensor([2, 0, 1], dtype=torch.int64)
    weights, ids = select_experts(logits, 2, scoring=scoring, token_ids=token_ids, hash_table=TID2EID)
    assert ids.tolist() == [[2, 1], [3, 0], [1, 2]]  # the table's order, not the scores'
    scores = {"sqrtsoftplus": torch.nn.functional.softplus(logits).sqrt(), "sigmoid": logits.sigmoid(),
              "softmax": logits.softmax(-1)}[scoring]
    picked = scores.gather(1, ids.long())
    assert torch.allclose(weights, picked / picked.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_hash_routing_matches_deepseek_v4_gate():
    gen = torch.Generator().manual_seed(1)
    vocab, E, k, M = 1000, 64, 6, 50
    table = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(vocab)]).to(torch.int32)
    token_ids = torch.randint(0, vocab, (M,), generator=gen)
    logits = torch.randn(M, E, generator=gen)
    weights, ids = select_experts(logits, k, scoring="sqrtsoftplus", token_ids=token_ids, hash_table=table)
    want_weights, want_ids = _deepseek_v4_gate(logits, k, token_ids=token_ids, tid2eid=table)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_weights, rtol=1e-6, atol=0)


def test_hash_routing_without_renormalize_gives_the_raw_scores():
    weights, ids = select_experts(SIGMOID_LOGITS, 2, scoring="sqrtsoftplus", renormalize=False,
                                  token_ids=torch.tensor([1]), hash_table=TID2EID)
    _check(weights, ids, [[1, 2]], [[_sqrtsoftplus(1), _sqrtsoftplus(-1)]])


def test_hash_routing_drops_unknown_tokens_and_bad_table_entries():
    table = torch.tensor([[3, 0], [1, 9], [-1, -2]], dtype=torch.int64)  # 9 >= E and negatives are invalid
    logits = SIGMOID_LOGITS.expand(4, 4)
    weights, ids = select_experts(logits, 2, scoring="sqrtsoftplus", token_ids=torch.tensor([0, 1, 2, 7]),
                                  hash_table=table)
    assert ids.tolist() == [[3, 0], [1, -1], [-1, -1], [-1, -1]]
    total = _sqrtsoftplus(2) + _sqrtsoftplus(0)
    _check(weights, ids, ids.tolist(),
           [[_sqrtsoftplus(2) / total, _sqrtsoftplus(0) / total], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])


def test_hash_routing_empty_batch():
    weights, ids = select_experts(torch.zeros(0, 4), 2, scoring="sqrtsoftplus",
                                  token_ids=torch.zeros(0, dtype=torch.int64), hash_table=TID2EID)
    assert weights.shape == ids.shape == (0, 2)


# Ties: the lower expert id wins and ids come out best first, whatever torch.topk would do.
TIED_LOGITS = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0, 2.0, 1.0]])


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_ties_go_to_the_lower_expert_id(scoring):
    _, ids = select_experts(TIED_LOGITS, 3, scoring=scoring)
    assert ids.tolist() == [[1, 2, 4]]
    _, ids = select_experts(TIED_LOGITS, 6, scoring=scoring)
    assert ids.tolist() == [[1, 2, 4, 5, 0, 6]]


def test_ties_in_many_equal_experts():
    _, ids = select_experts(torch.zeros(3, 512), 8, scoring="sqrtsoftplus")
    assert ids.tolist() == [list(range(8))] * 3


def test_ties_made_by_the_correction_bias():
    # sigmoid(0) + 0.25 == sigmoid(0) + 0.25 for experts 1 and 3; expert 1 wins.
    bias = torch.tensor([0.0, 0.25, 0.0, 0.25])
    _, ids = select_experts(torch.zeros(1, 4), 1, scoring="sigmoid", correction_bias=bias)
    assert ids.tolist() == [[1]]


def test_tied_groups_go_to_the_lower_group():
    _, ids = select_experts(torch.zeros(1, 8), 2, scoring="sigmoid", num_expert_group=4, topk_group=1,
                            correction_bias=torch.zeros(8))
    assert ids.tolist() == [[0, 1]]


def test_nan_scores_rank_first_as_in_topk():
    _, ids = select_experts(torch.tensor([[0.0, float("nan"), 1.0]]), 2, scoring="sigmoid")
    assert ids.tolist() == [[1, 2]]


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(token_ids=torch.zeros(2, dtype=torch.int64)), ValueError, "token_ids, hash_table: hash routing needs both"),
    (dict(hash_table=torch.zeros(5, 2, dtype=torch.int32)), ValueError, "token_ids, hash_table"),
    (dict(hash_table=torch.zeros(5, 2), token_ids=torch.zeros(2, dtype=torch.int64)), TypeError, "hash_table: "),
    (dict(hash_table=torch.zeros(5, 3, dtype=torch.int32), token_ids=torch.zeros(2, dtype=torch.int64)),
     ValueError, "hash_table: expected .* of shape \\[vocab, 2\\]"),
    (dict(hash_table=torch.zeros(0, 2, dtype=torch.int32), token_ids=torch.zeros(2, dtype=torch.int64)),
     ValueError, "hash_table: expected at least one row"),
    (dict(hash_table=torch.zeros(5, 2, dtype=torch.int32), token_ids=torch.zeros(3, dtype=torch.int64)),
     ValueError, "token_ids: expected .* of shape \\[2\\]"),
    (dict(hash_table=torch.zeros(5, 2, dtype=torch.int32), token_ids=torch.zeros(2)), TypeError, "token_ids: "),
    (dict(hash_table=torch.zeros(5, 2, dtype=torch.int32), token_ids=torch.zeros(2, dtype=torch.int64),
          correction_bias=torch.zeros(8)), ValueError, "correction_bias: hash routing"),
    (dict(hash_table=torch.zeros(5, 2, dtype=torch.int32), token_ids=torch.zeros(2, dtype=torch.int64),
          num_expert_group=4, topk_group=2), ValueError, "num_expert_group: hash routing"),
    (dict(hash_table=torch.zeros(5, 2, dtype=torch.int32), token_ids=torch.zeros(2, dtype=torch.int64),
          order="topk_then_softmax"), ValueError, "order: hash routing"),
    (dict(scoring="sqrtsoftplus", order="topk_then_softmax"), ValueError, "order: "),
])
def test_bad_hash_arguments_raise_naming_them(kwargs, error, message):
    with pytest.raises(error, match=message):
        select_experts(torch.zeros(2, 8), 2, **kwargs)
