"""verify_schedule: the step-time model, Algorithm 1, budget + top-K allocation, non-anticipation, App. A."""
import itertools

import pytest
import torch

from deepinfer_sg.engine import speculative as S
from deepinfer_sg.engine import verify_schedule as VS
from test_spec_toys import exact_verify_outcomes


# ------------------------------------------------------------------------------------------ step time model
def test_step_time_buckets_and_infeasible_sizes():
    m = VS.StepTimeModel.from_table({8: 2.0, 1: 1.0, 2: 1.1, 4: 1.5})
    got = m.step_seconds(torch.tensor([1, 2, 3, 4, 5, 8, 9]), num_seqs=1).tolist()
    assert got == [1.0, 1.1, 1.5, 1.5, 2.0, 2.0, float("inf")]
    with pytest.raises(ValueError, match="positive"):
        VS.StepTimeModel.from_table({1: 0.0})


def test_online_slope_and_sampler_corrections():
    m = VS.StepTimeModel.from_table({4: 1.0, 8: 2.0}, min_samples=3)
    for extra in (0.4, 0.8, 0.4):            # size 4: (measured - base) / 4 -> medians 0.1
        m.observe(num_seqs=2, rows=3, forward_seconds=1.0 + extra, sampler_seconds=0.5)
    assert m.slope() == pytest.approx(0.1)
    for extra in (1.6, 1.6):                 # size 8 has too few samples to count
        m.observe(num_seqs=3, rows=8, forward_seconds=2.0 + extra)
    assert m.slope() == pytest.approx(0.1)
    m.observe(num_seqs=3, rows=8, forward_seconds=3.6)
    assert m.slope() == pytest.approx(0.15)  # median over sizes of (0.1, 0.2)
    # sampler: fewer than 5 samples at n=2 -> global median 0.5; then per-n median
    assert m.sampler_seconds(2) == 0.5 and m.sampler_seconds(7) == 0.5
    for s in (0.1, 0.1, 0.2):
        m.observe(num_seqs=2, rows=4, forward_seconds=1.4, sampler_seconds=s)
    assert m.sampler_seconds(2) == pytest.approx(0.35)   # median of 0.1, 0.1, 0.2, 0.5, 0.5, 0.5
    t = float(m.step_seconds(torch.tensor([5]), num_seqs=2)[0])
    assert t == pytest.approx(2.0 + m.slope() * 8 + m.sampler_seconds(2))
    m.observe(num_seqs=1, rows=1, forward_seconds=0.1)   # faster than the profile: slope clamps at >= 0
    assert m.slope() >= 0


def test_profile_uses_the_trimmed_mean(monkeypatch):
    clock = [0.0]
    durations = {1: iter([9.0, 1.0, 2.0, 3.0, 100.0, 0.5]), 2: iter([9.0, 4.0, 4.0, 4.0, 4.0, 4.0])}
    monkeypatch.setattr(VS.time, "perf_counter", lambda: clock[0])

    def run_step(rows):
        clock[0] += next(durations[rows])

    m = VS.profile_step_times(run_step, [2, 1], warmup=1, repeats=5)
    assert m.sizes == [1, 2] and m.base_seconds == pytest.approx([2.0, 4.0])   # 1,2,3 of (1,2,3,100,0.5)


# ------------------------------------------------------------------------------------------ schedulers
def _theta(rates, lengths, model):
    r = rates.shape[0]
    exp = r + sum(float(rates[i, :int(lengths[i])].sum()) for i in range(r))
    return exp / float(model.step_seconds(torch.tensor([r + int(sum(lengths))]), r)[0])


def _brute_force_best(rates, model):
    r, L = rates.shape
    best, arg = -1.0, None
    for ls in itertools.product(range(L + 1), repeat=r):
        th = _theta(rates, ls, model)
        if th > best + 1e-15:
            best, arg = th, ls
    return best, arg


