"""engine/streams.py off the GPU: the side-stream helpers degrade to the one-stream path (fork gives None for a CPU
tensor or with the switch off; `on(None)` and `join(None)` do nothing), and MoE.forward_grouped's two orders (the
shared expert first on a side chain joined before the sum, or after the routed experts on one stream) give the same
bits, equal to the per-expert reference loop up to the grouped kernel's rounding."""
import contextlib

import torch

from deepinfer_sg.engine import moe as moe_mod
from deepinfer_sg.engine import streams
from deepinfer_sg.engine.moe import MoE


def _moe():
    torch.manual_seed(7)
    m = MoE(hidden=32, inter=24, n_experts=6, top_k=2, n_shared=1, limit=3.0, vocab_size=40, hashed=False,
            scaling=1.5)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def test_helpers_are_no_ops_off_the_gpu(monkeypatch):
    x = torch.randn(3, 4)
    assert streams.fork(x) is None
    with streams.on(None):
        y = x * 2
    streams.join(None)
    assert torch.equal(y, x * 2)
    monkeypatch.setattr(streams, "ENABLED", False)
    assert streams.fork(x) is None


@torch.no_grad()
def test_side_chain_order_gives_the_same_bits(monkeypatch):
    """The side-stream branch of forward_grouped (the shared expert launched first, then the gate and the routed
    experts, a join before the sum) forced on the CPU with a stand-in stream: the same result as the one-stream
    order, and the join comes after the routed experts and before the sum."""
    m = _moe()
    x = torch.randn(5, 32)
    one_stream = m.forward_grouped(x)
    events = []
    side = object()
    monkeypatch.setattr(streams, "fork", lambda t: events.append("fork") or side)
    monkeypatch.setattr(streams, "on", lambda s: events.append(("on", s is side)) or contextlib.nullcontext())
    monkeypatch.setattr(streams, "join", lambda s: events.append(("join", s is side)))
    real_fast = moe_mod.Expert.forward_fast
    monkeypatch.setattr(moe_mod.Expert, "forward_fast", lambda self, t: events.append("shared") or real_fast(self, t))
    import deepinfer_sg.kernels as K
    real_experts = K.moe_experts
    monkeypatch.setattr(K, "moe_experts", lambda *a, **k: events.append("routed") or real_experts(*a, **k))
    two_streams = m.forward_grouped(x)
    assert events == ["fork", ("on", True), "shared", "routed", ("join", True)]
    assert torch.equal(two_streams, one_stream)
    ref = m(x)
    assert torch.allclose(one_stream, ref, atol=1e-5 * float(ref.abs().max()))
