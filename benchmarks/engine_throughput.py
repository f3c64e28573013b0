"""Engine throughput: output tokens/s and step time at batch 1/8/64/256, unconstrained vs JSON-Schema-
constrained in the same run, plus where a decode step's time goes (forward vs everything else).

    python benchmarks/engine_throughput.py                                # CPU, bundled tiny default model
    python benchmarks/engine_throughput.py --model midsize --device cuda --dtype bfloat16 \
        --batches 1,8,64,256 --tokens 64       # H200: random weights drawn on the GPU (no checkpoint on disk)
    (--checkpoint DIR loads a write_checkpoint folder instead, writing it first if missing: ~25 GB, slow)
With $OUT set, the table is also written to $OUT/engine_throughput.txt (rewritten after every row).

Method: for each batch size, B requests with the same prompt length are prefilled first (not timed), then
`--tokens` decode steps are timed (ignore_eos, sampled at T=1 with per-request seeds). The constrained run
uses a JSON Schema whose minimum length is never reached within the budget ({"text": string, minLength
10000}), so no request finishes early and both runs decode exactly B x tokens tokens; its masks (most of
the vocabulary allowed inside a JSON string: the expensive case for mask computation) are filled on CPU
threads while the forward runs. Columns:
  tok/s        output tokens per second over the decode steps
  step ms      mean decode step (schedule + forward + mask wait + sample + commit)
  fwd ms       mean model forward inside the step (the physical part; CUDA-synchronised)
  mask wait ms mean time the step waited for masks AFTER the forward (what did not overlap)
  overhead     (step - forward) / step: the per-step Python/host share (target < 10% at batch 64 on GPU)
  c/u          constrained tok/s / unconstrained tok/s (target >= 97% on the H200)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinfer_sg import SamplingParams, load_tokenizer  # noqa: E402
from deepinfer_sg.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from deepinfer_sg.grammars import JsonSchema  # noqa: E402

SCHEMA = JsonSchema({"type": "object", "properties": {"text": {"type": "string", "minLength": 10000}},
                     "required": ["text"]}, whitespace="compact")


def build_model(args):
    dtype = getattr(torch, args.dtype)
    if args.model == "default":
        from deepinfer_sg.engine.default_model import build_default_model
        return build_default_model(seed=0, device=args.device, dtype=dtype)
    from deepinfer_sg.engine.testing import midsize_v41_config
    if args.checkpoint:   # an existing (or to be written) write_checkpoint folder
        from deepinfer_sg.engine.loader import load_model
        from deepinfer_sg.engine.testing import write_checkpoint
        path = Path(args.checkpoint)
        if not (path / "config.json").exists():
            print(f"writing the mid-size checkpoint to {path} (once; ~25 GB) ...", flush=True)
            write_checkpoint(midsize_v41_config(), path, seed=0)
        return load_model(str(path), device=args.device, dtype=dtype)
    t0 = time.perf_counter()
    model = random_model_on_device(midsize_v41_config(), args.device, dtype, seed=0)
    print(f"built the mid-size model with random weights on {args.device} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return model


BIG = 1 << 20   # tensors at least this large are drawn on the device; smaller ones by engine/testing.py's rules


def _big_tensor_std(name: str, shape: tuple, text: dict) -> float:
    """engine/testing.py `_init_value`'s std for the plain Gaussian matrices (the only big tensors)."""
    import math

    from deepinfer_sg.engine.testing import _RESIDUAL_OUT
    if name == "embed.weight" or name.endswith("markov_head.embed.weight"):
        return 1.0
    if name == "head.weight":
        return 2.5 * shape[1] ** -0.5
    std = shape[-1] ** -0.5
    if _RESIDUAL_OUT.search(name):
        std /= math.sqrt(2 * max(1, int(text.get("num_hidden_layers", 1))))
    if name.endswith("markov_head.head.weight"):
        std *= 0.5
    return std


