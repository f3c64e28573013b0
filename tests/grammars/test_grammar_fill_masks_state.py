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


def test_the_same_batch_filled_again_follows_every_state_change(compiler, ds_tokenizer):
    """An engine passes the same matchers step after step (fill_masks then reuses its work list): after accepts,
    a rollback that rebuilds a matcher (over the DSML token: a new llguidance matcher inside), EOS and a rollback
    over EOS, each row still equals the mask of a fresh matcher walked to the same tokens (the oracle)."""
    from deepinfer_sg.grammars import JsonSchema

    dsml = compiler.compile(dsml_grammar(TOOLS, "get_weather", starts_in_tool_calls=True))
    js = compiler.compile(JsonSchema({"type": "integer"}, whitespace="compact"))
    lt = ds_tokenizer.encode("<", add_special_tokens=False).ids[0]
    seven = ds_tokenizer.encode("7", add_special_tokens=False).ids[0]
    batch = [dsml.matcher() for _ in range(3)] + [js.matcher() for _ in range(3)]
    texts = [[] for _ in batch]
    compiled = [dsml] * 3 + [js] * 3

    def check():
        out = fill_masks(list(batch))  # a new list each step, as an engine builds it
        for i, (c, toks) in enumerate(zip(compiled, texts)):
            oracle = c.matcher()
            assert all(oracle.accept(t) for t in toks)
            assert torch.equal(out[i:i + 1], _mask(oracle)), (i, toks)

    check()
    for i in range(3):  # DSML matchers: "<" then the DSML token
        for t in (lt, DSML):
            assert batch[i].accept(t)
            texts[i].append(t)
    check()
    batch[1].rollback(1)  # over the DSML token: rebuilt from its history (a new llguidance matcher)
    texts[1].pop()
    check()
    assert batch[3].accept(seven) and batch[3].accept(1)  # an integer, then EOS: finished
    texts[3].append(seven)
    out = fill_masks(list(batch))
    eos_only = torch.zeros_like(out[3])
    eos_only[0] = 1 << 1
    assert torch.equal(out[3], eos_only)
    batch[3].rollback(1)  # over EOS: live again
    check()
