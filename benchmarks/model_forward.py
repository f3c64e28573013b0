"""Model forward: decode step time, reference path vs batched fast path, against the memory-bandwidth roofline.

    python benchmarks/model_forward.py                       # CPU, spec §6.1 tiny V4.1 config, fp32
    python benchmarks/model_forward.py --config midsize --device cuda --dtype bf16 --batches 1 8 32 64
    python benchmarks/model_forward.py --checkpoint DIR --device cuda --dtype bf16   # a write_checkpoint folder

Per batch size: one prefill step (every sequence's random prompt), then `--decode` timed decode steps (after
`--warmup` untimed ones) twice from the same caches: first the per-sequence reference path
(`model.fast_decode = False`), then, after rolling the caches back, the batched fast path with the kernels
(`fast_decode = True`) fed the same tokens, so the two runs do the same work and their logits are compared
(max |diff| / max |logit|). Printed per path: step time, tokens/s, the bytes one step must read (dense weights
+ the routed experts hit in that step + the KV caches) and the roofline = measured read bandwidth / bytes per
step, i.e. the speed of a perfect memory-bound implementation; plus the fast path's speed-up.
With OUT set, the table is also written to $OUT/model_forward.txt.

Random weights are built on the target device (no CPU-side init); Engram tables, which live on the host by
design, are tiled from a small random block so building them stays fast.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from deepinfer_sg.engine.config import ModelConfig
from deepinfer_sg.engine.model import Model, StepChunk

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
        e = blk.ffn.experts[0]
        per_expert.append(sum(p.numel() * p.element_size() for p in e.parameters()))
    return dense, per_expert


def decode_run(model, caches, toks_per_step, dev, counter, dense, per_expert, warmup):
    """Run the given token steps; -> (mean timed step s, mean bytes per step, logits of every step)."""
    times, bytes_, logits = [], [], []
    for s, toks in enumerate(toks_per_step):
        counter.ids.clear(); _sync(dev)
        t = time.perf_counter()
        out = model.forward_step([StepChunk(c, toks[b:b + 1], 1) for b, c in enumerate(caches)])
        _sync(dev)
        dt = time.perf_counter() - t
        logits.append(out.logits.float())
        if s >= warmup:
            times.append(dt)
            bytes_.append(dense + sum(n * per_expert[i] for i, n in counter.hits().items())
                          + sum(c.nbytes() for c in caches))
    return sum(times) / len(times), sum(bytes_) / len(bytes_), logits


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
    say(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), dtype {args.dtype}, "
        f"config {args.checkpoint or args.config}{' (no engram)' if args.no_engram else ''}: "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, built in {build_s:.1f} s; "
        f"measured read bandwidth {bw / 1e9:.1f} GB/s; prompt {args.prompt}, {args.decode} timed decode steps "
        f"after {args.warmup} warm-up")
    say(f"{'phase':8} {'path':9} {'batch':>5} {'step ms':>9} {'tok/s':>9} {'MB/step':>9} {'roof tok/s':>11} "
        f"{'of roof':>8} {'speed-up':>8} {'max rel diff':>12}")
    g = torch.Generator().manual_seed(0)
    for B in args.batches:
        caches = [model.new_cache() for _ in range(B)]
        prompts = torch.randint(0, V, (B, args.prompt), generator=g)
        _sync(dev)
        t = time.perf_counter()
        model.forward_step([StepChunk(c, prompts[b].to(dev), 1) for b, c in enumerate(caches)])
        _sync(dev); dt = time.perf_counter() - t
        say(f"{'prefill':8} {'reference':9} {B:5d} {dt * 1e3:9.1f} {B * args.prompt / dt:9.1f}")
        toks = [torch.randint(0, V, (B,), generator=g).to(dev) for _ in range(steps)]
        results = {}
        paths = ["fast"] if args.skip_reference else ["reference", "fast"]
        for path in paths:
            model.fast_decode = path == "fast"
            step_s, sb, logits = decode_run(model, caches, toks, dev, counter, dense, per_expert, args.warmup)
            for c in caches:
                c.rollback(steps)
            results[path] = (step_s, logits)
            roof = B * bw / sb
            diff = ""
            speed = ""
            if path == "fast" and "reference" in results:
                ref_s, ref_logits = results["reference"]
                d = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                        for a, b in zip(logits, ref_logits))
                diff = f"{d:12.2e}"
                speed = f"{ref_s / step_s:7.1f}x"
            say(f"{'decode':8} {path:9} {B:5d} {step_s * 1e3:9.2f} {B / step_s:9.1f} {sb / 1e6:9.1f} {roof:11.1f} "
                f"{B / step_s / roof:8.1%} {speed:>8} {diff:>12}")
        model.fast_decode = True
        del caches
    say(f"total {time.perf_counter() - t0:.1f} s")


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
    ap.add_argument("--no-engram", action="store_true", help="drop the Engram layers from --config")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 on CPU: tiny ops lose to OpenMP spin contention)")
    args = ap.parse_args()
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    try:
        run(args)
    finally:
        if os.environ.get("OUT"):
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["OUT"]) / "model_forward.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
