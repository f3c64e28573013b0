"""Time every kernel on a CUDA GPU against its torch twin and its roofline; print one table.

    python benchmarks/kernels.py [--quick] [--out results.json]
    python benchmarks/kernels.py --compile-check      # on any machine: sm_90 builds, registers and spills

Method (see the device notes' METHOD.md): the two ceilings are measured in this run (a large device-to-device
copy, bytes read + written; a large bf16 matmul); each kernel's floor is the fewest bytes it must move over the
measured copy bandwidth (all kernels here are memory-bound at decode shapes); inputs rotate among enough copies
that the working set is several times the L2, so the numbers are not L2 hits; times are medians of CUDA-graph
replays (triton.testing.do_bench_cudagraph), falling back to do_bench when a path cannot be captured (the twins
often sync). Each kernel is also checked against its twin at the benchmark shape before it is timed.
Columns: kernel, shape, Triton time, twin time, speedup, bytes moved (floor), achieved GB/s, fraction of the
copy bandwidth (the roofline fraction). The bitmask floor counts the mask plus a read and a write of every 32-byte
sector holding a banned token (a partial-sector write makes the memory system fetch the sector first; with the
random half-density masks used here that is every sector). The bitmask rows also time xgrammar's own kernel (its
default CUDA path, Triton) at the same shapes. --sweep adds launch-parameter variants; --dry runs every body once
on the CPU (interpreter, tiny shapes) to check the script itself. Twins are timed with do_bench when they sync.

Last measured (NVIDIA H200, torch 2.11 / Triton 3.6, 2026-11-29; copy 4273 GB/s, bf16 matmul 693 TFLOP/s):
  kernel                 shape                              triton us        twin us            roofline
  bitmask                B=64 / 256 / 512, V=129280         23 / 86 / 170    335 / 776 / 1506   67% / 73% / 74%
    xgrammar 0.2.9       same                               28 / 94 / 176    -                  56% / 67% / 71%
  bitmask by step        64 requests x 4 rows               84               -                  74%
  sample T=1 (1 pass)    B=64 / 256                         19 / 59          1955 / 5877        41% / 53%
  sample T=0.7 + mask    B=64 / 256                         27 / 83          2032 / 6374        30% / 38%
  sample top-k50 p0.9    B=64 / 256                         2174 / 3521      3154 / 10416       ~1% (bisection)
  speculative accept     64 req x 4 rows, draft probs       294              3693               13% (~80 launches)
  sparse attention       N=64 / 256, H=64 D=512, 128+512    44 / 158         324 / 1139         27% / 30%
  indexer score + top-k  N=64 Hi=32 Di=128 L=16384 k=512    166              1535               38% (scores 86%;
                                                                                                torch.topk 77 us)
  moe experts (bf16)     T=64 / 256, H=2048 F=1024 E=64 K=6 282 / 344        28942 / 27708      67% / 55%
  hc mixes + sinkhorn    T=64 / 256 / 4096, H=5120          43 / 115 / 1003  259 / 312 / 917    1-3% (needs work)

Changed since that run (helper D2, 2026-11-29, checked on CPU in the interpreter only; predictions to check):
  - top-k/top-p threshold (kernels/threshold.py): histogram pass + candidate compaction + register bisection on
    the few candidates, instead of <= 33 serial passes per row. Predicted: sample top-k50 p0.9 B=64 2174 -> ~60 us,
    B=256 3521 -> ~170 us (two reads of the logits plus the sampling pass). Rows now report the fast-path share
    and tau agreement with the twin. "top-p0.9 flat" (thousands of candidates) still takes the bisection fallback.
  - sampling noise: u built from bits (no int->float conversions; bit-identical): plain sampling ~5-10% faster.
  - speculative accept: ~80 launches -> 9 (fused per-request ratio test, no torch glue). Predicted 294 -> ~90 us.
  - sparse attention: key splits + combine (flash-decoding) when rows x head blocks do not fill the GPU.
    Predicted N=64 44 -> ~25 us; N=256 unchanged (one split); the "attention splits" rows time alternatives.
  - hc mixes: bf16 residuals now use three bf16 tensor-core products against a hi/mid/lo split of fn (fp32-
    accurate, checked against float64 in the tests) instead of the FMA dot that made the pass arithmetic-bound;
    more programs at small T. Predicted T=64/256/4096: 43/115/1003 -> ~10/~15/~60 us. The "hc streaming pass"
    note keeps D's FMA path for comparison.
  - indexer: a two-stage torch top-k is timed beside the single one ("indexer two-stage"; off by default).
  - --compile-check builds the hot kernels for sm_90 on any machine and prints registers/spills: D's moe gate/up
    (664 B) and attention (576 B at 4 warps) defaults spill; the D sweep measured them best anyway, so they stay,
    and the "moe no-spill tiles" rows time the spill-free moe tiles beside them.
  Unchanged: bitmask (at or above xgrammar's kernel already).
The whole run takes about 2-3 minutes on an H200 (--budget, default 200 s, skips the steps left after that);
with OUT set it also writes $OUT/kernels.txt (the table) and $OUT/kernels.json.
"""
import argparse
import importlib.util
import json
import math
import os
import sys
import time

