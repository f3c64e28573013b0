"""Masked drafting with the masks on the device: MaskedDraftSampler (engine/grammar_drafting.py) with its grammar
state held as TokenAutomaton states (engine/token_automaton.py) instead of CPU matchers, so the drafter's
sequential Markov loop runs with no host synchronisation per draft position (issue 7, option b).

Same proposal math, same counter-based draws, same block rules as MaskedDraftSampler (it is a subclass that only
replaces where masks come from and how the walk is tracked): given equal masks it drafts the very same block
(tests/engine/test_grammar_draft_automaton_sampler.py checks this, and the exact-enumeration harness runs with it).
Masked drafting is lossless whatever the mask, as long as the proposal is the distribution actually sampled; so
an automaton whose language differs from the verifier's (outlines-core JSON vs llguidance JSON, llguidance's
canonical-tokenization pruning) only changes acceptance: `finish` asks the verifier's own matchers
(`check_draft`, a validation walk, no masks) how many drafts are grammatical, and the engine cuts the block there
(mechanism 3: the cut row is a forced rejection, never a fresh draw).

Per position: one gather of the requests' mask rows, an unpack, the MaskedDraftSampler math, one searchsorted
advance: all device work. One host sync per block (`finish`: the tokens come down for scheduling). Forced-token
chains (`extend_forced`) run their `max_extra` positions without an early exit (an exit test would be a sync);
positions nobody uses are trimmed in `finish`.
Limits: one automaton per sampler (requests with other constraints use MaskedDraftSampler); no Triggered
constraints (a trigger is not part of the automaton); requests with matcher None draft unmasked.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .grammar_drafting import DraftBlock, MaskedDraftSampler, _softmax, unpack_bitmask
from .token_automaton import TokenAutomaton


class AutomatonDraftSampler(MaskedDraftSampler):
    """matchers: the verifier's committed matchers (None = unconstrained), read only in `finish`;
    states: long [R], each constrained request's automaton state after its anchor x0 (TokenAutomaton.walk).
    Other arguments as MaskedDraftSampler (mask_drafts is always on)."""

    def __init__(self, matchers: Sequence, automaton: TokenAutomaton, states: torch.Tensor, seeds: torch.Tensor,
                 positions: torch.Tensor, vocab_size: int,
                 to_probs: Callable[[torch.Tensor], torch.Tensor] = _softmax, force_tokens: bool = True,
                 stop_token_ids: Optional[Sequence[Sequence[int]]] = None, uniforms: Optional[torch.Tensor] = None):
        super().__init__([None] * len(matchers), seeds, positions, vocab_size, to_probs=to_probs, mask_drafts=True,
                         force_tokens=force_tokens, stop_token_ids=stop_token_ids, uniforms=uniforms)
        self.matchers = list(matchers)
        self.automaton = automaton
        dev = automaton.masks.device
        self.device = dev
        self.states = states.to(device=dev, dtype=torch.long)
        # on the device once: a per-position host tensor would be a copy that waits for the device queue
        self.seeds, self.positions = self.seeds.to(dev), self.positions.to(dev)
        self.constrained = torch.tensor([m is not None for m in matchers], dtype=torch.bool, device=dev)
        self.live = torch.ones(self.n, dtype=torch.bool, device=dev)          # the device twin of `active`
        width = max([len(s) for s in self.stops] + [1])
        self.stop_ids = torch.tensor([sorted(s) + [-1] * (width - len(s)) for s in self.stops], dtype=torch.long,
                                     device=dev).reshape(self.n, width)
        self.sampled_positions = 0

    def _masks(self, device):
        rows = self.automaton.mask_rows(self.states)
        has = self.constrained & self.live
        allowed = unpack_bitmask(rows, self.vocab_size) | ~has.unsqueeze(-1)
        count = allowed.sum(-1)
        none = torch.full((self.n,), -1, dtype=torch.long, device=allowed.device)
        forced_tok = torch.where(has & (count == 1), allowed.to(torch.int8).argmax(-1), none)
        return allowed.to(device), forced_tok.to(device), (has & (count == 0)).to(device)

    def _active_now(self, device) -> torch.Tensor:
        return self.live.to(device)

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        self.sampled_positions += 1
        return super().step(logits)

    def _record(self, tok: torch.Tensor, probs: torch.Tensor, forced: torch.Tensor):
        tok = tok.to(self.device)
        ok = tok >= 0
        nxt = self.automaton.advance(self.states, tok)
        self.states = torch.where(self.constrained & ok, nxt, self.states)
        stop = (tok.unsqueeze(-1) == self.stop_ids).any(-1)
        done = self.constrained & (self.states == self.automaton.terminated)
        self.live = self.live & ok & ~stop & ~done
        self.tokens.append(tok)                  # device tensors: no synchronisation until finish()
        self.probs.append(probs)
        self.forced.append(forced)

    def extend_forced(self, max_extra: int) -> None:
        """Up to `max_extra` forced positions for every request still in a single-token state (a chain that
        breaks ends that request's block); no early exit, unused positions are trimmed by `finish`."""
        dtype = self.probs[-1].dtype if self.probs else torch.float32
        pdev = self.probs[-1].device if self.probs else self.device
        for _ in range(max_extra):
            _, forced_tok, _ = self._masks(self.device)
            forced_tok = torch.where(self.live, forced_tok, torch.full_like(forced_tok, -1))
            self.live = self.live & (forced_tok >= 0)
            delta = torch.nn.functional.one_hot(forced_tok.clamp_min(0), self.vocab_size).to(dtype).to(pdev)
            self._record(forced_tok, delta, forced_tok >= 0)

    def finish(self, confidences: Optional[torch.Tensor] = None) -> DraftBlock:
        """The block (MaskedDraftSampler.finish), after the one host sync; valid lengths from the verifier's
        matchers (check_draft), so drafts outside the verifier's language are cut, never verified."""
        if self.tokens:
            tokens = torch.stack(self.tokens, 1).cpu()                          # the host synchronisation
            forced = torch.stack(self.forced, 1).cpu()
            present = torch.cumprod((tokens >= 0).to(torch.long), 1).to(torch.bool)
            lengths = present.sum(1)
            keep = max(self.sampled_positions, int(lengths.max()) if lengths.numel() else 0)
            self.tokens = [tokens[:, k] for k in range(keep)]
            self.forced = [forced[:, k] for k in range(keep)]
            self.probs = self.probs[:keep]
            for i, m in enumerate(self.matchers):
                n = int(lengths[i])
                self.valid[i] = n if m is None else int(m.check_draft(tokens[i, :n].tolist()))
        return super().finish(confidences)
