"""Attention-family kernel benchmarks: sparse decode attention (window + gathered compressed entries, sink) and
the indexer score + top-k. Imported by benchmarks/kernels.py after kbench.configure().

Floors printed beside the rows: bytes (each gathered key read once, q read, out written) over the measured copy
bandwidth (the roof column); for attention also the tensor-core work (QK and PV: 4 * H * D flops per key) over
an H200's ~700 TFLOP/s bf16, which is 0.65x the byte floor at H = 64, D = 512 (128 flops per key byte); and the
"launch floor" row: one empty kernel replayed from a CUDA graph, the least time any launch takes.

Measured (H200, copy ~4,250 GB/s, bf16 matmul 700-790 TFLOP/s; launch floor 0.7 us):
  session 2 (final)      sparse attention N=64 / 256: 44.5 / 149 us (27% / 32%; keys from L2 41 / 121 us);
                         indexer N=64 L=16384 k=512: 136 us (46%; scores 74 us = 87%, one-program-per-row select
                         41 us, torch.topk 77 us)
  session 3 round 1 (K2) tensor-core form (`sparse_attention_tc`: all 64 heads as the M of the dots, one loop over
                         window + compressed keys, key splits with in-launch combine, optional D split for P@V):
                         N=64 best 49.4 us (bk64 S2 w8 st2; bk32 58.8, dv256 w4 61-74, S4 71-80), N=256 best
                         148.1 us (bk64 S1; bk32 173, dv256 w4 171-229) -- no better than session 2's kernel
                         (44.1 / 148.5). Floors: bytes 11.8 / 47.4 us, flops 6.8 / 27.1 us. Ablations: with every
                         key an L2 hit 52.6 / 158 us, without the P@V dot 47.2 / 130 us: the time is neither HBM
                         nor tensor cores but the per-tile instruction stream (~1,300 SASS instructions per 32-key
                         tile per thread, 11 barriers, one 8-warp program per SM: the [64, 512] fp32 accumulator is
                         half the register file, Q 64 KB of shared memory) plus a large fixed cost per program.
                         Triton's chained-dot layout puts all 8 warps along M, so with 64 heads both warpgroups
                         compute the same Q K^T (2x the QK tensor work); lazy rescaling slower (spills).
                         Indexer: looped score programs (queries once per program, pipelined key loads) 68.3 us =
                         94% (bg128 w4 4 blocks st3); chunked select 28.5 us (4 chunks, unsorted; 8: 31.3, 16: 42;
                         sorted +3 us); score + select (default path) 114.2 us (55%); fused first stage 98.7 us
                         (4096-entry programs).
  session 3 round 2 (K2) tensor-core form: 128-key tiles (one stage: 192 KB of shared memory, spills) 64.9 / 173 us;
                         bf16 partials 48.9 us at N=64; lazy 153.7 at N=256. Default dispatch unchanged (session 2's
                         kernel): 43.9 / 147.0 us. Per-program cost vs keys (window only, N=256): tc 24.4 us for 64
                         keys, 35.4 for 128, 148 for 640 (~12 us per 64-key tile per wave of 132 programs, ~13 us
                         fixed); session 2's kernel 26.6 / 41.0 / 147.
                         Indexer: select counts as two int32 sums reduced together (16-bit fields) instead of one
                         int64: 27.5 us (4 chunks, 8 warps; 2 chunks w16 29.1; 8 chunks 30.8-32.1; one program per
                         row 35.7); score + select 100.3 us = 63% (unsorted, the engine's form, 98.2 = 64%); scores
                         alone 69.4 us = 92%; fused first stage 99.1 us (no better: kept as an option, not default).
"""
import os
import sys
import time

import torch
import triton
import triton.language as tl

from deepinfer_sg.kernels import decode_attention, indexer
from kbench import DEV, DRY, emit, rotating, row, S, time_ms

TFLOPS = 700.0          # bf16 dense matmul rate for the flop floor until `matmul_rate` has measured it
_RATE = {}

