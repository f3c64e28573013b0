"""Verification of speculative drafts for a packed batch: the standard rejection rule, exact residual
resampling, the bonus token, greedy argmax agreement, the forced-rejection sentinel, and stop tokens /
max_tokens inside an accepted block.

Row layout (one request after another, `row_counts[i]` rows for request i):
  the target ran on the inputs [x0, d_1 .. d_l] (x0 = last committed token), so row j of request i holds the
  processed target distribution q_j of the token at output position `positions[i] + j`, and it verifies the
  draft d_{j+1} that was proposed there with proposal distribution p_{j+1}:
    row_draft_tokens[row] >= 0   a draft to verify: accept iff U * p(d) < q(d)   (U ~ Uniform[0, 1))
    row_draft_tokens[row] == -1  FORCED_REJECT: a draft known to be rejected (it violates the grammar; cut
                                 at the first violation, scheme C): never accepted, the token is drawn from
                                 the residual of this row's proposal, exactly as a real rejection would do
    row_draft_tokens[row] == -2  FRESH: no draft here (the request's last row): the bonus token, drawn from q
  The last row of every request must be FORCED_REJECT or FRESH, so every request commits at least one token.
The accepted drafts are the longest all-accepted prefix; the "final" row is the first row not accepted.
Its token is drawn from the residual r = max(q - p, 0) / sum (rejected or forced-rejected row) or from q
(fresh row). Empty residual (sum == 0): only possible when q == p, where a rejection has probability 0; we
then draw from q so that the function is total. Greedy requests: accept iff d == argmax q (lowest id on
ties), the final token is argmax q: identical to plain argmax decoding, no randomness.

Randomness is counter-based: U = SplitMix64(seed, position, case) with the same formula as the engine's
plain sampler (engine/sampler.py: splitmix64(splitmix64(seed) + 3 * position + case)), case 0 = fresh /
bonus, 1 = residual, 2 = verify. Every draw depends only on (request seed, absolute token position, case),
never on the batch composition, the verify length chosen by the scheduler, or the row order; a bonus token
uses the very uniform plain sampling would use at that position. Sampling is inverse-CDF with that one
uniform (float64 cumulative sums), so a test can drive it with explicit uniforms (`VerifyUniforms`).

Stop tokens and max_tokens: the committed tokens (accepted drafts + final token) are cut right after the
first stop token and after `max_new_tokens`; `finish` says why (FINISH_STOP / FINISH_LENGTH). This is exact:
speculative sampling produces the target law for the whole token stream, and cutting at a stopping time
keeps the law of the prefix.

Cost: O(rows * V) elementwise work plus one cumulative sum over the vocabulary per request (final rows
only); no Python loop over rows or requests.

Integration (engine): reads the packed target probabilities of the verify forward (after grammar masks,
temperature, top-k/top-p: the processed q the engine's sampler would sample from), the drafter's stored
proposal rows and drafted tokens (`pack_verify_rows` builds the row tensors from a request-major draft
block), each request's seed, the absolute position of its first verify row, greedy flag, stop ids and
remaining token budget. Writes nothing: the engine appends `tokens[i, :num_committed[i]]` to request i,
feeds them to its matcher, and rolls the target cache back by `cache_rollback[i]` rows (rejected drafts).
`verify_logits_kernel` runs the same rule from raw logits through helper D's fused
`kernels.speculative_accept` (Triton on CUDA) and then `commit_tokens` for the stop/length cuts; it uses D's
random streams (matching `kernels.sample_from_logits`) and cannot end a request on a FORCED_REJECT row.
`ACCEPT_HOOK` is a seam for a fused acceptance test inside `verify`. This module owns the semantics and tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

FORCED_REJECT = -1
FRESH = -2
CASE_FRESH, CASE_RESIDUAL, CASE_VERIFY = 0, 1, 2
DRAFT_SEED_OFFSET = 1_000_000_007          # drafts use their own seed stream (seed + offset, case FRESH)
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ERROR = 0, 1, 2, 3

# --------------------------------------------------------------------------------------------- counter RNG
def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic on signed ints)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors holding uint64 bit patterns (int64 arithmetic wraps mod 2**64)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor, case: int) -> torch.Tensor:
    """float64 U in [0, 1) per element: 53 bits of splitmix64(splitmix64(seed) + 3 * position + case)."""
    x = splitmix64(splitmix64(seeds.to(torch.int64)) + positions.to(torch.int64) * 3 + case)
    return _shr(x, 11).to(torch.float64) * (1.0 / (1 << 53))


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [N, V] (any non-negative weights) from uniforms u [N] in [0, 1).

    Token t is chosen iff cdf[t-1] <= u * total < cdf[t] (float64), so it always has positive weight.
    Rows with zero total weight give -1.
    """
    w = probs.to(torch.float64).clamp_min(0)
    if w.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=w.device)
    cdf = w.cumsum(-1)
    total = cdf[:, -1]
    idx = torch.searchsorted(cdf, (u.to(torch.float64) * total).unsqueeze(-1), right=True).squeeze(-1)
    last_positive = w.shape[1] - 1 - (w > 0).flip(-1).to(torch.int8).argmax(-1)
    idx = torch.minimum(idx, last_positive)        # guards u * total rounding up to total
    return torch.where(total > 0, idx, torch.full_like(idx, -1))


