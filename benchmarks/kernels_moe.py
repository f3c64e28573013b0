"""MoE and hyper-connection kernel benchmarks: grouped routed-expert matmuls at decode batch sizes and the fused
mHC mixes + Sinkhorn. Imported by benchmarks/kernels.py after kbench.configure().

Shapes: the toy MoE shape of the first session (H=2048 F=1024 E=64 K=6) and V4.1-Flash's real one (H=5120
F=2304 E=384 K=6, architecture doc; experts are FP4 in the checkpoint and dequantized to bf16 by the loader,
so bf16 weights are what the engine streams today). mHC: M=4 streams of H=5120 (fn [24, 20480] fp32),
20 Sinkhorn iterations. MoE floor: every touched expert's w1/w3/w2 once + x and out; mHC floor: the residual
once + fn once (fp32). The "launch floor" rows time an empty kernel (one / two launches) in a CUDA graph:
below that no kernel can go, so the mHC rows also print the fraction of max(launch floor, bytes / bandwidth).

Before (NVIDIA H200, first session): moe T=64 / 256 (toy) 282 / 344 us (67% / 56%); hc mixes T=64 / 256 / 4096
27 / 40 / 152 us (4-26%).
Round 1 (H200, 2026-11-29; copy 4274 GB/s; an empty kernel in a CUDA graph 0.7 us):
  moe experts toy T=64 / 256        202 / 243 us   93% / 78%   (torch pair alignment 70 us -> Triton 2.2 us;
                                                                 T=256 block_m 16 / 32 / 64: 257 / 226 / 242 us)
  moe experts V4.1 T=64 / 256       3.83 / 6.23 ms 103% / 101% (pure reads beat the read+write copy rate)
  moe fp8 weights V4.1 T=64 / 256   3.21 / 4.84 ms 64% / 65% of the fp8 bytes (bf16 widening: only 1.2-1.3x)
  hc mixes (one launch) T=64/256/4096  31 / 40 / 188 us; two launches 28 / 36 / 177 us (latency-bound loops)
  hc post + next pre T=64 / 256     4.3 / 11.0 us (twin 55 / 168 us)
Round 2 (H200; the defaults since: TMA loads, block_m = mean pairs rounded up, two-launch mHC):
  moe experts toy T=64 / 256        200 / 226 us   94% / 84%   (twin 13.8 / 15.0 ms)
  moe experts V4.1 T=64 / 256       3.84 / 6.23 ms 103% / 100%
  moe fp8 weights (fp16 widening)   toy T=64 120 us (79%); V4.1 T=64 / 256 2.11 / 3.44 ms (93% / 91%), 1.8x bf16
  hc mixes T=64 / 256 / 4096        14.7 / 24.1 / 175 us (partial pass alone 9.1 us at T=64; one launch 20 us)
                                    floors: an empty launch 0.7 us, bytes/bw 1.1 / 2.9 / 40 us
  hc post + next pre T=64 / 256     4.3 / 10.9 us (36% / 56%); block_h 256 x 2 warps 3.9 / 10.1 (the default)
Not at 70%: the mHC mixes (latency-bound: a 8-step loop per partial program plus a 20-step Sinkhorn; 7-12%
of bytes/bw, and 7% of max(launch floor, bytes/bw) at T=64) and the fp8 path at toy T=256 (50%).

Session 3 (kept quantized experts: the loader keeps the checkpoint's FP4/FP8 routed experts as e4m3 + row scales
(+ 1x32 block shifts when they cannot be folded into the values exactly), or as packed FP4):
Round 1 (H200, copy 4249 GB/s), V4.1 shape, fp8 weights:
  per-row scales                     T=64 / 256   2.14 / 3.31 ms   98% / 95% of the bytes
  1x32 block shifts (R=1), fp16      T=64 / 256   3.23 / 4.88 ms   68% / 67%  (bk64 at T=64: 2.79 ms, 82%)
  32x32 block shifts (R=32), fp16    T=64         2.35 ms          89%
  1x32 block shifts, bf16 widening   T=64         4.03 ms          54%
  packed FP4 decoded in registers    T=64 / 256   3.83 / 5.73 ms   30% / 29% of its (half) bytes: ALU-bound
  -> the loader folds the shifts into the e4m3 values whenever exact (E2M1 values survive shifts <= 8: every
     row of a checkpoint whose 1x32 group scales are within 2**8 of each other), so FP4 checkpoints take the
     per-row path; unfoldable layers keep shifts (64-wide K tiles); packed FP4 stays an option, not the default.
  mHC (sweep cut short by the MoE rows): default 14.7 us, partial pass 9.2, per-lane Sinkhorn 14.8 (no change:
  the mixing launch is bound by its split-partial loads, not the Sinkhorn arithmetic).
Round 2 (H200, copy 4273 GB/s; shifts now group-major and loaded through tensor descriptors):
  kept fp8, folded row scales        V4.1 T=64    2.16 ms   93%   (toy T=64 / 256: 118 / 167 us, 79% / 57%)
  kept fp8 + 1x32 shifts (bk64)      V4.1 T=64    2.50 ms   84%   (was 3.23 ms with per-row-major pointer loads)
  kept packed FP4                    V4.1 T=64    3.71 ms   30% of its half bytes (slower than fp8: not default)
  mHC T=64: wide split reduce + per-lane Sinkhorn 16.7 / 18.5 (mix_bt 4) / 15.8 us (8 warps, sc 64), default 14.7.

Session 4 (block shifts as per-column factors of 32-wide K steps' partial products, no tile reshape; packed FP4
met by even / odd activation columns; tensor-descriptor boxes of 128-byte multiples only):
Round 1 (H200, copy 4253 GB/s; every compiled MoE test passes, the old kernel faulted in a 32-byte shift box):
  kept fp8, folded row scales        V4.1 T=64 / 256   2.09 / 3.30 ms   99% / 96%   (unchanged path)
  kept fp8 + 1x32 shifts             V4.1 T=64         8 warps 4 stages 3.28 ms (65%); 4 warps 3 stages 2.42 (88%)
  32x32 shifts (8 warps)             V4.1 T=64         2.82 ms  72%
  packed FP4, 8 warps                V4.1 T=64         nibble ops 5.40 ms (21%); inline-PTX byte permutes 3.66 (30%)
  mHC T=64: two launches 14.7 us = first pass 9.2 (8.4 loading a step ahead) + mixing launch 5.0 + ~0.5;
            one launch (ticket counter, wide reduce, per-lane Sinkhorn) 36.5 us; one launch streaming the same
            4.6 MB (the read floor) 2.9 us, an empty launch 0.5 us.
Round 2 (H200, copy 4246 GB/s; all compiled MoE + mHC tests pass; a tiny V4.1 checkpoint loaded kept on the GPU
(fp8, fp4, the new CUDA default fp8) gives exactly the dequantizing load's logits):
  kept fp8 + 1x32 shifts (4 warps, 3 stages, prefetch)  V4.1 T=64 / 256  2.44 / 3.92 ms  85% / 84%
                                                        (no prefetch 3.11 ms at T=64)
  kept packed FP4 (inline-PTX decode)                   V4.1 T=64 / 256  2.32 / 3.81 ms  47% / 44% (was 3.48 / 5.83)
  kept fp8, folded row scales                           V4.1 T=64 / 256  2.09 / 3.44 ms  95% / 92%
  mHC T=64 / 256: 13.7 / 18.9 us (was 14.7 / 24.3): first pass 8.2 us; mixing launch 5.0 us, of which the
            20-step Sinkhorn is 2.2 (2.8 us with one step); all 40 partials loaded at once 6.0 us.

Session 5 (mHC; rounds 1-2 on the H200, copy 4268-4287 GB/s, read floor at T=64 2.6 us, empty launch 0.5-0.7 us):
  per-token Sinkhorn (16 values in one thread, no shuffles): mixing launch alone 3.5 us (was 4.6)
  ONE launch (ticket per token block, last program adds + mixes): T=64 12.9 / 12.5 us vs two launches 12.8;
      T=256 19.0 vs 18.0: the ticket + serial tail cost what the second launch did -> deleted
  first pass through tensor descriptors (3-4 stages): 16.4 us alone vs 7.6 (fn parts 9.1); whole op 22.3 vs 12.5;
      T=4096 parts 141 vs 149 us -> deleted; sum of squares as diag(r r^T) on tensor cores: 15.3 vs 12.5 -> deleted
  first pass alone, 64-token blocks, 128-wide splits: 6.2 us (one token block: the mixing must then add 160 splits)
  the Sinkhorn loop unrolled inside a one-launch kernel took 23 s to build (2 s as a loop): sweeps now build their
      variants in parallel processes first (warm()), round 1's sweep was all build time.
Round 3 (final tree; all 27 MoE + 26 mHC tests pass compiled): decode tiles up to 128 tokens 256-wide splits in
  128-wide steps: T=64 10.6 us vs 11.5 with the old tiles (same run; first pass 5.9 vs 7.6, mixing launch 4.1 vs
  3.5 with twice the partials); default rows T=64 / 256 / 4096: 12.2 / 17.2 / 150.1 us (session 4: 13.2 / 18.4 /
  148.4); at T=256 the new tiles lose (22.0 vs 17.2), so 129-256 tokens keep the old ones.

Session 6 (packed FP4 through new swapped-operand kernels: weights decoded in registers as the first wgmma
operand, activations gathered in the decode's column order; H200, copy 4242-4274 GB/s), V4.1 shape, us:
Round 1 (no prefetch):            T=64 / 8 / 256   3327 / 730 / 5343 (30-33% of the FP4 bytes), session 4's
                                  two-dot kernel 2380 / - / 3737 (45-46%), kept fp8 2087 / 393 / 3294 (94-99%)
Round 2 (activations + shifts a step ahead; 128-row tiles):
                                  T=64 / 8 / 256   2168 / 476 / 3415 (44-50%), kept fp8 2144 / 451 / 3422
  -> packed FP4 now moves half the bytes in the same time as fp8 (the decode is no longer the limit: three
     decodes of 1.4-1.9 operations a weight time the same); fp8 stays the loader's CUDA default.

Session 7 (mHC in ONE launch: partials, a start ticket per token block, the last starters wait and mix a token
each; H200, copy 4249 GB/s, an empty launch 0.7 us; read floor = one launch streaming the same bytes):
Round 2, us at T = 64 / 256 / 4096 (read floor 2.9 / 4.6 / 38.4):
  two launches (the old default)          11.3 / 18.0 / 150.2
  one launch at its best tiles            10.9 / 16.4 / 89.6   (kernels/hc_mix.py _fused_tiles lists the sweep)
  T=64 breakdown: streaming pass alone 6.4, one Sinkhorn step instead of 20: 10.0; one waiter a token block
  (the last program mixes all 64 tokens) 46.5, 8 waiters 15.9.
  Round 1 hung at T=4096 (1280 programs, every program a waiter): waiters other than the last starter now only
  when the grid fits one wave.
  hc post + next pre (block_h x warps): 256 x 1 4.0 / 9.3 us (the new default; 256 x 2 4.1 / 10.1); one launch
  that only reads the same 6.6 / 26.2 MB takes 3.4 / 7.6 us.

Session 8 (the write-back + read-out + NEXT sub-layer's mixes in one launch, hc_mix.hc_post_mix_*; H200, copy
4247 GB/s, an empty launch 0.5-0.7 us; read floor = one launch streaming the same bytes: R, R', y, x and fp32 fn):
Rounds 1-2, us at T = 8 / 64 / 256 (read floor 2.0 / 3.8 / 8.0; the two launches it replaces 11.8-12.4 /
  14.7-15.0 / 24.6-25.3): 9.0-9.4 / 15.4-15.5 / 29.7-29.9 at the best tiles (kernels/hc_mix.py _post_mix_tiles
  has the sweep: fn tiles a stream ahead or the streams unrolled lost). A win up to 16 tokens only
  (hc_mix.POST_MIX_MAX_T); its streaming pass alone is 11.3 us at T = 64, as long as both launches' together.
  Mixes kernel register variants: see kernels/hc_mix.py _fused_tiles (the real builds do not spill).
  Packed FP4 with the shifts folded into the decoded weights: kernels/moe.py's W4_TILES notes (lost, deleted).

Session 9 (H200, copy 4248 GB/s, an empty launch 0.7 us; ncu source-level stall sampling in the rounds):
Round 1, us (read floor = one launch streaming the same bytes):
  mHC mixes T=64: tail form 0 (session 8) 10.9; 1 (leaving ticket early) 10.5; 3 (+ logits in registers) 10.5;
  7 (+ acquire-load polls) 9.9; form 7 with one Sinkhorn step 8.5; streaming pass alone 5.9; read floor 2.9.
  T=256 16.4 -> 17.0 and T=4096 89.3 -> 93.6 with form 7 (hc_mix._tail_form: 7 only where a waiter mixes one
  token). Tiles at T=64 (form 7): 128-wide splits 11.0, 32-token blocks 12.0, 32 x 128 x 64 26.9.
  Write-back + mixes (form 7) against the two launches: T=8 8.6 vs 11.7; T=64 15.4 (fn parts 14.6) vs 13.8
  (14.8 with form 0); T=256 29.7 vs 25.9; H=2048 T=64 11.8 vs 11.5. Its streaming pass alone at T=64: 9.8.
  ncu (T=64): the mixes kernel 80 programs, 6% achieved occupancy, stalls long-scoreboard 24% / barrier 15%;
  the write-back + mixes kernel's top stall is its per-stream fn tile loads inside the stream loop.
  Packed FP4 at V4.1 T=64 / 8: 2188 / 472 (50 / 43% of its bytes), fp8 rows 2078 / 432 (98 / 89%). ncu: L2 at
  75-78% of its throughput with DRAM at 37-42%, top stall the shift loads' use: the per-step word tiles are
  16 bytes wide per row (half a sector). Variants: kernels/moe.py's W4_TILES notes.
Round 3 (final tree, copy 4273 GB/s; session 8's form beside each default in the same run), us:
  mixes T=64 10.8 -> 9.5 (bench row 9.6; streaming pass 5.8, read floor 2.9); write-back then mixes T=64
  14.6 -> 13.6; write-back + mixes T=8 / 16 9.2 / 9.8 -> 8.5 / 9.0 (bench 8.2 / 8.8; H=2048 T=8 7.7).
  T=256 / 4096 mixes 16.3 / 90.1 (unchanged form). Experts V4.1 T=64 / 8 / 256: fp8 2118 / 448 / 3406 (94 / 85
  / 91%), packed FP4 2142 / 469 / 3403 (49 / 43 / 49% of its bytes).

Session 10 (the write-backs take the MoE output as two addends, y2, and RMSNorm the read-out inside, x_norm;
H200, H=5120; .round scripts timing the HEAD hc_mix beside this tree in the same run, CUDA graphs, us):
Round 1: y2 alone (the add launch + write-back before): write-back + mixes T=8 / 16 9.8 / 10.8 -> 8.6 / 9.2;
  write-back then mixes T=64 / 256 15.6 / 28.8 -> 13.8 / 25.4; write-back + read-out alone T=64 6.0 -> 4.2.
  The y2 read costs the one-addend kernel nothing measurable (T=8 8.5 against 8.6 for HEAD's).
  The norm launch after the write-back + mixes at T=8: +2.0 us; fused (every program its own columns) +1.2;
  norm form 1 (the waiters' whole rows in turn) 26.6 / 41.2 at T=8 / 64.
Round 2 (old: the add, the write-back (+ mixes), the norm; new: one launch up to hc_mix.POST_MIX_NORM_MAX_T):
  MoE write-back T=8 / 16 / 32 / 64 / 256   12.9 / 13.4 / 17.3 / 18.6 / 31.9 -> 9.3 / 10.0 / 13.8 / 15.2 / 28.8
                                             (norm form 2, every program its own columns: 10.1 / 10.6 / 15.4 / 16.1)
  attention write-back T=8 / 32 / 64         11.3 / 15.1 / 16.7 -> 9.4 / 13.8 / 15.1 (fused norm: +0.6 at T=8)
  plain write-back + mixes (no y2, no norm)  T=8 / 64 HEAD 8.9 / 13.6, this tree 8.8 / 13.6
  Packed FP4 laid out by K block: lost, deleted (kernels/moe.py's W4_TILES notes). Compiled mHC tests: 52 pass.
Round 3 (final tree, copy 4248 GB/s; bench_moe_write_back's rows, the old launches in the same run):
  MoE write-back T=8 / 16 / 32 / 64 / 256        12.1 / 13.6 / 17.6 / 18.5 / 31.8 -> 9.0 / 9.8 / 13.8 / 15.2 / 28.8
  attention write-back T=8 / 16 / 32 / 64 / 256  10.4 / 11.6 / 15.8 / 16.6 / 28.7 -> 9.0 / 9.7 / 13.7 / 15.1 / 28.7
  (22-30% of one launch streaming the bytes: the mixing tail); compiled mHC tests: 51 of 51 pass.

Session 11 (packed FP4: each 32-group's shift folded into a bf16 decode of the weights, 2.1 operations a weight,
one dot chain in place over 128-wide K steps, activations read as stored and permuted in registers, register caps
168 / 128 for gate/up / down; H200, copy 4225-4252 GB/s; .round scripts timing HEAD's kernel in the same run), us:
  V4.1 T = 64 / 8 / 256, % of the FP4 bytes   HEAD 2096-2099 / 466-467 / 3369-3393 (49-50 / 43%) ->
                                              1401-1414 / 312 / 2290-2319 (74-75 / 64 / 72-73%, round 4)
  the fp8 rows path (the loader's CUDA default until now) in the same run: 1989-1990 / 420-468 / 3277-3278 (96-99%
  of its bytes), so packed FP4 is now 1.4x faster than fp8 at T = 64 / 256, and the loader keeps FP4 packed on CUDA
  (engine/loader.CUDA_EXPERT_DTYPE = "fp4"). kernels/moe.py's W4_TILES notes have the ncu
  counts and the variants (block_k 64, 4 stages, register caps, tensor-descriptor shifts, 64-row tiles). The last
  layer's write-back with the final norm in one launch lost (kernels/hc_mix.py's hc_post_triton notes).
  Compiled MoE + mHC tests: 79 of 79 pass (round 4).

Session 12 (programmatic dependent launch for the step's small kernels: kernels.backend.PDL off / on in the same
run, K3_SWEEP=pdl's _sweep_pdl; H200, copy 4250 GB/s; mid-size V4.1 shapes, 16 calls back to back in a CUDA graph,
us a call off -> on, round 3): skinny products at 64 rows (the GEMM library beside): wq_a + wkv 6.69 -> 6.05
(6.05), wq_b 11.08 -> 10.64 (9.48), wo_a 10.38 -> 9.43 (9.15), wo_b 7.08 -> 6.74 (6.27), shared w1 + w3 8.27 ->
7.78 (17.89), shared w2 4.74 -> 4.42 (4.92); gate_route 5.59 -> 4.88; rmsnorm 1.74 -> 1.28; rope q 2.75-2.89 ->
2.65-2.70; ring write + pool 3.16 -> 2.69; MoE write-back + mixes + norm T=64 11.02 -> 10.76-10.82; write-back +
read-out T=256 4.87 -> 4.73; mixes T=256 11.77 -> 11.54. The "two launches ... pdl" sweep cases (session 9) passed
a `pdl=` keyword hc_post_triton no longer had (each one failed); they now flip backend.PDL (_hc_runner).

Session 12, routed experts (K3; packed FP4 through moe.moe_experts, HEAD's kernels/moe.py imported beside the tree
in the same run; a chain of 20 calls in a CUDA graph, two weight sets alternating; H200, copy 4225 GB/s; us a
call, % of the touched experts' bytes at copy bandwidth; round 3):
  mid-size (H=2048 F=1024 E=64 K=6, the TOY shape) T = 8 / 64 / 256   HEAD 61.9-62.1 / 90.6 / 170.3-170.7 (44 /
                                  56 / 30%) -> 56.3-56.5 / 87.3-87.4 / 123.6-124.1 (48 / 58 / 42%); PDL off 59.0-59.2
                                  / 90.3-90.5 / 126.4-126.5 (kernels/moe.py w4_tiles and its PDL notes)
  V4.1 T = 8 / 64 / 256 (chain of 4)  HEAD 316.5-317.7 / 1518-1582 / 2452-2490 -> 313.0-314.1 / 1556-1581 /
                                  2465-2493 (66-67 / 73-75 / 69%: unchanged within the runs' spread)
  V4.1 T = 4096 (prefill, 64-row blocks, one call)  packed FP4 8075-8273 us, the fp8 rows path 10577-10584: FP4
                                  stays the faster at prefill too (8 warps there 8693-8751: not taken)
  Where the mid-size time goes (round 2, torch profiler, PDL off, us a call): T=64 gate/up 55.7, down 31.0,
  combine 2.5, align 2.3; T=256 gate/up 105.5, down 55.4, align 5.2, combine 4.2 (before w4_tiles). ncu at T=64:
  gate/up DRAM 53% of peak, issue slots 56% busy, 15% warps active (3 programs an SM by registers and by
  shared memory), stalls per issue wait 0.67, not selected 0.62, long scoreboard 0.57, barrier 0.42; down 52% /
  61% / 22%, long scoreboard and not selected 1.01 each. At T=256 (32-row blocks, capped 4-warp builds) long
  scoreboard 1.72 / 3.20 (the spilled registers' loads), issue 40 / 41%; at 8 warps 0.84 / 1.38, 56 / 55%.
  Compiled MoE tests: 29 of 29 pass (round 3).

Session 13, mHC at the mid-size hidden 2048 (K4; .round scripts timing HEAD's kernels/hc_mix.py beside the tree in
the same run, 16 calls back to back in a CUDA graph, PDL on; H200, us a call): the write-back + mixes tiles that
fill the GPU once, the norm inside up to 256 tokens, fn parts from 32 tokens: MoE write-back T = 8 / 32 / 64 / 256
7.95 / 12.41 / 10.78 / 18.65 -> 7.13 / 7.21 / 8.27 / 17.38 (R3; kernels/hc_mix.py's module docstring has every row).
bench_moe_write_back now also runs at H = 2048.

Session 13, routed experts and router (K3; the mid-size shape now read from engine/testing.midsize_v41_config; a
.round script timing HEAD's kernels/moe.py and kernels/router.py beside the tree in the same run, chains of 20
layers in a CUDA graph, two input sets alternating, PDL on; H200, copy 4225-4251 GB/s; us a layer):
  the gate inside the router's launch up to 256 rows (router.FUSED_MAX_ROWS 64 -> 256; bench_router's rows, R3):
      router alone T = 64 / 128 / 256 4.8 / 4.9 / 5.1 against the GEMM library + route kernel 7.0 / 7.6 / 7.6;
      router + routed chain T = 128 / 256 110.7-111.7 / 151.6-151.7 -> 108.1-108.5 / 149.2-150.5
  routed chain alone, HEAD = tree (R3) T = 64 / 256 87.7-87.9 / 133.3-133.9 (58 / 38% of the touched bytes)
  measured and deleted (kernels/moe.py's notes): split-K gate/up (R1: T = 64 2 / 4 slices 97.1-97.5 / 100.9-101.5
      against 87.9-88.5), 128-register caps (4 programs an SM), the alignment inside the router's launch (R2:
      router + chain T = 8 / 64 / 256 63.8-67.2 / 94.8-95.3 / 153.9-155.3 against 61.4-62.3 / 92.1-92.3 /
      152.4-153.4); the align launch's share of the chain: 2.1 / 5.5 us at T = 64 / 256 (R2)
  fp8 rows path (FP8_TILES) PDL off / on, T = 64: 117.1-117.6 / 113.8-114.1 (81 / 84% of its bytes, R1): kept on

Session 14, routed experts and router (K3; .round scripts, HEAD's router beside the tree, us a call): V4.1's gate
(384 experts) in one launch as expert tiles up to router.TILED_MAX_ROWS = 16 rows, `route` a row a warp above 256
experts (kernels/router.py has every row; bench_router's V4.1 rows time both). The mid-size packed-FP4 chain at
T = 256 (R3, 20-call chain): the tree's tiles 114.1-114.5 (44% of 216 MB at 4250 GB/s) against 4 warps
130.3-130.7, 4 stages 118.7, 64-wide gate/up tiles 160.5: kept. ncu (R1, T = 256): gate/up 65.9 us, 2 programs
an SM (119 registers, 8 warps), issue slots 56% busy, ALU pipe 50%, stalls per issue barrier 1.14, not selected
1.07, long scoreboard 0.96, L2 hit 45%; down 44.6 us (105 registers), issue 55%, long scoreboard 1.50, barrier
0.95: both about half instruction-bound (the FP4 decode) and half waiting, at 2.1 / 1.5 TB/s.

Session 15, routed experts (K3; .round scripts, HEAD's kernels/moe.py beside the tree in the same run, chains in a
CUDA graph, PDL on; H200, us): the shared expert inside the packed FP4 launches (one more expert of weight 1, its
blocks first) lost against the side stream at every T: the whole MoE layer (gate + routed + shared + combine) R2
mid-size T = 32 / 64 / 256 92.6-92.8 / 98.2-98.8 / 154.3-172.6 -> 94.8-96.5 / 109.3-109.5 / 171.7-173.0, V4.1
T = 64 / 256 1211-1217 / 1984-1986 -> 1251-1254 / 2136-2165 (deleted; kernels/moe.py's module docstring has the
variants). Bounds on the routed chain (R3; copies of the kernels without the group factors' loads or without the
FP4 decode, wrong results): mid-size T = 64 87.9-88.9 / 89.8-90.4 / 84.3-85.0, T = 256 114.3-116.5 / 110.6-112.1
/ 104.3-110.3, V4.1 T = 64 1389-1460 / 1313 / 1248-1250 (kernels/moe.py's W4_TILES notes have the SASS counts).
Gate/up capped at 128 registers at mid-size T = 64 / 32 / 16 (R4; 4 programs an SM, one wave): 87.4-88.5 /
85.9-86.9 / 73.6-73.8 -> 93.9-95.1 / 93.0-93.9 / 85.1-85.7, not taken.

Session 16, routed experts (K3; .round scripts, HEAD's kernels in the same run, 20-call CUDA graphs, us): the packed
FP4 gate/up launched alone at mid-size T = 64 with the pairs dealt over N experts steps at 396 programs (3 an SM):
384 programs 39.1-40.3, 400 programs 53.0-53.7, 512 54.6-55.7; from 192 to 384 programs it stays at 38-40. A trace
of the programs (R3: %smid, %globaltimer) says why: three programs on an SM take 35 us together (~11.7 us each), a
program alone 19-20 us (latency-bound), and at T = 64 the 116 programs past the first 396 run alone: ~10 us over an
even spread of the work (kernels/moe.py's W4_TILES notes: a stream-K walk is the lead). Measured and deleted
(kernels/moe.py's W4_TILES notes have every row): split-K gate/up with the partials summed by a SwiGLU launch (T =
64: 93.8-93.9 against 87.4-88.0) or by the down kernel's prologue (115.7-115.8), 64-row gate/up or down tiles,
256-row down tiles, a persistent grid (98.3-99.0 against 88.4-88.5) and mma.sync builds (161.3-165.8).
"""
import math
import os
import time

