"""Per-sequence caches for the incremental path.

One `SequenceCache` per sequence holds, per backbone layer, a `LayerCache`:
  * `win`      [m, D]  the last m window keys (= values), ending at position `length - 1`; kept to
                        `sliding_window - 1 + max_rollback` rows so a rollback still leaves a full window
                        (after a batched decode step: a view of the sequence's `WindowStack`, all layers in one
                        tensor, itself a view of that step's window buffer shared by the step's sequences);
  * `comp`     CompressorState for kv-source layers (compressed entries + the open group's per-token projections);
  * `icomp`    CompressorState of V4's indexer compressor (index keys) on V4 indexer layers;
  * `ikeys`    [G, Di] index keys on V4.1 index-K source layers (one per compressed entry of the kv source).
Layers that share (V4.1 sources) keep nothing of their own for compressed KV / index keys: readers look up the
source layer's LayerCache. Also: the recent token ids (for Engram n-grams and hash routing) and a `drafter` slot
that dspark.py may fill with its own state.

`rollback(n)` forgets the last n tokens (n <= max_rollback): window rows and token projections are dropped,
compressed entries whose group is no longer complete become invisible and are removed.

Storage: the batched decode path (engine/batched.py) keeps every sequence's rows of one kind at fixed addresses
(engine/arena.py: a window slab, per-layer arenas), so the tensor attributes above (`tok_kv`, `tok_gate`,
`entries`, `latents`, `ikeys`, `tokens`, the WindowStack) are stored as (buffer, first row, rows) and sliced only
when read: updating a sequence is setting three numbers, and a rollback only shortens the row count. In an
arena the tuple is an `ArenaRows` (the arena's per-slot arrays hold its numbers: a step updates every sequence's
rows of the arena by writing those arrays at once). The slab
and arenas are written in place (a sequence's rows past its count belong to it and are overwritten by its next
step), so a slice read from a cache is valid until that sequence's next fast step; the reference path never
writes into them (it makes new tensors).
"""
from __future__ import annotations

import collections
import copy
import itertools
from dataclasses import dataclass, field

import torch


def ring_rows(buf: torch.Tensor, off: int, n: int, ring: int) -> torch.Tensor:
    """Rows off.. (n of them) of a ring of `ring` rows that starts at the ring-aligned row below off: row k of the
    result is buf[base + (off - base + k) % ring]. A copy (a gather)."""
    base = off - off % ring
    return buf[base + (off - base + torch.arange(n, device=buf.device)) % ring]


class ArenaRows:
    """The (buffer, first row, rows[, ring]) tuple of a state's rows in its slot of an engine/arena.py RowArena,
    read from the arena's per-slot arrays when indexed (one object per slot, kept by its state from step to step:
    the batched path writes the arrays for all slots at once instead of a new tuple per state)."""
    __slots__ = ("arena", "slot")

    def __init__(self, arena, slot: int):
        self.arena, self.slot = arena, slot

    def rows(self) -> tuple:
        a, s = self.arena, self.slot
        t = (a.flat, int(a.first[s]), int(a.count[s]))
        return t if a.ring is None else (*t, a.ring)

    def __len__(self) -> int:
        return 3 if self.arena.ring is None else 4

    def __getitem__(self, k):
        return self.rows()[k]

    def __iter__(self):
        return iter(self.rows())

    def __deepcopy__(self, memo):
        """In a copy of its arena (the model's deep copy): the copy's object of the slot. Else the plain tuple, its
        buffer deep-copied (not the arena, whose on_grow is the model's): `place` moves such rows in as it does any
        from elsewhere."""
        arena = memo.get(id(self.arena))
        return ArenaRows(arena, self.slot) if arena is not None else copy.deepcopy(self.rows(), memo)


def _shorter(rows, n: int):
    """A (buffer, first row, rows[, ring]) tuple cut to at most n rows (an ArenaRows: its count cut in place)."""
    if type(rows) is ArenaRows:
        a, s = rows.arena, rows.slot
        a.count[s] = max(0, min(int(a.count[s]), n))
        return rows
    return (rows[0], rows[1], max(0, min(rows[2], n)), *rows[3:])


def set_each(objs: list, attr: str, values) -> None:
    """objs[k].<attr> = values[k] for every k, by C-level maps (no Python bytecode per object: the batched path sets
    a few attributes of every sequence's states each step; a row tuple attribute is "_" + its name, `set_rows`)."""
    collections.deque(map(setattr, objs, itertools.repeat(attr), values), maxlen=0)


