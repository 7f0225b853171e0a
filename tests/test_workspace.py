"""Workspaces: the carving of one buffer into the layer's pieces, and caller-owned workspaces on the GPU."""
import pytest
import torch

import moe_cutlass as mc
from moe_cutlass.workspace import ALIGNMENT, Pieces, _cache, cached_workspace, carve
from test_fused_moe import assert_close, random_experts, random_hidden, random_routing

E, H, I = 8, 96, 64


def piece_sizes(M, k, gemm_bytes, expand_ints):
    """Bytes of each piece, in Pieces' order: what the kernels may touch for M tokens."""
    slots = M * k
    return (*gemm_bytes, 4 * E, 4 * (E + 1), 4 * expand_ints, 4 * slots, 4 * slots, 4 * slots, 2 * slots * H,
            2 * slots * I)


@pytest.mark.parametrize("M", [0, 1, 7, 1000])
@pytest.mark.parametrize("k", [1, 8])
def test_pieces_are_aligned_and_disjoint(M, k):
    gemm_bytes, expand_ints = (3000, 4100), (M * k // 256) * E
    p = carve(M, k, E, H, I, gemm_bytes, expand_ints)
    offsets = p[:len(Pieces._fields) - 3]
    ends = [o + s for o, s in zip(offsets, piece_sizes(M, k, gemm_bytes, expand_ints))]
    assert all(o % ALIGNMENT == 0 for o in offsets)
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:])) and ends[-1] <= p.total


