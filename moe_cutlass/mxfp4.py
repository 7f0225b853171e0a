"""MXFP4 (OCP Microscaling Formats v1.0) quantization and dequantization.

An MXFP4 block is 32 consecutive elements along the last axis: 32 E2M1 codes (4 bits
each: sign, 2 exponent bits with bias 1, 1 mantissa bit) sharing one E8M0 scale byte s
that stands for 2^(s - 127); s = 255 is NaN. Two codes share a byte, the LOW nibble
holding the EVEN index (gpt-oss, OCP, torch.float4_e2m1fn_x2).

Plain device-agnostic torch: the same code runs on CPU and CUDA tensors, with no host
synchronisation.
"""

import torch

from ._checks import FLOAT_DTYPES, check_tensor, describe

BLOCK = 32
BYTES_PER_BLOCK = BLOCK // 2

# Value of each 4-bit code; bit 3 is the sign, so code 8 is -0.0.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)

E2M1_EMAX = 2           # exponent of the largest element, 6 = 1.5 * 2^2
E8M0_BIAS = 127
E8M0_NAN = 255

# Round-to-nearest-even onto the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: the code of a
# magnitude is the number of midpoints below it, where a tie rounds to the even code.
# At these midpoints the lower neighbour has an even code, so a tie stays below...
_TIES_DOWN = torch.tensor([0.25, 1.25, 2.5, 5.0], dtype=torch.float64)
# ...and at these the upper neighbour has the even code, so a tie counts as above.
_TIES_UP = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float64)


def _e8m0_to_float32(scales):
    """2^(s - 127) exactly, built from float32 bits (s = 0 is the subnormal 2^-127)."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, 1 << 22, s << 23)
    bits = torch.where(s == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def _round_to_e2m1(magnitude):
    """Codes 0..7 of non-negative magnitudes, round-to-nearest-even, saturating at 6."""
    down = _TIES_DOWN.to(magnitude.device, magnitude.dtype)
    up = _TIES_UP.to(magnitude.device, magnitude.dtype)
    # bucketize counts boundaries < x (right=False) or <= x (right=True).
    code = torch.bucketize(magnitude, down, out_int32=True)
    code += torch.bucketize(magnitude, up, right=True, out_int32=True)
    return code


def quantize_mxfp4(w):
    """Quantize w [..., K] (any float dtype, K a multiple of 32) to MXFP4.

    Returns (blocks uint8 [..., K/2], scales uint8 [..., K/32]). The scale follows the
    OCP spec: shared_exp = floor(log2(amax)) - 2, clamped to E8M0's [-127, 127] (so an
    all-zero block gets scale byte 127, i.e. 1); elements round to nearest even on the E2M1 grid
    and saturate at +-6. A block holding a NaN or an infinity gets the NaN scale (255)
    and zero codes.
    """
    check_tensor("w", w, dtype=FLOAT_DTYPES)
    if w.ndim == 0 or w.shape[-1] % BLOCK != 0:
        raise ValueError(f"w: expected a tensor [..., K] with K a multiple of {BLOCK}, got {describe(w)}")
    # float32 holds bf16/fp16 exactly; float64 stays float64 so that it is rounded only once.
    x = w.to(torch.promote_types(w.dtype, torch.float32))
    x = x.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)

    amax = x.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    # frexp: amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exactly.
    shared_exp = (torch.frexp(amax).exponent - 1 - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    # log2(0) has no value; scale 1 keeps zero blocks plain for any decoder.
    shared_exp = torch.where(amax == 0, 0, shared_exp)
    # 2^-shared_exp is itself an E8M0 value, so it is built exactly from bits.
    scaled = x * _e8m0_to_float32(E8M0_BIAS - shared_exp).to(x.dtype)

    code = _round_to_e2m1(torch.where(finite, scaled.abs(), 0.0))
    code |= (torch.signbit(x) & finite).to(torch.int32) << 3
    code = code.to(torch.uint8).reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)

    scales = torch.where(finite, shared_exp + E8M0_BIAS, E8M0_NAN).to(torch.uint8).squeeze(-1)
    return blocks, scales


def _flat_blocks(blocks, scales):
    """blocks as [..., K/2], accepting checkpoint-shaped [..., K/32, 16] as well."""
    check_tensor("blocks", blocks, dtype=torch.uint8)
    check_tensor("scales", scales, dtype=torch.uint8)
    if scales.ndim == 0:
        raise ValueError(f"scales: expected uint8 tensor of shape [..., K/32], got {describe(scales)}")
    if blocks.device != scales.device:
        raise ValueError(f"scales: expected a tensor on {blocks.device} (where blocks is), got one on {scales.device}")
    if blocks.ndim == scales.ndim + 1:
        expected = [*scales.shape, BYTES_PER_BLOCK]
        if list(blocks.shape) != expected:
            raise ValueError(f"blocks: expected uint8 tensor of shape {expected} to match scales "
                             f"{describe(scales)}, got {describe(blocks)}")
        return blocks.flatten(-2)
    expected = [*scales.shape[:-1], scales.shape[-1] * BYTES_PER_BLOCK]
    if list(blocks.shape) != expected:
        raise ValueError(f"blocks: expected uint8 tensor of shape {expected} (or {expected[:-1]} + "
                         f"[{scales.shape[-1]}, {BYTES_PER_BLOCK}]) to match scales {describe(scales)}, "
                         f"got {describe(blocks)}")
    return blocks


def dequantize_mxfp4(blocks, scales, dtype=torch.float32):
    """Decode MXFP4 to w [..., K] of `dtype`.

    blocks: uint8 [..., K/2] (low nibble = even index) or, as in gpt-oss checkpoints,
    [..., K/32, 16]; scales: uint8 [..., K/32]. Decoding is exact in float32/float64;
    scale 255 gives NaN.
    """
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype: expected one of {', '.join(map(str, FLOAT_DTYPES))}, got {dtype}")
    flat = _flat_blocks(blocks, scales)
    compute = torch.promote_types(dtype, torch.float32)
    codes = torch.stack((flat & 0xF, flat >> 4), dim=-1).long()
    values = E2M1_VALUES.to(flat.device, compute)[codes]
    values = values.reshape(*scales.shape, BLOCK) * _e8m0_to_float32(scales).to(compute).unsqueeze(-1)
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK).to(dtype)
