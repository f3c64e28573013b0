"""engine/mhc.py's fused write-backs as engine/batched.py's post_attention calls them after the MoE sub-layer:
MoE.forward_grouped(parts=True) hands back the routed and the shared expert outputs, and the write-back adds them
itself (hc_post_and_mixes / hc_post with y2): one fp32 sum, no add launch. Run with the twins (CPU) and with the
Triton kernels where CUDA would run them; compared with the two-step path (the add, then one addend)
within bf16 rounding and with the fp32 formula tightly. The kernels' cases run where the kernels run: interpreted on
CPU tensors (CI), compiled on the GPU's tensors where nothing interprets (KERNEL_TEST_DEVICE=cuda rounds); the
MoE and the references stay twins."""
import math
from types import SimpleNamespace

import pytest
import torch

from deepinfer_sg.engine.mhc import hc_post, hc_post_and_mixes, join_mixes
from deepinfer_sg.engine.moe import MoE
from deepinfer_sg.kernels import hc_mix
from deepinfer_sg.kernels.backend import INTERPRETING

H, M = 48, 4


def _kernels_device(kernels: bool, monkeypatch) -> str:
    """Where a case runs: the twins on the CPU; the CUDA dispatch (forced) on CPU tensors when interpreting, else
    compiled on the GPU's tensors (a compiled kernel cannot read CPU tensors)."""
    if not kernels:
        return "cpu"
    if not INTERPRETING and not torch.cuda.is_available():
        pytest.skip("compiled Triton kernels need CUDA")
    monkeypatch.setattr(hc_mix, "use_triton", lambda t: True)
    return "cpu" if INTERPRETING else "cuda"


def _moe(gen):
    moe = MoE(H, 24, n_experts=6, top_k=2, n_shared=1, limit=7.0, vocab_size=50, hashed=False, scaling=1.5)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return moe.to(torch.bfloat16).requires_grad_(False)


def _block(gen, dev="cpu"):
    """What hc_post_and_mixes reads of a layer: its config and the mHC parameters of its two sub-layers."""
    c = SimpleNamespace(rms_norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=20, hc_post_mult=2.0)
    b = SimpleNamespace(config=c)
    nz = (2 + M) * M
    for which in ("attn", "ffn"):
        setattr(b, f"hc_{which}_fn", (torch.randn(nz, M * H, generator=gen) / math.sqrt(M * H) * 3).to(dev))
        setattr(b, f"hc_{which}_base", torch.randn(nz, generator=gen).to(dev))
        setattr(b, f"hc_{which}_scale", (torch.rand(3, generator=gen) + 0.5).to(dev))
    return b


def _write_back_inputs(gen, T, dev):
    """A write-back's residual R [T, M, H] (bf16) and its mixes post, comb and the next read-out's pre (fp32)."""
    R = (torch.randn(T, M, H, generator=gen) * 2).to(torch.bfloat16)
    post = torch.rand(T, M, generator=gen) * 2
    comb = torch.rand(T, M, M, generator=gen) + 0.05
    pre = torch.rand(T, M, generator=gen) + 0.1
    return R.to(dev), post.to(dev), comb.to(dev), pre.to(dev)


def _norm(gen, dev):
    from deepinfer_sg.engine.norm import RMSNorm
    norm = RMSNorm(H, 1e-6).requires_grad_(False)
    norm.weight.copy_(torch.rand(H, generator=gen) + 0.5)
    return norm.to(torch.bfloat16).to(dev)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_forward_grouped_parts_sum_to_the_output():
    gen = torch.Generator().manual_seed(0)
    moe = _moe(gen)
    xn = torch.randn(5, H, generator=gen).to(torch.bfloat16)
    routed, shared = moe.forward_grouped(xn, parts=True)
    assert torch.equal(routed + shared, moe.forward_grouped(xn))
    moe.shared_experts = None
    routed, shared = moe.forward_grouped(xn, parts=True)
    assert shared is None and torch.equal(routed, moe.forward_grouped(xn))


