"""moe_cutlass.parallel's bookkeeping with the ranks emulated in one process, no process group.

Each rank's share runs through the same pure pieces as ExpertParallel's forward; the collectives
are done by slicing and concatenating. The experts run through the float32 reference on the CPU
(`local_layer`), through fused_moe on a GPU (tests marked gpu), or through a stand-in whose rows
do not depend on the batch at all, against which exact mode must be bitwise. The layers themselves,
over real process groups: tests/distributed.
"""
import pytest
import torch

import moe_cutlass as mc
from moe_cutlass import parallel as par
from moe_cutlass import sharding
from tests.helpers import random_experts, random_hidden, random_routing, relerr

E, H, I, K = 16, 64, 96, 3
SCALE = 1.5
OPTIONS = dict(activation="swiglu_oai", swiglu_limit=7.0)


# ---- the ranks, emulated ----

def _blocks(sizes):
    """[start, end) of consecutive blocks of these sizes."""
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(end - size, end) for size, end in zip(sizes, ends)]


def emulate_ep(inputs, placement, computes, strategy, exact, max_tokens, scale=SCALE):
    """Every rank's ExpertParallel forward: inputs[r] = (hidden, topk_weights, topk_ids), computes[r] the
    layer over rank r's experts (unscaled when exact). Returns the ranks' outputs."""
    W, owners = placement.world_size, placement.owners
    k = inputs[0][2].shape[1]
    owner = [par.slot_owners(ids, owners.to(ids.device)) for _, _, ids in inputs]
    if strategy == "allgather":
        sent = [par.pack_tokens(x, w, ids, o, par.padded_index(x.shape[0], max_tokens, x.device))
                for (x, w, ids), o in zip(inputs, owner)]
        all_x, all_meta = torch.cat([s[0] for s in sent]), torch.cat([s[1] for s in sent])
        rows = [par.expert_rows(all_x, all_meta, compute, exact) for compute in computes]
        summed = torch.stack(rows).float().sum(0).bfloat16()  # the reduce-scatter's sum
        mine = summed.chunk(W)
        if exact:
            return [par.finalize(mine[r], par.own_slots(owner[r]), k, scale, torch.empty_like(inputs[r][0]))
                    for r in range(W)]
        return [mine[r][:x.shape[0]] for r, (x, _, _) in enumerate(inputs)]

    plans = [par.plan_dispatch(o, W) for o in owner]
    padded = strategy == "alltoall_padded"
    starts = [par.block_starts(p.counts, max_tokens if padded else None) for p in plans]
    sizes = [[max_tokens] * W if padded else p.counts.tolist() for p in plans]  # sizes[s][r]: rows s sends r
    sent = [par.pack_tokens(x, w, ids, o, par.send_index(p, st, sum(sz)))
            for (x, w, ids), o, p, st, sz in zip(inputs, owner, plans, starts, sizes)]
    spans = [_blocks(sz) for sz in sizes]  # spans[s][r]: rank r's block in s's send buffer
    rows = []
    for r in range(W):
        recv_x = torch.cat([sent[s][0][slice(*spans[s][r])] for s in range(W)])
        recv_meta = torch.cat([sent[s][1][slice(*spans[s][r])] for s in range(W)])
        rows.append(par.expert_rows(recv_x, recv_meta, computes[r], exact))
    per = k if exact else 1
    recv_spans = [_blocks([sizes[s][r] for s in range(W)]) for r in range(W)]  # s's block in r's receive buffer
    outs = []
    for s in range(W):
        back = torch.cat([rows[r][recv_spans[r][s][0] * per:recv_spans[r][s][1] * per] for r in range(W)])
        top_k, out_scale = (k, scale) if exact else (W, 1.0)
        outs.append(par.finalize(back, par.combine_slots(plans[s], starts[s], owner[s], exact), top_k, out_scale,
                                 torch.empty_like(inputs[s][0])))
    return outs


