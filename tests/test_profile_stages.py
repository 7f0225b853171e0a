"""benchmarks/profile_stages.py: what replaces the plan for --tall / --tile (the profiling runs on the H200 only)."""
import pytest

from benchmarks.profile_stages import plan_override
from moe_cutlass import _gemm


def test_no_override_keeps_the_rule():
    assert plan_override() is None


def test_tile_runs_every_call_on_one_tile():
    forced = plan_override(tile="n8k256")
    for rows, experts in ((4, 128), (4096 * 8, 128)):
        assert forced(rows, experts, None) == _gemm.single("moe_gemm1_m128n8k256_coop")
    assert plan_override(tile="m192n16k128_coop")(64, 128) == _gemm.single("moe_gemm1_m192n16k128_coop")


def test_tall_forces_192_rows_per_gemm():
    rows, experts = 256 * 8, 128   # qwen3 M = 256: the split plan's 32/64-token parts
    for tall in ("00", "01", "10", "11"):
        want = _gemm.plan(rows, experts, tall_tiles=(tall[0] == "1", tall[1] == "1"))
        assert plan_override(tall=tall)(rows, experts) == want
    assert plan_override(tall="00")(rows, experts) != plan_override(tall="11")(rows, experts)


@pytest.mark.parametrize("tall,tile", [("11", "n8k256"), ("1", None), ("12", None), ("ab", None)])
def test_bad_overrides_are_refused(tall, tile):
    with pytest.raises(ValueError, match="--tall"):
        plan_override(tall, tile)


def test_a_split_candidate_keeps_the_rule_with_other_split_tiles():
    rows, experts = 1024 * 4, 128   # gpt-oss M = 1024: 32 +- 17 rows per expert
    forced = plan_override(tile="split-128+96+64+32+16")(rows, experts)
    assert [_gemm.tile_n(part[0]) for part in forced.parts] == [64, 32, 16]
    assert forced != _gemm.plan(rows, experts)


def test_an_exact_candidate_runs_its_tiles_as_named():
    rows, experts = 4096 * 4, 128   # gpt-oss M = 4096: parts of 128 / 96 / 64 / 32 tokens (the rule adds 160)
    forced = plan_override(tile="exact-m128n128k128+m128n96k128+m128n64k256+m128n32k256")(rows, experts)
    assert all("_m128" in c for part in forced.parts for c in part[:2])
    assert [part[2:] for part in forced.parts] == [part[2:] for part in _gemm.split_plan(rows, experts, _gemm.SPLIT_TILES).parts]


def test_gemm2_min_k_moves_gemm2s_wide_parts_only():
    rows, experts, ks = 4096 * 4, 128, (2880, 2880)   # gpt-oss M = 4096
    rule = _gemm.plan(rows, experts, ks=ks)
    kept = plan_override(gemm2_min_k=1 << 20)(rows, experts, ks=ks)
    # parts[0] is the 160-token part, on 128 rows either way
    assert [p[1] for p in rule.parts[1:3]] == ["moe_gemm2_m192n128k128_coop", "moe_gemm2_m192n96k128_coop"]
    assert [p[1] for p in kept.parts[1:3]] == ["moe_gemm2_m128n128k128_coop", "moe_gemm2_m128n96k128_coop"]
    assert [p[0] for p in kept.parts] == [p[0] for p in rule.parts] and kept.parts[3:] == rule.parts[3:]
    assert kept.parts[0] == rule.parts[0]
    assert plan_override(gemm2_min_k=768)(rows, experts, ks=(2048, 768)).parts[1][1] == "moe_gemm2_m192n128k128_coop"
    with pytest.raises(ValueError, match="exclude"):
        plan_override(tall="11", gemm2_min_k=768)