@pytest.mark.parametrize("T,kernels", [(5, False), (5, True), (20, True)])
def test_moe_write_back_takes_the_two_parts(T, kernels, monkeypatch):
    """post_attention's MoE write-back with the next layer's mixes (hc_post_and_mixes) and without them (hc_post
    with the read-out, before an Engram layer). kernels: the CUDA dispatch (_kernels_device); T = 5 takes the
    write-back + mixes kernel, T = 20 the write-back kernel then the mixes kernel."""
    dev = _kernels_device(kernels, monkeypatch)
    gen = torch.Generator().manual_seed(T)
    moe, nxt = _moe(gen), _block(gen, dev)
    R, post, comb, pre = _write_back_inputs(gen, T, dev)
    xn = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    y, y2 = (t.to(dev) for t in moe.forward_grouped(xn, parts=True))        # what batched.py would run
    R1, ro = hc_post_and_mixes(nxt, "attn", R, y, post, comb, pre, y2=y2)
    R2, x2 = hc_post(R, y, post, comb, fast=True, next_pre=pre, y2=y2)
    R0, ro0 = hc_post_and_mixes(nxt, "attn", R, moe.forward_grouped(xn).to(dev), post, comb, pre)  # the add first
    join_mixes()                            # (mixes left to the side stream on a GPU)
    f32 = (post.unsqueeze(-1) * (y.float() + y2.float()).unsqueeze(-2)
           + torch.matmul(comb.transpose(-1, -2), R.float()))
    tol = 8e-3 if kernels else 4e-3     # one bf16 rounding (the interpreter's bf16 conversion truncates)
    for out, x in ((R1, ro.x), (R2, x2)):
        assert out.dtype == torch.bfloat16 and _rel(out, f32) < tol
        assert _rel(x, (pre.unsqueeze(-1) * out.float()).sum(1)) < tol
        assert _rel(out, R0) < 2 * tol and _rel(x, ro0.x) < 2 * tol
    if not kernels or T > 16:               # the same write-back kernel, or the same twin
        assert torch.equal(R1, R2) and torch.equal(ro.x, x2)
    want = hc_mix.hc_mixes_torch(R1, nxt.hc_attn_fn, nxt.hc_attn_base, nxt.hc_attn_scale, 1e-6, 1e-6, 20, 2.0)
    for u, v in zip(ro[1:], (want.pre, want.post, want.comb)):
        assert torch.allclose(u, v, atol=2e-5, rtol=1e-4), (u - v).abs().max()


