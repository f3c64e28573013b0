"""Speculative steps under the engine's token budget (issue 6's left-over, fixed for issue 7): SpecDecoder.step
(max_rows=...) never runs more target rows than the budget, and stays lossless: greedy identical to plain
decoding, and the sampled two-token law equal to the target's exact law (chi-square) with most requests capped."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_spec_engine import (PROMPTS, TABLE, assert_matches_law, exact_two_token_law, plain_greedy,  # noqa: E402,F401
                              tiny)  # (tiny: a module fixture)

from deepinfer_sg.engine import spec_decode as SD  # noqa: E402
from deepinfer_sg.engine.model import StepChunk  # noqa: E402


def test_row_shares_by_hand():
    assert SD.row_shares(3, 10).tolist() == [3, 2, 2]          # 7 spare rows over 3 requests
    assert SD.row_shares(4, 3).tolist() == [0, 0, 0, 0]        # fewer rows than requests: x0 rows only
    assert SD.row_shares(2, 2).tolist() == [0, 0]
    assert SD.row_shares(5, 5 + 5 * 4).tolist() == [4] * 5


class RowCounter(SD.SpecDecoder):
    """Records the verify rows of every step (the stats count them per step)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows_per_step = []
        self.budgets = []

    def step(self, seqs, commit, max_rows=None):
        before = self.stats.verify_rows
        super().step(seqs, commit, max_rows=max_rows)
        self.rows_per_step.append(self.stats.verify_rows - before)
        self.budgets.append(max_rows)


def test_greedy_identical_under_a_tight_budget(tiny):
    refs = [plain_greedy(tiny, p, 10)[0] for p in PROMPTS]
    for max_rows in (3, 5, 8):
        cfg = SD.SpecConfig(n=4, schedule="fixed", drafter="self", step_times=TABLE)
        reqs = [SD.StandaloneRequest(p, max_tokens=10) for p in PROMPTS]
        dec = SD.generate(tiny, reqs, cfg, decoder=RowCounter(tiny, cfg), max_rows=max_rows)
        assert [r.output for r in reqs] == refs
        assert max(dec.rows_per_step) <= max_rows
        assert max(dec.rows_per_step) == max_rows or max_rows == 3   # the budget is used, not just respected
        if max_rows == 3:
            assert dec.stats.mean_accepted_length == 1.0             # x0 rows only: plain decoding
        else:
            assert dec.stats.mean_accepted_length > 1.3


def test_sampled_two_token_law_under_a_budget(tiny):
    """300 requests share 400 rows: 100 of them may verify one draft, the rest none; the law of the first two
    tokens (top-k 3, T = 1) must still be the target's (8 degrees of freedom, P(chi2 > 26.1) = 0.001)."""
    prompt = PROMPTS[0]
    top_k = 3
    law = exact_two_token_law(tiny, prompt, top_k)
    n = 300
    reqs = [SD.StandaloneRequest(prompt, max_tokens=2, temperature=1.0, top_k=top_k, seed=s) for s in range(n)]
    cfg = SD.SpecConfig(n=2, schedule="fixed", drafter="dspark", step_times=TABLE)
    dec = SD.generate(tiny, reqs, cfg, decoder=RowCounter(tiny, cfg), max_rows=n + 100)
    assert max(dec.rows_per_step) <= n + 100
    assert_matches_law(reqs, law)


def test_pending_draft_rows_reads_the_stored_block(tiny):
    cfg = SD.SpecConfig(n=3, schedule="fixed", drafter="self", step_times=TABLE)
    dec = SD.SpecDecoder(tiny, cfg)
    cache = tiny.new_cache()
    assert SD.pending_draft_rows(cache) == 0 and SD.pending_draft_rows(None) == 0
    with torch.no_grad():
        tiny.forward_step([StepChunk(cache, torch.tensor(PROMPTS[0][:-1]), 1)])
        seq = SD.SpecSequence(cache, PROMPTS[0][-1], seed=0)
        cache.extra["spec"] = dec.draft([seq])[0]
    assert SD.pending_draft_rows(cache) == 3 == cache.extra["spec"].tokens.numel()