# the tensor-core attention sweep: (N, block_k, dv (1 = all of D per program, 2 = D / 2: two programs split
# P@V), splits, warps, stages, bf16 partials, lazy rescaling), most telling first
TC_VARIANTS = [
    (64, 128, 1, 2, 8, 1, False, False), (256, 128, 1, 1, 8, 1, False, False), (64, 64, 1, 2, 8, 2, False, False),
    (256, 64, 1, 1, 8, 2, False, False), (64, 128, 1, 4, 8, 1, False, False), (256, 64, 1, 1, 8, 2, False, True),
    (64, 64, 1, 2, 8, 2, True, False), (256, 128, 1, 2, 8, 1, True, False),
]
# chunked select: (chunks, warps stage 1, warps stage 2, sorted)
SELECT_VARIANTS = [(4, 8, 8, False), (4, 8, 8, True), (2, 8, 8, False), (2, 16, 8, False), (4, 16, 8, False),
                   (8, 8, 8, False), (8, 4, 8, False), (4, 4, 8, False), (4, 8, 16, False), (1, 16, 16, False),
                   (2, 8, 8, True), (8, 4, 8, True)]
# looped score kernel: (block_g, warps, blocks per program, stages)
SCORE_VARIANTS = [(128, 4, 4, 3), (128, 4, 8, 3), (128, 4, 4, 4), (128, 4, 2, 3), (64, 4, 4, 3), (128, 4, 16, 3),
                  (256, 8, 4, 3), (128, 8, 4, 4)]
# fused scores + first select stage: (block_g, warps, blocks per program, stages)
FUSED_VARIANTS = [(128, 4, 32, 3), (128, 8, 32, 3), (128, 8, 64, 3), (128, 4, 64, 3)]


def tc_kw(v):
    _, bk, halves, sp, w, st, b16, lazy = v
    return dict(block_k=bk, dv=attn_shape()[1] // halves, splits=sp, num_warps=w, num_stages=st, bf16_partials=b16,
                lazy=lazy)


def tc_label(v):
    N, bk, halves, sp, w, st, b16, lazy = v
    return (f"N={N} bk{bk} dv{attn_shape()[1] // halves} S{sp} w{w} st{st}{' bf16part' if b16 else ''}"
            f"{' lazy' if lazy else ''}")


@triton.jit
def _empty_kernel(x_ptr):
    pass


def launch_floor(bw):
    """The least time one launch takes (an empty kernel, CUDA-graph replay): no kernel can beat it."""
    x = torch.empty(1, device=DEV)
    t = time_ms(lambda: _empty_kernel[(1,)](x))
    row("  launch floor", "empty kernel, graph replay", t, None, 0, bw, "no launch is faster")
    return t


def matmul_rate():
    """Measured bf16 dense matmul rate (TFLOP/s) for the flop floor (kernels.py measures it too but does not pass
    it to the family modules)."""
    if DRY:
        return TFLOPS
    if "r" not in _RATE:
        a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
        t = triton.testing.do_bench(lambda: a @ b, warmup=5, rep=40, return_mode="median")
        _RATE["r"] = 2 * 8192 ** 3 / (t * 1e-3) / 1e12
    return _RATE["r"]


def attn_inputs(N, H, D, Kw, Kc, pool):
    def make():
        q = torch.randn(N, H, D, device=DEV, dtype=torch.bfloat16)
        win = torch.randn(N * Kw, D, device=DEV, dtype=torch.bfloat16)
        cmp_ = torch.randn(N * pool, D, device=DEV, dtype=torch.bfloat16)
        wi = (torch.arange(N, device=DEV)[:, None] * Kw + torch.arange(Kw, device=DEV)).int()
        ci = (torch.arange(N, device=DEV)[:, None] * pool +
              torch.randperm(pool, device=DEV)[:Kc][None, :]).int()
        return q, win, wi, torch.randn(H, device=DEV), cmp_, ci
    return make


def attn_shape():
    return S(64, 16), S(512, 64), S(128, 16), S(512, 16), S(2048, 64)


def attn_floors(N, H, D, Kw, Kc, bw):
    """(bytes, byte floor us, flop floor us): keys read once, q read, out written; 4 H D flops per key."""
    nbytes = N * (Kw + Kc) * D * 2 + 2 * N * H * D * 2
    flop_us = 4 * N * H * D * (Kw + Kc) / (matmul_rate() * 1e12) * 1e6
    return nbytes, nbytes / (bw * 1e9) * 1e6, flop_us


