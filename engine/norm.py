"""RMSNorm as DeepSeek-V4 uses it: statistics and the weight product in fp32, one cast back at the end."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_sg.kernels.rmsnorm import rms_norm


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm in the input dtype (V4's per-head q norm and the mHC input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """`weight * x * rsqrt(mean(x^2) + eps)`, computed in fp32, returned in x's dtype. Cost: O(numel)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._w32 = (None, None)     # (the weight's (address, version), its fp32 copy)

    def weight_fp32(self) -> torch.Tensor:
        """The weight in fp32, converted once per weight version (a bf16 model's norms would otherwise convert
        it on every call: one kernel per norm, ~90 per decode step of the mid-size model)."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version)
        if self._w32[0] != key:
            with torch.inference_mode(False):    # (a normal tensor, usable in and out of inference mode)
                self._w32 = (key, w.detach().float())
        return self._w32[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one launch on CUDA (deepinfer_sg.kernels.rmsnorm: x read in its dtype, fp32 math, one cast back) instead
        # of cast + PyTorch's fused rms_norm + cast; every layer runs 4-6 of these inside the decode step's graph.
        # Elsewhere the twin: F.rms_norm on the fp32 input
        return rms_norm(x, self.weight_fp32(), self.eps)
