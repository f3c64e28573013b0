"""mHC mixes: twin vs the doc's formulas computed token by token in float64; Triton vs twin."""
import math

import pytest
import torch

from deepinfer_sg.kernels.backend import sm_count
from deepinfer_sg.kernels.hc_mix import hc_mixes, hc_mixes_torch, hc_mixes_triton
from helpers import DEVICE, on_dev, to_cpu


def _params(gen, T, M, H, dtype=torch.float32):
    residual = (torch.randn(T, M, H, generator=gen) * 2).to(dtype)
    nz = (2 + M) * M
    fn = torch.randn(nz, M * H, generator=gen) / math.sqrt(M * H) * 3
    base = torch.randn(nz, generator=gen)
    scale = torch.rand(3, generator=gen) + 0.5
    return residual, fn, base, scale


def _naive(residual, fn, base, scale, iters, eps=1e-6):
    T, M, H = residual.shape
    pre = torch.zeros(T, M, dtype=torch.float64)
    post = torch.zeros(T, M, dtype=torch.float64)
    comb = torch.zeros(T, M, M, dtype=torch.float64)
    sig = lambda x: 1 / (1 + math.exp(-x))
    for t in range(T):
        r = residual[t].reshape(-1).double()
        z = (fn.double() @ r) / math.sqrt(float((r * r).mean()) + 1e-20)
        for j in range(M):
            pre[t, j] = sig(float(z[j]) * float(scale[0]) + float(base[j])) + eps
            post[t, j] = sig(float(z[M + j]) * float(scale[1]) + float(base[M + j])) * 2.0
        c = [[float(z[2 * M + j * M + k]) * float(scale[2]) + float(base[2 * M + j * M + k]) for k in range(M)]
             for j in range(M)]
        for j in range(M):
            mx = max(c[j])
            e = [math.exp(x - mx) for x in c[j]]
            c[j] = [x / sum(e) + eps for x in e]

        def norm_cols():
            for k in range(M):
                col = sum(c[j][k] for j in range(M)) + eps
                for j in range(M):
                    c[j][k] /= col

        def norm_rows():
            for j in range(M):
                row = sum(c[j]) + eps
                c[j] = [x / row for x in c[j]]
        norm_cols()
        for _ in range(iters - 1):
            norm_rows()
            norm_cols()
        comb[t] = torch.tensor(c, dtype=torch.float64)
    return pre, post, comb


def test_twin_matches_formulas():
    gen = torch.Generator().manual_seed(0)
    x = _params(gen, T=3, M=4, H=10)
    ref = _naive(*x, iters=20)
    out = hc_mixes_torch(*x)
    for a, b in zip((out.pre, out.post, out.comb), ref):
        assert torch.allclose(a.double(), b, atol=1e-5, rtol=1e-5)
    # Sinkhorn ends on a column step: columns sum to ~1, rows close to 1
    assert torch.allclose(out.comb.sum(1), torch.ones(3, 4), atol=1e-4)


@pytest.mark.parametrize("T,M,H,dtype,iters", [(5, 4, 24, torch.float32, 20), (37, 4, 100, torch.bfloat16, 20),
                                               (3, 2, 40, torch.float32, 3), (19, 2, 40, torch.bfloat16, 20)])
def test_triton_matches_twin(T, M, H, dtype, iters):
    """M = 2 takes the [tokens, M, M] Sinkhorn block, M = 4 the per-token one."""
    gen = torch.Generator().manual_seed(T * H)
    x = _params(gen, T, M, H, dtype)
    ref = hc_mixes_torch(*x, iters=iters)
    out = hc_mixes_triton(*on_dev(x), iters=iters, block_t=16, block_k=32, split=128)
    for a, b in zip(to_cpu((out.pre, out.post, out.comb)), (ref.pre, ref.post, ref.comb)):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("T,waiters,spc,fast", [(37, 2, 16, True), (5, 8, 16, False), (37, 16, 4, True),
                                              (21, 4, 2, False)])
def test_mixing_blocks_match_twin(T, waiters, spc, fast):
    """Mixing shapes on a token count that leaves partial blocks; waiters: programs mixing a token block's tokens
    (on a GPU); spc: split partials loaded at once (6 splits: a partial last chunk when spc does not divide them);
    fast: hardware reciprocals in the Sinkhorn loop (compiled kernels; the interpreter divides). Columns of the
    result sum to 1 (the loop ends on a column step)."""
    gen = torch.Generator().manual_seed(T + waiters)
    x = _params(gen, T, 4, 48, torch.bfloat16)
    ref = hc_mixes_torch(*x)
    out = hc_mixes_triton(*on_dev(x), block_t=16, block_k=32, split=32, waiters=waiters, spc=spc, fast_rcp=fast)
    for a, b in zip(to_cpu((out.pre, out.post, out.comb)), (ref.pre, ref.post, ref.comb)):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (a - b).abs().max()
    assert torch.allclose(to_cpu(out.comb).sum(1), torch.ones(T, 4), atol=1e-4)


