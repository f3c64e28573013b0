"""Index glue of the batched decode step's sparse attention (Triton on CUDA, torch twins elsewhere).

* `visible_scores`: which compressed entries each query row may see, g < min((p + 1) // ratio, count) (its
  position p, the entries its sequence holds), optionally and-ed with a candidate mask, and the index scores
  with every other entry set to -inf (what the top-k select reads) -> (visible bool [T, G], masked fp32 [T, G]).
  One launch; the step runs it only where the score kernel cannot pick the visible entries itself (quant_sim on
  CUDA: engine/indexer.py's `select_ids`), and its twin is the score kernel's twin's last step.
* `candidate_blocks_triton`: V4.1's candidate blocks from the candidate source's masked index scores (-inf = not
  visible; the visible entries a prefix of the row, as the step's g < min((p + 1) // ratio, count)): blocks of
  `block` entries from entry 0, block score = max over its visible entries, the block of the row's last visible
  entry always kept, the `top` best blocks kept (ties -> lower block) -> bool [T, G], the kept blocks' visible
  entries. The same set as engine/indexer.py's `candidate_block_mask` (its twin: ~30 torch launches and a stable
  sort of [T, G / block]) in three launches: the block scores (the forced block and blocks with nothing visible at
  -inf; the row's visible count from the program where its prefix ends), the exact select kernel's top - 1 of them
  (kernels/indexer.py: the same picks as the stable sort; the forced block is the top one, kept apart), and the
  mask (each program stores its tile with the forced block's entries, then True at the picked blocks' entries).
  H200, N=64, block 8, top 2,048, us (session 15; the chain runs only past top blocks: from G = 16,392 entries, at
  ratio 1 the context's tokens): G = 16,392 / 65,536 / 131,072 the chain 94.5-95.4 / 264.2-266.1 / 432.9-433.3; its
  first form here (the mask kernel re-reading the scores and counting each tile's picks with tl.histogram) 24.7-25.0
  / 56.1-58.4 / 112.7-112.9 (R1-R2), the row's count from the block scores 24.7 / 57.2 / 107.0 (its mask kernel
  alone 14.0 / 26.4 / 48.6: the histogram), the picks scattered 14.7 / 37.2 / 70.1 (mask alone 4.4 / 7.4 / 13.2;
  block scores 6.1 / 13.6 / 27.6, the select 4.3 / 14.2 / 25.9) (R2; the select in two chunks, with the histogram
  mask, 38.8 / 66.9 / 107.7); this form (the block scores' count per tile instead of a per-block gather of the next
  entry, 8 warps; mask tiles of 32k entries, each reading the row's winners once) 12.7-13.3 / 28.6 / 51.8-51.9
  against 14.1 / 37.6 / 69.2-69.3 for the scatter above (R3; block scores alone 3.6 / 6.7 / 15.5, mask alone 5.7 /
  6.2 / 10.3 = 96% of copy bandwidth at G = 131,072): 7.3x / 9.2x / 8.3x the chain. Measured and removed
  (session 16 R2, against copies of the session-15 files in the same run; the candidate source layer's engine form,
  N=64, Hi=64, Di=128, G = 16,392, visible prefixes G/2..G): the block maxima and the visible counts made by the
  index score kernel (each 128-entry score block reshaped to its blocks of 8 and maxed, the forced block at -inf;
  this module's first launch skipped): scores + mask 149.4-150.5 -> 167.9-169.0 us (the score kernel 134.9 ->
  157.1; this module's launches 12.8 (three) -> 9.5 (two)); the same masks and scores.
  Session 16 R3 (the pieces alone, each timed once; G = 131,072 / 65,536 / 16,392, the three launches 50.7-51.9 /
  27.0 / 13.3-13.4 us): the block scores at 4,096 entries and 4 warps a program 13.2 / 6.5 / 3.1 us (60% / 61% /
  32% of copy bandwidth) against 15.4 / 6.8 / 3.6 at 8,192 and 8 warps (4,096 w8 13.5 / 6.7 / 3.1, 8,192 w4 14.0 /
  6.6 / 3.8, 8,192 w16 15.6 / 7.1 / 3.6, 16,384 w8 19.0 / 8.0 / 4.3, 32,768 w16 17.7 / 7.3 / 7.1): now the default.
  The select of the 2,047 best blocks in one chunk a row (its default) 24.4 / 13.0 / 4.3; 2 chunks 24.1 / 27.3 /
  11.0, 4 chunks 41.5 / 31.9 / 11.0, 8 chunks 35.0 / 30.9 / 11.0.
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


@triton.jit
def _block_scores_kernel(scores_ptr, out_ptr, lim_ptr, G, NB, block, stride, TB: tl.constexpr, BP: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Program (row, TB blocks): block maxima of the visible entries (finite scores), -inf for blocks with nothing
    visible (never selected) and for the forced block (kept apart: the block of the row's last visible entry);
    the row's visible count lim, written by the program holding the end of the visible prefix (its tile's count
    of visible entries short of the tile, or the tile full and the next entry not visible), or 0 by the first
    program when nothing is visible."""
    row = tl.program_id(0).to(tl.int64)
    b0 = tl.program_id(1) * TB
    b = b0 + tl.arange(0, TB)
    c = tl.arange(0, BP)
    g = b[:, None] * block + c[None, :]
    pdl_wait(PDL)
    s = tl.load(scores_ptr + row * stride + g, mask=(c[None, :] < block) & (g < G), other=float("-inf"))
    e0 = b0 * block
    e1 = tl.minimum(e0 + TB * block, G)                # the tile's entries [e0, e1)
    lim = e0 + tl.sum((s > float("-inf")).to(tl.int32))
    ends = (lim < e1) | (e1 == G) | (tl.load(scores_ptr + row * stride + e1, mask=e1 < G, other=0.0) == float("-inf"))
    ends = ends & ((lim > e0) | (b0 == 0))
    tl.store(lim_ptr + row, lim, mask=ends)
    forced = ends & (b == (lim - 1) // block)
    tl.store(out_ptr + row * NB + b, tl.where(forced, float("-inf"), tl.max(s, 1)), mask=b < NB)


@triton.jit
def _block_mask_kernel(lim_ptr, ids_ptr, out_ptr, G, block, ids_stride, k, TB: tl.constexpr, BP: tl.constexpr,
                       KP: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, TB blocks): its entries' mask, the visible entries (g < lim) of the forced block (that of
    entry lim - 1) and of the blocks the select picked (the row's k winner ids, ascending, -1 padded): the tile
    stored with the forced block's entries, then, after a barrier (the program's own stores before it come
    first), True stored at the picked blocks' visible entries (the picks inside the tile: the ascending ids'
    segment [lo, lo + n), found by counting)."""
    row = tl.program_id(0).to(tl.int64)
    b0 = tl.program_id(1) * TB
    b = b0 + tl.arange(0, TB)
    c = tl.arange(0, BP)
    g = b[:, None] * block + c[None, :]
    j = tl.arange(0, KP)
    pdl_wait(PDL)
    lim = tl.load(lim_ptr + row)
    ids = tl.load(ids_ptr + row * ids_stride + j, mask=j < k, other=-1)
    lo = tl.sum(((ids >= 0) & (ids < b0)).to(tl.int32))
    n = tl.sum(((ids >= b0) & (ids < b0 + TB)).to(tl.int32))
    tl.store(out_ptr + row * G + g, (g < lim) & (b == (lim - 1) // block)[:, None],
             mask=(c[None, :] < block) & (g < G))
    tl.debug_barrier()
    t = tl.arange(0, TB)
    pick = tl.load(ids_ptr + row * ids_stride + lo + t, mask=t < n, other=0).to(tl.int32)
    gp = pick[:, None] * block + c[None, :]
    tl.store(out_ptr + row * G + gp, tl.full([TB, BP], 1, tl.int1), mask=(t < n)[:, None] & (c[None, :] < block)
             & (gp < lim))


TILE_SCORES = 4096       # entries a block-score program reads (fp32; 4 warps: the module docstring)
TILE_MASK = 32768        # entries a mask program writes (bool; each reads the row's winner ids once)


def candidate_blocks_triton(masked: torch.Tensor, block: int, top: int) -> torch.Tensor:
    """masked fp32 [T, G] (unit column stride; -inf = not visible, the visible entries a prefix of each row),
    block, top >= 2 -> bool [T, G] (module docstring; engine/indexer.py's `candidate_block_mask` is the twin)."""
    T, G = masked.shape
    check(masked.dtype == torch.float32 and masked.stride(1) == 1 and top >= 2 and block >= 1,
          f"candidate blocks: scores {masked.dtype} of strides {masked.stride()}, top {top}, block {block} (want "
          f"fp32 with unit column stride, top >= 2)")
    from .indexer import topk_select_triton          # (indexer imports this module's twin)
    nb = triton.cdiv(G, block)
    bp = triton.next_power_of_2(block)
    bs = empty((T, nb), torch.float32, masked.device)
    lim = empty((T,), torch.int32, masked.device)
    tb = max(1, min(triton.next_power_of_2(nb), TILE_SCORES // bp))
    _block_scores_kernel[(T, triton.cdiv(nb, tb))](masked, bs, lim, G, nb, block, masked.stride(0), TB=tb, BP=bp,
                                                   num_warps=4, **pdl_kw())
    ids, _ = topk_select_triton(bs, top - 1, sorted=False)
    out = empty((T, G), torch.bool, masked.device)
    tb = max(1, min(triton.next_power_of_2(nb), TILE_MASK // bp))
    _block_mask_kernel[(T, triton.cdiv(nb, tb))](lim, ids, out, G, block, ids.stride(0), top - 1, TB=tb, BP=bp,
                                                 KP=triton.next_power_of_2(top - 1), num_warps=8, **pdl_kw())
    return out


def entry_rows_torch(ids: torch.Tensor, start: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
    """int64 [T, width] = start + id where 0 <= id < count (else -1), ids -1 padded to width columns."""
    ent = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)
    return torch.where((ent >= 0) & (ent < count[:, None]), ent + start[:, None], -1)
