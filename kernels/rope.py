"""Rotary position embedding on the last channels of every row, in one launch (DeepSeek-V4 layout).

Layout: x [T, ..., D]; its last R channels are R/2 interleaved pairs (2i, 2i+1), each rotated by row t's turn
(cos_ti, sin_ti) as the complex product (a + ib)(cos + i sin); the first D - R channels pass through. The turns
come as fp32 [T, R/2, 2] (cos, sin) (`torch.view_as_real` of a complex turn tensor: the conjugate for the
inverse rotation). Math in fp32, the result in x's dtype (a new tensor).

Why a kernel: the torch form (the twin) is a cast to fp32, a contiguous copy, the complex product, a cast back and a
concatenation: ~5 launches per call, and the decode step rotates q, kv, the attention output, the index queries
and the compressors' entries of every layer (~100 calls per step of the mid-size model, each a few microseconds of
device time for a few KB). One launch reads x once and writes the result once.
Cost: T * D elements read and written; grid T x ceil(heads / BLOCK_H). Measured in the mid-size V4.1 decode step
(H200, batch 8, R1 of session 6): 73 calls of 1.6 us each, where the torch form took ~0.6 ms of device time.
Measured and dropped (session 9 R1, fp8 experts): an in-place form that reads and writes only the rotated channels
(q, the attention output and the index queries: 1/8 of q's bytes), one program per row: the step's graphs back to
back 4.17 / 5.12 ms at batch 8 / 64 against 4.13 / 5.15 out of place; the rope launches' eager device time 114 us
at batch 8 (fewer programs) against 86 (session 8).
Programmatic dependent launch (session 12, `_rope_kernel`'s docstring): H200, q of 64 tokens x 32 heads x 512 (64
rotated), 16 calls back to back in a CUDA graph, us, off -> on: R3 (benchmarks/kernels_moe.py's pdl sweep) 2.75 /
2.89 -> 2.70 / 2.65; R1 / R2 (.round script, 32 calls) 2.61 / 2.60 -> 2.18 / 2.15.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import check, empty, one_wave, pdl_kw, pdl_trigger, pdl_wait, use_triton


def apply_rope_torch(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """The twin (and the CPU path): x [T, ..., D], turn fp32 [T, R/2, 2] -> x with its last R channels rotated."""
    r = turn.shape[-2] * 2
    t = torch.view_as_complex(turn.float().contiguous())
    for _ in range(x.dim() - 2):
        t = t.unsqueeze(-2)
    pairs = torch.view_as_complex(x[..., -r:].float().unflatten(-1, (r // 2, 2)).contiguous())
    out = torch.view_as_real(pairs * t.to(x.device)).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-r], out], dim=-1)


@triton.jit
def turned(x, at, d, ok, turn_row, D: tl.constexpr, R: tl.constexpr):
    """x (channels d of rows of width D, loaded at `at + d`; ok: the loads' mask) with its last R channels
    (interleaved pairs) turned by the row's (cos, sin) pairs at turn_row (fp32) -> fp32 (the caller rounds): the
    pair's partner loaded again at d ^ 1 (an L1 hit). The rotation of loaded rows: this module's kernel, the
    indexer's score kernel and sparse attention's q call it. Two other copies of the product work on values in
    registers instead: kernels/rmsnorm.py's ROPE branch (the norm's output, its partner normed again) and
    kernels/decode_attention.py's `_unturn` (the output turned back by the conjugate)."""
    rot = (d >= D - R) & (d < D)                                             # (d < D: no turn read past the row)
    j = tl.where(rot, (d - (D - R)) // 2, 0)                                 # the pair of channel d
    partner = tl.load(at + (d ^ 1), mask=ok & rot, other=0.0).to(tl.float32)
    c = tl.load(turn_row + j * 2, mask=rot, other=1.0)
    s = tl.load(turn_row + j * 2 + 1, mask=rot, other=0.0)
    x = x.to(tl.float32)
    # (a + ib)(c + is): real a*c - b*s on the even channel, imaginary a*s + b*c on the odd one
    y = tl.where((d % 2) == 1, partner * s + x * c, x * c - partner * s)
    return tl.where(rot, y, x)


@triton.jit
def _rope_kernel(x_ptr, turn_ptr, out_ptr, H, D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr = False):
    """PDL: x and the turns are the step's, so the wait comes first; EARLY (one wave of programs): the next
    kernel may launch at once (its programs wait for ours)."""
    pdl_wait(PDL)
    if EARLY:
        pdl_trigger(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]          # [BH, 1]
    d = tl.arange(0, BLOCK_D)[None, :]                                       # [1, BD]
    ok = (h < H) & (d < D)
    base = (t * H + h) * D
    x = tl.load(x_ptr + base + d, mask=ok, other=0.0)
    y = turned(x, x_ptr + base, d, ok, turn_ptr + t * R, D, R)
    tl.store(out_ptr + base + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def apply_rope_triton(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """The kernel: same contract as `apply_rope_torch` (x contiguous or not; turn [T, R/2, 2] fp32)."""
    T, D = x.shape[0], x.shape[-1]
    check(turn.dim() == 3 and turn.shape[0] == T and turn.shape[2] == 2,
          f"rope: turn of shape {tuple(turn.shape)} for x of shape {tuple(x.shape)} (want [{T}, R/2, 2])")
    R = turn.shape[1] * 2
    check(R <= D and (D - R) % 2 == 0, f"rope: {R} rotated channels of {D} (x {tuple(x.shape)})")
    check(turn.dtype == torch.float32, f"rope: turn dtype {turn.dtype} (want float32)")
    xc = x.contiguous()
    H = xc.numel() // max(T * D, 1)
    out = empty(x.shape, x.dtype, x.device)
    if xc.numel() == 0:
        return out
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = max(1, min(triton.next_power_of_2(H), 4096 // BLOCK_D))
    grid = (T, triton.cdiv(H, BLOCK_H))
    _rope_kernel[grid](xc, turn.contiguous(), out, H, D=D, R=R, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
                       EARLY=one_wave(grid[0] * grid[1], x.device), **pdl_kw())
    return out


def apply_rope(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Dispatch: the kernel on CUDA, the twin elsewhere (module docstring for the contract)."""
    if use_triton(x) and turn.dim() == 3 and turn.shape[0] == x.shape[0] and x.dim() >= 2:
        return apply_rope_triton(x, turn)
    return apply_rope_torch(x, turn)
