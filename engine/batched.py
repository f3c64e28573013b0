"""The batched decode / verify path of `Model.forward_step`: attention of many short chunks in one kernel call.

The reference path (model.py) runs attention per sequence with a dense [n, keys] bias. For decode and
speculative verification (every chunk a few rows) that is Python-bound, so here one step's sequences are
batched per layer, and each layer is split in three: `pre_attention` (dense: Engram mix, mHC mixes + read-out,
norm, q / kv / index-query projections), the attention core, `post_attention` (output projection, mHC write-back,
the MoE sub-layer). Caches live at fixed addresses (engine/arena.py): the window keys of every layer in the model's
window slab [L, slots, cap, D], compressed entries / latents / index keys in per-layer arenas [slots, cap, D]; a
step writes its new rows in place and each sequence's cache points at its slot (cache.py's (buffer, first row,
rows) storage and WindowStack), so no tensor is made per sequence and nothing is rebuilt per step.
Per layer:
  * the compressors' cache updates: V4.1's inside the graph (engine/compress_step.py: fixed-size per token);
    V4's overlapping compressors and index compressors eagerly between two segments (`eager_layers`,
    `update_compressed`: one projection over all rows, every completed group pooled in one batch, token
    projections kept by one gather, new entries / latents appended into the arenas: step_many);
  * everything else inside a segment (`span`, with inputs `span_inputs` made before it from host-side lengths):
    the dense parts, the index selection (engine/indexer.py's `select_ids`: scores for every row at once over its
    index pool, padded to a power of two so shapes hold for many steps, then the top-k with the reference's tie
    rule; on CUDA the score kernel rotates the index queries, scales the head weights and scores only the visible
    candidates, and the exact select kernel gives ascending ids), then `attend`: write the window rows,
    `deepinfer_sg.kernels.sparse_attention` (Triton on CUDA, its torch twin on CPU) over the window rows [T, W]
    and the selected entry ids (-1 = none; the kernel makes their pool rows from each row's start and count).
Everything between two eager cache updates (V4.1: the whole step, embedding to head) is one pure function (`span`),
run through step_graphs.SegmentGraphs: a CUDA graph on CUDA once a token count is warm, eager otherwise (same
results bit for bit). Results equal the reference path to round-off (tests compare logits and cache states). The
host makes every index list of a segment as int64 arrays (`Deferred`: windows' (base, lo) rows, pool starts /
counts, compressor rows) and sends them in ONE copy (`BatchPlan.layout`, then `send`) into a buffer the graph reads
in place; the window indices and RoPE rotations are computed from them inside the graph; no host syncs here.

Cost per layer: O(T * (W + k) * D) attention reads; per step O(T * D) cache writes per layer, plus moving rows
into a slot when a sequence arrives from the reference path or its window reaches the end of its slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from deepinfer_sg.kernels import sparse_attention
from deepinfer_sg.kernels.backend import use_triton

from . import compress_step, projections, streams
from .arena import arena_for
from .attention import rope_inside
from .compressor import Sources
from .engram import WindowSource
from .indexer import fused_scores, select_ids, step_queries
from .mhc import ReadOut, hc_post, hc_post_and_mixes, hc_pre, join_mixes
from .rope import Turns, step_turns, turn_table
from .transfer import ragged_arange, to_device_many

MAX_FAST_ROWS = 16   # chunks up to this many rows use the batched path (decode, verify); longer ones: reference


@dataclass
class Deferred:
    """A host int64 array on its way to the device: every one made during a step's host preparation goes up in
    ONE copy (`BatchPlan.layout` / `send`); `plan.resolve(d)` is then its device view."""
    k: int
    shape: tuple


class SeqArrays(NamedTuple):
    """Per sequence of a step, int64 arrays (as Model's _Seq names them): its new rows, their offset in the flat
    batch, the position of its first new row."""
    n: np.ndarray
    off: np.ndarray
    start: np.ndarray


@dataclass
class BatchPlan:
    """Host-side layout of one step's rows plus per-step caches of index tensors and pools."""
    arrays: SeqArrays                 # per sequence: new rows, their offset, first position
    row_index: np.ndarray             # per row: its sequence (int64)
    positions: object = None          # [T] on the device (a Deferred until the step's upload, host ids)
    rect_lo: list[int] | None = None  # YOCO mask mode: decoder windows start no earlier than this
    device: torch.device | None = None
    windows: dict = field(default_factory=dict)   # (past lengths, decoder) -> window_index rows [T, 2]
    pools: dict = field(default_factory=dict)     # (kind, layer) -> (pool, start [T], count [T], G)
    topk: dict = field(default_factory=dict)      # eager index-source layer -> entry ids [T, k'] ascending, -1
                                                  # padded (None: empty pool)
    cand: dict = field(default_factory=dict)      # candidate-source layer -> bool [T, G]
    # the window slab (prepare_windows, engine/arena.py): win_all [L, slots, cap, D]; sequence s's slot win_slot[s]
    # holds its past rows up to row win_end[s] (win_m[s] rows), its new rows follow; win_lens[s] = per-layer past
    # window lengths, or None when all L layers hold win_m[s] rows (the sequence's WindowStack)
    win_all: torch.Tensor | None = None
    win_slab: object = None                       # the WindowSlab of win_all
    win_held: bool = False                        # every sequence's stack in its slot, held (WindowSlab.held)
    win_slot: list = field(default_factory=list)
    win_end: list = field(default_factory=list)
    win_m: list = field(default_factory=list)
    win_lens: list = field(default_factory=list)
    win_new_rows: Deferred | None = None          # [T] row of each new token in win_all[layer].view(slots * cap, D)
    win_uniform: bool = False                     # every win_lens entry is None
    pending: list = field(default_factory=list)   # (Deferred.k, host int64 array) waiting for the next layout
    views: dict = field(default_factory=dict)     # Deferred.k -> device view after its layout
    laid: dict = field(default_factory=dict)      # Deferred.k -> (host array, offset) laid out, not sent yet
    sends: list = field(default_factory=list)     # the laid-out uploads' send() calls
    deferred: int = 0                             # Deferred handles made so far
    flushes: int = 0                              # uploads laid out so far

    @cached_property
    def spans(self) -> list[tuple[int, int, int]]:
        """(start position, row offset, rows) per sequence (the compressors' input layout: the eager path's)."""
        ns, offs, starts = self.arrays
        return list(zip(starts.tolist(), offs.tolist(), ns.tolist()))

    def defer(self, arr) -> Deferred:
        """A host int64 array (numpy / list) for the step's next upload."""
        a = np.asarray(arr, dtype=np.int64)
        d = Deferred(self.deferred, a.shape)
        self.deferred += 1
        self.pending.append((d.k, a))
        return d

    def fill(self, d: Deferred, arr) -> None:
        """Set the values of a Deferred made with placeholder values (the token ids' slot, filled at launch),
        before its upload is sent (pending, or laid out by `layout` and not sent yet)."""
        a = np.asarray(arr, dtype=np.int64)
        if a.shape != d.shape:
            raise ValueError(f"fill: {a.shape} values for a slot of shape {d.shape}")
        for k, (dk, _) in enumerate(self.pending):
            if dk == d.k:
                self.pending[k] = (dk, a)
                return
        if d.k not in self.laid:
            raise RuntimeError(f"fill: slot {d.k} was already uploaded")
        flat, at = self.laid[d.k]
        flat[at:at + a.size] = a.reshape(-1)

    @cached_property
    def row_positions(self) -> np.ndarray:
        """Each row's position, int64 [T] on the host (made once per step)."""
        ns, _, starts = self.arrays
        return ragged_arange(starts, ns)

    def per_row(self, per_seq: list[list[int]], device=None) -> list[Deferred]:
        """Per-sequence host lists spread to per-row int64 arrays (device views after the next layout)."""
        return [self.defer(np.asarray(ps, dtype=np.int64)[self.row_index]) for ps in per_seq]

    def upload(self, parts: list, device=None) -> list[Deferred]:
        """Host int64 arrays for the next layout."""
        return [self.defer(p) for p in parts]

    def layout(self, graphs, device) -> None:
        """Lay the pending arrays out in one upload (SegmentGraphs.prepare_upload: under CUDA graphs a persistent
        buffer of this token count, whose views the graphs read in place): their device views exist from now on
        (`resolve`), their values go up at `send` (until then `fill` may still set a slot)."""
        if not self.pending:
            return
        layout = "_".join("x".join(map(str, a.shape)) for _, a in self.pending)     # (same name: same offsets)
        name = f"plan{self.flushes}:{layout}"
        # the arrays go straight into the upload's pinned buffer (its send, at launch, then copies nothing on the
        # host; the copy to the device itself costs the host ~6 us for 5 or 100 KB, session 11 R2 on the H200)
        size = sum(a.size for _, a in self.pending)
        host = graphs.host_buffer(name, (size,), torch.int64, device)
        if host is None:
            host = torch.empty(size, dtype=torch.int64)
        flat = host.numpy()
        np.concatenate([a.reshape(-1) for _, a in self.pending], out=flat)
        views, send = graphs.prepare_upload(name, host, device, [a.shape for _, a in self.pending])
        at = 0
        for (k, a), v in zip(self.pending, views):
            self.views[k] = v
            self.laid[k] = (flat, at)
            at += a.size
        self.pending = []
        self.flushes += 1
        self.sends.append(send)

    def send(self) -> None:
        """Copy the laid-out uploads to the device (their values as they are now)."""
        for send in self.sends:
            send()
        self.sends = []
        self.laid = {}

    def resolve(self, x):
        """The device view of a Deferred (after its layout); anything else as it is."""
        if isinstance(x, Deferred):
            return self.views[x.k]
        return x


def make_plan(ns: np.ndarray, offs: np.ndarray, starts: np.ndarray, rect_lo: list | None, device) -> BatchPlan:
    """The plan of a step's sequences from their rows, offsets and start positions (int64 arrays: kept as the
    plan's `arrays`) and YOCO's rect_lo (None: off); positions come with the step's upload."""
    return BatchPlan(SeqArrays(ns, offs, starts), np.repeat(np.arange(len(ns), dtype=np.int64), ns), rect_lo=rect_lo,
                     device=torch.device(device))


def usable(model, chunks_rows: np.ndarray) -> bool:
    """Whether a step can take the batched path (short chunks: `chunks_rows` int64, no YOCO compaction)."""
    return (getattr(model, "fast_decode", True) and model.yoco_mode != "compact"
            and int(chunks_rows.max()) <= MAX_FAST_ROWS)


# ------------------------------------------------------------------------------------------------ index tensors
def window_index(plan: BatchPlan, past_lens, W: int, decoder: bool) -> Deferred:
    """Each row's (first, skip) for the attention kernel's window gather (host arithmetic, uploaded with the step's
    other index lists).

    Sequence s's key at position kp sits at row slot_s * cap + win_end[s] + (kp - start_s) of the flat window pool
    win_all[layer].view(slots * cap, D): base = slot_s * cap + win_end[s] - start_s. A row at position p sees key
    positions p-W+1 .. p that still exist (>= lo = start - past_lens[s]) and, for YOCO decoder layers, are
    >= rect_lo: its key j (position p - W + 1 + j) is at first + j = base + p - W + 1 + j, when j >= skip =
    lo - p + W - 1. past_lens: per sequence, or None for plan.win_m (every layer of every sequence alike: the key of
    the step's one list, without hashing a tuple per layer)."""
    key = (None if past_lens is None else tuple(past_lens), decoder)
    if key in plan.windows:
        return plan.windows[key]
    cap = plan.win_all.shape[2]
    starts = plan.arrays.start
    base = np.asarray(plan.win_slot, dtype=np.int64) * cap + np.asarray(plan.win_end, dtype=np.int64) - starts
    lo = starts - np.asarray(plan.win_m if past_lens is None else past_lens, dtype=np.int64)
    if decoder:
        lo = np.maximum(lo, np.asarray(plan.rect_lo, dtype=np.int64))
    p = plan.row_positions - (W - 1)
    plan.windows[key] = rows = plan.defer(np.stack([base[plan.row_index] + p, lo[plan.row_index] - p], axis=1))
    return rows


def prepare_windows(model, ctx, plan: BatchPlan, like: torch.Tensor) -> None:
    """Place this step's sequences in the model's window slab (engine/arena.py; dtype/device of `like`) and record
    where their rows go. A sequence whose stack already lives in its slot costs nothing (unless its rows must move
    to the slot's start: once every ~cap - keep steps); windows from elsewhere (the reference path, a copy) are
    copied in, right-aligned at the same row for every layer. Once per step. The common case (the caches of the last
    step, each holding its stack: WindowSlab.held) is numpy over the slab's per-slot arrays."""
    from .arena import window_slab
    L = len(model.layers)
    slab = window_slab(model, like, MAX_FAST_ROWS)
    caches = ctx.caches
    plan.win_slab, data, cap = slab, slab.data, slab.cap
    held = slab.held(caches)
    if held is not None:
        lo, hi = slab.lo[held], slab.hi[held]
        for k in np.flatnonzero(hi + plan.arrays.n > cap).tolist():   # (rare: see below)
            slot, m = int(held[k]), int(hi[k] - lo[k])
            data[:, slot, :m] = data[:, slot, lo[k]:hi[k]].clone()
            lo[k], hi[k] = slab.lo[slot], slab.hi[slot] = 0, m
        plan.win_all, plan.win_slot, plan.win_end, plan.win_m = data, held, hi, hi - lo
        plan.win_lens, plan.win_uniform, plan.win_held = [None] * len(caches), True, True
        plan.win_new_rows = plan.defer(ragged_arange(held * cap + hi, plan.arrays.n))
        return
    ends, ms, lens = [], [], []
    slots = slab.slots_for(caches)     # (may grow the slab: read slab.data after this)
    data = slab.data
    for s, slot in zip(ctx.seqs, slots):
        st = s.cache.windows
        if st is not None and st.attached == L:
            m = st.m
            if st.slab is slab and st.slot == slot:
                end = st.hi
                if end + s.n > cap:        # move the kept rows to the slot's start
                    data[:, slot, :m] = data[:, slot, st.lo:st.hi].clone()
                    st.lo, st.hi = 0, m
                    end = m
            else:                          # a stack in another buffer
                if m:
                    data[:, slot, :m] = st.t
                end = m
            lens.append(None)
        else:                              # per-layer windows (possibly of different lengths)
            ls = [0 if lc.win is None else lc.win.shape[0] for lc in s.cache.layers]
            m = end = max(ls)
            for k, lc in enumerate(s.cache.layers):
                if ls[k]:
                    data[k, slot, m - ls[k]:m] = lc.win.clone()   # (clone: it may be a view of this slot)
            lens.append(ls)
        ends.append(end)
        ms.append(m)
    plan.win_all, plan.win_slot, plan.win_end, plan.win_m, plan.win_lens = data, slots, ends, ms, lens
    plan.win_uniform = all(ls is None for ls in lens)
    first = np.asarray(slots, dtype=np.int64) * cap + np.asarray(ends, dtype=np.int64)
    plan.win_new_rows = plan.defer(ragged_arange(first, plan.arrays.n))    # (row j of sequence s: first[s] + j)


_POOL_STATES = {   # pool kind -> (the arena's part name, the row attribute, the state holding it)
    "comp": ("comp", "entries", lambda lc: lc.comp),
    "icomp": ("icomp", "entries", lambda lc: lc.icomp),
    "ikeys": ("layer", "ikeys", lambda lc: lc),
}


def pool(model, plan: BatchPlan, seqs, kind: str, layer: int, device, dtype=None):
    """(pool [P, D] | None, start [T], count [T], G = largest count) of one per-sequence row kind, cached: the
    layer's arena (engine/arena.py) as it is. Rows that live elsewhere (fresh from the reference path, before the
    layer's first append on this path) are moved into the arena first, so a pool keeps its address from step to
    step (CUDA graphs read it in place)."""
    key = (kind, layer)
    if key not in plan.pools:
        part, name, state_of = _POOL_STATES[kind]
        states = [state_of(s.cache.layers[layer]) for s in seqs]
        tups = [getattr(st, "_" + name) for st in states]
        counts = [0 if t is None else t[2] for t in tups]
        G = max(counts)
        if G == 0:
            P, starts = None, [0] * len(seqs)
        else:
            like = next(t[0] for t in tups if t is not None and t[2])
            P, starts = arena_for(model, layer, part, name, like).append(states, like[:0], [0] * len(states))
        plan.pools[key] = (P, *plan.per_row([starts, counts], device), G)
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
    """Batched `Model._update_compressed`: the same state changes for every sequence of the step. The appends
    leave every sequence's entries / index keys in one buffer, which becomes the layer's pool for this step."""
    c = model.config
    i = attn.layer_id
    spec = attn.spec
    rot = model._rotator(spec.rope)
    R = model.max_rollback
    spans = plan.spans
    fresh = {}     # kind -> (arena, each sequence's first row in it, counts): this step's pools

    def arena(part):
        return lambda name, like: arena_for(model, i, part, name, like)
    if hasattr(attn, "compressor"):
        states = [s.cache.layers[i].comp for s in ctx.seqs]
        _, got = attn.compressor.step_many(states, x, spans, lambda lat, p: model._qdq(rot(lat, p), "compressed"),
                                           c.compressor_style == "v41", R, arena("comp"))
        if got is not None:
            fresh["comp"] = (*got, [st.n_entries for st in states])
    idx_mod = getattr(attn, "indexer", None)
    if idx_mod is not None and hasattr(idx_mod, "compressor"):
        states = [s.cache.layers[i].icomp for s in ctx.seqs]
        _, got = idx_mod.compressor.step_many(states, x, spans, lambda lat, p: model._qdq(rot(lat, p), "index"),
                                              False, R, arena("icomp"))
        if got is not None:
            fresh["icomp"] = (*got, [st.n_entries for st in states])
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
            gs_t, rows_t = to_device_many([gs, rows], x.device)
            lat = srcs.cat(None, 0)[rows_t]
            ik = model._qdq(rot(idx_mod.k_norm(idx_mod.wk(lat)), gs_t * spec.ratio), "index")
            fresh["ikeys"] = (*arena_for(model, i, "layer", "ikeys", ik).append(lcs, ik, news),
                              [lc.rows("ikeys") for lc in lcs])
    if hasattr(attn, "compressor") or (idx_mod is not None and hasattr(idx_mod, "compressor")
                                       or hasattr(idx_mod, "wk")):
        forget(plan, i)
    for kind, (buf, starts, counts) in fresh.items():   # the arenas are this step's pools (no copy)
        plan.pools[(kind, i)] = (buf, *plan.per_row([starts, counts], x.device), max(counts))


def index_pool(model, attn, ctx, plan):
    """(keys, start [T], count [T], G) the layer's index selection reads: G padded to a power of two (scores past
    a row's count are masked), so a graph segment holding the selection keeps its shapes for many steps."""
    c = model.config
    spec = attn.spec
    kind, src = ("icomp", attn.layer_id) if c.compressor_style == "v4" else ("ikeys", spec.index_k_source)
    keys, start, count, G = pool(model, plan, ctx.seqs, kind, src, plan.device)
    return keys, start, count, (_bucket(G) if G else 0)


def _fit(mask: torch.Tensor, G: int) -> torch.Tensor:
    """Pad / cut a [T, G'] mask to G columns (pools of different sources can differ in their padding)."""
    if mask.shape[1] >= G:
        return mask[:, :G]
    return torch.nn.functional.pad(mask, (0, G - mask.shape[1]), value=False)


def pre_attention(model, block, R: torch.Tensor, a, cos: torch.Tensor, sin: torch.Tensor, e, side: dict | None = None,
                  store: tuple | None = None, x: torch.Tensor | None = None):
    """The dense work of a layer before its attention core, as one pure function (a CUDA-graph segment, see
    step_graphs.py): [Engram mix of the looked-up rows e] -> [DSpark capture] -> attention mHC mixes -> read-out
    -> attn norm -> q / window kv projections -> [index queries on index-source layers]. The projections of the
    norm output run as one GEMM where engine/projections.py stacked them; side["comp"] then gets the in-graph
    compressor's (for compress_step.compress_rows). store = (win_all, new_rows): with model.fused_rope the window
    kv goes straight into its slab rows (Attention.store_kv; kv is then None: `attend` has nothing to write).
    x: the read-out hc_pre(R, a), when the write-back before made it (post_attention), or a mhc.ReadOut holding
    attn_norm(read-out) and this layer's attention mixes; unused after an Engram mix.
    -> (R, pre, post, comb, xn, q, kv, iq, w, feat); iq / w / feat None where the layer has none."""
    c = model.config
    i = block.layer_id
    attn = block.attn
    mixes = xn = None
    if isinstance(x, ReadOut):      # (its x is this layer's attn_norm output: the write-back normalised it)
        xn, mixes, x = x.x, x[1:], None
    if e is not None:
        R = block.engram.mix(R, e)
        x = xn = mixes = None     # (the streams changed)
    # (the mean accumulated in fp32 without an fp32 copy of R: on CUDA one launch, which sums in fp32 and rounds
    # once to R's dtype; the CPU's reduction of a bf16 R may round its sum first: 2 launches there)
    feat = None if i not in c.dspark_target_layer_ids else R.mean(dim=1) if R.is_cuda \
        else R.mean(dim=1, dtype=torch.float32).to(R.dtype)
    pre, post, comb = mixes if mixes is not None else block.mixes(R, "attn", True)
    if xn is None:
        xn = block.attn_norm(x if x is not None else hc_pre(R, a if c.hc_shifted else pre, fast=model.fused_mhc))
    parts = (None if model.quant_sim or not model.stack_projections   # [q_a, kv, (w), (the compressor's)]
             else projections.xn_products(model, attn, xn))
    inside = rope_inside(model)
    xkv = None if parts is None else parts[1]
    pool = None if store is None else window_pool(store[0], i)
    stored = pool is not None and inside and pool.dtype == xn.dtype
    if stored and parts is not None:     # (q_norm and the window kv's store in one launch: kernels.rmsnorm's pair)
        q, qr = attn.project_q_store_kv(xn, cos, sin, pool, store[1], parts[0], xkv, rope=not inside)
    else:
        q, qr = attn.project_q(xn, cos, sin, xa=None if parts is None else parts[0], rope=not inside)
        if stored:
            attn.store_kv(xn, cos, sin, pool, store[1], xkv=xkv)
    kv = None if stored else model._qdq(attn.project_kv(xn, cos, sin, xkv=xkv), "window")
    iq = w = None
    index = attn.spec.index_source == i
    if parts is not None and side is not None and len(parts) > 2 + index:
        side["comp"] = parts[2 + index:]
    if index:
        iq, w = step_queries(model, attn.indexer, qr, xn, cos, sin, None if parts is None else parts[2])
    return R, pre, post, comb, xn, q, kv, iq, w, feat


def post_attention(model, block, o: torch.Tensor, R: torch.Tensor, pre: torch.Tensor, post: torch.Tensor,
                   comb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_ids: torch.Tensor):
    """The dense work of a layer after its attention core (a CUDA-graph segment): output projection, mHC write-back,
    then the whole MoE sub-layer. With model.fused_mhc (shifted mHC only) the
    write-backs and read-outs are the fused kernels: the attention write-back also reads out the MoE input (its
    pre-mix is known, shifted schedule) and computes the MoE sub-layer's mixes from the R' it wrote
    (mhc.hc_post_and_mixes), and the MoE write-back reads out the next sub-layer's input the same way, with the
    next layer's attention mixes where nothing changes R in between (no Engram mix there: the read-out is then a
    mhc.ReadOut for its pre_attention). -> (R, a, that read-out or None)."""
    y = block.attn.output(o, cos, sin, rope=not rope_inside(model))
    # the grouped expert kernel bypasses the experts' Linear modules, so not with quant_sim's input hooks
    fast_moe = not model.quant_sim
    if not (model.fused_mhc and model.config.hc_shifted):
        R = hc_post(R, y, post, comb)
        return (*block.ffn_sublayer(R, pre, token_ids, fast=True, fast_moe=fast_moe), None)
    R, (xn, pre_f, post_f, comb_f) = hc_post_and_mixes(block, "ffn", R, y, post, comb, pre, norm=block.ffn_norm)
    y, y2 = block.ffn.forward_grouped(xn, token_ids, parts=True) if fast_moe else (block.ffn(xn, token_ids), None)
    j = block.layer_id + 1
    # the next layer's attention mixes from this write-back unless an Engram mix changes R first (a step's graph is
    # cut, if at all, only before Engram layers, so the ReadOut always reaches the next layer's pre_attention)
    if j < len(model.layers) and not hasattr(model.layers[j], "engram"):
        R, x = hc_post_and_mixes(model.layers[j], "attn", R, y, post_f, comb_f, pre_f, y2=y2,
                                 norm=model.layers[j].attn_norm)
    else:
        R, x = hc_post(R, y, post_f, comb_f, fast=True, next_pre=pre_f, y2=y2)
    return R, pre_f, x


def core_kind(attn) -> str:
    """What a layer's attention reads besides its window: "window" (nothing), "select" (entries it selects itself
    from its index pool), "consumer" (entries an earlier layer selected), "all" (every visible entry)."""
    spec, i = attn.spec, attn.layer_id
    if spec.ratio == 0:
        return "window"
    if spec.index_source is None:
        return "all"
    return "select" if spec.index_source == i else "consumer"


def grows(attn) -> bool:
    """Whether a layer's core grows caches by host-known amounts (a compressor, index keys, an index compressor):
    that part (`update_compressed`) runs eagerly between two graph segments."""
    idx = getattr(attn, "indexer", None)
    return hasattr(attn, "compressor") or (idx is not None and (hasattr(idx, "compressor") or hasattr(idx, "wk")))


def _structural(model, name: str, make):
    """make(model), kept in the model's attribute `name` while model.layers is the same object (a fact fixed by the
    model's structure, asked on every step's host path: computed once)."""
    got = model.__dict__.get(name)
    if got is None or got[0] is not model.layers:
        got = model.__dict__[name] = (model.layers, make(model))
    return got[1]


def eager_layers(model) -> list[int]:
    """Layers whose cache updates run eagerly between graph segments (those compress_step cannot run inside the
    graph: V4's overlapping compressors and index compressors). V4.1: none (its graph is cut only before Engram
    layers: `engram_splits`)."""
    def make(m):
        graph = set(compress_step.graph_layers(m))
        return [i for i, blk in enumerate(m.layers) if i not in graph and grows(blk.attn)]
    return _structural(model, "_eager_layers", make)


def select_layers(model) -> frozenset:
    """The layers whose attention selects its own entries (`core_kind` "select": a segment returns their ids)."""
    return _structural(model, "_select_layers",
                       lambda m: frozenset(i for i, blk in enumerate(m.layers) if core_kind(blk.attn) == "select"))


# a segment that starts or ends between two layers (not inside one): `span`'s prev_e / next_e
BOUNDARY = "layer boundary"


class Handoff(NamedTuple):
    """What a segment ending at a BOUNDARY hands the next one (V4.1: the cuts before Engram layers). It travels in
    the first four slots of the layer chain (R, pre, post, comb: the graph runner takes tensors in order), so
    `span` names them on both sides. turns: the step's rotations made once by its first segment
    (rope.step_turns' table, the rows of Model._turn_kinds)."""
    R: torch.Tensor
    a: torch.Tensor
    x: torch.Tensor
    turns: torch.Tensor


def engram_layers(model) -> list[int]:
    """The layers with an Engram module (a hasattr per layer would cost a failed nn.Module attribute lookup each)."""
    return _structural(model, "_engram_layers",
                       lambda m: [i for i, blk in enumerate(m.layers) if hasattr(blk, "engram")])


def engram_on_device(model) -> list[int]:
    """The Engram layers whose table rows the device reads inside the step's graph (EngramTable.device_arrays: an
    in-memory FP8 table, pinned on CUDA; model.engram_device_reads on): the token windows go up with the step's
    upload and the device hashes them (Model._plan_fast; with the caches' recent tokens on the device, the host
    hashes them into row ids at launch instead). The others' rows are looked up on the host (Model._engram_rows).
    Empty on CUDA with the kernels forced to their twins (DEEPINFER_SG_KERNELS=torch: the twin gathers on the host)."""
    if not getattr(model, "engram_device_reads", False) or (model.device.type == "cuda"
                                                            and not use_triton(model.embed.weight)):
        return []
    return [i for i in engram_layers(model) if model.layers[i].engram.table is not None
            and model.layers[i].engram.table.device_arrays(model.device) is not None]


def engram_splits(model, on_device: list[int] | None = None) -> list[int]:
    """Layers before which a V4.1 step's graph is cut (each Engram layer but the first layer whose rows the host
    looks up: those the device does not read, `engram_on_device`, or `on_device` when the caller has that list):
    the host looks a segment's Engram rows up while the device runs the segments before it, so only the first
    segment waits for the host after the token ids are known (Model._layers_fast). None ([]) when the model has
    eager layers (V4)."""
    if eager_layers(model):
        return []
    on_device = engram_on_device(model) if on_device is None else on_device
    return [i for i in engram_layers(model) if i > 0 and i not in on_device]


def span(model, prev_e, full, next_e, every_row, meta, R, pre, post, comb, q, kv, iq, w, token_ids, positions,
         win_all, new_rows, *per):
    """The work between two eager cache updates, as one pure function of its inputs (a CUDA-graph segment, see
    step_graphs.py): the rest of layer `prev_e` (its selection / attention over q, kv, iq, w and the MoE; None: the
    embedding instead; BOUNDARY: nothing, the streams R, pre-mix a = `pre` and read-out x = `post` come from the
    segment before), every layer of `full` whole, then `pre_attention` of layer `next_e` (None: the final
    collapse, norm and, with every_row, the head; BOUNDARY: nothing). meta[k] = (core kind, index G) and
    per[k] = LAYER_INPUTS of each layer with a core here ([prev_e] + full), then next_e's engram rows.
    -> (pre_attention's outputs of next_e, (hidden, logits in the head's dtype or None), or at a BOUNDARY a
    `Handoff`, which the next segment takes in its (R, pre, post, comb) slots), then per core layer its DSpark
    features (None for prev_e), its selected ids and candidate blocks (None where it has none)."""
    layers = model.layers
    c = model.config
    n = len(LAYER_INPUTS)
    n0 = len(ENTRY_INPUTS)
    ids_of, cand_of, extra = {}, {}, []
    # the step's rotations: made by the step's first segment, handed on at a BOUNDARY instead of being made again
    # by every segment
    handed = Handoff(R, pre, post, comb) if prev_e == BOUNDARY else None
    kinds, freqs, ratios = model._turn_kinds()
    tab = handed.turns if handed is not None else step_turns(freqs, ratios, positions)
    turn_of = {kr: Turns(tab[0, c], tab[1, c]) for c, kr in enumerate(kinds)}     # ((rope kind, ratio) -> Turns)
    rope = {k: (turn_of[(k, 1)], None) for k in ("main", "compress")}
    inside = rope_inside(model)

    def core(k, j, q, kv, iq, w):
        e, win_rows, kv_pool, kv_start, kv_count, ids, keys, kstart, kcount, cand = per[n * k:n * k + n0]
        kind, G = meta[k]
        attn = layers[j].attn
        spec = attn.spec
        cand_j = visible = None
        if kind == "select":
            ids = None
            if G:
                if spec.candidate_source is not None and cand is None:
                    cand = _fit(cand_of[spec.candidate_source], G)
                ids, cand_j = select_ids(attn.indexer, iq, w, keys, kstart, kcount, positions, spec.ratio, G,
                                         c.index_topk, cand, rope[spec.rope] if fused_scores(model, iq) else None,
                                         (c.candidate_block_size, c.candidate_topk_blocks)
                                         if j == c.candidate_source_layer_id else None)
            elif j == c.candidate_source_layer_id:
                cand_j = torch.zeros((q.shape[0], 0), dtype=torch.bool, device=q.device)
            ids_of[j], cand_of[j] = ids, cand_j
        elif kind == "consumer" and ids is None:
            ids = ids_of.get(spec.index_source)
        elif kind == "all" and kv_pool is not None:
            visible = (positions, spec.ratio, G)        # (every entry the row sees: the kernel makes their ids)
        extra.extend([ids if kind == "select" else None, cand_j])
        entries = kv_pool is not None and (ids is not None or visible is not None)   # (the kernel makes pool rows)
        return attend(attn, q, kv, win_all, new_rows, win_rows, kv_pool if entries else None, ids if entries else None,
                      kv_start, kv_count, turn_table(*rope[spec.rope]) if inside else None, visible)

    feats = []
    first = 0 if prev_e is None or prev_e == BOUNDARY else 1
    engram_in = {k: _engram_input(per[n * k], token_ids) for k in range(first, first + len(full))}
    ahead = _engram_ahead(model, full, engram_in, token_ids)
    if prev_e is None:
        R, a = model.embed_streams(token_ids, reuse=True)
        x = None
    elif handed is not None:
        R, a, x = handed.R, handed.a, handed.x
    else:
        blk = layers[prev_e]
        o = core(0, prev_e, q, kv, iq, w)
        feats.append(None)
        R, a, x = post_attention(model, blk, o, R, pre, post, comb, *rope[blk.attn.spec.rope], token_ids)
    for k, j in enumerate(full, start=first):
        blk = layers[j]
        cs = rope[blk.attn.spec.rope]
        side = {}
        if k in ahead:      # (read on the Engram lane at the segment's start: wait for it here)
            e, done, _ = ahead[k]
            streams.wait(done)
        else:
            e = engram_in[k]
        R, pre, post, comb, xn, q, kv, iq, w, feat = pre_attention(model, blk, R, a, *cs, e, side,
                                                                   (win_all, new_rows), x)
        feats.append(feat)
        cmp = per[n * k + n0:n * k + n]
        if cmp[compress_step.INPUTS.index("ent")] is not None:    # the compressor's cache rows (compress_step)
            compress_step.compress_rows(model, blk.attn, xn, *cmp, proj=side.get("comp"),
                                        turn=turn_of[(blk.attn.spec.rope, blk.attn.compressor.ratio)])
        o = core(k, j, q, kv, iq, w)
        R, a, x = post_attention(model, blk, o, R, pre, post, comb, *cs, token_ids)
    tail = [t for f, i2, c2 in zip(feats, extra[0::2], extra[1::2]) for t in (f, i2, c2)]
    if ahead:
        streams.join(next(iter(ahead.values()))[2])
    if next_e == BOUNDARY:
        out = Handoff(R, a, x, tab)
    elif next_e is None:
        hfin = x if x is not None else model.collapse_streams(R, a)    # (shifted mHC: the last read-out)
        # (the logits in the head's dtype: the caller's conversion to fp32 is also their copy out of a graph's buffer)
        out = (hfin, model.head(model.norm(hfin)) if every_row else None)
    else:
        blk = layers[next_e]
        out = pre_attention(model, blk, R, a, *rope[blk.attn.spec.rope], _engram_input(per[-1], token_ids), None,
                            (win_all, new_rows), x)
    join_mixes()     # (mHC mixes deferred to the side stream and not read here: joined before the segment ends)
    return (*out, *tail)


def _engram_ahead(model, full, engram_in: dict, token_ids) -> dict:
    """The Engram rows of the segment's layers `full` that the device reads from the windows (a window source input:
    engram_in, each layer's `_engram_input` by its index k in the segment, in order), read on a lane of their own
    (engine/streams.py) as the segment starts, so that their reads over PCIe overlap the layers before them instead
    of stalling the layer that needs them: {k: (rows, event after them, the lane)} ({} on the CPU: the layers read
    them in turn)."""
    got = {}
    lane = None
    for (k, e), j in zip(engram_in.items(), full):
        if not isinstance(e, WindowSource):
            continue
        if lane is None:
            lane = streams.fork(token_ids, "engram")
            if lane is None:
                return {}
        with streams.on(lane):
            rows = model.layers[j].engram.device_rows(e)
        got[k] = (rows, streams.mark(lane), lane)
    return got


def _engram_input(e, token_ids):
    """A layer's Engram input as `pre_attention` takes it: the step's window source (int64 [2, T, N], made by
    Model._plan_fast for the layers the device hashes) with the step's token ids, or e as it is (rows / row ids)."""
    return WindowSource(e, token_ids) if e is not None and e.dim() == 3 and e.dtype == torch.int64 else e


# a layer's inputs to `span`: engram rows, window rows, kv pool + each row's start / count in it, the ids of an
# index source selected before the segment, and for a "select" layer its index keys + start / count + the
# candidate mask when its candidate source selected before the segment
ENTRY_INPUTS = ("e", "win_rows", "kv_pool", "kv_start", "kv_count", "ids", "keys", "kstart", "kcount", "cand")
LAYER_INPUTS = ENTRY_INPUTS + compress_step.INPUTS     # then a compressing layer's compress_step inputs


def span_inputs(model, attn, ctx, plan):
    """The host side of one layer's core in a `span`: its ENTRY_INPUTS (device tensors made from host-side lengths
    and this step's earlier selections, plan.topk / plan.cand, when made before this segment; None where the layer
    has none) and its meta (core kind, G of its index pool or of its all-visible entries)."""
    j, spec = attn.layer_id, attn.spec
    kind = core_kind(attn)
    dev = plan.device
    got = dict.fromkeys(ENTRY_INPUTS)
    got["e"] = ctx.engram_rows.get(j)
    got["win_rows"] = window_rows(model, attn, plan)
    G = 0
    if kind != "window":
        P, start, count, Gk = pool(model, plan, ctx.seqs, "comp", spec.kv_source, dev, plan.win_all.dtype)
        if Gk:
            got.update(kv_pool=P, kv_start=start, kv_count=count)
        if kind == "consumer":
            got["ids"] = plan.topk.get(spec.index_source)
        elif kind == "all":
            G = _bucket(Gk) if Gk else 0
        elif kind == "select":
            keys, kstart, kcount, G = index_pool(model, attn, ctx, plan)
            got.update(keys=keys, kstart=kstart, kcount=kcount)
            if G and spec.candidate_source is not None and spec.candidate_source in plan.cand:
                got["cand"] = _fit(plan.cand[spec.candidate_source], G)
    cmp = ctx.compress.get(j)
    return [got[n] for n in ENTRY_INPUTS] + (cmp or [None] * len(compress_step.INPUTS)), (kind, G)


def attend(attn, q: torch.Tensor, kv: torch.Tensor, win_all: torch.Tensor, new_rows: torch.Tensor,
           win_rows: torch.Tensor, cmp_pool, ids, start, count, turn: torch.Tensor | None = None,
           visible: tuple | None = None) -> torch.Tensor:
    """Write this step's window rows kv [T, D] into the slab (rows new_rows of layer attn.layer_id; kv None: already
    written, pre_attention's `store`) and attend: q [T, nh, D] over its window keys (`window_index`'s rows [T, 2]:
    the kernel makes each row's W key rows from its (first, skip)) and the compressed entries ids [T, w] of cmp_pool
    (row t's at pool rows start[t] + id for 0 <= id < count[t]; -1 = none; or with visible = (positions, ratio, G)
    every entry id g < G with g < (p + 1) // ratio) -> [T, nh, D]. turn: the rows' RoPE turns (rope.turn_table)
    when q comes before its RoPE (attention.rope_inside): the kernel turns q and turns its output back."""
    win_pool = window_pool(win_all, attn.layer_id)
    if kv is not None:
        win_pool.index_copy_(0, new_rows, kv.to(win_pool.dtype))
    entries = cmp_pool is not None
    return sparse_attention(q, win_pool, win_rows, attn.attn_sink, cmp_pool, ids, scale=attn.scale,
                            cmp_start=start if entries else None, cmp_count=count if entries else None, turn=turn,
                            window=attn.config.sliding_window, visible=visible)


def window_pool(win_all: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer`'s part of the window slab [L, slots, cap, D] as one flat pool [slots * cap, D] (a view)."""
    _, S, cap, D = win_all.shape
    return win_all[layer].view(S * cap, D)


def window_rows(model, attn, plan: BatchPlan) -> Deferred:
    """The layer's `window_index` rows (shared by the layers with the same past lengths)."""
    c = model.config
    i = attn.layer_id
    if plan.win_uniform:      # every sequence's layers hold win_m rows: the same list for all layers
        past_lens = None
    else:
        past_lens = [m if ls is None else ls[i] for m, ls in zip(plan.win_m, plan.win_lens)]
    decoder = model.yoco_mode != "off" and c.n_prefill_layer is not None and i >= c.n_prefill_layer
    return window_index(plan, past_lens, c.sliding_window, decoder)


def _bucket(n: int) -> int:
    """n rounded up to a power of two (>= 16)."""
    b = 16
    while b < n:
        b *= 2
    return b


def commit_windows(model, ctx, plan: BatchPlan) -> None:
    """Advance every sequence's windows to the end of this step: its WindowStack points at its slab slot (rows
    written in place this step; no copies; when the plan found every stack held, numpy over the slab's per-slot
    arrays). A sequence whose layers held windows of different lengths (after a YOCO-compacted prefill) gets one
    view per layer instead."""
    if plan.win_all is None:
        return
    from .cache import WindowStack
    keep = model.config.sliding_window - 1 + model.max_rollback
    slab, win = plan.win_slab, plan.win_all
    if plan.win_held:
        end = plan.win_end + plan.arrays.n
        slab.lo[plan.win_slot] = np.maximum(slab.lo[plan.win_slot], end - keep)
        slab.hi[plan.win_slot] = end
        return
    stacks = []
    for b, (s, slot, end, ls) in enumerate(zip(ctx.seqs, plan.win_slot, plan.win_end, plan.win_lens)):
        end += s.n
        st = s.cache.windows
        if ls is None and st is not None and st.slab is slab and st.slot == slot:
            if end - keep > st.lo:
                st.lo = end - keep
            st.hi = end
        elif ls is None or len(set(ls)) == 1:
            m = plan.win_m[b] if ls is None else ls[0]
            st = WindowStack(slab, slot)
            st.lo, st.hi = max(0, end - min(keep, m + s.n)), end
            for k, lc in enumerate(s.cache.layers):
                lc.attach(st, k)
            s.cache.windows = st
        else:
            for k, lc in enumerate(s.cache.layers):
                lc.win = win[k, slot, end - min(keep, ls[k] + s.n):end]
            s.cache.windows = st = None
        stacks.append(st)
    if None not in stacks:
        slab.hold(stacks, plan.win_slot)
