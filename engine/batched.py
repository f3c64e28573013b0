"""The batched decode / verify path of `Model.forward_step`: attention of many short chunks in one kernel call.

The reference path (model.py) runs attention per sequence with a dense [n, keys] bias. For decode and
speculative verification (every chunk a few rows) that is Python-bound, so here one step's sequences are
batched per layer:
  * window keys: one pool = [every sequence's cached window rows ..., this step's new KV rows], and an index
    tensor [T, W] per row (-1 = no key) built once per step from host-side lengths (the same for all layers);
  * compressed entries / index keys: one pool per source layer (concatenated once per step, after the source
    layer's compressor ran), with per-row start and count;
  * index scores for every row at once over its padded [T, G] entries, then the top-k with the reference's tie
    rule (ties go to the lower entry id; relu makes exact-zero ties common, so selection must not depend on an
    unstable top-k): on CUDA the exact radix-select kernel `kernels.indexer.topk_select_triton` (the same
    selection as the reference's stable sort), elsewhere the reference's `topk_mask`; candidate blocks with the
    reference's `candidate_block_mask`;
  * `deepinfer_sg.kernels.sparse_attention` (Triton on CUDA, its torch twin on CPU) over the gathered keys;
  * compressors: one projection over all rows, every completed group pooled in one batch (Compressor.step_many);
  * windows: appended once per sequence per step for all layers (commit_windows), not per (sequence, layer).
Only per-sequence cache appends stay in Python. Results equal the reference path to round-off (tests compare
logits and cache states); no host syncs here.

Cost per layer: O(T * (W + k) * D) attention reads, O(sum of cached rows * D) to build the window pool (a copy
of the windows), O(sum of entries * D) per source layer per step for the compressed pool. A slab / paged cache
(windows as rings in one [sequences, W-1+R, D] tensor per layer, entries in pages) would remove both copies and
the per-sequence appends, and make the step CUDA-graph friendly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import deepinfer_sg.kernels.indexer as _kindexer
from deepinfer_sg.kernels import sparse_attention

from .indexer import candidate_block_mask, topk_mask
from .rope import apply_rope

MAX_FAST_ROWS = 16   # chunks up to this many rows use the batched path (decode, verify); longer ones: reference


@dataclass
class BatchPlan:
    """Host-side layout of one step's rows plus per-step caches of index tensors and pools."""
    starts: list[int]                 # per sequence: position of its first new row
    offs: list[int]                   # per sequence: offset of its rows in the flat batch
    ns: list[int]                     # per sequence: number of new rows
    row_seq: list[int]                # per row: its sequence
    positions: torch.Tensor           # [T] on the device
    rect_lo: list[int] | None = None  # YOCO mask mode: decoder windows start no earlier than this
    windows: dict = field(default_factory=dict)   # (past lengths, decoder) -> win_idx [T, W]
    pools: dict = field(default_factory=dict)     # (kind, layer) -> (pool, start [T], count [T], G)
    topk: dict = field(default_factory=dict)      # index-source layer -> bool [T, G]
    cand: dict = field(default_factory=dict)      # candidate-source layer -> bool [T, G]
    topk_idx: dict = field(default_factory=dict)  # (index-source layer, G) -> entry ids [T, k'] of its top-k mask
    new_kv: dict = field(default_factory=dict)    # layer -> this step's window KV rows [T, D] (commit_windows)

    def per_row(self, per_seq: list[int], device) -> torch.Tensor:
        """A per-sequence host list spread to a per-row int64 tensor on `device` (one host->device copy)."""
        return torch.tensor([per_seq[s] for s in self.row_seq], dtype=torch.long).to(device, non_blocking=True)


def make_plan(seqs, positions: torch.Tensor, rect: bool) -> BatchPlan:
    row_seq = [si for si, s in enumerate(seqs) for _ in range(s.n)]
    return BatchPlan([s.start for s in seqs], [s.off for s in seqs], [s.n for s in seqs], row_seq, positions,
                     [s.rect_lo for s in seqs] if rect else None)


def usable(model, chunks_rows: list[int]) -> bool:
    """Whether a step can take the batched path (short chunks, no YOCO compaction)."""
    return (getattr(model, "fast_decode", True) and model.yoco_mode != "compact"
            and max(chunks_rows) <= MAX_FAST_ROWS)


