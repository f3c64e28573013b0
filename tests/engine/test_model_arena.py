"""engine/arena.py: in-place row storage of the batched decode path, against plain per-state lists of rows.

Oracle: every state's rows kept by hand as a Python list of row tensors (append = list.extend, rollback = cut);
after every operation each state's `entries` must equal its list, whatever the arena did (slots handed out and
reused, slots and rows doubled, states with rows from elsewhere moved in, rollbacks overwritten)."""
import gc

import torch

from deepinfer_sg.engine.arena import RowArena, Slots, undo
from deepinfer_sg.engine.cache import ArenaRows, CompressorState


def _check(states, want):
    for k, (st, rows) in enumerate(zip(states, want)):
        if not rows:
            assert st.entries is None or st.entries.shape[0] == 0, k
        else:
            assert torch.equal(st.entries, torch.stack(rows)), f"state {k}"


def test_appends_growth_rollback_and_foreign_rows_keep_every_state_right():
    g = torch.Generator().manual_seed(0)
    arena = RowArena("entries", 4, torch.float32, torch.device("cpu"))
    states = [CompressorState(ratio=1) for _ in range(11)]     # > 8 slots: the slot count doubles
    want = [[] for _ in states]
    foreign = torch.randn(3, 4, generator=g)
    states[5].entries = foreign                                 # rows from the reference path: moved in
    want[5] = list(foreign)
    for step in range(90):                                      # > 64 rows per slot: the rows double
        pick = [k for k in range(len(states)) if (k + step) % 3]
        news = [(k + step) % 4 for k in pick]                   # 0 to 3 new rows each
        new = torch.randn(sum(news), 4, generator=g)
        flat, starts = arena.append([states[k] for k in pick], new, news)
        at = 0
        for k, n, s0 in zip(pick, news, starts):
            want[k].extend(new[at:at + n])
            at += n
            if want[k]:                                          # the pool view: rows at the returned start
                assert torch.equal(flat[s0:s0 + len(want[k])], torch.stack(want[k]))
        _check(states, want)
        if step % 7 == 3:                                        # roll some back; the next append overwrites
            for k in (1, 4):
                cut = min(2, len(want[k]))
                states[k].truncate(len(want[k]) - cut)
                del want[k][len(want[k]) - cut:]
            _check(states, want)
    assert arena.data.shape[0] == 16 and arena.data.shape[1] > 64 and max(len(w) for w in want) > 64
    assert arena.moved_rows == 3      # only the foreign rows were ever copied: growth re-points, appends write new


def test_a_states_rows_are_its_slots_object_written_in_bulk_cut_in_place_and_undone_from_the_log():
    """Each state holds its slot's ArenaRows: a reserve of the same states writes the arena's count array and no
    attribute, a rollback cuts the count through the same object, an undo log puts the arrays back, and a state
    whose rows were set another way (the reference path) is moved back into its slot at the next reserve."""
    arena = RowArena("entries", 2, torch.float32, torch.device("cpu"))
    states = [CompressorState(ratio=1) for _ in range(3)]
    arena.append(states, torch.arange(6.0).view(3, 2), [1, 1, 1])
    objs = [st._entries for st in states]
    assert all(type(o) is ArenaRows for o in objs)
    log = []
    arena.reserve(states, [2, 2, 3], log)
    assert all(st._entries is o for st, o in zip(states, objs)), "the common path re-points no state"
    assert [st.rows("entries") for st in states] == [2, 2, 3]
    undo(log)
    assert [st.rows("entries") for st in states] == [1, 1, 1]
    assert torch.equal(states[1].entries, torch.tensor([[2.0, 3.0]]))
    states[0].truncate(0)
    assert states[0]._entries is objs[0] and states[0].rows("entries") == 0
    states[2].entries = torch.full((2, 2), 9.0)
    arena.reserve(states, [1, 1, 2])
    assert states[2]._entries is objs[2] and torch.equal(states[2].entries, torch.full((2, 2), 9.0))
    assert torch.equal(states[1].entries, torch.tensor([[2.0, 3.0]])) and arena.moved_rows == 2


def test_a_collected_state_frees_its_slot_for_the_next_one():
    arena = RowArena("entries", 2, torch.float32, torch.device("cpu"))
    a, b = CompressorState(ratio=1), CompressorState(ratio=1)
    arena.append([a, b], torch.ones(2, 2), [1, 1])
    slot_b = arena.slots.of(b)
    del b
    gc.collect()
    c = CompressorState(ratio=1)
    _, starts = arena.append([c], torch.full((1, 2), 7.0), [1])
    assert arena.slots.of(c) == slot_b and starts == [slot_b * arena.data.shape[1]]
    assert torch.equal(c.entries, torch.full((1, 2), 7.0)) and torch.equal(a.entries, torch.ones(1, 2))


