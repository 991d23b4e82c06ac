"""Infection probes: where a survivor's mutated code would compute something other than the
unmutated code, found without running the mutant.

A mutant's run draws the examples of the unmutated run (the seed is pinned) and executes the same
code with the same state until its mutated code first yields another value (its *infection*); a
test in which that never happens cannot kill it. This module owns the instrumentation: it copies
the unmutated function of mutmut's ``mutants/`` tree (``x…__mutmut_orig``) and puts one probe
per mutant in it (``plan_probe`` picks the kind: ``truth``, ``value``, ``call`` or
``statement``), optionally with the triage ledger's guard. A probe returns what the unmutated code
computes, so the run stays the unmutated run, and records where the mutant's code would differ.
One suite run then tells, per mutant, the tests it is infected in (``mutation.infection_run``).
The probes' runtime is ``mutation/infection_plugin.py``; the method: ``docs/mutation-score.md``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

PLUGIN_MODULE = "infection_plugin"  # imported by instrumented modules under this name
_ALIAS = "_omni_infection"  # one leading underscore: not mangled inside class bodies
PURE_CALLS = frozenset({"isinstance", "callable", "len", "type", "bool", "hasattr"})
_PURE_NODES = (
    ast.Name,
    ast.Constant,
    ast.Attribute,
    ast.Compare,
    ast.BoolOp,
    ast.UnaryOp,
    ast.BinOp,
    ast.IfExp,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.Slice,
    ast.Call,  # only PURE_CALLS, checked in ``pure``
    ast.expr_context,
    ast.operator,
    ast.unaryop,
    ast.cmpop,
    ast.boolop,
)
# The bodies are compared, never the definitions' own names (``…__mutmut_orig`` / ``…_N``).
_IGNORED_FIELDS = frozenset({"ctx", "type_comment"})

Path = tuple[tuple[str, int | None], ...]  # (field, index in a list field or None) from the def


@dataclasses.dataclass(frozen=True)
class Probe:
    """How one mutant's infection is observed: its kind (``plan_probe``) and the path, from
    the function definition, of the node the probe wraps (or the statement it precedes)."""

    mutant: str  # mutmut's mangled name, ``x…__mutmut_N``
    kind: str  # "truth", "value", "call" or "statement"
    path: Path


def functions(tree: ast.AST) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {
        node.name: node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def pure(node: ast.AST) -> bool:
    """Whether evaluating ``node`` (an expression) cannot change state, judged from its syntax:
    names, constants, attribute reads, operators, displays and the calls of ``PURE_CALLS``.
    Attribute reads are taken not to change state, as the runtime's properties do not; item
    reads are left out, since a ``defaultdict`` adds the key it is asked for."""
    for n in ast.walk(node):
        if not isinstance(n, _PURE_NODES):
            return False
        if isinstance(n, ast.Call) and not (
            isinstance(n.func, ast.Name) and n.func.id in PURE_CALLS and not n.keywords
        ):
            return False
    return True


def _differences(a: ast.AST, b: ast.AST, path: Path, out: list[Path]) -> None:
    """The paths of the smallest nodes at which ``a`` and ``b`` differ."""
    if type(a) is not type(b):
        out.append(path)
        return
    for field in a._fields:
        if field in _IGNORED_FIELDS:
            continue
        va, vb = getattr(a, field, None), getattr(b, field, None)
        if isinstance(va, list) and isinstance(vb, list):
            if len(va) != len(vb):
                out.append(path)
                continue
            for i, (x, y) in enumerate(zip(va, vb, strict=True)):
                if isinstance(x, ast.AST) and isinstance(y, ast.AST):
                    _differences(x, y, (*path, (field, i)), out)
                elif type(x) is not type(y) or x != y:
                    out.append(path)
        elif isinstance(va, ast.AST) and isinstance(vb, ast.AST):
            _differences(va, vb, (*path, (field, None)), out)
        elif type(va) is not type(vb) or va != vb:  # ``1 == True``, yet another constant
            out.append(path)


def node_at(root: ast.AST, path: Path) -> ast.AST:
    node = root
    for field, index in path:
        value = getattr(node, field)
        node = value[index] if index is not None else value
    return node


def _common(paths: Sequence[Path]) -> Path:
    first = paths[0]
    n = 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in paths):
        n += 1
    return first[:n]


def _ancestors(path: Path) -> Iterator[Path]:
    """``path`` and each of its ancestors' paths, innermost first."""
    for n in range(len(path), -1, -1):
        yield path[:n]


