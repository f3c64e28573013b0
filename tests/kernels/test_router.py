"""MoE router epilogue (kernels/router.py): the twin vs the formulas written out in float64 per row (softplus by
its definition, the biased top-k by a full sort, normalisation and scale); the Triton kernel vs the twin on awkward
shapes (expert counts not a power of two, K not a power of two, one expert picked, logits large and very negative,
strided rows, bf16 logits; 384 experts a row in one warp, 1500 a row in four). Outputs start poisoned (conftest)."""
import math

import pytest
import torch

from deepinfer_sg.kernels import router
from deepinfer_sg.kernels.router import gate_route_torch, gate_route_triton, route_torch, route_triton
from deepinfer_sg.kernels.backend import INTERPRETING
from helpers import on_dev, to_cpu


def _by_hand(logits, bias, k, scaling):
    ws, ids = [], []
    for row in logits.double().tolist():
        s = [math.sqrt(math.log1p(math.exp(v)) if v <= 20 else v) for v in row]
        order = sorted(range(len(s)), key=lambda e: (-(s[e] + float(bias[e])), e))[:k]
        tot = sum(s[e] for e in order)
        ws.append([s[e] / (tot + 1e-20) * scaling for e in order])
        ids.append(order)
    return torch.tensor(ws, dtype=torch.float64), torch.tensor(ids)


def _sorted_pairs(w, idx):
    """(weights, ids) of each row ordered by expert id (the contract leaves the order to the implementation)."""
    o = idx.argsort(dim=1)
    return w.gather(1, o), idx.gather(1, o)


def test_twin_is_the_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 13, generator=g) * 4
    logits[0, 3] = 30.0              # above softplus' threshold
    logits[1, :4] = -25.0            # exp underflows to the series
    bias = torch.randn(13, generator=g)
    w, idx = route_torch(logits, bias, 4, 1.5)
    hw, hidx = _by_hand(logits, bias, 4, 1.5)
    w, idx = _sorted_pairs(w, idx)
    hw, hidx = _sorted_pairs(hw, hidx)
    assert torch.equal(idx, hidx) and torch.allclose(w.double(), hw, atol=1e-6)


