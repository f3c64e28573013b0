"""Model forward: decode step time, reference path vs batched fast path, against the memory-bandwidth roofline.

    python benchmarks/model_forward.py                       # CPU, spec §6.1 tiny V4.1 config, fp32
    python benchmarks/model_forward.py --config midsize --device cuda --dtype bf16 --batches 1 8 32 64
    python benchmarks/model_forward.py --checkpoint DIR --device cuda --dtype bf16   # a write_checkpoint folder

Per batch size: one prefill step (every sequence's random prompt), then `--decode` timed decode steps (after
`--warmup` untimed ones; the median step is reported) per path from the same caches: first the per-sequence reference path
(`model.fast_decode = False`), then, after rolling the caches back, the batched fast path with the kernels
(`fast_decode = True`) fed the same tokens, so the two runs do the same work and their logits are compared
(max |diff| / max |logit|); then the same fast path with its dense segments as CUDA graphs (`cuda_graphs = True`,
engine/step_graphs.py; the first warm-up step at a batch size runs eager, the second captures) compared with the
eager fast path (max |diff|: "exact" when bit for bit equal); "ahead": the graphs path with each step planned while
the device runs the previous one (Model.plan_step / launch, as engine/step_pipeline.py does; step time = the period
between two steps' ends; printed with the device time of the last step's graphs replayed back to back: the step
without its host gaps, then a "host" line (the host ms of launch, split at the graph run, and of the overlapped
plan; the device ms from the first graph launch to the end of the last, by CUDA events: the step's graphs as they
ran, their launch latency included; each timed step's period) and a "parts" line (host ms of named engine
functions, `_time_launch_parts`); the caches are
copied before those replays and put back after, and the line says whether the replays changed them: "unchanged",
"unchanged but the dump rows" (only the row arenas' dump rows differ: benign, see `graphs_back_to_back`) or
"CHANGED" with the rows that differ),
"exact" vs eager; "unstacked": the graphs path with one GEMM per attention-norm projection
(model.stack_projections = False, engine/projections.py), vs the fast path; "rope-apart": the graphs path with RoPE
in launches of its own (model.fused_rope = False), vs the fast path; "routes" (only when named, after "reference"):
the eager fast path with the reference run's MoE routes forced (engine/routes.py), vs the reference, with the
number of route choices that differed ("flips"): what is left of the difference is rounding; the ablations (only
when named; `ABLATIONS`): the ahead path with one engine choice changed for its duration, vs the fast path:
"torch-gate" (the MoE gates' GEMM, then their tail as torch ops, instead of kernels.router.gate_route),
"gemm-gate" (the GEMM, then kernels.router's tail), "torch-shared" (the shared experts' front half as torch ops
instead of kernels.skinny), "serial-shared" (the shared experts after the routed ones on one stream, not beside
them on a second: engine/streams.py), "host-engram" (the Engram rows looked up on the host, the graph cut before
each Engram layer, instead of gathered by the device from the pinned tables), "no-pdl" (every kernel launched
without programmatic dependent launch: kernels.backend.PDL off, as DEEPINFER_SG_PDL=0 does for a process),
"launch-send" (the step's upload sent at launch with the token ids in it: model.send_ahead off),
"control" (nothing changed: the drift between paths of one run), "cprofile" (the same under cProfile: the host
functions of the timed steps' launch + plan by own time, $OUT/cprofile_ahead_B<batch>.txt; its times are the
profiler's, not the engine's); with
--fused-mhc also the graphs path with the other mHC setting than the engine's default (model.fused_mhc;
"unfused" or "fused", vs the reference).
Printed per path: step time, tokens/s, the bytes one step must read (dense weights + the routed experts hit in that
step + the KV caches) and the roofline = measured read bandwidth / bytes per
step, i.e. the speed of a perfect memory-bound implementation; plus the fast path's speed-up. After each batch:
the device bytes the window slab and row arenas reserve against the rows in use (engine/arena.py).
The header says whether PDL is on (kernels.backend.PDL); with --pdl-census a "pdl" line after each path counts the
launches of each kernel that takes a PDL flag, with it on and off (`pdl_census`: eager and capture steps; replays
are not seen; its hooks cost the eager paths a Python call per Triton launch, so it is off by default).
With OUT set, the table is also written to $OUT/model_forward.txt.

Session 12 (H200, mid-size V4.1, fp4 experts, --decode 13 --warmup 3 --prompt 32, paths ahead + no-pdl + a temporary
"unfolded" path that ran the engine's launches as the session began; each round one process; ms: step / graphs back
to back). Session start (V1): b8 3.82 / 3.63, b64 4.99 / 4.51, b256 8.19 / 7.57.
  R1: PDL on 3.50 / 3.28, 4.48 / 4.15, 12.55 / 7.07; PDL off 3.88 / 3.58, 4.81 / 4.42, 11.39 / 7.23; unfolded (PDL
      on) 3.56 / 3.34, 4.69 / 4.27, 8.81 / 7.38 (b256: the host's plan, 5.9-9.3 ms, longer than the device's step,
      so its steps timed the host; DEEPINFER_SG_PDL=0 in a second process: b64 4.75 / 4.38, as "no-pdl");
  R2: PDL on 3.50 / 3.25, 4.68 / 4.16, 7.77 / 7.13; off 3.74 / 3.54, 4.76 / 4.43, 7.96 / 7.32; unfolded 3.51 / 3.31,
      4.57 / 4.23, 7.89 / 7.34 (the PDL-on path then also sent the upload at plan time: deleted, engine/model.py);
  R3 (the final code): PDL on b64 4.68 / 4.16 (36.3% of the roofline), b256 7.94 / 6.38; off b64 4.80 / 4.40 (35.4%).
PDL takes 0.16-0.30 ms off the device's step (back to back) at every batch; the folded launches 0.06-0.31 ms.

Session 13, the host's per-sequence work (H200, same command, paths ahead + a "base" ablation with HEAD's host
functions swapped in + control, one process per round; ms step / graphs back to back; host ms launch after the graph
run + plan): R2 b256 base 9.31 / 6.12 (1.86 + 6.77), ahead 6.79 / 6.06 (1.10 + 5.02), control 6.83 / 5.99 (1.08 +
5.10); b64 base 4.36 / 3.96, ahead 4.23 / 3.85, control 4.31 / 3.97; b8 3.42 / 3.38 / 3.41. R3 (a faster host):
b256 base 6.95 / 6.00 (1.24 + 5.05), ahead 6.81 / 5.99 (1.08 + 4.64), control 6.83 / 6.00 (1.11 + 4.88); b64 4.29 /
3.92, 4.19 / 3.81, 4.26 / 3.92; b8 3.50 / 3.19, 3.41 / 3.20, 3.48 / 3.20. At 256 the plan and the launch's tail
had outgrown the device step in R2: the plan's compressor snapshot (0.67-0.92 ms, R1) is now the undo log
compress_step.plan_layer writes while it reads the states anyway; the arenas and rings set every state's row tuples
by C-level maps and skip the rows-elsewhere check when each state still holds what they gave it last
(arena.RowArena.give / kept then; session 14's per-slot arrays since); Model._advance and the Engram windows read
the caches' recent tokens by comprehensions (R2 / R3 at 256: advance 1.03 / 0.76 -> 0.68-0.71 ms, the plan's
Engram windows 0.42 / 0.31 -> 0.21); a segment's input shapes and graph key are kept while its inputs are the
same objects (R3 0.43 -> 0.30 ms). What plan_layer's
share alone did is not settled: 2.99-3.17 against 3.45 ms (R2), 2.76-2.88 against 2.33 plus the
snapshot (R3). The paths' logits are copied into one buffer per path after each step and the step's own freed
(kept, every launch's fresh fp32 logits [T, V] needed a new device block: R1's `.to` calls cost the host 5-7 ms over
13 steps, R2's 1 ms).

Session 14, the host's per-sequence state in arrays (H200, same command, paths ahead / "base" (HEAD's compressor
and token host functions swapped in, upload sent at launch) / "launch-send" / control in one process; ms step /
device; host ms launch after the graph run + plan). The compressors' rows as per-arena count / first-row arrays
(cache.ArenaRows, arena.RowArena.held / update: a steady step reads and sets no state attribute) and the window
slab's lo / hi arrays (WindowSlab.held): plan: compressors at 256 1.00-1.16 ms against base 2.58 (R1), 1.22-1.30
against 2.88 (R2); the whole plan 2.51-2.80 against 4.36 (R1), 2.99-3.09 against 4.78 (R2); at 64 0.48-0.53 against
0.74 (R1). R1's host kept every path's step off the host at 256 (6.71-6.82 ms, device 5.97); in R2 a slow phase of
the host (the first paths at 64) made base host-bound: step 5.02 ms (plan 3.48 + 0.96 after the graph run against
4.07 of device) against ahead's 4.53 in the same phase (plan 2.48 + 0.91): what V1's b64 5.43 / 3.85 was (its
PDL-off process on a faster phase: 4.56 / 4.17). Windows (cross-round): commit windows at 256 0.10-0.14 -> 0.05-0.07
ms, plan: windows 0.14-0.18 -> 0.10-0.12. The step's remaining gap to the device is the launch until the graph runs
(0.19-0.22 ms at 64, 0.36-0.45 at 256) plus the graph's own launch latency (its device time as run, by events,
4.07 / 6.08-6.12 ms against 3.95 / 5.82-6.00 replayed back to back). The upload sent at the end of plan_step with
the ids copied in by the first graph (model.send_ahead) against "launch-send" (R2): before the graph run 0.19 vs
0.22 ms at 64, 0.36 vs 0.45 at 256; step 4.30 vs 4.34, 6.58 vs 6.64 (control; ahead 6.60). A pinned -> device copy
alone costs the host ~10 us at 3-94 KB (R1, .round copy test), yet "send: pinned copy" measures 0.05-0.15 ms.
R3 (the final code, with the session's kernels, K2's window rows / RoPE inside attention and the q_norm + kv store
pair; paths fast / ahead / base / launch-send; a slower host): b256 ahead 6.50 ms (25.9% of the roofline; device
5.98 as run, 5.81 back to back; "exact" against the eager fast path), base 7.26 (host-bound: plan 5.34 + 1.21 after
the graph run, compressors 3.26 against ahead's 1.48), launch-send 6.55; b64 ahead 4.08 (39.9%; device 3.76 / 3.63),
base 4.39, launch-send 4.31; before the graph run 0.27 / 0.40 ms at 64 / 256 against launch-send's 0.44 / 0.48.

Session 15, the recent token ids in a ring of per-slot arrays and plan_step's rows by numpy (H200, same command; one
process a round, paths ahead / "base" / control; "base": HEAD's model, batched, compress_step, arena and cache
loaded as a second package in the process and the model's class switched to its Model for the path,
.round/data/E/ab2.py; ms step / device as run; host ms launch + plan). engine/token_ring.py: a steady step's advance
writes the new ids in place and the ring's per-slot arrays, the Engram windows index the ring by position; plan_step
checks and reads the rows' numbers by numpy (BatchPlan.arrays kept for every layer), plan_layer reads the states
through two C-level maps. At 256: advance 0.57 -> 0.11-0.13 ms (R1), 0.84 -> 0.12-0.13 (R2); launch after the
graph run 0.92 -> 0.47-0.60 (R1), 1.54 -> 0.51-0.52 (R2); plan 3.07 -> 2.70-2.76, its compressors 1.43 ->
1.14-1.17, Engram windows 0.26 -> 0.16 (R2); the host's whole step (launch + plan) 5.17 -> 3.65-3.73 ms against
6.05-6.14 of device (R2): a host 1.6x slower than R2's stays under the device, where base's passed it at 1.2x (V1's
host was 1.5x slower: 8.13 ms against 5.71 of device). Steps at 256: R1 6.68 / base 6.64 / control 6.68 (device
6.17-6.25: no path host-bound), R2 6.54 / base 6.71 (its last steps 7.0-7.3: host-bound in a slower phase) /
control 6.60; at 64 (R1) 4.68 / 4.62 / 4.56 (device 4.28-4.30; advance 0.43 -> 0.06-0.09). R3 (batch 64, then 256):
64 ahead 4.09 / base 4.04 / control 4.06 (device 3.79 as run), after the graph run 0.36-0.39 against 0.62, advance
0.06 against 0.31, plan 1.65-1.77 against 1.65; 256 ahead 6.54 / base 6.48 / probe 6.48 (device 5.98-6.00), after
the graph run 0.51-0.56 against 1.11, advance 0.14-0.16 against 0.72, plan 3.01-3.30 against 3.40 (its compressors
1.37-1.61 against 1.41: no settled gain there; the first path after the eager one was the slow one in R1 too).
R4 at 8: ahead 3.34 / base 3.33 / control 3.32 (device 3.07 as run), after the graph run 0.38-0.40 against 0.59,
advance 0.06 against 0.25, plan 1.95-1.98 against 2.04.
Where "send: pinned copy" goes (R2, host clocks around each call, the "probe" path): the plan's copy_ 53.5 us and
its event record 43.4, where the same calls repeated right after took 13.7 and 2.6 (torch.cuda.current_stream()
alone 8.3): the first driver calls after the plan's ~3 ms of Python run on cold host caches; no gc collection ran in
the timed steps. With torch.Events for the copies (step_graphs.copy_event, R3) the record took 4.1-6.0 us at
64 / 256 and the next call paid the cold start (current_stream() 25.7-37.9); send: pinned copy 0.05 / 0.07 ms
(R1-R2 0.08-0.11). The launch until the segments (0.18-0.19 ms at 256): 81 us to its ids check, 19 in wait_done's
event query, the segments entered at 190.

Session 16, the launch until the step's graph runs (H200, same command at batch 64; one process a round, paths
ahead / "base" (HEAD's model, batched and step_graphs loaded as a second package, .round/data/E/ab.py) / "probe"
(host clocks inside launch) / control; both rounds in a slow phase of the host: plan 3.0-3.4 ms where session 15 R3
measured 1.65-1.77). The step ends with the device and its period is the launch until the graph runs plus the graphs
as run: the host's work after the graph run and the plan overlap the device. R1 probe (the engine as at HEAD): the
graph launched 405 us after launch's call (ids checked at 82-188 us, the segments' loop entered at 233,
`_run_segment` at 249, SegmentGraphs.run at 350), its cudaGraphLaunch then held the host 69 us; the events around
the graph run were recorded with torch.cuda.Event.record(), which asks torch.cuda.current_stream() first (25-38 us
in session 15's probe, not the engine's): now on the stream fetched once. The step's first graph replayed as
prepared by plan_step (Model._prepare_first, SegmentGraphs.prepare: launch writes the ids into their host buffer and
replays it, the inputs' resolving and identity check done at plan time), R2: before the graph run 0.28-0.29 ms
against base's 0.39, the graph runs as timed by the device 3.79 against 3.84, after the graph run 0.58-0.60 against
0.68 (the layers that select, batched.select_layers, known once), step 4.34 / control 4.39 against base 4.56 ms
(37.5% of the roofline against 35.7%); base's logits equal bit for bit. A fixed Python loop timed around the launch
(probe) took 86 us before it, 78 after it and 83 after the plan: no slower start after the wait for the device, the
host was slow throughout. With the prepared replay "of it to the segments" (the segments' loop entered) comes after
the graph run. R3 (the final code, batch 8, paths ahead / base / "lines" (a line tracer on launch) / control): step
3.22 / control 3.24 against base 3.33 ms (34.8% of the roofline against 33.4%), before the graph run 0.13 against
0.19 ms, the graph runs as timed by the device 3.05-3.07 against 3.10 (back to back 3.02-3.03), after the graph run
0.33-0.34 against 0.41; base's logits equal bit for bit. What is left before the graph run (R3's tracer, its own
cost in each line): the plan's state set through nn.Module.__setattr__ 28 us, the ids' range check 34, the model's
device 12, the graph launch 31 inside a replay_ready of 66.

`--profile` then looks at where one fast decode step's time goes, per batch size (fresh caches, after warm-up;
every batch's host-clock and cProfile measurements first, then the torch.profiler ones: once CUPTI is attached it
stays, and a CUDA-graph launch then costs the host ~0.3-1 ms instead of ~0.01-0.04, which made the step's one
launch look like ~1 ms of host time in session 5):
host time (until forward_step returns) vs the whole step (after a device sync), the device's kernel busy time, the
number of kernel launches, graph launches, host->device copies and synchronizations (torch.profiler, CPU + CUDA
activity; tables sorted by self CPU time in $OUT/profile_B<batch>.txt), where the device waited inside the step
(gaps between its kernels: `device_gaps`), the synchronizing calls that
`torch.cuda.set_sync_debug_mode("warn")` reports (with the Python line), and a cProfile of 3 steps
($OUT/cprofile_B<batch>.txt), and the device time per torch op and input shapes of one eager step
($OUT/ops_<mode>_B<batch>.txt: graph replays hide the ops).

Random weights are built on the target device (no CPU-side init); Engram tables, which live on the host by
design, are tiled from a small random block so building them stays fast.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import collections
import io
import os
import pstats
import statistics
import time
import warnings
from pathlib import Path

import torch

from deepinfer_sg.engine.config import ModelConfig
from deepinfer_sg.engine.model import Model, StepChunk
from deepinfer_sg.engine.step_graphs import run_key

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure_bandwidth(dev: torch.device) -> float:
    """Bytes/s of a large read (sum over a buffer much larger than the caches)."""
    n = (1 << 28) if dev.type == "cuda" else (1 << 26)   # 1 GiB / 256 MiB of fp32
    x = torch.ones(n, device=dev)
    x.sum(); _sync(dev)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter(); x.sum(); _sync(dev)
        best = min(best, time.perf_counter() - t)
    del x
    return n * 4 / best


def _config(args) -> dict:
    from deepinfer_sg.engine import testing
    over = {"engram_layer_ids": []} if args.no_engram else {}
    if args.config == "tiny":
        return testing.tiny_v41_config(**over)
    if args.config == "midsize":
        return testing.midsize_v41_config(**over)
    raise SystemExit(f"unknown --config {args.config}")


def _tiled_engram_table(rows: int, head_dim: int):
    """A random FP8 engram table of `rows` rows made by tiling 4096 random rows (fast for 10^6+ rows)."""
    from deepinfer_sg.engine.engram import EngramTable, quantize_rows_fp8
    w, s = quantize_rows_fp8(torch.randn(4096, head_dim))
    reps = -(-rows // 4096)
    w = w.view(torch.uint8).repeat(reps, 1)[:rows].view(torch.float8_e4m3fn)
    return EngramTable.from_tensors(w, s.repeat(reps, 1)[:rows])


def build(args) -> Model:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.checkpoint:
        from deepinfer_sg.engine.loader import load_model
        return load_model(args.checkpoint, device=args.device, dtype=dtype)
    cfg = ModelConfig.from_dict(_config(args))
    torch.manual_seed(0)
    from deepinfer_sg.engine.loader import skip_init
    import deepinfer_sg.engine.engram as engram_mod
    saved = getattr(engram_mod, "MAX_RANDOM_TABLE_ELEMENTS", None)
    if saved is not None:
        engram_mod.MAX_RANDOM_TABLE_ELEMENTS = 0   # no CPU-side random tables at construction; tiled below
    try:
        with skip_init(dtype=dtype):
            m = Model(cfg, dtype=dtype, device=args.device)
    finally:
        if saved is not None:
            engram_mod.MAX_RANDOM_TABLE_ELEMENTS = saved
    with torch.no_grad():   # small random weights so activations stay finite through the layers
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("_scale", "q_weight", "k_weight")):
                p.fill_(1.0)
            elif name.endswith(("_base", "attn_sink", "gate.bias", "ape")):
                p.zero_()
            else:
                p.normal_(0, 0.02)
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):   # hash routing: spread tokens over the experts
                E = m.config.n_routed_experts
                b.copy_((torch.arange(b.shape[0], device=b.device)[:, None] * 7
                         + torch.arange(b.shape[1], device=b.device)[None, :] * 13) % E)
    experts = args.experts
    if experts == "auto":       # what load_model does with a real checkpoint (FP4 experts) on this device
        from deepinfer_sg.engine import loader
        experts = getattr(loader, "CUDA_EXPERT_DTYPE", "bf16") if torch.device(args.device).type == "cuda" else "bf16"
    if experts != "bf16":       # FP4-rounded as the real checkpoint stores them, kept as the loader keeps them
        from deepinfer_sg.engine.moe import quantize_routed_experts
        quantize_routed_experts(m, experts)
    m.experts_kind = experts
    if hasattr(m, "fused_rope"):
        m.fused_rope = args.fused_rope == "on"
    for blk in m.layers:
        eng = getattr(blk, "engram", None)
        if eng is not None and getattr(eng, "table", None) is None:
            eng.table = _tiled_engram_table(eng.num_rows, eng.spec.head_dim)
    return m.eval()


class ExpertCounter:
    """Records each layer's routed expert ids of a step (no sync while timing); counted afterwards."""

    def __init__(self, model: Model):
        self.ids = {}
        for i, blk in enumerate(model.layers):
            blk.ffn.gate.register_forward_hook(lambda mod, a, out, i=i: self.ids.__setitem__(i, out[1]))

    def hits(self) -> dict:
        return {i: int(torch.unique(t).numel()) for i, t in self.ids.items()}


