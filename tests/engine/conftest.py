"""tests/engine fixtures. Shared helpers (the tiny config, the transformers oracle) live in model_oracle.py: a
conftest module is never imported by name, because every test folder has one."""
import pytest
import torch

from model_oracle import tiny_v41

# The engine tests run tiny models: one intra-op thread avoids OpenMP spin contention (on a loaded 2-core
# machine a second thread made single-token steps ~30x slower).
torch.set_num_threads(1)


@pytest.fixture
def tiny_v41_config():
    return tiny_v41()
