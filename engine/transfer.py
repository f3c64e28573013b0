"""Host -> device copies of the small index tensors the fast path builds from host-side lengths every step."""
from __future__ import annotations

import numpy as np
import torch


def ragged_arange(firsts, counts) -> np.ndarray:
    """int64 [sum(counts)]: counts[i] consecutive values from firsts[i], for each i in turn (a step's per-row
    positions or destination rows from per-sequence starts and row counts)."""
    counts = np.asarray(counts, dtype=np.int64)
    return (np.repeat(np.asarray(firsts, dtype=np.int64) - (np.cumsum(counts) - counts), counts)
            + np.arange(int(counts.sum()), dtype=np.int64))


_MADE: dict = {}     # made_once's constants


def made_once(key: tuple, device, make) -> torch.Tensor:
    """make() (a small constant tensor on `device`, made by device ops) the first time `key` is asked for on that
    device, then the same tensor. Not kept when made while a CUDA graph is being captured (it would live in the
    graph's private pool): a step runs each token count eagerly before its capture, so a capture finds it made."""
    device = torch.device(device)
    got = _MADE.get((device, *key))
    if got is None:
        got = make()
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _MADE[(device, *key)] = got
    return got


def to_device(data, device, dtype=torch.long) -> torch.Tensor:
    """A host list / CPU tensor on `device` without stalling the host: on CUDA through pinned memory and an
    asynchronous copy (a copy from pageable memory may wait for the device to drain its queue first, which
    serializes the host's work with the device's). Cost: one small host copy + one copy launch."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device_many(parts: list, device) -> list[torch.Tensor]:
    """Several int64 host lists (rectangular nested lists allowed) / CPU int64 tensors on `device` in ONE copy:
    concatenated on the host, copied once (as `to_device`), returned as views of the device buffer in the parts'
    shapes. Why: every pinned copy costs the host a pinned-block allocation and a launch (~40-80 us measured on
    the H200 host), and a decode step made ~40 of them."""
    ts = [p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.long) for p in parts]
    flat = torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1)
    buf = to_device(flat, device)
    out, at = [], 0
    for t in ts:
        n = t.numel()
        out.append(buf[at:at + n].view(t.shape))
        at += n
    return out
