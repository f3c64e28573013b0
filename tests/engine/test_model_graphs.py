"""The fast path's dense segments run through step_graphs.SegmentGraphs: replays must equal eager bit for bit.

On CUDA the segments are captured as CUDA graphs (checked on the H200 by benchmarks/model_forward.py --graphs,
which prints the max |diff| between graph replays and eager steps). Here the graphs are EMULATED on the CPU:
capture keeps the segment's input buffers, every replay re-runs the segment on them and copies its results into
the same output buffers. That keeps CUDA graphs' buffer discipline (inputs copied in, outputs overwritten by the
next replay), so any cache or output that kept a reference to a segment's buffer instead of a copy would change
under the next replay and show here. Oracle: the same model and caches run eagerly (graphs off).
"""
import copy

import pytest
import torch

from deepinfer_sg.engine import batched, testing
from deepinfer_sg.engine.model import StepChunk
from deepinfer_sg.engine.step_graphs import SegmentGraphs

from test_model_batched import _random_model

def _host_engram(m):
    """The model with its Engram rows looked up on the host (the path of memory-mapped tables), not read by the
    device from the table (model.engram_device_reads, the default for in-memory tables)."""
    m.engram_device_reads = False
    return m


MODELS = {
    "v4": lambda: _random_model(testing.tiny_v4_config(hc_mult=4, index_n_heads=2), seed=1),
    "v41": lambda: _random_model(testing.tiny_v41_config(), seed=2),
    "v41-host-engram": lambda: _host_engram(_random_model(testing.tiny_v41_config(), seed=2)),
}
PROMPTS = [3, 9, 30, 45]
# rows per sequence per step (the token count T repeats, so sizes get captured, then replayed), rollbacks after
SCHEDULE = [
    ([1, 1, 1, 1], None), ([1, 1, 1, 1], None), ([1, 1, 1, 1], None),       # T=4: eager, capture, replay
    ([3, 1, 2, 1], [2, 0, 1, 0]), ([3, 1, 2, 1], [1, 1, 0, 0]),             # T=7 verify rows: eager, capture
    ([1, 1, 1, 1], None), ([3, 1, 2, 1], [0, 0, 2, 1]),                     # replays of both sizes
    ([1, 0, 1, 1], None), ([1, 0, 1, 1], None), ([1, 1, 1, 1], None),       # T=3 and T=4 again
]


def _state(cache) -> list:
    """Every tensor and length of a SequenceCache (the state a later step reads)."""
    out = [cache.length, cache.tokens]
    for lc in cache.layers:
        out += [lc.win, lc.ikeys]
        for st in (lc.comp, lc.icomp):
            if st is not None:
                out += [st.tok_start, st.tok_kv, st.tok_gate, st.entries, st.latents]
    return out


def _on_launch(monkeypatch, note):
    """note(graphs, key) at every segment launch: SegmentGraphs.run, and replay_ready (the first graph of a steady
    step, prepared at plan time: SegmentGraphs.prepare; its key is run's with the ids' copy, step_graphs.run_key)."""
    real_run, real_ready = SegmentGraphs.run, SegmentGraphs.replay_ready
    monkeypatch.setattr(SegmentGraphs, "run", lambda gr, key, *a, **k: note(gr, key) or real_run(gr, key, *a, **k))
    monkeypatch.setattr(SegmentGraphs, "replay_ready", lambda gr, r: note(gr, r.key) or real_ready(gr, r))


def _same(a, b, what):
    assert len(a) == len(b), what
    for k, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and torch.equal(x, y), f"{what}: item {k} differs"
        else:
            assert x == y, f"{what}: item {k}: {x} != {y}"


def _prefilled(name, seed, graphs=None):
    """MODELS[name] (with `graphs` as its SegmentGraphs when given) after one prefill step of PROMPTS: (model, vocab,
    the generator that drew the prompts, the caches)."""
    m = MODELS[name]()
    if graphs is not None:
        m._graphs = graphs
    vocab = m.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    caches = [m.new_cache() for _ in PROMPTS]
    m.forward_step([StepChunk(c, torch.randint(0, vocab, (n,), generator=g), 1) for c, n in zip(caches, PROMPTS)])
    return m, vocab, g, caches