@pytest.mark.parametrize("T,kernels", [(5, False), (5, True), (20, True), (70, True)])
def test_write_back_reads_out_normalised(T, kernels, monkeypatch):
    """hc_post_and_mixes(norm=...) as post_attention would call it for the MoE input (ffn_norm) and the next
    layer's attention input (attn_norm): the read-out comes back RMSNorm-ed, equal to the separate norm launch on
    the un-normalised read-out (bit for bit with the twins; within bf16 rounding with the kernels, which
    normalise inside the write-back + mixes kernel where its grid is resident at once (a GPU's), else run
    kernels.rmsnorm after the write-back + mixes kernel (T = 5) or after the write-back and mixes kernels (T = 20,
    70)); on a GPU the grid is resident at any of these sizes: one launch with the norm inside."""
    dev = _kernels_device(kernels, monkeypatch)
    gen = torch.Generator().manual_seed(30 + T)
    blk, norm = _block(gen, dev), _norm(gen, dev)
    R, post, comb, pre = _write_back_inputs(gen, T, dev)
    y, y2 = (torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev) for _ in range(2))
    R1, ro = hc_post_and_mixes(blk, "ffn", R, y, post, comb, pre, y2=y2, norm=norm)
    R0, ro0 = hc_post_and_mixes(blk, "ffn", R, y, post, comb, pre, y2=y2)
    join_mixes()
    fused = hc_mix._post_mix_launch(T, H, R.device).resident
    if not kernels or T <= hc_mix.POST_MIX_MAX_T or not fused:      # the same launches but the norm
        assert torch.equal(R1, R0)
        for u, v in zip(ro[1:], ro0[1:]):
            assert torch.equal(u, v)
    else:                               # one launch instead of the write-back and mixes launches
        assert _rel(R1, R0) < 8e-3
        want = hc_mix.hc_mixes_torch(R1, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale, 1e-6, 1e-6, 20, 2.0)
        for u, v in zip(ro[1:], (want.pre, want.post, want.comb)):
            assert torch.allclose(u, v, atol=2e-5, rtol=1e-4), (u - v).abs().max()
    want = norm((pre.unsqueeze(-1) * R1.float()).sum(1).to(R1.dtype))       # the read-out of R1, then the norm
    if kernels:
        assert _rel(ro.x, want) < 1.6e-2
    else:
        assert torch.equal(ro.x, want) and torch.equal(ro.x, norm(ro0.x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream and the graph capture need CUDA")
@pytest.mark.parametrize("T", [5, 64, 128])
def test_deferred_mixes_on_the_side_stream(T, monkeypatch):
    """mhc.DEFER_MIXES: each write-back + mixes launch leaves its mixes' tail to a launch on the "mhc" side stream,
    beside the next sub-layer, and the next consumer joins it. A chain as post_attention runs it (the attention
    write-back with the MoE's mixes and norm, a stand-in MoE, the MoE write-back with the next attention's mixes
    and norm, a stand-in layer, the last write-back by hc_post), eagerly and captured in a CUDA graph and
    replayed: nothing left unjoined, the replay the eager chain's bits, and these the tail-inside chain's up to the
    finish's order of the partials' sums (16 tokens a program against the waiters' one: the first write-back and
    read-out the same bits, its mixes within fp32 rounding, what follows from them within bf16 rounding); T = 128
    (DEFER_MAX_T's default) takes 8 finish programs."""
    from deepinfer_sg.engine import mhc
    gen = torch.Generator().manual_seed(40 + T)
    dev = torch.device("cuda")
    blk, norm = _block(gen, dev), _norm(gen, dev)
    R, post, comb, pre = _write_back_inputs(gen, T, dev)
    w = (torch.randn(H, H, generator=gen) / H ** 0.5).to(torch.bfloat16).to(dev)

    monkeypatch.setattr(hc_mix, "DEFER_MAX_T", T)         # (every size deferred, whatever the default)
    opened = []

    def chain():
        R1, ro = hc_post_and_mixes(blk, "ffn", R, torch.tanh(R[:, 0] @ w), post, comb, pre, norm=norm)
        opened.append(len(mhc._PENDING))
        R2, ro2 = hc_post_and_mixes(blk, "attn", R1, torch.tanh(ro.x @ w), ro.post, ro.comb, ro.pre, norm=norm)
        R3, x3 = hc_post(R2, torch.tanh(ro2.x @ w), ro2.post, ro2.comb, fast=True, next_pre=ro2.pre)
        return [R1, *ro, R2, *ro2, R3, x3]

    monkeypatch.setattr(mhc, "DEFER_MIXES", False)
    want = [t.clone() for t in chain()]
    monkeypatch.setattr(mhc, "DEFER_MIXES", True)
    got = chain()
    assert opened == [0, 1] and not mhc._PENDING
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for u, v in zip(got[2:5], want[2:5]):
        assert torch.allclose(u, v, atol=5e-6, rtol=5e-5), (u - v).abs().max()
    for u, v in zip(got[5:], want[5:]):
        assert _rel(u, v) < 8e-3
    want = [t.clone() for t in got]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = chain()
    assert not mhc._PENDING
    for t in got:
        t.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for u, v in zip(got, want):
        assert torch.equal(u, v)
