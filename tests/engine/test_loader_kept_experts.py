"""Routed experts kept quantized by the loader (`load_model(..., expert_dtype="fp8"` or `"fp4"`, the default on CUDA).

Oracles: transformers' DeepseekV4ForCausalLM loaded (by transformers itself) from a twin folder whose quantized
experts were dequantized by transformers' own Fp8Dequantize; and our own bf16/fp32 load of the same quantized
checkpoint (expert_dtype="bf16", the long-standing exact dequantizing path). Checkpoints hold FP4 experts (1x32
UE8M0 groups, the real V4.1 format) and, in one layer, FP8 experts (32x32 UE8M0 blocks)."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from model_oracle import hf_tiny  # noqa: E402

from deepinfer_sg.engine.loader import load_model  # noqa: E402
from deepinfer_sg.engine.model import StepChunk  # noqa: E402
from deepinfer_sg.engine.moe import KeptExperts, MoE  # noqa: E402
from deepinfer_sg.engine.quant import quantize_fp4_blocks, quantize_fp8_blocks  # noqa: E402
from deepinfer_sg.engine.testing import tiny_v41_config, write_checkpoint  # noqa: E402

FP8_LAYER = 1          # this layer's routed experts are stored FP8 (32x32 blocks), the others FP4
WIDE_LAYER = 3         # FP4 with group scales 2**10 apart in every row: too far to fold into per-row scales


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _is_routed(name: str) -> bool:
    return ".ffn.experts." in name and name.endswith(".weight")


@pytest.fixture(scope="module")
def v4_folders(tmp_path_factory):
    """(quantized folder, transformers oracle on exactly the quantized values)."""
    pytest.importorskip("transformers")
    fp8mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import DeepseekV4ForCausalLM
    root = tmp_path_factory.mktemp("kept")
    # expert dims of 64 (two FP4 groups / FP8 blocks of 32 along both in dims); hc 4, hash + regular MoE layers
    _, folder = hf_tiny(root, seed=11, hidden_size=64, moe_intermediate_size=64, hc_mult=4)
    tensors = load_file(str(folder / "model.safetensors"))
    quant, twin = {}, {}
    deq = fp8mod.Fp8Dequantize(hf_quantizer=None)
    for k, v in tensors.items():
        if not _is_routed(k):
            quant[k] = twin[k] = v
            continue
        if f"layers.{WIDE_LAYER}." in k:            # the first group of each row 2**10 above the others
            v = torch.cat([v[:, :32], v[:, 32:] * 2.0 ** -10], dim=1)
        q, s = quantize_fp8_blocks(v) if f"layers.{FP8_LAYER}." in k else quantize_fp4_blocks(v)
        quant[k], quant[k[: -len("weight")] + "scale"] = q, s
        twin[k] = deq._dequantize_one(q, s, output_dtype=torch.float32).to(v.dtype)
    out = {}
    for name, data in (("q", quant), ("twin", twin)):
        d = root / name
        d.mkdir()
        for f in folder.iterdir():
            if f.suffix == ".json":
                shutil.copy(f, d / f.name)
        save_file(data, str(d / "model.safetensors"), metadata={"format": "pt"})
        out[name] = d
    hf = DeepseekV4ForCausalLM.from_pretrained(out["twin"], dtype=torch.float32).eval()
    return out["q"], hf


def _moes(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_kept_experts_match_transformers_oracle(v4_folders, expert_dtype):
    """fp8: every layer in e4m3 (FP4 repacked); fp4: the FP4 layers stay packed, the FP8 layer in e4m3."""
    folder, hf = v4_folders
    ours = load_model(folder, expert_dtype=expert_dtype)
    moes = _moes(ours)
    assert moes and all(m.kept is not None for m in moes)
    assert [m.kept.rows for m in moes] == [32 if i == FP8_LAYER else 1 for i in range(len(moes))]
    packed = expert_dtype == "fp4"
    assert [m.kept.w1.dtype for m in moes] == [torch.float8_e4m3fn if i == FP8_LAYER or not packed else torch.uint8
                                               for i in range(len(moes))]
    # FP4 layers with near group scales fold into per-row scales (no shifts kept); the wide one keeps its shifts
    assert [moes[i].kept.g1 is None for i in range(len(moes)) if i != FP8_LAYER] == \
        [not packed and i != WIDE_LAYER for i in range(len(moes)) if i != FP8_LAYER]
    assert all(ex.w1.weight.is_meta for m in moes for ex in m.experts)      # no dense copy of any expert
    rep = ours.load_report
    assert rep.kept_quantized and not any(_is_routed(k) for k in rep.dequantized)
    assert set(rep.kept_quantized.values()) == {"fp4", "fp8"}
    ids = torch.randint(0, hf.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    assert _rel(ours.forward_logits(ids), ref) < 1e-4              # reference path: experts dequantized per use
    # the step path: routed experts through kernels.moe_experts with the kept fp8 stacks (its CPU twin here)
    cache = ours.new_cache()
    out = ours.forward_step([StepChunk(cache, ids[0, :20], 20)]).logits
    rows = [out]
    for t in range(20, 33):
        rows.append(ours.forward_step([StepChunk(cache, ids[0, t:t + 1], 1)]).logits)
    assert _rel(torch.cat(rows), ref[0]) < 1e-4


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_kept_equals_the_dequantizing_load(v4_folders, expert_dtype):
    """Kept (fp8 / packed fp4) and dequantized (fp32) loads of one checkpoint: every expert weight dequantizes
    to the same values, and the logits are identical."""
    folder, hf = v4_folders
    kept, plain = load_model(folder, expert_dtype=expert_dtype), load_model(folder, expert_dtype="bf16")
    assert not plain.load_report.kept_quantized and all(m.kept is None for m in _moes(plain))
    for mk, mp in zip(_moes(kept), _moes(plain)):
        for e, ex in enumerate(mp.experts):
            for n in ("w1", "w3", "w2"):
                assert torch.equal(mk.kept.dequantized(n, e, torch.float32), getattr(ex, n).weight), (e, n)
    ids = torch.randint(0, hf.config.vocab_size, (1, 25), generator=torch.Generator().manual_seed(6))
    assert torch.equal(kept.forward_logits(ids), plain.forward_logits(ids))


def test_kept_memory_and_layout(tmp_path):
    """V4.1 tiny checkpoint (FP4 experts): the kept form is 1 byte per weight + a 4-byte row scale + 1 shift byte
    per 32 weights; nothing of the experts is allocated in the model dtype; bf16 load of the same folder holds
    2 bytes per weight. Same logits both ways (bf16 model)."""
    folder = write_checkpoint(tiny_v41_config(), tmp_path / "v41", seed=5, quantize="fp8")
    kept = load_model(folder, dtype=torch.bfloat16, expert_dtype="fp8")
    plain = load_model(folder, dtype=torch.bfloat16)
    n_weights = kept_bytes = 0
    for m in _moes(kept):
        q = m.kept
        E, F, H = q.w1.shape
        assert q.w1.dtype == torch.float8_e4m3fn and q.w2.shape == (E, H, F) and q.rows == 1
        assert q.g1 is None      # random weights: group scales close, shifts folded
        want = 3 * E * F * H + 4 * E * (2 * F + H)
        assert q.nbytes() == want
        n_weights += 3 * E * F * H
        kept_bytes += want
    real = lambda model: sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)  # noqa: E731
    assert real(plain) - real(kept) == 2 * n_weights
    assert kept_bytes < 0.6 * 2 * n_weights              # tiny rows (H=64): the 4-byte row scales weigh 6%
    E, F, H = 384, 2304, 5120                             # V4.1-Flash: 50.05% of bf16 (51.6% with shifts)
    assert (3 * E * F * H + 4 * E * (2 * F + H)) / (6 * E * F * H) < 0.501
    ids = torch.randint(0, 500, (1, 17), generator=torch.Generator().manual_seed(2))
    assert torch.equal(kept.forward_logits(ids), plain.forward_logits(ids))
    packed = load_model(folder, dtype=torch.bfloat16, expert_dtype="fp4")     # FP4 as stored: half a byte a weight
    for m, mk in zip(_moes(packed), _moes(kept)):
        q = m.kept
        E, F, H2 = q.w1.shape
        assert q.w1.dtype == torch.uint8 and q.g1 is not None
        assert q.nbytes() == mk.kept.nbytes() - 3 * E * F * H2 + sum(g.numel() for g in q.shifts())
        assert torch.equal(q.s1, mk.kept.s1)
    assert torch.equal(packed.forward_logits(ids), plain.forward_logits(ids))


def test_layer_with_float_scales_is_dequantized_instead(v4_folders, tmp_path):
    """Float (not UE8M0) scales in one layer: that layer is dequantized into real weights, the others kept."""
    folder, _ = v4_folders
    t = load_file(str(folder / "model.safetensors"))
    for k in list(t):
        if "layers.2." in k and ".ffn.experts." in k and k.endswith(".scale"):
            t[k] = 2.0 ** (t[k].view(torch.uint8).float() - 127)
    d = tmp_path / "mixed"
    d.mkdir()
    shutil.copy(folder / "config.json", d / "config.json")
    save_file(t, str(d / "model.safetensors"))
    ours = load_model(d, expert_dtype="fp8")
    moes = _moes(ours)
    assert moes[2].kept is None and not moes[2].experts[0].w1.weight.is_meta
    assert all(m.kept is not None for i, m in enumerate(moes) if i != 2)
    assert any("layers.2.ffn.experts." in k for k in ours.load_report.dequantized)
    ref = load_model(folder, expert_dtype="bf16")
    ids = torch.randint(0, 97, (1, 21), generator=torch.Generator().manual_seed(9))
    assert torch.equal(ours.forward_logits(ids), ref.forward_logits(ids))


def test_finalize_drops_only_all_zero_shifts():
    """All-zero shifts of e4m3 stacks are dropped (the kernel's per-row path); any nonzero shift keeps them, and
    packed FP4 stacks keep theirs (the kernel needs them to decode)."""
    def kept(top, packed=False):
        q = KeptExperts.empty(2, 64, 32, 1, "cpu", packed=packed)
        for g in (q.g1, q.g3, q.g2):
            g.zero_()
        q.g2[1, 0, 0] = top
        q.finalize()
        return q.shifts()
    assert kept(0) is None and kept(1) is not None and int(kept(126)[2][1, 0, 0]) == 126
    assert kept(0, packed=True) is not None


def test_bad_expert_dtype_is_named(tmp_path):
    folder = write_checkpoint(tiny_v41_config(), tmp_path / "c", seed=1)
    with pytest.raises(ValueError, match="expert_dtype"):
        load_model(folder, expert_dtype="int4")
    # a bf16 checkpoint asked to keep experts quantized: nothing to keep, the experts are ordinary weights
    m = load_model(folder, expert_dtype="fp8")
    assert not m.load_report.kept_quantized and all(x.kept is None for x in _moes(m))
    assert not any(p.is_meta for p in m.parameters())
    assert json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("expert_dtype,wide", [("fp8", False), ("fp4", False), ("fp8", True)])
def test_kept_layer_through_the_triton_kernel(tmp_path, monkeypatch, v4_folders, expert_dtype, wide):
    """The CUDA dispatch of a kept layer (kernels.moe_experts_triton with the stacks and the shifts the loader
    kept), run by the Triton interpreter, against the same layer's twin path: folded per-row
    scales (V4.1 tiny), packed FP4, and a layer whose shifts could not be folded (wide)."""
    import deepinfer_sg.kernels.moe as k_moe
    if wide:
        model = load_model(v4_folders[0], dtype=torch.bfloat16, expert_dtype=expert_dtype)
        moe = _moes(model)[WIDE_LAYER]
        assert moe.kept.g1 is not None
    else:
        folder = write_checkpoint(tiny_v41_config(), tmp_path / "v41", seed=6, quantize="fp8")
        model = load_model(folder, dtype=torch.bfloat16, expert_dtype=expert_dtype)
        moe = _moes(model)[2]
    x = torch.randn(13, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = moe.forward_grouped(x).float()
    ran = []
    monkeypatch.setattr(k_moe, "use_triton", lambda t: True)
    real = k_moe.moe_experts_triton
    monkeypatch.setattr(k_moe, "moe_experts_triton", lambda *a, **k: ran.append(k.get("shifts")) or real(*a, **k))
    out = moe.forward_grouped(x).float()
    assert len(ran) == 1 and (ran[0] is None) == (moe.kept.g1 is None)
    assert (out - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_quantize_routed_experts_of_a_random_model(tmp_path, expert_dtype):
    """Benchmarks' helper for random models: the experts become their FP4 rounding (quantize_fp4_blocks then
    dequantize_fp4_blocks, done here on a dense copy), kept in the loader's layout."""
    from deepinfer_sg.engine.moe import quantize_routed_experts
    from deepinfer_sg.engine.quant import dequantize_fp4_blocks
    folder = write_checkpoint(tiny_v41_config(), tmp_path / "plain", seed=7)
    kept, dense = load_model(folder), load_model(folder)
    n = quantize_routed_experts(kept, expert_dtype)
    assert n == len(_moes(kept)) and all(m.kept is not None for m in _moes(kept))
    with torch.no_grad():
        for m in _moes(dense):
            for ex in m.experts:
                for w in (ex.w1, ex.w3, ex.w2):
                    w.weight.copy_(dequantize_fp4_blocks(*quantize_fp4_blocks(w.weight)))
    ids = torch.randint(0, 500, (1, 19), generator=torch.Generator().manual_seed(3))
    assert torch.equal(kept.forward_logits(ids), dense.forward_logits(ids))
    assert quantize_routed_experts(kept, expert_dtype) == 0          # already kept: nothing to do


