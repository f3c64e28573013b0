"""The top-k/top-p threshold kernels (kernels/threshold.py) against the definition, computed by brute force in
float64 (every token's count and mass of strictly larger z; top-p on the renormalised top-k set), on both the fast
path and the bisection fallback."""
import pytest
import torch

from deepinfer_sg.kernels import threshold
from deepinfer_sg.kernels.sampling import masked_z_torch, row_params, sample_torch, sample_triton
from deepinfer_sg.kernels.threshold import thresholds_and_paths
from helpers import DEVICE, on_dev, params_on_dev, random_bitmask


def _brute_tau(z: torch.Tensor, top_k: int, top_p: float, greedy: bool) -> float:
    """Smallest kept z of one row by the definition: O(V^2) comparisons in float64."""
    V = z.numel()
    if greedy or not ((0 < top_k < V) or top_p < 1) or not bool((z > -torch.inf).any()):
        return float("-inf")
    z64 = z.double()
    e = torch.exp(z64 - z64.max())
    gt = z64[None, :] > z64[:, None]                      # gt[v, u]: z_u > z_v
    count = gt.sum(1)
    k = top_k if top_k > 0 else V + 1
    in_k = (count < k) & (z64 > -torch.inf)               # the top-k set; top-p acts on it, renormalised
    mass = (gt * e[None, :]).sum(1) / e[in_k].sum()
    keep = in_k & ((mass < top_p) | (top_p >= 1))        # p = 1: top-p off (even where float masses saturate)
    return float(z[keep].min())


def _check(logits, temperature, top_k, top_p, bitmask=None, mrows=None, **kw):
    R, V = logits.shape
    p = row_params(R, "cpu", temperature, top_k, top_p, seed=torch.arange(R), position=3)
    mr = None if bitmask is None else (torch.arange(R) if mrows is None else mrows)
    tau, path = thresholds_and_paths(on_dev(logits), params_on_dev(p), on_dev(bitmask), on_dev(mr), **kw)
    tau, path = tau.cpu(), path.cpu()
    z = masked_z_torch(logits, p.inv_temperature, bitmask, mr)
    want = torch.tensor([_brute_tau(z[r], int(p.top_k[r]), float(p.top_p[r]), bool(p.greedy[r])) for r in range(R)])
    assert torch.equal(tau, want), (tau, want, path)
    return path


def test_fast_path_matches_definition_on_mixed_rows():
    gen = torch.Generator().manual_seed(21)
    R, V = 9, 1000
    logits = torch.randn(R, V, generator=gen) * 3
    logits[4] = (logits[4] * 2).round() / 2                # many ties, also at the threshold
    logits[5, :7] = logits[5].max() + 0.125                # ties at the maximum, across the first chunk
    logits[6, 900:] = logits[6].max() + 2                  # every candidate in the last (partial) chunk
    bm = random_bitmask(R + 1, V, gen, density=0.6)
    bm[8] = 0                                              # nothing allowed in that mask row
    mrows = torch.tensor([0, 1, -1, 3, 4, 5, 6, 9, 8])
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 1.0, 2.0, 1.0, 1.0])
    top_k = torch.tensor([1, 50, 0, 5, 12, 3, 40, 0, 5])
    top_p = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.95, 1.0, 0.6, 1.0, 0.9])
    path = _check(logits, temperature, top_k, top_p, bm, mrows, chunk=256)
    assert (path > 0).sum() >= 6                           # the fast path did the work
    assert int(path[3]) == -2 and int(path[7]) == -2 and int(path[8]) == -2    # greedy, no filter, nothing allowed


def test_fallback_rows_flat_and_huge_logits():
    gen = torch.Generator().manual_seed(22)
    R, V = 4, 600
    logits = torch.randn(R, V, generator=gen) * 0.3        # flat: top-p 0.9 needs hundreds of candidates
    logits[2] = logits[2] * 1e7                            # beyond the bin grid: must fall back
    logits[3] = torch.randn(V, generator=gen) * 4
    path = _check(logits, 1.0, torch.tensor([0, 0, 0, 6]), torch.tensor([0.9, 0.5, 0.7, 1.0]), cmax=64, chunk=128)
    # flat rows with top-p alone: the histogram path gathers only the bins that may hold the cut (37 tokens here);
    # huge logits with top-p alone: one token carries the mass, the candidate path (no bin grid) decides
    assert 0 < int(path[0]) <= 64 and int(path[2]) > 0 and int(path[3]) > 0
    # more tokens in those bins than the candidate buffer holds: the row-wide bisection decides
    path = _check(logits, 1.0, torch.tensor([0, 0, 0, 6]), torch.tensor([0.9, 0.5, 0.7, 1.0]), cmax=16, chunk=128)
    assert int(path[0]) == -1 and int(path[2]) > 0 and int(path[3]) > 0
    # huge logits on the candidate path (no bin grid there): top-k 7, with and without top-p
    path = _check(logits[2:3].repeat(2, 1), 1.0, 7, torch.tensor([1.0, 0.5]), chunk=128)
    assert (path > 0).all()


