"""Time every kernel on a CUDA GPU against its torch twin and its roofline; print one table.

The bitmask rows live here; the other families in kernels_sampling.py, kernels_attention.py and kernels_moe.py
(shared timing and table code in kbench.py).

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

Last measured (NVIDIA H200, torch 2.11 / Triton 3.6; copy ~4,250 GB/s; bitmask 2026-11-29 session 3; the rows marked
s9 / s10 / s11 in sessions 9-11 (their stop notes on issue 8), the others in session 8 round 3; each family's module
docstring has its own rows and sweeps):
  kernel                 shape                                  triton us          roofline (of copy bandwidth)
  bitmask                B=64 / 256 / 512, V=129280             20.8 / 72 / 140    76% / 87% / 90% (xgrammar 0.2.9's
                                                                                        own kernel: 55% / 66% / 71%)
  bitmask by step        64 requests x 4 rows                   70.9               89%
  sample T=1 (s9)        B=64 / 256                             10.7 / 34.0        72% / 91% (read pass 84 / 100%)
  sample T=0.7 + mask s9 B=64 / 256                             13.2 / 41.1        60% / 78%
  sample greedy (s9)     B=64 / 256                             10.3 / 33.3        75% / 93%
  sample top-k50 p0.9    B=64 / 256 (s10; flat and peaked)      20.8-21.6 / 58-61  36-37% / 51-53%
  sample top-p0.9 flat   B=64 / 256 (s9)                        31.0 / 86.3        by rejection (was 150 / 461)
  sample top-p0.95 peak  B=64 / 256 (s9; B=64 s11)              21.8-21.9 / 63.2   36% / 49% (was 57.0 / 121)
  speculative accept     64 requests x 4 rows + draft probs     48.7-51.9 (s9)     64-65%; with top-k50 p0.9 102 (s10)
  sparse attention (s11) N=64 / 256, H=64 D=512, 128+512 keys   37.8-38.2 / 103.7  31% / 46% of max(bytes, flops)
  indexer score + top-k  N=64 Hi=32 Di=128 L=16384 k=512        92.9 / 89.0 unsort 68% / 71% (s9; scores alone 92-94%)
                         N=64 L=65536 / 131072 (s10, unsorted)  309.4 / 611.7      82% / 83%
  moe experts (fp8 w)    V4.1 shapes T=8 / 64 / 256             447 / 2,131 / 3,429  86% / 94% / 92% of the fp8 bytes
  moe experts (fp4 s11)  V4.1 shapes T=8 / 64 / 256             312 / 1,401-1,414 / 2,290-2,319  64% / 74-75% / 72-73%
                                                                                        of the fp4 bytes (CUDA default)
  hc mixes + sinkhorn    T=64 / 256 / 4096, H=5120              11.0 / 16.4 / 89.7 24-27% / 28% / 43% of a launch
                                                                                        that only streams the bytes
  hc post + next pre     T=64 / 256                             4.0 / 9.2          38% / 67% (83% / 82% of one
                                                                                        launch reading the bytes)
  hc post + next mixes   T=8 / 16, H=5120 (one launch)          9.1 / 9.8          was 11.9 / 12.6 in two launches
  hc moe write-back s10  T=8 / 64: y + y2, write-back, mixes,   9.0 / 15.2         was 12.1 / 18.5 in three launches
                         read-out RMSNorm in one launch                            (add, write-back + mixes, norm)
The whole run takes about 2-3 minutes on an H200 (--budget, default 200 s, skips the steps left after that);
with OUT set it also writes $OUT/kernels.txt (the table) and $OUT/kernels.json.
"""
import argparse
import importlib.util
import json
import os
import sys
import time

START = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kbench  # noqa: E402  (chooses the interpreter for --dry before any kernel is decorated)
import torch  # noqa: E402
import triton  # noqa: E402

from deepinfer_sg.kernels import bitmask as bm_mod  # noqa: E402
from kbench import S, bitmask_floor, emit, rand_bitmask, rotating, row, time_ms  # noqa: E402


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