def _rows_property(name: str, doc: str):
    """A tensor attribute stored as (buffer, first row, rows) or (buffer, first row, rows, ring): the batched decode
    path gives many states rows of one shared buffer by setting three numbers (`set_rows`), and the slice is only
    made when the attribute is read (the reference path, rollbacks, tests). With a 4th number the rows wrap
    around a ring of that many rows (the compressors' token rows, engine/compress_step.py): reading gathers them."""
    key = "_" + name

    def get(self):
        rows = getattr(self, key)
        if rows is None:
            return None
        if type(rows) is ArenaRows:
            rows = rows.rows()
        if len(rows) == 4:
            return ring_rows(*rows)
        buf, off, n = rows
        return buf if off == 0 and n == buf.shape[0] else buf[off:off + n]

    def set(self, value):
        setattr(self, key, None if value is None else (value, 0, value.shape[0]))
    return property(get, set, doc=doc)


def _in(t: torch.Tensor, storages: frozenset) -> bool:
    """Whether t lives in one of the storages (by base address)."""
    return bool(storages) and t.untyped_storage().data_ptr() in storages


class _RowsMixin:
    def set_rows(self, name: str, buf: torch.Tensor, off: int, n: int) -> None:
        """<name> = buf[off:off + n] without making the slice now."""
        setattr(self, "_" + name, (buf, off, n))

    def rows(self, name: str) -> int:
        r = getattr(self, "_" + name)
        return 0 if r is None else r[2]


@dataclass
class CompressorState(_RowsMixin):
    ratio: int
    tok_start: int = 0                    # absolute position of tok_kv[0]
    _tok_kv: tuple | None = None          # (buffer, first row, rows) of the properties below (_rows_property)
    _tok_gate: tuple | None = None
    _entries: tuple | None = None
    _latents: tuple | None = None

    tok_kv = _rows_property("tok_kv", "[b, Dc] fp32 per-token kv projections (recent tokens)")
    tok_gate = _rows_property("tok_gate", "[b, Dc] fp32 per-token gate projections (None when ungated)")
    entries = _rows_property("entries", "[G, D] compressed entries (post-norm, post-RoPE)")
    latents = _rows_property("latents", "[G, D] pre-RoPE normalized latents (V4.1 index-K input)")

    @property
    def n_entries(self) -> int:
        return self.rows("entries")

    def truncate(self, length: int) -> None:
        keep = length // self.ratio
        for name, n in (("entries", keep), ("latents", keep), ("tok_kv", max(0, length - self.tok_start)),
                        ("tok_gate", max(0, length - self.tok_start))):
            r = getattr(self, "_" + name)
            if r is not None:
                setattr(self, "_" + name, _shorter(r, n))

    def nbytes(self, exclude: frozenset = frozenset()) -> int:
        """Bytes of the rows in use, except rows inside the storages `exclude` names (by base address)."""
        n = 0
        for name in ("tok_kv", "tok_gate", "entries", "latents"):
            r = getattr(self, "_" + name)
            if r is not None and not _in(r[0], exclude):
                n += r[2] * (r[0][0].numel() if r[0].shape[0] else 0) * r[0].element_size()
        return n


class WindowStack:
    """Every layer's window of one sequence as one tensor t [L, m, D] (layer k of the model = t[k]). The batched
    decode path keeps all layers' windows of all sequences in one slab (engine/arena.py WindowSlab) and points each
    sequence at its part, t = slab.data[:, slot, lo:hi] (engine/batched.py), instead of one tensor per (sequence,
    layer); the slice is made only when `t` is read. lo / hi live in the slab's per-slot arrays (a step moves every
    sequence's window by writing them at once). `attached` counts the layers whose `win` still reads from here
    (writing a layer's `win` detaches that layer)."""
    __slots__ = ("slab", "slot", "attached")

    def __init__(self, slab, slot: int, attached: int = 0):
        self.slab, self.slot, self.attached = slab, slot, attached

    @property
    def buf(self) -> torch.Tensor:
        """[L, S, cap, D] the slab's data."""
        return self.slab.data

    @property
    def lo(self) -> int:
        return int(self.slab.lo[self.slot])

    @lo.setter
    def lo(self, v: int) -> None:
        self.slab.lo[self.slot] = v

    @property
    def hi(self) -> int:
        return int(self.slab.hi[self.slot])

    @hi.setter
    def hi(self, v: int) -> None:
        self.slab.hi[self.slot] = v

    @property
    def t(self) -> torch.Tensor:
        return self.slab.data[:, self.slot, self.lo:self.hi]

    @property
    def m(self) -> int:
        return self.hi - self.lo

    def __deepcopy__(self, memo):
        """In a copy of its slab (the model's deep copy): a stack of the copy. Else a stack over a copy of its rows
        alone (not the slab, whose on_grow is the model's): the next fast step copies them into the model's slab as
        it does any stack from elsewhere."""
        slab = memo.get(id(self.slab))
        if slab is not None:
            return WindowStack(slab, self.slot, self.attached)
        return WindowStack(_OwnRows(self.t.clone()), 0, self.attached)


