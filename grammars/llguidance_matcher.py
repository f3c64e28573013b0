"""The llguidance matcher: the Matcher protocol over an `LLMatcher`, with repairs for llguidance 1.9.1's
rollback bug and exhausted lexers, and the batched mask fill on llguidance's thread pool.

EOS is handled here, not by llguidance: EOS is allowed exactly when the grammar is in an accepting state,
and accepting it only sets a flag (so rollback over EOS is free).
"""
from __future__ import annotations

import threading
from array import array
from operator import attrgetter, countOf
from typing import TYPE_CHECKING

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher

from .matcher import row_address, set_only
from .specs import ConstraintError

if TYPE_CHECKING:
    from .backend_llguidance import LLGuidanceCompiled

HISTORY_CHUNK = 64  # matcher history: ids per frozen chunk (a fork copies at most this many)
EOS_FILTER_MIN = 96  # batches this large look for failed matchers among the rows that allow EOS only


def clean_error(msg: str) -> str:
    # Drop the parser-state dump (or its "<non-verbose/>" stand-in) llguidance appends after the message.
    return msg.split("\n<state>")[0].split("\n<non-verbose/>")[0].strip()


def _replay(m: LLMatcher, tokens: list) -> bool:
    """Feed `tokens` to a start-state matcher; True if all were consumed and it is healthy."""
    return (not tokens or m.try_consume_tokens(tokens) == len(tokens)) and not m.is_error()


