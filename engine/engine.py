"""LLMEngine: requests in, one step at a time, outputs out.

One step, spelled out so speculative decoding can slot into it:
    1. poll constraint compilations (ready -> schedulable; failed -> that request finishes with the error)
    2. schedule     : continuous batch of prefill chunks and decode rows under token + memory budgets
    3. masks        : start filling each constrained row's bitmask on CPU worker threads
    4. forward      : model.forward_step(chunks) while the masks are being filled; in steady decode the step was
                      planned during the previous step's device time and the next one is planned now (StepPipeline)
    5. sample       : wait for masks, apply them, temperature/top-k/top-p with counter-based randomness
    6. commit       : matchers accept the tokens, detokenize, stop checks, finish and free caches
The engine is single-threaded apart from the grammar workers (compilation and mask filling).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from .cache_pool import CachePool, model_device, step_chunk_type
from .detokenizer import IncrementalDetokenizer, find_stop, stop_holdback
from .request import (FINISH_CONSTRAINT_COMPLETE, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Request,
                      RequestOutput, RequestState, SamplingParams, StreamDelta, snapshot)
from .mask_fill import MaskFiller
from .sampler import SamplingRow, raw_logprobs, sample_batch, splitmix64
from .scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from .step_pipeline import StepPipeline
from .stats import EngineStats


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None        # default: the model's max_seq_len (or unbounded)
    cache_limit_bytes: Optional[int] = None    # default: GPU free memory share, or 2 GiB on CPU
    gpu_memory_utilization: float = 0.9
    compile_timeout_s: float = 30.0            # per request, measured from arrival
    seed: int = 0                              # draws per-request seeds when SamplingParams.seed is None
    eos_token_id: Optional[int] = None         # default: the tokenizer's <｜end▁of▁sentence｜> (id 1)
    fused_sampler: Optional[bool] = None       # None: kernels' fused sampler on CUDA, torch path on CPU
    speculative: Any = None                    # engine.spec_decode.SpecConfig: decode steps go through spec_decode
    # torch's intra-op CPU threads when the model runs on a GPU: the host work of a step is small ops that threads
    # only slow down, and they contend with the mask workers (decode step, mid-size V4.1 on an H200, batch 64:
    # 21.4 ms with 1 thread vs 31.3 with 4 and 29.3 with 16; benchmarks/model_forward.py --threads). None: untouched.
    gpu_host_threads: Optional[int] = 1


def _model_vocab_size(model) -> int:
    for obj in (model, getattr(model, "config", None)):
        v = getattr(obj, "vocab_size", None)
        if v:
            return int(v)
    raise ValueError("cannot find the model's vocab_size (model.vocab_size or model.config.vocab_size)")


def _takes_host_ids(model) -> bool:
    from .model import Model
    return isinstance(model, Model)


def _tokenizer_eos(tokenizer) -> Optional[int]:
    if tokenizer is None:
        return None
    for name in ("<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>"):
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return tid
    return None


class LLMEngine:
    """Offline engine over one model. Thread-compatible, not thread-safe: drive it from one thread.

    add_request(...) -> request id; step() -> list[StreamDelta]; has_unfinished(); output(id).
    """

    def __init__(self, model, tokenizer=None, config: Optional[EngineConfig] = None, compiler=None,
                 cache_pool: Optional[CachePool] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.device = model_device(model)
        if self.device.type == "cuda" and self.config.gpu_host_threads:
            torch.set_num_threads(self.config.gpu_host_threads)
        # the V4 model checks and uploads host token ids itself, with the positions, in one pinned async copy; ids
        # already on the device would cost a synchronisation for its range check
        self._ids_on_host = self.device.type == "cuda" and _takes_host_ids(model)
        self.vocab_size = _model_vocab_size(model)
        self.eos_token_id = self.config.eos_token_id if self.config.eos_token_id is not None else _tokenizer_eos(tokenizer)
        cfg = getattr(model, "config", None)
        model_max = getattr(model, "max_seq_len", None) or getattr(cfg, "max_position_embeddings", None)
        self.max_model_len = self.config.max_model_len or model_max
        # the resolved limit is visible in the (copied) config, for callers sizing max_tokens
        self.config = dataclasses.replace(self.config, max_model_len=self.max_model_len)
        self.pool = cache_pool or CachePool(model, self.config.cache_limit_bytes,
                                            gpu_memory_utilization=self.config.gpu_memory_utilization)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens), self.pool)
        self.masks = MaskFiller()
        # plans each steady decode step while the device still runs the one before (engine/step_pipeline.py)
        self.pipeline = StepPipeline(model)
        self.chunk_type = step_chunk_type(model)
        self._compiler = compiler
        self.requests: dict[str, Request] = {}
        self.compiling: list[Request] = []
        self._finished_undelivered: list[Request] = []
        self._arrivals = itertools.count()
        self.stats = EngineStats()
        self.spec = None
        self._automata = None               # automata.AutomatonBuilder, made on the first constraint that needs it
        if self.config.speculative is not None:
            from .spec_decode import SpecDecoder
            self.spec = SpecDecoder(model, self.config.speculative, chunk_type=self.chunk_type,
                                    vocab_size=self.vocab_size, ids_on_host=self._ids_on_host)

    # ------------------------------------------------------------ requests

    @property
    def automata(self):
        """Background builder of device token automata (SpecConfig(draft_masks="automaton"))."""
        if self._automata is None:
            from .automata import AutomatonBuilder
            limits = self.spec.config.automaton_limits if self.spec is not None else None
            self._automata = AutomatonBuilder(self.compiler, self.device, limits)
        return self._automata

    @property
    def compiler(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("constraints need a tokenizer; build the engine with tokenizer=...")
            from deepinfer_sg.grammars import ConstraintCompiler
            eos = [self.eos_token_id] if self.eos_token_id is not None else None
            self._compiler = ConstraintCompiler(self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=eos)
        return self._compiler

    def add_request(self, prompt: Union[str, Sequence[int]], params: Optional[SamplingParams] = None,
                    constraint: Any = None, request_id: Optional[str] = None, add_bos: bool = True) -> str:
        """Queue one request. Text prompts are tokenized (with a leading BOS unless the text has one).
        A bad prompt raises ValueError here; a bad constraint fails only this request (finish "error")."""
        params = params or SamplingParams()
        index = next(self._arrivals)
        request_id = request_id if request_id is not None else str(index)
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        text = prompt if isinstance(prompt, str) else None
        ids = self._tokenize(prompt, add_bos) if text is not None else [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"request {request_id!r}: empty prompt (give at least one token)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids {bad[:5]} outside [0, {self.vocab_size})")
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt has {len(ids)} tokens, the model allows "
                             f"{self.max_model_len} in total (prompt + output)")
        seed = params.seed if params.seed is not None else splitmix64((self.config.seed << 20) + index)
        req = Request(request_id=request_id, prompt_token_ids=ids, params=params, prompt=text,
                      constraint=constraint, seed=seed, arrival_index=index)
        req.metrics.arrival_time = time.perf_counter()
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.requests[request_id] = req
        if constraint is None:
            req.metrics.ready_time = req.metrics.arrival_time
            self.scheduler.add(req)
            return request_id
        req.state = RequestState.COMPILING
        try:
            req.compile_future = self.compiler.compile_async(constraint)
        except Exception as exc:  # the spec was rejected before even reaching a worker
            self._finish(req, FINISH_ERROR, _error_text(exc))
            return request_id
        self.compiling.append(req)
        return request_id

    def _tokenize(self, text: str, add_bos: bool) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids or build the engine with tokenizer=")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.tokenizer.token_to_id("<｜begin▁of▁sentence｜>")
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, FINISH_ERROR, "aborted by the caller")

    def has_unfinished(self) -> bool:
        return bool(self.compiling or self.scheduler.has_work() or self._finished_undelivered)

    def output(self, request_id: str) -> RequestOutput:
        return snapshot(self.requests[request_id])

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output, forgetting the request (long offline runs should not keep every request)."""
        out = snapshot(self.requests[request_id])
        if out.finished:
            del self.requests[request_id]
        return out

    # ------------------------------------------------------------ the step

    def step(self) -> list[StreamDelta]:
        """Run one engine step; returns the deltas of every request that produced text or finished."""
        t0 = time.perf_counter()
        self._poll_compiles()
        batch = self.scheduler.schedule()
        for req, message in batch.failed:
            self._finish(req, FINISH_ERROR, message)
        self.stats.num_preemptions += len(batch.preempted)
        t1 = time.perf_counter()
        self.stats.time_schedule_s += t1 - t0
        if batch.chunks:
            with torch.inference_mode():
                try:
                    self._run_batch(batch)
                except Exception as exc:   # one bad request must not take the others down: isolate it
                    self._isolate_failed_step(batch, exc)
                else:
                    for c in batch.chunks:
                        if c.samples:
                            c.request.suspect = False
        elif self.compiling:
            # nothing runnable: sleep until a compilation finishes rather than spinning
            wait([r.compile_future for r in self.compiling], timeout=0.05, return_when=FIRST_COMPLETED)
        deltas = self._collect_deltas(batch)
        t_end = time.perf_counter()
        if batch.chunks:
            self.stats.num_steps += 1
            self.stats.time_step_s += t_end - t0
        return deltas

    def _run_batch(self, batch: ScheduledBatch) -> None:
        spec: list = []
        if self.spec is not None:
            # decode rows of eligible requests take the speculative step; the rest (prefill chunks) ride along in
            # the same forward and are sampled on this path
            spec = [c for c in batch.chunks if self._spec_eligible(c)]
            if spec:
                rest = [c for c in batch.chunks if not any(c is s for s in spec)]
                budget = self.config.max_num_batched_tokens - sum(len(c.token_ids) for c in rest)
                if not rest:
                    self._run_spec(spec, budget)
                    return
                batch = ScheduledBatch(chunks=rest)
        sampling = batch.sampling_chunks
        rows = [c.request for c in sampling]
        # 3. masks on worker threads (matchers hold the committed state; nothing mutates them until 6.)
        mask_rows, broken = [], {}
        for i, r in enumerate(rows):
            if r.matcher is None:
                continue
            try:
                if r.matcher.is_constrained():
                    mask_rows.append((i, r.matcher))
            except Exception as exc:   # a broken matcher fails its own request, not the step
                broken[i] = f"request {r.request_id!r}: matcher failed: {type(exc).__name__}: {exc}"
        job = self.masks.start(mask_rows, len(rows), self.vocab_size)
        try:
            # 4. forward (one for the speculative rows and this batch's chunks together)
            t0 = time.perf_counter()
            chunks = self._model_chunks(batch)
            if spec:
                logits = self._run_spec(spec, budget, extra_chunks=chunks)
            else:
                logits = self._forward(chunks)
            self.stats.time_forward_s += time.perf_counter() - t0
            self._sample_commit(batch, rows, mask_rows, broken, job, logits)
        except BaseException:
            job.wait()          # the mask workers read the matchers: let them finish before anyone else does
            raise

    def _model_chunks(self, batch: ScheduledBatch) -> list:
        """The model's StepChunks of a batch: one host-to-device copy for the whole step, a view per chunk."""
        flat = torch.tensor([t for c in batch.chunks for t in c.token_ids], dtype=torch.long)
        if not self._ids_on_host:
            flat = flat.to(self.device)
        chunks, start = [], 0
        for c in batch.chunks:
            chunks.append(self.chunk_type(c.request.cache, flat[start:start + len(c.token_ids)], 1 if c.samples else 0))
            start += len(c.token_ids)
        return chunks

    def _forward(self, chunks: list) -> torch.Tensor:
        # no plan ahead with speculation: its steps verify varying row counts and roll caches back
        out = self.pipeline.forward(chunks, plan_next=self.spec is None)
        if self.spec is not None and getattr(self.model, "mtp", None) is not None and out.draft_features is not None:
            from .dspark import update_draft_keys
            update_draft_keys(self.model, chunks, out.draft_features)   # the drafter reads every processed token
        if out.logits.device.type == "cuda":
            torch.cuda.synchronize(out.logits.device)
        return out.logits

    def _sample_commit(self, batch: ScheduledBatch, rows: list, mask_rows: list, broken: dict, job,
                       logits: torch.Tensor) -> None:
        t1 = time.perf_counter()
        # 5. sample
        mask_errors = job.wait()
        mask_errors.update(broken)
        t2 = time.perf_counter()
        self.stats.time_mask_wait_s += t2 - t1
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs]
        lps = raw_logprobs(logits, lp_rows)
        srows = [SamplingRow(r.params.temperature, r.params.top_k, r.params.top_p, r.seed, r.num_tokens) for r in rows]
        tokens = sample_batch(logits.float(), srows, job, fused=self.config.fused_sampler)
        t3 = time.perf_counter()
        self.stats.time_sample_s += t3 - t2
        self.stats.num_masked_rows += len(mask_rows)
        self.stats.record_batch(len(rows))
        # 6. commit
        for c in batch.chunks:
            c.request.num_computed += len(c.token_ids)
            if not c.samples:
                self.stats.num_prefill_tokens += len(c.token_ids)
        lp_of = {}
        if lps is not None:
            chosen = torch.tensor([max(tokens[i], 0) for i in lp_rows], device=lps.device)
            vals = lps.gather(1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
            lp_of = dict(zip(lp_rows, vals))
        for i, req in enumerate(rows):
            if req.finished:
                continue
            if i in mask_errors:
                self._finish(req, FINISH_ERROR, mask_errors[i])
                continue
            self._commit_token(req, tokens[i], lp_of.get(i))
        self.pool.note_usage()
        self.stats.time_commit_s += time.perf_counter() - t3

    def _isolate_failed_step(self, batch: ScheduledBatch, exc: Exception) -> None:
        """A step raised (in the forward, the sampler or a speculative step). Caches may be half-advanced, but
        matchers and outputs only change at commit, so each request is consistent up to its committed tokens.
        Alone in its batch: that request is the cause and fails with the error. Otherwise every request of the
        batch drops its cache and reruns alone (scheduler `suspect`), which pins the failure on the guilty one
        and lets the others continue; nothing they generated is lost."""
        self.pipeline.cancel()
        self.stats.num_step_failures += 1
        reqs = list({id(c.request): c.request for c in batch.chunks if not c.request.finished}.values())
        why = _error_text(exc)
        if len(reqs) == 1:
            self._finish(reqs[0], FINISH_ERROR, f"request {reqs[0].request_id!r}: the model step failed on this "
                                                 f"request alone: {why}")
            return
        for req in reqs:
            self.scheduler.requeue_suspect(req)

    def _spec_eligible(self, c) -> bool:
        r = c.request
        return (c.samples and len(c.token_ids) == 1 and r.num_pending == 1 and bool(r.output_token_ids)
                and not r.params.logprobs and r.cache is not None)

    def _run_spec(self, chunks, max_rows: int, extra_chunks: Sequence = ()) -> Optional[torch.Tensor]:
        """Speculative decode step (engine/spec_decode.py) for decoding requests: verify their draft blocks,
        commit the accepted tokens through `_commit_token` (matchers, stops, lengths), draft the next blocks.
        max_rows: the step's token budget left after the other chunks (verify rows are trimmed to it).
        extra_chunks: the step's other model chunks (prefills), run in the same forward; returns their logits."""
        from .spec_decode import SpecSequence
        self.pipeline.cancel()      # speculation rolls caches back: no plan may be open on them
        reqs = [c.request for c in chunks]
        # start-up profile of the step-time curve (once; a SpecConfig.step_times table skips it)
        self.spec.ensure_time_model(min(self.config.max_num_seqs, 64 if self.device.type == "cuda" else 8))

        def left(r):
            n = r.params.max_tokens - len(r.output_token_ids)
            if self.max_model_len is not None:
                n = min(n, self.max_model_len - r.num_tokens)
            return max(1, n)

        seqs = []
        for r in reqs:
            p = r.params
            stops = list(p.stop_token_ids) + ([self.eos_token_id] if self.eos_token_id is not None and not p.ignore_eos else [])
            seqs.append(SpecSequence(r.cache, r.output_token_ids[-1], r.seed, p.temperature, p.top_k, p.top_p,
                                     r.matcher, tuple(stops), left(r), automaton=self._automaton_for(r)))

        def commit(i, tokens, finish):
            req = reqs[i]
            req.num_computed = req.cache.length            # x0 + accepted drafts; the last token is pending
            for t in tokens:
                if req.finished:
                    break
                self._commit_token(req, t, None)
            if finish == 3 and not req.finished:            # speculative.FINISH_ERROR: nothing allowed
                self._finish(req, FINISH_ERROR, f"request {req.request_id!r}: the constraint allows no token here "
                                                 "(all logits masked); the grammar is a dead end")
            if req.finished:
                return False
            seqs[i].last_token, seqs[i].max_new_tokens = req.output_token_ids[-1], left(req)
            return True

        t0 = time.perf_counter()
        extra_logits = self.spec.step(seqs, commit, max_rows=max(len(seqs), max_rows), extra_chunks=extra_chunks)
        if not extra_chunks:
            self.stats.time_forward_s += time.perf_counter() - t0
        self.stats.record_batch(len(reqs))
        self.pool.note_usage()
        return extra_logits

    def _automaton_for(self, req: Request):
        """The request's device automaton with its state after the committed output seeded in the cache (a new
        cache after preemption gets it again), or None: not built (yet), or the output left its language."""
        if req.automaton_key is None or self._automata is None:
            return None
        a = self._automata.get(req.automaton_key)
        if a is None:
            return None
        state = req.cache.extra.get("automaton_state")
        if state is None:
            state = req.cache.extra["automaton_state"] = a.walk(a.initial, req.output_token_ids)
        if state < 0:                 # DEAD: the verifier allowed what the automaton's regex does not
            req.automaton_key = None
            req.cache.extra.pop("automaton_state", None)
            return None
        return a

    def _commit_token(self, req: Request, token: int, logprob: Optional[float]) -> None:
        if token < 0:
            self._finish(req, FINISH_ERROR, f"request {req.request_id!r}: the constraint allows no token here "
                                             "(all logits masked); the grammar is a dead end")
            return
        now = time.perf_counter()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        matcher_done = False
        if req.matcher is not None:
            try:
                ok = req.matcher.accept(token)
            except Exception as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            else:
                why = "the matcher rejected a token its own mask allowed"
            if not ok:
                self._finish(req, FINISH_ERROR, f"request {req.request_id!r}: internal constraint error at output "
                                                 f"token {len(req.output_token_ids)} (id {token}): {why}")
                return
            matcher_done = req.matcher.is_terminated()
        req.output_token_ids.append(token)
        self.stats.num_sampled_tokens += 1
        if logprob is not None:
            req.output_logprobs.append(logprob)
        p = req.params
        is_eos = token == self.eos_token_id
        stop_token = token in p.stop_token_ids or (is_eos and not p.ignore_eos)
        if matcher_done:
            if not (is_eos or token in p.stop_token_ids):
                self._detokenize(req, token)
            self._finish(req, FINISH_CONSTRAINT_COMPLETE)
            return
        if stop_token:
            self._finish(req, FINISH_STOP)
            return
        if self._detokenize(req, token):
            self._finish(req, FINISH_STOP)
            return
        if len(req.output_token_ids) >= p.max_tokens or (
                self.max_model_len is not None and req.num_tokens >= self.max_model_len):
            self._finish(req, FINISH_LENGTH)

    def _detokenize(self, req: Request, token: int) -> bool:
        """Add one token's text; True when a stop string appeared (the text is cut before it)."""
        if req.detokenizer is None:
            return False
        before = len(req.detokenizer.text)
        req.detokenizer.add(token)
        req.text = req.detokenizer.text
        if req.params.stop:
            pos = find_stop(req.text, req.params.stop, before)
            if pos is not None:
                req.text = req.text[:pos]
                return True
        return False

    def _finish(self, req: Request, reason: str, error: Optional[str] = None) -> None:
        if req.finished:
            return
        # a plan made ahead holds its caches (and the slab / arena rows they reserved) until launched or cancelled:
        # a finished request's cache must not outlive it there, e.g. when the engine goes idle after this step
        self.pipeline.cancel()
        if req.detokenizer is not None and reason != FINISH_ERROR and not (reason == FINISH_STOP and req.params.stop
                                                                           and len(req.text) < len(req.detokenizer.text)):
            req.detokenizer.flush()
            req.text = req.detokenizer.text
        req.finish_reason = reason
        req.error = error
        req.state = RequestState.FINISHED
        req.metrics.finish_time = time.perf_counter()
        if req in self.compiling:
            self.compiling.remove(req)
        self.scheduler.remove(req)
        self.stats.num_finished += 1
        self.stats.num_errors += reason == FINISH_ERROR
        self._finished_undelivered.append(req)

    def _poll_compiles(self) -> None:
        now = time.perf_counter()
        for req in list(self.compiling):
            fut = req.compile_future
            if fut.done():
                self.compiling.remove(req)
                try:
                    compiled = fut.result()
                    req.matcher = compiled.matcher()
                except Exception as exc:
                    self._finish(req, FINISH_ERROR, _error_text(exc))
                    continue
                if self.spec is not None and self.spec.config.draft_masks == "automaton":
                    req.automaton_key = self.automata.request(req.constraint, compiled)
                req.metrics.ready_time = now
                self.scheduler.add(req)
            elif now - req.metrics.arrival_time > self.config.compile_timeout_s:
                fut.cancel()
                self._finish(req, FINISH_ERROR, f"constraint compilation timed out after "
                                                 f"{self.config.compile_timeout_s:.1f} s")

    def _collect_deltas(self, batch: ScheduledBatch) -> list[StreamDelta]:
        touched = {c.request.request_id: c.request for c in batch.sampling_chunks}
        for req in self._finished_undelivered:
            touched[req.request_id] = req
        self._finished_undelivered = []
        deltas = []
        for req in touched.values():
            text_end = len(req.text)
            if not req.finished and req.params.stop:
                text_end -= stop_holdback(req.text, req.params.stop)
            new_text = req.text[req.num_text_emitted:text_end] if text_end > req.num_text_emitted else ""
            new_tokens = req.output_token_ids[req.num_tokens_emitted:]
            if not new_text and not new_tokens and not req.finished:
                continue
            req.num_text_emitted = max(req.num_text_emitted, text_end)
            req.num_tokens_emitted = len(req.output_token_ids)
            deltas.append(StreamDelta(req.request_id, new_text, new_tokens, req.finish_reason, req.error))
        return deltas

    # ------------------------------------------------------------ conveniences

    def run_until_done(self, request_ids: Optional[Iterable[str]] = None, progress=None) -> list[RequestOutput]:
        """Step until the given requests (default: all) finish; returns their outputs in the given order."""
        ids = list(request_ids) if request_ids is not None else list(self.requests)
        pending = set(ids)
        while pending and self.has_unfinished():
            for d in self.step():
                if d.finish_reason is not None and d.request_id in pending:
                    pending.discard(d.request_id)
                    if progress is not None:
                        progress.update(1)
        return [self.output(i) for i in ids]

    def close(self) -> None:
        self.pipeline.cancel()
        self.masks.shutdown()
        if self._automata is not None:
            self._automata.close()


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
