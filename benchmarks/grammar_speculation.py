"""Grammar-aware speculation, mechanism by mechanism.

Default (the REAL path): the model + engine/spec_decode.py (target forward over verify rows, grammars.fill_masks
masks, speculative.verify, DSpark drafting with MaskedDraftSampler) on a JSON-Schema extraction workload and a
DSML tool-call workload (grammars/dsml.py), with speculation off, plain DSpark (drafts unmasked, masks only at
verification, as DeepInfer does), then each mechanism added in turn: cut at the first violation, masked drafting,
forced tokens (chains past n), grammar-aware scheduling. Reports mean accepted length, target rows per committed
token, tokens/s (wall, and with the drafter's time excluded), drafter and mask milliseconds per step, and how
many outputs are complete and valid. Random weights: the drafter is "self" by default (the target's own
UNMASKED distribution at the drafted prefix, sampled at --temperature; plain DSpark then proposes what an
unconstrained model wants to say, which the grammar mostly forbids) or --drafter dspark (the checkpoint's random
DSpark layers: plain acceptance near zero, so what gets accepted is the grammar's contribution, and the wall tok/s
includes the real drafter's cost), or --drafter self,dspark for both tables in one run; every row names its drafter.
CPU: the bundled tiny model (real vocabulary); CUDA: the mid-size V4.1 config. Tables go to
$OUT/grammar_speculation.txt when OUT is set.

--synthetic: the earlier CPU simulation on a SYNTHETIC target, described below.

What it measures, in one run, for a JSON-Schema extraction workload and a tool-call workload:
speculation off, plain DSpark (drafts unmasked, masks only at verification, as DeepInfer does), then each
grammar mechanism added in turn: mean accepted length per step (accepted drafts + 1), target rows per
committed token (the cost the target forward pays), and the CPU milliseconds per step spent on grammar work
for drafting (MaskedDraftSampler: one fill_mask + accept per position) and for verification masks
(grammars.fill_masks). It also checks the engine invariant that every committed token is accepted by the
committed matcher (no "grammar rejected tokens").

The setup, stated because it decides the numbers:
- real constraint compiler (deepinfer_sg.grammars, llguidance backend) on the real DeepSeek-V4 tokenizer;
- target: logits = noise * N(0, 1) + BOOST at the reference document's token at this position (EOS past
  its end) + DISTRACT on 32 fixed "prose" tokens containing a newline, which the compact JSON
  grammar forbids (what an unconstrained chat model wants to say instead of JSON); q = softmax over the mask;
- drafter ("self-drafting" with an imperfect copy): the target's UNMASKED logits at the drafted prefix plus
  independent N(0, DRAFT_NOISE) noise; confidence = the max probability of the proposal it sampled from
  (masked when masked drafting is on; 1 at forced positions): a stand-in for a trained, calibrated head;
- scheduling: fixed gamma, or Algorithm 1 over a linear step-time table (1 + 0.02 * rows, arbitrary units);
  "model tok/s" = committed tokens / sum over steps of that table's time (a stand-in for the H200 curve);
- "us/fill": matcher time (fill_mask + accept + fork + rollback, all on CPU) per drafting mask fill;
- "draft ms/step" is the MaskedDraftSampler's own CPU work (mask fill, matcher walk, sampling, forced-chain
  search), i.e. the price of CPU masks with one host round trip per draft position; the logits are excluded;
No trained DSpark drafter and no GPU here: tokens/s needs the engine on the H200 (benchmarks/speculative.py,
once the engine wires these functions in). Rows per committed token is the quantity speculation changes.

Usage: python benchmarks/grammar_speculation.py [--requests 4] [--gamma 5] [--max-tokens 120]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer_sg import load_tokenizer
from deepinfer_sg.engine import grammar_drafting as G
from deepinfer_sg.engine import speculative as S
from deepinfer_sg.engine import verify_schedule as VS
from deepinfer_sg.grammars import ConstraintCompiler, JsonSchema, fill_masks

NOISE, BOOST, DISTRACT, DRAFT_NOISE = 1.0, 19.0, 16.0, 1.0

EXTRACTION = {
    "type": "object",
    "properties": {
        "invoice_id": {"type": "string"}, "customer": {"type": "string"},
        "total": {"type": "number"}, "currency": {"enum": ["EUR", "USD", "GBP"]},
        "paid": {"type": "boolean"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"],
            "additionalProperties": False}},
    },
    "required": ["invoice_id", "customer", "total", "currency", "paid", "items"],
    "additionalProperties": False,
}
EXTRACTION_DOCS = [
    {"invoice_id": "INV-2024-0193", "customer": "Acme Tools GmbH", "total": 1284.5, "currency": "EUR",
     "paid": False, "items": [{"sku": "HX-220", "qty": 4}, {"sku": "BL-7", "qty": 12}]},
    {"invoice_id": "A-77", "customer": "Northwind Traders", "total": 99.0, "currency": "USD", "paid": True,
     "items": [{"sku": "NW-1", "qty": 1}]},
]
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_flights", "book_hotel"]},
        "arguments": {"type": "object", "properties": {
            "city": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "nights": {"type": "integer"}}, "required": ["city", "date"], "additionalProperties": False},
    },
    "required": ["name", "arguments"], "additionalProperties": False,
}
TOOL_DOCS = [
    {"name": "book_hotel", "arguments": {"city": "Lisbon", "date": "2025-06-14", "nights": 3}},
    {"name": "get_weather", "arguments": {"city": "Ulaanbaatar", "date": "2025-01-02"}},
]

MECHANISMS = [
    ("speculation off", dict(gamma=0)),
    ("plain DSpark (verify masks only)", dict()),
    ("+ cut at first violation", dict(cut=True)),
    ("+ masked drafting", dict(cut=True, mask=True)),
    ("+ forced tokens (chains past gamma)", dict(cut=True, mask=True, forced=True)),
    ("+ grammar-aware scheduling (sync)", dict(cut=True, mask=True, forced=True, schedule=True)),
]


class TimedMatcher:
    """Delegates to a grammars matcher and adds the time spent in it to a shared counter (the cost of
    walking drafts on CPU matchers: fill_mask, accept, fork, rollback)."""

    def __init__(self, inner, clock):
        self.inner, self.clock = inner, clock

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.clock["s"] += time.perf_counter() - t0
            self.clock["calls"] += name == "fill_mask"
            return TimedMatcher(out, self.clock) if name == "fork" else out
        return timed


class SyntheticTarget:
    def __init__(self, vocab_size: int, tok, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.V = vocab_size
        # "prose" tokens: ids whose text has a newline (JSON strings forbid them; compact JSON mostly too)
        prose = [i for i in torch.randperm(min(vocab_size, tok.get_vocab_size()), generator=g).tolist()
                 if "\n" in tok.decode([i])][:32]
        self.distract = torch.tensor(prose, dtype=torch.long)
        self.seed = seed

    def logits(self, request: int, ref: list, prefix: list, stream: int = 0) -> torch.Tensor:
        """Deterministic per (request, prefix length, stream); stream 1 is the drafter's extra noise."""
        g = torch.Generator().manual_seed(hash((self.seed, request, len(prefix), stream)) & 0x7FFFFFFF)
        z = torch.randn(self.V, generator=g) * (NOISE if stream == 0 else DRAFT_NOISE)
        if stream == 0:
            z[self.distract] += DISTRACT
            # position-aligned: after a deviation the target still steers back to the document's end
            z[ref[min(len(prefix), len(ref) - 1)]] += BOOST
        return z


