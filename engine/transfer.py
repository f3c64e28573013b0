"""Host -> device copies of the small index tensors the fast path builds from host-side lengths every step."""
from __future__ import annotations

import torch


def to_device(data, device, dtype=torch.long) -> torch.Tensor:
    """A host list / CPU tensor on `device` without stalling the host: on CUDA through pinned memory and an
    asynchronous copy (a copy from pageable memory may wait for the device to drain its queue first, which
    serializes the host's work with the device's). Cost: one small host copy + one copy launch."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