class LLGuidanceMatcher:
    """Matcher protocol over an `LLMatcher` (see matcher.Matcher), for a grammar that names no token by id (JSON
    schemas, regexes); NamedTokensLLGuidanceMatcher (a subclass) serves Grammar specs.

    Keeps the accepted tokens so that a backend failure can be repaired by rebuilding the state from the start:
    llguidance 1.9.1 cannot roll back over a non-special added token its grammar names by id (`｜DSML｜` as
    `<[128825]>`, with a mask computed after it: "rollback: too many bytes 11 > 10", or a silent landing one token
    too far back), and a lexer whose fuel another sequence exhausted fails every copy sharing it. The history costs
    one list append per accept and one counter update per rollback (`_back`: the newest ids rolled back but still
    listed, dropped at the next accept or history use): the newest ids sit in a list of this matcher's own; fork()
    freezes them into `array("i")` chunks (4 bytes an id, no garbage-collected object per token) shared with the
    fork, merging a short newest chunk so chunks stay near HISTORY_CHUNK ids, so a fork copies at most about
    HISTORY_CHUNK + the ids accepted since the last fork.
    That named token is the only place llguidance's own rollback goes wrong (test_grammar_rollback's raw
    reproductions: the same token as text, e.g. in a JSON string, and special tokens named by id roll back right).
    So only a grammar that can name tokens has `_added` ids (compiled.added_ids: the vocabulary's added tokens; empty
    here), and only its matcher switches to RiskyLLGuidanceMatcher, whose rollback checks the ids it drops, once it
    accepts one; the others roll back with one call and one counter update. And this class only has to keep EOS
    away from llguidance (whose own EOS handling does not roll back right): accept() tells EOS apart with one int
    compare (see _EOS_TOP); NamedTokensLLGuidanceMatcher also finds added tokens (two compares, see _PLAIN_LO).
    Repairs cost one replay of the history (plus one compile for a lexer of its own); the normal path pays nothing
    for them but one `is_error()` call per mask (~40 ns).
    """

    # (the slots the hot paths read first)
    __slots__ = ("m", "_bm", "_row", "_ptr", "_addr", "_nbytes", "_tail", "_back",
                 "c", "vocab", "vocab_size", "_base", "_private", "_chunks", "_frozen", "_eos", "_added", "_words",
                 "_rows", "_live")
    # The matcher's state beyond llguidance's is its class (class attributes, one source of truth): `_done`, EOS
    # accepted (the Finished* classes); `_risky`, an added token its grammar names was accepted and may still be in
    # the history (RiskyLLGuidanceMatcher and its finished twin); `_live_class`, the live class a fork is made in.
    # No hot path tests a flag.
    _done = False
    _risky = False

    def __init__(self, m: LLMatcher, compiled: "LLGuidanceCompiled", base: LLMatcher, done: bool = False,
                 tail=(), chunks=None, frozen: int = 0, private: bool = False):
        # `m` while the matcher is live, None once it accepted EOS: fill_batch hands `_live` of every matcher to
        # llguidance's executor, whose own type check then rejects a batch holding a finished matcher (or another
        # backend's), so a batch needs no class-uniformity pass of its own
        self.m = self._live = m
        self.c = compiled
        vocab = self.vocab = compiled.vocab
        self.vocab_size = vocab.vocab_size
        self._base = base  # the start-state matcher `m` was copied from (shares m's lexer)
        self._private = private  # True once this matcher runs on a lexer of its own
        # accepted tokens except EOS: older ones in frozen chunks (array, (older chunk, ...)) or None, the
        # newest in a list of this matcher's own
        self._tail = list(tail)
        self._chunks = chunks
        self._frozen = frozen  # how many ids the chunks hold
        self._back = 0  # how many of the newest listed ids were rolled back (dropped by _settle)
        if done:
            self._live = None
        self._eos = vocab.eos_token_ids
        self._added = compiled.added_ids
        self._words = vocab.bitmask_words
        self._nbytes = vocab.bitmask_nbytes
        # the last bitmask validated (checked once per tensor); with it (set by _address only: fill_mask reads them
        # only once _bm is a tensor) its address _ptr, row count _rows, and the row last filled and its address
        self._bm = None
        if done:
            self.__class__ = self._finished

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        # The hot path (every token): the tensor and row of the last call (identities), the tensor's address
        # unchanged (data_ptr: it follows a tensor re-pointed in place, the one check a raw client with its own
        # buffer skips: grammar_bench's "raw+safe" reference; 170-240 ns on the H200 host, measured as "ours vs
        # ours-1"; calling it through torch.Tensor's descriptor instead measured the same; no tensor can be made
        # immovable instead: set_, .data =, share_memory_ and torch.utils.swap_tensors re-point even a detached
        # tensor over numpy memory; const_data_ptr, ~20 ns cheaper on torch 2.13, is not in the host's torch 2.11),
        # then the address computed for them then.
        # A finished matcher is another class (FinishedLLGuidanceMatcher), so there is no EOS-flag test here.
        if bitmask is self._bm and row is self._row and bitmask.data_ptr() == self._ptr:
            addr = self._addr
        else:
            addr = self._address(bitmask, row)
        m = self.m
        m.unsafe_compute_mask_ptr(addr, self._nbytes)
        if m.is_error():
            self._recover(m.get_error())
            self.m.unsafe_compute_mask_ptr(addr, self._nbytes)
            if self.m.is_error():
                raise self._too_complex(self.m.get_error())

    def _address(self, bitmask: torch.Tensor, row: int) -> int:
        """Validate (a new tensor, or one re-pointed in place) and bound the row (ValueError), then remember the
        pair for fill_mask's identity test."""
        self._row = None  # (_row, _addr) always describe the current (_bm, _ptr): cleared until both are checked
        addr = row_address(self, bitmask, row)
        self._row, self._addr = row, addr
        return addr

    def accept(self, token_id: int) -> bool:
        # (a finished matcher is another class: it accepts nothing) Cost over a raw client's try_consume_tokens call
        # on the H200 host: the history (the `_back` test and the append) ~75 ns, the EOS compare ~15 ns, the call
        # ~20 ns. (llguidance's consume_token is ~30% cheaper than try_consume_tokens, but does not check the token:
        # a disallowed one is taken silently, so accept() cannot use it.)
        if _EOS_TOP < token_id:  # not EOS (one compare: see _EOS_TOP)
            try:
                if self.m.try_consume_tokens((token_id,)) == 1:
                    if self._back:
                        self._settle()
                    self._tail.append(token_id)
                    return True
            except OverflowError:  # an id past 32 bits
                return False
            return self._rejected(token_id)
        return self._accept_rare(token_id)

    def _accept_rare(self, token_id: int) -> bool:
        """accept() of an id its class's fast test sends here: EOS, an added token (of a grammar that names tokens), or
        an ordinary id at or below _EOS_TOP / outside the plain range."""
        if token_id in self._eos:
            return self._accept_eos(token_id)
        try:
            if self.m.try_consume_tokens((token_id,)) != 1:
                return self._rejected(token_id)
        except OverflowError:  # a negative id, or one past 32 bits
            return False
        if self._back:
            self._settle()
        self._tail.append(token_id)
        if not self._risky and token_id in self._added:
            self.__class__ = RiskyLLGuidanceMatcher  # from now on rollback checks the ids it drops
        return True

    def _accept_eos(self, token_id: int) -> bool:
        if self.m.is_accepting():
            self._live = None
            _live_changed()
            self.__class__ = self._finished  # see FinishedLLGuidanceMatcher
            return True
        return self._rejected(token_id)

    def rollback(self, n: int) -> None:
        # No added token of `_added` was accepted (else this is a RiskyLLGuidanceMatcher): llguidance's rollback is
        # right, and refuses (False, error state) n past its tokens. The history drops the ids later (_settle): the
        # counter is ~30 ns on the H200 host (dropping them here, `del tail[-1]`, measured ~3x that).
        try:
            if self.m.rollback(n):
                self._back += n
                return
        except OverflowError:  # a negative n (or one past 32 bits): n <= 0 rolls back nothing
            if n <= 0:
                return
        self._settle()
        self._recover(self.m.get_error() or "rollback failed")  # llguidance's state as it was
        self._rollback(n)  # too far: ValueError; else the careful path

    def _rollback(self, n: int) -> None:
        """rollback(n) for any n, checking the dropped ids for the added tokens of `_added`."""
        if n <= 0:
            return
        if self._back:
            self._settle()
        tail = self._tail
        if n > self._frozen + len(tail):
            raise ValueError(f"cannot roll back {n} tokens: only {self._frozen + len(tail)} accepted")
        added = self._added
        if n <= len(tail):
            unsafe = not added.isdisjoint(tail[-n:])
            del tail[-n:]
        else:
            unsafe = not added.isdisjoint(self._pop(n))
        # llguidance 1.9.1 rolls back wrongly over a non-special added token the grammar names by id (`｜DSML｜` as
        # `<[128825]>`, with a mask computed after it): either it fails ("rollback: too many bytes 11 > 10") or it
        # silently lands one token too far back. Over added tokens (of `_added`: none unless the grammar can name
        # tokens), and whenever its rollback fails, rebuild from the history instead.
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
        if self._back:
            self._settle()
        if self._tail:
            self._freeze()
        return self._live_class(self.m.deep_copy(), self.c, self._base, self._done, (), self._chunks,
                                self._frozen, self._private)

    def _freeze(self) -> None:
        """Move the tail into the shared chunks (merged with a newest chunk shorter than HISTORY_CHUNK)."""
        tail, chunks = self._tail, self._chunks
        if chunks is not None and len(chunks[0]) < HISTORY_CHUNK:
            chunks = (chunks[0] + array("i", tail), chunks[1])
        else:
            chunks = (array("i", tail), chunks)
        self._chunks = chunks
        self._frozen += len(tail)
        self._tail = []

    def history(self) -> list:
        """The accepted tokens, oldest first (EOS excluded). O(length)."""
        if self._back:
            self._settle()
        chunks, c = [], self._chunks
        while c is not None:
            chunks.append(c[0])
            c = c[1]
        out: list = []
        for chunk in reversed(chunks):
            out.extend(chunk)
        out.extend(self._tail)
        return out

    def _settle(self) -> None:
        """Drop the ids rollback() counted in `_back` from the history."""
        n, self._back = self._back, 0
        self._pop(n)

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
        if not 0 <= token_id < self.vocab_size:  # llguidance flags an out-of-range id as an error: undo that
            if m.is_error():
                self._recover(m.get_error())
            return False
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
            self.m = self._live = m
            self._base = base
            _live_changed()
            return
        reason = m.get_error() or reason
        if self._private:
            raise self._too_complex(reason)
        self.c.renew(self._base)
        base = self.c.new_start()
        m = base.deep_copy()
        if not _replay(m, tokens):
            raise self._too_complex(m.get_error() or reason)
        self.m = self._live = m
        self._base, self._private = base, True
        _live_changed()

    def _too_complex(self, reason: str) -> ConstraintError:
        reason = clean_error(reason) or "the matcher failed"
        why = (" (the text exceeds the lexer limits of this constraint: LLParserLimits fuel/states)"
               if "lexer" in reason or "fuel" in reason or "too many" in reason else "")
        return ConstraintError(f"llguidance: {reason} after {len(self.history())} output tokens{why}; "
                               f"the matcher could "
                               f"not be rebuilt, so this request is refused")

    @staticmethod
    def fill_batch(matchers, drafts, starts, out: torch.Tensor, errors: dict):
        """fill_masks for llguidance matchers (drafts None: no draft rows) -> counts, or None when `matchers` are
        not all live llguidance matchers (fill_masks then groups them by class)."""
        return (_EXECUTOR or _executor()).fill_batch(matchers, drafts, starts, out, errors)


