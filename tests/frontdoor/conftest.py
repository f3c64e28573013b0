"""Front-door fixtures: one default-model LLM for the whole session (building it takes seconds)."""
import pytest


@pytest.fixture(scope="session")
def default_llm():
    from deepinfer_sg import LLM
    return LLM(seed=0)