def bench_bitmask(bw, l2, batches):
    xgr, xgr_version = (None, "skipped (dry run)") if kbench.DRY else load_xgrammar_kernel()
    emit(f"# xgrammar kernel: {xgr_version}")
    for B in batches:
        nxt = rotating(lambda: (torch.randn(B, kbench.V, device=kbench.DEV), rand_bitmask(B)), B * kbench.V * 4, l2)
        a, m = nxt()
        nbytes = bitmask_floor(m)
        ref = a.clone()
        bm_mod.apply_token_bitmask_torch(ref, m)
        out = a.clone()
        bm_mod.apply_token_bitmask_triton(out, m)
        assert torch.equal(out, ref), "bitmask kernel disagrees with its twin"
        t = time_ms(lambda: bm_mod.apply_token_bitmask_triton(*nxt()))
        tt = time_ms(lambda: bm_mod.apply_token_bitmask_torch(*nxt()))
        row("bitmask", f"B={B} V={kbench.V}", t, tt, nbytes, bw)
        if xgr is not None:
            out = a.clone()
            xgr(out, m)
            assert torch.equal(out, ref), "xgrammar disagrees with our twin"
            tx = time_ms(lambda: xgr(*nxt()))
            row("  xgrammar bitmask", f"B={B} V={kbench.V}", tx, None, nbytes, bw, f"ours/xgr = {t / tx:.2f}")
    # speculative rows: 64 requests x 4 rows, masks by step
    B, L = S(64, 3), 4
    R = B * L
    cu = torch.arange(B + 1, device=kbench.DEV) * L
    mrows = bm_mod.by_step_mask_rows(cu, cu, R)
    rows_all = torch.arange(R, device=kbench.DEV)
    nxt = rotating(lambda: (torch.randn(R, kbench.V, device=kbench.DEV), rand_bitmask(R)), R * kbench.V * 4, l2)
    t = time_ms(lambda: bm_mod.apply_token_bitmask_triton(*nxt(), rows_all, mrows))
    row("bitmask by step", f"B={B}x{L} rows V={kbench.V}", t, None, bitmask_floor(nxt()[1]), bw)


def sweep_bitmask(bw, l2):
    """Launch-parameter variants of the bitmask kernel (adaptive=0: masked stores of the banned tokens only), and
    three mask shapes: random half-density tokens, and runs of 4096 tokens mostly banned / mostly allowed."""
    masks = {"random": lambda B: rand_bitmask(B),
             "mostly banned": lambda B: rand_bitmask(B, density=0.05, span=4096),
             "mostly allowed": lambda B: rand_bitmask(B, density=0.95, span=4096)}
    for B in (S(64, 3), S(512, 3)):
        for name, make in masks.items():
            nxt = rotating(lambda: (torch.randn(B, kbench.V, device=kbench.DEV), make(B)), B * kbench.V * 4, l2)
            floor = bitmask_floor(nxt()[1])
            for block, warps in ((512, 8), (1024, 4), (1024, 8), (2048, 8)):
                for adaptive in (False, True):
                    t = time_ms(lambda: bm_mod.apply_token_bitmask_triton(*nxt(), block=block, num_warps=warps,
                                                                          adaptive=adaptive))
                    row("  sweep bitmask", f"B={B} {name} block={block} w={warps} adaptive={int(adaptive)}", t,
                        None, floor, bw)


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
    cases = [case for family in families() for case in family.compile_cases()]
    for name, fn, extra, consts, warps, *more in cases:
        # an optional sixth item: build options as the launch sets them (num_stages, ...) and `hinted`, the integer
        # arguments the real launches specialise as divisible by 16 (Triton does for every int argument that is)
        opts = dict(more[0]) if more else {}
        hinted = set(opts.pop("hinted", ()))
        types = dict(ptr_types, **extra)
        params = list(inspect.signature(fn.fn).parameters)
        # constexprs the case leaves at their defaults (e.g. PDL) are built as the launches build them, not typed as
        # run-time values
        consts = {**{p: v.default for p, v in inspect.signature(fn.fn).parameters.items()
                     if "constexpr" in str(v.annotation) and v.default is not inspect.Parameter.empty}, **consts}
        sig = {p: "constexpr" if p in consts else types.get(p, "*fp32" if p.endswith("_ptr") else "i32")
               for p in params}
        # real launches specialise pointers that are 16-byte aligned (every torch allocation is) and the integer
        # arguments divisible by 16; without the same hints the build vectorises less and reports spills that never
        # happen (integers only where the case names them in `hinted`: e.g. the hc mixes at K = 20480 still build
        # unhinted)
        aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
                   if sig[p].startswith("*") or p in hinted}
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps, **opts})
        except Exception as e:                               # noqa: BLE001
            emit(f"{name:22s} FAILED to build: {type(e).__name__}: {str(e)[:300]}")
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            rep = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        usage = next((line.strip().split(" SHARED")[0] for line in rep.splitlines() if "REG:" in line), rep[:100])
        emit(f"{name:22s} sm_90 {warps} warps: {usage}, shared {k.metadata.shared} B")


