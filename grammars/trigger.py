"""Triggered constraints: free text until a trigger token sequence appears, then the inner grammar.

The trigger is matched over token ids with KMP (so overlapping prefixes such as [a, a, b] in "a a a b"
are found). With a bound token, sampling it commits: the rest of the trigger is forced one token at a
time, then the inner grammar applies. Every accepted token pushes the trigger state on a stack, so
rollback restores trigger progress exactly, including rolling back out of the grammar into free text.
"""
from __future__ import annotations

from functools import cached_property
from operator import countOf

import torch

from .matcher import check_bitmask, fill_masks, set_only

FREE, FORCING, INNER = 0, 1, 2


def kmp_failure(pattern: tuple) -> list:
    """failure[i] = length of the longest proper prefix of pattern[:i+1] that is also its suffix."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


def kmp_step(pattern: tuple, fail: list, progress: int, token: int) -> int:
    while progress and token != pattern[progress]:
        progress = fail[progress - 1]
    return progress + 1 if token == pattern[progress] else 0


class TriggeredCompiled:
    backend = "triggered"

    def __init__(self, spec, inner_compiled, vocab):
        self.spec = spec
        self.inner = inner_compiled
        self.vocab = vocab
        self.nbytes = inner_compiled.nbytes + 1024
        self.trigger = tuple(spec.trigger_token_ids)
        self.fail = kmp_failure(self.trigger)
        bound = spec.bound_token_id
        if bound is None:
            self.after_bound = None
        elif bound in self.trigger:
            self.after_bound = self.trigger.index(bound) + 1  # trigger progress right after the bound token
        else:
            self.after_bound = 0  # the whole trigger is forced after the bound token

    @cached_property
    def free_row(self) -> torch.Tensor:
        """Free-text mask: every tokenizer id except placeholders; padding logits stay disallowed."""
        allowed = torch.zeros(self.vocab.bitmask_words * 32, dtype=torch.bool)
        allowed[: self.vocab.n_tokens] = True
        if self.vocab.never_ids:
            allowed[list(self.vocab.never_ids)] = False
        weights = (torch.ones(32, dtype=torch.int64) << torch.arange(32, dtype=torch.int64))
        words = (allowed.view(-1, 32).to(torch.int64) * weights).sum(1)
        return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    def matcher(self):
        return TriggeredMatcher(self)


class TriggeredMatcher:
    """Matcher protocol; `is_constrained()` is False while waiting for the trigger (free text)."""

    def __init__(self, compiled: TriggeredCompiled, mode=FREE, progress=0, stack=None, depth=0, inner=None):
        self.c = compiled
        self.vocab_size = compiled.vocab.vocab_size
        self.mode = mode
        self.progress = progress
        # (mode, progress) before each accepted token, newest first, as an immutable linked list
        # ((mode, progress), (older...)): shared by forks, so fork() is O(1) however long the text
        self.stack = stack
        self.depth = depth
        self.inner = inner if inner is not None else compiled.inner.matcher()
        self._bm = None  # the last bitmask validated

    def _enter(self, progress):
        if progress == len(self.c.trigger):
            self.mode, self.progress = INNER, 0
        else:
            self.progress = progress

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        if bitmask is not self._bm:  # validated once per tensor (the inner matcher checks its writes itself)
            check_bitmask(bitmask, 1, self.c.vocab.bitmask_words)
            self._bm = bitmask
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
        if self.mode == INNER:
            self.inner.fill_mask(bitmask, row)
        elif self.mode == FORCING:
            set_only(bitmask, row, [self.c.trigger[self.progress]])
        else:
            bitmask[row].copy_(self.c.free_row)

    @staticmethod
    def fill_batch(matchers, drafts, starts, out: torch.Tensor, errors: dict):
        """fill_masks without drafts (None with drafts, or unless every matcher is a TriggeredMatcher: fill_masks then
        groups the batch by class and walks drafts one by one): the matchers inside
        the grammar pass their inner matchers to one fill_masks call (llguidance: one batch on its pool); the
        others (free text, forcing the trigger) are written here. `out` is validated by fill_masks."""
        if drafts is not None or countOf(map(type, matchers), TriggeredMatcher) != len(matchers):
            return None  # (nothing written: fill_masks then groups the batch by class)
        inner, inner_rows, where = [], [], []
        for k, m in enumerate(matchers):
            if m.mode == INNER:
                inner.append(m.inner)
                inner_rows.append(starts[k])
                where.append(k)
            elif m.mode == FORCING:
                set_only(out, starts[k], [m.c.trigger[m.progress]])
            else:
                out[starts[k]].copy_(m.c.free_row)
        if inner:
            failed: dict = {}
            fill_masks(inner, out=out, rows=inner_rows, errors=failed)
            for j, msg in failed.items():
                errors[where[j]] = msg
        return [0] * len(matchers)

    def accept(self, token_id: int) -> bool:
        token_id = int(token_id)
        before = (self.mode, self.progress)
        if self.mode == INNER:
            if not self.inner.accept(token_id):
                return False
        elif self.mode == FORCING:
            if token_id != self.c.trigger[self.progress]:
                return False
            self._enter(self.progress + 1)
        else:
            if not 0 <= token_id < self.c.vocab.n_tokens or token_id in self.c.vocab.never_ids:
                return False
            if token_id == self.c.spec.bound_token_id:
                self.mode = FORCING
                self._enter(self.c.after_bound)
            else:
                self._enter(kmp_step(self.c.trigger, self.c.fail, self.progress, token_id))
        self.stack = (before, self.stack)
        self.depth += 1
        return True

    def rollback(self, n: int) -> None:
        if n > self.depth:
            raise ValueError(f"cannot roll back {n} tokens, only {self.depth} accepted")
        inner_tokens = 0  # tokens the inner matcher consumed: the newest ones, rolled back in one call
        for _ in range(n):
            before, self.stack = self.stack
            self.depth -= 1
            inner_tokens += before[0] == INNER
            self.mode, self.progress = before
        if inner_tokens:
            self.inner.rollback(inner_tokens)

    def is_terminated(self) -> bool:
        return self.mode == INNER and self.inner.is_terminated()

    def is_constrained(self) -> bool:
        return self.mode != FREE

    def forced_tokens(self) -> list:
        if self.mode == FORCING:
            rest = list(self.c.trigger[self.progress:])
            probe = self.c.inner.matcher()
            return rest + probe.forced_tokens()
        if self.mode == INNER:
            return self.inner.forced_tokens()
        return []

    def check_draft(self, token_ids) -> int:
        probe = self.fork()
        n = 0
        for t in token_ids:
            if not probe.accept(t):
                break
            n += 1
        return n

    def fork(self) -> "TriggeredMatcher":
        return TriggeredMatcher(self.c, self.mode, self.progress, self.stack, self.depth, self.inner.fork())