class _LLGuidanceBatch:
    """Fills many llguidance matchers' masks (with draft rows) on llguidance's rayon thread pool."""

    def __init__(self, num_threads=None):
        self.executor = LLExecutor(num_threads=num_threads)
        # (matchers, _EPOCH then, their `_live`, work list, shared EOS) of the last no-draft batch filled at rows
        # 0..n-1: an engine's batch is usually the same sequences step after step, so its work list is reused
        self._last_work = ((), -1, (), (), None)

    def fill_batch(self, matchers, drafts, starts, out: torch.Tensor, errors: dict):
        """Rows the executor fills: each matcher's mask now and after each grammatical draft prefix; counts of
        grammatical drafts, or None (nothing written) unless every matcher is a live LLGuidanceMatcher.
        The executor walks drafts on the matchers themselves (consume, then roll back); a matcher left in an
        error state (llguidance's rollback bug, an exhausted lexer) is rebuilt from its history and its rows
        redone one by one. errors[k] = message for matcher k whose constraint failed.
        Python cost without drafts, when the batch is the previous call's (the usual engine step): one list
        comparison, and the failure check: llguidance reports a failed mask only through is_error() (~40-70 ns a
        call) and writes the row of a failed matcher allowing EOS alone (which would silently end the output), so
        small batches call is_error() on every matcher, large ones only on the rows that allow EOS (one numpy
        pass). A new batch adds C-level passes (each matcher's `_live`, the work list); the batch's type check is
        the executor's own. With drafts ~0.5 µs per matcher (one validate_tokens call each). The masks run in
        parallel."""
        rows, words = out.shape
        nbytes, ptr = words * 4, out.data_ptr()
        if drafts is None:  # the common no-draft step
            last, epoch, live, work, eos = self._last_work
            # The previous step's work list when the batch is the same matchers (list equality: identity per item)
            # and no matcher's `_live` changed since (a global count of such changes: they are rare): no pass of
            # ours over the batch at all.
            if starts.__class__ is not range or epoch != _EPOCH or matchers != last:
                epoch = _EPOCH
                try:
                    live = list(map(_LIVE, matchers))
                except AttributeError:  # another backend's matcher
                    return None
                work = list(zip(live, starts))
                eos = _shared_eos(matchers)
                if starts.__class__ is range:  # one tuple, one store: safe to race (worst case: rebuilt)
                    self._last_work = (list(matchers), epoch, live, work, eos)
            try:
                self.executor.unsafe_compute_mask_ptr(work, ptr, nbytes, rows)
            except TypeError:  # a finished matcher (`_live` None) or another backend's: rejected before any mask
                return None
            # A matcher that failed (before or during this fill) gets a row allowing EOS alone, so only rows that
            # allow EOS need the is_error() look: one numpy pass (~5 µs) instead of a call per matcher (~70 ns
            # each), worth it from about 100 matchers on.
            suspects = live if eos is None or len(live) < EOS_FILTER_MIN else \
                map(live.__getitem__, _rows_allowing(out, starts, *eos))
            if True in map(_IS_ERROR, suspects):  # repair whatever the executor left broken (rare)
                self._repair(matchers, None, starts, [0] * len(live), out, errors, [], ())
            return [0] * len(live)
        try:
            live = list(map(_LIVE, matchers))
        except AttributeError:  # another backend's matcher
            return None
        if None in live:
            return None
        slow, counts, plain, drafted, copies = [], [], [], [], []
        for k, m in enumerate(matchers):
            draft, mm = drafts[k], live[k]
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
                # The executor rolls its draft walk back, wrongly over added tokens the grammar names (see
                # _rollback): walk such drafts on a copy.
                walker = mm.deep_copy()
                drafted.append((walker, starts[k], draft[:c]))
                copies.append((k, walker))
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, ptr, nbytes, rows)
        if drafted:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, nbytes, rows)
        if slow or copies or True in map(_IS_ERROR, live):
            self._repair(matchers, drafts, starts, counts, out, errors, slow, copies)
        return counts

    @staticmethod
    def _repair(matchers, drafts, starts, counts, out, errors, slow, copies) -> None:
        """Redo one by one the rows of matchers the executor left broken, or that it cannot walk (`slow`)."""
        slow.extend(k for k, m in enumerate(matchers) if m.m.is_error() and k not in slow)
        slow.extend(k for k, walker in copies if walker.is_error() and k not in slow)
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