START = time.time()

if "--dry" in sys.argv:          # the interpreter must be chosen before any kernel is decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton
import triton.testing



def _import_kernels():
    """deepinfer_sg.kernels, or (on a machine where the package is not installed) the repository's kernels/
    folder loaded under that name: the kernels import nothing else of ours."""
    try:
        import deepinfer_sg.kernels                                          # noqa: F401
    except ImportError:
        import types
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        pkg = types.ModuleType("deepinfer_sg")
        pkg.__path__ = []
        sys.modules["deepinfer_sg"] = pkg
        spec = importlib.util.spec_from_file_location("deepinfer_sg.kernels", os.path.join(root, "kernels", "__init__.py"),
                                                      submodule_search_locations=[os.path.join(root, "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["deepinfer_sg.kernels"] = mod
        spec.loader.exec_module(mod)


_import_kernels()
from deepinfer_sg.kernels import bitmask as bm_mod  # noqa: E402
from deepinfer_sg.kernels import decode_attention, hc_mix, indexer, moe, sampling, speculative, threshold  # noqa: E402

V = 129280
W = (V + 31) // 32
ROWS = []
LINES = []           # everything the table prints, written to $OUT/kernels.txt at the end when OUT is set


def emit(line=""):
    LINES.append(line)
    print(line, flush=True)
DEV = "cuda"
DRY = False          # --dry: run every benchmark body once on tiny shapes on the CPU (Triton interpreter), untimed


def S(big, small):
    """The benchmark shape, or a tiny one for --dry."""
    return small if DRY else big


def time_ms(fn, graph=True):
    fn()
    if DRY:
        return 1.0
    torch.cuda.synchronize()
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
        except Exception:                                    # noqa: BLE001 - the path syncs: time it plainly
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def rotating(make, set_bytes, l2_bytes):
    """Enough independent input sets that cycling through them exceeds 4x the L2; returns a `next()` getter."""
    n = max(1, min(16, math.ceil(4 * l2_bytes / max(set_bytes, 1))))
    sets = [make() for _ in range(n)]
    state = {"i": 0}

    def nxt():
        s = sets[state["i"] % n]
        state["i"] += 1
        return s
    return nxt


def row(kernel, shape, t_ms, twin_ms, nbytes, bw, note=""):
    gbs = nbytes / (t_ms * 1e-3) / 1e9
    r = dict(kernel=kernel, shape=shape, triton_us=t_ms * 1e3, twin_us=None if twin_ms is None else twin_ms * 1e3,
             bytes=nbytes, gbs=gbs, roofline=gbs / bw, note=note)
    ROWS.append(r)
    tw = "-" if twin_ms is None else f"{twin_ms * 1e3:9.1f}"
    sp = "-" if twin_ms is None else f"{twin_ms / t_ms:6.1f}x"
    emit(f"{kernel:22s} {shape:34s} {t_ms * 1e3:9.1f} {tw:>9s} {sp:>8s} {nbytes / 1e6:9.1f} {gbs:8.0f} "
        f"{gbs / bw:6.0%}  {note}")


def ceilings():
    n = 1 << 29                                             # 2 GiB of fp32: far beyond the L2
    x = torch.randn(n, device=DEV)
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median")
    bw = 2 * x.numel() * 4 / (t * 1e-3) / 1e9
    del x, y
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=100, return_mode="median")
    tflops = 2 * 8192 ** 3 / (t * 1e-3) / 1e12
    return bw, tflops


def load_xgrammar_kernel():
    """xgrammar's own apply_token_bitmask_inplace on CUDA (its default path there is its Triton kernel)."""
    try:
        import xgrammar
        return lambda logits, mask: xgrammar.apply_token_bitmask_inplace(logits, mask), xgrammar.__version__
    except Exception:                                        # noqa: BLE001 - package init needs pydantic etc.
        pass
    for base in sys.path:
        path = os.path.join(base, "xgrammar", "kernels", "apply_token_bitmask_inplace_triton.py")
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("xgr_bitmask_triton", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return lambda logits, mask: mod.apply_token_bitmask_inplace_triton(logits, mask), "file:" + path
    return None, None


def rand_bitmask(rows, density=0.5):
    bits = torch.rand(rows, W * 32, device=DEV) < density
    packed = (bits.view(rows, W, 32).to(torch.int64) << torch.arange(32, device=DEV)).sum(-1)
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)


def bench_bitmask(bw, l2, batches):
    xgr, xgr_version = (None, "skipped (dry run)") if DRY else load_xgrammar_kernel()
    emit(f"# xgrammar kernel: {xgr_version}")
    for B in batches:
        nxt = rotating(lambda: (torch.randn(B, V, device=DEV), rand_bitmask(B)), B * V * 4, l2)
        a, m = nxt()
        nbytes = bitmask_floor(m)
        ref = a.clone()
        bm_mod.apply_token_bitmask_torch(ref, m)
        out = a.clone()
        bm_mod.apply_token_bitmask_triton(out, m)
        assert torch.equal(out, ref), "bitmask kernel disagrees with its twin"
        t = time_ms(lambda: bm_mod.apply_token_bitmask_triton(*nxt()))
        tt = time_ms(lambda: bm_mod.apply_token_bitmask_torch(*nxt()))
        row("bitmask", f"B={B} V={V}", t, tt, nbytes, bw)
        if xgr is not None:
            out = a.clone()
            xgr(out, m)
            assert torch.equal(out, ref), "xgrammar disagrees with our twin"
            tx = time_ms(lambda: xgr(*nxt()))
            row("  xgrammar bitmask", f"B={B} V={V}", tx, None, nbytes, bw, f"ours/xgr = {t / tx:.2f}")
    # speculative rows: 64 requests x 4 rows, masks by step
    B, L = S(64, 3), 4
    R = B * L
    cu = torch.arange(B + 1, device=DEV) * L
    mrows = bm_mod.by_step_mask_rows(cu, cu, R)
    rows_all = torch.arange(R, device=DEV)
    nxt = rotating(lambda: (torch.randn(R, V, device=DEV), rand_bitmask(R)), R * V * 4, l2)
    t = time_ms(lambda: bm_mod.apply_token_bitmask_triton(*nxt(), rows_all, mrows))
    row("bitmask by step", f"B={B}x{L} rows V={V}", t, None, bitmask_floor(nxt()[1]), bw)


def peaked_logits(B):
    """LLM-like rows: a few dozen plausible tokens far above a long normal tail (top-p lands among them)."""
    x = torch.randn(B, V, device=DEV) * 1.5
    x[:, :40] += 14 + 3 * torch.rand(B, 40, device=DEV)
    return x


def bench_sampling(bw, l2, batches):
    flat = lambda B: torch.randn(B, V, device=DEV) * 3            # noqa: E731
    for B in batches:
        cases = [("sample T=1", dict(temperature=1.0, top_k=0, top_p=1.0), False, flat),
                 ("sample T=0.7 +mask", dict(temperature=0.7, top_k=0, top_p=1.0), True, flat),
                 ("sample greedy", dict(temperature=0.0, top_k=0, top_p=1.0), False, flat),
                 ("sample top-k50 p0.9", dict(temperature=1.0, top_k=50, top_p=0.9), False, flat),
                 ("sample top-k50 +mask", dict(temperature=0.7, top_k=50, top_p=1.0), True, flat),
                 ("sample top-p0.95 peak", dict(temperature=1.0, top_k=0, top_p=0.95), False, peaked_logits)]
        if B == batches[0]:        # top-p alone on flat rows: thousands of candidates, the bisection fallback
            cases.append(("sample top-p0.9 flat", dict(temperature=1.0, top_k=0, top_p=0.9), False, flat))
        for name, kw, masked, gen_rows in cases:
            p = sampling.row_params(B, DEV, seed=torch.arange(B, device=DEV),
                                    position=torch.arange(B, device=DEV) + 7, **kw)
            nxt = rotating(lambda: (gen_rows(B), rand_bitmask(B) if masked else None), B * V * 4, l2)
            x, m = nxt()
            flt = kw["top_k"] > 0 or kw["top_p"] < 1         # known on the host, as sample_from_logits knows it
            a = sampling.sample_triton(x, p, m, filters=flt)
            b = sampling.sample_torch(x, p, m)
            note = f"tokens equal to twin: {float((a == b).float().mean()):.1%}"
            if flt:
                mr = torch.arange(B, device=DEV) if m is not None else None
                tau, path = threshold.thresholds_and_paths(x, p, m, mr)
                z = sampling.masked_z_torch(x, p.inv_temperature, m, mr)
                tau_ok = float((tau == sampling.thresholds_torch(z, p)).float().mean())
                fast = path > 0
                cands = float(path[fast].float().mean()) if bool(fast.any()) else 0.0
                note += f"; tau equal {tau_ok:.0%}; fast path {int(fast.sum())}/{B} rows, {cands:.0f} candidates"
            t = time_ms(lambda: sampling.sample_triton(*(lambda s: (s[0], p, s[1]))(nxt()), filters=flt))
            tt = time_ms(lambda: sampling.sample_torch(*(lambda s: (s[0], p, s[1]))(nxt())), graph=False)
            row(name, f"B={B} V={V}", t, tt, B * V * 4 + (B * W * 4 if masked else 0), bw, note)


def bench_speculative(bw, l2):
    B, L = S(64, 3), 4
    R = B * L
    cu = torch.arange(B + 1, device=DEV) * L

    def make():
        logits = torch.randn(R, V, device=DEV) * 2
        probs = torch.softmax(logits + 0.3 * torch.randn_like(logits), 1)
        drafts = torch.multinomial(probs, 1)[:, 0]
        return logits, probs, drafts
    nxt = rotating(make, 2 * R * V * 4, l2)
    x, pr, d = nxt()
    # per-request tensors already on the device: nothing is copied from the host inside a CUDA-graph capture
    for label, top_k, top_p in (("probs", 0, 1.0), ("probs top-k50 p0.9", 50, 0.9)):
        kw = dict(temperature=torch.ones(B, device=DEV), top_k=torch.full((B,), top_k, dtype=torch.int64, device=DEV),
                  top_p=torch.full((B,), top_p, device=DEV), seed=torch.arange(B, device=DEV),
                  position=torch.arange(B, device=DEV))
        a = speculative.speculative_accept(x, cu, d, pr, backend="triton", **kw)
        b = speculative.speculative_accept(x, cu, d, pr, backend="torch", **kw)
        agree = float((a.tokens == b.tokens).float().mean())
        acc = float(a.num_accepted.float().mean())

        def run(backend):
            s = nxt()
            return speculative.speculative_accept(s[0], cu, s[2], s[1], backend=backend, **kw)
        t = time_ms(lambda: run("triton"))
        tt = time_ms(lambda: run("torch"), graph=False)
        row("speculative accept", f"B={B} rows={R} V={V} {label}", t, tt, R * V * 4 + B * V * 4, bw,
            f"mean accepted {acc:.2f}; equal to twin {agree:.1%}")


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


def bench_moe(bw, l2, batches):
    H, F, E, K = S(2048, 64), S(1024, 32), S(64, 4), S(6, 2)
    for T in batches:
        def make():
            scores = torch.rand(T, E, device=DEV)
            ids = scores.topk(K, 1).indices
            return (torch.randn(T, H, device=DEV, dtype=torch.bfloat16), ids,
                    torch.rand(T, K, device=DEV),
                    torch.randn(E, F, H, device=DEV, dtype=torch.bfloat16) * 0.05,
                    torch.randn(E, F, H, device=DEV, dtype=torch.bfloat16) * 0.05,
                    torch.randn(E, H, F, device=DEV, dtype=torch.bfloat16) * 0.05)
        nxt = rotating(make, 3 * E * F * H * 2, l2)
        s = nxt()
        touched = int(torch.unique(s[1]).numel())
        nbytes = touched * 3 * F * H * 2 + 2 * T * H * 2
        a = moe.moe_experts_triton(*s)
        b = moe.moe_experts_torch(*s)
        err = float((a.float() - b.float()).norm() / b.float().norm())
        t = time_ms(lambda: moe.moe_experts_triton(*nxt()))
        tt = time_ms(lambda: moe.moe_experts_torch(*nxt()), graph=False)
        row("moe experts", f"T={T} H={H} F={F} E={E} K={K}", t, tt, nbytes, bw,
            f"{touched} experts touched; rel err {err:.1e}")
        t = time_ms(lambda: moe.moe_experts_triton(*nxt(), block_k=64, num_warps=8))
        row("  moe no-spill tiles", f"T={T} bk=64 w=8", t, None, nbytes, bw, "sm_90 build without spills")


def bench_hc(bw, l2, batches):
    M, H = 4, S(5120, 64)
    for T in batches:
        nz = (2 + M) * M

        def make():
            return (torch.randn(T, M, H, device=DEV, dtype=torch.bfloat16),
                    torch.randn(nz, M * H, device=DEV) / math.sqrt(M * H), torch.randn(nz, device=DEV),
                    torch.rand(3, device=DEV) + 0.5)
        nbytes = T * M * H * 2 + nz * M * H * 4
        nxt = rotating(make, nbytes, l2)
        s = nxt()
        parts = hc_mix.split_fn_bf16(s[1])       # once per layer in an engine; built outside the timed region
        a = hc_mix.hc_mixes_triton(*s, fn_parts=parts)
        b = hc_mix.hc_mixes_torch(*s)
        err = max(float((a.comb - b.comb).abs().max()), float((a.pre - b.pre).abs().max()))
        t = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), fn_parts=parts))
        tt = time_ms(lambda: hc_mix.hc_mixes_torch(*nxt()))
        row("hc mixes + sinkhorn", f"T={T} M={M} H={H}", t, tt, nbytes, bw,
            f"max abs err {err:.1e}; bf16x3 split-fn products (fn parts cached)")
        if not DRY:
            tp = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), fn_parts=parts, only_partial=True))
            ti = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), precision="ieee"))
            row("  hc streaming pass", f"T={T} M={M} H={H}", tp, None, nbytes, bw,
                f"(whole op with D's fp32 FMA dot instead: {ti * 1e3:.1f} us)")


