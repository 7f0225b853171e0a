"""Random MoE inputs and the reference comparison shared by the GPU tests and benchmarks/fuzz.py.

Every generator takes a torch.Generator and makes its tensors on that generator's device, so
the same code builds inputs on the GPU (tests) and on the CPU (the fuzzer's CPU mode).
"""
import torch

import moe_cutlass as mc

MAX_RELERR = 1e-2  # DESIGN.md section 2


class StandInExperts:
    """The slice of PreparedExperts the reference relies on, over plain float weights."""

    def __init__(self, w13, w2, b13=None, b2=None):
        self.num_experts, two_i, self.hidden_size = w13.shape
        self.intermediate_size = two_i // 2
        self._weights = (w13, w2, b13, b2)

    def select(self, expert_ids):
        picked = [None if w is None else w[list(expert_ids)] for w in self._weights]
        return StandInExperts(*picked)

    def dequantized(self):
        return self._weights


def random_mxfp4(E, N, K, gen):
    # Scales differ from block to block: a kernel applying one scale per tile must fail.
    blocks = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=gen.device, generator=gen)
    scales = torch.randint(116, 128, (E, N, K // 32), dtype=torch.uint8, device=gen.device, generator=gen)
    return blocks, scales


def random_experts(E, H, I, gen, bias=False, gate_up="concat"):
    w13 = random_mxfp4(E, 2 * I, H, gen)
    w2 = random_mxfp4(E, H, I, gen)
    biases = {}
    if bias:
        biases = dict(w13_bias=torch.randn(E, 2 * I, device=gen.device, generator=gen),
                      w2_bias=torch.randn(E, H, device=gen.device, generator=gen) * 0.1)
    return mc.prepare_experts(*w13, *w2, gate_up=gate_up, **biases)


def random_routing(M, E, k, gen):
    """k distinct experts per token and softmax weights: (float32 [M, k], int32 [M, k])."""
    ids = torch.rand(M, E, device=gen.device, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    weights = torch.rand(M, k, device=gen.device, generator=gen).softmax(dim=1)
    return weights, ids


def random_hidden(M, H, gen):
    return torch.randn(M, H, device=gen.device, generator=gen).to(torch.bfloat16)


def relerr(out, ref):
    """||out - ref|| / ||ref|| in float32; 0 when both are zero, inf when only ref is."""
    diff = (out.float() - ref.float()).norm().item()
    norm = ref.float().norm().item()
    if norm == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / norm


def assert_close(out, ref):
    assert torch.isfinite(out).all(), "output has NaN/Inf (unwritten rows?)"
    err = relerr(out, ref)
    assert err < MAX_RELERR, f"relative error {err:.3e}"


def assert_rows_close(out, ref):
    """Each token's row within the tolerance (a whole-tensor norm would hide one wrong row)."""
    assert torch.isfinite(out).all(), "output has NaN/Inf (unwritten rows?)"
    for t in range(ref.shape[0]):
        if ref[t].float().norm() == 0:
            assert torch.equal(out[t].float(), ref[t].float()), f"row {t}: expected zeros"
        else:
            err = relerr(out[t], ref[t])
            assert err < MAX_RELERR, f"row {t}: relative error {err:.3e}"


def check_graph_replay(M, E, H, I, k, gen, check=assert_close):
    """fused_moe captured in a CUDA graph (after a warm-up call on a side stream), then replayed three
    times on new tokens and routing copied into the captured inputs; check(out, reference) each time."""
    experts = random_experts(E, H, I, gen)
    x = random_hidden(M, H, gen)
    weights, ids = random_routing(M, E, k, gen)
    out = torch.empty(M, H, dtype=torch.bfloat16, device=gen.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mc.fused_moe(x, experts, weights, ids, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mc.fused_moe(x, experts, weights, ids, out=out)
    for _ in range(3):
        new_weights, new_ids = random_routing(M, E, k, gen)
        x.copy_(random_hidden(M, H, gen))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        check(out, mc.reference.fused_moe_float(x, experts, weights, ids))


def check_dropped_ids_and_expert_map(M, run):
    """run(x, experts, weights, ids, **options) on ids that are negative, past E or huge, then on
    global ids through an expert map (expert parallel: 16 global experts, the odd ones local)."""
    gen = torch.Generator("cuda").manual_seed(7)
    E = 8
    experts = random_experts(E, 128, 64, gen)
    weights, ids = random_routing(M, E, 4, gen)
    ids[::3, 0] = -1
    ids[1::3, 1] = E + 5
    ids[2::5, 2] = 1 << 30
    run(random_hidden(M, 128, gen), experts, weights, ids)
    expert_map = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    expert_map[1::2] = torch.arange(E, dtype=torch.int32, device="cuda")
    g_weights, g_ids = random_routing(M, 16, 4, gen)
    run(random_hidden(M, 128, gen), experts, g_weights, g_ids.long(), expert_map=expert_map)
    return experts, gen


def check_deterministic(M, repeats=3):
    """fused_moe on the same inputs gives the same bits every time."""
    gen = torch.Generator("cuda").manual_seed(10)
    experts = random_experts(16, 512, 256, gen)
    x = random_hidden(M, 512, gen)
    weights, ids = random_routing(M, 16, 6, gen)
    first = mc.fused_moe(x, experts, weights, ids)
    for _ in range(repeats):
        assert torch.equal(mc.fused_moe(x, experts, weights, ids), first)


def run_checked(x, experts, weights, ids, **kw):
    """fused_moe into a poisoned output, compared with the reference."""
    out = torch.full((x.shape[0], experts.hidden_size), float("nan"), dtype=torch.bfloat16, device=x.device)
    mc.fused_moe(x, experts, weights, ids, out=out, **kw)
    assert_close(out, mc.reference.fused_moe_float(x, experts, weights, ids, **kw))
    return out
