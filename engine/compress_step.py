"""The compressors' cache updates of V4.1's kv-source layers inside the decode step's CUDA graph.

Why: a compressor grows its caches by amounts the host decides (a ratio-2 group completes every other token), so
these updates used to run eagerly between graph segments (batched.update_compressed: a projection, gathers of the
open groups' token rows, appends), splitting a decode step into 4 graphs plus ~40 small launches and copies.
Here the work is made fixed-size per token, so it runs inside the one graph of the step:
  * every token row computes "its" group's entry: the group g = p // r its position p falls in, pooled from the
    ratio's token rows (its own and the earlier ones of the group, this step's or a previous step's); only a row
    that completes its group (p % r == r - 1) writes it to the group's arena row, the others write to the arena's
    dump row (engine/arena.py), so the shapes are [T, ...] whatever completes;
  * a gated compressor's per-token kv / gate projections live in a RING of `RING` rows per sequence at fixed
    addresses (position p at row p % RING of the sequence's slot), written in place every step; no buffer is
    rebuilt per step. The states point at their rows as (ring, first row, rows, RING) (cache.py reads them with
    a gather). RING covers a rollback of max_rollback tokens plus a step of MAX_FAST_ROWS rows plus a group;
  * the V4.1 index keys of a layer that owns them (k_norm(wk(latent)), rotated at the group's position) come from
    the same row's latent, written the same way.
The host side (`plan_layer`, before the graph) only does arithmetic on positions: arena room (growth, rows moved in
from the reference path: rare), each row's destination rows, and the states' counts after the step, written into
each arena's per-slot arrays for all states at once (arena.RowArena.update: each state keeps its slot's
cache.ArenaRows from step to step, so a steady step sets no state attribute but the rings' tok_start).
Same math as Compressor.step_many (the eager path, still used by V4's overlapping compressors and index
compressors), row for row, so results are equal bit for bit (with model.fused_rope on CUDA the entry's and index
key's norm + rotation + write run as one kernels.rmsnorm launch: the same steps and roundings in one kernel).
Cost per layer and step: the projections and one [T, r, W] gather + softmax for T rows (2x the groups that
complete at ratio 2: noise next to the projections), three [T, D] row writes; host: O(T) integer work.
"""
from __future__ import annotations

import itertools
import operator

import numpy as np
import torch

from deepinfer_sg.kernels.ring_pool import ring_pool, ring_pool_torch, ring_write, ring_write_torch
from deepinfer_sg.kernels.rmsnorm import rms_norm

from .arena import arena_for
from .cache import set_each
from .rope import apply_rope, turn_table

RING = 64    # >= max_rollback (16) + MAX_FAST_ROWS (16) + ratio: rows a rollback or this step can still need

# a layer's inputs to compress_rows (after batched.ENTRY_INPUTS in `span`'s per-layer inputs); None where absent
INPUTS = ("ring_kv", "ring_g", "tok_kv_dst", "tok_g_dst", "grp_kv", "grp_g", "ent", "ent_dst", "lat", "lat_dst",
          "ik", "ik_dst")


def in_graph(model, attn) -> bool:
    """Whether a layer's cache updates run here (inside the step's graph): V4.1 compressors (no overlap, no ape),
    with index keys only from the layer's own latents. Otherwise batched.update_compressed runs them eagerly."""
    comp = getattr(attn, "compressor", None)
    idx = getattr(attn, "indexer", None)
    if comp is None or model.config.compressor_style != "v41" or comp.overlap or comp.ape is not None:
        return False
    if idx is not None and hasattr(idx, "compressor"):
        return False
    return not (idx is not None and hasattr(idx, "wk") and attn.spec.kv_source != attn.layer_id)


def graph_layers(model) -> list[int]:
    """The layers whose cache updates run here (fixed by the model's structure: computed once)."""
    got = model.__dict__.get("_compress_graph_layers")
    if got is None or got[0] is not model.layers:
        got = model.__dict__["_compress_graph_layers"] = (
            model.layers, [i for i, blk in enumerate(model.layers) if in_graph(model, blk.attn)])
    return got[1]


# a state's token rows as plan_layer reads them on its slow path (for both rings, the rows it keeps, the undo log)
_TOK_FIELDS = ("tok_start", "_tok_kv", "_tok_gate")
_TOK = operator.attrgetter(*_TOK_FIELDS)
_TOK_START = operator.attrgetter("tok_start")
_LAYERS, _COMP = operator.attrgetter("layers"), operator.attrgetter("comp")