class _OwnRows:
    """The slab of a deep-copied WindowStack: its rows alone, data [L, 1, m, D], and their lo / hi (in the place
    of a slab's per-slot arrays)."""

    def __init__(self, t: torch.Tensor):
        self.data, self.lo, self.hi = t.unsqueeze(1), [0], [t.shape[1]]

    def forget(self) -> None:
        """(WindowSlab.forget: no step holds these rows.)"""


@dataclass
class LayerCache(_RowsMixin):
    ratio: int = 0                        # compression ratio of the layer (for truncating ikeys)
    comp: CompressorState | None = None
    icomp: CompressorState | None = None
    _ikeys: tuple | None = None           # (buffer, first row, rows) of `ikeys`
    _win: torch.Tensor | None = None      # own window (when not attached to a WindowStack)
    _stack: WindowStack | None = None     # attached: the window is _stack.t[_k]
    _k: int = 0

    ikeys = _rows_property("ikeys", "[G, Di] index keys (V4.1 index-K source layers)")

    @property
    def win(self) -> torch.Tensor | None:
        """[m, D] the last m window keys (= values) of this layer (see the module docstring)."""
        return self._stack.t[self._k] if self._stack is not None else self._win

    @win.setter
    def win(self, value: torch.Tensor | None) -> None:
        if self._stack is not None:
            self._stack.attached -= 1
            self._stack.slab.forget()      # (the stack no longer holds every layer: WindowSlab.held)
            self._stack = None
        self._win = value

    def attach(self, stack: WindowStack, k: int) -> None:
        """Read the window from stack.t[k] from now on."""
        if self._stack is not stack:
            self.win = None
            self._stack, self._k = stack, k
            stack.attached += 1
        self._k = k

    def nbytes(self, exclude: frozenset = frozenset()) -> int:
        n = 0
        for t in (self.win, self.ikeys):
            if t is not None and not _in(t, exclude):
                n += t.numel() * t.element_size()
        for s in (self.comp, self.icomp):
            if s is not None:
                n += s.nbytes(exclude)
        return n


@dataclass
class SequenceCache(_RowsMixin):
    layers: list[LayerCache]
    max_rollback: int = 16
    length: int = 0
    _tokens: tuple | None = None         # (buffer, first row, rows) of `tokens`
    keep_tokens: int = 32
    drafter: object = None               # free slot for the DSpark drafter's own state
    # earliest length a rollback may return to (data older is dropped): max(floor, length - max_rollback), the
    # second term taken into floor at each rollback (a step only moves the length; a rollback must not let the
    # next one reach below what the length before it allowed)
    floor: int = 0
    extra: dict = field(default_factory=dict)
    windows: WindowStack | None = None   # the layers' windows as one tensor (batched decode path), if attached

    tokens = _rows_property("tokens", "recent token ids (last `keep_tokens`), ending at length - 1")

    def recent_tokens(self) -> torch.Tensor:
        return self.tokens if self.tokens is not None else torch.zeros(0, dtype=torch.long)

    def rollback(self, n: int) -> None:
        """Forget the last n tokens. Raises ValueError if n > max_rollback or n > length."""
        if n < 0 or n > self.length:
            raise ValueError(f"rollback({n}) with cache length {self.length}")
        # (the floor as the steps since the last rollback left it: they only moved the length up)
        self.floor = max(self.floor, self.length - self.max_rollback)
        if n > self.max_rollback or self.length - n < self.floor:
            raise ValueError(f"rollback({n}) from length {self.length} goes past length {self.floor}: at most "
                             f"max_rollback={self.max_rollback} tokens after the last step can be rolled back")
        if n == 0:
            return
        new_len = self.length - n
        if self.windows is not None:      # every attached layer at once
            self.windows.hi = max(self.windows.lo, self.windows.hi - n)
        for lc in self.layers:
            if lc._stack is None and lc.win is not None:
                lc.win = lc.win[: max(0, lc.win.shape[0] - n)]
            for s in (lc.comp, lc.icomp):
                if s is not None:
                    s.truncate(new_len)
            if lc._ikeys is not None:     # (shorten the row count: the rows stay where they are, e.g. an arena)
                lc._ikeys = _shorter(lc._ikeys, new_len // lc.ratio)
        if self._tokens is not None:
            self._tokens = _shorter(self._tokens, self._tokens[2] - n)
        if self.drafter is not None and hasattr(self.drafter, "rollback"):
            self.drafter.rollback(n)
        self.length = new_len

    def nbytes(self, exclude: frozenset = frozenset()) -> int:
        """Bytes of the rows this cache holds. `exclude`: base addresses of shared storages (the model's window slab
        and row arenas, arena.storage_pointers) whose rows are not counted here: cache_pool counts those storages
        whole (their reserved bytes), not per cache."""
        return (sum(lc.nbytes(exclude) for lc in self.layers)
                + (0 if self.tokens is None else self.tokens.numel() * 8))
