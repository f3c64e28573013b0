"""Fixed-address storage for the rows a sequence's cache grows by: one layer's compressed entries, latents or index
keys (the batched decode path, engine/batched.py and compressor.py).

Why: before, every decode step rebuilt all sequences' rows of a kind as one new buffer (one gather of every row
so far: O(batch * entries) bytes and host index work per step, entries = length / ratio, so a ratio-1 layer at
4,096 tokens and batch 64 moved 262k rows per step per kind). Here each sequence owns a slot of one arena tensor
[slots, cap, width] and a step only writes its new rows in place (one `index_copy_` for all sequences); the
arena, viewed flat [slots * cap, width], is the attention / indexer pool as it is (sequence s's rows start at
slot * cap), so no pool is concatenated either.

Contract: the states (CompressorState / LayerCache) keep their rows as (buffer, first row, rows) (cache.py);
`append` points each at (flat arena, slot * cap, rows). A state whose rows live elsewhere (fresh from the reference
path, a deep copy, another arena) is moved into its slot first (one gather for all of them). A slot belongs to its
state until the state is garbage-collected (weakref.finalize). Rows past a state's count (after a rollback) are
free and overwritten by its next append; nothing else reads them. When a slot runs out of rows or the arena out of
slots the arena doubles (one copy) and every live state's tuple is re-pointed (addresses change only then).
Memory: slots * cap rows, cap = the longest sequence's rows rounded up to a power of two (>= 64). Not yet in
cache_pool's accounting (it counts the rows in use); sequences of very different lengths waste the difference, so a
paged arena (blocks of rows per sequence) is the next step for long mixed batches.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from .transfer import to_device_many


class Slots:
    """Slot numbers handed to owner objects, each freed when its owner is garbage-collected (weakref.finalize)."""

    def __init__(self):
        self._slot_of: dict[int, int] = {}        # id(owner) -> slot
        self.owner: dict[int, weakref.ref] = {}   # slot -> owner
        self._free: list[int] = []
        self.used = 0                             # slots handed out so far (free ones included)

    def of(self, owner) -> int:
        s = self._slot_of.get(id(owner))
        if s is None:
            if self._free:
                s = self._free.pop()
            else:
                s, self.used = self.used, self.used + 1
            self._slot_of[id(owner)] = s
            self.owner[s] = weakref.ref(owner)
            weakref.finalize(owner, self._release, id(owner), s)
        return s

    def _release(self, owner_id: int, slot: int) -> None:
        if self._slot_of.get(owner_id) == slot:
            del self._slot_of[owner_id]
            self.owner.pop(slot, None)
            self._free.append(slot)


class RowArena:
    def __init__(self, name: str, width: int, dtype: torch.dtype, device: torch.device, on_grow=None):
        self.name = name                          # the states' attribute (entries, latents, ikeys)
        self.on_grow = on_grow                    # called after the address changed (the model drops its graphs)
        self.key = "_" + name
        self.data = torch.empty((0, 0, width), dtype=dtype, device=device)    # [slots, cap, width]
        self.flat = self.data.view(-1, width)     # ONE view object: states' tuples are recognized by identity
        self.slots = Slots()
        self.moved_rows = 0                       # rows copied in from elsewhere so far (tests, benchmarks)

    def _grow(self, slots: int, rows: int) -> None:
        """Make room for `slots` slots of `rows` rows (doubling), copy, re-point every live state."""
        S, C, W = self.data.shape
        if slots <= S and rows <= C:
            return
        S2, C2 = max(S, 8), max(C, 64)
        while S2 < slots:
            S2 *= 2
        while C2 < rows:
            C2 *= 2
        old = self.flat
        # zeros, not empty: readers that gather a padded [rows, G] block (the CPU index scores) must see finite
        # values past a sequence's rows, which they mask afterwards. A normal tensor even when the step runs
        # under inference_mode (written in place by later steps, which may run outside it)
        with torch.inference_mode(False):
            data = torch.zeros((S2, C2, W), dtype=self.data.dtype, device=self.data.device)
            data[:S, :C] = self.data
            self.data, self.flat = data, data.view(-1, W)
        for s, ref in self.slots.owner.items():
            st = ref()
            t = None if st is None else getattr(st, self.key)
            if t is not None and t[0] is old:
                setattr(st, self.key, (self.flat, s * C2 + (t[1] - s * C), t[2]))
        if self.on_grow is not None and S * C:      # (nothing can have read an empty arena)
            self.on_grow()

    def append(self, states: list, new: torch.Tensor, news: list[int]) -> tuple[torch.Tensor, list[int]]:
        """state.<name> += its news[s] rows of `new` [sum(news), width] (in state order), in place.
        -> (the flat arena: this kind's pool, each state's first row in it). Cost: one index_copy_ of the new rows
        (plus one gather for states moved in), one host->device copy of the row lists; host work per state is a
        few attribute reads (the row lists are made by numpy)."""
        from .compressor import Sources
        key = self.key
        slots = [self.slots.of(st) for st in states]
        olds = [0 if t is None else t[2] for t in [getattr(st, key) for st in states]]
        counts = [o + k for o, k in zip(olds, news)]
        self._grow(max(slots) + 1, max(counts))
        flat, cap = self.flat, self.data.shape[1]
        starts = [s * cap for s in slots]
        tups = [getattr(st, key) for st in states]        # (after a growth: re-pointed)
        src, mig_from, mig_to = Sources(0), [], []
        for t, s0 in zip(tups, starts):
            if t is not None and t[2] and (t[0] is not flat or t[1] != s0):   # rows elsewhere: move them in
                base = src.base(t[0], None)
                mig_from.extend(range(base + t[1], base + t[1] + t[2]))
                mig_to.extend(range(s0, s0 + t[2]))
        n_new = sum(news)
        if not n_new and not mig_from:      # every state already in place, nothing new
            return flat, starts
        k = np.asarray(news, dtype=np.int64)
        first = np.asarray(starts, dtype=np.int64) + np.asarray(olds, dtype=np.int64)
        dst = torch.from_numpy(np.repeat(first - (np.cumsum(k) - k), k) + np.arange(n_new, dtype=np.int64))
        parts = to_device_many([dst] + ([mig_from, mig_to] if mig_from else []), flat.device)
        if mig_from:
            flat.index_copy_(0, parts[2], src.cat(None, 0)[parts[1]])
            self.moved_rows += len(mig_from)
        if n_new:
            flat.index_copy_(0, parts[0], new.to(flat.dtype))
        for st, s0, m in zip(states, starts, counts):
            if m:                            # (a state with no rows keeps None, as on the reference path)
                setattr(st, key, (flat, s0, m))
        return flat, starts


def arena_for(model, layer: int, part: str, name: str, like: torch.Tensor) -> RowArena:
    """The model's arena for the rows `name` of layer `layer`'s state `part` (comp, icomp, layer: the LayerCache
    itself) in like's width / dtype / device (made on first use)."""
    arenas = model.__dict__.setdefault("_row_arenas", {})
    key = (layer, part, name, like.shape[-1], like.dtype, like.device)
    a = arenas.get(key)
    if a is None:
        a = arenas[key] = RowArena(name, like.shape[-1], like.dtype, like.device, on_grow=model.reset_graphs)
    return a


