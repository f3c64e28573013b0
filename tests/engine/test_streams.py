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


@torch.no_grad()
def test_engram_rows_read_ahead_on_their_lane_give_the_same_bits(monkeypatch):
    """batched.span reads the Engram rows of the layers the device hashes on a lane of their own as the segment
    starts (each layer waits for its event; one join at the end), forced on the CPU with a stand-in stream: the
    step's logits are the same bits as reading them at the layer, and the order of events is the one above."""
    import copy
    from deepinfer_sg.engine import testing
    from deepinfer_sg.engine.engram import Engram
    from deepinfer_sg.engine.model import StepChunk
    from test_model_batched import _random_model
    m = _random_model(testing.tiny_v41_config(engram_layer_ids=[1, 3]), seed=3)
    m2 = copy.deepcopy(m)
    g = torch.Generator().manual_seed(5)
    caches = [m.new_cache() for _ in range(3)]
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (4, 9, 2)]
    m.forward_step([StepChunk(c, p, 1) for c, p in zip(caches, prompts)])
    caches2 = copy.deepcopy(caches)
    ids = torch.randint(0, 512, (3,), generator=g)
    want = m2.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(caches2)]).logits
    events = []
    lane = object()
    monkeypatch.setattr(streams, "fork", lambda t, name="side": events.append(("fork", name)) or lane)
    monkeypatch.setattr(streams, "on", lambda s: events.append("on") or contextlib.nullcontext())
    monkeypatch.setattr(streams, "mark", lambda s: events.append("mark") or len(events))
    monkeypatch.setattr(streams, "wait", lambda ev: events.append(("wait", ev)))
    monkeypatch.setattr(streams, "join", lambda s: events.append(("join", s is lane)))
    real = Engram.device_rows
    monkeypatch.setattr(Engram, "device_rows", lambda self, e: events.append(("read", self.layer_id)) or real(self, e))
    got = m.forward_step([StepChunk(c, ids[k:k + 1], 1) for k, c in enumerate(caches)]).logits
    assert torch.equal(got, want) and not got.isnan().any()
    engram = [e for e in events if e != "on" and (not isinstance(e, tuple) or e[0] != "fork" or e[1] == "engram")]
    assert engram[:5] == [("fork", "engram"), ("read", 1), "mark", ("read", 3), "mark"]
    marks = [k + 1 for k, e in enumerate(events) if e == "mark"]
    assert [e for e in events if isinstance(e, tuple) and e[0] == "wait"] == [("wait", k) for k in marks]
    assert engram[-1] == ("join", True)