def run(compiled, docs, tok, target, mech, gamma, max_tokens, eos, vocab):
    n = len(docs)
    refs = [tok.encode(json.dumps(d, separators=(",", ":"))).ids + [eos] for d in docs]
    clock = {"s": 0.0, "calls": 0}
    matchers = [TimedMatcher(compiled.matcher(), clock) for _ in range(n)]
    outs = [[] for _ in range(n)]
    done = [False] * n
    gamma = mech.get("gamma", gamma)
    model = VS.StepTimeModel.from_table({b: 1.0 + 0.02 * b for b in range(1, 64 * (gamma + 8) + 2)})
    stats = dict(steps=0, rows=0, tokens=0, accepted=0, draft_ms=0.0, mask_ms=0.0, req_steps=0, model_s=0.0)
    while not all(done):
        act = [i for i in range(n) if not done[i]]
        stats["steps"] += 1
        stats["req_steps"] += len(act)
        if gamma:
            t_grammar = 0.0                      # only the sampler's work (masks, walk, sampling), not the logits
            t0 = time.perf_counter()
            sampler = G.MaskedDraftSampler([matchers[i] for i in act], torch.zeros(len(act), dtype=torch.long),
                                           torch.tensor([len(outs[i]) for i in act]), vocab,
                                           mask_drafts=mech.get("mask", False), force_tokens=mech.get("forced", False),
                                           stop_token_ids=[[eos]] * len(act))
            t_grammar += time.perf_counter() - t0
            confs = []
            for k in range(gamma):
                rows = []
                for a, i in enumerate(act):
                    prefix = outs[i] + [int(sampler.tokens[j][a]) for j in range(k)]
                    rows.append(target.logits(i, refs[i], prefix) + target.logits(i, refs[i], prefix, stream=1))
                logits = torch.stack(rows)
                confs.append(torch.softmax(logits, -1).max(-1).values.double())
                t0 = time.perf_counter()
                sampler.step(logits)
                t_grammar += time.perf_counter() - t0
            t0 = time.perf_counter()
            if mech.get("forced"):
                sampler.extend_forced(8)
            block = sampler.finish(torch.stack(confs, 1))
            stats["draft_ms"] += (time.perf_counter() - t0 + t_grammar) * 1e3
            # no trained confidence head: the peak of the proposal actually used (masked when masking is on)
            conf = torch.where(block.forced, torch.ones_like(block.confidences), block.probs.max(-1).values.double())
            if mech.get("schedule"):
                conf = VS.grammar_confidences(conf, block.forced, block.valid_lengths, block.tokens,
                                              torch.full((len(act), 1), eos))
                ell = VS.schedule_sync(VS.cumulative_rates(conf, block.lengths), model)
            else:
                ell = VS.schedule_fixed(block.lengths)
            forced = torch.zeros(len(act), dtype=torch.bool)
            if mech.get("cut"):
                ell, forced = G.cut_at_violation(ell, block.valid_lengths)
            row_toks, row_probs, counts = S.pack_verify_rows(block.tokens, block.probs, ell, forced)
            drafts = [block.tokens[a, :int(ell[a]) + int(forced[a])].tolist() for a in range(len(act))]
        else:
            row_toks, row_probs = torch.full((len(act),), S.FRESH), None
            counts = torch.ones(len(act), dtype=torch.long)
            drafts = [[] for _ in act]
        t0 = time.perf_counter()
        bitmask = fill_masks([matchers[i].inner for i in act], drafts)
        stats["mask_ms"] += (time.perf_counter() - t0) * 1e3
        # verification rows: mask row r of request a is its state after drafts[a][:r]
        q_rows, mrow = [], 0
        for a, i in enumerate(act):
            for j in range(int(counts[a])):
                z = target.logits(i, refs[i], outs[i] + drafts[a][:j])
                bits = (bitmask[mrow + j].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
                allowed = bits.reshape(-1)[:vocab].bool()
                q_rows.append(torch.softmax(z.masked_fill(~allowed, float("-inf")), -1))
            mrow += len(drafts[a]) + 1
        res = S.verify(S.VerifyBatch(torch.stack(q_rows), row_probs, row_toks, counts,
                                     seeds=torch.arange(len(act)), positions=torch.tensor([len(outs[i]) for i in act]),
                                     stop_token_ids=torch.full((len(act), 1), eos),
                                     max_new_tokens=torch.tensor([max_tokens - len(outs[i]) for i in act])))
        stats["rows"] += int(counts.sum())
        stats["model_s"] += float(model.step_seconds(torch.tensor([int(counts.sum())]), len(act))[0])
        for a, i in enumerate(act):
            new = res.tokens[a, :int(res.num_committed[a])].tolist()
            for t in new:
                if not matchers[i].inner.accept(t):
                    raise AssertionError(f"request {i}: the grammar rejected committed token {t}")
            outs[i] += new
            stats["tokens"] += len(new)
            stats["accepted"] += int(res.num_accepted[a])
            done[i] = int(res.finish[a]) != S.FINISH_NONE
    valid = sum(_is_valid(tok, o, eos) for o in outs)
    stats["matcher_us_per_fill"] = 1e6 * clock["s"] / clock["calls"] if clock["calls"] else float("nan")
    return stats, valid


def _is_valid(tok, out, eos):
    try:
        json.loads(tok.decode([t for t in out if t != eos]))
        return 1
    except ValueError:
        return 0


def main_synthetic(args):
    torch.set_num_threads(1)
    tok = load_tokenizer()
    compiler = ConstraintCompiler(tok)
    vocab = compiler.vocab_size if hasattr(compiler, "vocab_size") else 129280
    eos = (compiler.eos_token_ids[0] if getattr(compiler, "eos_token_ids", None) else 1)
    target = SyntheticTarget(vocab, tok)
    print(f"synthetic target (noise {NOISE}, boost {BOOST}, distractors +{DISTRACT}), drafter noise {DRAFT_NOISE}, "
          f"gamma {args.gamma}, vocab {vocab}")
    for name, schema, docs in [("JSON-Schema extraction", EXTRACTION, EXTRACTION_DOCS), ("tool call", TOOL_CALL, TOOL_DOCS)]:
        compiled = compiler.compile(JsonSchema(schema))
        docs = docs * args.copies
        print(f"\n{name}: {len(docs)} requests")
        print(f"{'mechanism':40s} {'acc.len':>7s} {'rows/tok':>8s} {'model tok/s':>11s} {'draft ms/step':>13s} "
              f"{'mask ms/step':>12s} {'us/fill':>7s} {'valid':>5s}")
        for label, mech in MECHANISMS:
            st, valid = run(compiled, docs, tok, target, mech, args.gamma, args.max_tokens, eos, vocab)
            print(f"{label:40s} {st['tokens'] / st['req_steps']:7.2f} {st['rows'] / st['tokens']:8.2f} "
                  f"{st['tokens'] / st['model_s']:11.2f} "
                  f"{st['draft_ms'] / st['steps']:13.2f} {st['mask_ms'] / st['steps']:12.2f} "
                  f"{st['matcher_us_per_fill']:7.1f} {valid:>3d}/{len(docs)}")


# --------------------------------------------------------------------------------------------- the real path
REAL_MECHANISMS = [
    ("speculation off", dict(schedule="off")),
    ("plain DSpark (verify masks only)", dict(mask_drafts=False, force_tokens=False, cut=False, grammar_schedule=False)),
    ("+ cut at first violation", dict(mask_drafts=False, force_tokens=False, cut=True, grammar_schedule=False)),
    ("+ masked drafting", dict(mask_drafts=True, force_tokens=False, cut=True, grammar_schedule=False)),
    ("+ forced tokens (chains past n)", dict(mask_drafts=True, force_tokens=True, cut=True, grammar_schedule=False)),
    ("+ grammar-aware scheduling", dict(mask_drafts=True, force_tokens=True, cut=True, grammar_schedule=True)),
    ("+ device masks (token automaton)", dict(mask_drafts=True, force_tokens=True, cut=True, grammar_schedule=True,
                                             draft_masks="automaton")),
]
TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["city", "date"]}},
    {"name": "book_hotel", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}}, "required": ["city", "nights"]}},
]


