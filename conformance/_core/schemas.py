"""The JSON Schemas of the files the package writes and reads, and one-line reasons for a file
that does not match.

``conformance/schemas/<name>.schema.json``: ``compat-report`` (the gate's report),
``matrix-cell`` (a matrix cell's ``cell.json``), ``matrix-report`` (the merged report),
``recording`` (each line of an ``omni-conformance record`` file), ``release-diff`` (one pair's
``release-diff.json``), ``release-diff-pairs`` (the matrix's list of pairs) and ``reach``. ``validate(name, data)`` raises
``jsonschema.ValidationError``; ``problem(name, data)`` returns the best error as a ``Problem``,
the field's dotted path (``upstream_tests.passed``, ``modes.async.steps[0]``) and a short
sentence, which the readers put in their own one-line errors.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError, best_match

SCHEMA_DIR = Path(__file__).parents[1] / "schemas"


@functools.cache
def load(name: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


@functools.cache
def _validator(name: str) -> Any:
    schema = load(name)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate(name: str, data: Any) -> None:
    """Raise ``jsonschema.ValidationError`` (the most telling one) when ``data`` does not match."""
    error = best_match(_validator(name).iter_errors(data))
    if error is not None:
        raise error


@dataclass(frozen=True)
class Problem:
    field: str | None  # dotted path of the field at fault; None: the document itself
    text: str

    def __str__(self) -> str:
        """``field 'modes' is missing``, ``field 'status': 'passed' is not one of ...``."""
        if self.field is None:
            return self.text
        glue = " " if self.text.startswith(("is ", "should ", "must ")) else ": "
        return f"field {self.field!r}{glue}{self.text}"


def problem(name: str, data: Any) -> Problem | None:
    """Why ``data`` does not match schema ``name``, or None when it does."""
    error = best_match(_validator(name).iter_errors(data))
    return None if error is None else describe(error)


_TYPE_WORDS = {
    "object": "an object",
    "array": "an array",
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "null": "null",
}


def _json_type(value: Any) -> str:
    for word, kinds in (
        ("null", type(None)),
        ("boolean", bool),
        ("integer", int),
        ("number", float),
        ("string", str),
        ("array", list),
        ("object", dict),
    ):
        if isinstance(value, kinds):
            return word
    return type(value).__name__


def _dotted(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(error: ValidationError) -> Problem:
    path = list(error.absolute_path)
    kind, rule, value = error.validator, error.validator_value, error.instance
    if kind == "required":
        missing = next((k for k in rule if k not in value), rule[0])
        return Problem(_dotted([*path, missing]), "is missing")
    if kind == "additionalProperties" and isinstance(value, dict):
        known = set(error.schema.get("properties", {}))
        extra = sorted(k for k in value if k not in known)
        return Problem(_dotted([*path, extra[0]]) if extra else _dotted(path), "is not allowed")
    where = _dotted(path) or None
    if kind == "type":
        words = " or ".join(
            _TYPE_WORDS.get(t, t) for t in ([rule] if isinstance(rule, str) else rule)
        )
        text = f"should be {words}, got {_json_type(value)}"
    elif kind == "enum":
        text = f"{value!r} is not one of {', '.join(map(str, rule))}"
    elif kind == "const":
        text = f"{value!r} is not {rule!r}"
    elif kind == "minLength" and rule == 1:
        text = f"must not be empty, got {value!r}"
    elif kind == "minimum":
        text = f"must be >= {rule}, got {value!r}"
    elif kind == "pattern":
        text = f"{value!r} is not {error.schema.get('title') or 'of the form ' + rule}"
    else:
        text = " ".join(error.message.split())
    return Problem(where, text)
