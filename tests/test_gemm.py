"""The SM90 MXFP4 x BF16 grouped GEMMs (templates/sm90/moe_gemm*), against float32 torch."""

import pytest
import torch

from moe_cutlass import layout
from moe_cutlass.experts import _map_tensors

pytestmark = pytest.mark.gpu

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _gemm():
    from moe_cutlass import _gemm
    return _gemm


def _configs(kind):
    """Every GEMM<kind> config the built library holds (the default one when it cannot load)."""
    try:
        from moe_cutlass import _lib
        found = [k for k in _lib.library().kernels if k.startswith(f"moe_gemm{kind}_")]
    except Exception:
        found = []
    return found or [f"moe_gemm{kind}_m128n32k128_coop"]


CONFIGS1 = _configs(1)
CONFIGS2 = _configs(2)


def dequant(blocks, scales):
    if torch.cuda.is_available() and not blocks.is_cuda:
        return dequant(blocks.cuda(), scales.cuda()).cpu()
    codes = torch.stack((blocks & 15, blocks >> 4), -1).flatten(-2).long()
    vals = E2M1.to(blocks.device)[codes]
    s = torch.pow(2.0, scales.double() - 127).float()
    return vals * s.repeat_interleave(32, -1)


def random_weights(E, N, K, gen, lo=118, hi=126):
    blocks = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (E, N, K // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def offsets_of(counts):
    return torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int32)


def relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def ref_gemm2(W, b, x, w, counts):
    outs, r = [], 0
    for e, c in enumerate(counts):
        y = x[r:r + c].float() @ W[e].T
        if b is not None:
            y = y + b[e]
        outs.append(y * w[r:r + c, None])
        r += c
    return torch.cat(outs)


def ref_act(g, u, activation, alpha, limit):
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    return g * torch.sigmoid(alpha * g) * (u + 1)


def ref_gemm1(W13, b13, x, counts, activation, alpha, limit):
    """W13 [E, 2I, H] in concat order (gate rows then up rows)."""
    I = W13.shape[1] // 2
    outs, r = [], 0
    for e, c in enumerate(counts):
        h = x[r:r + c].float() @ W13[e].T
        if b13 is not None:
            h = h + b13[e]
        outs.append(ref_act(h[:, :I], h[:, I:], activation, alpha, limit))
        r += c
    return torch.cat(outs)


def to_cuda(d):
    return _map_tensors(torch.Tensor.cuda, d)