def _prefilled_with_eager_twin(name, seed):
    """MODELS[name] after one prefill step of PROMPTS, with an eager copy of the model and of its caches: (model,
    vocab, generator, caches, the caches' copy, the eager model). The eager run is on a copy of the model: its
    caches take slots in their own slab / arenas (sharing them would grow them midway, which drops the graphs and
    restarts the warm-up)."""
    m, vocab, g, caches = _prefilled(name, seed)
    m_eager = copy.deepcopy(m)
    m_eager.cuda_graphs = False
    return m, vocab, g, caches, copy.deepcopy(caches), m_eager


@pytest.mark.parametrize("name", list(MODELS))
def test_emulated_graph_replays_equal_eager_steps(name):
    m, vocab, g, caches, eager, m_eager = _prefilled_with_eager_twin(name, 3)
    m._graphs = graphs = SegmentGraphs(emulate=True, warm=1)
    modes = []
    kept = []     # every step's outputs: a later replay must not change them (they are copies, not graph buffers)
    for rows, back in SCHEDULE:
        chunks = [(i, torch.randint(0, vocab, (n,), generator=g)) for i, n in enumerate(rows) if n]
        outs = {}
        for use_graphs, cs in ((True, caches), (False, eager)):
            m.cuda_graphs = use_graphs
            if use_graphs:
                mode = {"n": None}
                begin = graphs.begin_step

                def spy(T, dev, begin=begin, mode=mode):
                    mode["n"] = begin(T, dev)
                    return mode["n"]
                graphs.begin_step = spy
            outs[use_graphs] = (m if use_graphs else m_eager).forward_step(
                [StepChunk(cs[i], t, t.shape[0]) for i, t in chunks])
            if use_graphs:
                del graphs.begin_step
                modes.append(mode["n"])
        a, b = outs[True], outs[False]
        assert torch.equal(a.logits, b.logits), f"step {len(modes)} ({modes[-1]}): logits differ"
        assert torch.equal(a.hidden, b.hidden)
        kept.append((a, b))
        for k, (ka, kb) in enumerate(kept):
            assert torch.equal(ka.logits, kb.logits) and torch.equal(ka.hidden, kb.hidden), f"step {k}'s outputs changed"
        assert (a.draft_features is None) == (b.draft_features is None)
        if a.draft_features is not None:
            assert torch.equal(a.draft_features, b.draft_features)
        for k, (x, y) in enumerate(zip(caches, eager)):
            _same(_state(x), _state(y), f"step {len(modes)} ({modes[-1]}), cache {k}")
        if back:
            for k, n in enumerate(back):
                caches[k].rollback(n)
                eager[k].rollback(n)
    # the schedule exercised every mode, and replays of one size after steps of another
    assert modes[:3] == ["eager", "capture", "replay"] and modes[5] == "replay" and modes[6] == "replay"
    # one segment per eager attention core + 1 per size (more where a new index bucket was captured later); the
    # other layers' cores ran inside the segments
    eager = batched.eager_layers(m)
    if name == "v4":     # V4's overlapping / index compressors update eagerly between segments
        assert 0 < len(eager) < m.config.num_layers
    else:                # V4.1: every cache update inside the graph (compress_step): embedding to head, cut only
        assert eager == []   # between layers before each Engram layer looked up on the host (batched.engram_splits)
        splits = batched.engram_splits(m)
        host = name == "v41-host-engram"
        assert splits == ([i for i in m.config.engram_layer_ids if i > 0] if host else [])
        assert batched.engram_on_device(m) == ([] if host else m.config.engram_layer_ids)
        L, B = m.config.num_layers, batched.BOUNDARY
        cuts = {(None if a == 0 else B, a, None if b == L else B) for a, b in zip([0] + splits, splits + [L])}
        assert {key[1:4] for size in graphs._sizes.values() for key in size.segments} == cuts
        eager = splits       # (as many cuts)
    assert modes.count("capture") == 3 and graphs.captures >= 3 * (len(eager) + 1)
    assert all(len(size.segments) >= len(eager) + 1 for size in graphs._sizes.values())


