"""Sampling-family kernel benchmarks: fused masked sampling (plain, temperature + mask, top-k/top-p) and the
speculative acceptance step. Imported by benchmarks/kernels.py after kbench.configure().

Floors printed in the same run (`floor` rows): the graph-replay time of one and of two empty launches (the
shortest a one- or two-launch kernel can take), and a plain read pass over the same logits with the sampling
grid (one program per (row, 4096-token segment), a max per segment): the bandwidth a single read of the logits
reaches at that shape. A sampling row's fraction of that read pass is its fraction of the achievable.

H200 numbers (torch 2.11 / Triton 3.6; copy 4,250 GB/s; us, fraction of copy bandwidth):
  floors                        empty launch 0.7, two launches 1.3; one read pass (max per 4096-token
                                program) B=64 9.1 (86%), B=256 30.5 (102%)
  session 2 final (R3)          T=1 13.7 / 37.7 (57% / 83%); T=0.7 +mask 18.8 / 52.6; greedy 11.6 / 33.5;
                                top-k50 p0.9 105 / 336; speculative accept 64 x 4 rows + probs 95
  session 3 round 1 (2026-11-29; lane draw trimmed to ~3 instructions per token, ex2.approx.ftz; top-k rows
  with 0 < k <= 64 on the new candidate path, before its stores went through inline PTX):
    sample T=1 / greedy / T=0.7 +mask   B=64 12.1 / 11.4 / 16.6 (64% / 68% / 49%); B=256 34.5 / 33.5 / 45.4
                                (90% / 93% / 71%); persistent P=1..4 programs per SM never faster (B=64 T=1
                                21.8 / 14.0 / 13.8 / 12.5), one launch 13.3, 4 warps 18.8
    top-k50 p0.9                B=64 67.6, B=256 184.8 (cand pass 31.6 / 108.5 of it: a [256, 16] layout
                                conversion for the data-dependent candidate stores; merge 12.4 / 16.9;
                                histogram kernels that only skip rows 12.2 / 23.8)
    speculative accept          100.1 = expand 3.0 + thresholds that exit at once 29.6 + stats 39.9 + accept
                                6.8 + residual 8.9 + finish 1.9 (the callers' host-known flags now skip the
                                threshold launches)
  round 2 (candidate stores through inline PTX, value bisection in the merge, vectorised ratio test):
    sample T=1 / greedy / T=0.7 +mask   B=64 12.5 / 11.7 / 16.8, B=256 35.5 / 34.4 / 44.9 with the in-lane pick
                                moved to the finish (late=True): no gain over the pick in the pass (12.2 / 35.1;
                                mask 16.6 / 45.6), so the pass keeps it; ~2.5 us over the read-pass floor at B=64
                                is latency (the last segments' loads land at the end of the read), not issue
    top-k50 p0.9                B=64 48.1 (cand pass 25.1 + merge 12.3 + pass with tau + finish), B=256 138.3;
                                the draw inside the merge (draw=True) 49.0 / 138.6: not kept
    top-p0.95 (peaked rows)     B=64 69.0, B=256 191.2 (was 111 / 344: top-p alone now tries the 64 largest)
    speculative accept          56.8 = expand 3.0 + thresholds 1.0 (host-known: none) + stats 37.9 + accept 4.8
                                + residual 8.4 + finish 1.7 (55% of the floor)
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
            hist = flt and not 0 < kw["top_k"] <= threshold.KMAX  # likewise: does a row need the histogram path
            a = sampling.sample_triton(x, p, m, filters=flt, histogram=hist)
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
            t = time_ms(lambda: sampling.sample_triton(*(lambda s: (s[0], p, s[1]))(nxt()), filters=flt,
                                                       histogram=hist))
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
        # what the caller knows on the host (the engine does): whether any request filters, and how
        flags = dict(filters=top_k > 0 or top_p < 1, histogram=top_p < 1 and not 0 < top_k <= threshold.KMAX)
        kw = dict(temperature=torch.ones(B, device=DEV), top_k=torch.full((B,), top_k, dtype=torch.int64, device=DEV),
                  top_p=torch.full((B,), top_p, device=DEV), seed=torch.arange(B, device=DEV),
                  position=torch.arange(B, device=DEV))
        a = speculative.speculative_accept(x, cu, d, pr, backend="triton", **kw, **flags)
        b = speculative.speculative_accept(x, cu, d, pr, backend="torch", **kw)
        agree = float((a.tokens == b.tokens).float().mean())
        acc = float(a.num_accepted.float().mean())

        def run(backend):
            s = nxt()
            return speculative.speculative_accept(s[0], cu, s[2], s[1], backend=backend, **kw,
                                                  **(flags if backend == "triton" else {}))
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
    """Variants of the sampling pass (one program per (row, segment) vs the persistent pass with P programs per
    SM that prefetches its next item; warps; one launch), for plain, greedy and masked rows, each checked against
    the twin once; the floors; the speculative step's stages. Other segment/lane values draw other tokens, so
    those rows time the layouts only."""
    batches = S([64, 256], [3])
    floors(bw, l2, batches)
    cases = (("T=1", 1.0, False), ("greedy", 0.0, False), ("T=0.7 +mask", 0.7, True))
    for B in batches:
        for label, temp, masked in cases:
            p = sampling.row_params(B, DEV, temp, 0, 1.0, seed=torch.arange(B, device=DEV), position=0)
            nxt = rotating(lambda: (torch.randn(B, V, device=DEV) * 3, rand_bitmask(B) if masked else None),
                           B * V * 4, l2)
            nbytes = B * V * 4 + (B * W * 4 if masked else 0)
            x, m = nxt()
            want = sampling.sample_torch(x, p, m)
            # round 1 (2026-11-29, this pass): persistent P=1/2/3/4 programs per SM never beat one program per
            # item (B=64 T=1: 21.8/14.0/13.8/12.5 vs 12.1 us; B=256: 35.4 vs 34.5); one launch 13.3; 4 warps 18.8
            variants = [("w=2 late pick", dict())]
            if label != "greedy":
                variants += [("w=2 pick in pass", dict(late=False))]
            if label == "T=1" and B == batches[0]:
                variants += [("persist P=4", dict(persistent=4)), ("1-launch w=2", dict(one_launch=True))]
            for vname, kw in variants:
                got = sampling.sample_triton(x, p, m, filters=False, **kw)
                same = float((got == want).float().mean())
                t = time_ms(lambda: sampling.sample_triton(*(lambda s: (s[0], p, s[1]))(nxt()), filters=False, **kw))
                row(f"  sweep {label}", f"B={B} {vname}", t, None, nbytes, bw, f"equal to twin {same:.1%}")
    sweep_threshold(bw, l2)
    sweep_speculative(bw, l2)


def sweep_speculative(bw, l2):
    """The speculative step's launches timed cumulatively (stages), to split its time."""
    B, L = S(64, 3), 4
    R = B * L
    cu = torch.arange(B + 1, device=DEV) * L

    def make():
        logits = torch.randn(R, V, device=DEV) * 2
        probs = torch.softmax(logits + 0.3 * torch.randn_like(logits), 1)
        return logits, probs, torch.multinomial(probs, 1)[:, 0]
    nxt = rotating(make, 2 * R * V * 4, l2)
    req = sampling.row_params(B, DEV, torch.ones(B, device=DEV), torch.zeros(B, dtype=torch.int64, device=DEV),
                              torch.ones(B, device=DEV), torch.arange(B, device=DEV), torch.arange(B, device=DEV))
    seed, pos = torch.arange(B, device=DEV), torch.arange(B, device=DEV)
    prev = 0.0
    for stages, label in ((1, "expand"), (5, "+thresholds"), (6, "+stats"), (7, "+accept"), (8, "+residual"),
                          (9, "+finish")):
        def run():
            s = nxt()
            return speculative._accept_triton(s[0], cu, s[2], s[1], req, seed, pos, None, None, stages=stages,
                                              filters=False)
        t = time_ms(run)
        row("  sweep spec", f"B={B}x{L} {label}", t, None, R * V * 4, bw, f"stage {(t - prev) * 1e3:.1f} us")
        prev = t