@pytest.mark.parametrize("block_t,split,block_k", [(16, 64, 32), (32, 128, 64)])
def test_decode_tiles_repeat_bit_for_bit(block_t, split, block_k):
    """Two calls on the same input give the same bits (the partials are added in split order, whatever order
    the programs ran in), and both match the float64 formula; 2 loop steps per program as the decode default."""
    gen = torch.Generator().manual_seed(100 + block_t)
    x = _params(gen, 37, 4, 72, torch.bfloat16)
    ref = _naive(x[0].double(), x[1].double(), x[2].double(), x[3].double(), 20)
    kw = dict(block_t=block_t, block_k=block_k, split=split)
    a = hc_mixes_triton(*on_dev(x), **kw)
    b = hc_mixes_triton(*on_dev(x), **kw)
    for u, v, w in zip((a.pre, a.post, a.comb), (b.pre, b.post, b.comb), ref):
        assert torch.equal(u, v)
        assert torch.allclose(u.cpu().double(), w, atol=2e-5, rtol=1e-4), (u.cpu().double() - w).abs().max()


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(1)
    residual, fn, base, scale = _params(gen, 2, 4, 8)
    with pytest.raises(ValueError, match="hc fn"):
        hc_mixes(residual, fn[:, :-1], base, scale)


@pytest.mark.parametrize("precision,prefetch", [("bf16x3", False), ("ieee", False), ("bf16x3", True),
                                               ("ieee", True)])
def test_bf16_residual_paths_match_float64_formula(precision, prefetch):
    """bf16 residual: the split-fn path (three bf16 products) and the fp32 dot both give fp32-accurate mixes,
    checked against the float64 formula; a token count that is not a multiple of the token block; prefetch:
    the first pass loads each step's tiles one step ahead (72 * 4 columns: a partial last split and step)."""
    gen = torch.Generator().manual_seed(31)
    x = _params(gen, 21, 4, 72, torch.bfloat16)
    ref = _naive(x[0].double(), x[1].double(), x[2].double(), x[3].double(), 20)
    out = hc_mixes_triton(*on_dev(x), iters=20, block_k=32, split=64, precision=precision, prefetch=prefetch)
    for a, b in zip((out.pre, out.post, out.comb), ref):
        assert torch.allclose(a.cpu().double(), b, atol=2e-5, rtol=1e-4), (a.cpu().double() - b).abs().max()


@pytest.mark.parametrize("parts,spc,waiters", [(False, 4, 16), (False, 8, 8), (True, 1, 2), (True, 2, 4)])
def test_fn_forms_agree_with_formula(parts, spc, waiters):
    """fn split in registers or read as bf16 parts; several token blocks, a split count (5) that is not a
    multiple of spc; two fresh inputs."""
    from deepinfer_sg.kernels.hc_mix import split_fn_bf16
    for seed in (41, 42):
        gen = torch.Generator().manual_seed(seed)
        x = _params(gen, 35, 4, 80, torch.bfloat16)
        ref = _naive(x[0].double(), x[1].double(), x[2].double(), x[3].double(), 20)
        out = hc_mixes_triton(*on_dev(x), iters=20, block_t=16, block_k=32, split=64, spc=spc, waiters=waiters,
                              fn_parts=on_dev(split_fn_bf16(x[1])) if parts else None)
        for a, b in zip((out.pre, out.post, out.comb), ref):
            assert torch.allclose(a.cpu().double(), b, atol=2e-5, rtol=1e-4), (a.cpu().double() - b).abs().max()


def test_fn_split_is_exact_to_fp32():
    from deepinfer_sg.kernels.hc_mix import split_fn_bf16
    fn = torch.randn(24, 500, generator=torch.Generator().manual_seed(3)) * 0.05
    parts = split_fn_bf16(fn).double()
    assert parts.shape == (3, 24, 500)
    assert float(((parts.sum(0) - fn.double()).abs() / fn.double().abs()).max()) < 2 ** -20


