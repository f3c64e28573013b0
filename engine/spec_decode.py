"""The speculative decode step: DSpark drafts (or self-drafts), confidence-scheduled verification, grammar-aware
drafting, for a batch of running requests. Issues 6 and 7, wired end to end on the real model.

One step for R decoding requests (each holds x0 = its last committed token, not yet in its cache, and the draft
block the previous step made after x0):
  1. scheduling: grammar_confidences -> cumulative_rates -> verify lengths by the configured mode
     ("off": no drafts, "fixed": every draft, "sync": Algorithm 1 with its early stop, "async": budget from the
     rates of the block verified one step earlier (round N-2), top-K allocation over the current rates), capped
     by what the request may still emit and by its share of the engine's row budget (`max_rows`, row_shares);
     then cut_at_violation (scheme C) for drafts that left the grammar;
  2. one target forward over the packed rows [x0, d_1 .. d_l] of every request (logit_rows = l + 1), then
     dspark.update_draft_keys;
  3. grammar masks for every verify row in one batched `grammars.fill_masks(matchers, drafts)` call, the
     processed target q per row (mask -> temperature -> top-k -> top-p; greedy one-hot);
  4. `speculative.verify` (rejection rule, residual, bonus, greedy argmax agreement, stop / max_tokens cuts);
  5. each cache rolls back its rejected rows; the caller commits the tokens (matchers accept them, stop checks)
     through `commit(i, tokens, finish_code) -> still_running`;
  6. the next block for every request still running: `dspark.draft` (or the target itself, "self" drafter) with a
     `grammar_drafting.MaskedDraftSampler` built on the committed matchers (mask_drafts / force_tokens switches),
     plus forced-token chains past n; with SpecConfig(draft_masks="automaton") and a TokenAutomaton on every
     constrained sequence, automaton_drafting.AutomatonDraftSampler instead (masks on the device, one host sync
     per block; the committed automaton state is walked on the host in cache.extra["automaton_state"]).
     The block is kept in `cache.extra["spec"]`, so a preempted request (new cache) simply starts without drafts.
Every random draw is counter-based (request seed, absolute position): outputs do not depend on the batch.
Losslessness rests on S's modules (tests/engine/test_spec_*.py); tests/engine/test_spec_engine.py checks the
wiring on the tiny V4.1 model: greedy identical to plain decoding for every mode, with and without constraints.

Drafters: "dspark" = the model's own DSpark layers (engine/dspark.py; random weights -> low acceptance);
"self" = the target's own distribution at the drafted prefix (the target is run on the drafts one position at a
time on the same cache, then rolled back): acceptance ~1 for greedy, a benchmark device that exercises the
scheduler at high acceptance; its drafting time is the target's, so benchmarks report it apart.

Cost per step: one target forward over sum(l_r + 1) rows, one fill_masks walk (CPU, constrained requests only),
O(rows * V) verification, then the drafter (DSpark: one n-slot backbone pass + n Markov steps with one host
round trip each; self: n target decode steps).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from . import dspark
from . import grammar_drafting as GD
from . import speculative as SP
from . import verify_schedule as VS

SCHEDULES = ("off", "fixed", "sync", "async")
DRAFTERS = ("dspark", "self")
DRAFT_MASKS = ("cpu", "automaton")


@dataclass
class SpecConfig:
    """Speculative decoding options (`LLM(..., speculative=SpecConfig(...))`)."""
    n: int = 5                        # drafts per block (DSpark's gamma)
    schedule: str = "sync"            # "off" | "fixed" | "sync" | "async"
    drafter: str = "dspark"           # "dspark" | "self" (the target's own distribution: benchmarks)
    mask_drafts: bool = True          # mechanism 1: the drafter samples under the grammar mask
    force_tokens: bool = True         # mechanism 2: single-token grammar states are free drafts (p = 1, c = 1)
    cut: bool = True                  # mechanism 3: cut the block at the first ungrammatical draft (forced reject)
    grammar_schedule: bool = True     # mechanism 4: forced positions certain, useless positions never scheduled
    max_forced_extension: int = 4     # forced-token chains may extend a block this far past n
    step_times: Optional[dict] = None  # {rows: seconds}; None: profiled at start-up (profile_time_model)
    conf_temperature: float = 1.0     # DSpark confidence-head temperature (STS), one value or one per position
    draft_masks: str = "cpu"          # where masked drafting gets its masks: "cpu" (the matchers, one host sync
                                      # per draft position) | "automaton" (SpecSequence.automaton on the device,
                                      # one sync per block; requests without one fall back to "cpu")
    automaton_limits: object = None   # engine.automata.AutomatonLimits for the engine's automaton builds (None:
                                      # its defaults: 256 MiB of tables, 60 s and 8 GiB for the index)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"SpecConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"SpecConfig.drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.n < 1:
            raise ValueError(f"SpecConfig.n must be >= 1, got {self.n}")
        if self.draft_masks not in DRAFT_MASKS:
            raise ValueError(f"SpecConfig.draft_masks must be one of {DRAFT_MASKS}, got {self.draft_masks!r}")


@dataclass
class SpecSequence:
    """One running request as the speculative step sees it (x0 is committed but not yet in the cache)."""
    cache: object                     # the model's SequenceCache (length = tokens before x0)
    last_token: int                   # x0
    seed: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    matcher: object = None            # committed grammar state after x0 (None: unconstrained)
    stop_token_ids: Sequence[int] = ()
    max_new_tokens: int = 1 << 30     # tokens this request may still emit (>= 1)
    automaton: object = None          # token_automaton.TokenAutomaton of the constraint (draft_masks="automaton");
                                      # its state after x0 lives in cache.extra["automaton_state"]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class _Block:
    """One request's draft block (made after its current x0), kept in cache.extra["spec"]."""
    tokens: torch.Tensor       # long [L] (CPU)
    probs: torch.Tensor        # [L, V] proposals (drafter device)
    confidences: torch.Tensor  # float64 [L]
    forced: torch.Tensor       # bool [L]
    valid: int                 # leading grammatical drafts
    prev_rates: Optional[torch.Tensor] = None  # cumulative rates of the block verified one step earlier (async)


