"""Sampling-family kernel benchmarks: fused masked sampling (plain, temperature + mask, top-k/top-p) and the
speculative acceptance step. Imported by benchmarks/kernels.py after kbench.configure().

Floors printed in the same run (`floor` rows, before the default rows or the sweep): the graph-replay time of one
and of two empty launches (the shortest a one- or two-launch kernel can take), and a plain read pass over the same
logits with the sampling grid (one program per (row, 4096-token segment), a max per segment): the bandwidth a
single read of the logits reaches at that shape. A sampling row's fraction of that read pass is its fraction of
the achievable.

H200 numbers (torch 2.11 / Triton 3.6; copy 4,250-4,275 GB/s; us, fraction of copy bandwidth):
  floors                        empty launch 0.7, two launches 1.3; one read pass B=64 9.1-9.2 (84-86%),
                                B=256 30.5-31.1 (100-102%)
  session 3 final (R3)          T=1 12.2 / 34.4 (64% / 91%); T=0.7 +mask 16.5 / 45.4 (49% / 71%); greedy
                                11.5 / 33.4 (68% / 93%); top-k50 p0.9 48.6 / 131 (16% / 24%); speculative
                                accept 64 x 4 rows + probs 65.9 (49%)
  session 4 round 1 (speculative step without the expand kernel and the torch ops on its parameters)
    speculative accept          57.3 (58%; 65.9 before)
  session 4 round 2 (2026-11-30), pass program shapes (lanes per program x warps), B=64 / 256:
    T=1                         256x2 12.2 / 35.0, 256x8 12.0 / 36.3, 128x1 12.2 / 35.1, 128x4 12.1 / 35.5
    T=0.7 +mask (words once     256x2 16.8 / 42.8, 256x8 15.5 / 45.3, 128x1 15.5 / 41.2, 128x4 14.7 / 42.9
    per thread and k)
    greedy                      256x2 11.5 / 34.1, 128x4 11.7 / 34.4
    top-k50 p0.9                candidate pass 256x2 (8 steps) 23.4 / 77.3, 256x8 21.5 / 74.5, 256x8 5 steps
                                19.4 / 66.6; merge 11.3 / 15.5 (was 12.3 / 15.7); whole call with the kept set
                                drawn by the finish 47.9 / 122.8, with the pass drawing 52.9 / 133.1
    speculative accept stages   statistics 42.4 + ratio test 4.5 + residual 8.2 + finish 1.8 = 57.0 (256x2);
                                55.8 with 256x8 passes
  session 4 round 3 (final defaults; copy 4,272 GB/s): T=1 12.2 / 35.1 (63% / 88%); T=0.7 +mask 14.6 / 41.4
                                (55% / 77%); greedy 11.5 / 34.2 (67% / 91%); top-k50 p0.9 46.6 / 116.9 (17% / 27%,
                                with 5 bisection steps; back to 8 after it: top-p0.95 peak rows overflowed units,
                                852 / 1274 us); speculative accept: skipped by the budget (round 2: 55.8, 61%)
  B=64 plain rows stay ~2.5 us over the read-pass floor at every shape: the last segments' loads land at the end
  of the read and their arithmetic follows (persistent, one-launch and late-pick variants measured no better).
  (Session 4's kernels never landed: 4 tests failed compiled. Cause, found in session 5: its packed mask-word
  asm copied a thread's first word to its 3 other packed lanes, right only when Triton lays a thread's lanes side
  by side, i.e. when the logits loads vectorise; at V = 9,000 it drew 20 of 64 masked rows wrong, 12 of them
  banned tokens, and none at V = 8,720; session 5's asm loads any lane whose word differs.)
  session 5 round 1 (2026-11-30; copy 4,275 GB/s): floors: empty launch 0.5, two 1.0; read pass 8.9 / 31.1
                                (87% / 99%); lane maxima stored, [256, 16] blocks, 2 warps 9.1 / 34.6 (90% / 95%)
    top-k50 p0.9, lane path     lane-maxima pass 9.6 / 34.2 (81% / 90%); + merge (which draws) 37.5 / 93.2 at 8
                                warps, 31.4 / 81.0 at 16 warps (25% / 38%); pass 128x4 34.8 / 86.4 (8 warps);
                                lcap 64: 37.6 / 89.7, 256: 42.8 / 104.3; with the sampling pass after it 48.0 /
                                101.0; session 4's candidate path 51.3 / 131.5 (its candidate pass 23.0 / 77.4)
    sampling pass shapes        see kernels/sampling.py (PASS_SHAPE): unmasked 256x8 11.3 at B=64, 256x2 35.1 at
                                B=256; masked 128x4 14.6 / 43.3
    speculative accept          stages at 256x8: statistics 41.4 + ratio test 3.9 + residual 7.8 + finish 1.9 =
                                55.1; whole step at 256x2 50.5 (61%; statistics 36.1); one block reduction for
                                the statistics instead of three: 50.2 at 256x2, 57.0 at 256x8 (deleted)
  session 5 round 2 (copy 4,273 GB/s; the merge draws column by column, candidates cut at the lane bound):
    top-k50 p0.9, lane path     lane-maxima pass 128x4 9.8 / 34.7; merge stages (by differences): the fixed part
                                (lane maxima loaded, a lane list, a gather, the stores) 6.7 / 14.9, the lane
                                bound 5.7 / 12.2, tau 6.0 / 11.9, the draw 2.5 / 4.2; whole call 30.5 / 77.8
                                (25% / 40%); merge at 32 warps 34.2 / 85.9, 4 warps 67.2 / 102.8; lcap 64 33.0 /
                                79.6; with the sampling pass after it 34.0 / 89.8. The merge is one program per
                                row of 16 warps: ~20 us of block-wide steps (each a barrier and a shared-memory
                                round trip) in a chain; at B=256 its 256 programs run in two waves (one per SM).
    speculative accept          256x2: statistics 35.9 + ratio test 4.2 + residual 7.2 + finish 1.5 = 48.9 (63%);
                                256x8 53.5, 128x4 52.2
  session 5 round 3 (final defaults; copy 4,275 GB/s), B=64 / 256: T=1 11.3 / 35.1 (68% / 88%); T=0.7 +mask
                                13.4 / 42.6 (59% / 75%); greedy 11.0 / 33.7 (70% / 92%); top-k50 p0.9 30.1 / 82.7
                                (26% / 37%; the B=256 row ran the merge at 8 warps, two programs per SM: 77.8 at
                                16 warps in round 2, the default again); top-k50 +mask 33.8 / 91.0; top-p0.95 peak
                                50.3 / 126.8; top-p0.9 flat (histogram path, bisection fallback) 1,255 at B=64;
                                speculative accept skipped by the budget (round 2: 48.9, 63%)
  session 6 round 1 (2026-11-30; copy 4,250 GB/s; the compiled tests ran beside it: +-1 us noise), B=64 / 256:
    top-p0.9 flat (top-p alone, histogram path with the bracketed cut, was 1,255 at B=64 by the row bisection):
                                166.5 / 497.4 with the lane try (k = 64, fails on flat rows), 126.8 / 412.6 without;
                                stages at B=64 without the lane try: histogram pass 53.9 (tl.histogram's ballots:
                                ~75 instructions per token at 512 bins), select 5.9, gather 34.2, tau 18.9, sampling
                                pass + finish 13.3; tau = the float64 definition on 64/64 and 256/256 rows (an fp32
                                sorted-cumsum twin: 96.9% / 98.8%); 2,000 candidates per row
    top-p0.95 peak              54.6 / 119.7 with the lane try (it succeeds), 120.4 / 397.9 without
    pass shapes B=64            T=1 256x8 11.1, 256x4 11.4, 128x2 10.9, 64x2 11.2; T=0.7 +mask (random 50% masks)
                                128x4 14.5, 256x4 15.3, 128x2 20.8, 64x2 14.4, 64x1 15.3, 128x4 mask-first 15.0;
                                grammar-like masks (2% allowed, runs of 512 tokens) 128x4 14.5, mask-first 11.4
    default rows                T=1 11.2 / 34.4; T=0.7 +mask 13.5 / 41.1; greedy 10.9 / 33.5; top-k50 p0.9 30.9 /
                                77.9; top-k50 +mask 34.3 / 85.4; top-p0.95 peak 55.1 / 120.9; top-p0.9 flat 162.1
  session 6 round 2 (copy 4,274 GB/s; the compiled tests from 28 s in), top-p alone, B=64 flat rows, whole tau
  call (histogram path alone): defaults 113.6; HIST_WARPS 4 116.1, 16 131.6; GATHER_SHAPE (512, 8) 109.6,
                                (256, 8) 103.0 (the new default), (1024, 8) 111.1, (256, 4) 113.1; SELECT_WARPS 4
                                113.7, 16 114.9; TAU_WARPS 4 130.8, 16 113.9. Stages: histogram 55.0, select 8.3,
                                gather 30.3, tau 18.9. Whole sampling call 126.6 (no lane try) / 159.1 (lane try);
                                B=256 412.2 / 497.1; peaked rows 60.8 / 120.3 (B=64), 120.9 / 395.5 (B=256)
    pass shapes B=64            (see kernels/sampling.py beside SMALL_SHAPE)
    compiled tests              71 / 71 passed (8 processes, 43-57 s each)
  session 7 round 1: lost (a bool local turned a constexpr branch of lane_block into a run-time one, so compiled
  kernels without a mask failed to build; the interpreter and --compile-check's signatures did not show it:
  .round/data/K1/gpu_compile.py now builds every launch's real signature on the CPU)
  session 7 round 2 (copy 4,248 GB/s; the compiled tests from 40 s in), top-p alone by rejection
  (kernels/rejection.py), whole call, us at B=64 / 256 (every row below still paid ~15 us of torch ops building the
  parameters' threshold view on the device, removed after this round):
    top-p0.9 flat               np=4 55.4 / 151.9 (pass with 4 proposals 29.2 / 63.4, mass-above pass + fused
                                finish 26.3 / 88.5); every lane read 52.5 / 141.8; finish apart 53.9 / 135.8; np=2
                                120.6, np=6 67.4 (B=64); tau first (session 6) 150.3 / 458.3
    top-p0.95 peak              np=4 53.8 / 142.3; every lane read 52.3 / 136.6; finish apart 52.0 / 128.0; np=2
                                63.6, np=6 65.3; tau first 56.0 / 121.2
    speculative accept          residual finish folded into the residual pass 49.1 / 49.2 against 49.3 / 49.6
  session 7 round 3 (final defaults; the compiled tests ran beside it from 30 s on), B=64 / 256: T=1 11.0 / 33.6
                                (71% / 93%); T=0.7 +mask 13.5 / 41.6; greedy 10.7 / 33.1; top-k50 p0.9 30.2 / 77.0;
                                top-k50 +mask 33.5 / 85.3; top-p0.95 peak 33.9 (was 57.0); top-p0.9 flat 33.0 (was
                                150.1); B=256 top-p rows and the speculative step cut by the round's budget. Sweep at
                                B=64 (each twice): one-launch pass 13.2 / 13.2 against 11.7 / 11.8; adaptive mask
                                mode 17.1 / 17.1 against 14.5 / 14.5 on random masks, 13.6 / 13.6 against 14.5 / 14.4
                                on grammar-like masks; top-k group bound 52.1 / 50.7 against 49.6 / 45.7: all off.
  session 8 round 1 (2026-11-30; copy 4,250 GB/s; the compiled tests beside it: +-1 us), B=64 / 256:
    top-k50, whole lane-path call  flat p0.9: group bound (16-lane groups) 30.0 / 75.0 against the histogram
                                rounds alone 31.0 / 78.7; peaked: 31.8 / 77.0 against 30.4 / 75.8 (102
                                candidates against 55: leaders in consecutive ids share groups). Stages at B=64 /
                                256 (group bound): lane maxima 10.1 / 34.2, merge fixed part (lane maxima loaded,
                                lane list, gather) 6.4 / 14.6, bound 3.2 / 7.9 (was 5.7 / 12.2 with the rounds),
                                tau 5.9 / 11.8, draw 3.5 / 6.8; merge at 8 warps 31.6 / 75.2
    top-p alone (rejection)     the pass with 4 proposals 11.0 / 35.2 with the in-lane picks deferred to the
                                winning lanes (1 proposal: 9.6 / 31.9) against 14.9 / 52.3 with every lane's picks;
                                the mass-above pass 16.6 / 46.3 (instruction-bound: an exp and 4 compare-adds per
                                token) and 19.4 / 72.8 when each of its programs drew the tokens itself (230
                                registers): the tokens are now drawn once per row (`_tokens_kernel`)
  session 8 round 2 (copy 4,249 GB/s; the compiled tests beside it), B=64 / 256:
    top-k50, whole call         group size 0 (rounds only) / 8 / 16 / 32: flat p0.9 30.5 / 28.9 / 29.3 / 28.2,
                                peaked 29.1 / 30.9 / 31.1 / 31.4 (B=64); B=256 flat 78.5 / - / 74.3, peaked 74.4 /
                                - / 75.9
    top-p alone (rejection)     tokens drawn once per row; the mass-above pass gathering only the lanes above the
                                smallest proposal (HOT_LANES, the pass storing lane maxima and program masses):
                                peaked p0.95 24.3 / 61.8 against 29.6 / 81.0 reading every lane (stages: pass 12.7
                                / 37.6, tokens + mass above 9.3 / 21.8, finish 2.3 / 2.4); flat p0.9 31.2 / 84.7
                                against 29.7 / 81.5 (~80 of a segment's 256 lanes lie above the smallest proposal
                                on these rows: the whole segment is read, and the lane maxima cost ~1.5 / 3 us)
    default rows                T=1 11.0 / 34.4; T=0.7 +mask 13.4 / 41.0; greedy 10.6 / 33.4; top-k50 p0.9 28.9 /
                                75.0; top-k50 +mask 34.6 / 83.8; top-p0.95 peak 25.8 / 63.1; top-p0.9 flat 32.8 /
                                85.4 (session 7: 33.0 / 136)
  session 9 round 1 (2026-11-30; copy 4,252 GB/s; the compiled tests beside it), top-k merge redesign tried: the
  candidates read column by column, one lane per thread (counted in-thread, placed by one scan, all pairs one
  candidate per thread), B=64 flat / peaked: 34.4 / 38.0 at 16 warps, 34.8 / 41.3 at 8, 51.0 / 58.4 at 4, against
  the [LCAP, 16] block's 29.9 / 31.8 (B=256: 88.0 / 90.3 against 75.3 / 76.7); stages at 4 warps: fixed 6.5,
  bound 4.1, tau 20.0 (the extra column sweep, and 192 B of spills), draw 3.9. Deleted.
  session 9 round 2 (copy 4,249 GB/s; the compiled tests beside it: 88 / 88 passed), B=64:
    programmatic dependent launch (off -> on, twice each; backend.PDL, now on): T=1 11.0 / 11.8 -> 10.7 / 10.7;
                                T=0.7 +mask 13.4 / 14.5 -> 13.2 / 14.4; top-k50 p0.9 28.7 / 28.0 -> 27.5 / 27.5;
                                top-p0.95 peak 24.6 / 26.0 -> 23.7 / 24.6; B=256 T=1 34.5 -> 33.5, top-k 74.5 ->
                                74.6; speculative step 48.7 / 49.9 -> 49.4 / 49.8 (its own kernels keep plain
                                launches; its lane path uses PDL); with top-k50
                                p0.9 151.0 / 151.0 (the lane path's two launches and a second read of every row)
    merge all-pairs block       JB 32 / 64 / 128: flat 29.4 / 32.3 / 32.3, peaked 35.3 / 32.2 / 32.5; B=256 flat
                                74.5 / 75.7 / 82.2, peaked 75.2 / 78.8 / 80.3 (32 kept)
    what a mask costs           T=1 11.0, T=0.7 11.0 (the temperature is free), T=1 at the masked shape (64 lanes x
                                2 warps: one lane per thread, 4-byte loads) 11.9, T=0.7 + a mask of all ones 14.6,
                                random 50% masks 13.6 (128x4 14.5, 128x2 17.1, 256x2 17.9, 32x1 15.4), grammar-like
                                masks 14.4 dense, 12.0 MASK_FIRST; T=1 again at the end 11.7. B=256: T=1 34.6,
                                T=0.7 + mask 41.1. So the mask costs ~2.6 us at B=64 beyond the lane-per-thread
                                shape's 0.9: the SASS of the masked pass has ~23 instructions per token against
                                ~17 unmasked (a word load, its address and the bit test per token), at B=64 the
                                pass issues ~6M warp instructions (~6.5 us of issue at 4 per SM per cycle) beside
                                the ~8 us read: instruction-bound, not bytes (the mask is 3% of them).
  session 9 round 3 (final defaults, PDL on; copy 4,273 GB/s; compiled tests 88 / 88 beside it), B=64 / 256: T=1
                                10.7 / 34.0 (72% / 91%); T=0.7 +mask 13.2 / 41.1 (60% / 78%); greedy 10.3 / 33.3
                                (75% / 93%); top-k50 p0.9 27.4 / 74.0 (28% / 42%); top-k50 +mask 31.0 / 80.7;
                                top-p0.95 peak 23.8 / 63.2; top-p0.9 flat 31.0 / 86.3; speculative accept 51.9
                                (64%), with top-k50 p0.9 152.7. PDL off / on at B=64 (twice): T=1 11.8 / 11.1 (both
                                pairs), +mask 14.4-14.5 / 14.3-14.4, top-k 28.5 / 27.2, top-p peak 25.9 & 24.4 / 23.6
  session 10 round 1 (2026-11-30), top-k50 p0.9, B=64, the lane path alone (sample_from_logits' two launches),
  twice each, against HEAD in the same run: flat rows 28.4 / 28.3 -> 21.1 / 21.6 us (28% -> 37% of copy
  bandwidth), peaked rows 30.3 / 30.3 -> 21.0 / 20.9 (the merge holds its lane groups in-thread, strided, and its
  rare branches' loops are no longer unrolled: kernels/threshold.py beside GROUP_BOUND); candidates per row
  (peaked) 102 -> 55. ncu of the new merge alone (B=64, flat): 16.9 us, 2.57M warp instructions (~2.5K per warp; one
  program of 16 warps per SM), stall samples: instruction fetch 20%, long scoreboard 13%, short scoreboard 11%,
  wait 11%, barrier 10%, issue (selected / not selected) 19%; the draw's unrolled sweeps held 22% of the
  samples, 72% of those instruction fetch (every SM runs the code once, cold).
  session 10 round 2 (copy 4,248 GB/s), same rows, twice each, us, flat; peaked: HEAD 27.3 / 27.2; 30.1 / 30.3,
  the merge with the draw's sweeps unrolled (kept) 21.4 / 21.3; 20.6 / 20.6 (36-38%), as loops 22.3 / 22.7; 21.5 /
  21.5, 8 merge warps (loops) 21.9 / 21.9; 20.5 / 20.5, parameters loaded after the PDL wait (loops) 22.9 / 22.9;
  21.6 / 21.6, all-pairs blocks of 128 columns 24.5 / 24.4; 23.2 / 23.2; B=256 flat (loops) 62.7 / 63.0 against
  HEAD 74.0 / 73.9 (50% / 42%). Speculative accept, 64 requests x 4 rows + draft probabilities, top-k50 p0.9:
  152.2 / 152.4 -> 101.9 / 102.0 (the top-k merge writes its rows' statistics; the statistics pass skips them).
  Floor of the histogram path: its histogram pass is instruction-bound (1,832 SASS instructions per thread, x 8
  warps x 2,048 programs at B=64 = 30M warp instructions: 32 us at 4 per SM per cycle, 55 us measured), so top-p
  alone on flat rows cannot approach one read (8.7 us) this way; a sampling rule that needs no tau (proposals from
  the full softmax, each kept iff the mass above it is < p * s: two passes) is the way to ~30 us.
  session 11 round 1 (2026-11-30; copy 4,249 GB/s), top-p alone by rejection, stages by differences (--sweep,
  K1_SWEEP=reject), B=64 / 256: flat p0.9: the pass with 4 proposals 12.8 / 38.1 (1 proposal 10.9 / 35.8),
                                + tokens and mass above 16.0 / 45.3, + finish 22.3 / 2.5 (at B=64 a row of that
                                input most likely missed all four proposals: the finish's loops over the row);
                                peaked p0.95: 12.8 / 38.1, + 8.8 / 23.3, + 2.1 / 2.3. ncu of one call (B=64 flat):
                                pass 14.1 us (7.05M warp instructions, issue active 59%, long scoreboard 3.9 per
                                issue), tokens 5.3 us (one warp a row, ~1,260 dependent instructions: latency),
                                mass above 16.9 us (31.6 MB read, 96 registers: 20 warps an SM, long scoreboard
                                3.9), finish 4.9 us
  session 11 rounds 2-4 (HEAD in the same run, twice each; kernels/rejection.py and kernels/threshold.py hold the
  variants' numbers), B=64: top-p0.95 peaked 23.9 -> 21.8-21.9 us (33% -> 36%), top-p0.9 flat 31.1 -> 30.5-30.8
  (the mass-above pass skips segments below every proposal; the pass packs its proposals in one reduction). Lane
  bounds deciding rows before the mass-above pass, the lanes' mass stored for a one-sweep in-lane draw, and the top-k
  merge's tau stage without layout conversions lost and were deleted. The speculative step's new row (top-p0.95
  alone on peaked rows: the merge skips those rows' draw) was cut by the rounds' budgets (tokens = twin 100%).
  session 12 round 1 (2026-11-30; copy 4,254 GB/s; session 11's final code, PDL on; tokens = twin 100% on every
  row), B=64 / 256: T=1 10.8 / 34.4 (72% / 90%); greedy 10.6 / 33.5 (73% / 93%); T=0.7 +mask 14.3 / 40.8-40.9
                                (56% / 79%); top-k50 p0.9 21.6 / 61.0-61.2 (36% / 51%); top-p0.95 peak 21.7 /
                                56.8-56.9 (36% / 55%); top-p0.9 flat 30.7-30.8 / 87.5-87.6 (25% / 36%). The
                                top-p chain's kernels (torch.profiler, PDL off, B=64, us): peaked: pass 11.9,
                                mass above 4.9, tokens 3.1, finish 2.3; flat: mass above 13.6 (33 MB: 2.4 TB/s,
                                instruction- and occupancy-bound), pass 12.3, tokens 3.3, finish 2.4.
  session 12 rounds 2-3 (HEAD in the same run, twice each, B=64; compiled tests beside them): the sampling pass and
  the lane-maxima pass PDL-launched themselves (R2): T=1 11.1 / 11.1 -> 10.6 / 11.0 (73% / 71%), top-k50 p0.9
                                21.2 / 21.2 -> 21.0 / 21.1 (37%); everything PDL off 11.8 / 11.9 and 22.4 / 22.1.
                                Kept (not before the rejection chain, not measured apart there). The top-p
                                variants (the mass-above pass in reverse segment order, several segments per
                                program, HOTCAP 128) lost and were deleted: kernels/rejection.py has their numbers.
  session 13 rounds 1-3 (2026-12-01; copy 4,228-4,247 GB/s; HEAD in the same run, twice each; the R2 / R3 compiled
  tests beside them), top-p alone by rejection (.round scripts timing sample_triton with TOP_P_ONLY, as this file's
  rows do): the mass-above pass's weights as one FFMA + exp2 per token, the row's (m, zmin, z of the proposals)
  handed over by the tokens kernel, the sampling pass PDL-launched in front of the chain (kernels/rejection.py):
    R3, B=64 / 256          top-p0.9 flat 30.5 / 86.3 -> 26.4-26.5 / 80.4-80.5 (26% -> 29% / 36% -> 39%); top-p0.95
                            peak 20.9 / 55.8-55.9 -> 19.6 / 54.8 (37% -> 40% / 56% -> 57%); tokens = twin 100%
    rows past 4 proposals   (the finish's loops over a row) flat rows at B=64: p 0.7 47.6 (R3) / 71.2 (R2), p 0.5
                            821 (R2: rows reach the bisection), against 26.4 at p 0.9; the pass with all 8 proposals
                            does not build (Triton 3.6 asserts on the finish at NP = 8)
    T=0.7 +mask (R2)        B=64 13.1-13.2 (61-62%; 56% in session 12's R1), B=256 42.0-42.2 (76-77%); the mask row
                            read after the block's loads (deleted: kernels/sampling.py beside SMALL_SHAPE) 13.1-13.2
                            and 40.2-41.9
  session 14 rounds 1-3 (2026-12-01; copy 4,224-4,250 GB/s; HEAD in the same run; .round scripts timing sample_triton
  with sample_from_logits' host flags, every row top-p alone, each input set timed apart: a set with a row missing the
  proposals the mass-above pass tests costs more), B=64 flat rows unless said, us:
    R2 (final form: 8 proposals in the pass when some row has p < 0.85, rows missing the first 4 finished from the
    lane maxima, kernels/rejection.py `_open_row_token`)
                            p 0.9 24.8 (HEAD 24.5; 31% / 32%); p 0.5 38.6 / 52.3 / 56.8 (1 / 5 / 6 such rows;
                            20% / 15% / 14%; HEAD ~821, session 13); p 0.7 29.4 (none) / 52.3 (one; HEAD 267.4 on
                            that set); p 0.8 52.0 (one); peaked p 0.95 19.0 (HEAD 18.3), p 0.5 31.5; B=256 p 0.9
                            83.8 (HEAD 80.2 in R1). Tokens = twin on every row of every set.
    R1 (first form, NMAX 4: every such row through tau and the restricted draw; replaced)
                            p 0.5 48.5-48.7 and 71.7, p 0.7 / 0.8 with one such row 82.8 / 87.8, B=256 p 0.5 134.6;
                            tau on the 8,192 block always (OPEN_SMALL 0) 62.3 against 48.7
  session 15 R2 (2026-12-01; copy 4,222 GB/s; .round scripts timing sample_triton with sample_from_logits' host
  flags on 4 input sets rotated, HEAD's launch options in the same run, twice each; the compiled tests beside it),
  B=256, us: more rows than SMs take launch options that fit two programs an SM (one wave instead of two):
    top-p alone (finish)    4 warps (rejection.FINISH_WAVE) flat p0.9 80.4 / 80.4 (39%), peaked p0.95 55.4 / 55.5
                            (57%); 16 warps capped at 64 registers 82.1 / 82.0, 57.7 / 57.6; HEAD's 16 warps 83.5 /
                            83.4 (38%), 57.9 / 57.9 (54%)
    top-k50 p0.9 (merge)    capped at 64 registers (threshold.MERGE_WAVE) flat 56.5 / 56.5 (55%) against 60.4 / 60.7
                            (52%)
  session 15 R3, the speculative step's top-p-alone bonus (sweep part spec_bonus's inputs: 64 requests x 4 rows,
  peaked, every draft accepted), us: p 0.5 233.4 / 233.5 (8 proposals in the statistics pass and its last draw; 3 /
  2 bonus rows missing the first four) against HEAD's 634.6 / 500.2 (loops over those rows); p 0.9 172.0 / 177.0
  session 16 R1-R3 (2026-12-01; copy 4,205-4,250 GB/s; .round scripts timing sample_triton, 4 input sets rotated,
  HEAD's kernels in the same run, variants alternating over three passes; tokens = twin on every row), us:
    R2, the pass in sub-blocks (kernels/sampling.py beside PASS_SHAPE; 256 lanes a program, x1 / x2 lanes side by
    side): T=0.7 + random 50% masks B=64 256x2x1 14.00 / 13.97 / 13.93 against HEAD 13.39 / 14.55 / 14.42 (the first
                            pass ran in a faster state of the card: 58% -> 58-59% of copy bandwidth in the later
                            passes' terms, 14.5 -> 13.95); B=256 38.66 / 38.75 / 38.63 against 41.12 / 41.08 / 41.07
                            (79% -> 84%); the engine's mask form (every 4th row unmasked) B=64 12.68 / 12.71 / 12.70
                            against 13.12 / 13.10 / 13.10 (61% -> 64%); T=1 B=256 256x2x2 33.98 / 34.06 / 33.78
                            against 34.48 / 34.42 / 34.48 (91% -> 93%); T=1 B=64 (unchanged shape) 11.08 / 11.00 /
                            11.06 against 11.14 / 11.06 / 11.17
    R1, words unpredicated     T=0.7 + mask B=256 (128x4) 39.50 / 39.65 against 40.36 / 40.74; the engine's form
    + ln S_g by lg2.approx     B=64 12.89 / 12.91 against 13.04 / 13.00; T=1 B=64 10.82 / 10.86 against 10.98 /
                            10.93
"""
import os

