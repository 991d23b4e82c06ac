"""What every report of the package renders with: its templates, one Markdown escaper, one JUnit
XML writer.

* ``environment()``: the jinja2 environment over ``conformance/templates`` (autoescape on for
  ``*.html.j2``; Markdown templates escape through the ``md`` and ``md_code`` filters).
* ``md(text)`` / ``md_code(text)``: a value as one line of Markdown text, or as one code span,
  that shows exactly the value inside a GitHub table cell or a list item.
* ``Suite`` / ``Case`` / ``junit_xml``: JUnit XML through ``ElementTree``; a suite's and the
  document's counts are computed from its cases, so they cannot disagree.

The compat report (``conformance._core.report``), the matrix report and the release diff
(``conformance.release``) all use these; ``docs/compat-matrix.md`` describes the reports.
"""

from __future__ import annotations

import functools
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

TEMPLATES = Path(__file__).parents[1] / "templates"

_SPACE = re.compile(r"\s+")
_TICKS = re.compile(r"`+")


def _line(value: Any) -> str:
    # One line, and no cell break: GitHub splits a table row at every unescaped "|", inside
    # code spans too.
    return _SPACE.sub(" ", str(value)).strip().replace("|", "\\|")


def md(value: Any) -> str:
    """``value`` as Markdown text on one line that shows as written: a pipe does not end a table
    cell, ``<cp311>`` is not taken for an HTML tag, a backtick does not open code, and an entity
    or a backslash in the value stays literal. Emphasis marks are left as they are: the reports
    are also read raw (``omni-conformance report`` prints one), and names like ``not_applicable``
    stay readable."""
    text = _SPACE.sub(" ", str(value)).strip()
    for char, escaped in (("\\", "\\\\"), ("`", "\\`"), ("&", "&amp;"), ("<", "&lt;")):
        text = text.replace(char, escaped)
    return text.replace("|", "\\|")


def md_code(value: Any) -> str:
    """``value`` as one code span. Code spans take no entities or backslash escapes, so the text
    stays as it is; a backtick in it is kept by fencing with a longer run of backticks than any
    in the text (CommonMark), not replaced by a lookalike."""
    text = _line(value)
    if not text:
        return "` `"
    longest = max((len(run) for run in _TICKS.findall(text)), default=0)
    fence = "`" * (longest + 1)
    # A space on each side is stripped by the renderer; it keeps an edge backtick off the fence.
    pad = " " if text[0] == "`" or text[-1] == "`" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=jinja2.select_autoescape(["html", "html.j2"]),
        undefined=jinja2.StrictUndefined,  # a misspelt name fails the render, not the reader
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["md"] = md
    env.filters["md_code"] = md_code
    return env


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)


# ---- JUnit XML ------------------------------------------------------------------------------

RESULTS = ("passed", "failure", "error", "skipped")
# Characters XML 1.0 cannot hold (an ANSI colour code in a captured message, say): a report
# holding one is not well-formed and CI readers drop it whole.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(value: Any) -> str:
    return _NOT_XML.sub("\ufffd", str(value))


@dataclass
class Case:
    classname: str
    name: str
    result: str = "passed"  # one of RESULTS
    message: str | None = None
    detail: str | None = None  # the failure's or error's text
    kind: str | None = None  # its ``type`` attribute
    time: float | None = None
    properties: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.result not in RESULTS:
            raise ValueError(f"JUnit case result {self.result!r} is not one of {RESULTS}")


@dataclass
class Suite:
    name: str
    cases: list[Case] = field(default_factory=list)
    properties: Mapping[str, Any] = field(default_factory=dict)
    time: float | None = None

    def counts(self) -> dict[str, int]:
        def n(result: str) -> int:
            return sum(c.result == result for c in self.cases)

        return {
            "tests": len(self.cases),
            "failures": n("failure"),
            "errors": n("error"),
            "skipped": n("skipped"),
        }


def _set(element: ET.Element, **attributes: Any) -> None:
    for key, value in attributes.items():
        if value is not None:
            element.set(key, _xml_text(value))


def _properties(parent: ET.Element, properties: Mapping[str, Any]) -> None:
    if properties:
        props = ET.SubElement(parent, "properties")
        for key, value in properties.items():
            _set(ET.SubElement(props, "property"), name=key, value=value)


def _seconds(value: float | None) -> str | None:
    return None if value is None else f"{float(value):.3f}"


def junit_xml(suites: Iterable[Suite], name: str | None = None) -> str:
    """The suites as one JUnit XML document; every count is the sum over the cases."""
    suites = list(suites)
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    root = ET.Element("testsuites")
    _set(root, name=name)
    for suite in suites:
        counts = suite.counts()
        for key, value in counts.items():
            totals[key] += value
        element = ET.SubElement(root, "testsuite")
        _set(element, name=suite.name, **counts, time=_seconds(suite.time))
        _properties(element, suite.properties)
        for case in suite.cases:
            c = ET.SubElement(element, "testcase")
            _set(c, classname=case.classname, name=case.name, time=_seconds(case.time))
            _properties(c, case.properties)
            if case.result != "passed":
                outcome = ET.SubElement(c, case.result)
                _set(outcome, type=case.kind, message=case.message)
                if case.detail and case.result != "skipped":
                    outcome.text = _xml_text(case.detail)
    _set(root, **totals)
    ET.indent(root, space="  ")
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, "unicode") + "\n"