import torch
import triton
import triton.language as tl

from deepinfer_sg.kernels import backend, hc_mix, moe, ring_pool, rmsnorm, rope, router, skinny
from kbench import DEV, DRY, emit, rotating, row, S, time_ms

T_START = [time.time()]     # the sweep's start (sweep() resets it: the ceilings before it are not its time)
FP8_COMPUTE = "fp16"     # fp8 weights widened to fp16 (one cvt) for the dot: set from the round-2 sweep
# the sweep stops adding variants this many seconds after it starts; K3_SWEEP names its parts ("hc,moe"), and the
# mHC part stops when less than HC_SHARE_LEFT of that time is left
SWEEP_S = float(os.environ.get("K3_SWEEP_S", "40"))
SWEEP_PARTS = os.environ.get("K3_SWEEP", "hc,moe").split(",")
HC_SHARE_LEFT = 0.45 if "moe" in SWEEP_PARTS else 0.0


def _midsize():
    """The mid-size V4.1 decode step's shapes, as engine/testing.midsize_v41_config (model_forward's --config
    midsize) has them: hidden 2048, 32 heads of 512 with 64 rotated channels, q / o LoRA ranks 768 / 512 in 4 output
    groups, 64 experts of 1024 (top 6); tiny ones for --dry."""
    from deepinfer_sg.engine.testing import midsize_v41_config
    c = midsize_v41_config()["text_config"]
    return dict(H=S(c["hidden_size"], 64), heads=S(c["num_attention_heads"], 2), hd=S(c["head_dim"], 64),
                rope=S(c["qk_rope_head_dim"], 16), ql=S(c["q_lora_rank"], 48), ol=S(c["o_lora_rank"], 32),
                groups=S(c["o_groups"], 2), inter=S(c["moe_intermediate_size"], 32),
                experts=S(c["n_routed_experts"], 8), top=S(c["num_experts_per_tok"], 2))


