"""expand / finalize kernels against plain torch, exactly (maps equal, rows bitwise; finalize against
moe_cutlass.reference.finalize).

GPU tests are marked `gpu` (tests/conftest.py skips them without an SM90 GPU and the
built library). Validation tests run anywhere: they use CPU or fake CUDA tensors.
"""

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.fuzz import ROUTING_SMALL_SLOTS
from moe_cutlass import reference
from moe_cutlass._ops_routing import expand, expand_workspace_numel, finalize

POISON_I32 = -7
H_DEFAULT = 96  # a multiple of 32 that is not one of 64: 12 vectors per row


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def local_experts(topk_ids, num_experts, expert_map):
    """Local expert per slot, -1 when dropped (the contract, in torch)."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        inside = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(inside, expert_map.long()[ids.clamp(0, expert_map.numel() - 1)], -1)
    return torch.where((ids >= 0) & (ids < num_experts), ids, -1)


def reference_expand(hidden, topk_ids, topk_weights, num_experts, expert_map=None):
    M, k = topk_ids.shape
    local = local_experts(topk_ids, num_experts, expert_map)
    kept = local >= 0
    slots = torch.arange(M * k, device=hidden.device)
    order = torch.sort(local[kept], stable=True).indices
    sorted_slots = slots[kept][order]
    counts = torch.bincount(local[kept], minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=hidden.device)
    offsets[1:] = torch.cumsum(counts, 0)
    slot_to_row = torch.full((M * k,), -1, dtype=torch.long, device=hidden.device)
    slot_to_row[sorted_slots] = torch.arange(sorted_slots.numel(), device=hidden.device)
    return {
        "expert_counts": counts.int(),
        "expert_offsets": offsets.int(),
        "sorted_slots": sorted_slots.int(),
        "slot_to_row": slot_to_row.int(),
        "gathered": hidden[sorted_slots // k],
        "row_weights": topk_weights.reshape(-1)[sorted_slots],
    }


def poisoned_buffers(M, k, E, H):
    slots = M * k
    i32 = dict(dtype=torch.int32, device="cuda")
    return {
        "expert_counts": torch.full((E,), POISON_I32, **i32),
        "expert_offsets": torch.full((E + 1,), POISON_I32, **i32),
        "sorted_slots": torch.full((slots,), POISON_I32, **i32),
        "slot_to_row": torch.full((slots,), POISON_I32, **i32),
        "gathered": torch.full((slots, H), float("nan"), dtype=torch.bfloat16, device="cuda"),
        "row_weights": torch.full((slots,), float("nan"), device="cuda"),
        "workspace": torch.full((max(1, expand_workspace_numel(M, k, E)),), POISON_I32, **i32),
    }


def run_expand(hidden, topk_ids, topk_weights, E, expert_map=None):
    M, k = topk_ids.shape
    out = poisoned_buffers(M, k, E, hidden.shape[1])
    expand(hidden, topk_ids, topk_weights, expert_map, E, out["expert_counts"], out["expert_offsets"],
           out["sorted_slots"], out["slot_to_row"], out["gathered"], out["row_weights"], out["workspace"])
    return out


def bits(t):
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def assert_expand_exact(got, ref):
    total = int(ref["expert_offsets"][-1])
    for name in ("expert_counts", "expert_offsets", "slot_to_row"):
        assert torch.equal(got[name], ref[name]), name
    assert torch.equal(got["sorted_slots"][:total], ref["sorted_slots"]), "sorted_slots"
    assert torch.equal(bits(got["gathered"][:total]), bits(ref["gathered"])), "gathered"
    assert torch.equal(bits(got["row_weights"][:total]), bits(ref["row_weights"])), "row_weights"
    untouched = got["gathered"][total:]
    assert torch.equal(bits(untouched), bits(torch.full_like(untouched, float("nan")))), "gathered rows past the end"


def random_inputs(M, k, E, H=H_DEFAULT, seed=0, id_low=0, id_high=None, id_dtype=torch.int32):
    g = gen(seed)
    hidden = torch.randn(M, H, device="cuda", generator=g).bfloat16()
    high = E if id_high is None else id_high
    ids = torch.randint(id_low, high, (M, k), device="cuda", generator=g).to(id_dtype)
    weights = torch.rand(M, k, device="cuda", generator=g)
    return hidden, ids, weights


# M * k covers the one-launch path (<= 16384 slots) and the tiled path, with both sides of
# each boundary (16384 slots, a one-launch block's part past one warp round of 32 slots, 1024-slot
# tiles, the scatter kernel's 256-slot parts) below.
@pytest.mark.gpu
@pytest.mark.parametrize("E", [8, 128, 384])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("M", [1, 7, 1000, 65536])
def test_expand_matches_torch(M, k, E):
    hidden, ids, weights = random_inputs(M, k, E, seed=M * 1000 + k * 10 + E)
    assert_expand_exact(run_expand(hidden, ids, weights, E), reference_expand(hidden, ids, weights, E))


@pytest.mark.gpu
@pytest.mark.parametrize("M,k", [(16384, 1), (16385, 1), (4096, 4), (4097, 4), (1025, 1), (8192, 1), (8193, 1),
                                 (17408, 1), (17409, 1), (4353, 4), (17664, 1), (17665, 1)])
def test_expand_path_boundaries(M, k):
    hidden, ids, weights = random_inputs(M, k, 64, seed=M + k)
    assert_expand_exact(run_expand(hidden, ids, weights, 64), reference_expand(hidden, ids, weights, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("M,k", [(100, 8), (4096, 4), (5000, 4)])
def test_expand_all_tokens_on_one_expert(M, k):
    hidden, _, weights = random_inputs(M, k, 128)
    ids = torch.full((M, k), 77, dtype=torch.int32, device="cuda")
    got = run_expand(hidden, ids, weights, 128)
    assert_expand_exact(got, reference_expand(hidden, ids, weights, 128))
    assert int(got["expert_counts"][77]) == M * k


@pytest.mark.gpu
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("M,k", [(7, 4), (3000, 8)])
def test_expand_drops_out_of_range_ids(M, k, id_dtype):
    E = 128
    hidden, ids, weights = random_inputs(M, k, E, seed=3, id_low=-5, id_high=E + 5, id_dtype=id_dtype)
    ids[0, 0] = -(2**31) if id_dtype == torch.int32 else -(2**40)
    ids[-1, -1] = 2**31 - 1 if id_dtype == torch.int32 else 2**40
    got = run_expand(hidden, ids, weights, E)
    assert_expand_exact(got, reference_expand(hidden, ids, weights, E))
    assert int(got["slot_to_row"][0]) == -1 and int(got["slot_to_row"][-1]) == -1


@pytest.mark.gpu
@pytest.mark.parametrize("M,k", [(7, 8), (1000, 8)])
def test_expand_with_expert_map(M, k):
    E, E_global = 96, 384
    g = gen(11)
    expert_map = torch.full((E_global,), -1, dtype=torch.int32, device="cuda")
    owned = torch.randperm(E_global, device="cuda", generator=g)[:E]
    expert_map[owned] = torch.arange(E, dtype=torch.int32, device="cuda")
    hidden, ids, weights = random_inputs(M, k, E, seed=12, id_low=-3, id_high=E_global + 3)
    ids[0, :] = owned[:k].int()  # at least one kept token even at tiny M
    got = run_expand(hidden, ids, weights, E, expert_map)
    assert_expand_exact(got, reference_expand(hidden, ids, weights, E, expert_map))


@pytest.mark.gpu
def test_expand_strided_hidden_gpt_oss_width():
    # gpt-oss H = 2880: a multiple of 32, not of 128; hidden is a column slice (row stride 3072)
    wide = torch.randn(300, 3072, device="cuda", generator=gen(5)).bfloat16()
    hidden = wide[:, :2880]
    _, ids, weights = random_inputs(300, 4, 128, seed=6)
    assert_expand_exact(run_expand(hidden, ids, weights, 128), reference_expand(hidden, ids, weights, 128))


@pytest.mark.gpu
def test_expand_zero_tokens():
    hidden, ids, weights = random_inputs(0, 4, 16)
    got = run_expand(hidden, ids, weights, 16)
    assert torch.equal(got["expert_counts"], torch.zeros(16, dtype=torch.int32, device="cuda"))
    assert torch.equal(got["expert_offsets"], torch.zeros(17, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("M,k,E", [(33, 8, 128), (20000, 8, 384)])
def test_expand_is_deterministic(M, k, E):
    hidden, ids, weights = random_inputs(M, k, E, seed=21, id_low=-2, id_high=E + 2)
    first = run_expand(hidden, ids, weights, E)
    second = run_expand(hidden, ids, weights, E)
    total = int(first["expert_offsets"][-1])
    for name in ("expert_counts", "expert_offsets", "slot_to_row"):
        assert torch.equal(first[name], second[name]), name
    assert torch.equal(first["sorted_slots"][:total], second["sorted_slots"][:total])
    for name in ("gathered", "row_weights"):
        assert torch.equal(bits(first[name][:total]), bits(second[name][:total])), name


def finalize_case(M, k, E, H, rsf, seed, row_pad=0):
    hidden, ids, weights = random_inputs(M, k, E, H=8, seed=seed, id_low=-1, id_high=E + 1)
    slot_to_row = reference_expand(hidden, ids, weights, E)["slot_to_row"]
    wide = torch.randn(M * k, H + row_pad, device="cuda", generator=gen(seed + 1)).bfloat16()
    rows = wide[:, :H]
    out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    finalize(rows, slot_to_row, k, rsf, out)
    return out, reference.finalize(rows, slot_to_row, k, rsf)


@pytest.mark.gpu
@pytest.mark.parametrize("rsf", [1.0, 2.5])
@pytest.mark.parametrize("M,k,E,H", [(1, 1, 8, 96), (7, 8, 128, 2880), (1000, 4, 384, 256), (65536, 8, 128, 64)])
def test_finalize_matches_torch_bitwise(M, k, E, H, rsf):
    out, ref = finalize_case(M, k, E, H, rsf, seed=M + k + E, row_pad=32)
    assert torch.equal(bits(out), bits(ref))


@pytest.mark.gpu
def test_finalize_token_with_all_slots_dropped_is_zero():
    k, H = 4, 64
    slot_to_row = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32, device="cuda")
    rows = torch.randn(4, H, device="cuda").bfloat16()
    out = torch.full((2, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    finalize(rows, slot_to_row, k, 1.0, out)
    assert torch.equal(bits(out), bits(reference.finalize(rows, slot_to_row, k, 1.0)))
    assert torch.equal(out[1], torch.zeros(H, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
def test_finalize_zero_tokens():
    out = torch.empty(0, 64, dtype=torch.bfloat16, device="cuda")
    finalize(torch.empty(0, 64, dtype=torch.bfloat16, device="cuda"),
             torch.empty(0, dtype=torch.int32, device="cuda"), 4, 1.0, out)


@pytest.mark.gpu
def test_finalize_is_deterministic():
    a, _ = finalize_case(4096, 8, 128, 512, 1.0, seed=9)
    b, _ = finalize_case(4096, 8, 128, 512, 1.0, seed=9)
    assert torch.equal(bits(a), bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [64, 2100])  # one-launch path and tiled path
def test_cuda_graph_replay_with_new_inputs(M):
    k, E, H, rsf = 8, 128, 256, 1.5
    got = poisoned_buffers(M, k, E, H)
    hidden, ids, weights = random_inputs(M, k, E, H=H, seed=1, id_low=-1, id_high=E + 1)
    out = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")

    def layer():
        expand(hidden, ids, weights, None, E, **got)
        finalize(got["gathered"], got["slot_to_row"], k, rsf, out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()

    for seed in (2, 3):
        new_hidden, new_ids, new_weights = random_inputs(M, k, E, H=H, seed=seed, id_low=-1, id_high=E + 1)
        hidden.copy_(new_hidden)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_expand(new_hidden, new_ids, new_weights, E)
        total = int(ref["expert_offsets"][-1])
        for name in ("expert_counts", "expert_offsets", "slot_to_row"):
            assert torch.equal(got[name], ref[name]), name
        assert torch.equal(got["sorted_slots"][:total], ref["sorted_slots"])
        assert torch.equal(bits(got["gathered"][:total]), bits(ref["gathered"]))
        assert torch.equal(bits(got["row_weights"][:total]), bits(ref["row_weights"]))
        assert torch.equal(bits(out), bits(reference.finalize(got["gathered"], ref["slot_to_row"], k, rsf)))


# ---- validation: runs without a GPU (CPU tensors, or fake CUDA tensors; CPU-only torch
# cannot take views of fake CUDA tensors, so bad arguments are built whole) ----

def fake_expand_args(M=5, k=2, E=8, H=64):
    d = "cuda"
    return dict(
        hidden=torch.empty(M, H, dtype=torch.bfloat16, device=d),
        topk_ids=torch.empty(M, k, dtype=torch.int32, device=d),
        topk_weights=torch.empty(M, k, device=d),
        expert_map=None,
        num_experts=E,
        expert_counts=torch.empty(E, dtype=torch.int32, device=d),
        expert_offsets=torch.empty(E + 1, dtype=torch.int32, device=d),
        sorted_slots=torch.empty(M * k, dtype=torch.int32, device=d),
        slot_to_row=torch.empty(M * k, dtype=torch.int32, device=d),
        gathered=torch.empty(M * k, H, dtype=torch.bfloat16, device=d),
        row_weights=torch.empty(M * k, device=d),
        workspace=torch.empty(1, dtype=torch.int32, device=d),
    )


def test_expand_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="hidden"):
        expand(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2),
               None, 8, *[torch.zeros(1)] * 7)


@pytest.mark.parametrize(
    "name,bad,error",
    [
        ("topk_ids", lambda a: a["topk_ids"].float(), TypeError),
        ("topk_ids", lambda a: torch.empty(4, 2, dtype=torch.int32, device="cuda"), ValueError),
        ("topk_weights", lambda a: a["topk_weights"].double(), TypeError),
        ("hidden", lambda a: torch.empty(5, 60, dtype=torch.bfloat16, device="cuda"), ValueError),
        ("hidden", lambda a: torch.empty_strided((5, 64), (1, 5), dtype=torch.bfloat16, device="cuda"), ValueError),
        ("expert_map", lambda a: torch.empty(0, dtype=torch.int32, device="cuda"), ValueError),
        ("num_experts", lambda a: 513, ValueError),
        ("expert_offsets", lambda a: a["expert_counts"], ValueError),
        ("gathered", lambda a: torch.empty(3, 64, dtype=torch.bfloat16, device="cuda"), ValueError),
        ("row_weights", lambda a: a["row_weights"].bfloat16(), TypeError),
    ],
)
def test_expand_names_the_bad_argument(name, bad, error):
    with FakeTensorMode():
        args = fake_expand_args()
        expand(**args)  # the good call passes
        args[name] = bad(args)
        with pytest.raises(error, match=name):
            expand(**args)


@pytest.mark.parametrize(
    "name,bad,error",
    [
        ("out", lambda: torch.empty(4, 64, device="cuda"), TypeError),
        ("rows", lambda: torch.empty(8, 32, dtype=torch.bfloat16, device="cuda"), ValueError),
        ("slot_to_row", lambda: torch.empty(7, dtype=torch.int32, device="cuda"), ValueError),
        ("top_k", lambda: 0, ValueError),
        ("routed_scaling_factor", lambda: float("inf"), ValueError),
    ],
)
def test_finalize_names_the_bad_argument(name, bad, error):
    with FakeTensorMode():
        args = dict(rows=torch.empty(8, 64, dtype=torch.bfloat16, device="cuda"),
                    slot_to_row=torch.empty(8, dtype=torch.int32, device="cuda"), top_k=2,
                    routed_scaling_factor=1.0, out=torch.empty(4, 64, dtype=torch.bfloat16, device="cuda"))
        finalize(**args)  # the good call passes
        args[name] = bad()
        with pytest.raises(error, match=name):
            finalize(**args)


def test_the_tests_know_the_one_launch_limit():
    """benchmarks.fuzz's ROUTING_SMALL_SLOTS (the fuzzer's, the soak's and these tests' path switch) is the
    kernel's."""
    source = (Path(__file__).parents[1] / "templates" / "sm90" / "routing.cuh").read_text()
    assert f"constexpr int kSmallSlots = {ROUTING_SMALL_SLOTS};" in source
