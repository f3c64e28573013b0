"""How grammar masks reach a masked drafter (issue 7): the options measured side by side, in one run.

Per engine step, B requests each draft n positions with DSpark's sequential Markov loop: position k's logits
are masked by the grammar state after the k drafts before it, then sampled. Only the mask delivery differs:

(a)  CPU masks, one host round trip per draft position (what is built, engine/grammar_drafting.py):
     per position, each request's CPU matcher fills its bitmask row, the rows go host -> device, the device
     masks + samples, the sampled tokens come back (the sync) and each matcher accepts its token.
     "a/built" = MaskedDraftSampler.step itself (its softmax / inverse-CDF sampling included);
     "a/loop" = the same delivery around the bare masked argmax the other options use;
     "a/batched" = the same with one llguidance thread-pool call per position for all rows (grammars.fill_masks).
(b)  GPU-resident token automaton (engine/token_automaton.py): regular constraints only (the regex; the JSON
     Schema through outlines-core's build_regex_from_schema): per-state bitmask rows + a sorted transition table
     on the device; the loop gathers mask rows and advances states there, no host sync until the block is done
     (one copy of the block's tokens, which scheduling needs anyway). Build time and device bytes reported.
     "b/built" = engine/automaton_drafting.AutomatonDraftSampler as wired (SpecConfig(draft_masks="automaton"):
     a/built's math, plus the verifier matchers' check_draft of the block); "b/automaton" = the bare loop.
(c)  Backend draft-chain traversal: masks for a KNOWN draft chain in one call (llguidance's batched draft API via
     grammars.fill_masks(matchers, drafts); xgrammar's GrammarMatcher.traverse_draft_tree, one call per
     request). Position k+1's mask needs the token sampled at k, so these cannot feed sequential masked
     drafting: they serve verification masks and "draft unmasked, then cut at the first violation"
     (mechanism 3), whose accepted length is plain DSpark's + cut (benchmarks/grammar_speculation.py table,
     "+ cut" row vs "+ masked drafting" row). Measured as that use: one call per step, n+1 rows per request.

Workload: the real DeepSeek-V4 tokenizer (129,280 logits); JSON-Schema extraction (grammar_speculation's
bounded invoice schema: maxLength 12 strings, bounded numbers and arrays; compact whitespace), the same schema
without bounds ("JSON unbounded": llguidance's cheap case), a regex (a yes/no answer with a confidence and a reason), the DSML
tool-call grammar (llguidance only: Lark, recursive JSON arguments, raw free text: no automaton, no xgrammar).
The drafter's logits are fixed noise plus a boost on a reference output's token at the request's position, so
walks mostly follow real documents and sometimes wander; a request that finishes restarts from the initial state.
Reported per option: wall microseconds per engine step (device synchronised at the end), host microseconds spent
in grammar code (CPU matcher fills/accepts/forks or backend calls; for (b) the Python launch work), device->host
syncs per step. Same drafts law for (a) and (b) where their masks agree; where they differ, mask agreement with the
llguidance verifier is reported (see the choice below).

Usage: python benchmarks/mask_delivery.py [--device cuda] [--batches 1,8,64] [--positions 4,8] [--steps 20]
       [--dry]  (CPU, tiny sizes: checks the script end to end)
Tables print as they go and are appended to $OUT/mask_delivery.txt when OUT is set.

Read the options in pairs that walk the same states (same draw rule, same masks): a/loop vs b/automaton is the
delivery alone; a/built vs b/built is the drafting path as wired (the shared proposal math, ~1.5 ms per position
of Python-launched kernels, is in both). a/built and a/loop draw differently, so their walks (and the costs of
the states they visit) differ: do not compare across the pairs.

Measured on the H200 (rounds 1-2, 2026-11-29; n = 8 positions; wall microseconds per engine step; syncs per
step 8 for (a), 1 for (b) and (c)):
                         delivery alone               as wired (incl. the proposal math)
                         a/loop      b/automaton      a/built     b/built
  JSON bounded     B=1    6,788       7,117           19,931      20,264
                   B=8   19,123       7,702           24,239      21,536
                   B=64 138,053       5,814           73,863      18,880
  JSON unbounded   B=1    2,153       5,626           11,664      15,812
                   B=8    2,619       3,864           10,041      12,181
                   B=64  14,939       7,053           25,013      15,287
  regex            B=1    6,059       5,516           15,972      15,276
                   B=8   31,899       4,955           42,301      13,205
                   B=64 243,172       4,099          167,964      11,644
  DSML (CPU only)  B=1    3,140         -             14,466        -
                   B=8    6,233         -             20,255        -
                   B=64  53,974         -            122,266        -
  llguidance fills cost ~40 us on the unbounded schema but ~270-470 us with bounded repetitions (maxLength
  strings, [A-Za-z ,]{10,80}); a/batched (llguidance's thread pool per position) never beat a/loop by much and
  was often slower. (c), the verification rows (B x 9): c/llguidance 0.3 / 1.9 / 13.5 ms (unbounded JSON, B=1/8/64),
  4.2 / 28 / 211 ms (regex), 0.8 / 9.2 / 58 ms (DSML), 4.3 / 30 / 213 ms (bounded JSON); c/xgrammar 0.14 / 0.6 /
  3.9 ms (unbounded JSON) and 1.9 / 7.4 / 90 ms (regex): 2-3.5x faster than llguidance's draft API where it
  applies; on the bounded schema xgrammar needs its regex (no maxLength) and takes 141 ms / 1.15 s at B=1/8.
  Automaton build: Index 0.4-1.6 s + tables 0.3-2.5 s + verifier refinement 0.04-0.3 s; device memory 8.8 MiB
  (unbounded JSON, 175 states), 59 MiB (bounded JSON, 620 states), 57 MiB (regex, 117 states).
  Accepted length with the automaton (grammar_speculation, random DSpark drafter): 1.84, the same as CPU masks,
  since the refined masks are the verifier's ("llg mask ok" 1.000 on every walk above).

THE CHOICE (what the numbers say): a hybrid, per step.
- GPU automaton (SpecConfig(draft_masks="automaton")) for regular constraints (Regex; JSON Schema without
  recursion, through outlines-core's regex) whose tables fit a memory bound, WHEN the CPU masks would cost more:
  its cost is flat in the batch (b/automaton 4-8 ms per 8-position block from B=1 to 64; one host sync per block),
  while CPU masks grow with B x fill cost: 24-59x slower delivery at B=64 on constraints with bounded repetitions,
  2.1x on the unbounded schema; 3.9x / 14x / 1.6x for the whole drafting path at B=64.
- CPU masks with one sync per position otherwise: always for DSML tool calls, triggers, recursive schemas,
  Lark/EBNF grammars and DFAs over the bound; and for cheap-fill constraints at small batch, where they win
  (unbounded JSON: 2.2 vs 5.6 ms at B=1, 2.6 vs 3.9 ms at B=8): the automaton's fixed ~0.5-0.7 ms of kernel launches
  per position beats nothing there. The rule: automaton when (constrained requests) x (measured fill time of the
  constraint) exceeds the automaton's per-position cost (~0.6 ms on the H200); today the switch is per
  configuration, the cost-based per-step choice is the follow-up.
- (c) the backends' draft-chain traversal cannot feed sequential masked drafting (position k+1's mask depends on
  the token drawn at k). It serves the verification rows (one call per step, overlapped with the forward) and
  "draft unmasked, then cut", which gives up masked drafting's acceptance (grammar_speculation, random DSpark
  drafter on the H200: "+ cut" 1.09 / 1.00 vs "+ masked drafting" 1.84 / 2.59 accepted length, JSON / DSML).
Next bottlenecks: the proposal math (~1.5 ms per position of Python-launched kernels, flat in B: a fused kernel or
CUDA graph), and the verification masks on bounded-repetition constraints (c/llguidance 211-213 ms per step at
B=64; xgrammar's traversal is 2-3.5x faster where it applies).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepinfer_sg import load_tokenizer                                  # noqa: E402
from deepinfer_sg.engine import grammar_drafting as GD                  # noqa: E402
from deepinfer_sg.engine import token_automaton as TA                   # noqa: E402
from deepinfer_sg.grammars import ConstraintCompiler, JsonSchema, Regex, fill_masks   # noqa: E402
from deepinfer_sg.kernels import apply_token_bitmask_inplace            # noqa: E402

V = 129_280
EOS = 1
BOOST = 6.0                       # reference token boost over N(0, 1) logits: followed when the grammar allows it
REGEX = r"(Yes|No)\. Confidence: (0\.[0-9]{1,3}|1\.0)\. Reason: [A-Za-z ,]{10,80}\."
REGEX_REF = "Yes. Confidence: 0.87. Reason: the total, customer and currency match the invoice."
DSML_ID = 128825


@dataclass
class Workload:
    name: str
    llg: object                               # llguidance compiled constraint (the verifier's)
    llg_regex: object = None                  # llguidance on the automaton's own regex (same language)
    xgr: object = None                        # xgrammar compiled constraint, when xgrammar can compile it
    automaton: Optional[TA.TokenAutomaton] = None
    no_automaton: str = ""                    # why there is none
    no_xgr: str = ""
    xgr_on_regex: bool = False                # xgrammar compiled the schema's regex (slow: see --xgr-regex-max-batch)
    ref: list = field(default_factory=list)   # a reference output (token ids, EOS last)
    build: dict = field(default_factory=dict)


def _extraction_schema():
    import grammar_speculation as GS
    doc = {"invoice_id": "INV-0193", "customer": "Acme Tools", "total": 1284.5, "currency": "EUR", "paid": False,
           "items": [{"sku": "HX-220", "qty": 4}, {"sku": "BL-7", "qty": 12}]}   # fits its maxLength 12 bounds
    return GS._bounded(GS.EXTRACTION), doc


def _dsml_ref(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids          # noqa: E731
    D = [DSML_ID]
    return (enc("<") + D + enc(' invoke name="get_weather">\n<') + D + enc(' parameter name="city" string="true">Lisbon</')
            + D + enc(' parameter>\n<') + D + enc(' parameter name="date" string="true">2025-06-14</') + D
            + enc(' parameter>\n</') + D + enc(' invoke>\n</') + D + enc(' calls>') + [EOS])


def build_workloads(tok, device, max_automaton_bytes, only=None):
    from outlines_core import Index
    from deepinfer_sg.grammars.backend_outlines import outlines_vocabulary, regex_for
    from deepinfer_sg.grammars.dsml import dsml_grammar
    import grammar_speculation as GS
    llg = ConstraintCompiler(tok, vocab_size=V, eos_token_ids=[EOS], timeout_s=120)
    xgr = ConstraintCompiler(tok, vocab_size=V, eos_token_ids=[EOS], backend="xgrammar", timeout_s=120)
    t0 = time.perf_counter()
    voc = outlines_vocabulary(llg.vocab)
    vocab_s = time.perf_counter() - t0
    schema, doc = _extraction_schema()
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids + [EOS]  # noqa: E731
    free = GS.EXTRACTION                      # the same schema without length / range bounds
    specs = [("JSON extraction", JsonSchema(schema, whitespace="compact"),
              regex_for(JsonSchema(schema, whitespace="compact")), enc(json.dumps(doc, separators=(",", ":")))),
             ("JSON unbounded", JsonSchema(free, whitespace="compact"), regex_for(JsonSchema(free, whitespace="compact")),
              enc(json.dumps(GS.EXTRACTION_DOCS[0], separators=(",", ":")))),
             ("regex", Regex(REGEX), REGEX, enc(REGEX_REF)),
             ("DSML tool call", dsml_grammar(GS.TOOLS, "get_weather", starts_in_tool_calls=True), None, _dsml_ref(tok))]
    out = []
    for name, spec, regex, ref in specs:
        if only and name not in only:
            continue
        try:
            w = Workload(name, llg.compile(spec), ref=ref)
        except Exception as exc:       # a broken constraint costs its own rows only
            print(f"{name}: skipped: {type(exc).__name__}: {exc}", flush=True)
            continue
        try:
            w.xgr = xgr.compile(spec)
        except Exception as exc:
            w.no_xgr = f"{type(exc).__name__}: {str(exc)[:100]}"
            if regex is not None:          # the schema's regex instead (same language as the automaton)
                w.xgr = xgr.compile(Regex(regex))
                w.xgr_on_regex = True
                w.no_xgr += "; c/xgrammar runs on the schema's outlines regex instead"
        if regex is None:
            w.no_automaton = "not regular (Lark grammar: recursive JSON arguments, raw free text)"
        else:
            t0 = time.perf_counter()
            index = Index(regex, voc)
            t1 = time.perf_counter()
            try:
                trans = index.get_transitions()
                a = TA.from_transitions(trans, index.get_initial_state(), sorted(index.get_final_states()), V,
                                        [EOS], max_bytes=max_automaton_bytes)
                t2 = time.perf_counter()
                # masks narrowed to the verifier's (llguidance) at each state: drafts it would mask out are
                # never proposed, and its single-token states are forced drafts here too
                refined = TA.refine_masks(a, trans, index.get_initial_state(), w.llg.matcher)
                t_ref = time.perf_counter() - t2
                t2 = time.perf_counter()
                w.automaton = a.to(device)
                w.llg_regex = w.llg if isinstance(spec, Regex) else llg.compile(Regex(regex))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t3 = time.perf_counter()
                w.build = dict(vocab_s=vocab_s, index_s=t1 - t0, tables_s=t2 - t1 - t_ref, refine_s=t_ref,
                               refined=refined, upload_s=t3 - t2,
                               states=a.num_states, transitions=a.keys.numel(), mib=a.nbytes / 2**20,
                               mask_mib=a.masks.numel() * 4 / 2**20)
            except TA.AutomatonTooLarge as exc:
                w.no_automaton = str(exc)
        for c in (w.llg, w.llg_regex):
            n_ok = c.matcher().check_draft(ref) if c is not None else len(ref)
            if n_ok != len(ref):
                raise RuntimeError(f"{name}: the reference output leaves the grammar at token {n_ok}")
        out.append(w)
    return out


# --------------------------------------------------------------------------------------------- drafter stand-in
class Drafter:
    """Fixed noise logits [n, B, V] on the device + a boost on ref[(position + k) % len(ref)] per step."""

    def __init__(self, ref, batch, n, device, seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.noise = torch.randn(n, batch, V, generator=g, device=device)
        self.ref = torch.tensor(ref, dtype=torch.long)
        self.device = device

    def logits(self, positions: list) -> torch.Tensor:
        n, B, _ = self.noise.shape
        pos = torch.tensor(positions, dtype=torch.long).unsqueeze(0) + torch.arange(n).unsqueeze(1)
        idx = self.ref[pos % self.ref.numel()].to(self.device)
        z = self.noise.clone()
        z.scatter_add_(2, idx.unsqueeze(-1), torch.full((n, B, 1), BOOST, device=self.device))
        return z


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pick(z_k: torch.Tensor, bitmask_dev: torch.Tensor) -> torch.Tensor:
    """The masked draw every option shares: mask the logits row (kernel), argmax."""
    z = z_k.clone()
    apply_token_bitmask_inplace(z, bitmask_dev)
    return z.argmax(-1)


class Requests:
    """Committed grammar states + positions of B requests; a request that terminates restarts."""

    def __init__(self, compiled, batch):
        self.compiled = compiled
        self.matchers = [compiled.matcher() for _ in range(batch)]
        self.positions = [0] * batch
        self.rejected = 0

    def commit(self, i, tokens):
        """Accept the block's tokens; a request that terminates (or whose matcher refuses a token, counted in
        `rejected`: a benchmark bookkeeping failure, never expected) restarts. Returns the tokens kept, or None
        when the request restarted."""
        m = self.matchers[i]
        kept = []
        for t in tokens:
            if t < 0:
                break
            ok = m.accept(int(t))
            self.rejected += not ok
            self.positions[i] += 1
            kept.append(int(t))
            if not ok or m.is_terminated():
                self.matchers[i] = self.compiled.matcher()
                self.positions[i] = 0
                return None
        return kept


# --------------------------------------------------------------------------------------------- the options
def step_cpu_loop(req, drafter, n, device, pinned, clock, batched=False):
    """(a): per position, CPU fills (per matcher, or one batched llguidance call), H2D, masked argmax, D2H."""
    B = len(req.matchers)
    z = drafter.logits(req.positions)
    t = time.perf_counter()
    walkers = [m.fork() for m in req.matchers]
    active = [True] * B
    clock["host"] += time.perf_counter() - t
    out = []
    for k in range(n):
        t = time.perf_counter()
        pinned.zero_()
        live = [i for i in range(B) if active[i]]
        if batched and live:
            if len(live) == B:
                fill_masks(walkers, None, out=pinned)
            else:
                pinned[:len(live)] = fill_masks([walkers[i] for i in live])
                pinned[torch.tensor(live)] = pinned[:len(live)].clone()
        else:
            for i in live:
                walkers[i].fill_mask(pinned, i)
        clock["host"] += time.perf_counter() - t
        bm = pinned.to(device, non_blocking=True)
        tok = _pick(z[k], bm).cpu().tolist()                    # the host sync of this position
        clock["syncs"] += 1
        t = time.perf_counter()
        for i in range(B):
            if not active[i]:
                tok[i] = -1
                continue
            walkers[i].accept(tok[i])
            if walkers[i].is_terminated():
                active[i] = False
        clock["host"] += time.perf_counter() - t
        out.append(tok)
    return [list(col) for col in zip(*out)]


def step_built(req, drafter, n, device, clock):
    """(a) as built: engine/grammar_drafting.MaskedDraftSampler (masks + sampling math + one sync per position)."""
    B = len(req.matchers)
    z = drafter.logits(req.positions)
    t = time.perf_counter()
    s = GD.MaskedDraftSampler(req.matchers, torch.zeros(B, dtype=torch.long), torch.tensor(req.positions), V,
                              mask_drafts=True, force_tokens=True, stop_token_ids=[[EOS]] * B)
    for k in range(n):
        s.step(z[k])
    block = s.finish()
    clock["host"] += time.perf_counter() - t
    clock["syncs"] += n
    return block.tokens.tolist()


def step_automaton_built(req, drafter, n, device, automaton, hstates, clock):
    """(b) as wired: engine/automaton_drafting.AutomatonDraftSampler (the MaskedDraftSampler math on device
    masks; one sync in finish, plus the verifier matchers' check_draft walk of the block)."""
    from deepinfer_sg.engine.automaton_drafting import AutomatonDraftSampler
    B = len(req.matchers)
    z = drafter.logits(req.positions)
    t = time.perf_counter()
    s = AutomatonDraftSampler(req.matchers, automaton, torch.tensor(hstates), torch.zeros(B, dtype=torch.long),
                              torch.tensor(req.positions), V, force_tokens=True, stop_token_ids=[[EOS]] * B)
    for k in range(n):
        s.step(z[k])
    block = s.finish()
    clock["host"] += time.perf_counter() - t
    clock["syncs"] += 1
    return block.tokens.tolist()


def step_automaton(req, drafter, n, device, automaton, states, clock):
    """(b): mask rows gathered and states advanced on the device; one D2H copy of the block at the end."""
    z = drafter.logits(req.positions)
    t = time.perf_counter()
    term = automaton.terminated
    s = torch.where(states == term, torch.full_like(states, automaton.initial), states)   # restarts
    toks = []
    for k in range(n):
        ended = s == term
        tok = _pick(z[k], automaton.mask_rows(s))
        tok = torch.where(ended, torch.full_like(tok, -1), tok)
        s = automaton.advance(s, tok)
        toks.append(tok)
    block = torch.stack(toks, 1)
    clock["host"] += time.perf_counter() - t
    out = block.cpu().tolist()                                  # the one sync: scheduling needs the block
    clock["syncs"] += 1
    states.copy_(s)
    return out


def step_chain_llg(req, chains, device, pinned_rows, clock):
    """(c) llguidance: masks for the known chains, one fill_masks call for all requests (n + 1 rows each)."""
    t = time.perf_counter()
    # forks, as engine/spec_decode.py passes them: the committed matchers must stay as they are
    bm = fill_masks([m.fork() for m in req.matchers], chains, out=pinned_rows)
    clock["host"] += time.perf_counter() - t
    bm.to(device, non_blocking=True)
    clock["syncs"] += 1                                         # the draft tokens came down once
    return bm


def step_chain_xgr(matchers, chains, device, pinned_rows, clock):
    """(c) xgrammar: GrammarMatcher.traverse_draft_tree over each request's chain (node 0 = the current state)."""
    t = time.perf_counter()
    row = 0
    for m, chain in zip(matchers, chains):
        L = len(chain) + 1
        nxt = torch.tensor(list(range(1, L)) + [-1], dtype=torch.long)
        sib = torch.full((L,), -1, dtype=torch.long)
        toks = torch.tensor([0] + list(chain), dtype=torch.long)
        m.m.traverse_draft_tree(nxt, sib, toks, pinned_rows[row:row + L])
        row += L
    clock["host"] += time.perf_counter() - t
    pinned_rows.to(device, non_blocking=True)
    clock["syncs"] += 1
    return pinned_rows


# --------------------------------------------------------------------------------------------- measurement
def measure(w, option, B, n, device, steps, warmup):
    """Mean (wall us, host us, syncs) per step of `option` on workload w; the block's drafts are committed
    (untimed) after each step so the walk moves through the whole grammar."""
    drafter = Drafter(w.ref, B, n, device, seed=B * 100 + n)
    pin = device.type == "cuda"
    pinned = torch.zeros(B, (V + 31) // 32, dtype=torch.int32, pin_memory=pin)
    rows = torch.zeros(B * (n + 1), (V + 31) // 32, dtype=torch.int32, pin_memory=pin)
    compiled = {"c/xgrammar": w.xgr, "b/automaton": w.llg_regex, "b/built": w.llg_regex}.get(option, w.llg)
    hstates = [w.automaton.initial] * B if w.automaton is not None else None
    req = Requests(compiled, B)                          # (b): commits through the automaton's own language
    states = w.automaton.initial_states(B, device) if w.automaton is not None else None
    verifier = [w.llg.matcher() for _ in range(B)]       # (b): does the real verifier allow the drafts?
    broken = [False] * B
    agree = [0, 0, 0, 0]                                 # same-language allowed, total; verifier allowed, total
    clock = dict(host=0.0, syncs=0)
    wall = 0.0
    for it in range(warmup + steps):
        if it == warmup:
            clock = dict(host=0.0, syncs=0)
            wall = 0.0
        _sync(device)
        t0 = time.perf_counter()
        if option == "a/built":
            block = step_built(req, drafter, n, device, clock)
        elif option == "a/loop":
            block = step_cpu_loop(req, drafter, n, device, pinned, clock)
        elif option == "a/batched":
            block = step_cpu_loop(req, drafter, n, device, pinned, clock, batched=True)
        elif option == "b/automaton":
            block = step_automaton(req, drafter, n, device, w.automaton, states, clock)
        elif option == "b/built":
            block = step_automaton_built(req, drafter, n, device, w.automaton, hstates, clock)
        else:
            chains = [_chain(w.ref, p, n) for p in req.positions]
            if option == "c/llguidance":
                step_chain_llg(req, chains, device, rows, clock)
            else:
                step_chain_xgr(req.matchers, chains, device, rows, clock)
            block = chains
        _sync(device)
        wall += time.perf_counter() - t0
        for i in range(B):
            if option == "b/automaton":
                _agreement(req.matchers[i].fork(), block[i], agree, 0)
                if not broken[i]:
                    broken[i] = not _agreement(verifier[i], block[i], agree, 2)
            kept = req.commit(i, block[i])
            if option == "b/automaton" and req.positions[i] == 0:   # restarted: both restart
                verifier[i], broken[i] = w.llg.matcher(), False
            if option == "b/built":
                hstates[i] = w.automaton.initial if kept is None else w.automaton.walk(hstates[i], kept)
    if req.rejected:
        print(f"  ({w.name} {option}: {req.rejected} committed drafts refused by the matcher)", flush=True)
    return 1e6 * wall / steps, 1e6 * clock["host"] / steps, clock["syncs"] / steps, agree


def _chain(ref, position, n):
    """n grammatical draft tokens for a request at `position` of its reference walk (the chain option's input):
    the reference continuation (requests restart at position 0, so ref[position:] is always grammatical)."""
    return ref[position:position + n]


def _agreement(matcher, block, agree, at):
    """Count the drafts `matcher`'s mask allows (agree[at] of agree[at + 1]); walks `matcher` along the block.
    Returns False when the matcher cannot accept a draft (its walk left the grammar)."""
    bm = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for t in block:
        if t < 0 or matcher.is_terminated():
            break
        matcher.fill_mask(bm, 0)
        word, bit = divmod(int(t), 32)
        agree[at + 1] += 1
        agree[at] += int((int(bm[0, word]) >> bit) & 1)
        if not matcher.accept(int(t)):
            return False
    return True


OPTIONS = ["a/built", "a/loop", "a/batched", "b/built", "b/automaton", "c/llguidance", "c/xgrammar"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--positions", default="4,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-automaton-mib", type=float, default=256.0)
    ap.add_argument("--workloads", default=None, help="comma list of workload names (default: all)")
    ap.add_argument("--options", default=None, help="comma list of options (default: all)")
    ap.add_argument("--xgr-regex-max-batch", type=int, default=8,
                    help="c/xgrammar on a schema's regex only up to this batch (H200: 1.15 s per step at B=8)")
    ap.add_argument("--dry", action="store_true", help="CPU check with tiny sizes")
    args = ap.parse_args()
    if args.dry:
        args.batches, args.positions, args.steps, args.warmup = "1,2", "4", 2, 1
    device = torch.device(args.device)
    torch.set_num_threads(min(4, os.cpu_count() or 1)) if device.type == "cpu" else None
    tok = load_tokenizer()
    only = set(args.workloads.split(",")) if args.workloads else None
    t0 = time.perf_counter()
    works = build_workloads(tok, device, int(args.max_automaton_mib * 2**20), only)
    lines = [f"# mask delivery to a masked drafter: device {device}"
             f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, vocab {V}, "
             f"steps {args.steps} (+{args.warmup} warm-up), setup {time.perf_counter() - t0:.1f} s"]
    for w in works:
        if w.automaton is not None:
            b = w.build
            lines.append(f"{w.name}: automaton {b['states']} states, {b['transitions']:,} transitions, "
                         f"{b['mib']:.1f} MiB on device ({b['mask_mib']:.1f} MiB masks); build: outlines Index "
                         f"{b['index_s']:.2f} s + tables {b['tables_s']:.2f} s + verifier-mask refinement of "
                         f"{b['refined']} states {b['refine_s']:.2f} s + upload {b['upload_s']:.3f} s "
                         f"(vocabulary {b['vocab_s']:.2f} s once per tokenizer)")
        else:
            lines.append(f"{w.name}: no automaton: {w.no_automaton}")
        if w.xgr is None:
            lines.append(f"{w.name}: no xgrammar: {w.no_xgr}")
    out = os.environ.get("OUT")

    def emit(text):                  # printed and appended line by line: a run cut by its time limit keeps its rows
        print(text, flush=True)
        if out:
            with open(os.path.join(out, "mask_delivery.txt"), "a") as f:
                f.write(text + "\n")

    emit("\n".join(lines))
    head = (f"{'workload':16s} {'B':>3s} {'n':>2s} {'option':13s} {'wall us/step':>12s} {'host us/step':>12s} "
            f"{'syncs/step':>10s} {'us/position':>11s} {'llg mask ok':>11s} {'verifier ok':>11s}")
    emit(head)
    # the first --positions value over every batch and workload first: a run cut by its time limit keeps them
    for n in [int(x) for x in args.positions.split(",")]:
        for B in [int(x) for x in args.batches.split(",")]:
            for w in works:
                for opt in OPTIONS:
                    if opt.startswith("b/") and w.automaton is None:
                        continue
                    if opt == "c/xgrammar" and (w.xgr is None or (w.xgr_on_regex and B > args.xgr_regex_max_batch)):
                        continue
                    if args.options and opt not in args.options.split(","):
                        continue
                    try:
                        wall, host, syncs, agree = measure(w, opt, B, n, device, args.steps, args.warmup)
                    except Exception as exc:     # one broken option must not cost the rest of the table
                        emit(f"{w.name:16s} {B:3d} {n:2d} {opt:13s} failed: {type(exc).__name__}: {exc}")
                        continue
                    ag = f"{agree[0] / agree[1]:.3f}" if agree[1] else "-"
                    ver = f"{agree[2] / agree[3]:.3f}" if agree[3] else "-"
                    emit(f"{w.name:16s} {B:3d} {n:2d} {opt:13s} {wall:12.0f} {host:12.0f} {syncs:10.1f} "
                         f"{wall / n:11.0f} {ag:>11s} {ver:>11s}")


if __name__ == "__main__":
    main()
