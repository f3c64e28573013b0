"""engine/token_ring.py: the caches' recent token ids in per-slot rings, against a plain history per cache.

Oracle: every cache's whole id history as a Python list and the number of ids it holds kept by hand (a step adds
its ids and keeps at most keep_tokens, a rollback of n drops the last n ids and n of those held); after every
operation `cache.tokens` must be the last `held` ids of the history, whatever the ring did (slots handed out, freed
and reused, the ring grown, ids set another way moved in, a caller's undo log replayed)."""
import gc

import numpy as np
import pytest
import torch

from deepinfer_sg.engine.arena import undo
from deepinfer_sg.engine.cache import ArenaRows, SequenceCache
from deepinfer_sg.engine.token_ring import TokenRing, ring_size


def _check(caches, hist, held):
    for k, c in enumerate(caches):
        want = hist[k][len(hist[k]) - held[k]:]
        got = c.tokens
        assert (0 if got is None else got.shape[0]) == held[k] and (not want or got.tolist() == want), f"cache {k}"


def _step(ring, caches, hist, held, g, host=True):
    """One step of 0-3 new ids per cache (0: a cache the step leaves alone is not in it)."""
    pick = [k for k in range(len(caches)) if torch.randint(0, 4, (1,), generator=g).item()]
    if not pick:
        return
    _take(ring, caches, hist, held, pick, [1 + (k * 7 + len(hist[k])) % 3 for k in pick], g, host)


def _take(ring, caches, hist, held, pick, n, g, host=True):
    """caches[pick[j]] take n[j] (>= 0) new random ids in one step (place, then advance), the oracle with them."""
    n = np.array(n, dtype=np.int64)
    ids = torch.randint(0, 1000, (int(n.sum()),), generator=g)
    step = [caches[k] for k in pick]
    slots = ring.place(step)
    off = np.cumsum(n) - n
    ring.advance(slots, ids, n, off, np.array([c.length for c in step], dtype=np.int64), host=host)
    for j, k in enumerate(pick):
        hist[k].extend(ids[off[j]:off[j] + n[j]].tolist())
        held[k] = min(held[k] + int(n[j]), caches[k].keep_tokens)
        caches[k].length += int(n[j])


def _roll(caches, hist, held, k, cut):
    caches[k].rollback(cut)
    del hist[k][len(hist[k]) - cut:]
    held[k] = max(0, held[k] - cut)


def test_steps_rollbacks_foreign_ids_and_growth_keep_every_cache_right():
    g = torch.Generator().manual_seed(0)
    keeps = [5, 32, 17, 9, 32, 3, 32, 12, 32, 6, 20]            # > 8 caches: the ring's slots grow
    ring = TokenRing(ring_size(max(keeps)), torch.device("cpu"))
    assert ring.ring == 32
    caches = [SequenceCache([], max_rollback=4, keep_tokens=kp) for kp in keeps]
    hist, held = [[] for _ in caches], [0] * len(caches)
    caches[3].tokens, caches[3].length = torch.tensor([7, 8, 9]), 3     # ids set another way: moved in
    hist[3], held[3] = [7, 8, 9], 3
    for step in range(60):
        _step(ring, caches, hist, held, g, host=step % 2 == 0)
        _check(caches, hist, held)
        if step % 5 == 2:                                         # roll some back; the next step overwrites
            for k in (0, 4, 7):
                _roll(caches, hist, held, k, min(2, held[k], caches[k].length))
            _check(caches, hist, held)
    assert len(ring.first) >= 16 and all(type(c._tokens) is ArenaRows for c in caches)
    # (a ring holds at most R ids a slot: refused before anything changes, with a new cache that would make the
    # slots grow)
    before = [x.copy() for x in (ring.first, ring.count, ring.keep)] + [ring.flat.clone(), ring.slots.used]
    big = [SequenceCache([], keep_tokens=40)] + [SequenceCache([], keep_tokens=4) for _ in range(len(ring.first))]
    with pytest.raises(ValueError, match="keeps 40 token ids"):
        ring.place(caches + big)
    after = [ring.first, ring.count, ring.keep, ring.flat, ring.slots.used]
    assert all(np.array_equal(x, y) for x, y in zip(before[:3], after[:3]))
    assert torch.equal(before[3], after[3]) and before[4] == after[4] and all(c._tokens is None for c in big)
    _check(caches, hist, held)


