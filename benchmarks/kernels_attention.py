"""Attention-family kernel benchmarks: sparse decode attention (window + gathered compressed entries, sink) and
the indexer score + top-k. Imported by benchmarks/kernels.py after kbench.configure().

Floors printed beside the rows: bytes (each gathered key read once, q read, out written) over the measured copy
bandwidth (the roof column); for attention also the tensor-core work (QK and PV: 4 * H * D flops per key) over
an H200's ~700 TFLOP/s bf16, which is 0.65x the byte floor at H = 64, D = 512 (128 flops per key byte); and the
"launch floor" row: one empty kernel replayed from a CUDA graph, the least time any launch takes.

Measured (H200, copy ~4,250 GB/s, bf16 matmul 700-790 TFLOP/s; launch floor 0.7 us):
  session 2 (final)      sparse attention N=64 / 256: 44.5 / 149 us (27% / 32%; keys from L2 41 / 121 us);
                         indexer N=64 L=16384 k=512: 136 us (46%; scores 74 us = 87%, one-program-per-row select
                         41 us, torch.topk 77 us)
  session 3 round 1 (K2) tensor-core form (`sparse_attention_tc`: all 64 heads as the M of the dots, one loop over
                         window + compressed keys, key splits with in-launch combine, optional D split for P@V):
                         N=64 best 49.4 us (bk64 S2 w8 st2; bk32 58.8, dv256 w4 61-74, S4 71-80), N=256 best
                         148.1 us (bk64 S1; bk32 173, dv256 w4 171-229) -- no better than session 2's kernel
                         (44.1 / 148.5). Floors: bytes 11.8 / 47.4 us, flops 6.8 / 27.1 us. Ablations: with every
                         key an L2 hit 52.6 / 158 us, without the P@V dot 47.2 / 130 us: the time is neither HBM
                         nor tensor cores but the per-tile instruction stream (~1,300 SASS instructions per 32-key
                         tile per thread, 11 barriers, one 8-warp program per SM: the [64, 512] fp32 accumulator is
                         half the register file, Q 64 KB of shared memory) plus a large fixed cost per program.
                         Triton's chained-dot layout puts all 8 warps along M, so with 64 heads both warpgroups
                         compute the same Q K^T (2x the QK tensor work); lazy rescaling slower (spills).
                         Indexer: looped score programs (queries once per program, pipelined key loads) 68.3 us =
                         94% (bg128 w4 4 blocks st3); chunked select 28.5 us (4 chunks, unsorted; 8: 31.3, 16: 42;
                         sorted +3 us); score + select (default path) 114.2 us (55%); fused first stage 98.7 us
                         (4096-entry programs).
  session 3 round 2 (K2) tensor-core form: 128-key tiles (one stage: 192 KB of shared memory, spills) 64.9 / 173 us;
                         bf16 partials 48.9 us at N=64; lazy 153.7 at N=256. Default dispatch unchanged (session 2's
                         kernel): 43.9 / 147.0 us. Per-program cost vs keys (window only, N=256): tc 24.4 us for 64
                         keys, 35.4 for 128, 148 for 640 (~12 us per 64-key tile per wave of 132 programs, ~13 us
                         fixed); session 2's kernel 26.6 / 41.0 / 147.
                         Indexer: select counts as two int32 sums reduced together (16-bit fields) instead of one
                         int64: 27.5 us (4 chunks, 8 warps; 2 chunks w16 29.1; 8 chunks 30.8-32.1; one program per
                         row 35.7); score + select 100.3 us = 63% (unsorted, the engine's form, 98.2 = 64%); scores
                         alone 69.4 us = 92%; fused first stage 99.1 us (no better: kept as an option, not default).
  session 4 round 1 (K2) attention sweep (N=64 / 256; dispatched kernel 44.2 / 148.5 us): session 2's kernel with 3
                         stages (index loads async) 49.3 (bh16 bk64 w4) / 155.8 (bh64 bk32 w8); bh16 with 8 warps
                         or 16-key blocks 75-85 / 280; tensor-core form (one loop, all heads) bk64 w8 S2 st2 49.3,
                         st3 56.9 / S1 st3 142.6 (the one win, 4%); missing keys masked by a bias dot (no index
                         reload in the dot's layout) 49.6 / 150.7; D split over two programs (2 CTAs per SM at 4
                         warps, bk16: 58.6 / 188; 8 warps bk32: 91.7 / 297.5). Scores alone 68.1 us = 94%; chunked
                         select 27.5 / 30.0 (sorted); scores + threshold select in one launch 157.6-158.5 us.
                         Removed after this round (numbers in kernels/decode_attention.py's docstring): the
                         tensor-core kernel's D split, lazy rescale, bias masking, bf16 partials, the two-launch
                         combine, register prefetch; the tensor-core form is now the one-loop option of the one
                         kernel.
  session 4 round 2 (K2) select (scores in L2): threshold select (group maxima -> candidates -> exact select, radix
                         passes starting below the keys' shared leading bits) 26.4 us unsorted / 30.3 sorted (16
                         warps 31.6, 4 warps 41.7); chunked 29.3 / 32.0, 2 chunks w16 30.4; scores + threshold
                         select in one launch 156.9 (removed). The merged attention kernel's one-loop form gets a
                         different QK layout from Triton than the former tensor-core kernel (warps over heads, both
                         warpgroups computing Q K^T), so the N >= 192 default stays two loops until measured.
  session 5 round 1 (K2) attention (dispatch 43.8-43.9 / 146.6-146.8 us): "unchained" (P and the rescales through a
                         per-program scratch so Triton splits Q K^T over the two warpgroups): N=256 one loop bk64
                         123.1 (38%), bk32 154.5, pool by pool bk32 136.7, two splits 192.9; N=64 bk64 S2 42.8, bk32
                         S1-S4 76.6 / 51.2 / 75.2 / 71.7 (more than 132 programs = two waves: S <= 132 / N). A
                         "lookahead" form (each block's Q K^T one iteration before its softmax and P@V, keys gathered
                         twice) 185.9 at N=256, 63.1 at N=64 S2: removed. Keys from L2: dispatch 119.2, unchained bk32
                         128.4. Select (scores in L2) with the early-exit radix search: chunked 26.0 (was 29.4;
                         stage 1 alone 16.9, stage 2 alone 9.3), threshold 25.5, 4 warps 27.2, 16 warps 30.1, 8
                         chunks 27.5; score + select 97.6 sorted / 95.1 unsorted (64% / 66%; was 102.9 / 100.4).
  session 5 round 2 (K2) attention N=64 / 256: unchained pool by pool bk64 (S2 / S1) 42.6 / 110.6 us (28% / 43%),
                         one loop 45.9 / 122.9 (removed), pools bk32 49.3 / 136.7; 32-head programs (mma.sync)
                         bk64 w8 49.3 / 210.4, bk32 63.9-75.0; 16-head bk32 56.1; session 4 dispatch 44.0 / 146.8.
                         Ablations at N=256 (two waves): keys from L2 90.6, the 128 window keys only 33.9, no keys
                         10.9. Select: direct winner writes + no recount after an exact cut: chunked 28.7 with 8-warp
                         chunk programs, 24.8 with 4 (the new default), threshold 24.7, stage 1 alone 20.4 (8 warps),
                         stage 2 alone 8.3; programmatic dependent launch 35.8 alone, 103.7 after the scores
                         (removed); score + select 100.4 sorted / 98.4 unsorted with 8-warp chunks.
  session 5 round 3 (K2, final) dispatch N=64 / 256: 42.2-42.6 / 110.7-111.1 us (28% / 42-43%); keys from L2 34.6 /
                         90.9; N=256 with the 128 window keys only 34.1, no keys 10.9 (launch floor 0.7). (Its
                         "session 4" rows ran unchained by mistake: 61.7 / 136.8; the real session 4 dispatch is 43.8-
                         44.0 / 146.6-146.8 in rounds 1-2.) Select alone: chunked 25.0 unsorted / 27.5 sorted,
                         threshold 24.8; score + select 97.1 sorted / 94.6 unsorted (65% / 66%), with the threshold
                         select 98.0; scores alone 69.5 (92%).
  session 6 round 1 (K2) attention (dispatch 42.9 / 111.2 us, again 43.0 / 111.2): the gathers' latency is not the
                         bottleneck. Indices preloaded before the loops (Triton then keeps 1-2 gathers in flight
                         across iterations instead of issuing the next block's after this block's P@V and waiting
                         for it at the next iteration's top): N=64 S2 bk32 st3 47.6, st4 49.0, bk64 st2 46.6; one
                         loop over both pools bk32 st4 42.1 (chained 51.3); N=256 S1 bk32 st3 134.3, st4 140.3,
                         bk64 st2 120.3, one loop st3 125.8 / st4 133.2 (chained 137.6); 16 warps 51.7-73.7 at N=64,
                         140.2-236.9 at N=256. Keys from L2 (N=256) 90.2. Select (scores in L2): 24.7 (2-bit steps);
                         4-bit steps (15 counts per reduction) slower in both stages: stage 1 16.2 -> 30.3, stage 2
                         8.3 -> 12.3, both 42.4, threshold 32.3; the merge by the chunks' last program (one launch)
                         25.0 (4-bit 44.4). Score + select 92.0 (69%, two launches); scores alone 67.9 (95%).
  session 6 round 2 (K2) dispatch 42.2 / 110.5 us (again 42.2 / 110.4), the one-loop preload form at N=64 41.6
                         (round 1: 42.1 against 42.9: ~1.5%, within the spread between rounds; removed); keys
                         from L2 34.4 / 90.6. Scores + select in one launch (tickets: score pieces first, then
                         select chunks that wait for their row's scores, the row's last chunk merging): 4 chunks
                         94.4 against 93.4 for the two launches, 8 chunks 105.2, 2 chunks 106.2, sorted 98.9
                         (removed). Default rows: score + select 98.6 sorted / 96.0 unsorted (64% / 65%; round 1
                         95.5 / 93.0), scores alone 69.3 (92%; round 1 67.9), select alone 25.2 unsorted.
  session 6 round 3 (K2, final) dispatch 42.6 / 111.6 us (28% / 42%; session 5 dispatch, the same kernel, 43.1 /
                         111.7); keys from L2 34.6 / 91.0; launch floor 0.7. Score + select 96.0 sorted / 93.4
                         unsorted (66% / 68%), scores alone 68.0 (94%), select alone 24.6 unsorted. Select sweep:
                         4-chunk w2 34.6, 8 chunks 25.5-27.9, merge w4 / w16 26.3; a shrinking search (the bucket
                         holding the k-th key compacted to 256-1024 entries after 4-7 reductions) 26.8-31.6 against
                         25.2 (behind the scores 95.3 against 92.8): removed.
  session 7 round 1 (K2) attention: denominators kept per column (`lazy_sum`, one cross-warpgroup reduction less
                         per block) 41.8 / 108.0 us against 42.7-42.8 / 111.1-111.3 (keys from L2 at N=256 88.5
                         against 90.4): the new default. ncu (keys from L2, N=256): ~1,000 instructions per warp
                         per 64-key block at 7.5 cycles each (2 warps per scheduler, 0.35 eligible; IPC 1.05).
                         Indexer: one select row alone 18.8 us, 8 rows 21.4 (64 rows 25.0): latency. Scores + select
                         in one launch with interleaved tickets (select chunks `lag` rows behind the score pieces)
                         95.4-110 against 93.4-93.5 for the two launches: removed (kernels/indexer.py).
  session 7 round 2 (K2) attention default 41.5-41.7 / 108.0-108.5 us against session 6's 43.0 / 111.6 (keys from
                         L2 89.1-89.2 against 91.8). Score kernel grid (N=64, L=16384): 4 blocks a program 67.9
                         (94%), 2 blocks 67.7, 3 blocks (6.95 waves of ~3 programs per SM, against 5.2) 69.3, 5-8
                         blocks 69.0-70.7, 4 stages 69.2-69.4, 8 warps 70.0, 64-entry blocks 69.8: no tail to win.
                         ncu of one row's select (the latency case): chunk stage 4 programs x 4 warps, ~5,700
                         instructions per warp at 3.5 cycles (stalls: fixed-latency dependency 1.6, short scoreboard
                         0.4; 254 registers), merge 1 program x 8 warps, ~2,340 per warp at 6.1 cycles: ~10.5 + 7.5
                         us of dependent instruction chains.
  session 8 round 1 (K2) select (scores in L2, unsorted): the k-th key found by an interpolation search (normal-fit
                         first guess, then interpolated thresholds, a top-4 reduction for the last <= 4 ranks)
                         19.2 us against 25.1 for the two-bit search (sorted 21.8 / 27.7); without the top-4 end
                         game 25.1, rank spread 1 instead of 2 20.6, first-guess spread .5 19.6; 4-warp merge 19.5,
                         8-warp chunks 22.4, 2 chunks of 8 warps 19.2, 8 chunks 21.0-21.6, one program per row
                         24.0-24.5; the group-maxima threshold select 24.8 (removed). One row 12.5 (two-bit 19.0),
                         8 rows 15.6 (21.1). Score + select 93.8 sorted / 91.1 unsorted (67% / 69%) against 96.8 /
                         94.2; scores alone 68.0 (94%). Attention unchanged: 41.9 / 108.4 us.
  session 8 round 2 (K2) select (scores in L2): 18.9 us unsorted (again 18.9), both stages in one launch (each row's
                         last chunk program merges, `fused`) 18.4 (2 chunks of 8 warps 18.2), sorted 21.3 two
                         launches / 21.6 fused; rank spread 3 19.6-19.8, first-guess spread .2 20.1, 16-warp merge
                         20.3, 2 chunks 19.2, 8 chunks 20.9. On the score kernel's output instead of randn 21.4 (the
                         search's passes depend on the scores; emulated: ~3.2 reductions per chunk against ~2.8).
                         One row 13.3, 8 rows 14.9. Score + select 93.5 sorted / 91.1 unsorted (two launches).
  session 9 round 1 (K2) the shared tickets (kernels.backend) in both families; attention 41.5 / 108.1 us (before:
                         42.6 / 111.5). Scores + select in one launch of the score kernel (each 4096-entry chunk's
                         last score program selects it, the row's last chunk merges): 95.2 against 90.3 for the
                         two launches (212 registers: 2 score programs per SM), capped at 168 registers 91.3, the
                         chunk's last piece in launch order waiting for the others 93.4 (capped 90.1), rows
                         together 93.1, 2048-entry chunks 98.1, sorted 99.5; a running top-k per row (chunks merge
                         in turn, each keeping its entries above the running k-th) 110.4-126.6: all removed.
                         Select alone 18.5-18.7 unsorted (2 chunks of 8 warps 17.9), one row 13.3 (its chunk
                         stage 8.0, merge 5.5), 8 rows 15.2; on the score kernel's rows 20.8. Unsorted engine
                         form 89.4 (71%), sorted 93.2, scores alone 68.2 (94%). Longer rows (the flat merge of 16
                         chunks' 8192 candidates, spilling): N=8, L=131072 162.6 us (39%), N=64, L=65536 348.7
                         (72%), N=64, L=131072 656.7 (77%).
  session 9 round 2 (K2) a tree for rows of more than 4 chunks (groups of 4 merged by their last chunk, the groups by
                         the row's last): N=8, L=131072 123.5 us (51%; select alone 33.1 against 43.5 for two
                         launches), N=8, L=65536 74.4 (42%, scores alone 36.9), N=64, L=65536 323.1 (78%; select
                         alone 63.8 against 57.5 for two launches), N=64, L=131072 629.4 (80%). 2 chunks of 8
                         warps on the score kernel's rows 19.5 against 20.4 (4 of 4 warps), behind the scores 88.2
                         (72%) against 90.9: the new default. Attention 41.3 / 108.0.
  session 10 round 1 (K2) attention against a copy of the session-9 file (each twice; the round's own script, the
                         kernel's docstring has the ncu breakdown): session 9 41.9-42.2 / 108.4-108.6 us, exp2 (log2
                         units) 41.1-41.4 / 105.9, + an L2 prefetch of the next block each iteration 43.3-43.4 /
                         110.1, + P stored from registers 49.4-49.5 / 145.2, transposed 32-head programs 46.0 /
                         139.5 (4 warps), 51.3 / 215.5 (8 warps): the last three removed.
  session 10 round 2 (K2) session 9 41.5-41.7 / 107.2, exp2 40.7-41.4 / 104.7, + the split combine's next chunk
                         loaded before this one is stored 40.1-40.2 / 104.7 (the default; 128 dims a step
                         40.9-41.1), + one prefetch of the compressed loop's first block 40.5-41.0 / 109.7-109.9
                         (removed). Indexer scores + select (unsorted) at long rows by chunks per row: N=64,
                         L=65536 16 (tree) 327.6-330.5, 8 (tree) 327.1-327.5, 8 in two launches 318.4-319.5, 4
                         339.0; N=64, L=131072 32 (tree) 646.3-648.0, 16 (tree) 633.6-637.9, 8 657.6-658.3, 16 in
                         two launches 627.1-627.2; N=8, L=131072 32 (tree) 121.6-121.9, 16 (tree) 100.0-100.2;
                         N=8, L=65536 16 (tree) 76.9-77.0, 32 80.4-80.6: chunks of 16k entries, and more than 16
                         rows merge in a second launch (`default_chunks`, `TREE_ROWS`).
  session 10 round 3 (K2) against session 9's files: attention 41.3-41.8 -> 40.3-40.4 / 107.9-108.0 -> 104.1 us
                         (29-30% / 46%); indexer scores + select N=8, L=65536 76.4 -> 63.1, N=64, L=65536 323.3-323.5
                         -> 309.4-309.7 (82%), N=8, L=131072 119.9 -> 99.6-99.7 (63%), N=64, L=131072 631.8-632.0 ->
                         611.7-612.5 (83%). Compiled attention + indexer tests: 69 passed.
  session 11 (K2, a round script against session 10's files in the same run, copy 4,221-4,250 GB/s) attention
                         N=64 (two splits): the second program merges from its registers 40.3-40.8 -> 37.8-38.2 us
                         (29% -> 31%; rounds 2-3), the ticket-first protocol with the stored merge 42.1-42.3, the
                         first register form (partial addresses split like the accumulator: one element per thread)
                         120.0; N=256 unchanged 103.7-104.2 (46%). Indexer scores + select (unsorted): the tree merge
                         against a second launch, N=8 / 12 / 16 / 24 / 32 rows: L=65536 (8 chunks) 63.3 / 78.9 / 94.5
                         / 134.7 / 176.1 against 59.2 / 76.1 / 90.8 / 131.3 / 166.6, L=131072 (16 chunks) 99.5 /
                         137.9 / 175.4 / 251.0 / 324.1 against 99.6 / 139.8 / 170.4 / 247.6 / 317.4; N=8, L=65536
                         with 4 chunks 84.4, L=131072 with 8 127.6; the tree's groups of 2 / 8 chunks 63.8 / 59.2
                         (L=65536), 105.9 / 103.7 (L=131072, 4: 99.4); scores alone at N=8 37.5 (84%) / 69.2 (91%)
                         (rounds 1-2). Round 3, the new defaults (`TREE_ROWS` 12, `TREE_CHUNKS` 16): N=8, L=65536
                         63.1-63.2 -> 59.2 (50% -> 53%), N=12, L=65536 81.2 -> 77.1-77.2 (58% -> 62%), N=16,
                         L=131072 177.0-177.1 -> 173.3-173.4 (72% -> 73%), N=12, L=131072 139.8-140.0 (unchanged).
                         Round 4, the score kernel alone by blocks per program (4, the default / 2 / 8; of the
                         bytes read + scores written at round 3's copy rate): N=8, L=65536 37.0-37.1 / 36.8 / 40.5
                         (87% / 87% / 79%), N=8, L=131072 67.9-68.3 / 67.4-68.1 / 69.0, N=64, L=16384 68.1-68.4 /
                         67.6-68.0 / 68.5-68.6: no change beyond noise, the default stays. Compiled tests: attention
                         30 passed (round 3), indexer 40 passed (round 4).
  session 12 (K2, a round script against session 11's files in the same run; us, each row timed twice) the
                         mid-size model's 32 heads (D=512, 128 + 512 keys): the new dispatch (16-head programs with
                         key splits while they can take two, else 32-head programs; `default_config`) N=32 / 64 /
                         128 / 256 34.0-34.1 / 36.5-36.6 / 46.4-46.8 / 87.0-87.2 -> 21.3 / 28.7-29.0 / 42.3-42.5 /
                         72.9 (R3; of the bytes at session 11's copy rate, ~4,240 GB/s: 16% -> 25%, 30% -> 38%, 47%
                         -> 51%, 50% -> 60%); the step's short rows (37 window + 20 compressed keys) N=64 / 128 / 256
                         12.6-12.8 / 17.0 / 32.1 -> 12.1-12.4 / 16.6-16.8 / 26.6-26.7. Programmatic dependent launch
                         for all five kernels (`select_layer`'s chain, N=64 / 256 at G=1024, 64 at G=16384, PDL off ->
                         on: 47.9-48.3 -> 45.2-45.3, 109.5-109.9 -> 108.5-109.0, 125.6 -> 123.9-124.2; session 11's
                         files 54.9 / 122.2 / 131.9); V4.1's 64 heads N=64 38.1-38.2 (session 11) / 38.1 (off) /
                         37.9-38.0 (on). Compiled tests: attention 34, indexer 40, index rows 16 passed (R2), attention
                         34 again (R3). The rows of `bench_attention`'s 32 heads, its PDL-off rows and
                         `bench_select_layer` came after the rounds: not yet run on a GPU.
  session 13 (K2, a round script against session 12's files in the same run; us, each row timed twice) the select
                         layer in the engine's three launches (the score kernel rotating the index queries, scaling
                         the bf16 head weights and scoring only the visible entries; the select; the attention
                         kernel making the entries' pool rows in its gather) against session 12's seven (weights
                         multiply, rope, scores, visible, select, entry rows, attention), mid-size shapes: N=64 /
                         256, G=64 31.8 / 59.6 -> 22.9 / 46.7, N=64 G=1024 57.6 -> 46.5-46.6, G=16384 133.7 -> 132.6
                         (R3), N=8 G=64 26.1-26.2 -> 23.8-23.9 (R1); outputs bit-equal. Attention alone with entry
                         ids, 128 + 512 keys: 32 heads N=64 28.4-28.6 -> 29.5, 64 heads 37.6 -> 37.1-37.2 (R3). The
                         last program of more than two key splits merging from its registers lost (R2, numbers in
                         kernels/decode_attention.py). Compiled tests: attention + indexer + index rows 118 passed
                         (R2), attention + index rows 60 again (R3). `bench_select_layer`'s rows were not run in a
                         round (the round script timed the same chain against session 12's files).
  session 14 (K2, a round script against session 13's files in the same run; us, each row timed twice) the engine's
                         attention launch with RoPE inside (q turned as it loads, the output turned back before it
                         is stored) against rope + attention + inverse rope, entry ids: 32 heads N=64 / 256 / 8
                         33.5-34.4 / 84.1 / 17.3-17.7 -> 31.0-31.3 / 72.2-72.4 / 15.5-15.8, the step's short rows
                         (37 + 20 keys) N=64 18.1-18.2 -> 15.0, 64 heads N=64 44.4 -> 42.3-42.4; with the window keys
                         made from each row's (first, skip) in the gather too 29.9-30.2 / 70.9 / 15.5-15.9 / 11.5 /
                         42.2 (R1; the window list's three launches a step were 6.7-7.3 us; of the bytes at 4,250
                         GB/s, 32 heads N=64 32% -> 36%, N=256 52% -> 61%, 64 heads 27% -> 28%). `step_form`'s rows
                         (`bench_attention`) time the same two forms. The "all"-kind layers' entries made in the
                         gather (visible) against their id list's five launches + attention, 400 of G = 512 entries
                         visible: 32 heads N=64 39.5-39.6 -> 27.8-27.9 (23% -> 33%), N=256 80.0-80.1 -> 61.3-61.4
                         (46% -> 60%), 64 heads N=64 51.3-51.4 -> 37.5 (20% -> 27%) (R2). R3 repeated R1's rows
                         within 0.7 us (32 heads N=256 with the window rows 69.8-70.2, 62%). Compiled tests:
                         attention + indexer 102 of 111 passed in R2 (9 select tests cut by its time limit), those 9
                         in R3.
  session 15 (K2, round scripts against HEAD's files / configurations in the same run; us, each row timed twice)
                         V4.1's 64 heads at few rows in 16-head programs of 4 warps (default_config; the engine's
                         form): N=8 / 16 / 32 33.9 / 34.8-35.2 / 39.0-39.1 -> 18.3-18.4 / 21.3-21.4 / 28.1-28.7
                         (R2; R4 against HEAD's file: N=8 / 32 / 33 33.4 / 38.4 / 39.0 -> 17.6-17.9 / 27.9-28.0 /
                         28.9-29.0; ncu, spills and the rest of the sweep in kernels/decode_attention.py). Candidate
                         blocks (`bench_candidate_blocks`: kernels/index_rows.py's three launches against the
                         torch chain), N=64, G = 16,392 / 65,536 / 131,072: 94.5-95.4 / 264.2-266.1 / 432.9-433.3
                         -> 12.7-13.3 / 28.6 / 51.8-51.9 (R1-R3; the forms measured on the way in index_rows.py's
                         docstring; the function's own rows were run only --dry: the round scripts timed the same
                         calls). Compiled tests (R4): attention 70 passed, index rows 18 passed.
"""
import os
import sys
import time