def _random_rates(gen, r, L):
    return VS.cumulative_rates(torch.rand(r, L, generator=gen, dtype=torch.float64) * 0.9 + 0.1)


def test_sync_is_optimal_when_throughput_is_unimodal():
    """Linear step time makes Theta quasi-concave along the path; Algorithm 1 then finds the optimum
    over ALL verify-length vectors (brute force)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        r, L = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        slope = float(torch.rand(1, generator=gen)) * 0.5
        model = VS.StepTimeModel.from_table({b: 1.0 + slope * b for b in range(1, r * (L + 1) + 1)})
        rates = _random_rates(gen, r, L)
        best, _ = _brute_force_best(rates, model)
        got = VS.schedule_sync(rates, model)
        assert _theta(rates, got.tolist(), model) == pytest.approx(best, rel=1e-12)


def test_budget_plus_top_k_is_optimal_on_a_jagged_curve():
    """The unconstrained scan with allocation over the same rates reaches the brute-force optimum
    even when the step-time curve has buckets (where Algorithm 1's early stop may stop short)."""
    gen = torch.Generator().manual_seed(1)
    sync_short = 0
    for trial in range(40):
        r, L = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        n = r * (L + 1)
        sizes = sorted(set([1, 2, 4] + list(range(8, n + 8, 4)) + [n]))
        times = torch.cumsum(torch.rand(len(sizes), generator=gen, dtype=torch.float64) * 0.6 + 0.05, 0)
        model = VS.StepTimeModel(sizes, times.tolist())
        rates = _random_rates(gen, r, L)
        best, _ = _brute_force_best(rates, model)
        got = VS.allocate_top_k(rates, VS.verify_budget(rates, model))
        assert _theta(rates, got.tolist(), model) == pytest.approx(best, rel=1e-12)
        sync_short += _theta(rates, VS.schedule_sync(rates, model).tolist(), model) < best - 1e-12
    assert sync_short > 0          # the jagged curves really exercise the difference


def test_top_k_allocation_prefixes_and_ties():
    rates = torch.tensor([[0.9, 0.9, 0.5], [0.9, 0.6, 0.0], [0.5, 0.5, 0.5]], dtype=torch.float64)
    # order: (0,0) (0,1) (1,0) (1,1) (0,2) (2,0) (2,1) (2,2); zeros never admitted
    assert VS.allocate_top_k(rates, 3).tolist() == [2, 1, 0]
    assert VS.allocate_top_k(rates, 5).tolist() == [3, 2, 0]
    assert VS.allocate_top_k(rates, 6).tolist() == [3, 2, 1]
    assert VS.allocate_top_k(rates, 100).tolist() == [3, 2, 3]
    assert VS.allocate_top_k(rates, 0).tolist() == [0, 0, 0]


@pytest.mark.parametrize("scheduler", ["sync", "async"])
def test_admission_never_depends_on_the_entries_it_enables(scheduler):
    """Non-anticipation: the rates a[r, j+1:] depend on the draft d_{r,j}; changing them (keeping them
    non-increasing and <= a[r, j]) never changes whether d_{r,j} is verified."""
    gen = torch.Generator().manual_seed(2)
    model = VS.StepTimeModel.from_table({1: 1.0, 2: 1.02, 3: 1.3, 4: 1.31, 6: 1.6, 8: 2.2, 12: 2.6, 16: 3.5})
    for trial in range(300):
        r, L = int(torch.randint(1, 4, (1,), generator=gen)), 3
        rates = _random_rates(gen, r, L)
        budget_rates = _random_rates(gen, r, L)
        i, j = int(torch.randint(0, r, (1,), generator=gen)), int(torch.randint(0, L - 1, (1,), generator=gen))
        other = rates.clone()
        tail = torch.rand(L - j - 1, generator=gen, dtype=torch.float64)
        other[i, j + 1:] = rates[i, j] * torch.cumprod(tail, 0)
        run = (lambda a: VS.schedule_sync(a, model)) if scheduler == "sync" else \
              (lambda a: VS.schedule_async(budget_rates, a, model))
        assert (run(rates)[i] > j) == (run(other)[i] > j)


def test_a_global_scan_over_current_rates_anticipates():
    """The property above is not vacuous: budgeting from the CURRENT rates (no early stop) lets a later
    entry decide whether an earlier draft is verified."""
    model = VS.StepTimeModel.from_table({1: 1.0, 2: 1.6, 3: 1.7})
    naive = lambda a: VS.allocate_top_k(a, VS.verify_budget(a, model))
    hi, lo = VS.cumulative_rates(torch.tensor([[0.5, 0.95]])), VS.cumulative_rates(torch.tensor([[0.5, 0.05]]))
    assert naive(hi).tolist() == [2] and naive(lo).tolist() == [0]
    assert VS.schedule_sync(hi, model).tolist() == VS.schedule_sync(lo, model).tolist() == [0]


def test_grammar_confidences():
    c = torch.tensor([[0.5, 0.6, 0.7, 0.8, 0.9]] * 3, dtype=torch.float64)
    forced = torch.tensor([[False, True, False, False, False]] * 3)
    valid = torch.tensor([5, 1, 3])
    drafts = torch.tensor([[3, 1, 0, 2, 2], [3, 3, 3, 3, 3], [4, 4, 4, 4, 4]])
    out = VS.grammar_confidences(c, forced, valid, drafts, torch.tensor([[0], [0], [0]]))
    assert out.tolist() == [[0.5, 1.0, 0.7, 0.0, 0.0],      # stop drafted at index 2: later entries 0
                            [0.5, 1.0, 0.0, 0.0, 0.0],      # violation at index 1 (forced pos kept as 1)
                            [0.5, 1.0, 0.7, 0.8, 0.0]]      # violation at index 3 keeps its own entry


# ------------------------------------------------------------------------------------------ App. A
def _app_a_law(schedule, budget_rates=None):
    """Exact P(first token) in the paper's App. A: V = {A=0, B=1}, q = (0.7, 0.3), p = (0.5, 0.5);
    c_1 = 0.5, c_2 = 0.95 after A and 0.05 after B; the second position is a coin flip everywhere."""
    law = [0.0, 0.0]
    half = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q1 = torch.tensor([0.7, 0.3], dtype=torch.float64)
    for d1 in (0, 1):
        for d2 in (0, 1):
            w = 0.25
            rates = VS.cumulative_rates(torch.tensor([[0.5, 0.95 if d1 == 0 else 0.05]]))
            ell = int(schedule(rates)[0])
            drafts = [d1, d2][:ell]
            q = torch.stack([q1, half, half])[:ell + 1]
            p = torch.stack([half, half, torch.zeros(2, dtype=torch.float64)])[:ell + 1]
            p[ell] = 0
            [outcomes] = exact_verify_outcomes([dict(q=q, p=p, tokens=torch.tensor(drafts + [S.FRESH]))])
            for prob, n, committed, _ in outcomes:
                law[committed[0]] += w * prob
    return law


def test_app_a_counterexample():
    model = VS.StepTimeModel.from_table({1: 1.0, 2: 1.6, 3: 1.7})
    naive = _app_a_law(lambda a: VS.allocate_top_k(a, VS.verify_budget(a, model)))
    assert naive[0] == pytest.approx(0.85, abs=1e-12)       # biased: 0.5 * 1 + 0.5 * 0.7
    sync = _app_a_law(lambda a: VS.schedule_sync(a, model))
    assert sync[0] == pytest.approx(0.7, abs=1e-12)
    for prev in (0.05, 0.95):    # async: budget from the previous round's rates, whatever they were
        old = VS.cumulative_rates(torch.tensor([[0.5, prev]]))
        asyn = _app_a_law(lambda a: VS.schedule_async(old, a, model))
        assert asyn[0] == pytest.approx(0.7, abs=1e-12)
