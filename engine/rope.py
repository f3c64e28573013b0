"""Rotary position embedding, DeepSeek-V4 flavour: interleaved pairs (2i, 2i+1) on the LAST `rope_dim` channels.

Two kinds per model: "main" (base `rope_theta`, plain) for sliding-window-only layers and "compress"
(base `compress_rope_theta`, YaRN if configured, mscale 1) for layers with compressed KV. The inverse rotation
(conjugate, angle -pos) is applied to attention outputs to make the rope part position-free again.
"""
from __future__ import annotations

import torch

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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] channels of x [T, ..., D] in interleaved pairs; cos/sin are [T, R/2].

    Math in fp32, result in x's dtype. `inverse=True` rotates by -angle (conjugate)."""
    r = cos.shape[-1] * 2
    extra = x.dim() - cos.dim()
    c = cos.repeat_interleave(2, dim=-1)
    s = sin.repeat_interleave(2, dim=-1)
    if inverse:
        s = -s
    for _ in range(extra):
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    nope, rot = x[..., :-r], x[..., -r:]
    rf = rot.float()
    half = torch.stack((-rf[..., 1::2], rf[..., 0::2]), dim=-1).flatten(-2)
    out = (rf * c.to(x.device) + half * s.to(x.device)).to(x.dtype)
    return torch.cat([nope, out], dim=-1)