def stand_in_layer(placement, rank, scale):
    """compute for rank `rank` whose slot rows depend on nothing but the token: global expert e maps x to
    x * (e + 1) / 8 + e / 16, the row is bf16(w * that), rows summed as finalize sums them."""
    local_to_global = torch.tensor(placement.experts_of(rank))
    expert_map = placement.expert_map(rank)

    def compute(x, w, ids):
        ids = ids.long().cpu()
        mapped = torch.where((ids >= 0) & (ids < expert_map.numel()), expert_map[ids.clamp(0, E - 1)].long(), -1)
        e = local_to_global[mapped.clamp(min=0)].to(x.device).unsqueeze(-1).float()
        rows = (w.unsqueeze(-1) * (x.float().unsqueeze(1) * (e + 1) / 8 + e / 16)).bfloat16()
        rows = torch.where((mapped >= 0).to(x.device).unsqueeze(-1), rows, torch.zeros_like(rows))
        M, k = ids.shape
        return mc.reference.finalize(rows.reshape(M * k, -1), torch.arange(M * k, dtype=torch.int32, device=x.device),
                                     k, scale)
    return compute


def rank_inputs(sizes, seed, device="cpu", num_experts=E, top_k=K, hidden=H, bad_ids=True):
    """Each rank's (hidden, topk_weights, topk_ids), with an id -1 and an id past E among them."""
    gen = torch.Generator(device).manual_seed(seed)
    inputs = []
    for M in sizes:
        x = random_hidden(M, hidden, gen)
        w, ids = random_routing(M, num_experts, top_k, gen)
        if M and bad_ids:
            ids[0, -1], ids[-1, 0] = -1, num_experts + 5
        inputs.append((x, w, ids))
    return inputs


def whole(inputs):
    return [torch.cat(parts) for parts in zip(*inputs)]


PLACEMENTS = {
    "linear2": lambda: par.Placement.linear(E, 2),
    "round_robin4": lambda: par.Placement.round_robin(E, 4),
    "uneven3": lambda: par.Placement.from_owners([0] * 9 + [1] * 2 + [2] * 5, 3),
}
CASES = [(strategy, exact) for strategy in par.STRATEGIES for exact in (False, True)]


def reference_computes(experts, placement, exact):
    return [par.local_layer(placement.local_experts(experts, r), placement.expert_map(r), 1.0 if exact else SCALE,
                            False, **OPTIONS) for r in range(placement.world_size)]


# ---- placement ----

