"""Thin Python wrapper of the MoE grouped-GEMM C ABI (templates/sm90/moe_gemm.h.j2): the layer,
the tests and benchmarks/bench_gemm.py call the kernels through it, and the host's choice of token
tiles (pick_config, plan).

    mc_sm90_<config>(w_blocks, w_scales, bias, act, act_rows, expert_offsets, row_chunk, rem_lo, rem_hi,
                     row_weights, out, E, N, K, scale_max, activation, swiglu_alpha, swiglu_limit,
                     workspace, workspace_bytes, stream, pdl)
"""

import bisect
import functools
import math
import re
from typing import NamedTuple

import torch

from . import _lib

ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}
MAX_SCALE_BYTE = 255   # a prepared dict without scale_max takes the conversion exact for every byte
GEMM1_CONFIG = "moe_gemm1_m128n32k128_coop"
GEMM2_CONFIG = "moe_gemm2_m128n32k128_coop"
ALL_ROWS = (1 << 30, 0, 1 << 30)   # the row window (chunk, rem_lo, rem_hi) that takes every row
PLAN = "plan"   # a tuned choice that keeps the built-in rule (plan) for its batch size
# A tuned choice that keeps the rule's plan but runs that GEMM's tiles on 128 rows (short): with few experts a
# GEMM's 192-row tiles can leave the last wave of a launch mostly idle (mixtral-8x7b's GEMM2: 22 of them an
# expert, 8 experts; benchmarks/NOTES.md (40)); tuning.autotune measures it beside the rule.
PLAN_SHORT = "plan-128rows"
PLANS = (PLAN, PLAN_SHORT)


def pick_config(kind: int, rows: int, num_experts: int, available=None, batch_invariant=False) -> str:
    """A config for GEMM<kind> given the host-known number of rows (M * top_k) and E.

    With few rows per expert the kernels stream weights, and the 8/32-token tiles with TileK 256
    win even when a busy expert needs a second tile; from ~24 rows per expert on, routing's
    unevenness decides: a tile sized for the average makes many experts re-stream their weights
    for a second tile, so the next larger tile wins. Layer A/B on an H200 with random routing
    (benchmarks/results/bench_20261129T133320Z.json vs bench_20261129T133334Z.json): at 32 rows
    per expert the 64-token tile beats the 32-token one (gpt-oss M=1024 1138 vs 1346 us, dsv3
    3656 vs 4401 us), at 64 the 128-token tile beats the 64-token one (qwen3 411 vs 458 us), at
    24 the 32-token tile still wins (dsv4 1918 vs 2122 us), at 8 the 16-token one (gpt-oss 738
    vs 909 us). The 32- and 64-token tiles take TileK 256: the same tile with half the k tiles'
    fixed work (barrier wait, GMMA descriptors, scale loads) is 3-10% faster in one run
    (benchmarks/results/bench_20261201T030839Z.json, NOTES.md 2026-12-01 (5)). From 4 to 12 rows per
    expert the 32-token tile (on 192 rows: its GMMAs only as wide as each expert's rows, 8-32) replaced
    the 16-token one: layers, five rounds interleaved, every routing, the four shapes at 4.5-12 rows
    per expert (benchmarks/results/raw/bench_20261204T1439*Z_stream_tile_n32_sweep_*.json, and
    bench_20261204T1440*Z_...): uniform -0.4..-20.8% (gpt-oss M = 192 +0.4%), Zipf -6.9..-25.6%,
    Dirichlet -9.2..-31.4%; seven more models' shapes (raw/bench_20261204T1442*Z_models_stream_tile_n32_*.json)
    uniform -0.6..-15.1%, Zipf -1.0..-23.5%. Timed as the peer benchmark times (100 back-to-back replays a
    round, the board at its power cap; raw/bench_20261204T15*Z_stream_tile_n32_sustained_*.json, two runs
    uniform): Zipf -5.0..-17.4%, Dirichlet -12.3..-23.2%, uniform -0.7..-9.6% but dsv3 at 6 / 8 rows per
    expert, +0.1 / +1.3% and +5.8 / +3.7% (rechecked on another machine: -2.3 / +0.7%,
    raw/bench_20261204T1559*Z_stream_tile_recheck_*.json). At 4 rows per expert and below it loses under
    uniform routing (+1.5..+10.4%; -1.4..-10.9% under Zipf, raw/bench_20261204T16*Z_stream_tile_low_rows_*.json;
    the 16-token tile is no middle ground), so the 8-token tile stays there. The real per-expert
    counts live on the device only.

    batch_invariant: only tiles that sum a token's products in one order. A tile's order depends
    on its number of accumulator chains alone (moe_gemm_mainloop.hpp, NumAcc: 4 for N <= 16, 2
    for N = 32, 1 above; the chain of k-block g is g % NumAcc whatever TileK is), so the 64- and
    128-token tiles agree bit for bit and the others differ.
    """
    per_expert = rows / max(1, num_experts)
    tiles = ((48, "n64k256"),) if batch_invariant else (
        (4, "n8k256"), (24, "n32k256"), (48, "n64k256"))
    for limit, tile in tiles:
        if per_expert <= limit:
            break
    else:
        tile = "n128k128"
    name = f"moe_gemm{kind}_m128{tile}_coop"
    if available is not None and name not in available:
        name = f"moe_gemm{kind}_m128n32k128_coop"
    return name


