"""Fixed-address storage for the rows a sequence's cache grows by: one layer's compressed entries, latents or index
keys (the batched decode path, engine/batched.py and compressor.py).

Why: before, every decode step rebuilt all sequences' rows of a kind as one new buffer (one gather of every row
so far: O(batch * entries) bytes and host index work per step, entries = length / ratio, so a ratio-1 layer at
4,096 tokens and batch 64 moved 262k rows per step per kind). Here each sequence owns a slot of one arena tensor
[slots, cap, width] and a step only writes its new rows in place (one `index_copy_` for all sequences); the
arena, viewed flat [slots * cap, width], is the attention / indexer pool as it is (sequence s's rows start at
slot * cap), so no pool is concatenated either.

Contract: the states (CompressorState / LayerCache) keep their rows as (buffer, first row, rows) (cache.py);
here each state's attribute holds its slot's `cache.ArenaRows`, which reads that tuple from the arena's per-slot
arrays `first` / `count` (numpy, indexed by slot). A step changes every state's rows by writing those arrays for
all its slots at once (`update`: no Python per state, no attribute written); a rollback writes its slot's count
through the same object. `held` answers whether the step's states still hold their objects (one identity check
over them, against the last `hold`); when not (rows set by the reference path, a deep copy, another arena, a
first step) the slow path `place` points them at their slots again, a state whose rows live elsewhere moved into
its slot first (one gather for all of them). A state left with no rows holds None, as on the reference path
(`_none`), so while a step's batch holds a sequence with no rows of an arena (e.g. one shorter than the layer's
compression ratio) every step takes that slow path there (Python per state). A slot belongs to its state until
the state is garbage-collected (weakref.finalize). Rows past a state's count (after a rollback) are free and
overwritten by its next append; nothing else reads them. When a slot runs out of rows or the arena out of slots
the arena grows (one copy: rows per slot doubled, slots compacted to the live ones), renumbering the slots'
objects (addresses change only then).
Memory: slots * cap rows, cap = the longest sequence's rows rounded up to a power of two (>= MIN_ROWS),
slots a power of two (>= the live sequences at the last growth): sequences of
very different lengths reserve the longest one's rows each (a paged arena, blocks of rows per sequence, is the next
step for long mixed batches). cache_pool counts what is reserved, not the rows in use, plus the growth the next
step may cause (engine/cache_memory.py), so a pool sized to the device never allocates past its limit.
"""
from __future__ import annotations

import itertools
import operator
import weakref

import numpy as np
import torch

from .cache import ArenaRows, set_each
from .transfer import ragged_arange, to_device_many

# smallest slot capacity / slot count of a storage. Slots and rows double when they run out (each growth copies
# the storage once and drops the CUDA graphs, which read its old address: doubling keeps that logarithmic), and a
# growth compacts the slots to the live ones (free slots of finished sequences are not carried along)
MIN_ROWS = 16
MIN_SLOTS = 1


class Slots:
    """Slot numbers handed to owner objects, each freed when its owner is garbage-collected (weakref.finalize)."""

    def __init__(self):
        self._slot_of: dict[int, int] = {}        # id(owner) -> slot
        self.owner: dict[int, weakref.ref] = {}   # slot -> owner
        self._free: list[int] = []
        self.used = 0                             # slots handed out so far (free ones included)
        self._last: tuple | None = None           # (owner ids, slots) of the last `of_all` (dropped on any change)

    def of(self, owner) -> int:
        s = self._slot_of.get(id(owner))
        if s is None:
            if self._free:
                s = self._free.pop()
            else:
                s, self.used = self.used, self.used + 1
            self._slot_of[id(owner)] = s
            self.owner[s] = weakref.ref(owner)
            weakref.finalize(owner, self._release, id(owner))
        return s

    def of_all(self, owners: list) -> list[int]:
        """[of(o) for o in owners], answered from a cache when the owners are the same objects as last time (a
        decode step asks for the same sequences' slots of ~10 storages: ~600 lookups per step at batch 64). The
        cache is dropped whenever a slot is released (before its owner's id can be reused) or renumbered."""
        ids = list(map(id, owners))
        if self._last is not None and self._last[0] == ids:
            return self._last[1]
        slots = [self.of(o) for o in owners]
        self._last = (ids, slots)
        return slots

    def _release(self, owner_id: int) -> None:
        self._last = None
        slot = self._slot_of.pop(owner_id, None)
        if slot is not None:
            self.owner.pop(slot, None)
            self._free.append(slot)

    def compact(self) -> list[tuple[int, int, object]]:
        """Renumber the live owners 0..n-1 in slot order (free slots dropped) -> [(old slot, new slot, owner)].
        The storage moves its rows accordingly (it is copying them anyway when it grows)."""
        moves = []
        for old in sorted(self.owner):
            o = self.owner[old]()
            if o is not None:
                moves.append((old, len(moves), o))
        self._last = None
        self._slot_of = {id(o): new for _, new, o in moves}
        self.owner = {new: weakref.ref(o) for _, new, o in moves}
        self._free, self.used = [], len(moves)
        return moves


