"""Exact codecs for DeepSeek-V4's checkpoint number formats, and the runtime quantize-dequantize recipes.

Checkpoint formats (spec §5.4), all dequantized *exactly* (every value is a small float times a power of two,
so it is representable in bf16 and fp32):
- UE8M0 scale byte ``e`` (safetensors ``F8_E8M0``, torch ``float8_e8m0fnu``) means ``2 ** (e - 127)``
  (fp32 scales, as transformers may save them, are accepted by the dequantizers too).
- dense FP8 weights: ``float8_e4m3fn [out, in]`` with one UE8M0 scale per 32x32 block,
  scale shape ``[ceil(out/32), ceil(in/32)]``.
- FP4 routed experts: ``int8 [out, in/2]``, two E2M1 codes per byte (element ``2k`` in the LOW nibble,
  ``2k+1`` in the high nibble), one UE8M0 scale per 1x32 block along the input dim: scale ``[out, in/32]``.
- Engram tables: rows of E4M3 with one UE8M0 scale per 32 values of a row (``dequantize_fp8_groups``).

Runtime QDQ recipes (spec §5.4 / §7.2, TileKernels' torch reference semantics): quantize then dequantize
along the last dim in groups, used to simulate DeepInfer's FP8 activations and FP8/FP4 KV caches.

Everything here is plain torch on any device; cost is a few elementwise passes over the tensor.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
FP4_MAX = 6.0  # largest E2M1 magnitude
FP8_BLOCK = 32  # dense FP8 weights: 32x32 blocks (quantization_config.weight_block_size)
FP4_GROUP = 32  # routed experts: 1x32 blocks

# E2M1 code -> value. Code bits are `s e e m`: codes 0..7 are the positive magnitudes, 8..15 their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------------------
# UE8M0 scale bytes
# ----------------------------------------------------------------------------------------------------------

def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (``float8_e8m0fnu`` or raw ``uint8`` exponent bytes) -> fp32 ``2 ** (e - 127)``.

    Built from the exponent bits directly, so it is exact for every byte (e = 0 gives 2^-127, a float32
    subnormal; e = 255 gives NaN as in the format)."""
    e = _scale_bytes(scale).to(torch.int32)
    out = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23).view(torch.float32)  # e=0: 2^-127
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales in [2^-126, 2^127] -> ``float8_e8m0fnu`` (the exponent byte). Checks exactness."""
    s = scale.to(torch.float32).contiguous()
    bits = s.view(torch.int32)
    if bool(((bits & 0x807FFFFF) != 0).any()):
        raise ValueError("float_to_ue8m0: scales must be positive normal powers of two")
    return ((bits >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as fp32 multipliers: UE8M0 bytes are decoded, float scales (e.g. transformers'
    ``weight_scale_inv`` saved as fp32) are used as they are."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return ue8m0_to_float(scale)
    if scale.dtype.is_floating_point:
        return scale.to(torch.float32)
    raise TypeError(f"unsupported scale dtype {scale.dtype}")


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    raise TypeError(f"expected a UE8M0 scale (float8_e8m0fnu or uint8), got {scale.dtype}")


def _round_up_pow2(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x for positive normal fp32 x, by rounding the bit pattern up (no log2 error)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    return ((bits + 0x007FFFFF) & 0x7F800000).view(torch.float32)


# ----------------------------------------------------------------------------------------------------------
# E2M1 (FP4) codes
# ----------------------------------------------------------------------------------------------------------

def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (integer tensor, values 0..15) -> fp32 values by table lookup."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.int32)]  # int32 indices: half the temporary of int64


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> E2M1 codes (uint8, 0..15), round to nearest, ties to even mantissa, saturating at 6.

    The representable magnitudes are {0, .5, 1, 1.5, 2, 3, 4, 6}; a magnitude exactly halfway between two
    neighbours goes to the one with an even code (even mantissa bit), as in IEEE RNE: .25->0, .75->1,
    1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. NaN is not expected (inputs are finite scaled values)."""
    x = x.to(torch.float32)
    mag = x.abs()
    # Magnitude code = number of thresholds passed; '>' at a tie whose lower neighbour has an even code
    # (round down) and '>=' where the upper neighbour is even (round up).
    code = (
        (mag > 0.25).to(torch.uint8)
        + (mag >= 0.75)
        + (mag > 1.25)
        + (mag >= 1.75)
        + (mag > 2.5)
        + (mag >= 3.5)
        + (mag > 5.0)
    ).to(torch.uint8)
    sign = (torch.signbit(x) & (code > 0)).to(torch.uint8)  # -0 encodes as +0
    return code | (sign << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[..., n]`` (n even) -> ``int8 [..., n/2]``; element 2k in the low nibble, 2k+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``int8``/``uint8 [..., m]`` -> E2M1 codes ``uint8 [..., 2m]`` (low nibble first)."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


# ----------------------------------------------------------------------------------------------------------
# Checkpoint weights: dequantize (loader) and quantize (write_checkpoint)
# ----------------------------------------------------------------------------------------------------------

def _expand_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """Per-block fp32 scales -> per-element, cropped to [rows, cols] (blocks at the edges may be partial)."""
    s = scale_to_float(scale)
    return s.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32,
                          block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 E4M3 ``[out, in]`` with UE8M0 ``[ceil(out/b), ceil(in/b)]`` block scales -> ``dtype`` (exact)."""
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        raise TypeError(f"expected a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    rows, cols = weight.shape
    want = (_cdiv(rows, block), _cdiv(cols, block))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 weight {tuple(weight.shape)} needs a {block}x{block} block scale of shape "
                         f"{want}, got {tuple(scale.shape)}")
    w = weight.to(torch.float32)
    if rows % block == 0 and cols % block == 0:  # scale blocks in place: no per-element scale tensor
        w.view(rows // block, block, cols // block, block).mul_(scale_to_float(scale)[:, None, :, None])
    else:
        w.mul_(_expand_scale(scale, rows, cols, block, block))
    return w.to(dtype)


def quantize_fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float -> (``float8_e4m3fn`` weight, ``float8_e8m0fnu`` block scales).

    Scale per block = smallest power of two with amax/scale <= 448 (amax clamped >= 1e-4, like the runtime
    recipe), so ``dequantize_fp8_blocks`` returns the nearest E4M3 grid value of every element."""
    rows, cols = w.shape
    rb, cb = _cdiv(rows, block), _cdiv(cols, block)
    x = w.to(torch.float32)
    padded = torch.nn.functional.pad(x, (0, cb * block - cols, 0, rb * block - rows))
    amax = padded.abs().view(rb, block, cb, block).amax(dim=(1, 3)).clamp(min=1e-4)
    sf = _round_up_pow2(amax / FP8_MAX)
    full = sf.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    q = (x / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, float_to_ue8m0(sf)


def dequantize_fp4_blocks(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32,
                          group: int = FP4_GROUP) -> torch.Tensor:
    """Packed FP4 ``int8 [out, in/2]`` with UE8M0 ``[out, in/group]`` scales -> ``dtype [out, in]`` (exact)."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.ndim != 2:
        raise TypeError(f"expected a 2-D int8 packed FP4 weight, got {packed.dtype} {tuple(packed.shape)}")
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    want = (rows, _cdiv(cols, group))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP4 weight {tuple(packed.shape)} (in={cols}) needs a 1x{group} scale of shape "
                         f"{want}, got {tuple(scale.shape)}")
    w = e2m1_to_float(unpack_fp4(packed))
    if cols % group == 0:
        w.view(rows, cols // group, group).mul_(scale_to_float(scale)[:, :, None])
    else:
        w.mul_(_expand_scale(scale, rows, cols, 1, group))
    return w.to(dtype)


def quantize_fp4_blocks(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float (in % group == 0) -> (packed ``int8 [out, in/2]``, ``float8_e8m0fnu [out, in/group]``).

    Scale per 1x32 group = smallest power of two with amax/scale <= 6; values round to nearest E2M1 (ties even)."""
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"quantize_fp4_blocks: in dim {cols} must be a multiple of {group}")
    x = w.to(torch.float32).view(rows, cols // group, group)
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -126)
    sf = _round_up_pow2(amax / FP4_MAX)
    codes = float_to_e2m1(x / sf).view(rows, cols)
    return pack_fp4(codes), float_to_ue8m0(sf.squeeze(-1))


def dequantize_fp8_groups(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32,
                          group: int = 32) -> torch.Tensor:
    """FP8 rows ``[..., n]`` with UE8M0 ``[..., n/group]`` scales (1 x group along the last dim) -> ``dtype``.

    This is the Engram table layout (``[rows, 256]`` with ``[rows, 8]``); exact."""
    n = weight.shape[-1]
    if tuple(scale.shape) != (*weight.shape[:-1], _cdiv(n, group)):
        raise ValueError(f"FP8 rows {tuple(weight.shape)} need scales {(*weight.shape[:-1], _cdiv(n, group))}, "
                         f"got {tuple(scale.shape)}")
    s = scale_to_float(scale).repeat_interleave(group, dim=-1)[..., :n]
    return (weight.to(torch.float32) * s).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# Runtime quantize-dequantize (simulation of DeepInfer's activation / KV precision), along the last dim
# ----------------------------------------------------------------------------------------------------------

def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"QDQ: last dim {x.shape[-1]} is not a multiple of the group size {group}")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)