MID = _midsize()
TOY = dict(H=MID["H"], F=MID["inter"], E=MID["experts"], K=MID["top"])      # the mid-size experts
REAL = dict(H=S(5120, 64), F=S(2304, 48), E=S(384, 6), K=S(6, 2))


def moe_inputs(T, H, F, E, K):
    """Random bf16 activations and weights (never zeros), router top-k of uniform scores, fp32 weights."""
    def w(*shape):
        return torch.randn(*shape, device=DEV, dtype=torch.bfloat16).mul_(0.05)
    ids = torch.rand(T, E, device=DEV).topk(K, 1).indices
    return w(T, H).mul_(20), ids, torch.rand(T, K, device=DEV), w(E, F, H), w(E, F, H), w(E, H, F)


def fp8_inputs(T, H, F, E, K):
    """(x, ids, weights, w1, w3, w2 in float8_e4m3fn) and the per-row scales (random, never zero)."""
    def w(*shape):
        return torch.randn(*shape, device=DEV, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    ids = torch.rand(T, E, device=DEV).topk(K, 1).indices
    sc = tuple(torch.rand(E, n, device=DEV) * 0.02 + 0.005 for n in (F, F, H))
    return (torch.randn(T, H, device=DEV, dtype=torch.bfloat16), ids, torch.rand(T, K, device=DEV), w(E, F, H),
            w(E, F, H), w(E, H, F)), sc


def moe_bytes(s):
    x, ids, _, w1, _, _ = s
    E, F, H = w1.shape
    touched = int(torch.unique(ids).numel())
    return touched * 3 * F * H * w1.element_size() + 2 * x.numel() * x.element_size(), touched


def moe_err(s, **kw):
    a = moe.moe_experts_triton(*s, **kw).float()
    b = moe.moe_experts_torch(*s).float()
    return float((a - b).norm() / b.norm())


def _kept_row(label, shape, s, kw, twin_kw, nbytes, bw, note):
    """moe_experts on kept-quantized weights: checked against the twin, timed, one row; -> ms."""
    a = moe.moe_experts(*s, **kw).float()
    b = moe.moe_experts_torch(*s, **twin_kw).float()
    err = float((a - b).norm() / b.norm())
    t = time_ms(lambda: moe.moe_experts(*s, **kw))
    row(label, shape, t, None, nbytes, bw, f"rel err {err:.1e}; {note(t)}")
    return t


def bench_moe(bw, l2, batches):
    for name, shp in (("V4.1", REAL), ("toy", TOY)):      # the real shape first (the numbers that matter)
        H, F, E, K = shp["H"], shp["F"], shp["E"], shp["K"]
        for T in batches:
            nxt = rotating(lambda: moe_inputs(T, H, F, E, K), 3 * E * F * H * 2, l2)
            s = nxt()
            nbytes, touched = moe_bytes(s)
            err = moe_err(s)
            t = time_ms(lambda: moe.moe_experts_triton(*nxt()))
            tt = None
            if name == "toy":           # the twin loops over experts in fp32: seconds at the real shape
                tt = time_ms(lambda: moe.moe_experts_torch(*nxt()), graph=False)
            row("moe experts", f"{name} T={T} H={H} F={F} E={E} K={K}", t, tt, nbytes, bw,
                f"{touched} experts touched; rel err {err:.1e}; block_m {moe.default_block_m(T, K, E)}")
            s = nxt = None
            try:        # the loader's kept experts: fp8 (1 byte) with the checkpoint's 1x32 block scales, and FP4
                s, sc = fp8_inputs(T, H, F, E, K)       # packed as stored (half a byte), through moe_experts
                nb8, touched = moe_bytes(s)
                nbr = nb8 + sum(x.numel() * 4 for x in sc)
                tr = _kept_row("  moe kept fp8", f"{name} T={T}", s, dict(scales=sc), dict(scales=sc), nbr, bw,
                               lambda x: f"row scales (shifts folded); {t / x:.2f}x faster than bf16 weights")
                scales, shifts = block_scaled_inputs(s, 1)
                nb8 += sum(x.numel() * 4 for x in sc) + sum(g.numel() for g in shifts)
                tw8 = dict(scales=scales, shifts=shifts, shift_rows=1)
                kw8 = dict(tw8, fp8_compute=FP8_COMPUTE)
                _kept_row("  moe kept fp8 + shifts", f"{name} T={T}", s, kw8, tw8, nb8, bw,
                          lambda x: f"1x32 block shifts (unfoldable layers); {t / x:.2f}x faster than bf16")
                s4 = s[:3] + tuple(torch.randint(0, 256, (w.shape[0], w.shape[1], w.shape[2] // 2), device=DEV,
                                                 dtype=torch.uint8) for w in s[3:])
                _kept_row("  moe kept fp4 packed", f"{name} T={T}", s4, kw8, tw8, nb8 - touched * 3 * F * H // 2, bw,
                          lambda x: f"decoded in registers; {t / x:.2f}x faster than bf16, {tr / x:.2f}x fp8")
            except Exception as e:                      # noqa: BLE001
                emit(f"  moe fp8 {name} T={T}: FAILED {type(e).__name__}: {str(e)[:300]}")
            s = s4 = sc = None
            if not DRY:
                torch.cuda.empty_cache()
    bench_router(bw, S((64, 128, 256), (5,)), (MID["H"], MID["experts"], MID["top"]), "mid")
    bench_router(bw, S((8, 16, 64, 256), (5,)), (REAL["H"], S(384, 300), 6), "V4.1")    # (E 300 > 256 dry: tiled)


def bench_router(bw, batches, shape, name):
    """The router (gate GEMM + sqrt-softplus scores + biased top-k + weights) at each row count: the gate inside one
    launch (router.gate_route_triton; above 256 experts in expert tiles) against the GEMM library then
    router.route's kernel (the dispatch above FUSED_MAX_ROWS, or TILED_MAX_ROWS for tiled gates), 16 calls back to
    back in a CUDA graph over 16 gate weights; bytes: the gate weight."""
    H, E, K = shape
    ws = [torch.randn(E, H, device=DEV, dtype=torch.bfloat16) * H ** -0.5 for _ in range(16)]
    b = torch.randn(E, device=DEV) * 0.1
    F_ = torch.nn.functional
    most = router.FUSED_MAX_ROWS if router.one_tile(E, 2) else router.TILED_MAX_ROWS
    for T in batches:
        x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
        fused = time_ms(lambda: [router.gate_route_triton(x, w, b, K, 1.5) for w in ws]) / len(ws)
        lib = time_ms(lambda: [router.route(F_.linear(x, w), b, K, 1.5) for w in ws]) / len(ws)
        row("router gate + top-k", f"{name} T={T} H={H} E={E} K={K}", fused, None, E * H * 2, bw,
            f"GEMM library + route kernel {lib * 1e3:.1f} us (dispatch: fused up to {most} rows)")


@triton.jit
def _empty_kernel(x_ptr):
    pass


def launch_floor():
    """(one empty launch, two empty launches) in a CUDA graph, ms."""
    x = torch.empty(16, device=DEV)
    one = time_ms(lambda: _empty_kernel[(1,)](x))
    two = time_ms(lambda: (_empty_kernel[(1,)](x), _empty_kernel[(1,)](x)))
    return one, two


def hc_inputs(T, M, H):
    nz = (2 + M) * M
    return (torch.randn(T, M, H, device=DEV, dtype=torch.bfloat16),
            torch.randn(nz, M * H, device=DEV) / math.sqrt(M * H), torch.randn(nz, device=DEV),
            torch.rand(3, device=DEV) + 0.5)


def hc_err(s, public=False, **kw):
    a = hc_mix.hc_mixes(*s) if public else hc_mix.hc_mixes_triton(*s, **kw)
    b = hc_mix.hc_mixes_torch(*s)
    return max(float((a.comb - b.comb).abs().max()), float((a.pre - b.pre).abs().max()),
               float((a.post - b.post).abs().max()))


def bench_hc(bw, l2, batches):
    M, H = 4, S(5120, 64)
    one, two = launch_floor()
    emit(f"# launch floor (empty kernel in a CUDA graph): one launch {one * 1e3:.1f} us, two {two * 1e3:.1f} us")
    for T in batches:
        nz = (2 + M) * M
        nbytes = T * M * H * 2 + nz * M * H * 4
        nxt = rotating(lambda: hc_inputs(T, M, H), nbytes, l2)
        s = nxt()
        err = hc_err(s, public=True)
        for _ in range(16):                 # fn parts cached per rotating input set (T > 256) before the graph
            hc_mix.hc_mixes(*nxt())
        t = time_ms(lambda: hc_mix.hc_mixes(*nxt()))          # the public entry (T > 256: cached fn parts)
        tt = time_ms(lambda: hc_mix.hc_mixes_torch(*nxt()))
        achievable = max(one, nbytes / (bw * 1e9) * 1e3)
        rf = one if DRY else read_floor(nbytes)
        row("hc mixes + sinkhorn", f"T={T} M={M} H={H}", t, tt, nbytes, bw,
            f"max abs err {err:.1e}; one launch; {achievable / t:.0%} of max(launch floor, bytes/bw); "
            f"{rf / t:.0%} of one launch streaming the bytes ({rf * 1e3:.1f} us)")
        if T <= 64:
            tp = time_ms(lambda: hc_mix.hc_mixes_triton(*nxt(), only_partial=True))
            row("  hc partial pass", f"T={T} M={M} H={H}", tp, None, nbytes, bw, "the streaming pass alone")
    for T in batches[:2]:                  # applying the mixes: R' = post*y + comb^T R, then the next read-out
        nb = T * M * H * 2 * 2 + T * H * 2 * 2
        nxt = rotating(lambda: _apply_inputs(T, M, H), nb, l2)
        s = nxt()
        o, x = hc_mix.hc_post_triton(*s)
        ro, rx = hc_mix.hc_post_torch(*s)
        err = max(float((o.float() - ro.float()).abs().max() / ro.float().abs().max()),
                  float((x.float() - rx.float()).abs().max() / rx.float().abs().max()))
        t = time_ms(lambda: hc_mix.hc_post_triton(*nxt()))
        tt = time_ms(lambda: hc_mix.hc_post_torch(*nxt()))
        achievable = max(one, nb / (bw * 1e9) * 1e3)
        row("hc post + next pre", f"T={T} M={M} H={H}", t, tt, nb, bw,
            f"err/max {err:.1e} (bf16 ulps); {achievable / t:.0%} of max(launch floor, bytes/bw); twin ~9 launches")
    bench_post_mix(bw, l2, S((8, 16, 64, 256), (5,)), one)
    bench_post_mix(bw, l2, S((8, 64), (5,)), one, H=S(2048, 32))        # the mid-size decode step's shape
    bench_moe_write_back(bw, l2, S((8, 16, 32, 64, 80, 96, 256), (5,)), one)     # (80, 96: resident at once on an H200)
    bench_moe_write_back(bw, l2, S((8, 32, 64, 256), (5,)), one, H=S(2048, 32))      # the mid-size decode step's


def _post_mix_inputs(T, M, H):
    """(R, y, post, comb, next_pre, fn, base, scale): a write-back and the next sub-layer's mixes parameters."""
    return _apply_inputs(T, M, H) + hc_inputs(1, M, H)[1:]


def _post_mix_bytes(T, M, H):
    """R read, R' written, y read, x written (bf16) and fn once (fp32): the write-back + mixes pass's floor."""
    return T * M * H * 2 * 2 + T * H * 2 * 2 + (2 + M) * M * M * H * 4


def _two_launches(s):
    """What the engine ran before the fused pass: the write-back + read-out, then the mixes of R'."""
    out, x = hc_mix.hc_post_apply(*s[:5])
    return out, x, hc_mix.hc_mixes(out, *s[5:])


def post_mix_err(a, s):
    """Largest difference of (R', x) relative to their size, and of the mixes absolute, against the twin."""
    out, x, m = a
    ro, rx, rm = hc_mix.hc_post_mix_torch(*s)
    rel = max(float((u.float() - v.float()).abs().max() / v.float().abs().max()) for u, v in ((out, ro), (x, rx)))
    # the mixes compared on the kernel's own R' (a bf16 ulp of R' moves them more than the kernel's error)
    rm = hc_mix.hc_mixes_torch(out, *s[5:])
    return rel, max(float((u - v).abs().max()) for u, v in ((m.pre, rm.pre), (m.post, rm.post), (m.comb, rm.comb)))


def _post_mix_kernel(s):
    """The write-back + mixes kernel at its default tiles, with fn's cached parts where hc_post_mix_apply uses
    them (it takes the kernel up to hc_mix.POST_MIX_MAX_T tokens only)."""
    big = hc_mix.parts_pay(s[0].shape[0], post_mix=True)
    return hc_mix.hc_post_mix_triton(*s, fn_parts=hc_mix.fn_parts_cached(s[5]) if big else None)


def bench_post_mix(bw, l2, batches, one, H=S(5120, 64)):
    """The write-back + read-out + next sub-layer's mixes in one launch (hc_post_mix_triton) against the two
    launches it replaces, timed in the same run (H: 5120 for V4.1, 2048 for model_forward's mid-size config)."""
    M = 4
    for T in batches:
        nb = _post_mix_bytes(T, M, H)
        nxt = rotating(lambda: _post_mix_inputs(T, M, H), nb, l2)
        s = nxt()
        rel, err = post_mix_err(_post_mix_kernel(s), s)
        for _ in range(16):                 # fn parts cached per rotating input set before the graph
            _post_mix_kernel(nxt())
            _two_launches(nxt())
        t = time_ms(lambda: _post_mix_kernel(nxt()))
        t2 = time_ms(lambda: _two_launches(nxt()))
        rf = one if DRY else read_floor(nb)
        row("hc post + next mixes", f"T={T} M={M} H={H}", t, None, nb, bw,
            f"two launches {t2 * 1e3:.1f} us; err R'/x {rel:.0e} (bf16 ulps), mixes {err:.0e}; "
            f"{rf / t:.0%} of one launch streaming the bytes ({rf * 1e3:.1f} us)")


def _moe_write_back_inputs(T, M, H):
    """_post_mix_inputs plus the shared expert's output y2 and the next sub-layer's norm (fp32 weight, eps)."""
    return _post_mix_inputs(T, M, H) + (torch.randn(T, H, device=DEV, dtype=torch.bfloat16),
                                         (torch.rand(H, device=DEV) + 0.5, 1e-6))


def _write_back(s, fused=True, moe=True):
    """The write-back (+ next mixes) as the engine runs it after the MoE (moe: routed y + shared y2) or the
    attention, with the read-out normalised inside (hc_post_mix_apply's y2 and x_norm), or (fused=False) the
    launches that replaces: the add (moe), the write-back (+ mixes), then kernels.rmsnorm."""
    y2 = s[8] if moe else None
    if fused:
        return hc_mix.hc_post_mix_apply(*s[:8], y2=y2, x_norm=s[9])
    out, x, m = hc_mix.hc_post_mix_apply(s[0], s[1] if y2 is None else s[1] + y2, *s[2:8])
    return out, rmsnorm.rms_norm(x, *s[9]), m


def bench_moe_write_back(bw, l2, batches, one, H=S(5120, 64)):
    """The write-backs with the next input's RMSNorm inside (x_norm) and, after the MoE, its two addends (y2):
    one launch wherever its grid is resident at once (hc_mix.hc_post_mix_apply), against the (add +) write-back
    + norm launches."""
    M = 4
    for T in batches:
        nb = _post_mix_bytes(T, M, H) + T * H * 2
        nxt = rotating(lambda: _moe_write_back_inputs(T, M, H), nb, l2)
        s = nxt()
        rf = one if DRY else read_floor(nb)
        for moe_ in (True, False):
            out, x, _ = _write_back(s, moe=moe_)
            ro, rx, _ = hc_mix.hc_post_mix_torch(*s[:8], y2=s[8] if moe_ else None, x_norm=s[9])
            rel = max(float((u.float() - v.float()).abs().max() / v.float().abs().max())
                      for u, v in ((out, ro), (x, rx)))
            for _ in range(16):             # fn parts cached per rotating input set before the graph
                _write_back(nxt(), moe=moe_)
            t = time_ms(lambda: _write_back(nxt(), moe=moe_))
            t3 = time_ms(lambda: _write_back(nxt(), fused=False, moe=moe_))
            row(f"hc {'moe' if moe_ else 'attn'} write-back", f"T={T} M={M} H={H}", t, None, nb, bw,
                f"{'add + ' if moe_ else ''}write-back + norm {t3 * 1e3:.1f} us; err R'/xn {rel:.0e} (bf16 "
                f"ulps); {rf / t:.0%} of one launch streaming the bytes ({rf * 1e3:.1f} us)")


def _left():
    return SWEEP_S - (time.time() - T_START[0])


def block_scaled_inputs(s, R):
    """The fp8 weights of `s` with checkpoint-style block scales (what the loader keeps): row scale = the row's
    largest block scale, random shifts 0..6 per (R rows x 32 columns) block (never all zero)."""
    x, ids, wts, w1, w3, w2 = s
    sc, sh = [], []
    for w in (w1, w3, w2):
        E, N, K = w.shape
        g = torch.randint(0, 7, (E, -(-K // 32), -(-N // R)), device=DEV, dtype=torch.uint8)   # group-major
        sc.append(torch.rand(E, N, device=DEV) * 0.02 + 0.005)
        sh.append(g)
    return tuple(sc), tuple(sh)


def sweep(bw, l2):
    """Variants, most informative first; stops adding rows when the sweep's time is spent."""
    T_START[0] = time.time()
    one, two = (1.0, 1.0) if DRY else launch_floor()
    emit(f"# launch floor (empty kernel in a CUDA graph): one launch {one * 1e3:.1f} us, two {two * 1e3:.1f} us")
    # mHC (breakdown of the mixing launch, first-pass tiles) for the first part of the sweep's time, then MoE
    if "hc" in SWEEP_PARTS:
        _sweep_hc(bw, l2, one)
    if "moe" in SWEEP_PARTS:
        _sweep_moe(bw)
    if "pdl" in SWEEP_PARTS:
        _sweep_pdl(bw, l2)


def _mid_products():
    """(name, groups, N, K, clamped SwiGLU with an up product) of the step's few-row products."""
    m = MID
    return [("wq_a+wkv", 1, m["ql"] + m["hd"], m["H"], False), ("wq_b", 1, m["heads"] * m["hd"], m["ql"], False),
            ("wo_a", m["groups"], m["ol"], m["heads"] * m["hd"] // m["groups"], False),
            ("wo_b", 1, m["H"], m["groups"] * m["ol"], False), ("shared w1+w3", 1, m["inter"], m["H"], True),
            ("shared w2", 1, m["H"], m["inter"], False)]


def _product_calls(T, groups, N, K, glu, l2, lib=False):
    """(calls, weight bytes): kernels.skinny's product (lib: the GEMM library's, F.linear / one bmm, + the SwiGLU
    launches) over weight copies rotating past the L2."""
    F_ = torch.nn.functional
    nb = groups * N * K * 2 * (2 if glu else 1)
    copies = max(2, min(16, int(4 * l2 // nb) + 1))
    ws = [torch.randn(groups * N, K, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    ups = [torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * 0.02 if glu else None for _ in range(copies)]
    x = torch.randn(T, groups * K, device=DEV, dtype=torch.bfloat16)

    def run(w, u):
        if not lib:
            return skinny.skinny_linear_triton(x, w, groups, (u, 10.0) if glu else None)
        if glu:
            return F_.silu(F_.linear(x, w).clamp(max=10.0)) * F_.linear(x, u).clamp(-10.0, 10.0)
        if groups == 1:
            return F_.linear(x, w)
        return torch.bmm(x.view(T, groups, -1).transpose(0, 1), w.view(groups, N, -1).transpose(1, 2))
    return [lambda w=w, u=u: run(w, u) for w, u in zip(ws, ups)], nb


def _small_calls(name, T):
    """(calls, bytes moved) of one of the step's small kernels at the mid-size shapes, 16 calls on 4-8 input sets."""
    m, H = MID, MID["H"]
    bf = dict(device=DEV, dtype=torch.bfloat16)
    if name == "rmsnorm":
        xs, w = [torch.randn(T, H, **bf) for _ in range(8)], torch.rand(H, device=DEV) + 0.5
        return [lambda x=x: rmsnorm.rms_norm(x, w, 1e-6) for x in xs] * 2, 4 * T * H
    if name == "rope q":
        xs = [torch.randn(T, m["heads"], m["hd"], **bf) for _ in range(8)]
        turn = torch.randn(T, m["rope"] // 2, 2, device=DEV)
        return [lambda x=x: rope.apply_rope(x, turn) for x in xs] * 2, 4 * T * m["heads"] * m["hd"]
    if name == "gate_route":
        ws = [torch.randn(m["experts"], H, **bf) * H ** -0.5 for _ in range(16)]
        x, b = torch.randn(T, H, **bf), torch.randn(m["experts"], device=DEV) * 0.1
        return [lambda w=w: router.gate_route(x, w, b, 6, 1.5) for w in ws], 2 * m["experts"] * H
    if name == "ring write+pool":                       # a compressor's step: 512-wide fp32 rings, groups of 4
        n, W = 4 * T + 8, S(512, 32)
        rkv, rg = torch.randn(n, W, device=DEV), torch.randn(n, W, device=DEV)
        dst, grp = torch.randperm(n, device=DEV)[:T], torch.randint(0, n, (T, 4), device=DEV)
        kvs = [(torch.randn(T, W, **bf), torch.randn(T, W, **bf)) for _ in range(4)]

        def step(kv):
            ring_pool.ring_write(kv[0], kv[1], rkv, rg, dst, dst)
            return ring_pool.ring_pool(rkv, rg, grp, grp, torch.bfloat16)
        return [lambda kv=kv: step(kv) for kv in kvs] * 4, T * W * (2 * 2 + 2 * 4 + 2 * 4 * 4 + 2)
    if name.startswith("q_norm + kv store"):         # the two norms after the stacked wq_a + wkv product
        ql, hd, n = m["ql"], m["hd"], 4 * T + 8
        st = [torch.randn(T, ql + hd, **bf) for _ in range(8)]
        wq, wkv = torch.rand(ql, device=DEV) + 0.5, torch.rand(hd, device=DEV) + 0.5
        ang = torch.rand(T, m["rope"] // 2, device=DEV) * 20
        turn, pool = torch.stack([ang.cos(), ang.sin()], -1), torch.randn(n, hd, **bf)
        rows = torch.randperm(n, device=DEV)[:T]

        def two(x):
            rmsnorm.rms_norm(x[:, ql:], wkv, 1e-6, turn, pool, rows)
            return rmsnorm.rms_norm(x[:, :ql], wq, 1e-6)
        one = lambda x: rmsnorm.rms_norm_pair(x[:, :ql], wq, 1e-6, x[:, ql:], wkv, 1e-6, turn, pool, rows)  # noqa
        f = one if name.endswith("pair") else two
        return [lambda x=x: f(x) for x in st] * 2, 4 * T * (ql + hd)
    ss = [_moe_write_back_inputs(T, 4, H) for _ in range(4)]
    if name.startswith("write-back chain"):             # engine/mhc's DEFER_MIXES off / on ("deferred")
        ss = [s + (torch.randn(H, H, **bf) * H ** -0.5,) for s in ss]
        return [lambda s=s: _write_back_chain(s, name.endswith("deferred")) for s in ss] * 4, \
            2 * (_post_mix_bytes(T, 4, H) + T * H * 2)
    if name == "hc post":                               # the write-back + read-out (where not one launch)
        return [lambda s=s: hc_mix.hc_post_apply(*s[:5]) for s in ss] * 4, T * 4 * H * 2 * 2 + T * H * 2 * 2
    if name == "hc mixes":
        return [lambda s=s: hc_mix.hc_mixes(*s[:1], *s[5:8]) for s in ss] * 4, T * 4 * H * 2 + 24 * 4 * H * 4
    # "moe write-back": the write-back of the routed + shared outputs, the read-out normalised, the next mixes
    return ([lambda s=s: hc_mix.hc_post_mix_apply(*s[:8], y2=s[8], x_norm=s[9]) for s in ss] * 4,
            _post_mix_bytes(T, 4, H) + T * H * 2)


def _write_back_chain(s, defer):
    """Two write-backs + mixes + norm (engine/mhc.hc_post_and_mixes, the MoE's then the attention's) with four
    products by lin [H, H] after each (a stand-in sub-layer), the mixes' tail inside the launch or deferred to the
    side stream (the second write-back and the end join it), at any token count (hc_mix.DEFER_MAX_T raised)."""
    from types import SimpleNamespace
    from deepinfer_sg.engine import mhc
    R, y, post, comb, pre, fn, base, scale, y2, (w, eps), lin = s
    c = SimpleNamespace(rms_norm_eps=eps, hc_eps=1e-6, hc_sinkhorn_iters=20, hc_post_mult=2.0)
    blk = SimpleNamespace(config=c, hc_ffn_fn=fn, hc_ffn_base=base, hc_ffn_scale=scale, hc_attn_fn=fn,
                          hc_attn_base=base, hc_attn_scale=scale)
    norm = SimpleNamespace(weight_fp32=lambda: w, eps=eps)

    def sub(x):
        for _ in range(4):
            x = torch.nn.functional.linear(x, lin)
        return x
    was = mhc.DEFER_MIXES, hc_mix.DEFER_MAX_T
    mhc.DEFER_MIXES, hc_mix.DEFER_MAX_T = defer, R.shape[0]
    try:
        R1, ro = mhc.hc_post_and_mixes(blk, "ffn", R, y, post, comb, pre, y2=y2, norm=norm)
        R2, ro2 = mhc.hc_post_and_mixes(blk, "attn", R1, sub(ro.x), ro.post, ro.comb, ro.pre, norm=norm)
        out = sub(ro2.x)
        mhc.join_mixes()
    finally:
        mhc.DEFER_MIXES, hc_mix.DEFER_MAX_T = was
    return R2, out


def _sweep_pdl(bw, l2):
    """Programmatic dependent launch (kernels.backend.PDL) off / on, twice each in this order, for the step's
    small kernels back to back (us per call in one CUDA graph of 16 calls, each kernel's inputs rotating): each
    launch then waits inside for the one before, its launch and scheduling hidden under that one's tail; the
    skinny products beside the GEMM library's (no PDL there) at the mid-size shapes (numbers: the module
    docstring's session 12). Run: K3_SWEEP=pdl python3 benchmarks/kernels.py --only hc --sweep --budget 15."""
    T = S(64, 5)
    jobs = [(f"{name} T={T}", "product", lambda g=g, n=n, k=k, glu=glu: _product_calls(T, g, n, k, glu, l2))
            for name, g, n, k, glu in _mid_products()]
    jobs += [(f"{name} T={t}", "small", lambda name=name, t=t: _small_calls(name, t)) for name, t in (
        ("gate_route", T), ("rmsnorm", T), ("q_norm + kv store", T), ("q_norm + kv store pair", T), ("rope q", T),
        ("ring write+pool", T), ("moe write-back", T), ("write-back chain", T), ("write-back chain deferred", T),
        ("write-back chain", S(8, 3)), ("write-back chain deferred", S(8, 3)),
        ("hc post", S(256, 7)), ("hc mixes", S(256, 7)))]
    for label, kind, make in jobs:
        try:
            calls, nb = make()
            ts = []
            for on in (False, True, False, True):
                with backend.pdl_as(on):
                    ts.append(time_ms(lambda: [c() for c in calls]) / len(calls))
            note = "off / on / off / on " + " / ".join(f"{t * 1e3:.2f}" for t in ts) + " us"
            if kind == "product":
                name, g, n, k, glu = next(p for p in _mid_products() if label.startswith(p[0] + " "))
                lib, _ = _product_calls(T, g, n, k, glu, l2, lib=True)
                note += f"; GEMM library {time_ms(lambda: [c() for c in lib]) / len(lib) * 1e3:.2f} us"
            row("  sweep pdl", label, min(ts[1::2]), None, nb, bw, note)
        except Exception as e:                  # noqa: BLE001 - one case must not end the sweep
            emit(f"  sweep pdl {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
        calls = None


def _moe_variants(T):
    """(label, options) of the MoE sweep at T tokens (V4.1 shape): the kept fp8 default against packed FP4 at its
    default tiles (moe.w4_tiles; the variants measured are in kernels/moe.py's notes). Options: R (block shift
    rows; None: per-row scales only), W4 (packed FP4 bytes), the rest moe_experts_triton's; block_m as the
    384-expert default (warm_moe builds with fewer experts)."""
    bm = moe.default_block_m(T, REAL["K"], REAL["E"])
    fp8 = dict(R=None, block_m=bm, **moe.FP8_TILES)                       # "fp8": FP4 repacked to e4m3
    tiles = moe.w4_tiles(T, REAL["K"], REAL["E"], REAL["F"], DEV)
    fp4 = dict(R=1, W4=True, block_m=bm, **tiles)                          # the CUDA default: FP4 kept packed
    return [("fp8 rows", fp8), ("fp4 packed (w4_tiles, default)", fp4)]


def _moe_case(s, v, cache=None):
    """(inputs, options for moe_experts_triton, twin options, bytes moved) of a sweep variant on fp8 inputs s =
    ((x, ids, weights, w1, w3, w2), row scales) at the V4.1 shape; `cache` (a dict) reuses the inputs of variants
    with the same weight kind (R, W4)."""
    kw = dict(v)
    R = kw.pop("R", None)
    w4 = kw.pop("W4", False)
    key = (R, w4)
    if cache is None or key not in cache:
        (x, ids, wts, w1, w3, w2), sc = s
        E, F, H = w1.shape
        nb, touched = moe_bytes(s[0])
        nb += sum(t.numel() * 4 for t in sc) * touched // E
        scales, shifts, si = sc, None, s[0]
        if R is not None:
            scales, shifts = block_scaled_inputs(s[0], R)
            nb += sum(g.numel() for g in shifts) * touched // E
        if w4:                                   # packed FP4 bytes: half the weight bytes
            si = (x, ids, wts) + tuple(torch.randint(0, 256, (w.shape[0], w.shape[1], w.shape[2] // 2), device=DEV,
                                                     dtype=torch.uint8) for w in (w1, w3, w2))
            nb -= touched * 3 * F * H // 2
        got = si, dict(scales=scales, shifts=shifts, shift_rows=R or 1), nb
        if cache is None:
            return got[0], dict(kw, **got[1]), got[1], got[2]
        cache[key] = got
    si, tw, nb = cache[key]
    return si, dict(kw, **tw), tw, nb


def warm_moe(i: int, n: int):
    """Build the MoE sweep's variants (every n-th from the i-th; run once on the V4.1 H and F with 16 experts:
    the same specialisation, a fraction of the bytes)."""
    H, F, K = REAL["H"], REAL["F"], REAL["K"]

    def jobs():
        for T in (64, 8, 256):
            s = fp8_inputs(T, H, F, 16, K)
            for label, v in _moe_variants(T):
                si, kw, _, _ = _moe_case(s, v)
                yield f"moe T={T} {label}", (lambda si=si, kw=kw: moe.moe_experts_triton(*si, **kw))
    _run_share(i, n, jobs())


def _sweep_moe(bw):
    """Kept-quantized experts at the V4.1 shape: fp8 (the default) against packed FP4 kernels (_moe_variants);
    each row checked against the twin (rel err) and timed."""
    H, F, E, K = REAL["H"], REAL["F"], REAL["E"], REAL["K"]
    for T in S((64, 8, 256), (5,)):
        if _left() < 0:
            emit("  sweep moe: stopped (time)")
            return
        s = fp8_inputs(T, H, F, E, K)
        cache, refs = {}, {}
        for label, v in _moe_variants(T):
            if _left() < 0:
                emit("  sweep moe: stopped (time)")
                break
            try:
                si, kw, tw, nb = _moe_case(s, v, cache)
                a = moe.moe_experts_triton(*si, **kw).float()
                key = (v.get("R"), v.get("W4", False))
                if key not in refs:                     # the twin once per weight kind (seconds at this shape)
                    refs[key] = moe.moe_experts_torch(*si, **tw).float()
                b = refs[key]
                err = float((a - b).norm() / b.norm())
                t = time_ms(lambda: moe.moe_experts_triton(*si, **kw))
            except Exception as e:                      # noqa: BLE001 - one variant must not end the sweep
                emit(f"  sweep moe V4.1 T={T} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            row("  sweep moe", f"V4.1 T={T} {label}", t, None, nb, bw, f"err {err:.0e}")
            a = b = si = None
        s = cache = refs = None
        if not DRY:
            torch.cuda.empty_cache()


@triton.jit
def _read_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """One pass over x (each program sums its block): the time one launch needs to stream these bytes."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + i, mask=i < N, other=0.0), 0))


def read_floor(nbytes: int) -> float:
    """ms for one launch that reads `nbytes` (fp32, 4096 per program) and writes a float per program: the floor
    of any one-pass kernel over the mHC's bytes (launch + DRAM latency + transfer), in a CUDA graph."""
    n = nbytes // 4
    xs = [torch.randn(n, device=DEV) for _ in range(max(1, min(16, (200 << 20) // max(nbytes, 1))))]
    out = torch.empty(triton.cdiv(n, 4096), device=DEV)
    it = iter(range(1 << 30))
    return time_ms(lambda: _read_kernel[(triton.cdiv(n, 4096),)](xs[next(it) % len(xs)], out, n, BLOCK=4096,
                                                                  num_warps=8))


def _hc_cases():
    """(label, kind, T, H, options) of the mHC sweep, most informative first. kind "mix": hc_mixes_triton on R;
    "post": the write-back + next mixes launch (hc_post_mix_triton); "two": the two launches it replaces
    (hc_post_apply, then hc_mixes_triton with the options). Options: the kernels' keywords, and parts=True for
    fn read as its cached bf16 parts (hc_mixes's rule, parts_pay, when not given). tail_form: _finish_block's
    FORM bits (1 early leaving ticket, 2 logits in registers, 4 acquire-load polls); pdl: kernels.backend.PDL
    for the case's launches (programmatic dependent launch off / on in the same run)."""
    H, H2 = S(5120, 64), S(2048, 32)
    T64, T256, T4096 = S(64, 5), S(256, 7), S(4096, 9)
    c = [(f"mixes T={T64} (default form 7)", "mix", T64, H, {}),
         (f"mixes T={T64} form 7 parts", "mix", T64, H, dict(parts=True)),
         (f"mixes T={T64} form 7 waiters 32", "mix", T64, H, dict(waiters=32))]
    c += [(f"{lb} T={T} pdl {int(on)}", kind, T, H, dict(pdl=on)) for T in S((64, 32), (3,))
          for kind, lb in (("two", "two launches"), ("post", "post+mix")) for on in (False, True)]
    c += [(f"mixes T={T} form {f}", "mix", T, H, dict(tail_form=f)) for T in (T256, T4096) for f in (0, 5)]
    for T in S((16, 32, 64), (3,)):
        for h in (H, H2):
            c += [(f"post+mix H={h} T={T}", "post", T, h, {}), (f"two launches H={h} T={T}", "two", T, h, {})]
    c += [(f"post+mix T={T64} {lb}", "post", T64, H, kw) for lb, kw in (
        ("bt16 s128 k64 parts w8", dict(block_t=16, split=128, block_k=64, parts=True, num_warps=8)),
        ("bt16 s64 k64 parts", dict(block_t=16, split=64, block_k=64, parts=True)),
        ("bt16 s128 k32 parts", dict(block_t=16, split=128, block_k=32, parts=True)),
        ("bt32 s128 k32 parts", dict(block_t=32, split=128, block_k=32, parts=True)))]
    return c


def _hc_final_cases():
    """The final round's mHC rows: each default beside session 8's form of it, in the same run (tail form 0, fn
    split in registers at T=64); the rest of the defaults are bench_hc's rows."""
    H, T64 = S(5120, 64), S(64, 5)
    return [(f"mixes T={T64} session 8 (form 0, fn split in registers)", "mix", T64, H, dict(tail_form=0, parts=False)),
            (f"mixes T={T64} default", "mix", T64, H, {}),
            (f"two launches T={T64} session 8 (form 0)", "two", T64, H, dict(tail_form=0, parts=False)),
            (f"two launches T={T64} default", "two", T64, H, {})] + \
        [(f"post+mix T={T} {lb}", "post", T, H, kw) for T in S((8, 16), (3,))
         for lb, kw in (("session 8 (form 0)", dict(tail_form=0)), ("default", {}))]


def _bench_defaults():
    """(label, thunk) of every default launch bench_hc times, for warm() to build first."""
    H, H2 = S(5120, 64), S(2048, 32)
    for T in S((64, 256, 4096), (5,)):
        yield f"mixes T={T} default", (lambda T=T: hc_mix.hc_mixes(*hc_inputs(T, 4, H)))
    for T in S((64, 256), (5,)):
        yield f"post + pre T={T}", (lambda T=T: hc_mix.hc_post_triton(*_apply_inputs(T, 4, H)))
    for T, h in [(T, H) for T in S((8, 16, 64, 256), (5,))] + [(T, H2) for T in S((8, 64), (5,))]:
        yield f"post+mix T={T} H={h} kernel", (lambda T=T, h=h: _post_mix_kernel(_post_mix_inputs(T, 4, h)))
        yield f"post+mix T={T} H={h} two launches", (lambda T=T, h=h: _two_launches(_post_mix_inputs(T, 4, h)))


FINAL = os.environ.get("K3_FINAL") == "1"


def _hc_inputs_for(kind, T, H):
    """((inputs), fn's bf16 parts) of a sweep case."""
    s = hc_inputs(T, 4, H) if kind == "mix" else _post_mix_inputs(T, 4, H)
    return s, hc_mix.split_fn_bf16(s[1] if kind == "mix" else s[5])


def _hc_runner(kind, T, kw):
    """run(inputs, parts) for a sweep case, with kernels.backend.PDL as its option pdl says (default: as set)."""
    kw = dict(kw)
    use = kw.pop("parts", hc_mix.parts_pay(T))
    pdl = kw.pop("pdl", backend.PDL)
    run = _hc_launches(kind, use, kw)

    def with_pdl(s, p):             # (set at every call: the sweep's graphs capture the launches as set here)
        with backend.pdl_as(pdl):
            return run(s, p)
    return with_pdl


def _hc_launches(kind, use, kw):
    """run(inputs, parts) of a sweep case's launches (kw: the kernels' keywords)."""
    if kind == "mix":
        return lambda s, p: hc_mix.hc_mixes_triton(*s, fn_parts=p if use else None, **kw)
    if kind == "post":
        return lambda s, p: hc_mix.hc_post_mix_triton(*s, fn_parts=p if use else None, **kw)

    def two(s, p):
        out, x = hc_mix.hc_post_apply(*s[:5])
        return out, x, hc_mix.hc_mixes_triton(out, *s[5:], fn_parts=p if use else None, **kw)
    return two


def _run_share(i: int, n: int, jobs):
    """Run every n-th of the (label, thunk) jobs from the i-th, untimed, printing each one's time (mostly the
    kernels' build): n such processes beside a timed sweep fill Triton's disk cache ahead of it."""
    for k, (label, job) in enumerate(jobs):
        if k % n != i:
            continue
        t0 = time.time()
        try:
            job()
            torch.cuda.synchronize()
            print(f"warm {label}: {time.time() - t0:.1f} s", flush=True)
        except Exception as e:                      # noqa: BLE001
            print(f"warm {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


def warm(i: int, n: int):
    """Build the mHC sweep's cases (every n-th from the i-th) by running each once on its real shape (building
    is most of the sweep's time: ~3 s per variant)."""
    def jobs():
        for label, kind, T, H, kw in _hc_final_cases() if FINAL else _hc_cases():
            yield label, (lambda kind=kind, T=T, H=H, kw=kw: _hc_runner(kind, T, kw)(*_hc_inputs_for(kind, T, H)))
        if FINAL:
            yield from _bench_defaults()
    _run_share(i, n, jobs())


def report_builds():
    """Registers and spilled bytes of every mHC kernel build this process ran (the real launches' builds: the
    --compile-check builds lack the launch's integer specialisations and report spills these do not have)."""
    for fn in (hc_mix._hc_fused_kernel, hc_mix._hc_post_mix_kernel):
        names = fn.arg_names
        for caches in getattr(fn, "device_caches", {}).values():
            for k in list(caches[0].values()):
                try:
                    k._init_handles()
                    consts = getattr(k.src, "constants", {})
                    shown = {names[key[0]] if isinstance(key, tuple) else key: val for key, val in consts.items()}
                    tiles = " ".join(f"{c}={shown[c]}" for c in ("BT", "BK", "SPLIT", "MODE", "NW", "TPW", "PF", "FORM")
                                     if c in shown)
                    emit(f"# build {fn.__name__} {tiles} warps={k.metadata.num_warps}: {k.n_regs} registers, "
                         f"{k.n_spills} spilled")
                except Exception as e:              # noqa: BLE001 - a report line must not end the sweep
                    emit(f"# build {fn.__name__}: {type(e).__name__}: {str(e)[:120]}")


def _hc_bytes(kind, T, H):
    """The fewest bytes of a case: R once and fp32 fn once (mixes); R, R', y, x and fn (the write-back + mixes)."""
    return T * 4 * H * 2 + 24 * 4 * H * 4 if kind == "mix" else _post_mix_bytes(T, 4, H)


def _hc_case_err(kind, got, s):
    """(relative error of R' / x, largest absolute error of the mixes) against the twins."""
    if kind == "mix":
        ref = hc_mix.hc_mixes_torch(*s)
        return 0.0, max(float((u - v).abs().max()) for u, v in ((got.pre, ref.pre), (got.post, ref.post),
                                                               (got.comb, ref.comb)))
    return post_mix_err(got, s)


def _sweep_hc(bw, l2, one):
    """The mHC cases (_hc_cases) at decode sizes; `read floor`: one launch streaming the same bytes."""
    floors = {}
    for label, kind, T, H, kw in _hc_final_cases() if FINAL else _hc_cases():
        if _left() < SWEEP_S * HC_SHARE_LEFT:
            emit("  sweep hc: stopped (time)")
            break
        try:
            nb = _hc_bytes(kind, T, H)
            if nb not in floors:
                floors[nb] = one if DRY else read_floor(nb)
            run = _hc_runner(kind, T, kw)
            nxt = rotating(lambda: _hc_inputs_for(kind, T, H), nb * 1.5, l2)
            s, parts = nxt()
            rel, err = _hc_case_err(kind, run(s, parts), s) if not kw.get("only_partial") else (0.0, 0.0)
            for _ in range(16):
                run(*nxt())
            t = time_ms(lambda: run(*nxt()))
        except Exception as e:                      # noqa: BLE001 - one variant must not end the sweep
            emit(f"  sweep hc {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        row("  sweep hc", label, t, None, nb, bw,
            f"err {rel:.0e} / {err:.0e}; {floors[nb] / t:.0%} of the read floor ({floors[nb] * 1e3:.1f} us)")
        nxt = s = parts = None
    if not DRY:
        report_builds()


def _apply_inputs(T, M, H):
    """(R, y, post, comb, next_pre) of the write-back pass: random, never zeros."""
    return (torch.randn(T, M, H, device=DEV, dtype=torch.bfloat16), torch.randn(T, H, device=DEV, dtype=torch.bfloat16),
            torch.rand(T, M, device=DEV) * 2, torch.rand(T, M, M, device=DEV), torch.rand(T, M, device=DEV))


# (label, block_t, split, block_k, mode (1: fn split in registers, 2: bf16 parts), warps, y2, read-out norm form)
# built by --compile-check (its builds lack the launches' integer specialisations: report_builds prints the real
# ones)
POST_MIX_BUILDS = (("bt16 s64 k64", 16, 64, 64, 1, 4, False, 0), ("bt16 s128 k64", 16, 128, 64, 1, 4, False, 0),
                   ("bt16 s128 k64 parts", 16, 128, 64, 2, 4, False, 0),
                   ("bt16 s64 k64 y2 norm", 16, 64, 64, 1, 4, True, 2),
                   ("bt16 s128 k64 parts y2 norm1", 16, 128, 64, 2, 4, True, 1))


def compile_cases():
    """(name, kernel, extra pointer types, constexprs, warps) for kernels.py --compile-check."""
    desc_t = dict(w1_desc="constexpr", w3_desc="constexpr", w2_desc="constexpr")
    fused = dict(M=4, NZP=32, PRECISION="ieee", UPCAST=False, ITERS=20, FAST=True, TAIL=True, PF=True, FORM=7)
    fz = dict(r_ptr="*bf16", cnt_ptr="*i32", norm_eps="fp32", hc_eps="fp32", post_mult="fp32")
    cases = [
        ("moe align", moe._align_kernel, dict(ids_ptr="*i64", slot_pair_ptr="*i32", block_expert_ptr="*i32"),
         dict(BM=16, EP=64, CH=512), 4),
        ("moe gate/up pointers", moe._gate_up_kernel, dict(desc_t, slot_pair_ptr="*i32", block_expert_ptr="*i32"),
         dict(BM=16, BN=64, BK=128, F32=False, TMA=False, FP8=False, w1_desc=None, w3_desc=None), 4),
        ("moe gate/up bk64 w8", moe._gate_up_kernel, dict(desc_t, slot_pair_ptr="*i32", block_expert_ptr="*i32"),
         dict(BM=16, BN=64, BK=64, F32=False, TMA=False, FP8=False, w1_desc=None, w3_desc=None), 8),
        ("moe gate/up bm64", moe._gate_up_kernel, dict(desc_t, slot_pair_ptr="*i32", block_expert_ptr="*i32"),
         dict(BM=64, BN=64, BK=128, F32=False, TMA=False, FP8=False, w1_desc=None, w3_desc=None), 4),
        ("moe down pointers", moe._down_kernel,
         dict(desc_t, y_ptr="*fp32", slot_pair_ptr="*i32", block_expert_ptr="*i32"),
         dict(BM=16, BN=64, BK=128, F32=False, TMA=False, FP8=False, w2_desc=None), 4),
        ("moe gate/up tma", moe._gate_up_kernel, dict(slot_pair_ptr="*i32", block_expert_ptr="*i32",
                                                      w1_desc="tensordesc<bf16[64,128]>",
                                                      w3_desc="tensordesc<bf16[64,128]>"),
         dict(BM=16, BN=64, BK=128, F32=False, TMA=True, FP8=False), 4),
        ("moe down tma", moe._down_kernel, dict(y_ptr="*fp32", slot_pair_ptr="*i32", block_expert_ptr="*i32",
                                                w2_desc="tensordesc<bf16[64,128]>"),
         dict(BM=16, BN=64, BK=128, F32=False, TMA=True, FP8=False), 4),
        ("moe gate/up fp8 R=1", moe._gate_up_kernel, dict(slot_pair_ptr="*i32", block_expert_ptr="*i32",
                                                         w1_desc="tensordesc<fp8e4nv[128,32]>",
                                                         w3_desc="tensordesc<fp8e4nv[128,32]>", g1_ptr="*u8",
                                                         g3_ptr="*u8"),
         dict(BM=16, BN=128, BK=32, F32=False, TMA=True, FP8=True, CD=tl.float16, GS=True, GR=1, PF=True), 8),
        ("moe gate/up fp8 rows", moe._gate_up_kernel, dict(slot_pair_ptr="*i32", block_expert_ptr="*i32",
                                                           w1_desc="tensordesc<fp8e4nv[128,128]>",
                                                           w3_desc="tensordesc<fp8e4nv[128,128]>"),
         dict(BM=16, BN=128, BK=128, F32=False, TMA=True, FP8=True, CD=tl.float16, GS=False, GR=1), 8),
        ("moe down fp8 R=1", moe._down_kernel, dict(y_ptr="*fp32", slot_pair_ptr="*i32", block_expert_ptr="*i32",
                                                    w2_desc="tensordesc<fp8e4nv[128,32]>", g2_ptr="*u8"),
         dict(BM=16, BN=128, BK=32, F32=False, TMA=True, FP8=True, CD=tl.float16, GS=True, GR=1), 8),
        ("moe w4 gate/up", moe._w4_gate_up_kernel, dict(slot_pair_ptr="*i32", block_expert_ptr="*i32",
                                                        w1_desc="tensordesc<i32[128,16]>",
                                                        w3_desc="tensordesc<i32[128,16]>", g1_ptr="*u8", g3_ptr="*u8"),
         dict(BM=16, BN=128, BK=128, TMA=True, F32=False, GR=1), 4),
        ("moe w4 down", moe._w4_down_kernel, dict(y_ptr="*fp32", slot_pair_ptr="*i32", block_expert_ptr="*i32",
                                                  w2_desc="tensordesc<i32[128,16]>", g2_ptr="*u8"),
         dict(BM=16, BN=128, BK=128, TMA=True, F32=False, GR=1), 4),
        ("moe combine", moe._combine_kernel, dict(out_ptr="*bf16"), dict(K_TOP=6, BH=1024), 4),
        ("hc T<=128 bt64 s256", hc_mix._hc_fused_kernel, fz,
         dict(fused, BT=64, BK=128, SPLIT=256, MODE=1, NW=64, TPW=1, SPC=128), 4),
        ("hc T<=256 parts", hc_mix._hc_fused_kernel, dict(fz, fn_ptr="*bf16"),
         dict(fused, BT=64, BK=128, SPLIT=512, MODE=2, NW=40, TPW=2, SPC=64), 4),
        ("hc prefill parts", hc_mix._hc_fused_kernel, dict(fz, fn_ptr="*bf16"),
         dict(fused, BT=128, BK=64, SPLIT=2048, MODE=2, NW=1, TPW=128, SPC=2, PF=False), 8),
        ("hc post + pre", hc_mix._hc_post_kernel, dict(r_ptr="*bf16", y_ptr="*bf16", y2_ptr="*bf16", out_ptr="*bf16",
                                                       x_ptr="*bf16"), dict(M=4, BH=256, PRE=True, Y2=True), 1),
    ]
    pm = dict(NZP=32, UPCAST=False, ITERS=20, FAST=True, SPC=32, TAIL=True, FORM=7)
    pz = dict(r_ptr="*bf16", y_ptr="*bf16", y2_ptr="*bf16", out_ptr="*bf16", x_ptr="*bf16", cnt_ptr="*i32",
              norm_eps="fp32", hc_eps="fp32", post_mult="fp32", x_eps="fp32")
    for label, bt, sp, bk, mode, w, y2, norm in POST_MIX_BUILDS:
        cases.append((f"hc post+mix {label}", hc_mix._hc_post_mix_kernel,
                      dict(pz, fn_ptr="*bf16") if mode == 2 else pz,
                      dict(pm, BT=bt, BK=bk, SPLIT=sp, MODE=mode, NW=bt, TPW=1, Y2=y2, NORM=norm, NSP=128), w))
    return cases    # (kernels.py builds the constexprs a case leaves out at their defaults)


if __name__ == "__main__":          # python benchmarks/kernels_moe.py warm I N  (see warm())
    import sys
    if sys.argv[1:2] == ["warm"]:
        warm(int(sys.argv[2]), int(sys.argv[3]))
    if sys.argv[1:2] == ["warm_moe"]:
        warm_moe(int(sys.argv[2]), int(sys.argv[3]))
