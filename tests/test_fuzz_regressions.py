"""fused_moe on the configurations the fuzzer (benchmarks/fuzz.py) has to get right.

REGRESSIONS holds the reproducers a failing fuzz run prints (paste them in as they come), and
hand-picked edges: one expert, every id invalid, no tokens, the routing kernels' path switch at
16384 slots (and its earlier one at 2048), 512 experts with k = 16, gpt-oss's odd H = I = 2880, duplicate ids.
"""
import pytest

from benchmarks.fuzz import Case, check_case

pytestmark = pytest.mark.gpu

REGRESSIONS = [
    Case(seed=1, E=1, k=1, H=32, I=32, M=1),
    Case(seed=2, E=4, k=2, H=64, I=32, M=17, invalid_ids=1.0, out=True),
    Case(seed=3, E=4, k=2, H=64, I=32, M=0, out=True, side_stream=True),
    Case(seed=4, E=8, k=4, H=96, I=160, M=513, id_dtype="int64", dead_rows=0.1, expert_map=12),
    Case(seed=5, E=512, k=16, H=32, I=32, M=129, invalid_ids=0.05, bias=True),
    Case(seed=6, E=4, k=2, H=2880, I=2880, M=65, activation="swiglu_oai", bias=True, gate_up="interleaved",
         swiglu_limit=7.0),
    Case(seed=7, E=3, k=3, H=32, I=64, M=100, duplicate_ids=True, signed_weights=True, side_stream=True),
    Case(seed=8, E=16, k=6, H=256, I=128, M=300, hidden_scale=16.0, routed_scaling_factor=2.5, out=True),
    Case(seed=9, E=8, k=4, H=96, I=160, M=4097, id_dtype="int64", dead_rows=0.1, expert_map=12),
]


@pytest.mark.parametrize("case", REGRESSIONS, ids=lambda c: f"seed{c.seed}-E{c.E}-k{c.k}-H{c.H}-I{c.I}-M{c.M}")
def test_fuzz_case(case):
    result = check_case(case, "cuda")
    assert result.ok, result.message
