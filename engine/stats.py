"""Counters and timers of the step loop, so benchmarks can say where a step's time goes.

Per step we time: scheduling, the forward (synchronised on CUDA so the number is real), waiting for the
grammar masks beyond the forward (what did NOT overlap), applying masks + sampling, and committing.
`python_overhead_fraction` = (step time - forward time) / step time: the share of a step spent outside
the model, which a faster host loop or CUDA graphs would have to remove.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0          # tokens run through the model that produced no sample
    num_sampled_tokens: int = 0          # output tokens produced
    num_finished: int = 0
    num_errors: int = 0
    num_preemptions: int = 0
    num_step_failures: int = 0           # steps whose forward/sampling raised (their requests were isolated)
    num_masked_rows: int = 0
    time_schedule_s: float = 0.0
    time_forward_s: float = 0.0
    time_mask_wait_s: float = 0.0
    time_sample_s: float = 0.0
    time_commit_s: float = 0.0
    time_step_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)   # sampled rows per step (last 10k steps)

    def record_batch(self, rows: int) -> None:
        self.batch_sizes.append(rows)
        if len(self.batch_sizes) > 10_000:
            del self.batch_sizes[:5_000]

    @property
    def python_overhead_fraction(self) -> float:
        return 0.0 if self.time_step_s <= 0 else max(0.0, self.time_step_s - self.time_forward_s) / self.time_step_s

    @property
    def mean_step_s(self) -> float:
        return self.time_step_s / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "batch_sizes"}
        d["python_overhead_fraction"] = self.python_overhead_fraction
        d["mean_step_s"] = self.mean_step_s
        d["output_tokens_per_s"] = self.num_sampled_tokens / self.time_step_s if self.time_step_s else 0.0
        return d

    def reset(self) -> None:
        self.__init__()