def _bounded(schema):
    """The extraction schema with bounded strings / arrays (as a production schema would be), so that a
    random-weight model can finish a record within the token budget."""
    schema = json.loads(json.dumps(schema))

    def walk(s):
        if isinstance(s, dict):
            if s.get("type") == "string" and "pattern" not in s:
                s["maxLength"] = 12
            if s.get("type") == "array":
                s["maxItems"] = 2
            if s.get("type") in ("integer", "number"):
                s.update(minimum=0, maximum=9999)
            for v in s.values():
                walk(v)

    walk(schema)
    return schema


def schema_automaton(compiler, spec, device, reference=None):
    """The GPU token automaton of a JSON Schema spec (outlines-core's regex of the schema; the verifier stays the
    compiler's llguidance matcher, the engine cuts drafts it rejects). None when it cannot be built."""
    try:
        from outlines_core import Index
        from deepinfer_sg.engine.token_automaton import from_index
        from deepinfer_sg.grammars.backend_outlines import outlines_vocabulary, regex_for
        t0 = time.perf_counter()
        a = from_index(Index(regex_for(spec), outlines_vocabulary(compiler.vocab)), compiler.vocab_size,
                       list(compiler.vocab.eos_token_ids), max_bytes=256 << 20, reference=reference).to(device)
        print(f"(token automaton: {a.num_states} states, {a.nbytes / 2**20:.1f} MiB, built in "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
        return a
    except Exception as exc:
        print(f"(no token automaton: {type(exc).__name__}: {exc})", flush=True)
        return None


def real_workloads(compiler, tok, device="cpu"):
    """(name, compiled, prompt, validity check, token automaton or None)."""
    from deepinfer_sg.grammars.dsml import dsml_grammar
    schema = _bounded(EXTRACTION)
    spec = JsonSchema(schema, whitespace="compact")
    out = []
    try:
        compiled = compiler.compile(spec)
        out.append(("JSON-Schema extraction", compiled,
                    "Extract the invoice fields as JSON: invoice INV-2024-0193 from Acme Tools GmbH, 1284.50 EUR, unpaid.",
                    lambda text: _schema_valid(text, schema),
                    schema_automaton(compiler, spec, device, reference=compiled.matcher)))
    except Exception as exc:   # a broken compiler costs this workload only
        print(f"(JSON-Schema workload skipped: {type(exc).__name__}: {exc})")
    try:
        # the prompt already opened the tool-call block (deepseek-recipe pre-fills it for a named tool_choice):
        # the completion is DSML invoke markup, mostly grammar-forced tokens
        out.append(("DSML tool call", compiler.compile(dsml_grammar(TOOLS, "get_weather", starts_in_tool_calls=True)),
                    "What is the weather in Lisbon on 2025-06-14?", lambda text: "get_weather" in text, None))
    except Exception as exc:   # grammars/dsml.py missing or broken: report, keep the JSON workload
        print(f"(tool-call workload skipped: {type(exc).__name__}: {exc})")
    return out


def _schema_valid(text, schema):
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except Exception:
        return False


def main_real(args):
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from speculative import bench_model, fresh
    from deepinfer_sg.engine import spec_decode as SD
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = bench_model(args.device, args.model or ("midsize" if cuda else "tiny"))
    tok = load_tokenizer()
    V = model.config.vocab_size
    compiler = ConstraintCompiler(tok, vocab_size=V, eos_token_ids=[1])
    drafters = [d.strip() for d in args.drafter.split(",") if d.strip()]
    lines = [f"# grammar-aware speculation, real path: device {args.device}, model {args.model or ('midsize' if cuda else 'tiny')}"
             f" (random weights), drafters {','.join(drafters)}, n {args.gamma}, schedule {args.schedule}, temperature "
             f"{args.temperature}, {args.requests} requests x {args.max_tokens} tokens max",
             "# drafter 'dspark' = the checkpoint's own DSpark draft layers (random weights: near-zero plain acceptance, so"
             " what is accepted is the grammar's doing); 'self' = the target's own unmasked distribution at the drafted"
             " prefix (acceptance upper bound; it costs n target forwards, so its wall tok/s is not a drafter claim)",
             "# wall tok/s = committed tokens / wall time of the whole run INCLUDING drafting; 'excl. drafter' subtracts"
             " the drafter's time"]
    print("\n".join(lines), flush=True)
    prof = SD.SpecDecoder(model, SD.SpecConfig(n=args.gamma, drafter="self"))
    prof.ensure_time_model(max(8, args.requests))       # the start-up profile, shared by every run below
    for name, compiled, prompt, check, automaton in real_workloads(compiler, tok, args.device):
        ids = [0] + tok.encode(prompt, add_special_tokens=False).ids
        for drafter in drafters:
            lines += ["", f"{name}: {args.requests} requests, drafter {drafter}",
                      f"{'drafter':7s} {'mechanism':36s} {'acc.len':>7s} {'rows/tok':>8s} {'wall tok/s':>10s} "
                      f"{'tok/s excl. drafter':>19s} {'draft ms/step':>13s} {'mask ms/step':>12s} {'done+valid':>10s} "
                      f"{'errors':>6s}"]
            print("\n".join(lines[-3:]), flush=True)
            for label, mech in REAL_MECHANISMS:
                if drafter != drafters[0] and mech.get("schedule") == "off":
                    continue                              # speculation off does not depend on the drafter
                if mech.get("draft_masks") == "automaton" and automaton is None:
                    continue                              # not a regular constraint (DSML): CPU masks only
                cfg = SD.SpecConfig(n=args.gamma, drafter=drafter, **{"schedule": args.schedule, **mech})
                reqs = [SD.StandaloneRequest(ids, max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                                             stop_token_ids=(1,), matcher=compiled.matcher(), automaton=automaton)
                        for i in range(args.requests)]
                dec = SD.SpecDecoder(model, cfg, time_model=fresh(prof.time_model))
                t0 = time.perf_counter()
                with torch.inference_mode():
                    SD.generate(model, reqs, cfg, decoder=dec)
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                st = dec.stats
                tokens = sum(len(r.output) for r in reqs)
                valid = sum(1 for r in reqs if r.finish == "constraint_complete"
                            and check(tok.decode([t for t in r.output if t != 1])))
                errors = sum(1 for r in reqs if r.error is not None)
                who = "-" if mech.get("schedule") == "off" else drafter
                lines.append(f"{who:7s} {label:36s} {st.mean_accepted_length:7.2f} {st.rows_per_token:8.2f} "
                             f"{tokens / wall:10.1f} {tokens / max(1e-9, wall - st.drafter_s):19.1f} "
                             f"{1e3 * st.drafter_s / max(1, st.steps):13.1f} {1e3 * st.mask_s / max(1, st.steps):12.1f} "
                             f"{valid:>6d}/{len(reqs):<3d} {errors:6d}")
                print(lines[-1], flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "grammar_speculation.txt"), "a") as f:
            f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", action="store_true", help="the CPU simulation on a synthetic target")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="tiny | midsize")
    ap.add_argument("--drafter", default="self", help="self | dspark | a comma list (one table per drafter)")
    ap.add_argument("--schedule", default="sync", help="fixed | sync | async")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--copies", type=int, default=4, help="(synthetic) requests per reference document")
    args = ap.parse_args()
    if args.synthetic:
        args.max_tokens = args.max_tokens or 120
        main_synthetic(args)
    else:
        args.max_tokens = args.max_tokens or (64 if args.device.startswith("cuda") else 40)
        main_real(args)


if __name__ == "__main__":
    main()