# Token ids strictly between _PLAIN_LO and _PLAIN_HI are neither EOS nor an added token of any vocabulary a
# compiled constraint of this process uses (for DeepSeek-V4: 2 and 128000), so accept()'s hot path tests two int
# compares against module globals: ~2% of an accept cheaper than a set lookup. The rest take accept's rare path,
# which looks the id up exactly. Only narrowed (one more vocabulary), under a lock, before that vocabulary's first
# matcher exists; LO only rises and HI only falls, so a racing reader of old and new values is still right.
_PLAIN_LO, _PLAIN_HI = 0, 0
# LLGuidanceMatcher.accept (grammars that name no token: only EOS must not reach llguidance) tests one compare:
# ids above _EOS_TOP, the largest EOS id of any vocabulary registered (for DeepSeek-V4: 1), are not EOS. Only rises.
_EOS_TOP = -1
_PLAIN_VOCABS: set = set()
_PLAIN_LOCK = threading.Lock()


def plain_range(vocab) -> tuple:
    """(lo, hi): the largest run of ids lo < id < hi holding no EOS or added id of `vocab`."""
    rare = sorted(i for i in vocab.rare_ids if 0 <= i < vocab.vocab_size)
    bounds = [-1, *rare, vocab.vocab_size]
    return max(zip(bounds, bounds[1:]), key=lambda b: b[1] - b[0])