@dataclass
class SpecStats:
    steps: int = 0
    request_steps: int = 0
    committed: int = 0
    verify_rows: int = 0
    drafts_made: int = 0
    drafts_verified: int = 0
    drafts_accepted: int = 0
    verified_at: list = field(default_factory=list)   # per draft position: times verified
    accepted_at: list = field(default_factory=list)   # per draft position: times accepted
    forward_s: float = 0.0
    mask_s: float = 0.0
    verify_s: float = 0.0
    drafter_s: float = 0.0
    automaton_blocks: int = 0         # draft blocks whose masks came from a device automaton

    @property
    def mean_accepted_length(self) -> float:
        """Committed tokens per request per step (accepted drafts + the final token)."""
        return self.committed / max(1, self.request_steps)

    @property
    def rows_per_token(self) -> float:
        return self.verify_rows / max(1, self.committed)

    @property
    def rows_per_step(self) -> float:
        return self.verify_rows / max(1, self.steps)

    def acceptance_per_position(self) -> list:
        return [a / v if v else float("nan") for a, v in zip(self.accepted_at, self.verified_at)]

    def summary(self) -> dict:
        return dict(steps=self.steps, mean_accepted_length=self.mean_accepted_length,
                    rows_per_token=self.rows_per_token, rows_per_step=self.rows_per_step,
                    acceptance_per_position=self.acceptance_per_position(), forward_s=self.forward_s,
                    mask_s=self.mask_s, verify_s=self.verify_s, drafter_s=self.drafter_s)


# --------------------------------------------------------------------------------------------- helpers
def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, rows: Optional[tuple] = None) -> torch.Tensor:
    """The distribution a request samples from, per row of already-masked fp32 logits [R, V]: temperature, then
    top-k, then top-p (smallest prefix of the sorted probabilities whose mass reaches top_p); greedy rows
    (temperature < 1e-5) one-hot at the argmax (lowest id on ties); rows with nothing allowed are all zeros.
    rows: optional (filtered row indices, greedy row indices) as device tensors, from the host parameters
    (`filter_and_greedy_rows`): then nothing here waits for the device (the drafting loop calls this per
    position). Cost: one sort per row when a row uses top-k or top-p."""
    R, V = logits.shape
    dev = logits.device
    temperature, top_k, top_p = temperature.to(dev), top_k.to(dev), top_p.to(dev)
    greedy = temperature < 1e-5
    dead = torch.isneginf(logits.max(-1).values) | torch.isnan(logits.max(-1).values)
    x = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature).float().unsqueeze(-1)
    probs = torch.softmax(x, -1)
    filt = (~greedy) & ((top_k > 0) | (top_p < 1.0))
    if rows is not None:
        filt_idx, greedy_idx = rows
    else:
        filt_idx = torch.nonzero(filt).flatten() if bool(filt.any()) else None
        greedy_idx = torch.nonzero(greedy).flatten() if bool(greedy.any()) else None
    if filt_idx is not None and filt_idx.numel():
        idx = filt_idx
        p, order = torch.sort(probs[idx], dim=-1, descending=True, stable=True)
        rank = torch.arange(V, device=dev)
        k = torch.where(top_k[idx] > 0, top_k[idx], torch.full_like(top_k[idx], V))
        keep = rank.unsqueeze(0) < k.unsqueeze(-1)
        p = p * keep
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        cum = p.cumsum(-1)
        keep &= (cum - p) < top_p[idx].to(p.dtype).unsqueeze(-1)
        p = p * keep
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        probs[idx] = torch.zeros_like(p).scatter(1, order, p)
    if greedy_idx is not None and greedy_idx.numel():
        g = greedy_idx
        probs[g] = torch.nn.functional.one_hot(logits[g].argmax(-1), V).to(probs.dtype)
    return torch.where(dead.unsqueeze(-1), torch.zeros_like(probs), probs)