def attn_note(t_ms, byte_us, flop_us, err):
    roof = max(byte_us, flop_us)
    return (f"rel err {err:.1e}; floors: bytes {byte_us:.1f} us, flops {flop_us:.1f} us "
            f"({matmul_rate():.0f} TFLOP/s); {roof / (t_ms * 1e3):.0%} of roofline")


def bench_attention(bw, l2, batches):
    H, D, Kw, Kc, pool = attn_shape()
    launch_floor(bw)
    for N in batches:
        nbytes, byte_us, flop_us = attn_floors(N, H, D, Kw, Kc, bw)
        nxt = rotating(attn_inputs(N, H, D, Kw, Kc, pool), nbytes, l2)
        s = nxt()
        b = decode_attention.sparse_attention_torch(*s).float()
        cfg = decode_attention.default_config(N, H, D, Kw + Kc, s[0].device)
        tc = decode_attention.default_tc_config(N, H, D, Kw + Kc)
        runs = (("sparse attention", decode_attention.sparse_attention, {}, "default dispatch"),
                ("  tensor-core form", decode_attention.sparse_attention_tc, tc,
                 " ".join(f"{k}={v}" for k, v in tc.items())),
                ("  before (session 2)", decode_attention.sparse_attention_triton, {},
                 f"bh{cfg['block_h']} bk{cfg['block_k']} w{cfg['num_warps']} S{cfg['splits']}"))
        for label, fn, kw, what in runs:
            a = fn(*s, **kw)
            err = float((a.float() - b).norm() / b.norm())
            t = time_ms(lambda: fn(*nxt(), **kw))
            tt = time_ms(lambda: decode_attention.sparse_attention_torch(*nxt())) if label[0] != " " else None
            row(label, f"N={N} H={H} D={D} keys={Kw}+{Kc}", t, tt, nbytes, bw,
                attn_note(t, byte_us, flop_us, err) + f"; {what}")
        # the same work with every row's keys among 32 rows of the pool (L2 hits): the kernel's time without HBM
        # traffic, i.e. its compute + latency floor at this launch configuration; and without the P @ V dot
        q, win, wi, sink, cmp_, ci = s
        hw, hc = (wi % 32).int(), (ci % 32).int()
        for label, fn, kw in (("  keys from L2", decode_attention.sparse_attention, {}),
                              ("  tc keys from L2", decode_attention.sparse_attention_tc, tc),
                              ("  tc without P@V", decode_attention.sparse_attention_tc, dict(tc, _skip_pv=True))):
            ix = (wi, ci) if "P@V" in label else (hw, hc)
            t = time_ms(lambda: fn(q, win, ix[0], sink, cmp_, ix[1], **kw))
            row(label, f"N={N} " + ("(wrong output: timing only)" if "P@V" in label else "(32 distinct keys)"),
                t, None, nbytes, bw, "compute + latency floor" if "L2" in label else "loads + Q K^T + softmax")
        # fewer keys per row (window only, no compressed entries): time = fixed cost per program + per key tile
        for kw_keys in (64, 128):
            wsl = wi[:, :kw_keys].contiguous()
            for label, fn, kw in (("  tc window only", decode_attention.sparse_attention_tc, tc),
                                  ("  before, window only", decode_attention.sparse_attention_triton, {})):
                t = time_ms(lambda: fn(q, win, wsl, sink, **kw))
                row(label, f"N={N} keys={kw_keys}+0", t, None, N * kw_keys * D * 2 + 2 * N * H * D * 2, bw,
                    "fixed + per-tile cost")


def indexer_inputs(N, Hi, Di, L):
    def make():
        return (torch.randn(N, Hi, Di, device=DEV, dtype=torch.bfloat16), torch.randn(N, Hi, device=DEV),
                torch.randn(N * L, Di, device=DEV, dtype=torch.bfloat16), torch.arange(N, device=DEV) * L,
                torch.full((N,), L, device=DEV))
    return make