import torch
import triton

from deepinfer_sg.engine.indexer import candidate_block_mask, index_score_scale
from deepinfer_sg.engine.testing import midsize_v41_config
from deepinfer_sg.kernels import backend, decode_attention, index_rows, indexer, rope
from kbench import DEV, DRY, emit, rotating, row, S, time_ms

MIDSIZE = midsize_v41_config()["text_config"]
TFLOPS = 700.0          # bf16 dense matmul rate for the flop floor until `matmul_rate` has measured it
_RATE = {}

# attention sweep variants (N, keywords of sparse_attention_triton) beside the dispatched launch (none left: session
# 6's preload / one-loop / 16-warp forms lost, numbers above and in kernels/decode_attention.py)
_U = dict(block_h=64, num_warps=8, unchain=True)
ATTN_VARIANTS = []
# session 6's dispatch (the "before" rows of this session): all heads, unchained, 64-key blocks, 2 stages, the
# softmax denominators summed per block
BEFORE = dict(_U, block_k=64, num_stages=2, lazy_sum=False)
# select variants (label, topk_select_triton keywords), most telling first
SELECT_VARIANTS = [("default", dict(sorted=False)),
                   ("4 chunks w4 (session 8 default)", dict(chunks=4, sorted=False)),
                   ("2 chunks w8 two launches", dict(chunks=2, sorted=False, fused=False)),
                   ("default sorted", dict(sorted=True)),
                   ("4 chunks w4 sorted (session 8 default)", dict(chunks=4, sorted=True)),
                   ("2 chunks w8 fused sorted", dict(chunks=2, sorted=True, fused=True)),
                   ("default again", dict(sorted=False))]