class WindowSlab:
    """Every sequence's sliding-window keys of every layer at fixed addresses: data [L, slots, cap, D].

    A sequence (its SequenceCache) owns one slot; its WindowStack is (data, slot, lo, hi): rows lo..hi of the
    slot hold its last hi - lo keys of every layer, and a step writes its new rows at hi.. in place (the attention
    kernel reads data[layer] flat as its window pool). When a slot's rows would pass cap, the kept rows move to
    the slot's start first (once every ~cap - keep steps). Slots are freed with their cache (weakref.finalize);
    when the slots run out the slab doubles (one copy), re-points every live stack and calls `on_grow` (the
    model drops its CUDA graphs, which read the old address)."""

    def __init__(self, layers: int, width: int, keep: int, max_rows: int, dtype: torch.dtype,
                 device: torch.device, on_grow=None):
        self.keep = keep                                   # rows a sequence keeps per layer
        self.cap = -(-(keep + 2 * max_rows) // 16) * 16    # room for the kept rows + a few steps of new ones
        with torch.inference_mode(False):    # (a normal tensor: written in place in and out of inference_mode)
            self.data = torch.zeros((layers, 0, self.cap, width), dtype=dtype, device=device)
        self.on_grow = on_grow
        self.slots = Slots()

    def slot(self, cache) -> int:
        """The cache's slot (handed out on first use; the slab grows when none is free)."""
        s = self.slots.of(cache)
        if s >= self.data.shape[1]:
            self._grow(max(8, 2 * self.data.shape[1], s + 1))
        return s

    def _grow(self, slots: int) -> None:
        old = self.data
        L, S, C, D = old.shape
        with torch.inference_mode(False):
            self.data = torch.zeros((L, slots, C, D), dtype=old.dtype, device=old.device)
            self.data[:, :S] = old
        for ref in self.slots.owner.values():
            cache = ref()
            st = None if cache is None else cache.windows
            if st is not None and st.buf is old:
                st.buf = self.data
        if self.on_grow is not None and S:
            self.on_grow()


def window_slab(model, like: torch.Tensor, max_rows: int) -> WindowSlab:
    """The model's window slab in like's width / dtype / device (made on first use)."""
    slabs = model.__dict__.setdefault("_window_slabs", {})
    key = (like.shape[-1], like.dtype, like.device)
    s = slabs.get(key)
    if s is None:
        keep = model.config.sliding_window - 1 + model.max_rollback
        s = slabs[key] = WindowSlab(len(model.layers), like.shape[-1], keep, max_rows, like.dtype, like.device,
                                    on_grow=model.reset_graphs)
    return s
