"""Record the MoE routes of one forward pass and force them on another (a diagnostic for bf16 comparisons).

Why: the fast and the reference path of a bf16 model round differently, and a router score that lands on the other
side of a near tie sends a token to another expert: the logits then differ by far more than rounding. To tell the
two apart, `record_routes` keeps every score-routed gate's expert choice per call (in call order: one forward step
calls each layer's gate once, over all of the step's rows in chunk order on either path), and `force_routes` makes
the gates choose those experts, with the weights computed from their own scores at them (Gate.weights_at). A
difference that remains is the rounding of everything else.

Both are context managers that patch engine/moe.py's Gate for their duration (eager steps only: a CUDA graph
replays what its capture saw); hash-routed gates are left alone (their route is the token id's).
"""
from __future__ import annotations

import contextlib

from .moe import Gate


def _gates(model) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, Gate) and not m.hashed}


@contextlib.contextmanager
def record_routes(model):
    """-> dict gate name -> list of expert ids [T, K] per call, filled while the block runs."""
    got: dict = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: got.setdefault(name, []).append(
        out[1].clone())) for name, m in _gates(model).items()]
    try:
        yield got
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def force_routes(model, routes: dict):
    """The model's gates named in `routes` (record_routes' result, of this model or a copy) choose the recorded
    experts, call by call; yields a list whose element 0 counts the (row, expert) choices that differed from the
    gate's own."""
    routes = {g: routes[name] for name, g in _gates(model).items() if name in routes}
    calls = {g: 0 for g in routes}
    flips = [0]
    orig = Gate.forward

    def forward(self, x, token_ids):
        if self not in routes:
            return orig(self, x, token_ids)
        own = orig(self, x, token_ids)[1]
        idx = routes[self][calls[self]].to(x.device)
        calls[self] += 1
        flips[0] += int((own.sort(dim=1).values != idx.sort(dim=1).values).sum())
        return self.weights_at(self.scores(x), idx), idx
    Gate.forward = forward
    try:
        yield flips
    finally:
        Gate.forward = orig
