"""Load a DeepSeek-V4 / V4.1 checkpoint folder into a `Model`, streaming one tensor at a time.

A checkpoint folder holds `config.json` and either `model.safetensors.index.json` + shards or safetensors
file(s); optionally `tokenizer.json`. Tensor names are DeepSeek's (`layers.3.attn.wq_a.weight`), with or
without a `model.` prefix; checkpoints written by transformers' `save_pretrained` are accepted too (its
few names that differ are mapped back, see `_ALIASES`).

Stored formats (spec §5.4), converted exactly to the model's parameter dtype while loading:
- bf16 / fp16 / fp32 tensors: copied (cast to the parameter's dtype);
- FP8 E4M3 `X.weight` + UE8M0 `X.scale` (32x32 blocks, or the config's `weight_block_size`): dequantized;
- FP4 routed experts: `int8 [out, in/2]` (low nibble first) + UE8M0 `[out, in/32]`: dequantized.
Routed experts with `expert_dtype="fp8"`: kept quantized instead, per layer, in kernels.moe's fp8 layout
(engine/moe.py `KeptExperts`: e4m3 weights, fp32 row scales, uint8 block shifts; FP4 repacked to e4m3 losslessly):
about half the bytes of bf16 experts, and the grouped kernel's fp8 path. `expert_dtype="fp4"` (the CUDA default;
see CUDA_EXPERT_DTYPE): all-FP4 layers stay packed FP4 as stored (a quarter of bf16; decoded in the kernel's
registers), the others as with "fp8". A layer is kept only if all its routed experts are FP8/FP4 with UE8M0
scales; otherwise it is dequantized as above.

Memory: the model is built once with parameter initialisation switched off (allocation only), then every
tensor is read from its shard (memory-mapped), converted and copied into its parameter, and dropped before
the next is read; so the peak is the model plus about one stored tensor and its converted copy.
Engram tables (`layers.{i}.engram.embed.weight` / `.scale`) are never read into memory: each becomes an
`EngramTable` memory-mapped from its shard (see engine/engram.py).

Everything is checked BEFORE any data is read: a missing, unexpected or mis-shaped tensor is named in a
`CheckpointError`, all problems at once. Known-unused tensors are skipped and listed in the `LoadReport`:
the vision tower and image markers, the MTP layers' copies of embed/head, `ffn.gate.bias_vl` when the model
has no image routing, and all `mtp.*` tensors when the model has no draft layers.
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer_sg.kernels.moe import is_packed_fp4, packed_fp4_fits

from .quant import dequantize_fp4_blocks, dequantize_fp8_blocks, expert_fp4_packed, expert_to_fp8, FP4_GROUP, FP8_BLOCK

INDEX_FILE = "model.safetensors.index.json"
EXPERT_DTYPES = ("bf16", "fp8", "fp4")     # routed experts: dequantized / kept as e4m3 / FP4 layers kept packed
# load_model's choice on CUDA: "fp4" (all-FP4 layers, every routed layer of a V4.1-Flash checkpoint, stay packed as
# stored: a quarter of bf16's bytes; FP8 layers go to e4m3). Since session 11 the packed kernel folds each group's
# shift into the weights as it decodes them and reaches 64 / 74-75 / 72-73% of its bytes at T = 8 / 64 / 256 (H200,
# V4.1 shape: 312 / 1401-1414 / 2290-2319 us), against the e4m3 stacks' 420-468 / 1989 / 3277 us in the same run:
# half the memory and 1.35-1.5x faster. "fp8" (FP4 repacked to e4m3 losslessly) stays available; both kept forms
# give the logits of the dequantizing load on the CPU twin (tests/engine/test_loader_kept_experts.py); on CUDA the
# kernels round differently: the packed kernel multiplies in bf16 (an fp32 model's expert activations are rounded
# to bf16 there; the fp8 kernel's to fp16). Layers whose dims are not multiples of 8 (the packed kernel's vector
# loads) go to e4m3.
CUDA_EXPERT_DTYPE = "fp4"


class CheckpointError(ValueError):
    """The checkpoint does not fit the model; the message names every offending tensor."""


@dataclass
class LoadReport:
    """What `load_weights` did: canonical names per category (for logs and tests)."""
    loaded: list[str] = field(default_factory=list)
    dequantized: dict[str, str] = field(default_factory=dict)   # name -> "fp8" | "fp4"
    kept_quantized: dict[str, str] = field(default_factory=dict)  # routed experts kept quantized: name -> stored kind
    engram_tables: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)            # stored names of known-unused tensors


# ----------------------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------------------

# transformers' save_pretrained reverses its rename table imperfectly for deepseek_v4: anchored patterns
# keep its own names under the `model.` prefix, and `attn.kv_norm` comes back as `attn.norm`.
_ALIASES = [
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
]

# Tensors a text-only model never uses: vision tower and image markers, the MTP layers' copies of the
# tied embedding/head. Skipped (and reported) instead of being "unexpected".
_UNUSED = re.compile(r"^(vision_pipeline\.|image_(start|end|newline)$|mtp\.\d+\.(embed|head)\.weight$)")
# The image-routing bias is unused by text-only models that do not declare it.
_UNUSED_IF_ABSENT = re.compile(r"\.ffn\.gate\.bias_vl$")
_ENGRAM_TABLE = re.compile(r"^(?:layers|mtp)\.\d+\.engram\.embed\.weight$")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


def _strip_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def canonical_name(stored: str, targets=None) -> str:
    """DeepSeek name for a stored tensor name: drop `model.`, undo transformers' renames.

    With `targets` (the model's names), an alias is used only if it is what the model has."""
    name = _strip_prefix(stored)
    if targets is not None and name in targets:
        return name
    for pattern, repl in _ALIASES:
        alias = pattern.sub(repl, name)
        if alias != name and (targets is None or alias in targets):
            return alias
    return name


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Stored tensor name -> the safetensors file holding it. Reads only the index / headers.

    `path` is a folder (with `model.safetensors.index.json`, or any `*.safetensors`) or one safetensors file."""
    p = Path(path)
    if p.is_file():
        return {name: p for name in _header_names(p)}
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    index = p / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        out = {}
        for name, fname in weight_map.items():
            f = p / fname
            if not f.exists():
                raise CheckpointError(f"{index} maps tensor {name!r} to missing shard {fname}")
            out[name] = f
        return out
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{p} has neither {INDEX_FILE} nor *.safetensors files")
    out = {}
    for f in files:
        for name in _header_names(f):
            if name in out:
                raise CheckpointError(f"tensor {name!r} is stored twice: in {out[name].name} and {f.name}")
            out[name] = f
    return out


def _header_names(f: Path) -> list[str]:
    with safe_open(str(f), framework="pt") as h:
        return list(h.keys())


# ----------------------------------------------------------------------------------------------------------
# Planning: match stored tensors to model parameters, validate everything before reading any data
# ----------------------------------------------------------------------------------------------------------

@dataclass
class _Item:
    target: str           # model state_dict name
    stored: str           # name in the file
    file: Path
    scale: tuple[str, Path] | None = None
    kind: str = "plain"   # "plain" | "fp8" | "fp4"
    scale_dtype: str | None = None   # the scale's safetensors dtype (F8_E8M0 / U8: UE8M0 bytes; F32: floats)


class _Handles:
    """One open safe_open handle per shard (memory-mapped; cheap), closed at the end."""

    def __init__(self):
        self._open: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def __call__(self, f: Path):
        if f not in self._open:
            self._open[f] = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
        return self._open[f]

    def close(self):
        self._stack.close()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _plan(files: dict[str, Path], targets: dict[str, torch.Tensor], handles: _Handles, block: int,
          strict: bool) -> tuple[list[_Item], list[tuple[str, str, Path, tuple[str, Path] | None]], list[str]]:
    """-> (items to load, engram tables (layer module path, weight name, file, scale), skipped stored names)."""
    problems: list[str] = []
    by_canon: dict[str, tuple[str, Path]] = {}
    for stored, f in files.items():
        canon = canonical_name(stored, targets)
        if canon in by_canon:
            problems.append(f"tensor {canon!r} is stored twice (as {by_canon[canon][0]!r} and {stored!r})")
        by_canon[canon] = (stored, f)

    # quantization scales: `X.scale` / `X.weight_scale_inv` next to a stored `X.weight` the model has
    scales: dict[str, tuple[str, Path]] = {}
    for canon in list(by_canon):
        for suf in _SCALE_SUFFIXES:
            if canon.endswith(suf) and canon not in targets:
                weight = canon[: -len(suf)] + ".weight"
                if weight in by_canon:
                    scales[weight] = by_canon.pop(canon)
                break

    # a model built without draft layers (e.g. V4, where only the V4.1 DSpark drafter is implemented) skips the
    # checkpoint's MTP layers instead of rejecting them
    has_mtp = any(t.startswith("mtp.") for t in targets)
    items, tables, skipped, unexpected = [], [], [], []
    for canon, (stored, f) in sorted(by_canon.items()):
        if _ENGRAM_TABLE.match(canon) and canon not in targets:
            tables.append((canon[: -len(".embed.weight")], stored, f, scales.pop(canon, None)))
            continue
        if canon in targets:
            items.append(_Item(canon, stored, f, scales.pop(canon, None)))
        elif _UNUSED.match(canon) or _UNUSED_IF_ABSENT.search(canon) or (not has_mtp and canon.startswith("mtp.")):
            skipped.append(stored)
            if canon in scales:
                skipped.append(scales.pop(canon)[0])
        else:
            unexpected.append(stored)
    if unexpected and strict:
        problems.append(f"{len(unexpected)} unexpected tensor(s) the model has no parameter for: "
                        + _names(unexpected))
    missing = sorted(set(targets) - {it.target for it in items})
    if missing:
        problems.append(f"{len(missing)} missing tensor(s) the model needs: " + _names(missing))

    for it in items:
        problems += _check_shape(it, targets[it.target], handles, block)
    if problems:
        raise CheckpointError("checkpoint does not match the model:\n  - " + "\n  - ".join(problems))
    return items, tables, skipped


def _names(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


_QUANT_DTYPES = {"F8_E4M3": "fp8", "I8": "fp4", "U8": "fp4"}


def _check_shape(it: _Item, target: torch.Tensor, handles: _Handles, block: int) -> list[str]:
    """Decide the item's storage kind from its header and check shapes against the parameter; sets it.kind."""
    try:
        sl = handles(it.file).get_slice(it.stored)
    except Exception:  # an index that names the wrong shard
        return [f"{it.stored!r} is not in {it.file.name}, the shard the index names for it"]
    shape, dtype = list(sl.get_shape()), sl.get_dtype()
    want = list(target.shape)
    kind = _QUANT_DTYPES.get(dtype, "plain")
    if kind == "fp4" and target.dtype in (torch.int8, torch.uint8):
        kind = "plain"  # an integer parameter stored as integers
    it.kind = kind
    if kind == "plain":
        if it.scale is not None:
            return [f"{it.stored!r} is {dtype} but has a quantization scale {it.scale[0]!r}"]
        if shape != want:
            return [f"{it.stored!r} has shape {shape}, the model expects {want}"]
        return []
    if it.scale is None:
        return [f"{it.stored!r} is stored as {dtype} ({kind}) but its scale '{it.target[:-len('weight')]}scale' "
                f"is missing"]
    ssl = handles(it.scale[1]).get_slice(it.scale[0])
    sshape, it.scale_dtype = list(ssl.get_shape()), ssl.get_dtype()
    if len(want) != 2:
        return [f"{it.stored!r} is quantized ({dtype}) but the model parameter has shape {want}"]
    out_dim, in_dim = want
    if kind == "fp8":
        want_w, want_s = want, [_cdiv(out_dim, block), _cdiv(in_dim, block)]
    else:
        want_w, want_s = [out_dim, in_dim // 2], [out_dim, _cdiv(in_dim, FP4_GROUP)]
    errs = []
    if shape != want_w:
        errs.append(f"{it.stored!r} ({kind}) has shape {shape}, expected {want_w} for a model parameter of {want}")
    if sshape != want_s:
        errs.append(f"{it.scale[0]!r} has shape {sshape}, expected {want_s} for {kind} weight {it.stored!r}")
    return errs


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------

def _read(handle, name: str) -> torch.Tensor:
    """Read one stored tensor (the single place data leaves the file; tests instrument it)."""
    return handle.get_tensor(name)


_ROUTED = re.compile(r"^(.*\.ffn)\.experts\.(\d+)\.(w[123])\.weight$")
_UE8M0_DTYPES = ("F8_E8M0", "U8")


def _keep_experts(model: torch.nn.Module, items: list[_Item], block: int, expert_dtype: str) -> dict:
    """Per MoE layer: keep its routed experts quantized (KeptExperts) when `expert_dtype` is "fp8" / "fp4" and
    every one of them is stored FP8 (block x block, block 32) or FP4 with UE8M0 scales ("fp4": an all-FP4 layer
    stays packed FP4, others go to e4m3); otherwise make sure they have real weights (meta-built layers are
    materialized). -> {target name: (KeptExperts, "w1"|"w2"|"w3", expert, rows)}."""
    from .moe import MoE
    layers: dict[str, list] = {}
    for it in items:
        m = _ROUTED.match(it.target)
        if m:
            layers.setdefault(m.group(1), []).append((it, int(m.group(2)), m.group(3)))
    kept = {}
    for path, entries in layers.items():
        moe = model.get_submodule(path)
        if not isinstance(moe, MoE):
            continue
        device = moe.gate.weight.device
        kinds = {it.kind for it, _, _ in entries}
        keep = (expert_dtype in ("fp8", "fp4") and len(entries) == 3 * len(moe.experts) and kinds <= {"fp8", "fp4"}
                and all(it.scale_dtype in _UE8M0_DTYPES for it, _, _ in entries)
                and ("fp8" not in kinds or block == FP4_GROUP))
        if not keep:
            moe.materialize_experts(device)
            continue
        rows = block if kinds == {"fp8"} else 1
        # (dims the packed kernel cannot take go to e4m3)
        packed = expert_dtype == "fp4" and kinds == {"fp4"} and packed_fp4_fits(*moe.experts[0].w1.weight.shape[::-1])
        q = moe.keep_quantized(rows, device, packed=packed)
        for it, e, which in entries:
            kept[it.target] = (q, which, e, rows)
    return kept


@torch.no_grad()
def load_weights(model: torch.nn.Module, path: str | Path, strict: bool = True,
                 block_size: int | None = None, expert_dtype: str = "bf16") -> LoadReport:
    """Copy a checkpoint's tensors into `model`'s parameters and persistent buffers, one tensor at a time.

    `strict=False` tolerates unexpected tensors (missing or mis-shaped ones always raise). `block_size`:
    FP8 block edge (default: the checkpoint config's `weight_block_size`, else 32). `expert_dtype`: "bf16"
    dequantizes FP8/FP4 routed experts into the model's dtype; "fp8" / "fp4" keep them quantized (module doc).
    Cost: reads every tensor once; peak extra memory ~ one stored tensor plus its fp32 conversion."""
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype must be 'bf16' (dequantize), 'fp8' or 'fp4' (keep quantized), got "
                         f"{expert_dtype!r}")
    path = Path(path)
    files = checkpoint_files(path)
    block = block_size or _config_block_size(path) or FP8_BLOCK
    targets = dict(model.state_dict(keep_vars=True))
    handles = _Handles()
    report = LoadReport()
    try:
        items, tables, report.skipped = _plan(files, targets, handles, block, strict)
        kept = _keep_experts(model, items, block, expert_dtype)
        targets = dict(model.state_dict(keep_vars=True))        # materialized layers have new parameters
        # shard by shard, in file order, so each shard's pages are touched once
        for it in sorted(items, key=lambda i: (str(i.file), i.stored)):
            target = targets[it.target]
            if it.target in kept:
                q, which, e, rows = kept[it.target]
                dev = q.w1.device
                raw = _read(handles(it.file), it.stored).to(dev)
                scale = _read(handles(it.scale[1]), it.scale[0]).to(dev)
                parts = (expert_fp4_packed(raw, scale) if is_packed_fp4(q.w1) else
                         expert_to_fp8(raw, scale, it.kind, rows, block))
                q.store(which, e, *parts)
                report.kept_quantized[it.target] = it.kind
                report.loaded.append(it.target)
                del raw, scale
                continue
            raw = _read(handles(it.file), it.stored).to(target.device)
            if it.kind == "plain":
                value = raw
            else:
                scale = _read(handles(it.scale[1]), it.scale[0]).to(target.device)
                if it.kind == "fp8":
                    value = dequantize_fp8_blocks(raw, scale, torch.float32, block)
                else:
                    value = dequantize_fp4_blocks(raw, scale, torch.float32)
                report.dequantized[it.target] = it.kind
                del scale
            target.copy_(value)
            report.loaded.append(it.target)
            del raw, value
        for q in {id(v[0]): v[0] for v in kept.values()}.values():
            q.finalize()
        for module_path, weight_name, f, scale in tables:
            _attach_engram_table(model, module_path, weight_name, f, scale)
            report.engram_tables.append(weight_name)
    finally:
        handles.close()
    return report


def _attach_engram_table(model, module_path: str, weight_name: str, f: Path, scale) -> None:
    from .engram import EngramTable  # helper C's memory-mapped table
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        raise CheckpointError(f"unexpected engram table {weight_name!r}: the model has no module {module_path!r}")
    module.table = EngramTable.from_safetensors(f, weight_name, scale[0] if scale else None)


def _config_block_size(path: Path) -> int | None:
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    if not cfg.exists():
        return None
    qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    bs = qc.get("weight_block_size")
    if bs is None:
        return None
    if len(bs) != 2 or bs[0] != bs[1]:
        raise CheckpointError(f"{cfg}: quantization_config.weight_block_size {bs} is not a square block")
    return int(bs[0])


@contextlib.contextmanager
def skip_init(dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """Build modules without running their random initialisers (allocation only), optionally with a default
    dtype and device; the loader overwrites every parameter anyway, so init is wasted time."""
    names = ["uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
             "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_"]
    saved = {n: getattr(torch.nn.init, n) for n in names if hasattr(torch.nn.init, n)}
    old_dtype = torch.get_default_dtype()

    def noop(tensor, *args, **kwargs):
        return tensor

    try:
        for n in saved:
            setattr(torch.nn.init, n, noop)
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with (torch.device(device) if device is not None else contextlib.nullcontext()):
            yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)
        torch.set_default_dtype(old_dtype)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               strict: bool = True, expert_dtype: str | None = None, **model_options):
    """Build `Model(ModelConfig.from_json(path/config.json), **model_options)` on `device` and load its weights.

    Floating parameters are created in `dtype` (the model may keep some in fp32 on purpose); quantized
    tensors are dequantized exactly, except routed experts with `expert_dtype="fp8"` or "fp4" (None: the
    CUDA_EXPERT_DTYPE on CUDA; "bf16" elsewhere, where the CPU twin would dequantize every used expert at every
    step): kept quantized, see the module doc (their Linear weights are then meta placeholders, never
    allocated in `dtype`). The model gets
    `tokenizer_path` (the folder's tokenizer.json or None) and `load_report`. Raises `CheckpointError` naming
    missing / unexpected / mis-shaped tensors."""
    from .config import ModelConfig
    from .model import Model
    from .moe import routed_experts_on_meta

    if expert_dtype is None:
        expert_dtype = CUDA_EXPERT_DTYPE if torch.device(device).type == "cuda" else "bf16"
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype must be 'bf16' (dequantize), 'fp8' or 'fp4' (keep quantized), got "
                         f"{expert_dtype!r}")

    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    config = ModelConfig.from_json(folder / "config.json")
    # Parameters are allocated directly in `dtype` (default dtype during construction), so a bf16 load never
    # holds an fp32 copy of the model; buffers the model computes (RoPE frequencies) use explicit dtypes.
    # routed experts start as meta placeholders when they may be kept quantized (a real V4.1's bf16 experts
    # would not fit); the layers that are not kept get real weights before their data is read
    with skip_init(dtype=dtype if dtype.is_floating_point else None), routed_experts_on_meta(expert_dtype != "bf16"):
        model = Model(config, dtype=dtype, device=device, **model_options)
    model.eval()
    model.load_report = load_weights(model, path, strict=strict, expert_dtype=expert_dtype)
    tok = folder / "tokenizer.json"
    model.tokenizer_path = str(tok) if tok.exists() else None
    return model