def test_a_workspace_for_more_tokens_is_larger():
    totals = [carve(M, 4, E, H, I, (3000, 4100), (M * 4 // 256) * E).total for M in range(0, 600, 37)]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def cpu_experts():
    gen = torch.Generator().manual_seed(0)
    return mc.prepare_experts(*mc.quantize_mxfp4(torch.randn(E, 2 * I, H, generator=gen)),
                              *mc.quantize_mxfp4(torch.randn(E, H, I, generator=gen)))


@pytest.mark.parametrize("workspace, error", [
    (lambda: torch.empty(100, dtype=torch.uint8), TypeError),
    (lambda: mc.Workspace(torch.empty(100, dtype=torch.int32), 8), TypeError),
    (lambda: mc.Workspace(torch.empty(100, dtype=torch.uint8), 2), ValueError),
    (lambda: mc.Workspace(torch.empty(100, dtype=torch.uint8), -1), ValueError),
])
def test_fused_moe_refuses_a_bad_workspace(workspace, error):
    x = torch.randn(5, H).to(torch.bfloat16)
    ids = torch.zeros(5, 2, dtype=torch.int32)
    with pytest.raises(error, match="workspace"):
        mc.fused_moe(x, cpu_experts(), torch.rand(5, 2), ids, workspace=workspace())


@pytest.mark.parametrize("args, error, name", [
    (dict(max_tokens=-1), ValueError, "max_tokens"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(max_tokens=2**30, top_k=2), ValueError, "max_tokens, top_k: .* 2147483647 \\(int32\\)"),
    (dict(experts=object()), TypeError, "experts"),
    (dict(device="cpu"), ValueError, "device"),
])
def test_workspace_size_names_the_bad_argument(args, error, name):
    with pytest.raises(error, match=name):
        mc.workspace_size(**(dict(max_tokens=4, top_k=2, experts=cpu_experts(), device="cuda:0") | args))


def no_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory")


def test_a_cached_workspace_that_does_not_fit_says_so_and_leaves_no_entry(monkeypatch):
    monkeypatch.setattr("moe_cutlass.workspace.pieces", lambda M, k, E, H, I, index: carve(M, k, E, H, I, (0, 0), 0))
    key = (0, 123, 4, E, H, I)  # (device, stream, top_k, E, H, I)
    monkeypatch.setitem(_cache, key, mc.Workspace(torch.empty(64, dtype=torch.uint8), 1))
    monkeypatch.setattr(torch, "empty", no_memory)
    size = carve(10**6, 4, E, H, I, (0, 0), 0).total
    with pytest.raises(torch.OutOfMemoryError, match=f"workspace: {size} bytes .* for M=1000000, top_k=4, E={E}, "
                                                     f"H={H}, I={I} .*allocate_workspace"):
        cached_workspace(10**6, 4, E, H, I, 0, 123)
    assert key not in _cache  # neither the smaller one it replaced nor a half-built one


# ---- GPU ----

@pytest.fixture(scope="module")
def experts():
    return random_experts(16, 256, 128, torch.Generator("cuda").manual_seed(20))


def inputs(M, k, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    return (random_hidden(M, 256, gen), *random_routing(M, 16, k, gen))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 33, 64])
def test_caller_workspace_gives_the_cached_path_bits(experts, M):
    workspace = mc.allocate_workspace(64, 4, experts)
    assert workspace.buffer.numel() == mc.workspace_size(64, 4, experts) and workspace.max_tokens == 64
    x, weights, ids = inputs(M, 4, seed=M)
    got = mc.fused_moe(x, experts, weights, ids, workspace=workspace)
    assert torch.equal(got, mc.fused_moe(x, experts, weights, ids))
    assert_close(got, mc.reference.fused_moe_float(x, experts, weights, ids))


@pytest.mark.gpu
def test_one_workspace_serves_layers_of_other_shapes_when_large_enough(experts):
    small = random_experts(4, 128, 64, torch.Generator("cuda").manual_seed(21))
    workspace = mc.allocate_workspace(32, 4, experts)
    assert mc.workspace_size(32, 4, small) <= workspace.buffer.numel()
    gen = torch.Generator("cuda").manual_seed(22)
    x, (weights, ids) = random_hidden(20, 128, gen), random_routing(20, 4, 4, gen)
    assert_close(mc.fused_moe(x, small, weights, ids, workspace=workspace),
                 mc.reference.fused_moe_float(x, small, weights, ids))


@pytest.mark.gpu
def test_too_small_a_workspace_is_refused(experts):
    x, weights, ids = inputs(8, 4, seed=1)
    size = mc.workspace_size(8, 4, experts)
    short = mc.Workspace(torch.empty(size - 1, dtype=torch.uint8, device="cuda"), 8)
    with pytest.raises(ValueError, match="workspace"):
        mc.fused_moe(x, experts, weights, ids, workspace=short)
    with pytest.raises(ValueError, match="workspace"):
        mc.fused_moe(x, experts, weights, ids, workspace=mc.allocate_workspace(7, 4, experts))
    with pytest.raises(ValueError, match="workspace"):  # sized for top_k 2: too small for top_k 4
        mc.fused_moe(x, experts, weights, ids, workspace=mc.allocate_workspace(8, 2, experts))
    misaligned = mc.Workspace(torch.empty(size + 8, dtype=torch.uint8, device="cuda")[8:], 8)
    with pytest.raises(ValueError, match="workspace"):
        mc.fused_moe(x, experts, weights, ids, workspace=misaligned)


@pytest.mark.gpu
def test_cuda_graph_replay_with_a_caller_workspace(experts):
    M, k = 48, 4
    workspace = mc.allocate_workspace(M, k, experts)
    x, weights, ids = inputs(M, k, seed=2)
    out = torch.empty(M, 256, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # nothing to allocate or grow: no warm-up needed
        mc.fused_moe(x, experts, weights, ids, out=out, workspace=workspace)
    for seed in (3, 4):
        new_x, new_weights, new_ids = inputs(M, k, seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, mc.fused_moe(new_x, experts, new_weights, new_ids))


@pytest.mark.gpu
def test_forward_with_a_caller_workspace_never_synchronizes(experts):
    workspace = mc.allocate_workspace(16, 4, experts)
    x, weights, ids = inputs(16, 4, seed=5)
    mc.fused_moe(x, experts, weights, ids, workspace=workspace)  # first call loads the library
    torch.cuda.set_sync_debug_mode("error")
    try:
        mc.fused_moe(x, experts, weights, ids, workspace=workspace)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_free_workspaces_returns_the_cached_memory(experts):
    x, weights, ids = inputs(4096, 4, seed=6)
    mc.fused_moe(x, experts, weights, ids)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    mc.free_workspaces()
    assert torch.cuda.memory_allocated() <= before - mc.workspace_size(4096, 4, experts)
    out = mc.fused_moe(x, experts, weights, ids)  # allocates a new one
    assert_close(out, mc.reference.fused_moe_float(x, experts, weights, ids))


def twice_the_gpu():
    return 2 * torch.cuda.get_device_properties(0).total_memory


@pytest.mark.gpu
def test_a_batch_whose_workspace_exceeds_the_gpu_is_an_out_of_memory_error_and_the_next_call_works():
    # Small experts, wide rows, many slots a token: the workspace holds top_k rows of 2H bytes per
    # token, so twice the GPU's memory takes only a few GB of hidden_states (and of out).
    E_, H_, I_, k = 4, 8192, 32, 128
    gen = torch.Generator("cuda").manual_seed(30)
    experts = random_experts(E_, H_, I_, gen)

    def routing(M):  # ids repeat (k > E): a token may pick an expert several times
        return (torch.rand(M, k, device="cuda", generator=gen).softmax(dim=1),
                torch.randint(0, E_, (M, k), dtype=torch.int32, device="cuda", generator=gen))

    x, (weights, ids) = random_hidden(64, H_, gen), routing(64)
    first = mc.fused_moe(x, experts, weights, ids)  # caches a workspace for this stream and (k, E, H, I)
    M = -(-twice_the_gpu() // (k * 2 * H_))
    assert M * k < 2**31  # within the kernels' limit: the allocation is what fails
    big = (torch.zeros(M, H_, dtype=torch.bfloat16, device="cuda"), torch.zeros(M, k, device="cuda"),
           torch.zeros(M, k, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    message = rf"workspace: \d+ bytes \(.* GiB\) for M={M}, top_k={k}, E={E_}, H={H_}, I={I_} do not fit .*workspace="
    with pytest.raises(torch.OutOfMemoryError, match=message) as info:
        mc.fused_moe(big[0], experts, big[1], big[2])
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)  # torch's own, with the free memory
    del info  # its traceback holds the call's frames, and with them its output
    # Nothing of the failed call stays allocated, and the smaller cached workspace went before it.
    assert torch.cuda.memory_allocated() < allocated
    assert torch.equal(mc.fused_moe(x, experts, weights, ids), first)
    assert_close(first, mc.reference.fused_moe_float(x, experts, weights, ids))


@pytest.mark.gpu
def test_a_workspace_larger_than_the_gpu_is_an_out_of_memory_error(experts):
    max_tokens = twice_the_gpu() // (4 * 2 * 256)
    with pytest.raises(torch.OutOfMemoryError, match=f"workspace: .* for max_tokens={max_tokens}, top_k=4, E=16, "
                                                     f"H=256, I=128 do not fit .*fewer max_tokens"):
        mc.allocate_workspace(max_tokens, 4, experts)
    assert mc.allocate_workspace(64, 4, experts).max_tokens == 64