def bitmask_floor(mask: torch.Tensor) -> int:
    """Fewest bytes for masking fp32 logits in place: the mask, plus read + write of every 32-byte sector (8 tokens)
    that holds a banned token (a partial-sector write makes the memory system fetch the sector first)."""
    R = mask.shape[0]
    bits = (mask.unsqueeze(-1) >> torch.arange(32, device=mask.device, dtype=torch.int32)) & 1
    banned = (bits.view(R, -1)[:, :V] == 0)
    pad = (-V) % 8
    sectors = torch.nn.functional.pad(banned, (0, pad)).view(R, -1, 8).any(-1)
    return mask.numel() * 4 + 2 * 32 * int(sectors.sum())


def sweep(bw, l2):
    """Launch-parameter variants (for tuning the defaults)."""
    B = S(512, 3)
    nxt = rotating(lambda: (torch.randn(B, V, device=DEV), rand_bitmask(B)), B * V * 4, l2)
    floor = bitmask_floor(nxt()[1])
    for block, warps in ((512, 8), (512, 16), (1024, 8), (1024, 16), (1024, 32), (2048, 16), (2048, 32),
                         (4096, 32)):
        t = time_ms(lambda: bm_mod.apply_token_bitmask_triton(*nxt(), block=block, num_warps=warps))
        row("  sweep bitmask", f"B={B} block={block} warps={warps}", t, None, floor, bw)
    B = S(64, 3)
    p = sampling.row_params(B, DEV, 1.0, 0, 1.0, seed=torch.arange(B, device=DEV), position=0)
    nxt = rotating(lambda: torch.randn(B, V, device=DEV), B * V * 4, l2)
    for block, chunk, warps in ((1024, 4096, 4), (1024, 4096, 8), (512, 2048, 4), (2048, 4096, 8), (1024, 8192, 8),
                                (2048, 8192, 8), (2048, 2048, 8)):
        t = time_ms(lambda: sampling.sample_triton(nxt(), p, block=block, chunk=chunk, num_warps=warps,
                                                   filters=False))
        row("  sweep sample", f"B={B} block={block} chunk={chunk} w={warps}", t, None, B * V * 4, bw)
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
    T, H, F, E, K = S(64, 5), S(2048, 64), S(1024, 32), S(64, 4), S(6, 2)

    def make_moe():
        return (torch.randn(T, H, device=DEV, dtype=torch.bfloat16), torch.rand(T, E, device=DEV).topk(K, 1).indices,
                torch.rand(T, K, device=DEV), torch.randn(E, F, H, device=DEV, dtype=torch.bfloat16) * 0.05,
                torch.randn(E, F, H, device=DEV, dtype=torch.bfloat16) * 0.05,
                torch.randn(E, H, F, device=DEV, dtype=torch.bfloat16) * 0.05)
    nxt = rotating(make_moe, 3 * E * F * H * 2, l2)
    for bn, bk, warps, stages in ((64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4),
                                  (32, 128, 4, 3), (32, 256, 4, 3)):
        t = time_ms(lambda: moe.moe_experts_triton(*nxt(), block_n=bn, block_k=bk, num_warps=warps,
                                                   num_stages=stages))
        row("  sweep moe", f"T={T} bn={bn} bk={bk} w={warps} st={stages}", t, None, 3 * E * F * H * 2, bw)
    M, H = 4, S(5120, 64)
    for T in S((64, 256), (5,)):
        nz = (2 + M) * M

        def make_hc():
            return (torch.randn(T, M, H, device=DEV, dtype=torch.bfloat16),
                    torch.randn(nz, M * H, device=DEV) / math.sqrt(M * H), torch.randn(nz, device=DEV),
                    torch.rand(3, device=DEV) + 0.5)
        nxt = rotating(make_hc, T * M * H * 2, l2)
        for bt, split in ((16, 512), (16, 1024), (32, 512), (64, 2048), (16, 2048)):
            t = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), block_t=bt, split=split, only_partial=True))
            t2 = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), block_t=bt, split=split))
            row("  sweep hc partial", f"T={T} bt={bt} split={split}", t, None, T * M * H * 2 + nz * M * H * 4, bw,
                f"with mix kernel: {t2 * 1e3:.1f} us")