def attn_label(v):
    N, kw = v
    form = ("unchained" if kw.get("unchain") else "chained") + (" lazy sum" if kw.get("lazy_sum") else "")
    return (f"N={N} bh{kw['block_h']} bk{kw['block_k']} w{kw['num_warps']} st{kw['num_stages']} S{kw['splits']} "
            f"{form}")


@triton.jit
def _empty_kernel(x_ptr):
    pass


def launch_floor(bw):
    """The least time one launch takes (an empty kernel, CUDA-graph replay): no kernel can beat it."""
    x = torch.empty(1, device=DEV)
    t = time_ms(lambda: _empty_kernel[(1,)](x))
    row("  launch floor", "empty kernel, graph replay", t, None, 0, bw, "no launch is faster")
    return t


def matmul_rate():
    """Measured bf16 dense matmul rate (TFLOP/s) for the flop floor (kernels.py measures it too but does not pass
    it to the family modules)."""
    if DRY:
        return TFLOPS
    if "r" not in _RATE:
        a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
        t = triton.testing.do_bench(lambda: a @ b, warmup=5, rep=40, return_mode="median")
        _RATE["r"] = 2 * 8192 ** 3 / (t * 1e-3) / 1e12
    return _RATE["r"]


def attn_inputs(N, H, D, Kw, Kc, pool):
    def make():
        q = torch.randn(N, H, D, device=DEV, dtype=torch.bfloat16)
        win = torch.randn(N * Kw, D, device=DEV, dtype=torch.bfloat16)
        cmp_ = torch.randn(N * pool, D, device=DEV, dtype=torch.bfloat16)
        wi = (torch.arange(N, device=DEV)[:, None] * Kw + torch.arange(Kw, device=DEV)).int()
        ci = (torch.arange(N, device=DEV)[:, None] * pool +
              torch.randperm(pool, device=DEV)[:Kc][None, :]).int()
        return q, win, wi, torch.randn(H, device=DEV), cmp_, ci
    return make


