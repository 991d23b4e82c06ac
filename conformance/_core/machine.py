"""Hypothesis building blocks: the workload language as a ``RuleBasedStateMachine``.

``LockstepMachine`` turns each workload operation into a rule (add a request, step, abort a
subset of ids in whatever state they are, the three forms of ``reset_prefix_cache``, deliver
chunks), applies it to upstream and the subject in lock step, and fails on the first difference
no registry entry tolerates; hypothesis then shrinks the program, and the failing (shrunk) trace
is written to the failures folder for ``omni-conformance replay``. At teardown it drains the
workload and checks conservation (C-06) and that no subject state survives its request (C-04).

Use ``machine_for(recorder, config, ...)`` to get a factory of machines bound to one test's
recorder and configuration, then ``run_state_machine_as_test`` it.

The workload's constants live here, once, for every user (the scripted workload in
``conformance._core.scenarios``, the suite, the tests): ``TIGHT``, the configuration the suite runs
with; ``PREFIXES``, the shared prompt prefixes; ``STOP_IDS``, the stop tokens requests may use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conformance._core import hash_seed
from conformance._core.config import HarnessConfig
from conformance._core.multimodal import IMAGE_DRAWS, IMAGES
from conformance._core.workload import (
    PAUSE_STATES,
    Abort,
    AddRequest,
    DeliverChunks,
    Pause,
    ResetEncoderCache,
    ResetPrefixCache,
    Step,
    StreamInput,
)

if TYPE_CHECKING:
    import random


# Shared prefixes long enough to fill whole blocks (block_size 16): prefix-cache hits need them.
PREFIXES: dict[str, tuple[int, ...]] = {
    "sys": tuple(range(40, 72)),
    "doc": tuple(range(300, 348)),
}
STOP_IDS = (5, 6)
# The tight budget's context (``TIGHT``).
TIGHT_LEN = 128


def own_length(length: int, prefix: str | None, axis_fields: Mapping[str, Any], room: int) -> int:
    """How many of its own tokens a request drawn with ``length`` gets: at most what leaves its
    whole prompt (prefix, images' placeholders, own tokens) under ``room`` tokens, at least one.
    An engine's input processor refuses a prompt that fills the context, so the harness never
    sends one (only images can make a drawn prompt that long)."""
    used = len(PREFIXES[prefix]) if prefix else 0
    used += sum(IMAGES[name][1] for name, _ in axis_fields.get("images", ()))
    return max(1, min(length, room - used))


def valid_fields(axis_fields: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """An axis's drawn fields as a client can send them with ``max_tokens``: vLLM refuses
    ``min_tokens`` above it."""
    if axis_fields.get("min_tokens", 0) > max_tokens:
        return {**axis_fields, "min_tokens": max_tokens}
    return axis_fields


def random_request(
    rng: random.Random,
    request_id: str,
    request_values: Mapping[str, tuple[Any, ...]] | None = None,
    max_model_len: int = TIGHT_LEN,
) -> AddRequest:
    """One request as the machine's rule draws it, from a ``random.Random`` instead of
    hypothesis (seeded corpora and unshrunk programs): prompt, shared prefix, limits, stops, and
    an axis's per-request fields (``request_values``)."""
    length, salt = rng.randint(1, 40), rng.randint(0, 3)
    axis_fields = {k: rng.choice(v) for k, v in sorted((request_values or {}).items())}
    prefix = rng.choice([None, "sys", "doc"])
    length = own_length(length, prefix, axis_fields, max_model_len - 1)
    max_tokens = rng.randint(1, 20)  # drawn in the order the fields below were drawn before
    return AddRequest(
        request_id,
        tuple(100 + (salt * 37 + i) % 200 for i in range(length)),
        prefix=prefix,
        max_tokens=max_tokens,
        stop_token_ids=STOP_IDS if rng.random() < 0.5 else (),
        ignore_eos=rng.random() < 0.5,
        **valid_fields(axis_fields, max_tokens),
    )


def session_chunk(salt: int, length: int) -> tuple[int, ...]:
    """The tokens of one chunk a client streams into a session."""
    return tuple(100 + (salt * 53 + i) % 200 for i in range(length))


def client_trace_headers(n: int, count: int) -> tuple[tuple[str, str], ...] | None:
    """The tracing context a client of request number ``n`` sends (W3C trace context, as an
    OpenTelemetry client would): none (``count`` 0), a ``traceparent``, or that and a
    ``tracestate``. Distinct per request, so an output carrying another request's headers shows."""
    if count <= 0:
        return None
    headers = [("traceparent", f"00-{n + 1:032x}-{(n * 7919) % 2**64 + 1:016x}-01")]
    if count > 1:
        headers.append(("tracestate", f"omni=r{n}"))
    return tuple(headers)


def second_client(length: int, salt: int, max_tokens: int) -> int:
    """The client a request of these draws comes from: 1 for about one in eight, else 0."""
    return int(salt == 3 and (length + max_tokens) % 2 == 1)


# The tight budget the suite runs with: 14 blocks of 16 tokens, so preemption and eviction happen.
# Derive variants with ``TIGHT.with_(...)``.
TIGHT = HarnessConfig(
    num_blocks=14, max_num_batched_tokens=48, max_num_seqs=6, max_model_len=TIGHT_LEN
)
# Whether this interpreter hashes strings with PYTHONHASHSEED=0, read from the interpreter itself:
# the environment variable says nothing about this process once a conftest has set it for the
# workers it starts (the root conftest does), so ``pytest -m invariants`` without ``-n`` ran
# multi-id aborts in a random set order, and step counts changed from run to run. Any other seed
# splits the aborts (below), which is the same on every run.
PINNED_HASH_SEED = hash_seed.this_process_uses_seed()


class LockstepMachine(RuleBasedStateMachine):
    """One lock-step session driven by hypothesis; ``session`` defaults to the recorder's."""

    def __init__(
        self,
        recorder: Any,
        config: HarnessConfig,
        *,
        final_stages: tuple[str | None, ...] = (None,),
        plain_requests: bool = False,
        name: str = "lockstep",
        session: Any = None,
        request_values: Mapping[str, tuple[Any, ...]] | None = None,
    ) -> None:
        super().__init__()
        # A scheduler axis's per-request fields (``conformance._core.axes``), drawn after the
        # others; none on the plain machine, whose examples stay as they were.
        self.request_values = sorted((request_values or {}).items())
        self.recorder = recorder
        self.config = config
        self.final_stages = final_stages
        # What the ``final`` draw picks from: a final stage, or (for a feature with
        # ``plain_requests``) a request of a client that knows nothing of the runtime. One draw
        # for both, so a feature without plain requests explores exactly the examples it did
        # before the option existed.
        self.destinations: list[tuple[str | None, bool]] = [(f, False) for f in final_stages]
        if plain_requests:
            self.destinations.append((None, True))
        self.name = name
        self.session = session or recorder.lockstep(config, prefixes=PREFIXES)
        self.counter = 0

    @rule(
        prefix=st.sampled_from([None, "sys", "doc"]),
        length=st.integers(1, 40),
        salt=st.integers(0, 3),
        max_tokens=st.integers(1, 20),
        stop=st.booleans(),
        ignore_eos=st.booleans(),
        final=st.data(),
    )
    def add(
        self,
        prefix: str | None,
        length: int,
        salt: int,
        max_tokens: int,
        stop: bool,
        ignore_eos: bool,
        final: st.DataObject,
    ) -> None:
        rid = f"r{self.counter}"
        # Whether (and how) the client traces the request follows from the draws above, not
        # from a draw of its own: a new draw would shift every example the suite's derandomized
        # runs explore, and with them what its fixed example budgets reach.
        trace_headers = client_trace_headers(self.counter, (length + salt) % 3)
        # The same holds for the client: about one request in eight comes from a second one, so
        # that most steps still have a single client (upstream's common case, and the omni
        # scheduler's fast path) while some interleave two.
        client_index = second_client(length, salt, max_tokens)
        self.counter += 1
        final_stage, plain = final.draw(st.sampled_from(self.destinations))
        axis_fields = {k: final.draw(st.sampled_from(v)) for k, v in self.request_values}
        length = own_length(length, prefix, axis_fields, self.config.max_model_len - 1)
        prompt = tuple(100 + (salt * 37 + i) % 200 for i in range(length))
        self.session.apply(
            AddRequest(
                rid,
                prompt,
                prefix=prefix,
                max_tokens=max_tokens,
                stop_token_ids=STOP_IDS if stop else (),
                ignore_eos=ignore_eos,
                final_stage=final_stage,
                trace_headers=trace_headers,
                client_index=client_index,
                plain=plain,
                **valid_fields(axis_fields, max_tokens),
            )
        )

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            if self.session.failure is not None:
                return
            self.session.apply(Step())

    @precondition(lambda self: self.counter > 0)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        known = [f"r{i}" for i in range(self.counter)]
        ids = data.draw(st.lists(st.sampled_from(known), min_size=1, max_size=3, unique=True))
        if PINNED_HASH_SEED:
            self.session.apply(Abort(tuple(ids)))
            return
        # vLLM's finish_requests frees a multi-id abort in set order, i.e. in an order that
        # depends on PYTHONHASHSEED, and the free order steers later prefix hits and hence step
        # counts. Unless the seed is pinned, abort the subset one id at a time (same ids, same
        # step), so verdicts and step counts are identical run to run.
        for rid in ids:
            if self.session.failure is not None:
                return
            self.session.apply(Abort((rid,)))

    @rule(form=st.sampled_from(["plain", "running", "connector"]))
    def reset_prefix_cache(self, form: str) -> None:
        self.session.apply(
            ResetPrefixCache(
                reset_running_requests=form == "running", reset_connector=form == "connector"
            )
        )

    @rule()
    def deliver_chunks(self) -> None:
        self.session.apply(DeliverChunks())

    @invariant()
    def no_undeclared_difference(self) -> None:
        if self.session.failure is not None:
            # Hypothesis shrinks; the last (smallest) failing example's trace is what remains.
            self.recorder.fail(self.session, self.name)

    def teardown(self) -> None:
        if self.session.failure is None:
            self.session.drain()
            if self.session.failure is not None:
                self.recorder.fail(self.session, self.name)
            problems = self.session.conservation_problems()
            assert not problems, "; ".join(problems)


class StreamsInput:
    """The client of streaming input sessions, as a rule for a machine whose requests may be
    resumable (the ``streaming-sessions`` axis): more input for a session upstream still holds,
    or the end of its stream. A client sends nothing to a session that has finished, as vLLM's
    ``AsyncLLM`` stops its input task then; the drain ends the streams left open. With a
    multimodal model a chunk may carry images too."""

    session: Any
    config: HarnessConfig

    @precondition(lambda self: not all(self.session.sessions.values()))
    @rule(
        data=st.data(),
        length=st.integers(1, 16),
        salt=st.integers(0, 3),
        max_tokens=st.integers(1, 6),
    )
    def stream_input(self, data: st.DataObject, length: int, salt: int, max_tokens: int) -> None:
        open_ids = self.session.open_sessions()
        if not open_ids:
            return
        rid = data.draw(st.sampled_from(open_ids))
        if salt == 0 and length % 2:  # about one input in eight ends the stream
            self.session.apply(StreamInput(rid, end=True))
        else:
            images = data.draw(st.sampled_from(IMAGE_DRAWS)) if self.config.multimodal else ()
            chunk = session_chunk(salt, length)
            self.session.apply(StreamInput(rid, chunk, max_tokens, images=images))


class Pauses:
    """The engine pausing and resuming its scheduler, as a rule (the pause axes): no new
    requests, nothing at all, or resumed; the drain resumes a scheduler left paused. With a
    multimodal model the engine may also drop its encoder cache, as a weight update does."""

    session: Any
    config: HarnessConfig

    @rule(state=st.sampled_from(PAUSE_STATES))
    def pause(self, state: str) -> None:
        self.session.apply(Pause(state))

    @precondition(lambda self: self.config.multimodal)
    @rule()
    def reset_encoder_cache(self) -> None:
        self.session.apply(ResetEncoderCache())


def machine_for(
    recorder: Any,
    config: HarnessConfig,
    *,
    final_stages: tuple[str | None, ...] = (None,),
    plain_requests: bool = False,
    name: str = "lockstep",
    request_values: Mapping[str, tuple[Any, ...]] | None = None,
) -> Callable[[], LockstepMachine]:
    """A factory for ``run_state_machine_as_test``: one fresh machine per example."""
    return lambda: LockstepMachine(
        recorder,
        config,
        final_stages=final_stages,
        plain_requests=plain_requests,
        name=name,
        request_values=request_values,
    )