def sweep_threshold(bw, l2):
    """Top-k sampling by stages: the candidate pass, + its merge (tau), + the merge's draw, the whole sampling call
    with the draw in the merge (default) and with the sampling pass drawing (draw=False), at B=64 and 256
    (top-k50 p0.9 and top-k50 alone, flat rows)."""
    for B in S([64, 256], [3]):
        for k, top_p in ((50, 0.9), (50, 1.0)):
            p = sampling.row_params(B, DEV, 1.0, k, top_p, seed=torch.arange(B, device=DEV), position=0)
            nxt = rotating(lambda: torch.randn(B, V, device=DEV) * 3, B * V * 4, l2)
            x = nxt()
            want = sampling.sample_torch(x, p)
            prev = 0.0
            label = f"top-k{k} p{top_p}"
            if top_p < 1:
                for stages, draw, name in ((1, None, "cand pass"), (2, None, "+merge"), (2, (4096, 256), "+draw")):
                    t = time_ms(lambda: threshold.thresholds_and_paths(nxt(), p, None, None, stages=stages,
                                                                       histogram=False, draw=draw))
                    row("  sweep threshold", f"B={B} {label} {name}", t, None, B * V * 4, bw,
                        f"stage {(t - prev) * 1e3:.1f} us")
                    prev = t
            for draw in (True, False):
                same = float((sampling.sample_triton(x, p, filters=True, histogram=False, draw=draw) == want)
                             .float().mean())
                t = time_ms(lambda: sampling.sample_triton(nxt(), p, filters=True, histogram=False, draw=draw))
                row("  sweep top-k sample", f"B={B} {label} draw={'merge' if draw else 'pass'}", t, None,
                    B * V * 4, bw, f"equal to twin {same:.1%}")


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps) for kernels.py --compile-check."""
    seg_types = {"greedy_ptr": "*i1", "out_ptr": "*i64", "count_ptr": "*i32"}
    return [
        ("sample segment w8", sampling._segment_kernel, seg_types, dict(HAS_MASK=False, HAS_TAU=False, LANES=256,
                                                                        LW=16, ONE_LAUNCH=False, NCP=32, FAST=True), 8),
        ("topk cand pass", threshold._cand_kernel, {"cnt_ptr": "*i32", "cid_ptr": "*i32", "greedy_ptr": "*i8"},
         dict(HAS_MASK=True, LANES=256, LW=16, CAND=128, KMAX=64, STEPS=8, IDS=True, FAST=True), 2),
        ("topk merge + draw", threshold._cand_tau_kernel, {"cnt_ptr": "*i32", "cid_ptr": "*i32", "path_ptr": "*i32",
                                                           "sid_ptr": "*i32", "tok_ptr": "*i32", "greedy_ptr": "*i8"},
         dict(HAS_MASK=True, NCP=32, CAND=128, KMAX=64, KP=128, JB=32, BLOCK=1024, DRAW=True, KD=64, SEG=4096,
              LANES=256, FAST=True), 8),
        ("sample persistent", sampling._segment_loop_kernel, {"greedy_ptr": "*i1"},
         dict(HAS_MASK=True, HAS_TAU=True, LANES=256, LW=16, FAST=True), 2),
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
        ("spec accept", speculative._accept_kernel, {"final_ptr": "*i64", "pack_ptr": "*i64"},
         dict(HAS_MASK=True, HAS_PROBS=True, NCP=32, NR=8), 1),
        ("spec residual pass", speculative._residual_kernel, {}, dict(HAS_MASK=True, HAS_PROBS=True, LANES=256,
                                                                      LW=16, FAST=True), 4),
    ]
