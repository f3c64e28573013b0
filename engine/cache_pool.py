"""Per-sequence caches handed out under a memory budget.

Layout choice: SLAB, not paged. Each running request owns one `SequenceCache` from `model.new_cache()`
(V4's caches are a fixed sliding-window ring plus compressed entries that grow by 1/ratio per token,
so one object per sequence is the natural unit). The pool does not pre-carve memory; it *accounts*:
bytes in use = the live caches' own rows (`nbytes()`) + everything the model's shared storages reserve (the batched
decode path keeps windows, compressed entries and index keys in a window slab and per-layer row arenas at fixed
addresses, engine/arena.py: slots * capacity rows, free slots and rows past each sequence's count included) + the
bytes those storages may add in the next step (an arena's rows per slot double: engine/cache_memory.py); a new
sequence is charged the slot growth it causes at admission (`CacheGrowthModel.slot`). Counting
rows in use only would under-count the arenas by up to slots * longest sequence / sum of lengths (mixed lengths), and
a pool sized to the device would then allocate past it (a growth briefly holds the old and the new storage: that
transient is left to the headroom gpu_memory_utilization keeps). A new pool first frees the storages no live
sequence holds (what an earlier engine on the same model left). It predicts growth with a linear model
`fixed + per_token * tokens` measured on the real model at start-up. The scheduler admits a request
only when its prefill fits, and preempts the newest request when the next step would not fit.
Paged KV blocks would let sequences share prefixes; that is future work and would live here.

Budget: `limit_bytes` if given; otherwise on CUDA a fraction of the free memory after the weights
are loaded (`torch.cuda.mem_get_info`), on CPU a fixed default (2 GiB) that callers can change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .cache_memory import admission_bytes, growth_reserve, release_idle_storage, storage_bytes, storage_pointers

DEFAULT_CPU_LIMIT_BYTES = 2 << 30


@dataclass
class CacheGrowthModel:
    """bytes(cache of n tokens) ~= fixed + per_token * n + slot (an over-estimate is safe, an under-estimate
    only makes preemption happen one step later). `slot`: the bytes a new sequence's slot in the model's window
    slab and row arenas takes (cache_memory.admission_bytes; None for models without them)."""

    fixed: int
    per_token: float
    slot: Optional[Callable[[], int]] = None

    def bytes_for(self, num_tokens: int) -> int:
        return int(self.fixed + self.per_token * max(0, num_tokens) + (self.slot() if self.slot else 0))


def measure_growth(model, probe_tokens: int = 64) -> CacheGrowthModel:
    """Run one small prefill through a scratch cache to measure how caches grow. Cost: one forward of
    `probe_tokens` tokens; runs once at engine start."""
    cache = model.new_cache()
    empty = int(cache.nbytes())
    n = max(1, min(probe_tokens, getattr(model, "max_seq_len", probe_tokens) or probe_tokens))
    chunk_type = step_chunk_type(model)
    device = model_device(model)
    with torch.inference_mode():
        model.forward_step([chunk_type(cache, torch.zeros(n, dtype=torch.long, device=device), 1)])
    full = int(cache.nbytes())
    # 25% margin: compressed levels with long ratios only start filling after the probe length.
    per_token = max(0.0, (full - empty) / n) * 1.25
    return CacheGrowthModel(fixed=empty, per_token=per_token)


def step_chunk_type(model):
    """The model's StepChunk class (B1's), or the duck-typed fallback for stand-in models."""
    import sys

    mod = sys.modules.get(type(model).__module__)
    if mod is not None and hasattr(mod, "StepChunk"):
        return mod.StepChunk
    try:
        from .model import StepChunk  # type: ignore
        return StepChunk
    except Exception:
        from .request import StepChunkFallback  # pragma: no cover - only if the model module lacks it
        return StepChunkFallback


def model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def default_limit_bytes(device: torch.device, gpu_memory_utilization: float = 0.9) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # keep (1 - utilization) of the whole card free for activations, sampling buffers, fragmentation
        return max(0, int(free - (1.0 - gpu_memory_utilization) * total))
    return DEFAULT_CPU_LIMIT_BYTES


class CachePool:
    """Hands out caches and keeps the books. Not thread-safe (the engine loop owns it)."""

    def __init__(self, model, limit_bytes: Optional[int] = None, growth: Optional[CacheGrowthModel] = None,
                 gpu_memory_utilization: float = 0.9):
        self.model = model
        release_idle_storage(model)      # what an earlier engine's finished sequences left reserved
        self.growth = growth or measure_growth(model)
        if growth is None and hasattr(model, "max_rollback"):    # our model: slots in its slab and arenas
            self.growth.slot = self._admission_slot_bytes
        self.limit_bytes = int(limit_bytes) if limit_bytes is not None else default_limit_bytes(
            model_device(model), gpu_memory_utilization)
        self.live: dict[str, object] = {}
        self.peak_bytes = 0
        self.num_allocated = 0
        self.num_released = 0

    def used_bytes(self) -> int:
        """Device bytes the live caches hold now, plus the next step's possible storage growth (module docstring).
        Cost: O(live caches * layers) attribute reads."""
        caches = list(self.live.values())
        if not hasattr(self.model, "max_rollback"):     # a stand-in model (tests): no shared storages
            return sum(int(c.nbytes()) for c in caches)
        shared = storage_pointers(self.model)
        own = sum(int(c.nbytes(exclude=shared)) for c in caches)
        return own + storage_bytes(self.model) + growth_reserve(self.model, caches)

    def _admission_slot_bytes(self) -> int:
        """What one more sequence adds to the slab and arenas (cache_memory.admission_bytes)."""
        return admission_bytes(self.model, list(self.live.values()))

    def allocate(self, request_id: str):
        cache = self.model.new_cache()
        self.live[request_id] = cache
        self.num_allocated += 1
        return cache

    def release(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.num_released += 1

    def note_usage(self) -> int:
        used = self.used_bytes()
        self.peak_bytes = max(self.peak_bytes, used)
        return used

    def stats(self) -> dict:
        return {
            "layout": "slab (one SequenceCache per running request)",
            "limit_bytes": self.limit_bytes,
            "used_bytes": self.used_bytes(),
            "shared_storage_bytes": storage_bytes(self.model),
            "peak_bytes": self.peak_bytes,
            "live_caches": len(self.live),
            "fixed_bytes_per_cache": self.growth.fixed,
            "bytes_per_token_estimate": self.growth.per_token,
        }