def indexer_shape():
    return S(64, 2), S(32, 4), S(128, 32), S(16384, 300), S(512, 16)


def bench_indexer(bw, l2):
    N, Hi, Di, L, k = indexer_shape()
    nbytes = N * L * Di * 2
    nxt = rotating(indexer_inputs(N, Hi, Di, L), nbytes, l2)
    s = nxt()
    # the select must pick exactly what the stable twin picks on the same scores
    sc = indexer.indexer_scores_triton(*s, L)
    i2, v2 = indexer._select(sc, k)
    checks = []
    for chunks in (None, 1):
        i1, v1 = indexer.topk_select_triton(sc, k, chunks=chunks)
        checks.append(bool(torch.equal(i1, i2) and torch.equal(v1, v2)))
    ia, va = indexer.indexer_topk_triton(*s, k, max_len=L)
    ib, vb = indexer.indexer_topk_torch(*s, k, max_len=L)
    overlap = float(sum(len(set(ia[i].tolist()) & set(ib[i].tolist())) for i in range(N)) / (N * k))
    floor_us = nbytes / (bw * 1e9) * 1e6
    note = f"bytes floor {floor_us:.1f} us"
    t = time_ms(lambda: indexer.indexer_topk_triton(*nxt(), k, max_len=L))
    tt = time_ms(lambda: indexer.indexer_topk_torch(*nxt(), k, max_len=L))
    row("indexer score+top-k", f"N={N} Hi={Hi} Di={Di} L={L} k={k}", t, tt, nbytes, bw,
        f"{note}; select == stable twin: {checks[0]} (one program per row: {checks[1]}); overlap {overlap:.1%}")
    t = time_ms(lambda: indexer.topk_select_triton(indexer.indexer_scores_triton(*nxt(), L), k, sorted=False))
    row("  unsorted (engine)", f"N={N} L={L} k={k}", t, None, nbytes, bw, "scores + select(sorted=False)")
    t = time_ms(lambda: indexer.indexer_topk_triton(*nxt(), k, max_len=L, select="topk"))
    row("  with torch.topk", f"N={N} L={L} k={k} (D's version)", t, None, nbytes, bw)
    t = time_ms(lambda: indexer.indexer_scores_triton(*nxt(), L))
    row("  scores alone", f"N={N} L={L}", t, None, nbytes + N * L * 4, bw)
    scs = [torch.randn(N, L, device=DEV) for _ in range(4)]
    it = iter(range(1 << 30))
    for label, kw in (("  select alone", {}), ("  select unsorted", dict(sorted=False)),
                      ("  select 1 prog/row", dict(chunks=1))):
        t = time_ms(lambda: indexer.topk_select_triton(scs[next(it) % 4], k, **kw))
        row(label, f"N={N} L={L} k={k} (scores in L2)", t, None, N * L * 4, bw,
            f"chunks {kw.get('chunks', indexer.default_chunks(L, k))}")
    t = time_ms(lambda: scs[next(it) % 4].topk(k, dim=1))
    row("  torch.topk alone", f"N={N} L={L} k={k}", t, None, N * L * 4, bw)


