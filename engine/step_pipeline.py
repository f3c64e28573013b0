"""Decode steps whose host planning overlaps the device: step n+1 is planned while the device runs step n.

Why: a decode step's host work (windows' slab slots, the compressors' arena rows, every index list: Model.plan_step)
depends on the sequences' lengths, not on the sampled tokens, so it can run while the device still computes the
previous step; only the token-dependent half (Engram table reads, the one upload, the graph launch: Model.launch)
waits for the sampler. A step then costs about launch + max(device, plan) instead of plan + launch + device.
How much room that leaves (session 11, mid-size V4.1 on the H200, benchmarks/model_forward.py's "ahead" path, its
host ms): at batch 256 / 64 / 8 the plan took 4.5-5.7 / 1.8-2.2 / 1.2-1.4 ms and launch's part after the graph run
1.4-1.7 / 0.5-0.85 / 0.3-0.5, against 7.6-7.7 / 5.0 / 4.0 ms of graphs (R1, R2, R4): the host was idle 0.4-1.8 /
2.0-2.6 / 2.1-2.4 ms a step, the room a serving loop has for the step's grammar masks on the same thread. In a
round whose host ran ~1.5x slower (R3: plan 7.1-7.6 ms at 256) the plan passed the device time and the step
grew from 8.3 to 10.0-10.4 ms: at 256 rows the plan's per-sequence Python was the host lever. Session 14 keeps
the compressors' and windows' per-sequence numbers in per-arena arrays (engine/arena.py): plan_layer 2.6-2.9 ->
1.0-1.3 ms and the plan 4.4-4.8 -> 2.5-3.1 ms at 256 (benchmarks/model_forward.py's docstring); session 15 the
recent token ids (engine/token_ring.py) and plan_step's rows: launch + plan at 256 5.17 -> 3.65-3.73 ms against
~6.1 ms of graphs (R2), so the host has ~2.4 ms of room there too.

Contract: `forward(chunks)` is `model.forward_step(chunks)` (same StepOutput, same cache updates, bit for bit):
it launches with the plan made ahead when that plan was made for exactly these chunks (the same caches in the same
order, one token and one logit row each: a steady decode batch), otherwise it cancels that plan and plans now.
After launching a step of decode rows it plans the same rows' next step before returning (the device still runs this
one). While a plan is open the planned caches are one step ahead in their compressor counts: call `cancel()` before
anything else touches those caches (rollback, a speculative step, a forward_step of another caller, dropping
the pipeline); `forward` cancels by itself when the chunks differ from the plan. Models without `plan_step` just
run forward_step.
"""
from __future__ import annotations


class StepPipeline:
    def __init__(self, model):
        self.model = model
        self._ahead = None          # (the open plan, its caches in order)
        self.hits = 0               # steps launched with a plan made ahead (for stats / tests)
        self.misses = 0             # plans made ahead and cancelled

    def forward(self, chunks: list, plan_next: bool = True):
        """model.forward_step(chunks), then (plan_next and every chunk one decode row) the next step's plan."""
        model = self.model
        if not hasattr(model, "plan_step"):
            return model.forward_step(chunks)
        plan = self._take(chunks)
        rows, ids = model.step_ids(chunks)
        if plan is None:
            plan = model.plan_step(rows, undo=False)
        out = model.launch(plan, ids)
        if plan_next and all(r.n == 1 and r.logit_rows == 1 for r in rows):
            self._ahead = (model.plan_step([type(r)(r.cache, 1, 1) for r in rows]), [r.cache for r in rows])
        return out

    def cancel(self) -> None:
        """Drop the plan made ahead (the caches are as if it had never been made)."""
        if self._ahead is not None:
            plan, self._ahead = self._ahead[0], None
            if plan.state == "planned":     # (another caller of the model may have superseded it: model.plan_step)
                self.model.cancel(plan)
            self.misses += 1

    def _take(self, chunks: list):
        """The plan made ahead if it fits these chunks (else it is cancelled): None when there is none."""
        if self._ahead is None:
            return None
        plan, caches = self._ahead
        if plan.state == "planned" and len(caches) == len(chunks) and all(
                ch.cache is c and ch.logit_rows == 1 and ch.token_ids.numel() == 1 for ch, c in zip(chunks, caches)):
            self._ahead = None
            self.hits += 1
            return plan
        self.cancel()
        return None