def compile_check():
    """Build the hot kernels for sm_90 on this machine (no GPU needed: Triton's front end and its bundled ptxas)
    and print registers and stack (spill) bytes per thread from the ptxas resource report."""
    import inspect
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    ptr_types = dict(greedy_ptr="*i8", top_k_ptr="*i64", bitmask_ptr="*i32", mask_rows_ptr="*i64", cbin_ptr="*i32",
                     hist_ptr="*i32", low_ptr="*i32", ncand_ptr="*i32", offset_ptr="*i32", keys_ptr="*i64",
                     packed_ptr="*i64", drafts_ptr="*i64", cu_ptr="*i64", seed_ptr="*i64", pos_ptr="*i64",
                     amax_c_ptr="*i64", amax_ptr="*i64", n_acc_ptr="*i64", rows_f_ptr="*i64", draft_f_ptr="*i64",
                     residual_ptr="*i8", keys_f_ptr="*i64", tokens_ptr="*i64", rows_ptr="*i64", res_ptr="*i64",
                     q_ptr="*i64", C_VERIFY="i64", C_RESIDUAL="i64", C_FRESH="i64", scale="fp32", limit="fp32",
                     x_ptr="*bf16", w1_ptr="*bf16", w3_ptr="*bf16", w2_ptr="*bf16", h_ptr="*bf16",
                     slot_pair_ptr="*i64", block_expert_ptr="*i64", win_kv_ptr="*bf16", cmp_kv_ptr="*bf16",
                     win_idx_ptr="*i32", cmp_idx_ptr="*i32", r_ptr="*bf16")
    from deepinfer_sg.kernels import rng  # noqa: F401
    cases = [
        ("threshold hist", threshold._hist_kernel, {}, dict(HAS_MASK=True, CHUNK=4096, NB=512, INV_W=32.0,
                                                            BIN_LIMIT=1 << 24), 8),
        ("threshold select", threshold._select_kernel, {}, dict(NCP=32, NB=512, INV_W=32.0, BIN_LIMIT=1 << 24,
                                                                CMAX=4096), 8),
        ("threshold gather", threshold._gather_kernel, {}, dict(HAS_MASK=True, CHUNK=4096, INV_W=32.0,
                                                                BIN_LIMIT=1 << 24, CMAX=4096), 8),
        ("threshold tau", threshold._tau_kernel, {}, dict(HAS_MASK=True, BLOCK=1024, CMAX=4096, SMALL=256), 8),
        ("sample gumbel pass", sampling._gumbel_split_kernel, {}, dict(HAS_MASK=True, HAS_TAU=True, BLOCK=1024,
                                                                       CHUNK=4096, FAST_LOG=True), 4),
        ("spec accept", speculative._accept_kernel, {}, dict(HAS_MASK=True, HAS_PROBS=True, NCP=32), 1),
        ("spec final pass", speculative._final_split_kernel, {}, dict(HAS_MASK=True, HAS_PROBS=True, BLOCK=1024,
                                                                      CHUNK=4096, FAST_LOG=True), 4),
        ("attention split", decode_attention._sparse_attention_kernel, dict(q_ptr="*bf16", out_ptr="*bf16"),
         dict(D=512, BLOCK_H=16, BLOCK_K=64, HAS_CMP=True, IEEE=False, SPLIT=True), 8),
        ("moe gate/up", moe._gate_up_kernel, {}, dict(BM=16, BN=64, BK=64, F32=False), 8),
        ("moe down", moe._down_kernel, dict(y_ptr="*fp32"), dict(BM=16, BN=64, BK=64, F32=False), 8),
        ("hc partial bf16x3", hc_mix._hc_partial_kernel, dict(fn_ptr="*bf16"),
         dict(BT=16, NZP=32, BK=64, SPLIT=2048, PRECISION="ieee", SPLIT_FN=True, UPCAST=False), 4),
    ]
    for name, fn, extra, consts, warps in cases:
        types = dict(ptr_types, **extra)
        params = list(inspect.signature(fn.fn).parameters)
        sig = {p: "constexpr" if p in consts else types.get(p, "*fp32" if p.endswith("_ptr") else "i32")
               for p in params}
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps})
        except Exception as e:                               # noqa: BLE001
            emit(f"{name:22s} FAILED to build: {type(e).__name__}: {str(e)[:300]}")
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            rep = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        usage = next((line.strip().split(" SHARED")[0] for line in rep.splitlines() if "REG:" in line), rep[:100])
        emit(f"{name:22s} sm_90 {warps} warps: {usage}, shared {k.metadata.shared} B")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--only", default=None, help="comma-separated subset: bitmask,sampling,spec,attn,indexer,moe,hc")
    ap.add_argument("--dry", action="store_true", help="CPU smoke run of the script itself (tiny shapes)")
    ap.add_argument("--sweep", action="store_true", help="also time launch-parameter variants")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds after which remaining steps are skipped")
    ap.add_argument("--compile-check", action="store_true",
                    help="only build the hot kernels for sm_90 here (no GPU needed) and print registers / spills")
    args = ap.parse_args()
    if args.compile_check:
        compile_check()
        return
    global DEV, DRY, V, W
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV, DRY, V = "cpu", True, 1000
        W = (V + 31) // 32
        props = type("P", (), dict(name="cpu (dry run)", multi_processor_count=0))()
        l2, bw, tflops = 1 << 20, 1.0, 1.0
    else:
        assert torch.cuda.is_available(), "benchmarks/kernels.py needs a CUDA GPU (or --dry)"
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 50 * 2**20)
        bw, tflops = ceilings()
    emit(f"# {props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB; torch {torch.__version__}, "
        f"triton {triton.__version__}")
    emit(f"# measured copy bandwidth {bw:.0f} GB/s (read+write), bf16 matmul {tflops:.0f} TFLOP/s")
    emit(f"{'kernel':22s} {'shape':34s} {'triton us':>9s} {'twin us':>9s} {'speedup':>8s} {'MB floor':>9s} "
        f"{'GB/s':>8s} {'roof':>6s}  note")
    only = set(args.only.split(",")) if args.only else None
    want = lambda k: only is None or k in only          # noqa: E731
    quick = args.quick or DRY
    steps = [("bitmask", lambda: bench_bitmask(bw, l2, S([64, 256, 512], [3]))),
             ("sampling", lambda: bench_sampling(bw, l2, S([64] if quick else [64, 256], [3]))),
             ("spec", lambda: bench_speculative(bw, l2)),
             ("attn", lambda: bench_attention(bw, l2, S([64] if quick else [64, 256], [2]))),
             ("indexer", lambda: bench_indexer(bw, l2)),
             ("moe", lambda: bench_moe(bw, l2, S([64] if quick else [64, 256], [5]))),
             ("hc", lambda: bench_hc(bw, l2, S([64, 256] if quick else [64, 256, 4096], [5])))]
    if args.sweep:
        steps.insert(0, ("sweep", lambda: sweep(bw, l2)))
        only = None if only is None else only | {"sweep"}
    for name, fn in steps:
        if want(name) and time.time() - START > args.budget:
            emit(f"{name}: SKIPPED (past the --budget of {args.budget:.0f} s)")
        elif want(name):
            t0 = time.time()
            try:
                fn()
            except Exception as e:                           # noqa: BLE001 - one broken kernel must not hide the rest
                emit(f"{name}: FAILED {type(e).__name__}: {e}")
            print(f"# {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            if not DRY:
                torch.cuda.empty_cache()
    emit(f"# wall time {time.time() - START:.0f} s")
    dest = os.environ.get("OUT")
    if dest and not DRY:
        os.makedirs(dest, exist_ok=True)
        with open(os.path.join(dest, "kernels.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")
        args.out = args.out or os.path.join(dest, "kernels.json")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=props.name, copy_gbs=bw, bf16_tflops=tflops, rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
