"""Decode attention for V4's sparse pattern: a query row attends to a gathered key set with a per-head sink.

Each query row n (one decode token, or one verify row of a speculative request) has its own key set, given as
indices into up to two key pools: the sequence's sliding-window keys (win_idx into win_kv) and its top-k
compressed entries (cmp_idx into cmp_kv). Index -1 = no key. K = V: every pool row is the single shared KV
vector of that position (MQA, one KV head), so a key is read once and used for both scores and values.

  s_j = scale * (q_h . k_j);   m = max(max_j s_j, sink_h)
  o_h = sum_j exp(s_j - m) k_j / (sum_j exp(s_j - m) + exp(sink_h - m))        (empty key set: o_h = 0)

Shapes: q [N, H, D], win_kv [Pw, D], win_idx [N, Kw] int, cmp_kv [Pc, D], cmp_idx [N, Kc] int (optional; pool rows,
or with cmp_start / cmp_count [N] entry ids: row cmp_start[n] + id when 0 <= id < cmp_count[n]),
sink [H] fp32; returns [N, H, D] in q's dtype. Duplicate keys count twice (they are different vectors in V4).
The engine's forms make the lists in the gather: window=W, win_idx [N, 2] each row's (first, skip), its window keys
first + j for skip <= j < W; visible=(positions, ratio, G), every entry id g < G below (p + 1) // ratio (no
cmp_idx). turn fp32 [N, R/2, 2]: RoPE inside (q's last R channels turned as they load, the output's turned back).
Triton: grid (head blocks, rows, key splits); a program runs an online softmax over its slice of the row's keys
for block_h heads (block_h = 64 = all heads from 34 rows: each gathered key read once, the heads the M of wgmma
tiles; fewer rows, or fewer heads, take 16- or 32-head programs of 4 warps, two an SM: `default_config`), the
window keys then the compressed ones (two pipelined loops). "Unchained" (the default at 64 heads): P and the
rescale factors reach the P@V dot through a per-program scratch, so Triton splits Q K^T over the two warpgroups
instead of having both compute all of it. With splits > 1 (flash-decoding) each split writes its partial (m, l,
acc) in fp32 and the last program of the (row, head block) to finish (an atomic ticket, reset to 0 after) merges
them with the sink in split order (deterministic) in the same launch. Two splits (unchained; N = 45-66 rows on an
H200) take their tickets before storing: the first stores its partial, the second merges it with its own
accumulator from registers (`_combine_two`, the same bits whichever comes second). The output projection stays in
the model.
Cost: keys x D x bytes per (row, head block) (from L2 after the first head block) + splits x H x D x 8 bytes of
partials (L2); 4 x H x D flops per key (tensor cores), 128 flops per key byte at H = 64, D = 512: close to the
H200's ridge (~165), so the matrix work is ~0.6x the byte time and must overlap the loads.

H200 (N = 64 / 256 rows, H = 64, D = 512, 128 + 512 keys; floors: bytes 11.8 / 47.1 us, flops 7.2 / 28.7 us):
`default_config`'s choices run 40.1-40.2 / 104.7 us, 30% / 45% (session 10 R2, session 9's file in the same run
41.5-41.7 / 107.2); before session 10, 41.5-41.8 / 108.0-108.5 us, 28-29% / 44% (session 7: the denominators kept
per column, `lazy_sum`, one cross-warpgroup reduction less per block; session 6's kernel 42.7-43.0 / 111.1-111.6 in
the same runs; session 4: 44.1 / 146.3). Per program (N = 256, two waves of 128-132 programs): no keys 10.9 us for
both waves, the 128 window keys 33.9, all 640 keys 110.6, from L2 90.6: ~75 ns per key per program, latency-bound (a
64-key block is ~900 instructions per thread against ~9,500 cycles: the Q K^T wait, the cross-warpgroup softmax
reductions, the P round trip and barrier, the P@V wait run one after another in the single 8-warp program an SM
holds). Measured and removed: register-prefetched gathers (98-160 us), bf16 partials (48.9 at N=64), a second launch
for the split combine, lazy rescaling (153.7 at N=256), masking missing keys through a bias dot instead of a select
(49.6 / 150.7), D split over two programs for P@V (1.5x the QK work; 58.6-91.7 at N=64, 188-297 at N=256), 3
pipeline stages (49.3-56.9 at N=64, 150.2 unchained at N=256), one loop over window + compressed keys (45.9 / 122.9
unchained), a "lookahead" loop (each block's Q K^T an iteration before its softmax and P@V, keys gathered twice:
63.1 at N=64 S2, 185.9 at N=256); session 6: the waits for the gathers are not the limit. With the key indices
loaded in the loop Triton issues the next block's gather after this block's P@V and waits for it at the next
iteration's top (no overlap); with every index of a split loaded before the loop (each block's picked from
registers) it keeps 1-2 gathers in flight across iterations (32-key blocks, 3-4 stages), and that runs 46.6-49.0 at
N=64 / 120.3-140.3 at N=256 (one loop over both pools, so the pipeline never drains between them: 42.1 /
125.8-133.2; chained 51.3 / 137.6); 16 warps 51.7-73.7 / 140.2-236.9.
Session 7, ncu on the keys-from-L2 launch at N = 256 (256 programs of 8 warps, 1.94 waves, 255 registers): 22.1 M
warp instructions = ~1,000 per warp per 64-key block, one issued every 7.5 cycles per warp (IPC 1.05 per SM, 2
warps per scheduler, 0.35 of them eligible): ~7,500 cycles per block against ~2,000 of tensor-core work (Q K^T and
P@V, 4.2 MFLOP each). The loop's SASS (sm_90, 831 instructions per block, 11 CTA barriers) runs as one chain:
gather addresses and index loads | 32 HGMMA 64x32x16 (Q K^T, the warpgroups splitting keys) and their wait | row
max (shuffles, shared memory, 2 barriers) | exp + per-column sums | P to bf16, through shared memory to the
global scratch (2 barriers) | the rescales likewise (2) | the inline bar.sync, P and rescales loaded back and
staged for the wgmma (2) | 128 FMUL rescaling the accumulator + 4 HGMMA 64x256x16 (P@V) and their wait | a
barrier | the next block's 16 cp.async gathers with their masked addresses.
FlashMLA (the same shape) gets its overlap by giving each warpgroup whole key blocks in turn: each computes the
full S of its block (softmax inside one warpgroup, only the row maxima and P crossing over) while the other runs
its wgmma ("seesaw"). Triton 3.6 spreads every tl.dot over all warps of a program and
has no warpgroup roles on Hopper, so the forms it can express are the two measured: both warpgroups computing
all of S (chained, 2x the Q K^T work: 54.6 / 146.8) or S split by keys with cross-warpgroup reductions and P
through a scratch (unchained, the default); two independent online softmaxes per program would need two
[64, 512] fp32 accumulators, the whole register file.
Session 10 (R1-R2: rounds of that session, each against a copy of the session-9 file in the same run). ncu of the
session-9 kernel (R1; N=64 two splits, N=256 one; warp-stall sampling per SASS instruction): stalls per issued
instruction long scoreboard 2.5-3.7, barrier 1.7-2.0, wait 1.1-1.4; gmma pipe 2-3% of peak; one 8-warp program per
SM (255 registers, 200 KB of shared memory). Where the samples fall at N=64: the two loops 56%, the split epilogue
(partials stored, release, the last program's combine) 28%, the prologue (q, the first gather) 10%, between the pool
loops (the compressed loop's first gather) 6%; at N=256 the loops 81%, and in the compressed loop: the wait for the
block's gather at the loop's top 14% (Triton issues it after the previous block's P@V), Q K^T 10% (barrier and
shared-memory throttle: each warpgroup reads all of Q), the row max 11% (barriers), exp 6%, P and the rescales
through the scratch 5%, P staged for the wgmma 6%, P@V and its wait 10%, the next gather's addresses and issue 5%.
Changes kept: exp2 with the scores, maxima and sink in log2 units (the log2(e) multiply folded into the scale, no
range fix-up: 795 -> 723 instructions per block), R1 41.9-42.2 -> 41.1-41.4 / 108.4-108.6 -> 105.9 us; the combine's
next chunk loaded before this chunk is stored (the 8 chunks' L2 round trips had run one after another), R2 40.1-40.2
against 40.7-41.4 with exp2 alone (128 dims a step 40.9-41.1). Measured and removed: an L2 prefetch
(prefetch.global.L2 per 128-byte line) of the next block's keys at each iteration's top, indices loaded an iteration
ahead: 43.3-43.4 / 110.1 against 41.1-41.4 / 105.9 (R1; with the register stores below, the loop-top wait fell from
10% to 6% of the samples, the rest of the loop grew); one prefetch of the compressed loop's first block at the
program's start: 40.5-41.0 / 109.7-109.9 against 40.1-40.2 / 104.7 (R2); P and the rescales stored from their
registers (a st.global per element: 7 barriers a block instead of 11) 49.4-49.5 / 145.2 (R1: Triton then reloads P
in 16-bit loads); the transposed form (keys as the M of both dots, S^T = K Q^T, O^T += K^T P^T with P^T through
shared memory as the B operand), 32-head programs sharing each row's keys through L2, two programs per SM: 4 warps
46.0 / 139.5, 8 warps 51.3 / 215.5 (R1; 32-key tiles take mma.sync for Q K^T and need 1.9-2.2x the instructions per
key and head, and with 64 keys and 8 warps Triton gives both warpgroups the whole S^T tile). Compile-only: the
gather's indices carried from the previous iteration (so that it could be issued early) stop Triton from pipelining
it (loads through registers, 480 bytes of spills); tl.range(warp_specialize=True) builds the same code on sm_90.
Session 11 (R1-R2, against a copy of the session-10 file in the same run; N = 64, two splits): the second
program's merge from its registers, 37.8-38.2 us against 40.3-40.8 (R2-R3; 29% -> 31% of the roofline). The ticket is
taken before the partial is stored, so the second program waits for the first one's stores: that protocol with the
stored merge is 42.1-42.3 (it costs ~1.7 us; the register merge saves ~4.3). The merge runs in four column chunks
of the accumulator split in registers (`_halves`: reshape/permute/split, no data movement), the scale vectors
through the scratch so that the chunk arithmetic stays in the loads' layout; its first form, whose partial
addresses went through the same splits (Triton then loaded and stored one element per thread, 32 rows a warp),
ran 120.0 us. More than two splits keep the stored merge: a chunk of every other split's partial beside the live
accumulator does not fit the registers. Not tried, and why: a third 64-key buffer, or two programs an SM with D
split over warpgroups (P@V already splits D over the two warpgroups; the 200 KB of Q + two key buffers + P is
what holds one program an SM, and Q alone is 64 KB); the next block's gather issued before this block's P@V
(Triton's pipeliner places the copy after the P@V wait, and a hand-rotated loop has no way to carry the keys in
shared memory: register or twice-gathered forms lost above).
Session 12 (R1-R3, against a copy of the session-11 file in the same run; us, each timed twice). Programmatic
dependent launch (`pdl_kw`): everything the kernel reads but the sink is written earlier in the step (q, both
pools, the indices), so it waits before its first load, and it never triggers (the output projection after it is
a cuBLAS launch): back to back at 32 heads N=64 36.2 -> 35.9-36.0, V4.1 N=64 38.1 -> 37.9-38.0 (R1, R3). The scale
is a float argument (it reached the kernel as a constexpr, one compile per scale): V4.1 N=64 38.1-38.2 against
38.1 (R3). The mid-size model's 32 heads (D = 512, 128 + 512 keys) ran 16-head programs with one split; ncu of the
new defaults (R3; N=64 16-head programs with 2 splits, N=256 32-head programs): two 4-warp programs an SM (limited
by registers, 202 / 255, and shared memory, 84 / 100 KB alike), 1.9 warps per scheduler of which 0.28-0.32
eligible, an instruction issued on 24-27% of cycles; stalls per issued instruction long scoreboard (the gathers
and index loads) 1.8 / 2.7, fixed-latency waits 1.8 / 1.9, short scoreboard (shared memory) 1.0 / 1.2, barrier
0.4. Ablations of the same launches: keys from L2 23.7 / 55.3 (against 28.7 / 72.9), the 128 window keys only
10.8 / 21.0, no keys 2.4 / 6.3: latency per key block, as at 64 heads. `default_config` now fills the SMs' two
slots (R2 sweep): at N=64 16-head programs with 2 splits 28.3-28.6 (32-head 2 / 4 splits 30.9 / 31.5, 8 warps 33.4
/ 44.5), at N=128 32-head with 2 splits 42.3 (16-head 1 / 2 splits 46.2 / 55.8, 32-head 1 split 52.7), at N=256
32-head 72.6-72.7 (16-head 85.8, 8 warps 96.6), at N=32 16-head with 4 splits 21.2 (32-head 4 / 8 splits 23.6 /
31.5): R3 in the `default_config` docstring. Measured and not kept: the two-split merge from registers for these
chained programs (16-head 29.1 against 28.3 stored, 32-head 31.8 against 30.9); two splits of a short row (the
step's 37 window + 20 compressed keys at N=64: 14.0-14.3 against 12.9-13.0 unsplit), hence splits of at least two
key blocks.
Session 13 (R1-R3, against a copy of the session-12 file in the same run; us, each timed twice). Entry ids
(cmp_start / cmp_count): the engine hands the select's int64 ids with each row's pool start and count, and the
gather makes the pool rows (one launch a select layer less, kernels/index_rows.py's entry rows). Its first form
(int64 arithmetic per key) spilled the 16-head programs (255 registers and 280 bytes of stack a thread against 205
in a compile for sm_90): 32 heads N=64 / 8 28.9 / 14.4-14.5 -> 39.7 / 18.5, 64 heads N=64 37.9-38.0 -> 39.2 (R1);
with the ids narrowed to int32 on load (rows and counts below 2^31, as the int32 rows before) 207 registers, no
stack: 32 heads N=64 28.4-28.6 -> 29.5, 64 heads 37.6 -> 37.1-37.2 (R3; 128 + 512 keys, the kernel alone; the
select layer's chain, a launch fewer, in kernels/indexer.py's docstring). Measured and removed: the last
program of more than two splits merging the others' partials with its own from registers (`_combine_two`'s
protocol: tickets first, a counter of stored partials, four column chunks), R2: 64 heads N=8 (8 splits) 29.4 ->
30.3-30.7, N=32 (4 splits) 31.4 -> 35.1-35.2; 32 heads N=8 (5 splits of 16-head programs) 14.3 -> 18.2-18.3.
Session 14 (R1, a round script against the session-13 file in the same run; us, each timed twice; entry ids, 128 +
512 keys unless said). RoPE inside (`turn`) against the three launches it replaces in the step (rope on q, this
kernel, inverse rope on its output): 32 heads N=64 33.5-34.4 -> 31.0-31.3, N=256 84.1 -> 72.2-72.4, N=8 17.3-17.7
-> 15.5-15.8, the step's short rows (37 window + 20 compressed keys) N=64 18.1-18.2 -> 15.0; 64 heads N=64 44.4 ->
42.3-42.4 (this file without it, between the two rope launches: 33.4 / 79.3 / 17.7 / 18.2 / 44.5). q's turned
channels go through a per-program scratch and q is loaded whole from it and q (one load, `tl.where` of the
addresses): turned in registers, q became the Q K^T dot's register operand and spilled inside the compressed loop
at 64 heads (a compile for sm_90: 255 registers and 288 bytes of stack a thread, against 48). The output's turned
channels are rounded once (the three launches round them twice); its other channels are the three launches' bits
at 32 heads (at 64 heads 2 rows of 64 differ, by up to 3.1e-5, R2: q's turned channels, the same expression in
another kernel, may take its fused multiply-adds otherwise; both forms 2.1-2.2e-3 from the fp32 twin). The window
made from each row's (first, skip) (`window`: no index load in the window loop, which starts at the row's first
key; batched.window_idx's three launches a step, 6.7-7.3 us alone, go) on top: 29.9-30.2 / 70.9 / 15.5-15.9 / 11.5
/ 42.2 (R3 again, HEAD's three launches -> RoPE inside -> + the window rows: 33.6-34.3 -> 31.0-31.3 -> 29.8-30.0,
84.2-84.3 -> 72.1-72.4 -> 69.8-70.2, 17.1-17.5 -> 15.4-15.6 -> 15.4-15.7, 18.1 -> 14.8 -> 11.4, 44.1-44.2 ->
42.3-42.4 -> 42.2). The "all"-kind layers' entries made in the gather (`visible`: the loop ends at the row's last
visible entry) against the engine's id list (five launches) + this kernel, both with RoPE inside and the window
rows, 400 of G = 512 entries visible (R2): 32 heads N=64 39.5-39.6 -> 27.8-27.9, N=256 80.0-80.1 -> 61.3-61.4, 64
heads N=64 51.3-51.4 -> 37.5; the same bits.
Session 15 (R1-R2, a round script against HEAD's launch configurations in the same run; the engine's form: RoPE
inside, window rows, entry ids; 128 + 512 keys; us, each timed twice). ncu of V4.1's launch at N=64 (R1; 64-head
programs, two splits, 128 programs on 132 SMs): 44.4 us under ncu, the SMs active on 78% of its cycles (64,949 of
82,947: the ramp, the first program of each row idle while the second merges, 4 SMs without a program), one
8-warp program an SM (255 registers, 204.8 KB of shared memory: theoretical occupancy 12.5%), an instruction
every 10.0 cycles per warp of which 3.7 wait on L1TEX (the gathers, the P / rescale round trips through the
scratch, local memory). The launches' local memory (R1, the compiled kernels' own report): 64-head programs spill
136 B a thread with two splits (208 B one split, 480 B stored multi-split merges), 32-head 4-warp programs
160-184 B, 16-head 4-warp programs none (200-203 registers); a compile for sm_90 gives the same once it takes the
launches' 2 stages and their integer hints (benchmarks/kernels.py's check does since session 15; at Triton's
default 3 stages and without the hints the 16-head form reported 255 registers + 120 B). The launch-configuration
sweep at 64 heads and what it changed (16-head programs of 4 warps while N x 4 <= 132): `default_config`'s
docstring.
Session 16 (R1, a round script against this file in the same run; window rows + entry ids without RoPE, 128 + 512
keys, us, HEAD timed twice). Measured and removed: the scores and P@V in two launches (no [heads, D] accumulator
beside Q K^T, no rescale, no cross-warpgroup reduction in the P@V loop): a score launch writing each 64-key block's
fp32 scores with its max and sum for all 64 heads (programs of 1-5 blocks a row), then a P@V launch of (row, d_v
tile) programs taking the row's softmax from the block stats: 64 heads N=64 49.6 (score programs of 5 blocks, d_v
tiles of 128, 4 warps) / 57.0 / 60.3 (1 block) / 79.1 (d_v 64) against 37.8-38.2, N=256 200.4-267.4 against
109.7-109.8, N=8 22.7-35.1 against 16.8; 32 heads N=64 43.9-49.5 against 28.1. Alone, the score launch (1-block
programs) takes 35.2 / 138.9 at N=64 / 256 and the P@V launch 26.1 / 106.1: each is as latency-bound per gathered
key block as the one kernel (the P@V launch reads the keys again, the score launch reloads q per block). One
pipeline stage instead of two: 43.3 / 138.9 / 19.1 at N=64 / 256 / 8, 37.1 at 32 heads N=64. Known from session 4:
D split over two programs (58.6-91.7 at N=64).
"""
import torch
import triton
import triton.language as tl