# --------------------------------------------------------------------------------------------- inputs
@dataclass
class VerifyUniforms:
    """The three uniform streams verification consumes, given explicitly (tests: exact enumeration drives
    `verify` with values inside each cell of the spec's breakpoints)."""
    verify: torch.Tensor      # float64 [rows]: acceptance uniform of each row
    residual: torch.Tensor    # float64 [N]: draw of the final token when the final row rejected its draft
    fresh: torch.Tensor       # float64 [N]: draw of the bonus token when every verified draft was accepted


@dataclass
class VerifyBatch:
    """A packed verification batch (see the module docstring for the row layout)."""
    target_probs: torch.Tensor                  # [rows, V] processed target distribution q per row
    draft_probs: Optional[torch.Tensor]         # [rows, V] proposal p of the draft each row verifies (None: all greedy)
    row_draft_tokens: torch.Tensor              # long [rows]: draft id, FORCED_REJECT or FRESH
    row_counts: torch.Tensor                    # long [N]: rows per request (>= 1)
    seeds: Optional[torch.Tensor] = None        # long [N] (needed unless uniforms are given)
    positions: Optional[torch.Tensor] = None    # long [N]: absolute position of the token decided by row 0
    greedy: Optional[torch.Tensor] = None       # bool [N]; default all False
    stop_token_ids: Optional[torch.Tensor] = None   # long [N, S], -1 padded; default none
    max_new_tokens: Optional[torch.Tensor] = None   # long [N]: tokens the request may still emit (>= 1)


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor    # long [N]: drafts accepted by verification (before stop / length cuts)
    tokens: torch.Tensor          # long [N, max_rows]: committed tokens, -1 padded
    num_committed: torch.Tensor   # long [N]: committed tokens after stop / length cuts (>= 1 unless error)
    finish: torch.Tensor          # long [N]: FINISH_NONE / FINISH_STOP / FINISH_LENGTH / FINISH_ERROR
    final_rows: torch.Tensor      # long [N]: packed index of each request's final row
    cache_rollback: torch.Tensor  # long [N]: rows whose cache entries must be dropped (row_counts - accepted - 1)


# Seam for a fused kernel: (q_at_draft, p_at_draft, u) -> accepted bool, same semantics as `_accept_rows`.
ACCEPT_HOOK: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None


def counter_verify_uniforms(batch: VerifyBatch) -> VerifyUniforms:
    """The uniforms of `batch` from its seeds and positions (the default randomness)."""
    if batch.seeds is None or batch.positions is None:
        raise ValueError("VerifyBatch.seeds and .positions are required unless explicit uniforms are passed")
    req, local = _row_index(batch.row_counts)
    row_pos = batch.positions.to(torch.long)[req] + local
    return VerifyUniforms(
        verify=counter_uniforms(batch.seeds[req], row_pos, CASE_VERIFY),
        # the residual / fresh draws use the final row's position, known only after acceptance: these are
        # per-row streams ([rows], not [N]); `verify` picks the final row's value.
        residual=counter_uniforms(batch.seeds[req], row_pos, CASE_RESIDUAL),
        fresh=counter_uniforms(batch.seeds[req], row_pos, CASE_FRESH),
    )


def _row_index(row_counts: torch.Tensor):
    """(request index, local row index) of every packed row."""
    counts = row_counts.to(torch.long)
    req = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(req.numel(), device=counts.device) - starts[req]
    return req, local


