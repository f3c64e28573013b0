"""Attention-family kernel benchmarks: sparse decode attention (window + gathered compressed entries, sink) and
the indexer score + top-k. Imported by benchmarks/kernels.py after kbench.configure()."""
import torch

from deepinfer_sg.kernels import decode_attention, indexer
from kbench import DEV, rotating, row, S, time_ms


def bench_attention(bw, l2, batches):
    H, D, Kw, Kc = S(64, 16), S(512, 64), S(128, 16), S(512, 16)
    pool = S(2048, 64)
    for N in batches:
        def make():
            q = torch.randn(N, H, D, device=DEV, dtype=torch.bfloat16)
            win = torch.randn(N * Kw, D, device=DEV, dtype=torch.bfloat16)
            cmp_ = torch.randn(N * pool, D, device=DEV, dtype=torch.bfloat16)
            wi = (torch.arange(N, device=DEV)[:, None] * Kw + torch.arange(Kw, device=DEV)).int()
            ci = (torch.arange(N, device=DEV)[:, None] * pool +
                  torch.randperm(pool, device=DEV)[:Kc][None, :]).int()
            return q, win, wi, torch.randn(H, device=DEV), cmp_, ci
        nbytes = N * (Kw + Kc) * D * 2 + 2 * N * H * D * 2
        nxt = rotating(make, nbytes, l2)
        s = nxt()
        a = decode_attention.sparse_attention_triton(*s)
        b = decode_attention.sparse_attention_torch(*s)
        err = float((a.float() - b.float()).norm() / b.float().norm())
        sp = decode_attention.default_splits(N, H, Kw + Kc, 16, 64, s[0].device)
        t = time_ms(lambda: decode_attention.sparse_attention_triton(*nxt()))
        tt = time_ms(lambda: decode_attention.sparse_attention_torch(*nxt()))
        row("sparse attention", f"N={N} H={H} D={D} keys={Kw}+{Kc}", t, tt, nbytes, bw,
            f"rel err {err:.1e}; {sp} key splits")
        for alt in sorted({1, 2 * sp} - {sp}):
            a = decode_attention.sparse_attention_triton(*s, splits=alt)
            err = float((a.float() - b.float()).norm() / b.float().norm())
            t = time_ms(lambda: decode_attention.sparse_attention_triton(*nxt(), splits=alt))
            row("  attention splits", f"N={N} splits={alt}", t, None, nbytes, bw, f"rel err {err:.1e}")


def bench_indexer(bw, l2):
    N, Hi, Di, L, k = S(64, 2), S(32, 4), S(128, 32), S(16384, 100), S(512, 16)

    def make():
        return (torch.randn(N, Hi, Di, device=DEV, dtype=torch.bfloat16), torch.randn(N, Hi, device=DEV),
                torch.randn(N * L, Di, device=DEV, dtype=torch.bfloat16), torch.arange(N, device=DEV) * L,
                torch.full((N,), L, device=DEV))
    nbytes = N * L * Di * 2
    nxt = rotating(make, nbytes, l2)
    s = nxt()
    ia, va = indexer.indexer_topk_triton(*s, k, max_len=L)
    ib, vb = indexer.indexer_topk_torch(*s, k, max_len=L)
    overlap = float(sum(len(set(ia[i].tolist()) & set(ib[i].tolist())) for i in range(N)) / (N * k))
    t = time_ms(lambda: indexer.indexer_topk_triton(*nxt(), k, max_len=L))
    tt = time_ms(lambda: indexer.indexer_topk_torch(*nxt(), k, max_len=L))
    row("indexer score+top-k", f"N={N} Hi={Hi} Di={Di} L={L} k={k}", t, tt, nbytes, bw,
        f"top-k overlap with twin {overlap:.1%}")
    i2, v2 = indexer.indexer_topk_triton(*s, k, max_len=L, two_stage=True)
    same = bool(torch.equal(v2, va))
    t = time_ms(lambda: indexer.indexer_topk_triton(*nxt(), k, max_len=L, two_stage=True))
    row("  indexer two-stage", f"N={N} L={L} k={k} (2048-wide slices)", t, None, nbytes, bw,
        f"same scores as one topk: {same}")


def sweep(bw, l2):
    """Launch-parameter variants of the attention and indexer-score kernels."""
    N, H, D, Kw, Kc = S(64, 2), S(64, 16), S(512, 64), S(128, 16), S(512, 16)

    def make_attn():
        return (torch.randn(N, H, D, device=DEV, dtype=torch.bfloat16),
                torch.randn(N * Kw, D, device=DEV, dtype=torch.bfloat16),
                torch.randperm(N * Kw, device=DEV).view(N, Kw).int(), torch.randn(H, device=DEV),
                torch.randn(N * Kc, D, device=DEV, dtype=torch.bfloat16),
                torch.randperm(N * Kc, device=DEV).view(N, Kc).int())
    nxt = rotating(make_attn, N * (Kw + Kc) * D * 2, l2)
    for bh, bk, warps, stages in ((16, 64, 8, 1), (16, 64, 8, 2), (16, 64, 8, 3), (16, 64, 4, 2), (16, 32, 4, 2),
                                  (16, 128, 8, 2), (32, 64, 8, 2), (16, 64, 16, 2), (64, 32, 16, 2)):
        t = time_ms(lambda: decode_attention.sparse_attention_triton(*nxt(), block_h=bh, block_k=bk, num_warps=warps,
                                                                     num_stages=stages))
        row("  sweep attention", f"N={N} bh={bh} bk={bk} w={warps} st={stages}", t, None,
            N * (Kw + Kc) * D * 2 + 2 * N * H * D * 2, bw)
    N, Hi, Di, L = S(64, 2), S(32, 4), S(128, 32), S(16384, 100)

    def make_idx():
        return (torch.randn(N, Hi, Di, device=DEV, dtype=torch.bfloat16), torch.randn(N, Hi, device=DEV),
                torch.randn(N * L, Di, device=DEV, dtype=torch.bfloat16), torch.arange(N, device=DEV) * L,
                torch.full((N,), L, device=DEV))
    nxt = rotating(make_idx, N * L * Di * 2, l2)
    for bg, warps in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)):
        t = time_ms(lambda: indexer.indexer_scores_triton(*nxt(), L, block_g=bg, num_warps=warps))
        row("  sweep indexer scores", f"N={N} L={L} bg={bg} w={warps}", t, None, N * L * Di * 2 + N * L * 4, bw)
    sc = torch.randn(N, L, device=DEV)
    t = time_ms(lambda: sc.topk(S(512, 16), dim=1))
    row("  torch.topk alone", f"N={N} L={L} k=512", t, None, N * L * 4, bw)


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps) for kernels.py --compile-check."""
    return [
        ("attention split", decode_attention._sparse_attention_kernel, dict(q_ptr="*bf16", out_ptr="*bf16"),
         dict(D=512, BLOCK_H=16, BLOCK_K=64, HAS_CMP=True, IEEE=False, SPLIT=True), 8),
    ]