from .backend import empty, INTERPRETING, check, pdl_kw, pdl_wait, sm_count, tickets, use_triton
from .index_rows import entry_rows_torch
from .rope import apply_rope_torch, turned


def _check(q, win_kv, win_idx, cmp_kv, cmp_idx, sink, cmp_start=None, cmp_count=None, turn=None, window=None,
           visible=None):
    check(q.dim() == 3, f"q must be [rows, heads, head_dim], got {tuple(q.shape)}")
    N, H, D = q.shape
    check(visible is None or (cmp_idx is None and cmp_start is not None and visible[0].shape == (N,)),
          f"visible: positions [{N}] with cmp_start / cmp_count and no cmp_idx")
    if visible is not None:     # (the ids it stands for, for the checks below: no tensor made)
        cmp_idx = cmp_start.expand(visible[2], N).t()
    check(turn is None or (turn.dim() == 3 and turn.shape[0] == N and turn.shape[2] == 2 and 2 * turn.shape[1] <= D
                           and turn.dtype == torch.float32 and turn.stride(1) == 2 and turn.stride(2) == 1),
          f"attention: turn {None if turn is None else (turn.dtype, tuple(turn.shape), turn.stride())} for q "
          f"{tuple(q.shape)} (want fp32 [{N}, R/2, 2], R <= {D}, pairs adjacent)")
    entries = cmp_start is not None
    check(entries == (cmp_count is not None) and (not entries or cmp_idx is not None
                                                   and cmp_start.shape == cmp_count.shape == (N,)),
          f"cmp_start and cmp_count come together with cmp_idx, each [{N}], got "
          f"{None if cmp_start is None else tuple(cmp_start.shape)} and "
          f"{None if cmp_count is None else tuple(cmp_count.shape)}")
    check(win_kv.dim() == 2 and win_kv.shape[1] == D, f"win_kv must be [pool, {D}], got {tuple(win_kv.shape)}")
    check(win_idx.dim() == 2 and win_idx.shape[0] == N and (window is None or win_idx.shape[1] == 2),
          f"win_idx must be [{N}, {'keys' if window is None else '2 (first, skip)'}], got {tuple(win_idx.shape)}")
    if cmp_kv is not None or cmp_idx is not None:
        check(cmp_kv is not None and cmp_idx is not None, "cmp_kv and cmp_idx come together")
        check(cmp_kv.dim() == 2 and cmp_kv.shape[1] == D, f"cmp_kv must be [pool, {D}], got {tuple(cmp_kv.shape)}")
        check(cmp_idx.dim() == 2 and cmp_idx.shape[0] == N,
              f"cmp_idx must be [{N}, keys], got {tuple(cmp_idx.shape)}")
    check(sink.shape == (H,), f"sink must be [{H}] (one logit per head), got {tuple(sink.shape)}")


