"""The sequences' recent token ids (SequenceCache.tokens: the last `keep_tokens`, read by the Engram n-gram windows)
at fixed addresses: one ring of R ids per sequence, the id at position p of the sequence in slot s at
flat[s * R + p % R].

Why: Model._advance used to append every sequence's new ids by one gather into a new buffer and give each cache a
new (buffer, first row, rows) tuple: Python per sequence after the graph run (advance 0.57-1.06 ms at batch 256 on
the H200, sessions 14-15; with the ring 0.11-0.16 ms in the same processes, benchmarks/model_forward.py's
docstring). Here each cache keeps its slot's cache.ArenaRows (its numbers in the ring's per-slot arrays `first` /
`count`, as engine/arena.py's RowArena), a steady step is one identity check over the caches (`held`), one write of
the new ids in place (numpy on the host, one index_put on a device) and the arrays written for all slots at once
(`advance`); the Engram windows index the ring by position (Model._windows_prep). A cache whose ids live elsewhere
(a deep copy, another ring, a first step) is placed by the slow path (`place`: its ids read and written into its
slot). A rollback cuts its slot's count in place (cache._shorter); rows past the count are free. Slots are freed
with their cache (weakref.finalize); when they run out the ring grows (slots doubled, compacted to the live ones,
one copy). Nothing captured in a CUDA graph reads the ring (the windows' values go up with the step's upload), so a
growth needs no graph reset.
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from .arena import MIN_SLOTS, Slots, SlotRows, _pow2_at_least, live_slots
from .transfer import ragged_arange, to_device_many

MIN_RING = 16
# a cache's recent ids (a tuple or cache.ArenaRows) and how many it keeps
_TOKENS = operator.attrgetter("_tokens")
_KEEP = operator.attrgetter("keep_tokens")


def ring_size(keep: int) -> int:
    """R for caches keeping up to `keep` ids: a power of two >= keep (>= MIN_RING)."""
    return _pow2_at_least(keep, MIN_RING)


class TokenRing(SlotRows):
    def __init__(self, ring: int, device: torch.device):
        self.ring = ring
        self.key, self._get = "_tokens", _TOKENS
        # flat [slots * R + 1]: every slot's ring, then a -1 (the Engram windows' index points there for ids before a
        # sequence's start or beyond its kept ones, Model._windows_prep: no copy of the ring with a -1 each step)
        with torch.inference_mode(False):     # (written in place in and out of inference_mode)
            self.flat = torch.full((1,), -1, dtype=torch.long, device=device)
        self.slots = Slots()
        # per slot: its first id's row in flat, how many it holds, and how many its cache keeps (keep_tokens, read
        # when the cache is placed)
        self.first = np.zeros(0, dtype=np.int64)
        self.count = np.zeros(0, dtype=np.int64)
        self.keep = np.zeros(0, dtype=np.int64)
        self._rows: list = []                       # per slot: its ArenaRows (made on first use)
        self._held: tuple | None = None             # (ArenaRows list, slots int64) of the last `place`, cache order

    def place(self, caches: list, log: list | None = None) -> np.ndarray:
        """Each cache's slot (int64), every cache holding its slot's ArenaRows with the ids it held (those held
        elsewhere read through cache.tokens and written into its slot at their positions: one write for all) and
        its keep_tokens (<= R) in `keep`. log: an undo log (arena.undo) that gets the caches' old `_tokens`."""
        slots = self.held(caches)
        return slots if slots is not None else self._move_in(caches, log)

    def _move_in(self, caches: list, log: list | None) -> np.ndarray:
        """`place` for caches that are not all held (the slow path)."""
        R = self.ring
        keep = np.fromiter(map(_KEEP, caches), np.int64, len(caches))
        if keep.max() > R:     # (checked before anything changes: a refused placement leaves the ring as it was)
            raise ValueError(f"a cache keeps {int(keep.max())} token ids, more than this ring's {R}")
        slots = self.slots_for(caches)
        self.keep[slots] = keep
        moved, rows = [], []
        for c, t, s in zip(caches, map(_TOKENS, caches), slots):
            if t is self.rows_of(s):
                continue
            ids = c.tokens if t is not None else None
            m = 0 if ids is None else min(ids.shape[0], R)
            if m:
                moved.append(ids[ids.shape[0] - m:])
                rows.append(s * R + np.arange(c.length - m, c.length) % R)
            self.count[s] = m
            self.first[s] = s * R + (c.length - m) % R
        if moved:
            self._write(np.concatenate(rows), torch.cat([t.to(self.flat.device) for t in moved]))
        return self.hold(caches, slots, log=log)

    def advance(self, slots: np.ndarray, ids: torch.Tensor, n: np.ndarray, off: np.ndarray, length: np.ndarray,
                host: bool = False) -> None:
        """The caches at `slots` (held) take their n[k] (>= 0) new ids ids[off[k]:off[k] + n[k]] at positions
        length[k]..: the last min(n, keep) of them written, each then holding min(its count + n, keep) ids. host: the
        ids are the host's (the step's ids as given on the host: read by numpy when the ring is there too)."""
        R, keep = self.ring, self.keep[slots]
        base, end = slots * R, length + n
        # one id each (a decode step): the ids in order, no ragged lists. (n == 1 checked, not implied by the ids'
        # count: Model.plan_step refuses n <= 0, but n = [0, 2] has as many ids as slots)
        if ids.shape[0] == len(slots) and (n == 1).all():
            self._write(base + length % R, ids, None, host)
        else:
            new = np.minimum(n, keep)      # (older ones of a longer chunk would fall out of its ring anyway)
            self._write(np.repeat(base, new) + ragged_arange(end - new, new) % R, ids,
                        ragged_arange(off + n - new, new), host)
        count = self.count[slots] = np.minimum(self.count[slots] + n, keep)
        self.first[slots] = base + (end - count) % R

    def _write(self, rows: np.ndarray, values: torch.Tensor, pick: np.ndarray | None = None,
               host: bool = False) -> None:
        """flat[rows] = values (values[pick] when given): by numpy when both are on the host (`host`: values is a
        host tensor numpy may read), else one index_put (its indices in one copy)."""
        flat = self.flat
        if host and flat.device.type == "cpu":
            v = values.numpy()
            flat.numpy()[rows] = v if pick is None else v[pick]
            return
        parts = to_device_many([torch.from_numpy(rows)] + ([] if pick is None else [torch.from_numpy(pick)]),
                               flat.device)
        values = values.to(flat.device)
        flat[parts[0]] = values if pick is None else values[parts[1]]

    def _grow(self, slots: int) -> bool:
        """Make room for `slots` slots: a new ring with the live slots renumbered 0..n-1 (free ones dropped), slots
        a power of two >= twice the live ones; copy, renumber the slots' objects. -> whether it grew."""
        R, S = self.ring, len(self.first)
        if slots <= S:
            return False
        moves = self.slots.compact()
        S2 = _pow2_at_least(2 * len(moves), MIN_SLOTS)
        old = self.flat[:S * R].view(S, R)
        with torch.inference_mode(False):
            flat = torch.zeros(S2 * R + 1, dtype=torch.long, device=self.flat.device)
        flat[-1] = -1
        n, live = live_slots(moves, S, old.device)
        if n:
            flat[:S2 * R].view(S2, R)[:n] = old[live]
        self._rows, self.first, self.count, self.keep = self._renumber(moves, S2, R, R, (self.keep,))
        self.flat, self._held = flat, None
        return True


