"""A canonical scripted workload that drives a lock-step session through every situation.

``canonical_workload(session)`` is adaptive: it reads the *oracle's* state (never the subject's)
to pick what to abort, so the same script works for any subject and, on a conforming subject,
produces the same trace every time. It hits shared-prefix cache hits, preemption under a tight
block budget, aborts in every state (waiting, running, preempted, finished-but-not-yet-reported,
in flight under async scheduling), stop tokens, EOS, max_tokens, and all three forms of
``reset_prefix_cache``. ``session.stats`` says what actually happened.

``conformance._core.machine.TIGHT`` is the configuration it is meant for: few blocks and a small token
budget; it uses that module's ``PREFIXES`` and ``STOP_IDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from conformance._core import vllm_compat as vc
from conformance._core.config import HarnessConfig
from conformance._core.driver import AsyncDriver
from conformance._core.machine import PREFIXES, STOP_IDS
from conformance._core.workload import Abort, AddRequest, DeliverChunks, Op, ResetPrefixCache, Step

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

    from conformance._core.lockstep import Lockstep
    from conformance._core.sides import Side
    from conformance._core.subjects import Subject


class _Script:
    def __init__(self, session: Lockstep, final_stages: tuple[str | None, ...]) -> None:
        self.s = session
        self.finals = final_stages
        self.n = 0

    @property
    def ok(self) -> bool:
        return self.s.failure is None

    def add(self, prefix: str | None, length: int, **kw: Any) -> str:
        rid = f"q{self.n}"
        final = self.finals[self.n % len(self.finals)]
        self.n += 1
        prompt = tuple(100 + (self.n * 31 + i) % 200 for i in range(length))
        if self.ok:
            self.s.apply(AddRequest(rid, prompt, prefix=prefix, final_stage=final, **kw))
        return rid

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            if not self.ok:
                return
            self.s.apply(Step())

    def op(self, op: Op) -> None:
        if self.ok:
            self.s.apply(op)

    def up(self) -> Scheduler:
        """The oracle's live scheduler: the script decides its next operation from it, so it
        needs the oracle in this process."""
        from conformance._core.pristine import require_oracle_in_process
        from conformance._core.sides import Side

        if not isinstance(self.s.up, Side):
            require_oracle_in_process("a scripted scenario")
        return cast(Side, self.s.up).scheduler

    def ids_with(self, status: str) -> list[str]:
        return [rid for rid, r in self.up().requests.items() if vc.status_name(r) == status]

    def step_until(self, cond: Callable[[], bool], limit: int = 40) -> bool:
        for _ in range(limit):
            if not self.ok:
                return False
            if cond():
                return True
            self.step()
        return cond()

    def in_flight_running(self) -> list[str]:
        driver = cast("Side", self.s.up).driver  # an oracle in this process (``up``)
        if not isinstance(driver, AsyncDriver):
            return []
        queued = {rid for so, _ in driver.queue for rid in so.num_scheduled_tokens}
        return [rid for rid in self.ids_with("RUNNING") if rid in queued]


def canonical_workload(
    session: Lockstep, *, final_stages: tuple[str | None, ...] = (None,)
) -> Lockstep:
    w = _Script(session, final_stages)
    stop = {"stop_token_ids": STOP_IDS, "max_tokens": 30}
    # Warm the prefix cache, with a mix of stop ids, EOS and max_tokens endings.
    w.add("sys", 8, max_tokens=12)
    w.add("doc", 4, **stop)
    w.step(3)
    w.add("sys", 20, max_tokens=24, ignore_eos=False)  # prefix hit on "sys"
    w.add("doc", 12, **stop)  # prefix hit on "doc"
    w.add(None, 30, max_tokens=3)
    w.add("sys", 2, max_tokens=20)
    # Abort while waiting: added and aborted before any step could schedule it.
    doomed = w.add("doc", 6, max_tokens=5)
    w.op(Abort((doomed,)))
    w.step(2)
    # The block budget is tight: decoding pushes the scheduler into preemption.
    w.add("sys", 24, max_tokens=30)
    w.add("doc", 10, max_tokens=30)
    w.step_until(lambda: bool(w.ids_with("PREEMPTED")))
    if pre := w.ids_with("PREEMPTED"):
        w.op(Abort((pre[0],)))
    # Under async scheduling, abort a request whose batch is still in the queue.
    if inflight := w.in_flight_running():
        w.op(Abort((inflight[0],)))
    if running := w.ids_with("RUNNING"):
        w.op(Abort((running[-1],)))
    # Finished but not yet reported to the worker: abort right after it stopped.
    w.step_until(lambda: bool(vc.finished_unreported(w.up())))
    if fin := sorted(vc.finished_unreported(w.up())):
        w.op(Abort(tuple(fin[:2])))
    w.op(DeliverChunks())
    # Reset while blocks are held (upstream refuses), then forcibly (running requests preempted).
    w.op(ResetPrefixCache())
    w.add("sys", 5, max_tokens=6)
    w.step(2)
    w.op(ResetPrefixCache(reset_running_requests=True))
    w.step(3)
    w.add("doc", 9, **stop)
    w.op(ResetPrefixCache(reset_connector=True))
    w.step(2)
    if inflight := w.in_flight_running():
        w.op(Abort((inflight[0],)))
    # Run dry, reset on an idle pool (succeeds), and check the cache really is cold afterwards.
    if w.ok:
        session.drain()
    w.op(ResetPrefixCache())
    w.add("sys", 7, max_tokens=4)
    w.add("sys", 7, max_tokens=4)  # hits the block its neighbour just filled
    w.step(4)
    w.op(Abort(tuple(w.up().requests)[:1]))
    if w.ok:
        session.drain()
    return session


def run_canonical(config: HarnessConfig, subject: Subject, **kw: Any) -> Lockstep:
    from conformance._core.lockstep import Lockstep

    session = Lockstep(config, subject, prefixes=PREFIXES, registry=kw.pop("registry", None))
    return canonical_workload(session, **kw)
