"""The device bytes the batched decode path's shared cache storages hold and may add: cache_pool's books.

The window slab and the row arenas (engine/arena.py) reserve slots * rows per slot for every sequence at once, free
slots and rows past each sequence's count included, so the rows the live caches use (SequenceCache.nbytes) under-
count them, up to slots * the longest sequence / the sum of lengths with mixed lengths. These functions count
what is reserved (`storage_bytes`), what the next step may add for the live caches (`growth_reserve`: rows per
slot doubling, storages made on a first batched step) and what admitting one more sequence adds
(`admission_bytes`: nothing while a slot is spare, else the slot growth), so a pool sized to the device never
allocates past its limit. Cost: attribute reads, O(caches * layers + storages) per call.
"""
from __future__ import annotations

from .arena import MIN_ROWS, MIN_SLOTS, WindowSlab, _pow2_at_least
from .compress_step import RING, in_graph


def shared_storage(model) -> list:
    """Every window slab and row arena the model holds (empty before its first batched step, or for models
    without them)."""
    d = getattr(model, "__dict__", {})
    return list(d.get("_window_slabs", {}).values()) + list(d.get("_row_arenas", {}).values())


def release_idle_storage(model) -> int:
    """Drop every slab / arena no live sequence holds a slot in (a new cache pool takes the model over: what a
    previous engine's finished sequences left reserved is freed, and the model's CUDA graphs with it).
    -> bytes freed."""
    freed = 0
    d = getattr(model, "__dict__", {})
    for name in ("_window_slabs", "_row_arenas"):
        stores = d.get(name, {})
        for key, s in list(stores.items()):
            if all(ref() is None for ref in s.slots.owner.values()):
                freed += s.nbytes()
                del stores[key]
    if freed and hasattr(model, "reset_graphs"):
        model.reset_graphs()
    return freed


def storage_bytes(model) -> int:
    """Device bytes reserved by the model's slabs and arenas (all slots, free ones included)."""
    return sum(s.nbytes() for s in shared_storage(model))


def storage_pointers(model) -> frozenset:
    """The storages' base addresses: a cache's rows that live there are counted by `storage_bytes`, not by the
    cache (SequenceCache.nbytes(exclude=...))."""
    return frozenset(s.data.untyped_storage().data_ptr() for s in shared_storage(model))


def _row_kinds(cache):
    """(layer, part, name, state) of every row kind a cache holds (the arenas' keys, arena_for)."""
    for i, lc in enumerate(cache.layers):
        for part, st in (("comp", lc.comp), ("icomp", lc.icomp)):
            if st is not None:
                for name in ("entries", "latents", "tok_kv", "tok_gate"):   # (token rows: compress_step's rings)
                    yield i, part, name, st
        yield i, "layer", "ikeys", lc


def _arenas_by_kind(model) -> dict:
    out = {}
    for a in getattr(model, "__dict__", {}).get("_row_arenas", {}).values():
        out.setdefault((a.layer, a.part, a.name), []).append(a)
    return out


def growth_reserve(model, caches: list, step_rows: int = 16) -> int:
    """Device bytes the next step may add to the arenas for these live caches: an arena's rows per slot double when
    a sequence needs more (its rows of that kind wherever they live now, plus `step_rows` new ones); an arena not
    made yet counts its first size for the caches holding such rows. Growths of all arenas add up (the ratio-1
    layers' arenas fill up in the same step). Slots are charged at admission (`slot_bytes`). While a storage grows
    the old and the new tensor briefly coexist: that transient is left to the pool's headroom
    (gpu_memory_utilization). Cost: O(caches * layers + arenas) attribute reads."""
    arenas = _arenas_by_kind(model)
    slabs = list(getattr(model, "__dict__", {}).get("_window_slabs", {}).values())
    total = 0
    if not slabs:                # the first batched step makes the slab (its slots charged at admission so far)
        if any(lc.win is not None for c in caches for lc in c.layers):
            total += _pow2_at_least(len(caches), MIN_SLOTS) * slot_bytes(model)
    for s in slabs:              # live caches that take their slot on their first batched step
        held = sum(ref() is not None for ref in s.slots.owner.values())
        need = held + sum(id(c) not in s.slots._slot_of for c in caches)
        if need > s.data.shape[1]:
            total += (_pow2_at_least(need, MIN_SLOTS) - s.data.shape[1]) * s.slot_bytes()
    rows, like = {}, {}
    for c in caches:
        for i, part, name, st in _row_kinds(c):
            r = getattr(st, "_" + name)
            if r is not None and r[2]:
                key = (i, part, name)
                rows[key] = max(rows.get(key, 0), r[2])
                like.setdefault(key, r[0])
    for key, n in rows.items():
        if key in arenas:
            for a in arenas[key]:
                total += a.extra_bytes(n + step_rows)
        else:
            t = like[key]
            rows_made = _pow2_at_least(len(caches), MIN_SLOTS) * _pow2_at_least(n + step_rows, MIN_ROWS) + 1  # +dump
            total += rows_made * t.shape[-1] * t.element_size()
    return total


