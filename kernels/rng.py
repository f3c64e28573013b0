"""Counter-based random numbers shared bit-for-bit by the Triton kernels and their torch twins.

Every random draw is a pure function of (request seed, token position, stream, vocab id), so a request's
samples never depend on which other requests share its batch, on the batch order, or on the device.
Streams keep the draws of one position independent: FRESH (plain sampling and the bonus token),
RESIDUAL (resampling after a rejected draft), VERIFY (the acceptance uniform).

A row key (32 bits) mixes seed, position and stream once per row (`row_keys`; one small Triton launch on CUDA);
the kernels then hash (key, vocab id) once per element with `lowbias32` (a bijective 32-bit mixer), ~8 integer
ops. Uniforms take the top 23 bits: u = (h + 0.5) / 2**23 is exact in fp32 and never 0 or 1 (so the Gumbel noise
is always finite). Exponentials use E = -log(u), with a short series in v = 1 - u (exact from the integers) when
u is within 1/64 of 1: there -log(u) is tiny and a fast log2 would lose it, and Gumbel-max winners come from there.
Arithmetic is done in int64 holding values < 2**32 so that torch needs no unsigned type; multiplications are
split in 16-bit halves so nothing overflows int64 (signed overflow would be undefined behaviour).
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FRESH, RESIDUAL, VERIFY = 0, 1, 2
MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_M1, _M2 = 0x7FEB352D, 0x846CA68B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """Per-row 32-bit key (int64 tensor) from int64 seed and position tensors of the same shape."""
    if seed.is_cuda and seed.dim() == 1:
        return row_keys_triton(seed, position, stream)
    return row_keys_torch(seed, position, stream)


def row_keys_torch(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    seed = seed.to(torch.int64)
    position = position.to(torch.int64)
    k = mix32((seed & MASK32) ^ 0x5BD1E995)
    k = mix32(k ^ ((seed >> 32) & MASK32))
    k = mix32(k ^ (position & MASK32))
    k = mix32(k ^ ((position >> 32) & MASK32))
    return mix32(k ^ (stream * 0x68E31DA4 + 0x1B873593))


LN2 = 0.6931471805599453
_SERIES_BELOW = 1.0 / 64


def _hash(keys, ids):
    return mix32(keys ^ _mul32(ids.to(torch.int64), _GOLDEN))


def unit_from_hash(h: torch.Tensor) -> torch.Tensor:
    """(top 23 bits + 0.5) / 2**23: exact in fp32, in [2**-24, 1 - 2**-24]."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniform(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in (0, 1) for each (key, id) pair (broadcasting); exactly what `uniform_tl` returns."""
    return unit_from_hash(_hash(keys, ids))


def exponential(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise E = -log(u), computed as the kernels compute it (series near u = 1)."""
    h = _hash(keys, ids)
    u = unit_from_hash(h)
    v = ((8388607 - (h >> 9)).to(torch.float32) + 0.5) * (1.0 / 8388608.0)        # 1 - u, exactly
    series = v * (1 + v * (0.5 + v * (1.0 / 3 + v * 0.25)))
    return torch.where(v < _SERIES_BELOW, series, -torch.log2(u) * LN2)


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise -log(E): argmax(logits + gumbel) is an exact sample of softmax(logits)."""
    return -torch.log2(exponential(keys, ids)) * LN2


@triton.jit
def _hash_tl(key, ids):
    x = key ^ (ids.to(tl.uint32) * 0x9E3779B1)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _unit_tl(h):
    """(h >> 9 + 0.5) / 2**23 built from bits (1 + k/2**23 has exactly those mantissa bits), bit-for-bit what
    `unit_from_hash` computes, without the integer-to-float conversion (a quarter-rate instruction on a GPU)."""
    one_plus = ((h >> 9) | 0x3F800000).to(tl.float32, bitcast=True)
    return (one_plus - 1.0) + (0.5 / 8388608.0)                    # both steps exact in fp32


@triton.jit
def uniform_tl(key, ids):
    """Triton twin of `uniform`: key is a uint32 scalar, ids an int tensor; returns float32 in (0, 1)."""
    return _unit_tl(_hash_tl(key, ids))


@triton.jit
def _log2(x, FAST: tl.constexpr):
    # FAST: the hardware approximation (lg2.approx; abs. error ~2**-22 near 1, rel. ~2**-22 elsewhere), used on
    # GPUs where the accurate libdevice log costs ~12 FMAs per call and made sampling instruction-bound.
    # The interpreter has no libdevice, and CI compares with the twin there, so it takes the accurate path.
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def gumbel_tl(key, ids, FAST: tl.constexpr):
    """Triton twin of `gumbel` (to an ulp of the logs when FAST is False, ~1e-5 absolute when it is True)."""
    u = _unit_tl(_hash_tl(key, ids))
    v = 1.0 - u                                                    # exact: u has 24 significant bits at most
    series = v * (1 + v * (0.5 + v * (1.0 / 3 + v * 0.25)))
    e = tl.where(v < 0.015625, series, -_log2(u, FAST) * 0.6931471805599453)
    return -_log2(e, FAST) * 0.6931471805599453


@triton.jit
def row_key_tl(seed, pos, c_stream):
    """Triton twin of `row_keys_torch` for int64 seed/position scalars or tensors; c_stream is the stream constant
    (stream * 0x68E31DA4 + 0x1B873593) mod 2**32. Returns uint32."""
    k = _mix32_tl((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x5BD1E995)
    k = _mix32_tl(k ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    k = _mix32_tl(k ^ (pos & 0xFFFFFFFF).to(tl.uint32))
    k = _mix32_tl(k ^ ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32))
    return _mix32_tl(k ^ c_stream.to(tl.uint32))


def stream_constant(stream: int) -> int:
    """The per-stream constant row_key_tl takes."""
    return (stream * 0x68E31DA4 + 0x1B873593) & MASK32


@triton.jit
def _row_keys_kernel(seed_ptr, pos_ptr, out_ptr, n, c_stream, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    seed = tl.load(seed_ptr + i, mask=ok, other=0)
    pos = tl.load(pos_ptr + i, mask=ok, other=0)
    tl.store(out_ptr + i, row_key_tl(seed, pos, c_stream).to(tl.int64), mask=ok)


@triton.jit
def _mix32_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def row_keys_triton(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """One launch instead of ~60 small torch ops (what made the speculative step launch-bound on a GPU)."""
    seed = seed.to(torch.int64).contiguous()
    position = position.to(torch.int64).expand_as(seed).contiguous()
    out = torch.empty_like(seed)
    n = seed.numel()
    if n:
        c = stream_constant(stream)
        _row_keys_kernel[(triton.cdiv(n, 256),)](seed, position, out, n, c, BLOCK=256)
    return out