def test_sampling_with_filters_matches_twin_tokens():
    """End to end through sample_triton: same tokens as the twin on rows with top-k/top-p."""
    gen = torch.Generator().manual_seed(23)
    R, V = 40, 700
    logits = torch.randn(R, V, generator=gen) * 2.5
    top_k = torch.randint(0, 30, (R,), generator=gen)
    top_p = torch.where(torch.rand(R, generator=gen) < 0.5, torch.rand(R, generator=gen) * 0.9 + 0.05,
                        torch.ones(R))
    p = row_params(R, "cpu", 1.0, top_k, top_p, seed=torch.arange(R) * 31 + 1, position=9)
    a = sample_torch(logits, p)
    b = sample_triton(on_dev(logits), params_on_dev(p)).cpu()
    assert torch.equal(a, b)


def test_top_p_acts_on_the_renormalised_top_k_set():
    """Top-k, then top-p relative to the mass of the top-k set (the engine's order): on these rows that keeps
    fewer tokens than top-p over the whole row would, on the fast path and on the fallback."""
    gen = torch.Generator().manual_seed(24)
    R, V = 4, 500
    logits = torch.randn(R, V, generator=gen) * 0.5
    logits[:, :6] = torch.tensor([6.0, 5.8, 5.6, 5.4, 5.2, 5.0])     # six leaders over a wide flat tail
    path = _check(logits, 1.0, torch.tensor([4, 4, 6, 3]), torch.tensor([0.7, 0.7, 0.6, 0.9]), chunk=128)
    # the histogram path (kmax below every k) with its fallback, and the lane path's overflow fallback (lcap 2)
    path_fb = _check(logits, 1.0, torch.tensor([4, 4, 6, 3]), torch.tensor([0.7, 0.7, 0.6, 0.9]), cmax=4, chunk=128,
                     kmax=2)
    path_ov = _check(logits, 1.0, torch.tensor([4, 4, 6, 3]), torch.tensor([0.7, 0.7, 0.6, 0.9]), chunk=128, lcap=2)
    assert (path > 0).all() and (path_fb == -1).any() and (path_ov == -1).all()
    # the old rule (mass over the whole row) keeps all k tokens here: the tail carries most of the mass
    p = row_params(R, "cpu", 1.0, torch.tensor([4, 4, 6, 3]), torch.tensor([0.7, 0.7, 0.6, 0.9]), 0, 0)
    tau = thresholds_and_paths(on_dev(logits), params_on_dev(p), None, None)[0].cpu()
    kept = masked_z_torch(logits, p.inv_temperature) >= tau[:, None]
    assert kept.sum(1).tolist() != [4, 4, 6, 3]


@pytest.mark.parametrize("lane_shape,wave", [(None, False), ((128, 4), False), ((256, 8), False), (None, True)])
def test_candidate_path_overflow_ties_and_masks(lane_shape, wave, monkeypatch):
    """The lane path (0 < top_k <= kmax) against the definition on its awkward rows: more tied lanes at the bound
    than the merge may gather (the row's exact fallback), a top-k set larger than the all-pairs block (200 tied
    leaders: the bisection), rows whose mask leaves fewer than k lanes alive, and k at the limit; for each program
    shape of the lane-maxima pass, and with the merge's launch options for more rows than SMs (MERGE_WAVE)."""
    if wave:
        monkeypatch.setattr(threshold, "one_wave", lambda programs, device: programs <= 1)
    gen = torch.Generator().manual_seed(25)
    R, V = 6, 1500
    logits = torch.randn(R, V, generator=gen) * 2
    logits[1, 100:300] = 9.0                               # 200 tied leaders: |K| > KP
    logits[2, :] = (logits[2] * 4).round() / 4             # ties everywhere
    bm = random_bitmask(R, V, gen, density=0.7)
    bm[3] = 0
    bm[3, :2] = -1                                         # 64 allowed tokens, all in segment 0: few live lanes
    top_k = torch.tensor([8, 50, 30, 40, 64, 3])
    top_p = torch.tensor([0.9, 0.8, 1.0, 0.7, 0.95, 1.0])
    path = _check(logits, 0.8, top_k, top_p, bm, chunk=256, lcap=256, lane_shape=lane_shape)
    assert (path >= 1).all()
    path = _check(logits, 0.8, top_k, top_p, bm, chunk=256, lane_shape=lane_shape)     # 140 tied lanes > 128
    assert int(path[1]) == -1 and int((path >= 1).sum()) >= 4
    path = _check(logits, 0.8, top_k, top_p, bm, chunk=256, lcap=16, lane_shape=lane_shape)   # overflow: fallback
    assert (path == -1).any() and (path >= 1).any()