def test_graphs_are_dropped_when_the_weights_move_or_the_kernels_change():
    m = _random_model(testing.tiny_v41_config(), seed=2)
    m._graphs = SegmentGraphs(emulate=True, warm=1)
    c = m.new_cache()
    m.forward_step([StepChunk(c, torch.arange(5), 1)])
    for _ in range(3):
        m.forward_step([StepChunk(c, torch.tensor([7]), 1)])
    assert m._graphs._sizes, "size 1 should have been captured"
    m.set_dtype(torch.float32)
    assert not m._graphs._sizes
    for _ in range(2):
        m.forward_step([StepChunk(c, torch.tensor([7]), 1)])
    m.to("cpu")
    assert not m._graphs._sizes
    for _ in range(2):
        m.forward_step([StepChunk(c, torch.tensor([7]), 1)])
    assert m._graphs._sizes
    m.fused_mhc = not m.fused_mhc     # the segments would run other kernels: recapture
    assert not m._graphs._sizes
    for _ in range(3):
        m.forward_step([StepChunk(c, torch.tensor([7]), 1)])
    assert m._graphs._sizes
    m.stack_projections = False      # other GEMMs (engine/projections.py): recapture
    assert not m._graphs._sizes


def test_a_segment_input_of_another_shape_is_refused():
    graphs = SegmentGraphs(emulate=True, warm=0)
    graphs.begin_step(2, torch.device("cpu"))
    x = torch.randn(2, 3)
    (y,) = graphs.run("double", lambda t: (t * 2,), x)
    assert torch.equal(y, x * 2)
    graphs.end_step()
    graphs.begin_step(2, torch.device("cpu"))
    x2 = torch.randn(2, 3)
    (y2,) = graphs.run("double", lambda t: (t * 2,), x2)
    assert y2 is y and torch.equal(y2, x2 * 2)       # replay: the same output buffer, new values
    with pytest.raises(RuntimeError, match="input shape"):
        graphs.run("double", lambda t: (t * 2,), torch.randn(3, 3))


def test_a_size_is_captured_on_its_third_step_by_default_and_old_sizes_are_dropped():
    graphs = SegmentGraphs(emulate=True, max_sizes=2)
    cpu = torch.device("cpu")
    modes = []
    for T in (4, 4, 4, 4, 5, 5, 5, 6, 6, 6, 4, 4, 4):
        modes.append(graphs.begin_step(T, cpu))
        graphs.run("id", lambda t: (t + 1,), torch.zeros(T))
        graphs.end_step()
    assert modes[:4] == ["eager", "eager", "capture", "replay"]
    assert modes[4:7] == ["eager", "eager", "capture"]
    assert modes[7:10] == ["eager", "eager", "capture"]     # size 4 (least recently used) dropped here
    assert modes[10:] == ["eager", "eager", "capture"] and sorted(graphs._sizes) == [4, 6]   # warm again first


def test_a_v41_decode_step_is_one_graph_and_one_upload_of_its_index_lists(monkeypatch):
    """V4.1: the compressors' cache updates run inside the graph (compress_step), so a replayed decode / verify step
    runs ONE segment per cut before an Engram layer (batched.engram_splits; one segment without Engram), and every
    index list the host makes for it, the token ids and positions included, goes to the device in ONE copy
    (BatchPlan.layout, sent once a step); the graph reads that upload in place (no staging copy per input).
    Checked by counting (emulated graphs, CPU); the replays' results are checked against eager steps above."""
    from deepinfer_sg.engine import transfer
    m, vocab, g, caches = _prefilled("v41", 4, SegmentGraphs(emulate=True, warm=1))
    counts = {"run": 0, "layout": 0, "uploads": 0, "stage": 0}
    real_layout, real_stage = batched.BatchPlan.layout, SegmentGraphs.stage
    real_many = transfer.to_device_many

    def count(name, real):
        def f(*a, **k):
            counts[name] += 1
            return real(*a, **k)
        return f
    _on_launch(monkeypatch, lambda *a: counts.__setitem__("run", counts["run"] + 1))
    monkeypatch.setattr(batched.BatchPlan, "layout",     # (layouts that lay something out)
                        lambda plan, *a: (counts.__setitem__("layout", counts["layout"] + bool(plan.pending)),
                                          real_layout(plan, *a))[1])
    monkeypatch.setattr(SegmentGraphs, "stage", count("stage", real_stage))
    for mod in ("model", "batched", "arena", "compressor", "compress_step"):   # multi-part uploads made elsewhere
        monkeypatch.setattr(f"deepinfer_sg.engine.{mod}.to_device_many", count("uploads", real_many), raising=False)
    for step in range(5):
        for k in counts:
            counts[k] = 0
        rows = [1, 1, 1, 1] if step % 2 == 0 else [2, 1, 2, 2]     # decode rows, verify rows (T = 4, 7)
        if step == 4:
            rows = [1, 1, 1, 1]
        m.forward_step([StepChunk(c, torch.randint(0, vocab, (n,), generator=g), n) for c, n in zip(caches, rows)])
        for c, n in zip(caches, rows):
            if n > 1:
                c.rollback(n - 1)
    # the last step (T = 4, third time: a replay) ran its segments and laid its index lists out in one upload
    assert counts["run"] == len(batched.engram_splits(m)) + 1 and counts["layout"] == 1, counts
    # no other upload (the token ids and positions came with that upload) and nothing staged (copied) per replay
    assert counts["uploads"] == 0 and counts["stage"] == 0, counts


