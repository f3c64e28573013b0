"""The llguidance matcher: the Matcher protocol over an `LLMatcher`, with repairs for llguidance 1.9.1's
rollback bug and exhausted lexers, and the batched mask fill on llguidance's thread pool.

EOS is handled here, not by llguidance: EOS is allowed exactly when the grammar is in an accepting state,
and accepting it only sets a flag (so rollback over EOS is free).
"""
from __future__ import annotations

import threading
from array import array
from operator import attrgetter
from typing import TYPE_CHECKING

import torch
from llguidance import LLExecutor, LLMatcher

from .matcher import bitmask_rows, set_only
from .specs import ConstraintError

if TYPE_CHECKING:
    from .backend_llguidance import LLGuidanceCompiled

HISTORY_CHUNK = 64  # matcher history: ids per frozen chunk (a fork copies at most this many)


def clean_error(msg: str) -> str:
    # Drop the parser-state dump (or its "<non-verbose/>" stand-in) llguidance appends after the message.
    return msg.split("\n<state>")[0].split("\n<non-verbose/>")[0].strip()


def _replay(m: LLMatcher, tokens: list) -> bool:
    """Feed `tokens` to a start-state matcher; True if all were consumed and it is healthy."""
    return (not tokens or m.try_consume_tokens(tokens) == len(tokens)) and not m.is_error()


