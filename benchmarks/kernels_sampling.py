"""Sampling-family kernel benchmarks: fused masked sampling (plain, temperature + mask, top-k/top-p) and the
speculative acceptance step. Imported by benchmarks/kernels.py after kbench.configure()."""
import torch

from deepinfer_sg.kernels import sampling, speculative, threshold
from kbench import DEV, V, W, rand_bitmask, rotating, row, S, time_ms


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


def sweep(bw, l2):
    """Launch-parameter variants of the sampling pass."""
    B = S(64, 3)
    p = sampling.row_params(B, DEV, 1.0, 0, 1.0, seed=torch.arange(B, device=DEV), position=0)
    nxt = rotating(lambda: torch.randn(B, V, device=DEV), B * V * 4, l2)
    for block, chunk, warps in ((1024, 4096, 4), (1024, 4096, 8), (512, 2048, 4), (2048, 4096, 8), (1024, 8192, 8),
                                (2048, 8192, 8), (2048, 2048, 8)):
        t = time_ms(lambda: sampling.sample_triton(nxt(), p, block=block, chunk=chunk, num_warps=warps,
                                                   filters=False))
        row("  sweep sample", f"B={B} block={block} chunk={chunk} w={warps}", t, None, B * V * 4, bw)


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps) for kernels.py --compile-check."""
    return [
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
    ]