@pytest.mark.parametrize("T,E,K", [(1, 8, 1), (7, 64, 6), (3, 13, 4), (9, 384, 6), (4, 100, 7), (2, 5, 5),
                                   (3, 1500, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin(T, E, K, dtype):
    g = torch.Generator().manual_seed(T * E + K)
    wide = torch.randn(T, E + 3, generator=g) * 3
    wide[:, 0] = -40.0               # (a tiny score) and large ones
    wide[0, 1] = 25.0
    logits = wide[:, 1:E + 1].to(dtype)      # strided rows
    bias = torch.randn(E, generator=g) * 0.5
    want_w, want_i = _sorted_pairs(*route_torch(logits, bias, K, 1.5))
    got = to_cpu(route_triton(on_dev(logits), on_dev(bias), K, 1.5))
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64 and got[0].shape == (T, K)
    got_w, got_i = _sorted_pairs(*got)
    assert torch.equal(got_i, want_i)
    assert torch.allclose(got_w, want_w, atol=1e-6, rtol=1e-5)


def test_ties_go_to_the_lower_expert():
    logits = torch.zeros(2, 10)
    got_w, got_i = to_cpu(route_triton(on_dev(logits), on_dev(torch.zeros(10)), 3, 1.0))
    assert got_i.tolist() == [[0, 1, 2], [0, 1, 2]] and torch.allclose(got_w, torch.full((2, 3), 1 / 3))


def test_bad_bias_is_refused_with_the_shapes():
    with pytest.raises(ValueError, match="bias"):
        route_triton(torch.randn(3, 8), torch.randn(7), 2, 1.0)
    with pytest.raises(ValueError, match="top 9 of 8"):
        route_triton(torch.randn(3, 8), torch.randn(8), 9, 1.0)


# (rows, hidden, experts, top-k, config): several row blocks, hidden not a multiple of BK, experts not a power of two,
# split-K by default, forced to several / no slices; several expert tiles (V4.1's 384 experts in 3 tiles, split 3;
# 200 in 2, unsplit; 100 in 4, split 2; 130 in 2, the second with fewer than K experts)
GATE_CASES = [(5, 300, 13, 4, None), (20, 256, 64, 6, {"BM": 16, "SPLIT": 3, "BK": 32}), (3, 96, 8, 1, {"SPLIT": 1}),
              (33, 200, 100, 7, {"BK": 16}), (200, 256, 64, 6, {"SPLIT": 2, "BK": 64}),
              (19, 96, 384, 6, {"BK": 32, "SPLIT": 3}), (6, 64, 200, 6, {"SPLIT": 1}),
              (3, 64, 100, 3, {"BN": 32, "BK": 32, "SPLIT": 2}), (5, 64, 130, 6, {"BN": 128})]


@pytest.mark.parametrize("case", GATE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_route_matches_twin(case, dtype):
    """The gate GEMM inside the kernel, on strided rows, twice in a row (the split-K tickets reset themselves).
    fp32: the twin's experts (GEMM, then the formulas) and weights. bf16: the kernel's logits are the same sums in
    another order, rounded to bf16, so a near tie may go the other way: its experts must be a top-k of the exact
    (float64) scores + bias up to the rounding of a logit, and its weights the exact ones at its experts."""
    T, H, E, K, cfg = case
    g = torch.Generator().manual_seed(T * H + E)
    wide = torch.randn(T, H + 5, generator=g)
    x = wide[:, 2:H + 2].to(dtype)                       # strided rows
    gw = (torch.randn(E, H, generator=g) * 2 / H ** 0.5).to(dtype)
    bias = torch.randn(E, generator=g) * 0.3
    exact = torch.nn.functional.softplus(x.double() @ gw.double().T).sqrt()          # float64 scores
    want_w, want_i = _sorted_pairs(*gate_route_torch(x, gw, bias, K, 1.5))
    for _ in range(2):
        got = to_cpu(gate_route_triton(on_dev(x), on_dev(gw), on_dev(bias), K, 1.5, config=cfg))
        assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64 and got[0].shape == (T, K)
        got_w, got_i = _sorted_pairs(*got)
        if dtype == torch.float32 and INTERPRETING:      # (a GPU's fp32 dot runs in tf32: checked as bf16 below)
            assert torch.equal(got_i, want_i)
            assert torch.allclose(got_w, want_w, atol=1e-5, rtol=1e-4)
            continue
        key = exact + bias.double()
        chosen = torch.zeros_like(key, dtype=torch.bool).scatter_(1, got_i, True)
        worst_in = key.masked_fill(~chosen, float("inf")).min(dim=1).values
        best_out = key.masked_fill(chosen, float("-inf")).max(dim=1).values
        assert (worst_in >= best_out - 2e-2).all()       # (a bf16 logit of size ~3 is within ~1e-2 of its sum)
        s = exact.gather(1, got_i)
        assert torch.allclose(got_w.double(), s / s.sum(1, keepdim=True) * 1.5, rtol=2e-2)


def test_gate_route_ties_across_tiles_go_to_the_lower_expert():
    """Equal keys in two expert tiles (zero logits, experts 0-12 biased down): the merge of the tiles' candidates
    takes the lower ids, 13-15 from the first tile, then 16-18 from the second."""
    bias = torch.zeros(40)
    bias[:13] = -1.0
    x, gw = torch.zeros(3, 64, dtype=torch.bfloat16), torch.randn(40, 64).to(torch.bfloat16)
    w, idx = to_cpu(gate_route_triton(on_dev(x), on_dev(gw), on_dev(bias), 6, 1.0, config={"BN": 16}))
    assert idx.tolist() == [list(range(13, 19))] * 3 and torch.allclose(w, torch.full((3, 6), 1 / 6))


def test_gate_route_without_tickets_runs_unsplit(monkeypatch):
    """When kernels.backend.tickets has none to give (a CUDA graph captured before a warm-up made them), the gate
    is the unsplit launch, bit for bit, or with several expert tiles the GEMM library + route; with them, the split
    and the tiled launches leave the router's counters zero."""
    from deepinfer_sg.kernels import backend, router
    g = torch.Generator().manual_seed(3)
    x = on_dev(torch.randn(5, 512, generator=g).to(torch.bfloat16))
    gw = on_dev((torch.randn(16, 512, generator=g) * 0.1).to(torch.bfloat16))
    bias = on_dev(torch.randn(16, generator=g) * 0.3)
    gate_route_triton(x, gw, bias, 4, 1.0, config={"SPLIT": 4, "BK": 64})
    assert not to_cpu(backend.tickets(x.device, 4, site="router")).any()
    unsplit = to_cpu(gate_route_triton(x, gw, bias, 4, 1.0, config={"SPLIT": 1, "BK": 64}))
    gate_route_triton(x, gw, bias, 4, 1.0, config={"SPLIT": 4, "BK": 64, "BN": 8})
    assert not to_cpu(backend.tickets(x.device, 8, site="router")).any()
    monkeypatch.setattr(router, "tickets", lambda *a, **k: None)
    got = to_cpu(gate_route_triton(x, gw, bias, 4, 1.0, config={"SPLIT": 4, "BK": 64}))
    assert torch.equal(got[0], unsplit[0]) and torch.equal(got[1], unsplit[1])
    got = to_cpu(gate_route_triton(x, gw, bias, 4, 1.0, config={"SPLIT": 4, "BK": 64, "BN": 8}))
    lib = to_cpu(router.route(torch.nn.functional.linear(x, gw), bias, 4, 1.0))
    assert torch.equal(got[0], lib[0]) and torch.equal(got[1], lib[1])


def test_gate_route_dispatch_by_width(monkeypatch):
    """On CUDA (forced here) a bf16 gate runs the one launch up to FUSED_MAX_ROWS rows when one tile holds its
    experts, up to TILED_MAX_ROWS when it takes several; above, the GEMM then `route`."""
    ran = []
    monkeypatch.setattr(router, "use_triton", lambda t: True)
    for fn in ("gate_route_triton", "route_triton"):
        monkeypatch.setattr(router, fn, lambda *a, real=getattr(router, fn), fn=fn, **k: ran.append(fn) or
                            real(*a, **k))
    for E, rows in ((64, router.FUSED_MAX_ROWS), (300, router.TILED_MAX_ROWS)):
        gw, bias = on_dev(torch.randn(E, 16).to(torch.bfloat16)), on_dev(torch.zeros(E))
        for T, want in ((rows, "gate_route_triton"), (rows + 1, "route_triton")):
            ran.clear()
            router.gate_route(on_dev(torch.randn(T, 16).to(torch.bfloat16)), gw, bias, 2, 1.0)
            assert ran == [want]


def test_gate_route_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="gate weight"):
        gate_route_triton(torch.randn(3, 8), torch.randn(4, 9), torch.zeros(4), 2, 1.0)
    with pytest.raises(ValueError, match="at most 4096"):
        gate_route_triton(torch.randn(3, 8), torch.randn(5000, 8), torch.zeros(5000), 2, 1.0)
