"""Engram (spec §2.6): hash layout, token classes, memory-mapped table and the gated value add.

Every expected value is recomputed here from the spec with independent means: primes by trial division,
the hash with Python integers, the table decoded by hand from its bytes, the gate written per token."""
from __future__ import annotations

import json
import math
import re
import unicodedata

import numpy as np
import pytest
import torch

from deepinfer_sg.engine import engram as eg
from deepinfer_sg.kernels.engram_gate import unpack_rows

TINY = {  # the engram part of the spec's tiny V4.1 config (§6.1)
    "vocab_size": 512, "hidden_size": 64, "hc_mult": 4, "rms_norm_eps": 1e-6,
    "engram_layer_ids": [1], "engram_max_ngram_size": 3, "engram_vocab_size": 97,
    "engram_n_heads": 2, "engram_head_dim": 32, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 0,
}
REAL = {  # DeepSeek-V4.1-Flash text_config (§1.2)
    "vocab_size": 129280, "hidden_size": 5120, "hc_mult": 4, "rms_norm_eps": 1e-20,
    "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_vocab_size": 16000000,
    "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
}
INT64_MAX = 2**63 - 1


def is_prime_trial(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def primes_by_trial_division(cfg: dict) -> dict[int, list[list[int]]]:
    """The spec's rule: per (layer, n, head) in config order, the next prime above the previous
    (starting from engram_vocab_size - 1 for every n), skipping primes used anywhere before."""
    used, out = set(), {}
    for layer in cfg["engram_layer_ids"]:
        out[layer] = []
        for _n in range(2, cfg["engram_max_ngram_size"] + 1):
            p, heads = cfg["engram_vocab_size"] - 1, []
            for _h in range(cfg["engram_n_heads"]):
                p += 1
                while not is_prime_trial(p) or p in used:
                    p += 1
                used.add(p)
                heads.append(p)
            out[layer].append(heads)
    return out


def multipliers_by_numpy(layer: int, n: int, class_count: int) -> list[int]:
    bound = max(1, (INT64_MAX // class_count) // 2)
    r = np.random.default_rng(10007 * layer).integers(0, bound, size=n, dtype=np.int64)
    return [int(x) * 2 + 1 for x in r]


def rows_by_hand(tokens: list[int], classes, cfg: dict, layer: int, primes, mults) -> list[list[int]]:
    """Row ids per token with Python ints: pad before the start, acc = c0*m0, acc ^= ci*mi, % prime + offset."""
    n_max, pad = cfg["engram_max_ngram_size"], cfg["engram_pad_token_id"]
    flat_primes = [p for per_n in primes for p in per_n]
    out = []
    for t in range(len(tokens)):
        c = [int(classes[tokens[t - r]]) if t - r >= 0 else int(classes[pad]) for r in range(n_max)]
        acc = c[0] * mults[0]
        rows = []
        for i in range(1, n_max):
            acc ^= c[i] * mults[i]
            for h in range(cfg["engram_n_heads"]):
                k = (i - 1) * cfg["engram_n_heads"] + h
                rows.append(acc % flat_primes[k] + sum(flat_primes[:k]))
        out.append(rows)
    return out


# ------------------------------------------------------------------------------------------------
# Static layout
# ------------------------------------------------------------------------------------------------


def test_tiny_primes_match_the_spec_and_trial_division():
    spec = eg.EngramSpec.from_config(TINY)
    assert eg.engram_primes(spec, 1) == [[97, 101], [103, 107]]  # spec §6.1: table 408 rows
    assert eg.engram_table_rows(spec, 1) == 408
    assert eg.engram_offsets(eg.engram_primes(spec, 1)) == [0, 97, 198, 301]


def test_later_layers_skip_primes_used_by_earlier_layers():
    cfg = dict(TINY, engram_layer_ids=[1, 3, 5], engram_max_ngram_size=4, engram_n_heads=3)
    spec = eg.EngramSpec.from_config(cfg)
    expected = primes_by_trial_division(cfg)
    for layer in cfg["engram_layer_ids"]:
        assert eg.engram_primes(spec, layer) == expected[layer]
    flat = [p for layer in expected for per_n in expected[layer] for p in per_n]
    assert len(set(flat)) == len(flat)


def test_real_config_table_rows_match_the_checkpoint():
    spec = eg.EngramSpec.from_config(REAL)
    expected = primes_by_trial_division(REAL)
    for layer, rows in zip((1, 14), (384006168, 384016682)):  # config engram_num_embeddings
        assert eg.engram_primes(spec, layer) == expected[layer]
        assert sum(p for per_n in expected[layer] for p in per_n) == rows
        assert eg.engram_table_rows(spec, layer) == rows


def test_frozen_multipliers_regenerate_identically():
    with open(eg.FROZEN_MULTIPLIERS_FILE, encoding="utf-8") as f:
        frozen = json.load(f)
    assert frozen["class_count"] == 99092 and frozen["max_ngram_size"] == 4
    spec = eg.EngramSpec.from_config(REAL)
    bound = max(1, (INT64_MAX // 99092) // 2)
    for layer in (1, 14):
        regenerated = multipliers_by_numpy(layer, 4, 99092)
        assert frozen["multipliers"][str(layer)] == regenerated
        assert eg.engram_multipliers(spec, layer, 99092) == regenerated
        assert all(m % 2 == 1 and m < 2 * bound + 1 for m in regenerated)


def test_multipliers_of_other_configs_are_generated():
    spec = eg.EngramSpec.from_config(TINY)
    assert eg.engram_multipliers(spec, 1, 512) == multipliers_by_numpy(1, 3, 512)


# ------------------------------------------------------------------------------------------------
# Token classes
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(eg.default_tokenizer_path())


@pytest.fixture(scope="module")
def real_classes():
    return eg.token_class_map(129280, 99092)


def key_by_hand(text: str) -> str:
    """The spec's normalization written with Python's unicodedata (fine for the plain tokens used here)."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if unicodedata.category(ch) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = s if s == " " else s.strip()
    return s or text


def test_real_class_map_has_the_spec_class_count(real_classes):
    assert len(real_classes) == 129280
    assert int(real_classes.max()) + 1 == 99092
    # class ids appear in token-id order: each new class is exactly one more than any seen before
    running_max = np.maximum.accumulate(np.concatenate([[-1], real_classes[:-1]]))
    assert np.all(real_classes <= running_max + 1)
    assert real_classes[0] == 0


def test_tricky_tokens_share_classes_as_normalization_says(real_tokenizer, real_classes):
    vocab = real_tokenizer.get_vocab()
    # byte-level vocab strings: Ġ = space, Ċ = newline, ĉ = tab, Ã© = é, ĠÃī = " É", ï¼¡ = fullwidth A,
    # ï¬ģ = the ligature ﬁ, ĠÂł = " " + no-break space
    words = ["Hello", "hello", "ĠHello", "Ġhello", "e", "ĠE", "Ã©", "Ã¨", "ĠÃī", "Ã©t", "ĠÃ©t", "a", "ï¼¡",
             "Ċ", "ĊĊ", "Ġ", "ĠĠ", "ĉ", "ĠÂł", "The", "Ġthe", "ï¬ģ", "fi"]
    ids = [vocab[w] for w in words]
    texts = {i: real_tokenizer.decode([i], skip_special_tokens=False) for i in ids}
    keys = {i: key_by_hand(texts[i]) for i in ids if "\ufffd" not in texts[i]}
    for a in keys:
        for b in keys:
            assert (real_classes[a] == real_classes[b]) == (keys[a] == keys[b]), (texts[a], texts[b])
    same = [("Hello", "Ġhello"), ("e", "Ã©"), ("ĠÃī", "Ã¨"), ("Ã©t", "ĠÃ©t"), ("a", "ï¼¡"), ("ï¬ģ", "fi"), ("The", "Ġthe")]
    for a, b in same:
        assert real_classes[vocab[a]] == real_classes[vocab[b]], (a, b)
    assert real_classes[vocab["e"]] != real_classes[vocab["a"]]
    # whitespace-only tokens all collapse to the lone-space class (which survives the strip)
    spaces = [vocab[w] for w in ("Ġ", "Ċ", "ĊĊ", "ĠĠ", "ĉ", "ĠÂł")]
    assert len({int(real_classes[i]) for i in spaces}) == 1


def test_partial_utf8_tokens_use_their_raw_vocab_string(real_tokenizer, real_classes):
    partial = [i for i in range(3, 400) if "\ufffd" in real_tokenizer.decode([i], skip_special_tokens=False)]
    assert len(partial) > 10
    raw = [real_tokenizer.id_to_token(i) for i in partial]
    assert len(set(raw)) == len(raw)
    # distinct raw strings -> distinct classes
    assert len({int(real_classes[i]) for i in partial}) == len(partial)


def test_special_tokens_keep_distinct_classes(real_classes):
    assert len({int(real_classes[i]) for i in (0, 1, 2)}) == 3


def test_class_count_mismatch_is_reported():
    with pytest.raises(ValueError, match="engram_compressed_vocab_size=1234"):
        eg.token_class_map(129280, 1234)


# ------------------------------------------------------------------------------------------------
# n-gram windows and row ids
# ------------------------------------------------------------------------------------------------


def test_windows_pad_before_the_start_and_chunk_consistently():
    tokens = torch.tensor([10, 11, 12, 13, 14])
    w = eg.ngram_windows(tokens, None, 3, pad_token_id=2)
    assert w.tolist() == [[10, 2, 2], [11, 10, 2], [12, 11, 10], [13, 12, 11], [14, 13, 12]]
    tail = eg.ngram_windows(tokens[3:], tokens[:3], 3, pad_token_id=2)
    assert torch.equal(tail, w[3:])
    one = eg.ngram_windows(tokens[1:2], [10], 3, pad_token_id=2)
    assert one.tolist() == [[11, 10, 2]]


def test_tiny_rows_match_the_hash_by_hand():
    spec = eg.EngramSpec.from_config(TINY)
    module = eg.Engram(spec, 1)
    tokens = [0, 5, 511, 300, 2, 2, 77, 5, 511, 300]
    classes = list(range(512))
    rows = module.row_ids(eg.ngram_windows(torch.tensor(tokens), None, 3, 2))
    expected = rows_by_hand(tokens, classes, TINY, 1, primes_by_trial_division(TINY)[1], multipliers_by_numpy(1, 3, 512))
    assert rows.tolist() == expected
    assert int(rows.max()) < 408


def test_real_rows_match_the_hash_by_hand(real_classes):
    spec = eg.EngramSpec.from_config(REAL)
    tokens = [0, 19923, 14, 2501, 129279 - 1000, 128799, 3, 3, 3, 100, 65000]
    primes = primes_by_trial_division(REAL)
    for layer in (1, 14):
        classes = torch.from_numpy(real_classes)
        w = eg.ngram_windows(torch.tensor(tokens), None, 4, 2)
        got = eg.hash_rows(classes[w], eg.engram_multipliers(spec, layer, 99092), eg.engram_primes(spec, layer),
                           eg.engram_offsets(eg.engram_primes(spec, layer)))
        expected = rows_by_hand(tokens, real_classes, REAL, layer, primes[layer], multipliers_by_numpy(layer, 4, 99092))
        assert got.tolist() == expected


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------


def e4m3_by_hand(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def test_fp8_table_from_safetensors_matches_decoding_by_hand(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    rows, width = 300, 64
    weight_bytes = torch.randint(0, 256, (rows, width), dtype=torch.uint8)
    weight_bytes[(weight_bytes & 0x7F) == 0x7F] = 0x11  # no NaN codes
    scale_bytes = torch.randint(110, 140, (rows, width // 32), dtype=torch.uint8)
    path = tmp_path / "t.safetensors"
    save_file({"layers.1.engram.embed.weight": weight_bytes.view(torch.float8_e4m3fn),
               "layers.1.engram.embed.scale": scale_bytes.view(torch.float8_e8m0fnu),
               "other": torch.zeros(3)}, str(path))
    table = eg.EngramTable.from_safetensors(path, "layers.1.engram.embed.weight", "layers.1.engram.embed.scale")
    assert (table.rows, table.head_dim) == (rows, width)
    ids = torch.tensor([[5, 299, 0], [5, 17, 123]])
    got = table.lookup(ids)
    assert got.shape == (2, 3, width) and got.dtype == torch.float32
    for r in ids.flatten().tolist():
        expected = [e4m3_by_hand(int(weight_bytes[r, j])) * 2.0 ** (int(scale_bytes[r, j // 32]) - 127) for j in range(width)]
        row = got.reshape(-1, width)[ids.flatten().tolist().index(r)]
        assert row.tolist() == expected
    in_memory = eg.EngramTable.from_tensors(weight_bytes.view(torch.float8_e4m3fn), scale_bytes.view(torch.float8_e8m0fnu))
    assert torch.equal(in_memory.lookup(ids), got)
    assert torch.equal(in_memory.full(), table.full())
    # the packed bytes (the fast path ships these and decodes on the device): the stored bytes, decoding to
    # the hand-decoded values bit for bit
    for t in (table, in_memory):
        packed = t.lookup_packed(ids)
        assert packed.shape == (2, 3, width + width // 32) and packed.dtype == torch.uint8
        assert torch.equal(packed[..., :width], weight_bytes[ids]) and torch.equal(packed[..., width:], scale_bytes[ids])
        assert torch.equal(unpack_rows(packed, width, torch.float32), got)   # the decoder the model runs
        into = torch.full(packed.shape, 7, dtype=torch.uint8)       # (the upload's pinned buffer on CUDA)
        assert t.lookup_packed(ids, out=into) is into and torch.equal(into, packed)
    assert isinstance(table._weight, np.memmap)       # (both of lookup_packed's branches ran)
    assert eg.EngramTable.from_tensors(torch.randn(4, 64)).lookup_packed(ids[:, :1] % 4) is None   # not FP8


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_huge_sparse_table_reads_only_touched_rows(tmp_path):
    """A 2 GiB table file (sparse on disk): lookups must not pull the table into memory."""
    rows, width = 1 << 26, 32
    header = {"w": {"dtype": "F8_E4M3", "shape": [rows, width], "data_offsets": [0, rows * width]},
              "s": {"dtype": "F8_E8M0", "shape": [rows, 1], "data_offsets": [rows * width, rows * width + rows]}}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    start = 8 + len(blob)
    touched = {0: 0x38, 12345678: 0x40, rows - 1: 0xB8}  # e4m3 bytes: 1.0, 2.0, -1.0
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        f.truncate(start + rows * width + rows)  # sparse: the untouched rows are holes that read as 0
        for r, byte in touched.items():
            f.seek(start + r * width)
            f.write(bytes([byte]) * width)
            f.seek(start + rows * width + r)
            f.write(bytes([127 + 3]))  # scale 2^3
    before = _rss_bytes()
    table = eg.EngramTable.from_safetensors(path, "w", "s")
    got = table.lookup(torch.tensor(list(touched) + [777]))
    grew = _rss_bytes() - before
    assert got[:, 0].tolist() == [8.0, 16.0, -8.0, 0.0]
    assert torch.equal(got, got[:, :1].expand(-1, width))
    assert grew < 256 * 1024 * 1024, f"RSS grew by {grew} bytes for a {rows * width}-byte table"


def test_missing_table_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(4, 32)}, str(path))
    with pytest.raises(KeyError, match="layers.1.engram.embed.weight"):
        eg.EngramTable.from_safetensors(path, "layers.1.engram.embed.weight", "layers.1.engram.embed.scale")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_a_deep_copied_table_hands_kernels_pinned_rows():
    """device_arrays hands kernels pinned memory they read over PCIe; a deep copy's arrays are plain host memory
    (a kernel reading them faults), so the copy pins its own."""
    import copy
    t = eg.EngramTable.random(64, 32)
    w, s = t.device_arrays("cuda")
    c = copy.deepcopy(t)
    cw, cs = c.device_arrays("cuda")
    assert w.is_pinned() and cw.is_pinned() and cs.is_pinned() and cw.data_ptr() != w.data_ptr()
    assert torch.equal(cw, w) and torch.equal(cs, s)


def test_random_table_round_trips_fp8_scaling():
    torch.manual_seed(1)
    values = torch.randn(50, 64) * 3
    w, s = eg.quantize_rows_fp8(values)
    back = eg.EngramTable.from_tensors(w, s).full()
    # E4M3 keeps 3 mantissa bits (relative error <= 2^-4); below 2^-6 * scale the grid step is 2^-9 * scale
    scale = values.abs().view(50, 2, 32).amax(-1, keepdim=True).div(448).log2().ceil().exp2().expand(-1, -1, 32).reshape(50, 64)
    assert torch.all((back - values).abs() <= torch.maximum(values.abs() * 2**-4, scale * 2**-10))


# ------------------------------------------------------------------------------------------------
# The module
# ------------------------------------------------------------------------------------------------


def engram_forward_by_hand(residual, tokens, table_rows, wkv, q_w, k_w, cfg, primes, mults):
    """Spec §2.6 token by token, stream by stream, in float64."""
    t_len, m, h = residual.shape
    rows = rows_by_hand(tokens, list(range(cfg["vocab_size"])), cfg, 1, primes, mults)
    out = residual.double().clone()
    eps = cfg["rms_norm_eps"]
    for t in range(t_len):
        e = torch.cat([table_rows[r] for r in rows[t]]).double()
        kv = wkv.double() @ e
        key, value = kv[: m * h].view(m, h), kv[m * h:]
        for j in range(m):
            x = residual[t, j].double()
            dot = (x * q_w[j].double() * k_w[j].double() * key[j]).sum()
            dot = dot / math.sqrt(float((x * x).mean()) + eps) / math.sqrt(float((key[j] ** 2).mean()) + eps) / math.sqrt(h)
            d = float(dot)
            gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(d), 1e-6)), d)))
            out[t, j] = x + gate * value
    return out


@pytest.mark.parametrize("eps", [1e-6, 1e-20])
def test_forward_matches_the_spec_by_hand(eps):
    cfg = dict(TINY, rms_norm_eps=eps)
    torch.manual_seed(3)
    table_values = torch.randn(408, 32)
    module = eg.Engram(cfg, 1, table=eg.EngramTable.from_tensors(table_values))
    with torch.no_grad():
        module.wkv.weight.normal_(0, 0.05)
        module.q_weight.uniform_(0.5, 1.5)
        module.k_weight.uniform_(0.5, 1.5)
    tokens = [7, 8, 9, 7, 8, 9, 2, 500, 1, 0, 33]
    residual = torch.randn(len(tokens), 4, 64)
    got = module(residual, eg.ngram_windows(torch.tensor(tokens), None, 3, 2))
    expected = engram_forward_by_hand(residual, tokens, table_values, module.wkv.weight.detach(), module.q_weight.detach(),
                                      module.k_weight.detach(), cfg, primes_by_trial_division(cfg)[1],
                                      multipliers_by_numpy(1, 3, 512))
    assert got.dtype == residual.dtype
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_packed_values_mix_like_the_fp32_values():
    """The fast path's packed rows (raw FP8 bytes, decoded in `mix`) give the same output bit for bit."""
    torch.manual_seed(4)
    module = eg.Engram(TINY, 1)
    assert module.table.lookup_packed(torch.zeros(1, dtype=torch.long)) is not None   # the random table is FP8
    windows = eg.ngram_windows(torch.tensor([7, 8, 9, 7, 500, 1, 0, 33]), torch.tensor([3, 4]), 3, 2)
    packed = module.packed_values(windows)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == module.packed_shape(windows.shape[0])
    r = torch.randn(windows.shape[0], 4, 64)
    assert torch.equal(module.mix(r, packed), module.mix(r, module.values(windows)))
    # written into a caller's buffer (the upload's pinned buffer on the GPU path): the same bytes, no other copy
    out = torch.full(module.packed_shape(windows.shape[0]), 7, dtype=torch.uint8)
    assert module.packed_values(windows, out=out) is out and torch.equal(out, packed)
    with pytest.raises(ValueError, match="lookup_packed: out"):
        module.packed_values(windows[:3], out=out)
    module.table = eg.EngramTable.from_tensors(torch.randn(408, 32))      # unquantized: falls back to fp32 rows
    assert module.packed_values(windows).dtype == torch.float32 and module.packed_shape(8) is None


def test_forward_keeps_bf16_and_parameter_names():
    module = eg.Engram(TINY, 1)
    assert sorted(n for n, _ in module.named_parameters()) == ["k_weight", "q_weight", "wkv.weight"]
    assert tuple(module.wkv.weight.shape) == (5 * 64, 2 * 2 * 32)
    assert "token_classes" not in module.state_dict()
    r = torch.randn(6, 4, 64).to(torch.bfloat16)
    out = module(r, eg.ngram_windows(torch.arange(6), None, 3, 2))
    assert out.dtype == torch.bfloat16 and out.shape == r.shape


def test_wrong_table_shape_is_rejected():
    module = eg.Engram(TINY, 1)
    with pytest.raises(ValueError, match="sum of primes"):
        module.table = eg.EngramTable.from_tensors(torch.zeros(100, 32))


def test_negative_window_ids_hash_as_the_pad_token():
    module = eg.Engram(TINY, 1)
    with_pad = torch.tensor([[5, 2, 2], [6, 5, 2]])
    with_minus_one = torch.tensor([[5, -1, -1], [6, 5, -1]])
    assert torch.equal(module.row_ids(with_minus_one), module.row_ids(with_pad))


def test_meta_device_construction_leaves_the_table_to_the_loader():
    with torch.device("meta"):
        module = eg.Engram(TINY, 1)
    assert module.table is None and module.token_classes.device.type == "cpu"
    with pytest.raises(RuntimeError, match="no table loaded"):
        module(torch.zeros(1, 4, 64), torch.tensor([[5, 2, 2]]))


def test_spec_reads_the_model_config():
    from deepinfer_sg.engine.config import ModelConfig

    from test_dspark import TINY as TINY_MODEL  # the spec's full tiny V4.1 config

    spec = eg.EngramSpec.from_config(ModelConfig.from_dict(TINY_MODEL))
    assert spec == eg.EngramSpec.from_config(TINY)


def test_real_config_module_shapes(real_classes):
    with torch.device("meta"):
        module = eg.Engram(REAL, 14)
    assert tuple(module.wkv.weight.shape) == (5 * 5120, 3 * 8 * 256)   # [(M+1)*H, 24*256] = [25600, 6144]
    assert tuple(module.q_weight.shape) == (4, 5120) and module.num_rows == 384016682
    assert module.multipliers == multipliers_by_numpy(14, 4, 99092)
    assert torch.equal(module.token_classes, torch.from_numpy(real_classes))
