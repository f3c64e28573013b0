"""Continuous batching with chunked prefill under a token budget, bounded by cache memory.

Each step every running request contributes the tokens it still has to run through the model
(`all_token_ids[num_computed:]`): one token when decoding, a chunk of its prompt when prefilling,
its prompt plus earlier outputs when resuming after preemption. Decoding requests go first (latency),
then prefills, then newly admitted requests, until `max_num_batched_tokens` is used up. A chunk that
reaches the end of its request's tokens yields one logits row, from which the next token is sampled.

Memory: before scheduling a chunk we predict the cache growth it causes (CachePool's growth model).
If the step would exceed the pool's limit we preempt the newest running request (its cache is
dropped; its tokens, matcher state and counters are kept, so it resumes by re-running prompt+outputs
and, with counter-based randomness, produces exactly the tokens it would have). Admission only
happens while the predicted usage stays under the limit.

Failure isolation: when a step raises (engine.py), every request of that batch is requeued like a preempted
one and marked `suspect`; a batch that holds a suspect is cut down to that suspect's chunk alone, so the next
failure names exactly one request (which then fails alone) and the innocent ones clear their mark after one
solo step. Each suspect makes at least one token of progress per failure, so this cannot loop.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .cache_pool import CachePool
from .request import Request, RequestState
from .spec_decode import pending_draft_rows


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256              # running requests at once
    max_num_batched_tokens: int = 2048   # tokens per forward (prefill chunks + decode rows)


@dataclass
class ScheduledChunk:
    request: Request
    token_ids: list[int]                 # fed to the model this step, right after the cache's length
    samples: bool                        # True: the chunk ends at the request's last token -> 1 logits row


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)   # cannot fit even alone

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def sampling_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.samples]


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: CachePool):
        self.config = config
        self.pool = pool
        self.waiting: list[Request] = []    # sorted by arrival_index (preempted requests regain their place)
        self.running: list[Request] = []    # sorted by arrival_index
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.state = RequestState.WAITING
        keys = [r.arrival_index for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.arrival_index), req)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its cache."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.pool.release(req.request_id)
        req.cache = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _drop_cache(self, req: Request) -> None:
        """Back to waiting without a cache; tokens, matcher and counters stay, so it resumes by recompute."""
        self.running.remove(req)
        self.pool.release(req.request_id)
        req.cache = None
        req.num_computed = 0
        self.add(req)

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self._drop_cache(req)
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(req)

    def requeue_suspect(self, req: Request) -> None:
        """A request of a failed step: its cache may be half-advanced, so drop it; it reruns alone."""
        req.suspect = True
        if req in self.running:
            self._drop_cache(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        growth = self.pool.growth
        projected = self.pool.used_bytes()
        limit = self.pool.limit_bytes
        scheduled: set[str] = set()

        # running requests: decodes first, then unfinished prefills; both oldest first
        order = sorted(self.running, key=lambda r: (r.num_pending > 1, r.arrival_index))
        for req in order:
            if budget <= 0:
                break
            if req not in self.running:        # preempted earlier in this loop
                continue
            n = min(req.num_pending, budget)
            # a decoding request with a stored draft block verifies 1 + its drafts rows: charge them all, in
            # tokens and in cache growth (the speculative step trims drafts to what is left of the budget)
            extra = pending_draft_rows(req.cache) if req.num_pending == 1 else 0
            need = int(growth.per_token * (n + extra)) + 1
            while projected + need > limit:
                victims = [r for r in self.running if r.request_id not in scheduled]
                victim = max(victims, key=lambda r: r.arrival_index)
                if victim is req and len(self.running) == 1 and not scheduled:
                    batch.failed.append((req, self._too_big_message(req)))
                    self.running.remove(req)
                    break
                projected -= int(victim.cache.nbytes()) if victim.cache is not None else 0
                self._preempt(victim, batch)
                if victim is req:
                    break
            if req not in self.running:
                continue
            projected += need
            budget -= n + extra
            scheduled.add(req.request_id)
            batch.chunks.append(self._chunk(req, n))

        # admission of waiting requests, oldest first, while tokens, slots and memory allow
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_pending, budget)
            need = growth.bytes_for(n)
            if projected + need > limit:
                if not self.running and not batch.chunks:
                    self.waiting.pop(0)
                    batch.failed.append((req, self._too_big_message(req)))
                    continue
                break
            self.waiting.pop(0)
            req.cache = self.pool.allocate(req.request_id)
            req.state = RequestState.RUNNING
            keys = [r.arrival_index for r in self.running]
            self.running.insert(bisect.bisect(keys, req.arrival_index), req)
            projected += need
            budget -= n
            scheduled.add(req.request_id)
            batch.admitted.append(req)
            batch.chunks.append(self._chunk(req, n))
        # a suspect runs alone (the others keep their caches and are scheduled again next step)
        suspect = next((c for c in batch.chunks if c.request.suspect), None)
        if suspect is not None:
            batch.chunks = [suspect]
        return batch

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed
        tokens = req.all_token_ids[start:start + n]
        return ScheduledChunk(req, tokens, samples=(start + n == req.num_tokens))

    def _too_big_message(self, req: Request) -> str:
        return (f"request {req.request_id!r} needs more cache memory than the pool's limit "
                f"({self.pool.limit_bytes} bytes) even when running alone "
                f"({req.num_tokens} tokens ~ {self.pool.growth.bytes_for(req.num_tokens)} bytes)")