# ------------------------------------------------------------------------------------------------ index tensors
def window_index(plan: BatchPlan, past_lens: list[int], W: int, decoder: bool, device) -> torch.Tensor:
    """win_idx [T, W] into the pool [past_0, ..., past_{B-1}, new rows of all sequences]; -1 = no key.

    Row at position p sees key positions p-W+1 .. p that still exist (>= start - cached rows) and, for YOCO
    decoder layers, are >= rect_lo."""
    key = (tuple(past_lens), decoder)
    if key in plan.windows:
        return plan.windows[key]
    P = sum(past_lens)
    past_base, acc = [], 0
    for n in past_lens:
        past_base.append(acc)
        acc += n
    a = [past_base[s] + past_lens[s] - plan.starts[s] for s in range(len(past_lens))]   # past row = a + kp
    b = [P + plan.offs[s] - plan.starts[s] for s in range(len(past_lens))]               # new row = b + kp
    lo = [plan.starts[s] - past_lens[s] for s in range(len(past_lens))]
    if decoder:
        lo = [max(x, r) for x, r in zip(lo, plan.rect_lo)]
    rows = torch.tensor([[a[s], b[s], lo[s], plan.starts[s]] for s in plan.row_seq], dtype=torch.long)
    rows = rows.to(device, non_blocking=True)
    kp = plan.positions[:, None] - (W - 1) + torch.arange(W, device=device)[None, :]
    idx = torch.where(kp < rows[:, 3:4], rows[:, 0:1] + kp, rows[:, 1:2] + kp)
    idx = torch.where(kp >= rows[:, 2:3], idx, torch.full_like(idx, -1))
    plan.windows[key] = idx
    return idx


def _layer_tensor(cache, kind: str, layer: int):
    lc = cache.layers[layer]
    if kind == "comp":
        return lc.comp.entries
    if kind == "icomp":
        return lc.icomp.entries
    return lc.ikeys


def pool(plan: BatchPlan, seqs, kind: str, layer: int, device, dtype=None):
    """(pool [P, D] | None, start [T], count [T], G = largest count) of one per-sequence tensor list, cached."""
    key = (kind, layer)
    if key not in plan.pools:
        ts = [_layer_tensor(s.cache, kind, layer) for s in seqs]
        counts = [0 if t is None else t.shape[0] for t in ts]
        starts, acc = [], 0
        for n in counts:
            starts.append(acc)
            acc += n
        G = max(counts)
        P = torch.cat([t for t in ts if t is not None and t.shape[0]]) if G else None
        plan.pools[key] = (P, plan.per_row(starts, device), plan.per_row(counts, device), G)
    P, start, count, G = plan.pools[key]
    if P is not None and dtype is not None and P.dtype != dtype:
        P = P.to(dtype)
    return P, start, count, G


def forget(plan: BatchPlan, layer: int) -> None:
    """A layer's compressor / index keys changed: drop its cached pools."""
    for kind in ("comp", "icomp", "ikeys"):
        plan.pools.pop((kind, layer), None)


# ------------------------------------------------------------------------------------------------ layer parts
def update_compressed(model, attn, x: torch.Tensor, ctx, plan: BatchPlan) -> None:
    """Batched `Model._update_compressed`: the same state changes for every sequence of the step."""
    c = model.config
    i = attn.layer_id
    spec = attn.spec
    rot = model._rotator(spec.rope)
    R = model.max_rollback
    spans = [(s.start, s.off, s.n) for s in ctx.seqs]
    if hasattr(attn, "compressor"):
        attn.compressor.step_many([s.cache.layers[i].comp for s in ctx.seqs], x, spans,
                                  lambda lat, p: model._qdq(rot(lat, p), "compressed"),
                                  c.compressor_style == "v41", R)
    idx_mod = getattr(attn, "indexer", None)
    if idx_mod is not None and hasattr(idx_mod, "compressor"):
        idx_mod.compressor.step_many([s.cache.layers[i].icomp for s in ctx.seqs], x, spans,
                                     lambda lat, p: model._qdq(rot(lat, p), "index"), False, R)
    if idx_mod is not None and hasattr(idx_mod, "wk"):   # V4.1 index keys of the new entries, all sequences at once
        lats, gs, owners = [], [], []
        for s in ctx.seqs:
            lc = s.cache.layers[i]
            src = s.cache.layers[c.layers[i].kv_source].comp
            have = 0 if lc.ikeys is None else lc.ikeys.shape[0]
            if src.n_entries > have:
                lats.append(src.latents[have:])
                gs.extend(range(have, src.n_entries))
                owners.append((lc, src.n_entries - have))
        if lats:
            p = torch.tensor(gs, dtype=torch.long).to(x.device) * spec.ratio
            ik = model._qdq(rot(idx_mod.k_norm(idx_mod.wk(torch.cat(lats))), p), "index")
            at = 0
            for lc, k in owners:
                part = ik[at:at + k]
                at += k
                lc.ikeys = part if lc.ikeys is None else torch.cat([lc.ikeys, part])
    forget(plan, i)


