"""The matcher protocol the engine talks to, bitmask helpers, and the batched mask fill.

Bitmask layout (shared with the kernels): torch.int32 [rows, ceil(vocab_size / 32)], bit (id % 32) of
word (id // 32) set = token allowed. Ids beyond the tokenizer (padding logits) are never set.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Protocol, Sequence, runtime_checkable

import torch

from .specs import ConstraintError


@runtime_checkable
class Matcher(Protocol):
    """State of one constrained sequence. All methods are cheap (µs) except `fill_mask` (tens of µs)."""

    vocab_size: int

    def fill_mask(self, bitmask: torch.Tensor, row: int = 0) -> None: ...
    def accept(self, token_id: int) -> bool: ...
    def rollback(self, n: int) -> None: ...
    def is_terminated(self) -> bool: ...
    def forced_tokens(self) -> list: ...
    def check_draft(self, token_ids: Sequence[int]) -> int: ...
    def is_constrained(self) -> bool: ...
    def fork(self) -> "Matcher": ...


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A zeroed int32 bitmask [rows, ceil(vocab_size/32)] (all tokens disallowed until filled)."""
    return torch.zeros((rows, (vocab_size + 31) // 32), dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack int32 words to a bool [rows, vocab_size] tensor (tests and debugging; ~1 ms per 129k row)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def set_only(bitmask: torch.Tensor, row: int, token_ids) -> None:
    """Row allows exactly `token_ids`."""
    bitmask[row].zero_()
    for t in token_ids:
        word, bit = divmod(int(t), 32)
        value = 1 << bit
        bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value  # int32 sign bit


def check_bitmask(bitmask: torch.Tensor, rows: int, words: int) -> None:
    """Raise ValueError unless `bitmask` is a contiguous CPU int32 [>= rows, words] tensor."""
    if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32 or bitmask.dim() != 2 \
            or bitmask.device.type != "cpu":
        what = f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}" if isinstance(bitmask, torch.Tensor) \
            else type(bitmask).__name__
        raise ValueError(f"bitmask must be a CPU torch.int32 [rows, words] tensor, got {what}")
    if bitmask.shape[0] < rows or bitmask.shape[1] != words:
        raise ValueError(f"bitmask shape {tuple(bitmask.shape)} too small: need [{rows}, {words}]")
    if not bitmask.is_contiguous():
        raise ValueError("bitmask must be contiguous")
    # (a storage shrunk in place, e.g. untyped_storage().resize_(0), leaves the shape as it was: writes by address
    # must stay inside the memory the storage really holds)
    if bitmask.untyped_storage().nbytes() < (bitmask.storage_offset() + bitmask.numel()) * 4:
        raise ValueError(f"bitmask storage holds {bitmask.untyped_storage().nbytes()} bytes, less than its shape "
                         f"{tuple(bitmask.shape)} needs")


def bitmask_rows(bitmask: torch.Tensor, words: int) -> int:
    """Validate a bitmask a matcher writes into by address (check_bitmask, at least one row); its row count.

    Matchers call this again whenever the tensor object or its data pointer changes (the cached tensor is
    kept alive by the cache, so its id cannot be reused); an in-place resize that keeps the address never
    shrinks the storage, so writes by address at the cached row count stay in bounds. The last tensor that
    passed is remembered for all matchers: an engine hands every matcher of a step the same new bitmask, so
    only the first of them pays check_bitmask (~2 µs), the others ~0.1 µs."""
    global _last_valid
    last, ptr, last_words, rows = _last_valid
    if bitmask is last and words == last_words and bitmask.data_ptr() == ptr:
        return rows
    check_bitmask(bitmask, 1, words)
    rows = bitmask.shape[0]
    _last_valid = (bitmask, bitmask.data_ptr(), words, rows)  # one tuple, one store: safe to race
    return rows


_last_valid = (None, 0, 0, 0)  # (tensor, data pointer, words, rows) of the last bitmask bitmask_rows passed


def row_address(holder, bitmask: torch.Tensor, row: int) -> int:
    """The address of `row` of `bitmask`, for a matcher that has a backend write masks by address: validates the
    tensor (bitmask_rows) when it is not the one `holder` validated last (its `_bm`, `_ptr`, `_rows`; `_words` =
    words per row), and the row bound; ValueError naming the problem. The matchers' hot paths test the cached
    tensor inline and call this only for a new tensor."""
    try:
        ptr = bitmask.data_ptr()
    except AttributeError:
        raise ValueError(f"bitmask must be a torch.int32 tensor, got {type(bitmask).__name__}") from None
    if bitmask is not holder._bm or ptr != holder._ptr:
        holder._rows = bitmask_rows(bitmask, holder._words)
        holder._bm, holder._ptr = bitmask, ptr
    if not 0 <= row < holder._rows:
        raise ValueError(f"bitmask row {row} out of range for {holder._rows} rows")
    return ptr + row * holder._words * 4


def check_draft_on_fork(m: Matcher, token_ids) -> int:
    """How many leading tokens a matcher accepts, walked on a fork (the matcher itself is untouched); for
    backends with no native draft validation."""
    probe = m.fork()
    n = 0
    for t in token_ids:
        if not probe.accept(int(t)):
            break
        n += 1
    return n


def fill_masks(matchers: Sequence[Matcher], drafts: Sequence[Sequence[int]] | None = None,
               out: torch.Tensor | None = None, valid_counts: list | None = None,
               errors: dict | None = None, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Masks for every matcher now and after each prefix of its draft, in one call.

    Row order: for matcher i, the mask now, then after drafts[i][0], ..., after drafts[i][-1]
    (sum(len(d) + 1) rows). Without drafts, `rows` may place matcher i's mask at row rows[i] of `out` instead of
    row i (an engine step whose unconstrained sequences keep their logits rows; the other rows of `out` are left
    as they are). Rows after the first ungrammatical draft token are all zeros; how many draft
    tokens were grammatical per matcher is appended to `valid_counts` if given. Matchers end in the state
    they started in. llguidance matchers are filled together on llguidance's thread pool (GIL released); without
    drafts, xgrammar matchers together in one xgrammar batch call and Triggered matchers through their inner
    matchers; the others one by one.
    A matcher whose constraint fails (ConstraintError: e.g. it exceeded the backend's lexer limits) gets
    all-zero rows; with `errors` (a dict) the message goes to errors[i] and the others are unaffected;
    without it the first such error is raised once every row is filled.
    Cost: the masks (tens of µs each, in parallel for llguidance) plus ~0.3-0.5 µs of Python per matcher
    (plus ~0.3 µs per draft token).
    """
    n = len(matchers)
    if rows is not None:
        if drafts is not None:
            raise ValueError("fill_masks: `rows` places one mask per matcher; it cannot be given with drafts")
        if len(rows) != n:
            raise ValueError(f"{n} matchers but {len(rows)} rows")
        starts = range(n) if _is_range(rows) else list(map(int, rows))
        if starts and min(starts) < 0:
            raise ValueError(f"bitmask row {min(starts)} out of range")
        rows, lens = (max(starts) + 1 if starts else 0), None
    elif drafts is None:
        starts, rows, lens = range(n), n, None
    else:
        if len(drafts) != n:
            raise ValueError(f"{n} matchers but {len(drafts)} draft lists")
        lens = list(map(len, drafts))
        ends = list(accumulate(map((1).__add__, lens)))  # C-level loops: this runs every engine step
        rows = ends[-1] if ends else 0
        starts = [0, *ends]
        starts.pop()
    words = (matchers[0].vocab_size + 31) // 32 if matchers else 1
    if out is None:  # (rows no matcher writes, when `rows` skips some: nothing allowed)
        out = (torch.empty if lens is not None or starts.__class__ is range else torch.zeros)(
            (rows, words), dtype=torch.int32)
    else:
        _check_out(out, rows, words)
    failed: dict = {}
    # A class with a `fill_batch(matchers, drafts, starts, out, errors) -> counts | None` static method fills a
    # whole batch of its own matchers in one call (llguidance: one call into its thread pool) and says None, having
    # written nothing, when the batch holds others; the common case is one such call, with no pass of ours over
    # the batch to check its classes (the backend's batch call checks them anyway).
    fill_batch = getattr(type(matchers[0]), "fill_batch", None) if matchers else None
    counts = fill_batch(matchers, drafts, starts, out, failed) if fill_batch is not None else None
    if counts is None:
        counts = [0] * n
        groups: dict = {}
        for i, m in enumerate(matchers):
            groups.setdefault(type(m), []).append(i)
        for cls, idx in groups.items():
            fill_batch = getattr(cls, "fill_batch", None)
            group_errors: dict = {}
            sub = None if fill_batch is None else fill_batch(
                [matchers[i] for i in idx], None if drafts is None else [drafts[i] for i in idx],
                [starts[i] for i in idx], out, group_errors)
            if sub is None:  # one by one
                for i in idx:
                    d = list(drafts[i]) if drafts is not None else []
                    try:
                        counts[i] = _fill_one(matchers[i], d, out, starts[i])
                    except ConstraintError as e:
                        out[starts[i]: starts[i] + len(d) + 1].zero_()
                        failed[i] = str(e)
                continue
            for i, c in zip(idx, sub):
                counts[i] = c
            for k, msg in group_errors.items():
                failed[idx[k]] = msg
    if lens is not None and counts != lens:
        for i, d in enumerate(lens):
            if counts[i] < d:  # rows after the first ungrammatical draft token: nothing allowed
                out[starts[i] + counts[i] + 1: starts[i] + d + 1].zero_()
    if valid_counts is not None:
        valid_counts.extend(counts)
    if failed:
        if errors is None:
            i = min(failed)
            raise ConstraintError(f"matcher {i}: {failed[i]}")
        errors.update(failed)
    return out


def _is_range(rows) -> bool:
    """rows == [0, 1, ..., n-1] (the usual engine step: every sequence constrained), so fill_masks can use its
    reusable consecutive-rows path."""
    if rows.__class__ is range:
        return rows.start == 0 and rows.step == 1
    return not rows or (rows[0] == 0 and rows[-1] == len(rows) - 1 and list(rows) == list(range(len(rows))))


_checked_out = (None, 0, None)  # (tensor, data pointer, shape) of the last output bitmask check_bitmask passed


def _check_out(out: torch.Tensor, rows: int, words: int) -> None:
    """check_bitmask, skipped when `out` is the tensor last checked, unmoved and unresized (an engine passes the
    same preallocated bitmask every step; the full check costs ~1 µs)."""
    global _checked_out
    last, ptr, shape = _checked_out
    if out is last and out.data_ptr() == ptr and out.shape == shape:
        if shape[0] < rows or shape[1] != words:
            raise ValueError(f"bitmask shape {tuple(shape)} too small: need [{rows}, {words}]")
        return
    check_bitmask(out, rows, words)
    _checked_out = (out, out.data_ptr(), out.shape)  # one tuple, one store: safe to race (worst case: re-checked)


def _fill_one(m: Matcher, draft: list, out: torch.Tensor, start: int) -> int:
    n_ok = m.check_draft(draft) if draft else 0
    m.fill_mask(out, start)
    if n_ok == 0:
        return 0
    walker = m.fork()
    for j in range(n_ok):
        walker.accept(draft[j])
        walker.fill_mask(out, start + j + 1)
    return n_ok
