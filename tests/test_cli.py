"""``omni-runtime run``: writes playable 16-bit mono WAV files and prints text and timings.

The WAV is read back with the stdlib ``wave`` module: one channel, 2-byte samples, the codec
decoder's sample rate, and exactly ``hop_length`` frames per audio code the run reported.
"""

from __future__ import annotations

import re
import subprocess
import sys
import wave

import pytest

from omni_runtime import cli
from omni_runtime.models import load_config

HOP = load_config("code2wav").hop_length
RATE = load_config("code2wav").sample_rate


def test_run_writes_wav_and_prints_text(tmp_path, capsys) -> None:
    out = tmp_path / "hello.wav"
    rc = cli.main(
        [
            "run",
            "--prompt",
            "hello",
            "--out",
            str(out),
            "--max-text-tokens",
            "5",
            "--max-codec-tokens",
            "20",
            "--sync",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured
    assert "text: " in captured.out and f"wav: {out.resolve()}" in captured.out
    assert "first text token" in captured.out and "first audio chunk" in captured.out
    codes = int(re.search(r"\((\d+) audio codes", captured.out).group(1))
    tokens = int(re.search(r"codec tokens: (\d+)", captured.out).group(1))
    assert 1 <= codes <= tokens <= 20
    assert "done 1/1" in captured.err  # the progress line
    with wave.open(str(out), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        assert w.getnframes() == codes * HOP


def test_run_several_prompts_json_async_background(tmp_path, capsys) -> None:
    import json

    out = tmp_path / "multi.wav"
    rc = cli.main(
        [
            "run",
            "--prompt",
            "one",
            "--prompt",
            "two",
            "--out",
            str(out),
            "--max-text-tokens",
            "3",
            "--max-codec-tokens",
            "10",
            "--async",
            "--materialization",
            "background",
            "--no-prefix-caching",
            "--json",
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured
    lines = [json.loads(x) for x in captured.out.splitlines()]
    assert [x["wav"] for x in lines] == [
        str(out.resolve()),
        str((tmp_path / "multi-1.wav").resolve()),
    ]
    for x in lines:
        with wave.open(x["wav"], "rb") as w:
            assert w.getnframes() == x["num_audio_codes"] * HOP
        assert x["finish_reason"] in ("stop", "length")
    assert captured.err == ""


def test_text_only_writes_no_wav(tmp_path, capsys) -> None:
    out = tmp_path / "none.wav"
    rc = cli.main(
        [
            "run",
            "--prompt",
            "just text",
            "--text-only",
            "--out",
            str(out),
            "--max-text-tokens",
            "4",
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert "text: " in captured.out and "wav:" not in captured.out
    assert not out.exists()


def test_bad_pipeline_config_is_reported(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["run", "--prompt", "x", "--pipeline-config", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_console_script_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    for flag in (
        "--prompt",
        "--text-only",
        "--out",
        "--async",
        "--sync",
        "--materialization",
        "--prefix-caching",
        "--no-prefix-caching",
        "--pipeline-config",
    ):
        assert flag in proc.stdout


def test_wav_paths() -> None:
    assert [p.name for p in cli.wav_paths("d/out.wav", 3)] == ["out.wav", "out-1.wav", "out-2.wav"]


@pytest.mark.parametrize("prompt", ["hello", "héllo wörld", ""])
def test_byte_tokenizer_round_trip(prompt) -> None:
    from omni_runtime import text

    ids = text.encode(prompt)
    assert ids[0] == text.BOS_ID and all(3 <= i < 259 for i in ids[1:])
    assert text.decode(ids) == prompt


def test_backend_choices_are_the_engine_backends() -> None:
    from omni_runtime.cli import build_parser
    from omni_runtime.engine.config import BACKENDS

    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    [action] = [a for a in run._actions if a.dest == "backend"]
    assert tuple(action.choices) == BACKENDS