def test_slots_of_a_repeated_owner_list_stay_right_when_owners_die_and_ids_are_reused():
    """Slots.of_all caches the last owner list's slots; the oracle is `of` asked one by one, and the rule that two
    live owners never share a slot (a dead owner's id can be reused by a new object)."""
    class Owner:
        pass
    slots = Slots()
    owners = [Owner() for _ in range(6)]
    for _ in range(2):     # (the second call is answered from the cache)
        assert slots.of_all(owners) == [slots.of(o) for o in owners]
    for k in range(40):    # replace one or two owners per round: CPython often reuses a dead owner's id
        gone = [k % 6] if k % 2 else [k % 6, (k + 3) % 6]
        for j in gone:
            owners[j] = None
        gc.collect()
        for j in gone:
            owners[j] = Owner()
        got = slots.of_all(owners)
        assert all(slots.owner.get(s) is not None and slots.owner[s]() is o for s, o in zip(got, owners)), \
            f"round {k}: a slot not registered to its owner"
        assert got == [slots.of(o) for o in owners] and len(set(got)) == len(owners)
        assert slots.of_all(list(owners)) == got


def test_windows_that_reach_the_end_of_their_slab_slot_move_and_stay_right():
    """Decode long enough that every sequence's window rows reach the end of its slab slot (they move to the
    slot's start), with rollbacks in between: logits and windows against the reference path (per-sequence
    dense attention over its own window tensors)."""
    import copy

    from deepinfer_sg.engine import testing
    from deepinfer_sg.engine.model import StepChunk
    from test_model_batched import _close, _random_model, _rel
    m = _random_model(testing.tiny_v41_config(), seed=4)
    g = torch.Generator().manual_seed(4)
    caches = [m.new_cache() for _ in range(3)]
    m.fast_decode = False
    m.forward_step([StepChunk(c, torch.randint(0, 512, (n,), generator=g), 1) for c, n in zip(caches, (5, 17, 30))])
    ref = copy.deepcopy(caches)
    moved = 0
    for step in range(90):
        ids = torch.randint(0, 512, (3,), generator=g)
        m.fast_decode = True
        before = [c.windows.lo if c.windows is not None else None for c in caches]
        a = m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(caches)]).logits
        moved += sum(b is not None and c.windows.lo < b for b, c in zip(before, caches))
        m.fast_decode = False
        b = m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(ref)]).logits
        assert _rel(a, b) < 1e-5, step
        for c, r in zip(caches, ref):
            for lc, lr in zip(c.layers, r.layers):
                _close(lc.win, lr.win, f"step {step}")
        if step % 9 == 4:
            for c, r in zip(caches, ref):
                c.rollback(2)
                r.rollback(2)
    assert moved >= 3, "no window reached the end of its slot"


def test_a_deep_copy_of_caches_after_fast_steps_copies_their_rows_not_the_model():
    """Caches after fast steps hold ArenaRows and WindowStacks, whose arena / slab hold the model's reset_graphs:
    copy.deepcopy of them copies no model tensor (its memo names none of the model's parameters), and the copies'
    next fast step (their rows moved into the model's slab and arenas) gives the logits of the same step from the
    originals (a separate launch) and from the reference path on a copy taken by hand (rows cloned per layer). A
    deep copy of the model still copies its arenas with their slots' objects."""
    import copy

    from deepinfer_sg.engine import testing
    from deepinfer_sg.engine.cache import WindowStack
    from deepinfer_sg.engine.model import StepChunk
    from test_model_batched import _random_model, _rel
    m = _random_model(testing.tiny_v41_config(), seed=6)
    g = torch.Generator().manual_seed(6)
    caches = [m.new_cache() for _ in range(3)]
    m.forward_step([StepChunk(c, torch.randint(0, 512, (n,), generator=g), 1) for c, n in zip(caches, (9, 40, 70))])
    for _ in range(3):
        m.forward_step([StepChunk(c, torch.randint(0, 512, (1,), generator=g), 1) for c in caches])
    assert all(type(c.windows) is WindowStack for c in caches)
    assert any(type(lc.comp._entries) is ArenaRows for c in caches for lc in c.layers if lc.comp is not None)
    by_hand = [_plain_copy(c) for c in caches]
    memo = {}
    copies = copy.deepcopy(caches, memo)
    assert id(m) not in memo and not any(id(p) in memo for p in m.parameters())
    ids = torch.randint(0, 512, (3,), generator=g)
    got = m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(copies)]).logits
    orig = m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(caches)]).logits
    m.fast_decode = False
    ref = m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(by_hand)]).logits
    assert torch.equal(got, orig) and _rel(got, ref) < 1e-5
    # a deep copy of the model itself copies its arenas whole: their slots' objects are the copies' own
    m2 = copy.deepcopy(m)
    for a in m2._row_arenas.values():
        assert all(o is None or (type(o) is ArenaRows and o.arena is a) for o in a._rows)