def test_fn_parts_cache_follows_in_place_changes():
    from deepinfer_sg.kernels.hc_mix import fn_parts_cached, split_fn_bf16
    fn = torch.randn(24, 64, generator=torch.Generator().manual_seed(4))
    a = fn_parts_cached(fn)
    assert fn_parts_cached(fn) is a                          # cached
    fn.mul_(2.0)                                             # an in-place update must not reuse stale parts
    b = fn_parts_cached(fn)
    assert b is not a and torch.equal(b, split_fn_bf16(fn))


def _apply_inputs(gen, T, M, H, dtype):
    R = (torch.randn(T, M, H, generator=gen) * 2).to(dtype)
    y = torch.randn(T, H, generator=gen).to(dtype)
    post = torch.rand(T, M, generator=gen) * 2
    comb = torch.rand(T, M, M, generator=gen) + 0.05
    a = torch.rand(T, M, generator=gen) + 0.1
    return R, y, post, comb, a


def _post_f64(R, y, post, comb):
    T, M, H = R.shape
    out = torch.zeros(T, M, H, dtype=torch.float64)
    for t in range(T):
        for k in range(M):
            out[t, k] = float(post[t, k]) * y[t].double()
            for j in range(M):
                out[t, k] += float(comb[t, j, k]) * R[t, j].double()
    return out


@pytest.mark.parametrize("T,M,H,dtype", [(5, 4, 600, torch.float32), (3, 2, 70, torch.bfloat16),
                                         (7, 4, 1100, torch.bfloat16)])
def test_post_and_pre_apply_match_formula(T, M, H, dtype):
    """R' = post*y + comb^T R and x = sum_j a_j R_j against float64 loops (hidden sizes that are not a multiple
    of the kernel's block); the fused post+pre pass reads x out of the rounded R'."""
    from deepinfer_sg.kernels.hc_mix import hc_post_torch, hc_post_triton, hc_pre_torch, hc_pre_triton
    gen = torch.Generator().manual_seed(T * H)
    R, y, post, comb, a = _apply_inputs(gen, T, M, H, dtype)
    ref = _post_f64(R, y, post, comb)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for out in (hc_post_torch(R, y, post, comb), hc_post_triton(*on_dev((R, y, post, comb))).cpu()):
        assert out.dtype == dtype
        assert float((out.double() - ref).abs().max() / ref.abs().max()) < tol
    out, x = to_cpu(hc_post_triton(*on_dev((R, y, post, comb, a))))
    x_ref = (a.double().unsqueeze(-1) * out.double()).sum(1)
    assert float((x.double() - x_ref).abs().max() / x_ref.abs().max()) < tol
    x2 = hc_pre_triton(*on_dev((R, a))).cpu()
    x2_ref = (a.double().unsqueeze(-1) * R.double()).sum(1)
    assert float((x2.double() - x2_ref).abs().max() / x2_ref.abs().max()) < tol
    assert float((hc_pre_torch(R, a).double() - x2_ref).abs().max() / x2_ref.abs().max()) < tol


def test_apply_bad_shapes_raise():
    from deepinfer_sg.kernels.hc_mix import hc_post_apply
    R, y, post, comb, a = _apply_inputs(torch.Generator().manual_seed(0), 2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="comb mix"):
        hc_post_apply(R, y, post, comb[:, :2])


@pytest.mark.parametrize("T,block_t,split,block_k,waiters,spc,parts,prefetch", [
    (37, 16, 64, 32, None, None, False, True),    # 3 token blocks (the last partial), 5 splits, 2 steps per split
    (21, 8, 128, 64, 2, 2, False, True),          # waiters with several tokens each; 3 split chunks of 2
    (35, 16, 64, 32, None, 4, True, False),       # fn as bf16 parts, loads in their step; 5 splits in chunks of 4
    (6, 16, 320, 64, None, None, False, False)])  # one token block, one split (K = 320), 5 steps