def test_top_p_alone_on_the_candidate_path_when_the_leaders_carry_the_mass():
    """Top-p without top-k first tries the 64 largest: exact when they carry at least p of the row's mass (peaked
    rows, as LLM logits are), else the histogram path decides (flat rows)."""
    gen = torch.Generator().manual_seed(26)
    R, V = 4, 3000
    logits = torch.randn(R, V, generator=gen)
    logits[:2, :30] += 9.0                                 # 30 leaders carry almost all the mass
    path = _check(logits, 1.0, 0, torch.tensor([0.95, 0.5, 0.9, 0.6]), chunk=512)
    assert (path[:2] > 0).all()
    p = row_params(R, "cpu", 1.0, 0, torch.tensor([0.95, 0.5, 0.9, 0.6]), seed=torch.arange(R), position=3)
    cand_only = thresholds_and_paths(on_dev(logits), params_on_dev(p), None, None, chunk=512, histogram=False)[1]
    assert cand_only.cpu().tolist()[2:] == [-3, -3]          # left to the histogram path
    # a unit with more candidates than its slots: the merge's exact bisection must use top-p alone (no k)
    path = _check(logits, 1.0, 0, torch.tensor([0.95, 0.5, 0.9, 0.6]), chunk=512, lcap=8)
    assert (path[:2] == -1).all()


def test_merge_top_slice_on_many_candidates():
    """Rows whose leading lanes are full of large tokens (20 lanes of 12 tokens far above the rest) leave hundreds
    of candidates >= the lane bound (more than the merge's all-pairs block): the merge keeps the top bins of a
    histogram holding >= k of them, then all pairs; exact against the definition."""
    gen = torch.Generator().manual_seed(27)
    R, V = 4, 3000
    logits = torch.randn(R, V, generator=gen) * 3
    ids = (torch.arange(20)[:, None] + torch.arange(12)[None, :] * 256).flatten()     # lanes 0..19, every k
    logits[:, ids] = 12 + torch.randn(R, ids.numel(), generator=gen)
    path = _check(logits, 1.0, torch.tensor([50, 50, 20, 64]), torch.tensor([1.0, 0.9, 0.5, 0.95]))
    assert int((path > 128).sum()) >= 3, path               # the many-candidates branch ran (k = 20: fewer)


def _sorted_keep_margins(z: torch.Tensor, top_p: float):
    """Top-p alone by the definition in float64 through one sort (V too large for the all-pairs oracle): per token
    (in descending order) the value and the mass of strictly larger tokens over the row's mass, minus p (kept iff
    < 0)."""
    zs = z.double().sort(descending=True).values
    zs = zs[zs > -torch.inf]
    e = torch.exp(zs - zs[0])
    above = torch.cumsum(e, 0) - e
    first = torch.searchsorted(-zs, -zs, side="left")          # the first of each tie group: strictly larger mass
    return zs, above[first] / e.sum() - top_p


def _check_top_p_alone(logits, temperature, top_p, bitmask=None, tol=0.0, **kw):
    """thresholds_and_paths on top-p-alone rows against `_sorted_keep_margins`: the kept set {z >= tau} equals
    the definition's, except (tol > 0, compiled kernels with the hardware exp) tokens within tol of the margin."""
    R, V = logits.shape
    p = row_params(R, "cpu", temperature, 0, top_p, seed=torch.arange(R), position=3)
    mr = None if bitmask is None else torch.arange(R)
    tau, path = thresholds_and_paths(on_dev(logits), params_on_dev(p), on_dev(bitmask), on_dev(mr), **kw)
    tau, path = tau.cpu(), path.cpu()
    z = masked_z_torch(logits, p.inv_temperature, bitmask, mr)
    for r in range(R):
        zs, margin = _sorted_keep_margins(z[r], float(p.top_p[r]))
        differ = (zs >= float(tau[r])) != (margin < 0)
        assert bool((margin[differ].abs() <= tol).all()), (r, float(tau[r]), int(differ.sum()), int(path[r]))
    return path