def register_vocab(vocab) -> None:
    """Narrow the plain range to exclude `vocab`'s EOS and added ids (its plain_range), and raise _EOS_TOP to its
    largest EOS id."""
    global _PLAIN_LO, _PLAIN_HI, _EOS_TOP
    if vocab.fingerprint in _PLAIN_VOCABS:
        return
    lo, hi = plain_range(vocab)
    with _PLAIN_LOCK:
        _EOS_TOP = max((_EOS_TOP, *vocab.eos_token_ids))
        if _PLAIN_VOCABS:  # the intersection with the range so far
            lo, hi = max(_PLAIN_LO, lo), min(_PLAIN_HI, hi)
            if hi <= lo:
                lo = hi = _PLAIN_LO  # empty: every id takes the exact rare path
        _PLAIN_HI = hi  # (HI first: a reader between the two stores sees a narrower range, never a wider one)
        _PLAIN_LO = lo
        _PLAIN_VOCABS.add(vocab.fingerprint)


_LIVE = attrgetter("_live")
_EPOCH = 0  # how many times some matcher's `_live` changed (finished, live again, rebuilt): see fill_batch


def _live_changed() -> None:
    global _EPOCH
    _EPOCH += 1  # (a racing lost increment still changes the value: enough for fill_batch's test)
_EOS = attrgetter("_eos")
_IS_ERROR = LLMatcher.is_error


def _shared_eos(matchers) -> tuple | None:
    """(word, bit value) of the EOS id every matcher shares, or None (several EOS ids, or not all the same)."""
    eos = matchers[0]._eos if matchers else ()
    if len(eos) != 1 or countOf(map(_EOS, matchers), eos) != len(matchers):
        return None
    word, bit = divmod(eos[0], 32)
    return word, np.int32(np.uint32(1 << bit).view(np.int32))


_view = (None, 0, None)  # (tensor, data pointer, numpy view) of the last output bitmask (re-made if resized)


def _rows_allowing(out: torch.Tensor, starts, word: int, bit) -> list:
    """Indices k whose row starts[k] of `out` has `bit` set in `word` (a numpy view of `out`, kept per tensor)."""
    global _view
    last, ptr, view = _view
    if out is not last or out.data_ptr() != ptr or view.shape != out.shape:
        view = out.numpy()
        _view = (out, out.data_ptr(), view)
    rows = slice(starts.start, starts.stop, starts.step) if starts.__class__ is range else np.asarray(starts, np.int64)
    col = view[rows, word]
    return np.flatnonzero(col & bit).tolist()


