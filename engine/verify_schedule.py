"""Confidence-scheduled verification: how many drafts of each request the next target forward verifies.

For R requests with cumulative confidences a[r, j] = prod_{i<=j} c[r, i] (a[r, j] estimates P(d_1..d_j all
accepted)), verifying l_r drafts of request r costs B = sum_r (1 + l_r) target rows and is expected to
commit E[tau] = sum_r (1 + sum_{j<=l_r} a[r, j]) tokens. We maximise throughput E[tau] / time(B), where
time(B) comes from a profiled step-time table (`StepTimeModel`, never constants). a is non-increasing in j,
so the marginal gain of extending r from j-1 to j is exactly a[r, j] and the best set for a fixed B is the
top-(B-R) entries: scheduling is a scan along the global descending order of the entries.

Lossless rule (non-anticipation): whether draft d_{r,j} is verified must not depend on d_{r,j} itself.
a[r, j+1] depends on d_{r,j} (the confidence head reads the previous draft), so a scan that looks past a
non-improvement lets d_{r,j} decide its own admission (the paper's App. A counterexample: P(A) = 0.85
instead of 0.7). Two safe rules, both implemented here:
- `schedule_sync` (Algorithm 1): scan the descending order and stop at the FIRST non-improvement.
  Whether (r, j) is admitted depends only on the entries before it in the order, which are >= a[r, j]
  and are either other requests' entries or r's own earlier ones (functions of d_{r,<j}).
- `schedule_async` (what a pipelined engine runs): the total budget K comes from an unconstrained scan
  (`verify_budget`) over rates that do not depend on the current drafts (the round two steps back);
  the allocation is a top-K over the current cumulative rates (`allocate_top_k`), where (r, j) is in the
  top-K iff fewer than K entries beat it (higher value, or equal value and lower flat index r*L + j).
  Entries after (r, j) of the same request are <= a[r, j] and come later in flat order, so they never
  beat it: the admitted entries of every request form a prefix and d_{r,j} does not influence its own
  admission. Entries with a == 0 are never admitted (they would add rows for no expected gain).
Ties are broken by flat index everywhere.

Grammar-aware rules (`grammar_confidences`): a position where the grammar allows exactly one token is
drafted with proposal delta(t) and is accepted with certainty, so its conditional confidence is 1;
positions strictly after the first grammar-violating draft (or after a drafted stop token) are useless and
get confidence 0. The violating draft's OWN entry keeps its rate: zeroing it would make its admission
depend on its own value; `grammar_drafting.cut_at_violation` instead turns an admitted violating draft into
a forced rejection that costs no extra row.

Cost: one sort of R*L entries and an O(R*L) scan per step (CPU or device tensors).

Integration (engine): per step the engine keeps, per request, the conditional confidences of the block it
is about to verify (drafter output, round N-1) and of the block verified one step earlier (round N-2, for
the async budget). It calls `grammar_confidences` then `cumulative_rates`, then `schedule_sync` or
`schedule_async` with its `StepTimeModel`, and feeds the measured step back with `StepTimeModel.observe`.
The result is the number of drafts to verify per request; `speculative.pack_verify_rows` builds the rows.
"""
from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

import torch