def test_fused_launch_matches_formula_and_repeats(T, block_t, split, block_k, waiters, spc, parts, prefetch):
    """The launch (partials, tickets, the last starters mix) against the float64 formula, twice on the
    same input (same bits: the partials are added in a fixed order whichever program stored last), and its
    counters are left zero for the next launch."""
    from deepinfer_sg.kernels import hc_mix
    gen = torch.Generator().manual_seed(T * split)
    x = _params(gen, T, 4, 80, torch.bfloat16)
    ref = _naive(x[0].double(), x[1].double(), x[2].double(), x[3].double(), 20)
    kw = dict(block_t=block_t, split=split, block_k=block_k, waiters=waiters, spc=spc, prefetch=prefetch,
              fn_parts=on_dev(hc_mix.split_fn_bf16(x[1])) if parts else None)
    a = hc_mixes_triton(*on_dev(x), **kw)
    b = hc_mixes_triton(*on_dev(x), **kw)
    for u, v, w in zip((a.pre, a.post, a.comb), (b.pre, b.post, b.comb), ref):
        assert torch.equal(u, v)
        assert torch.allclose(u.cpu().double(), w, atol=2e-5, rtol=1e-4), (u.cpu().double() - w).abs().max()
    assert int(_tickets_left(a.pre.device).abs().sum()) == 0


def _tickets_left(dev):
    """The mHC launches' shared ticket counters (kernels.backend.tickets at their site): a launch must leave every
    one of them zero, or the next launch's programs would take wrong tickets."""
    from deepinfer_sg.kernels import backend, hc_mix
    return backend.tickets(dev, 512, site=hc_mix.TICKET_SITE)


def _tail_shape(one: bool):
    """(tokens, block_t, H, split, waiters, tokens a waiter) of test_tail_forms' launches (the same for both
    kernels: the mixes split 4H columns, the write-back + mixes H). A GPU (whole grid resident): 21 tokens in
    16-token blocks (the last partial) with 16 waiters of one token each over 16 splits (the form that runs at
    T = 64), or 2 waiters of 8 tokens. The interpreter runs one waiter a block (programs run one after another),
    so one token a waiter needs 1-token blocks (5 of them: the interpreter is slow), else the waiter mixes the
    block's 16."""
    if DEVICE == "cuda":
        return (21, 16, 256, 16, 16, 1) if one else (21, 16, 48, 32, 2, 8)
    return (5, 1, 48, 32, None, 1) if one else (21, 16, 48, 32, None, 16)


@pytest.mark.parametrize("one", [False, True])
@pytest.mark.parametrize("form", [0, 1, 2, 3, 7])
def test_tail_forms_match_formula_and_leave_counters_zero(form, one):
    """Every form of the mixing tail (_finish_block FORM bits: early leaving ticket, logits in registers, acquire
    polls) in both launches, with waiters of one token each and of several (_tail_shape, asserted on the launch
    shape), against the float64 formula, with the ticket counters left zero."""
    from deepinfer_sg.kernels import hc_mix
    T, block_t, H, split, waiters, tpw = _tail_shape(one)
    gen = torch.Generator().manual_seed(50 + form)
    x = _params(gen, T, 4, H, torch.bfloat16)
    dev = on_dev(x[0]).device
    for K, sp in ((4 * H, 4 * split), (H, split)):      # the mixes' columns and split, then the write-back's
        assert hc_mix._split_launch(T, K, block_t, sp, split, 4, waiters, None, dev).tpw == tpw
    ref = _naive(x[0].double(), x[1].double(), x[2].double(), x[3].double(), 20)
    out = hc_mixes_triton(*on_dev(x), block_t=block_t, block_k=split, split=4 * split, waiters=waiters,
                          tail_form=form)
    for a, b in zip((out.pre, out.post, out.comb), ref):
        assert torch.allclose(a.cpu().double(), b, atol=2e-5, rtol=1e-4), (a.cpu().double() - b).abs().max()
    R, y, post, comb, a = _apply_inputs(gen, T, 4, H, torch.bfloat16)
    o, _, m = hc_mix.hc_post_mix_triton(*on_dev((R, y, post, comb, a) + x[1:]), block_t=block_t, split=split,
                                        block_k=split, waiters=waiters, tail_form=form)
    mix_ref = _naive(o.cpu().double(), x[1].double(), x[2].double(), x[3].double(), 20)
    for u, w in zip((m.pre, m.post, m.comb), mix_ref):
        assert torch.allclose(u.cpu().double(), w, atol=2e-5, rtol=1e-4), (u.cpu().double() - w).abs().max()
    assert int(_tickets_left(out.pre.device).abs().sum()) == 0