def _index_scores(idx_mod, iq: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                  count: torch.Tensor, G: int) -> torch.Tensor:
    """I [T, G] fp32 = sum_h w * Di^-0.5 * relu(iq_h . ik_g) over each row's entries start..start+G (padded
    columns hold -inf or whatever the clamped gather gives: callers mask them).

    On CUDA the score kernel of deepinfer_sg.kernels.indexer reads the keys in place (no [T, G, Di] gather)."""
    if _kindexer.use_triton(iq):
        return _kindexer.indexer_scores_triton(iq, (w.float() * idx_mod.idx_dim ** -0.5).contiguous(), keys,
                                               start, count, G)
    g = torch.arange(G, device=iq.device)
    rows = (start[:, None] + g[None, :]).clamp(max=keys.shape[0] - 1)
    k = keys[rows].float()                                                          # [T, G, Di]
    s = torch.relu(torch.matmul(iq.float(), k.transpose(1, 2))) * idx_mod.idx_dim ** -0.5   # [T, Hi, G]
    return (s * w.unsqueeze(-1)).sum(dim=1)


def select_entries(model, attn, x: torch.Tensor, qr: torch.Tensor, cos, sin, ctx, plan) -> None:
    """Index-source layer: top-k mask [T, G] (and candidate blocks on the candidate-source layer)."""
    c = model.config
    i = attn.layer_id
    spec = attn.spec
    idx_mod = attn.indexer
    iq, w = idx_mod.queries(qr, x)
    iq = model._qdq(apply_rope(iq, cos, sin), "index")
    plan.topk_idx = {key: v for key, v in plan.topk_idx.items() if key[0] != i}   # this layer's mask changes
    kind, src = ("icomp", i) if c.compressor_style == "v4" else ("ikeys", spec.index_k_source)
    keys, start, count, G = pool(plan, ctx.seqs, kind, src, x.device)
    g = torch.arange(G, device=x.device)
    visible = (g[None, :] < ((plan.positions + 1) // spec.ratio)[:, None]) & (g[None, :] < count[:, None])
    if G == 0:
        plan.topk[i] = visible
        if i == c.candidate_source_layer_id:
            plan.cand[i] = visible
        return
    scores = _index_scores(idx_mod, iq, w, keys, start, count, G)
    allowed = visible
    if spec.candidate_source is not None:
        allowed = visible & _fit(plan.cand[spec.candidate_source], G)
    plan.topk[i] = _topk_mask(scores, allowed, c.index_topk)
    if i == c.candidate_source_layer_id:
        plan.cand[i] = candidate_block_mask(scores, visible, c.candidate_block_size, c.candidate_topk_blocks)


def _topk_mask(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """`topk_mask` (the k best allowed entries, ties -> lower id); on CUDA by the select kernel, which picks the
    same entries as the stable sort (allowed scores are finite; disallowed ones become -inf, never selected)."""
    if not _kindexer.use_triton(scores):
        return topk_mask(scores, allowed, k)
    T, G = scores.shape
    idx, _ = _kindexer.topk_select_triton(scores.masked_fill(~allowed, float("-inf")), k, sorted=False)
    sel = torch.zeros((T, G + 1), dtype=torch.bool, device=scores.device)      # column G absorbs the -1 padding
    sel.scatter_(1, torch.where(idx >= 0, idx, G), True)
    return sel[:, :G] & allowed


def _fit(mask: torch.Tensor, G: int) -> torch.Tensor:
    """Pad / cut a [T, G'] mask to G columns (pools of different sources can differ in their padding)."""
    if mask.shape[1] >= G:
        return mask[:, :G]
    return torch.nn.functional.pad(mask, (0, G - mask.shape[1]), value=False)


def _mask_to_index(sel: torch.Tensor, k: int) -> torch.Tensor:
    """bool [T, G] with <= k True per row -> entry ids [T, min(k, G)] ascending, -1 padded."""
    G = sel.shape[1]
    key = torch.where(sel, torch.arange(G, device=sel.device)[None, :], G)
    idx = key.sort(dim=1).values[:, :min(k, G)]
    return torch.where(idx < G, idx, torch.full_like(idx, -1))


def attention(model, attn, x: torch.Tensor, ctx, plan: BatchPlan) -> torch.Tensor:
    """Batched `Model._attention` for short chunks: x [T, H] (attn-norm output) -> [T, H]."""
    c = model.config
    i = attn.layer_id
    spec = attn.spec
    dev = x.device
    cos, sin = ctx.rope[spec.rope]
    q, qr = attn.project_q(x, cos, sin)
    kv = model._qdq(attn.project_kv(x, cos, sin), "window")
    update_compressed(model, attn, x, ctx, plan)
    if spec.index_source == i:
        select_entries(model, attn, x, qr, cos, sin, ctx, plan)
    # window pool and indices
    W = c.sliding_window
    pasts = [s.cache.layers[i].win for s in ctx.seqs]
    past_lens = [0 if p is None else p.shape[0] for p in pasts]
    decoder = model.yoco_mode != "off" and c.n_prefill_layer is not None and i >= c.n_prefill_layer
    win_pool = torch.cat([p for p in pasts if p is not None and p.shape[0]] + [kv])
    win_idx = window_index(plan, past_lens, W, decoder, dev)
    # compressed entries
    cmp_pool = cmp_idx = None
    if spec.ratio > 0:
        P, start, count, G = pool(plan, ctx.seqs, "comp", spec.kv_source, dev, win_pool.dtype)
        if G > 0:
            if spec.index_source is None:
                g = torch.arange(G, device=dev)[None, :]
                vis = (g < ((plan.positions + 1) // spec.ratio)[:, None]) & (g < count[:, None])
                ent = torch.where(vis, g.expand(vis.shape[0], -1), -1)
            else:
                key = (spec.index_source, G)       # consumer layers of one index source share the ids
                if key not in plan.topk_idx:
                    plan.topk_idx[key] = _mask_to_index(_fit(plan.topk[spec.index_source], G), c.index_topk)
                ent = plan.topk_idx[key]
            cmp_pool = P
            cmp_idx = torch.where(ent >= 0, ent + start[:, None], torch.full_like(ent, -1))
    o = sparse_attention(q, win_pool, win_idx, attn.attn_sink, cmp_pool, cmp_idx, scale=attn.scale)
    plan.new_kv[i] = kv    # the windows advance once for all layers at the end of the step (commit_windows)
    return attn.output(o, cos, sin)


def commit_windows(model, ctx, plan: BatchPlan) -> None:
    """Append this step's KV rows to every layer's window: ONE copy per sequence for all layers (a [L, m, D]
    buffer whose rows are the layers' windows), instead of one per (sequence, layer). Caches never share storage
    across sequences. Layers whose cached windows differ in length (after a YOCO-compacted prefill) fall back to
    one copy per layer."""
    if not plan.new_kv:
        return
    keep = model.config.sliding_window - 1 + model.max_rollback
    layers = sorted(plan.new_kv)
    for s in ctx.seqs:
        lcs = [s.cache.layers[i] for i in layers]
        news = [plan.new_kv[i][s.off:s.off + s.n] for i in layers]
        lens = {0 if lc.win is None else lc.win.shape[0] for lc in lcs}
        if len(lens) == 1 and s.n <= keep:
            m = min(keep, lens.pop() + s.n)
            pieces = []
            for lc, new in zip(lcs, news):
                if lc.win is not None and m > s.n:
                    pieces.append(lc.win[lc.win.shape[0] - (m - s.n):])
                pieces.append(new)
            buf = torch.cat(pieces).view(len(layers), m, -1)
            for k, lc in enumerate(lcs):
                lc.win = buf[k]
        else:
            for lc, new in zip(lcs, news):
                lc.win = (new.clone() if lc.win is None else torch.cat([lc.win, new]))[-keep:]
