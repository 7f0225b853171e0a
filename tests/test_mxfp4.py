import pytest
import torch

from moe_cutlass.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4


# E2M1 decoded by hand from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit.
def _e2m1_from_bits(code):
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    magnitude = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return sign * magnitude


def _pack(codes):
    """codes uint8 [..., K] (values 0..15) -> bytes [..., K/2], low nibble = even index."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _one_block(codes, scale):
    """A single 32-element block: `codes` first, zeros after, with scale byte `scale`."""
    padded = torch.zeros(32, dtype=torch.uint8)
    padded[: len(codes)] = torch.tensor(codes, dtype=torch.uint8)
    return _pack(padded), torch.tensor([scale], dtype=torch.uint8)


def test_table_matches_bit_decoding():
    expected = torch.tensor([_e2m1_from_bits(c) for c in range(16)], dtype=torch.float32)
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.shape == (16,)
    assert torch.equal(E2M1_VALUES.view(torch.int32), expected.view(torch.int32))  # -0.0 too


def test_all_16_codes_decode_exactly():
    blocks, scales = _one_block(list(range(16)), 127)
    out = dequantize_mxfp4(blocks, scales)
    expected = torch.tensor([_e2m1_from_bits(c) for c in range(16)] + [0.0] * 16)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


def test_low_nibble_is_even_index():
    blocks, scales = _one_block([1, 7], 127)  # byte 0x71: 0.5 then 6.0
    assert blocks[0].item() == 0x71
    assert dequantize_mxfp4(blocks, scales)[:2].tolist() == [0.5, 6.0]


def test_scales_decode_exactly_and_255_is_nan():
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(-1)
    blocks = torch.full((256, 16), 0x22, dtype=torch.uint8)  # every element 1.0
    out = dequantize_mxfp4(blocks, scales)
    factors = out[:, 0].double()
    expected = torch.tensor([2.0 ** (s - 127) for s in range(255)], dtype=torch.float64)
    assert torch.equal(factors[:255], expected)
    assert torch.isnan(out[255]).all()
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype=torch.float64)[:255, 0], expected)


def test_smallest_scale_with_largest_element_is_exact():
    blocks, scales = _one_block([7, 1], 0)
    out = dequantize_mxfp4(blocks, scales)
    assert out[0].item() == 6 * 2.0 ** -127 and out[1].item() == 2.0 ** -128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_output_dtype(dtype):
    blocks, scales = _one_block([3, 11], 127)
    out = dequantize_mxfp4(blocks, scales, dtype=dtype)
    assert out.dtype == dtype and out[:2].tolist() == [1.5, -1.5]


def _random_representable(shape, gen):
    """MXFP4 data that quantize must reproduce bit for bit: each block holds a +-4 or +-6
    (so its amax fixes the scale the spec would pick) and scales keep values normal."""
    *lead, k = shape
    codes = torch.randint(0, 16, (*lead, k), generator=gen, dtype=torch.uint8)
    blocks_view = codes.view(*lead, k // 32, 32)
    blocks_view[..., 0] = torch.randint(6, 8, blocks_view[..., 0].shape, generator=gen, dtype=torch.uint8)
    blocks_view[..., 0] |= torch.randint(0, 2, blocks_view[..., 0].shape, generator=gen, dtype=torch.uint8) << 3
    scales = torch.randint(100, 155, (*lead, k // 32), generator=gen, dtype=torch.uint8)
    return _pack(codes), scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_quantize_dequantize_roundtrip_is_bitwise(dtype):
    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_representable((4, 3, 256), gen)
    w = dequantize_mxfp4(blocks, scales, dtype=dtype)
    q_blocks, q_scales = quantize_mxfp4(w)
    assert q_blocks.dtype == torch.uint8 and q_scales.dtype == torch.uint8
    assert torch.equal(q_scales, scales)
    assert torch.equal(q_blocks, blocks)


# (input, expected) with the block's amax pinned at 6 so the scale is 2^0.
RNE_CASES = [
    (0.25, 0.0), (0.2, 0.0), (0.3, 0.5), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0),
    (2.5, 2.0), (2.6, 3.0), (3.5, 4.0), (4.9, 4.0), (5.0, 4.0), (5.1, 6.0),
    (-0.75, -1.0), (-2.5, -2.0), (-5.0, -4.0),
]


@pytest.mark.parametrize("value,expected", RNE_CASES)
def test_quantize_rounds_to_nearest_even(value, expected):
    w = torch.zeros(32)
    w[0], w[1] = 6.0, value
    out = dequantize_mxfp4(*quantize_mxfp4(w))
    assert out[1].item() == expected


def _brute_force_codes(w):
    """Codes per the spec, by nearest grid point in float64 (ties to the even code)."""
    x = w.double().view(*w.shape[:-1], -1, 32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    v = x / 2.0 ** (torch.floor(torch.log2(amax)) - 2)
    grid = E2M1_VALUES[:8].double()
    odd = torch.arange(8) % 2
    magnitude_code = ((v.abs().unsqueeze(-1) - grid).abs() + odd * 1e-12).argmin(dim=-1)
    return (magnitude_code | (torch.signbit(v).long() << 3)).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_brute_force(dtype):
    w = (torch.randn(16, 512, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    w[0, :64] = torch.arange(64) / 8  # many exact ties
    blocks, _ = quantize_mxfp4(w)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()
    assert torch.equal(codes, _brute_force_codes(w))


def test_quantize_saturates_to_six():
    # amax 7.5: floor(log2(7.5)) - 2 = 0, so the scale is 1 and 7.5 and 7 exceed the grid.
    w = torch.zeros(32)
    w[:4] = torch.tensor([7.5, -7.0, 6.5, 1.0])
    blocks, scales = quantize_mxfp4(w)
    assert scales.item() == 127
    assert dequantize_mxfp4(blocks, scales)[:4].tolist() == [6.0, -6.0, 6.0, 1.0]


def test_quantize_scale_follows_ocp_rule():
    # shared_exp = floor(log2(amax)) - 2: amax 1.0 -> 2^-2, amax 100 -> 2^4, amax 2^-140 -> clamped 2^-127.
    w = torch.zeros(3, 32)
    w[0, 5], w[1, 9], w[2, 0] = 1.0, -100.0, 2.0 ** -140
    _, scales = quantize_mxfp4(w)
    assert scales.flatten().tolist() == [125, 131, 0]


def test_zero_block_and_negative_zero():
    blocks, scales = quantize_mxfp4(torch.zeros(2, 32))
    assert scales.flatten().tolist() == [127, 127] and not blocks.any()
    w = torch.zeros(32)
    w[0], w[1] = 6.0, -0.1  # rounds to -0: the sign survives
    assert quantize_mxfp4(w)[0][0].item() == 0x87


def test_non_finite_block_gets_nan_scale():
    w = torch.ones(2, 32)
    w[1, 3] = float("inf")
    blocks, scales = quantize_mxfp4(w)
    assert scales.flatten().tolist() == [125, 255]
    assert torch.isnan(dequantize_mxfp4(blocks, scales)[1]).all()


def test_checkpoint_shape_is_accepted():
    gen = torch.Generator().manual_seed(1)
    blocks, scales = _random_representable((2, 6, 128), gen)
    flat = dequantize_mxfp4(blocks, scales)
    ckpt = dequantize_mxfp4(blocks.view(2, 6, 4, 16), scales)
    assert ckpt.shape == (2, 6, 128) and torch.equal(flat, ckpt)


def test_quantization_error_of_normal_data_is_small():
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (64, 512) and scales.shape == (64, 32)
    rel = (dequantize_mxfp4(blocks, scales) - w).norm() / w.norm()
    assert rel < 0.15  # E2M1 with a power-of-two scale: about 0.12 for normal data
    # Scaled, an element is off by at most half a grid step (1, between 4 and 6) or, when
    # it saturates from below 8 to 6, by 2.
    err = (dequantize_mxfp4(blocks, scales) - w).abs().view(64, 32, 32)
    assert (err <= 2 * 2.0 ** (scales.double() - 127).unsqueeze(-1)).all()


def test_bf16_and_batched_input():
    w = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 2, 32) and scales.shape == (3, 2, 2)
    assert torch.equal(quantize_mxfp4(w.float())[0], blocks)


@pytest.mark.parametrize("shape", [(4, 48), (31,), ()])
def test_quantize_rejects_k_not_multiple_of_32(shape):
    with pytest.raises(ValueError, match="w: .*multiple of 32"):
        quantize_mxfp4(torch.zeros(shape))


def test_quantize_rejects_non_float():
    with pytest.raises(TypeError, match="w: "):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="w: "):
        quantize_mxfp4([0.0] * 32)


def test_dequantize_rejects_bad_dtypes():
    blocks, scales = torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)
    with pytest.raises(TypeError, match="blocks: expected uint8"):
        dequantize_mxfp4(blocks.to(torch.int8), scales)
    with pytest.raises(TypeError, match="scales: expected uint8"):
        dequantize_mxfp4(blocks, scales.float())
    with pytest.raises(TypeError, match="dtype: "):
        dequantize_mxfp4(blocks, scales, dtype=torch.int32)


@pytest.mark.parametrize("blocks_shape,scales_shape", [
    ((2, 16), (2, 2)),       # K/2 does not match K/32
    ((3, 16), (2, 1)),       # leading dims differ
    ((2, 1, 8), (2, 1)),     # checkpoint shape needs 16 bytes per block
    ((2, 2, 16), (2, 1)),    # checkpoint shape with the wrong block count
])
def test_dequantize_rejects_mismatched_shapes(blocks_shape, scales_shape):
    with pytest.raises(ValueError, match="blocks: expected"):
        dequantize_mxfp4(torch.zeros(blocks_shape, dtype=torch.uint8), torch.zeros(scales_shape, dtype=torch.uint8))
