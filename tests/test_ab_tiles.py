"""benchmarks/ab_tiles.py: the candidates' interleaving (the timing itself runs on the H200 only)."""
from benchmarks.ab_tiles import interleaved_us, label
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
    assert label(_gemm.plan(4096 * 4, 128)) == "plan:n128+n96+n64+n32"
