"""Grammar-aware drafting: drafts made grammatical before verification, losslessly.

Four mechanisms (docs/dspark-and-constraints.md §5.10), each keeping the output law equal to the
grammar-masked target's:
1. Masked drafting (`MaskedDraftSampler(mask_drafts=True)`): the drafter's sequential Markov loop samples
   position k from its distribution masked by the grammar state after x0, d_1..d_{k-1}, p'_k = p_k * 1_S /
   p_k(S); the masked p'_k is the proposal stored for verification. Drafts are always grammatical and,
   since q is zero off S, sum min(p', q) >= sum min(p, q): acceptance can only rise. If the drafter puts no
   mass on S, p' is uniform over S (any proposal is lossless as long as the draft is sampled from it).
2. Forced tokens as free drafts (`force_tokens=True`): where the mask allows exactly one token t, the draft
   is t with proposal delta(t) and confidence 1; the target (masked: q = delta(t)) accepts it with
   certainty. `extend_forced` appends chains of forced tokens past the drafter's n positions.
3. Cut at the first violation (`first_violations` + `cut_at_violation`), for drafts sampled without masks
   (or with stale masks): rows after the first ungrammatical draft d_v are never computed; if the
   scheduler admitted d_v, the row that verifies it becomes a FORCED_REJECT row (speculative.py): its
   token is drawn from the residual max(q - p_v, 0), exactly what verifying d_v would give (q(d_v) = 0 means
   certain rejection). Drawing it fresh from q instead (scheme B) is biased; the tests show it.
4. Scheduling hints: `forced` positions have confidence 1 and positions strictly after the first violation
   (or after a drafted stop token) get confidence 0 (verify_schedule.grammar_confidences). The violating
   draft's own entry keeps the drafter's confidence: its admission must not depend on its own value, and an
   admitted violating draft costs no row anyway (it becomes the forced rejection).

How masks reach the drafter: CPU matchers, one mask fill and one host round trip per draft position
(`MaskedDraftSampler.step`), or, for regular constraints, a token automaton on the device with one host sync per
block (engine/automaton_drafting.AutomatonDraftSampler, a subclass with the same math:
SpecConfig(draft_masks="automaton")). DSpark's heavy backbone never sees sampled drafts, so only the cheap
Markov loop runs per position. Options measured and the choice: benchmarks/mask_delivery.py.

Matchers follow the grammars protocol (fill_mask / accept / rollback / is_terminated / check_draft /
is_constrained / fork). A matcher that is None or not constrained (a Triggered constraint still waiting
for its trigger) leaves its positions unmasked but still tracks the drafts, so a trigger completed
mid-block masks the positions after it.

Integration (engine + drafter): the engine passes, per request, its committed matcher (state after the
anchor x0; the sampler forks it and never mutates it), the seed, the absolute position of d_1 and its
processed-distribution function. Then
    sampler = MaskedDraftSampler(matchers, seeds, positions, V, to_probs=..., mask_drafts=True, force_tokens=True)
    result = dspark.draft(model, caches, golden, sampler, n)      # the sampler is dspark's `Sampler`
    sampler.extend_forced(max_extra)                              # optional forced chain past n
    block = sampler.finish(result.confidences)                    # tokens, proposals, confidences, lengths
The drafter feeds the returned tokens back as the previous tokens of the next position (a request whose
block ended returns -1 and its later outputs are ignored), so a substituted forced token re-runs only the
Markov loop. The engine stores the block for the next step's scheduling and verification; it needs
`block.valid_lengths` for the cut (unmasked drafting) and `block.forced` for the scheduling rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .speculative import CASE_FRESH, DRAFT_SEED_OFFSET, counter_uniforms, sample_inverse_cdf


@dataclass
class DraftBlock:
    """One draft block per request. probs stay on the drafter's device; the rest is on the CPU (the
    scheduler and the matchers read them there)."""
    tokens: torch.Tensor        # long [R, L]: drafts, -1 padded
    probs: torch.Tensor         # float [R, L, V]: proposal each draft was sampled from (zeros when absent)
    confidences: torch.Tensor   # float64 [R, L]: conditional confidences (1 at forced positions, 0 when absent)
    forced: torch.Tensor        # bool [R, L]: grammar-forced positions (proposal delta)
    lengths: torch.Tensor       # long [R]: drafts per request
    valid_lengths: torch.Tensor  # long [R]: leading grammatical drafts (== lengths for masked drafting)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size] from an int32 bitmask [R, ceil(V/32)] (bit set = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].to(torch.bool)


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


class MaskedDraftSampler:
    """Per-position sampler for the drafter's sequential loop (mechanisms 1 and 2).

    matchers: one per request (None = unconstrained); seeds, positions: long [R] (position of d_1).
    to_probs: logits [R, V] -> the drafter's processed distribution (temperature/top-k/top-p; greedy
      requests one-hot); applied after the grammar mask. Default softmax.
    mask_drafts: mechanism 1. force_tokens: mechanism 2. With both off this is the plain DSpark drafter
      (drafts unmasked) that still records where the first violation happened (for the cut).
    stop_token_ids: a request's block ends after a drafted stop token.
    uniforms: explicit draw uniforms [R, positions] (exact-enumeration tests); default: counter RNG
      (seed + DRAFT_SEED_OFFSET, position, CASE_FRESH).
    Cost per position: one fill_mask + accept per constrained request (CPU), one [R, V] mask upload.
    """

    def __init__(self, matchers: Sequence, seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                 to_probs: Callable[[torch.Tensor], torch.Tensor] = _softmax, mask_drafts: bool = True,
                 force_tokens: bool = True, stop_token_ids: Optional[Sequence[Sequence[int]]] = None,
                 uniforms: Optional[torch.Tensor] = None):
        self.uniforms = uniforms             # explicit draw uniforms [R, positions] (tests); default counter RNG
        self.vocab_size = vocab_size
        self.n = len(matchers)
        self.walkers = [m.fork() if m is not None else None for m in matchers]
        self.seeds = seeds.to(torch.long)
        self.positions = positions.to(torch.long)
        self.to_probs = to_probs
        self.mask_drafts = mask_drafts
        self.force_tokens = force_tokens
        self.stops = [set(s) for s in stop_token_ids] if stop_token_ids is not None else [set()] * self.n
        self.active = [True] * self.n        # block still growing
        self.grammatical = [True] * self.n   # every draft so far accepted by the grammar
        self.valid = [0] * self.n            # leading grammatical drafts
        self.tokens, self.probs, self.forced = [], [], []
        self.words = (vocab_size + 31) // 32

    # -- grammar state of each request at the current position
    def _masks(self, device):
        """Fill the CPU bitmask rows of the requests that have a live constrained state and unpack them on
        `device`. Returns (allowed bool [R, V] or None when no request is masked, forced token or -1 [R],
        empty-mask [R]) as device tensors; no host synchronisation."""
        bitmask = torch.zeros(self.n, self.words, dtype=torch.int32)
        has_mask = [False] * self.n
        for i, w in enumerate(self.walkers):
            if not (self.mask_drafts or self.force_tokens):
                break                             # plain drafter: walk only (records the violation point)
            if w is None or not self.active[i] or not self.grammatical[i] or not w.is_constrained():
                continue
            w.fill_mask(bitmask, i)
            has_mask[i] = True
        none = torch.full((self.n,), -1, dtype=torch.long, device=device)
        if not any(has_mask):
            return None, none, torch.zeros(self.n, dtype=torch.bool, device=device)
        has = torch.tensor(has_mask, dtype=torch.bool).to(device)
        allowed = unpack_bitmask(bitmask.to(device), self.vocab_size) | ~has.unsqueeze(-1)
        count = allowed.sum(-1)
        forced_tok = torch.where(has & (count == 1), allowed.to(torch.int8).argmax(-1), none)
        return allowed, forced_tok, has & (count == 0)

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample the next draft of every request from the drafter's logits [R, V] (on any device; the
        probability math stays there, only the bitmask goes up and the tokens come down: one host sync).
        Returns long [R] on the logits' device (-1 for requests whose block has ended)."""
        k = len(self.tokens)
        dev = logits.device
        allowed, forced_tok, empty = self._masks(dev)
        logits = logits if logits.dtype == torch.float64 else logits.float()   # fp64 only in exact tests
        dtype = logits.dtype
        if self.mask_drafts and allowed is not None:
            probs = self.to_probs(logits.masked_fill(~allowed, float("-inf"))).to(dtype)
            total = probs.sum(-1, keepdim=True)
            bad = ~(total > 0) | ~torch.isfinite(total)     # drafter has no mass on S: uniform over S
            uniform = allowed.to(dtype) / allowed.to(dtype).sum(-1, keepdim=True).clamp_min(1)
            probs = torch.where(bad, uniform, probs / torch.where(bad, torch.ones_like(total), total))
        else:
            probs = self.to_probs(logits).to(dtype)
        is_forced = (forced_tok >= 0) & self.force_tokens
        if self.force_tokens and allowed is not None:     # forced rows: proposal delta(t)
            idx = forced_tok.clamp_min(0).unsqueeze(-1)
            keep = torch.gather(probs, 1, idx)
            probs = probs.masked_fill(is_forced.unsqueeze(-1), 0.0)
            probs = probs.scatter(1, idx, torch.where(is_forced.unsqueeze(-1), torch.ones_like(keep), keep))
        if self.uniforms is not None:
            u = self.uniforms[:, k].to(torch.float64).to(dev)
        else:
            u = self._counter_uniforms(k, dev)
        tok = sample_inverse_cdf(probs, u)
        active = self._active_now(dev) & ~empty
        tok = torch.where(active, tok, torch.full_like(tok, -1))
        self._record(tok, probs, is_forced & active)
        return tok

    def _counter_uniforms(self, k: int, device) -> torch.Tensor:
        """The draw uniforms of position k (counter RNG: seed + DRAFT_SEED_OFFSET, position of d_1 + k,
        CASE_FRESH), computed 16 positions at a time: one RNG evaluation instead of one per position."""
        cache = getattr(self, "_u_cache", None)
        if cache is None or k >= cache.shape[1] or cache.device != torch.device(device):
            start = 0 if cache is None or cache.device != torch.device(device) else cache.shape[1]
            width = max(16, k + 1 - start)
            pos = (self.positions.to(device).unsqueeze(-1) + start
                   + torch.arange(width, device=device).unsqueeze(0))
            seeds = (self.seeds.to(device) + DRAFT_SEED_OFFSET).unsqueeze(-1).expand_as(pos)
            more = counter_uniforms(seeds, pos, CASE_FRESH)
            cache = more if start == 0 else torch.cat([cache, more], 1)
            self._u_cache = cache
        return cache[:, k]

    def _active_now(self, device) -> torch.Tensor:
        """bool [R] on `device`: requests whose block is still growing."""
        return torch.tensor(self.active, dtype=torch.bool).to(device)

    def __call__(self, logits: torch.Tensor, step: int):
        """The DSpark drafter's sampler protocol (engine/dspark.py `Sampler`): (tokens [B] on the logits'
        device, None: the proposals stay here and come back with `finish`)."""
        if step != len(self.tokens):
            raise ValueError(f"MaskedDraftSampler: step {step} called after {len(self.tokens)} positions")
        return self.step(logits).to(logits.device), None

    def _record(self, tok: torch.Tensor, probs: torch.Tensor, forced: torch.Tensor):
        tok = tok.cpu()                           # the one host synchronisation of a draft position
        for i, t in enumerate(tok.tolist()):
            if t < 0:
                self.active[i] = False
                continue
            w = self.walkers[i]
            if w is not None and self.grammatical[i] and not w.accept(t):
                self.grammatical[i] = False       # unmasked draft left the grammar: the cut point
            if self.grammatical[i]:
                self.valid[i] += 1
            if t in self.stops[i] or (w is not None and self.grammatical[i] and w.is_terminated()):
                self.active[i] = False
        self.tokens.append(tok)
        self.probs.append(probs)                  # rows of ended requests are zeroed in finish()
        self.forced.append(forced.cpu())

    def extend_forced(self, max_extra: int) -> None:
        """Append grammar-forced tokens (delta proposals) while some request sits in a single-token state,
        up to `max_extra` positions past the drafted block (bounded by the engine's rollback limit)."""
        dev = self.probs[-1].device if self.probs else torch.device("cpu")
        dtype = self.probs[-1].dtype if self.probs else torch.float32
        for _ in range(max_extra):
            _, forced_tok, _ = self._masks(dev)
            forced_tok = torch.where(torch.tensor(self.active).to(dev), forced_tok, torch.full_like(forced_tok, -1))
            if not bool((forced_tok >= 0).any()):
                return
            for i in torch.nonzero(forced_tok < 0).flatten().tolist():
                self.active[i] = False            # a chain that breaks ends the block: no gaps in a block
            delta = torch.nn.functional.one_hot(forced_tok.clamp_min(0), self.vocab_size).to(dtype)
            self._record(forced_tok, delta, forced_tok >= 0)

    def finish(self, confidences: Optional[torch.Tensor] = None) -> DraftBlock:
        """The block. confidences [R, k] from the drafter's confidence head for its k sampled positions
        (None: 0.5 everywhere); forced positions (incl. the extension) get 1, absent positions 0."""
        L = len(self.tokens)
        tokens = torch.stack(self.tokens, 1) if L else torch.zeros(self.n, 0, dtype=torch.long)
        # a request's block is the prefix before its first -1
        present = torch.cumprod((tokens >= 0).to(torch.long), 1).to(torch.bool)
        tokens = torch.where(present, tokens, torch.full_like(tokens, -1))
        lengths = present.sum(1)
        probs = torch.stack(self.probs, 1) if L else torch.zeros(self.n, 0, self.vocab_size)
        probs = torch.where(present.unsqueeze(-1).to(probs.device), probs, torch.zeros_like(probs))
        forced = (torch.stack(self.forced, 1) if L else torch.zeros(self.n, 0, dtype=torch.bool)) & present
        conf = torch.full((self.n, L), 0.5, dtype=torch.float64)
        if confidences is not None:
            k = min(confidences.shape[1], L)
            conf[:, :k] = confidences[:, :k].to(torch.float64).cpu()
        conf = torch.where(forced, torch.ones_like(conf), conf)
        conf = torch.where(present, conf, torch.zeros_like(conf))
        valid = torch.minimum(torch.tensor(self.valid, dtype=torch.long), lengths)
        return DraftBlock(tokens, probs, conf, forced, lengths, valid)


