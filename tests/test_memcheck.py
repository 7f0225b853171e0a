"""compute-sanitizer memcheck over a small fused_moe call: no out-of-bounds or misaligned access.

Odd sizes (H = I = 96 are not tile multiples), out-of-range ids and an expert map exercise the
edges. The caching allocator is off so that every tensor is its own allocation and an access
past one is caught.
"""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

CASE = textwrap.dedent("""
    import torch, moe_cutlass as mc
    g = torch.Generator("cuda").manual_seed(0)
    E, H, I, M, k = 6, 96, 96, 37, 3
    def mx(N, K):
        return (torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda", generator=g),
                torch.randint(118, 126, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=g))
    experts = mc.prepare_experts(*mx(2 * I, H), *mx(H, I), w13_bias=torch.randn(E, 2 * I, device="cuda"),
                                 w2_bias=torch.randn(E, H, device="cuda"), gate_up="interleaved")
    x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
    ids = torch.randint(-2, E + 2, (M, k), dtype=torch.int32, device="cuda", generator=g)
    w = torch.rand(M, k, device="cuda", generator=g)
    out = mc.fused_moe(x, experts, w, ids, activation="swiglu_oai", swiglu_limit=7.0)
    emap = torch.tensor([3, -1, 0, 5, 1, -1, 2, 4], dtype=torch.int32, device="cuda")
    gids = torch.randint(0, 8, (M, k), dtype=torch.int64, device="cuda", generator=g)
    out2 = mc.fused_moe(x, experts, w, gids, expert_map=emap)
    torch.cuda.synchronize()
    print("case done", out.float().norm().item(), out2.float().norm().item())
""")


def _sanitizer():
    for path in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if path and os.access(path, os.X_OK):
            return path
    pytest.skip("compute-sanitizer not found")


def test_fused_moe_is_memcheck_clean():
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([_sanitizer(), "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c", CASE],
                          capture_output=True, text=True, timeout=900, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "case done" in log, log[-4000:]
    assert "ERROR SUMMARY: 0 errors" in log, log[-4000:]