def _plain_copy(cache):
    """A SequenceCache with every row attribute read out and cloned (plain tensors: no arena, no slab)."""
    from deepinfer_sg.engine.cache import CompressorState, LayerCache, SequenceCache
    layers = []
    for lc in cache.layers:
        states = []
        for st in (lc.comp, lc.icomp):
            if st is None:
                states.append(None)
                continue
            new = CompressorState(ratio=st.ratio, tok_start=st.tok_start)
            for name in ("tok_kv", "tok_gate", "entries", "latents"):
                t = getattr(st, name)
                setattr(new, name, None if t is None else t.clone())
            states.append(new)
        new = LayerCache(ratio=lc.ratio, comp=states[0], icomp=states[1])
        new.ikeys = None if lc.ikeys is None else lc.ikeys.clone()
        new.win = None if lc.win is None else lc.win.clone()
        layers.append(new)
    out = SequenceCache(layers, max_rollback=cache.max_rollback, length=cache.length, keep_tokens=cache.keep_tokens,
                        floor=cache.floor)
    out.tokens = cache.tokens.clone()
    return out


def test_steps_in_and_out_of_inference_mode_share_the_caches():
    """The engine runs steps under torch.inference_mode, other callers under no_grad: the slab and arenas made in
    one mode are written in place in the other."""
    from deepinfer_sg.engine import testing
    from deepinfer_sg.engine.model import StepChunk
    from test_model_batched import _random_model
    m = _random_model(testing.tiny_v41_config(), seed=5)
    c = m.new_cache()
    m.forward_step([StepChunk(c, torch.arange(30), 1)])    # (reference path: no slab yet)
    for k in range(6):
        if k % 2:
            out = m.forward_step([StepChunk(c, torch.tensor([k]), 1)])
        else:
            with torch.inference_mode():
                out = m.forward_step([StepChunk(c, torch.tensor([k]), 1)])
        assert torch.isfinite(out.logits).all()


def _allocated_cache_bytes(model, caches) -> int:
    """Oracle: bytes of every distinct storage the caches' tensors and the model's slabs / arenas live in (from
    torch's own storage sizes, whatever the arenas' books say)."""
    seen = {}

    def add(t):
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    def add_rows(holder, name):    # the buffer behind a (buffer, first row, rows[, ring]) attribute
        t = getattr(holder, "_" + name)
        if t is not None:
            add(t[0])
    for c in caches:
        add_rows(c, "tokens")
        for lc in c.layers:
            add(lc.win)
            add_rows(lc, "ikeys")
            for s in (lc.comp, lc.icomp):
                if s is not None:
                    for name in ("tok_kv", "tok_gate", "entries", "latents"):
                        add_rows(s, name)
    for d in (model.__dict__.get("_window_slabs", {}), model.__dict__.get("_row_arenas", {})):
        for s in d.values():
            add(s.data)
    return sum(seen.values())


def test_the_pool_counts_what_the_slab_and_arenas_reserve_before_they_grow():
    """Mixed lengths (one long sequence, short ones: every arena slot reserves the longest one's rows), sequences
    admitted one per step until the slab's and arenas' slots double, rows doubling as the long one grows: before
    every step, the pool's used bytes plus the growth it predicts for the step's tokens (what the scheduler
    checks against the limit) cover everything allocated for the caches after it (the oracle: torch's storage
    sizes), while the rows in use alone (the old books) fall short of it."""
    from deepinfer_sg.engine import testing
    from deepinfer_sg.engine.cache_pool import CachePool
    from deepinfer_sg.engine.model import StepChunk
    from test_model_batched import _random_model
    m = _random_model(testing.tiny_v41_config(), seed=6)
    pool = CachePool(m, limit_bytes=1 << 40)        # (growth model measured on the model)
    g = torch.Generator().manual_seed(6)
    short_of = 0
    for step in range(48):
        steps = [[StepChunk(c, torch.randint(0, 512, (1,), generator=g), 1) for c in pool.live.values()]]
        fresh = 0
        if step % 4 == 0 and len(pool.live) < 10:   # an admission (charged before it is allocated, as the
            n = 60 if not pool.live else 3 + len(pool.live)    # scheduler does); its prefill runs first
            fresh = pool.growth.bytes_for(n)
            steps.insert(0, [StepChunk(pool.allocate(str(len(pool.live))), torch.randint(0, 512, (n,), generator=g),
                                       1)])
        for chunks in steps:
            if not chunks:
                continue
            if fresh:
                before, fresh = pool.used_bytes() - sum(ch.cache.nbytes() for ch in chunks) + fresh, 0
            else:
                before = pool.used_bytes() + pool.growth.per_token * len(chunks)
            m.forward_step(chunks)
            caches = list(pool.live.values())
            actual = _allocated_cache_bytes(m, caches)
            assert before >= actual, f"step {step}: the pool counted {before} bytes, {actual} are allocated"
            short_of += sum(c.nbytes() for c in caches) < actual
    assert len(m._window_slabs) == 1 and next(iter(m._window_slabs.values())).data.shape[1] == 16   # slots doubled
    assert max(a.data.shape[1] for a in m._row_arenas.values()) >= 128                              # rows doubled
    assert short_of > 40, "the rows in use should under-count the reserved storage in most steps"