def test_linear_placement_is_sharding_expert_map():
    placement = par.Placement.linear(E, 4)
    for r in range(4):
        assert torch.equal(placement.expert_map(r), sharding.expert_map(E, (r, 4)))
        assert placement.experts_of(r) == list(range(4 * r, 4 * r + 4))
    assert placement.owners.tolist() == [e // 4 for e in range(E)]


def test_round_robin_placement():
    placement = par.Placement.round_robin(8, 2)
    assert placement.experts_of(1) == [1, 3, 5, 7]
    assert placement.expert_map(1).tolist() == [-1, 0, -1, 1, -1, 2, -1, 3]
    assert placement.owners.tolist() == [0, 1] * 4


def test_explicit_placement_keeps_the_maps_local_order():
    maps = torch.tensor([[1, -1, 0, -1], [-1, 0, -1, 1]])
    placement = par.Placement(maps)
    assert placement.experts_of(0) == [2, 0] and placement.experts_of(1) == [1, 3]
    assert torch.equal(placement.expert_maps, maps.int())


def test_local_experts_are_the_ranks_share():
    experts = random_experts(8, H, I, torch.Generator().manual_seed(0), bias=True)
    placement = par.Placement.round_robin(8, 2)
    local = placement.local_experts(experts, 1)
    assert local.num_experts == 4
    for key in ("blocks", "scales", "bias"):
        assert torch.equal(local.w13[key], experts.w13[key][[1, 3, 5, 7]])
    with pytest.raises(ValueError, match="experts: expected all 8"):
        placement.local_experts(local, 0)


@pytest.mark.parametrize("make, error, words", [
    (lambda: par.Placement.linear(127, 2), ValueError, "world_size: 2 ranks do not divide num_experts=127"),
    (lambda: par.Placement.round_robin(10, 4), ValueError, "world_size"),
    (lambda: par.Placement.from_owners([0, 1, 3], 3), ValueError, "owners"),
    (lambda: par.Placement.from_owners([0, 0, 2], 3), ValueError, r"owners: ranks \[1\] of 3 hold no expert"),
    (lambda: par.Placement.from_owners([0.0, 1.0], 2), TypeError, "owners"),
    (lambda: par.Placement(torch.tensor([[0, 1], [1, -1]])), ValueError, r"expert 0 is held by ranks \[0, 1\]"),
    (lambda: par.Placement(torch.tensor([[0, -1], [-1, -1]])), ValueError, "expert 1 is held by no rank"),
    (lambda: par.Placement(torch.tensor([[0, 2], [-1, -1]])), ValueError, "held by no rank|local ids"),
    (lambda: par.Placement(torch.tensor([[1, -1], [-1, 0]])), ValueError, "rank 0's local ids must be 0..n-1"),
    (lambda: par.Placement(torch.tensor([0, 1])), ValueError, "expert_maps"),
    (lambda: par.Placement.linear(8, 2).expert_map(2), ValueError, "rank"),
])
def test_bad_placements_name_the_argument(make, error, words):
    with pytest.raises(error, match=words):
        make()


# ---- the dispatch plan ----

def test_plan_sends_a_token_once_per_rank_of_its_experts():
    placement = par.Placement.linear(8, 4)  # rank r: experts 2r, 2r + 1
    ids = torch.tensor([[0, 1], [2, 7], [-1, 9], [6, 3]])
    owner = par.slot_owners(ids, placement.owners)
    assert owner.tolist() == [[0, 0], [1, 3], [-1, -1], [3, 1]]
    plan = par.plan_dispatch(owner, 4)
    assert plan.sent.tolist() == [[True, False, False, False], [False, True, False, True],
                                  [False, False, False, False], [False, True, False, True]]
    assert plan.counts.tolist() == [1, 2, 0, 2]
    starts = par.block_starts(plan.counts)
    assert starts.tolist() == [0, 1, 3, 3]
    assert par.send_index(plan, starts, 5).tolist() == [0, 1, 3, 1, 3]
    padded = par.block_starts(plan.counts, 3)
    assert par.send_index(plan, padded, 12).tolist() == [0, -1, -1, 1, 3, -1, -1, -1, -1, 1, 3, -1]
    assert par.combine_slots(plan, starts, owner, exact=False).view(4, 4).tolist() == [
        [0, -1, -1, -1], [-1, 1, -1, 3], [-1, -1, -1, -1], [-1, 2, -1, 4]]
    # exact: k rows per token sent; slot (t, j) -> (its rank's block start + t's row there) * k + j
    assert par.combine_slots(plan, starts, owner, exact=True).view(4, 2).tolist() == [
        [0, 1], [2, 7], [-1, -1], [8, 5]]


def test_pack_unpack_round_trip_and_padding():
    x = random_hidden(3, H, torch.Generator().manual_seed(1))
    w = torch.rand(3, 2)
    ids = torch.tensor([[0, 5], [2, 2 ** 32 + 1], [-4, 1]])  # 2**32 + 1 would wrap to 1 in int32
    owner = par.slot_owners(ids, torch.tensor([0, 0, 1, 1]))
    index = torch.tensor([2, -1, 0])
    sent_x, meta = par.pack_tokens(x, w, ids, owner, index)
    weights, got_ids = par.unpack_meta(meta)
    assert torch.equal(sent_x[0], x[2]) and torch.equal(sent_x[2], x[0])
    assert got_ids.tolist() == [[-1, 1], [-1, -1], [0, -1]]
    assert torch.equal(weights[0], w[2]) and torch.equal(weights[2], w[0])
    empty_x, empty_meta = par.pack_tokens(x[:0], w[:0], ids[:0], owner[:0], torch.full((4,), -1))
    assert empty_x.shape == (4, H) and (par.unpack_meta(empty_meta)[1] == -1).all()


def test_padded_index():
    assert par.padded_index(2, 5).tolist() == [0, 1, -1, -1, -1]


# ---- the forward, emulated ----

@pytest.mark.parametrize("strategy, exact", CASES)
@pytest.mark.parametrize("placement_name", list(PLACEMENTS))
def test_emulated_ranks_match_the_reference(placement_name, strategy, exact):
    placement = PLACEMENTS[placement_name]()
    experts = random_experts(E, H, I, torch.Generator().manual_seed(2), bias=True)
    sizes = [5, 0, 17, 1][:placement.world_size]
    inputs = rank_inputs(sizes, seed=3)
    outs = emulate_ep(inputs, placement, reference_computes(experts, placement, exact), strategy, exact, 17)
    x, w, ids = whole(inputs)
    ref = mc.reference.fused_moe_float(x, experts, w, ids, routed_scaling_factor=SCALE, **OPTIONS)
    assert [o.shape[0] for o in outs] == sizes
    assert relerr(torch.cat(outs), ref) < 1e-2


@pytest.mark.parametrize("strategy", par.STRATEGIES)
@pytest.mark.parametrize("placement_name", list(PLACEMENTS))
def test_exact_mode_is_bitwise_the_one_rank_sum(placement_name, strategy):
    """With rows that depend on the token alone, exact mode must give the one-rank layer's bits: the rows
    of every slot come back to the right place and are summed in slot order."""
    placement = PLACEMENTS[placement_name]()
    W = placement.world_size
    inputs = rank_inputs([7, 3, 0, 12][:W], seed=4)
    computes = [stand_in_layer(placement, r, 1.0) for r in range(W)]
    outs = emulate_ep(inputs, placement, computes, strategy, True, 12)
    one_rank = stand_in_layer(par.Placement.linear(E, 1), 0, SCALE)
    x, w, ids = whole(inputs)
    assert torch.equal(torch.cat(outs).view(torch.int16), one_rank(x, w, ids).view(torch.int16))


def test_hot_expert_routing_all_tokens_to_one_rank():
    placement = par.Placement.linear(E, 2)
    experts = random_experts(E, H, I, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    inputs = []
    for M in (9, 4):
        ids = (E // 2 + torch.rand(M, E // 2, generator=gen).topk(K, dim=1).indices).int()  # rank 1's experts only
        inputs.append((random_hidden(M, H, gen), torch.rand(M, K, generator=gen), ids))
    x, w, ids = whole(inputs)
    ref = mc.reference.fused_moe_float(x, experts, w, ids, routed_scaling_factor=SCALE, **OPTIONS)
    for strategy, exact in CASES:
        outs = emulate_ep(inputs, placement, reference_computes(experts, placement, exact), strategy, exact, 9)
        assert relerr(torch.cat(outs), ref) < 1e-2, (strategy, exact)


# ---- tensor parallel ----

@pytest.mark.parametrize("size", [2, 3])
def test_tp_shards_sum_to_the_layer(size):
    experts = random_experts(E, H, I, torch.Generator().manual_seed(7), bias=True)
    shards = [par.tp_shard(experts, (r, size)) for r in range(size)]
    widths = [sharding.intermediate_range(I, (r, size)) for r in range(size)]
    assert [s.intermediate_size for s in shards] == [end - start for start, end in widths]
    assert shards[0].w2["bias"].abs().sum() > 0 and all(s.w2["bias"].abs().sum() == 0 for s in shards[1:])
    x, w, ids = rank_inputs([23], seed=8)[0]
    parts = [mc.reference.fused_moe_float(x, s, w, ids, routed_scaling_factor=SCALE, **OPTIONS) for s in shards]
    ref = mc.reference.fused_moe_float(x, experts, w, ids, routed_scaling_factor=SCALE, **OPTIONS)
    assert relerr(sum(parts), ref) < 1e-5


def test_tp_shard_cuts_whole_blocks_of_the_dequantized_weights():
    experts = random_experts(4, H, I, torch.Generator().manual_seed(9))
    w13, w2, _, _ = experts.dequantized()
    shard = par.tp_shard(experts, (1, 3))
    s13, s2, _, _ = shard.dequantized()
    assert torch.equal(s13, torch.cat((w13[:, 32:64], w13[:, I + 32:I + 64]), dim=1))
    assert torch.equal(s2, w2[:, :, 32:64])


def test_tp_shard_bad_arguments():
    experts = random_experts(4, H, I, torch.Generator().manual_seed(9))
    with pytest.raises(ValueError, match="tp rank"):
        par.tp_shard(experts, (3, 3))
    with pytest.raises(TypeError, match="experts"):
        par.tp_shard(object(), (0, 2))


# ---- the same on one GPU with the kernels ----

GPU_E, GPU_H, GPU_I, GPU_K = 32, 320, 160, 4


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", par.STRATEGIES)
@pytest.mark.parametrize("sizes", [(1, 1), (64, 3), (333, 1000), (0, 5)])
def test_emulated_ranks_on_one_gpu_exact_is_bitwise_fused_moe(strategy, sizes):
    gen = torch.Generator("cuda").manual_seed(10)
    experts = random_experts(GPU_E, GPU_H, GPU_I, gen, bias=True)
    placement = par.Placement.round_robin(GPU_E, 2)
    inputs = rank_inputs(sizes, seed=11, device="cuda", num_experts=GPU_E, top_k=GPU_K, hidden=GPU_H)
    x, w, ids = whole(inputs)
    one_gpu = mc.fused_moe(x, experts, w, ids, routed_scaling_factor=SCALE, batch_invariant=True, **OPTIONS)
    for exact in (False, True):
        computes = [par.local_layer(placement.local_experts(experts, r), placement.expert_map(r, "cuda"),
                                    1.0 if exact else SCALE, True, **OPTIONS) for r in range(2)]
        out = torch.cat(emulate_ep(inputs, placement, computes, strategy, exact, max(sizes)))
        if exact:
            assert torch.equal(out.view(torch.int16), one_gpu.view(torch.int16))
        else:
            assert relerr(out, one_gpu) < 1e-2


@pytest.mark.gpu
def test_tp_shards_on_one_gpu_sum_to_fused_moe():
    gen = torch.Generator("cuda").manual_seed(12)
    experts = random_experts(GPU_E, GPU_H, GPU_I, gen, bias=True)
    x, w, ids = rank_inputs([200], seed=13, device="cuda", num_experts=GPU_E, top_k=GPU_K, hidden=GPU_H)[0]
    parts = [mc.fused_moe(x, par.tp_shard(experts, (r, 2)), w, ids, routed_scaling_factor=SCALE, **OPTIONS)
             for r in range(2)]
    one_gpu = mc.fused_moe(x, experts, w, ids, routed_scaling_factor=SCALE, **OPTIONS)
    assert relerr(parts[0] + parts[1], one_gpu) < 1e-2


def test_the_layers_need_a_process_group():
    experts = random_experts(4, H, I, torch.Generator().manual_seed(9))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        par.ExpertParallel(experts, 2, par.Placement.linear(4, 1))
    with pytest.raises(RuntimeError, match="init_process_group"):
        par.TensorParallel(experts)
