"""Grammar bitmasks for one engine step, filled on a background thread while the model's forward runs.

`MaskFiller.start(rows, num_rows, vocab_size)` returns at once; `MaskJob.wait()` blocks until every row is filled.
The step's constrained rows go to ONE background thread, as ONE `grammars.fill_masks(matchers, out=, rows=)` call:
llguidance matchers (the default backend, and Triggered matchers inside their grammar) are filled together on
llguidance's own thread pool with the GIL released, reusing the previous step's work list when the batch is the
same sequences; xgrammar matchers in one xgrammar batch call; others one by one inside that call. A matcher whose
constraint fails
(ConstraintError) fails only its own row (zeroed, message in wait()'s dict); any other exception out of the batch
call makes the thread redo the step row by row, each row isolated, so one broken matcher still only fails its own
request.
Matchers are only read here: the engine commits tokens after wait(). The bitmask is one of two alternating
buffers (pinned when CUDA is present, so the copy to the GPU is asynchronous), grown when a step has more rows:
a step's buffer is not written again until two steps later, after its own step's sampling has synchronized.
Only the rows of constrained sequences are written; the sampler reads only those (MaskJob.rows).
A fill the mask thread has not started by wait() (nothing ran in between) is run by wait() itself.
Cost on the engine's thread: one submit; on the mask thread: fill_masks' Python work (about a list comparison
for an unchanged batch) plus the masks themselves, in parallel.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Sequence

import torch

from .sampler import apply_token_bitmask, bitmask_words


def _fill_rows(bitmask: torch.Tensor, rows) -> dict[int, str]:
    """Fill (logits row, matcher) pairs one at a time; {row: message} for those that raised (row zeroed)."""
    errors = {}
    for row, matcher in rows:
        try:
            matcher.fill_mask(bitmask, row)
        except Exception as exc:  # one broken matcher must only fail its own request
            errors[row] = f"grammar mask failed: {type(exc).__name__}: {exc}"
            bitmask[row].zero_()
    return errors


def _fill_step(bitmask: torch.Tensor, rows, matchers: list, row_ids: list) -> dict[int, str]:
    """One fill_masks call for the whole step; row by row if it raises anything but a per-matcher error."""
    from deepinfer_sg.grammars import fill_masks  # (lazily, as the engine imports grammars: ~1 s at first)

    failed: dict = {}
    try:
        fill_masks(matchers, out=bitmask, rows=row_ids, errors=failed)
    except Exception:  # e.g. a matcher object that does not follow the protocol: isolate every row
        return _fill_rows(bitmask, rows)
    return {row_ids[i]: f"grammar mask failed: ConstraintError: {msg}" for i, msg in failed.items()}


class MaskFiller:
    """Fills a step's grammar bitmasks on one background thread so they overlap the model's forward (see the
    module docstring). The parallelism is the backend's own pool (llguidance's), not ours."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="mask")
        self._buffers: list = [None, None]
        self._turn = 0

    def _buffer(self, num_rows: int, words: int) -> torch.Tensor:
        """The next of the two alternating buffers, as a [num_rows, words] view (re-allocated when too small). The
        view object is kept while the row count is unchanged (the usual step), so fill_masks' tensor checks
        see the tensor they checked last time and skip."""
        self._turn ^= 1
        buf, view = self._buffers[self._turn] or (None, None)
        if view is not None and view.shape[0] == num_rows and view.shape[1] == words:
            return view
        if buf is None or buf.shape[0] < num_rows or buf.shape[1] != words:
            # a normal tensor even when the step runs under inference_mode: the mask thread (outside inference
            # mode) writes into it
            with torch.inference_mode(False):
                buf = torch.empty((max(num_rows, 2 * (0 if buf is None else buf.shape[0])), words),
                                  dtype=torch.int32, pin_memory=torch.cuda.is_available())
        with torch.inference_mode(False):
            view = buf[:num_rows]
        self._buffers[self._turn] = (buf, view)
        return view

    def start(self, rows: Sequence[tuple[int, object]], num_rows: int, vocab_size: int) -> "MaskJob":
        """rows: (logits row, matcher) pairs needing a mask; every other row stays unmasked."""
        row_ids = [r for r, _ in rows]
        job = MaskJob(num_rows=num_rows, rows=row_ids)
        if not rows:
            return job
        job.bitmask = self._buffer(num_rows, bitmask_words(vocab_size))
        matchers = [m for _, m in rows]
        job.work = partial(_fill_step, job.bitmask, rows, matchers, row_ids)
        job.future = self.pool.submit(job.work)
        return job

    def shutdown(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class MaskJob:
    num_rows: int
    rows: list
    bitmask: Optional[torch.Tensor] = None
    future: Optional[Future] = None
    work: Optional[Callable[[], dict]] = None  # the fill itself (what the future runs)

    def wait(self) -> dict[int, str]:
        """Block until filled; returns {row: error message} for rows whose matcher failed. A fill the mask thread
        has not picked up yet (nothing overlapped it: the caller waited at once) runs here instead, saving the
        two thread switches."""
        if self.future is None:
            return {}
        return self.work() if self.future.cancel() else self.future.result()

    def apply(self, logits: torch.Tensor) -> None:
        if self.bitmask is None:
            return
        idx = torch.tensor(self.rows, dtype=torch.long)
        bm = self.bitmask.to(logits.device, non_blocking=True)
        apply_token_bitmask(logits, bm, idx.to(logits.device))