def qdq_fp8_ue8m0(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP8 E4M3 per ``group`` with a power-of-two (UE8M0) scale: SWA KV, activations before FP8 GEMMs.

    amax clamped >= 1e-4; sf = 2^ceil(log2(amax/448)); x_hat = e4m3(clamp(x/sf, +-448)) * sf. Returns x's dtype."""
    g = _groups(x, group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    sf = _round_up_pow2(amax / FP8_MAX)
    q = (g * (1.0 / sf)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * sf).reshape(x.shape).to(x.dtype)


def qdq_fp4_e4m3(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """FP4 E2M1 per ``group`` with an E4M3 (not power-of-two) scale: the compressed-KV cache.

    amax clamped >= 6 * 2^-9; sf = e4m3(amax / 6) (round to nearest E4M3); x_hat = e2m1(x * (1/sf)) * sf."""
    g = _groups(x, group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -9)
    sf = (amax / FP4_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    q = e2m1_to_float(float_to_e2m1(g * (1.0 / sf)))
    return (q * sf).reshape(x.shape).to(x.dtype)


def qdq_fp4_ue8m0(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP4 E2M1 per ``group`` with a power-of-two scale: the indexer's q and k.

    amax clamped >= 6 * 2^-126; sf = 2^ceil(log2(amax/6)); x_hat = e2m1(x / sf) * sf."""
    g = _groups(x, group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -126)
    sf = _round_up_pow2(amax / FP4_MAX)
    q = e2m1_to_float(float_to_e2m1(g * (1.0 / sf)))
    return (q * sf).reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Routed experts kept quantized: the checkpoint's formats -> kernels.moe's fp8 layout (lossless)
# ----------------------------------------------------------------------------------------------------------

def fp4_to_fp8(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP4 ``int8 [out, in/2]`` + UE8M0 ``[out, in/32]`` -> (``float8_e4m3fn [out, in]``, exponent bytes
    ``uint8 [out, in/32]``). Lossless: every E2M1 value (0, +-0.5 ... +-6) is an E4M3 value, and the scales stay
    the same powers of two."""
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if tuple(scale.shape) != (rows, _cdiv(cols, FP4_GROUP)):
        raise ValueError(f"FP4 weight {tuple(packed.shape)} needs a 1x{FP4_GROUP} scale of shape "
                         f"{(rows, _cdiv(cols, FP4_GROUP))}, got {tuple(scale.shape)}")
    return e2m1_to_float(unpack_fp4(packed)).to(torch.float8_e4m3fn), _scale_bytes(scale)


def split_block_scales(exponents: torch.Tensor, rows_per_block: int, out_rows: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """UE8M0 exponent bytes ``[ceil(out/R), ceil(in/32)]`` (one per R x 32 block) -> (fp32 row scales ``[out]``,
    shifts ``uint8 [ceil(in/32), ceil(out/R)]``, group-major as kernels.moe reads them) with block scale = row
    scale * 2**-shift exactly: the row scale is its block row's largest scale, so every shift is >= 0. Shifts are capped at 126 (the kernel builds
    2**-shift as an fp32 normal): a block more than 2**126 below its row's largest differs from its row by more
    than fp32 can hold anyway (only all-zero blocks, whose scale does not matter, get there in practice)."""
    e = exponents.to(torch.int32)
    top = e.amax(dim=1)
    row_scale = ue8m0_to_float(top.to(torch.uint8)).repeat_interleave(rows_per_block)[:out_rows]
    return row_scale.contiguous(), (top[:, None] - e).clamp(max=126).to(torch.uint8).t().contiguous()


def expert_to_fp8(raw: torch.Tensor, scale: torch.Tensor, kind: str, rows_per_block: int, block: int = FP8_BLOCK
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stored routed-expert weight ("fp4": packed E2M1 with 1x32 scales, or "fp8": E4M3 with block x block
    scales, UE8M0 bytes both) -> (e4m3 [out, in], fp32 row scales [out], uint8 shifts [out/R, in/32]) for
    kernels.moe with shift_rows R = rows_per_block (1, or 32 for FP8 blocks of 32); shifts group-major
    [in/32, out/R]. Exact (see the two above)."""
    if kind == "fp4":
        w8, exps = fp4_to_fp8(raw, scale)
        if rows_per_block != 1:
            raise ValueError("FP4 experts have one scale per row: rows_per_block must be 1")
    elif kind == "fp8":
        if block != FP4_GROUP:
            raise ValueError(f"keeping FP8 experts quantized needs {FP4_GROUP}x{FP4_GROUP} blocks, got {block}")
        w8, exps = raw, _scale_bytes(scale)
        if rows_per_block == 1:                                   # per-row form (a layer that mixes FP4 and FP8)
            exps = exps.repeat_interleave(block, 0)[: raw.shape[0]]
        elif rows_per_block != block:
            raise ValueError(f"FP8 {block}x{block} blocks cannot use rows_per_block {rows_per_block}")
    else:
        raise ValueError(f"unknown quantized expert kind {kind!r}")
    row_scale, shift = split_block_scales(exps, rows_per_block, raw.shape[0])
    return w8, row_scale, shift


def fold_shifts(w8: torch.Tensor, shift: torch.Tensor, rows_per_block: int) -> torch.Tensor | None:
    """e4m3 weights [out, in] times 2**-shift of their (R rows x 32 columns) block (shift [in/32, out/R]),
    rounded to e4m3, if that is
    EXACT for every element (then the row scale alone describes the weight: kernels.moe's fastest fp8 path);
    None otherwise. E2M1 values (FP4 experts) stay exact for shifts up to 8 (their lowest bit is 2**-1 and e4m3
    keeps bits down to 2**-9), so a typical FP4 checkpoint, whose 1x32 group scales within a row differ by a few
    powers of two, folds completely; FP8 blocks rarely do."""
    N, K = w8.shape
    if int(shift.max()) == 0:
        return w8
    mult = torch.exp2(-shift.t().float()).repeat_interleave(rows_per_block, 0)[:N].repeat_interleave(32, 1)[:, :K]
    want = w8.float() * mult
    folded = want.to(torch.float8_e4m3fn)
    return folded if torch.equal(folded.float(), want) else None


def expert_fp4_packed(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stored FP4 routed-expert weight kept as it is (``uint8 [out, in/2]``, half a byte per weight) with fp32
    row scales ``[out]`` and shifts ``uint8 [in/32, out]``: kernels.moe's packed-FP4 path (decoded in registers)."""
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if tuple(scale.shape) != (rows, _cdiv(cols, FP4_GROUP)):
        raise ValueError(f"FP4 weight {tuple(packed.shape)} needs a 1x{FP4_GROUP} scale of shape "
                         f"{(rows, _cdiv(cols, FP4_GROUP))}, got {tuple(scale.shape)}")
    row_scale, shift = split_block_scales(_scale_bytes(scale), 1, rows)
    return packed.view(torch.uint8), row_scale, shift
