"""What the commands share: the hypothesis profiles (``check``, ``matrix``), where the oracle runs
(``check``, ``replay``) and the one line that says so."""

from __future__ import annotations

PROFILES = ("ci", "dev", "thorough", "smoke")
ORACLE_CHOICES = ("auto", "process")


def place_oracle(choice: str) -> None:
    """Apply ``--oracle`` and say, in one line, when upstream runs in its own process."""
    from conformance._core.pristine import isolate_oracle, oracle_placement

    if choice == "process":
        isolate_oracle("requested by --oracle process")
    placement = oracle_placement()
    if placement.isolated:
        print(f"oracle: upstream vLLM runs {placement.describe()}", flush=True)