def test_mixed_counts_zero_included_and_rollbacks_then_wrap_around():
    """Steps whose caches take mixed counts, 0 included (n = [0, 2]: as many ids as caches, not one each), and
    speculative-style steps (1 + 3 drafted ids, then 0-3 rejected and rolled back) with keep_tokens = R, run until
    every ring has wrapped around many times."""
    g = torch.Generator().manual_seed(1)
    ring = TokenRing(ring_size(16), torch.device("cpu"))
    assert ring.ring == 16
    caches = [SequenceCache([], max_rollback=4, keep_tokens=kp) for kp in (16, 5, 16)]
    hist, held = [[] for _ in caches], [0] * len(caches)
    for pick, n in (([0, 1], [0, 2]), ([0, 1, 2], [1, 0, 2]), ([1, 2], [2, 0]), ([0, 1, 2], [0, 0, 0]),
                    ([0, 1, 2], [1, 1, 1]), ([2, 0], [0, 2]), ([0, 1, 2], [20, 7, 0])):
        _take(ring, caches, hist, held, pick, n, g, host=len(pick) % 2 == 0)
        _check(caches, hist, held)
    for step in range(40):
        _take(ring, caches, hist, held, [0, 1, 2], [4, 4, 4], g, host=step % 2 == 0)
        _check(caches, hist, held)
        for k in range(3):
            _roll(caches, hist, held, k, (step + k) % 4)
        _check(caches, hist, held)
        _take(ring, caches, hist, held, [0, 1, 2], [1, 1, 1], g, host=step % 3 == 0)    # (one id each)
        _check(caches, hist, held)
    assert min(c.length for c in caches) > 4 * ring.ring


def test_a_steady_step_is_held_a_freed_slot_is_reused_and_an_undo_puts_the_old_ids_back():
    """The same caches again: `held` answers their slots (no placement); a cache set another way is placed again
    and an undo log of that placement puts its own tuple back; a collected cache's slot goes to the next one."""
    ring = TokenRing(16, torch.device("cpu"))
    caches = [SequenceCache([], keep_tokens=8) for _ in range(3)]
    slots = ring.place(caches)
    ring.advance(slots, torch.arange(3), np.ones(3, np.int64), np.arange(3), np.zeros(3, np.int64), host=True)
    for k in range(3):
        caches[k].length = 1
    assert ring.held(caches) is not None and ring.held(caches[::-1]) is None
    old = caches[1]._tokens
    caches[1].tokens = torch.tensor([42])
    mine = caches[1]._tokens
    assert ring.held(caches) is None
    log = []
    assert ring.place(caches, log).tolist() == slots.tolist() and caches[1].tokens.tolist() == [42]
    assert caches[1]._tokens is old
    undo(log)
    assert caches[1]._tokens is mine and ring.held(caches) is None
    gone = int(slots[2])
    del caches[2]
    gc.collect()
    fresh = SequenceCache([], keep_tokens=8)
    assert ring.place(caches[:2] + [fresh])[2] == gone and fresh.tokens.shape[0] == 0


def test_rollbacks_reach_back_at_most_max_rollback_tokens_past_the_longest_length_since():
    """Steps only move a cache's length (Model._advance); the rollback floor follows it: from length 10 with
    max_rollback 4, rollbacks of 3 then 2 go past 6 (refused), a step to 8 and a rollback of 2 reach 6, one more
    is refused."""
    c = SequenceCache([], max_rollback=4, length=10)
    c.rollback(3)
    with pytest.raises(ValueError, match="goes past length 6"):
        c.rollback(2)
    c.length += 1
    c.rollback(2)
    assert c.length == 6
    with pytest.raises(ValueError, match="goes past length 6"):
        c.rollback(1)
    with pytest.raises(ValueError, match="goes past"):
        c.rollback(5)