def test_a_v41_step_reads_each_engram_layers_rows_after_launching_the_segments_before_it(monkeypatch):
    """The cut before an Engram layer is there so the host reads that layer's table rows while the device runs the
    segments before it: the order of events in a decode step is run(layers before) -> read(rows) -> run(the rest),
    and the step's logits are still the reference path's."""
    from deepinfer_sg.engine.engram import Engram
    m = MODELS["v41-host-engram"]()
    ref = copy.deepcopy(m)
    ref.fast_decode = False
    events = []
    real_read = Engram.packed_values
    _on_launch(monkeypatch, lambda g, key: events.append(("run", key[2])))
    monkeypatch.setattr(Engram, "packed_values",
                        lambda e, *a, **k: events.append(("read", e.layer_id)) or real_read(e, *a, **k))
    g = torch.Generator().manual_seed(8)
    caches = [m.new_cache() for _ in range(2)]
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (9, 4)]
    m.forward_step([StepChunk(c, p, 1) for c, p in zip(caches, prompts)])
    rc = copy.deepcopy(caches)
    ids = torch.randint(0, 512, (2,), generator=g)
    events.clear()
    got = m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(caches)]).logits
    want = ref.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(rc)]).logits
    splits = batched.engram_splits(m)
    order = [("run", 0)] + [e for j in splits for e in (("read", j), ("run", j))]
    assert events == order
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tail_on_host", [True, False])
def test_a_v41_step_whose_engram_rows_the_device_reads_is_one_segment_with_the_host_lookups_results(monkeypatch,
                                                                                                   tail_on_host):
    """With the tables readable by the device (model.engram_device_reads, an in-memory table) the step's Engram rows
    are read inside the graph: from the token windows in the step's one upload, which the device hashes (the caches'
    recent tokens on the host), or from row ids hashed on the host at launch (on the device: as if they were,
    `tail_on_host` False). One segment, no host table read, and the same logits and caches as the host lookups
    bit for bit (emulated graphs: eager, capture, then replays)."""
    from deepinfer_sg.engine import model as model_module
    from deepinfer_sg.engine.engram import EngramTable, Engram
    if not tail_on_host:
        monkeypatch.setattr(model_module, "_on_host", lambda t: False)
        monkeypatch.setattr(Engram, "hash_consts", lambda *a: pytest.fail("hashed on the device"))
    m, host = MODELS["v41"](), MODELS["v41-host-engram"]()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in PROMPTS]
    caches, host_caches = [m.new_cache() for _ in PROMPTS], [host.new_cache() for _ in PROMPTS]
    for x, cs in ((m, caches), (host, host_caches)):
        x._graphs = SegmentGraphs(emulate=True, warm=1)
        x.forward_step([StepChunk(c, p, 1) for c, p in zip(cs, prompts)])     # (the reference path: host reads)
    runs, captured = [], []
    _on_launch(monkeypatch, lambda gr, key: runs.append(gr is m._graphs))
    for step in range(7):
        if step == 4:     # (a rollback shortens the caches' recent tokens: the windows' shapes must not change)
            for c in caches + host_caches:
                c.rollback(2)
        ids = torch.randint(0, 512, (len(PROMPTS),), generator=g)
        runs.clear()
        with monkeypatch.context() as mp:
            mp.setattr(EngramTable, "lookup_packed", lambda *a, **k: pytest.fail("a host table read"))
            got = m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(caches)])
        want = host.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(host_caches)])
        assert runs.count(True) == 1 and runs.count(False) == len(batched.engram_splits(host)) + 1
        assert torch.equal(got.logits, want.logits) and torch.equal(got.hidden, want.hidden)
        for k, (x, y) in enumerate(zip(caches, host_caches)):
            _same(_state(x), _state(y), f"step {step}, cache {k}")
        captured.append(m._graphs.captures)
    assert captured[1] == captured[-1] > 0      # captured at the second step, replayed ever since


