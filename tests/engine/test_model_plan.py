"""Model.plan_step / launch / cancel: a step's count-dependent host half planned ahead (while the device would still
run the previous step), then launched with the token ids.

Oracle: the same model and caches stepped by `forward_step` (plan and launch back to back, no plan ahead), which
test_model_batched / test_model_graphs check against the per-sequence reference path and eager steps. A plan made
ahead must give the same logits and cache states bit for bit, with emulated CUDA graphs (their buffer discipline:
step n's outputs must survive step n+1's planning) and without; a cancelled plan must leave the caches as if it
had never been made.
"""
import copy

import pytest
import torch

from deepinfer_sg.engine import model as model_mod, testing
from deepinfer_sg.engine.model import StepChunk, StepRows
from deepinfer_sg.engine.step_graphs import SegmentGraphs

from test_model_batched import _random_model
from test_model_graphs import _same, _state

PROMPTS = [3, 9, 30, 45]


def _setup(seed=5):
    m = _random_model(testing.tiny_v41_config(), seed=2)
    g = torch.Generator().manual_seed(seed)
    caches = [m.new_cache() for _ in PROMPTS]
    m.forward_step([StepChunk(c, torch.randint(0, m.config.vocab_size, (n,), generator=g), 1)
                    for c, n in zip(caches, PROMPTS)])
    return m, caches, g


def _twins(seed: int, graphs: bool):
    """A model with its caches after the prompts, and a deep copy of both (the reference that sees no plan), each
    with emulated graphs on or off."""
    m, caches, g = _setup(seed=seed)
    ref_m, ref_caches = copy.deepcopy(m), copy.deepcopy(caches)
    for mm in (m, ref_m):
        mm._graphs = SegmentGraphs(emulate=True, warm=1)
        mm.cuda_graphs = graphs
    return m, caches, g, ref_m, ref_caches