def random_model_on_device(config: dict, device: str, dtype: torch.dtype, seed: int = 0):
    """The model of `config` with random weights drawn directly on `device` (no checkpoint on disk): the same
    value distributions as engine/testing.write_checkpoint (small tensors by its own `_init_value`, big
    Gaussian matrices with its std rules but a device generator), and random FP8 Engram tables generated on
    the device in chunks. Not bit-identical to a written checkpoint; a benchmark only needs realistic scales.
    Cost on an H200: seconds for ~10 B parameters (vs minutes to write and read back ~25 GB)."""
    from deepinfer_sg.engine import engram as engram_mod
    from deepinfer_sg.engine import testing as T
    from deepinfer_sg.engine.config import ModelConfig
    from deepinfer_sg.engine.loader import skip_init
    from deepinfer_sg.engine.model import Model

    text = config.get("text_config", config)
    saved = engram_mod.MAX_RANDOM_TABLE_ELEMENTS
    engram_mod.MAX_RANDOM_TABLE_ELEMENTS = 0          # tables are attached below, from device-made values
    try:
        with skip_init(dtype=dtype):
            model = Model(ModelConfig.from_dict(config), dtype=dtype, device=device)
    finally:
        engram_mod.MAX_RANDOM_TABLE_ELEMENTS = saved
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point() and t.numel() >= BIG and t.dim() == 2 and not name.endswith(("_fn", "_base")):
                t.normal_(0.0, _big_tensor_std(name, tuple(t.shape), text), generator=dev_gen)
            else:
                g = torch.Generator().manual_seed(seed * 1_000_003 + T._stable_hash(name))
                t.copy_(T._init_value(name, tuple(t.shape), t.dtype if not t.is_floating_point() else torch.float32,
                                      text, g).to(t.device, t.dtype))
        for layer, (rows, width) in sorted(T.engram_tables(config).items()):
            ws, ss = [], []
            for start in range(0, rows, 1 << 20):
                vals = torch.randn(min(1 << 20, rows - start), width, device=device, generator=dev_gen)
                w, sc = engram_mod.quantize_rows_fp8(vals)
                ws.append(w.cpu())
                ss.append(sc.cpu())
            model.layers[layer].engram.table = engram_mod.EngramTable.from_tensors(torch.cat(ws), torch.cat(ss))
    return model.eval()


def run_one(engine: LLMEngine, batch: int, tokens: int, constrained: bool, prompt_ids: list[int]) -> dict:
    ids = []
    for i in range(batch):
        sp = SamplingParams(max_tokens=tokens + 1, temperature=1.0, seed=1000 + i, ignore_eos=True)
        ids.append(engine.add_request(list(prompt_ids), sp, SCHEMA if constrained else None))
    # prefill (and compile wait) until every request has its first token: not timed
    while any(len(engine.requests[i].output_token_ids) == 0 and not engine.requests[i].finished for i in ids):
        engine.step()
    engine.stats.reset()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    s = engine.stats
    outs = [engine.pop_output(i) for i in ids]
    errors = [o.error for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"benchmark requests failed: {errors[:2]}")
    n = s.num_sampled_tokens
    return {
        "tok_s": n / wall, "step_ms": 1e3 * s.time_step_s / max(1, s.num_steps),
        "fwd_ms": 1e3 * s.time_forward_s / max(1, s.num_steps),
        "mask_wait_ms": 1e3 * s.time_mask_wait_s / max(1, s.num_steps),
        "sample_ms": 1e3 * s.time_sample_s / max(1, s.num_steps),
        "overhead": s.python_overhead_fraction, "steps": s.num_steps, "tokens": n,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["default", "midsize"], default="default")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--checkpoint", default=None,
                    help="mid-size: load this write_checkpoint folder (written if missing) instead of drawing "
                         "random weights directly on the device")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--tokens", type=int, default=16, help="timed decode steps per request")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    tok = load_tokenizer()
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=max(batches), max_num_batched_tokens=8192))
    engine.compiler.compile(SCHEMA)   # warm the compile cache: compile time is not decode throughput
    prompt_ids = [0] + tok.encode("Write a long story about a lighthouse keeper. " * 8).ids[: args.prompt_len - 1]
    table = Table(Path(os.environ["OUT"]) / "engine_throughput.txt" if os.environ.get("OUT") else None)
    table.line(f"device={args.device} model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} "
               f"tokens/request={args.tokens} prompt={len(prompt_ids)} sampler={_sampler_path(args.device)}")
    head = (f"{'batch':>5} {'mode':>12} {'tok/s':>9} {'step ms':>9} {'fwd ms':>9} {'mask wait':>9} "
            f"{'sample ms':>9} {'overhead':>8} {'c/u':>6}")
    table.line(head)
    table.line("-" * len(head))
    for b in batches:
        u = run_one(engine, b, args.tokens, False, prompt_ids)
        c = run_one(engine, b, args.tokens, True, prompt_ids)
        for mode, r in (("unconstrained", u), ("json-schema", c)):
            ratio = f"{c['tok_s'] / u['tok_s']:.1%}" if mode == "json-schema" else ""
            table.line(f"{b:>5} {mode:>12} {r['tok_s']:>9.1f} {r['step_ms']:>9.2f} {r['fwd_ms']:>9.2f} "
                       f"{r['mask_wait_ms']:>9.2f} {r['sample_ms']:>9.2f} {r['overhead']:>8.1%} {ratio:>6}")
    engine.close()


class Table:
    """Prints each line and, when a path is given ($OUT/engine_throughput.txt), rewrites that file after every
    line, so a run cut off by a time limit still leaves the rows it finished."""

    def __init__(self, path: Optional[Path]):
        self.path, self.lines = path, []

    def line(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("\n".join(self.lines) + "\n")


def _sampler_path(device: str) -> str:
    from deepinfer_sg.engine import sampler
    fused = sampler._FUSED is not None and (device.startswith("cuda") or sampler.FUSED_ON_CPU)
    return "kernels.sample_from_logits (fused)" if fused else "engine torch path"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
