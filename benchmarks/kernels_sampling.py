"""Sampling-family kernel benchmarks: fused masked sampling (plain, temperature + mask, top-k/top-p) and the
speculative acceptance step. Imported by benchmarks/kernels.py after kbench.configure().

Floors printed in the same run (`floor` rows): the graph-replay time of one and of two empty launches (the
shortest a one- or two-launch kernel can take), and a plain read pass over the same logits with the sampling
grid (one program per (row, 4096-token segment), a max per segment): the bandwidth a single read of the logits
reaches at that shape. A sampling row's fraction of that read pass is its fraction of the achievable.

H200 numbers (torch 2.11 / Triton 3.6; copy 4,275 GB/s; us, fraction of copy bandwidth):
  floors                        empty launch 0.7, two launches 1.3; one read pass (max per 4096-token
                                program) B=64 9.2 (84%), B=256 31.1 (100%)
  before (session 1)            sample T=1 B=64 19 (41-45%), B=256 59 (53-59%); top-k50 p0.9 B=64 117.7;
                                speculative accept 64 x 4 rows + probs 124 (31%)
  round 1 (segment draw + lane scan + re-read, replaced): T=1 B=64 18.3 at 4 warps (42%), 12.6 at 2 warps
                                (61%), 35.8 at 8 warps: latency-bound (~9 block reductions and a dependent
                                re-read per program); greedy 13.5 (58%); top-k50 p0.9 115.9; spec 106.5
  round 2 (per-lane draw, one block reduction per program; 2026-11-29):
    sample T=1                  B=64: 13.7 at 2 warps (57%; 68% of the read-pass floor), 21.3 at 4 (36%), 45.1 at
                                8; seg 8192 / 512 lanes at 4 warps 13.9 (56%); B=256 at 4 warps 68.6 (45%)
    sample T=0.7 +mask (4 w)    B=64 24.3 (33%), B=256 78.4 (41%);  greedy (4 w) B=64 15.0 (52%)
    top-k50 p0.9 B=64           112.5 = threshold 91.7 (hist 57.2, select 5.4, gather 16.8, tau 12.3) + pass
    speculative accept (4 w)    119.2 (28% of logits once + p of rejecting rows; 32% of the old floor);
                                with top-k50 p0.9 415 (thresholds on 256 rows)
    Why warps matter: with 16-byte loads a warp covers 128 lanes; 2 warps hold a segment's 256 lanes, so each
    lane's 16 tokens stay in one thread; at 4+ warps the lanes' tokens are split across warps and every per-lane
    sum crosses warps (shared memory + barriers). Defaults are now 2 warps (round 3 confirms).
"""
import torch
import triton
import triton.language as tl

from deepinfer_sg.kernels import sampling, speculative, threshold
from kbench import DEV, V, W, emit, rand_bitmask, rotating, row, S, time_ms


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
        # floor: every logits row once + the draft probabilities of the rows that need a residual (one per
        # rejecting request; the benchmark's drafts reject often) -- the ratio test reads p only at the draft
        resid = float((a.num_accepted < L - 1).float().mean())
        nbytes = R * V * 4 + int(resid * B) * V * 4
        old_floor = (R * V * 4 + B * V * 4) / (t * 1e-3) / 1e9 / bw        # the previous table's floor
        row("speculative accept", f"B={B} rows={R} V={V} {label}", t, tt, nbytes, bw,
            f"mean accepted {acc:.2f}; residual rows {resid:.0%}; equal to twin {agree:.1%}; "
            f"{old_floor:.0%} of the old floor (p of every final row)")