def _ring_move_in(arena, states, slots, toks, which: int) -> None:
    """Rows of a state's token rows (`toks`: its (tok_start, tok_kv, tok_gate) tuple, `which` 1 or 2) held
    elsewhere (the reference path's tensors, an eager gather buffer) are copied into its ring slot at their
    positions' ring rows (one gather + one index_copy for all such states)."""
    flat = arena.flat
    moved, dst = [], []
    for st, tk, slot in zip(states, toks, slots):
        t = tk[which]
        if t is None or not t[2] or (t[0] is flat and len(t) == 4 and t[1] // RING == slot):
            continue
        moved.append(getattr(st, _TOK_FIELDS[which][1:]))
        dst.extend(slot * RING + p % RING for p in range(tk[0], tk[0] + t[2]))
    if moved:
        rows = torch.tensor(dst, dtype=torch.long).to(flat.device)
        flat.index_copy_(0, rows, torch.cat(moved).to(flat.dtype))
        arena.moved_rows += len(dst)


def _rings(model, i, comp, states, starts, ends, dev, log):
    """The gated compressor's two token-row rings of layer i (`RING` rows a slot), every state then holding the
    rows it keeps after the step -> (rings, each state's slot in each (int64), where each state keeps from).
    The common case (`RowArena.held`: the same states, each holding its slots' objects) reads no state: a state's
    ring rows end at its length (`held` below), and tok_start is written for all at once."""
    f32 = torch.empty((0, comp.wkv.weight.shape[0]), dtype=torch.float32, device=dev)
    rings = tuple(arena_for(model, i, "comp", name, f32, ring=RING) for name in ("tok_kv", "tok_gate"))
    slots = [a.held(states) for a in rings]
    fast = slots[0] is not None and slots[1] is not None
    if fast:      # (the rows a state holds end at its length: plan_layer / a rollback keep it so)
        held = starts - rings[0].count[slots[0]]
        if log is not None:
            log.append((states, "tok_start", list(map(_TOK_START, states))))
    else:
        slots = [a.slots_for(states, RING) for a in rings]     # (growths first: they re-point the states)
        toks = list(map(_TOK, states))
        if log is not None:
            log.append((states, _TOK_FIELDS, toks))
        for which, (arena, sl) in enumerate(zip(rings, slots), start=1):
            _ring_move_in(arena, states, sl, toks, which)
        held = np.asarray([tk[0] if tk[1] is not None and tk[1][2] else s0 for tk, s0 in zip(toks, starts.tolist())],
                          dtype=np.int64)
    keep = np.maximum(held, comp.keep_from(ends, model.max_rollback))
    set_each(states, "tok_start", keep.tolist())
    out = []
    for arena, sl in zip(rings, slots):
        if not fast:
            sl = arena.hold(states, sl)     # (the old values: logged above)
        arena.update(states, sl, ends - keep, sl * RING + keep % RING, log)
        out.append(sl)
    return rings, out


def plan_layer(model, attn, ctx, plan, log: list | None = None) -> list:
    """Host side of one layer's compressor step for this step's rows (before the graph): arena room, each row's
    destination rows, the states advanced to the end of the step (their rows are written by `compress_rows`),
    the layer's pools in `plan.pools` (what batched.pool would give after the update). log: an undo log
    (arena.undo) that gets every state value changed here as it was (Model.cancel puts them back).
    Host work: numpy over the step's sequences and rows; the states are only read (one identity check an arena,
    RowArena.held) unless a step changed them another way (then RowArena.place's slow path).
    -> the layer's INPUTS (device tensors; the arenas' flat tensors at fixed addresses)."""
    i = attn.layer_id
    comp = attn.compressor
    r, D = comp.ratio, comp.out_dim
    dev = plan.device
    dtype = model.embed.weight.dtype
    lcs = list(map(operator.itemgetter(i), map(_LAYERS, ctx.caches)))
    states = list(map(_COMP, lcs))
    ns, _, starts = plan.arrays
    ends = starts + ns
    counts = ends // r
    G = int(counts.max())
    # per row: its sequence, position, group, whether it completes the group
    seq, pos = plan.row_index, plan.row_positions
    grp = pos // r
    done = pos % r == r - 1
    like = torch.empty((0, D), dtype=dtype, device=dev)
    ent_arena = arena_for(model, i, "comp", "entries", like)
    ent_slots = ent_arena.place(states, G, log)
    have = ent_arena.count[ent_slots]
    if (have != starts // r).any():      # (reachable: a cache advanced or rolled back behind the model's back)
        k = int(np.flatnonzero(have != starts // r)[0])
        raise RuntimeError(f"layer {i}: sequence {k} of the step has {int(have[k])} compressed entries, but its "
                           f"cache length {int(starts[k])} at ratio {r} needs {int(starts[k]) // r}: cache and "
                           "compressor state out of sync (was the cache changed outside forward_step / rollback?)")

    def rows_in(arena, owners, slots=None):
        flat, first = arena.reserve(owners, counts, log, slots)
        return flat, first, np.where(done, first[seq] + grp, arena.dump)

    ent, ent_first, ent_dst = rows_in(ent_arena, states, ent_slots)     # (placed above: its counts were read)
    lat, _, lat_dst = rows_in(arena_for(model, i, "comp", "latents", like), states)
    ik = ik_dst = None
    idx = getattr(attn, "indexer", None)
    if idx is not None and hasattr(idx, "wk"):
        ik_like = torch.empty((0, idx.wk.weight.shape[0]), dtype=dtype, device=dev)
        ik, ik_first, ik_dst = rows_in(arena_for(model, i, "layer", "ikeys", ik_like), lcs)
    ring_kv = ring_g = None
    host = {"ent_dst": ent_dst, "lat_dst": lat_dst}
    if ik is not None:
        host["ik_dst"] = ik_dst
    if comp.gated:
        rings, ring_slots = _rings(model, i, comp, states, starts, ends, dev, log)
        members = grp[:, None] * r + np.arange(r)[None, :]              # the group's positions [T, r]
        for name, slots in zip(("tok_kv", "tok_gate"), ring_slots):
            base = slots[seq] * RING
            host[name + "_dst"] = base + pos % RING
            host[name + "_grp"] = base[:, None] + members % RING
        ring_kv, ring_g = rings[0].flat, rings[1].flat
    else:
        if log is not None:
            log.append((states, _TOK_FIELDS, list(map(_TOK, states))))
        set_each(states, "tok_start", ends.tolist())
        if any(map(operator.is_not, map(operator.attrgetter("_tok_kv"), states), itertools.repeat(None))):
            set_each(states, "_tok_kv", itertools.repeat(None, len(states)))
            set_each(states, "_tok_gate", itertools.repeat(None, len(states)))
    names = list(host)
    got = dict(zip(names, plan.upload([host[k] for k in names], dev)))
    # this step's pools of the layer (the arenas: no copy)
    for kind in ("comp", "icomp", "ikeys"):
        plan.pools.pop((kind, i), None)
    plan.pools[("comp", i)] = (ent if G else None, *plan.per_row([ent_first, counts], dev), G)
    if ik is not None:
        plan.pools[("ikeys", i)] = (ik if G else None, *plan.per_row([ik_first, counts], dev), G)
    return [ring_kv, ring_g, got.get("tok_kv_dst"), got.get("tok_gate_dst"), got.get("tok_kv_grp"),
            got.get("tok_gate_grp"), ent, got["ent_dst"], lat, got["lat_dst"], ik, got.get("ik_dst")]


def compress_rows(model, attn, xn: torch.Tensor, ring_kv, ring_g, tok_kv_dst, tok_g_dst, grp_kv, grp_g, ent,
                  ent_dst, lat, lat_dst, ik, ik_dst, turn, proj: list | None = None) -> None:
    """Device side (pure, inside the step's graph): the layer's compressor rows from its attention-norm output
    xn [T, H], written in place into the rings and arenas at the rows `plan_layer` chose (module docstring).
    proj: [wkv(xn), wgate(xn) if gated] when already computed (engine/projections.py). turn: the rotation at each
    row's group start, a rope.Turns (from the step's one rope.step_turns table, made by its first segment:
    batched.span)."""
    comp = attn.compressor
    kv = comp.wkv(xn) if proj is None else proj[0]
    # model.fused_rope: the fused launches (the ring write + pool as 2 kernels.ring_pool launches instead of ~9; the
    # entry's and index key's norm + rotation + row write as one kernels.rmsnorm launch each instead of 3)
    fused = model.fused_rope and not model.quant_sim
    if comp.gated:   # the ring rows of this step's tokens, then each row's group pooled ([T, r, W] -> [T, W])
        gate = comp.wgate(xn) if proj is None else proj[1]
        if fused:
            ring_write(kv, gate, ring_kv, ring_g, tok_kv_dst, tok_g_dst)
            pooled = ring_pool(ring_kv, ring_g, grp_kv, grp_g, xn.dtype)
        else:
            ring_write_torch(kv, gate, ring_kv, ring_g, tok_kv_dst, tok_g_dst)
            pooled = ring_pool_torch(ring_kv, ring_g, grp_kv, grp_g, xn.dtype)
    else:     # ratio 1: the entry is the token's own projection (its fp32 round trip was the identity: no launch)
        pooled = kv if kv.dtype == xn.dtype else kv.float().to(xn.dtype)
    latent = comp.norm(pooled)
    fused = fused and ent.dtype == lat.dtype == xn.dtype
    table = turn_table(turn, None) if fused else None
    if fused:
        rms_norm(pooled, comp.norm.weight_fp32(), comp.norm.eps, table, out=ent, rows=ent_dst)
    else:
        ent.index_copy_(0, ent_dst, model._qdq(apply_rope(latent, turn, None), "compressed").to(ent.dtype))
    lat.index_copy_(0, lat_dst, latent.to(lat.dtype))
    if ik is not None:
        idx = attn.indexer
        if fused and ik.dtype == xn.dtype:
            rms_norm(idx.wk(latent), idx.k_norm.weight_fp32(), idx.k_norm.eps, table, out=ik, rows=ik_dst)
        else:
            keys = model._qdq(apply_rope(idx.k_norm(idx.wk(latent)), turn, None), "index")
            ik.index_copy_(0, ik_dst, keys.to(ik.dtype))