class NamedTokensLLGuidanceMatcher(LLGuidanceMatcher):
    """An LLGuidanceMatcher for a grammar that may name tokens by id (a Grammar spec: lark `<[id]>`, DSML), whose
    compiled.added_ids are the vocabulary's added tokens: accept() sends EOS and every added token down the exact
    path (two int compares, see _PLAIN_LO), where accepting one switches to RiskyLLGuidanceMatcher."""

    __slots__ = ()

    def accept(self, token_id: int) -> bool:
        # (a finished matcher is another class: it accepts nothing)
        if _PLAIN_LO < token_id < _PLAIN_HI:  # neither EOS nor an added token (two compares: see _PLAIN_LO)
            if self.m.try_consume_tokens((token_id,)) == 1:  # (ids in the plain range fit in 32 bits)
                if self._back:
                    self._settle()
                self._tail.append(token_id)
                return True
            return self._rejected(token_id)
        return self._accept_rare(token_id)


class RiskyLLGuidanceMatcher(NamedTokensLLGuidanceMatcher):
    """A NamedTokensLLGuidanceMatcher that has accepted an added token: every rollback checks the ids it drops
    (llguidance 1.9.1 rolls back wrongly over those its grammar names by id, see _rollback). It stays this class
    once switched (a rollback past every added token only costs the check)."""

    __slots__ = ()
    _risky = True

    rollback = LLGuidanceMatcher._rollback


class FinishedLLGuidanceMatcher(LLGuidanceMatcher):
    """An LLGuidanceMatcher that has accepted EOS (`_done`; accept() and rollback() switch the class, a risky one's
    to FinishedRiskyLLGuidanceMatcher; `_live` is None meanwhile, which llguidance's executor refuses, so a batch
    holding one falls back to fill_masks' per-class groups). Why a class: no per-matcher "finished?" test on the hot
    paths (fill_mask, accept, the batch fill: a whole pass over the batch every engine step)."""

    __slots__ = ()
    _done = True

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        row_address(self, bitmask, row)  # validates the tensor and the row
        set_only(bitmask, row, self._eos)

    def accept(self, token_id: int) -> bool:
        return False

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self._back:
            self._settle()
        if n > self._frozen + len(self._tail) + 1:
            raise ValueError(f"cannot roll back {n} tokens: only {self._frozen + len(self._tail) + 1} accepted")
        self._live = self.m  # (EOS is our class, not llguidance's state)
        _live_changed()
        self.__class__ = self._unfinished
        if n > 1:
            self.rollback(n - 1)

    @staticmethod
    def fill_batch(matchers, drafts, starts, out: torch.Tensor, errors: dict):
        """EOS-only rows (no draft token is grammatical after EOS: fill_masks zeroes their rows); None unless
        every matcher is finished."""
        if not all(isinstance(m, FinishedLLGuidanceMatcher) for m in matchers):  # (both finished classes)
            return None
        for m, start in zip(matchers, starts):
            m.fill_mask(out, start)
        return [0] * len(matchers)


class FinishedNamedTokensLLGuidanceMatcher(FinishedLLGuidanceMatcher):
    """A NamedTokensLLGuidanceMatcher that has accepted EOS."""

    __slots__ = ()


class FinishedRiskyLLGuidanceMatcher(FinishedLLGuidanceMatcher):
    """A RiskyLLGuidanceMatcher that has accepted EOS."""

    __slots__ = ()
    _risky = True


# Per live class: the class accept(EOS) switches to, the one rollback() over that EOS switches back to, and the
# class its matchers (and forks, finished or not) are made in (`_live_class`).
for _live_cls, _finished_cls in ((LLGuidanceMatcher, FinishedLLGuidanceMatcher),
                                 (NamedTokensLLGuidanceMatcher, FinishedNamedTokensLLGuidanceMatcher),
                                 (RiskyLLGuidanceMatcher, FinishedRiskyLLGuidanceMatcher)):
    _live_cls._finished = _finished_cls
    _live_cls._live_class = _finished_cls._unfinished = _finished_cls._live_class = _live_cls
del _live_cls, _finished_cls

_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> _LLGuidanceBatch:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _LLGuidanceBatch()
        return _EXECUTOR