class LLGuidanceMatcher:
    """Matcher protocol over an `LLMatcher` (see matcher.Matcher).

    Keeps the accepted tokens (4 bytes each: a short list, then frozen `array("i")` chunks of
    HISTORY_CHUNK ids shared by forks, so a fork copies at most HISTORY_CHUNK ids and the history adds no
    garbage-collected objects per token) so that a backend failure can be repaired by rebuilding the state
    from the start: llguidance 1.9.1 cannot roll back some token pairs (`"<"` then the DSML special token, with a
    mask computed in between: "rollback: too many bytes 11 > 10"), and a lexer whose fuel another sequence
    exhausted fails every copy sharing it. Repairs cost one replay of the history (plus one compile for a
    lexer of its own); the normal path pays nothing for them but one `is_error()` call per mask (~50 ns).
    """

    __slots__ = ("m", "c", "vocab", "vocab_size", "_base", "_private", "_tail", "_chunks", "_frozen", "_done",
                 "_eos", "_added", "_words", "_nbytes", "_bm", "_ptr", "_rows")

    def __init__(self, m: LLMatcher, compiled: "LLGuidanceCompiled", base: LLMatcher, done: bool = False,
                 tail=(), chunks=None, frozen: int = 0, private: bool = False):
        self.m = m
        self.c = compiled
        vocab = self.vocab = compiled.vocab
        self.vocab_size = vocab.vocab_size
        self._base = base  # the start-state matcher `m` was copied from (shares m's lexer)
        self._private = private  # True once this matcher runs on a lexer of its own
        # accepted tokens except EOS: older ones in frozen chunks (array, (older chunk, ...)) or None, the
        # newest (< HISTORY_CHUNK) in a list of this matcher's own
        self._tail = list(tail)
        self._chunks = chunks
        self._frozen = frozen  # how many ids the chunks hold
        self._done = done  # EOS accepted
        self._eos = vocab.eos_token_ids
        self._added = compiled.added_ids
        self._words = vocab.bitmask_words
        self._nbytes = self._words * 4
        self._bm = self._ptr = None  # the last bitmask validated (checked once per tensor)
        self._rows = 0
        if done:
            self.__class__ = FinishedLLGuidanceMatcher

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        # The hot path (every token): its checks are a tensor-identity test and a row bound; a finished
        # matcher is another class (FinishedLLGuidanceMatcher), so there is no EOS-flag test here.
        try:
            ptr = bitmask.data_ptr()
        except AttributeError:
            raise ValueError(f"bitmask must be a torch.int32 tensor, got {type(bitmask).__name__}") from None
        if bitmask is not self._bm or ptr != self._ptr:
            self._rows = bitmask_rows(bitmask, self._words)
            self._bm, self._ptr = bitmask, ptr
        if not 0 <= row < self._rows:
            raise ValueError(f"bitmask row {row} out of range for {self._rows} rows")
        m, nbytes = self.m, self._nbytes
        m.unsafe_compute_mask_ptr(ptr + row * nbytes, nbytes)
        if m.is_error():
            self._recover(m.get_error())
            self.m.unsafe_compute_mask_ptr(ptr + row * self._nbytes, self._nbytes)
            if self.m.is_error():
                raise self._too_complex(self.m.get_error())

    def accept(self, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size:  # (a finished matcher is another class: it accepts nothing)
            return False
        if token_id in self._eos:
            if self.m.is_accepting():
                self._done = True
                self.__class__ = FinishedLLGuidanceMatcher  # see that class
                return True
            return self._rejected(token_id)
        if self.m.try_consume_tokens((token_id,)) == 1:
            tail = self._tail
            tail.append(token_id)
            if len(tail) == HISTORY_CHUNK:
                self._chunks = (array("i", tail), self._chunks)
                self._frozen += HISTORY_CHUNK
                self._tail = []
            return True
        return self._rejected(token_id)

    def rollback(self, n: int) -> None:
        tail = self._tail
        if 0 < n <= len(tail) and not self._done:  # the common case: within the unfrozen tail
            if n == 1:
                unsafe = tail.pop() in self._added
            else:
                added = self._added
                unsafe = any(t in added for t in tail[-n:])
                del tail[-n:]
        else:
            if n <= 0:
                return
            if n > self._frozen + len(tail) + self._done:
                raise ValueError(f"cannot roll back {n} tokens: only {self._frozen + len(tail) + self._done} accepted")
            if self._done:  # EOS is our flag, not llguidance's state
                self._done = False
                self.__class__ = LLGuidanceMatcher
                n -= 1
                if not n:
                    return
            added = self._added
            unsafe = any(t in added for t in self._pop(n))
        # llguidance 1.9.1 rolls back wrongly over added tokens (`｜DSML｜` after "<", with a mask computed in
        # between): either it fails ("rollback: too many bytes 11 > 10") or it silently lands one token too
        # far back. Over those tokens, and whenever its rollback fails, rebuild from the history instead.
        if unsafe or not self.m.rollback(n):
            self._recover(self.m.get_error() or "rollback over an added token")

    def is_terminated(self) -> bool:
        return self._done

    def is_accepting(self) -> bool:
        return self._done or self.m.is_accepting()

    def is_constrained(self) -> bool:
        return True

    def forced_tokens(self) -> list:
        if self._done:
            return []
        return list(self.m.compute_ff_tokens())

    def check_draft(self, token_ids) -> int:
        if self._done or not token_ids:
            return 0
        token_ids = list(token_ids)
        n = self.m.validate_tokens(token_ids)
        if n < len(token_ids) and token_ids[n] in self._eos:
            probe = self.m.deep_copy()
            if n == 0 or probe.try_consume_tokens(token_ids[:n]) == n:
                if probe.is_accepting():
                    n += 1
        return n

    def fork(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self.m.deep_copy(), self.c, self._base, self._done, self._tail, self._chunks,
                                 self._frozen, self._private)

    def history(self) -> list:
        """The accepted tokens, oldest first (EOS excluded). O(length)."""
        chunks, c = [], self._chunks
        while c is not None:
            chunks.append(c[0])
            c = c[1]
        out: list = []
        for chunk in reversed(chunks):
            out.extend(chunk)
        out.extend(self._tail)
        return out

    def _pop(self, n: int) -> list:
        """Drop the n newest history ids (n <= the history's length); returns them."""
        gone: list = []
        tail = self._tail
        while n > len(tail):
            gone += tail
            n -= len(tail)
            chunk, self._chunks = self._chunks
            self._frozen -= len(chunk)
            tail = self._tail = list(chunk)
        if n:
            gone += tail[-n:]
            del tail[-n:]
        return gone

    # -- repair paths (rare) --------------------------------------------------------------------------
    def _rejected(self, token_id: int) -> bool:
        """accept() said no. Usually the token is simply not allowed; but llguidance 1.9.1 also rejects
        silently when the lexer runs out of fuel, and flags that only on the next mask. Compute one mask
        (tens of µs, rejections only) to tell the two apart, then repair and retry once."""
        m = self.m
        if not m.is_error():
            m.compute_bitmask()
            if not m.is_error():
                return False
        self._recover(m.get_error())
        return self.accept(token_id) if not self.m.is_error() else False

    def _recover(self, reason: str) -> None:
        """Rebuild `self.m` at the accepted history, or raise ConstraintError.

        First on a copy of the shared template (cheap: a replay), then, if the lexer's fuel is the
        problem, on a lexer of this sequence's own (one compile + a replay), renewing the shared template
        for everyone else. A sequence whose own text exhausts a fresh lexer is refused."""
        tokens = self.history()
        base = self._base if self._private else self.c.template
        m = base.deep_copy()
        if _replay(m, tokens):
            self.m, self._base = m, base
            return
        reason = m.get_error() or reason
        if self._private:
            raise self._too_complex(reason)
        self.c.renew(self._base)
        base = self.c.new_start()
        m = base.deep_copy()
        if not _replay(m, tokens):
            raise self._too_complex(m.get_error() or reason)
        self.m, self._base, self._private = m, base, True

    def _too_complex(self, reason: str) -> ConstraintError:
        reason = clean_error(reason) or "the matcher failed"
        why = (" (the text exceeds the lexer limits of this constraint: LLParserLimits fuel/states)"
               if "lexer" in reason or "fuel" in reason or "too many" in reason else "")
        return ConstraintError(f"llguidance: {reason} after {self._frozen + len(self._tail)} output tokens{why}; "
                               f"the matcher could "
                               f"not be rebuilt, so this request is refused")

    @staticmethod
    def fill_batch(matchers, drafts, starts, out: torch.Tensor, errors: dict) -> list:
        """fill_masks for a group of llguidance matchers (drafts None: no draft rows) -> counts."""
        return (_EXECUTOR or _executor()).fill_batch(matchers, drafts, starts, out, errors)


class _LLGuidanceBatch:
    """Fills many llguidance matchers' masks (with draft rows) on llguidance's rayon thread pool."""

    def __init__(self, num_threads=None):
        self.executor = LLExecutor(num_threads=num_threads)

    def fill_batch(self, matchers, drafts, starts, out: torch.Tensor, errors: dict) -> list:
        """Rows the executor fills: each matcher's mask now and after each grammatical draft prefix. The
        executor walks drafts on the matchers themselves (consume, then roll back); a matcher left in an
        error state (llguidance's rollback bug, an exhausted lexer) is rebuilt from its history and its
        rows redone one by one. errors[k] = message for matcher k whose constraint failed.
        Python cost: ~0.1 µs per matcher without drafts (C-level maps and zips only), ~0.5 µs with drafts
        (one validate_tokens call each); the masks run in parallel."""
        rows, words = out.shape
        nbytes, ptr = words * 4, out.data_ptr()
        raw = list(map(_RAW, matchers))
        slow, copies, drafted = [], (), ()
        if drafts is None:  # the common no-draft step (no matcher here is finished: see FinishedLLGuidanceMatcher)
            counts = [0] * len(raw)
            plain = list(zip(raw, starts))
        else:  # (no matcher here is finished either: fill_masks groups by exact class)
            counts, plain, drafted, copies = [], [], [], []
            for k, m in enumerate(matchers):
                draft, mm = drafts[k], raw[k]
                if not draft:
                    c = 0
                else:
                    if draft.__class__ is not list:
                        draft = list(draft)
                    c = mm.validate_tokens(draft)
                    if c < len(draft) and draft[c] in m._eos:
                        c = m.check_draft(draft)  # EOS inside the draft (rare): our rule for it
                counts.append(c)
                if not c:
                    plain.append((mm, starts[k]))
                elif draft[c - 1] in m._eos:
                    slow.append(k)  # EOS inside the draft: our flag, not llguidance's state
                elif m._added.isdisjoint(draft):
                    drafted.append((mm, starts[k], draft if c == len(draft) else draft[:c]))
                else:
                    # The executor rolls its draft walk back, wrongly over added tokens (see rollback()):
                    # walk such drafts on a copy.
                    walker = mm.deep_copy()
                    drafted.append((walker, starts[k], draft[:c]))
                    copies.append((k, walker))
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, ptr, nbytes, rows)
        if drafted:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, nbytes, rows)
        if True in map(_IS_ERROR, raw):  # repair whatever the executor left broken (rare)
            slow.extend(k for k, r in enumerate(raw) if r.is_error() and k not in slow)
        for k, walker in copies:
            if walker.is_error() and k not in slow:
                slow.append(k)
        for k in slow:
            m, start, c = matchers[k], starts[k], counts[k]
            try:
                m.fill_mask(out, start)  # repairs m first if the executor left it broken
                if c:
                    w = m.fork()
                    for j in range(c):
                        if not w.accept(drafts[k][j]):
                            raise ConstraintError(f"draft token {drafts[k][j]} passed check_draft but was rejected")
                        w.fill_mask(out, start + j + 1)
            except ConstraintError as e:
                out[start: start + c + 1].zero_()
                errors[k] = str(e)
        return counts


_RAW = attrgetter("m")
_IS_ERROR = LLMatcher.is_error


class FinishedLLGuidanceMatcher(LLGuidanceMatcher):
    """An LLGuidanceMatcher that has accepted EOS: a matcher's class while its `_done` flag is set (accept() and
    rollback() switch it). Why a class: fill_masks already checks that a batch is all one matcher type, so
    finished matchers land in their own group with no per-matcher flag test in LLGuidanceMatcher.fill_batch (a
    whole pass over the batch every engine step, ~5% of a B=64 mask fill)."""

    __slots__ = ()

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        bitmask_rows(bitmask, self._words)
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
        set_only(bitmask, row, self._eos)

    def accept(self, token_id: int) -> bool:
        return False

    @staticmethod
    def fill_batch(matchers, drafts, starts, out: torch.Tensor, errors: dict) -> list:
        """EOS-only rows (no draft token is grammatical after EOS: fill_masks zeroes their rows)."""
        for m, start in zip(matchers, starts):
            m.fill_mask(out, start)
        return [0] * len(matchers)


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> _LLGuidanceBatch:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _LLGuidanceBatch()
        return _EXECUTOR