def live_slots(moves: list, slots: int, device) -> tuple:
    """After Slots.compact (`moves`, old slot -> new slot in order) of a storage of `slots` slots: (how many live slots
    it held, their index in the old storage in the new order: a slice when they are its first ones, one block copy,
    else a device tensor) for the growths' copy `new[:n] = old[index]` (along the slot dimension)."""
    src = [a for a, _, _ in moves if a < slots]
    n = len(src)
    return n, slice(0, n) if src == list(range(n)) else torch.tensor(src, device=device)


def _held(last: tuple | None, get, items: list) -> np.ndarray | None:
    """The slots of the last `hold` (last = (objects, slots int64)) when `get` of each item is, in order, the object
    held then (C-level identity checks, no Python per item); else None."""
    if last is None or len(last[0]) != len(items) or not all(map(operator.is_, map(get, items), last[0])):
        return None
    return last[1]


class SlotRows:
    """Per-slot rows whose numbers live in arrays (`first`: a slot's first row in `flat`, `count`: its rows, plus a
    subclass's own): each owner holds its slot's cache.ArenaRows in its attribute `key` (one object per slot,
    renumbered with it by a growth), and `held` checks that a step's owners still do (RowArena, token_ring's
    TokenRing). A subclass sets flat, ring, first, count, key, _get, _rows and _held and has
    `_grow(slots, ...)` (`slots_for`)."""

    def rows_of(self, slot: int) -> ArenaRows:
        """The slot's ArenaRows (one object per slot, renumbered with it by a growth)."""
        obj = self._rows[slot]
        if obj is None:
            obj = self._rows[slot] = ArenaRows(self, slot)
        return obj

    def held(self, owners: list) -> np.ndarray | None:
        """Each owner's slot (int64) when the owners are those of the last `hold`, in its order, and each still
        holds its slot's ArenaRows (C-level identity checks, no Python per owner); else None."""
        return _held(self._held, self._get, owners)

    def slots_for(self, owners: list, *size) -> list[int]:
        """Each owner's slot, grown first where the slots (or the subclass's `size`: RowArena's rows a slot) do
        not fit (`_grow(slots, *size)` -> whether it grew)."""
        slots = self.slots.of_all(owners)
        if self._grow(max(slots) + 1, *size):
            slots = self.slots.of_all(owners)  # (a growth renumbers the slots)
        return slots

    def hold(self, owners: list, slots: list, first=None, count=None, log: list | None = None) -> np.ndarray:
        """Point each owner at its slot's ArenaRows, with (first, count) rows when given (the rows already in
        place; else the caller sets them: RowArena.update, TokenRing.place), the old attribute values logged
        (`undo`). -> the slots (int64)."""
        objs = list(map(self.rows_of, slots))
        at = np.asarray(slots, dtype=np.int64)
        if count is not None:
            self.first[at], self.count[at] = first, count
        if log is not None:
            log.append((owners, self.key, list(map(self._get, owners))))
        set_each(owners, self.key, objs)
        self._held = (objs, at)
        return at

    def _renumber(self, moves: list, slots: int, cap: int, new_cap: int, extra: tuple = ()) -> tuple:
        """After a growth to `slots` slots of `new_cap` rows (from `cap`): the objects and per-slot arrays moved
        from old slot a to new slot b (Slots.compact's moves), first rows shifted to their new slot's start ->
        (objects, first, count, *extra arrays)."""
        objs = [None] * slots
        arrays = [np.zeros(slots, dtype=np.int64) for _ in range(2 + len(extra))]
        for a, b, _ in moves:
            if a < len(self._rows) and self._rows[a] is not None:
                objs[b], objs[b].slot = self._rows[a], b
                arrays[0][b] = b * new_cap + self.first[a] - a * cap
                for new, old in zip(arrays[1:], (self.count, *extra)):
                    new[b] = old[a]
        return (objs, *arrays)


