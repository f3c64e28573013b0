"""engine/projections.py: a layer's attention-norm projections as one GEMM over stacked weights.

Oracles: the per-sequence reference path (`fast_decode = False`, one GEMM per Linear) and the same fast step with
stacking off; the parameters' values before stacking (the state_dict must not change); a load through the
parameters after stacking must reach the stacked product.
"""
import copy

import torch

from deepinfer_sg.engine import projections, testing
from deepinfer_sg.engine.model import StepChunk

from test_model_batched import _random_model


def _decode(m, caches, ids):
    return m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(caches)]).logits


def _stacked_model(seed):
    """A tiny V4.1 model after a prefill of two sequences and one fast decode step (which stacks)."""
    m = _random_model(testing.tiny_v41_config(), seed=seed)
    g = torch.Generator().manual_seed(seed)
    caches = [m.new_cache() for _ in range(2)]
    m.forward_step([StepChunk(c, torch.randint(0, m.config.vocab_size, (7,), generator=g), 1) for c in caches])
    _decode(m, caches, torch.tensor([1, 2]))
    return m, caches, g


def test_stacked_projections_are_the_parameters_and_give_the_same_logits():
    m = _random_model(testing.tiny_v41_config(), seed=3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    V = m.config.vocab_size
    caches = [m.new_cache() for _ in range(3)]
    m.forward_step([StepChunk(c, torch.randint(0, V, (n,), generator=g), 1) for c, n in zip(caches, (4, 9, 17))])
    plain, ref = copy.deepcopy(m), copy.deepcopy(m)
    plain.stack_projections = False
    ref.fast_decode = False
    pc, rc = copy.deepcopy(caches), copy.deepcopy(caches)
    for step in range(4):
        ids = torch.randint(0, V, (3,), generator=g)
        got, unstacked, want = _decode(m, caches, ids), _decode(plain, pc, ids), _decode(ref, rc, ids)
        assert torch.allclose(got, unstacked, atol=1e-4, rtol=1e-4), f"step {step}"
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"step {step}"
    # every layer's xn Linears are row blocks of one tensor, in order, and the state_dict is what it was
    stacked = 0
    for blk in m.layers:
        mods = projections.xn_linears(m, blk.attn)
        base = mods[0].weight.untyped_storage().data_ptr()
        assert all(x.weight.untyped_storage().data_ptr() == base for x in mods)
        ends = [x.weight.data_ptr() + x.weight.numel() * x.weight.element_size() for x in mods]
        assert all(e == x.weight.data_ptr() for e, x in zip(ends[:-1], mods[1:]))
        stacked += len(mods)
    assert stacked > 2 * len(m.layers)           # (index heads and compressors included)
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_a_load_through_the_parameters_reaches_the_stacked_product():
    m, caches, g = _stacked_model(seed=4)
    new = _random_model(testing.tiny_v41_config(), seed=5).state_dict()
    m.load_state_dict(new)                              # (copies into the parameters: into the stacked tensor)
    plain = copy.deepcopy(m)
    plain.stack_projections = False
    pc = copy.deepcopy(caches)
    ids = torch.tensor([3, 4])
    assert torch.allclose(_decode(m, caches, ids), _decode(plain, pc, ids), atol=1e-4, rtol=1e-4)
    m.to(torch.float64).to(torch.float32)               # (casts make new tensors: stacked again next step)
    plain.to(torch.float64).to(torch.float32)
    ids = torch.tensor([5, 6])
    assert torch.allclose(_decode(m, caches, ids), _decode(plain, pc, ids), atol=1e-4, rtol=1e-4)
    assert all(blk.attn.wkv.weight.data_ptr() == blk.attn.wq_a.weight.data_ptr() + blk.attn.wq_a.weight.numel() * 4
               for blk in m.layers)


def test_a_weight_replaced_behind_the_models_back_is_not_read_stale():
    """A Linear's weight pointed at a new tensor without reset_graphs (so no new stacking check): the eager fast
    path must not use the old stacked copy (it checks the addresses and runs the GEMMs one by one)."""
    m, caches, g = _stacked_model(seed=6)
    w = m.layers[1].attn.wkv.weight
    w.data = torch.randn(w.shape, generator=g) * 0.05     # (a new tensor: no longer a row block of the stack)
    plain = copy.deepcopy(m)
    plain.stack_projections = False
    pc = copy.deepcopy(caches)
    ids = torch.tensor([3, 4])
    assert torch.allclose(_decode(m, caches, ids), _decode(plain, pc, ids), atol=1e-4, rtol=1e-4)