def _test_of(fn: ast.AST, path: Path) -> Path | None:
    """The path of the condition ``path`` lies in (of an ``if``, ``while``, ``assert``,
    conditional expression or comprehension filter), when every node from it down to ``path``
    is an expression; else None."""
    for p in _ancestors(path):
        if not p or not isinstance(node_at(fn, p), ast.expr):
            return None
        parent, (field, _) = node_at(fn, p[:-1]), p[-1]
        if (
            field == "test" and isinstance(parent, ast.If | ast.While | ast.Assert | ast.IfExp)
        ) or (field == "ifs" and isinstance(parent, ast.comprehension)):
            return p
    return None


def _wrappable(fn: ast.AST, path: Path) -> bool:
    """Whether the expression at ``path`` may be replaced by a call returning its value."""
    node = node_at(fn, path)
    if not isinstance(node, ast.expr) or isinstance(
        node, ast.Starred | ast.Slice | ast.FormattedValue
    ):
        return False
    if not isinstance(getattr(node, "ctx", ast.Load()), ast.Load):
        return False
    parent = node_at(fn, path[:-1])
    return not isinstance(parent, ast.JoinedStr)


def plan_probe(
    orig: ast.FunctionDef | ast.AsyncFunctionDef,
    mutant: ast.FunctionDef | ast.AsyncFunctionDef,
    name: str,
) -> Probe | None:
    """The finest probe that observes mutant ``name`` (``mutant``, mutmut's copy of ``orig``
    with one mutation); None when the mutation is outside the body (a default in the signature
    is met wherever the function runs: its survivor runs every reaching test). Finest first:

    * ``truth``: the mutation is inside the condition of an ``if``, ``while``, ``assert``, a
      conditional expression or a comprehension's filter, and the mutant's whole condition is
      ``pure``. Infected when the two conditions' truth differs (or the mutant's raises).
    * ``value``: the mutation replaces an expression by a ``pure`` one (``None``, a constant, a
      flipped comparison). Infected when the values differ: not the same object, and not equal
      plain values (bool, int, float, str, bytes, None, and tuples, lists and dicts of them).
    * ``call``: the mutation changes a call's arguments (one dropped, one replaced). They are
      evaluated once, as unmutated; infected when the mutant's bind differently to the callee's
      signature (a dropped argument whose default is the value passed binds the same).
    * ``statement``: anything else in the body (``continue`` became ``break``, say). Infected
      whenever the statement executes: the reach's own criterion, per test."""
    if ast.dump(orig.args) != ast.dump(mutant.args) or len(orig.body) != len(mutant.body):
        return None
    found: list[Path] = []
    for i, (a, b) in enumerate(zip(orig.body, mutant.body, strict=True)):
        _differences(a, b, (("body", i),), found)
    if not found:
        return None
    path = _common(found)
    # Up to the nearest expression or statement (an operator or a keyword is neither).
    while path and not isinstance(node_at(orig, path), ast.expr | ast.stmt):
        path = path[:-1]
    if not path:
        return None
    if isinstance(node_at(orig, path), ast.expr):
        test = _test_of(orig, path)
        if test is not None and pure(node_at(mutant, test)):
            return Probe(name, "truth", test)
        if _wrappable(orig, path) and pure(node_at(mutant, path)):
            return Probe(name, "value", path)
        call = _call_probe_path(orig, mutant, path)
        if call is not None:
            return Probe(name, "call", call)
    # The statement holding the change (a statement in a list: a body, never a condition).
    while path and not (isinstance(node_at(orig, path), ast.stmt) and path[-1][1] is not None):
        path = path[:-1]
    return Probe(name, "statement", path) if path else None


