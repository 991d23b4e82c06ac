"""Typed stage payloads: what crosses a stage boundary, and the omni fields on vLLM's outputs.

Three kinds of objects live here, each a data contract rather than behaviour:

* ``StagePayload`` — one request's model outputs of one step (hidden rows of its scheduled
  tokens, named multimodal tensors, prefill conditioning), built only by the output adapter.
* ``StageChunk`` — one delivery to a downstream stage, decided by the scheduler's transfer
  adapter: the accepted token ids of the step, the payload (or the processor's transform of it)
  and whether it is the request's terminal (EOF) delivery.
* ``OmniEngineCoreOutput(s)`` and ``OmniModelRunnerOutput`` — upstream's output structures
  extended with trailing fields only, so upstream decoders and code that reads upstream fields
  keep working unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput


@dataclass(frozen=True, eq=False)
class StagePayload:
    """One request's model outputs of one step.

    ``start`` is the token position of the first row of ``hidden``; rows cover the positions
    ``[start, start + num_rows)`` that the step scheduled (C-51). ``hidden`` is None in token-only
    mode (C-30); ``conditioning`` and ``multimodal`` still cross in that mode (C-31).
    """

    request_id: str
    start: int
    num_tokens: int
    hidden: torch.Tensor | None = None
    multimodal: Mapping[str, torch.Tensor] = field(default_factory=dict)
    conditioning: torch.Tensor | None = None

    @property
    def has_tensors(self) -> bool:
        return self.hidden is not None or bool(self.multimodal) or self.conditioning is not None

    def trimmed_before(self, position: int) -> StagePayload | None:
        """The payload without rows for positions before ``position`` (already delivered).

        None when nothing is left: no hidden row past ``position`` and no other tensor.
        """
        drop = min(max(0, position - self.start), self.num_tokens)
        if drop == 0:
            return self
        hidden = None if self.hidden is None else self.hidden[drop:]
        if hidden is not None and hidden.shape[0] == 0 and not self.multimodal:
            if self.conditioning is None:
                return None
        return StagePayload(
            self.request_id,
            self.start + drop,
            self.num_tokens - drop,
            hidden,
            self.multimodal,
            self.conditioning,
        )


@dataclass(frozen=True, eq=False)
class StageChunk:
    """One delivery from a stage to its downstream consumer for one request.

    ``seq`` counts deliveries per request from 0; ``is_final`` marks the one terminal (EOF)
    delivery (C-43); ``finish_reason`` is vLLM's reason string (``stop``, ``length``, ``abort``,
    ``error``) on that delivery. ``token_ids`` is an immutable copy of the step's accepted ids
    (C-44). ``data`` is what the chunk processor returned, or the payload when there is none.
    """

    request_id: str
    source_stage: str
    seq: int
    token_ids: tuple[int, ...]
    payload: StagePayload | None
    data: Any
    is_final: bool
    finish_reason: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.source_stage}/{self.request_id}/{self.seq}"


@dataclass
class OmniModelRunnerOutput(ModelRunnerOutput):
    """Upstream's runner output plus per-request payloads aligned with ``req_ids`` (C-51).

    ``omni_payloads`` is None when the step built no payload objects at all (C-50).
    """

    omni_payloads: list[StagePayload | None] | None = None
    # Requests a step fault was pinned on by the worker's isolation (``worker.recovery``), with
    # the cause naming the stage; they carry no tokens and no payload. None: nobody failed.
    omni_failed: dict[str, str] | None = None


class OmniEngineCoreOutput(
    EngineCoreOutput,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    """An ``EngineCoreOutput`` with trailing omni fields (upstream decoders ignore them).

    ``omni_chunk_refs`` names the chunks this step handed to the transfer adapter for the
    downstream stage; ``omni_eof`` is True on the step that made the terminal delivery.
    """

    omni_chunk_refs: list[str] | None = None
    omni_eof: bool = False
    # Why a request finished with an error, naming the stage (set with an error finish reason).
    omni_error: str | None = None


class OmniEngineCoreOutputs(
    EngineCoreOutputs,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    # The element type must be re-declared for msgspec to encode and decode the subclass fields.
    outputs: list[OmniEngineCoreOutput] = []  # type: ignore[assignment]


def omni_output_from(
    base: EngineCoreOutput, refs: list[str] | None, eof: bool
) -> OmniEngineCoreOutput:
    """Copy an upstream output into its omni form, field for field."""
    # Positional construction from astuple is the cheap path (C-level) on every chunk step.
    return OmniEngineCoreOutput(*msgspec.structs.astuple(base), refs, eof)  # type: ignore[call-arg]
