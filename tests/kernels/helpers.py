"""Shared test helpers: random inputs that are never zeros, and a plain statistical check."""
import math

import torch


def random_bitmask(rows: int, vocab: int, gen: torch.Generator, density: float = 0.5) -> torch.Tensor:
    """int32 [rows, ceil(vocab/32)] with each token allowed with probability `density` (bits past vocab random)."""
    words = (vocab + 31) // 32
    bits = (torch.rand(rows, words * 32, generator=gen) < density).to(torch.int64)
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)


def bit_allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Hand decoding of one bit with Python integers (independent of the kernels' vectorised unpacking)."""
    word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
    return (word >> (token % 32)) & 1 == 1


def assert_matches_distribution(counts: torch.Tensor, probs: torch.Tensor, n: int, sigmas: float = 6.0) -> None:
    """Each category's count is within `sigmas` binomial standard deviations (+1) of n * p (false alarm ~1e-8)."""
    for v in range(probs.numel()):
        p = float(probs[v])
        sd = math.sqrt(n * p * (1 - p))
        assert abs(float(counts[v]) - n * p) <= sigmas * sd + 1, (v, float(counts[v]), n * p, sd)


# The Triton-vs-twin tests run the kernels in the interpreter on CPU (CI); KERNEL_TEST_DEVICE=cuda runs the same
# tests with the kernels compiled for a GPU (the twins stay on the CPU as the reference).
import os  # noqa: E402

DEVICE = os.environ.get("KERNEL_TEST_DEVICE", "cpu")


def on_dev(x):
    """Move a tensor (or each tensor in a tuple/list/dict) to DEVICE; other values pass through."""
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    if isinstance(x, (tuple, list)):
        return type(x)(on_dev(v) for v in x)
    if isinstance(x, dict):
        return {k: on_dev(v) for k, v in x.items()}
    return x


def to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(to_cpu(v) for v in x)
    return x


def params_on_dev(p):
    """A RowParams (or any dataclass of tensors) with every field on DEVICE."""
    import dataclasses
    return dataclasses.replace(p, **{f.name: on_dev(getattr(p, f.name)) for f in dataclasses.fields(p)})
