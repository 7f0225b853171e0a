"""fused_moe argument checks: bad input raises a clear error before anything is launched.

These run without a GPU: every check happens before the device is touched.
"""
import pytest
import torch

import moe_cutlass as mc

E, H, I, M, K = 4, 64, 32, 5, 2


@pytest.fixture(scope="module")
def experts():
    gen = torch.Generator().manual_seed(0)
    w13 = mc.quantize_mxfp4(torch.randn(E, 2 * I, H, generator=gen))
    w2 = mc.quantize_mxfp4(torch.randn(E, H, I, generator=gen))
    return mc.prepare_experts(*w13, *w2)


def args(**over):
    base = dict(hidden_states=torch.randn(M, H).to(torch.bfloat16),
                topk_weights=torch.rand(M, K),
                topk_ids=torch.randint(0, E, (M, K), dtype=torch.int32))
    base.update(over)
    return base


def call(experts, **over):
    a = args(**over)
    hidden = a.pop("hidden_states")
    return mc.fused_moe(hidden, experts, a.pop("topk_weights"), a.pop("topk_ids"), **a)


@pytest.mark.parametrize("over, error, words", [
    (dict(hidden_states=torch.randn(M, H)), TypeError, "hidden_states"),
    (dict(hidden_states=torch.randn(M, H + 32).to(torch.bfloat16)), ValueError, "hidden_states"),
    (dict(hidden_states=torch.randn(H, M).to(torch.bfloat16).T), ValueError, "hidden_states"),
    (dict(topk_ids=torch.rand(M, K)), TypeError, "topk_ids"),
    (dict(topk_ids=torch.zeros(M + 1, K, dtype=torch.int32)), ValueError, "topk_ids"),
    (dict(topk_weights=torch.rand(M, K).double()), TypeError, "topk_weights"),
    (dict(topk_weights=torch.rand(M, K + 1)), ValueError, "topk_weights"),
    (dict(activation="gelu"), ValueError, "activation"),
    (dict(swiglu_limit=-1.0), ValueError, "swiglu_limit"),
    (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor"),
    (dict(expert_map=torch.zeros(8, dtype=torch.int64)), TypeError, "expert_map"),
    (dict(out=torch.empty(M, H)), TypeError, "out"),
    (dict(out=torch.empty(M + 1, H, dtype=torch.bfloat16)), ValueError, "out"),
])
def test_bad_arguments_name_the_argument(experts, over, error, words):
    with pytest.raises(error, match=words):
        call(experts, **over)


def test_experts_must_be_prepared():
    with pytest.raises(TypeError, match="experts"):
        mc.fused_moe(torch.randn(M, H).to(torch.bfloat16), object(), torch.rand(M, K),
                     torch.zeros(M, K, dtype=torch.int32))


def test_cpu_tensors_are_refused(experts):
    with pytest.raises(ValueError, match="CUDA"):
        call(experts)


@pytest.mark.parametrize("rows_per_expert, tile", [
    (1, "n8k256"), (4, "n8k256"), (5, "n32k256"), (8, "n32k256"), (12, "n32k256"), (24, "n32k256"),
    (32, "n64k256"), (48, "n64k256"), (64, "n128k128"), (512, "n128k128"),
])
def test_gemm_tile_follows_rows_per_expert(rows_per_expert, tile):
    from moe_cutlass import _gemm

    for kind in (1, 2):
        assert _gemm.pick_config(kind, rows_per_expert * 128, 128) == f"moe_gemm{kind}_m128{tile}_coop"


def test_gemm_tile_falls_back_to_one_the_library_holds():
    from moe_cutlass import _gemm

    assert _gemm.pick_config(1, 8, 1, available=["moe_gemm1_m128n32k128_coop"]) == "moe_gemm1_m128n32k128_coop"


SHAPE_ROUTES = {"qwen3-30b-a3b": (128, 8), "gpt-oss-120b": (128, 4), "dsv4-flash": (256, 6), "dsv3": (256, 8),
                "e8k2": (8, 2)}


@pytest.mark.parametrize("ks", [None, (7168, 2048)])
@pytest.mark.parametrize("M", [1, 16, 64, 256, 300, 512, 1000, 1024, 2048, 3072, 4096, 16384, 10 ** 6])
@pytest.mark.parametrize("shape", list(SHAPE_ROUTES))
def test_plan_parts_take_every_row_once(shape, M, ks):
    """Whatever an expert's row count, the parts of the GEMM plan take each of its rows exactly once,
    as one contiguous run per part, and each part's token tile holds its remainder (ks: large experts,
    whose split plans end with the skew part)."""
    from moe_cutlass import _gemm

    E, k = SHAPE_ROUTES[shape]
    plan = _gemm.plan(M * k, E, ks=ks)
    assert 1 <= len(plan.parts) <= mc.ops.MAX_GEMM_PARTS
    tiles = [_gemm.tile_n(part[0]) for part in plan.parts]
    if plan.parts[-1][3] == plan.chunk and len(plan.parts) > 1:   # the skew part, launched last
        tiles = tiles[-1:] + tiles[:-1]
    assert tiles == sorted(tiles, reverse=True) and all(_gemm.tile_n(p[1]) == _gemm.tile_n(p[0]) for p in plan.parts)
    for rows in range(0, 3 * 160 + 2):
        taken = []
        for config1, _, lo, hi in plan.parts:
            first, count = _gemm.window_rows(rows, plan.chunk, lo, hi)
            taken += range(first, first + count)
            if count and len(plan.parts) > 1 and hi < plan.chunk:
                assert count <= _gemm.tile_n(config1), "a remainder part takes one tile per expert"
        assert sorted(taken) == list(range(rows)), (rows, plan)


@pytest.mark.parametrize("config, widths", [
    ("moe_gemm1_m192n64k128_coop", (40, 48, 56, 64)), ("moe_gemm2_m192n32k256_coop", (8, 16, 24, 32)),
    ("moe_gemm1_m192n8k256_coop", (8,)), ("moe_gemm1_m128n16k256_coop", (8, 16)),
    ("moe_gemm2_m128n160k128_coop", (144, 160)), ("moe_gemm1_m128n128k128_coop_c2", (128,)),
    ("moe_gemm1_m192n128k128_coop_c2", (104, 112, 120, 128))])
def test_gmma_widths_mirror_the_mainloop(config, widths):
    """_gemm.gmma_widths names the widths that moe_gemm_mainloop.hpp's kTokenWidths / kWidthStep build: the
    160-token part (129-160 tokens per tile) in two, 16 apart."""
    from moe_cutlass import _gemm

    assert _gemm.gmma_widths(config) == widths


def test_plan_clusters_the_128_token_part_from_256_rows_per_expert():
    from moe_cutlass import _gemm

    def first(plan):
        return plan.parts[0][:2]
    assert first(_gemm.plan(16384 * 8, 128)) == ("moe_gemm1_m192n128k128_coop_c2", "moe_gemm2_m128n128k128_coop_c2")
    assert all("_c2" not in c for part in _gemm.plan(16384 * 8, 128).parts[1:] for c in part[:2])
    # 128 rows per expert: the 160-token part first, the 128-token one without clusters
    assert [part[:2] for part in _gemm.plan(4096 * 4, 128).parts[:2]] == [
        ("moe_gemm1_m128n160k128_coop", "moe_gemm2_m128n160k128_coop"),
        ("moe_gemm1_m192n128k128_coop", "moe_gemm2_m128n128k128_coop")]
    assert _gemm.plan(16384 * 8, 128, batch_invariant=True) == _gemm.single("moe_gemm1_m128n128k128_coop")
    named = _gemm.plan(16384 * 8, 128, split_tiles=_gemm.SPLIT_TILES)   # an A/B candidate runs as named
    assert first(named) == ("moe_gemm1_m192n128k128_coop", "moe_gemm2_m128n128k128_coop")
    without = [f"moe_gemm1_{t}" for t in (*_gemm.SPLIT_TILES, "m192n128k128_coop")]   # a build without _c2
    assert first(_gemm.plan(16384 * 8, 128, available=without)) == first(named)


def test_plan_splits_only_above_the_streaming_tiles():
    from moe_cutlass import _gemm

    for per_expert in (1, 4, 8, 12):
        plan = _gemm.plan(per_expert * 128, 128)
        tiles = {_gemm.tile_n(c) for c in plan.parts[0][:2]}
        assert len(plan.parts) == 1 and tiles == {_gemm.tile_n(_gemm.pick_config(1, per_expert * 128, 128))}
    # the M = 1024 ridge: one part per expert size class, each expert's weights converted once
    assert [_gemm.tile_n(p[0]) for p in _gemm.plan(1024 * 4, 128).parts] == [64, 32]      # gpt-oss
    assert [_gemm.tile_n(p[0]) for p in _gemm.plan(1024 * 8, 128).parts] == [96, 64]      # qwen3
    assert _gemm.plan(1024 * 8, 128).chunk == 96   # the smallest tile above the spread, any size
    assert [_gemm.tile_n(p[0]) for p in _gemm.plan(4096 * 4, 128).parts] == [160, 128, 96, 64, 32]
    # the 160-token part where the spread passes 128 rows per expert, up to WIDE_MAX_ROWS on average
    assert _gemm.plan(4096 * 8, 128).chunk == 160 == _gemm.plan(2048 * 8, 128).chunk         # qwen3 M = 4096, 2048
    assert _gemm.plan(4096 * 6, 256).chunk == 128 == _gemm.plan(8192 * 8, 128).chunk         # dsv4-flash M = 4096, qwen3 M = 8192
    assert _gemm.WIDE_TILE not in str(_gemm.plan(8192 * 8, 128)) + str(_gemm.plan(4096 * 6, 256))
    assert _gemm.plan(4096 * 4, 128, batch_invariant=True) == _gemm.single("moe_gemm1_m128n128k128_coop")
    every = [f"moe_gemm1_{t}" for t in _gemm.SPLIT_TILES]   # GEMM1 names, as ops passes configs_of(1)
    assert len(_gemm.plan(4096 * 4, 128, available=every).parts) == 4
    only = ["moe_gemm1_m128n128k128_coop", "moe_gemm1_m128n32k128_coop"]   # a partial build: one tile
    assert _gemm.plan(4096 * 4, 128, available=only) == _gemm.single("moe_gemm1_m128n128k128_coop")


@pytest.mark.parametrize("shape", ["gpt-oss-120b", "dsv4-flash", "dsv3"])
def test_split_plans_of_large_experts_end_with_the_128_token_part(shape):
    """Skewed routing's busy experts: with (hidden, intermediate) given and at least SKEW_PART_MIN_WEIGHTS weights an
    expert, every split plan launches the 128-token part too, last, over chunks of 128 rows; the spread's parts
    stay as without it. qwen3's small experts, and calls whose K is not given, keep the rule."""
    from moe_cutlass import _gemm

    E, k = SHAPE_ROUTES[shape]
    H, I = {"gpt-oss-120b": (2880, 2880), "dsv4-flash": (4096, 2048), "dsv3": (7168, 2048)}[shape]
    for M in (512, 1024, 2048):
        rows = M * k
        if rows / E <= _gemm.SPLIT_MIN_ROWS:
            continue
        plan, rule = _gemm.plan(rows, E, ks=(H, I)), _gemm.plan(rows, E)
        skew, spread = plan.parts[-1], plan.parts[:-1]   # launched last: under uniform routing it gets no rows
        assert plan.chunk == 128 and _gemm.tile_n(skew[0]) == 128 and skew[3] == 128
        assert [_gemm.tile_n(p[0]) for p in spread] == [_gemm.tile_n(p[0]) for p in rule.parts]
        assert all(p[3] == _gemm.tile_n(p[0]) for p in spread)   # each takes the remainders its tile holds
        assert skew[2] == _gemm.tile_n(spread[0][0])   # the remainders above them
    for M, tiles in ((512, [64, 32]), (1024, [96, 64])):   # qwen3: 1.5 M weights an expert
        qwen3 = _gemm.plan(M * 8, 128, ks=(2048, 768))
        assert [_gemm.tile_n(p[0]) for p in qwen3.parts] == tiles and qwen3.chunk == _gemm.plan(M * 8, 128).chunk
    # from ALL_PARTS_ROWS on every part is launched anyway: the same plan with or without ks
    assert [p[2:] for p in _gemm.plan(4096 * 4, 128, ks=(2880, 2880)).parts] == [p[2:] for p in _gemm.plan(4096 * 4, 128).parts]


@pytest.mark.parametrize("shape", ["mixtral-8x7b", "llama4-scout", "gpt-oss-20b", "qwen2-57b-a14b"])
def test_layers_of_few_large_experts_keep_the_spreads_parts(shape):
    """Below SKEW_PART_MIN_EXPERTS experts the skew part is left out however large the experts are (it cost
    mixtral-8x7b up to 28% under skewed routing): the plan is the one without the experts' K."""
    from benchmarks.bench_moe import MODELS
    from moe_cutlass import _gemm

    E, H, I, k = MODELS[shape]
    assert H * I >= _gemm.SKEW_PART_MIN_WEIGHTS and E < _gemm.SKEW_PART_MIN_EXPERTS
    for M in (256, 512, 1024):
        if M * k / E <= _gemm.SPLIT_MIN_ROWS:
            continue
        with_ks, rule = _gemm.plan(M * k, E, ks=(H, I)), _gemm.plan(M * k, E)
        assert [p[2:] for p in with_ks.parts] == [p[2:] for p in rule.parts] and with_ks.chunk == rule.chunk
    big = _gemm.plan(1024 * 8, _gemm.SKEW_PART_MIN_EXPERTS, ks=(H, I))   # as many experts as the rule asks: the part
    assert _gemm.tile_n(big.parts[-1][0]) == _gemm.SKEW_TILE_N and big.chunk == _gemm.SKEW_TILE_N


def test_short_is_the_inverse_of_tall_and_tuned_plans_use_it():
    """Every 192-row tile maps back to the 128-row tile it stands for; a tuned (PLAN, PLAN_SHORT) is the rule's
    plan with GEMM2's tiles on 128 rows and GEMM1's as the rule has them; two configs are one launch each."""
    from moe_cutlass import _gemm

    for table in (_gemm.TALL_TILES, _gemm.TALL_TILES_GEMM1):
        for s, t in table.items():
            assert _gemm.short(f"moe_gemm2_{t}") == f"moe_gemm2_{s}"
    assert _gemm.short("moe_gemm2_m128n64k256_coop") == "moe_gemm2_m128n64k256_coop"
    assert _gemm.short("moe_gemm2_m192n64k128_coop", available=["moe_gemm1_m192n64k128_coop"]) == \
        "moe_gemm2_m192n64k128_coop"   # a library without the twin keeps the tile
    for rows, E, ks in ((256 * 2, 8, (4096, 14336)), (16 * 2, 8, (4096, 14336)), (4096 * 8, 256, (7168, 2048))):
        rule = _gemm.plan(rows, E, ks=ks)
        short = _gemm.tuned_plan((_gemm.PLAN, _gemm.PLAN_SHORT), rows, E, ks=ks)
        assert short.chunk == rule.chunk and [p[0] for p in short.parts] == [p[0] for p in rule.parts]
        assert [p[2:] for p in short.parts] == [p[2:] for p in rule.parts]
        assert [p[1] for p in short.parts] == [_gemm.short(p[1]) for p in rule.parts]
        assert all(p[1].startswith("moe_gemm2_m128") for p in short.parts) and any(
            p[1].startswith("moe_gemm2_m192") for p in rule.parts)
        assert _gemm.tuned_plan((_gemm.PLAN, _gemm.PLAN), rows, E, ks=ks) == rule
    pair = ("moe_gemm1_m128n32k256_coop", "moe_gemm2_m128n32k256_coop")
    assert _gemm.tuned_plan(pair, 1000, 8) == _gemm.single(*pair)


def test_ridge_parts_run_tilek_256_on_192_rows_at_any_k():
    from moe_cutlass import _gemm

    def tiles(ks, available=None):   # dsv3 M = 1024: 64 + 32 (after the skew part's 128, where ks names large experts)
        return [(c1[len("moe_gemm1_"):], c2[len("moe_gemm2_"):])
                for c1, c2, _, _ in _gemm.plan(1024 * 8, 256, available, ks=ks).parts if _gemm.tile_n(c1) < 128]

    assert tiles((7168, 2048)) == tiles(None) == tiles((2880, 2880)) == [("m192n64k256_coop",) * 2,
                                                                          ("m192n32k256_coop",) * 2]
    # a library without the 192-row versions falls back to 128 rows
    assert tiles((7168, 2048), [f"moe_gemm1_{t}" for t in _gemm.SPLIT_TILES]) == [
        ("m128n64k256_coop",) * 2, ("m128n32k256_coop",) * 2]
    # GEMM2's 96/128-token parts run on 192 rows where its K is long (TALL_GEMM2_MIN_K), not at qwen3's 768;
    # the streaming tiles do not depend on K
    assert _gemm.plan(4096 * 4, 128, ks=(2048, 768)).parts[:2] == _gemm.plan(4096 * 4, 128).parts[:2]
    assert [(c1[len("moe_gemm1_"):], c2[len("moe_gemm2_"):]) for c1, c2, _, _ in
            _gemm.plan(4096 * 4, 128, ks=(2880, 2880)).parts[1:3]] == [("m192n128k128_coop",) * 2, ("m192n96k128_coop",) * 2]
    assert _gemm.plan(16384 * 8, 256, ks=(7168, 2048)).parts[0][:2] == ("moe_gemm1_m192n128k128_coop_c2",
                                                                        "moe_gemm2_m192n128k128_coop_c2")
    assert _gemm.plan(16384 * 8, 128, ks=(2048, 768)).parts[0][:2] == ("moe_gemm1_m192n128k128_coop_c2",
                                                                       "moe_gemm2_m128n128k128_coop_c2")
    assert _gemm.plan(64 * 4, 128, ks=(2048, 768)) == _gemm.plan(64 * 4, 128) == _gemm.single("moe_gemm1_m192n8k256_coop")


def test_split_parts_run_on_192_rows_where_the_library_holds_them():
    from moe_cutlass import _gemm

    # GEMM1's parts all on 192 rows but the 160-token one, GEMM2's of up to 64 tokens
    parts = _gemm.plan(4096 * 4, 128).parts
    assert [(c1[len("moe_gemm1_"):], c2[len("moe_gemm2_"):]) for c1, c2, _, _ in parts] == [
        ("m128n160k128_coop",) * 2,
        ("m192n128k128_coop", "m128n128k128_coop"), ("m192n96k128_coop", "m128n96k128_coop"),
        ("m192n64k256_coop",) * 2, ("m192n32k256_coop",) * 2]
    assert [p[2:] for p in parts] == [p[2:] for p in _gemm.split_plan(4096 * 4, 128).parts]
    no_wide = [f"moe_gemm1_{t}" for t in (*_gemm.SPLIT_TILES, *_gemm.TALL_TILES.values())]
    assert [_gemm.tile_n(p[0]) for p in _gemm.plan(4096 * 4, 128, available=no_wide).parts if "_m192" in p[0]] == [64, 32]
    every = [f"moe_gemm1_{t}" for t in _gemm.SPLIT_TILES]   # a build without the 192-row tiles
    assert all("_m128" in c for part in _gemm.plan(4096 * 4, 128, available=every).parts for c in part[:2])
    # the streaming 8/32-token tiles run on 192 rows, the 32-token one on TileK 256 at any K;
    # an explicit tall_tiles overrides the rule both ways
    assert _gemm.plan(64 * 4, 128) == _gemm.single("moe_gemm1_m192n8k256_coop")          # 2 rows per expert
    assert _gemm.plan(2 * 8, 256) == _gemm.single("moe_gemm1_m192n8k256_coop")           # 1/16
    assert _gemm.plan(64 * 4, 128, available=every + ["moe_gemm1_m128n8k256_coop"]) == _gemm.single(
        "moe_gemm1_m128n8k256_coop")
    assert _gemm.plan(256 * 4, 128) == _gemm.single("moe_gemm1_m192n32k256_coop")        # 8
    assert _gemm.plan(256 * 4, 128, ks=(2880, 2880)) == _gemm.plan(256 * 4, 128)
    assert _gemm.plan(256 * 4, 128, tall_tiles=_gemm.NO_TALL) == _gemm.single("moe_gemm1_m128n32k256_coop")
    assert _gemm.plan(64 * 4, 128, tall_tiles=_gemm.NO_TALL) == _gemm.single("moe_gemm1_m128n8k256_coop")
    assert _gemm.plan(32 * 4, 128, tall_tiles=_gemm.BOTH_TALL) == _gemm.single("moe_gemm1_m192n8k256_coop")
    assert all("_m128" in c for part in _gemm.plan(4096 * 4, 128, tall_tiles=_gemm.NO_TALL).parts for c in part[:2])