def families():
    """The per-family benchmark modules (imported only after kbench.configure: they take the shapes' globals)."""
    import kernels_attention
    import kernels_moe
    import kernels_sampling
    return kernels_sampling, kernels_attention, kernels_moe


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
    kbench.configure(args.dry)
    if args.compile_check:
        compile_check()
        return
    if args.dry:
        props = type("P", (), dict(name="cpu (dry run)", multi_processor_count=0))()
        l2, bw, tflops = 1 << 20, 1.0, 1.0
    else:
        assert torch.cuda.is_available(), "benchmarks/kernels.py needs a CUDA GPU (or --dry)"
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 50 * 2**20)
        bw, tflops = kbench.ceilings()
    samp, attn, moe_hc = families()
    emit(f"# {props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB; torch {torch.__version__}, "
         f"triton {triton.__version__}")
    emit(f"# measured copy bandwidth {bw:.0f} GB/s (read+write), bf16 matmul {tflops:.0f} TFLOP/s")
    emit(f"{'kernel':22s} {'shape':34s} {'triton us':>9s} {'twin us':>9s} {'speedup':>8s} {'MB floor':>9s} "
         f"{'GB/s':>8s} {'roof':>6s}  note")
    only = set(args.only.split(",")) if args.only else None
    want = lambda k: only is None or k in only          # noqa: E731
    quick = args.quick or args.dry
    steps = [("bitmask", lambda: bench_bitmask(bw, l2, S([64, 256, 512], [3]))),
             ("sampling", lambda: samp.bench_sampling(bw, l2, S([64] if quick else [64, 256], [3]))),
             ("spec", lambda: samp.bench_speculative(bw, l2)),
             ("attn", lambda: attn.bench_attention(bw, l2, S([64] if quick else [64, 256], [2]))),
             ("indexer", lambda: attn.bench_indexer(bw, l2)),
             ("moe", lambda: moe_hc.bench_moe(bw, l2, S([64] if quick else [64, 256], [5]))),
             ("hc", lambda: moe_hc.bench_hc(bw, l2, S([64, 256] if quick else [64, 256, 4096], [5])))]
    if args.sweep:       # each family's launch-parameter variants; with --only, just the families named there
        sweeps = [({"bitmask"}, lambda: sweep_bitmask(bw, l2)), ({"sampling", "spec"}, lambda: samp.sweep(bw, l2)),
                  ({"attn", "indexer"}, lambda: attn.sweep(bw, l2)), ({"moe", "hc"}, lambda: moe_hc.sweep(bw, l2))]
        steps = [("sweep", fn) for names, fn in sweeps if only is None or names & only] + steps
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
            if not args.dry:
                torch.cuda.empty_cache()
    emit(f"# wall time {time.time() - START:.0f} s")
    dest = os.environ.get("OUT")
    if dest and not args.dry:
        os.makedirs(dest, exist_ok=True)
        with open(os.path.join(dest, "kernels.txt"), "w") as f:
            f.write("\n".join(kbench.LINES) + "\n")
        args.out = args.out or os.path.join(dest, "kernels.json")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=props.name, copy_gbs=bw, bf16_tflops=tflops, rows=kbench.ROWS), f, indent=1)


if __name__ == "__main__":
    main()