def _warm_one(task):
    """Compile one sweep variant at its benchmark shape (a worker process: fills Triton's on-disk cache)."""
    kind, v = task
    t0 = time.time()
    try:
        if kind == "tc":
            H, D, Kw, Kc, pool = attn_shape()
            decode_attention.sparse_attention_tc(*attn_inputs(v[0], H, D, Kw, Kc, pool)(), **tc_kw(v))
        elif kind == "select":
            N, Hi, Di, L, k = indexer_shape()
            indexer.topk_select_triton(torch.randn(N, L, device=DEV), k, sorted=v[3], chunks=v[0], num_warps=v[1],
                                       num_warps2=v[2])
        elif kind == "attn-defaults":          # the non-sweep rows' kernels at N = v
            H, D, Kw, Kc, pool = attn_shape()
            x = attn_inputs(v, H, D, Kw, Kc, pool)()
            decode_attention.sparse_attention(*x)
            decode_attention.sparse_attention_triton(*x)
            tc = decode_attention.default_tc_config(v, H, D, Kw + Kc)
            decode_attention.sparse_attention_tc(*x, **tc)
            decode_attention.sparse_attention_tc(*x, **tc, _skip_pv=True)
            for n in (64, 128):
                decode_attention.sparse_attention_tc(*x[:2], x[2][:, :n], x[3], **tc)
                decode_attention.sparse_attention_triton(*x[:2], x[2][:, :n], x[3])
        elif kind == "indexer-defaults":
            N, Hi, Di, L, k = indexer_shape()
            x = indexer_inputs(N, Hi, Di, L)()
            sc = indexer.indexer_scores_triton(*x, L)
            for kw in ({}, dict(sorted=False), dict(chunks=1), dict(chunks=1, sorted=False)):
                indexer.topk_select_triton(sc, k, **kw)
        elif kind == "fused":
            N, Hi, Di, L, k = indexer_shape()
            indexer.indexer_topk_fused(*indexer_inputs(N, Hi, Di, L)(), k, max_len=L, block_g=v[0], num_warps=v[1],
                                       bpp=v[2], num_stages=v[3])
        elif kind == "score":
            N, Hi, Di, L, k = indexer_shape()
            indexer.indexer_scores_triton(*indexer_inputs(N, Hi, Di, L)(), L, block_g=v[0], num_warps=v[1],
                                          blocks_per_program=v[2], num_stages=v[3])
        torch.cuda.synchronize()
        return f"{kind} {v}: {time.time() - t0:.1f} s"
    except Exception as e:                                   # noqa: BLE001
        return f"{kind} {v}: FAILED {type(e).__name__}: {str(e)[:100]}"