def tile_n(config: str) -> int:
    """The token tile (TileN) of a GEMM config name (moe_gemm<kind>_m<M>n<N>k<K>_<schedule>) or tile."""
    return int(re.search(r"m\d+n(\d+)k\d+", config).group(1))


def gmma_widths(config: str) -> tuple:
    """The GMMA widths, in tokens, that a config's mainloop holds for an expert's last token tile: it runs
    the narrowest that covers the tile's tokens (templates/sm90/moe_gemm_mainloop.hpp item 12, kTokenWidths
    and kWidthStep): the 192-row tiles' upper four 8-token widths, 8 / 16 for the 16-token tile, 144 / 160
    for the 160-token one, the full tile elsewhere."""
    n = tile_n(config)
    if re.search(r"m192n", config):
        return tuple(range(n - 8 * (min(4, n // 8) - 1), n + 1, 8))
    return {16: (8, 16), 160: (144, 160)}.get(n, (n,))


class Plan(NamedTuple):
    """How a layer call launches its GEMMs: parts[p] = (GEMM1 config, GEMM2 config, rem_lo, rem_hi),
    each run over the rows that the window (chunk, rem_lo, rem_hi) takes of every expert
    (templates/sm90/moe_rows.hpp), largest tile first."""

    chunk: int
    parts: tuple


def window_rows(rows: int, chunk: int, rem_lo: int, rem_hi: int) -> tuple:
    """(first, count): the rows of an expert with `rows` rows that a launch with this window takes,
    first counted from the expert's first row (MoeRowWindow::rows of templates/sm90/moe_rows.hpp)."""
    rem = rows % chunk
    full = rem_hi == chunk
    take = rem if rem_lo < rem <= rem_hi else 0
    return (0 if full else rows - rem), (rows - rem if full else 0) + take


def single(config1: str, config2: str = None) -> Plan:
    """One launch per GEMM over every row: config1, and for GEMM2 config2 or config1's tile."""
    config2 = config2 or config1.replace("moe_gemm1_", "moe_gemm2_", 1)
    return Plan(ALL_ROWS[0], ((config1, config2, ALL_ROWS[1], ALL_ROWS[2]),))


# Token tiles that split_plan may combine, largest first, and the spread of an expert's rows it
# plans for (mean +- SPREAD_SDS sqrt(mean), uniform top-k routing's spread; busier experts are still
# correct, in a larger tile than they need).
SPLIT_TILES = ("m128n128k128_coop", "m128n96k128_coop", "m128n64k256_coop", "m128n32k256_coop")
SPLIT_MIN_ROWS = 12   # rows per expert above which plan() splits (pick_config's 8/32-token tiles below)
SPREAD_SDS = 3.0
# From this many rows per expert on, every part is launched, whatever the spread says: a skewed
# routing's remainders are then still in the tile that fits them (dsv4-flash at M = 4096, 96 rows
# per expert: waste 1.52 -> 1.16 under Dirichlet routing in the tile_waste simulation), and a part
# without rows costs a few microseconds against layers of 2.5 ms and more there.
ALL_PARTS_ROWS = 96
# The 160-token part (128 rows: 80 accumulator registers a thread, too many for the 192-row tiles' 152),
# where an expert's rows spread past 128 (the spread's top above the 128-token tile) and the mean is at
# most WIDE_MAX_ROWS: a chunk of 160 rows keeps an expert of 129-160 rows in one tile where 128-row chunks
# add a second, nearly empty one that streams and converts the expert's weights again (dsv3 and gpt-oss
# at M = 4096: 1.48 -> 1.00 weight passes per expert under bench_moe's routing), and qwen3's 208-304 rows
# at M = 4096 in two tiles instead of 2.5. Layers in graph replay against the 128-row chunks, the same
# library, five rounds in two orders (benchmarks/results/raw/bench_20261202T124*Z_{o29,w29}_r*_wide_tile_ab.json):
# gpt-oss M = 4096 -13.0 / -13.3%, dsv3 M = 4096 -8.5 / -9.2%, qwen3 M = 2048 -3.3 / -3.2%, M = 4096
# -1.5 / -1.4%; at M = 8192 (192-256 rows per expert) -1.1..+3.5%, within the spread of unchanged plans
# in the same runs (-2.6..+5.5%), and with the part up to M = 16384 (raw/bench_20261202T1326*Z_{z29,x29}_r*_
# wide_part_m8192_16384_ab.json) qwen3 M = 8192 +2.5%, M = 16384 -0.3..+3.1%: the part stops at 256 rows per
# expert. Under skewed routing it keeps the MMA waste (1.12 at M = 4096) with fewer passes (tile_waste); the
# same parts over chunks of 256 (a power of two, four parts) would pad hot experts' chunks to 160 + 96 (waste
# 1.35 under Dirichlet routing, NOTES.md 2026-12-02 (28)). The any-chunk row window this needs
# (templates/sm90/moe_rows.hpp) costs the 16-token tile's single launches 1-2% at M = 256 and M = 16 up to
# 1.5% against the power-of-two mask, measured in both orders (NOTES.md 2026-12-02 (29)).
WIDE_TILE = "m128n160k128_coop"
WIDE_MAX_ROWS = 256
# Where an expert holds at least SKEW_PART_MIN_WEIGHTS weights per GEMM (hidden x intermediate size) and a layer has
# at least SKEW_PART_MIN_EXPERTS experts, every split plan launches the SKEW_TILE_N-token part too, with chunks of
# SKEW_TILE_N rows, whatever the spread says: under skewed routing a busy expert's full chunks and any remainder above
# the spread's parts then run in 128-token tiles, where the ridge's 64 / 32-token parts (chunks of 64) streamed and
# converted its weights once per 64 or 32 rows. Where the spread does not need it, it launches last: under uniform
# routing it gets no rows, and its two launches cost least there. Layers in graph replay against the rule without that
# part, five rounds interleaved, M = 512 / 1024 / 2048
# (benchmarks/results/raw/bench_20261204T1252*Z_skew_part_last_final_*.json, ab_tiles --routing): Dirichlet routing
# gpt-oss -6.2 / -2.8 / -7.1%, dsv4-flash (M = 1024 / 2048) -2.2 / -11.9%, dsv3 -10.5 / -3.2 / -8.5%; Zipf
# -1.0..-8.9%; uniform routing -0.2..+2.1% (gpt-oss +1.7 / +1.7 / -0.0%, dsv3 +0.7 / +0.8 / +2.1%). Launched first
# (raw/bench_20261204T12*Z_skew_part_first*.json, *_skew_part_position_*.json) the skew gains were alike and uniform
# routing paid -1.0..+5.5% over three runs; second, +4.9% at dsv3 M = 1024. qwen3 (1.6 M weights an expert: a pass of
# them costs less than the part's launches) lost 3.8-10.7% at M = 256-512 under every routing with the part (M = 1024:
# uniform +3.0%, Zipf -0.5%, Dirichlet -5.9%), so it keeps the rule's parts. The part taking full chunks only (the
# remainders in up to two tiles of the next part) measured worse under skew (dsv3 M = 1024 Dirichlet +4.5%,
# raw/bench_20261204T1237*Z_skew_part_last_full_chunks_*.json).
# It takes SKEW_PART_MIN_EXPERTS experts too: with few experts the busy ones hold most of a call's rows, and their
# 128-token tiles, few and long, run last and alone. The same A/B on other public models' shapes (bench_moe.MODELS,
# two runs: raw/bench_20261204T1335*Z_models_skew_part_*.json, then 60 reps a point,
# raw/bench_20261204T1337*Z_models_skew_part_*.json), the part against the rule without it where their plans differ:
# mixtral-8x7b (8 experts, M = 256) Zipf +12.7 / +27.7%, Dirichlet +23.0 / +24.9%; llama4-scout (16, M = 256-1024)
# Zipf +0.5..+13.1%, Dirichlet -3.0..+8.8%; gpt-oss-20b (32, M = 256 / 512) Zipf +4.9..+13.2%, Dirichlet -3.6..+12.0%;
# uniform -1.3..+4.3% for the three; qwen2-57b-a14b (64) -2.4..+3.9%, no gain; from 128 experts (qwen3-235b-a22b,
# glm-4.5-air, kimi-k2, M = 256-1024) skewed -5.6..+1.6% (kimi-k2 M = 2048 -9.4 / -11.6%), uniform -0.8..+2.5%.
SKEW_PART_MIN_WEIGHTS = 4 << 20
SKEW_PART_MIN_EXPERTS = 128
SKEW_TILE_N = 128


def split_plan(rows: int, num_experts: int, tiles=None, expert_weights=None) -> Plan:
    """Parts of token tiles (160 /) 128 / 96 / 64 / 32 that the device chooses between per expert: each
    expert's full 128-row (160-row: WIDE_TILE) chunks and a remainder above 96 (128) in the largest tile, a remainder in
    (64, 96] in the 96-token tile, and so on down to 32 (KERNEL_NOTES H.4: one tile per launch
    pads 24-48% of the MMA work at M = 4096, or makes half the experts stream and convert their
    weights twice at the M = 1024 ridge). Parts that no expert within the expected spread of rows
    needs are left out (a launch without rows still costs a few microseconds), their windows
    merged into the next larger part's; the chunk is the smallest tile above the spread, else the
    largest tile. Skewed routing is still right, its outliers in larger or more tiles
    than they need; with expert_weights (hidden x intermediate size) of at least SKEW_PART_MIN_WEIGHTS
    and SKEW_PART_MIN_EXPERTS experts, the 128-token part takes them in chunks of 128, launched last where the
    spread does not need it. tiles: the config suffixes to combine, largest first
    (default SPLIT_TILES, with WIDE_TILE ahead of them up to WIDE_MAX_ROWS rows per expert)."""
    mean = rows / max(1, num_experts)
    lo, hi = max(0.0, mean - SPREAD_SDS * math.sqrt(mean)), mean + SPREAD_SDS * math.sqrt(mean)
    if tiles is None:
        tiles = (WIDE_TILE, *SPLIT_TILES) if mean <= WIDE_MAX_ROWS else SPLIT_TILES
    tiles = tuple(tiles)
    sizes = [tile_n(t) for t in tiles]
    # The smallest tile above the spread, else the largest (160 with WIDE_TILE): a busy expert's full chunks then
    # fill the largest part's tiles. Powers of two only (the row window's mask before 2026-12-02 (29)) made qwen3
    # at M = 768 / 1024 (parts 96 / 64 (/ 32)) cut 128-row chunks into 96 + 32: layers, five rounds interleaved
    # (benchmarks/results/raw/bench_20261204T13*Z_any_chunk_*.json), Zipf -7.6 / -5.5%, Dirichlet -7.2 / -3.9%,
    # uniform -0.1 / -0.2% (no expert within the spread reaches 96 rows).
    chunk = next((n for n in reversed(sizes) if n >= hi), sizes[0])
    skew = (expert_weights is not None and expert_weights >= SKEW_PART_MIN_WEIGHTS
            and num_experts >= SKEW_PART_MIN_EXPERTS and SKEW_TILE_N in sizes and chunk <= SKEW_TILE_N)
    if skew:
        chunk = SKEW_TILE_N
    needed = {chunk} if hi >= chunk else set()   # full chunks expected
    for r in range(int(lo), int(math.ceil(hi)) + 1):
        if r % chunk:
            needed.add(min(n for n in sizes if n >= r % chunk))
    # The largest kept part also takes the full chunks and any remainder above it (its window ends
    # at the chunk): rows past the expected spread, in more than one of its tiles.
    skew_only = skew and SKEW_TILE_N not in needed and mean < ALL_PARTS_ROWS   # that part: launched last
    kept = [(t, n) for t, n in zip(tiles, sizes)
            if n <= chunk and (n in needed or mean >= ALL_PARTS_ROWS or skew_only and n == SKEW_TILE_N)]
    parts = [(f"moe_gemm1_{t}", f"moe_gemm2_{t}", kept[i + 1][1] if i + 1 < len(kept) else 0, chunk if i == 0 else n)
             for i, (t, n) in enumerate(kept)]
    if skew_only:
        parts.append(parts.pop(0))
    return Plan(chunk, tuple(parts))


# The 192-row versions (three consumer warpgroups, templates/sm90/moe_gemm_kernel.hpp) of the
# 128-row tiles of up to 64 tokens. Per-GEMM device times on an H200, each GEMM's both variants
# twice (benchmarks/results/profile_20261201T0448{06,17,27,37}Z.json: --tall 00 / 11 / 10 / 01):
# the split plan's 32/64-token parts gain on 192 rows (qwen3 M = 256 GEMM1 / GEMM2 -6.7 / -7.8%,
# gpt-oss M = 1024 GEMM1 -8.2%, dsv3 M = 1024 GEMM1 -1.4%; the worst, dsv4-flash M = 1024 GEMM2,
# +1.7%), the streaming 8/16-token tiles on TileK 128 lose (+2..+12% at M = 4-64). The 8-token tile
# keeps TileK 256 on 192 rows (half-tile register sets, moe_gemm_mainloop.hpp 10.): layer kernel time
# against 128x8x256, two rounds each (benchmarks/results/raw/profile_20261201T14*Z_tall_n8k256_*.json),
# from 1.5 rows per expert on -1.2..-3.6% on all four shapes (M = 32 qwen3, M = 64 all, M = 128
# gpt-oss / dsv4-flash; dsv3 M = 128 +2.8 / -0.1%), below it -3.5..+4.2% (dsv4-flash +3.8..+4.2% at
# M = 8-16, dsv3 -2.9..-3.5%): fewer, longer tiles leave more of the last wave idle when few
# experts are active, so plan() took it from 1.5 rows per expert. Since the kernels' every GMMA goes through
# mc_token_gmmas (moe_gemm_mainloop.hpp item 13) it wins below that too: the layer on m192n8k256 against the rule's
# m128n8k256 on the four-launch path, 500 reps in five interleaved rounds (timed as the peer benchmark times;
# benchmarks/results/raw/bench_20261204T152*Z_stream_tile_n8_tall_*.json), M = 2-32 (0.06-1 rows per expert): uniform
# qwen3 M = 8 / 16 0.0 / -2.5%, gpt-oss M = 8 / 16 / 32 -1.6 / -9.1 / -11.1%, dsv4-flash M = 3-32 -3.7..-11.7%, dsv3
# M = 2-32 -3.7..-8.8%; Zipf -0.5..-10.2% (qwen3 and gpt-oss up to M = 4 run the one launch, where no plan applies).
# So every streaming call runs on 192 rows. The 32-token tile, streaming
# from 4 to 12 rows per expert (pick_config) or a split part, and the 64-token part keep TileK 256 on 192 rows too
# (half-tile register sets). Measured first (2026-12-01 (15)) at M = 1024 against TileK 128: dsv3 -2.0 / -2.0%,
# dsv4-flash -1.9 / -2.7%, qwen3 M = 256 -1.7 / -2.6%, gpt-oss (K = 2880, padded to 3072 by TileK 256 and to 2944
# by 128) +1.0 / +0.5%, so the rule then asked for K % 256 == 0. Since the GMMAs run only as wide as the tile's
# tokens (moe_gemm_mainloop.hpp items 12-13), gpt-oss gains too: its split plans with the 32/64-token parts on TileK
# 256 against 128, five rounds interleaved, M = 512-2048 (benchmarks/results/raw/bench_20261204T144*Z_gpt_oss_k256_
# split_parts_*.json): uniform -0.8..-8.9%, Zipf -2.1..-8.6%, Dirichlet -1.4..-3.4%; gpt-oss-20b -6.2..+0.1%. And
# as the streaming tile at M = 256 / 384, -4.8 / -5.1% (raw/bench_20261204T143751Z_stream_tile_n32_first_uniform.json).
TALL_TILES = {"m128n8k256_coop": "m192n8k256_coop", "m128n32k256_coop": "m192n32k256_coop",
              "m128n64k256_coop": "m192n64k256_coop"}
# GEMM1's 96/128-token split parts run on 192 rows too (half-tile register sets, moe_gemm_mainloop.hpp
# 10.): GEMM1 device time against 128 rows, each twice in one session (benchmarks/results/raw/
# profile_20261201T1538*Z_prefill_*rows.json), M = 2048 / 4096 / 16384: qwen3 -5.8 / -3.7 / -7.5%
# (M = 1024, its 96-token part: -5.2%), gpt-oss -2.4 / -5.2 / -7.9%, dsv4-flash +0.7 / -5.2 / -0.5%,
# dsv3 -2.5 / -2.6 / -1.8%. GEMM2's moved -2.2..+3.0% (dsv4-flash M = 16384 +3.0%) then, with full-width GMMAs (below).
TALL_TILES_GEMM1 = {**TALL_TILES, "m128n96k128_coop": "m192n96k128_coop", "m128n128k128_coop": "m192n128k128_coop",
                    "m128n128k128_coop_c2": "m192n128k128_coop_c2"}
# Since their GMMAs run only as wide as the tile's tokens (moe_gemm_mainloop.hpp item 12, 192-row tiles only), GEMM2's
# 96/128-token parts take 192 rows too where its K (the intermediate size) is at least TALL_GEMM2_MIN_K: GEMM2 device
# time against 128 rows, two sessions, two libraries (benchmarks/results/raw/profile_20261202T0244*Z_gemm2_96_128_parts_
# 192rows_*.json and profile_20261202T0313*Z_gemm2_96_128_parts_192rows_*.json), M = 2048 / 4096 / 16384: dsv3 -9.4 / -1.2 /
# -1.1% and -3.9 / +0.4 / -2.1%, gpt-oss -0.8 / -0.3 / -2.1% and -0.7 / -0.8 / -2.2%, dsv4-flash +0.7 / -1.5 / +0.5% and
# +1.0 / -6.7 / +0.4%; qwen3 (K = 768, six k tiles per tile, the staggered 128-row tile of moe_gemm_kernel.hpp item 6
# against it) +4.7 / +5.0% and +5.2 / +5.7% at M = 4096 / 16384.
TALL_GEMM2_MIN_K = 2048
BOTH_TALL, NO_TALL = (True, True), (False, False)
# The 128-token part in clusters of two CTAs with token multicast (the _c2 configs, moe_gemm_mainloop.hpp
# 11.) from this many rows per expert: per-GEMM device time against the same part without, three rounds
# each, interleaved (benchmarks/results/raw/profile_20261201T1902*Z_*_c2_ab.json, medians), GEMM1 / GEMM2
# at M = 16384: dsv3 -3.4 / -4.6%, dsv4-flash -2.1 / -2.9%, gpt-oss -1.9 / -0.5%, qwen3 -0.2 / -0.7%; at
# M = 4096 (96-128 rows per expert but qwen3's 256) -1.3..+3.3% (gpt-oss GEMM2 +3.0%: its 23 weight-row
# tiles round up to 24 for the pairs).
CLUSTER_TILES = {"m128n128k128_coop": "m128n128k128_coop_c2", "m192n128k128_coop": "m192n128k128_coop_c2"}
CLUSTER_MIN_ROWS = 256


# 192-row tile -> its 128-row twin: the inverse of TALL_TILES_GEMM1 (which holds TALL_TILES).
SHORT_TILES = {t: s for s, t in TALL_TILES_GEMM1.items()}


def _mapped(config: str, table: dict, available=None) -> str:
    """config with its tile replaced by table's (keyed by config suffix) where the library holds that
    (available: GEMM1 names; a GEMM2 config follows its GEMM1 twin), else config."""
    head, tile = config[:len("moe_gemm1_")], config[len("moe_gemm1_"):]
    other = head + table.get(tile, tile)
    return other if available is None or other.replace("moe_gemm2_", "moe_gemm1_", 1) in available else config


def clustered(config: str, available=None) -> str:
    """config's version in a cluster of two (CLUSTER_TILES) where the library holds it, else config."""
    return _mapped(config, CLUSTER_TILES, available)


def tall(config: str, on: bool, available=None, K=None, gemm2_min_k=None) -> str:
    """config, or when `on` its 192-row version that the library holds: TALL_TILES_GEMM1's for GEMM1, and for
    GEMM2 where K (its reduction length) is known and at least gemm2_min_k (default TALL_GEMM2_MIN_K), else
    TALL_TILES's."""
    if not on:
        return config
    gemm2_min_k = TALL_GEMM2_MIN_K if gemm2_min_k is None else gemm2_min_k
    wide = config.startswith("moe_gemm1_") or (K is not None and K >= gemm2_min_k)
    return _mapped(config, TALL_TILES_GEMM1 if wide else TALL_TILES, available)


def short(config: str, available=None) -> str:
    """config's 128-row twin (SHORT_TILES) where the library holds it, else config."""
    return _mapped(config, SHORT_TILES, available)


def plan(rows: int, num_experts: int, available=None, batch_invariant=False, tall_tiles=None,
         split_tiles=None, ks=None, tall_gemm2_min_k=None) -> Plan:
    """The GEMM launches of a call with `rows` (M * top_k) rows (available: the GEMM1 configs the
    library holds, as for pick_config; GEMM2's follow them): pick_config's one tile up to
    SPLIT_MIN_ROWS rows per expert (streaming tiles, on 192 rows) and for batch_invariant (whose bits must not depend on
    which part a row lands in), split_plan's parts above, their tiles of up to 64 tokens on 192
    rows (TALL_TILES), GEMM1's larger ones too (TALL_TILES_GEMM1), and GEMM2's where ks gives its K
    as at least TALL_GEMM2_MIN_K. tall_tiles = (GEMM1, GEMM2)
    overrides which GEMM's tiles run on 192 rows (for A/B; not with batch_invariant); split_tiles
    overrides SPLIT_TILES (for A/B; its tiles run as named, no cluster added). ks = (GEMM1's K, GEMM2's K),
    i.e. (hidden, intermediate) size, where known: GEMM2's 96/128-token parts on 192 rows
    (TALL_GEMM2_MIN_K), and the 128-token part for skewed routing where the experts are large
    (SKEW_PART_MIN_WEIGHTS). From CLUSTER_MIN_ROWS rows per expert the 128-token part runs in clusters of two.
    tall_gemm2_min_k overrides TALL_GEMM2_MIN_K (for A/B)."""
    per_expert = rows / max(1, num_experts)
    rule = BOTH_TALL
    if batch_invariant or per_expert <= SPLIT_MIN_ROWS:
        p = single(pick_config(1, rows, num_experts, available, batch_invariant))
    else:
        tiles = split_tiles
        if tiles is None and available is not None and f"moe_gemm1_{WIDE_TILE}" not in available:
            tiles = SPLIT_TILES   # a library built before the 160-token tile
        p = split_plan(rows, num_experts, tiles, None if ks is None else ks[0] * ks[1])
        if available is not None and not all(part[0] in available for part in p.parts):
            p, rule = single(pick_config(1, rows, num_experts, available, batch_invariant)), NO_TALL
    if batch_invariant:
        return p
    t1, t2 = rule if tall_tiles is None else tall_tiles
    k1, k2 = (None, None) if ks is None else ks
    parts = tuple((tall(c1, t1, available, k1), tall(c2, t2, available, k2, tall_gemm2_min_k), lo, hi)
                  for c1, c2, lo, hi in p.parts)
    if split_tiles is None and per_expert >= CLUSTER_MIN_ROWS:
        parts = tuple((clustered(c1, available), clustered(c2, available), lo, hi) for c1, c2, lo, hi in parts)
    return Plan(p.chunk, parts)


def tuned_plan(pair, rows: int, num_experts: int, available=None, ks=None) -> Plan:
    """The plan of a tuned choice (gemm1, gemm2): two configs, one launch each over every row; or two of PLANS, the
    rule's plan (plan(), ks as there) with each GEMM whose entry is PLAN_SHORT on its 128-row tiles."""
    if pair[0] not in PLANS:
        return single(*pair)
    p = plan(rows, num_experts, available, ks=ks)
    s1, s2 = (entry == PLAN_SHORT for entry in pair)
    return Plan(p.chunk, tuple((short(c1, available) if s1 else c1, short(c2, available) if s2 else c2, lo, hi)
                               for c1, c2, lo, hi in p.parts))


# Tile choices that moe_cutlass.tuning measured for a layer shape on a device, in force for fused_moe
# (tuning.use / tuning.load): {(device name, E, H, I, top_k): (bounds, choices)}. A call of M tokens
# takes choices[bisect(bounds, M)]: the tuned batch nearest to M on a log scale.
_TUNED = {}


def set_tuned(device_name: str, E: int, H: int, I: int, top_k: int, choices: dict) -> None:
    """Installs {M: (gemm1 config, gemm2 config)} for one shape on devices named device_name."""
    ms = sorted(choices)
    bounds = [math.sqrt(a * b) for a, b in zip(ms, ms[1:])]   # log-scale midpoints
    _TUNED[(device_name, E, H, I, top_k)] = (bounds, [tuple(choices[m]) for m in ms])


def clear_tuned() -> None:
    _TUNED.clear()


def tuned_configs(device_name: str, E: int, H: int, I: int, top_k: int, num_tokens: int):
    """(gemm1 config, gemm2 config) tuned for the batch nearest num_tokens, or None for an untuned shape."""
    entry = _TUNED.get((device_name, E, H, I, top_k))
    if entry is None:
        return None
    bounds, choices = entry
    return choices[bisect.bisect(bounds, num_tokens)]


@functools.lru_cache(maxsize=None)
def configs_of(kind: int) -> tuple:
    """The GEMM<kind> configs the built library holds."""
    configs = tuple(k for k in _lib.library().kernels if k.startswith(f"moe_gemm{kind}_"))
    if not configs:
        raise RuntimeError(f"the kernel library holds no GEMM{kind} instantiation; rebuild it with "
                           f"`python -m codegen --arch sm90`")
    return configs


def function(config: str):
    """The ctypes function that launches `config`."""
    return _lib.library().function(f"mc_sm90_{config}")


def workspace_size(config: str, num_experts: int, device=None) -> int:
    device = torch.device(device if device is not None else "cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return int(_lib.library().function(f"mc_sm90_{config}_workspace_size")(num_experts, sms))


def workspace(config: str, num_experts: int, device=None) -> torch.Tensor:
    return torch.empty(workspace_size(config, num_experts, device), dtype=torch.uint8,
                       device=device if device is not None else "cuda")


def _ptr(t):
    return None if t is None else t.data_ptr()


def run(config: str, prepared: dict, act: torch.Tensor, expert_offsets: torch.Tensor, out: torch.Tensor,
        N: int, K: int, row_weights=None, activation="silu", swiglu_alpha=1.702, swiglu_limit=None,
        ws=None, stream=None, check=True, window=ALL_ROWS, pdl=0) -> int:
    """Launch one grouped GEMM. `prepared` is layout.prepare_w13/prepare_w2's dict (on the GPU);
    window: (chunk, rem_lo, rem_hi), which of each expert's rows the launch takes (a Plan part's).
    pdl: the launch mode of templates/sm90/pdl.cuh (0: an ordinary launch; mc_layer uses 1 and 2).
    Returns the status code (raises on non-zero when check=True)."""
    E = prepared["blocks"].shape[0]
    if ws is None:
        ws = workspace(config, E, act.device)
    if stream is None:
        stream = torch.cuda.current_stream(act.device).cuda_stream
    act_code = ACTIVATIONS[activation] if isinstance(activation, str) else int(activation)
    status = launch(function(config), prepared, act.data_ptr(), act.shape[0], expert_offsets.data_ptr(), _ptr(row_weights),
                    out.data_ptr(), E, N, K, ws.data_ptr(), ws.numel(), stream, act_code, swiglu_alpha, swiglu_limit,
                    window, pdl)
    if check and status != 0:
        raise RuntimeError(f"mc_sm90_{config} failed: {_lib.library().error_string(status)} ({status})")
    return status


def launch(fn, prepared: dict, act: int, act_rows: int, expert_offsets: int, row_weights, out: int, E: int, N: int,
           K: int, ws: int, ws_bytes: int, stream: int, activation=0, swiglu_alpha=1.702, swiglu_limit=None,
           window=ALL_ROWS, pdl=0) -> int:
    """`run` on data pointers (fn from `function`), for the layer: nothing but the C call; returns its status.
    act_rows: the rows the act buffer holds (its TMA descriptor's extent; the same value every call
    keeps the host's cached descriptors)."""
    limit = math.inf if swiglu_limit is None else float(swiglu_limit)
    return fn(prepared["blocks"].data_ptr(), prepared["scales"].data_ptr(), _ptr(prepared.get("bias")), act, act_rows,
              expert_offsets, *window, row_weights, out, E, N, K, prepared.get("scale_max", MAX_SCALE_BYTE), activation,
              float(swiglu_alpha), limit, ws, ws_bytes, stream, pdl)