def masked_draft_loop(logits_fn: Callable[[int, torch.Tensor], torch.Tensor], anchors: torch.Tensor, num_steps: int,
                      sampler: MaskedDraftSampler,
                      confidence_fn: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
                      max_forced_extension: int = 0) -> DraftBlock:
    """Reference sequential Markov loop: logits_fn(k, prev_tokens) -> corrected logits [R, V] of draft
    position k (prev = anchors for k = 0), confidence_fn(k, prev_tokens) -> [R] conditional confidence.
    The real drafter (engine/dspark.py) runs the same loop with its backbone outputs."""
    prev = anchors.to(torch.long)
    confs = []
    for k in range(num_steps):
        safe_prev = torch.where(prev >= 0, prev, torch.zeros_like(prev))
        if confidence_fn is not None:
            confs.append(confidence_fn(k, safe_prev).to(torch.float64))
        tok = sampler.step(logits_fn(k, safe_prev))
        prev = tok
    if max_forced_extension:
        sampler.extend_forced(max_forced_extension)
    return sampler.finish(torch.stack(confs, 1) if confs else None)


# --------------------------------------------------------------------------------------------- the cut
def first_violations(matchers: Sequence, draft_tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Leading grammatical drafts per request (matcher state = after the anchor; unchanged).
    Unconstrained requests (None) count all their drafts as valid."""
    out = []
    for i, m in enumerate(matchers):
        n = int(lengths[i])
        out.append(n if m is None else int(m.check_draft(draft_tokens[i, :n].tolist())))
    return torch.tensor(out, dtype=torch.long)


def cut_at_violation(verify_lengths: torch.Tensor, valid_lengths: torch.Tensor):
    """Scheme C. Returns (verify lengths after the cut, forced_reject bool [R]): a request whose scheduled
    verification reaches its first violating draft (verify_lengths > valid_lengths) verifies only the
    valid drafts and its last row becomes a FORCED_REJECT of the violating draft (no fresh sampling)."""
    forced = verify_lengths > valid_lengths
    return torch.minimum(verify_lengths, valid_lengths), forced