class _CopyEvent:
    """Stands in for torch.cuda.Event on the CPU: a recorded copy stays queued until synchronize(), which notes what
    its buffer held then (a wait must come before the host writes the buffer again)."""

    def __init__(self, buf):
        self.buf, self.records, self.queued, self.held_at_sync = buf, 0, False, []

    def query(self):
        return not self.queued

    def synchronize(self):
        self.held_at_sync.append(self.buf.clone())
        self.queued = False

    def record(self):
        self.records += 1
        self.queued = True


def test_an_upload_alternates_its_two_host_buffers():
    """_Pinned (an upload's two pinned host buffers, here plain host tensors and stand-in events): a host tensor
    that is not one of them is copied through each in turn, each write waits for that buffer's queued copy first,
    one written in place (take) is sent as it is, and every send lands the host's values in the device buffer.
    (The first form told the buffers apart with list.index, which compares tensors by value: the second buffer's
    turn raised "Boolean value of Tensor with more than one value is ambiguous", and a GPU extraction lost a
    request to it.)"""
    from deepinfer_sg.engine.step_graphs import _Pinned
    p = _Pinned.__new__(_Pinned)
    p.bufs = [torch.full((6,), -1), torch.full((6,), -2)]
    p.done, p.next = [_CopyEvent(b) for b in p.bufs], 0
    sent = []
    for i in range(5):
        host, dev = torch.arange(6) * 7 + i, torch.full((6,), -9)
        p.copy(host, dev)
        assert torch.equal(dev, host) and torch.equal(p.bufs[i % 2], host)
        sent.append(host)
    assert [e.records for e in p.done] == [3, 2]
    # buffer 0 was written again at sends 2 and 4, buffer 1 at send 3: each time after a wait that found it
    # still holding what its previous send copied
    assert [t.tolist() for t in p.done[0].held_at_sync] == [sent[0].tolist(), sent[2].tolist()]
    assert [t.tolist() for t in p.done[1].held_at_sync] == [sent[1].tolist()]
    b = p.take()                      # buffer 1's turn, written in place
    assert b is p.bufs[1] and len(p.done[1].held_at_sync) == 2
    b.copy_(torch.arange(6) + 100)
    dev = torch.full((6,), -9)
    p.copy(b, dev)
    assert torch.equal(dev, torch.arange(6) + 100) and [e.records for e in p.done] == [3, 3] and p.next == 0


def test_arena_growth_frees_the_replaced_buffers():
    """Arenas that grow (more slots as sequences join, more rows as they lengthen) give their old buffers back:
    nothing the fast path keeps between steps (the graphs, the segments' remembered inputs) holds one. Oracle: a
    weak reference to every arena buffer a step replaced is dead after a collection."""
    import gc
    import weakref
    m = _random_model(testing.tiny_v41_config(), seed=3)
    m._graphs = SegmentGraphs(emulate=True, warm=1)
    vocab = m.config.vocab_size
    g = torch.Generator().manual_seed(3)
    caches, seen = [], {}
    for step in range(40):
        fresh = []
        if step % 4 == 0 and len(caches) < 10:
            caches.append(m.new_cache())
            fresh = [StepChunk(caches[-1], torch.randint(0, vocab, (6,), generator=g), 1)]
        m.forward_step(fresh + [StepChunk(c, torch.randint(0, vocab, (1,), generator=g), 1) for c in caches[:-1]]
                       if fresh else [StepChunk(c, torch.randint(0, vocab, (1,), generator=g), 1) for c in caches])
        for d in (m.__dict__.get("_window_slabs", {}), m.__dict__.get("_row_arenas", {})):
            for a in d.values():
                seen.setdefault(id(a.data), weakref.ref(a.data))
    live = {id(a.data) for d in (m.__dict__.get("_window_slabs", {}), m.__dict__.get("_row_arenas", {}))
            for a in d.values()}
    replaced = [r for k, r in seen.items() if k not in live]
    assert replaced, "no arena grew: the test needs more steps or sequences"
    gc.collect()
    assert all(r() is None for r in replaced), f"{sum(r() is not None for r in replaced)} replaced buffers alive"