def run_gemm2(blocks, scales, bias, x, counts, w, extra_rows=3, config=None, window=None, out=None, pdl=0):
    g = _gemm()
    config = config or g.GEMM2_CONFIG
    E, N, _ = blocks.shape
    K = x.shape[1]
    p = layout.prepare_w2(blocks.cuda(), scales.cuda(), None if bias is None else bias.cuda())
    off = offsets_of(counts).cuda()
    total = sum(counts)
    if out is None:
        out = torch.full((total + extra_rows, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    g.run(config, p, x.cuda(), off, out, N, K, row_weights=w.cuda(), window=window or g.ALL_ROWS, pdl=pdl)
    torch.cuda.synchronize()
    return out


def run_gemm1(blocks, scales, bias, x, counts, gate_up="concat", activation="silu", alpha=1.702, limit=None,
              extra_rows=3, config=None, window=None, out=None, pdl=0):
    g = _gemm()
    config = config or g.GEMM1_CONFIG
    E, N, _ = blocks.shape
    K = x.shape[1]
    p = layout.prepare_w13(blocks.cuda(), scales.cuda(), None if bias is None else bias.cuda(), gate_up)
    off = offsets_of(counts).cuda()
    total = sum(counts)
    if out is None:
        out = torch.full((total + extra_rows, N // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    g.run(config, p, x.cuda(), off, out, N, K, activation=activation, swiglu_alpha=alpha,
          swiglu_limit=limit, window=window or g.ALL_ROWS, pdl=pdl)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("config", CONFIGS2)
@pytest.mark.parametrize("K", [320, 384, 448])
def test_converter_exact_all_codes_and_scales(config, K):
    """One-hot activations through GEMM2 (row weight 1, no bias): out[r, m] = W[m, r] exactly, for
    all 16 codes times scales 2^-20..2^20, a distinct scale in every 32-block. K = 5, 6, 7 units of
    64: a last k tile of 1, 2, 3 real units with TileK 256 (1 with 128), the rest zero-filled by TMA."""
    E, N = 1, 128
    codes = (torch.arange(N).view(N, 1) * 7 + torch.arange(K).view(1, K)) % 16
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(E, N, K // 2)
    s = 107 + (torch.arange(N).view(N, 1) * 3 + torch.arange(K // 32).view(1, -1) * 5) % 41
    scales = s.to(torch.uint8).view(E, N, K // 32)
    x = torch.eye(K, dtype=torch.bfloat16)
    w = torch.ones(K)
    out = run_gemm2(blocks, scales, None, x, [K], w, config=config)
    want = dequant(blocks, scales)[0].T.contiguous()                 # [K tokens, N]
    got = out[:K].float().cpu()
    assert torch.equal(got, want), f"{(got != want).sum().item()} mismatches"
    assert torch.isnan(out[K:].float()).all(), "wrote past the last row"


@pytest.mark.parametrize("config", CONFIGS2)
@pytest.mark.parametrize("path", ["fast", "slow"])
def test_converter_exact_every_scale_byte(config, path):
    """All 16 codes x every scale byte the path covers (fast: 0..128, the one-multiply conversion;
    slow: 0..254 and one NaN byte 255), distinct per 32-block and per row. Token r is one-hot at
    k = r with value 2^(127 - B) (B the block's base byte), so every product is a normal bf16
    and out[r, m] = x_r * W[m, r] exactly, subnormal and huge weights included."""
    G = 33 if path == "fast" else 64
    top = layout.FAST_SCALE_MAX if path == "fast" else 254
    E, N, K = 1, 128, 32 * G
    base = 4 * torch.arange(G)
    s = (base.view(1, G) + torch.arange(N).view(N, 1) % 4).clamp(max=top)
    codes = (torch.arange(N).view(N, 1) * 7 + torch.arange(K).view(1, K)) % 16
    # 2 * 2^(254-127) overflows bf16, and one inf weight would turn its whole row NaN (0 * inf):
    # blocks with bytes 253 and 254 keep the codes 0, 0.5, 1, 1.5 (clear e1)
    codes = torch.where(s.repeat_interleave(32, 1) >= 253, codes & 0b1011, codes)
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(E, N, K // 2)
    if path == "slow":
        s[5, 3] = 255
    scales = s.to(torch.uint8).view(E, N, G)
    assert layout.prepare_w2(blocks, scales)["scale_max"] == (top if path == "fast" else 255)
    x_scale = torch.pow(2.0, 127.0 - base.double()).repeat_interleave(32)
    x = torch.diag(x_scale).to(torch.bfloat16)
    out = run_gemm2(blocks, scales, None, x, [K], torch.ones(K), config=config)
    want = (dequant(blocks, scales)[0].double().T * x_scale.view(K, 1)).float()   # [K tokens, N]
    got = out[:K].float().cpu()
    nan_row = torch.zeros(N, dtype=torch.bool)
    if path == "slow":
        nan_row[5] = True
        assert torch.isnan(got[:, nan_row]).all(), "a NaN scale byte must make its weight row NaN"
    assert torch.equal(got[:, ~nan_row], want[:, ~nan_row]), f"{(got[:, ~nan_row] != want[:, ~nan_row]).sum()} mismatches"
    assert torch.isnan(out[K:].float()).all(), "wrote past the last row"


@pytest.mark.parametrize("config", CONFIGS2)
def test_distinct_random_scales_every_block(config):
    """Random scales per 32-block over several k tiles: catches a per-tile scale (the wrong-scale trap)."""
    gen = torch.Generator().manual_seed(1)
    E, N, K = 1, 256, 320
    blocks, scales = random_weights(E, N, K, gen, lo=110, hi=140)
    x = torch.eye(K, dtype=torch.bfloat16)[:200]
    out = run_gemm2(blocks, scales, None, x, [200], torch.ones(200), config=config)
    want = dequant(blocks, scales)[0].T[:200]
    assert torch.equal(out[:200].float().cpu(), want)


# rows per expert of test_grouped_gemm2 by (H, I). At I = 768 (six k tiles) GEMM2's 96/128-token
# tiles stagger their consumer warpgroups (moe_gemm_kernel.hpp, 6.); 1431 rows over 16 weight-row
# tiles give every CTA several tiles in a row. H = 96, 160, 448 and 2880 leave a last weight-row tile
# partly past H (448 = 2 * 192 + 64: one slab of three, as dsv3's H = 7168); at 2880 the 192-row tiles
# stop at H, not at its 128-row padding (moe_gemm_launch.hpp, MoeProblemShape).
GEMM2_COUNTS = {(96, 160): [0, 5, 1, 37, 0, 3, 70], (160, 96): [0, 5, 1, 37, 0, 3, 70], (2880, 2880): [3, 0, 17, 1],
                (2048, 768): [300, 0, 257, 129, 700, 45], (448, 192): [9, 0, 130, 33]}


@pytest.mark.parametrize("config", CONFIGS2)
@pytest.mark.parametrize("H,I", list(GEMM2_COUNTS))
def test_grouped_gemm2(H, I, config):
    gen = torch.Generator().manual_seed(H + I)
    counts = GEMM2_COUNTS[H, I]
    E = len(counts)
    blocks, scales = random_weights(E, H, I, gen)
    bias = torch.randn(E, H, generator=gen)
    x = torch.randn(sum(counts), I, generator=gen).to(torch.bfloat16)
    w = torch.rand(sum(counts), generator=gen)
    out = run_gemm2(blocks, scales, bias, x, counts, w, config=config)
    ref = ref_gemm2(dequant(blocks, scales), bias, x, w, counts)
    total = sum(counts)
    assert not torch.isnan(out[:total].float()).any(), "rows left unwritten"
    assert torch.isnan(out[total:].float()).all(), "wrote past the last row"
    assert relerr(out[:total].cpu(), ref) < 1e-2


@pytest.mark.parametrize("H,I", [(96, 160), (160, 96), (2880, 2880)])
@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
@pytest.mark.parametrize("config", CONFIGS1)
def test_grouped_gemm1(H, I, gate_up, config):
    gen = torch.Generator().manual_seed(H * 3 + I)
    counts = [0, 5, 1, 37, 0, 3, 70] if H * I < 10**6 else [3, 0, 17, 1]
    E = len(counts)
    blocks, scales = random_weights(E, 2 * I, H, gen)
    bias = torch.randn(E, 2 * I, generator=gen)
    x = torch.randn(sum(counts), H, generator=gen).to(torch.bfloat16)
    out = run_gemm1(blocks, scales, bias, x, counts, gate_up=gate_up, config=config)
    W = dequant(blocks, scales)
    b = bias
    if gate_up == "interleaved":
        order = torch.cat((torch.arange(0, 2 * I, 2), torch.arange(1, 2 * I, 2)))
        W, b = W[:, order], b[:, order]
    ref = ref_gemm1(W, b, x, counts, "silu", 1.702, None)
    total = sum(counts)
    assert not torch.isnan(out[:total].float()).any(), "rows left unwritten"
    assert torch.isnan(out[total:].float()).all(), "wrote past the last row"
    assert relerr(out[:total].cpu(), ref) < 1e-2


def _token_width_configs():
    """The configs whose GMMAs run as wide as the tile's tokens (moe_gemm_mainloop.hpp item 12)."""
    return [c for c in CONFIGS1 + CONFIGS2 if len(_gemm().gmma_widths(c)) > 1]


def _check_each_expert(config, counts, seed, repeats=1, pdl=0):
    """One GEMM of `config` over experts holding `counts` rows, each expert's rows against the reference; run
    `repeats` times, every run's bits the first's."""
    E = len(counts)
    gen = torch.Generator().manual_seed(seed)
    total = sum(counts)
    if config.startswith("moe_gemm1_"):
        H, I = 256, 192
        blocks, scales = random_weights(E, 2 * I, H, gen)
        bias = torch.randn(E, 2 * I, generator=gen)
        x = torch.randn(total, H, generator=gen).to(torch.bfloat16)
        run = lambda: run_gemm1(blocks, scales, bias, x, counts, config=config, pdl=pdl)  # noqa: E731
        ref = ref_gemm1(dequant(blocks, scales), bias, x, counts, "silu", 1.702, None)
    else:
        H, I = 384, 256
        blocks, scales = random_weights(E, H, I, gen)
        bias = torch.randn(E, H, generator=gen)
        x = torch.randn(total, I, generator=gen).to(torch.bfloat16)
        w = torch.rand(total, generator=gen)
        run = lambda: run_gemm2(blocks, scales, bias, x, counts, w, config=config, pdl=pdl)  # noqa: E731
        ref = ref_gemm2(dequant(blocks, scales), bias, x, w, counts)
    out = run()
    for i in range(1, repeats):
        again = run()
        differ = (again.view(torch.int16) != out.view(torch.int16)).any(1).nonzero().flatten().tolist()
        assert not differ, f"run {i}: rows {differ[:8]} (of {len(differ)}) differ from the first run's"
    assert torch.isnan(out[total:].float()).all(), "wrote past the last row"
    out = out[:total].cpu()
    r = 0
    for e, c in enumerate(counts):
        assert not torch.isnan(out[r:r + c].float()).any(), f"expert {e} ({c} rows): rows left unwritten"
        assert relerr(out[r:r + c], ref[r:r + c]) < 1e-2, f"expert {e} ({c} rows)"
        r += c


@pytest.mark.parametrize("config", _token_width_configs() or ["moe_gemm1_m192n64k128_coop"])
def test_every_token_width(config):
    """moe_gemm_mainloop.hpp item 12: an expert's last token tile runs its GMMAs over its tokens rounded up
    to 8 (the widths in the tile's upper half, the narrowest below). Experts whose last tile holds 1, half
    the tile -+ 1, each width's first and last count, and a full tile plus a tail, each against the reference."""
    tile_n = _gemm().tile_n(config)
    half, widths = tile_n // 2, _gemm().gmma_widths(config)
    # each width's first and last count (the narrowest's first: 7 below its last)
    counts = sorted({1, half - 1, half + 1, tile_n + half + 3}
                    | {c for lo, w in zip((widths[0] - 8,) + widths, widths) for c in (lo + 1, w)})
    _check_each_expert(config, counts, tile_n)


@pytest.mark.parametrize("config", [c for c in CONFIGS1 + CONFIGS2 if _gemm().tile_n(c) >= 16])
def test_every_token_box(config):
    """A tile of fewer than TileN tokens: the 32-token tile loads its 8-row chunks in one box (mainloop item 15),
    the 96-160-token tiles one box per chunk, those past the expert out of bounds (item 4), the 16- and 64-token
    tiles the whole box. Experts whose last tile ends at each chunk's first and last row (alone, and after a full
    tile), in an order where a tile of many chunks runs before one of few (rows a tile does not load keep an
    earlier tile's tokens), each against the reference."""
    tile_n = _gemm().tile_n(config)
    tails = [c for j in range(1, tile_n // 8 + 1) for c in (8 * j - 7, 8 * j)]
    counts = tails[::-1] + [tile_n + c for c in tails[::3]]
    _check_each_expert(config, counts, 7 * tile_n)


@pytest.mark.parametrize("pdl", [0, 2])
@pytest.mark.parametrize("config", [c for c in CONFIGS1 + CONFIGS2 if c.endswith("_c2")] or
                         ["moe_gemm2_m128n128k128_coop_c2"])
def test_cluster_tiles_repeat_the_same_bits(config, pdl):
    """A cluster's CTAs multicast their halves of the token tile to both, and each stage's arrive must expect
    them (a later expect let 1 of 12 such runs read a full tile's stage before its tokens landed:
    benchmarks/NOTES.md 2026-12-05 (50)). 32 experts of 470-560 rows (full tiles and partial ones of every
    size), the GEMM run 16 times: the same bits each time, against the reference."""
    gen = torch.Generator().manual_seed(50 + pdl)
    counts = torch.randint(470, 560, (32,), generator=gen).tolist()
    _check_each_expert(config, counts, 50, repeats=16, pdl=pdl)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("config", CONFIGS1)
def test_activations(activation, limit, with_bias, config):
    gen = torch.Generator().manual_seed(5)
    H, I, counts = 128, 96, [9, 0, 20]
    E = len(counts)
    blocks, scales = random_weights(E, 2 * I, H, gen, lo=124, hi=130)   # large pre-activations: limit matters
    bias = 4 * torch.randn(E, 2 * I, generator=gen) if with_bias else None
    x = torch.randn(sum(counts), H, generator=gen).to(torch.bfloat16)
    out = run_gemm1(blocks, scales, bias, x, counts, activation=activation, alpha=1.702, limit=limit,
                    config=config)
    ref = ref_gemm1(dequant(blocks, scales), bias, x, counts, activation, 1.702, limit)
    assert relerr(out[:sum(counts)].cpu(), ref) < 1e-2


@pytest.mark.parametrize("rows, tiles, chunk", [(4096 * 4, [160, 128, 96, 64, 32], 160),
                                                 (16384 * 8, [128, 96, 64, 32], 128), (1024 * 8, [96, 64], 96)])
@pytest.mark.parametrize("kind", [1, 2])
def test_row_windows_take_their_rows_only(kind, rows, tiles, chunk):
    """A split plan's parts (templates/sm90/moe_rows.hpp), over chunks of 160, 128 and 96 rows: each
    launch writes exactly the rows its window takes of every expert (the rest stay poisoned), and the
    parts together match the reference; row counts around every window edge. The window of a chunk of
    one row takes every row, as ALL_ROWS does."""
    g = _gemm()
    plan = g.split_plan(rows, 128)
    assert [g.tile_n(part[0]) for part in plan.parts] == tiles and plan.chunk == chunk
    gen = torch.Generator().manual_seed(11 + kind)
    counts = [0, 5, 32, 33, 64, 65, 127, 128, 129, 200, 300, 1, 160, 159, 161, 320, 321, 289]
    E, total, H, I = len(counts), sum(counts), 160, 96
    N, K = (2 * I, H) if kind == 1 else (H, I)
    blocks, scales = random_weights(E, N, K, gen)
    bias = torch.randn(E, N, generator=gen)
    x = torch.randn(total, K, generator=gen).to(torch.bfloat16)
    w = torch.rand(total, generator=gen)

    def run(part, out=None, window=None):
        config = part[kind - 1]
        window = window or (plan.chunk, part[2], part[3])
        if kind == 1:
            return run_gemm1(blocks, scales, bias, x, counts, config=config, window=window, out=out)
        return run_gemm2(blocks, scales, bias, x, counts, w, config=config, window=window, out=out)

    start = offsets_of(counts).tolist()
    for part in plan.parts:
        written = ~torch.isnan(run(part).float().cpu()).all(1)
        want = torch.zeros(total + 3, dtype=torch.bool)
        for e, c in enumerate(counts):
            first, count = g.window_rows(c, plan.chunk, part[2], part[3])
            want[start[e] + first:start[e] + first + count] = True
        assert torch.equal(written, want), f"part {part[0]}: rows {torch.nonzero(written != want).flatten().tolist()}"
    out = run(plan.parts[0])
    for part in plan.parts[1:]:
        run(part, out)
    if kind == 1:
        ref = ref_gemm1(dequant(blocks, scales), bias, x, counts, "silu", 1.702, None)
    else:
        ref = ref_gemm2(dequant(blocks, scales), bias, x, w, counts)
    assert not torch.isnan(out[:total].float()).any() and torch.isnan(out[total:].float()).all()
    assert relerr(out[:total].cpu(), ref) < 1e-2
    assert torch.equal(run(plan.parts[0], window=(1, 0, 1)).view(torch.int16),
                       run(plan.parts[0], window=g.ALL_ROWS).view(torch.int16))


@pytest.mark.parametrize("config", CONFIGS1 + CONFIGS2)
@pytest.mark.parametrize("K", [96, 2880])
def test_dependent_launch_modes_give_the_same_bits(config, K):
    """Launched dependent (templates/sm90/pdl.cuh), waiting first or loading the first tile's weights
    before the tokens (fewer k tiles than stages at K = 96, more at 2880): the bits of an ordinary
    launch, every row written and none past the last."""
    gen = torch.Generator().manual_seed(K)
    counts = [0, 5, 1, 37, 0, 3, 70, 130]
    N = 192
    blocks, scales = random_weights(len(counts), N, K, gen)
    x = torch.randn(sum(counts), K, generator=gen).to(torch.bfloat16)
    w = torch.rand(sum(counts), generator=gen)
    run = (lambda pdl: run_gemm1(blocks, scales, None, x, counts, config=config, pdl=pdl)) if "gemm1" in config \
        else (lambda pdl: run_gemm2(blocks, scales, None, x, counts, w, config=config, pdl=pdl))
    want = run(0)
    total = sum(counts)
    assert not torch.isnan(want[:total].float()).any() and torch.isnan(want[total:].float()).all()
    for pdl in (1, 2):
        got = run(pdl)
        assert torch.equal(got.view(torch.int16)[:total], want.view(torch.int16)[:total]), pdl
        assert torch.isnan(got[total:].float()).all(), pdl


def test_deterministic():
    gen = torch.Generator().manual_seed(9)
    H, I, counts = 256, 128, [40, 0, 90, 7]
    blocks, scales = random_weights(len(counts), H, I, gen)
    x = torch.randn(sum(counts), I, generator=gen).to(torch.bfloat16)
    w = torch.rand(sum(counts), generator=gen)
    a = run_gemm2(blocks, scales, None, x, counts, w)
    b = run_gemm2(blocks, scales, None, x, counts, w)
    assert torch.equal(a.view(torch.int16)[:sum(counts)], b.view(torch.int16)[:sum(counts)])


def test_cuda_graph_replay_new_offsets():
    """Capture one GEMM2 launch; replays honour new offsets and data written into the same buffers."""
    g = _gemm()
    gen = torch.Generator().manual_seed(3)
    E, H, I, cap = 5, 160, 96, 64
    blocks, scales = random_weights(E, H, I, gen)
    p = to_cuda(layout.prepare_w2(blocks, scales, None))
    W = dequant(blocks, scales)
    x = torch.zeros(cap, I, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(cap, device="cuda")
    off = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    out = torch.zeros(cap, H, dtype=torch.bfloat16, device="cuda")
    ws = g.workspace(g.GEMM2_CONFIG, E)
    stream = torch.cuda.Stream()
    # warm-up (host-side initialisation) outside capture
    with torch.cuda.stream(stream):
        g.run(g.GEMM2_CONFIG, p, x, off, out, H, I, row_weights=w, ws=ws)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        g.run(g.GEMM2_CONFIG, p, x, off, out, H, I, row_weights=w, ws=ws)
    for counts in ([3, 0, 20, 1, 9], [0, 0, 0, 0, 0], [0, 33, 0, 0, 31], [1, 1, 1, 1, 1]):
        n = sum(counts)
        xs = torch.randn(n, I, generator=gen).to(torch.bfloat16)
        ws_ = torch.rand(n, generator=gen)
        x.zero_()
        x[:n] = xs.cuda()
        w[:n] = ws_.cuda()
        off.copy_(offsets_of(counts))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if n:
            ref = ref_gemm2(W, None, xs, ws_, counts)
            assert relerr(out[:n].cpu(), ref) < 1e-2, counts
        assert torch.isnan(out[n:].float()).all()


def test_bad_arguments_return_errors():
    g = _gemm()
    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_weights(2, 64, 64, gen)
    p = to_cuda(layout.prepare_w2(blocks, scales, None))
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    off = offsets_of([2, 2]).cuda()
    out = torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(4, device="cuda")
    assert g.run(g.GEMM2_CONFIG, p, x, off, out, 64, 48, row_weights=w, check=False) != 0    # K % 32
    assert g.run(g.GEMM2_CONFIG, p, x, off, out, 64, 64, row_weights=None, check=False) != 0  # no row weights
    # No per-launch device state is left (static descriptors, shapes from the offsets): the GEMMs
    # need no workspace, and a NULL one is accepted.
    assert all(g.workspace_size(c, 2) == 0 for c in CONFIGS1 + CONFIGS2)
    assert g.run(g.GEMM1_CONFIG, p, x, off, out, 64, 64, activation=5, check=False) != 0
    for window in ((96, 0, 97), (128, 64, 64), (128, 0, 129), (128, -1, 32), (0, 0, 0)):   # moe_rows.hpp's rules
        assert g.run(g.GEMM2_CONFIG, p, x, off, out, 64, 64, row_weights=w, window=window, check=False) != 0
    for pdl in (-1, 3):   # pdl.cuh's modes are 0, 1, 2
        assert g.run(g.GEMM2_CONFIG, p, x, off, out, 64, 64, row_weights=w, pdl=pdl, check=False) != 0
    torch.cuda.synchronize()


def test_layout_same_on_cpu_and_gpu():
    gen = torch.Generator().manual_seed(12)
    blocks, scales = random_weights(3, 192, 160, gen)
    bias = torch.randn(3, 192, generator=gen)
    for fn, args in ((layout.prepare_w13, ("interleaved",)), (layout.prepare_w2, ())):
        a = fn(blocks, scales, bias, *args)
        b = fn(blocks.cuda(), scales.cuda(), bias.cuda(), *args)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k].cpu()) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k
