"""Offline arrangement of MXFP4 expert weights into the SM90 kernel layout (and back).

Pure torch, CPU or CUDA, deterministic; runs once per model load.

Prepared tensors (dict values; the expert is dim 0 of every tensor):

- ``blocks``: uint8 [E, Npad/64, Kp/64, 2048]. Npad = roundup(N, 128) weight rows, Kp =
  roundup(K, 64); padding holds zero codes. The weights are cut into 64-row x 64-K "units"
  (slab s = rows [64s, 64s+64), unit u = K [64u, 64u+64)), each stored as 2048 contiguous bytes,
  the units of a slab back to back along K: a weight tile (TileM x TileK) is TileM/64 runs of
  TileK/64 * 2 KB, which the kernel's TMA copies as is. Inside a unit, thread t (0..127) of a
  consumer warpgroup finds its RS-WGMMA A fragments for the unit's 4 k-blocks (16 K each) in the
  16 bytes at offset 16*t (one conflict-free 128-bit ld.shared).
  Each 32-bit word of a fragment holds the 8 values v = 0..7 of one k-block in the m64k16
  register order (v: k + (v & 1), row + 8 * ((v >> 1) & 1), k + 8 * (v >> 2), with row =
  16 * (t // 32) + (t % 32) // 4 and k = 2 * (t % 4)). The (sign, e1, e0, m) bits of value v sit
  at the word's bit positions CODE_BITS[v]: the layout whose conversion to bf16 is a few shifts
  and masks per output register plus one multiply (templates/sm90/mxfp4_math.cuh,
  mc_e2m1x8_to_bf16). State dicts of MoELayer before version 2 hold BIT_POS_V1's layout
  (`migrate_blocks_v1` rewrites them).
- ``scales``: uint8 [E, Npad/64, Kp/64, 128]: per unit (as ``blocks``) 32 little-endian 32-bit words,
  word p for the rows r = 16 (p // 8) + p % 8 and r + 8 of the slab (thread t's rows read word t // 4),
  holding the unit's two 32-K groups' E8M0 bytes s as t = (s + SCALE_BIAS) mod 256, the bf16
  exponent field of 2^(s-1): group 2u's at bits 7..14 (row r) and 23..30 (row r + 8), group 2u+1's
  at the same bits after a rotation left by 8 (templates/sm90/mxfp4_math.cuh, mc_scale_pairs: one
  load and three instructions give a thread its four multipliers of a unit). Padding holds s = 0
  (with zero codes, contributes exactly 0). State dicts of MoELayer before version 3 hold the byte
  layout [E, Kp/32, Npad] (`migrate_scales_v2` rewrites them).
- ``bias`` (only when a bias is given): float32 [E, Npad], zero padded.
- ``scale_max``: int, the largest scale byte of the tensor. The kernels' one-multiply conversion
  is exact for scale bytes <= FAST_SCALE_MAX; a tensor holding a larger byte (a block scale
  above 2, or 255 = NaN) takes a two-multiply path. Known offline, so the mainloop never tests
  scale bytes.

Rows are in kernel order. GEMM2 (W2, N = H): the original order. GEMM1 (W13, N = 2I): per
16-row block b, rows 16b..16b+7 are gate rows 8b..8b+7 and rows 16b+8..16b+15 the matching up
rows, so one thread's accumulators hold gate row j and up row j (8 rows apart, WGMMA
accumulator layout) and the epilogue writes inter column j = 8b + (row % 8). Gate row j is
original row j ("concat") or 2j ("interleaved"); up row j is I + j or 2j + 1.

K padding: the kernel reads the weights over Kp and the activations over the real K; the TMA
zero-fills activation columns [K, Kp), so the padding never reads past a token row.
"""
import torch

ROW_PAD = 128   # weight rows: a multiple of every TileM (64, 128)
K_PAD = 64      # K: one unit
UNIT_M = 64
UNIT_K = 64
GATE_UP_ORDERS = ("concat", "interleaved")

