"""Index glue of the batched decode step's sparse attention (Triton on CUDA, torch twins elsewhere).

* `visible_scores`: which compressed entries each query row may see, g < min((p + 1) // ratio, count) (its
  position p, the entries its sequence holds), optionally and-ed with a candidate mask, and the index scores
  with every other entry set to -inf (what the top-k select reads) -> (visible bool [T, G], masked fp32 [T, G]).
  One launch; the step runs it only where the score kernel cannot pick the visible entries itself (quant_sim on
  CUDA: engine/indexer.py's `select_ids`), and its twin is the score kernel's twin's last step.
* `entry_rows_torch`: selected entry ids [T, w] (-1 = none; ids past the row's count dropped) -> rows of the kv
  pool start + id, -1 padded to `width` columns: the attention twin's reading of entry ids (its kernel makes the
  rows in its gather, kernels/decode_attention.py's cmp_start / cmp_count).

Why: in torch each is a chain of ~8 small elementwise launches (arange, compares, and, not, masked_fill / pad,
compares, add, where, cast) per index layer of every decode step, a few microseconds each inside the step's graph.
Cost: one read and one write of the [T, G] tile.
A programmatic dependent launch (`pdl_kw`): a program waits before its first load (positions, counts, scores: all
written earlier in the step) and lets the next kernel launch once it has loaded (one short program a row). H200
(session 12 R2, back to back, PDL off -> on, us): visible N=64 / 256, G=1024 1.5 -> 1.2 / 1.8 -> 1.3; the entry rows
kernel (session 12) 1.2 -> 0.9 / 1.4 -> 1.1, removed in session 13 with its launch (the attention kernel's gather
makes the rows; the select layer's chain in benchmarks/kernels_attention.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import check, empty, pdl_kw, pdl_trigger, pdl_wait, use_triton


def visible_scores_torch(scores: torch.Tensor, positions: torch.Tensor, count: torch.Tensor, ratio: int,
                         cand: torch.Tensor | None = None):
    """The twin: (visible [T, G] bool, scores with the entries not visible (or not candidates) at -inf)."""
    G = scores.shape[1]
    g = torch.arange(G, device=scores.device)[None, :]
    visible = (g < ((positions + 1) // ratio)[:, None]) & (g < count[:, None])
    allowed = visible if cand is None else visible & cand
    return visible, scores.masked_fill(~allowed, float("-inf"))


@triton.jit
def _visible_kernel(scores_ptr, pos_ptr, count_ptr, cand_ptr, vis_ptr, out_ptr, G, ratio, s_stride, c_stride,
                    HAS_CAND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    g = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = g < G
    pdl_wait(PDL)
    lim = tl.minimum((tl.load(pos_ptr + t) + 1) // ratio, tl.load(count_ptr + t))
    vis = ok & (g < lim)
    allowed = vis
    if HAS_CAND:
        allowed = allowed & (tl.load(cand_ptr + t * c_stride + g, mask=ok, other=0) != 0)
    s = tl.load(scores_ptr + t * s_stride + g, mask=ok, other=0.0)
    pdl_trigger(PDL)
    tl.store(vis_ptr + t * G + g, vis, mask=ok)
    tl.store(out_ptr + t * G + g, tl.where(allowed, s, float("-inf")), mask=ok)


def visible_scores_triton(scores: torch.Tensor, positions: torch.Tensor, count: torch.Tensor, ratio: int,
                          cand: torch.Tensor | None = None):
    """The kernel: same contract as `visible_scores_torch` (scores fp32 [T, G] with unit column stride)."""
    T, G = scores.shape
    check(scores.dtype == torch.float32 and scores.stride(1) == 1,
          f"visible_scores: scores {scores.dtype} of strides {scores.stride()} (want fp32, unit column stride)")
    check(positions.shape == (T,) and count.shape == (T,),
          f"visible_scores: positions {tuple(positions.shape)} / count {tuple(count.shape)} for {T} rows")
    check(cand is None or (cand.shape == (T, G) and cand.dtype == torch.bool and cand.stride(1) == 1),
          f"visible_scores: candidate mask {None if cand is None else (cand.dtype, tuple(cand.shape))} for [{T}, {G}]")
    vis = empty((T, G), torch.bool, scores.device)
    out = empty((T, G), torch.float32, scores.device)
    if T and G:
        BLOCK = min(1024, triton.next_power_of_2(G))
        c = cand if cand is not None else vis
        _visible_kernel[(T, triton.cdiv(G, BLOCK))](scores, positions, count, c, vis, out, G, ratio, scores.stride(0),
                                                    c.stride(0), HAS_CAND=cand is not None, BLOCK=BLOCK, **pdl_kw())
    return vis, out


def visible_scores(scores, positions, count, ratio: int, cand=None):
    """Dispatch: the kernel on CUDA, the twin elsewhere."""
    if use_triton(scores):
        return visible_scores_triton(scores, positions, count, ratio, cand)
    return visible_scores_torch(scores, positions, count, ratio, cand)


def entry_rows_torch(ids: torch.Tensor, start: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
    """int64 [T, width] = start + id where 0 <= id < count (else -1), ids -1 padded to width columns."""
    ent = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)
    return torch.where((ent >= 0) & (ent < count[:, None]), ent + start[:, None], -1)