def weight_bytes(model: Model) -> tuple[int, list[int]]:
    """(bytes of everything except routed experts and the embedding table, bytes of one routed expert per layer)."""
    dense, per_expert = 0, []
    for name, p in model.named_parameters():
        if ".ffn.experts." in name or name == "embed.weight" or name.startswith("mtp."):
            continue
        dense += p.numel() * p.element_size()
    for blk in model.layers:
        kept = getattr(blk.ffn, "kept", None)
        if kept is not None:     # routed experts kept quantized (fp8 / packed fp4 stacks + scales)
            per_expert.append(kept.nbytes() // len(blk.ffn.experts))
            continue
        e = blk.ffn.experts[0]
        per_expert.append(sum(p.numel() * p.element_size() for p in e.parameters()))
    return dense, per_expert


def decode_run(model, caches, toks_per_step, dev, counter, dense, per_expert, warmup, ahead=False, prof=None):
    """Run the given token steps; -> (median timed step s, mean bytes per step, logits of every step).
    ahead: plan each step while the device runs the one before (Model.plan_step / launch), as an engine loop
    would: launch(n) -> plan(n+1) -> wait for step n; the step time is then the period between two steps' ends
    (the planning of a step overlaps its predecessor; the benchmark's own bookkeeping between steps, ~13 ms at
    batch 64, is left out), and `decode_run.host_ms` holds the median host time of launch (the token-dependent
    half) and of plan_step (overlapped). prof: a cProfile.Profile enabled around the timed steps' launch + plan."""
    times, bytes_, logits, all_times, experts = [], [], [], [], []
    if ahead:
        from deepinfer_sg.engine.model import StepRows
        rows = [StepRows(c, 1, 1) for c in caches]
        marks = []     # (time the step's graph run starts, ends): splits launch into before / in / after the replay
        g = model._graphs
        real_run = g.run

        keys = []      # the segments the last step ran (graphs_back_to_back replays them)
        # events around the step's graph runs (CUDA): the device time of the step as it ran, its launch latency in it
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
        # (recorded on this stream, fetched once: Event.record() alone asks torch.cuda.current_stream(), 25-38 us of
        # the host's launch before the graph run in session 15's probe, which the engine itself does not spend)
        stream = torch.cuda.current_stream() if ev is not None else None
        graph_ms = []

        def timed(real, key_of):
            def call(*a, **k):
                if ev is not None and not marks:
                    ev[0].record(stream)
                t = time.perf_counter()
                out = real(*a, **k)
                marks.append((t, time.perf_counter()))
                if ev is not None:
                    ev[1].record(stream)
                keys.append(key_of(*a, **k))     # (the key SegmentGraphs keeps the segment under)
                return out
            return call
        g.run = timed(real_run, lambda key, *a, pre=None: run_key(key, pre))
        if hasattr(g, "replay_ready"):      # (a graph replay prepared at plan time: SegmentGraphs.prepare)
            g.replay_ready = timed(g.replay_ready, lambda ready: ready.key)
        real_layers = model._layers_fast
        entered = []   # when launch reaches the segments (its checks and id handling done)

        def layers_fast(*a, **k):
            entered.append(time.perf_counter())
            return real_layers(*a, **k)
        model._layers_fast = layers_fast
        split = []
        parts_ms = collections.defaultdict(float)
        restore = _time_launch_parts(model, parts_ms)
    launch_ms, plan_ms = [], []
    plan = model.plan_step(rows) if ahead else None
    _sync(dev)
    free = time.perf_counter()      # the end of the last step's bookkeeping (ahead: where a step's period starts)
    for s, toks in enumerate(toks_per_step):
        counter.ids.clear()
        if ahead:
            if s == warmup:     # (the parts' times of the timed steps only: capture and growth left out)
                parts_ms.clear()
            t = free
            if prof is not None and s >= warmup:
                prof.enable()
            t0 = time.perf_counter()
            out = model.launch(plan, toks)
            t1 = time.perf_counter()
            plan = model.plan_step(rows) if s + 1 < len(toks_per_step) else None
            t2 = time.perf_counter()
            if prof is not None:
                prof.disable()
            _sync(dev)
            end = time.perf_counter()
            if s >= warmup:
                launch_ms.append((t1 - t0) * 1e3)
                plan_ms.append((t2 - t1) * 1e3)
                if ev is not None and marks:
                    graph_ms.append(ev[0].elapsed_time(ev[1]))
                if marks:
                    split.append(((marks[0][0] - t0) * 1e3, (marks[-1][1] - marks[0][0]) * 1e3,
                                  (t1 - marks[-1][1]) * 1e3, (entered[0] - t0) * 1e3))
            marks.clear()
            entered.clear()
            if s + 1 < len(toks_per_step):
                keys.clear()
        else:
            _sync(dev)
            t = time.perf_counter()
            out = model.forward_step([StepChunk(c, toks[b:b + 1], 1) for b, c in enumerate(caches)])
            _sync(dev)
            end = time.perf_counter()
        dt = end - t
        all_times.append(dt)
        if not logits:     # (one buffer for the path's logits, its steps' rows copied in after each step's sync)
            logits = list(torch.empty((len(toks_per_step), *out.logits.shape), dtype=torch.float32,
                                      device=out.logits.device))
        logits[s].copy_(out.logits)
        _sync(dev)
        del out      # (the step's own logits freed, as an engine's sampler frees them: with each step's kept, every
        # launch's fresh fp32 logits [T, V] needed a new device block; the copy is outside the timed period)
        if counter.ids:   # (graph replays run no Python hooks: the eager / capture steps' expert counts stand in)
            experts.append(sum(n * per_expert[i] for i, n in counter.hits().items()))
            decode_run.expert_bytes = experts[-1]
        elif not experts:    # (every step a replay of graphs an earlier path captured: its count stands in)
            experts.append(getattr(decode_run, "expert_bytes", 0))
        if s >= warmup:
            times.append(dt)
            bytes_.append(dense + experts[-1] + sum(c.nbytes() for c in caches))
        free = time.perf_counter()   # (the bookkeeping above, ~13 ms at batch 64, is not the model's)
    decode_run.warm_ms = [round(t * 1e3, 1) for t in all_times[:warmup]]   # first steps: compiles, graph capture
    decode_run.step_ms = [round(t * 1e3, 2) for t in times]     # the timed steps (a slow one among them: the median)
    decode_run.host_ms = None
    if ahead:
        decode_run.replay_ms = graphs_back_to_back(model, sum(r.n for r in rows), dev, keys)
        del model._graphs.run, model._layers_fast
        model._graphs.__dict__.pop("replay_ready", None)
        restore()
        n = max(1, len(toks_per_step) - warmup)
        decode_run.launch_parts = {k: v / n for k, v in parts_ms.items()}
        decode_run.host_ms = (statistics.median(launch_ms), statistics.median(plan_ms),
                              *(statistics.median(x[k] for x in split) if split else float("nan") for k in range(4)),
                              statistics.median(graph_ms) if graph_ms else float("nan"))
    return statistics.median(times), sum(bytes_) / len(bytes_), logits   # median: robust to a stray slow step


def graphs_back_to_back(model, T: int, dev, keys: list, reps: int = 5) -> float:
    """Device ms of the last step's CUDA-graph segments (`keys`, in order) replayed back to back (no host work
    between them: the step's device time with its host gaps taken out), median of `reps`; nan when the step ran
    no graphs. The replays redo the last step on its captured inputs. Safe by construction for the paths that run
    later on these caches: every cache storage the graphs write (the window slabs and row arenas, engine/arena.py)
    is copied before and put back after; `graphs_back_to_back.kept` says whether the replays left it as it was
    (True: each segment writes what the step wrote, from inputs it does not itself change; "dump": all but the row
    arenas' dump rows, `_replays_kept`).
    Why "dump" is benign (session 11 R1, tiny V4.1 on the H200, batch 16, prompt 64: layer 2's entries and latents
    arenas, their dump rows only; prompt 65: unchanged): a ratio-2 compressor row that completes no group writes its
    entry / latent / index key to its arena's dump row (engine/compress_step.py, engine/arena.py), so when a step
    ends on an even position every row of the step writes that one row, and which row's bytes land last is up to
    the device's scheduling, replay to replay. No state's rows reach the dump row (a state's rows start at slot * cap,
    count of them, below it), so no value read from it is used (the index scores' padded reads past a state's
    rows may land on it and are masked); the mid-size runs (prompt 32, 16 steps) end on an odd position, where
    every row completes its group, and never showed it."""
    graphs_back_to_back.kept = None
    size = getattr(model._graphs, "_sizes", {}).get(T)
    if dev.type != "cuda" or size is None or not keys or any(k not in size.segments for k in keys):
        return float("nan")
    slabs = list(model.__dict__.get("_window_slabs", {}).values())
    arenas = list(model.__dict__.get("_row_arenas", {}).values())
    stores = [s.data for s in slabs] + [a.flat for a in arenas]
    names = ["window slab"] * len(slabs) + [f"layer {a.layer} {a.part}.{a.name}" for a in arenas]
    saved = [t.clone() for t in stores]
    times = []
    try:
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for k in keys:
                size.segments[k].graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    except Exception as e:      # (a diagnostic: never the reason a path fails)
        say(f"graphs back to back: {e!r}")
        return float("nan")
    finally:
        graphs_back_to_back.kept = _replays_kept(stores, saved, names, len(slabs))
        for t, c in zip(stores, saved):
            t.copy_(c)
        del saved
    return statistics.median(times)


def _replays_kept(stores, saved, names, slabs: int):
    """True when the replays left every store as it was; "dump" when only arenas' dump rows differ (the last row of
    each arena flat, after the slab's stores); else False, with the changed rows named in
    `graphs_back_to_back.changed`."""
    changed, dump_only = [], True
    for k, (t, c) in enumerate(zip(stores, saved)):
        if torch.equal(t, c):
            continue
        if k < slabs:    # [L, slots, cap, D]: (layer, slot, row) of the changed rows
            dump, where = False, f"(layer, slot, row) {(t != c).any(-1).nonzero()[:4].tolist()}"
        else:
            rows = (t != c).reshape(t.shape[0], -1).any(1).nonzero().flatten().tolist()
            dump, where = rows == [t.shape[0] - 1], f"rows {rows[:6]} of {t.shape[0]}"
        dump_only = dump_only and dump
        changed.append(f"{names[k]}: " + ("the dump row" if dump else where))
    graphs_back_to_back.changed = changed
    return True if not changed else "dump" if dump_only else False


def _gate_by(kind: str):
    """A path whose score-routed MoE gates run another way than kernels.router.gate_route's one launch: "torch" (the
    gate GEMM, then the ~9 torch ops of the twin, as engine/moe.py's Gate ran before session 8) or "gemm" (the GEMM
    library, then kernels.router's one-launch tail). -> (model -> undo())."""
    def patch(model):
        import torch.nn.functional as F
        from deepinfer_sg.kernels import router
        orig = router.gate_route
        other = router.gate_route_torch if kind == "torch" else \
            (lambda x, w, b, k, s: router.route(F.linear(x, w), b, k, s))
        return _patched(model, lambda: setattr(router, "gate_route", other),
                        lambda: setattr(router, "gate_route", orig))
    return patch


def _shared_by_torch(model):
    """The "torch-shared" path: the shared experts' front half as the 6 torch launches (kernels.skinny's twin)
    instead of its one launch. -> undo()."""
    from deepinfer_sg.engine import moe
    from deepinfer_sg.kernels.skinny import skinny_linear_torch
    orig = moe.skinny_linear
    return _patched(model, lambda: setattr(moe, "skinny_linear", lambda x, w, groups=1, glu=None, site="":
                                           skinny_linear_torch(x, w, groups, glu)),
                    lambda: setattr(moe, "skinny_linear", orig))


def _serial_shared(model):
    """The "serial-shared" path: the shared experts after the routed ones on one stream (engine/streams.py off;
    the device's Engram reads then run on the main stream too). -> undo()."""
    from deepinfer_sg.engine import streams
    orig = streams.ENABLED
    return _patched(model, lambda: setattr(streams, "ENABLED", False), lambda: setattr(streams, "ENABLED", orig))


def _host_engram(model):
    """The "host-engram" path: the Engram rows looked up on the host and uploaded, the graph cut before each Engram
    layer (model.engram_device_reads off: the path of memory-mapped tables and of sessions up to 9), instead of the
    token windows hashed and their rows read by the device from the pinned table inside the one graph. -> undo()."""
    orig = model.engram_device_reads
    return _patched(model, lambda: setattr(model, "engram_device_reads", False),
                    lambda: setattr(model, "engram_device_reads", orig))


def _no_pdl(model):
    """The "no-pdl" path: every kernel launched without programmatic dependent launch (kernels.backend.PDL off for
    its duration, as DEEPINFER_SG_PDL=0 does for a whole process; pdl_kw reads it at each launch). -> undo()."""
    from deepinfer_sg.kernels import backend
    orig = backend.PDL
    return _patched(model, lambda: setattr(backend, "PDL", False), lambda: setattr(backend, "PDL", orig))


def _launch_send(model):
    """The "launch-send" path: the step's upload, token ids in it, sent at launch (model.send_ahead off) instead of at
    the end of plan_step with the ids copied in by the first graph. -> undo()."""
    return _patched(model, lambda: setattr(model, "send_ahead", False), lambda: setattr(model, "send_ahead", True))


def _control(model):
    """The "control" path: nothing changed, the graphs captured again, measured after the other paths (how far the
    same code drifts between paths of one run). -> undo()."""
    return _patched(model, lambda: None, lambda: None)


# paths that change one engine choice for their duration (only when named in --paths): graphs + plan-ahead steps,
# compared with the fast path (a changed rounding can flip MoE routes: the difference is then not rounding)
ABLATIONS = {"torch-gate": _gate_by("torch"), "gemm-gate": _gate_by("gemm"), "torch-shared": _shared_by_torch,
             "serial-shared": _serial_shared, "host-engram": _host_engram, "no-pdl": _no_pdl,
             "launch-send": _launch_send, "control": _control, "cprofile": _control}


def pdl_census() -> dict:
    """Counts, per kernel that takes a `PDL` flag (kernels.backend.pdl_kw), its eager and captured launches with PDL
    on and off: {name: [on, off]}, filled from then on (a pre-run hook on each such Triton kernel; graph replays run
    no hooks, so a path's warm-up and capture steps are what it counts)."""
    import importlib
    import pkgutil
    from triton.runtime.jit import JITFunction
    from deepinfer_sg import kernels
    counts = collections.defaultdict(lambda: [0, 0])

    def hook(name):
        def count(*args, **kwargs):
            counts[name][0 if kwargs.get("PDL") else 1] += 1
        return count
    for info in pkgutil.iter_modules(kernels.__path__):     # (every kernel module, used yet or not)
        mod = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for obj in vars(mod).values():
            fn = obj if isinstance(obj, JITFunction) else getattr(obj, "fn", None)   # (autotuned: wrapped)
            if isinstance(fn, JITFunction) and fn.__module__ == mod.__name__ and "PDL" in fn.arg_names:
                fn.add_pre_run_hook(hook(fn.__name__))
    return counts


def _pdl_line(counts: dict) -> str:
    """"PDL on: name launches, ...; off: ..." of the launches counted."""
    on = [f"{n} {c[0]}" for n, c in sorted(counts.items()) if c[0]]
    off = [f"{n} {c[1]}" for n, c in sorted(counts.items()) if c[1]]
    return f"PDL on: {', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"


def _patched(model, apply, restore):
    """apply() now, restore() by the returned undo(); the captured graphs dropped both times (they ran the other
    code; model None: none yet)."""
    apply()
    if model is not None:
        model.reset_graphs()

    def undo():
        restore()
        if model is not None:
            model.reset_graphs()
    return undo


@contextlib.contextmanager
def _routes_for(model, path: str, paths: list, results: dict):
    """The reference run records its MoE routes when the "routes" path follows; the "routes" path is the eager fast
    path with those routes forced (engine/routes.py); yields [flipped choices] (the routes path) or [0]."""
    if path == "reference" and "routes" in paths:
        from deepinfer_sg.engine.routes import record_routes
        with record_routes(model) as got:
            yield [0]
        results["_routes"] = got
    elif path == "routes":
        from deepinfer_sg.engine.routes import force_routes
        model.cuda_graphs = False
        with force_routes(model, results.pop("_routes")) as flips:
            yield flips
    else:
        yield [0]


def _time_launch_parts(model, acc: dict):
    """Host ms spent in the named parts of Model.launch and Model.plan_step (accumulated into acc while steps run;
    "plan:" parts run in plan_step); -> undo()."""
    from deepinfer_sg.engine import batched, compress_step, model as M, step_graphs
    parts = [("token windows", M.Model, "_token_windows"), ("advance", M.Model, "_advance"),
             ("commit windows", batched, "commit_windows"), ("upload", step_graphs.SegmentGraphs, "upload"),
             ("plan send", batched.BatchPlan, "send"), ("engram rows / ids", M.Model, "_engram_rows"),
             ("plan: segment inputs", M.Model, "_segment"), ("plan: windows", batched, "prepare_windows"),
             ("plan: engram windows", M.Model, "_windows_prep"), ("plan: compressors", compress_step, "plan_layer"),
             ("plan: span inputs", batched, "span_inputs"), ("send: pinned copy", step_graphs._Pinned, "copy"),
             ("fill ids", batched.BatchPlan, "fill")]
    try:
        from deepinfer_sg.engine.engram import Engram
        parts.append(("engram lookup", Engram, "packed_values"))
    except ImportError:
        pass
    saved = []
    for label, owner, name in parts:
        fn = owner.__dict__.get(name)
        if fn is None or isinstance(fn, classmethod):
            continue
        static = isinstance(fn, staticmethod)

        def timed(*a, _fn=fn.__func__ if static else fn, _label=label, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                acc[_label] += (time.perf_counter() - t) * 1e3
        saved.append((owner, name, fn))
        setattr(owner, name, staticmethod(timed) if static else timed)

    def undo():
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return undo


def run(args):
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    model = build(args)
    _sync(dev)
    build_s = time.perf_counter() - t0
    V = model.config.vocab_size
    bw = measure_bandwidth(dev)
    dense, per_expert = weight_bytes(model)
    counter = ExpertCounter(model)
    steps = args.warmup + args.decode
    if steps > model.max_rollback:
        raise SystemExit(f"--warmup + --decode = {steps} > max_rollback {model.max_rollback}: the caches are "
                         "rolled back between the reference and the fast run")
    from deepinfer_sg.kernels import backend
    pdl_counts = pdl_census() if args.pdl_census else None
    say(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), dtype {args.dtype}, "
        f"config {args.checkpoint or args.config}{' (no engram)' if args.no_engram else ''}, routed experts "
        f"{getattr(model, 'experts_kind', 'as loaded')}: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, built in {build_s:.1f} s; "
        f"measured read bandwidth {bw / 1e9:.1f} GB/s; prompt {args.prompt}, {args.decode} timed decode steps "
        f"after {args.warmup} warm-up; engine code in {Path(__import__('deepinfer_sg.engine.model').engine.model.__file__).parent}; "
        f"PDL {'on' if backend.PDL else 'off'} (DEEPINFER_SG_PDL={os.environ.get('DEEPINFER_SG_PDL', 'unset')})")
    say(f"{'phase':8} {'path':12} {'batch':>5} {'step ms':>9} {'tok/s':>9} {'MB/step':>9} {'roof tok/s':>11} "
        f"{'of roof':>8} {'speed-up':>8} {'diff':>12}")
    g = torch.Generator().manual_seed(0)
    for B in [] if args.gemms_only else args.batches:
        caches = [model.new_cache() for _ in range(B)]
        prompts = torch.randint(0, V, (B, args.prompt), generator=g)
        _sync(dev)
        t = time.perf_counter()
        model.forward_step([StepChunk(c, prompts[b], 1) for b, c in enumerate(caches)])   # host ids, as the engine
        _sync(dev); dt = time.perf_counter() - t
        say(f"{'prefill':8} {'reference':9} {B:5d} {dt * 1e3:9.1f} {B * args.prompt / dt:9.1f}")
        # token ids on the host, as the engine gives them (ids on the device would cost a range-check sync)
        toks = [torch.randint(0, V, (B,), generator=g) for _ in range(steps)]
        results = {}
        has_graphs = hasattr(model, "cuda_graphs")
        ref = not args.skip_reference and (args.reference_max_batch is None or B <= args.reference_max_batch)
        ahead = hasattr(model, "plan_step")
        stacking = hasattr(model, "stack_projections")
        paths = (["reference"] if ref else []) + ["fast"] + (["graphs"] if has_graphs else []) + \
            (["ahead"] if has_graphs and ahead else []) + (["unstacked"] if has_graphs and stacking else []) + \
            (["rope-apart"] if has_graphs and hasattr(model, "fused_rope") else []) + \
            (["routes"] if ref and args.paths and "routes" in args.paths else []) + \
            [p for p in ABLATIONS if has_graphs and ahead and args.paths and p in args.paths]
        if args.paths:
            paths = [p for p in paths if p in args.paths]
        fused_default = getattr(model, "fused_mhc", None)
        other_mhc = "unfused" if fused_default else "fused"     # the mHC setting that is not the engine's default
        if args.fused_mhc and fused_default is not None:
            paths.append(other_mhc)
        for path in paths:
            model.fast_decode = path != "reference"
            if has_graphs:
                model.cuda_graphs = path in ("graphs", "ahead", "unstacked", "rope-apart", other_mhc, *ABLATIONS)
            if stacking:
                model.stack_projections = path != "unstacked"
            if hasattr(model, "fused_rope"):
                model.fused_rope = path != "rope-apart" and args.fused_rope == "on"
            if fused_default is not None:
                model.fused_mhc = (not fused_default) if path == other_mhc else fused_default
            undo = ABLATIONS.get(path, lambda m: None)(model)
            if pdl_counts is not None:
                pdl_counts.clear()
            try:
                with _routes_for(model, path, paths, results) as flips:
                    prof = cProfile.Profile() if path == "cprofile" else None
                    step_s, sb, logits = decode_run(model, caches, toks, dev, counter, dense, per_expert, args.warmup,
                                                    ahead=path == "ahead" or path in ABLATIONS, prof=prof)
                    if prof is not None:     # (the host's own functions first: where launch + plan spend it)
                        _out_file(f"cprofile_ahead_B{B}.txt", _cprofile_text(prof, 60))
            except Exception as e:   # (the graphs path is last: report, then go on eager)
                import traceback
                say(f"{'decode':8} {path:12} {B:5d} FAILED: {e!r}")
                _out_file(f"failed_{path}_B{B}.txt", traceback.format_exc())
                if has_graphs:
                    model.cuda_graphs = False
                break
            finally:
                if undo is not None:
                    undo()
            for cache in caches:
                cache.rollback(steps)
            del cache    # (a name left bound to a cache keeps it, and its slab / arena slots, alive past its batch)
            results[path] = (step_s, logits, sb)
            roof = B * bw / sb
            diff = ""
            speed = ""
            # fast vs reference: relative (bf16 round-off can flip MoE routes); graphs vs fast: must be exactly 0
            against = {"fast": "reference", "graphs": "fast", "ahead": "fast", "unstacked": "fast", "rope-apart": "fast",
                       "routes": "reference", other_mhc: "reference", **{p: "fast" for p in ABLATIONS}}.get(path)
            if against == "fast" and "fast" not in results:     # (--paths without fast: against the plan-ahead path
                # that ran first, the engine's or an ablation)
                against = next((p for p in ("ahead", *ABLATIONS) if p in results and p != path), None)
            if against in results:
                ref_s, ref_logits, _ = results[against]
                if path in ("graphs", "ahead"):
                    d = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
                    diff = f"abs {d:.1e}" if d else "exact"
                else:
                    d = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                            for a, b in zip(logits, ref_logits))
                    diff = f"{d:12.2e}"
                speed = f"{results.get('reference', results[against])[0] / step_s:7.1f}x"
            if path == "routes":
                speed = f"{flips[0]} flips"
            timed_ahead = path == "ahead" or path in ABLATIONS
            replays = "" if not timed_ahead else \
                (f"   graphs back to back {decode_run.replay_ms:.2f} ms (caches "
                 f"{ {True: 'unchanged', 'dump': 'unchanged but the dump rows', False: 'CHANGED, restored', None: '-'}[graphs_back_to_back.kept]}"
                 f"{'' if graphs_back_to_back.kept in (True, None) else ': ' + '; '.join(graphs_back_to_back.changed)})")
            say(f"{'decode':8} {path:12} {B:5d} {step_s * 1e3:9.2f} {B / step_s:9.1f} {sb / 1e6:9.1f} {roof:11.1f} "
                f"{B / step_s / roof:8.1%} {speed:>8} {diff:>12}   warm-up steps ms {decode_run.warm_ms}{replays}")
            if timed_ahead:     # (the host's parts on lines of their own: short enough to read whole)
                h = decode_run.host_ms
                say(f"{'host':8} {path:12} {B:5d} launch {h[0]:.2f} ms (before the graph run {h[2]:.2f}, of it to the "
                    f"segments {h[5]:.2f}; in it {h[3]:.2f}; after it {h[4]:.2f}) + plan {h[1]:.2f} (overlapped); "
                    f"the graph runs as timed by the device {h[6]:.2f}; steps ms {decode_run.step_ms}")
                say(f"{'parts':8} {path:12} {B:5d} " +
                    ", ".join(f"{k} {v:.3f}" for k, v in getattr(decode_run, "launch_parts", {}).items()))
            if pdl_counts is not None:
                say(f"{'pdl':8} {path:12} {B:5d} {_pdl_line(pdl_counts)}")
        model.fast_decode = True
        if stacking:
            model.stack_projections = True
        if hasattr(model, "fused_rope"):
            model.fused_rope = args.fused_rope == "on"
        if fused_default is not None:
            model.fused_mhc = fused_default
        memory_line(model, caches)
        del caches
    if args.engram_kernels:
        engram_table(model, args.batches, dev)
    if args.gemms or args.gemms_only:
        gemm_table(model, args.batches, bw, dev, args.gemm_names, args.gemm_sweep == "on")
    if args.profile:
        modes = ["graphs"] if hasattr(model, "cuda_graphs") else ["fast"]
        if args.paths and "unstacked" in args.paths and hasattr(model, "stack_projections"):
            modes.append("unstacked")     # (its device kernel time against the stacked GEMMs')
        states = []
        for phase in ("host", "device"):     # every host measurement before the first torch.profiler (CUPTI)
            for k, (mode, B) in enumerate((m, b) for m in modes for b in args.batches):
                if hasattr(model, "cuda_graphs"):
                    model.cuda_graphs = mode in ("graphs", "unstacked")
                if hasattr(model, "stack_projections"):
                    model.stack_projections = mode != "unstacked"
                try:
                    if phase == "host":
                        states.append(profile_fast(model, B, args, dev, mode))
                    elif states[k] is not None:
                        profile_device(model, states[k], args, dev)
                        states[k] = None     # (its caches go)
                except Exception as e:   # report and go on (the table above is already written)
                    import traceback
                    say(f"profile {mode} batch {B} FAILED: {e!r}")
                    _out_file(f"failed_profile_B{B}.txt", traceback.format_exc())
                    if phase == "host":
                        states.append(None)
    say(f"total {time.perf_counter() - t0:.1f} s")


