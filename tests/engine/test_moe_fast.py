"""engine/moe.py's decode-step pieces that call E's kernels: the Gate (score routing through kernels.router) against
the V4 router formulas written out in float64 by hand, and the shared expert's `forward_fast` (front half through
kernels.skinny) against its plain `forward`, with the Triton kernels run by the interpreter where CUDA would run
them."""
import math

import pytest
import torch

from deepinfer_sg.engine.moe import Expert, Gate
from deepinfer_sg.kernels import router as k_router
from deepinfer_sg.kernels import skinny as k_skinny
from deepinfer_sg.kernels.skinny import MAX_ROWS


def _gate(hashed: bool, E=12, K=3, H=32, V=50):
    torch.manual_seed(3)
    g = Gate(hidden=H, n_experts=E, top_k=K, vocab_size=V, hashed=hashed, scaling=1.5)
    with torch.no_grad():
        g.weight.normal_()
        if hashed:
            g.tid2eid.copy_(torch.randint(0, E, (V, K)))
        else:
            g.bias.normal_()
    return g


def _by_hand(logits, bias, K, scaling, ids=None):
    """float64: s = sqrt(log(1 + e^x)); the K largest s + bias (or the given ids); s at them / their sum * scaling."""
    ws, out_ids = [], []
    bias = None if bias is None else bias.detach().tolist()
    for r, row in enumerate(logits.double().tolist()):
        s = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        pick = ids[r] if ids is not None else sorted(range(len(s)), key=lambda e: -(s[e] + bias[e]))[:K]
        tot = sum(s[e] for e in pick)
        ws.append([s[e] / tot * scaling for e in pick])
        out_ids.append(list(pick))
    return torch.tensor(ws, dtype=torch.float64), torch.tensor(out_ids)


def _by_id(w, idx):
    o = idx.argsort(dim=1)
    return w.gather(1, o), idx.gather(1, o)


@pytest.mark.parametrize("kernel", [False, True])
def test_score_routed_gate_is_the_formula(kernel, monkeypatch):
    """kernel: the dispatch taken as on CUDA (kernels.router's Triton kernel, interpreted)."""
    if kernel:
        monkeypatch.setattr(k_router, "use_triton", lambda t: True)
    g = _gate(hashed=False)
    x = torch.randn(6, 32)
    w, idx = g(x, None)
    hw, hidx = _by_hand(torch.nn.functional.linear(x, g.weight), g.bias, 3, 1.5)
    w, idx = _by_id(w, idx)
    hw, hidx = _by_id(hw, hidx)
    assert w.dtype == torch.float32 and torch.equal(idx, hidx)
    assert torch.allclose(w.double(), hw, atol=1e-6)


def test_hash_routed_gate_is_the_formula():
    g = _gate(hashed=True)
    x, tok = torch.randn(5, 32), torch.tensor([3, 0, 49, 7, 3])
    w, idx = g(x, tok)
    assert torch.equal(idx, g.tid2eid[tok])
    hw, _ = _by_hand(torch.nn.functional.linear(x, g.weight), None, 3, 1.5, ids=g.tid2eid[tok].tolist())
    assert torch.allclose(w.double(), hw, atol=1e-6)
    with pytest.raises(ValueError, match="token ids"):
        g(x, None)


@pytest.mark.parametrize("rows", [3, MAX_ROWS + 1])
def test_shared_expert_fast_equals_forward(rows, monkeypatch):
    """kernels.skinny's dispatch taken as on CUDA: up to its MAX_ROWS rows the front half and the down product are
    its Triton kernel (interpreted, two launches), equal to the plain forward up to bf16 rounding of the products; above, the twin: the plain
    forward exactly. The clamp limit is small enough that both clamps bite."""
    calls = []
    monkeypatch.setattr(k_skinny, "use_triton", lambda t: True)
    monkeypatch.setattr(k_skinny, "skinny_linear_triton",
                        lambda *a, real=k_skinny.skinny_linear_triton, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(5)
    ex = Expert(hidden=64, inter=48, limit=1.0).to(torch.bfloat16)
    with torch.no_grad():
        for lin in (ex.w1, ex.w3, ex.w2):
            lin.weight.normal_(0, 0.3)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    want = ex(x)
    got = ex.forward_fast(x)
    h = torch.nn.functional.linear(x.float(), ex.w1.weight.float())
    assert (h > 1.0).any() and (h < -1.0).any()
    if rows > MAX_ROWS:
        assert not calls and torch.equal(got, want)
    else:
        assert len(calls) == 2 and got.dtype == torch.bfloat16     # (w1 + w3 with the SwiGLU, then w2)
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2e-2


def test_gate_runs_the_gemm_inside_the_router_kernel_for_few_rows(monkeypatch):
    """On CUDA (the dispatch forced here, the kernels interpreted) a bf16 gate is kernels.router.gate_route's one
    launch up to its FUSED_MAX_ROWS rows, above them (and in fp32) the GEMM then `route`'s kernel: the twin's
    experts either way."""
    ran = []
    monkeypatch.setattr(k_router, "use_triton", lambda t: True)
    for fn in ("gate_route_triton", "route_triton"):
        monkeypatch.setattr(k_router, fn, lambda *a, real=getattr(k_router, fn), fn=fn, **k: ran.append(fn) or
                            real(*a, **k))
    g16 = _gate(hashed=False).to(torch.bfloat16)
    g16.bias.data = g16.bias.data.float()
    for T, dt, want in ((k_router.FUSED_MAX_ROWS, torch.bfloat16, "gate_route_triton"),
                        (k_router.FUSED_MAX_ROWS + 1, torch.bfloat16, "route_triton"),
                        (4, torch.float32, "route_triton")):
        ran.clear()
        g = g16 if dt == torch.bfloat16 else _gate(hashed=False)
        x = torch.randn(T, 32).to(dt)
        w, idx = g(x, None)
        assert ran == [want]
        tw, tidx = k_router.gate_route_torch(x, g.weight, g.bias, 3, 1.5)
        w, idx = _by_id(w, idx)
        tw, tidx = _by_id(tw, tidx)
        assert torch.equal(idx, tidx) and torch.allclose(w, tw, atol=1e-2)