def warm(workers=8):
    """Compile every sweep variant in parallel worker processes before the timed run (a round's budget cannot
    pay ~3 s of compile per variant one after the other)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    tasks = [("attn-defaults", 64), ("attn-defaults", 256), ("indexer-defaults", None)]
    if os.environ.get("WARM_DEFAULTS_ONLY") == "1":
        tasks += [("tc", v) for v in TC_VARIANTS[2:4]]
    else:
        tasks += [("tc", v) for v in TC_VARIANTS] + [("select", v) for v in SELECT_VARIANTS] + \
            [("score", v) for v in SCORE_VARIANTS] + [("fused", v) for v in FUSED_VARIANTS]
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for msg in ex.map(_warm_one, tasks):
            print("  warm", msg, flush=True)
    print(f"# warm: {len(tasks)} variants in {time.time() - t0:.0f} s", flush=True)


def sweep(bw, l2):
    """Variants of the tensor-core attention kernel (N = 64 and 256), of the chunked select and of the looped
    score kernel; stops adding rows after ATTN_SWEEP_S seconds (default 40) to fit a round's budget."""
    t_end = time.time() + float(os.environ.get("ATTN_SWEEP_S", "40"))
    H, D, Kw, Kc, pool = attn_shape()
    sets = {}
    for N in S((64, 256), (2,)):
        nb = N * (Kw + Kc) * D * 2 + 2 * N * H * D * 2
        sets[N] = (rotating(attn_inputs(N, H, D, Kw, Kc, pool), nb, l2), nb)
    t_attn = time.time() + 0.6 * (t_end - time.time())       # the rest of the budget is the indexer's
    for v in TC_VARIANTS:
        if time.time() > t_attn:
            emit("  sweep attention: stopped (ATTN_SWEEP_S)")
            break
        N = S(v[0], 2)
        nxt, nb = sets[N]
        _, byte_us, flop_us = attn_floors(N, H, D, Kw, Kc, bw)
        kw = tc_kw(v)
        s = nxt()
        try:
            a = decode_attention.sparse_attention_tc(*s, **kw)
            b = decode_attention.sparse_attention_torch(*s)
            err = float((a.float() - b.float()).norm() / b.float().norm())
            t = time_ms(lambda: decode_attention.sparse_attention_tc(*nxt(), **kw))
        except Exception as e:                               # noqa: BLE001 - e.g. out of shared memory
            emit(f"  sweep tc {tc_label(v)}: FAILED {type(e).__name__}: {str(e)[:120]}")
            continue
        row("  sweep tc attention", tc_label(v), t, None, nb, bw, attn_note(t, byte_us, flop_us, err))
    N, Hi, Di, L, k = indexer_shape()
    scs = [torch.randn(N, L, device=DEV) for _ in range(4)]
    it = iter(range(1 << 30))
    ref = indexer._select(scs[0], k)
    t_sel = time.time() + 0.6 * (t_end - time.time())
    for chunks, w1, w2, srt in SELECT_VARIANTS:
        if time.time() > t_sel:
            emit("  sweep select: stopped")
            break
        kw = dict(sorted=srt, chunks=chunks, num_warps=w1, num_warps2=w2)
        got = indexer.topk_select_triton(scs[0], k, **kw)
        same = bool(torch.equal(got[0], ref[0])) if srt else bool(torch.equal(got[0].sort(1).values,
                                                                              ref[0].sort(1).values))
        t = time_ms(lambda: indexer.topk_select_triton(scs[next(it) % 4], k, **kw))
        row("  sweep select", f"N={N} L={L} k={k} C{chunks} w{w1}/{w2} sorted={srt}", t, None, N * L * 4, bw,
            f"exact: {same}")
    nbytes = N * L * Di * 2 + N * L * 4
    nxt = rotating(indexer_inputs(N, Hi, Di, L), nbytes, l2)
    s = nxt()
    ref = indexer.indexer_scores_triton(*s, L)
    for bg, w, bpp, st in SCORE_VARIANTS:
        if time.time() > t_end:
            emit("  sweep scores: stopped")
            break
        kw = dict(block_g=bg, num_warps=w, blocks_per_program=bpp, num_stages=st)
        same = bool(torch.equal(indexer.indexer_scores_triton(*s, L, **kw), ref))
        t = time_ms(lambda: indexer.indexer_scores_triton(*nxt(), L, **kw))
        row("  sweep scores", f"N={N} L={L} bg{bg} w{w} bpp{bpp} st{st}", t, None, nbytes, bw, f"same: {same}")
    ref_i, ref_v = indexer.indexer_topk_triton(*s, k, max_len=L)
    for bg, w, bpp, st in FUSED_VARIANTS:
        if time.time() > t_end + 4:
            emit("  sweep fused: stopped")
            break
        kw = dict(block_g=bg, num_warps=w, bpp=S(bpp, 1), num_stages=st)
        got_i, got_v = indexer.indexer_topk_fused(*s, k, max_len=L, **kw)
        same = bool(torch.equal(got_i, ref_i) and torch.equal(got_v, ref_v))
        t = time_ms(lambda: indexer.indexer_topk_fused(*nxt(), k, max_len=L, **kw))
        row("  sweep fused", f"N={N} L={L} bg{bg} w{w} bpp{bpp} st{st}", t, None, N * L * Di * 2, bw,
            f"score+select (sorted), same as default path: {same}")


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps) for kernels.py --compile-check."""
    return [
        ("attention (tc, N=256)", decode_attention._attn_tc_kernel,
         dict(q_ptr="*bf16", out_ptr="*bf16", cnt_ptr="*i32"),
         dict(D=512, DV=512, BLOCK_H=64, BLOCK_K=32, HAS_CMP=True, IEEE=False, SPLIT=False, FUSE=False, BLOCK_S=2,
              DC=64, NORMED=False), 8),
        ("attention (tc split)", decode_attention._attn_tc_kernel,
         dict(q_ptr="*bf16", out_ptr="*bf16", cnt_ptr="*i32"),
         dict(D=512, DV=512, BLOCK_H=64, BLOCK_K=32, HAS_CMP=True, IEEE=False, SPLIT=True, FUSE=True, BLOCK_S=2,
              DC=64, NORMED=False), 8),
        ("topk select", indexer._topk_select_kernel, dict(idx_ptr="*i64", val_ptr="*fp32", scores_ptr="*fp32",
                                                          map_ptr="*i64"),
         dict(BLOCK=2048, RESIDENT=True, SORTED=False, KP=512, MAP=False), 4),
    ]


if __name__ == "__main__" and "--warm" in sys.argv:
    warm(int(os.environ.get("WARM_WORKERS", "8")))
