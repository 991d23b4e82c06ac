"""Runner-level driving: one upstream schedule executed by several of the subject's runners.

The payload and materialization properties (C-22, C-30, C-31, C-50..C-54) compare runners of
different configurations on identical work. ``drive_runners`` lets vLLM's own scheduler schedule
a generated batch (``invariants.strategies.Job``), hands every ``SchedulerOutput`` to each
executor, lets ``on_step`` compare their outputs, and updates the scheduler with the first one's.
``RunnerExec`` drives a runner as the uni executor does, with a hook between ``sample_tokens``
returning and the output being collected (where C-52 overwrites buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from conformance._core.capabilities import PayloadView
from conformance._core.config import HarnessConfig
from conformance._core.subjects import UpstreamSubject
from conformance._core.workload import AddRequest
from invariants.strategies import Job, job_prompt


class RunnerExec:
    def __init__(self, runner: Any, after_sample: Callable[[Any], None] | None = None) -> None:
        self.runner = runner
        self.after_sample = after_sample

    def execute(self, so: Any) -> Any:
        out = self.runner.execute_model(so)
        if out is None:
            out = self.runner.sample_tokens(None)
            if self.after_sample is not None:
                self.after_sample(self.runner)
        get = getattr(out, "get_output", None)
        return get() if get is not None else out


def drive_runners(
    workload: list[Job],
    cfg: HarnessConfig,
    execs: list[Any],
    on_step: Callable[[int, Any, Any, list[Any]], None],
    *,
    max_steps: int = 200,
) -> int:
    """Returns the number of steps run; ``on_step(step, scheduler, so, outputs)`` checks each."""
    from vllm.v1.request import RequestStatus

    upstream = UpstreamSubject()
    sched = upstream.build_scheduler(cfg.with_(additional_config={}))
    for i, job in enumerate(workload):
        prompt = job_prompt(i, job)
        op = AddRequest(f"j{i}", tuple(prompt), max_tokens=job.max_tokens)
        upstream.admit(sched, upstream.make_request(op, prompt, cfg, sched, float(i)))
    steps = 0
    while sched.has_requests() and steps < max_steps:
        for i, job in enumerate(workload):
            if job.abort_after == steps and f"j{i}" in sched.requests:
                sched.finish_requests([f"j{i}"], RequestStatus.FINISHED_ABORTED)
        so = sched.schedule()
        outs = [e.execute(so) for e in execs]
        on_step(steps, sched, so, outs)
        sched.update_from_output(so, outs[0])
        steps += 1
    return steps


def same_view(a: PayloadView | None, b: PayloadView | None) -> bool:
    """Exact equality of two payloads: positions, and every tensor bit for bit."""
    if a is None or b is None:
        return a is b
    if (a.request_id, a.start, a.num_tokens) != (b.request_id, b.start, b.num_tokens):
        return False
    for x, y in ((a.hidden, b.hidden), (a.conditioning, b.conditioning)):
        if x is None or y is None:
            if x is not y:
                return False
        elif not torch.equal(x, y):
            return False
    return set(a.multimodal) == set(b.multimodal) and all(
        torch.equal(a.multimodal[k], b.multimodal[k]) for k in a.multimodal
    )
