"""model.fused_rope: the window kv's norm + RoPE + slab write as one kernels.rmsnorm launch (with q_norm's, from
the stacked projection: rms_norm_pair); the in-graph compressors' entry and index key norm + RoPE + arena write as
one kernels.rmsnorm launch each, their ring write +
pooling as two kernels.ring_pool launches. On the CPU the twins do the separate steps, so here the Triton kernels
themselves run (in the interpreter, CPU tensors) inside the engine's fast path: the strided projection columns, the
slab and arena rows and the turn tables they get from the engine are checked by the logits against the
per-sequence reference path (no fused kernels), over decode and verify steps and a rollback."""
import copy

import pytest
import torch

from deepinfer_sg.engine import attention, compress_step, testing
from deepinfer_sg.engine.model import StepChunk
from deepinfer_sg.kernels import ring_pool, rmsnorm
from deepinfer_sg.kernels.backend import INTERPRETING

from test_model_batched import _random_model


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The fused launches take the Triton kernels for CPU tensors (the interpreter, set by conftest); counts them.
    Compiled kernels cannot read CPU tensors: without the interpreter (a GPU round) the cases skip."""
    if not INTERPRETING:
        pytest.skip("the kernels run here on CPU tensors: interpreted only")
    calls = {"kv": 0, "compress": 0, "pool": 0}     # fused launches per kind

    def norm(kind):
        def run(x, w, eps, turn=None, out=None, rows=None):
            calls[kind] += rows is not None
            return rmsnorm.rms_norm_triton(x, w, eps, turn, out, rows)
        return run
    monkeypatch.setattr(attention, "rms_norm", norm("kv"))
    monkeypatch.setattr(compress_step, "rms_norm", norm("compress"))

    def pair(xa, wa, eps_a, x, w, eps, turn=None, out=None, rows=None):    # (q_norm + the kv store: one launch)
        calls["kv"] += rows is not None
        y, ya = rmsnorm.rms_norm_triton(x, w, eps, turn, out, rows, also=(xa, wa, eps_a))
        return ya, y
    monkeypatch.setattr(attention, "rms_norm_pair", pair)

    def pooled(*a):
        calls["pool"] += 1
        return ring_pool.ring_pool_triton(*a)
    monkeypatch.setattr(compress_step, "ring_write", ring_pool.ring_write_triton)
    monkeypatch.setattr(compress_step, "ring_pool", pooled)
    return calls


@pytest.mark.parametrize("config", ["v41", "v4"])
def test_fused_rope_kernels_in_the_fast_path_match_the_reference(config, kernels_on_cpu):
    d = testing.tiny_v41_config() if config == "v41" else testing.tiny_v4_config(hc_mult=4, index_n_heads=2)
    m = _random_model(d, seed=7)
    ref = copy.deepcopy(m)
    ref.fast_decode = False
    assert m.fused_rope
    g = torch.Generator().manual_seed(3)
    V = m.config.vocab_size
    caches = [m.new_cache() for _ in range(3)]
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (5, 20, 33)]
    m.forward_step([StepChunk(c, p, 1) for c, p in zip(caches, prompts)])
    rc = copy.deepcopy(caches)
    for step, rows in enumerate([(1, 1, 1), (3, 1, 2), (1, 1, 1)]):
        ids = [torch.randint(0, V, (n,), generator=g) for n in rows]
        got = m.forward_step([StepChunk(c, t, len(t)) for c, t in zip(caches, ids)]).logits
        want = ref.forward_step([StepChunk(c, t, len(t)) for c, t in zip(rc, ids)]).logits
        assert torch.allclose(got, want, atol=2e-4, rtol=2e-4), f"step {step}: {(got - want).abs().max()}"
        n = (step + 1) * len(m.layers)
        # in-graph compressors (V4.1): the entry and, on index-K sources, the index key; the gated ones' pooling
        graph = compress_step.graph_layers(m)
        n_c = (step + 1) * sum(1 + hasattr(getattr(m.layers[i].attn, "indexer", None), "wk") for i in graph)
        n_pool = (step + 1) * sum(m.layers[i].attn.compressor.gated for i in graph)
        assert kernels_on_cpu == {"kv": n, "compress": n_c, "pool": n_pool}
        if step == 1:
            for c, r in zip(caches + rc, rows + rows):
                c.rollback(r - 1)