@pytest.mark.parametrize("name", ["v4", "v41"])
def test_token_ids_on_the_device_go_into_the_graphs_without_a_host_copy(monkeypatch, name):
    """launch with the step's token ids on the device (emulated on the CPU: model._on_host answers False for that
    one tensor) under send_ahead (the default): through eager, capture and replay steps the ids are never read on
    the host (a .cpu() / .numpy() of them would wait for the device) and no segment copies them in from the host
    buffer (no `pre` copy: they go into the graphs' ids buffer by a device copy). Oracle: the same steps with host
    ids on an eager copy of the model: logits, hidden and caches bit for bit."""
    from deepinfer_sg.engine import model as model_module
    m, vocab, g, caches, eager, m_eager = _prefilled_with_eager_twin(name, 11)
    assert m.send_ahead
    m._graphs = SegmentGraphs(emulate=True, warm=1)
    modes, pres = [], []
    real_begin, real_run, real_on_host = SegmentGraphs.begin_step, SegmentGraphs.run, model_module._on_host
    monkeypatch.setattr(SegmentGraphs, "begin_step", lambda gr, *a: modes.append(real_begin(gr, *a)) or modes[-1])
    monkeypatch.setattr(SegmentGraphs, "run",
                        lambda gr, key, *a, pre=None: pres.append(pre) or real_run(gr, key, *a, pre=pre))
    device_ids = []

    def not_on_host(real):
        def f(t, *a, **k):
            assert not any(t.data_ptr() == d.data_ptr() for d in device_ids), "the device ids read on the host"
            return real(t, *a, **k)
        return f
    for step in range(4):
        ids = torch.randint(0, vocab, (len(PROMPTS),), generator=g)
        rows, flat = m.step_ids([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(caches)])
        device_ids[:] = [flat]
        with monkeypatch.context() as mp:
            mp.setattr(model_module, "_on_host", lambda t: real_on_host(t) and t is not flat)
            mp.setattr(torch.Tensor, "cpu", not_on_host(torch.Tensor.cpu))
            mp.setattr(torch.Tensor, "numpy", not_on_host(torch.Tensor.numpy))
            got = m.launch(m.plan_step(rows, undo=False), flat)
        device_ids.clear()
        want = m_eager.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(eager)])
        assert torch.equal(got.logits, want.logits) and torch.equal(got.hidden, want.hidden), f"step {step}"
        for k, (x, y) in enumerate(zip(caches, eager)):
            _same(_state(x), _state(y), f"step {step}, cache {k}")
    assert modes == ["eager", "capture", "replay", "replay"] and pres and all(p is None for p in pres)


class _Side:
    """Stands in for the "mhc" side stream of a deferred mix (mhc._PENDING)."""


def test_deferred_mixes_are_joined_before_a_segment_returns_and_dropped_when_a_step_fails(monkeypatch):
    """mhc's deferred mixes (on CUDA the mixes' tail on the "mhc" side stream, mhc._PENDING) must not outlive the
    segment that deferred them (a CUDA graph's capture must not end with the side stream unjoined) nor a failed
    step (the next step would join them inside its own capture). Emulated on the CPU: every post_attention leaves
    a stand-in side stream pending, as if its last write-back had deferred its mixes, and streams.join notes the
    stand-ins it joins. Oracle: the stand-ins made. Through eager, capture and replay steps every segment returns
    with none pending and each is joined once; a step that fails inside a segment leaves none pending either."""
    from deepinfer_sg.engine import mhc, streams
    m, vocab, g, caches = _prefilled("v41", 12, SegmentGraphs(emulate=True, warm=1))
    made, joined, fail = [], [], []
    real_join, real_post, real_span = streams.join, batched.post_attention, batched.span
    monkeypatch.setattr(streams, "join", lambda side: joined.append(side) if isinstance(side, _Side)
                        else real_join(side))

    def post(*a, **k):
        out = real_post(*a, **k)
        made.append(_Side())
        mhc._PENDING.append((made[-1], None))
        if fail:
            raise RuntimeError("a stand-in failure")
        return out

    def span(*a, **k):
        out = real_span(*a, **k)
        assert not mhc._PENDING, "a segment returned with deferred mixes pending"
        return out
    monkeypatch.setattr(batched, "post_attention", post)
    monkeypatch.setattr(batched, "span", span)
    for step in range(3):
        m.forward_step([StepChunk(c, torch.randint(0, vocab, (1,), generator=g), 1) for c in caches])
        assert not mhc._PENDING and len(made) == len(joined) and set(map(id, made)) == set(map(id, joined))
    assert made and m._graphs.captures > 0
    fail.append(True)
    with pytest.raises(RuntimeError, match="stand-in failure"):
        m.forward_step([StepChunk(c, torch.randint(0, vocab, (1,), generator=g), 1) for c in caches])
    assert not mhc._PENDING and joined[-1] is made[-1]