def admission_bytes(model, caches: list) -> int:
    """Device bytes admitting one more sequence adds to the window slab and the row arenas: nothing while a slot is
    spare (no sequence holds it and none of these live caches will take it: a cache takes its slot on its first
    batched step), else the growth it causes (slots double: size(n) = max(slots now, n rounded up to a power of
    two); admission k pays size(k) - size(k - 1), so the admissions together pay exactly the growth). Before a
    storage exists its slots cost `slot_bytes`. The engine allocates each admitted cache before checking the next
    one, so these live caches include the ones admitted earlier in the same step."""
    d = getattr(model, "__dict__", {})
    slabs = list(d.get("_window_slabs", {}).values())
    if slabs:
        s = slabs[0]
        held = sum(ref() is not None for ref in s.slots.owner.values())   # (dead owners not finalized yet: free)
        need = held + sum(id(c) not in s.slots._slot_of for c in caches) + 1
    else:
        need = len(caches) + 1

    def size(n, now):
        return max(now, _pow2_at_least(n, MIN_SLOTS)) if n > now else now
    if not slabs:
        return (size(need, 0) - size(need - 1, 0)) * slot_bytes(model)
    total = 0
    for st in [*slabs, *d.get("_row_arenas", {}).values()]:
        S = st.data.shape[1] if isinstance(st, WindowSlab) else st.data.shape[0]
        total += (size(need, S) - size(need - 1, S)) * st.slot_bytes()
    return total


def slot_bytes(model) -> int:
    """Device bytes one more sequence takes in the window slab and the row arenas at their current rows per slot
    (before they exist: their first size, from the model's layers and dtype). Cost: O(layers)."""
    d = getattr(model, "__dict__", {})
    c = model.config
    elt = model.embed.weight.element_size()
    slabs = list(d.get("_window_slabs", {}).values())
    if slabs:
        total = sum(s.slot_bytes() for s in slabs)
    else:
        keep = c.sliding_window - 1 + model.max_rollback
        total = len(model.layers) * (-(-(keep + 2 * 16) // 16) * 16) * c.head_dim * elt
    arenas = _arenas_by_kind(model)
    for i, blk in enumerate(model.layers):
        attn = blk.attn
        idx = getattr(attn, "indexer", None)
        kinds = []
        if hasattr(attn, "compressor"):
            kinds += [("comp", "entries", c.head_dim)] + ([("comp", "latents", c.head_dim)]
                                                          if c.compressor_style == "v41" else [])
            if in_graph(model, attn) and attn.compressor.gated:     # token rows in rings, fp32 (compress_step)
                w = attn.compressor.wkv.weight.shape[0] * 4 // elt
                kinds += [("comp", "tok_kv", w, RING), ("comp", "tok_gate", w, RING)]
        if idx is not None and hasattr(idx, "compressor"):
            kinds.append(("icomp", "entries", c.index_head_dim))
        if idx is not None and hasattr(idx, "wk"):
            kinds.append(("layer", "ikeys", c.index_head_dim))
        for part, name, width, *rows in kinds:
            have = arenas.get((i, part, name))
            total += max(a.slot_bytes() for a in have) if have else (rows or [MIN_ROWS])[0] * width * elt
    return total