# Bit positions in the 32-bit word of the (sign, e1, e0, m) bits of value v = 0..7, for
# mc_e2m1x8_to_bf16's output registers j = v >> 1 (lane v & 1): j0 = q & T, j1 = ((q << 4) & T') |
# ((q >> 4) & T''), j2 = (q << 6) & T, j3 = rotl(q, 10) & T, T = 0x81C081C0 (per lane: sign on
# bf16 bit 15, e1 e0 on exponent bits 8..7, m on mantissa bit 6), so each yields the bf16 of the
# e2m1 value times 2^-126.
CODE_BITS = ((15, 8, 7, 6), (31, 24, 23, 22), (11, 4, 3, 10), (27, 20, 19, 26),
             (9, 2, 1, 0), (25, 18, 17, 16), (5, 30, 29, 28), (21, 14, 13, 12))
# The layout before (MoELayer state dicts of version 1): positions inside the 16-bit lane v & 1 of
# value v's bits, by register j = v >> 1.
BIT_POS_V1 = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 11, 10, 13))
# The prepared layout's version: 1 BIT_POS_V1's blocks, 2 CODE_BITS' blocks with the byte scales, 3 the scale
# words above. The kernels read one (MC_PREPARED_FORMAT, templates/sm90/routing.cu.j2: change both together);
# ops checks a built library's before its first call.
FORMAT = 3
FAST_SCALE_MAX = 128   # 2^(s-1) must be a normal bf16: the bias-fixing multiply folds in the scale
SCALE_BIAS = 126       # stored scale field t = s + 126: 2^(s-1)'s bf16 exponent field


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _unit_index(device) -> torch.Tensor:
    """int64 [128, 4, 8]: (thread, k-block, value) -> row * 64 + k inside a 64x64 unit."""
    t = torch.arange(128, device=device).view(128, 1, 1)
    kb = torch.arange(4, device=device).view(1, 4, 1)
    v = torch.arange(8, device=device).view(1, 1, 8)
    row = 16 * (t // 32) + (t % 32) // 4 + 8 * ((v >> 1) & 1)
    k = 16 * kb + 2 * (t % 4) + (v & 1) + 8 * (v >> 2)
    return (row * UNIT_K + k).reshape(-1)


def _unpack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K] (low nibble = even k)."""
    lo = blocks & 0x0F
    hi = blocks >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _rows_w13(I: int, gate_up: str, device) -> torch.Tensor:
    """int64 [2I]: kernel row p -> original row."""
    p = torch.arange(2 * I, device=device)
    j = (p // 16) * 8 + p % 8           # gate/up pair index
    is_up = (p % 16) >= 8
    if gate_up == "concat":
        return torch.where(is_up, I + j, j)
    return torch.where(is_up, 2 * j + 1, 2 * j)


def _code_bits(device) -> torch.Tensor:
    """int32 [8, 16]: value v's code c -> its bits in the word (two's complement where bit 31 is set)."""
    bits = [[sum(((c >> (3 - i)) & 1) << pos for i, pos in enumerate(CODE_BITS[v])) for c in range(16)]
            for v in range(8)]
    return torch.tensor([[b - (1 << 32) if b >> 31 else b for b in row] for row in bits], dtype=torch.int32,
                        device=device)


def _swizzle_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [E, Npad, Kp] (logical, padded) -> prepared blocks uint8 [E, Npad/64, Kp/64, 2048].
    Works in int32 words (little endian, as the kernel reads them): a few bytes per code at a time."""
    E, Np, Kp = codes.shape
    S, U = Np // UNIT_M, Kp // UNIT_K
    idx = _unit_index(codes.device)
    units = codes.view(E, S, UNIT_M, U, UNIT_K).permute(0, 1, 3, 2, 4).reshape(E, S, U, UNIT_M * UNIT_K)
    g = units.index_select(3, idx).view(E, S, U, 128, 4, 8)             # (t, kb, value v)
    table = _code_bits(codes.device)
    words = table[0][g[..., 0].int()]
    for v in range(1, 8):
        words |= table[v][g[..., v].int()]
    return words.view(torch.uint8).reshape(E, S, U, 2048)               # unit offset o = 16 t + 4 kb + byte


