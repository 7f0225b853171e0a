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


def run_checked(x, experts, weights, ids, **kw):
    """fused_moe into a poisoned output, compared with the reference."""
    out = torch.full((x.shape[0], experts.hidden_size), float("nan"), dtype=torch.bfloat16, device=x.device)
    mc.fused_moe(x, experts, weights, ids, out=out, **kw)
    assert_close(out, mc.reference.fused_moe_float(x, experts, weights, ids, **kw))
    return out