def test_a_steady_replay_step_launches_its_first_graph_as_prepared_at_plan_time(monkeypatch):
    """A replay step whose first graph's inputs are the captured objects (steady decode rows) has that graph's replay
    prepared by plan_step (SegmentGraphs.prepare), and launch replays it before the rest of its host work (before
    the segments' loop, Model._layers_fast); eager and capture steps run it through SegmentGraphs.run. The values
    are checked against eager steps by the tests above (emulated replays)."""
    from deepinfer_sg.engine.model import Model
    m, vocab, g, caches = _prefilled("v41", 12, SegmentGraphs(emulate=True, warm=1))
    events = []
    real_ready, real_run, real_layers = SegmentGraphs.replay_ready, SegmentGraphs.run, Model._layers_fast
    monkeypatch.setattr(SegmentGraphs, "replay_ready", lambda gr, r: events.append("ready") or real_ready(gr, r))
    monkeypatch.setattr(SegmentGraphs, "run", lambda gr, *a, **k: events.append("run") or real_run(gr, *a, **k))
    monkeypatch.setattr(Model, "_layers_fast", lambda *a: events.append("segments") or real_layers(*a))
    steps = []
    for step in range(4):
        events.clear()
        m.forward_step([StepChunk(c, torch.randint(0, vocab, (1,), generator=g), 1) for c in caches])
        steps.append(list(events))
    assert steps[:2] == [["segments", "run"]] * 2            # eager, capture
    assert steps[2:] == [["ready", "segments"]] * 2          # replays: launched before the segments' loop


@pytest.mark.parametrize("between", ["reset", "device ids"])
def test_a_prepared_first_graph_is_not_replayed_when_the_launch_cannot_use_it(between, monkeypatch):
    """A steady step's first graph is prepared at plan time; launch must not replay it when the graphs were reset in
    between (weights moved, a switch changed the kernels: replay_ready answers None, the retired graph stays
    unplayed) or when the ids come on the device (the graph's copy would overwrite them with the stale host
    buffer): the first segment goes through SegmentGraphs.run and the logits equal an eager copy's."""
    from deepinfer_sg.engine import model as model_module
    from deepinfer_sg.engine.model import StepRows
    m, vocab, g, caches, eager, m_eager = _prefilled_with_eager_twin("v41", 13)
    m._graphs = SegmentGraphs(emulate=True, warm=1)
    replayed, ran = [], []
    real_ready, real_run, real_on_host = SegmentGraphs.replay_ready, SegmentGraphs.run, model_module._on_host
    monkeypatch.setattr(SegmentGraphs, "replay_ready", lambda gr, r: replayed.append(real_ready(gr, r)) or replayed[-1])
    monkeypatch.setattr(SegmentGraphs, "run", lambda gr, *a, **k: ran.append(1) or real_run(gr, *a, **k))
    for step in range(4):          # eager, capture, replay (prepared), then the case
        ids = torch.randint(0, vocab, (len(caches),), generator=g)
        plan = m.plan_step([StepRows(c, 1, 1) for c in caches])
        replayed.clear(), ran.clear()
        if step == 3:
            assert plan.ctx.ready is not None
            if between == "reset":
                m.reset_graphs()
            else:
                monkeypatch.setattr(model_module, "_on_host", lambda t: real_on_host(t) and t is not ids)
        out = m.launch(plan, ids)
        want = m_eager.forward_step([StepChunk(c, ids[i:i + 1], 1) for i, c in enumerate(eager)])
        assert torch.equal(out.logits, want.logits), f"step {step}"
        if step == 2:
            assert len(replayed) == 1 and replayed[0] is not None
    assert replayed == ([None] if between == "reset" else []) and ran