def memory_line(model, caches) -> None:
    """What the caches of this batch hold on the device: the window slab + row arenas (reserved, all slots) against
    the rows in use, and what one more sequence's slot would add (engine/cache_memory.py: cache_pool's books)."""
    try:
        from deepinfer_sg.engine import cache_memory as books
        reserved = books.storage_bytes(model)
        rows = sum(c.nbytes() for c in caches)
        say(f"memory   batch {len(caches)}: slab + arenas reserve {reserved / 1e6:.1f} MB for {len(caches)} sequences "
            f"(rows in use {rows / 1e6:.1f} MB; one more slot {books.slot_bytes(model) / 1e6:.2f} MB)")
    except (ImportError, AttributeError) as e:     # (the base engine files have no memory books)
        say(f"memory   batch {len(caches)}: n/a ({e})")


# ------------------------------------------------------------------------------------------------ --profile
_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel")
_SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent")


def _out_file(name: str, text: str) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / name).write_text(text)


def profile_fast(model: Model, B: int, args, dev: torch.device, label: str = "fast") -> dict:
    """Where the time of one fast decode step goes at batch B (module docstring). Fresh caches, own prompt. This
    part measures with host clocks and cProfile only; `profile_device` (torch.profiler) must come after every
    host measurement of the process: once CUPTI is attached it stays, and a graph launch then costs the host
    ~0.3-1 ms instead of ~0.01-0.04 (R2 of session 6)."""
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    caches = [model.new_cache() for _ in range(B)]
    model.fast_decode = True
    model.forward_step([StepChunk(c, torch.randint(0, V, (args.prompt,), generator=g), 1) for c in caches])

    def step():
        toks = torch.randint(0, V, (B,), generator=g)     # host ids, as the engine gives them
        return model.forward_step([StepChunk(c, toks[b:b + 1], 1) for b, c in enumerate(caches)])

    for _ in range(args.warmup + 1):
        step()
    _sync(dev)
    host, whole = [], []
    for _ in range(3):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        _sync(dev)
        host.append(t1 - t0)
        whole.append(time.perf_counter() - t0)
    # synchronizing calls, with the Python line that made them
    syncs = collections.Counter()
    if dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                step()
                _sync(dev)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for w in rec:
            syncs[f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:70]}"] += 1
    pr = cProfile.Profile()
    for _ in range(3):      # (a sync after each step, as the engine does)
        pr.enable()
        step()
        pr.disable()
        _sync(dev)
    _out_file(f"cprofile_{label}_B{B}.txt", _cprofile_text(pr, 40))
    if hasattr(model, "plan_step"):     # the token-dependent half alone (Model.launch, as the "ahead" path runs it)
        from deepinfer_sg.engine.model import StepRows
        rows = [StepRows(c, 1, 1) for c in caches]
        pl = cProfile.Profile()
        for _ in range(3):
            plan = model.plan_step(rows)
            toks = torch.randint(0, V, (B,), generator=g)
            _sync(dev)
            pl.enable()
            model.launch(plan, toks)
            pl.disable()
            _sync(dev)
        _out_file(f"cprofile_launch_{label}_B{B}.txt", _cprofile_text(pl, 30, ("tottime",)))
    top = _cprofile_text(pr, 12, ("tottime",))
    return dict(B=B, label=label, caches=caches, step=step, host=host, whole=whole, syncs=syncs, top=top)