def attn_shape():
    return S(64, 16), S(512, 64), S(128, 16), S(512, 16), S(2048, 64)


def attn_floors(N, H, D, Kw, Kc, bw):
    """(bytes, byte floor us, flop floor us): keys read once, q read, out written; 4 H D flops per key."""
    nbytes = N * (Kw + Kc) * D * 2 + 2 * N * H * D * 2
    flop_us = 4 * N * H * D * (Kw + Kc) / (matmul_rate() * 1e12) * 1e6
    return nbytes, nbytes / (bw * 1e9) * 1e6, flop_us


def attn_note(t_ms, byte_us, flop_us, err):
    roof = max(byte_us, flop_us)
    return (f"rel err {err:.1e}; floors: bytes {byte_us:.1f} us, flops {flop_us:.1f} us "
            f"({matmul_rate():.0f} TFLOP/s); {roof / (t_ms * 1e3):.0%} of roofline")


def _before_cfg(N, sms=132):
    """Session 6's dispatch (the "before" row): all heads unchained, 64-key blocks, sms // N key splits, per-block
    denominator sums."""
    return dict(BEFORE, splits=max(1, min(8, sms // N)))


# session 11's dispatch at fewer than 64 heads (the "before" row at the mid-size model's 32): 16-head programs, one
# split
BEFORE_FEW_HEADS = dict(block_h=16, block_k=64, num_warps=4, num_stages=2, splits=1)


def pdl(on: bool, fn):
    """fn with programmatic dependent launch on / off (`kernels.backend.pdl_as`)."""
    def run():
        with backend.pdl_as(on):
            return fn()
    return run


def bench_attention(bw, l2, batches):
    H, D, Kw, Kc, pool = attn_shape()
    launch_floor(bw)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if not DRY else 132
    for N in batches:
        for heads in (H, S(32, 16)):     # V4.1's 64 heads, the mid-size model's 32
            nbytes, byte_us, flop_us = attn_floors(N, heads, D, Kw, Kc, bw)
            nxt = rotating(attn_inputs(N, heads, D, Kw, Kc, pool), nbytes, l2)
            s = nxt()
            b = decode_attention.sparse_attention_torch(*s).float()
            cfg = decode_attention.default_config(N, heads, D, Kw + Kc, sms=sms)
            before, when = (_before_cfg(N), "session 6") if heads == H else (BEFORE_FEW_HEADS, "session 11")
            runs = (("sparse attention", {}, backend.PDL,
                     "default dispatch: " + " ".join(f"{k}={v}" for k, v in cfg.items())),
                    ("  PDL off", {}, False, "the default dispatch, plain launches"),
                    (f"  before ({when})", before, backend.PDL, " ".join(f"{k}={v}" for k, v in before.items())))
            for label, kw, on, what in runs:
                a = decode_attention.sparse_attention_triton(*s, **kw)
                err = float((a.float() - b).norm() / b.norm())
                t = time_ms(pdl(on, lambda: decode_attention.sparse_attention_triton(*nxt(), **kw)))
                tt = time_ms(lambda: decode_attention.sparse_attention_torch(*nxt())) if label[0] != " " else None
                row(label, f"N={N} H={heads} D={D} keys={Kw}+{Kc}", t, tt, nbytes, bw,
                    attn_note(t, byte_us, flop_us, err) + f"; {what}")
            step_form(s, N, heads, Kw, f"N={N} H={heads} D={D} keys={Kw}+{Kc}", nxt, nbytes, bw, byte_us, flop_us)
            if heads == H:
                # the same work with every row's keys among 32 rows of the pool (L2 hits): the kernel's time without
                # HBM traffic, i.e. its compute + latency floor at this launch configuration (V4.1's 64 heads)
                q, win, wi, sink, cmp_, ci = s
                hw, hc = (wi % 32).int(), (ci % 32).int()
                t = time_ms(lambda: decode_attention.sparse_attention(q, win, hw, sink, cmp_, hc))
                row("  keys from L2", f"N={N} H={heads} (32 distinct keys)", t, None, nbytes, bw,
                    "compute + latency floor")


def step_form(s, N, heads, Kw, shape, nxt, nbytes, bw, byte_us, flop_us):
    """The engine's launch (session 14): RoPE inside (q turned as it loads, the output turned back before it is
    stored) and the window keys made in the gather from each row's (first, skip), against the three launches it
    replaces (rope on q, attention over the window's id list, inverse rope on the output); the same inputs."""
    ang = torch.rand(N, S(ROPE_DIM, 16) // 2, device=DEV) * 6.283
    turn, inv = torch.stack([ang.cos(), ang.sin()], -1), torch.stack([ang.cos(), -ang.sin()], -1)
    rows = torch.stack([torch.arange(N, device=DEV) * Kw, torch.zeros(N, dtype=torch.int64, device=DEV)], 1)

    def inside(x):
        q, win, wi, sink, cmp_, ci = x
        return decode_attention.sparse_attention_triton(q, win, rows, sink, cmp_, ci, turn=turn, window=Kw)

    def apart(x):
        q, win, wi, sink, cmp_, ci = x
        o = decode_attention.sparse_attention_triton(rope.apply_rope_triton(q, turn), win, wi, sink, cmp_, ci)
        return rope.apply_rope_triton(o, inv)
    b = decode_attention.sparse_attention_torch(*s, turn=turn).float()
    for label, fn in (("  rope, window inside", inside), ("  rope apart (3)", apart)):
        err = float((fn(s).float() - b).norm() / b.norm())
        t = time_ms(lambda: fn(nxt()))
        row(label, shape, t, None, nbytes, bw,
            attn_note(t, byte_us, flop_us, err) + ("; one launch" if fn is inside else "; rope, attention, rope"))


ROPE_DIM = MIDSIZE["qk_rope_head_dim"]        # the rotated channels (V4.1 / the mid-size model)


def chain_inputs(N, Hi, Di, G):
    """The select layer's inputs as the step has them: index queries before RoPE, head weights as weights_proj
    gives them (bf16, a column slice of the stacked product), the rows' rotations, each row's G index keys,
    positions that see them all, and attention inputs (32 heads) whose compressed pool holds each row's G entries."""
    def make():
        q, win, wi, sink, kv, _ = attn_inputs(N, S(32, 16), 512 if not DRY else 64, 128 if not DRY else 16, 1, G)()
        iq, _, keys, start, count = indexer_inputs(N, Hi, Di, G)()
        wx = torch.randn(N, Hi + 16, device=DEV, dtype=torch.bfloat16)[:, 8:8 + Hi]
        ang = torch.rand(N, S(ROPE_DIM, 16) // 2, device=DEV) * 6.283
        turn = torch.stack([ang.cos(), ang.sin()], -1)
        return iq, wx, turn, keys, start, count, torch.full((N,), 2 * G, device=DEV), q, win, wi, sink, kv
    return make


def select_layer(x, G, k):
    """The engine's select layer (session 13) as one chain of launches: index scores (the queries rotated, the
    head weights scaled and the entries the positions see picked in the kernel) -> top-k select (unsorted) ->
    sparse attention over the window and the selected entries (their pool rows made in the kernel's gather)."""
    iq, wx, turn, keys, start, count, pos, q, win, wi, sink, kv = x
    scores = indexer.indexer_scores_triton(iq, wx, keys, start, count, G, w_scale=index_score_scale(*iq.shape[1:]),
                                           turn=turn, positions=pos, ratio=2)
    ids, _ = indexer.topk_select_triton(scores, k, sorted=False)
    return decode_attention.sparse_attention_triton(q, win, wi, sink, kv, ids[:, :min(k, G)], cmp_start=start,
                                                    cmp_count=count)


def bench_select_layer(bw, l2):
    """The select layer's three launches back to back (CUDA graph), timed twice, and with programmatic dependent
    launch off. Every kernel waits before its first load, so only launch latency and scheduling overlap. G = 64:
    the mid-size step's shape (a 32-token prompt)."""
    N, Hi, Di, L, k = indexer_shape()
    for n, G in S(((64, 64), (256, 64), (64, 1024), (64, L)), ((2, 64),)):
        nbytes = n * G * Di * 2 + n * (128 + min(k, G)) * 512 * 2
        nxt = rotating(chain_inputs(n, Hi, Di, G), nbytes, l2)
        for label, on in (("select layer", backend.PDL), ("  again", backend.PDL), ("  PDL off", False)):
            t = time_ms(pdl(on, lambda: select_layer(nxt(), G, k)))
            row(label, f"N={n} G={G} k={k} H={S(32, 16)}", t, None, nbytes, bw,
                "index scores, select, attention (3 launches)")


def indexer_inputs(N, Hi, Di, L):
    def make():
        return (torch.randn(N, Hi, Di, device=DEV, dtype=torch.bfloat16), torch.randn(N, Hi, device=DEV),
                torch.randn(N * L, Di, device=DEV, dtype=torch.bfloat16), torch.arange(N, device=DEV) * L,
                torch.full((N,), L, device=DEV))
    return make


def indexer_shape():
    return S(64, 2), S(32, 4), S(128, 32), S(16384, 300), S(512, 16)


def bench_indexer(bw, l2):
    N, Hi, Di, L, k = indexer_shape()
    nbytes = N * L * Di * 2
    nxt = rotating(indexer_inputs(N, Hi, Di, L), nbytes, l2)
    s = nxt()
    # the select must pick exactly what the stable twin picks on the same scores
    sc = indexer.indexer_scores_triton(*s, L)
    i2, v2 = indexer._select(sc, k)
    checks = []
    for kw in ({}, dict(chunks=1), dict(chunks=4)):
        i1, v1 = indexer.topk_select_triton(sc, k, **kw)
        checks.append(bool(torch.equal(i1, i2) and torch.equal(v1, v2)))
    ia, va = indexer.indexer_topk_triton(*s, k, max_len=L)
    ib, vb = indexer.indexer_topk_torch(*s, k, max_len=L)
    overlap = float(sum(len(set(ia[i].tolist()) & set(ib[i].tolist())) for i in range(N)) / (N * k))
    floor_us = nbytes / (bw * 1e9) * 1e6
    note = f"bytes floor {floor_us:.1f} us"
    t = time_ms(lambda: indexer.indexer_topk_triton(*nxt(), k, max_len=L))
    tt = time_ms(lambda: indexer.indexer_topk_torch(*nxt(), k, max_len=L))
    row("indexer score+top-k", f"N={N} Hi={Hi} Di={Di} L={L} k={k}", t, tt, nbytes, bw,
        f"{note}; select == stable twin: {checks[0]} (one program per row: {checks[1]}, 4 chunks: {checks[2]}); "
        f"overlap {overlap:.1%}")
    t = time_ms(lambda: indexer.topk_select_triton(indexer.indexer_scores_triton(*nxt(), L), k, sorted=False))
    row("  unsorted (engine)", f"N={N} L={L} k={k}", t, None, nbytes, bw, "scores + select(sorted=False)")
    t = time_ms(lambda: indexer.topk_select_triton(indexer.indexer_scores_triton(*nxt(), L), k, sorted=False,
                                                   fused=False))
    row("  unsorted, 2 launches", f"N={N} L={L} k={k}", t, None, nbytes, bw, "scores + select(fused=False)")
    t = time_ms(lambda: indexer.indexer_topk_triton(*nxt(), k, max_len=L, select="topk"))
    row("  with torch.topk", f"N={N} L={L} k={k} (D's version)", t, None, nbytes, bw)
    t = time_ms(lambda: indexer.indexer_scores_triton(*nxt(), L))
    row("  scores alone", f"N={N} L={L}", t, None, nbytes + N * L * 4, bw)
    scs = [torch.randn(N, L, device=DEV) for _ in range(4)]
    it = iter(range(1 << 30))
    for label, kw in (("  select alone", {}), ("  select unsorted", dict(sorted=False)),
                      ("  select 1 prog/row", dict(chunks=1, sorted=False))):
        t = time_ms(lambda: indexer.topk_select_triton(scs[next(it) % 4], k, **kw))
        row(label, f"N={N} L={L} k={k} (scores in L2)", t, None, N * L * 4, bw,
            f"chunks {kw.get('chunks', indexer.default_chunks(L, k))}")
    real = [indexer.indexer_scores_triton(*nxt(), L) for _ in range(4)]      # the score kernel's own output
    t = time_ms(lambda: indexer.topk_select_triton(real[next(it) % 4], k, sorted=False))
    row("  select, real scores", f"N={N} L={L} k={k} (scores in L2)", t, None, N * L * 4, bw,
        "unsorted, on score-kernel output instead of randn")
    t = time_ms(lambda: scs[next(it) % 4].topk(k, dim=1))
    row("  torch.topk alone", f"N={N} L={L} k={k}", t, None, N * L * 4, bw)
    bench_select_layer(bw, l2)
    bench_candidate_blocks(bw, l2)


def bench_candidate_blocks(bw, l2):
    """V4.1's candidate blocks at the candidate source layer (blocks of 8 entries, the 2,048 best kept) from the
    score kernel's masked rows (-inf past each row's visible prefix, here half to all of the row): kernels/
    index_rows.py's three launches against engine/indexer.py's torch chain (its twin), N=64 at G = 16,392 (2,049
    blocks: the first G the restriction changes; at ratio 1 G is the context's tokens), 65,536 and 131,072; bytes:
    the scores read and the mask written."""
    N = S(64, 2)
    block, top = 8, S(2048, 3)
    for G in S((16392, 65536, 131072), (64,)):
        def make():
            s = torch.randn(N, G, device=DEV)
            pos = torch.randint(G // 2, G, (N,), device=DEV)
            return s.masked_fill(torch.arange(G, device=DEV)[None, :] > pos[:, None], float("-inf"))
        nxt = rotating(make, N * G * 4, l2)
        m = nxt()
        same = bool(torch.equal(index_rows.candidate_blocks_triton(m, block, top),
                                candidate_block_mask(m, None, block, top)))
        for label, fn in (("candidate blocks", lambda m: index_rows.candidate_blocks_triton(m, block, top)),
                          ("  torch chain", lambda m: candidate_block_mask(m, None, block, top))):
            t = time_ms(lambda: fn(nxt()))
            row(label, f"N={N} G={G} block={block} top={top}", t, None, N * G * 5, bw,
                f"the chain's mask: {same}" if label[0] != " " else "the twin (~30 launches)")


def _warm_one(task):
    """Compile one sweep variant at its benchmark shape (a worker process: fills Triton's on-disk cache)."""
    kind, v = task
    t0 = time.time()
    try:
        if kind == "attn":
            H, D, Kw, Kc, pool = attn_shape()
            decode_attention.sparse_attention_triton(*attn_inputs(v[0], H, D, Kw, Kc, pool)(), **v[1])
        elif kind == "select":
            N, Hi, Di, L, k = indexer_shape()
            indexer.topk_select_triton(torch.randn(N, L, device=DEV), k, **SELECT_VARIANTS[v][1])
        elif kind == "attn-dispatch":
            H, D, Kw, Kc, pool = attn_shape()
            decode_attention.sparse_attention(*attn_inputs(v, H, D, Kw, Kc, pool)())
        elif kind == "attn-defaults":          # bench_attention's rows at N = v
            H, D, Kw, Kc, pool = attn_shape()
            x = attn_inputs(v, H, D, Kw, Kc, pool)()
            decode_attention.sparse_attention(*x)
            decode_attention.sparse_attention_triton(*x, **_before_cfg(v))
        elif kind == "select-long":            # a select variant on longer rows
            (rows_, L_), i = v
            indexer.topk_select_triton(torch.randn(rows_, L_, device=DEV), 512 if not DRY else 16,
                                       **LONG_SELECT[i][1])
        elif kind == "indexer-defaults":       # bench_indexer's kernels that no select / fused task builds
            N, Hi, Di, L, k = indexer_shape()
            x = indexer_inputs(N, Hi, Di, L)()
            sc = indexer.indexer_scores_triton(*x, L)
            indexer.topk_select_triton(sc, k, chunks=1, sorted=False)
        torch.cuda.synchronize()
        return f"{kind} {v}: {time.time() - t0:.1f} s"
    except Exception as e:                                   # noqa: BLE001
        return f"{kind} {v}: FAILED {type(e).__name__}: {str(e)[:100]}"


def warm(workers=8):
    """Compile every sweep variant in parallel worker processes before the timed run (a round's budget cannot
    pay ~3 s of compile per variant one after the other)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    tasks = [("attn-dispatch", 64), ("attn-dispatch", 256), ("indexer-defaults", None),
             ("select", 0), ("select", 1), ("select", 3)]                        # what the default rows run
    # the streamed variants last: their compiled test runs beside this, and one that hangs only ends its worker
    tasks += [("select-long", (sh, i)) for sh in S([(8, 131072), (64, 65536)], [(2, 2048)])
              for i in range(len(LONG_SELECT))]
    if os.environ.get("WARM_SWEEP", "1") == "1":
        tasks += [("attn", v) for v in ATTN_VARIANTS] + [("select", i) for i in range(len(SELECT_VARIANTS))
                                                         if i not in (0, 1, 3)]
    if os.environ.get("WARM_ATTN_ROWS") == "1":           # the kernels of bench_attention's rows
        tasks += [("attn-defaults", 64), ("attn-defaults", 256)]
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for msg in ex.map(_warm_one, tasks):
            print("  warm", msg, flush=True)
    print(f"# warm: {len(tasks)} variants in {time.time() - t0:.0f} s", flush=True)


def select_latency(bw):
    """The select (scores in L2) for 1 and 8 rows: its latency, which a one-launch score + select form leaves
    after the last scores (session 7 round 1: 18.8 / 21.4 us against 25.0 for 64 rows)."""
    N, Hi, Di, L, k = indexer_shape()
    for rows in S((1, 8), (1,)):
        sc = torch.randn(rows, L, device=DEV)
        t = time_ms(lambda: indexer.topk_select_triton(sc, k, sorted=False))
        row("  sweep select rows", f"N={rows} L={L} k={k}", t, None, rows * L * 4, bw, "unsorted, latency")
    # one row's two stages apart: the chunk programs alone, then the merge alone on their candidates
    sc = torch.randn(1, L, device=DEV)
    chunks = indexer.default_chunks(L, k)
    ci, cv = indexer._select_launch(sc, k, chunks, False, None, 4)
    t = time_ms(lambda: indexer._select_launch(sc, k, chunks, False, None, 4))
    row("  sweep select rows", f"N=1 L={L} k={k} chunk stage alone", t, None, L * 4, bw, f"{chunks} chunks")
    t = time_ms(lambda: indexer._select_launch(cv, k, 1, False, None, 4, id_map=ci))
    row("  sweep select rows", f"N=1 L={L} k={k} merge alone", t, None, L * 4, bw, f"{chunks * k} candidates")


LONG_SELECT = [("default", dict(sorted=False)), ("two launches", dict(sorted=False, fused=False)),
               ("8 chunks two launches", dict(sorted=False, fused=False, chunks=8)),
               ("32 chunks two launches", dict(sorted=False, fused=False, chunks=32))]
# longer contexts (rows users hit at 64k-128k tokens of compressed entries' worth)
LONG_SHAPES = S([(64, 65536), (8, 65536), (64, 131072), (8, 131072)], [(2, 2048)])


def sweep(bw, l2):
    """The select variants first, then attention: the dispatched kernel twice (the spread between two timings of
    one version) around ATTN_VARIANTS; stops adding attention rows ATTN_SWEEP_S seconds (default 40) after the
    first."""
    N, Hi, Di, L, k = indexer_shape()
    scs = [torch.randn(N, L, device=DEV) for _ in range(4)]
    it = iter(range(1 << 30))
    ref = indexer._select(scs[0], k)
    for label, kw in SELECT_VARIANTS:
        try:
            got = indexer.topk_select_triton(scs[0], k, **kw)
        except Exception as e:                               # noqa: BLE001 - one failing variant must not end the sweep
            emit(f"  sweep select {label}: FAILED {type(e).__name__}: {str(e)[:120]}")
            continue
        same = bool(torch.equal(got[0], ref[0])) if kw["sorted"] else bool(torch.equal(got[0].sort(1).values,
                                                                                      ref[0].sort(1).values))
        t = time_ms(lambda: indexer.topk_select_triton(scs[next(it) % 4], k, **kw))
        row("  sweep select", f"N={N} L={L} k={k} {label} sorted={kw['sorted']}", t, None, N * L * 4, bw,
            f"exact: {same}")
    select_latency(bw)
    # the select's defaults against 2 chunks of 8 warps on the score kernel's own rows, alone and behind the scores
    real = [indexer.indexer_scores_triton(*indexer_inputs(N, Hi, Di, L)(), L) for _ in range(4)]
    for label, kw in (("default (2 chunks w8)", dict(sorted=False)),
                      ("4 chunks w4 (session 8 default)", dict(sorted=False, chunks=4))):
        t = time_ms(lambda: indexer.topk_select_triton(real[next(it) % 4], k, **kw))
        row("  sweep select real", f"N={N} L={L} k={k} {label}", t, None, N * L * 4, bw, "scores in L2")
        nxt = rotating(indexer_inputs(N, Hi, Di, L), N * L * Di * 2, l2)
        t = time_ms(lambda: indexer.topk_select_triton(indexer.indexer_scores_triton(*nxt(), L), k, **kw))
        row("  sweep score+select", f"N={N} L={L} k={k} {label}", t, None, N * L * Di * 2, bw, "two launches")
    # longer rows: scores + select (two launches, the engine's form) against the bytes floor, then the select
    # alone on [8, 131072] and [64, 65536] scores (chunks x k candidates merged)
    for rows_, L_ in LONG_SHAPES:
        nb = rows_ * L_ * Di * 2
        nxt = rotating(indexer_inputs(rows_, Hi, Di, L_), nb, l2)
        t = time_ms(lambda: indexer.topk_select_triton(indexer.indexer_scores_triton(*nxt(), L_), k, sorted=False))
        ts = time_ms(lambda: indexer.indexer_scores_triton(*nxt(), L_))
        row("  sweep score+select long", f"N={rows_} L={L_} k={k}", t, None, nb, bw,
            f"scores + select(sorted=False); scores alone {ts * 1e3:.1f} us; "
            f"bytes floor {nb / (bw * 1e9) * 1e6:.1f} us")
    for rows_, L_ in S([(8, 131072), (64, 65536)], [(2, 2048)]):
        scl = [torch.randn(rows_, L_, device=DEV) for _ in range(2)]
        for label, kw in LONG_SELECT:
            try:
                t = time_ms(lambda: indexer.topk_select_triton(scl[next(it) % 2], k, **kw))
            except Exception as e:                           # noqa: BLE001 - one failing variant must not end the sweep
                emit(f"  sweep select long {label}: FAILED {type(e).__name__}: {str(e)[:120]}")
                continue
            row("  sweep select long", f"N={rows_} L={L_} k={k} {label}", t, None, rows_ * L_ * 4, bw, "scores in L2")
    H, D, Kw, Kc, pool = attn_shape()
    sets = {}
    for N in S((64, 256), (2,)):
        nb = N * (Kw + Kc) * D * 2 + 2 * N * H * D * 2
        sets[N] = (rotating(attn_inputs(N, H, D, Kw, Kc, pool), nb, l2), nb)
    runs = [(N, "default dispatch", {}) for N in sets]
    runs += [(S(v[0], 2), attn_label(v).split(" ", 1)[1], v[1]) for v in ATTN_VARIANTS]
    hot = dict(BEFORE, splits=1)
    runs += [(S(256, 2), "before (S1), keys from L2", dict(hot, hot=True)),
             (S(256, 2), "default (S1), keys from L2", dict(hot=True))]
    runs += [(N, "default dispatch again", {}) for N in sets]
    fn = decode_attention.sparse_attention_triton
    t_end = time.time() + float(os.environ.get("ATTN_SWEEP_S", "40"))
    for N, label, kw in runs:
        if time.time() > t_end:
            emit("  sweep attention: stopped (ATTN_SWEEP_S)")
            break
        nxt, nb = sets[N]
        _, byte_us, flop_us = attn_floors(N, H, D, Kw, Kc, bw)
        s = nxt()
        kw = dict(kw)
        if kw.pop("hot", False):         # every row's keys among 32 pool rows (L2 hits): the time without HBM
            nxt = (lambda x: lambda: x)((s[0], s[1], (s[2] % 32).int(), s[3], s[4], (s[5] % 32).int()))
            s = nxt()
        keys = kw.pop("keys", "all")     # ablations: the 128 window keys only / no keys (the per-program fixed cost)
        if keys != "all":
            nxt = (lambda x: lambda: x)((s[0], s[1], s[2] if keys == "window" else s[2][:, :0], s[3], None, None))
            s = nxt()
        try:
            a, b = fn(*s, **kw).float(), decode_attention.sparse_attention_torch(*s).float()
            t = time_ms(lambda: fn(*nxt(), **kw))
        except Exception as e:                               # noqa: BLE001 - one failing variant must not end the sweep
            emit(f"  sweep attention N={N} {label}: FAILED {type(e).__name__}: {str(e)[:120]}")
            continue
        row("  sweep attention", f"N={N} {label}", t, None, nb, bw,
            attn_note(t, byte_us, flop_us, float((a - b).norm() / b.norm())))


_SELECT_PTRS = dict(idx_ptr="*i64", val_ptr="*fp32", scores_ptr="*fp32", fin_idx_ptr="*i64", fin_val_ptr="*fp32",
                    cnt_ptr="*i32")


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps[, build options]) for kernels.py --compile-check.
    The engine forms build as launched: 2 stages, the row counts and strides the step passes divisible by 16
    (session 15, K2: without them the 16-head form reported 255 registers + 120 B of stack where the launch has 203
    and none)."""
    launched = dict(num_stages=2, hinted=("n_win", "n_cmp", "cmp_stride", "H", "per_split", "turn_stride"))
    attn = dict(D=512, BLOCK_H=64, BLOCK_K=64, HAS_CMP=True, IEEE=False, SPLIT=False, BLOCK_S=2, DC=64, UNCHAIN=True,
                LAZY_SUM=False)
    types = dict(q_ptr="*bf16", out_ptr="*bf16", cnt_ptr="*i32", scr_p_ptr="*bf16")
    return [
        ("attention (N>=192)", decode_attention._sparse_attention_kernel, types, attn, 8),
        ("attention pools S2", decode_attention._sparse_attention_kernel, types,
         dict(attn, SPLIT=True), 8),
        ("attention lazy sum", decode_attention._sparse_attention_kernel, types, dict(attn, LAZY_SUM=True), 8),
        ("attention lazy sum S2", decode_attention._sparse_attention_kernel, types,
         dict(attn, LAZY_SUM=True, SPLIT=True), 8),
        ("attention H<64 PDL", decode_attention._sparse_attention_kernel, types,
         dict(attn, BLOCK_H=16, UNCHAIN=False, PDL=True), 4),
        # the engine's forms: RoPE inside, the window from each row's (first, skip), entry ids (or every visible one)
        *[(f"attention step{' all' if vis else ''} {h}h", decode_attention._sparse_attention_kernel,
           dict(types, scr_q_ptr="*bf16", win_idx_ptr="*i64", cmp_idx_ptr="*i64", cmp_start_ptr="*i64",
                cmp_count_ptr="*i64"),
           dict(attn, BLOCK_H=h, UNCHAIN=h == 64, LAZY_SUM=h == 64, SPLIT=True, OWN=h == 64, PDL=True, ROT=64,
                WINDOW=True, ENTRIES=True, VISIBLE=vis), 8 if h == 64 else 4, launched)
          for h, vis in ((16, False), (64, False), (16, True))],
        *[(f"select {stage}{' sorted' if srt else ''}", indexer._topk_select_kernel,
           dict(_SELECT_PTRS, map_ptr="*i64" if mp else "*fp32"),
           dict(BLOCK=blk, RESIDENT=True, SORTED=srt, KP=512, MAP=mp, FW=0.3, WIDTH=2.0, TOPR=4, FUSE=False,
                MBLOCK=16, MSORTED=False), w)
          for stage, blk, mp, w in (("chunk", 4096, False, 4), ("merge", 2048, True, 8))
          for srt in ((False, True) if mp else (False,))],
        *[(f"select fused {blk}{' tree' if fan else ''}", indexer._topk_select_kernel,
           dict(_SELECT_PTRS, map_ptr="*fp32", grp_idx_ptr="*i64", grp_val_ptr="*fp32"),
           dict(BLOCK=blk, RESIDENT=True, SORTED=False, KP=512, MAP=False, FW=0.3, WIDTH=2.0, TOPR=4, FUSE=True,
                MBLOCK=mb, MSORTED=False, FAN=fan, GBLOCK=2048, PDL=True), w)
          for fan, mb, blk, w in ((0, 1024, 8192, 8), (0, 2048, 4096, 4), (4, 4096, 4096, 4))],
    ]


def ncu_target(N=256, launches=3):
    """A few launches of the dispatched attention kernel at N rows with every key among 32 pool rows (L2 hits),
    for `ncu --launch-skip 1 --launch-count 1`: its stall reasons are the keys-from-L2 chain's."""
    H, D, Kw, Kc, pool = attn_shape()
    q, win, wi, sink, cmp_, ci = attn_inputs(N, H, D, Kw, Kc, pool)()
    for _ in range(launches):
        decode_attention.sparse_attention(q, win, (wi % 32).int(), sink, cmp_, (ci % 32).int())
    torch.cuda.synchronize()


def ncu_select(launches=3):
    """A few one-row selects (scores in L2: the latency case), for `ncu --launch-skip 2 --launch-count 2` (one
    call's chunk stage and merge)."""
    N, Hi, Di, L, k = indexer_shape()
    sc = torch.randn(1, L, device=DEV)
    for _ in range(launches):
        indexer.topk_select_triton(sc, k, sorted=False)
    torch.cuda.synchronize()


if __name__ == "__main__" and "--warm" in sys.argv:
    warm(int(os.environ.get("WARM_WORKERS", "8")))
if __name__ == "__main__" and "--ncu-target" in sys.argv:
    ncu_target()
if __name__ == "__main__" and "--ncu-select" in sys.argv:
    ncu_select()
