"""Scheduler decisions checked by hand: token budget, decode-first order, chunk boundaries, slots,
memory-bounded admission and newest-first preemption."""
from __future__ import annotations

from deepinfer_sg.engine.cache_pool import CacheGrowthModel, CachePool
from deepinfer_sg.engine.request import Request, SamplingParams
from deepinfer_sg.engine.scheduler import Scheduler, SchedulerConfig
from test_engine_fakes import PrefixHashModel

MODEL = PrefixHashModel(vocab_size=64, rows=3)


def make(budget=10, seqs=8, limit=1 << 30):
    pool = CachePool(MODEL, limit_bytes=limit, growth=CacheGrowthModel(fixed=1024, per_token=256))
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget), pool), pool


def req(i, n_prompt):
    return Request(request_id=str(i), prompt_token_ids=list(range(1, n_prompt + 1)), params=SamplingParams(),
                   arrival_index=i)


def advance(batch):
    """What the engine does after a step: caches advance; sampled chunks get one new token."""
    for c in batch.chunks:
        c.request.cache.hashes.extend([0] * len(c.token_ids))
        c.request.num_computed += len(c.token_ids)
        if c.samples:
            c.request.output_token_ids.append(5)


def test_chunked_prefill_under_budget_then_decode_first():
    s, _ = make(budget=10)
    a, b = req(0, 14), req(1, 3)
    s.add(a)
    s.add(b)
    b1 = s.schedule()
    assert [(c.request.request_id, len(c.token_ids), c.samples) for c in b1.chunks] == [("0", 10, False)]
    advance(b1)
    b2 = s.schedule()    # a finishes its prompt (4 tokens, samples), b is admitted with its whole prompt
    assert [(c.request.request_id, len(c.token_ids), c.samples) for c in b2.chunks] == [("0", 4, True), ("1", 3, True)]
    advance(b2)
    b3 = s.schedule()    # both decode: one token each, the token sampled last step
    assert [(c.request.request_id, c.token_ids, c.samples) for c in b3.chunks] == [("0", [5], True), ("1", [5], True)]


def test_slots_limit_admission():
    s, _ = make(budget=100, seqs=2)
    for i in range(3):
        s.add(req(i, 2))
    b = s.schedule()
    assert [c.request.request_id for c in b.chunks] == ["0", "1"] and len(s.waiting) == 1


def test_memory_bounds_admission_and_preempts_newest():
    # each cache: 1024 + 256 * tokens. Limit fits two 4-token requests (2 * 2048) but not a third.
    s, pool = make(budget=100, limit=2 * 2048 + 100)
    for i in range(3):
        s.add(req(i, 4))
    b1 = s.schedule()
    assert [c.request.request_id for c in b1.chunks] == ["0", "1"]
    advance(b1)
    # next step both grow by 256 bytes: over the limit, so the newest (1) is preempted, 0 decodes
    b2 = s.schedule()
    assert [r.request_id for r in b2.preempted] == ["1"]
    assert [c.request.request_id for c in b2.chunks] == ["0"]
    r1 = b2.preempted[0]
    assert r1.num_computed == 0 and r1.cache is None and r1.output_token_ids == [5]
    assert [r.request_id for r in s.waiting] == ["1", "2"]    # back in arrival order, ahead of 2
    assert "1" not in pool.live


def test_decode_with_a_stored_draft_block_is_charged_its_verify_rows():
    """A decoding request holding a draft block of 4 tokens verifies 1 + 4 rows next step: the budget (10) is
    charged 5 for it, so of three decoding requests only two fit, and the third waits for the next step."""
    import torch

    from deepinfer_sg.engine.spec_decode import _Block

    s, _ = make(budget=10)
    reqs = [req(i, 2) for i in range(3)]
    for r in reqs:
        s.add(r)
    advance(s.schedule())                       # the three prompts, whole
    block = _Block(tokens=torch.zeros(4, dtype=torch.long), probs=torch.zeros(4, 8),
                   confidences=torch.ones(4, dtype=torch.float64), forced=torch.zeros(4, dtype=torch.bool), valid=4)
    for r in reqs:
        r.cache.extra["spec"] = block
    b = s.schedule()
    assert [(c.request.request_id, c.token_ids) for c in b.chunks] == [("0", [5]), ("1", [5])]
    for r in reqs:
        r.cache.extra.pop("spec")
    assert [c.request.request_id for c in s.schedule().chunks] == ["0", "1", "2"]   # without blocks: 1 row each
