"""DSpark speculation end to end on the real model path (engine/spec_decode.py): tokens/s and mean accepted length
with speculation off, fixed-length verification, and confidence scheduling (sync, async), at batch 1/8/64.

Setup, stated because it decides the numbers:
- model: random weights (no trained checkpoint here). CPU: the bundled tiny V4.1 network with the real 129,280
  vocabulary; CUDA: the mid-size V4.1 config of engine/testing.py (~12.6 B params, bf16), initialised on the GPU.
- drafter "self": the target's own distribution at the drafted prefix (the target run on the drafts one
  position at a time, then rolled back). Acceptance is ~1 (greedy) so the scheduler works at high acceptance;
  confidence = 1 (the proposal is the target itself). Its drafting costs n target decode steps, so the table
  also gives "tok/s, free drafter" = tokens / (wall - drafter time): what a drafter that costs nothing would
  give; a trained DSpark drafter costs one small n-slot pass + n Markov steps (its time is measured in the
  "dspark" rows, where random weights make acceptance ~0).
- "off" runs the same step code with no drafts (one row per request: plain decoding through `verify`).
- the step-time model of sync/async is profiled at start-up on this device (engine/spec_decode.profile_time_model).
With trained weights: DSpark acceptance would be ~0.6-0.9 per position (paper: 3-4.5 tokens per step at gamma 5)
instead of 0 here, and the confidence head would be calibrated, so sync/async would pick long blocks for easy
text and short ones at large batch; the self-drafting rows bound what that can reach.

Usage: python benchmarks/speculative.py [--device cuda|cpu] [--batches 1,8,64] [--max-tokens 64] [--n 5] [--core]
Writes the table to $OUT/speculative.txt when OUT is set. --core adds the cost of the verification core alone.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from deepinfer_sg.engine import spec_decode as SD
from deepinfer_sg.engine import speculative as S
from deepinfer_sg.engine import verify_schedule as VS


# --------------------------------------------------------------------------------------------- models
def bench_model(device: str, size: str):
    """("tiny": the bundled default model, real vocabulary) or ("midsize": engine/testing's mid-size V4.1)."""
    if size == "tiny":
        from deepinfer_sg.engine.default_model import build_default_model
        return build_default_model(seed=0, device=device)
    from deepinfer_sg.engine.testing import midsize_v41_config
    from engine_throughput import random_model_on_device   # same directory: the one GPU random-weight builder
    return random_model_on_device(midsize_v41_config(), device, torch.bfloat16, seed=0)


def emit(lines, name):
    text = "\n".join(lines)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "a") as f:
            f.write(text + "\n")


# --------------------------------------------------------------------------------------------- end to end
def fresh(time_model):
    """A copy of the start-up profile without the online corrections of earlier runs."""
    return None if time_model is None else VS.StepTimeModel(list(time_model.sizes), list(time_model.base_seconds))


def run_case(model, batch, cfg, max_tokens, temperature, prompt_len=32, seed=0, time_model=None):
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    prompts = [torch.randint(3, V - 2, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    reqs = [SD.StandaloneRequest(p, max_tokens=max_tokens, temperature=temperature, seed=i, stop_token_ids=())
            for i, p in enumerate(prompts)]
    dec = SD.SpecDecoder(model, cfg, time_model=fresh(time_model))
    dec.ensure_time_model(max(batch, 8))         # start-up profile (when none is given), not timed
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    SD.generate(model, reqs, cfg, decoder=dec)
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output) for r in reqs)
    return tokens, wall, dec.stats