# ---------------------------------------------------------------------------------------------- floors
@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _read_max_kernel(x_ptr, out_ptr, V, n_seg, SEG: tl.constexpr):
    """Program (row, segment): max of the segment (the least work a pass over the logits can do)."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    cols = seg * SEG + tl.arange(0, SEG)
    x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
    tl.store(out_ptr + row * n_seg + seg, tl.max(x, 0))


def floors(bw, l2, batches):
    dummy = torch.empty(16, device=DEV)
    t1 = time_ms(lambda: _empty_kernel[(1,)](dummy))
    t2 = time_ms(lambda: (_empty_kernel[(1,)](dummy), _empty_kernel[(1,)](dummy)))
    emit(f"floor: empty launch (graph replay) {t1 * 1e3:.1f} us; two launches {t2 * 1e3:.1f} us")
    for B in batches:
        nxt = rotating(lambda: torch.randn(B, V, device=DEV), B * V * 4, l2)
        n_seg = triton.cdiv(V, 4096)
        out = torch.empty(B, n_seg, device=DEV)
        t = time_ms(lambda: _read_max_kernel[(B, n_seg)](nxt(), out, V, n_seg, SEG=4096, num_warps=4))
        row("  floor read pass", f"B={B} seg=4096 w=4", t, None, B * V * 4, bw)


# ---------------------------------------------------------------------------------------------- sweep
def sweep(bw, l2):
    """Launch-parameter and layout variants of the sampling pass (segment, lanes, warps: other segment/lane
    values draw other tokens, so these rows time the layouts only), the one-launch variant, masks, the floors and
    the threshold stages. Round 1 (2026-11-29, segment draw with a lane scan + re-read, since replaced) and the
    previous per-token Gumbel pass measured 18.3 / ~19 us at B=64."""
    batches = S([64, 256], [3])
    floors(bw, l2, batches)
    for B in batches:
        p = sampling.row_params(B, DEV, 1.0, 0, 1.0, seed=torch.arange(B, device=DEV), position=0)
        nxt = rotating(lambda: torch.randn(B, V, device=DEV), B * V * 4, l2)
        layouts = ((4096, 256, 4), (4096, 256, 8), (4096, 256, 2), (8192, 512, 4))
        for seg, lanes, warps in layouts if B == batches[0] else layouts[:2]:
            t = time_ms(lambda: sampling.sample_triton(nxt(), p, seg=seg, lanes=lanes, num_warps=warps,
                                                       filters=False))
            row("  sweep sample", f"B={B} seg={seg} lanes={lanes} w={warps}", t, None, B * V * 4, bw)
        if B == batches[0]:
            t = time_ms(lambda: sampling.sample_triton(nxt(), p, filters=False, one_launch=True))
            row("  sweep sample 1-launch", f"B={B} seg=4096 lanes=256 w=4", t, None, B * V * 4, bw)
        pm = sampling.row_params(B, DEV, 0.7, 0, 1.0, seed=torch.arange(B, device=DEV), position=0)
        nxm = rotating(lambda: (torch.randn(B, V, device=DEV), rand_bitmask(B)), B * V * 4, l2)
        t = time_ms(lambda: sampling.sample_triton(*(lambda s: (s[0], pm, s[1]))(nxm()), filters=False))
        row("  sweep sample +mask", f"B={B} seg=4096 lanes=256 w=4", t, None, B * V * 4 + B * W * 4, bw)
    sweep_threshold(bw, l2)


def sweep_threshold(bw, l2):
    """The top-k/top-p threshold kernels alone (hist + select + gather + tau), to split a filtered row's time."""
    B = S(64, 3)
    p = sampling.row_params(B, DEV, 1.0, 50, 0.9, seed=torch.arange(B, device=DEV), position=0)
    nxt = rotating(lambda: torch.randn(B, V, device=DEV) * 3, B * V * 4, l2)
    prev = 0.0
    for stages, label in ((1, "hist"), (2, "+select"), (3, "+gather"), (4, "+tau")):
        t = time_ms(lambda: threshold.thresholds_and_paths(nxt(), p, None, None, stages=stages))
        row("  sweep threshold", f"B={B} top-k50 p0.9 {label}", t, None, B * V * 4, bw,
            f"stage {(t - prev) * 1e3:.1f} us")
        prev = t
    t = time_ms(lambda: threshold.thresholds_and_paths(nxt(), p, None, None, tau_warps=2))
    row("  sweep threshold", f"B={B} top-k50 p0.9 tau warps=2", t, None, B * V * 4, bw)


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps) for kernels.py --compile-check."""
    seg_types = {"greedy_ptr": "*i1", "out_ptr": "*i64", "count_ptr": "*i32"}
    return [
        ("sample segment w8", sampling._segment_kernel, seg_types, dict(HAS_MASK=False, HAS_TAU=False, LANES=256,
                                                                        LW=16, ONE_LAUNCH=False, NCP=32, FAST=True), 8),
        ("threshold hist", threshold._hist_kernel, {}, dict(HAS_MASK=True, CHUNK=4096, NB=512, INV_W=32.0,
                                                            BIN_LIMIT=1 << 24), 8),
        ("threshold select", threshold._select_kernel, {}, dict(NCP=32, NB=512, INV_W=32.0, BIN_LIMIT=1 << 24,
                                                                CMAX=4096), 8),
        ("threshold gather", threshold._gather_kernel, {}, dict(HAS_MASK=True, LANES=512, LW=8, INV_W=32.0,
                                                                BIN_LIMIT=1 << 24, CMAX=4096), 4),
        ("threshold tau", threshold._tau_kernel, {}, dict(HAS_MASK=True, BLOCK=1024, CMAX=4096, SMALL=256), 8),
        ("sample segment pass", sampling._segment_kernel, seg_types, dict(HAS_MASK=False, HAS_TAU=False, LANES=256,
                                                                          LW=16, ONE_LAUNCH=False, NCP=32, FAST=True), 4),
        ("sample segment +mask", sampling._segment_kernel, seg_types, dict(HAS_MASK=True, HAS_TAU=True, LANES=256,
                                                                           LW=16, ONE_LAUNCH=True, NCP=32, FAST=True), 4),
        ("spec stats pass", speculative._stats_kernel, {"last_ptr": "*i8", "pack_ptr": "*i64"}, dict(HAS_MASK=True, LANES=256, LW=16,
                                                                                          FAST=True),
         4),
        ("spec accept", speculative._accept_kernel, {"final_ptr": "*i64", "pack_ptr": "*i64"}, dict(HAS_MASK=True, HAS_PROBS=True,
                                                                                NCP=32), 1),
        ("spec residual pass", speculative._residual_kernel, {}, dict(HAS_MASK=True, HAS_PROBS=True, LANES=256,
                                                                      LW=16, FAST=True), 4),
    ]