@pytest.mark.parametrize("tol", [0.0] if DEVICE == "cpu" else [1e-6])
def test_top_p_alone_on_flat_rows_takes_the_bracketed_cut(tol):
    """Top-p without top-k on flat rows (thousands of kept tokens): the select brackets the bins that may hold the
    cut, the gather sums the exact mass around them, the tau pass narrows them by a histogram to an all-pairs
    block (or bisects a dense block): no row falls back to the row-wide bisection, tau by the definition in
    float64. Rows of several widths (hundreds to thousands of tokens per bin), a masked row, a row of ties."""
    gen = torch.Generator().manual_seed(28)
    R, V = 6, 20000
    scale = torch.tensor([3.0, 1.0, 5.0, 2.0, 3.0, 1.5])[:, None]
    logits = torch.randn(R, V, generator=gen) * scale
    logits[5] = (logits[5] * 8).round() / 8                  # ties: bins of identical values
    bm = random_bitmask(R, V, gen, density=0.8)
    bm[:4] = -1                                              # rows 0-3 unmasked
    top_p = torch.tensor([0.9, 0.8, 0.95, 0.5, 0.9, 0.7])
    path = _check_top_p_alone(logits, 1.0, top_p, bm, tol=tol)
    assert (path > 0).all(), path                              # no fallback
    assert (path > 128).sum() >= 3, path                       # the tau pass's narrowing ran
    path = _check_top_p_alone(logits, torch.tensor([0.8, 1.2, 1.0, 0.6, 2.0, 1.0]), top_p, bm, tol=tol,
                              kmax=2)                           # no lane path attempt
    assert (path > 0).all(), path


@pytest.mark.parametrize("cmax", [None, 16])
def test_top_p_boundary_within_fp32_rounding_follows_the_float64_definition(cmax):
    """Flat rows whose p sits just past a token's cumulative mass (2e-7 of the row's mass; interpreted kernels,
    3e-6 compiled, whose hardware exp rounds each weight to ~5e-7): the float64 definition keeps that token.
    Session 5's kernel summed these masses in fp32 (~1e-6 relative) and its row-wide bisection (cmax 16 forces
    it) dropped the token in 2 of these 4 rows; both paths now sum in fp64 by one formula."""
    gen = torch.Generator().manual_seed(3)
    R, V = 4, 30000
    logits = torch.randn(R, V, generator=gen) * 3
    zs = logits.double().sort(1, descending=True).values
    e = torch.exp(zs - zs[:, :1])
    frac = (torch.cumsum(e, 1) - e) / e.sum(1, keepdim=True)       # mass strictly above each token (no ties)
    at = (frac < 0.9).sum(1) - 1 + torch.arange(R)                 # tokens near the 0.9 cut
    top_p = frac[torch.arange(R), at] + (2e-7 if DEVICE == "cpu" else 3e-6)
    kw = {} if cmax is None else dict(cmax=cmax)
    path = _check_top_p_alone(logits, 1.0, top_p.float(), **kw)
    assert (path == -1).all() if cmax else (path > 0).all()


def test_top_p_alone_without_the_lane_path_matches_twin(monkeypatch):
    """When the host knows no row takes the lane path (top-p alone with the lane try off, greedy and unfiltered
    rows), the lane launches are skipped: tau still equals the definition and the drawn tokens the twin's."""
    import deepinfer_sg.kernels.threshold as th
    monkeypatch.setattr(th, "P_ONLY_LANES", False)
    gen = torch.Generator().manual_seed(29)
    R, V = 6, 2000
    logits = torch.randn(R, V, generator=gen) * 2
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.0, 1.3, 1.0])
    top_p = torch.tensor([0.9, 0.6, 0.9, 1.0, 0.95, 0.3])
    p = row_params(R, "cpu", temperature, 0, top_p, seed=torch.arange(R) + 5, position=11)
    assert th.needs_lane_path(p, V) is False
    _check(logits, temperature, 0, top_p, lane_rows=False)
    got = sample_triton(on_dev(logits), params_on_dev(p), filters=True, histogram=True, lane_rows=False).cpu()
    assert torch.equal(got, sample_torch(logits, p))


