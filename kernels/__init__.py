"""Triton kernels for the hot paths, each with a plain-torch twin (the CPU path and the test oracle).

Every function below dispatches on its main tensor: the Triton kernel on CUDA, the torch twin elsewhere
(DEEPINFER_SG_KERNELS=torch forces the twins). `*_triton` / `*_torch` variants live in the modules.

Grammar masks (bitmask.py; bitmask int32 [N, ceil(V/32)], bit set = allowed):
    apply_token_bitmask_inplace(logits[R, V], bitmask, indices=None, mask_rows=None) -> None
        logits row indices[k] takes mask row mask_rows[k] (default indices[k]; -1 skips); indices None: row r
        takes mask row r. Columns >= min(V, 32*W) are untouched.
    apply_token_bitmask_by_step_inplace(logits[R, V], bitmask, logits_cu_rows[B+1], mask_cu_rows[B+1]) -> None
        packed speculative rows: request i's s-th logits row takes its s-th mask row if it has one.
    by_step_mask_rows(logits_cu_rows, mask_cu_rows, R) -> int64 [R] mask row per logits row (-1 none)

Sampling (sampling.py; seeded, counter-based: a draw depends only on (seed, position, distribution)):
    sample_from_logits(logits[R, V], temperature, top_k, top_p, seed, position, bitmask=None, mask_rows=None)
        -> int64 [R]; per-row scalars or [R] tensors; T <= 0 greedy; top_k 0 / top_p 1 = off; -1 if nothing allowed.
        Filters apply in the order temperature, top-k, then top-p over the renormalised top-k set (vLLM's order).
    processed_probs(logits[R, V], temperature, top_k, top_p, bitmask=None, mask_rows=None) -> fp32 [R, V]: that q
        (torch on any device), for drafters that must keep the exact p their drafts came from.
    speculative_accept(logits[R, V], cu_rows[B+1], draft_tokens[R], draft_probs[R, V] | None, temperature, top_k,
                       top_p, seed, position, bitmask=None, mask_rows=None, filters=None, histogram=None)
                       -> AcceptResult(num_accepted [B],
                       tokens [R] packed committed tokens (-1 elsewhere), final_tokens [B])

Model hot spots:
    sparse_attention(q[N, H, D], win_kv[Pw, D], win_idx[N, Kw], sink[H], cmp_kv=None, cmp_idx=None, scale=None,
                     cmp_start=None, cmp_count=None, turn=None, window=None, visible=None)
        -> [N, H, D]: MQA decode attention over gathered window + compressed keys (K = V), per-head sink.
        cmp_start / cmp_count: cmp_idx holds entry ids (pool row start + id); turn [N, R/2, 2]: q's RoPE applied
        as it loads and the output's inverse before it stores; window=W: win_idx holds each row's (first, skip)
        and the gather computes its W key rows; visible=(positions, ratio, G): every entry a row's position sees.
    indexer_topk(iq[N, Hi, Di], w[N, Hi], index_keys[P, Di], key_start[N], key_len[N], k, max_len=None)
        -> (idx int64 [N, k], scores [N, k]): sum_h w * relu(q_h . k_g), top-k best first, ties -> lower entry id,
        -1 / -inf padded (CUDA: an exact select kernel, indexer.topk_select_triton, instead of torch.topk).
    moe_experts(x[T, H], ids[T, K], weights[T, K], w1[E, F, H], w3[E, F, H], w2[E, H, F], swiglu_limit=10.0,
                scales=None, shifts=None, shift_rows=None, fp8_compute=None) -> [T, H]: weighted sum of the routed
        SwiGLU experts (clamped), grouped by expert; `scales` = per-row scales of FP8 weights (moe.quantize_fp8_rows)
        read at one byte per weight, `shifts` = per-block power-of-two shifts (a checkpoint's block scales kept,
        applied to each 32-wide K step's fp32 partial product, so the result is exact whatever `fp8_compute` says);
        packed FP4 (uint8) weights are accepted and decoded in registers.
    hc_mixes(residual[T, M, H], fn[(2+M)M, MH], base[(2+M)M], scale[3], norm_eps=1e-20, hc_eps=1e-6, iters=20,
             post_mult=2.0) -> HcMixes(pre [T, M], post [T, M], comb [T, M, M]): mHC mixes with Sinkhorn
        (bf16 residual on CUDA: fp32-accurate bf16x3 products, one launch whose last programs per token block sum
        the partials and mix; fn is split to bf16 parts in registers at decode sizes, from a per-tensor cache above
        128 tokens). hc_mix.hc_pre_apply / hc_post_apply
        (next_pre=) fuse the pre/post applications into one launch each.
Top-k/top-p thresholds (threshold.py): rows with 0 < top_k <= 64 take the lane path (2 launches: every lane's max,
then a per-row merge that gathers the few lanes able to hold the top-k, applies top-k/top-p exactly and draws the
token; sample_from_logits then runs no sampling pass); top-p alone (top-k off) is drawn by rejection
(rejection.py: proposals from the unrestricted softmax, the first inside the top-p set is the token: the same law q,
but a seed draws other tokens than the tau path did, and the speculative bonus token follows the same rule; the
sampling pass stores each proposal's best lane, a per-row kernel draws the tokens inside those lanes, and the
mass-above pass gathers only the lanes whose max exceeds the smallest proposal); the
other filters take the histogram path (a top-p cut is
bracketed by per-bin mass bounds, only the bracketed bins' tokens are gathered, and tau is placed on masses summed
in float64, as in the torch twin: fp32 sums misplace the cut of flat rows); sampling draws a lane of 16 tokens by
Gumbel-max over lane masses, then the token inside it by inverse CDF (exact; sampling.py says why);
speculative_accept's Triton path is up to 11 launches (5 when the host says no row filters); sparse_attention runs
all 64 heads per program from 34 rows on an H200 (unchained: Q.K^T split over the two warpgroups, window keys then
compressed keys in 64-key blocks) with SM-count // N key splits combined inside the launch; fewer rows (while every
row and 16-head block gets an SM of its own) and fewer heads run 16- or 32-head programs with key splits
(`default_config`).
On Hopper nearly every kernel of the decode step and of sampling is launched with programmatic dependent launch
(`backend.pdl_kw`): it may be scheduled while the kernel before it finishes and waits on the device (`pdl_wait`)
before it stores anything or reads what an earlier kernel wrote; only constant inputs (weights) are read, or
prefetched to L2, before the wait. DEEPINFER_SG_PDL=0 turns it off; CUDA graphs capture the launches. Plain
launches (not measured as a gain): the histogram path's kernels (threshold.py's hist / select / gather / tau) and
the speculative step's own kernels (its row expansion, statistics and acceptance).

Decode-step kernels the engine calls from their modules (each with its torch twin in the same file):
    router.gate_route (MoE gate GEMM + scores + top-k + weights, one split-K launch in row blocks of 16),
    skinny (few-row products such as the shared expert's w1/w3 + clamped SwiGLU in one launch), hc_mix.hc_post_mix
    (mHC write-back, the next sub-layer's mixes and its read-out norm in one launch while the grid fits on the GPU
    at once), rope, rmsnorm, engram_gate, ring_pool; the indexer's score kernel takes the index queries before
    RoPE, the bf16 head weights with their scale and each row's visible entries, and sparse_attention gathers
    compressed entries by id from each sequence's pool rows (index_rows' visible mask runs only under quant_sim).
Split launches (attention key splits, the indexer's one-launch select, mHC mixes, split-K products) count their
programs on int32 tickets from backend.tickets(device, n, site): zeroed once per (device, site) and left zero by
every launch; launches that may overlap on two streams use different sites.
"""
from .bitmask import apply_token_bitmask_by_step_inplace, apply_token_bitmask_inplace, by_step_mask_rows
from .hc_mix import HcMixes, hc_mixes
from .indexer import indexer_topk
from .moe import moe_experts
from .sampling import processed_probs, sample_from_logits
from .decode_attention import sparse_attention
from .speculative import AcceptResult, speculative_accept

__all__ = [
    "apply_token_bitmask_inplace", "apply_token_bitmask_by_step_inplace", "by_step_mask_rows",
    "sample_from_logits", "processed_probs", "speculative_accept", "AcceptResult",
    "sparse_attention", "indexer_topk", "moe_experts", "hc_mixes", "HcMixes",
]