# ---------------------------------------------------------------------------------------------- torch twin
def sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv=None, cmp_idx=None, scale=None, cmp_start=None,
                           cmp_count=None, turn=None, window=None, visible=None):
    _check(q, win_kv, win_idx, cmp_kv, cmp_idx, sink, cmp_start, cmp_count, turn, window, visible)
    N, H, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    if turn is not None:     # q's RoPE first (rounded to q's dtype, as kernels/rope.py's result)
        q = apply_rope_torch(q, turn)
    if window is not None:          # each row's (first, skip) -> its window's pool rows
        j = torch.arange(window, device=win_idx.device)
        win_idx = torch.where(j >= win_idx[:, 1:2], win_idx[:, 0:1] + j, -1)
    if visible is not None:
        # every entry id g the row's position sees: index_rows.visible_scores_torch's rule (its g < count is
        # entry_rows_torch's, below), as the kernel's VISIBLE bound
        positions, ratio, G = visible
        g = torch.arange(G, device=positions.device)[None, :]
        cmp_idx = torch.where(g < ((positions + 1) // ratio)[:, None], g, -1)
    if cmp_start is not None:       # entry ids -> pool rows
        cmp_idx = entry_rows_torch(cmp_idx, cmp_start, cmp_count, cmp_idx.shape[1])
    keys = [win_kv[win_idx.long().clamp_min(0)]]
    valid = [win_idx >= 0]
    if cmp_kv is not None:
        keys.append(cmp_kv[cmp_idx.long().clamp_min(0)])
        valid.append(cmp_idx >= 0)
    k = torch.cat(keys, 1).float()                                   # [N, K, D]
    ok = torch.cat(valid, 1)                                         # [N, K]
    s = torch.einsum("nhd,nkd->nhk", q.float(), k) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    s = torch.cat([s, sink.float()[None, :, None].expand(N, H, 1)], 2)
    p = torch.softmax(s, 2)[:, :, :-1]
    o = torch.einsum("nhk,nkd->nhd", p, k)
    if turn is not None:     # the inverse RoPE (the conjugate turn) in fp32, rounded once with the output
        # (built from turn on its device: a host tensor here would be a copy that breaks a CUDA graph capture)
        o = apply_rope_torch(o, torch.stack((turn[..., 0], -turn[..., 1]), -1))
    return o.to(q.dtype)


# ---------------------------------------------------------------------------------------------- Triton
LOG2E = tl.constexpr(1.4426950408889634)      # scores, maxima and the sink in log2 units: exp2, no multiply
# (the launch folds LOG2E.value, a float, into the scale: a constexpr product would compile a kernel per scale)
_COMPILED = tl.constexpr(not INTERPRETING)    # the interpreter runs a program's tensor ops in order: no barrier


@triton.jit
def _cta_barrier(x):
    """bar.sync 0 for the whole program; returns 0 (as x's type), for addresses that must wait for it."""
    if not _COMPILED:
        return x * 0
    return tl.inline_asm_elementwise("bar.sync 0;\n\tmov.b64 $0, 0;", "=l,l", [x], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def _unturn(o, cols, turn_row, D: tl.constexpr, ROT: tl.constexpr):
    """o [BH, C] fp32, the output's columns cols [C] (pairs adjacent: cols[2i + 1] = cols[2i] + 1) -> o with the
    pairs among the last ROT of D channels turned back by the conjugate of the row's turn at turn_row (the
    output's inverse RoPE: (a + ib)(c - is)); the others as they are. The pair's two channels are split in
    registers (each thread holds both: the accumulators' and the loads' layouts keep pairs together)."""
    BH: tl.constexpr = o.shape[0]
    C: tl.constexpr = o.shape[1]
    first, _ = cols.reshape([C // 2, 2]).split()
    rot = first >= D - ROT
    j = tl.where(rot, (first - (D - ROT)) // 2, 0)
    c = tl.load(turn_row + j * 2, mask=rot, other=1.0)[None, :]
    s = tl.load(turn_row + j * 2 + 1, mask=rot, other=0.0)[None, :]
    a, b = o.reshape([BH, C // 2, 2]).split()
    return tl.join(a * c + b * s, b * c - a * s).reshape([BH, C])


@triton.jit
def _scores(q, k, ok, scale, IEEE: tl.constexpr):
    """scale * q k^T for a block of keys k [BLOCK_K, D]: [BH, BLOCK_K] fp32, -inf where ok is False."""
    if IEEE:   # fp32 pools (and the interpreter): exact fp32 products
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    return tl.where(ok[None, :], s, float("-inf"))


@triton.jit
def _accumulate(m, l, acc, s, k, it, scr_p, scr_a, IEEE: tl.constexpr, UNCHAIN: tl.constexpr,
                LAZY_SUM: tl.constexpr):
    """A block's scores s [BH, BLOCK_K] and keys k into the online softmax (m, l, acc); `it` counts the blocks.
    l [BH] is the row sum, or with LAZY_SUM [BH, BLOCK_K] per-column partial sums reduced once after the loop (one
    cross-warpgroup reduction less per block).
    UNCHAIN: P and the rescale factors reach the P@V dot through this program's scratch (two buffers by block
    parity, so a block's stores never overwrite what a slower thread still reads from the previous block):
    without a data path from the Q K^T dot to the P@V dot, Triton does not treat them as a chain and lays Q K^T
    out with the warpgroups splitting keys (each computes half) instead of both computing all of it."""
    new_m = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - new_m)
    p = tl.exp2(s - new_m[:, None])
    if LAZY_SUM:
        l = l * alpha[:, None] + p
    else:
        l = l * alpha + tl.sum(p, 1)
    if UNCHAIN:
        BH: tl.constexpr = s.shape[0]
        BK: tl.constexpr = s.shape[1]
        hh = tl.arange(0, BH)
        par = (it % 2).to(tl.int64)
        pp = scr_p + par * (BH * BK) + hh[:, None] * BK + tl.arange(0, BK)[None, :]
        tl.store(pp, p.to(scr_p.dtype.element_ty))
        tl.store(scr_a + par * BH + hh, alpha)
        # every thread's P / alpha stores precede the loads below: a bar.sync in inline assembly (Triton's own
        # barrier op would stop the key loads from being pipelined); the loads' addresses depend on its result
        zero = _cta_barrier(par)
        p = tl.load(pp + zero)
        alpha = tl.load(scr_a + par * BH + hh + zero)
    if IEEE:
        acc = tl.dot(p.to(tl.float32), k.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None])
    return new_m, l, acc


@triton.jit
def _softmax_step(q, m, l, acc, k, ok, scale, it, scr_p, scr_a, IEEE: tl.constexpr, UNCHAIN: tl.constexpr,
                  LAZY_SUM: tl.constexpr):
    """One block of keys k [BLOCK_K, D] (ok: which are real) into the online softmax (m, l, acc)."""
    return _accumulate(m, l, acc, _scores(q, k, ok, scale, IEEE), k, it, scr_p, scr_a, IEEE, UNCHAIN, LAZY_SUM)


@triton.jit
def _gather(kv_ptr, idx_ptr, stride, row, kk, k1, base, lo, lim, D: tl.constexpr, RANGE: tl.constexpr):
    """Key block kk of the row (its indices at idx_ptr + row * stride): (keys [BLOCK_K, D], ok [BLOCK_K]); positions
    >= k1 and indices outside [0, lim) are not keys; index i is pool row base + i. RANGE: no index list, position kk
    is pool row base + kk when lo <= kk < k1."""
    if RANGE:
        idx = kk
        ok = (kk >= lo) & (kk < k1)
    else:
        idx = tl.load(idx_ptr + row * stride + kk, mask=kk < k1, other=-1).to(tl.int32)
        ok = (idx >= 0) & (idx < lim)
    k = tl.load(kv_ptr + (base + tl.maximum(idx, 0)).to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :],
                mask=ok[:, None], other=0.0)
    return k, ok


@triton.jit
def _attend_pool(q, m, l, acc, it, kv_ptr, idx_ptr, stride, k0, k1, row, base, lo, lim, scale, scr_p, scr_a,
                 D: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, UNCHAIN: tl.constexpr,
                 LAZY_SUM: tl.constexpr, RANGE: tl.constexpr = False):
    """Online softmax over the pool's keys [k0, k1) of this row (`it`: blocks so far, returned advanced); the
    indices as `_gather` reads them."""
    for start in range(k0, k1, BLOCK_K):
        k, ok = _gather(kv_ptr, idx_ptr, stride, row, start + tl.arange(0, BLOCK_K), k1, base, lo, lim, D, RANGE)
        m, l, acc = _softmax_step(q, m, l, acc, k, ok, scale, it, scr_p, scr_a, IEEE, UNCHAIN, LAZY_SUM)
        it += 1
    return m, l, acc, it


@triton.jit
def _store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, o, m, l, acc, hok, D: tl.constexpr):
    """A split's partial (m, l, acc) at rows o of the partials; returns after a CTA barrier, so that every
    thread's stores precede a release by one thread."""
    tl.store(part_m_ptr + o, m, mask=hok)
    tl.store(part_l_ptr + o, l, mask=hok)
    tl.store(part_acc_ptr + o[:, None] * D + tl.arange(0, D)[None, :], acc, mask=hok[:, None])
    tl.debug_barrier()


@triton.jit
def _combine_splits(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, row, heads, hok, H, n_split, turn_row,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, DC: tl.constexpr,
                    ROT: tl.constexpr):
    """o_h = sum_s 2^(m_s - M) acc_s / (2^(sink_h - M) + sum_s 2^(m_s - M) l_s) (m_s, M and the sink in log2
    units: the scores were scaled by log2 e) for a block of heads, in split
    order (deterministic), DC output dims at a time. This runs on the critical path of the row's last program, so
    each chunk's partials (all splits in one load, the ones past n_split masked off) are loaded before the
    previous chunk is stored: a store between them would keep the compiler from issuing the next loads early
    (it cannot tell that out and the partials do not overlap), and the chunks' L2 round trips would run one after
    another. Partials are read with .cg (from L2, never a stale L1 line: other programs of this launch wrote
    them). ROT: the chunks holding the last ROT channels turned back (`_unturn`)."""
    sp = tl.arange(0, BLOCK_S)
    base = (row * H + heads) * n_split                                          # [BLOCK_H]
    ok = hok[:, None] & (sp[None, :] < n_split)
    ms = tl.load(part_m_ptr + base[:, None] + sp[None, :], mask=ok, other=-1e30, cache_modifier=".cg")
    ls = tl.load(part_l_ptr + base[:, None] + sp[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    sink = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32) * LOG2E
    big = tl.maximum(tl.max(ms, 1), sink)
    w = tl.exp2(ms - big[:, None])
    w = w / (tl.exp2(sink - big) + tl.sum(w * ls, 1))[:, None]                    # [BLOCK_H, BLOCK_S]
    parts = part_acc_ptr + ((base[:, None] + sp[None, :]) * D)[:, :, None] + tl.arange(0, DC)[None, None, :]
    a = tl.load(parts, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")     # [BLOCK_H, BLOCK_S, DC]
    for dc in tl.static_range(0, D, DC):
        cur = a
        if dc + DC < D:
            a = tl.load(parts + dc + DC, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        o = tl.sum(w[:, :, None] * cur, 1)
        if dc + DC > D - ROT:
            o = _unturn(o, dc + tl.arange(0, DC), turn_row, D, ROT)
        tl.store(out_ptr + (row * H + heads[:, None]) * D + dc + tl.arange(0, DC)[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hok[:, None])


@triton.jit
def _halves(x):
    """x [R, C] -> the two [R, C // 2] of the columns whose bit C // 4 is 0 / 1. In the P@V accumulator's layout
    that bit is held in each thread's registers, so the split moves no data."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    a, b = x.reshape([R, 2, 2, C // 4]).permute(0, 1, 3, 2).split()
    return a.reshape([R, C // 2]), b.reshape([R, C // 2])


@triton.jit
def _mix_store(own, part_acc_ptr, out_ptr, o_, orow, hok, c0, c1, first, turn_row, off: tl.constexpr,
               D: tl.constexpr, ROT: tl.constexpr):
    """out = c0 acc_0 + c1 acc_1 for the column chunk `_halves` gives at `off` (columns (j // (D/8)) * D/2 + off +
    j % (D/8)), the partials in split order (own is acc_0 when first; the other's is read at row o_ of the
    partials): the same operations whichever program merges, so that a fused multiply-add rounds alike. ROT: a
    chunk holding some of the last ROT channels turns them back (`_unturn`)."""
    j = tl.arange(0, D // 4)
    cols = (j // (D // 8)) * (D // 2) + off + j % (D // 8)
    x = tl.load(part_acc_ptr + o_[:, None] * D + cols[None, :], mask=hok[:, None], other=0.0, cache_modifier=".cg")
    o = tl.where(first, own, x) * c0[:, None] + tl.where(first, x, own) * c1[:, None]
    if D // 2 + off + D // 8 > D - ROT:
        o = _unturn(o, cols, turn_row, D, ROT)
    tl.store(out_ptr + orow[:, None] * D + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=hok[:, None])


@triton.jit
def _combine_two(acc, m, l, split, out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scr_a, row, heads, hok,
                 H, turn_row, D: tl.constexpr, ROT: tl.constexpr):
    """Two splits: the last program's own partial (m, l, acc) from its registers, the other's from memory, merged
    in split order as `_combine_splits` merges them: o = (2^(m_0 - M) acc_0 + 2^(m_1 - M) acc_1) / (2^(sink - M) +
    2^(m_0 - M) l_0 + 2^(m_1 - M) l_1), the same bits whichever program came last. In four column chunks (split in
    registers, `_halves`), so that the other's partial never takes a full tile of registers."""
    o_ = (row * H + heads) * 2 + 1 - split
    m2 = tl.load(part_m_ptr + o_, mask=hok, other=-1e30, cache_modifier=".cg")
    l2 = tl.load(part_l_ptr + o_, mask=hok, other=0.0, cache_modifier=".cg")
    first = split == 0
    m0 = tl.where(first, m, m2)
    m1 = tl.where(first, m2, m)
    sink = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32) * LOG2E
    big = tl.maximum(tl.maximum(m0, m1), sink)
    w0 = tl.exp2(m0 - big)
    w1 = tl.exp2(m1 - big)
    inv = 1.0 / (tl.exp2(sink - big) + (w0 * tl.where(first, l, l2) + w1 * tl.where(first, l2, l)))
    # the two scale vectors through this program's scratch: loaded back, they take the layout of the chunks'
    # loads, so the chunk arithmetic stays there (computed from m they would pull each chunk into the Q K^T layout)
    hh = tl.arange(0, m.shape[0])
    tl.store(scr_a + hh, w0 * inv)
    tl.store(scr_a + m.shape[0] + hh, w1 * inv)
    zero = _cta_barrier(split.to(tl.int64))
    c0 = tl.load(scr_a + hh + zero)
    c1 = tl.load(scr_a + m.shape[0] + hh + zero)
    orow = row * H + heads
    a0, a1 = _halves(acc)
    a00, a01 = _halves(a0)
    _mix_store(a00, part_acc_ptr, out_ptr, o_, orow, hok, c0, c1, first, turn_row, 0, D, ROT)
    _mix_store(a01, part_acc_ptr, out_ptr, o_, orow, hok, c0, c1, first, turn_row, D // 8, D, ROT)
    a10, a11 = _halves(a1)
    _mix_store(a10, part_acc_ptr, out_ptr, o_, orow, hok, c0, c1, first, turn_row, D // 4, D, ROT)
    _mix_store(a11, part_acc_ptr, out_ptr, o_, orow, hok, c0, c1, first, turn_row, D // 4 + D // 8, D,
               ROT)


@triton.jit
def _sparse_attention_kernel(q_ptr, out_ptr, sink_ptr, win_kv_ptr, win_idx_ptr, n_win, cmp_kv_ptr, cmp_idx_ptr,
                             n_cmp, cmp_stride, cmp_start_ptr, cmp_count_ptr, H, scale, per_split, part_m_ptr,
                             part_l_ptr, part_acc_ptr, cnt_ptr, scr_p_ptr, scr_a_ptr, turn_ptr, turn_stride, scr_q_ptr,
                             D: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, HAS_CMP: tl.constexpr,
                             IEEE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, DC: tl.constexpr,
                             UNCHAIN: tl.constexpr, LAZY_SUM: tl.constexpr, OWN: tl.constexpr,
                             ENTRIES: tl.constexpr = False, ROT: tl.constexpr = 0, WINDOW: tl.constexpr = False,
                             VISIBLE: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (head block, row, split): the split's slice [lo, hi) of the row's keys (window keys first, then
    compressed). Without SPLIT the one split starts from the sink and writes the output; with SPLIT it writes its
    partial (m, l, acc) and the last program of the (row, head block) to finish merges the splits and the sink
    (ticket counter, reset to 0). ENTRIES: the compressed indices are the row's entry ids, pool row cmp_start[row]
    + id for 0 <= id < cmp_count[row] (else no key). WINDOW: win_idx holds each row's (first, skip) (int64 [N, 2]),
    its window keys the pool rows first + j for skip <= j < n_win (no index list). VISIBLE (with ENTRIES): no
    compressed id list, cmp_idx holds the rows' positions and cmp_stride the ratio: the entry ids g < n_cmp below
    (p + 1) // ratio. ROT > 0: RoPE inside, q's last ROT channels turned by the
    row's turn (fp32 (cos, sin) pairs at turn_ptr + row * turn_stride) as they load, rounded to q's dtype as
    kernels/rope.py rounds them, and the output's turned back (the conjugate) in fp32 before it is stored. PDL:
    everything it reads but the sink (q, the indices, the rows' starts and counts, the turns, both pools) is
    written earlier in the step, so it waits before its first load."""
    row = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    hok = heads < H
    dims = tl.arange(0, D)
    pdl_wait(PDL)
    if ENTRIES:     # (pool rows and counts below 2^31, as the int32 rows the kernel reads otherwise)
        c_base = tl.load(cmp_start_ptr + row).to(tl.int32)
        c_lim = tl.load(cmp_count_ptr + row).to(tl.int32)
        if VISIBLE:
            c_lim = tl.minimum(c_lim, ((tl.load(cmp_idx_ptr + row) + 1) // cmp_stride).to(tl.int32))
    else:
        c_base = 0
        c_lim = 2**31 - 1
    if WINDOW:      # the row's (first, skip): window key j at pool row first + j for skip <= j < n_win
        w_base = tl.load(win_idx_ptr + row * 2).to(tl.int32)
        w_lo = tl.load(win_idx_ptr + row * 2 + 1).to(tl.int32)
    else:
        w_base = 0
        w_lo = 0
    prog = (row * tl.num_programs(2) + split) * tl.num_programs(0) + tl.program_id(0)
    q_row = q_ptr + (row * H + heads[:, None]) * D
    q_at = q_row + dims[None, :]
    turn_row = turn_ptr + row * turn_stride
    if ROT > 0:
        # q's last ROT channels turned and staged in this program's scratch, then q loaded from both in one plain
        # load: a q computed in registers becomes the Q K^T dot's register operand (64 more registers a thread at
        # 64 heads, spilled inside the loop), a loaded one goes through shared memory
        r = tl.arange(0, ROT)[None, :]
        at = q_row + D - ROT
        qr = turned(tl.load(at + r, mask=hok[:, None], other=0.0), at, r, hok[:, None], turn_row, ROT, ROT)
        stage = scr_q_ptr + prog * (BLOCK_H * ROT) + tl.arange(0, BLOCK_H)[:, None] * ROT - (D - ROT)
        tl.store(stage + D - ROT + r, qr.to(scr_q_ptr.dtype.element_ty))
        q_at = tl.where(dims[None, :] >= D - ROT, stage + dims[None, :] + _cta_barrier(row), q_at)
        q_at = tl.max_contiguous(tl.multiple_of(q_at, [1, 16]), [1, 8])     # (16-byte loads: the host checks)
    q = tl.load(q_at, mask=hok[:, None], other=0.0)
    q = q.to(win_kv_ptr.dtype.element_ty)
    if SPLIT:
        m = tl.full([BLOCK_H], -1e30, tl.float32)           # finite: exp2(m - new_m) stays 0, never NaN
        l0 = 0.0
    else:
        # the sink is a key with logit sink_h and value 0: start the online softmax from it
        m = tl.load(sink_ptr + heads, mask=hok, other=0.0).to(tl.float32) * LOG2E
        l0 = 1.0
    if LAZY_SUM:   # per-column partial sums, the sink's 1 in column 0
        l = tl.where(tl.arange(0, BLOCK_K)[None, :] == 0, l0, tl.zeros([BLOCK_H, BLOCK_K], tl.float32))
    else:
        l = tl.zeros([BLOCK_H], tl.float32) + l0
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    lo = split * per_split
    hi = lo + per_split
    it = tl.zeros([], tl.int32)
    scr_p = scr_p_ptr + prog * (2 * BLOCK_H * BLOCK_K)
    scr_a = scr_a_ptr + prog * (2 * BLOCK_H)
    w0 = tl.maximum(tl.minimum(lo, n_win), w_lo)     # (WINDOW: from the row's first key: a short window, fewer blocks)
    m, l, acc, it = _attend_pool(q, m, l, acc, it, win_kv_ptr, win_idx_ptr, n_win, w0, tl.minimum(hi, n_win), row,
                                 w_base, w_lo, 2**31 - 1, scale, scr_p, scr_a, D, BLOCK_K,
                                 IEEE, UNCHAIN, LAZY_SUM, WINDOW)
    if HAS_CMP:
        c1 = tl.minimum(tl.maximum(hi - n_win, 0), n_cmp)
        if VISIBLE:     # (the row's visible entries only: fewer blocks)
            c1 = tl.minimum(c1, c_lim)
        m, l, acc, it = _attend_pool(q, m, l, acc, it, cmp_kv_ptr, cmp_idx_ptr, cmp_stride, tl.maximum(lo - n_win, 0),
                                     c1, row, c_base, 0, c_lim, scale, scr_p, scr_a, D, BLOCK_K, IEEE, UNCHAIN,
                                     LAZY_SUM, VISIBLE)
    if LAZY_SUM:
        l = tl.sum(l, 1)
    if OWN:
        # two splits: the ticket first, so that the last program merges from its registers (`_combine_two`); the
        # counter after the ticket says that the other program's partial is stored
        ticket_ptr = cnt_ptr + 2 * (row * tl.num_programs(0) + tl.program_id(0))
        if tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu") == 0:
            _store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, (row * H + heads) * 2 + split, m, l, acc, hok, D)
            tl.atomic_xchg(ticket_ptr + 1, 1, sem="release", scope="gpu")
        else:
            # the other program took its ticket before, so it runs and has only its stores left: wait for them
            done = tl.atomic_add(ticket_ptr + 1, 0, sem="acquire", scope="gpu")
            while done == 0:
                done = tl.atomic_add(ticket_ptr + 1, 0, sem="acquire", scope="gpu")
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(ticket_ptr + 1, 0, sem="relaxed", scope="gpu")
            _combine_two(acc, m, l, split, out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scr_a, row, heads,
                         hok, H, turn_row, D, ROT)
    elif SPLIT:
        n_split = tl.num_programs(2)
        _store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, (row * H + heads) * n_split + split, m, l, acc, hok, D)
        ticket_ptr = cnt_ptr + row * tl.num_programs(0) + tl.program_id(0)
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == n_split - 1:
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
            _combine_splits(out_ptr, sink_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, row, heads, hok, H, n_split,
                            turn_row, D, BLOCK_H, BLOCK_S, DC, ROT)
    else:
        o = acc / l[:, None]
        if ROT > 0:
            o = _unturn(o, dims, turn_row, D, ROT)
        tl.store(out_ptr + (row * H + heads[:, None]) * D + dims[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hok[:, None])


def default_config(N: int, H: int, D: int, n_keys: int, elem_bytes: int = 2, sms: int = 132) -> dict:
    """Launch parameters at a shape, from the H200 sweeps (H = 64, D = 512, 128 + 512 keys, bf16; us at N = 64 /
    256 rows): all heads per program, unchained, per-column denominators (lazy_sum: 41.5 / 108.0 against 43.0 /
    111.6 summed per block), pool by pool, 64-key blocks, 8 warps, 2 stages, with key splits
    S = sms // N (every program in one wave: one ~200 KB program per SM; S = 3-4 at N = 64 is two waves, 59-75)
    42.6 / 110.6 before lazy_sum; the same in one loop over window + compressed keys (one gather) 45.9 / 122.9 (removed);
    32-key blocks 49.3 / 136.7; chained (both warpgroups compute all of Q K^T) 54.6 / 146.8; 16-head programs
    (mma.sync, 4 warps) 44.0 / 227.3; 32-head programs 49.3 / 210.4.
    fp32 pools at D = 512 take 16-key blocks (the key stages must fit shared memory); compiled fp32 pools run
    chained (`sparse_attention_triton`). Fewer than 64 heads (the mid-size model's 32; H200, D = 512, 128 + 512
    keys, session 12 R3, us, against session 11's 16-head programs with one split): N=32 16-head programs with 4
    splits 21.3 against 34.0-34.1, N=64 with 2 splits 28.7-29.0 against 36.5-36.6, N=128 32-head programs with 2
    splits 42.3-42.5 against 46.4-46.8, N=256 32-head 72.9 against 87.0-87.2; the step's short rows (37 + 20 keys:
    one split) N=64 / 128 / 256 12.1-12.4 / 16.6-16.8 / 26.6-26.7 against 12.6-12.8 / 17.0 / 32.1.
    V4.1's 64 heads at few rows take the same 16-head programs (only 64 heads were measured: more heads keep the
    all-head programs; session 15 R2, H200, the engine's form: RoPE inside, window rows, entry ids; 128 + 512 keys,
    us, each timed twice, against the all-head programs with sms // N splits): N=8 16-head S5 18.3-18.4 (S8
    18.1-18.2, 32-head S4 25.6) against 33.9; N=16 S4 21.3-21.4 (32-head S4 26.2-26.3) against 34.8-35.2; N=32 S2
    28.1-28.7 (32-head S2 34.0-34.2) against 39.0-39.1; from N=34 (more (row, 16-head block) pairs than SMs) the
    all-head programs stay: N=48 40.2-40.4 against 45.0-45.2 (16-head S1) / 46.1-46.2 (32-head S2), N=64 41.7-41.8
    against 46.7-47.0 / 48.3-48.5 (S2) (R1), N=256 120.5-120.6 against 125.1-125.2 (32-head S1). R4 against HEAD's
    file: N=8 / 32 / 33 33.4 / 38.4 / 39.0 -> 17.6-17.9 / 27.9-28.0 / 28.9-29.0."""
    if elem_bytes * D > 1024:
        return dict(block_h=16, block_k=16, num_warps=4, num_stages=2, splits=1)
    # 16- and 32-head programs of 4 warps run two an SM (84 / 100 KB of shared memory at D = 512); key splits fill
    # those slots, each split at least two key blocks (a short row's split costs more than it saves). 16-head
    # programs while every (row, 16-head block) has an SM (then they take two splits or more), up to 64 heads
    # (measured at 32 and 64; more heads keep the all-head programs); past that all-head programs at 64 heads,
    # else 32-head programs (each key read once per row) if they fill the SMs
    slots, most = 2 * sms, max(1, triton.cdiv(n_keys, 64) // 2)

    def splits(block_h: int) -> int:     # key splits that fill the slots, at most `most` and 8
        return max(1, min(8, most, slots // max(N * triton.cdiv(H, block_h), 1)))
    if H > 64 or N * triton.cdiv(H, 16) > sms:
        if H >= 64:
            return dict(block_h=64, block_k=64 if elem_bytes == 2 else 32, num_warps=8, num_stages=2,
                        splits=max(1, min(8, sms // max(N, 1))), unchain=True, lazy_sum=True)
        if H > 16 and N * triton.cdiv(H, 32) * splits(32) >= sms:
            return dict(block_h=32, block_k=64, num_warps=4, num_stages=2, splits=splits(32))
    return dict(block_h=16, block_k=64, num_warps=4, num_stages=2, splits=splits(16))


def sparse_attention_triton(q, win_kv, win_idx, sink, cmp_kv=None, cmp_idx=None, scale=None,
                            block_h: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, splits: int | None = None, unchain: bool | None = None,
                            lazy_sum: bool | None = None, cmp_start=None, cmp_count=None, turn=None, window=None,
                            visible=None):
    """Launch parameters left None come from `default_config`. splits > 1: key splits per row with fp32 partials
    [N, H, splits, D] (L2-resident at decode sizes), combined by the last program of each (row, head block).
    unchain: P and the rescale factors pass to the P@V dot through a per-program scratch (L1/L2; 2 x block_h x
    (block_k + 2) x 4 bytes per program) so Triton lays Q K^T out with the two warpgroups splitting the keys
    instead of both computing all of it (see `_accumulate`); compiled fp32 pools ignore it (the pipeliner cannot
    predicate the barrier in their loop). lazy_sum: the softmax denominators kept as per-column partial sums and
    reduced once after the loop. cmp_start / cmp_count [N]: cmp_idx holds entry ids, row r's pool rows cmp_start[r]
    + id for 0 <= id < cmp_count[r] (others no key: kernels/index_rows.py's `entry_rows_torch` in the kernel's
    gather). turn fp32 [N, R/2, 2] (kernels/rope.py's table, the forward turn): RoPE inside (q's last R channels
    turned as they load, the output's turned back before it is stored). window W: win_idx holds each row's (first,
    skip), int [N, 2], its window keys the pool rows first + j for skip <= j < W (the gather makes them: no [N, W]
    list). visible (positions [N] int64, ratio, G), with cmp_start / cmp_count and no cmp_idx: the compressed keys
    are every entry id g < G the row's position sees, g < (p + 1) // ratio (the "all"-kind layers: no id list)."""
    _check(q, win_kv, win_idx, cmp_kv, cmp_idx, sink, cmp_start, cmp_count, turn, window, visible)
    N, H, D = q.shape
    check(D >= 16 and D & (D - 1) == 0, f"head_dim must be a power of two >= 16 for the Triton path, got {D}")
    check(cmp_kv is None or cmp_kv.dtype == win_kv.dtype, "window and compressed pools must share a dtype")
    scale = D ** -0.5 if scale is None else scale
    q, win_kv = q.contiguous(), win_kv.contiguous()
    if turn is not None:
        # (q's staged load claims 16-byte aligned groups of 8: R a multiple of 8, q's rows at 16-byte addresses;
        # the turned channels are a tl.arange(0, R): R a power of two)
        R = 2 * turn.shape[1]
        check(R >= 8 and R & (R - 1) == 0, f"attention: {R} rotated channels (want a power of two >= 8)")
        q = q if q.data_ptr() % 16 == 0 else q.clone()
    win_idx = win_idx.contiguous() if window is not None else win_idx.to(torch.int32).contiguous()
    has_cmp = cmp_kv is not None
    if has_cmp:
        # (entry ids as the select gives them: int64, a column slice; no cast or copy launch)
        cmp_kv = cmp_kv.contiguous()
        if visible is not None:      # (no id list: the row's positions in its place)
            cmp_idx = visible[0].contiguous()
        elif cmp_start is None or cmp_idx.stride(1) != 1:
            cmp_idx = cmp_idx.to(torch.int32).contiguous()
    n_win = win_idx.shape[1] if window is None else window
    n_cmp = 0 if not has_cmp else cmp_idx.shape[1] if visible is None else visible[2]
    n_keys = n_win + n_cmp
    cfg = default_config(N, H, D, n_keys, win_kv.element_size(), sm_count(q.device))
    block_h = block_h or cfg["block_h"]
    block_k = block_k or cfg["block_k"]
    splits = splits or cfg["splits"]
    unchain = cfg.get("unchain", False) if unchain is None else unchain
    ieee = win_kv.dtype == torch.float32 or INTERPRETING
    unchain = unchain and (INTERPRETING or not ieee)
    per_split = triton.cdiv(triton.cdiv(max(n_keys, 1), splits), block_k) * block_k   # whole key blocks per split
    splits = max(1, triton.cdiv(n_keys, per_split))
    out = empty(q.shape, q.dtype, q.device)
    n_hb = triton.cdiv(H, block_h)
    own = splits == 2 and unchain      # two splits merge from the last program's registers (two counters each)
    cnt = tickets(q.device, (2 if own else 1) * N * n_hb, site="attention") if splits > 1 else None
    if cnt is None:      # one split, or a CUDA graph capture before any warm-up made the counters: unsplit
        splits = 1
        per_split = max(per_split, triton.cdiv(max(n_keys, 1), block_k) * block_k)
    if splits > 1:
        part_m = torch.empty((N, H, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((N, H, splits, D), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = cnt = out
    grid = (n_hb, N, splits)   # head blocks of one row launch together: its keys are read once
    if unchain:   # per program: two [block_h, block_k] P buffers (the pools' dtype) and two [block_h] rescales
        progs = n_hb * N * splits
        scr_p = torch.empty(progs * 2 * block_h * block_k, dtype=win_kv.dtype, device=q.device)
        scr_a = torch.empty(progs * 2 * block_h, dtype=torch.float32, device=q.device)
    else:
        scr_p = scr_a = out
    entries = cmp_start is not None
    # RoPE inside: each program stages its heads' turned q channels ([block_h, R] in q's dtype)
    scr_q = out if turn is None else empty((n_hb * N * splits * block_h * 2 * turn.shape[1],), q.dtype, q.device)
    _sparse_attention_kernel[grid](
        q, out, sink.float().contiguous(), win_kv, win_idx, n_win, cmp_kv if has_cmp else win_kv,
        cmp_idx if has_cmp else win_idx, n_cmp,
        visible[1] if visible is not None else cmp_idx.stride(0) if has_cmp else 0,
        cmp_start.contiguous() if entries else win_idx, cmp_count.contiguous() if entries else win_idx, H,
        float(scale) * LOG2E.value, per_split, part_m, part_l, part_acc, cnt, scr_p, scr_a,
        sink if turn is None else turn, 0 if turn is None else turn.stride(0), scr_q, D=D, ENTRIES=entries,
        ROT=0 if turn is None else 2 * turn.shape[1], WINDOW=window is not None, VISIBLE=visible is not None,
        BLOCK_H=block_h, BLOCK_K=block_k, HAS_CMP=has_cmp, IEEE=ieee,
        SPLIT=splits > 1, BLOCK_S=max(2, triton.next_power_of_2(splits)), DC=min(D, 64),
        UNCHAIN=unchain, LAZY_SUM=cfg.get("lazy_sum", False) if lazy_sum is None else lazy_sum,
        OWN=own and splits > 1,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"], **pdl_kw())
    return out


def sparse_attention(q: torch.Tensor, win_kv: torch.Tensor, win_idx: torch.Tensor, sink: torch.Tensor,
                     cmp_kv: torch.Tensor | None = None, cmp_idx: torch.Tensor | None = None,
                     scale: float | None = None, cmp_start: torch.Tensor | None = None,
                     cmp_count: torch.Tensor | None = None, turn: torch.Tensor | None = None,
                     window: int | None = None, visible: tuple | None = None) -> torch.Tensor:
    """Sparse MQA decode attention with per-head sink (module docstring). scale defaults to D**-0.5. cmp_start /
    cmp_count: cmp_idx holds entry ids; turn: RoPE inside; window: win_idx holds each row's (first, skip);
    visible: every entry the row's position sees (`sparse_attention_triton`)."""
    if use_triton(q):
        return sparse_attention_triton(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, scale, cmp_start=cmp_start,
                                       cmp_count=cmp_count, turn=turn, window=window, visible=visible)
    return sparse_attention_torch(q, win_kv, win_idx, sink, cmp_kv, cmp_idx, scale, cmp_start, cmp_count, turn,
                                  window, visible)
