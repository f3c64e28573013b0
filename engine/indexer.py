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

import deepinfer_sg.kernels.index_rows as _index_rows
import deepinfer_sg.kernels.indexer as _kindexer

from .compressor import Compressor
from .norm import RMSNorm
from .rope import apply_rope, turn_table
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

    def raw_queries(self, qr: torch.Tensor, x: torch.Tensor, wx: torch.Tensor | None = None):
        """-> (iq [T, Hi, Di] before RoPE, weights_proj(x) as it is); wx: that product when already computed."""
        return self.wq_b(qr).view(qr.shape[0], self.n_heads, self.idx_dim), self.weights_proj(x) if wx is None else wx

    def queries(self, qr: torch.Tensor, x: torch.Tensor, wx: torch.Tensor | None = None, also: float = 1.0):
        """-> (iq [T, Hi, Di] before RoPE, head weights [T, Hi] fp32 incl. Hi^-0.5). wx: weights_proj(x) when
        already computed (engine/projections.py). also: a further factor of the head weights (the score kernel's
        Di^-0.5), folded into their conversion: one launch, the product of fp32(wx) and fp32(Hi^-0.5 also) (a
        one-element fp32 tensor: torch computes in fp32), where two factors one after the other cost three. One
        rounding instead of two: the same bits when Hi^-0.5 is exact (Hi a power of 4), else at most the last bit."""
        iq, wx = self.raw_queries(qr, x, wx)
        if also == 1.0:
            return iq, wx.float() * self.n_heads ** -0.5
        f = self.n_heads ** -0.5 * also
        return iq, wx * made_once(("factor", f), wx.device,
                                  lambda: torch.full((1,), f, dtype=torch.float32, device=wx.device))

    @property
    def score_scale(self) -> float:
        """The head weights' factor in the scores (the score kernel's w_scale): `index_score_scale`."""
        return index_score_scale(self.n_heads, self.idx_dim)

    def scores(self, iq: torch.Tensor, w: torch.Tensor, ik: torch.Tensor) -> torch.Tensor:
        """iq [n, Hi, Di], w [n, Hi], ik [G, Di] -> I [n, G] fp32."""
        s = F.relu(torch.matmul(iq.float(), ik.float().transpose(0, 1))) * self.idx_dim ** -0.5  # [n, Hi, G]
        return (s * w.unsqueeze(-1)).sum(dim=1)


def index_score_scale(n_heads: int, idx_dim: int) -> float:
    """Hi^-0.5 Di^-0.5: the head weights' factor in the scores."""
    return n_heads ** -0.5 * idx_dim ** -0.5


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


def candidate_block_mask(scores: torch.Tensor, visible: torch.Tensor | None, block: int, top_blocks: int,
                         masked: bool = False) -> torch.Tensor:
    """Candidate blocks (V4.1): entries split in blocks of `block` from entry 0; block score = max I over its
    visible entries; the block holding each query's last visible entry is always kept; keep `top_blocks` best.
    Returns boolean [n, G]: entries inside kept blocks (and visible). With at most `top_blocks` blocks every block
    holding a visible entry is kept: the mask is `visible` itself (no launch; the torch chain below is ~30).
    masked: the scores are already -inf outside `visible` (the score kernel's, or visible_scores'), so not masked
    again; visible may then be None (the finite scores). On CUDA masked scores take kernels/index_rows.py's three
    launches (`candidate_blocks_triton`: the same set, the visible entries a prefix of each row as the step's are;
    this chain is its twin)."""
    n, G = scores.shape
    nb = (G + block - 1) // block
    if nb <= top_blocks:
        return scores > float("-inf") if visible is None else visible
    if masked and top_blocks > 1 and _index_rows.use_triton(scores):
        return _index_rows.candidate_blocks_triton(scores, block, top_blocks)
    visible = scores > float("-inf") if visible is None else visible
    pad = nb * block - G
    s = scores if masked else scores.masked_fill(~visible, float("-inf"))
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


# ------------------------------------------------------------------ the batched decode step's index path (batched.py)
def fused_scores(model, x: torch.Tensor) -> bool:
    """Whether the batched step runs the score kernel's engine form (`step_queries`, `select_ids`): on CUDA, unless
    the model fake-quantizes the index queries (quant_sim: after their rotation, so the kernel cannot rotate them)."""
    return _kindexer.use_triton(x) and not model.quant_sim


def step_queries(model, idx: Indexer, qr: torch.Tensor, x: torch.Tensor, cos, sin, wx: torch.Tensor | None = None):
    """pre_attention's index queries and head weights, as `select_ids` takes them. With `fused_scores`: the
    queries before RoPE and weights_proj(x) as it is (wx: that product when already made, a column slice of the
    stacked projection): the score kernel rotates the queries and scales the weights, so only wq_b launches here
    (the rotation and the scaling were a launch each). Else the queries rotated (and fake-quantized) and the
    weights fp32 times Hi^-0.5 (on CUDA Di^-0.5 too: the plain score kernel's weights)."""
    if fused_scores(model, qr):
        return idx.raw_queries(qr, x, wx)
    iq, w = idx.queries(qr, x, wx=wx, also=idx.idx_dim ** -0.5 if _kindexer.use_triton(qr) else 1.0)
    return model._qdq(apply_rope(iq, cos, sin), "index"), w


