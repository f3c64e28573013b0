"""Test-wide settings: Triton kernels run in the interpreter on CPU, torch stays single-threaded-friendly."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# One thread: tiny test tensors are dominated by thread hand-off cost, and CI has only 2 cores.
torch.set_num_threads(1)