def test_fp4_layers_the_packed_kernel_cannot_take_go_to_e4m3(tmp_path, monkeypatch):
    """expert_dtype="fp4" keeps an all-FP4 layer packed only when kernels.moe.packed_fp4_fits takes its dims (the
    packed kernel reads int32 words of 8 weights); otherwise the layer is kept as e4m3, as with "fp8", and the
    logits are still the dequantizing load's."""
    import deepinfer_sg.engine.loader as loader_mod
    from deepinfer_sg.kernels.moe import packed_fp4_fits
    assert packed_fp4_fits(4096, 2048) and not packed_fp4_fits(4096, 2044) and not packed_fp4_fits(4092, 2048)
    folder = write_checkpoint(tiny_v41_config(), tmp_path / "v41", seed=8, quantize="fp8")
    seen = []
    monkeypatch.setattr(loader_mod, "packed_fp4_fits", lambda h, f: seen.append((h, f)) or False)
    kept = load_model(folder, dtype=torch.bfloat16, expert_dtype="fp4")
    moes = _moes(kept)
    assert moes and all(m.kept is not None and m.kept.w1.dtype == torch.float8_e4m3fn for m in moes)
    F, H = moes[0].experts[0].w1.weight.shape
    assert seen == [(H, F)] * len(moes)                       # asked with (hidden, inter), once a layer
    plain = load_model(folder, dtype=torch.bfloat16)
    ids = torch.randint(0, 500, (1, 17), generator=torch.Generator().manual_seed(4))
    assert torch.equal(kept.forward_logits(ids), plain.forward_logits(ids))