def _validate(batch: VerifyBatch) -> None:
    """Shape checks always; value checks (which synchronise with the device) only off CUDA, where the
    engine's `pack_verify_rows` guarantees the layout."""
    q = batch.target_probs
    if q.is_cuda:
        if q.dim() != 2 or batch.row_draft_tokens.shape != (q.shape[0],):
            raise ValueError(f"target_probs [rows, V] and row_draft_tokens [rows] disagree: {tuple(q.shape)} vs "
                             f"{tuple(batch.row_draft_tokens.shape)}")
        return
    rows = int(batch.row_counts.sum())
    if q.dim() != 2 or q.shape[0] != rows:
        raise ValueError(f"target_probs must be [sum(row_counts)={rows}, V], got {tuple(q.shape)}")
    if batch.row_draft_tokens.shape != (rows,):
        raise ValueError(f"row_draft_tokens must be [{rows}], got {tuple(batch.row_draft_tokens.shape)}")
    if batch.draft_probs is not None and batch.draft_probs.shape != q.shape:
        raise ValueError(f"draft_probs must match target_probs {tuple(q.shape)}, got {tuple(batch.draft_probs.shape)}")
    if bool((batch.row_counts < 1).any()):
        bad = torch.nonzero(batch.row_counts < 1).flatten().tolist()
        raise ValueError(f"row_counts must be >= 1 (requests {bad})")
    last = torch.cumsum(batch.row_counts.to(torch.long), 0) - 1
    tail = batch.row_draft_tokens[last]
    if bool((tail >= 0).any()):
        bad = torch.nonzero(tail >= 0).flatten().tolist()
        raise ValueError(f"the last row of requests {bad} holds a draft; it must be FRESH (-2) or FORCED_REJECT (-1)")
    if bool((batch.row_draft_tokens >= q.shape[1]).any()) or bool((batch.row_draft_tokens < FRESH).any()):
        raise ValueError(f"row_draft_tokens must be in [-2, {q.shape[1]})")
    if batch.draft_probs is None:
        greedy = batch.greedy if batch.greedy is not None else torch.zeros_like(batch.row_counts, dtype=torch.bool)
        req, _ = _row_index(batch.row_counts)
        needs_p = (~greedy[req]) & (batch.row_draft_tokens != FRESH)
        if bool(needs_p.any()):
            raise ValueError("draft_probs is required for non-greedy rows that verify a draft")


def _on_device(batch: VerifyBatch, device) -> VerifyBatch:
    """The batch with every index/parameter tensor on the device of the target probabilities."""
    move = lambda t: t.to(device) if t is not None else None   # noqa: E731
    return VerifyBatch(batch.target_probs, move(batch.draft_probs), move(batch.row_draft_tokens),
                       move(batch.row_counts), move(batch.seeds), move(batch.positions), move(batch.greedy),
                       move(batch.stop_token_ids), move(batch.max_new_tokens))


