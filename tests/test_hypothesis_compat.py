"""The gate's one reach into hypothesis's internals is applied only where it was checked."""

from __future__ import annotations

from hypothesis.internal.conjecture import providers

from conformance._core import hypothesis_compat


def test_the_pinned_release_draws_no_local_constants():
    assert hypothesis_compat.version() <= hypothesis_compat.CHECKED_UP_TO
    assert hypothesis_compat.freeze_local_constants()
    assert hypothesis_compat.local_constants_frozen()
    pool = providers._get_local_constants()
    assert not any(len(getattr(pool, kind)) for kind in ("integers", "floats", "bytes", "strings"))


def test_a_newer_release_is_left_alone(monkeypatch):
    def sentinel():
        return "untouched"

    monkeypatch.setattr(hypothesis_compat, "version", lambda: (6, 999, 0))
    monkeypatch.setattr(hypothesis_compat, "_frozen", False)
    monkeypatch.setattr(providers, "_get_local_constants", sentinel)
    assert not hypothesis_compat.freeze_local_constants()
    assert providers._get_local_constants is sentinel
    assert not hypothesis_compat.local_constants_frozen()