@pytest.mark.parametrize("graphs,device_tail", [(False, False), (True, False), (True, True)])
def test_planned_ahead_decode_equals_forward_step(graphs, device_tail, monkeypatch):
    """device_tail: the caches' recent token ids taken for device tensors (as on CUDA after ids given on the
    device): the launch then hashes the Engram row ids on the host into their slots of the step's upload
    (Model._engram_rows, ctx.engram_ids) instead of the device hashing the windows; same results. Graph steps send
    their upload at plan time and copy the ids in inside the first graph (model.send_ahead); the oracle sends its
    upload, ids in it, at launch."""
    m, caches, g = _setup()
    ref_m, ref_caches = copy.deepcopy(m), copy.deepcopy(caches)
    for mm in (m, ref_m):
        mm._graphs = SegmentGraphs(emulate=True, warm=1)
        mm.cuda_graphs = graphs
    ref_m.send_ahead = False
    V = m.config.vocab_size
    # decode rows then verify-like rows (T changes: a new graph size midway), one sequence sitting out a step
    schedule = [[1, 1, 1, 1]] * 4 + [[2, 1, 3, 1]] * 3 + [[1, 0, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2
    ids = [torch.randint(0, V, (sum(r),), generator=g) for r in schedule]

    def rows_of(k):
        return [StepRows(c, n, n) for c, n in zip(caches, schedule[k]) if n]
    if device_tail:
        monkeypatch.setattr(model_mod, "_on_host", lambda t: False)
    plan = m.plan_step(rows_of(0))
    outs, ahead = [], 0
    for k in range(len(schedule)):
        # (device ids: the Engram slots of the prepared segments are hashed at plan time, none is left for launch)
        assert plan.segments and not (device_tail and any(s.late for s in plan.segments))
        if plan.ctx.ids_host is not None:     # (a graph step: the upload went at plan time unless launch fills it)
            ahead += 1
            assert bool(plan.ctx.plan.sends) == bool(plan.ctx.engram_ids)
        out = m.launch(plan, ids[k])
        plan = m.plan_step(rows_of(k + 1)) if k + 1 < len(schedule) else None   # before step k's outputs are read
        outs.append(out)
    monkeypatch.undo()     # (the oracle: the device hash)
    for k, r in enumerate(schedule):
        chunks, at = [], 0
        for c, n in zip(ref_caches, r):
            if n:
                chunks.append(StepChunk(c, ids[k][at:at + n], n))
                at += n
        want = ref_m.forward_step(chunks)
        assert torch.equal(outs[k].logits, want.logits), f"step {k}: logits differ"
    for k, (x, y) in enumerate(zip(caches, ref_caches)):
        _same(_state(x), _state(y), f"cache {k}")
    if graphs:
        assert m._graphs.captures > 0 and m._graphs._sizes    # (graphs were captured and replayed)
        assert ahead >= 6, "graph steps (capture and replays) should take the ids through their host buffer"


@pytest.mark.parametrize("graphs", [False, True])
def test_a_cancelled_plan_leaves_the_caches_as_they_were(graphs):
    m, caches, g, ref_m, ref_caches = _twins(6, graphs)
    V = m.config.vocab_size
    for k in range(7):
        ids = torch.randint(0, V, (len(caches),), generator=g)
        if k % 2 == 0:     # a plan for a step that does not happen (e.g. a request finished): cancelled
            # (lengths 30 + k and 45 + k complete ratio-2 / ratio-4 groups on some steps: counts advance)
            m.cancel(m.plan_step([StepRows(c, 2, 1) for c in caches[1:]]))
        out = m.forward_step([StepChunk(c, ids[b:b + 1], 1) for b, c in enumerate(caches)])
        want = ref_m.forward_step([StepChunk(c, ids[b:b + 1], 1) for b, c in enumerate(ref_caches)])
        assert torch.equal(out.logits, want.logits), f"step {k}"
        for b, (x, y) in enumerate(zip(caches, ref_caches)):
            _same(_state(x), _state(y), f"step {k}, cache {b}")


@pytest.mark.parametrize("graphs", [False, True])
def test_a_plan_that_fails_midway_leaves_the_caches_as_they_were(graphs, monkeypatch):
    """plan_step raising after some compressing layers were planned (their states' rows reserved and token rows
    changed): the undo log puts every state back, and the next steps equal a model that never saw that plan. The
    plan also placed recent ids into the token ring (engine/token_ring.py): a cache's ids set another way moved in
    and a new cache given a slot; both hold what they held before, the others their ring rows as they were."""
    m, caches, g, ref_m, ref_caches = _twins(7, graphs)
    for cs in (caches, ref_caches):
        cs[1].tokens = cs[1].tokens.clone()
    foreign, fresh = caches[1]._tokens, m.new_cache()
    ring_rows = [c._tokens for c in caches]
    real = model_mod.compress_step.plan_layer
    calls = {"n": 0}

    def fails_on_the_last(*a, **k):
        calls["n"] += 1
        if calls["n"] == len(model_mod.compress_step.graph_layers(m)):
            raise RuntimeError("planned failure")
        return real(*a, **k)
    monkeypatch.setattr(model_mod.compress_step, "plan_layer", fails_on_the_last)
    with pytest.raises(RuntimeError, match="planned failure"):
        m.plan_step([StepRows(c, 1, 1) for c in caches + [fresh]])
    assert calls["n"] >= 2, "the failure did not come after some layers were planned"
    monkeypatch.setattr(model_mod.compress_step, "plan_layer", real)
    assert all(c._tokens is t for c, t in zip(caches, ring_rows)) and caches[1]._tokens is foreign
    assert fresh._tokens is None and fresh.length == 0
    for b, (x, y) in enumerate(zip(caches, ref_caches)):
        _same(_state(x), _state(y), f"after the failed plan, cache {b}")
    V = m.config.vocab_size
    for k in range(3):
        ids = torch.randint(0, V, (len(caches),), generator=g)
        out = m.forward_step([StepChunk(c, ids[b:b + 1], 1) for b, c in enumerate(caches)])
        want = ref_m.forward_step([StepChunk(c, ids[b:b + 1], 1) for b, c in enumerate(ref_caches)])
        assert torch.equal(out.logits, want.logits), f"step {k}"
        for b, (x, y) in enumerate(zip(caches, ref_caches)):
            _same(_state(x), _state(y), f"step {k}, cache {b}")


def test_plan_misuse_is_refused_with_a_clear_error():
    m, caches, g = _setup()
    # planning again (another caller of the same model) supersedes an open plan: it is cancelled, not launchable
    lengths = [c.length for c in caches]
    stale = m.plan_step([StepRows(c, 1) for c in caches])
    plan = m.plan_step([StepRows(c, 1) for c in caches])
    assert stale.state == "cancelled" and [c.length for c in caches] == lengths
    with pytest.raises(RuntimeError, match="already cancelled"):
        m.launch(stale, torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="token ids of shape"):
        m.launch(plan, torch.tensor([1, 2]))
    # a failed launch dropped the plan and restored the caches: a new plan is allowed, and runs
    lengths = [c.length for c in caches]
    plan = m.plan_step([StepRows(c, 1) for c in caches])
    with pytest.raises(ValueError, match="token id outside"):
        m.launch(plan, torch.tensor([1, 2, -3, 4]))
    assert [c.length for c in caches] == lengths
    plan = m.plan_step([StepRows(c, 1) for c in caches])
    m.launch(plan, torch.tensor([1, 2, 3, 4]))
    assert [c.length for c in caches] == [n + 1 for n in lengths]
    with pytest.raises(RuntimeError, match="already launched"):
        m.launch(plan, torch.tensor([1, 2, 3, 4]))
    with pytest.raises(RuntimeError, match="already launched"):
        m.cancel(plan)
    with pytest.raises(ValueError, match="no tokens"):
        m.plan_step([StepRows(caches[0], 0)])
    # (the rows' numbers are checked by numpy over all rows: the first bad row is named)
    with pytest.raises(ValueError, match="StepChunk 2 with no tokens"):
        m.plan_step([StepRows(c, 0 if k > 1 else 1) for k, c in enumerate(caches)])
    with pytest.raises(ValueError, match=r"logit_rows 3 not in 0\.\.2"):
        m.plan_step([StepRows(caches[0], 1), StepRows(caches[1], 2, 3), StepRows(caches[2], 1, -1)])
    with pytest.raises(ValueError, match="appears in two chunks"):
        m.plan_step([StepRows(caches[1], 1), StepRows(caches[1], 1)])
    assert [c.length for c in caches] == [n + 1 for n in lengths]
    # recent ids set outside forward_step, one the device's Engram hash would read its class map at: refused when
    # planned (the step's own ids are checked at launch)
    caches[0].tokens = torch.tensor([1, m.config.vocab_size])
    with pytest.raises(ValueError, match="recent token ids hold"):
        m.plan_step([StepRows(c, 1) for c in caches])


def test_the_step_pipeline_gives_forward_step_results_through_batch_changes():
    """An engine-like loop through engine/step_pipeline.py (plans made ahead, used or cancelled) against
    forward_step on copies: a sequence finishing, a prefill chunk joining, a rollback after cancel()."""
    from deepinfer_sg.engine.step_pipeline import StepPipeline
    m, caches, g = _setup(seed=8)
    ref_m, ref_caches = copy.deepcopy(m), copy.deepcopy(caches)
    for mm in (m, ref_m):
        mm._graphs = SegmentGraphs(emulate=True, warm=1)
    V = m.config.vocab_size
    pipe = StepPipeline(m)
    live = [0, 1, 2, 3]
    for step in range(9):
        if step == 3:
            live.remove(1)                                  # a request finished
        if step == 5:                                       # a new request's prefill rides along
            caches.append(m.new_cache())
            ref_caches.append(ref_m.new_cache())
            live.append(4)
        n_of = {k: (5 if step == 5 and k == 4 else 1) for k in live}
        ids = {k: torch.randint(0, V, (n_of[k],), generator=g) for k in live}
        out = pipe.forward([StepChunk(caches[k], ids[k], 1) for k in live])
        want = ref_m.forward_step([StepChunk(ref_caches[k], ids[k], 1) for k in live])
        assert torch.equal(out.logits, want.logits), f"step {step}"
        if step == 6:        # a rollback (as after a speculative step): the open plan goes first
            pipe.cancel()
            for k in live:
                caches[k].rollback(1)
                ref_caches[k].rollback(1)
    pipe.cancel()
    for k in live:
        _same(_state(caches[k]), _state(ref_caches[k]), f"cache {k}")
    assert pipe.hits >= 4 and pipe.misses >= 3


def test_a_cache_changed_behind_the_models_back_is_an_explicit_error():
    """compress_step.plan_layer's cache / compressor sync check is an error with the layer and sequence (it was
    an assert, gone under python -O); the step is refused before anything changes."""
    m, caches, g = _setup(seed=9)
    m.forward_step([StepChunk(c, torch.tensor([5]), 1) for c in caches])
    caches[2].length += 3              # (e.g. a caller's own bookkeeping): the compressor states did not move
    with pytest.raises(RuntimeError, match=r"sequence 2 of the step has \d+ compressed entries.*out of sync"):
        m.forward_step([StepChunk(c, torch.tensor([6]), 1) for c in caches])
    caches[2].length -= 3
    m.forward_step([StepChunk(c, torch.tensor([6]), 1) for c in caches])   # and the model still steps after it
