"""layout.py: exact round trips, gate/up row order, and an emulation of the kernel's reading of
the prepared bytes (fragment addressing + bit-placement converter + scale multiply) on the CPU."""

import pytest
import torch

from moe_cutlass import layout

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _random(E, N, K, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (E, N, K // 32), generator=g, dtype=torch.uint8)
    b = torch.randn(E, N, generator=g) if bias else None
    return blocks, scales, b


def _dequant(blocks, scales):
    codes = torch.stack((blocks & 15, blocks >> 4), -1).flatten(-2).long()
    vals = torch.tensor(E2M1)[codes]
    s = torch.pow(2.0, scales.double() - 127).float()
    return vals * s.repeat_interleave(32, -1)


@pytest.mark.parametrize("H,I", [(96, 32), (2880, 96), (64, 160), (160, 64)])
@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_w13_round_trip(H, I, gate_up):
    blocks, scales, bias = _random(3, 2 * I, H, seed=H + I)
    p = layout.prepare_w13(blocks, scales, bias, gate_up)
    Np, Kp = layout.round_up(2 * I, 128), layout.round_up(H, 64)
    assert p["blocks"].shape == (3, Np // 64, Kp // 64, 2048) and p["blocks"].dtype == torch.uint8
    assert p["scales"].shape == (3, Np // 64, Kp // 64, 128) and p["scales"].dtype == torch.uint8
    assert p["bias"].shape == (3, Np) and p["bias"].dtype == torch.float32
    b2, s2, bias2 = layout.unprepare_w13(p, H, I)
    if gate_up == "interleaved":   # unprepare returns concat order
        order = torch.cat((torch.arange(0, 2 * I, 2), torch.arange(1, 2 * I, 2)))
        blocks, scales, bias = blocks[:, order], scales[:, order], bias[:, order]
    assert torch.equal(b2, blocks) and torch.equal(s2, scales) and torch.equal(bias2, bias)


@pytest.mark.parametrize("H,I", [(2880, 2880), (96, 32), (32, 96)])
def test_w2_round_trip(H, I):
    E = 2
    blocks, scales, bias = _random(E, H, I, seed=7, bias=False)
    if H * I > 100000:
        blocks, scales = blocks[:1], scales[:1]
        E = 1
    p = layout.prepare_w2(blocks, scales, None)
    assert "bias" not in p
    b2, s2, bias2 = layout.unprepare_w2(p, H, I)
    assert bias2 is None and torch.equal(b2, blocks) and torch.equal(s2, scales)


def test_checkpoint_block_shape():
    blocks, scales, _ = _random(2, 64, 128, seed=3, bias=False)
    a = layout.prepare_w2(blocks, scales)
    b = layout.prepare_w2(blocks.view(2, 64, 4, 16), scales)
    assert torch.equal(a["blocks"], b["blocks"]) and torch.equal(a["scales"], b["scales"])


@pytest.mark.parametrize("gate_up", ["concat", "interleaved"])
def test_w13_kernel_row_order(gate_up):
    """Kernel row 16b + i (i < 8) is gate row 8b + i, 16b + 8 + i the up row 8b + i."""
    I, H, E = 32, 64, 1
    rows = torch.arange(2 * I, dtype=torch.float32)
    blocks = torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8)
    scales = torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8)
    p = layout.prepare_w13(blocks, scales, rows.view(1, -1), gate_up)
    kb = p["bias"][0, : 2 * I]
    for j in range(I):
        gate = j if gate_up == "concat" else 2 * j
        up = I + j if gate_up == "concat" else 2 * j + 1
        assert kb[16 * (j // 8) + j % 8] == gate
        assert kb[16 * (j // 8) + 8 + j % 8] == up


# ---- emulation of the kernel's reads (moe_gemm_mainloop.hpp) ----

def _convert(q):
    """Python twin of mc_e2m1x8_to_bf16: word -> 8 bf16 bit patterns (v0..v7), each the e2m1 value
    times 2^-126."""
    mask = 0x81C081C0
    rotl10 = ((q << 10) | (q >> 22)) & 0xFFFFFFFF
    regs = [q & mask, ((q << 4) & 0x81808180) | ((q >> 4) & 0x00400040), (q << 6) & mask, rotl10 & mask]
    out = []
    for r in regs:
        out += [r & 0xFFFF, (r >> 16) & 0xFFFF]
    return out


def _bf16(bits):
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _mul_bf16(a_bits, b_bits):
    """bf16 x bf16 -> bf16 (round to nearest even), as mul.rn.bf16x2 does on one half."""
    return (_bf16(a_bits).float() * _bf16(b_bits).float()).to(torch.bfloat16)


def _scale_fast(s):
    """The fast path's multiplier of byte s: its stored field (s + SCALE_BIAS) mod 256 on bf16 exponent bits."""
    return ((s + layout.SCALE_BIAS) & 0xFF) << 7


def _scale_slow(s):
    return 0x0040 if s == 0 else 0x7FC0 if s == 255 else s << 7


def _scale_fields(word):
    """Python twin of mc_scale_pairs: a scale word -> the four stored fields (group 2u row r, row r + 8,
    group 2u+1 row r, row r + 8), each as the bf16 bits the fast path multiplies by."""
    rot = ((word << 8) | (word >> 24)) & 0xFFFFFFFF
    out = []
    for pair in (word & 0x7F807F80, rot & 0x7F807F80):
        out += [pair & 0xFFFF, pair >> 16]
    return out


def _slow_from_field(bits):
    """mc_scale_pair_slow, one half: the stored field back to byte s, as 2^(s-127)."""
    return _scale_slow(((bits >> 7) + 130) & 0xFF)


def _word(codes):
    """The prepared word holding codes[v] for v = 0..7 (layout.CODE_BITS)."""
    return _word_at(codes, layout.CODE_BITS)


def _word_at(codes, positions):
    q = 0
    for v, c in enumerate(codes):
        for i, pos in enumerate(positions[v]):
            q |= ((c >> (3 - i)) & 1) << pos
    return q


def test_code_bits_fill_the_word():
    assert sorted(p for bits in layout.CODE_BITS for p in bits) == list(range(32))


def test_converter_all_codes():
    """Every code in every value slot converts to its exact e2m1 value times 2^-126."""
    for v in range(8):
        for code in range(16):
            codes = [(v + 3 * s) % 16 for s in range(8)]
            codes[v] = code
            got = [_bf16(x).float().item() * 2.0 ** 126 for x in _convert(_word(codes))]
            want = [E2M1[c] for c in codes]
            assert got == want
            assert str(got[v]) == str(E2M1[code])   # sign of zero too


def test_converter_scales_every_byte():
    """Both scale paths against exact 2^(s-127) for all 16 codes x every scale byte: the fast
    path (one multiply by 2^(s-1)) for s <= FAST_SCALE_MAX, the slow one (2^126, then 2^(s-127))
    for every byte; the kernel picks the slow path for a tensor whose scale_max is larger."""
    codes = torch.arange(16)
    bits = torch.tensor([x for q in (_word(list(range(8))), _word(list(range(8, 16)))) for x in _convert(q)])
    conv = bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)          # value * 2^-126, code order
    for s in range(256):
        want = torch.tensor(E2M1, dtype=torch.float64)[codes] * 2.0 ** (s - 127) if s < 255 else None
        slow = (conv.float() * _bf16(0x7E80).float()).to(torch.bfloat16)
        slow = (slow.float() * _bf16(_scale_slow(s)).float()).to(torch.bfloat16).double()
        paths = [slow]
        if s <= layout.FAST_SCALE_MAX:
            paths.append((conv.float() * _bf16(_scale_fast(s)).float()).to(torch.bfloat16).double())
        for got in paths:
            if s == 255:
                assert torch.isnan(got).all()
            else:
                finite = want.abs() < 2.0 ** 128                               # 4 * 2^126 overflows bf16
                assert torch.equal(got[finite], want[finite]), s
                assert torch.isinf(got[~finite]).all(), s
    assert _scale_fast(layout.FAST_SCALE_MAX + 1) == 0x7F80                   # 2^128: not a finite bf16


def _u32(raw, base):
    return raw[base] | raw[base + 1] << 8 | raw[base + 2] << 16 | raw[base + 3] << 24


@pytest.mark.parametrize("top", [128, 254])
def test_kernel_read_emulation(top):
    """Read the prepared tensors the way the kernel does (thread addressing, words, scale words, the
    fast path when every byte is <= FAST_SCALE_MAX, else the slow one) and compare with the
    dequantized weights."""
    E, N, K = 1, 128, 256
    blocks, _, _ = _random(E, N, K, seed=11, bias=False)
    scales = torch.randint(top - 40, top + 1, (E, N, K // 32), generator=torch.Generator().manual_seed(top),
                           dtype=torch.uint8)
    scales[0, 5, 1] = 0
    p = layout.prepare_w2(blocks, scales)
    fast = p["scale_max"] <= layout.FAST_SCALE_MAX
    assert fast == (top == 128)
    ref = _dequant(blocks, scales)[0]
    Kp = p["blocks"].shape[2] * 64
    raw = p["blocks"][0].reshape(-1).tolist()
    sraw = p["scales"][0].reshape(-1).tolist()
    got = torch.zeros(N, K)
    TileK = 128
    for slab in range(N // 64):
        for ktile in range(K // TileK):
            for t in range(128):
                row0 = slab * 64 + (t // 32) * 16 + (t % 32) // 4
                for kb in range(TileK // 16):
                    u, w = kb // 4, kb % 4
                    # the tile's units lie contiguous: [slab][unit][2048 B], thread t at 16 t
                    unit = ktile * (TileK // 64) + u
                    base = (slab * (Kp // 64) + unit) * 2048 + 16 * t + 4 * w
                    q = _u32(raw, base)
                    # the unit's scale word of thread t's row pair: [slab][unit][128 B], word t // 4
                    fields = _scale_fields(_u32(sraw, (slab * (Kp // 64) + unit) * 128 + 4 * (t // 4)))
                    pair = fields[2 * (w // 2): 2 * (w // 2) + 2]                  # k-blocks 0, 1: group 2u
                    for v, x in enumerate(_convert(q)):
                        m = pair[(v >> 1) & 1]
                        if fast:
                            val = _mul_bf16(x, m)
                        else:
                            val = (_bf16(x).float() * 2.0 ** 126 * _bf16(_slow_from_field(m)).float()).to(torch.bfloat16)
                        r = row0 + 8 * ((v >> 1) & 1)
                        k = ktile * TileK + kb * 16 + 2 * (t % 4) + (v & 1) + 8 * (v >> 2)
                        got[r, k] = val.float().item()
    assert torch.equal(got, ref)


def test_scale_words_every_byte():
    """Every byte in every field of a scale word reads back as its fast-path multiplier (field) and
    its slow-path byte, and the words round-trip; padding reads as byte 0."""
    E, N, K = 1, 64, 128
    s = torch.arange(N * K // 32, dtype=torch.int64).view(E, N, K // 32)
    scales = ((s * 37 + 11) % 256).to(torch.uint8)                        # every byte once
    p = layout.prepare_w2(torch.zeros(E, N, K // 2, dtype=torch.uint8), scales)
    sraw = p["scales"][0].reshape(-1).tolist()
    seen = set()
    for slab in range(p["scales"].shape[1]):
        for unit in range(p["scales"].shape[2]):
            for word in range(32):
                r = slab * 64 + 16 * (word // 8) + word % 8
                fields = _scale_fields(_u32(sraw, ((slab * p["scales"].shape[2]) + unit) * 128 + 4 * word))
                for i, f in enumerate(fields):
                    row, g = r + 8 * (i % 2), 2 * unit + i // 2
                    byte = int(scales[0, row, g]) if row < N else 0
                    assert f == _scale_fast(byte)
                    assert _slow_from_field(f) == _scale_slow(byte)
                    seen.add(byte)
    assert seen == set(range(256))
    assert layout.prepared_scale_max(p["scales"]) == 255


def v1_blocks(blocks):
    """Prepared blocks rewritten into layout.BIT_POS_V1's bit positions (what version 1 wrote)."""
    v1 = [tuple(p + 16 * (v & 1) for p in layout.BIT_POS_V1[v >> 1]) for v in range(8)]
    words = blocks.reshape(-1, 4).long()
    out = []
    for b0, b1, b2, b3 in words.tolist():
        q = b0 | b1 << 8 | b2 << 16 | b3 << 24
        codes = [sum(((q >> p) & 1) << (3 - i) for i, p in enumerate(layout.CODE_BITS[v])) for v in range(8)]
        w = _word_at(codes, v1)
        out += [(w >> (8 * b)) & 0xFF for b in range(4)]
    return torch.tensor(out, dtype=torch.uint8).view(blocks.shape)


def v2_scales(scales):
    """Prepared scales rewritten into the byte layout [E, Kp/32, Npad] (what versions 1 and 2 wrote)."""
    return layout._unswizzle_scales(scales).transpose(1, 2).contiguous()


def test_migrate_scales_v2():
    blocks, scales, _ = _random(2, 96, 160, seed=6, bias=False)
    p = layout.prepare_w2(blocks, scales)
    old = v2_scales(p["scales"])
    assert old.shape == (2, 192 // 32, 128) and torch.equal(old[:, :5, :96], scales.transpose(1, 2))
    assert torch.equal(layout.migrate_scales_v2(old), p["scales"])


def test_migrate_blocks_v1():
    """Version 1's bit layout -> today's, exactly, for random codes of two experts."""
    blocks, scales, _ = _random(2, 64, 128, seed=5, bias=False)
    p = layout.prepare_w2(blocks, scales)
    old = v1_blocks(p["blocks"])
    assert not torch.equal(old, p["blocks"])
    assert torch.equal(layout.migrate_blocks_v1(old), p["blocks"])