import torch
import triton
import triton.language as tl

from deepinfer_sg.kernels import backend as kernel_backend, sampling, speculative, threshold
from kbench import DEV, DRY, V, W, emit, rand_bitmask, rotating, row, S, time_ms


# what the host tells sample_triton when every row is a top-k row (sample_from_logits' host_flags): the merge
# draws every token, no sampling pass, no top-p-alone rows (so no device-side parameter view either)
LANE_ONLY = dict(filters=True, histogram=False, lane_only=True, reject=False)
TOP_P_ONLY = dict(filters=False, histogram=False, lane_rows=False, reject=True)      # every row top-p alone


def flat_logits(B):
    """Flat rows (normal, scale 3): thousands of tokens near the top, the hard case for top-k bounds."""
    return torch.randn(B, V, device=DEV) * 3


def peaked_logits(B):
    """LLM-like rows: a few dozen plausible tokens far above a long normal tail (top-p lands among them)."""
    x = torch.randn(B, V, device=DEV) * 1.5
    x[:, :40] += 14 + 3 * torch.rand(B, 40, device=DEV)
    return x


def bench_sampling(bw, l2, batches):
    """The default path's rows (each checked against the twin), after the floors (empty launches, one read pass)
    unless the sweep printed them already."""
    if not SWEPT:
        floors(bw, l2, batches)
    for B in batches:
        cases = [("sample T=1", dict(temperature=1.0, top_k=0, top_p=1.0), False, flat_logits),
                 ("sample T=0.7 +mask", dict(temperature=0.7, top_k=0, top_p=1.0), True, flat_logits),
                 ("sample greedy", dict(temperature=0.0, top_k=0, top_p=1.0), False, flat_logits),
                 ("sample top-k50 p0.9", dict(temperature=1.0, top_k=50, top_p=0.9), False, flat_logits),
                 ("sample top-k50 +mask", dict(temperature=0.7, top_k=50, top_p=1.0), True, flat_logits),
                 ("sample top-p0.95 peak", dict(temperature=1.0, top_k=0, top_p=0.95), False, peaked_logits),
                 # top-p alone on flat rows: ~2,000 candidates in the bracketed bins (the bisection until session 5)
                 ("sample top-p0.9 flat", dict(temperature=1.0, top_k=0, top_p=0.9), False, flat_logits),
                 # most rows miss every proposal of some call: the finish's draw from the lane maxima
                 ("sample top-p0.5 flat", dict(temperature=1.0, top_k=0, top_p=0.5), False, flat_logits)]
        for name, kw, masked, gen_rows in cases:
            p = sampling.row_params(B, DEV, seed=torch.arange(B, device=DEV),
                                    position=torch.arange(B, device=DEV) + 7, **kw)
            nxt = rotating(lambda: (gen_rows(B), rand_bitmask(B) if masked else None), B * V * 4, l2)
            x, m = nxt()
            flt = kw["top_k"] > 0 or kw["top_p"] < 1
            # what the host knows, as sample_from_logits knows it (which launches a row needs)
            flags = sampling.host_flags(sampling.row_params(B, "cpu", **kw, seed=0, position=0), V)
            a = sampling.sample_triton(x, p, m, **flags)
            b = sampling.sample_torch(x, p, m)
            note = f"tokens equal to twin: {float((a == b).float().mean()):.1%}"
            if flt:
                mr = torch.arange(B, device=DEV) if m is not None else None
                tau, path = threshold.thresholds_and_paths(x, p, m, mr)
                z = sampling.masked_z_torch(x, p.inv_temperature, m, mr)
                tau_ok = float((tau == sampling.thresholds_torch(z, p)).float().mean())
                fast = path > 0
                cands = float(path[fast].float().mean()) if bool(fast.any()) else 0.0
                note += f"; tau = f64 twin {tau_ok:.0%}; fast path {int(fast.sum())}/{B} rows, {cands:.0f} candidates"
            t = time_ms(lambda: sampling.sample_triton(*(lambda s: (s[0], p, s[1]))(nxt()), **flags))
            tt = time_ms(lambda: sampling.sample_torch(*(lambda s: (s[0], p, s[1]))(nxt())), graph=False)
            row(name, f"B={B} V={V}", t, tt, B * V * 4 + (B * W * 4 if masked else 0), bw, note)


