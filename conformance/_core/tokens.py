"""A deterministic stand-in for a model runner: the tokens both schedulers are fed.

``DeterministicTokenSource.execute(scheduler_output)`` behaves like a worker: it reads only the
``SchedulerOutput``, keeps its own view of each request until the id is finished, returns no
token for a partial prefill chunk and answers exactly the scheduled requests in order (C-20).
A sampled token is a pure function of (request id, position), so two schedulers that schedule
the same work get the same tokens. A fixed share of positions yields stop tokens where sampling
allows them, and one in ``EDGE_PERIOD`` a token edge (``HarnessConfig.token_edges``). Under
speculative decoding (``HarnessConfig.num_speculative_tokens``) it also drafts tokens and
verifies the drafts vLLM scheduled, depending on positions only. A structured request samples
within the grammar bitmask the step gives it (``execute``'s ``grammar``), except at a fixed
share of positions, where it takes a token the grammar forbids.

How stops, edges, drafting and verification are chosen: docs/design.md, "Inside the gate".
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from conformance._core import vllm_compat as vc
from conformance._core.ec_connectors import RunnerReport
from conformance._core.harness_faults import harness_code
from conformance._core.kv_connectors import WorkerStandIn
from conformance._core.logprobs import runner_logprobs, runner_prompt_logprobs

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

# One position in STOP_PERIOD emits a stop token when the request allows one.
STOP_PERIOD = 7
EOS_PERIOD = 11
# One position in EDGE_PERIOD samples a token edge, where the configuration names any.
EDGE_PERIOD = 5
# One draft in DRAFT_MISS_PERIOD is wrong (and with it the rest of its step's drafts): steps
# accept anything from none to all of their drafts.
DRAFT_MISS_PERIOD = 3
# The draft id async scheduling schedules in place of the drafts its runner keeps.
PLACEHOLDER = -1
# A structured request samples the first token its grammar allows at or after the one above,
# except at one position in GRAMMAR_MISS_PERIOD, where it takes the first one the grammar
# forbids (a runner that ignored the bitmask): vLLM then ends the request with an error.
GRAMMAR_MISS_PERIOD = 19


# Values a pooling runner returns per request (an embedding's width).
POOLED_WIDTH = 8


def pooled_embedding(request_id: str) -> Any:
    """A pooling runner's output for a request: an embedding that is a function of its id."""
    import torch

    return torch.tensor(
        [
            (zlib.crc32(f"pool:{request_id}:{i}".encode()) % 2000 - 1000) / 1000
            for i in range(POOLED_WIDTH)
        ],
        dtype=torch.float32,
    )


def token_at(request_id: str, position: int, vocab: int = 512) -> int:
    """The non-stop token at ``position``: never 0..2 (pad/bos/eos in the tiny model)."""
    return 3 + zlib.crc32(f"{request_id}:{position}".encode()) % (vocab - 3)


@dataclass
class _ReqView:
    num_tokens: int
    stop_ids: tuple[int, ...]
    eos: int | None
    # A structured request's allowed ids when it last sampled: the drafter keeps to them.
    allowed: np.ndarray | None = None
    # The logprobs the request asks for per sampled token (``SamplingParams.logprobs``).
    logprobs: int | None = None
    # Positions before this one sample no stop id and no EOS: vLLM's sampler masks them until
    # the request has ``SamplingParams.min_tokens`` outputs (its min-tokens logits processor).
    min_tokens_end: int = 0
    # Where the request's output starts to loop and the loop's length (``_loop``), or None.
    loop: tuple[int, int] | None = None


def _loop(request_id: str, prompt: int, sp: Any) -> tuple[int, int] | None:
    """A request that asks for repetition detection gets an output that falls into a loop, as a
    degenerate model's does: from one of its first six positions on it repeats a pattern of 1-4
    tokens, so vLLM's detector has patterns to find (or, longer than it looks for, to miss)."""
    params = getattr(sp, "repetition_detection", None) if sp is not None else None
    if params is None:
        return None
    h = zlib.crc32(f"loop:{request_id}".encode())
    return prompt + 1 + (h >> 4) % 6, 1 + h % 4


