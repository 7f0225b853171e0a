"""benchmarks/ab_tiles.py: the candidates' interleaving (the timing itself runs on the H200 only)."""
from benchmarks.ab_tiles import candidate, exact_tiles, interleaved_us, label, split_tiles
from moe_cutlass import _gemm


def test_interleaving_cancels_a_first_place_advantage():
    calls = []

    def time_us(fn):   # the same layer three times; whichever runs first in a round is 10% faster
        first = len(calls) % 3 == 0
        calls.append(fn)
        return 90.0 if first else 100.0

    fns = [object(), object(), object()]
    assert interleaved_us(fns, time_us, rounds=1) == [90.0, 100.0, 100.0]   # one after another: biased
    calls.clear()
    assert interleaved_us(fns, time_us, rounds=3) == [100.0, 100.0, 100.0]
    assert [calls.count(fn) for fn in fns] == [3, 3, 3]
    assert [calls[3 * r] for r in range(3)] == fns   # each fn leads one round


def test_candidates_keep_their_own_times():
    times = {"a": 10.0, "b": 20.0}
    assert interleaved_us(["a", "b"], times.get, rounds=5) == [10.0, 20.0]


def test_labels_keep_a_192_row_tile_apart():
    assert label(_gemm.single("moe_gemm1_m128n64k256_coop")) == "n64k256"
    assert label(_gemm.single("moe_gemm1_m192n64k128_coop")) == "m192n64k128"
    assert label(_gemm.plan(4096 * 4, 128)) == "plan:n160+n128t/n128+n96t/n96+n64t+n32t"
    assert label(_gemm.plan(4096 * 4, 128, tall_tiles=_gemm.NO_TALL)) == "plan:n160+n128+n96+n64+n32"


def test_labels_name_each_gemms_tile_where_they_differ():
    one = _gemm.plan(64 * 4, 128, tall_tiles=(True, False))   # 2 rows per expert: one 8-token tile
    assert label(one) == "m192n8k256/n8k256"
    parts = _gemm.plan(1024 * 4, 128, tall_tiles=(True, True))
    assert label(parts) == "plan:n64t+n32t"


def test_plan_variants_force_the_192_row_tiles_per_gemm():
    name, forced, picked = candidate("plan-t01", 1024, 4, 128)
    assert not picked and name == "plan-t01:plan:n64/n64t+n32/n32t"
    assert [(c1, c2) for c1, c2, _, _ in forced.parts] == [
        ("moe_gemm1_m128n64k256_coop", "moe_gemm2_m192n64k256_coop"),
        ("moe_gemm1_m128n32k256_coop", "moe_gemm2_m192n32k256_coop")]


def test_exact_candidates_run_the_tiles_they_name():
    name, forced, picked = candidate("exact-m128n128k128+m128n96k128+m192n64k128+m192n32k128", 4096, 4, 128)
    assert not picked and name == "exact:plan:n128+n96+n64t+n32t"
    assert [(c1, c2) for c1, c2, _, _ in forced.parts] == [
        (f"moe_gemm1_{t}_coop", f"moe_gemm2_{t}_coop") for t in ("m128n128k128", "m128n96k128", "m192n64k128", "m192n32k128")]
    assert exact_tiles("exact-m192n128k128+m128n32k256") == ("m192n128k128_coop", "m128n32k256_coop")


def test_split_candidates_combine_the_token_tiles_they_name():
    assert split_tiles("split-128+96+64+16") == ("m128n128k128_coop", "m128n96k128_coop", "m128n64k256_coop",
                                                 "m128n16k256_coop")
    assert split_tiles("split-128c2+96+32") == ("m128n128k128_coop_c2", "m128n96k128_coop", "m128n32k256_coop")
    # GEMM1's 128-token part runs on 192 rows, in a cluster when the candidate asks for one
    name, forced, _ = candidate("split-128c2+96+64+32", 4096, 4, 128)   # gpt-oss: 128 +- 34 rows
    assert forced.parts[0][:2] == ("moe_gemm1_m192n128k128_coop_c2", "moe_gemm2_m128n128k128_coop_c2")
    name, forced, picked = candidate("split-128+64+32+16", 1024, 6, 256)   # dsv4-flash: 24 +- 15 rows
    assert name == "split-128+64+32+16:plan:n64t+n32t+n16" and not picked   # no 192-row 16-token twin
    chunk = forced.chunk
    windows = [(lo, hi) for _, _, lo, hi in forced.parts]
    assert chunk == 64 and windows == [(32, 64), (16, 32), (0, 16)]
    # every remainder lands in exactly one part, in the smallest of its tiles that holds it
    for rows in range(0, 200):
        takes = [_gemm.window_rows(rows, chunk, lo, hi)[1] for lo, hi in windows]
        assert sum(takes) == rows
    assert candidate("split-128+96+64+32", 1024, 6, 256)[2]   # SPLIT_TILES itself: the rule


def test_plan_constant_candidates_run_the_rule_with_those_constants():
    import pytest

    name, plan, picked = candidate("plan@SKEW_PART_MIN_WEIGHTS=inf", 1024, 8, 256, ks=(7168, 2048))   # dsv3
    assert name == "plan@SKEW_PART_MIN_WEIGHTS=inf:plan:n64t+n32t" and not picked
    assert [p[2:] for p in plan.parts] == [p[2:] for p in _gemm.plan(1024 * 8, 256).parts]   # the rule without ks
    assert _gemm.SKEW_PART_MIN_WEIGHTS == 4 << 20   # restored after
    assert candidate("plan", 1024, 8, 256, ks=(7168, 2048))[0] == "plan:n64t+n32t+n128t"
    # every part from 12 rows: the 128-token part is one the rule launches, so first
    assert candidate("plan@ALL_PARTS_ROWS=12", 1024, 8, 256, ks=(7168, 2048))[0].endswith(":plan:n128t+n96t+n64t+n32t")
    for bad in ("plan@NO_SUCH=1", "plan@WIDE_TILE=1"):
        with pytest.raises(ValueError, match="numeric constant"):
            candidate(bad, 1024, 8, 256)