def end_to_end(model, args):
    dev = model.device.type
    lines = [f"# speculation end to end: device {dev}, model {args.model}, vocab {model.config.vocab_size}, "
             f"n {args.n}, {args.max_tokens} tokens/request, temperature {args.temperature}, random weights",
             f"{'batch':>5s} {'drafter':>7s} {'mode':>6s} {'tokens':>6s} {'wall s':>7s} {'tok/s':>8s} "
             f"{'tok/s free drafter':>18s} {'acc len':>7s} {'rows/step':>9s} {'drafter s':>9s} "
             f"{'fwd s':>6s}  acceptance per position"]
    # warm-up (kernels compile, allocator)
    run_case(model, 2, SD.SpecConfig(n=args.n, schedule="fixed", drafter="self"), 4, args.temperature)
    # the start-up profile, once for the largest batch (engine/spec_decode.profile_time_model)
    t0 = time.perf_counter()
    prof = SD.SpecDecoder(model, SD.SpecConfig(n=args.n, schedule="sync", drafter="self"))
    prof.ensure_time_model(max(args.batches))
    tm = prof.time_model
    lines.insert(1, f"# step-time profile ({time.perf_counter() - t0:.1f} s): " + ", ".join(
        f"{r}:{1e3 * t:.1f}ms" for r, t in zip(tm.sizes, tm.base_seconds)))
    for b in args.batches:
        cases = [("self", m) for m in ("off", "fixed", "sync", "async")] + [("dspark", "sync")]
        for drafter, mode in cases:
            if drafter == "dspark" and getattr(model, "mtp", None) is None:
                continue
            cfg = SD.SpecConfig(n=args.n, schedule=mode, drafter=drafter)
            tokens, wall, st = run_case(model, b, cfg, args.max_tokens, args.temperature, time_model=tm)
            free = tokens / max(1e-9, wall - st.drafter_s)
            acc = " ".join(f"{a:.2f}" for a in st.acceptance_per_position() if a == a)
            lines.append(f"{b:5d} {drafter:>7s} {mode:>6s} {tokens:6d} {wall:7.2f} {tokens / wall:8.1f} {free:18.1f} "
                         f"{st.mean_accepted_length:7.2f} {st.rows_per_step:9.1f} {st.drafter_s:9.2f} "
                         f"{st.forward_s:6.2f}  {acc}")
            print(lines[-1], flush=True)
    emit(lines, "speculative.txt")


# --------------------------------------------------------------------------------------------- the core alone
def timed(fn, repeats, sync):
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def core_table(dev, V=129280, L=5, repeats=5):
    """What verification and scheduling add to a step (real vocabulary), vs plain sampling of as many rows."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    try:
        from deepinfer_sg.kernels import sample_from_logits
    except ImportError:
        sample_from_logits = None
    model = VS.StepTimeModel.from_table({b: 1e-3 * (1 + b / 64) for b in range(1, 64 * (L + 1) + 1)})
    lines = [f"# verification core: device {dev}, vocab {V}, gamma {L}; median of {repeats} runs, ms",
             f"{'batch':>5s} {'rows':>5s} {'verify':>8s} {'GB/s':>6s} {'plain sample':>12s} {'sched sync':>10s} "
             f"{'sched async':>11s}"]
    g = torch.Generator(device="cpu").manual_seed(0)
    for b in (1, 8, 64):
        rows = b * (L + 1)
        logits = torch.randn(rows, V, generator=g).to(dev)
        q = torch.softmax(logits, -1)
        p = torch.softmax(logits + torch.randn(rows, V, generator=g).to(dev), -1)
        d = torch.multinomial(p, 1).squeeze(-1)
        d.view(b, L + 1)[:, -1] = S.FRESH
        counts = torch.full((b,), L + 1, device=dev)
        batch = S.VerifyBatch(q, p, d, counts, seeds=torch.arange(b, device=dev), positions=torch.full((b,), 100, device=dev),
                              stop_token_ids=torch.full((b, 1), 1, device=dev), max_new_tokens=torch.full((b,), 1000, device=dev))
        t_verify = timed(lambda: S.verify(batch), repeats, sync)
        t_plain = float("nan")
        if sample_from_logits is not None:
            t_plain = timed(lambda: sample_from_logits(logits, 1.0, 0, 1.0, 0, 100), repeats, sync)
        rates = VS.cumulative_rates(torch.rand(b, L, generator=g, dtype=torch.float64))
        t_sync = timed(lambda: VS.schedule_sync(rates, model), repeats, lambda: None)
        t_async = timed(lambda: VS.schedule_async(rates, rates, model), repeats, lambda: None)
        lines.append(f"{b:5d} {rows:5d} {t_verify * 1e3:8.2f} {2 * rows * V * 4 / t_verify / 1e9:6.1f} "
                     f"{t_plain * 1e3:12.2f} {t_sync * 1e3:10.3f} {t_async * 1e3:11.3f}")
    emit(lines, "speculative.txt")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="tiny | midsize (default: midsize on CUDA, tiny on CPU)")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,64 on CUDA, 1,8 on CPU)")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--core", action="store_true", help="also time the verification core alone")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("midsize" if cuda else "tiny")
    args.batches = [int(b) for b in (args.batches or ("1,8,64" if cuda else "1,8")).split(",")]
    args.max_tokens = args.max_tokens or (64 if cuda else 16)
    if not cuda:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = bench_model(args.device, args.model)
    with torch.inference_mode():
        end_to_end(model, args)
        if args.core:
            core_table(args.device)


if __name__ == "__main__":
    main()