def _first(hits: np.ndarray, start: int) -> int:
    """The first id at or after ``start`` whose entry in ``hits`` is true, wrapping around
    (``start`` itself when none is)."""
    found = np.flatnonzero(hits)
    if not found.size:
        return start
    i = int(np.searchsorted(found, start))
    return int(found[i if i < found.size else 0])


class DeterministicTokenSource:
    def __init__(
        self,
        vocab: int = 512,
        stop_period: int = STOP_PERIOD,
        edges: tuple[int, ...] = (),
        num_drafts: int = 0,
        report: RunnerReport | None = None,
        aux: vc.AuxRunner | None = None,
        dynamic_drafts: bool = False,
    ) -> None:
        self.vocab = vocab
        self.stop_period = stop_period
        self.edges = tuple(t for t in edges if 0 <= t < vocab)
        self.num_drafts = num_drafts
        # Dynamic speculative decoding: each step says how many drafts to propose after it
        # (the batch-size schedule's count), as vLLM's runner reads it; else ``num_drafts``.
        self.dynamic_drafts = dynamic_drafts
        self._draft_count = num_drafts
        self._reqs: dict[str, _ReqView] = {}
        # Requests that asked for logprobs (``execute`` builds rows only while there are any).
        self._logprob_ids: set[str] = set()
        # Requests that asked for prompt logprobs and have not had them: prompt and candidates.
        self._prompt_logprobs: dict[str, tuple[list[int], int]] = {}
        self._drafted: list[str] = []  # the last step's requests, in its order
        self._grammar: GrammarOutput | None = None  # for the next step (``receive_grammar``)
        self._kv = WorkerStandIn()  # a KV connector's worker half (none configured: idle)
        # Sampling masks and routed experts, when the configuration asks the runner for them.
        self.aux = aux
        # What the instance's runner returns besides tokens (an EC connector's output; none at
        # all on an encoder-only instance).
        self._report = report or RunnerReport()

    def choose(self, view: _ReqView, request_id: str, position: int) -> int:
        # The min-tokens mask counts real positions; a looping output repeats what it chose.
        stops = position >= view.min_tokens_end
        if view.loop is not None and position >= view.loop[0]:
            position = view.loop[0] + (position - view.loop[0]) % view.loop[1]
        h = zlib.crc32(f"stop:{request_id}:{position}".encode())
        if stops and view.stop_ids and h % self.stop_period == 0:
            return view.stop_ids[(h >> 8) % len(view.stop_ids)]
        if stops and view.eos is not None and h % EOS_PERIOD == 1:
            return view.eos
        tok = token_at(request_id, position, self.vocab)
        if self.edges and (h >> 4) % EDGE_PERIOD == 0:
            tok = self.edges[(h >> 12) % len(self.edges)]
        # Keep ordinary tokens distinct from stop ids so stops happen only where chosen above.
        while tok in view.stop_ids or tok == view.eos:
            tok = 3 + (tok + 1 - 3) % (self.vocab - 3)
        return tok

    def expect(self, view: _ReqView, request_id: str, position: int) -> int:
        """What the drafter expects at ``position``: ``choose``'s token, kept (for a structured
        request) to the ids its grammar allowed when it last sampled."""
        token = self.choose(view, request_id, position)
        if view.allowed is not None:
            token = _first(view.allowed, token)
        return token

    def sample(
        self, view: _ReqView, request_id: str, position: int, rows: vc.GrammarRows | None, i: int
    ) -> int:
        """The token sampled at ``position``, the ``i``-th the step samples for the request:
        ``choose``'s, or for a structured request the first its bitmask row allows from there
        (the first it forbids, at a ``GRAMMAR_MISS_PERIOD`` position)."""
        token = self.choose(view, request_id, position)
        if rows is None:
            return token
        view.allowed = rows.allowed[i]
        if zlib.crc32(f"grammar:{request_id}:{position}".encode()) % GRAMMAR_MISS_PERIOD == 0:
            return _first(~view.allowed, token)
        return _first(view.allowed, token)

    def guess(self, view: _ReqView, request_id: str, position: int) -> int:
        """The drafter's token for ``position``: the one it expects there, except at one
        position in ``DRAFT_MISS_PERIOD`` (a miss, which ends what a step accepts)."""
        token = self.expect(view, request_id, position)
        if zlib.crc32(f"draft:{request_id}:{position}".encode()) % DRAFT_MISS_PERIOD == 0:
            return 3 + (token + 1 - 3) % (self.vocab - 3)
        return token

    def receive_grammar(self, grammar: GrammarOutput) -> None:
        """The grammar output (bitmask) the next ``execute`` samples its structured requests
        under, as ``sample_tokens`` receives it after ``execute_model`` in a worker."""
        self._grammar = grammar

    @harness_code
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.v1.outputs import ModelRunnerOutput

        for rid in so.finished_req_ids:
            self._reqs.pop(rid, None)
            self._logprob_ids.discard(rid)
            self._prompt_logprobs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            if sp is not None and sp.logprobs is not None:
                self._logprob_ids.add(new.req_id)
            if sp is not None and sp.prompt_logprobs is not None and new.num_computed_tokens == 0:
                self._prompt_logprobs[new.req_id] = (
                    list(new.prompt_token_ids or ()),
                    sp.prompt_logprobs,
                )
            prompt = vc.prompt_length(new)
            self._reqs[new.req_id] = _ReqView(
                num_tokens=prompt,
                stop_ids=tuple(sp.stop_token_ids or ()) if sp is not None else (),
                eos=sp.eos_token_id if sp is not None else None,
                logprobs=sp.logprobs if sp is not None else None,
                min_tokens_end=prompt + sp.min_tokens if sp is not None else 0,
                loop=_loop(new.req_id, prompt, sp),
            )
        computed = vc.computed_before(so)
        for rid in so.scheduled_cached_reqs.req_ids:
            all_ids = vc.resumed_all_token_ids(so, rid)
            view = self._reqs.get(rid)
            if all_ids is not None and view is not None:
                # A resumed request's tokens as the scheduler knows them (V1 runner semantics).
                view.num_tokens = len(all_ids)

        if self.dynamic_drafts:
            self._draft_count = min(self.num_drafts, vc.spec_tokens_to_schedule(so))
        kv_output = self._kv.step(so, self._reqs)
        req_ids = list(so.num_scheduled_tokens)
        drafts = vc.scheduled_drafts(so)
        grammar, self._grammar = self._grammar, None
        grammar_rows = vc.grammar_rows(grammar, self.num_drafts, self.vocab, so)
        sampled: list[list[int]] = []
        for rid in req_ids:
            view = self._reqs.get(rid)
            # Drafts sit at the end of what is scheduled: the step verifies them.
            proposed = drafts.get(rid, ())
            end = computed.get(rid, 0) + so.num_scheduled_tokens[rid] - len(proposed)
            if view is None or end < view.num_tokens or not self._report.samples:
                # A partial prefill chunk: nothing to sample yet. An encoder-only runner never
                # samples: it publishes the prompt's encoder outputs.
                sampled.append([])
                continue
            if proposed and end > view.num_tokens:
                # Async scheduling counted the step in flight as if all its drafts were
                # accepted; a runner knows what it rejected and samples where it really is.
                end = view.num_tokens
            rows = grammar_rows.get(rid)
            ids = [self.sample(view, rid, end, rows, 0)]
            for draft in proposed:
                if rows is not None and len(ids) > rows.acceptable:
                    break  # the grammar invalidated the drafts from here on
                if draft == PLACEHOLDER:
                    # Async scheduling schedules placeholders: the runner drafted itself, as
                    # ``take_draft_token_ids`` would have (the guess for this position).
                    draft = self.guess(view, rid, end + len(ids) - 1)
                if draft != ids[-1]:
                    break
                ids.append(self.sample(view, rid, end + len(ids), rows, len(ids)))
            sampled.append(ids)
            view.num_tokens = end + len(ids)
        self._drafted = req_ids
        aux = {} if self.aux is None else self.aux.outputs(so, req_ids, computed, sampled)
        if self._report.pools:
            self._attach_pooled(aux, so, req_ids, computed)
        if self._logprob_ids:  # read per step only while some request asks for logprobs
            self._attach_logprobs(aux, so, req_ids, computed, drafts, sampled)
        if self._prompt_logprobs:
            self._attach_prompt_logprobs(aux, req_ids, sampled)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
            # None (the default) unless the runner attaches its EC connector's output.
            ec_connector_output=self._report.ec_connector_output(so),
            **aux,
        )

    def _attach_pooled(
        self, aux: dict, so: SchedulerOutput, req_ids: list[str], computed: dict[str, int]
    ) -> None:
        # As a pooling runner: a request's pooled output in the step that computes its last
        # prompt token, None for a partial prefill.
        pooled: list[Any] = []
        for rid in req_ids:
            view = self._reqs.get(rid)
            end = computed.get(rid, 0) + so.num_scheduled_tokens[rid]
            pooled.append(
                pooled_embedding(rid) if view is not None and end >= view.num_tokens else None
            )
        if any(p is not None for p in pooled):
            aux["pooler_output"] = pooled

    def _attach_prompt_logprobs(
        self, aux: dict, req_ids: list[str], sampled: list[list[int]]
    ) -> None:
        # As vLLM's runner: a request's prompt rows all at once, in the step that computes its
        # last prompt token (the one that samples its first token), never for a partial prefill.
        got: dict[str, Any] = {}
        for rid, ids in zip(req_ids, sampled, strict=True):
            pending = self._prompt_logprobs.get(rid) if ids else None
            if pending is not None:
                del self._prompt_logprobs[rid]
                got[rid] = runner_prompt_logprobs(rid, pending[0], pending[1], self.vocab)
        if got:
            aux["prompt_logprobs_dict"] = got

    def _attach_logprobs(
        self,
        aux: dict,
        so: SchedulerOutput,
        req_ids: list[str],
        computed: dict[str, int],
        drafts: dict,
        sampled: list[list[int]],
    ) -> None:
        # ``logprobs=0`` asks too: the sampled token's own logprob, no other candidate.
        asked = [
            v.logprobs for rid in req_ids if (v := self._reqs.get(rid)) and v.logprobs is not None
        ]
        if not asked:
            return
        # Where each request's first sampled token sits (its rows are keyed by it).
        positions = [
            computed.get(rid, 0) + so.num_scheduled_tokens[rid] - len(drafts.get(rid, ()))
            for rid in req_ids
        ]
        # As a runner does: every request's rows, as many candidates as any asks for.
        aux["logprobs"] = runner_logprobs(
            list(zip(req_ids, positions, sampled, strict=True)),
            max(asked),
            self.vocab,
            per_token=self.num_drafts > 0,
        )

    @harness_code
    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts for the next step of every request the last step ran (none for a partial
        prefill): the next ``num_drafts`` tokens (the step's count under dynamic speculative
        decoding), the first wrong one where the position's hash
        says so. None without speculative decoding, as a worker without a drafter returns."""
        if not self.num_drafts:
            return None
        drafts: list[list[int]] = []
        for rid in self._drafted:
            view = self._reqs.get(rid)
            proposed: list[int] = []
            if view is not None:
                for k in range(self._draft_count):
                    position = view.num_tokens + k
                    token = self.guess(view, rid, position)
                    proposed.append(token)
                    if token != self.expect(view, rid, position):
                        break
            drafts.append(proposed)
        return vc.draft_token_ids(self._drafted, drafts)

    def live_ids(self) -> set[str]:
        return set(self._reqs)