def test_histogram_path_rows_with_few_allowed_tokens_stay_on_the_fast_path(monkeypatch):
    """Masks that leave fewer tokens than top_k asks (k > KMAX: the histogram path), or a top-p the bins' mass
    bounds cannot certify (p 0.995 on a row whose few tokens sit in one bin): every allowed token is counted, so
    the candidates stop at the last counted bin instead of falling back to the row-wide bisection."""
    import deepinfer_sg.kernels.threshold as th
    monkeypatch.setattr(th, "P_ONLY_LANES", False)
    gen = torch.Generator().manual_seed(30)
    R, V = 4, 3000
    logits = torch.randn(R, V, generator=gen)
    bm = torch.zeros(R, (V + 31) // 32, dtype=torch.int32)
    bm[:, 5] = 0x00FF00F0                                  # 12 allowed tokens per row
    logits[:, 160:192] = 3.0 + torch.rand(R, 32, generator=gen) * 0.01   # ... all in one bin
    path = _check(logits, 1.0, torch.tensor([100, 0, 100, 0]), torch.tensor([1.0, 0.995, 0.9, 0.5]), bm,
                  lane_rows=False)
    assert (path > 0).all(), path


def test_merge_bound_rows_with_few_live_lanes_or_groups_and_clustered_leaders():
    """The lane path's merge bounds (the maxima of strided lane groups first: group i holds lanes i, i + NG/16, ...
    of the NG lanes padded to a power of two; the histogram rounds when that leaves more than LCAP lanes or fewer
    than k groups are alive) against the definition and the twin's tokens: a flat row (the group bound holds), a
    row whose mask leaves fewer live lanes than k with tokens below every lane's max (all of them belong to the
    top-k set: a bound at the smallest lane max lost them before session 8), k = 64 over 64 live groups, leaders
    in a few lane groups (too many lanes above the group bound), a mask leaving more lanes than k in fewer groups
    than k. The inputs' lane and group counts are checked here, as the kernel groups them, so every case is the
    one named."""
    from deepinfer_sg.kernels.sampling import lanes_view
    from deepinfer_sg.kernels.threshold import GROUP_SIZE
    gen = torch.Generator().manual_seed(41)
    R, V = 6, 9000                                          # 3 segments x 256 lanes: 64 groups of 16 lanes
    ids = torch.arange(V)
    logits = torch.randn(R, V, generator=gen) * 2
    bm = torch.full((R, (V + 31) // 32), -1, dtype=torch.int32)
    few = torch.cat([torch.arange(10) + 256 * j for j in range(3)])          # 10 lanes holding 3 tokens each
    bm[1] = 0
    bm[1, 0] = (1 << 10) - 1
    bm[1, 8] = (1 << 10) - 1
    bm[1, 16] = (1 << 10) - 1
    logits[1, few[10:]] = -20 - torch.rand(20, generator=gen)                # below every lane's max
    logits[3, ids % 64 < 12] += 8                                            # leaders in a few lane groups
    allowed = torch.nn.functional.pad(ids % 64 < 3, (0, bm.shape[1] * 32 - V)).view(-1, 32).long()
    words = (allowed << torch.arange(32)).sum(-1)
    bm[4] = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)   # lanes alive in 3 groups
    top_k = torch.tensor([20, 25, 64, 40, 30, 0])
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.8, 1.0, 1.0])
    temperature = torch.tensor([1.0, 0.9, 1.0, 1.2, 0.8, 0.0])
    z = masked_z_torch(logits, 1.0 / temperature.clamp_min(1e-6), bm, torch.arange(R))
    lanes = lanes_view(z, float("-inf")).amax(-1)                            # [R, 768] lane maxima
    NG = 1 << (lanes.shape[1] - 1).bit_length()
    padded = torch.nn.functional.pad(lanes, (0, NG - lanes.shape[1]), value=float("-inf"))
    group_max = padded.view(R, GROUP_SIZE, NG // GROUP_SIZE).amax(1)          # the kernel's strided groups
    live = lanes > float("-inf")
    groups = (group_max > float("-inf")).sum(1)
    assert live[1].sum() == 10 < 25 and groups[2] == 64 and groups[4] == 3 < 30 <= live[4].sum()
    fortieth = torch.sort(group_max[3], descending=True).values[39]
    assert int((lanes[3] >= fortieth).sum()) > 128                           # the group bound leaves too many
    path = _check(logits, temperature, top_k, top_p, bm)
    assert (path[:5] >= 1).all() and int(path[1]) == 30
    p = row_params(R, "cpu", temperature, top_k, top_p, seed=torch.arange(R) * 7, position=4)
    want = sample_torch(logits, p, bm, torch.arange(R))
    got = sample_triton(on_dev(logits), params_on_dev(p), on_dev(bm), on_dev(torch.arange(R))).cpu()
    assert torch.equal(got, want)