def token_ring(model, device: torch.device, ring: int) -> TokenRing:
    """The model's token ring of R = `ring` ids a slot on `device` (made on first use)."""
    rings = model.__dict__.setdefault("_token_rings", {})
    key = (torch.device(device), ring)
    got = rings.get(key)
    if got is None:
        got = rings[key] = TokenRing(ring, key[0])
    return got


def ring_for(model, caches: list, device=None, log: list | None = None) -> tuple:
    """(the token ring holding the caches' recent ids, their slots in it): the model's ring of its last step when it
    still holds them all (one identity check, TokenRing.held) and is on `device` (when given); else they are placed
    into the model's ring of that device (default: the device of a cache's ids that are not on the host, else the
    host) sized for the largest keep_tokens (TokenRing.place; log: an undo log)."""
    last = model.__dict__.get("_tokens_in")
    checked = last is not None and (device is None or last.flat.device == torch.device(device))
    if checked:
        slots = last.held(caches)
        if slots is not None:
            return last, slots
    if device is None:
        device = next((t[0].device for t in map(_TOKENS, caches) if t is not None
                       and t[0].device.type != "cpu"), torch.device("cpu"))
    ring = model._tokens_in = token_ring(model, device, ring_size(max(map(_KEEP, caches))))
    # (the held check just failed for this ring: not asked again)
    return ring, ring._move_in(caches, log) if checked and ring is last else ring.place(caches, log)
