"""Reach per scheduler area: which feature of vLLM's scheduler each measured branch serves.

A branch belongs to an area when the condition it tests names the area's feature (``AREAS``:
words such as ``connector``, ``spec``, ``priority``, ``encoder``), or else the nearest enclosing
condition or function that does; a branch that none names is ``core`` (plain decoding,
preemption, the prefix cache, aborts). The words are matched against the source text of the
condition (or the function's name), so the split follows vLLM's own naming and needs no table
per release. ``split`` turns a file's executed and missing branches (coverage.py's JSON) into
covered and total branches per area; ``PART`` says which scheduler issue an area belongs to.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

CORE = "core"

# Area -> the words that name it (a regular expression, case-insensitive), in the order they
# are tried: the first area whose words appear wins, so the narrower features come first (the
# encoder-cache connector is the encoder cache's, not the KV connectors').
AREAS: tuple[tuple[str, str], ...] = (
    ("multimodal and encoder cache", r"encoder|mm_|multimodal|ec_connector|ec_transfer|embed"),
    ("routed experts and masks", r"aux_output|routed|sampling_mask"),
    ("streaming sessions", r"session|resumable|streaming"),
    (
        "hybrid KV groups",
        r"mamba|sliding|hybrid|hisparse|cow_|eagle|zeroing|block_copies|"
        r"prefix_cacheable|retained_hit",
    ),
    ("LoRA", r"lora"),
    ("pooling", r"pooling|pooler"),
    ("pause and prefill cadence", r"pause|throttle|schedule_interval|prefill_interval|cadence"),
    ("diffusion", r"diffusion"),
    ("structured outputs", r"structured|grammar|bitmask"),
    (
        "speculative decoding",
        r"spec_decode|spec_token|num_spec|invalid_spec|speculative|draft|"
        r"lookahead|accepted",
    ),
    (
        "KV connectors",
        r"connector|kv_transfer|remote_kv|recving|sending|invalid_block|"
        r"load_failure|kv_xfer|kv_fetch|defer|offload|kv_load|prefix_replay|replay_window",
    ),
    ("statistics and events", r"log_stats|stats\b|_stats|event|publisher|usage|metrics"),
    ("priority", r"priority"),
    ("pipeline parallelism", r"use_pp|pipeline|batch_queue|concurrent|decode_eligible|stagger"),
    ("limits", r"min_tokens|max_model_len|long_prefill|partial_prefill|max_num_active|repetition"),
)
PART: dict[str, int] = {
    CORE: 1,
    "structured outputs": 1,
    "speculative decoding": 1,
    "KV connectors": 1,
    "statistics and events": 1,
    "priority": 1,
    "pipeline parallelism": 1,
}
ORDER: tuple[str, ...] = (CORE, *(name for name, _ in AREAS))
_COMPILED = tuple((name, re.compile(words, re.IGNORECASE)) for name, words in AREAS)


def area_of_text(text: str) -> str | None:
    for name, words in _COMPILED:
        if words.search(text):
            return name
    return None


def _named_area(node: ast.AST, source: str) -> tuple[str | None, str | None]:
    """The area a function's name or a condition names: (for the condition's own lines, for
    the body it guards). A condition that joins a feature's test with others (``not
    preempted and pause_state != PAUSED``) names the feature for its own branch only: the
    code it guards is not that feature's."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        area = area_of_text(node.name)
        return area, area
    test = getattr(node, "test", None)
    if not isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert) or test is None:
        return None, None
    own = area_of_text(ast.get_source_segment(source, test) or "")
    if own is None or not isinstance(test, ast.BoolOp):
        return own, own
    parts = {area_of_text(ast.get_source_segment(source, v) or "") for v in test.values}
    return own, own if parts == {own} else None


def line_areas(source: str) -> dict[int, str]:
    """The area of every line of ``source`` that is named by a condition or function, directly
    or through its nearest naming ancestor (lines no ancestor names are left out: core)."""
    tree = ast.parse(source)
    areas: dict[int, str] = {}

    def visit(node: ast.AST, inherited: str | None) -> None:
        own, guarded = _named_area(node, source)
        own = own or inherited
        # Innermost first: an outer statement then fills only the lines no inner one named.
        for child in ast.iter_child_nodes(node):
            visit(child, guarded or inherited)
        start = getattr(node, "lineno", None)
        end = getattr(node, "end_lineno", None)
        if own is None or start is None or end is None:
            return
        if isinstance(node, ast.If | ast.While):
            # The condition's lines are the branch origins: they take the condition's area.
            for line in range(start, (node.test.end_lineno or start) + 1):
                areas[line] = own
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for line in range(start, end + 1):
                areas.setdefault(line, guarded or inherited or own)

    visit(tree, None)
    return areas


def split(
    source: str, executed: Iterable[Sequence[int]], missing: Iterable[Sequence[int]]
) -> dict[str, dict[str, int]]:
    """Covered and total branches per area, from coverage.py's branch arcs of one file."""
    areas = line_areas(source)
    out: dict[str, dict[str, int]] = {}
    for arcs, covered in ((executed, True), (missing, False)):
        for arc in arcs:
            area = areas.get(int(arc[0]), CORE)
            entry = out.setdefault(area, {"branches": 0, "branch_total": 0})
            entry["branch_total"] += 1
            entry["branches"] += covered
    return {a: out[a] for a in ORDER if a in out}


def file_areas(path: Path, entry: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """``split`` for one file of coverage.py's JSON report (``entry``) read from ``path``."""
    return split(
        path.read_text(encoding="utf-8"),
        entry.get("executed_branches", ()),
        entry.get("missing_branches", ()),
    )