def spec_inputs(l2, L=4, gen_rows=None):
    """B requests x L rows (target logits: normal with scale 2, or gen_rows(R); draft probabilities near them,
    drafts sampled from those), rotated past the L2: (B, L, R, cu_rows, next())."""
    B = S(64, 3)
    R = B * L

    def make():
        logits = gen_rows(R) if gen_rows else torch.randn(R, V, device=DEV) * 2
        probs = torch.softmax(logits + 0.3 * torch.randn_like(logits), 1)
        return logits, probs, torch.multinomial(probs, 1)[:, 0]
    return B, L, R, torch.arange(B + 1, device=DEV) * L, rotating(make, 2 * R * V * 4, l2)


def bench_speculative(bw, l2):
    """The speculative step (64 requests x 4 rows, draft probabilities): unfiltered, top-k50 p0.9, and top-p0.95
    alone on peaked rows (the top-k merge's lane try decides their tau; their bonus follows kernels/rejection.py)."""
    for label, top_k, top_p, gen_rows in (("probs", 0, 1.0, None), ("probs top-k50 p0.9", 50, 0.9, None),
                                          ("probs top-p0.95 peak", 0, 0.95, peaked_logits)):
        B, L, R, cu, nxt = spec_inputs(l2, gen_rows=gen_rows)
        x, pr, d = nxt()
        # per-request tensors already on the device: nothing is copied from the host inside a CUDA-graph capture
        # what the caller knows on the host (the engine does): whether any request filters, and how
        flags = dict(filters=top_k > 0 or top_p < 1, histogram=top_p < 1 and not 0 < top_k <= threshold.KMAX)
        kw = dict(temperature=torch.ones(B, device=DEV), top_k=torch.full((B,), top_k, dtype=torch.int64, device=DEV),
                  top_p=torch.full((B,), top_p, device=DEV), seed=torch.arange(B, device=DEV),
                  position=torch.arange(B, device=DEV))
        a = speculative.speculative_accept(x, cu, d, pr, backend="triton", **kw, **flags)
        b = speculative.speculative_accept(x, cu, d, pr, backend="torch", **kw)
        agree = float((a.tokens == b.tokens).float().mean())
        acc = float(a.num_accepted.float().mean())

        def run(backend):
            s = nxt()
            return speculative.speculative_accept(s[0], cu, s[2], s[1], backend=backend, **kw,
                                                  **(flags if backend == "triton" else {}))
        t = time_ms(lambda: run("triton"))
        tt = time_ms(lambda: run("torch"), graph=False)
        # floor: every logits row once + the draft probabilities of the rows that need a residual (one per
        # rejecting request; the benchmark's drafts reject often) -- the ratio test reads p only at the draft
        resid = float((a.num_accepted < L - 1).float().mean())
        nbytes = R * V * 4 + int(resid * B) * V * 4
        old_floor = (R * V * 4 + B * V * 4) / (t * 1e-3) / 1e9 / bw        # the previous table's floor
        row("speculative accept", f"B={B} rows={R} V={V} {label}", t, tt, nbytes, bw,
            f"mean accepted {acc:.2f}; residual rows {resid:.0%}; equal to twin {agree:.1%}; "
            f"{old_floor:.0%} of the old floor (p of every final row)")