# --------------------------------------------------------------------------------------------- step time
@dataclass
class StepTimeModel:
    """Seconds per target step as a function of the number of rows B and of the number of requests.

    time(B) = base(g) + slope * g + sampler(num_seqs), g = the smallest profiled size >= B (CUDA-graph
    buckets make the curve a step function); B beyond the largest profiled size is infeasible (inf).
    slope: online correction for context growth, max(0, median over sizes of the median of the last
    `window` samples of (measured - base(g)) / g), a size counting once it has `min_samples` samples.
    sampler(n): median of the last 9 measured sampler+drafter times at n requests (>= 5 samples), else the
    median over all n, else 0.
    """
    sizes: list[int]
    base_seconds: list[float]
    window: int = 5000
    min_samples: int = 10
    _slope_samples: dict = field(default_factory=dict, repr=False)
    _sampler_by_n: dict = field(default_factory=dict, repr=False)
    _sampler_all: deque = field(default_factory=lambda: deque(maxlen=1000), repr=False)

    def __post_init__(self):
        if len(self.sizes) == 0 or len(self.sizes) != len(self.base_seconds):
            raise ValueError("StepTimeModel needs one profiled time per size and at least one size")
        order = sorted(range(len(self.sizes)), key=lambda i: self.sizes[i])
        self.sizes = [int(self.sizes[i]) for i in order]
        self.base_seconds = [float(self.base_seconds[i]) for i in order]
        if self.sizes[0] < 1 or len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"profiled sizes must be distinct positive row counts, got {self.sizes}")
        if any(not (t > 0) for t in self.base_seconds):
            raise ValueError(f"profiled times must be positive seconds, got {self.base_seconds}")
        self._sizes_t = torch.tensor(self.sizes, dtype=torch.long)
        self._graph_t = torch.cat([self._sizes_t, self._sizes_t[-1:]]).to(torch.float64)
        self._base_t = torch.tensor(self.base_seconds + [float("inf")], dtype=torch.float64)

    @classmethod
    def from_table(cls, table: Mapping[int, float], **kw) -> "StepTimeModel":
        """From {rows: seconds} (e.g. the engine's start-up profile, or a table a user passes in)."""
        return cls(list(table.keys()), list(table.values()), **kw)

    def graph_size(self, rows: int) -> Optional[int]:
        i = bisect.bisect_left(self.sizes, rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def slope(self) -> float:
        per_size = [statistics.median(s) for s in self._slope_samples.values() if len(s) >= self.min_samples]
        return max(0.0, statistics.median(per_size)) if per_size else 0.0

    def sampler_seconds(self, num_seqs: int) -> float:
        recent = self._sampler_by_n.get(num_seqs)
        if recent is not None and len(recent) >= 5:
            return statistics.median(recent)
        return statistics.median(self._sampler_all) if self._sampler_all else 0.0

    def step_seconds(self, rows: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """float64 seconds for each entry of the row-count tensor `rows` (inf beyond the table)."""
        idx = torch.searchsorted(self._sizes_t, rows.to(torch.long).cpu(), right=False)
        return self._base_t[idx] + self.slope() * self._graph_t[idx] + self.sampler_seconds(num_seqs)

    def observe(self, num_seqs: int, rows: int, forward_seconds: float, sampler_seconds: Optional[float] = None):
        """Feed back one measured step (forward time at `rows` rows; sampler+drafter time at `num_seqs`)."""
        g = self.graph_size(rows)
        if g is not None:
            i = self.sizes.index(g)
            self._slope_samples.setdefault(g, deque(maxlen=self.window)).append(
                (forward_seconds - self.base_seconds[i]) / g)
        if sampler_seconds is not None:
            self._sampler_by_n.setdefault(num_seqs, deque(maxlen=9)).append(sampler_seconds)
            self._sampler_all.append(sampler_seconds)


def profile_step_times(run_step: Callable[[int], None], sizes: Iterable[int], warmup: int = 1, repeats: int = 5,
                       synchronize: Callable[[], None] = lambda: None) -> StepTimeModel:
    """Time `run_step(rows)` (a target forward over `rows` decode/verify rows) at each size: `warmup`
    untimed runs, then `repeats` timed ones; the mean after dropping the fastest and slowest run.
    `synchronize` (e.g. torch.cuda.synchronize) is called before reading the clock."""
    sizes = sorted(set(int(s) for s in sizes))
    times = []
    for rows in sizes:
        for _ in range(warmup):
            run_step(rows)
        synchronize()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_step(rows)
            synchronize()
            samples.append(time.perf_counter() - t0)
        samples.sort()
        trimmed = samples[1:-1] if len(samples) > 2 else samples
        times.append(sum(trimmed) / len(trimmed))
    # more rows never run faster: a noisy dip would otherwise make the scheduler's scan (and the sync early
    # stop) react to measurement noise
    times = [max(times[:i + 1]) for i in range(len(times))]
    return StepTimeModel(sizes, times)


# --------------------------------------------------------------------------------------------- rates
def cumulative_rates(confidences: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a[r, j] = prod_{i<=j} c[r, i] (float64), clamped to [0, 1]; 0 at positions >= lengths[r]."""
    c = confidences.to(torch.float64).clamp(0.0, 1.0)
    if lengths is not None:
        col = torch.arange(c.shape[1], device=c.device)
        c = torch.where(col < lengths.to(c.device).unsqueeze(-1), c, torch.zeros_like(c))
    return torch.cumprod(c, dim=1)


def grammar_confidences(confidences: torch.Tensor, forced: Optional[torch.Tensor] = None,
                        valid_lengths: Optional[torch.Tensor] = None, draft_tokens: Optional[torch.Tensor] = None,
                        stop_token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Conditional confidences [R, L] with the grammar-aware rules (see the module docstring).

    forced [R, L] bool: grammar-forced positions -> 1.
    valid_lengths [R]: leading grammatical drafts; positions > valid_lengths (0-based: >= valid+1), i.e.
      strictly after the first violating draft, -> 0 (the violating draft's own entry is kept).
    draft_tokens [R, L] + stop_token_ids [R, S] (-1 padded): positions after a drafted stop token -> 0.
    """
    c = confidences.to(torch.float64).clone()
    col = torch.arange(c.shape[1], device=c.device)
    if forced is not None:
        c = torch.where(forced.to(torch.bool), torch.ones_like(c), c)
    if valid_lengths is not None:
        c = torch.where(col > valid_lengths.to(c.device).unsqueeze(-1), torch.zeros_like(c), c)
    if draft_tokens is not None and stop_token_ids is not None and stop_token_ids.numel():
        is_stop = ((draft_tokens.unsqueeze(-1) == stop_token_ids.unsqueeze(1)) & (stop_token_ids.unsqueeze(1) >= 0)).any(-1)
        after_stop = (torch.cumsum(is_stop.to(torch.long), 1) - is_stop.to(torch.long)) > 0
        c = torch.where(after_stop, torch.zeros_like(c), c)
    return c


def _descending_order(rates: torch.Tensor):
    """Flat indices of the entries sorted by value descending, ties by flat index (stable sort)."""
    flat = rates.reshape(-1)
    order = torch.sort(-flat, stable=True).indices
    return order, flat[order]


def _throughput_path(sorted_rates: torch.Tensor, num_req: int, model: StepTimeModel) -> torch.Tensor:
    """Theta_k for k = 0..M admitted entries along the given order: (R + sum_{i<=k} a_i) / time(R + k)."""
    expected = num_req + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(sorted_rates.cpu(), 0)])
    rows = num_req + torch.arange(sorted_rates.numel() + 1)
    return expected / model.step_seconds(rows, num_req)


def _lengths_from_admitted(order: torch.Tensor, k: int, shape) -> torch.Tensor:
    r, width = shape
    req = order[:k] // max(width, 1)
    return torch.bincount(req, minlength=r).to(torch.long)


def schedule_sync(rates: torch.Tensor, model: StepTimeModel) -> torch.Tensor:
    """Algorithm 1 with the early stop: verify lengths [R] from cumulative rates [R, L] (lossless)."""
    r = rates.shape[0]
    if r == 0 or rates.numel() == 0:
        return torch.zeros(r, dtype=torch.long)
    order, vals = _descending_order(rates.cpu())
    m = int((vals > 0).sum())
    theta = _throughput_path(vals[:m], r, model)
    improves = theta[1:] > theta[:-1]
    # admit the entries before the first non-improvement (the causal barrier), all of them if none
    k = m if bool(improves.all()) else int(torch.nonzero(~improves)[0])
    return _lengths_from_admitted(order, k, rates.shape)


def verify_budget(rates: torch.Tensor, model: StepTimeModel) -> int:
    """Extra verify rows K maximising throughput along the descending order, scanning the whole jagged
    curve (no early stop). Only lossless when `rates` do not depend on the drafts being verified."""
    r = rates.shape[0]
    if r == 0 or rates.numel() == 0:
        return 0
    _, vals = _descending_order(rates.cpu())
    vals = vals[vals > 0]
    theta = _throughput_path(vals, r, model)
    if not bool(torch.isfinite(theta).any()) or float(theta.max()) <= 0:
        return 0
    return int(torch.argmax(theta))                 # first maximum: the fewest rows among equals


def allocate_top_k(rates: torch.Tensor, budget: int) -> torch.Tensor:
    """Verify lengths [R]: the top-`budget` entries of cumulative rates [R, L] (ties by flat index);
    entries with rate 0 are never admitted. Each request's admitted entries form a prefix."""
    r = rates.shape[0]
    if r == 0 or rates.numel() == 0 or budget <= 0:
        return torch.zeros(r, dtype=torch.long)
    order, vals = _descending_order(rates.cpu())
    k = min(int(budget), int((vals > 0).sum()))
    return _lengths_from_admitted(order, k, rates.shape)


def schedule_async(budget_rates: torch.Tensor, alloc_rates: torch.Tensor, model: StepTimeModel) -> torch.Tensor:
    """Pipelined scheduling: budget from rates that predate the current drafts (round N-2; a request
    without history may pass 1.0 for each draft it will have), allocation by top-K over the current ones."""
    if budget_rates.shape[0] != alloc_rates.shape[0]:
        raise ValueError(f"budget_rates and alloc_rates need one row per request: {budget_rates.shape[0]} vs {alloc_rates.shape[0]}")
    return allocate_top_k(alloc_rates, verify_budget(budget_rates, model))


def schedule_fixed(lengths: torch.Tensor, max_drafts: Optional[int] = None) -> torch.Tensor:
    """Verification without scheduling: every available draft (capped at max_drafts)."""
    out = lengths.to(torch.long)
    return out.clamp_max(max_drafts) if max_drafts is not None else out
