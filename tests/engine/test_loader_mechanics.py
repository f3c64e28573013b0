"""Loader mechanics on hand-made safetensors files and a small stand-in module with DeepSeek tensor names:
prefixes, shards, FP8/FP4 dequantization (checked against decoding by hand), error messages naming the
tensor, transformers' save-name aliases, and the memory bound (instrumented, not timed)."""
import json
import weakref

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_sg.engine import loader
from deepinfer_sg.engine.loader import CheckpointError, load_weights


class Lin(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(o, i))


class Toy(nn.Module):
    """Names as in a DeepSeek checkpoint: embed, one layer with attention, a norm, 2 routed experts, a hash
    table buffer, and the V4 head mix."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(16, 64, dtype=dtype)
        layer = nn.Module()
        layer.attn = nn.Module()
        layer.attn.wq_a = Lin(64, 96).to(dtype)
        layer.attn.kv_norm = nn.Module()
        layer.attn.kv_norm.weight = nn.Parameter(torch.zeros(64, dtype=dtype))
        layer.attn.attn_sink = nn.Parameter(torch.zeros(4))        # stays fp32 whatever the dtype
        layer.ffn = nn.Module()
        layer.ffn.experts = nn.ModuleList()
        for _ in range(2):
            e = nn.Module()
            e.w1 = Lin(64, 32).to(dtype)
            e.w2 = Lin(32, 64).to(dtype)
            layer.ffn.experts.append(e)
        layer.ffn.gate = nn.Module()
        layer.ffn.gate.register_buffer("tid2eid", torch.zeros(16, 2, dtype=torch.long))
        self.layers = nn.ModuleList([layer])
        self.hc_head_fn = nn.Parameter(torch.zeros(2, 128))


def toy_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 64, generator=g).to(torch.bfloat16),
        "layers.0.attn.wq_a.weight": torch.randn(96, 64, generator=g).to(torch.bfloat16),
        "layers.0.attn.kv_norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
        "layers.0.attn.attn_sink": torch.randn(4, generator=g),
        "layers.0.ffn.experts.0.w1.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16),
        "layers.0.ffn.experts.0.w2.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.ffn.experts.1.w1.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16),
        "layers.0.ffn.experts.1.w2.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.ffn.gate.tid2eid": torch.randint(0, 2, (16, 2), generator=g),
        "hc_head_fn": torch.randn(2, 128, generator=g),
    }


def assert_loaded(model, tensors):
    sd = model.state_dict()
    for k, v in tensors.items():
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k


def test_single_file_with_and_without_model_prefix(tmp_path):
    t = toy_tensors()
    save_file(t, tmp_path / "a.safetensors")
    m = Toy()
    rep = load_weights(m, tmp_path / "a.safetensors")
    assert_loaded(m, t)
    assert sorted(rep.loaded) == sorted(t)
    (tmp_path / "p").mkdir()
    save_file({"model." + k: v for k, v in t.items()}, tmp_path / "p" / "model.safetensors")
    m2 = Toy(torch.bfloat16)
    load_weights(m2, tmp_path / "p")
    assert_loaded(m2, t)
    assert m2.layers[0].attn.attn_sink.dtype == torch.float32  # parameter dtype is the model's choice


def test_sharded_index(tmp_path):
    t = toy_tensors(1)
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: t[k] for k in keys}, tmp_path / fname)
        weight_map.update({k: fname for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    m = Toy()
    load_weights(m, tmp_path)
    assert_loaded(m, t)
    # an index that points at the wrong shard, or at a shard that is not there, is named
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"'{names[0]}' is not in model-00002-of-00002"):
        load_weights(Toy(), tmp_path)
    weight_map[names[0]] = "model-00003-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00003"):
        load_weights(Toy(), tmp_path)


def quantized_toy(seed=2):
    """FP8 wq_a (32x32 blocks) and FP4 experts, built from random codes and scale bytes, plus their values
    decoded by hand (e4m3 via torch's float8 dtype, e2m1 via the bit layout)."""
    g = torch.Generator().manual_seed(seed)
    t = toy_tensors(seed)
    want = dict(t)
    w8 = (torch.randn(96, 64, generator=g) * 30).to(torch.float8_e4m3fn)
    s8 = torch.randint(115, 135, (3, 2), generator=g, dtype=torch.uint8)
    t["layers.0.attn.wq_a.weight"] = w8
    t["layers.0.attn.wq_a.scale"] = s8.view(torch.float8_e8m0fnu)
    want["layers.0.attn.wq_a.weight"] = w8.float() * (2.0 ** (s8.float() - 127)).repeat_interleave(32, 0).repeat_interleave(32, 1)

    def e2m1(code):
        s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
        mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        return -mag if s else mag

    for name, (o, i) in [("layers.0.ffn.experts.0.w1", (32, 64)), ("layers.0.ffn.experts.1.w2", (64, 32))]:
        codes = torch.randint(0, 16, (o, i), generator=g)
        s4 = torch.randint(118, 130, (o, i // 32), generator=g, dtype=torch.uint8)
        packed = torch.tensor([[codes[r, 2 * k] | (codes[r, 2 * k + 1] << 4) for k in range(i // 2)]
                               for r in range(o)], dtype=torch.uint8).view(torch.int8)
        t[name + ".weight"] = packed
        t[name + ".scale"] = s4.view(torch.float8_e8m0fnu)
        vals = torch.tensor([[e2m1(int(c)) for c in row] for row in codes])
        want[name + ".weight"] = vals * (2.0 ** (s4.float() - 127)).repeat_interleave(32, 1)
    return t, want


def test_fp8_and_fp4_dequantized_exactly(tmp_path):
    t, want = quantized_toy()
    save_file(t, tmp_path / "q.safetensors")
    m = Toy()
    rep = load_weights(m, tmp_path / "q.safetensors")
    assert_loaded(m, want)
    assert rep.dequantized == {"layers.0.attn.wq_a.weight": "fp8", "layers.0.ffn.experts.0.w1.weight": "fp4",
                               "layers.0.ffn.experts.1.w2.weight": "fp4"}
    mb = Toy(torch.bfloat16)  # exact in bf16 too: e4m3/e2m1 times a power of two
    load_weights(mb, tmp_path / "q.safetensors")
    for k, v in want.items():
        assert torch.equal(mb.state_dict()[k].float(), v.to(mb.state_dict()[k].dtype).float()), k


def _expect_error(tmp_path, tensors, *fragments, strict=True):
    save_file(tensors, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_weights(Toy(), tmp_path / "bad.safetensors", strict=strict)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_missing_tensor_is_named(tmp_path):
    t = toy_tensors()
    del t["layers.0.attn.kv_norm.weight"], t["hc_head_fn"]
    _expect_error(tmp_path, t, "missing", "'layers.0.attn.kv_norm.weight'", "'hc_head_fn'")


def test_misshaped_tensor_is_named(tmp_path):
    t = toy_tensors()
    t["layers.0.attn.wq_a.weight"] = torch.zeros(95, 64)
    _expect_error(tmp_path, t, "'layers.0.attn.wq_a.weight' has shape [95, 64]", "[96, 64]")


def test_unexpected_tensor_is_named_unless_not_strict(tmp_path):
    t = toy_tensors()
    t["layers.0.attn.wq_c.weight"] = torch.zeros(3)
    _expect_error(tmp_path, t, "unexpected", "'layers.0.attn.wq_c.weight'")
    m = Toy()
    load_weights(m, tmp_path / "bad.safetensors", strict=False)
    assert_loaded(m, toy_tensors())


def test_quantized_tensor_errors_are_named(tmp_path):
    t, _ = quantized_toy()
    del t["layers.0.ffn.experts.0.w1.scale"]
    _expect_error(tmp_path, t, "'layers.0.ffn.experts.0.w1.weight'", "scale", "missing")
    t, _ = quantized_toy()
    t["layers.0.attn.wq_a.scale"] = torch.zeros(2, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    _expect_error(tmp_path, t, "'layers.0.attn.wq_a.scale' has shape [2, 2], expected [3, 2]")
    t, _ = quantized_toy()
    t["layers.0.ffn.experts.1.w2.weight"] = torch.zeros(64, 15, dtype=torch.int8)
    _expect_error(tmp_path, t, "'layers.0.ffn.experts.1.w2.weight' (fp4) has shape [64, 15], expected [64, 16]")


def test_unused_vision_and_mtp_copies_are_skipped(tmp_path):
    t = toy_tensors()
    extra = {"image_newline": torch.zeros(64), "vision_pipeline.aligner.w.weight": torch.zeros(2, 2),
             "mtp.0.embed.weight": torch.zeros(16, 64), "layers.0.ffn.gate.bias_vl": torch.zeros(2)}
    # a model without draft layers skips a checkpoint's MTP layers (with their scales)
    extra.update({"mtp.0.attn.wq_a.weight": torch.zeros(32, 32, dtype=torch.float8_e4m3fn),
                  "mtp.0.attn.wq_a.scale": torch.ones(1, 1).to(torch.float8_e8m0fnu), "mtp.0.norm.weight": torch.ones(4)})
    save_file({**t, **extra}, tmp_path / "v.safetensors")
    m = Toy()
    rep = load_weights(m, tmp_path / "v.safetensors")
    assert sorted(rep.skipped) == sorted(extra)
    assert_loaded(m, t)


def test_transformers_save_names_map_back():
    """The names transformers' save_pretrained writes for deepseek_v4 (seen in its output) -> DeepSeek's."""
    cases = {
        "model.embed_tokens.weight": "embed.weight",
        "head.weight": "head.weight",
        "lm_head.weight": "head.weight",
        "model.hc_head.hc_fn": "hc_head_fn",
        "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale",
        "model.layers.3.attn.norm.weight": "layers.3.attn.kv_norm.weight",
        "model.layers.3.attn.compressor.norm.weight": "layers.3.attn.compressor.norm.weight",
        "model.layers.3.attn.indexer.compressor.norm.weight": "layers.3.attn.indexer.compressor.norm.weight",
        "model.layers.0.ffn.gate.tid2eid": "layers.0.ffn.gate.tid2eid",
    }
    for stored, want in cases.items():
        assert loader.canonical_name(stored) == want, stored
    # an alias is only taken when the model has it
    assert loader.canonical_name("model.layers.3.attn.norm.weight", {"layers.3.attn.norm.weight"}) == \
        "layers.3.attn.norm.weight"


class LiveBytes(TorchDispatchMode):
    """Counts bytes of tensor storages newly allocated by torch ops (safetensors reads included) that are
    still alive; views and in-place results (storage shared with an input) are not new allocations."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in _flat(args) + _flat(kwargs) if isinstance(a, torch.Tensor)}
        for t in _flat(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in inputs or key in self.live or st.nbytes() == 0:
                continue
            self.live[key] = st.nbytes()
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._free, key)
        return out

    def _free(self, key):
        self.current -= self.live.pop(key, 0)


def _flat(x):
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    return [x]


def test_memory_stays_bounded_by_one_tensor(tmp_path):
    """Many equal tensors: the bytes alive during the load (beyond the model, which exists before) never
    exceed what one tensor needs (read + fp32 dequantization + scale), far below the checkpoint size."""
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Lin(256, 256) for _ in range(12))

    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(12):
        w = torch.randn(256, 256, generator=g)
        if i % 2:
            from deepinfer_sg.engine.quant import quantize_fp8_blocks
            q, s = quantize_fp8_blocks(w)
            tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.scale"] = q, s
        else:
            tensors[f"layers.{i}.weight"] = w
    save_file(tensors, tmp_path / "w.safetensors")
    m = Wide()
    with LiveBytes() as mem:
        load_weights(m, tmp_path / "w.safetensors")
    one_fp32 = 256 * 256 * 4
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert mem.peak > 0, "instrumentation saw no allocation"
    # one FP8 tensor in flight: its bytes (1/4), its scale and its fp32 dequantized copy
    print("peak live bytes", mem.peak, "one fp32 tensor", one_fp32)
    assert mem.peak <= 1.5 * one_fp32, (mem.peak, one_fp32)
    assert mem.peak < checkpoint_bytes / 2
    assert mem.current <= 64 * 1024  # nothing big retained after loading


def test_float_scales_under_transformers_name(tmp_path):
    """FP8 weights whose block scales are fp32 multipliers stored as `X.weight_scale_inv` (transformers' name)."""
    t, want = quantized_toy()
    s8 = t.pop("layers.0.attn.wq_a.scale")
    t["layers.0.attn.wq_a.weight_scale_inv"] = 2.0 ** (s8.view(torch.uint8).float() - 127)
    save_file(t, tmp_path / "f.safetensors")
    m = Toy()
    rep = load_weights(m, tmp_path / "f.safetensors")
    assert rep.dequantized["layers.0.attn.wq_a.weight"] == "fp8"
    assert_loaded(m, want)