def _call_probe_path(orig: ast.AST, mutant: ast.AST, path: Path) -> Path | None:
    """The path of the call whose arguments the mutation changes (the callee itself unchanged),
    when each of the mutant's arguments is one of the unmutated call's or pure; else None."""
    for p in _ancestors(path):
        if not p:
            return None
        a, b = node_at(orig, p), node_at(mutant, p)
        if not isinstance(a, ast.Call):
            continue
        if not isinstance(b, ast.Call) or ast.dump(a.func) != ast.dump(b.func):
            return None
        if not _wrappable(orig, p):
            return None
        if any(isinstance(x, ast.Starred) for x in [*a.args, *b.args]):
            return None
        if any(k.arg is None for k in [*a.keywords, *b.keywords]):
            return None  # ``**kwargs``
        given = {ast.dump(x) for x in a.args} | {ast.dump(k.value) for k in a.keywords}
        if all(ast.dump(x) in given or pure(x) for x in [*b.args, *(k.value for k in b.keywords)]):
            return p
        return None
    return None


def _probe_call(helper: str, *args: ast.expr) -> ast.Call:
    return ast.Call(
        func=ast.Attribute(value=ast.Name(_ALIAS, ast.Load()), attr=helper, ctx=ast.Load()),
        args=list(args),
        keywords=[],
    )


def _lambda(body: ast.expr, params: Sequence[str] = ()) -> ast.Lambda:
    return ast.Lambda(
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(p) for p in params],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=body,
    )


def _locate(root: ast.AST, node: ast.AST) -> tuple[ast.AST, str, int | None]:
    """Where ``node`` (by identity) is in the tree under ``root``: its parent, the parent's
    field, and its index when that field is a list."""
    for parent in ast.walk(root):
        for field, value in ast.iter_fields(parent):
            if value is node:
                return parent, field, None
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is node:
                        return parent, field, i
    raise ValueError("node not found")


def _replace(root: ast.AST, old: ast.AST, new: ast.AST) -> None:
    """Put ``new`` where ``old`` is in the tree under ``root``."""
    parent, field, index = _locate(root, old)
    if index is None:
        setattr(parent, field, new)
    else:
        getattr(parent, field)[index] = new


def _insert_before(root: ast.AST, old: ast.AST, new: ast.stmt) -> None:
    """Put the statement ``new`` just before ``old`` in its body under ``root``."""
    parent, field, index = _locate(root, old)
    assert index is not None  # a statement probe's target is a statement in a body
    getattr(parent, field).insert(index, new)


def _call_spec(orig_call: ast.Call, mut_call: ast.Call) -> ast.Lambda:
    """``lambda a, k: (mutant args, mutant kwargs)``: each of the mutant's arguments taken from
    the unmutated call's evaluated ones (``a``, ``k``) where it is one of them, else its own
    (pure) expression."""
    positional = {ast.dump(x): i for i, x in enumerate(orig_call.args)}
    keyword = {ast.dump(k.value): k.arg for k in orig_call.keywords}

    def taken(x: ast.expr) -> ast.expr:
        d = ast.dump(x)
        if d in positional:
            return ast.Subscript(ast.Name("a", ast.Load()), ast.Constant(positional[d]), ast.Load())
        if d in keyword:
            return ast.Subscript(ast.Name("k", ast.Load()), ast.Constant(keyword[d]), ast.Load())
        return copy.deepcopy(x)

    args = ast.Tuple([taken(x) for x in mut_call.args], ast.Load())
    kwargs = ast.Dict(
        [ast.Constant(k.arg) for k in mut_call.keywords],
        [taken(k.value) for k in mut_call.keywords],
    )
    return _lambda(ast.Tuple([args, kwargs], ast.Load()), ("a", "k"))