def row_shares(num_requests: int, max_rows: int) -> torch.Tensor:
    """Drafts each request may verify when a step may use at most `max_rows` target rows: every request keeps
    its x0 row, the rest is split evenly (the first requests get the remainder). A function of the batch size
    and the budget only, never of a draft: like the max_tokens cap it is a constant verify-length bound, so
    verification stays lossless (a share computed from other requests' schedules would not be: the joint
    schedulers read every request's rates, which depend on its drafts)."""
    spare = max(0, int(max_rows) - num_requests)
    share = torch.full((num_requests,), spare // max(1, num_requests), dtype=torch.long)
    share[:spare % max(1, num_requests)] += 1
    return share


def pending_draft_rows(cache) -> int:
    """Verify rows past x0 that the next speculative step of this cache's request may run (its stored draft
    block's length; 0 without one): what a token budget should charge on top of the decode row."""
    block = cache.extra.get("spec") if cache is not None else None
    return int(block.tokens.numel()) if isinstance(block, _Block) else 0


def filter_and_greedy_rows(seqs: Sequence[SpecSequence], device) -> tuple:
    """(rows using top-k / top-p, greedy rows) as device index tensors, from the host parameters (the same
    rows processed_probs would find on the device, without waiting for it)."""
    filt = [i for i, s in enumerate(seqs) if not s.greedy and (int(s.top_k) > 0 or float(s.top_p) < 1.0)]
    greedy = [i for i, s in enumerate(seqs) if s.greedy]
    return (torch.tensor(filt, dtype=torch.long, device=device), torch.tensor(greedy, dtype=torch.long, device=device))


def _row_params(seqs: Sequence[SpecSequence], device):
    t = torch.tensor([s.temperature for s in seqs], dtype=torch.float32, device=device)
    k = torch.tensor([int(s.top_k) for s in seqs], dtype=torch.long, device=device)
    p = torch.tensor([float(s.top_p) for s in seqs], dtype=torch.float32, device=device)
    return t, k, p


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[k]] masked by bitmask[k] (helper D's kernel: Triton on CUDA, torch twin on CPU)."""
    from deepinfer_sg.kernels import apply_token_bitmask_inplace
    dev = logits.device
    apply_token_bitmask_inplace(logits, bitmask.to(dev).contiguous(), indices=rows.to(dev),
                                mask_rows=torch.arange(rows.numel(), device=dev))


def profile_time_model(model, chunk_type, sizes: Sequence[int], rows_per_seq: int,
                       prompt_len: int = 16, repeats: int = 3) -> VS.StepTimeModel:
    """Start-up profile: time a target forward over `rows` verify rows (sequences of `rows_per_seq` rows on
    dummy caches holding `prompt_len` tokens) for each size, rolled back after each run."""
    caches = []
    dev = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    max_seqs = -(-max(sizes) // rows_per_seq)
    ids = torch.arange(prompt_len, device=dev) % model.config.vocab_size
    for _ in range(max_seqs):
        c = model.new_cache()
        model.forward_step([chunk_type(c, ids, 1)])
        caches.append(c)

    def run(rows: int):
        chunks, left = [], rows
        for c in caches:
            k = min(left, rows_per_seq)
            if k <= 0:
                break
            chunks.append(chunk_type(c, ids[:k], k))
            left -= k
        model.forward_step(chunks)
        for ch in chunks:
            ch.cache.rollback(int(ch.token_ids.numel()))

    return VS.profile_step_times(run, sizes, warmup=1, repeats=repeats, synchronize=sync)


def default_profile_sizes(max_rows: int) -> list:
    """1, 2, 4, then multiples of 8 (DeepInfer's CUDA-graph buckets), thinned to at most ~24 sizes."""
    sizes = [s for s in (1, 2, 4) if s < max_rows]
    step = max(8, ((max_rows // 20) + 7) // 8 * 8)
    sizes += list(range(8, max_rows, step)) + [max_rows]
    return sorted(set(sizes))


# --------------------------------------------------------------------------------------------- the decoder
class SpecDecoder:
    """Runs speculative decode steps for one model. Stateless across requests except the per-request blocks
    (in cache.extra["spec"]), the step-time model and the stats."""

    def __init__(self, model, config: SpecConfig, time_model: Optional[VS.StepTimeModel] = None,
                 chunk_type=None, vocab_size: Optional[int] = None, ids_on_host: bool = False):
        self.model = model
        self.config = config
        # the V4 model uploads a step's token ids with its positions in one pinned copy; ids already on the GPU
        # would move the caches' recent tokens there and bring back a range-check and an Engram sync per step
        self.ids_on_host = ids_on_host
        self.vocab_size = vocab_size or model.config.vocab_size
        if chunk_type is None:
            from .model import StepChunk as chunk_type
        self.chunk_type = chunk_type
        if config.drafter == "dspark" and getattr(model, "mtp", None) is None:
            raise ValueError("SpecConfig(drafter='dspark') needs a model with DSpark draft layers "
                             "(num_nextn_predict_layers > 0); use drafter='self' otherwise")
        max_rb = int(getattr(model, "max_rollback", 16))
        if config.n + 1 > max_rb:
            raise ValueError(f"SpecConfig.n = {config.n} needs a cache rollback of n + 1 = {config.n + 1} rows; "
                             f"the model allows {max_rb}")
        self.max_extra = max(0, min(config.max_forced_extension, max_rb - 1 - config.n)) if config.force_tokens else 0
        self.max_block = config.n + self.max_extra
        self.time_model = time_model
        if self.time_model is None and config.step_times is not None:
            self.time_model = VS.StepTimeModel.from_table(config.step_times)
        self.stats = SpecStats(verified_at=[0] * self.max_block, accepted_at=[0] * self.max_block)

    def ensure_time_model(self, max_seqs: int) -> None:
        """Profile the step-time curve once (sync / async modes) if no table was given."""
        if self.time_model is None and self.config.schedule in ("sync", "async"):
            rows = max_seqs * (self.max_block + 1)
            self.time_model = profile_time_model(self.model, self.chunk_type, default_profile_sizes(rows),
                                                 self.config.n + 1)

    # ---------------------------------------------------------------- scheduling
    def _schedule(self, seqs, blocks, max_rows: Optional[int] = None):
        cfg = self.config
        R = len(seqs)
        L = max([b.tokens.numel() for b in blocks if b is not None] + [0])
        tokens = torch.full((R, L), -1, dtype=torch.long)
        conf = torch.zeros(R, L, dtype=torch.float64)
        forced = torch.zeros(R, L, dtype=torch.bool)
        lengths = torch.zeros(R, dtype=torch.long)
        valid = torch.zeros(R, dtype=torch.long)
        prev = torch.zeros(R, L, dtype=torch.float64)
        for i, b in enumerate(blocks):
            if b is None:
                continue
            n = b.tokens.numel()
            tokens[i, :n], conf[i, :n], forced[i, :n] = b.tokens, b.confidences, b.forced
            lengths[i], valid[i] = n, b.valid
            if b.prev_rates is not None:
                k = min(n, b.prev_rates.numel())
                prev[i, :k] = b.prev_rates[:k]
            else:
                prev[i, :n] = 1.0          # no history: count every draft it will have
        if cfg.grammar_schedule:
            stops = [list(s.stop_token_ids) for s in seqs]
            width = max([len(s) for s in stops] + [1])
            stop_t = torch.tensor([s + [-1] * (width - len(s)) for s in stops], dtype=torch.long)
            conf = VS.grammar_confidences(conf, forced=forced, valid_lengths=valid if cfg.cut else None,
                                          draft_tokens=tokens, stop_token_ids=stop_t)
        rates = VS.cumulative_rates(conf, lengths)
        if cfg.schedule == "off" or L == 0:
            lens = torch.zeros(R, dtype=torch.long)
        elif cfg.schedule == "fixed":
            lens = VS.schedule_fixed(lengths)
        elif cfg.schedule == "sync":
            lens = VS.schedule_sync(rates, self.time_model)
        else:
            lens = VS.schedule_async(prev, rates, self.time_model)
        # never verify past what the request may still emit (depends on no draft: lossless)
        cap = torch.tensor([max(0, s.max_new_tokens - 1) for s in seqs], dtype=torch.long)
        lens = torch.minimum(torch.minimum(lens, lengths), cap)
        if max_rows is not None:      # the engine's token budget: a fixed share per request (depends on no draft)
            lens = torch.minimum(lens, row_shares(R, max_rows))
        forced_reject = torch.zeros(R, dtype=torch.bool)
        if cfg.cut:
            lens, forced_reject = GD.cut_at_violation(lens, valid)
        return tokens, lens, forced_reject, rates

    # ---------------------------------------------------------------- one step
    @torch.no_grad()
    def step(self, seqs: Sequence[SpecSequence], commit: Callable[[int, list, int], bool],
             max_rows: Optional[int] = None, extra_chunks: Sequence = ()) -> Optional[torch.Tensor]:
        """One speculative decode step for `seqs` (see the module docstring). commit(i, tokens, finish) must
        append the tokens to request i (matcher accepts them in order, stop checks) and return whether the
        request is still running; `finish` is speculative.FINISH_* from verification (stop / length cut, or
        FINISH_ERROR when the grammar allowed no token). max_rows: the most target rows this step's verify
        forward may use (the engine's token budget left for it; at least one row per request): each request
        verifies at most `row_shares(R, max_rows)[i]` drafts.
        extra_chunks: other model chunks of the engine's step (prefill chunks of other requests), run in the same
        target forward after the verify rows (their caches advance too); returns their logits rows (chunk order,
        each chunk's `logit_rows`), None without extra chunks."""
        if not seqs:
            return self._forward_only(extra_chunks) if extra_chunks else None
        model, V = self.model, self.vocab_size
        dev = model.device
        t0 = time.perf_counter()
        blocks = [s.cache.extra.get("spec") for s in seqs]
        blocks = [b if isinstance(b, _Block) else None for b in blocks]
        if self.time_model is None:
            self.ensure_time_model(max(8, len(seqs)))
        tokens, lens, forced_reject, rates = self._schedule(seqs, blocks, max_rows)
        R, L = tokens.shape
        probs = None
        if L:
            probs = torch.zeros(R, L, V, device=dev)
            for i, b in enumerate(blocks):
                if b is not None and b.tokens.numel():
                    probs[i, :b.tokens.numel()] = b.probs.to(dev)
        row_tokens, row_probs, counts = SP.pack_verify_rows(tokens, probs, lens, forced_reject)
        if row_probs is None:
            row_probs = torch.zeros(int(counts.sum()), V, device=dev)

        # target forward over [x0, d_1 .. d_l]
        t1 = time.perf_counter()
        chunks, flat = [], []
        for i, s in enumerate(seqs):
            flat += [s.last_token] + tokens[i, :int(lens[i])].tolist()
        flat_t = torch.tensor(flat, dtype=torch.long)
        if not self.ids_on_host:
            flat_t = flat_t.to(dev)                                  # one host-to-device copy per step
        at = 0
        for i, s in enumerate(seqs):
            l = int(lens[i])
            chunks.append(self.chunk_type(s.cache, flat_t[at:at + l + 1], l + 1))
            at += l + 1
        n_verify = at
        chunks += list(extra_chunks)
        out = model.forward_step(chunks)
        if getattr(model, "mtp", None) is not None and out.draft_features is not None:
            dspark.update_draft_keys(model, chunks, out.draft_features)
        extra_logits = out.logits[n_verify:] if extra_chunks else None
        logits = out.logits[:n_verify].float()

        # grammar masks for every verify row (while the forward may still run on the device)
        t2 = time.perf_counter()
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        starts = torch.cumsum(counts, 0) - counts
        mask_error = {}
        if constrained:
            from deepinfer_sg.grammars import fill_masks
            drafts = [tokens[i, :int(lens[i])].tolist() for i in constrained]
            valid_counts: list = []
            try:
                # the committed matchers themselves: fill_masks walks drafts on private copies and leaves every
                # matcher as it was (grammars contract, tests/grammars/test_grammar_fill_masks_state.py; the
                # engine tests check the final matcher states against plain decoding)
                bm = fill_masks([seqs[i].matcher for i in constrained], drafts, valid_counts=valid_counts)
            except Exception:   # fall back request by request: one broken matcher fails only itself
                bm, valid_counts = self._fill_one_by_one(seqs, constrained, drafts, mask_error)
            rows, r = [], 0
            for j, i in enumerate(constrained):
                n = len(drafts[j])
                # rows after the first ungrammatical draft: verification rejects at or before it, leave them
                # unmasked (an all-zero row would only make NaNs)
                bm[r + valid_counts[j] + 1: r + n + 1] = -1
                rows.extend(range(int(starts[i]), int(starts[i]) + n + 1))
                r += n + 1
            _apply_bitmask(logits, bm, torch.tensor(rows, dtype=torch.long))
        t3 = time.perf_counter()
        temp, topk, topp = _row_params(seqs, dev)
        q = processed_probs(logits, temp[torch.repeat_interleave(torch.arange(R), counts).to(dev)],
                            topk[torch.repeat_interleave(torch.arange(R), counts).to(dev)],
                            topp[torch.repeat_interleave(torch.arange(R), counts).to(dev)])
        stops = [list(s.stop_token_ids) for s in seqs]
        width = max([len(x) for x in stops] + [1])
        batch = SP.VerifyBatch(
            target_probs=q, draft_probs=row_probs.to(q.dtype), row_draft_tokens=row_tokens.to(dev),
            row_counts=counts.to(dev), seeds=torch.tensor([s.seed & ((1 << 63) - 1) for s in seqs], device=dev),
            positions=torch.tensor([s.cache.length - int(lens[i]) for i, s in enumerate(seqs)], device=dev),
            greedy=torch.tensor([s.greedy for s in seqs], device=dev),
            stop_token_ids=torch.tensor([x + [-1] * (width - len(x)) for x in stops], dtype=torch.long, device=dev),
            max_new_tokens=torch.tensor([max(1, s.max_new_tokens) for s in seqs], device=dev))
        res = SP.verify(batch)
        n_acc = res.num_accepted.cpu().tolist()
        n_com = res.num_committed.cpu().tolist()
        fin = res.finish.cpu().tolist()
        toks = res.tokens.cpu()
        rollback = res.cache_rollback.cpu().tolist()
        t4 = time.perf_counter()

        # roll back rejected rows, commit, bookkeeping
        alive = []
        st = self.stats
        st.steps += 1
        st.request_steps += R
        st.verify_rows += int(counts.sum())
        for i, s in enumerate(seqs):
            s.cache.rollback(rollback[i])
            l = int(lens[i])
            st.drafts_verified += l
            st.drafts_accepted += n_acc[i]
            for j in range(l):
                st.verified_at[j] += 1
                st.accepted_at[j] += j < n_acc[i]
            committed = toks[i, :n_com[i]].tolist()
            st.committed += len(committed)
            if i in mask_error:
                commit(i, [], SP.FINISH_ERROR)
                continue
            if commit(i, committed, fin[i]):
                alive.append(i)
                if s.automaton is not None and "automaton_state" in s.cache.extra:
                    s.cache.extra["automaton_state"] = s.automaton.walk(s.cache.extra["automaton_state"], committed)
        st.forward_s += t2 - t1
        st.mask_s += t3 - t2
        st.verify_s += t4 - t3

        # the next block for every request still running; its rates come along for the async budget
        for i in range(R):
            if i not in alive:
                seqs[i].cache.extra.pop("spec", None)
        if alive and self.config.schedule != "off":
            a_seqs = [seqs[i] for i in alive]
            new_blocks = self.draft(a_seqs)
            for i, b in zip(alive, new_blocks):
                old = blocks[i]
                b.prev_rates = rates[i, :old.tokens.numel()].clone() if old is not None else None
                seqs[i].cache.extra["spec"] = b
        if self.time_model is not None and not extra_chunks:
            # forward time at this row count; everything else of the step (scheduling, masks, verification,
            # drafting: DeepInfer's "sampler time", paid whatever the verify lengths) at this batch size (not
            # observed when prefill chunks rode along: that forward's time is not a function of the verify rows)
            self.time_model.observe(R, int(counts.sum()), t2 - t1, time.perf_counter() - t0 - (t2 - t1))
        return extra_logits

    def _forward_only(self, chunks) -> torch.Tensor:
        out = self.model.forward_step(list(chunks))
        if getattr(self.model, "mtp", None) is not None and out.draft_features is not None:
            dspark.update_draft_keys(self.model, list(chunks), out.draft_features)
        return out.logits

    def _fill_one_by_one(self, seqs, constrained, drafts, errors):
        from deepinfer_sg.grammars import fill_masks
        words = (self.vocab_size + 31) // 32
        parts, counts = [], []
        for j, i in enumerate(constrained):
            vc: list = []
            try:
                parts.append(fill_masks([seqs[i].matcher], [drafts[j]], valid_counts=vc))
                counts.append(vc[0])
            except Exception as exc:
                errors[i] = f"grammar mask failed: {type(exc).__name__}: {exc}"
                parts.append(torch.full((len(drafts[j]) + 1, words), -1, dtype=torch.int32))
                counts.append(len(drafts[j]))
        return torch.cat(parts), counts

    # ---------------------------------------------------------------- drafting
    def draft(self, seqs: Sequence[SpecSequence]) -> list:
        """Draft blocks after each sequence's x0 (= last_token, the golden token; its cache ends before it)."""
        cfg = self.config
        t0 = time.perf_counter()
        dev = self.model.device
        temp, topk, topp = _row_params(seqs, dev)
        rows = filter_and_greedy_rows(seqs, dev)      # host-known: the per-position calls never wait on the device

        def to_probs(logits):
            return processed_probs(logits, temp, topk, topp, rows)

        seeds = torch.tensor([s.seed & ((1 << 63) - 1) for s in seqs])
        positions = torch.tensor([s.cache.length + 1 for s in seqs])
        stops = [list(s.stop_token_ids) for s in seqs]
        automaton = _shared_automaton(seqs) if cfg.draft_masks == "automaton" and cfg.mask_drafts else None
        if automaton is not None:
            from .automaton_drafting import AutomatonDraftSampler
            states = torch.tensor([s.cache.extra["automaton_state"] if s.matcher is not None else automaton.initial
                                   for s in seqs])
            sampler = AutomatonDraftSampler([s.matcher for s in seqs], automaton, states, seeds, positions,
                                            self.vocab_size, to_probs=to_probs, force_tokens=cfg.force_tokens,
                                            stop_token_ids=stops)
            self.stats.automaton_blocks += len(seqs)
        else:
            sampler = GD.MaskedDraftSampler(
                [s.matcher for s in seqs], seeds, positions, self.vocab_size, to_probs=to_probs,
                mask_drafts=cfg.mask_drafts, force_tokens=cfg.force_tokens, stop_token_ids=stops)
        golden = torch.tensor([s.last_token for s in seqs], dtype=torch.long, device=dev)
        confidences = None
        if cfg.drafter == "dspark":
            result = dspark.draft(self.model, [s.cache for s in seqs], golden, sampler, cfg.n,
                                  conf_temperature=cfg.conf_temperature)
            confidences = result.confidences
        else:
            self._self_draft(seqs, golden, sampler)
        if self.max_extra:
            sampler.extend_forced(self.max_extra)
        block = sampler.finish(confidences)
        if cfg.drafter == "self":
            # the proposal IS the target's distribution at that prefix: expected acceptance sum min(p, q) = 1
            # (up to the grammar mass an unmasked drafter ignores, which a grammar-agnostic head cannot see
            # either). A constant: never a function of the draft it admits.
            present = torch.arange(block.tokens.shape[1]).unsqueeze(0) < block.lengths.unsqueeze(-1)
            block.confidences = present.to(torch.float64)
        self.stats.drafter_s += time.perf_counter() - t0
        out = []
        for i in range(len(seqs)):
            n = int(block.lengths[i])
            self.stats.drafts_made += n
            out.append(_Block(block.tokens[i, :n].clone(), block.probs[i, :n].clone(),
                              block.confidences[i, :n].clone(), block.forced[i, :n].clone(),
                              int(block.valid_lengths[i])))
        return out

    def _self_draft(self, seqs, golden, sampler):
        """The target drafts for itself: run it on the drafted prefix one position at a time (same caches),
        sampling each position with `sampler`; the caches are rolled back afterwards."""
        model = self.model
        prev = golden
        fed = 0
        for k in range(self.config.n):
            chunks = [self.chunk_type(s.cache, prev[i:i + 1].clamp_min(0), 1) for i, s in enumerate(seqs)]
            out = model.forward_step(chunks)
            if getattr(model, "mtp", None) is not None and out.draft_features is not None:
                dspark.update_draft_keys(model, chunks, out.draft_features)
            fed += 1
            prev, _ = sampler(out.logits.float(), k)
            if not any(sampler.active):
                break
        for s in seqs:
            s.cache.rollback(fed)


def _shared_automaton(seqs):
    """The one automaton every constrained sequence drafts with, if there is one (each with a known state);
    else None: the batch drafts on CPU masks."""
    found = None
    for s in seqs:
        if s.matcher is None:
            continue
        a = s.automaton
        if a is None or "automaton_state" not in s.cache.extra or (found is not None and a is not found):
            return None
        found = a
    return found


# --------------------------------------------------------------------------------------------- standalone driver
@dataclass
class StandaloneRequest:
    """A request for `generate` (tests and benchmarks that drive the model without the engine)."""
    prompt: list
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    matcher: object = None
    automaton: object = None           # TokenAutomaton of the constraint (SpecConfig.draft_masks="automaton")
    output: list = field(default_factory=list)
    finish: Optional[str] = None       # "stop" | "length" | "constraint_complete" | "error"
    error: Optional[str] = None


def _commit_standalone(req: StandaloneRequest, tokens: list, finish: int) -> bool:
    """The engine's commit rules in miniature: matcher accepts each token, stop ids, max_tokens."""
    for t in tokens:
        if req.matcher is not None:
            if not req.matcher.accept(t):
                req.finish, req.error = "error", f"the matcher rejected committed token {t}"
                return False
        req.output.append(t)
        if req.matcher is not None and req.matcher.is_terminated():
            req.finish = "constraint_complete"
            return False
        if t in req.stop_token_ids:
            req.finish = "stop"
            return False
        if len(req.output) >= req.max_tokens:
            req.finish = "length"
            return False
    if finish == SP.FINISH_ERROR:
        req.finish, req.error = "error", "the constraint allows no token here"
        return False
    return True


def generate(model, requests: Sequence[StandaloneRequest], config: SpecConfig,
             decoder: Optional[SpecDecoder] = None, max_rows: Optional[int] = None) -> SpecDecoder:
    """Prefill every request (one batched forward, first token sampled through `verify` with no drafts), draft,
    then speculative steps until all finish (each under `max_rows` verify rows, see SpecDecoder.step). Fills
    each request's output / finish. Returns the decoder (stats)."""
    decoder = decoder or SpecDecoder(model, config)
    decoder.ensure_time_model(len(requests))
    dev = model.device
    caches = [model.new_cache() for _ in requests]
    with torch.no_grad():
        chunks = [decoder.chunk_type(c, torch.tensor(r.prompt, dtype=torch.long, device=dev), 1)
                  for c, r in zip(caches, requests)]
        out = model.forward_step(chunks)
        if getattr(model, "mtp", None) is not None and out.draft_features is not None:
            dspark.update_draft_keys(model, chunks, out.draft_features)
        # first token: the last prompt row, masked, processed, drawn as a bonus row (l = 0)
        logits = out.logits.float()
        words = (decoder.vocab_size + 31) // 32
        cons = [i for i, r in enumerate(requests) if r.matcher is not None]
        if cons:
            bm = torch.full((len(cons), words), -1, dtype=torch.int32)
            for j, i in enumerate(cons):
                requests[i].matcher.fill_mask(bm, j)
            _apply_bitmask(logits, bm, torch.tensor(cons))
        seqs = [SpecSequence(c, -1, r.seed, r.temperature, r.top_k, r.top_p, r.matcher, tuple(r.stop_token_ids),
                             r.max_tokens, automaton=r.automaton) for c, r in zip(caches, requests)]
        temp, topk, topp = _row_params(seqs, dev)
        q = processed_probs(logits, temp, topk, topp)
        R = len(requests)
        res = SP.verify(SP.VerifyBatch(q, torch.zeros_like(q), torch.full((R,), SP.FRESH, device=dev),
                                       torch.ones(R, dtype=torch.long, device=dev),
                                       seeds=torch.tensor([s.seed & ((1 << 63) - 1) for s in seqs], device=dev),
                                       positions=torch.tensor([c.length for c in caches], device=dev),
                                       greedy=torch.tensor([s.greedy for s in seqs], device=dev)))
        first = res.tokens[:, 0].cpu().tolist()
        running = []
        for i, r in enumerate(requests):
            if _commit_standalone(r, [first[i]] if first[i] >= 0 else [],
                                  SP.FINISH_ERROR if first[i] < 0 else SP.FINISH_NONE):
                running.append(i)
                if r.automaton is not None:
                    caches[i].extra["automaton_state"] = r.automaton.walk(r.automaton.initial, r.output)
        if running and config.schedule != "off":
            for i, b in zip(running, decoder.draft([_refresh(seqs[i], requests[i]) for i in running])):
                caches[i].extra["spec"] = b
        while running:
            batch = [_refresh(seqs[i], requests[i]) for i in running]
            still = []

            def commit(j, tokens, finish):
                ok = _commit_standalone(requests[running[j]], tokens, finish)
                if ok:
                    still.append(running[j])
                    _refresh(seqs[running[j]], requests[running[j]])
                return ok

            decoder.step(batch, commit, max_rows=max_rows)
            running = still
    return decoder


def _refresh(seq: SpecSequence, req: StandaloneRequest) -> SpecSequence:
    seq.last_token = req.output[-1]
    seq.max_new_tokens = req.max_tokens - len(req.output)
    return seq