def _words(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] -> int32 [..., n]: the little-endian 32-bit words."""
    return blocks.contiguous().view(torch.int32)


def _u32(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] -> int64 [..., n]: the 32-bit words as unsigned values (room for shifts)."""
    return _words(blocks).long() & 0xFFFFFFFF


def _bytes_of(words: torch.Tensor) -> torch.Tensor:
    """Inverse of _u32: int64 [..., n] holding 32-bit words -> uint8 [..., 4n]."""
    return (words - ((words >> 31) << 32)).to(torch.int32).view(torch.uint8)


def _unswizzle_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Exact inverse of _swizzle_codes."""
    E, S, U, _ = blocks.shape
    Np, Kp = S * UNIT_M, U * UNIT_K
    words = _words(blocks).view(E, S, U, 128, 4)                        # (t, kb)
    g = torch.stack([sum(((words >> pos) & 1) << (3 - i) for i, pos in enumerate(CODE_BITS[v])).to(torch.uint8)
                     for v in range(8)], dim=-1)                         # (t, kb, v)
    g = g.reshape(E, S, U, UNIT_M * UNIT_K)
    units = torch.empty_like(g)
    units[..., _unit_index(blocks.device)] = g
    return units.view(E, S, U, UNIT_M, UNIT_K).permute(0, 1, 3, 2, 4).reshape(E, Np, Kp)


def migrate_blocks_v1(blocks: torch.Tensor) -> torch.Tensor:
    """Prepared blocks in BIT_POS_V1's bit layout (MoELayer state dicts of version 1) -> the same
    weights in CODE_BITS's layout (a permutation of each word's bits), a chunk of experts at a time."""
    moves = [(BIT_POS_V1[v >> 1][i] + 16 * (v & 1), CODE_BITS[v][i]) for v in range(8) for i in range(4)]
    out = torch.empty_like(blocks)
    for e0, e1 in _chunks(len(blocks), blocks[0].numel() if len(blocks) else 1):
        words = _u32(blocks[e0:e1])
        out[e0:e1] = _bytes_of(sum(((words >> old) & 1) << new for old, new in moves)).view(out[e0:e1].shape)
    return out


def _pair_rows(device) -> torch.Tensor:
    """int64 [32]: word p of a unit's scales -> its first row r in the slab (the other is r + 8)."""
    p = torch.arange(32, device=device)
    return 16 * (p // 8) + p % 8


def _rotl32(x: torch.Tensor, n: int) -> torch.Tensor:
    """Rotation of int64 values holding 32-bit words."""
    return ((x << n) | (x >> (32 - n))) & 0xFFFFFFFF


def _swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes uint8 [E, Npad, Kp/32] (logical, padded) -> prepared scales uint8 [E, Npad/64, Kp/64, 128]."""
    E, Np, G = scales.shape
    S, U = Np // UNIT_M, G // 2
    t = (scales.long() + SCALE_BIAS) & 0xFF
    t = t.view(E, S, UNIT_M, U, 2).permute(0, 1, 3, 2, 4)                 # (E, S, U, row, group of the unit)
    r = _pair_rows(scales.device)
    lo, hi = t.index_select(3, r), t.index_select(3, r + 8)               # (E, S, U, 32, 2)
    fields = (lo << 7) | (hi << 23)
    words = fields[..., 0] | _rotl32(fields[..., 1], 24)                  # group 2u+1: rotated right by 8
    return _bytes_of(words).reshape(E, S, U, 128)


def _unswizzle_scales(prepared: torch.Tensor) -> torch.Tensor:
    """Exact inverse of _swizzle_scales."""
    E, S, U, _ = prepared.shape
    words = _u32(prepared)                                                # (E, S, U, 32)
    out = torch.empty(E, S, U, UNIT_M, 2, dtype=torch.uint8, device=prepared.device)
    r = _pair_rows(prepared.device)
    for g, pair in enumerate((words, _rotl32(words, 8))):
        for rows, shift in ((r, 7), (r + 8, 23)):
            out[:, :, :, rows, g] = (((pair >> shift) - SCALE_BIAS) & 0xFF).to(torch.uint8)
    return out.permute(0, 1, 3, 2, 4).reshape(E, S * UNIT_M, U * 2)


def migrate_scales_v2(scales: torch.Tensor) -> torch.Tensor:
    """Prepared scales in the byte layout [E, Kp/32, Npad] (MoELayer state dicts before version 3)
    -> the same scales in today's word layout."""
    return _swizzle_scales(scales.transpose(1, 2))


def scale_max(scales: torch.Tensor) -> int:
    """A prepared dict's ``scale_max`` from the original scales [..., K/32]. Reads the tensor back to the host."""
    return int(scales.max()) if scales.numel() else 0


def prepared_scale_max(scales: torch.Tensor) -> int:
    """``scale_max`` from prepared scales (padding holds 0). Reads the tensor back to the host."""
    if not scales.numel():
        return 0
    return max(int(_unswizzle_scales(scales[e0:e1]).max()) for e0, e1 in _chunks(len(scales), scales[0].numel() * 8))


def _chunks(E: int, per_expert: int, limit: int = 1 << 26):
    step = max(1, limit // max(1, per_expert))
    for e0 in range(0, E, step):
        yield e0, min(E, e0 + step)


def _prepare(blocks, scales, bias, rows, device=None):
    """rows: int64 [N] on `device`, kernel row -> original row, or None for the identity. The output goes to
    `device` (default: the inputs'); the inputs are read a chunk of experts at a time, so besides
    them and the output only one chunk is ever held (on `device`)."""
    if blocks.dim() == 4:
        blocks = blocks.reshape(*blocks.shape[:2], -1)
    E, N, half = blocks.shape
    K = 2 * half
    if scales.shape != (E, N, K // 32):
        raise ValueError(f"scales: expected shape {(E, N, K // 32)}, got {tuple(scales.shape)}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError("blocks and scales must be uint8")
    Np, Kp = round_up(N, ROW_PAD), round_up(K, K_PAD)
    dev = blocks.device if device is None else torch.device(device)
    out_blocks = torch.empty(E, Np // UNIT_M, Kp // UNIT_K, 2048, dtype=torch.uint8, device=dev)
    out_scales = torch.empty(E, Np // UNIT_M, Kp // UNIT_K, 128, dtype=torch.uint8, device=dev)
    out = {"blocks": out_blocks, "scales": out_scales, "scale_max": scale_max(scales)}
    if bias is not None:
        out["bias"] = torch.zeros(E, Np, dtype=torch.float32, device=dev)
    for e0, e1 in _chunks(E, Np * Kp):
        part = [None if t is None else t[e0:e1].to(dev) for t in (blocks, scales, bias)]
        if rows is not None:
            part = [None if t is None else t.index_select(1, rows) for t in part]
        codes = torch.zeros(e1 - e0, Np, Kp, dtype=torch.uint8, device=dev)
        codes[:, :N, :K] = _unpack_codes(part[0])
        out_blocks[e0:e1] = _swizzle_codes(codes)
        byte = torch.zeros(e1 - e0, Np, Kp // 32, dtype=torch.uint8, device=dev)
        byte[:, :N, : K // 32] = part[1]
        out_scales[e0:e1] = _swizzle_scales(byte)
        if bias is not None:
            out["bias"][e0:e1, :N] = part[2].float()
    return out


def prepared_shapes(E: int, N: int, K: int) -> dict:
    """Shapes of the prepared tensors of E experts' [N, K] weights, by dict key."""
    Np, Kp = round_up(N, ROW_PAD), round_up(K, K_PAD)
    return {"blocks": (E, Np // UNIT_M, Kp // UNIT_K, 2048), "scales": (E, Np // UNIT_M, Kp // UNIT_K, 128), "bias": (E, Np)}


def _unprepare(prepared, N, K, rows):
    blocks, scales = prepared["blocks"], prepared["scales"]
    E = blocks.shape[0]
    Np, Kp = round_up(N, ROW_PAD), round_up(K, K_PAD)
    shapes = prepared_shapes(E, N, K)
    if tuple(blocks.shape) != shapes["blocks"] or tuple(scales.shape) != shapes["scales"]:
        raise ValueError(f"prepared tensors do not match N={N}, K={K}: blocks {tuple(blocks.shape)}, "
                         f"scales {tuple(scales.shape)}")
    out_blocks = torch.empty(E, N, K // 2, dtype=torch.uint8, device=blocks.device)
    out_scales = torch.empty(E, N, K // 32, dtype=torch.uint8, device=blocks.device)
    for e0, e1 in _chunks(E, Np * Kp):
        codes = _unswizzle_codes(blocks[e0:e1])
        out_blocks[e0:e1] = _pack_codes(codes[:, :N, :K].contiguous())
        out_scales[e0:e1] = _unswizzle_scales(scales[e0:e1])[:, :N, : K // 32]
    bias = prepared.get("bias")
    bias = None if bias is None else bias[:, :N].float().contiguous()
    if rows is not None:
        inv = torch.empty_like(rows)
        inv[rows] = torch.arange(rows.numel(), device=rows.device)
        out_blocks = out_blocks.index_select(1, inv)
        out_scales = out_scales.index_select(1, inv)
        if bias is not None:
            bias = bias.index_select(1, inv)
    return out_blocks, out_scales, bias


def prepare_w13(blocks, scales, bias=None, gate_up="concat", device=None) -> dict:
    """W13 (gate + up) blocks uint8 [E, 2I, H/2] (or [E, 2I, H/32, 16]), scales uint8
    [E, 2I, H/32], bias [E, 2I] or None -> prepared dict (see the module docstring) on `device`
    (default: the inputs')."""
    if gate_up not in GATE_UP_ORDERS:
        raise ValueError(f"gate_up: expected one of {GATE_UP_ORDERS}, got {gate_up!r}")
    two_i = blocks.shape[1]
    if two_i % 2 or (two_i // 2) % 8:
        raise ValueError(f"w13: 2I = {two_i} rows, I must be a multiple of 8 (32 for the kernels)")
    rows = _rows_w13(two_i // 2, gate_up, blocks.device if device is None else device)
    return _prepare(blocks, scales, bias, rows, device)


def prepare_w2(blocks, scales, bias=None, device=None) -> dict:
    """W2 (down) blocks uint8 [E, H, I/2] (or [E, H, I/32, 16]), scales uint8 [E, H, I/32],
    bias [E, H] or None -> prepared dict (see the module docstring) on `device` (default: the
    inputs')."""
    return _prepare(blocks, scales, bias, None, device)


def unprepare_w13(prepared: dict, H: int, I: int):
    """Inverse of prepare_w13, in CONCAT order: (blocks uint8 [E, 2I, H/2], scales uint8
    [E, 2I, H/32], bias float32 [E, 2I] or None)."""
    rows = _rows_w13(I, "concat", prepared["blocks"].device)
    return _unprepare(prepared, 2 * I, H, rows)


def unprepare_w2(prepared: dict, H: int, I: int):
    """Inverse of prepare_w2: (blocks uint8 [E, H, I/2], scales uint8 [E, H, I/32], bias
    float32 [E, H] or None)."""
    return _unprepare(prepared, H, I, None)