def test_fused_launch_beyond_one_wave():
    """More programs than the GPU holds at once (132 token blocks x 5 splits on a GPU; a small case in the
    interpreter): only the last starter of each block waits, so the launch cannot deadlock; results as the twin."""
    T = 2100 if DEVICE == "cuda" else 40
    x = _params(torch.Generator().manual_seed(7), T, 4, 80, torch.bfloat16)
    ref = hc_mixes_torch(*x)
    out = hc_mixes_triton(*on_dev(x), block_t=16, split=64, block_k=64)
    for a, b in zip(to_cpu((out.pre, out.post, out.comb)), (ref.pre, ref.post, ref.comb)):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("T,H,dtype,block_t,split,block_k,parts,waiters,warps", [
    (21, 100, torch.bfloat16, 16, 64, 32, False, None, 4),  # 2 token blocks (the last partial), 2 splits (partial),
    #                                                         2 steps
    (5, 72, torch.float32, 16, 32, 32, False, 2, 4),        # fp32 streams (one fp32 dot), 3 splits, waiters
    (35, 80, torch.bfloat16, 16, 128, 64, True, 4, 4),      # fn as bf16 parts, one split of 2 steps, 3 token blocks
    (9, 40, torch.bfloat16, 16, 16, 16, True, None, 4),     # 16-wide splits of one 16-wide step (3, the last partial)
    (9, 40, torch.bfloat16, 16, 16, 16, True, None, 2)])    # the same in programs of 2 warps
def test_post_mix_matches_twin_and_repeats(T, H, dtype, block_t, split, block_k, parts, waiters, warps):
    """The write-back + next mixes launch: R' and x as the write-back's formula (float64 loops), the mixes as the
    float64 formula on the R' the kernel wrote (what a separate mixes launch would read), twice with the same
    bits, and the counters left zero."""
    from deepinfer_sg.kernels import hc_mix
    gen = torch.Generator().manual_seed(T * H)
    R, y, post, comb, a = _apply_inputs(gen, T, 4, H, dtype)
    _, fn, base, scale = _params(gen, 1, 4, H)
    kw = dict(block_t=block_t, split=split, block_k=block_k, waiters=waiters, num_warps=warps,
              fn_parts=on_dev(hc_mix.split_fn_bf16(fn)) if parts else None)
    args = on_dev((R, y, post, comb, a, fn, base, scale))
    out, x, m = hc_mix.hc_post_mix_triton(*args, **kw)
    out2, x2, m2 = hc_mix.hc_post_mix_triton(*args, **kw)
    out, x = to_cpu((out, x))
    ref = _post_f64(R, y, post, comb)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert out.dtype == dtype and float((out.double() - ref).abs().max() / ref.abs().max()) < tol
    x_ref = (a.double().unsqueeze(-1) * out.double()).sum(1)
    assert float((x.double() - x_ref).abs().max() / x_ref.abs().max()) < tol
    mix_ref = _naive(out.double(), fn.double(), base.double(), scale.double(), 20)
    for u, v, w in zip((m.pre, m.post, m.comb), (m2.pre, m2.post, m2.comb), mix_ref):
        assert torch.equal(u, v)
        assert torch.allclose(u.cpu().double(), w, atol=2e-5, rtol=1e-4), (u.cpu().double() - w).abs().max()
    assert torch.equal(to_cpu(out2), out) and torch.equal(to_cpu(x2), x)
    assert int(_tickets_left(m.pre.device).abs().sum()) == 0


def test_post_mix_apply_is_post_then_mixes():
    """The public entry equals the write-back then the mixes (on CPU the twins, bit for bit; the engine's
    fused and separate paths rely on it); a stream count the kernel does not take (2) still works."""
    from deepinfer_sg.kernels import hc_mix
    for M in (4, 2):
        gen = torch.Generator().manual_seed(M)
        R, y, post, comb, a = _apply_inputs(gen, 6, M, 40, torch.bfloat16)
        _, fn, base, scale = _params(gen, 1, M, 40)
        out, x, m = hc_mix.hc_post_mix_apply(R, y, post, comb, a, fn, base, scale)
        o2, x2 = hc_mix.hc_post_apply(R, y, post, comb, a)
        m2 = hc_mix.hc_mixes(o2, fn, base, scale)
        assert torch.equal(out, o2) and torch.equal(x, x2)
        for u, v in zip((m.pre, m.post, m.comb), (m2.pre, m2.post, m2.comb)):
            assert torch.equal(u, v)


