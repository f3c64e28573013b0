"""The bundled default model: a tiny random-weight V4.1-architecture network with the REAL DeepSeek-V4
vocabulary (129,280), built in memory from a seed in about a second on CPU.

It exists so that `LLM()` works with no checkpoint: every code path (tokenizer, constraints, scheduler,
sampler, caches) runs for real; only the text is meaningless. Same seed -> same weights -> same outputs.
Its weights are random except for a Zipf unigram prior over token ids (see `add_unigram_prior`), which keeps
structured outputs from degenerating (e.g. JSON numbers hundreds of tokens long).
Geometry: the tiny test config of v41-flash-architecture.md §6.1 (7 layers: sliding-window, ratio-2 and
ratio-1 compressed attention, engram, 2 DSpark layers) with the vocabulary widened to the tokenizer's.
"""
from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_VOCAB_SIZE = 129280

def default_config_dict() -> dict:
    """The spec's tiny V4.1 config with the tokenizer's vocabulary, a longer context and float32 storage."""
    from .testing import tiny_v41_config
    cfg = tiny_v41_config(
        vocab_size=DEFAULT_VOCAB_SIZE, max_position_embeddings=4096,
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1},
        dspark_noise_token_id=DEFAULT_VOCAB_SIZE - 1)
    cfg["dtype"] = "float32"
    del cfg["quantization_config"]
    return cfg


# A unigram prior, as trained LMs have. With purely random output weights every token is a priori alike, and
# structured output becomes pathological: inside a JSON number 1,110 digit tokens compete with 3 closers
# (',', '}', ',"'), so a number runs ~370 tokens on average under any token-agnostic distribution and a
# greedy path cycles through the same digits forever. A trained model has learnt that common tokens are
# common; BPE ids follow merge order, i.e. roughly frequency, so the prior is Zipf-like in the id:
# logit_t += -UNIGRAM_ALPHA * ln(1 + t), the same for every context and every constraint (a property of the
# model's weights, like any trained bias; sampling and grammars stay exact). The random context-dependent
# part of the logits (spread ~1.2 after CONTEXT_LOGIT_SCALE) stays on top of it.
UNIGRAM_ALPHA = 1.5
# The writer's head gives context logits a spread of ~2.5: so peaked that a tiny random network's slowly
# varying hidden state keeps picking the same few tokens (long runs of the same digits). Halved: spread ~1.2.
CONTEXT_LOGIT_SCALE = 0.5
PRIOR_DIM = 0             # hidden dimension that carries the prior (a constant direction of every embedding)
PRIOR_EMBED_VALUE = 8.0   # large next to the other unit-variance dims, so it survives the layers with one sign


def add_unigram_prior(model, alpha: float = UNIGRAM_ALPHA, dim: int = PRIOR_DIM,
                      value: float = PRIOR_EMBED_VALUE, context_scale: float = CONTEXT_LOGIT_SCALE) -> None:
    """Give `model` (built, random weights) a Zipf unigram prior over token ids, the way trained LMs carry one:
    every input embedding gets the constant `value` in hidden dimension `dim`, which therefore reaches the final
    norm with a stable positive value h_dim (measured here on a calibration prompt, ~6 +- 10%), and head column
    `dim` becomes -alpha * ln(1 + id) / mean(h_dim), an output bias; the other head columns (the
    context-dependent part) are scaled by `context_scale`. Deterministic (no randomness used).
    Cost: two forward passes of a 24-token prompt."""
    with torch.no_grad():
        head, embed = model.head.weight, model.embed.weight
        V = head.shape[0]
        head.mul_(context_scale)
        embed[:, dim] = value
        head[:, dim] = 0.0
        calib = (torch.arange(24, device=head.device) * 7919 + 11) % V          # any fixed token ids
        without = model.forward_logits(calib.unsqueeze(0))[0].float()
        prior = -torch.log1p(torch.arange(V, device=head.device, dtype=torch.float32))
        head[:, dim] = prior.to(head.dtype)
        with_unit = model.forward_logits(calib.unsqueeze(0))[0].float()
        h_dim = ((with_unit - without)[:, 1:] / prior[1:]).mean()              # per-unit response of the logits
        head[:, dim] = (alpha * prior / h_dim).to(head.dtype)


def build_default_model(seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The default model with weights drawn from `seed` by B2's checkpoint writer (the trained-like random
    scales of engine/testing.py), written to a RAM-backed temporary folder and loaded back, plus the unigram
    prior of `add_unigram_prior`. Same seed -> same weights. Cost: ~70 MB of fp32 weights (embedding + head
    dominate), about a second on CPU."""
    import tempfile

    from .loader import load_model
    from .testing import write_checkpoint

    ram = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="deepinfer-default-", dir=ram if ram.is_dir() else None) as tmp:
        write_checkpoint(default_config_dict(), tmp, seed=seed)
        model = load_model(tmp, device=device, dtype=dtype).eval()
    add_unigram_prior(model)
    return model
