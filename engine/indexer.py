"""Lightning indexer: scores compressed entries per query and keeps the top-k.

  I[t, g] = sum_h w[t, h] * Hi^-0.5 * relu(iq[t, h] . ik[g]) * Di^-0.5
iq = RoPE(wq_b(qr)) per head (qr = the attention's normalized low-rank query), w = weights_proj(x).
Index keys ik come from
  * V4: the indexer's own overlapping compressor at width Di (`indexer.compressor.*`), or
  * V4.1: `k_norm(wk(latent_g))` of the kv source's pre-RoPE latents, rotated at g*r (`indexer.wk`, `indexer.k_norm`),
    owned by index-K source layers only.
The positive scale constants do not change the ranking; they are kept to match transformers' scores.
Top-k ties resolve to the lower entry id (stable sort). Cost per query: Hi * Di * G multiply-adds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .compressor import Compressor
from .norm import RMSNorm
from .transfer import made_once


class Indexer(nn.Module):
    def __init__(self, *, hidden: int, q_lora_rank: int, head_dim: int, n_heads: int, idx_dim: int, ratio: int,
                 eps: float, own_compressor: bool, owns_keys: bool):
        super().__init__()
        self.n_heads, self.idx_dim = n_heads, idx_dim
        self.wq_b = nn.Linear(q_lora_rank, n_heads * idx_dim, bias=False)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)
        if own_compressor:   # V4 CSA
            self.compressor = Compressor(hidden, idx_dim, ratio, overlap=True, gated=True, ape=True, eps=eps)
        if owns_keys:        # V4.1 index-K source
            self.wk = nn.Linear(head_dim, idx_dim, bias=False)
            self.k_norm = RMSNorm(idx_dim, eps)

    def queries(self, qr: torch.Tensor, x: torch.Tensor, wx: torch.Tensor | None = None, also: float = 1.0):
        """-> (iq [T, Hi, Di] before RoPE, head weights [T, Hi] fp32 incl. Hi^-0.5). wx: weights_proj(x) when
        already computed (engine/projections.py). also: a further factor of the head weights (the score kernel's
        Di^-0.5), folded into their conversion: one launch, the product of fp32(wx) and fp32(Hi^-0.5 also) (a
        one-element fp32 tensor: torch computes in fp32), where two factors one after the other cost three. One
        rounding instead of two: the same bits when Hi^-0.5 is exact (Hi a power of 4), else at most the last bit."""
        iq = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.idx_dim)
        wx = self.weights_proj(x) if wx is None else wx
        if also == 1.0:
            return iq, wx.float() * self.n_heads ** -0.5
        f = self.n_heads ** -0.5 * also
        return iq, wx * made_once(("factor", f), wx.device,
                                  lambda: torch.full((1,), f, dtype=torch.float32, device=wx.device))

    def scores(self, iq: torch.Tensor, w: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
        """iq [n, Hi, Di], w [n, Hi], ik [G, Di] -> I [n, G] fp32."""
        s = F.relu(torch.matmul(iq.float(), ik.float().transpose(0, 1))) * self.idx_dim ** -0.5  # [n, Hi, G]
        return (s * w.unsqueeze(-1)).sum(dim=1)


def topk_mask(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [n, G]: the k best allowed entries per row (fewer if fewer are allowed); ties -> lower id."""
    n, G = scores.shape
    if G == 0 or k <= 0:
        return torch.zeros_like(allowed)
    s = scores.masked_fill(~allowed, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    sel = torch.zeros_like(allowed)
    sel.scatter_(1, order, True)
    return sel & allowed


def candidate_block_mask(scores: torch.Tensor, visible: torch.Tensor, block: int, top_blocks: int) -> torch.Tensor:
    """Candidate blocks (V4.1): entries split in blocks of `block` from entry 0; block score = max I over its
    visible entries; the block holding each query's last visible entry is always kept; keep `top_blocks` best.
    Returns boolean [n, G]: entries inside kept blocks (and visible)."""
    n, G = scores.shape
    nb = (G + block - 1) // block
    pad = nb * block - G
    s = scores.masked_fill(~visible, float("-inf"))
    s = F.pad(s, (0, pad), value=float("-inf")).view(n, nb, block).amax(-1)        # [n, nb]
    n_vis = visible.sum(-1)                                                           # [n]
    last_block = (n_vis - 1).clamp(min=0) // block
    has_any = n_vis > 0
    forced = torch.zeros_like(s, dtype=torch.bool)
    forced[torch.arange(n, device=scores.device), last_block] = has_any
    s = torch.where(forced, torch.full_like(s, float("inf")), s)
    vis_block = F.pad(visible, (0, pad), value=False).view(n, nb, block).any(-1)
    keep = topk_mask(s, vis_block, top_blocks)                                        # [n, nb]
    return keep.repeat_interleave(block, dim=1)[:, :G] & visible