def _index_scores(idx_mod, iq: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                  count: torch.Tensor, G: int) -> torch.Tensor:
    """I [T, G] fp32 = sum_h w * Di^-0.5 * relu(iq_h . ik_g) over each row's entries start..start+G (padded
    columns hold -inf or whatever the clamped gather gives: callers mask them). w as `step_queries` made it (when
    the Triton kernel runs, already fp32 times Di^-0.5).

    On CUDA the score kernel of deepinfer_sg.kernels.indexer reads the keys in place (no [T, G, Di] gather)."""
    if _kindexer.use_triton(iq):
        return _kindexer.indexer_scores_triton(iq, w, keys, start, count, G)
    g = torch.arange(G, device=iq.device)
    rows = (start[:, None] + g[None, :]).clamp(max=keys.shape[0] - 1)
    k = keys[rows].float()                                                          # [T, G, Di]
    s = torch.relu(torch.matmul(iq.float(), k.transpose(1, 2))) * idx_mod.idx_dim ** -0.5   # [T, Hi, G]
    return (s * w.unsqueeze(-1)).sum(dim=1)


def select_ids(idx_mod, iq, w, keys, start, count, positions, ratio: int, G: int, k: int, cand=None, rot=None,
               blocks: tuple | None = None):
    """Every row's index selection, as a pure function (eager, or inside a graph segment): the k best entries
    (ties -> lower id) among each row's visible ones, start..start + count of `keys` that its position can see
    (g < (p + 1) // ratio), and `cand` [T, G] where given. rot: the rows' (cos, sin) when iq and w come from
    `step_queries` under `fused_scores` (before RoPE, unscaled): then one launch of the score kernel makes the
    scores of the visible candidates (-inf elsewhere), and the select a second. blocks: (block size, blocks kept)
    at the candidate source layer. -> (ids [T, min(k, G)] ascending, -1 padded; the candidate mask [T, G] that
    `blocks` asks for, else None)."""
    if rot is not None:
        masked = _kindexer.indexer_scores_triton(iq, w, keys, start, count, G, w_scale=idx_mod.score_scale,
                                                 turn=turn_table(*rot), positions=positions, ratio=ratio, cand=cand)
        # (visible entries have finite scores: the candidate source has no candidates of its own)
        return _select(masked, k), None if blocks is None else candidate_block_mask(masked, None, *blocks,
                                                                                      masked=True)
    scores = _index_scores(idx_mod, iq, w, keys, start, count, G)
    # visible entries and the scores of the others at -inf: one launch on CUDA (kernels/index_rows.py)
    visible, masked = _index_rows.visible_scores(scores, positions, count, ratio, cand)
    if _kindexer.use_triton(scores):
        ids = _select(masked, k)
    else:
        ids = topk_ids(scores, visible if cand is None else visible & cand, k, triton=False)
    # (the candidate source has no candidates of its own: masked is -inf exactly outside the visible prefix)
    return ids, None if blocks is None else candidate_block_mask(masked, visible, *blocks, masked=True)


def topk_ids(scores: torch.Tensor, allowed: torch.Tensor, k: int, triton: bool | None = None) -> torch.Tensor:
    """The entries of `topk_mask(scores, allowed, k)` (the k best allowed ones, ties -> lower id) as ids [T, min(k, G)]
    ascending, -1 padded (what the attention kernel reads). triton (default: on CUDA): the select kernel, which
    picks the same entries as the stable sort (allowed scores are finite; disallowed ones become -inf, never
    selected) and with sorted=False returns its winners in ascending entry order, -1 padded at the end
    (kernels/indexer.py's contract), so they are the ids as they are (2 launches instead of the mask's 6 + 5 to
    turn it into ids; a re-sort here cost 2 more)."""
    if not (_kindexer.use_triton(scores) if triton is None else triton):
        return _mask_to_index(topk_mask(scores, allowed, k), k)
    return _select(scores.masked_fill(~allowed, float("-inf")), k)


def _select(masked: torch.Tensor, k: int) -> torch.Tensor:
    """The select kernel on scores whose disallowed entries are -inf -> ids [T, min(k, G)] ascending, -1 padded."""
    idx, _ = _kindexer.topk_select_triton(masked, k, sorted=False)
    return idx[:, :min(k, masked.shape[1])]


def _mask_to_index(sel: torch.Tensor, k: int) -> torch.Tensor:
    """bool [T, G] with <= k True per row -> entry ids [T, min(k, G)] ascending, -1 padded."""
    G = sel.shape[1]
    key = torch.where(sel, torch.arange(G, device=sel.device)[None, :], G)
    idx = key.sort(dim=1).values[:, :min(k, G)]
    return torch.where(idx < G, idx, torch.full_like(idx, -1))
