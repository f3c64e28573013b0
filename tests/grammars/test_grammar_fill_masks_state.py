"""fill_masks leaves every matcher in the state it started in, even where llguidance's own rollback fails.

llguidance 1.9.1 cannot roll back "<" followed by the DSML special token when they were consumed one by one
("rollback: too many bytes 11 > 10"); its executor's draft walk does exactly that, so walking the real matcher
broke it. The oracle is a fresh matcher of the same grammar (never touched by fill_masks) and token-by-token
walks on forks.
"""
import torch

from deepinfer_sg.grammars import allocate_bitmask, fill_masks
from deepinfer_sg.grammars.dsml import dsml_grammar

from grammar_testutil import DEEPSEEK_VOCAB

DSML = 128825
TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                "required": ["city"]}}]


def _mask(m):
    b = allocate_bitmask(1, DEEPSEEK_VOCAB)
    m.fill_mask(b, 0)
    return b


def test_dsml_draft_walk_leaves_matcher_unchanged(compiler, ds_tokenizer):
    compiled = compiler.compile(dsml_grammar(TOOLS, "get_weather", starts_in_tool_calls=True))
    lt = ds_tokenizer.encode("<", add_special_tokens=False).ids
    assert len(lt) == 1
    draft = [lt[0], DSML]
    m, fresh = compiled.matcher(), compiled.matcher()
    counts = []
    out = fill_masks([m], [draft], valid_counts=counts)
    assert counts == [2]
    assert torch.equal(_mask(m), _mask(fresh))            # same state as a matcher fill_masks never saw
    walker = fresh.fork()                                   # rows agree with a token-by-token walk
    assert torch.equal(out[0:1], _mask(walker))
    for j, t in enumerate(draft):
        assert walker.accept(t)
        assert torch.equal(out[j + 1:j + 2], _mask(walker))
    assert m.accept(draft[0]) and m.accept(DSML)           # the committed path is still open
