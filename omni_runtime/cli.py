"""``omni-runtime``: run the embedded thinker -> talker -> code2wav pipeline from a shell.

``omni-runtime run --prompt "hello" [--prompt ...] [--text-only] [--out out.wav]`` prints each
request's text, its number of codec tokens, where its WAV file went and its timings, with a
progress line on stderr while the stages run. With several prompts the files are ``out.wav``,
``out-1.wav``, ``out-2.wav`` ... in prompt order. Heavy imports (torch, vLLM) happen inside
``main`` so ``--help`` is instant and a connector's spawned child does not pay for them.

Exit codes: 0 every request finished, 1 some request ended in error or abort, 2 bad input (one
line on stderr), 130 interrupted by SIGINT, 143 interrupted by SIGTERM (128 + the signal's
number). An interrupted run prints one line saying so, stops the stages, ends the pipe
connector's relay children and removes any WAV file it had not finished writing; WAV files are
written under a temporary name and renamed when complete, so none is ever left half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TextIO

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException, like KeyboardInterrupt, so the runtime's
    fault handlers (``except Exception``: a request's fault fails only that request) never
    mistake it for a request's fault and swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Interrupted`` in the main thread while this is active. The
    first one only: further signals are ignored, so the clean-up the first one unwinds into
    (stages, relay children, partial files) runs to its end."""

    def handler(signum: int, frame: FrameType | None) -> None:
        for sig in INTERRUPT_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in INTERRUPT_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class _Parser(argparse.ArgumentParser):
    """A usage error is one line and exit 2, as for every other bad input."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _at_least_one(text: str) -> int:
    """A token limit: an integer of at least 1 (argparse turns the ValueError into one line)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="omni-runtime", description="Omni-modality AR runtime on vLLM's EngineCore (CPU)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate text and speech for prompts")
    run.add_argument("--prompt", action="append", required=True, help="a text prompt (repeatable)")
    run.add_argument("--text-only", action="store_true", help="stop at the thinker (no audio)")
    run.add_argument(
        "--out",
        default="out.wav",
        help="WAV path; with several prompts the i-th (i>0) goes to <stem>-<i><suffix>",
    )
    run.add_argument("--max-text-tokens", type=_at_least_one, default=None)
    run.add_argument("--max-codec-tokens", type=_at_least_one, default=None)
    run.add_argument(
        "--async",
        dest="async_scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="async (batch-queue) or sync (--no-async) scheduling",
    )
    run.add_argument(
        "--sync", dest="async_scheduling", action="store_false", help="same as --no-async"
    )
    run.add_argument("--materialization", choices=("inline", "background"), default="inline")
    run.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    run.add_argument("--pipeline-config", default=None, help="stage graph JSON file")
    run.add_argument(
        "--connector", choices=("inprocess", "pipe"), default=None, help="override every edge"
    )
    run.add_argument(
        "--backend",
        # engine.config.BACKENDS, spelled out: importing the engine here would make --help
        # wait for vLLM (tests/test_cli.py holds the two equal).
        choices=("inprocess", "multiprocess", "ray"),
        default="inprocess",
        help="where each LM stage's vLLM engine runs: in this process, in its own, or in a Ray "
        "actor (needs the [ray] extra)",
    )
    run.add_argument(
        "--ray-address",
        default=None,
        help="with --backend ray: the Ray cluster to join (host:port, or auto); default: start a "
        "local Ray instance",
    )
    run.add_argument("--json", action="store_true", help="print results as JSON lines")
    run.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return parser


def wav_paths(out: str, n: int) -> list[Path]:
    base = Path(out)
    return [base if i == 0 else base.with_name(f"{base.stem}-{i}{base.suffix}") for i in range(n)]


class Progress:
    """One stderr line per step on a terminal (rewritten in place), sparser lines otherwise."""

    def __init__(self, stream: TextIO, total: int, enabled: bool) -> None:
        self.stream = stream
        self.total = total
        self.enabled = enabled
        self.tty = stream.isatty()
        self.done = 0
        self.audio_chunks = 0
        self.text_tokens = 0
        self.step = 0
        self.t0 = time.perf_counter()

    def update(self, events: list[Any], stage_load: dict[str, int]) -> None:
        self.step += 1
        for ev in events:
            if ev.kind == "text":
                self.text_tokens += len(ev.token_ids)
            elif ev.kind == "audio":
                self.audio_chunks += 1
            elif ev.kind == "finished":
                self.done += 1
        if not self.enabled:
            return
        stages = " ".join(f"{k}:{v}" for k, v in stage_load.items())
        line = (
            f"step {self.step:4d} | {stages} | text tokens {self.text_tokens} | "
            f"audio chunks {self.audio_chunks} | done {self.done}/{self.total} | "
            f"{time.perf_counter() - self.t0:6.2f}s"
        )
        if self.tty:
            self.stream.write("\r" + line)
        elif self.step % 10 == 1 or any(ev.kind == "finished" for ev in events):
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f} ms"