def instrument(
    orig: ast.FunctionDef | ast.AsyncFunctionDef,
    probes: Sequence[tuple[Probe, ast.FunctionDef | ast.AsyncFunctionDef]],
    guards: Mapping[str, str] | None = None,
) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """A copy of ``orig`` with every probe in place (each with its mutant's definition, and
    the mutant's guard from ``guards`` when it has one: an expression, in the function's scope
    at the probe, false where the difference cannot matter). A guard comes from the triage
    ledger's ``[[guard]]`` entry for a survivor, with its reason: the infection run checks the
    argument's premise under the re-check's profile instead of taking it on trust."""
    guards = guards or {}

    def guard(probe: Probe) -> list[ast.expr]:
        text = guards.get(probe.mutant)
        return [_lambda(ast.parse(text, mode="eval").body)] if text else []

    fn = copy.deepcopy(orig)
    # Each probe's target is found by path in the pristine copy, then replaced by identity: a
    # wrapper keeps the node it wraps, so probes on the same or nested nodes compose.
    targets = [(probe, node_at(fn, probe.path), mutant) for probe, mutant in probes]
    statements: list[tuple[Probe, ast.AST]] = []
    for probe, node, mutant in targets:
        name = ast.Constant(probe.mutant)
        if probe.kind == "statement":
            statements.append((probe, node))
            continue
        other = copy.deepcopy(node_at(mutant, probe.path))
        if probe.kind in ("truth", "value"):
            assert isinstance(node, ast.expr) and isinstance(other, ast.expr)
            wrapper = _probe_call(probe.kind, name, node, _lambda(other), *guard(probe))
        else:
            assert isinstance(node, ast.Call) and isinstance(other, ast.Call)
            wrapper = _probe_call(
                "call",
                name,
                node.func,
                ast.Tuple(list(node.args), ast.Load()),
                ast.Dict(
                    [ast.Constant(k.arg) for k in node.keywords], [k.value for k in node.keywords]
                ),
                _call_spec(node, other),
                *guard(probe),
            )
        _replace(fn, node, wrapper)
    for probe, node in statements:
        _insert_before(
            fn, node, ast.Expr(_probe_call("hit", ast.Constant(probe.mutant), *guard(probe)))
        )
    ast.fix_missing_locations(fn)
    return fn


def instrument_source(
    source: str, mutants: Sequence[str], guards: Mapping[str, str] | None = None
) -> tuple[str, dict[str, Probe | None]]:
    """``source`` (a file of mutmut's ``mutants/`` tree) with the unmutated functions of
    ``mutants`` (mangled names) instrumented, and each mutant's probe (None: none possible,
    or the mutant is not in this file). ``guards``: by mangled name, the guard of a mutant
    (``instrument``)."""
    tree = ast.parse(source)
    fns = functions(tree)
    plans: dict[str, Probe | None] = {}
    by_function: dict[str, list[tuple[Probe, ast.FunctionDef | ast.AsyncFunctionDef]]] = {}
    for name in mutants:
        base = name.rsplit("__mutmut_", 1)[0]
        orig, mutant = fns.get(f"{base}__mutmut_orig"), fns.get(name)
        probe = plan_probe(orig, mutant, name) if orig and mutant else None
        plans[name] = probe
        if probe is not None and mutant is not None:
            by_function.setdefault(f"{base}__mutmut_orig", []).append((probe, mutant))
    if not by_function:
        return source, plans
    lines = source.splitlines(keepends=True)
    # From the bottom up, so the line numbers of the functions still to splice hold.
    for orig_name in sorted(by_function, key=lambda n: -fns[n].lineno):
        orig = fns[orig_name]
        start = min([orig.lineno, *(d.lineno for d in orig.decorator_list)]) - 1
        indent = " " * orig.col_offset
        text = ast.unparse(instrument(orig, by_function[orig_name], guards))
        lines[start : orig.end_lineno] = [
            indent + line + "\n" if line else "\n" for line in text.splitlines()
        ]
    # The probes' module, imported after the docstring and ``from __future__`` imports.
    first = next(
        (
            s
            for i, s in enumerate(tree.body)
            if not (
                (isinstance(s, ast.ImportFrom) and s.module == "__future__")
                or (i == 0 and isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
            )
        ),
        None,
    )
    at = (first.lineno - 1) if first is not None else len(lines)
    lines.insert(at, f"import {PLUGIN_MODULE} as {_ALIAS}\n")
    return "".join(lines), plans