class RowArena(SlotRows):
    def __init__(self, name: str, width: int, dtype: torch.dtype, device: torch.device, on_grow=None,
                 layer: int | None = None, part: str | None = None, ring: int | None = None):
        self.name = name                          # the states' attribute (entries, latents, ikeys)
        self.layer, self.part = layer, part       # whose rows (arena_for): cache.layers[layer].<part> (memory books)
        self.on_grow = on_grow                    # called after the address changed (the model drops its graphs)
        self.key = "_" + name
        self.ring = ring                          # rows wrap around a ring of this many (compress_step's token rows)
        self._get = operator.attrgetter(self.key)
        # flat [slots * cap + 1, width]: every slot's rows, then one dump row (writes made inside a CUDA graph for
        # rows that complete nothing go there); data [slots, cap, width] views the slots. ONE flat object: states'
        # tuples are recognized by identity
        self.flat = torch.zeros((1, width), dtype=dtype, device=device)
        self.data = self.flat[:0].view(0, 0, width)
        self.slots = Slots()
        self.moved_rows = 0                       # rows copied in from elsewhere so far (tests, benchmarks)
        # per slot: the first row in flat and the rows its state holds (read through the slot's ArenaRows)
        self.first = np.zeros(0, dtype=np.int64)
        self.count = np.zeros(0, dtype=np.int64)
        self._rows: list = []                     # per slot: its ArenaRows (made on first use)
        self._held: tuple | None = None           # (ArenaRows list, slots int64) of the last `hold`, state order

    def _shape_for(self, slots: int, rows: int) -> tuple[int, int]:
        """(slots, rows per slot) after a growth that must hold `slots` live slots of `rows` rows: rows double
        (sequences grow a few rows per step: doubling keeps the copies and graph recaptures logarithmic); slots are
        exactly the live ones (a growth compacts them: a slot is charged to the sequence admitted into it, and one
        long sequence doubling its rows does not double the rows of slots nobody holds, cache_pool)."""
        _, C, _ = self.data.shape
        C2 = max(C, MIN_ROWS)
        while C2 < rows:
            C2 *= 2
        return _pow2_at_least(slots, MIN_SLOTS), C2

    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def dump(self) -> int:
        """The dump row's index in `flat`."""
        return self.flat.shape[0] - 1

    def live_slots(self) -> int:
        return sum(ref() is not None for ref in self.slots.owner.values())

    def extra_bytes(self, rows: int) -> int:
        """Device bytes a growth to `rows` rows per slot would add (0 when they fit; the growth compacts the slots
        to the live ones)."""
        S, C, W = self.data.shape
        if rows <= C:
            return 0
        S2, C2 = self._shape_for(self.live_slots(), rows)
        return max(0, S2 * C2 - S * C) * W * self.data.element_size()

    def slot_bytes(self) -> int:
        """Bytes of one slot at the current rows per slot (what admitting one more sequence adds)."""
        _, C, W = self.data.shape
        return max(C, MIN_ROWS) * W * self.data.element_size()

    def _grow(self, slots: int, rows: int) -> bool:
        """Make room for `slots` slots of `rows` rows: a new tensor with the live slots renumbered 0..n-1 (free
        ones dropped) and rows doubled as needed; copy, renumber the slots' objects. -> whether it grew."""
        S, C, W = self.data.shape
        if slots <= S and rows <= C:
            return False
        old_data = self.data
        moves = self.slots.compact()
        S2, C2 = self._shape_for(len(moves), rows)
        # zeros, not empty: readers that gather a padded [rows, G] block (the CPU index scores) must see finite
        # values past a sequence's rows, which they mask afterwards. A normal tensor even when the step runs
        # under inference_mode (written in place by later steps, which may run outside it)
        with torch.inference_mode(False):
            store = torch.zeros((S2 * C2 + 1, W), dtype=old_data.dtype, device=old_data.device)
            data = store[:S2 * C2].view(S2, C2, W)
            if moves and S * C:
                n, live = live_slots(moves, S, old_data.device)
                data[:n, :C] = old_data[live]
            self.data, self.flat = data, store
        # (only ArenaRows ever point into an arena: `hold` gives a state its slot's object, and nothing makes a
        # plain tuple of an arena's storage (a deep copy's tuple is of a copy, `place` keeps its tuples to itself),
        # so renumbering the objects re-points every state)
        self._rows, self.first, self.count = self._renumber(moves, S2, C, C2)
        self._held = None
        if self.on_grow is not None and S * C:      # (nothing can have read an empty arena)
            self.on_grow()
        return True

    def update(self, states: list, slots: np.ndarray, count: np.ndarray, first=None, log: list | None = None) -> None:
        """The states (at `slots`, holding their ArenaRows: `held`) now hold `count` rows (from `first`, when
        given): the arrays written for all slots at once, their old values logged (`undo`)."""
        if log is not None:
            log.append((self, slots, self.first[slots], self.count[slots]))
        if first is not None:
            self.first[slots] = first
        self.count[slots] = count
        self._none(states, count, log)

    def _none(self, states: list, count: np.ndarray, log: list | None) -> None:
        """States given no rows hold None, as on the reference path (a rollback to none leaves its ArenaRows,
        read as no rows, as a cut tuple was); `held` then answers None until the next `hold`."""
        if count.all():
            return
        zero = [states[k] for k in np.flatnonzero(count == 0).tolist()]
        if log is not None:
            log.append((zero, self.key, list(map(self._get, zero))))
        set_each(zero, self.key, itertools.repeat(None, len(zero)))
        self._held = None

    def place(self, states: list, rows: int, log: list | None = None) -> np.ndarray:
        """Each state's slot (int64), room for `rows` rows a slot made and every state holding its slot's
        ArenaRows with the rows it held (`count`): the arena grows as needed and rows a state holds elsewhere
        (fresh from the reference path, a deep copy, another arena) move in (one gather). The common case (the
        same states as last time, each holding its object, rows that fit) is one identity check (`held`)."""
        slots = self.held(states)
        if slots is not None and rows <= self.data.shape[1]:
            return slots
        from .compressor import Sources
        slots = self.slots_for(states, rows)
        flat, cap = self.flat, self.data.shape[1]
        starts = list(map(cap.__mul__, slots))
        # (a state's own slot's object stays; another one, of another arena or slot, as the tuple it reads)
        olds = [t.rows() if type(t) is ArenaRows and (t.arena is not self or t.slot != s) else t
                for t, s in zip(map(self._get, states), slots)]
        away = [k for k, (t, s0) in enumerate(zip(olds, starts))
                if t is not None and t[2] and type(t) is not ArenaRows and (t[0] is not flat or t[1] != s0)]
        if away:                              # rows elsewhere: move them in (one gather)
            src, mig_from, mig_to = Sources(0), [], []
            for k in away:
                t, s0 = olds[k], starts[k]
                base = src.base(t[0], None)
                mig_from.extend(range(base + t[1], base + t[1] + t[2]))
                mig_to.extend(range(s0, s0 + t[2]))
            rows_from, rows_to = to_device_many([mig_from, mig_to], flat.device)
            flat.index_copy_(0, rows_to, src.cat(None, 0)[rows_from])
            self.moved_rows += len(mig_from)
        return self.hold(states, slots, starts, [0 if t is None else t[2] for t in olds], log)

    def reserve(self, states: list, counts, log: list | None = None,
                slots: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """Room for counts[k] rows of states[k] in its slot (`place`), each state then holding counts[k] rows
        from its slot's first row. Its rows past what it held before are the caller's to write (`append`, or a
        CUDA graph, engine/compress_step.py). log: an undo log (`undo`) that gets what changes as it was. slots:
        what `place(states, max(counts), log)` returned this step, when the caller already placed them.
        -> (flat, each state's first row, int64)."""
        counts = np.asarray(counts, dtype=np.int64)
        if slots is None:
            slots = self.place(states, int(counts.max()), log)
        self.update(states, slots, counts, log=log)
        return self.flat, self.first[slots]

    def append(self, states: list, new: torch.Tensor, news: list[int]) -> tuple[torch.Tensor, list[int]]:
        """state.<name> += its news[s] rows of `new` [sum(news), width] (in state order), in place.
        -> (the flat arena: this kind's pool, each state's first row in it). Cost: `reserve`, then one
        index_copy_ of the new rows and one host->device copy of their row list (made by numpy)."""
        olds = [0 if t is None else t[2] for t in [getattr(st, self.key) for st in states]]
        flat, starts = self.reserve(states, [o + k for o, k in zip(olds, news)])
        n_new = sum(news)
        if n_new:
            dst = torch.from_numpy(ragged_arange(starts + np.asarray(olds, dtype=np.int64), news))
            flat.index_copy_(0, to_device_many([dst], flat.device)[0], new.to(flat.dtype))
        return flat, starts.tolist()


def arena_for(model, layer: int, part: str, name: str, like: torch.Tensor, ring: int | None = None) -> RowArena:
    """The model's arena for the rows `name` of layer `layer`'s state `part` (comp, icomp, layer: the LayerCache
    itself) in like's width / dtype / device (made on first use; ring: its rows wrap around rings of that many)."""
    arenas = model.__dict__.setdefault("_row_arenas", {})
    key = (layer, part, name, like.shape[-1], like.dtype, like.device)
    a = arenas.get(key)
    if a is None:
        a = arenas[key] = RowArena(name, like.shape[-1], like.dtype, like.device, on_grow=model.reset_graphs,
                                   layer=layer, part=part, ring=ring)
    return a


def undo(log: list) -> None:
    """Put back what an undo log holds, last entry first: entries (objects, attribute name, their old values),
    (objects, attribute names, their old value tuples) or (arena, slots, their old first rows, counts): made
    before the values change (`RowArena.hold` / `update`, compress_step.plan_layer)."""
    for objs, keys, *vals in reversed(log):
        if isinstance(objs, RowArena):
            objs.first[keys], objs.count[keys] = vals
            continue
        vals = vals[0]
        if isinstance(keys, str):
            for o, v in zip(objs, vals):
                setattr(o, keys, v)
        else:
            for o, v in zip(objs, vals):
                for k, x in zip(keys, v):
                    setattr(o, k, x)


class WindowSlab:
    """Every sequence's sliding-window keys of every layer at fixed addresses: data [L, slots, cap, D].

    A sequence (its SequenceCache) owns one slot; its WindowStack is (slab, slot): rows lo[slot]..hi[slot] of the
    slot hold its last hi - lo keys of every layer (the per-slot arrays `lo` / `hi`), and a step writes its new rows
    at hi.. in place (the attention kernel reads data[layer] flat as its window pool) and moves every sequence's
    lo / hi at once (batched.commit_windows). When a slot's rows would pass cap, the kept rows move to the slot's
    start first (once every ~cap - keep steps). Slots are freed with their cache (weakref.finalize); when the
    slots run out the slab grows (slots doubled, compacted to the live ones, renumbered; one copy), renumbers every
    live stack and calls `on_grow` (the model drops its CUDA graphs, which read the old address)."""

    def __init__(self, layers: int, width: int, keep: int, max_rows: int, dtype: torch.dtype,
                 device: torch.device, on_grow=None):
        self.keep = keep                                   # rows a sequence keeps per layer
        self.cap = -(-(keep + 2 * max_rows) // 16) * 16    # room for the kept rows + a few steps of new ones
        with torch.inference_mode(False):    # (a normal tensor: written in place in and out of inference_mode)
            self.data = torch.zeros((layers, 0, self.cap, width), dtype=dtype, device=device)
        self.on_grow = on_grow
        self.slots = Slots()
        self.lo = np.zeros(0, dtype=np.int64)     # per slot: its stack's first and end row (WindowStack.lo / hi)
        self.hi = np.zeros(0, dtype=np.int64)
        self._held: tuple | None = None           # (stacks, slots int64) of the last `hold`, in cache order

    def held(self, caches: list) -> np.ndarray | None:
        """Each cache's slot (int64) when the caches are those of the last `hold`, in its order, each still holding
        its stack with every layer attached (a detach calls `forget`): C-level identity checks; else None."""
        return _held(self._held, _WINDOWS, caches)

    def hold(self, stacks: list, slots) -> None:
        """The step's caches hold these stacks (every layer attached), in cache order (`held`)."""
        self._held = (stacks, np.asarray(slots, dtype=np.int64))

    def forget(self) -> None:
        self._held = None

    def slots_for(self, caches: list) -> list[int]:
        """Each cache's slot (handed out on first use; the slab grows once when they do not fit)."""
        slots = self.slots.of_all(caches)
        if slots and max(slots) >= self.data.shape[1]:
            self._grow()
            slots = self.slots.of_all(caches)
        return slots

    def _grow(self) -> None:
        """A new slab with the live slots renumbered 0..n-1 (free ones dropped), slots a power of two; copy,
        re-point every live stack."""
        old = self.data
        L, S, C, D = old.shape
        moves = self.slots.compact()
        with torch.inference_mode(False):
            S2 = _pow2_at_least(len(moves), MIN_SLOTS)
            self.data = torch.zeros((L, S2, C, D), dtype=old.dtype, device=old.device)
            n, live = live_slots(moves, S, old.device)
            if n:
                self.data[:, :n] = old[:, live]
        lo, hi = np.zeros(S2, dtype=np.int64), np.zeros(S2, dtype=np.int64)
        for a, b, cache in moves:
            st = cache.windows
            if st is not None and st.slab is self and st.slot == a:
                lo[b], hi[b], st.slot = self.lo[a], self.hi[a], b
        self.lo, self.hi, self._held = lo, hi, None
        if self.on_grow is not None and S:
            self.on_grow()

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def slot_bytes(self) -> int:
        """Bytes of one slot (every layer's window rows of one sequence)."""
        L, _, C, D = self.data.shape
        return L * C * D * self.data.element_size()


_WINDOWS = operator.attrgetter("windows")


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


def _pow2_at_least(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b