def test_post_mix_tiles_fill_the_gpu_once():
    """The write-back + mixes tiles: the narrowest split (16 to 128 columns) that keeps the grid within one
    program an SM (132 here), else 128-wide; V4.1's hidden 5120 keeps session 8-10's picks."""
    from deepinfer_sg.kernels import hc_mix
    dev = torch.device("cpu")
    picks = {(T, H): hc_mix._post_mix_tiles(T, H, dev) for T in (5, 8, 16, 32, 64, 128, 256) for H in (2048, 5120)}
    assert {k: v["split"] for k, v in picks.items()} == {
        (5, 2048): 16, (8, 2048): 16, (16, 2048): 16, (32, 2048): 32, (64, 2048): 64, (128, 2048): 128,
        (256, 2048): 128, (5, 5120): 64, (8, 5120): 64, (16, 5120): 64, (32, 5120): 128, (64, 5120): 128,
        (128, 5120): 128, (256, 5120): 128}
    assert all(v["block_k"] == min(64, v["split"]) and v["block_t"] == 16 for v in picks.values())


@pytest.mark.parametrize("T", [8, 32, 64, 256] if DEVICE == "cuda" else [5])
def test_post_mix_apply_at_the_mid_size_shape(T, monkeypatch):
    """hc_post_mix_apply as the engine calls it after the MoE (y2 and the read-out norm) at the mid-size model's
    hidden 2048 on a GPU, where the one launch takes 16- to 128-wide splits and the norm up to 256 tokens (the
    grid resident at once): R' and the normalised x as the twin's within bf16 rounding, the mixes as the twin's on
    the kernel's R', counters left zero. In the interpreter (a tiny case): the one launch without the norm, then
    the norm's twin."""
    from deepinfer_sg.kernels import hc_mix
    H = 2048 if DEVICE == "cuda" else 40
    if DEVICE != "cuda":
        monkeypatch.setattr(hc_mix, "use_triton", lambda t: True)
    gen = torch.Generator().manual_seed(90 + T)
    R, y, post, comb, a = _apply_inputs(gen, T, 4, H, torch.bfloat16)
    y2 = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    _, fn, base, scale = _params(gen, 1, 4, H)
    w = torch.rand(H, generator=gen) + 0.5
    if DEVICE == "cuda" and sm_count(torch.device("cuda")) >= 132:      # (an H200: the grid resident at once)
        monkeypatch.setattr(hc_mix, "rms_norm", lambda *a: pytest.fail("the read-out norm ran as its own launch"))
    out, x, m = hc_mix.hc_post_mix_apply(*on_dev((R, y, post, comb, a, fn, base, scale)), y2=on_dev(y2),
                                         x_norm=(on_dev(w), 1e-6))
    out, x = to_cpu((out, x))
    ro, rx, _ = hc_mix.hc_post_mix_torch(R, y, post, comb, a, fn, base, scale, y2=y2, x_norm=(w, 1e-6))
    assert float((out.float() - ro.float()).abs().max() / ro.float().abs().max()) < 8e-3
    assert float((x.float() - rx.float()).abs().max() / rx.float().abs().max()) < 1.6e-2
    ref = hc_mix.hc_mixes_torch(out, fn, base, scale)
    for u, v in zip(to_cpu((m.pre, m.post, m.comb)), (ref.pre, ref.post, ref.comb)):
        assert torch.allclose(u, v, atol=2e-5, rtol=1e-4), (u - v).abs().max()
    assert int(_tickets_left(m.pre.device).abs().sum()) == 0


def test_post_mix_beyond_one_wave():
    """The write-back + mixes launch with more programs than the GPU holds at once (132 token blocks x 3 splits
    on a GPU; a small case in the interpreter): one waiter per token block, no deadlock; mixes as the twin's on
    the kernel's R'."""
    from deepinfer_sg.kernels import hc_mix
    T = 2100 if DEVICE == "cuda" else 20
    gen = torch.Generator().manual_seed(9)
    R, y, post, comb, a = _apply_inputs(gen, T, 4, 80, torch.bfloat16)
    _, fn, base, scale = _params(gen, 1, 4, 80)
    out, x, m = hc_mix.hc_post_mix_triton(*on_dev((R, y, post, comb, a, fn, base, scale)), block_t=16, split=32,
                                          block_k=32)
    ref = hc_mix.hc_mixes_torch(out.cpu(), fn, base, scale)
    for u, v in zip(to_cpu((m.pre, m.post, m.comb)), (ref.pre, ref.post, ref.comb)):
        assert torch.allclose(u, v, atol=2e-5, rtol=1e-4), (u - v).abs().max()
    ro = hc_mix.hc_post_torch(R, y, post, comb)
    assert float((out.cpu().float() - ro.float()).abs().max() / ro.float().abs().max()) < 8e-3
    x_ref = (a.double().unsqueeze(-1) * out.cpu().double()).sum(1)      # the read-out of the kernel's R'
    assert float((x.cpu().double() - x_ref).abs().max() / x_ref.abs().max()) < 8e-3


