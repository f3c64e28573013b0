"""The batched decode / verify path of `Model.forward_step`: attention of many short chunks in one kernel call.

The reference path (model.py) runs attention per sequence with a dense [n, keys] bias. For decode and
speculative verification (every chunk a few rows) that is Python-bound, so here one step's sequences are
batched per layer, and each layer is split in three:
  * `pre_attention` (dense: Engram mix, mHC mixes + read-out, norm, q / kv / index-query projections) and
    `post_attention` (output projection, mHC write-back, the MoE sub-layer): pure functions of their inputs, run
    (as `post_then_pre` between two layers) through step_graphs.SegmentGraphs: CUDA graphs on CUDA once a token
    count is warm, eager otherwise;
  * `attention_core` in between, eager because it reads and grows the caches:
      - window keys: one buffer per step, win_all [L, S, cap, D] (prepare_windows: every sequence's cached
        windows, stacked once for all layers, plus room for the new rows, which each layer writes in place);
        an index tensor [T, W] per row (-1 = no key) built once per step from host-side lengths; after the
        step each sequence's WindowStack becomes a view of that buffer (commit_windows: no copies);
      - compressed entries / index keys: one pool per source layer (concatenated once per step, after the
        source layer's compressor ran), with per-row start and count;
      - index scores for every row at once over its padded [T, G] entries, then the top-k with the reference's
        tie rule (ties go to the lower entry id; relu makes exact-zero ties common, so selection must not depend
        on an unstable top-k): on CUDA the exact radix-select kernel `kernels.indexer.topk_select_triton` (the
        same selection as the reference's stable sort), elsewhere the reference's `topk_mask`; candidate blocks
        with the reference's `candidate_block_mask`;
      - `deepinfer_sg.kernels.sparse_attention` (Triton on CUDA, its torch twin on CPU) over the gathered keys;
      - compressors: one projection over all rows, every completed group pooled in one batch, and the states'
        rows (token projections, entries, latents, index keys) rebuilt by one gather per kind (step_many,
        compressor.append_rows); the appended entries are the layer's pool for the step.
Per-sequence work is host-side integer bookkeeping only: caches point at their rows of shared step buffers
(cache.py's lazily sliced rows, WindowStack), so no tensor is made per sequence. Results equal the reference
path to round-off (tests compare logits and cache states); host->device index copies go through pinned memory;
no host syncs here.

Cost per layer: O(T * (W + k) * D) attention reads; per step O(sum of cached window rows * L * D) to copy the
windows into the step's buffer once, O(sum of entries * D) per source layer to rebuild the compressed pool (and
its index keys). A paged / slab cache for the compressed entries (appends in place) would remove that copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import deepinfer_sg.kernels.indexer as _kindexer
from deepinfer_sg.kernels import sparse_attention

from .compressor import Sources, append_rows
from .indexer import candidate_block_mask, topk_mask
from .mhc import hc_pre, hc_post
from .rope import apply_rope
from .transfer import to_device

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
    cmp_idx: dict = field(default_factory=dict)   # (kv source, index source, ratio, G) -> pool rows [T, k']
    visible: dict = field(default_factory=dict)   # (pool kind, source, ratio) -> bool [T, G] visible entries
    # this step's window buffer (prepare_windows): win_all [L, S, cap, D]; sequence s's rows before this step end
    # at win_m[s] (each layer's window right-aligned there), its new rows follow; win_lens[s] = per-layer past
    # window lengths, or None when all L layers hold win_m[s] rows (the sequence's WindowStack)
    win_all: torch.Tensor | None = None
    win_m: list = field(default_factory=list)
    win_lens: list = field(default_factory=list)
    win_new_rows: torch.Tensor | None = None      # [T] row of each new token in win_all[layer].view(S * cap, D)
    win_uniform: bool = False                     # every win_lens entry is None

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        """(start position, row offset, rows) per sequence (the compressors' input layout)."""
        return list(zip(self.starts, self.offs, self.ns))

    def per_row(self, per_seq: list[int], device) -> torch.Tensor:
        """A per-sequence host list spread to a per-row int64 tensor on `device` (one host->device copy)."""
        return to_device([per_seq[s] for s in self.row_seq], device)


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
    """win_idx [T, W] into the flat window buffer win_all[layer].view(S * cap, D); -1 = no key.

    Sequence s's key at position kp sits at row s * cap + win_m[s] + (kp - start_s). A row at position p sees
    key positions p-W+1 .. p that still exist (>= start - past_lens[s]) and, for YOCO decoder layers, are
    >= rect_lo."""
    key = (tuple(past_lens), decoder)
    if key in plan.windows:
        return plan.windows[key]
    cap = plan.win_all.shape[2]
    base = [s * cap + plan.win_m[s] - plan.starts[s] for s in range(len(past_lens))]
    lo = [plan.starts[s] - past_lens[s] for s in range(len(past_lens))]
    if decoder:
        lo = [max(x, r) for x, r in zip(lo, plan.rect_lo)]
    rows = to_device([[base[s], lo[s]] for s in plan.row_seq], device)
    kp = plan.positions[:, None] - (W - 1) + torch.arange(W, device=device)[None, :]
    idx = torch.where(kp >= rows[:, 1:2], rows[:, 0:1] + kp, torch.full_like(kp, -1))
    plan.windows[key] = idx = _kernel_index(idx)
    return idx


def _kernel_index(idx: torch.Tensor) -> torch.Tensor:
    """Key indices as the attention kernel reads them: int32 on CUDA (made once per step and shared by the layers,
    instead of a conversion in every kernel call), int64 for the torch twin."""
    return idx.to(torch.int32) if idx.is_cuda else idx


def prepare_windows(model, ctx, plan: BatchPlan, like: torch.Tensor) -> None:
    """Build this step's window buffer win_all [L, S, cap, D] (dtype/device of `like`): every sequence's cached
    windows (one stacked copy for the sequences whose layers all read from their WindowStack, per layer for the
    rest), room for the new rows, and the new rows' positions in it. Once per step."""
    L = len(model.layers)
    seqs = ctx.seqs
    ms, lens, groups = [], [], {}
    for b, s in enumerate(seqs):
        st = s.cache.windows
        if st is not None and st.attached == L:
            m = st.m
            lens.append(None)
            if m:   # stacks in one earlier buffer at the same rows: one copy per group
                groups.setdefault((id(st.buf), st.slot is None, st.lo, st.hi), []).append(b)
        else:
            ls = [0 if lc.win is None else lc.win.shape[0] for lc in s.cache.layers]
            m = max(ls)
            lens.append(ls)
        ms.append(m)
    cap = max(m + s.n for m, s in zip(ms, seqs))
    S = len(seqs)
    win = torch.empty((L, S, cap, like.shape[-1]), dtype=like.dtype, device=like.device)
    for (_, own, lo, hi), idx in groups.items():
        m = hi - lo
        first = seqs[idx[0]].cache.windows
        if own:                                   # (a stack with its own tensor)
            for b in idx:
                win[:, b, :m] = seqs[b].cache.windows.t
            continue
        slots = [seqs[b].cache.windows.slot for b in idx]
        if len(idx) == S and slots == idx and first.buf.shape[1] == S:   # the same sequences as that step
            win[:, :, :m] = first.buf[:, :, lo:hi]
        else:
            win[:, to_device(idx, like.device), :m] = first.buf[:, to_device(slots, like.device), lo:hi]
    for b, (s, ls) in enumerate(zip(seqs, lens)):
        if ls is None:
            continue
        for k, lc in enumerate(s.cache.layers):
            if ls[k]:
                win[k, b, ms[b] - ls[k]:ms[b]] = lc.win
    plan.win_all, plan.win_m, plan.win_lens = win, ms, lens
    plan.win_uniform = all(ls is None for ls in lens)
    plan.win_new_rows = to_device([b * cap + ms[b] + j for b, s in enumerate(seqs) for j in range(s.n)], like.device)


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
    plan.cmp_idx.clear()
    plan.visible.clear()


# ------------------------------------------------------------------------------------------------ layer parts
def update_compressed(model, attn, x: torch.Tensor, ctx, plan: BatchPlan) -> None:
    """Batched `Model._update_compressed`: the same state changes for every sequence of the step. The appends
    leave every sequence's entries / index keys in one buffer, which becomes the layer's pool for this step."""
    c = model.config
    i = attn.layer_id
    spec = attn.spec
    rot = model._rotator(spec.rope)
    R = model.max_rollback
    spans = plan.spans
    fresh = {}
    if hasattr(attn, "compressor"):
        states = [s.cache.layers[i].comp for s in ctx.seqs]
        _, buf = attn.compressor.step_many(states, x, spans, lambda lat, p: model._qdq(rot(lat, p), "compressed"),
                                           c.compressor_style == "v41", R)
        fresh["comp"] = (buf, states)
    idx_mod = getattr(attn, "indexer", None)
    if idx_mod is not None and hasattr(idx_mod, "compressor"):
        states = [s.cache.layers[i].icomp for s in ctx.seqs]
        _, buf = idx_mod.compressor.step_many(states, x, spans, lambda lat, p: model._qdq(rot(lat, p), "index"),
                                              False, R)
        fresh["icomp"] = (buf, states)
    if idx_mod is not None and hasattr(idx_mod, "wk"):   # V4.1 index keys of the new entries, all sequences at once
        rows, gs, news, lcs, srcs = [], [], [], [], Sources(0)
        for s in ctx.seqs:
            lc = s.cache.layers[i]
            src = s.cache.layers[c.layers[i].kv_source].comp
            have, total = lc.rows("ikeys"), src.n_entries
            lcs.append(lc)
            news.append(max(total - have, 0))
            if total > have:   # latents have..total of the source (one gather for all sequences below)
                buf, o, _ = src._latents
                base = srcs.base(buf, None)
                rows.extend(range(base + o + have, base + o + total))
                gs.extend(range(have, total))
        if rows:
            p = to_device(gs, x.device) * spec.ratio
            lat = srcs.cat(None, 0)[to_device(rows, x.device)]
            ik = model._qdq(rot(idx_mod.k_norm(idx_mod.wk(lat)), p), "index")
            fresh["ikeys"] = (append_rows(lcs, "ikeys", ik, news), None)
    if hasattr(attn, "compressor") or (idx_mod is not None and hasattr(idx_mod, "compressor")
                                       or hasattr(idx_mod, "wk")):
        forget(plan, i)
    for kind, (buf, states) in fresh.items():   # the appended buffers are this step's pools (no second copy)
        if buf is None:
            continue
        if kind == "ikeys":
            counts = [s.cache.layers[i].rows("ikeys") for s in ctx.seqs]
        else:
            counts = [st.n_entries for st in states]
        starts, acc = [], 0
        for n in counts:
            starts.append(acc)
            acc += n
        plan.pools[(kind, i)] = (buf, plan.per_row(starts, x.device), plan.per_row(counts, x.device), max(counts))


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


def select_entries(model, attn, iq: torch.Tensor, w: torch.Tensor, ctx, plan) -> None:
    """Index-source layer: top-k mask [T, G] (and candidate blocks on the candidate-source layer) from the index
    queries iq [T, Hi, Di] (rotated) and head weights w [T, Hi] (`pre_attention` makes them)."""
    c = model.config
    i = attn.layer_id
    spec = attn.spec
    idx_mod = attn.indexer
    dev = iq.device
    plan.topk_idx = {key: v for key, v in plan.topk_idx.items() if key[0] != i}   # this layer's mask changes
    plan.cmp_idx.clear()
    kind, src = ("icomp", i) if c.compressor_style == "v4" else ("ikeys", spec.index_k_source)
    keys, start, count, G = pool(plan, ctx.seqs, kind, src, dev)
    vkey = (kind, src, spec.ratio)              # index layers reading one pool share the visibility mask
    visible = plan.visible.get(vkey)
    if visible is None:
        g = torch.arange(G, device=dev)
        visible = plan.visible[vkey] = ((g[None, :] < ((plan.positions + 1) // spec.ratio)[:, None])
                                        & (g[None, :] < count[:, None]))
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


def pre_attention(model, block, R: torch.Tensor, a, cos: torch.Tensor, sin: torch.Tensor, e):
    """The dense work of a layer before its attention core, as one pure function (a CUDA-graph segment, see
    step_graphs.py): [Engram mix of the looked-up rows e] -> [DSpark capture] -> attention mHC mixes -> read-out
    -> attn norm -> q / window kv projections -> [index queries on index-source layers].
    -> (R, pre, post, comb, xn, q, kv, iq, w, feat); iq / w / feat None where the layer has none."""
    c = model.config
    i = block.layer_id
    attn = block.attn
    if e is not None:
        R = block.engram.mix(R, e)
    feat = R.float().mean(dim=1).to(R.dtype) if i in c.dspark_target_layer_ids else None
    pre, post, comb = block.mixes(R, "attn", True)
    xn = block.attn_norm(hc_pre(R, a if c.hc_shifted else pre, fast=model.fused_mhc))
    q, qr = attn.project_q(xn, cos, sin)
    kv = model._qdq(attn.project_kv(xn, cos, sin), "window")
    iq = w = None
    if attn.spec.index_source == i:
        iq, w = attn.indexer.queries(qr, xn)
        iq = model._qdq(apply_rope(iq, cos, sin), "index")
    return R, pre, post, comb, xn, q, kv, iq, w, feat


def post_attention(model, block, o: torch.Tensor, R: torch.Tensor, pre: torch.Tensor, post: torch.Tensor,
                   comb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_ids: torch.Tensor):
    """The dense work of a layer after its attention core (a CUDA-graph segment): output projection, mHC write-back,
    then the whole MoE sub-layer. -> (R, a) for the next layer. With model.fused_mhc (shifted mHC only) the
    write-backs and read-outs are the fused kernels: the attention write-back also reads out the MoE input (its
    pre-mix is known, shifted schedule), one launch each instead of ~9 (same math up to fp32 summation order)."""
    y = block.attn.output(o, cos, sin)
    # the grouped expert kernel bypasses the experts' Linear modules, so not with quant_sim's input hooks
    fast_moe = not model.quant_sim
    if not (model.fused_mhc and model.config.hc_shifted):
        R = hc_post(R, y, post, comb)
        return block.ffn_sublayer(R, pre, token_ids, fast=True, fast_moe=fast_moe)
    R, x = hc_post(R, y, post, comb, fast=True, next_pre=pre)
    pre_f, post_f, comb_f = block.mixes(R, "ffn", True)
    xn = block.ffn_norm(x)
    y = block.ffn.forward_grouped(xn, token_ids) if fast_moe else block.ffn(xn, token_ids)
    return hc_post(R, y, post_f, comb_f, fast=True), pre_f


def post_then_pre(model, block, nxt, o, R, pre, post, comb, cos, sin, token_ids, ncos, nsin, e):
    """`post_attention` of `block`, then `pre_attention` of the next layer `nxt` (one graph segment)."""
    R, a = post_attention(model, block, o, R, pre, post, comb, cos, sin, token_ids)
    return pre_attention(model, nxt, R, a, ncos, nsin, e)


def attention_core(model, attn, xn: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, iq, w, ctx,
                   plan: BatchPlan) -> torch.Tensor:
    """The cache-dependent middle of a layer: compressors, index top-k, window / compressed key pools and the
    sparse attention kernel. xn [T, H] attn-norm output, q [T, nh, D], kv [T, D] -> o [T, nh, D]."""
    c = model.config
    i = attn.layer_id
    spec = attn.spec
    dev = xn.device
    update_compressed(model, attn, xn, ctx, plan)
    if spec.index_source == i:
        select_entries(model, attn, iq, w, ctx, plan)
    # window keys: this step's buffer (cached windows + the new rows written in place) and indices into it
    if plan.win_all is None:
        prepare_windows(model, ctx, plan, kv)
    _, S, cap, D = plan.win_all.shape
    win_pool = plan.win_all[i].view(S * cap, D)
    win_pool.index_copy_(0, plan.win_new_rows, kv.to(win_pool.dtype))
    if plan.win_uniform:      # every sequence's layers hold win_m rows: the same list for all layers
        past_lens = plan.win_m
    else:
        past_lens = [m if ls is None else ls[i] for m, ls in zip(plan.win_m, plan.win_lens)]
    decoder = model.yoco_mode != "off" and c.n_prefill_layer is not None and i >= c.n_prefill_layer
    win_idx = window_index(plan, past_lens, c.sliding_window, decoder, dev)
    # compressed entries
    cmp_pool = cmp_idx = None
    if spec.ratio > 0:
        P, start, count, G = pool(plan, ctx.seqs, "comp", spec.kv_source, dev, win_pool.dtype)
        if G > 0:
            cmp_pool = P
            # layers reading the same pool through the same selection share the indices (until a source changes)
            ckey = (spec.kv_source, spec.index_source, spec.ratio, G)
            cmp_idx = plan.cmp_idx.get(ckey)
            if cmp_idx is None:
                if spec.index_source is None:
                    g = torch.arange(G, device=dev)[None, :]
                    vis = (g < ((plan.positions + 1) // spec.ratio)[:, None]) & (g < count[:, None])
                    ent = torch.where(vis, g.expand(vis.shape[0], -1), -1)
                else:
                    key = (spec.index_source, G)       # consumer layers of one index source share the ids
                    if key not in plan.topk_idx:
                        plan.topk_idx[key] = _mask_to_index(_fit(plan.topk[spec.index_source], G), c.index_topk)
                    ent = plan.topk_idx[key]
                cmp_idx = plan.cmp_idx[ckey] = _kernel_index(
                    torch.where(ent >= 0, ent + start[:, None], torch.full_like(ent, -1)))
    return sparse_attention(q, win_pool, win_idx, attn.attn_sink, cmp_pool, cmp_idx, scale=attn.scale)


def attention(model, attn, x: torch.Tensor, ctx, plan: BatchPlan) -> torch.Tensor:
    """Batched `Model._attention` for short chunks: x [T, H] (attn-norm output) -> [T, H] (projections, core,
    output projection; the model's fast layer runs the same pieces as graph segments around the core)."""
    spec = attn.spec
    cos, sin = ctx.rope[spec.rope]
    q, qr = attn.project_q(x, cos, sin)
    kv = model._qdq(attn.project_kv(x, cos, sin), "window")
    iq = w = None
    if spec.index_source == attn.layer_id:
        iq, w = attn.indexer.queries(qr, x)
        iq = model._qdq(apply_rope(iq, cos, sin), "index")
    return attn.output(attention_core(model, attn, x, q, kv, iq, w, ctx, plan), cos, sin)


def commit_windows(model, ctx, plan: BatchPlan) -> None:
    """Advance every sequence's windows to the end of this step: its WindowStack becomes a view of this step's
    buffer (one view per sequence for all layers, no copy). A sequence whose layers held windows of different
    lengths (after a YOCO-compacted prefill) gets one view per layer instead."""
    if plan.win_all is None:
        return
    from .cache import WindowStack
    keep = model.config.sliding_window - 1 + model.max_rollback
    win = plan.win_all
    for b, s in enumerate(ctx.seqs):
        end = plan.win_m[b] + s.n
        ls = plan.win_lens[b]
        if ls is None:
            st = s.cache.windows
            st.buf, st.slot, st.lo, st.hi = win, b, max(0, end - keep), end
        elif len(set(ls)) == 1:
            st = WindowStack(win, b, max(0, end - min(keep, ls[0] + s.n)), end)
            for k, lc in enumerate(s.cache.layers):
                lc.attach(st, k)
            s.cache.windows = st
        else:
            for k, lc in enumerate(s.cache.layers):
                lc.win = win[k, b, end - min(keep, ls[k] + s.n):end]
            s.cache.windows = None