def _accept_rows(q_at_d: torch.Tensor, p_at_d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept iff U < min(1, q(d)/p(d)), written without a division: U * p(d) < q(d) (float64)."""
    return u * p_at_d < q_at_d


def verify(batch: VerifyBatch, uniforms: Optional[VerifyUniforms] = None) -> VerifyResult:
    """Verify every request of a packed batch; see the module docstring for the exact rules.

    `uniforms`: explicit randomness (tests); by default the counter-based streams of (seed, position).
    Explicit `residual`/`fresh` are per request ([N]); the counter default is per row (the final row's value
    is used), so both give draws that depend only on the request's own (seed, position of the final row).
    """
    _validate(batch)
    batch = _on_device(batch, batch.target_probs.device)
    q = batch.target_probs
    device = q.device
    n_req = batch.row_counts.numel()
    counts = batch.row_counts.to(torch.long)
    req, local = _row_index(counts)
    starts = torch.cumsum(counts, 0) - counts
    greedy = batch.greedy.to(device) if batch.greedy is not None else torch.zeros(n_req, dtype=torch.bool, device=device)
    per_row_streams = uniforms is None
    if uniforms is None:
        uniforms = counter_verify_uniforms(batch)
    else:
        uniforms = VerifyUniforms(uniforms.verify.to(device), uniforms.residual.to(device), uniforms.fresh.to(device))
    d = batch.row_draft_tokens.to(torch.long)
    has_draft = d >= 0
    d_safe = d.clamp_min(0).unsqueeze(-1)

    # ---- acceptance of every row (vectorized), then the longest accepted prefix per request
    q_at_d = torch.gather(q, 1, d_safe).squeeze(-1).to(torch.float64)
    argmax_q = q.argmax(-1)                                 # first maximum: lowest id on ties
    if batch.draft_probs is not None:
        p_at_d = torch.gather(batch.draft_probs, 1, d_safe).squeeze(-1).to(torch.float64)
        accept_fn = ACCEPT_HOOK or _accept_rows
        sampled_accept = accept_fn(q_at_d, p_at_d, uniforms.verify.to(torch.float64))
    else:
        sampled_accept = torch.zeros_like(has_draft)
    accepted = has_draft & torch.where(greedy[req], d == argmax_q, sampled_accept)
    big = torch.full((n_req,), 1 << 40, dtype=torch.long, device=device)
    first_reject = big.scatter_reduce(0, req, torch.where(accepted, big[req], local), reduce="amin")
    num_accepted = first_reject                            # the last row is never accepted, so this is < counts
    final_rows = starts + num_accepted

    # ---- the final token: residual (rejected / forced-rejected draft), q (fresh row), argmax (greedy)
    qf = q[final_rows].to(torch.float64)
    d_final = d[final_rows]
    if batch.draft_probs is not None:
        residual = (qf - batch.draft_probs[final_rows].to(torch.float64)).clamp_min(0)
    else:
        residual = qf
    use_residual = d_final != FRESH
    empty = residual.sum(-1) <= 0                          # only when q == p: rejection had probability 0
    dist = torch.where((use_residual & ~empty).unsqueeze(-1), residual, qf)
    if per_row_streams:
        u_final = torch.where(use_residual, uniforms.residual[final_rows], uniforms.fresh[final_rows])
    else:
        u_final = torch.where(use_residual, uniforms.residual, uniforms.fresh)
    sampled = sample_inverse_cdf(dist, u_final)
    greedy_tok = torch.where(qf.sum(-1) > 0, argmax_q[final_rows], torch.full_like(sampled, -1))
    final_tok = torch.where(greedy, greedy_tok, sampled)

    return commit_tokens(d, counts, num_accepted, final_tok, batch.stop_token_ids, batch.max_new_tokens)


def commit_tokens(row_draft_tokens: torch.Tensor, row_counts: torch.Tensor, num_accepted: torch.Tensor,
                  final_tokens: torch.Tensor, stop_token_ids: Optional[torch.Tensor] = None,
                  max_new_tokens: Optional[torch.Tensor] = None) -> VerifyResult:
    """Committed tokens = the accepted drafts + the final token of each request, cut right after the first
    stop token and at max_new_tokens (shared by `verify` and `verify_logits`)."""
    device = row_draft_tokens.device
    counts = row_counts.to(torch.long)
    n_req = counts.numel()
    req, local = _row_index(counts)
    starts = torch.cumsum(counts, 0) - counts
    width = int(counts.max()) if n_req else 0
    col = torch.arange(width, device=device)
    tokens = torch.full((n_req, width), -1, dtype=torch.long, device=device)
    tokens[req, local] = row_draft_tokens.to(torch.long)
    tokens = torch.where(col < num_accepted.unsqueeze(-1), tokens, torch.full_like(tokens, -1))
    tokens[torch.arange(n_req, device=device), num_accepted] = final_tokens
    n_commit = num_accepted + 1
    finish = torch.full((n_req,), FINISH_NONE, dtype=torch.long, device=device)
    if stop_token_ids is not None and stop_token_ids.numel():
        stops = stop_token_ids.to(device)
        is_stop = ((tokens.unsqueeze(-1) == stops.unsqueeze(1)) & (stops.unsqueeze(1) >= 0)).any(-1)
        is_stop &= col < n_commit.unsqueeze(-1)
        first_stop = torch.where(is_stop, col, torch.full_like(col, 1 << 40)).min(-1).values
        hit = first_stop < n_commit
        n_commit = torch.where(hit, first_stop + 1, n_commit)
        finish = torch.where(hit, torch.full_like(finish, FINISH_STOP), finish)
    if max_new_tokens is not None:
        cap = max_new_tokens.to(device).to(torch.long)
        if bool((cap < 1).any()):
            raise ValueError(f"max_new_tokens must be >= 1 (requests {torch.nonzero(cap < 1).flatten().tolist()})")
        # a stop token cut away by the length limit does not count; one kept as the last token does
        length_hit = (n_commit > cap) | ((n_commit == cap) & (finish == FINISH_NONE))
        finish = torch.where(length_hit, torch.full_like(finish, FINISH_LENGTH), finish)
        n_commit = torch.minimum(n_commit, cap)
    # an empty final distribution (no allowed token) is an error for that request only, unless the
    # request already ended on an earlier token
    bad = (final_tokens < 0) & (n_commit == num_accepted + 1)
    finish = torch.where(bad, torch.full_like(finish, FINISH_ERROR), finish)
    n_commit = torch.where(bad, num_accepted, n_commit)
    tokens = torch.where(col < n_commit.unsqueeze(-1), tokens, torch.full_like(tokens, -1))
    return VerifyResult(num_accepted=num_accepted, tokens=tokens, num_committed=n_commit, finish=finish,
                        final_rows=starts + num_accepted, cache_rollback=counts - num_accepted - 1)


def verify_logits_kernel(logits: torch.Tensor, row_draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                         row_counts: torch.Tensor, temperature, top_k, top_p, seeds: torch.Tensor,
                         positions: torch.Tensor, bitmask: Optional[torch.Tensor] = None, mask_rows=None,
                         stop_token_ids: Optional[torch.Tensor] = None,
                         max_new_tokens: Optional[torch.Tensor] = None) -> VerifyResult:
    """The same verification from raw logits through helper D's fused `kernels.speculative_accept`
    (processing, acceptance, residual and bonus in one pass; Triton on CUDA), then our stop/length cuts.

    Same rule and row layout as `verify`, with D's randomness (kernels/rng.py streams, lane draws: Gumbel-max over 16-token lanes, inverse CDF inside),
    which matches `kernels.sample_from_logits`, not engine/sampler.py's inverse-CDF draws: use it when the
    engine samples plain rows with D's kernels too. D's kernel has no FORCED_REJECT final row (its last row
    is always the bonus row), so batches with a cut-at-violation row must use `verify`.
    """
    from deepinfer_sg.kernels import speculative_accept
    counts = row_counts.to(torch.long).to(logits.device)
    last = torch.cumsum(counts, 0) - 1
    if bool((row_draft_tokens[last] == FORCED_REJECT).any()):
        raise ValueError("kernels.speculative_accept cannot end a request on a FORCED_REJECT row; use verify()")
    cu_rows = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    out = speculative_accept(logits, cu_rows, row_draft_tokens.clamp_min(-1), draft_probs, temperature, top_k, top_p,
                             seeds, positions, bitmask=bitmask, mask_rows=mask_rows)
    return commit_tokens(row_draft_tokens, counts, out.num_accepted, out.final_tokens, stop_token_ids, max_new_tokens)


# --------------------------------------------------------------------------------------------- packing
def pack_verify_rows(draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor], verify_lengths: torch.Tensor,
                     forced_reject: Optional[torch.Tensor] = None):
    """Row tensors of a verification batch from a request-major draft block.

    draft_tokens [N, L] (-1 padded), draft_probs [N, L, V] or None, verify_lengths [N] (drafts to verify,
    from the scheduler, after any cut), forced_reject [N] bool (scheme C: the draft right after the verified
    ones violates the grammar; its proposal row becomes the last row, marked FORCED_REJECT).
    Returns (row_draft_tokens [rows] (CPU), row_draft_probs [rows, V] or None (on draft_probs' device),
    row_counts [N] (CPU)); rows of request i
    are its verify_lengths[i] drafts followed by one FRESH or FORCED_REJECT row. The target must be run on
    [x0, d_1 .. d_l] for each request, which gives exactly these rows.
    """
    draft_tokens = draft_tokens.cpu()
    n, width = draft_tokens.shape
    lengths = verify_lengths.to(torch.long).cpu()
    if bool((lengths < 0).any()) or bool((lengths > width).any()):
        raise ValueError(f"verify_lengths must be in [0, {width}]")
    forced = forced_reject.to(torch.bool).cpu() if forced_reject is not None else torch.zeros(n, dtype=torch.bool)
    if bool((forced & (lengths >= width)).any()):
        raise ValueError("forced_reject needs the proposal of the draft after the verified ones (lengths < L)")
    counts = lengths + 1
    req, local = _row_index(counts)
    is_last = local == lengths[req]
    col = local.clamp_max(width - 1) if width else local
    tok = draft_tokens[req, col] if width else torch.full_like(local, FRESH)
    tail = torch.where(forced[req], torch.full_like(tok, FORCED_REJECT), torch.full_like(tok, FRESH))
    row_tokens = torch.where(is_last, tail, tok)
    if bool((row_tokens[~is_last] < 0).any()):
        raise ValueError("a verified draft position holds no draft (verify_lengths exceed the drafted length)")
    row_probs = None
    if draft_probs is not None and width:
        dev = draft_probs.device                   # proposals may live on the drafter's device
        row_probs = draft_probs[req.to(dev), col.to(dev)]
        fresh = (is_last & ~forced[req]).to(dev)
        row_probs = torch.where(fresh.unsqueeze(-1), torch.zeros_like(row_probs), row_probs)
    return row_tokens, row_probs, counts
