"""Rotary position embedding, DeepSeek-V4 flavour: interleaved pairs (2i, 2i+1) on the LAST `rope_dim` channels.

Two kinds per model: "main" (base `rope_theta`, plain) for sliding-window-only layers and "compress"
(base `compress_rope_theta`, YaRN if configured, mscale 1) for layers with compressed KV. The inverse rotation
(conjugate, angle -pos) is applied to attention outputs to make the rope part position-free again.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer_sg.kernels.rope import apply_rope as _kernel_rope

from .config import ModelConfig, yarn_low_high


def inv_freq(config: ModelConfig, kind: str) -> torch.Tensor:
    """fp32 [rope_dim/2] inverse frequencies for rope kind "main" or "compress"."""
    dim = config.rope_dim
    base = config.rope_theta if kind == "main" else config.compress_rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrap = 1.0 / pos_freqs
    if kind == "main" or config.yarn is None:
        return extrap
    y = config.yarn
    interp = 1.0 / (y.factor * pos_freqs)
    low, high = yarn_low_high(dim, base, y)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap_factor = 1 - ramp
    return interp * (1 - extrap_factor) + extrap * extrap_factor


def rope_cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., rope_dim/2] (fp32) for integer positions [...]."""
    ang = positions.to(torch.float32)[..., None] * freqs.to(positions.device)
    return ang.cos(), ang.sin()


class Turns(NamedTuple):
    """cos + i sin at a step's positions [T, R/2] (complex) and its conjugate (the inverse rotation): made once per
    step and passed as `cos` (with sin=None) to every apply_rope of the step, instead of building them per call
    (two fewer kernels per call: the decode step rotates q, kv and the output of every layer)."""
    fwd: torch.Tensor
    inv: torch.Tensor


def step_turns(freqs: torch.Tensor, ratios: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Every rotation of a step at once -> [2, C, T, R/2] complex: [0, c] is cos + i sin of the angle
    (p // ratios[c] * ratios[c]) * freqs[c] at each position p of positions [T] (int64), [1, c] its conjugate, each
    a contiguous [T, R/2] (`Turns(t[0, c], t[1, c])`). freqs [C, R/2] fp32 and ratios [C, 1] int64 on the positions'
    device. Eight launches for all C, made by a step's first graph segment and handed on to the others (before,
    rope_cos_sin and a complex pair per kind and ratio, seven launches each, in every segment: ~34 a step at the
    mid-size model; the same operations, so the same bits; session 12's numbers: benchmarks/model_forward.py)."""
    ang = (torch.div(positions, ratios, rounding_mode="floor") * ratios)[..., None] * freqs[:, None, :]
    cos, sin = ang.cos(), ang.sin()
    return torch.complex(cos, torch.stack([sin, -sin]))


def apply_rope(x: torch.Tensor, cos, sin: torch.Tensor | None = None, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] channels of x [T, ..., D] in interleaved pairs; cos/sin are [T, R/2] (or cos
    is a `Turns` and sin None).

    Math in fp32 (each pair as one complex number times cos + i sin), result in x's dtype. `inverse=True` rotates
    by -angle (conjugate). One launch on CUDA (deepinfer_sg.kernels.rope, instead of the torch form's ~5: the
    decode step runs this on q, kv, the attention output, the index queries and the compressors' entries of every
    layer, inside its CUDA graph); the torch twin elsewhere."""
    return _kernel_rope(x, turn_table(cos, sin, inverse).to(x.device))


def turn_table(cos, sin: torch.Tensor | None = None, inverse: bool = False) -> torch.Tensor:
    """The rotation as the kernels read it: fp32 [T, R/2, 2] (cos, sin per pair; the conjugate when inverse), from
    cos/sin [T, R/2] or a `Turns` (then a view, no launch)."""
    if isinstance(cos, Turns):
        turn = cos.inv if inverse else cos.fwd
    else:
        turn = torch.complex(cos.float(), -sin.float() if inverse else sin.float())
    return torch.view_as_real(turn)