# ---------------------------------------------------------------------------------------------- floors
@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _read_max_kernel(x_ptr, out_ptr, V, n_seg, SEG: tl.constexpr):
    """Program (row, segment): max of the segment (the least work a pass over the logits can do)."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    cols = seg * SEG + tl.arange(0, SEG)
    x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
    tl.store(out_ptr + row * n_seg + seg, tl.max(x, 0))


@triton.jit
def _read_lanes_kernel(x_ptr, out_ptr, V, n_seg, LANES: tl.constexpr, LW: tl.constexpr, VEC: tl.constexpr):
    """Program (row, segment): the segment as the sampling pass holds it ([LANES, LW], a lane's LW tokens in one
    thread) and every lane's max stored (no block reduction): the least a lane-structured pass can do."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    lane = tl.arange(0, LANES)
    pos = lane[:, None] + tl.arange(0, LW)[None, :] * LANES
    pos = tl.max_contiguous(tl.multiple_of(pos, [VEC, 1]), [VEC, 1])
    x = tl.load(x_ptr + row * V + seg * (LANES * LW) + pos, mask=pos < V - seg * (LANES * LW), other=float("-inf"))
    tl.store(out_ptr + (row * n_seg + seg) * LANES + lane, tl.max(x, 1))


def floors(bw, l2, batches):
    dummy = torch.empty(16, device=DEV)
    t1 = time_ms(lambda: _empty_kernel[(1,)](dummy))
    t2 = time_ms(lambda: (_empty_kernel[(1,)](dummy), _empty_kernel[(1,)](dummy)))
    emit(f"floor: empty launch (graph replay) {t1 * 1e3:.1f} us; two launches {t2 * 1e3:.1f} us")
    for B in batches:
        nxt = rotating(lambda: flat_logits(B), B * V * 4, l2)
        n_seg = triton.cdiv(V, 4096)
        out = torch.empty(B, n_seg, device=DEV)
        t = time_ms(lambda: _read_max_kernel[(B, n_seg)](nxt(), out, V, n_seg, SEG=4096, num_warps=4))
        row("  floor read pass", f"B={B} seg=4096 w=4", t, None, B * V * 4, bw)
        lanes_out = torch.empty(B, n_seg, 256, device=DEV)
        for warps in (2, 8):
            t = time_ms(lambda: _read_lanes_kernel[(B, n_seg)](nxt(), lanes_out, V, n_seg, LANES=256, LW=16,
                                                              VEC=8 // warps, num_warps=warps))
            row("  floor lane maxima", f"B={B} 256x{warps} stored", t, None, B * V * 4 + lanes_out.numel() * 4, bw)


# ---------------------------------------------------------------------------------------------- sweep
SWEPT = []        # the sweep ran in this process (its floors stand for the default rows' too)


def sweep(bw, l2):
    """The floors, then the top-k lane path's stages and variants, then the speculative step's stages and pass
    shapes. (The sampling pass's program shapes were swept in session 5's round 1: kernels/sampling.py keeps
    those numbers beside PASS_SHAPE; the sweep that timed them is gone with the shapes it rejected.)"""
    batches = S([64, 256], [3])
    floors(bw, l2, batches)
    SWEPT.append(True)
    parts = dict(pdl=sweep_pdl, threshold=sweep_threshold, reject=sweep_reject, top_p_p=sweep_top_p_p,
                 spec_one=sweep_spec_one, spec_bonus=sweep_spec_bonus,
                 plain=sweep_plain, top_p_tune=sweep_top_p_tune, top_p=sweep_top_p, shapes=sweep_shapes,
                 spec=sweep_speculative)
    chosen = os.environ.get("K1_SWEEP")                    # a comma list of the parts to run (default: all)
    for name, part in parts.items():
        if chosen and name not in chosen.split(","):
            continue
        try:                                   # one failing part must not hide the others' rows
            part(bw, l2)
        except Exception as e:                 # noqa: BLE001
            emit(f"  sweep part FAILED {type(e).__name__}: {str(e)[:600]}")


def sweep_pdl(bw, l2, batches=None):
    """Programmatic dependent launch (backend.PDL: the per-row kernel after a pass is scheduled while the pass's
    last programs run, and waits on the pass's completion inside): T=1 and T=0.7 + mask (pass + finish), top-k50
    p0.9 (lane maxima + merge) and top-p0.95 peaked rows (the rejection chain) at B=64, off / on twice each (B=256:
    T=1 and top-k once each); with PDL on, whether a CUDA graph captures the launches (time_ms falls back to plain
    launches when not)."""
    for B in batches or S([64, 256], [3]):
        for label, kw, masked, flags in (("T=1", dict(temperature=1.0, top_k=0, top_p=1.0), False,
                                          dict(filters=False, reject=False)),
                                         ("T=0.7 +mask", dict(temperature=0.7, top_k=0, top_p=1.0), True,
                                          dict(filters=False, reject=False)),
                                         ("top-k50 p0.9", dict(temperature=1.0, top_k=50, top_p=0.9), False,
                                          LANE_ONLY),
                                         ("top-p0.95 peak", dict(temperature=1.0, top_k=0, top_p=0.95), False,
                                          TOP_P_ONLY)):
            p = sampling.row_params(B, DEV, seed=torch.arange(B, device=DEV), position=0, **kw)
            gen_rows = peaked_logits if "peak" in label else flat_logits
            nxt = rotating(lambda: (gen_rows(B), rand_bitmask(B) if masked else None), B * V * 4, l2)
            x, m = nxt()
            want = sampling.sample_torch(x, p, m)
            if B > S(64, 3) and label in ("T=0.7 +mask", "top-p0.95 peak"):
                continue                                         # B=256: two cases, once each
            for on in (False, True, False, True)[:4 if B == S(64, 3) else 2]:
                with kernel_backend.pdl_as(on):
                    same = float((sampling.sample_triton(x, p, m, **flags) == want).float().mean())
                    note = f"tokens = twin {same:.1%}"
                    if on and not DRY:
                        try:
                            g = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(g):
                                sampling.sample_triton(x, p, m, **flags)
                            g.replay()
                            torch.cuda.synchronize()
                            note += "; graph capture ok"
                        except Exception as e:                       # noqa: BLE001
                            note += f"; graph capture FAILED {type(e).__name__}: {str(e)[:120]}"
                            torch.cuda.synchronize()
                    t = time_ms(lambda: (lambda s: sampling.sample_triton(s[0], p, s[1], **flags))(nxt()))
                    row("  sweep pdl", f"B={B} {label} pdl={int(on)}", t, None,
                        B * V * 4 + (B * W * 4 if masked else 0), bw, note)


def sweep_plain(bw, l2):
    """Plain rows at B=64, to see what a grammar mask costs (T=0.7 + random 50% masks sits at 59% of the copy
    bandwidth against 66-71% for T=1): T=1 and T=0.7 without a mask at the unmasked default shape and at the
    masked one (`MASKED_SMALL_SHAPE`: one lane per thread, 4-byte loads, in sub-blocks), a mask of all ones (every word loaded,
    every token kept), random masks at several program shapes (lanes x warps: 2 or 4 lanes per thread take the
    packed word loads), grammar-like masks (2% allowed in runs of 512) dense and MASK_FIRST; T=1 is timed at the
    start and at the end (run-to-run spread); B=256: T=1 and T=0.7 + mask."""
    B = S(64, 3)
    ones = lambda rows: torch.full((rows, W), -1, dtype=torch.int32, device=DEV)    # noqa: E731
    cases = [("T=1", 1.0, None, None, False), ("T=0.7", 0.7, None, None, False),
             ("T=1 one lane/thread", 1.0, None, sampling.MASKED_SMALL_SHAPE, False),
             ("T=0.7 mask of ones", 0.7, ones, None, False),
             ("T=0.7 +mask", 0.7, lambda rows: rand_bitmask(rows), None, False)]
    cases += [(f"T=0.7 +mask {sh[0]}x{sh[1]}", 0.7, lambda rows: rand_bitmask(rows), sh, False)
              for sh in ((128, 4), (128, 2), (256, 2), (32, 1))]
    grammar = lambda rows: rand_bitmask(rows, density=0.02, span=512)                  # noqa: E731
    cases += [("T=0.7 grammar mask", 0.7, grammar, None, False), ("T=0.7 grammar mask first", 0.7, grammar, None, True),
              ("T=1 again", 1.0, None, None, False)]
    cases = [(B, *c) for c in cases] + [(S(256, 3), "T=1", 1.0, None, None, False),
                                        (S(256, 3), "T=0.7 +mask", 0.7, lambda rows: rand_bitmask(rows), None, False)]
    for B, label, temp, make_mask, shape, mf in cases:
        p = sampling.row_params(B, DEV, temp, 0, 1.0, seed=torch.arange(B, device=DEV), position=0)
        nxt = rotating(lambda: (flat_logits(B), make_mask(B) if make_mask else None), B * V * 4, l2)
        x, m = nxt()
        want = sampling.sample_torch(x, p, m)
        run = lambda s: sampling.sample_triton(s[0], p, s[1], filters=False, reject=False,  # noqa: E731
                                               mask_first=mf, shape=shape)
        same = float((run((x, m)) == want).float().mean())
        t = time_ms(lambda: run(nxt()))
        row("  sweep plain", f"B={B} {label}", t, None, B * V * 4 + (B * W * 4 if make_mask else 0), bw,
            f"tokens = twin {same:.1%}")


def top_p_cases(l2):
    """(B, label, params, next(), first logits) of the top-p-alone sweeps: B=64 and 256, flat rows with p 0.9 and
    peaked rows with p 0.95, inputs rotated past the L2."""
    for B in S([64, 256], [3]):
        for label, gen_rows, top_p in (("top-p0.9 flat", flat_logits, 0.9), ("top-p0.95 peak", peaked_logits, 0.95)):
            p = sampling.row_params(B, DEV, 1.0, 0, top_p, seed=torch.arange(B, device=DEV), position=0)
            nxt = rotating(lambda: gen_rows(B), B * V * 4, l2)
            yield B, label, p, nxt, nxt()


def sweep_spec_one(bw, l2):
    """The speculative step (64 requests x 4 rows, draft probabilities, no filters) with the residual finish as
    its own launch or folded into the residual pass (ONE_LAUNCH_RESIDUAL), each twice."""
    B, L, R, cu, nxt = spec_inputs(l2)
    kw = dict(temperature=torch.ones(B, device=DEV), top_k=torch.zeros(B, dtype=torch.int64, device=DEV),
              top_p=torch.ones(B, device=DEV), seed=torch.arange(B, device=DEV), position=torch.arange(B, device=DEV))
    x, pr, d = nxt()
    want = speculative.speculative_accept(x, cu, d, pr, backend="torch", **kw).tokens
    for one in (False, True, False, True):
        speculative.ONE_LAUNCH_RESIDUAL = one
        same = float((speculative.speculative_accept(x, cu, d, pr, backend="triton", filters=False, **kw).tokens
                      == want).float().mean())
        t = time_ms(lambda: (lambda s: speculative.speculative_accept(s[0], cu, s[2], s[1], backend="triton",
                                                                      filters=False, **kw))(nxt()))
        row("  sweep spec", f"B={B}x{L} residual finish {'folded' if one else 'apart'}", t, None, R * V * 4, bw,
            f"equal to twin {same:.1%}")
    speculative.ONE_LAUNCH_RESIDUAL = False


def sweep_spec_bonus(bw, l2):
    """The speculative step's top-p-alone bonus (64 requests x 4 rows, peaked rows, drafts drawn from q itself with
    draft probabilities q: every draft is accepted, so every request draws its bonus) at p 0.5 and 0.9, with the
    statistics pass's proposal count the host would choose (sampling.proposal_count), two input sets each; how many
    bonus rows miss the first 4 proposals (HEAD drew proposals 4 .. 7 and the last draw for them by loops over
    the row)."""
    B, L = S(64, 3), 3
    R = B * (L + 1)
    for top_p in (0.5, 0.9):
        np_ = sampling.proposal_count(sampling.row_params(B, "cpu", 1.0, 0, top_p, 0, 0), V)
        for seed in (1, 2):
            x = peaked_logits(R)
            q = sampling.processed_probs(x, 1.0, 0, top_p)
            d = torch.multinomial(q, 1)[:, 0]
            cu = torch.arange(B + 1, device=DEV) * (L + 1)
            kw = dict(temperature=torch.ones(B, device=DEV), top_k=torch.zeros(B, dtype=torch.int64, device=DEV),
                      top_p=torch.full((B,), top_p, device=DEV), seed=torch.arange(B, device=DEV) * 7 + seed,
                      position=torch.arange(B, device=DEV) * 9)
            last = cu[1:] - 1
            miss = int(sampling.open_rows_torch(x[last], sampling.row_params(B, DEV, 1.0, 0, top_p, kw["seed"],
                                                                           kw["position"] + L), n=4).sum())
            run = lambda: speculative._accept_triton(x, cu, d, q, *kw.values(), None, None, filters=True,  # noqa
                                                     histogram=True, proposals=np_)
            res = run()
            want = speculative.speculative_accept(x, cu, d, q, backend="torch", **kw).final_tokens
            t = time_ms(run)
            row("  sweep spec bonus", f"B={B}x{L + 1} peak p{top_p} np={np_} set {seed}", t, None, R * V * 4, bw,
                f"accepted {float(res.num_accepted.float().mean()):.2f}; bonus rows missing 4 proposals {miss}; "
                f"final = twin {float((res.final_tokens == want).float().mean()):.0%}")


def sweep_top_p_p(bw, l2):
    """Top-p alone at p 0.5 / 0.7 / 0.8 / 0.9 / 0.95 on flat and peaked rows, B=64 and 256: the whole call on four
    input sets each (a set decides whether some row misses the four proposals the mass-above pass tests: then the
    finish draws it from the lane maxima, kernels/rejection.py `_open_row_token`), each set timed (median of graph
    replays), with how many of its rows were open (the twin's count) and whether its tokens are the twin's."""
    from deepinfer_sg.kernels import rejection
    for B in S([64, 256], [3]):
        for kind, gen_rows in (("flat", flat_logits), ("peak", peaked_logits)):
            for top_p in (0.5, 0.7, 0.8, 0.9, 0.95):
                times, opened, same = [], 0, 1.0
                # what the host knows, as sample_from_logits knows it (the proposal count at this p included)
                flags = sampling.host_flags(sampling.row_params(B, "cpu", 1.0, 0, top_p, seed=0, position=0), V)
                for i in range(S(4, 1)):
                    x = gen_rows(B)
                    p = sampling.row_params(B, DEV, 1.0, 0, top_p, seed=torch.arange(B, device=DEV) + 1000 * i,
                                            position=7)
                    same = min(same, float((sampling.sample_triton(x, p, **flags) ==
                                            sampling.sample_torch(x, p)).float().mean()))
                    opened += int(sampling.open_rows_torch(x, p, n=rejection.ABOVE_NP).sum())   # missed the tested four
                    times.append(time_ms(lambda: sampling.sample_triton(x, p, **flags)))
                t = sum(times) / len(times)
                row("  sweep top-p p", f"B={B} {kind} p{top_p} ({len(times)} sets)", t, None, B * V * 4, bw,
                    f"sets {' / '.join(f'{u * 1e3:.1f}' for u in times)} us; open rows {opened}; "
                    f"tokens = twin {same:.1%}")


def sweep_reject(bw, l2):
    """Top-p alone by rejection (kernels/rejection.py) at B=64 and 256, flat rows p 0.9 and peaked rows p 0.95:
    tokens against the twin, the whole call at several proposal counts, its stages by differences (the pass with
    the proposals, + the proposals' tokens and the mass-above pass, + the finish), the mass-above pass reading
    every lane (HOT_LANES off); K1_REJECT_KNOBS=1 adds the mass-above pass at 4 warps and session 6's tau-first
    path."""
    from deepinfer_sg.kernels import rejection
    for B, label, p, nxt, x in top_p_cases(l2):
        want = sampling.sample_torch(x, p)
        flags = TOP_P_ONLY
        for np_ in (1, 4):
            same = float((sampling.sample_triton(x, p, proposals=np_, **flags) == want).float().mean())
            prev = 0.0
            for stages in ((0, 1, 2) if np_ == 4 else (0,)):
                rejection.STAGES = stages
                t = time_ms(lambda: sampling.sample_triton(nxt(), p, proposals=np_, **flags))
                rejection.STAGES = 2
                row("  sweep reject", f"B={B} {label} np={np_} st{stages}", t, None, B * V * 4, bw,
                    f"stage {(t - prev) * 1e3:.1f} us; tokens = twin {same:.1%}")
                prev = t
        rejection.HOT_LANES = False
        same = float((sampling.sample_triton(x, p, **flags) == want).float().mean())
        t = time_ms(lambda: sampling.sample_triton(nxt(), p, **flags))
        rejection.HOT_LANES = True
        row("  sweep reject", f"B={B} {label} np=4 every lane read", t, None, B * V * 4, bw,
            f"tokens = twin {same:.1%}")
        if not os.environ.get("K1_REJECT_KNOBS"):
            continue
        keep = rejection.ABOVE_WARPS
        rejection.ABOVE_WARPS = 4
        t = time_ms(lambda: sampling.sample_triton(nxt(), p, **flags))
        rejection.ABOVE_WARPS = keep
        row("  sweep reject", f"B={B} {label} np=4 mass-above pass 4 warps", t, None, B * V * 4, bw)
        sampling.P_REJECT = False
        try:
            t = time_ms(lambda: sampling.sample_triton(nxt(), p, filters=True, histogram=True, reject=False))
        finally:
            sampling.P_REJECT = True
        row("  sweep reject", f"B={B} {label} tau first (session 6)", t, None, B * V * 4, bw)


def sweep_speculative(bw, l2):
    """The speculative step's launches timed cumulatively (stages: statistics pass, + ratio test, + residual pass,
    + finish; no request filters), and the whole step at other program shapes of its passes."""
    B, L, R, cu, nxt = spec_inputs(l2)
    temp, top_p = torch.ones(B, device=DEV), torch.ones(B, device=DEV)
    top_k = torch.zeros(B, dtype=torch.int64, device=DEV)
    seed, pos = torch.arange(B, device=DEV), torch.arange(B, device=DEV)
    x, pr, d = nxt()
    want = speculative.speculative_accept(x, cu, d, pr, temp, top_k, top_p, seed, pos, backend="torch").tokens
    prev = 0.0
    for stages, label in ((6, "stats"), (7, "+accept"), (8, "+residual"), (9, "+finish")):
        def run():
            s = nxt()
            return speculative._accept_triton(s[0], cu, s[2], s[1], temp, top_k, top_p, seed, pos, None, None,
                                              stages=stages, filters=False)
        t = time_ms(run)
        row("  sweep spec", f"B={B}x{L} {label}", t, None, R * V * 4, bw, f"stage {(t - prev) * 1e3:.1f} us")
        prev = t
    for shape in ((256, 8), (128, 4)):
        got = speculative._accept_triton(x, cu, d, pr, temp, top_k, top_p, seed, pos, None, None, filters=False,
                                         shape=shape).tokens
        same = float((got == want).float().mean())
        t = time_ms(lambda: (lambda s: speculative._accept_triton(s[0], cu, s[2], s[1], temp, top_k, top_p, seed, pos,
                                                                  None, None, filters=False, shape=shape))(nxt()))
        row("  sweep spec", f"B={B}x{L} lanes={shape[0]} w={shape[1]}", t, None, R * V * 4, bw,
            f"equal to twin {same:.1%}")


def tau_fp32_sort(z, top_p):
    """Top-p alone by one sort and an fp32 cumulative sum (session 5's twin): to show how often fp32 rounding alone
    moves a flat row's margin against the float64 definition (sampling.thresholds_torch)."""
    zs = z.sort(1, descending=True).values
    e = torch.exp(zs - zs[:, :1])
    above = torch.cumsum(e, 1) - e
    first = torch.searchsorted(-zs, -zs, side="left")
    keep = torch.gather(above, 1, first) < top_p[:, None] * e.sum(1, keepdim=True)
    return torch.where(keep, zs, torch.full_like(zs, float("inf"))).min(1).values


def sweep_top_p(bw, l2):
    """Top-p alone (p 0.9 flat rows, p 0.95 peaked rows) at B=64 and 256: the histogram path's stages timed
    cumulatively (2: the lane path's try with k = 64, 3: + histogram pass, 4: + select, 5: + gather, 6: + tau),
    the whole sampling call with and without the lane path's try (P_ONLY_LANES), and tau against the float64
    definition: the kernel's bracketed cut, its row-wide bisection (forced: cmax 16), an fp32 sort twin."""
    for B, label, p, nxt, x in top_p_cases(l2):
        want = sampling.thresholds_torch(x, p)
        tau, path = threshold.thresholds_and_paths(x, p, None, None, histogram=True)
        fast = path > 0
        note = (f"tau = f64 definition {float((tau == want).float().mean()):.1%}; fast {int(fast.sum())}/{B}, "
                f"{float(path[fast].float().mean()) if bool(fast.any()) else 0:.0f} candidates")
        if label.endswith("flat"):
            fb = threshold.thresholds_and_paths(x, p, None, None, histogram=True, cmax=16)[0]
            f32 = tau_fp32_sort(x, p.top_p)
            note += (f"; bisection fallback = f64 {float((fb == want).float().mean()):.1%}; "
                     f"fp32 sort twin = f64 {float((f32 == want).float().mean()):.1%}")
        emit(f"  sweep top-p B={B} {label}: {note}")
        for p_lanes in (True, False):
            prev = 0.0
            stage_list = (2, 3, 4, 5, 6) if B == S(64, 3) and label.endswith("flat") and not p_lanes else ()
            for stages in stage_list:
                t = time_ms(lambda: threshold.thresholds_and_paths(nxt(), p, None, None, histogram=True,
                                                                    stages=stages, p_lanes=p_lanes,
                                                                    lane_rows=None if p_lanes else False))
                row("  sweep top-p", f"B={B} {label[4:]} lanes={int(p_lanes)} st{stages}", t, None, B * V * 4,
                    bw, f"stage {(t - prev) * 1e3:.1f} us")
                prev = t
            keep = threshold.P_ONLY_LANES
            threshold.P_ONLY_LANES = p_lanes
            lr = None if p_lanes else False          # no lane-path row: its launches skipped
            same = float((sampling.sample_triton(x, p, filters=True, histogram=True, lane_rows=lr) ==
                          sampling.sample_torch(x, p)).float().mean())
            t = time_ms(lambda: sampling.sample_triton(nxt(), p, filters=True, histogram=True, lane_rows=lr))
            threshold.P_ONLY_LANES = keep
            row("  sweep top-p sample", f"B={B} {label} lanes={int(p_lanes)}", t, None, B * V * 4, bw,
                f"tokens = twin {same:.1%}")


def sweep_top_p_tune(bw, l2):
    """Top-p alone on flat rows (B=64, histogram path alone): the four launches' program shapes, one knob at a
    time from the defaults (threshold.HIST_WARPS, GATHER_SHAPE, TAU_WARPS), each timed as the whole tau call."""
    B = S(64, 3)
    p = sampling.row_params(B, DEV, 1.0, 0, 0.9, seed=torch.arange(B, device=DEV), position=0)
    nxt = rotating(lambda: flat_logits(B), B * V * 4, l2)
    x = nxt()
    want = sampling.thresholds_torch(x, p)
    knobs = [("HIST_WARPS", (4, 16)), ("GATHER_SHAPE", ((512, 8), (256, 8), (1024, 8), (256, 4))),
             ("SELECT_WARPS", (4, 16)), ("TAU_WARPS", (4, 16))]
    run = lambda: threshold.thresholds_and_paths(nxt(), p, None, None, histogram=True, p_lanes=False,  # noqa
                                                 lane_rows=False)
    t = time_ms(run)
    row("  sweep top-p tune", f"B={B} p0.9 flat defaults", t, None, B * V * 4, bw)
    for name, values in knobs:
        keep = getattr(threshold, name)
        for v in values:
            setattr(threshold, name, v)
            tau = threshold.thresholds_and_paths(x, p, None, None, histogram=True, p_lanes=False, lane_rows=False)[0]
            t = time_ms(run)
            row("  sweep top-p tune", f"B={B} p0.9 flat {name}={v}", t, None, B * V * 4, bw,
                f"tau = f64 {float((tau == want).float().mean()):.0%}")
        setattr(threshold, name, keep)


def sweep_shapes(bw, l2):
    """The sampling pass's program shapes (lanes per program x warps) at B=64, where T=1 and masked rows miss the
    70% line: the defaults (SMALL_SHAPE, MASKED_SMALL_SHAPE) against session 5's, each twice, and MASK_FIRST."""
    B = S(64, 3)
    for masked, temp, shapes in ((False, 1.0, (sampling.SMALL_SHAPE, (256, 8), sampling.SMALL_SHAPE, (256, 8))),
                                 (True, 0.7, (sampling.MASKED_SMALL_SHAPE, (128, 4), sampling.MASKED_SMALL_SHAPE,
                                              (128, 4)))):
        p = sampling.row_params(B, DEV, temp, 0, 1.0, seed=torch.arange(B, device=DEV), position=0)
        nxt = rotating(lambda: (flat_logits(B), rand_bitmask(B) if masked else None), B * V * 4, l2)
        x, m = nxt()
        want = sampling.sample_torch(x, p, m)
        variants = [(shape, False) for shape in shapes] + ([(sampling.MASKED_SMALL_SHAPE, True)] if masked else [])
        for shape, first in variants:
            run = lambda s: sampling.sample_triton(s[0], p, s[1], filters=False, shape=shape, mask_first=first)  # noqa
            same = float((run((x, m)) == want).float().mean())
            t = time_ms(lambda: run(nxt()))
            row("  sweep pass shape", f"B={B} {'T=0.7 +mask' if masked else 'T=1'} {'x'.join(map(str, shape))}"
                f"{' mask first' if first else ''}", t, None, B * V * 4 + (B * W * 4 if masked else 0), bw,
                f"tokens = twin {same:.1%}")
    # grammar-like masks: 2% of the vocabulary allowed, in runs of 512 tokens (whole sectors banned)
    p = sampling.row_params(B, DEV, 0.7, 0, 1.0, seed=torch.arange(B, device=DEV), position=0)
    nxt = rotating(lambda: (flat_logits(B), rand_bitmask(B, density=0.02, span=512)), B * V * 4, l2)
    x, m = nxt()
    want = sampling.sample_torch(x, p, m)
    for first in (False, True):
        run = lambda s: sampling.sample_triton(s[0], p, s[1], filters=False, mask_first=first)  # noqa: E731
        same = float((run((x, m)) == want).float().mean())
        t = time_ms(lambda: run(nxt()))
        row("  sweep pass shape", f"B={B} sparse mask 2%{' mask first' if first else ''}", t, None,
            B * V * 4 + B * W * 4, bw, f"tokens = twin {same:.1%} (floor: every logit read)")


def sweep_threshold(bw, l2):
    """Top-k sampling (top-k50 p0.9, flat rows) at B=64 and 256 on the lane path: the lane-maxima pass alone, then
    the merge's stages timed by differences (1: the lane maxima read only, 2: + the lane bound, 3: + the candidates'
    gather and tau, 4: + the
    draw = the whole two-launch call), and the sampling call when the host cannot promise every row is a lane-path
    row (the pass then runs and skips them)."""
    for B in S([64, 256], [3]):
        k, top_p = 50, 0.9
        p = sampling.row_params(B, DEV, 1.0, k, top_p, seed=torch.arange(B, device=DEV), position=0)
        nxt = rotating(lambda: flat_logits(B), B * V * 4, l2)
        label = f"top-k{k} p{top_p}"
        layout = (sampling.SEG, sampling.LANES)
        prev = time_ms(lambda: threshold.thresholds_and_paths(nxt(), p, None, None, stages=1, histogram=False,
                                                              draw=layout))
        row("  sweep threshold", f"B={B} {label} lane max", prev, None, B * V * 4, bw)
        tau, path, tok = (torch.empty(B, device=DEV), torch.empty(B, dtype=torch.int32, device=DEV),
                          torch.empty(B, dtype=torch.int64, device=DEV))
        for upto in (1, 2, 3, 4):
            t = time_ms(lambda: threshold.lane_path(nxt(), p, None, None, tau, path, tok, *layout, upto=upto))
            row("  sweep threshold", f"B={B} {label} merge upto {upto}", t, None, B * V * 4, bw,
                f"stage {(t - prev) * 1e3:.1f} us")
            prev = t
        t = time_ms(lambda: sampling.sample_triton(nxt(), p, filters=True, histogram=False, reject=False))
        row("  sweep top-k sample", f"B={B} {label} lane + pass", t, None, B * V * 4, bw)


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps) for kernels.py --compile-check."""
    seg_types = {"greedy_ptr": "*i1", "out_ptr": "*i64", "count_ptr": "*i32"}
    # constexprs (an unlisted one would build as a run-time int)
    seg_flags = dict(DONE=False, MASK_FIRST=False, NP=1, REJECT=False)
    from deepinfer_sg.kernels import rejection
    rej_types = {"packed_ptr": "*i64", "part_ptr": "*fp64", "out_ptr": "*i64", "done_ptr": "*i64", "keys_ptr": "*i64"}
    merge_types = {"path_ptr": "*i32", "tok_ptr": "*i64", "lane_ptr": "*i32", "greedy_ptr": "*i8", "pack_ptr": "*i64",
                   "solved_ptr": "*i8"}
    merge_flags = dict(NG=8192, LCAP=128, KMAX=64, KP=128, JB=32, HB=64, ROUNDS=3, BLOCK=1024, DRAW=True, LANES=256,
                       LW=16, FAST=True, GROUPS=True, GS=16)
    return [
        ("sample segment w8", sampling._segment_kernel, seg_types, dict(HAS_MASK=False, HAS_TAU=False, LANES=256,
                                                                        LW=16, PL=256, VEC=1, FAST=True, **seg_flags),
         8),
        ("topk lane max pass", threshold._lane_max_kernel, {"greedy_ptr": "*i8"},
         dict(HAS_MASK=True, LANES=256, LW=16, PL=128, VEC=1, KMAX=64, FAST=True), 4),
        ("topk lane merge", threshold._lane_merge_kernel, merge_types, dict(merge_flags, HAS_MASK=True), 16),
        ("topk lane max pdl", threshold._lane_max_kernel, {"greedy_ptr": "*i8"},
         dict(HAS_MASK=False, LANES=256, LW=16, PL=128, VEC=1, KMAX=64, FAST=True, PDL=True), 4),
        ("topk lane merge pdl", threshold._lane_merge_kernel, merge_types,
         dict(merge_flags, HAS_MASK=False, PDL=True), 16),
        ("topk merge spec stats", threshold._lane_merge_kernel, merge_types,
         dict(merge_flags, HAS_MASK=False, PDL=True, STATS=True, NP=4), 16),
        ("sample segment pdl", sampling._segment_kernel, seg_types,
         dict(HAS_MASK=False, HAS_TAU=False, LANES=256, LW=16, PL=128, VEC=2, FAST=True, PDL=True, **seg_flags), 2),
        ("sample finish", sampling._finish_kernel, {"done_ptr": "*i64", "NEG_INF_KEY": "i64"},
         dict(BLOCK=32, DONE=True), 1),
        ("sample finish pdl", sampling._finish_kernel, {"done_ptr": "*i64", "NEG_INF_KEY": "i64"},
         dict(BLOCK=32, DONE=False, PDL=True), 1),
        ("threshold hist", threshold._hist_kernel, {}, dict(HAS_MASK=True, CHUNK=4096, NB=512, INV_W=32.0,
                                                            BIN_LIMIT=1 << 24), 8),
        ("threshold select", threshold._select_kernel, {}, dict(NCP=32, NB=512, INV_W=32.0, BIN_LIMIT=1 << 24,
                                                                CMAX=4096), 8),
        ("threshold gather", threshold._gather_kernel, {"outside_ptr": "*fp64"},
         dict(HAS_MASK=True, LANES=512, LW=8, INV_W=32.0, BIN_LIMIT=1 << 24, CMAX=4096, VEC=4, FAST=True), 4),
        ("threshold tau", threshold._tau_kernel, {"outside_ptr": "*fp64"},
         dict(HAS_MASK=True, BLOCK=1024, CMAX=4096, SMALL=256, NCP=32, KP=128, HB=512), 8),
        ("sample segment pass", sampling._segment_kernel, seg_types, dict(HAS_MASK=False, HAS_TAU=False, LANES=256,
                                                                          LW=16, PL=256, VEC=4, FAST=True,
                                                                          **seg_flags), 2),
        ("sample segment +mask", sampling._segment_kernel, seg_types, dict(HAS_MASK=True, HAS_TAU=True, LANES=256,
                                                                           LW=16, PL=128, VEC=1, FAST=True,
                                                                           **seg_flags), 4),
        ("sample segment +mask 1st", sampling._segment_kernel, seg_types,
         dict(HAS_MASK=True, HAS_TAU=True, LANES=256, LW=16, PL=128, VEC=1, FAST=True, DONE=False, MASK_FIRST=True,
              NP=1, REJECT=False), 4),
        ("sample segment +mask v4", sampling._segment_kernel, seg_types, dict(HAS_MASK=True, HAS_TAU=True,
                                                                              LANES=256, LW=16, PL=256, VEC=4,
                                                                              FAST=True, **seg_flags), 2),
        ("sample segment +mask sub4", sampling._segment_kernel, seg_types,
         dict(HAS_MASK=True, HAS_TAU=False, LANES=256, LW=16, PL=256, VEC=1, FAST=True, SUBS=4, PDL=True,
              **seg_flags), 2),
        ("sample segment sub2 v2", sampling._segment_kernel, seg_types,
         dict(HAS_MASK=False, HAS_TAU=False, LANES=256, LW=16, PL=256, VEC=2, FAST=True, SUBS=2, PDL=True,
              **seg_flags), 2),
        ("sample segment np4", sampling._segment_kernel, seg_types,
         dict(HAS_MASK=False, HAS_TAU=False, LANES=256, LW=16, PL=128, VEC=2, FAST=True, DONE=False, MASK_FIRST=False,
              NP=4, REJECT=True, HOT=True, NPR=4), 2),
        ("sample segment np8", sampling._segment_kernel, seg_types,
         dict(HAS_MASK=False, HAS_TAU=False, LANES=256, LW=16, PL=128, VEC=2, FAST=True, DONE=False, MASK_FIRST=False,
              NP=8, REJECT=True, HOT=True, NPR=8, PDL=True), 2),
        ("reject tokens", rejection._tokens_kernel, dict(rej_types, tok_ptr="*i64", dec_ptr="*i64", zrow_ptr="*fp32"),
         dict(DONE=True, HAS_MASK=True, HAS_TAU=True, NP=4, NPP=64, NPQ=8, LANES=256, LW=16, FAST=True), 1),
        ("reject tokens np8", rejection._tokens_kernel, dict(rej_types, tok_ptr="*i64", dec_ptr="*i64",
                                                             zrow_ptr="*fp32"),
         dict(DONE=False, HAS_MASK=False, HAS_TAU=False, NP=8, NPP=64, NPQ=16, LANES=256, LW=16, FAST=True, NA=4,
              PDL=True), 1),
        ("reject mass above", rejection._above_kernel, dict(rej_types, zrow_ptr="*fp32", lane_ptr="*fp32",
                                                            hot_ptr="*i32"),
         dict(HAS_MASK=True, NP=4, LANES=256, LW=16, VEC=4, FAST=True, NPQ=8, HOT=True, HOTCAP=32, PER=2), 2),
        ("reject mass above np8", rejection._above_kernel, dict(rej_types, zrow_ptr="*fp32", lane_ptr="*fp32",
                                                                hot_ptr="*i32"),
         dict(HAS_MASK=False, NP=4, LANES=256, LW=16, VEC=4, FAST=True, NPQ=16, HOT=True, HOTCAP=32, PER=2, NAQ=8,
              PDL=True), 2),
        ("reject finish", rejection._reject_finish_kernel, dict(rej_types, tok_ptr="*i64", dec_ptr="*i64",
                                                                pmass_ptr="*fp32", list_ptr="*i32"),
         dict(HAS_MASK=True, NP=8, NPP=64, NPQ=16, NSP=32, NMAX=8, LANES=256, LW=16, BLOCK=1024, FAST=True, HOT=True,
              NG=8192, LC=512, CMAX=8192, KP=128, HB=512, SMALL=1024, NA=4), 16),
        ("reject finish np4", rejection._reject_finish_kernel, dict(rej_types, tok_ptr="*i64", dec_ptr="*i64",
                                                                    pmass_ptr="*fp32", list_ptr="*i32"),
         dict(HAS_MASK=False, NP=4, NPP=64, NPQ=8, NSP=32, NMAX=8, LANES=256, LW=16, BLOCK=1024, FAST=True, HOT=True,
              NG=8192, LC=512, CMAX=8192, KP=128, HB=512, SMALL=1024, NA=4, PDL=True), 16),
        ("reject finish cold", rejection._reject_finish_kernel, dict(rej_types, tok_ptr="*i64", dec_ptr="*i64",
                                                                     pmass_ptr="*fp32", list_ptr="*i32"),
         dict(HAS_MASK=False, NP=4, NPP=64, NPQ=8, NSP=32, NMAX=8, LANES=256, LW=16, BLOCK=1024, FAST=True,
              PDL=True), 16),
        ("spec stats pass", speculative._stats_kernel, {"pack_ptr": "*i64"},
         dict(HAS_MASK=True, HAS_TAU=False, LANES=256, LW=16, PL=256, VEC=4, NB=64, FAST=True, NP=1), 2),
        ("spec stats pass np4", speculative._stats_kernel, {"pack_ptr": "*i64", "solved_ptr": "*i8",
                                                            "fin_ptr": "*i64"},
         dict(HAS_MASK=True, HAS_TAU=True, LANES=256, LW=16, PL=256, VEC=4, NB=64, FAST=True, NP=4), 2),
        ("spec stats pass np8", speculative._stats_kernel, {"pack_ptr": "*i64", "solved_ptr": "*i8",
                                                            "fin_ptr": "*i64"},
         dict(HAS_MASK=False, HAS_TAU=True, LANES=256, LW=16, PL=256, VEC=4, NB=64, FAST=True, NP=8), 2),
        ("spec accept", speculative._accept_kernel, {"final_ptr": "*i64", "pack_ptr": "*i64"},
         dict(HAS_MASK=True, HAS_PROBS=True, HAS_TAU=False, NCP=32, NR=8, NP=1, NMAX=8, LANES=256, LW=16,
              BLOCK=1024, FAST=True), 1),
        ("spec accept np4", speculative._accept_kernel, {"final_ptr": "*i64", "pack_ptr": "*i64", "fin_ptr": "*i64"},
         dict(HAS_MASK=True, HAS_PROBS=True, HAS_TAU=True, NCP=32, NR=8, NP=4, NMAX=8, LANES=256, LW=16,
              BLOCK=1024, FAST=True), 1),
        ("spec accept np8", speculative._accept_kernel, {"final_ptr": "*i64", "pack_ptr": "*i64", "fin_ptr": "*i64"},
         dict(HAS_MASK=False, HAS_PROBS=True, HAS_TAU=True, NCP=32, NR=8, NP=8, NMAX=8, LANES=256, LW=16,
              BLOCK=1024, FAST=True), 1),
        ("spec residual pass", speculative._residual_kernel, {}, dict(HAS_MASK=True, HAS_PROBS=True, HAS_TAU=False,
                                                                      LANES=256, LW=16, PL=256, VEC=4, FAST=True,
                                                                      ONE=False), 2),
        ("spec residual one launch", speculative._residual_kernel, {"res_ptr": "*i64", "cnt_ptr": "*i32",
                                                                    "final_ptr": "*i64", "tokens_ptr": "*i64"},
         dict(HAS_MASK=True, HAS_PROBS=True, HAS_TAU=False, LANES=256, LW=16, PL=256, VEC=4, FAST=True, ONE=True), 2),
    ]
