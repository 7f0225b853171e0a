"""benchmarks/tile_waste.py: the waste and re-stream arithmetic, its record."""
import json

import pytest
import torch

from benchmarks import tile_waste


def test_one_tile_pads_each_expert_to_whole_tiles():
    rows = torch.tensor([1, 0, 9])
    waste, restream = tile_waste.factors(rows, lambda r: tile_waste.one_tile(r, 8))
    assert waste == pytest.approx(24 / 10)  # 8 + 0 + 16 padded rows
    assert restream == pytest.approx(3 / 2)  # 1 + 2 tiles over 2 active experts


def test_rem128_rounds_the_remainder_up_to_32():
    padded, tiles = tile_waste.rem128(torch.tensor([130, 128, 33, 0]))
    assert padded.tolist() == [160, 128, 64, 0] and tiles.tolist() == [2, 1, 1, 0]
    assert tile_waste.factors(torch.tensor([130]), tile_waste.rem128) == (pytest.approx(160 / 130), 2.0)


def test_oracle_breaks_ties_toward_the_larger_tile():
    padded, tiles = tile_waste.oracle(torch.tensor([64, 63, 200, 1, 0]))
    # 63 pads to 64 with TileN 64 or 128: the 128-token tile; 200 needs TileN 8 to avoid padding.
    assert padded.tolist() == [64, 64, 200, 8, 0] and tiles.tolist() == [1, 1, 25, 1, 0]


def test_oracle_never_wastes_more_than_one_tile_or_rem128():
    rows = torch.randint(0, 700, (4096,), generator=torch.Generator().manual_seed(0))
    waste, _ = tile_waste.factors(rows, tile_waste.oracle)
    for scheme in [tile_waste.rem128] + [lambda r, n=n: tile_waste.one_tile(r, n) for n in tile_waste.TILES]:
        assert waste <= tile_waste.factors(rows, scheme)[0]


def test_tile_n_reads_the_config_name():
    from moe_cutlass import _gemm

    assert _gemm.tile_n("moe_gemm1_m128n32k128_coop") == 32
    assert _gemm.tile_n("moe_gemm2_m128n128k128_coop") == 128
    assert _gemm.tile_n("m128n8k256_coop") == 8


def test_a_split_plan_pads_each_part_to_its_tile():
    from moe_cutlass import _gemm

    # 128 (full chunks, rest > 96), 96 (65..96), 64 (33..64), 32 (1..32)
    plan = _gemm.split_plan(4096 * 4, 128, _gemm.SPLIT_TILES)
    rows = torch.tensor([300, 130, 100, 70, 64, 33, 20, 0])
    padded, tiles = tile_waste.planned(rows, plan)
    assert padded.tolist() == [256 + 64, 128 + 32, 128, 96, 64, 64, 32, 0]
    assert tiles.tolist() == [3, 2, 1, 1, 1, 1, 1, 0]
    # the default at 128 rows per expert: a chunk of 160, its remainders above 128 in the 160-token tile
    padded, tiles = tile_waste.planned(rows, _gemm.split_plan(4096 * 4, 128))
    assert padded.tolist() == [160 + 160, 160, 128, 96, 64, 64, 32, 0]
    assert tiles.tolist() == [2, 1, 1, 1, 1, 1, 1, 0]
    single = _gemm.single("moe_gemm1_m128n64k128_coop")
    assert tile_waste.planned(torch.tensor([130]), single)[0].tolist() == [192]


def test_the_gmma_scheme_pads_last_tiles_to_their_gmma_width():
    from moe_cutlass import _gemm

    plan = _gemm.plan(4096 * 4, 128)   # 160 / 128 / 96 / 64 / 32, all but the 160-token part on 192 rows
    rows = torch.tensor([300, 150, 130, 100, 70, 33, 20, 0])
    padded, tiles = tile_waste.planned(rows, plan, gmma=True)
    # 300 = a full 160 chunk + 140 on the 144 width; 100 on the 128-token part's 104; 33 on 40; 20 on 24
    assert padded.tolist() == [160 + 144, 160, 144, 104, 72, 40, 24, 0]
    assert tiles.tolist() == tile_waste.planned(rows, plan)[1].tolist()


def test_uniform_gpt_oss_m4096_matches_the_earlier_simulation():
    # KERNEL_NOTES H.4: one 128-token tile wastes 1.45 at gpt-oss M=4096 (one draw; the mean over
    # 100 seeds is 1.48).
    row = tile_waste.measure("gpt-oss-120b", 4096, "uniform", seeds=5)
    assert row["pick_tile_n"] == 128
    assert row["pick_waste"] == pytest.approx(1.45, rel=0.05)
    assert row["rem128_waste"] == pytest.approx(1.11, rel=0.05)


def test_cli_writes_a_record(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CUTLASS_COMMIT", "abc123")
    assert tile_waste.main(["--ms", "16,64", "--configs", "dsv3", "--seeds", "2", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("tile_waste_*.json")
    record = json.loads(path.read_text())
    assert record["kind"] == "tile_waste" and record["commit"] == "abc123"
    assert record["device"] == "cpu (simulation)"
    assert [(r["M"], r["routing"]) for r in record["rows"]] == [(M, r) for M in (16, 64) for r in tile_waste.ROUTINGS]
    assert all(r["oracle_waste"] <= r["pick_waste"] for r in record["rows"])