@pytest.mark.parametrize("fused", [False, True])
def test_second_addend_is_one_fp32_sum(fused):
    """y2 (the MoE's shared expert output beside its routed output y): the twin is the write-back of the fp32 sum
    y + y2 bit for bit; the kernels (write-back + read-out, or write-back + read-out + next mixes) match the
    float64 formula on y + y2 as tightly as with one addend, and the old path (y + y2 rounded to bf16 first) within
    bf16 rounding. T = 7, H = 100: a partial hidden block, two splits."""
    from deepinfer_sg.kernels import hc_mix
    gen = torch.Generator().manual_seed(70 + fused)
    R, y, post, comb, a = _apply_inputs(gen, 7, 4, 100, torch.bfloat16)
    y2 = (torch.randn(7, 100, generator=gen) * 3).to(torch.bfloat16)
    _, fn, base, scale = _params(gen, 1, 4, 100)
    out_t, x_t = hc_mix.hc_post_torch(R, y, post, comb, a, y2=y2)
    o_ref, x_ref = hc_mix.hc_post_torch(R, y.float() + y2.float(), post, comb, a)
    assert torch.equal(out_t, o_ref) and torch.equal(x_t, x_ref)
    if fused:
        out, x, m = hc_mix.hc_post_mix_triton(*on_dev((R, y, post, comb, a, fn, base, scale)), block_t=16, split=64,
                                              block_k=32, y2=on_dev(y2))
        mix_ref = _naive(out.cpu().double(), fn.double(), base.double(), scale.double(), 20)
        for u, w in zip((m.pre, m.post, m.comb), mix_ref):
            assert torch.allclose(u.cpu().double(), w, atol=2e-5, rtol=1e-4), (u.cpu().double() - w).abs().max()
    else:
        out, x = hc_mix.hc_post_triton(*on_dev((R, y, post, comb, a)), y2=on_dev(y2))
    out, x = to_cpu((out, x))
    f64 = _post_f64(R, y.double() + y2.double(), post, comb)
    tol = 8e-3          # one bf16 rounding (the interpreter's bf16 conversion truncates: 2**-7)
    assert float((out.double() - f64).abs().max() / f64.abs().max()) < tol
    assert float((out.float() - out_t.float()).abs().max() / out_t.float().abs().max()) < tol
    x_f64 = (a.double().unsqueeze(-1) * out.double()).sum(1)
    assert float((x.double() - x_f64).abs().max() / x_f64.abs().max()) < tol
    old = hc_mix.hc_post_torch(R, y + y2, post, comb)                              # the add launch, then one addend
    assert float((out.float() - old.float()).abs().max() / old.float().abs().max()) < 2 * tol


def _write_back_inputs(seed: int, H: int):
    """A write-back + mixes call's inputs for 21 tokens, 4 streams of width H (bf16): ((R, y, post, comb, a, fn,
    base, scale), the second addend y2, a read-out norm weight w)."""
    gen = torch.Generator().manual_seed(seed)
    R, y, post, comb, a = _apply_inputs(gen, 21, 4, H, torch.bfloat16)
    y2 = torch.randn(21, H, generator=gen).to(torch.bfloat16)
    _, fn, base, scale = _params(gen, 1, 4, H)
    return (R, y, post, comb, a, fn, base, scale), y2, torch.rand(H, generator=gen) + 0.5


@pytest.mark.parametrize("form,waiters,H", [(1, None, 100), (2, None, 100), (2, 2, 100), (2, 16, 768)]
                         if DEVICE == "cuda" else [(1, None, 100)])