def out_problem(out: str, n: int) -> str | None:
    """Why the WAV files for ``n`` prompts cannot be written at ``out`` (checked before any
    stage runs, so a bad path costs nothing), or None."""
    for path in wav_paths(out, n):
        if path.is_dir():
            return f"--out {out}: {path} is a folder"
        folder = path.parent
        while not folder.exists():  # the first existing ancestor decides whether mkdir can work
            folder = folder.parent
        if not folder.is_dir():
            return f"--out {out}: {folder} is a file, not a folder"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"--out {out}: folder {folder} is not writable"
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from omni_runtime.engine.graph import PipelineConfigError
    from omni_runtime.engine.pipeline import OmniPipeline
    from omni_runtime.engine.remote import BackendUnavailable

    problem = None if args.text_only else out_problem(args.out, len(args.prompt))
    if args.ray_address is not None and args.backend != "ray":
        problem = f"--ray-address needs --backend ray (got --backend {args.backend})"
    if problem:
        print(f"omni-runtime: error: {problem}", file=sys.stderr)
        return 2
    try:
        pipeline = OmniPipeline(
            args.pipeline_config,
            async_scheduling=args.async_scheduling,
            materialization=args.materialization,
            prefix_caching=args.prefix_caching,
            connector=args.connector,
            backend=args.backend,
            ray_address=args.ray_address,
        )
    except (PipelineConfigError, BackendUnavailable) as exc:
        print(f"omni-runtime: error: {exc}", file=sys.stderr)
        return 2
    try:
        progress = Progress(sys.stderr, len(args.prompt), not args.no_progress)
        orch = pipeline.orchestrator

        def on_step(events: list[Any]) -> None:
            load = {sid: e.num_requests() for sid, e in orch.engines.items()}
            progress.update(events, load)

        results = pipeline.generate(
            args.prompt,
            max_text_tokens=args.max_text_tokens,
            max_codec_tokens=args.max_codec_tokens,
            text_only=args.text_only,
            on_step=on_step,
        )
        progress.close()
        paths = wav_paths(args.out, len(results))
        failed = 0
        for prompt, result, path in zip(args.prompt, results, paths, strict=True):
            wav: Path | None = None
            if result.waveform is not None and result.sample_rate is not None:
                wav = _write_whole(path, result.waveform, result.sample_rate)
            failed += not result.ok
            if args.json:
                print(json.dumps(_as_json(prompt, result, wav)))
                continue
            print(f"[{result.request_id}] prompt: {prompt!r}")
            print(
                f"  text: {result.text!r} ({len(result.text_token_ids)} tokens, "
                f"finish: {result.stage_finish_reasons.get(pipeline.stage_ids[0], 'n/a')})"
            )
            if not args.text_only:
                seconds = (
                    0.0
                    if result.waveform is None or not result.sample_rate
                    else result.waveform.numel() / result.sample_rate
                )
                print(
                    f"  codec tokens: {len(result.codec_token_ids)} "
                    f"({len(result.audio_codes)} audio codes in {result.num_audio_chunks} chunks, "
                    f"{seconds:.3f} s of audio)"
                )
                print(f"  wav: {wav if wav is not None else 'not written'}")
            print(
                f"  finish: {result.finish_reason}" + (f" ({result.error})" if result.error else "")
            )
            print(
                f"  timings: first text token {_ms(result.time_to_first_text_token)}, "
                f"first audio chunk {_ms(result.time_to_first_audio_chunk)}, "
                f"total {_ms(result.total_time)}"
            )
        return 1 if failed else 0
    finally:
        pipeline.close()


def _write_whole(path: Path, waveform: Any, sample_rate: int) -> Path:
    """Write the WAV under a temporary name beside ``path``, then rename: an interrupted write
    leaves no partial file (the temporary one is removed)."""
    from omni_runtime.audio import write_wav

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        write_wav(partial, waveform, sample_rate)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path.resolve()


def _as_json(prompt: str, result: Any, wav: Path | None) -> dict[str, Any]:
    return {
        "request_id": result.request_id,
        "prompt": prompt,
        "text": result.text,
        "text_token_ids": result.text_token_ids,
        "num_codec_tokens": len(result.codec_token_ids),
        "num_audio_codes": len(result.audio_codes),
        "wav": None if wav is None else str(wav),
        "finish_reason": result.finish_reason,
        "stage_finish_reasons": result.stage_finish_reasons,
        "error": result.error,
        "time_to_first_text_token": result.time_to_first_text_token,
        "time_to_first_audio_chunk": result.time_to_first_audio_chunk,
        "total_time": result.total_time,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with interruptible():
            return _main(args)
    except Interrupted as exc:
        # After the unwinding: the stages are stopped and the relay children reaped by now.
        print(f"omni-runtime: interrupted by {exc.name} (exit {exc.exit_code})", file=sys.stderr)
        return exc.exit_code


def _main(args: argparse.Namespace) -> int:
    # Before vLLM is imported: keep its INFO chatter off the user's terminal, never download.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from omni_runtime.vllm_support import UnsupportedVllm, check_vllm

    try:
        check_vllm()
    except UnsupportedVllm as exc:
        print(f"omni-runtime: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "run":
        return cmd_run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
