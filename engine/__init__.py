"""deepinfer_sg.engine: the DeepSeek-V4 / V4.1 network, its caches and weights, and the runtime around them.

    from deepinfer_sg.engine import ModelConfig, Model, StepChunk, load_model
    model = load_model(path)                     # or Model(ModelConfig.from_json(path))
    logits = model.forward_logits(ids)           # [B, S] -> [B, S, V]
    cache = model.new_cache(); out = model.forward_step([StepChunk(cache, ids, logit_rows=1)])
"""
from .cache import SequenceCache
from .config import ConfigError, ModelConfig
from .model import Model, StepChunk, StepOutput

__all__ = ["ConfigError", "ModelConfig", "Model", "StepChunk", "StepOutput", "SequenceCache", "load_model",
           "write_checkpoint"]


def __getattr__(name):
    # loader / testing are imported on first use so a problem there never breaks `import deepinfer_sg.engine`
    if name == "load_model":
        from .loader import load_model
        return load_model
    if name == "write_checkpoint":
        from .testing import write_checkpoint
        return write_checkpoint
    raise AttributeError(f"module 'deepinfer_sg.engine' has no attribute {name!r}")