def test_read_out_norm_in_the_write_back(form, waiters, H):
    """x_norm: the read-out RMSNorm-ed in the write-back + mixes launch (_finish_block's NORM forms: 1, the
    waiters normalise whole rows after the wait; 2, GPU only, every program waits for the block's partials, then
    the non-waiters normalise all columns (2 waiters of the 4 splits), or with every program a waiter (4
    waiters) each its own; and H=768: 24 splits, 16 one-token waiters, the acquire-poll tail form 7 with
    non-waiters, the form the model runs at T=8 / 64 on the H200), with the second addend, 2 token blocks (the
    last partial) and 4 splits (the last partial) at H=100: the normalised x
    against the float64 formula on the kernel's R', the twin (kernels.rmsnorm's on the rounded x) within bf16
    rounding, R' and the mixes unchanged by the norm, the same bits twice, counters left zero."""
    from deepinfer_sg.kernels import hc_mix
    (R, y, post, comb, a, fn, base, scale), y2, w = _write_back_inputs(80 + form, H)
    args = on_dev((R, y, post, comb, a, fn, base, scale))
    kw = dict(block_t=16, split=32, block_k=32, y2=on_dev(y2), norm_form=form, waiters=waiters)
    out, x, m = hc_mix.hc_post_mix_triton(*args, **kw, x_norm=(on_dev(w), 1e-6))
    out2, x2, m2 = hc_mix.hc_post_mix_triton(*args, **kw, x_norm=(on_dev(w), 1e-6))
    o_plain, _, m_plain = hc_mix.hc_post_mix_triton(*args, **kw)
    out, x = to_cpu((out, x))
    assert torch.equal(to_cpu(out2), out) and torch.equal(to_cpu(x2), x) and torch.equal(to_cpu(o_plain), out)
    for u, v, p in zip((m.pre, m.post, m.comb), (m2.pre, m2.post, m2.comb), (m_plain.pre, m_plain.post, m_plain.comb)):
        assert torch.equal(u, v) and torch.equal(u, p)
    x64 = (a.double().unsqueeze(-1) * out.double()).sum(1)
    n64 = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    assert float((x.double() - n64).abs().max() / n64.abs().max()) < 8e-3
    _, x_twin, _ = hc_mix.hc_post_mix_torch(R, y, post, comb, a, fn, base, scale, y2=y2, x_norm=(w, 1e-6))
    assert float((x.float() - x_twin.float()).abs().max() / x_twin.float().abs().max()) < 1.6e-2
    assert int(_tickets_left(m.pre.device).abs().sum()) == 0


@pytest.mark.parametrize("H,norm,one", [(100, False, False), (768, True, False)] if DEVICE == "cuda"
                         else [(100, False, False), (100, False, True)])
def test_deferred_mixes_match_the_one_launch(H, norm, one, monkeypatch):
    """defer: the write-back + mixes launch leaves the mixes to HcMixes.finish (_mix_partials_kernel, run later:
    engine/mhc.py's side stream). Before it the mixes are unwritten (still poisoned); after it R' and x are the
    one launch's bits, and so are the mixes where the finish mixes as many tokens a program as the waiters did,
    else (waiters of one token each: 16 tokens a finish program, _finish_tokens) within fp32 rounding; the
    counters are left zero. H = 768 with the read-out norm (GPU: form 2 with no waiters, every program normalises
    x; 24 splits; waiters of one token each, so two finish programs for the 21 tokens); H = 100 without it (the
    launch stores its partials only). one (the interpreter, whose grids are never resident): the deferred launch
    shaped for waiters of one token each, as the GPU's resident grids are (its main launch has no waiters). The
    finish's grid, seen at its launch: two programs for the 21 tokens (16 a program) whatever the waiters."""
    import dataclasses
    from deepinfer_sg.kernels import hc_mix
    inputs, y2, w = _write_back_inputs(60 + H, H)
    args = on_dev(inputs)
    kw = dict(block_t=16, split=32, block_k=32, y2=on_dev(y2), x_norm=(on_dev(w), 1e-6) if norm else None)
    out, x, m = hc_mix.hc_post_mix_triton(*args, **kw)
    L = hc_mix._post_mix_launch(21, H, args[0].device, 16, 32, 32)
    if one:
        L = dataclasses.replace(L, nw=16, tpw=1)
    got_out, got_x, late = hc_mix.hc_post_mix_triton(*args, **kw, launch=L, defer=True)
    assert m.finish is None and late.finish is not None
    assert bool(to_cpu(late.comb).isnan().all())
    grids, kernel = [], hc_mix._mix_partials_kernel

    class Spy:          # the finish's launch, its grid noted
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]
    monkeypatch.setattr(hc_mix, "_mix_partials_kernel", Spy())
    late.finish()
    assert grids == [(2,)]
    assert torch.equal(to_cpu(got_out), to_cpu(out)) and torch.equal(to_cpu(got_x), to_cpu(x))
    same = hc_mix._finish_tokens(L) == (L.tpw, L.spc)     # the finish mixes as the waiters did: the same bits
    for u, v in zip((late.pre, late.post, late.comb), (m.pre, m.post, m.comb)):
        u, v = to_cpu(u), to_cpu(v)
        assert torch.equal(u, v) if same else torch.allclose(u, v, atol=5e-6, rtol=5e-5), (u - v).abs().max()
    assert int(_tickets_left(m.pre.device).abs().sum()) == 0