def _cprofile_text(prof: cProfile.Profile, rows: int, orders=("tottime", "cumulative")) -> str:
    """A cProfile's top `rows` functions by own time, then (by default) by cumulative time."""
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for order in orders:
        stats.sort_stats(order).print_stats(rows)
    return text.getvalue()


def profile_device(model: Model, state: dict, args, dev: torch.device) -> None:
    """torch.profiler of one step of `profile_fast`'s caches: launches, copies, syncs, device kernel time, the op
    tables; then the profile line."""
    B, label, step, host, whole, syncs, top = (state[k] for k in ("B", "label", "step", "host", "whole", "syncs",
                                                                    "top"))
    for _ in range(args.warmup + 1):     # (graphs again, after another mode's steps or a recapture)
        step()
    _sync(dev)
    # launches, copies, kernel time
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(dev)
    avgs = prof.key_averages()
    count = collections.Counter()
    kernel_us = 0.0
    for e in avgs:
        if e.key in _LAUNCH:
            count["launch"] += e.count
        elif e.key == "cudaGraphLaunch":
            count["graph"] += e.count
        elif e.key.startswith("cudaMemcpy"):
            count["memcpy"] += e.count
        elif e.key in _SYNC:
            count["sync"] += e.count
        elif not e.key.startswith("aten::") and e.device_type.name == "CPU":
            pass
    spans = []
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernel_us += e.device_time   # per-event device time
            spans.append((e.time_range.start, e.time_range.end))
    n_aten = sum(1 for e in prof.events() if e.name.startswith("aten::")
                 and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))   # top-level ops
    tables = [f"batch {B}: one fast decode step, torch.profiler, sorted by self CPU time",
              avgs.table(sort_by="self_cpu_time_total", row_limit=40)]
    if dev.type == "cuda":
        tables += ["sorted by device time", avgs.table(sort_by="self_device_time_total", row_limit=25)]
    _out_file(f"profile_{label}_B{B}.txt", "\n".join(tables) + "\n")
    if dev.type == "cuda":   # device time per torch op and input shapes, from one eager step (graph replays hide ops)
        graphs_on = getattr(model, "cuda_graphs", False)
        if hasattr(model, "cuda_graphs"):
            model.cuda_graphs = False
        try:
            with profile(activities=acts, record_shapes=True) as prof_ops:
                step()
                _sync(dev)
        finally:
            if hasattr(model, "cuda_graphs"):
                model.cuda_graphs = graphs_on
        ops = prof_ops.key_averages(group_by_input_shape=True)
        _out_file(f"ops_{label}_B{B}.txt", ops.table(sort_by="device_time_total", row_limit=60, max_name_column_width=40,
                                                     max_shapes_column_width=70) + "\n")
    if dev.type == "cuda":
        profile_parts(model, step, acts, B, label)
    if spans:     # where the device waited inside the step (between its first and last kernel)
        say(f"idle {label} batch {B}: " + device_gaps(spans))
    say(f"profile {label} batch {B}: step {statistics.median(whole) * 1e3:.2f} ms, host returns after "
        f"{statistics.median(host) * 1e3:.2f} ms; device kernel time {kernel_us / 1e3:.2f} ms; "
        f"{count['launch']} kernel launches + {count['graph']} graph launches, {count['memcpy']} memcpy, "
        f"{count['sync']} sync calls, {n_aten} aten ops")
    for k, v in syncs.most_common(12):
        say(f"  sync x{v}: {k}")
    lines = [ln for ln in top.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    for ln in lines[start:start + 9]:
        say("  " + ln.rstrip()[:150])


def device_gaps(spans: list, over_us: float = 5.0) -> str:
    """From the device's activity intervals (us; kernels and copies, overlapping ones merged): the span from the
    first start to the last end, the busy time, and the gaps longer than over_us (count, total, the 4 largest with
    their offset from the first start): where the device waited for the host inside one step."""
    spans = sorted(spans)
    first, busy, gaps = spans[0][0], 0.0, []
    cur_s, cur_e = spans[0]
    for a, b in spans[1:]:
        if a > cur_e:
            busy += cur_e - cur_s
            if a - cur_e > over_us:
                gaps.append((a - cur_e, cur_e - first))
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    top = ", ".join(f"{g:.0f} us at +{at:.0f}" for g, at in sorted(gaps, reverse=True)[:4])
    return (f"device span {(cur_e - first) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms; {len(gaps)} gaps > {over_us:g} us "
            f"= {sum(g for g, _ in gaps) / 1e3:.2f} ms (largest: {top})")


# the step's parts for `profile_parts`: (label, owner object, attribute); each is wrapped in a profiler range while one
# eager step runs, and every kernel is charged to the innermost range around its launch
def _part_hooks():
    from deepinfer_sg import kernels as K
    from deepinfer_sg.engine import attention, batched, compress_step, model as M, moe, norm
    parts = [("pre_attention", batched, "pre_attention"), ("post_attention", batched, "post_attention"),
             ("mhc.mixes", M.Block, "mixes"), ("mhc.pre", batched, "hc_pre"), ("mhc.post", batched, "hc_post"),
             ("mhc.post+mixes", batched, "hc_post_and_mixes"),
             ("norm", norm.RMSNorm, "forward"), ("proj.stacked", batched.projections, "xn_products"),
             ("attn.q", attention.Attention, "project_q"), ("attn.kv", attention.Attention, "project_kv"),
             ("attn.kv", attention.Attention, "store_kv"),
             ("attn.out", attention.Attention, "output"), ("rope", attention, "apply_rope"),
             ("index.q", batched, "step_queries"), ("index.select", batched, "select_ids"),
             ("attend", batched, "attend"),
             ("sparse_attention", batched, "sparse_attention"), ("compress", compress_step, "compress_rows"),
             ("moe", moe.MoE, "forward_grouped"), ("moe.gate", moe.Gate, "forward"),
             ("moe.shared", moe.Expert, "forward"), ("moe.shared", moe.Expert, "forward_fast"),
             ("moe.routed", K, "moe_experts"),
             ("embed", M.Model, "embed_streams"), ("collapse", M.Model, "collapse_streams")]
    try:
        from deepinfer_sg.engine import engram
        parts.append(("engram.mix", engram.Engram, "mix"))
    except ImportError:
        pass
    return [(label, owner, name) for label, owner, name in parts if hasattr(owner, name)]


def profile_parts(model: Model, step, acts, B: int, label: str) -> None:
    """Device time and kernel count of one eager fast step per part of the step (`_part_hooks`; a kernel goes to
    the innermost part around its launch, "other" outside every part) -> $OUT/parts_<label>_B<batch>.txt + a line."""
    from torch.profiler import profile, record_function
    import functools
    saved = []

    def wrap(tag, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            with record_function(tag):
                return fn(*a, **k)
        return inner
    for part, owner, name in _part_hooks():
        fn = owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
        saved.append((owner, name, fn))
        setattr(owner, name, wrap("part:" + part, fn))
    graphs_on = getattr(model, "cuda_graphs", False)
    try:
        if hasattr(model, "cuda_graphs"):
            model.cuda_graphs = False
        with profile(activities=acts) as prof:
            step()
            _sync(model.device)
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)
        if hasattr(model, "cuda_graphs"):
            model.cuda_graphs = graphs_on
    # each device kernel -> the host call that launched it (same correlation id) -> the innermost part around that
    # call's start (Triton launches included: they carry no torch op)
    us, n, names = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    raw = prof.profiler.kineto_results.events()
    ranges = sorted((e.start_ns(), e.end_ns(), e.name()[5:]) for e in raw if e.name().startswith("part:"))
    launched = {e.correlation_id(): e.start_ns() for e in raw
                if e.device_type().name == "CPU" and e.name() in _LAUNCH + ("cudaMemcpyAsync", "cudaMemsetAsync")}
    for e in raw:
        if e.device_type().name != "CUDA" or e.name().startswith(("Memcpy", "Memset", "part:")):   # (ranges too)
            continue
        t = launched.get(e.correlation_id(), launched.get(e.linked_correlation_id()))
        part = "other"
        if t is not None:
            inside = [r for r in ranges if r[0] <= t <= r[1]]
            if inside:
                part = max(inside)[2]         # (the latest start: the innermost)
        dur = e.duration_ns() / 1e3
        us[part] += dur
        n[part] += 1
        names[part][e.name()[:60]] += dur
    total = sum(us.values())
    lines = [f"batch {B}, {label}: one eager fast step, device time per part (innermost), total {total:.0f} us, "
             f"{sum(n.values())} kernels", f"{'part':18} {'kernels':>8} {'us':>9} {'share':>7}  top kernels (us)"]
    for part, t in us.most_common():
        top = ", ".join(f"{k} {v:.0f}" for k, v in names[part].most_common(4))
        lines.append(f"{part:18} {n[part]:8d} {t:9.1f} {t / max(total, 1e-9):7.1%}  {top}")
    _out_file(f"parts_{label}_B{B}.txt", "\n".join(lines) + "\n")
    say(f"parts {label} batch {B} (eager step: kernels / device us): " + "; ".join(
        f"{part} {n[part]}/{t:.0f}" for part, t in us.most_common(14)))


# ------------------------------------------------------------------------------------------------ --engram-kernels
def engram_table(model: Model, batches: list[int], dev) -> None:
    """The step's two Engram launches of a layer (kernels.engram_gate: hashed_rows, its rows hashed from the token
    windows, read from the pinned host table and decoded; engram_gate, the gate into the streams) at each batch size,
    each 16 times in a CUDA graph (`_graph_us`), with programmatic dependent launch off and on (kernels.backend.PDL:
    a PDL launch starts under the tail of the launch before it)."""
    from deepinfer_sg.engine import batched
    from deepinfer_sg.kernels import backend, engram_gate as kg
    eng = model.layers[batched.engram_layers(model)[0]].engram
    weight, scale = eng.table.device_arrays(dev)
    consts = eng.hash_consts(dev)
    N, M, H, V = consts[1].shape[0], eng.hc_mult, eng.hidden_size, model.config.vocab_size
    say(f"{'engram':8} {'T':>4} {'rows off':>9} {'rows on':>8} {'gate off':>9} {'gate on':>8}  (us per call: "
        f"hashed_rows, engram_gate; 16 calls in a CUDA graph; PDL off / on)")
    for T in batches:
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(0, V, (T,), generator=g).to(dev)
        src = torch.stack([torch.where(torch.arange(N) == 0, torch.arange(T)[:, None], -1),    # (the token itself,
                           torch.randint(0, V, (T, N), generator=g)]).to(dev)                  # then earlier ones)
        R = torch.randn(T, M, H, device=dev, dtype=model.dtype)
        kv = torch.randn(T, (M + 1) * H, device=dev, dtype=model.dtype)
        w = eng.gate_weight()
        got = []
        for on in (False, True):
            with backend.pdl_as(on):
                got.append(_graph_us([lambda: kg.hashed_rows(src, ids, consts, eng.spec.pad_token_id, weight, scale,
                                                             model.dtype)] * 16))
                got.append(_graph_us([lambda: kg.engram_gate(R, kv, w, eng.eps)] * 16))
        say(f"{'engram':8} {T:4d} {got[0]:9.2f} {got[2]:8.2f} {got[1]:9.2f} {got[3]:8.2f}")


# ------------------------------------------------------------------------------------------------ --gemms
def _graph_us(fn_calls, reps: int = 3) -> float:
    """Device us per call of a list of calls (each with its own inputs: the weights rotate past the L2), as one CUDA
    graph replayed; median of `reps` replays (events). Elsewhere (a CPU dry run) host time of one pass."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for f in fn_calls:
            f()
        return (time.perf_counter() - t) * 1e6 / len(fn_calls)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fn_calls:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fn_calls:
            f()
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fn_calls))
    return statistics.median(times[1:])


def gemm_table(model: Model, batches: list[int], bw: float, dev, names: list[str] | None = None,
               sweep: bool = True) -> None:
    """The decode step's few-row products at each batch size: the GEMM library ('lib': F.linear / the grouped einsum;
    for a shared expert's front half its two products and the SwiGLU launches) vs kernels.skinny (the SwiGLU
    inside), each against its weight bytes over the measured read bandwidth ('floor'); and the MoE router's tail,
    Gate's torch ops vs kernels.router. In CUDA graphs, weights rotating through copies larger than the L2.
    names: only the products whose name contains one of these; sweep: also time kernels.skinny's block sweep."""
    from deepinfer_sg.kernels.skinny import skinny_linear_triton, launch_config
    c = model.config
    attn = next(blk.attn for blk in model.layers if blk.attn.spec.index_source == blk.layer_id)
    H, D, G = c.hidden_size, c.head_dim, c.o_groups
    # (name, groups, N, K, with the clamped SwiGLU of an up product)
    shapes = [("wo_b", 1, H, G * c.o_lora_rank, False), ("wq_a+wkv (stacked)", 1, c.q_lora_rank + D, H, False),
              ("wo_a (grouped)", G, c.o_lora_rank, c.num_heads * D // G, False),
              ("wq_b", 1, attn.wq_b.weight.shape[0], c.q_lora_rank, False),
              ("router (K3)", 1, c.n_routed_experts, H, False),
              ("shared w1+w3 glu (K3)", 1, c.moe_intermediate_size, H, True),
              ("shared w2 (K3)", 1, H, c.moe_intermediate_size, False)]
    dt = model.dtype
    # the gate: its GEMM + the ~9 torch ops of the tail (before session 8) vs the GEMM + kernels.router's tail vs
    # kernels.router.gate_route (one launch)
    from deepinfer_sg.kernels.router import gate_route_triton, route_torch, route_triton
    E, K = c.n_routed_experts, c.num_experts_per_tok
    bias = torch.randn(E, device=dev) * 0.1
    gws = [torch.randn(E, H, device=dev, dtype=dt) * H ** -0.5 for _ in range(16)]
    say(f"{'gate + route':20} {'T':>3} {'torch':>8} {'tail k.':>8} {'fused':>8} {'fused16':>8}  (us; GEMM + torch "
        f"tail, GEMM + kernels.router tail, kernels.router.gate_route, the same in row blocks of 16)")
    F_ = torch.nn.functional
    for T in batches:
        x = torch.randn(T, H, device=dev, dtype=dt)
        t_lib = _graph_us([lambda w=w: route_torch(F_.linear(x, w), bias, K, 1.5) for w in gws])
        t_k = _graph_us([lambda w=w: route_triton(F_.linear(x, w), bias, K, 1.5) for w in gws])
        t_f = _graph_us([lambda w=w: gate_route_triton(x, w, bias, K, 1.5) for w in gws])
        t_16 = _graph_us([lambda w=w: gate_route_triton(x, w, bias, K, 1.5, config={"BM": 16}) for w in gws])
        a, b = route_torch(F_.linear(x, gws[0]), bias, K, 1.5), gate_route_triton(x, gws[0], bias, K, 1.5)
        b16 = gate_route_triton(x, gws[0], bias, K, 1.5, config={"BM": 16})
        same = bool((a[1].sort(1).values == b[1].sort(1).values).all())
        same16 = bool((b16[1] == b[1]).all() and (b16[0] == b[0]).all())
        say(f"{'gate + route':20} {T:3d} {t_lib:8.2f} {t_k:8.2f} {t_f:8.2f} {t_16:8.2f}  same experts (fused vs "
            f"torch): {same}; fused16 bit-equal to fused: {same16}")
    say("gemms: us per call at T rows (CUDA graph, cold weights); 'lib' = F.linear / one bmm (+ the clamps, silu "
        "and product for glu), 'skinny' = kernels.skinny default config, 'unsplit' = the same without split-K, "
        "'best' = the best of its sweep")
    say(f"{'product':20} {'T':>3} {'MB':>6} {'floor us':>8} {'lib us':>7} {'skinny':>7} {'unsplit':>7} {'best':>7}  "
        f"best config")
    for name, groups, N, K, glu in [sh for sh in shapes if not names or any(n in sh[0] for n in names)]:
        wbytes = groups * N * K * 2 * (2 if glu else 1)
        copies = max(2, min(16, int(2 * 60e6 // wbytes) + 1)) if dev.type == "cuda" else 1
        ws = [torch.randn(groups * N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        ups = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)] if glu else [None] * copies
        for T in batches:
            x = torch.randn(T, groups * K, device=dev, dtype=dt)

            def lib(w, u):
                if glu:
                    return F_.silu(F_.linear(x, w).clamp(max=10.0)) * F_.linear(x, u).clamp(-10.0, 10.0)
                if groups > 1:       # (as engine/projections.py runs it without kernels.skinny: one bmm)
                    out = x.new_empty(T, groups * N)
                    torch.bmm(x.view(T, groups, -1).transpose(0, 1), w.view(groups, N, -1).transpose(1, 2),
                              out=out.view(T, groups, N).transpose(0, 1))
                    return out
                return F_.linear(x, w)
            floor = wbytes / bw * 1e6
            t_lib = _graph_us([lambda w=w, u=u: lib(w, u) for w, u in zip(ws, ups)])
            cfgs = [None, dict(SPLIT=1)] + [dict(BN=bn, BK=128) for bn in (16, 32, 64)][
                :(None if dev.type == "cuda" else 2) if sweep else 0]
            res = []
            for cfg in cfgs:
                try:
                    t = _graph_us([lambda w=w, u=u, cfg=cfg: skinny_linear_triton(
                        x, w, groups, (u, 10.0) if glu else None, config=cfg) for w, u in zip(ws, ups)])
                except Exception:   # (a config the compiler refuses: skipped)
                    t = float("inf")
                res.append((t, cfg))
            best = min(res[2:] or res[:1], key=lambda r: r[0])
            want = lib(ws[0], ups[0]).float()
            got = skinny_linear_triton(x, ws[0], groups, (ups[0], 10.0) if glu else None).float()
            err = (got - want).abs().max() / want.abs().max()
            say(f"{name:20} {T:3d} {wbytes / 1e6:6.1f} {floor:8.2f} {t_lib:7.2f} {res[0][0]:7.2f} {res[1][0]:7.2f} "
                f"{best[0]:7.2f}  {best[1]} (default {launch_config(T, N, K, groups)}; |skinny - lib| / max {err:.1e})")
        del ws, ups


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=["tiny", "midsize"])
    ap.add_argument("--checkpoint", default=None, help="a checkpoint folder (load_model) instead of --config")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--decode", type=int, default=8, help="timed decode steps per path")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (Triton compiles)")
    ap.add_argument("--skip-reference", action="store_true", help="time the fast path only")
    ap.add_argument("--paths", nargs="+", default=None,
                    choices=["reference", "fast", "graphs", "ahead", "unstacked", "rope-apart", "routes",
                             *ABLATIONS],
                    help="time only these decode paths (default: all; graphs is compared with fast when both run)")
    ap.add_argument("--fused-mhc", action="store_true",
                    help="also time the graphs path with the other mHC setting than the engine's default "
                         "(model.fused_mhc: 'fused' or 'unfused'), vs the reference")
    ap.add_argument("--profile", action="store_true",
                    help="then profile one fast decode step per batch size (module docstring)")
    ap.add_argument("--experts", default="auto", choices=["auto", "bf16", "fp8", "fp4"],
                    help="routed experts of --config models: bf16 (dense), or FP4-rounded as the real checkpoint "
                         "stores them and kept as the loader keeps them, fp8 (e4m3 stacks) or fp4 (packed); "
                         "auto (default): what load_model does for a real checkpoint on the device (CUDA: "
                         "loader.CUDA_EXPERT_DTYPE, CPU: bf16)")
    ap.add_argument("--fused-rope", default="on", choices=["on", "off"],
                    help="model.fused_rope for every path but rope-apart (off: e.g. when the fused kernels failed)")
    ap.add_argument("--gate", default="fused", choices=["fused", "gemm", "torch"],
                    help="score-routed MoE gates for every path: kernels.router.gate_route's one launch (fused), the "
                         "GEMM library then kernels.router's tail (gemm, e.g. when its compiled tests failed), or "
                         "the GEMM then the torch twin (torch)")
    ap.add_argument("--engram-kernels", action="store_true",
                    help="CUDA: also time the Engram kernels with PDL off and on (engram_table)")
    ap.add_argument("--gemms", action="store_true",
                    help="CUDA: also time the step's few-row products, GEMM library vs kernels.skinny (gemm_table)")
    ap.add_argument("--gemm-names", nargs="+", default=None, help="--gemms: only products whose name has one of these")
    ap.add_argument("--gemm-sweep", default="on", choices=["on", "off"], help="--gemms: also kernels.skinny's sweep")
    ap.add_argument("--gemms-only", action="store_true", help="only the --gemms table (no decode steps)")
    ap.add_argument("--no-engram", action="store_true", help="drop the Engram layers from --config")
    ap.add_argument("--pdl-census", action="store_true",
                    help="count each PDL-capable kernel's launches with PDL on / off per path (pre-run hooks: the "
                         "eager paths then pay a Python call per Triton launch)")
    ap.add_argument("--reference-max-batch", type=int, default=None,
                    help="run the (slow) reference path only for batches up to this size")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1: the step's host-side ops are tiny and lose to OpenMP "
                         "wake-ups and spin contention, on the CPU path and in the host work of a GPU step alike)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or 1)
    if args.gate != "fused":
        _gate_by(args.gate)(None)
    try:
        run(args)
    finally:
        if os.environ.get("OUT"):
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["OUT"]) / "model_forward.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
