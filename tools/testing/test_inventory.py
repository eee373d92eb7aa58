"""What the test suite checks for durability and bad input, listed statically (ast).

    python -m tools.testing.test_inventory [--root DIR]
    python -m tools.testing.test_inventory --check BEFORE.tsv [--root DIR]

Prints one tab-separated line per check, sorted: ``kind  <file>::<test>  value``, kind being

- ``fault``: a fault point the test arms: a string literal naming one of the points that
  `rftpipe.faults.fault` is reached with in DIR/rftpipe (or a comma list of them);
- ``sigkill``: a process the test kills or stops with a signal: ``SIGKILL``, ``SIGTERM``,
  ``SIGUSR2`` (``signal.SIG*``, ``os.kill``/``killpg`` with a number, those names as
  strings, ``--signal=USR2``), ``scancel``, or ``kill`` (``.kill()``, ``kill_*=`` handed to
  a helper process, a signal not spelled out);
- ``bad_input``: a check of a one-line error exiting 2 (``returncode == 2``, ``exit_code ==
  2``, ``pytest.raises(UserError | ConfigError)``), a line per parametrize case (its id, else
  its values' source text, 80 characters), ``-`` for a test without parameters.

A test's checks are those in its body and decorators, in the fixtures it takes (its module's
or conftest.py's), in the functions of its module or tests/helpers.py it names, transitively,
and (fault points only) in the module-level constants they name. String literals passed as
keyword arguments (``_ev("stop", signal="SIGUSR2")``: synthetic event records) do not count.
``--check`` exits 1 listing every line of BEFORE.tsv that the current listing lacks: a
refactor that makes the tests faster must check nothing less.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("test_inventory")

Func = ast.FunctionDef | ast.AsyncFunctionDef
SIGNALS = ("SIGKILL", "SIGTERM", "SIGUSR2")
SIGNUMS = {9: "SIGKILL", 15: "SIGTERM", 12: "SIGUSR2"}
ERRORS = frozenset({"UserError", "ConfigError"})


@dataclass
class Module:
    path: str = ""
    funcs: dict[str, Func] = field(default_factory=dict)
    consts: dict[str, ast.expr] = field(default_factory=dict)
    tests: list[tuple[str, Func]] = field(default_factory=list)


def load(path: Path, root: Path) -> Module:
    """A test module's functions, module-level constants and tests (absent file: empty)."""
    if not path.exists():
        return Module()
    mod = Module(path.relative_to(root).as_posix())
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, Func):
            mod.funcs[node.name] = node
            if node.name.startswith("test"):
                mod.tests.append((node.name, node))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            methods = [m for m in node.body if isinstance(m, Func) and m.name.startswith("test")]
            mod.tests += [(f"{node.name}::{m.name}", m) for m in methods]
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                pairs = [(t, node.value)]
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(t.elts, node.value.elts, strict=False))  # A, B = x, y
                mod.consts |= {n.id: v for n, v in pairs if isinstance(n, ast.Name)}
    return mod


def callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def text(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def literals(nodes: Iterable[ast.AST]) -> Iterator[str]:
    """The string literals under `nodes`, less those passed straight as keyword arguments."""
    for n in nodes:
        skip = {id(k.value) for x in ast.walk(n) if isinstance(x, ast.Call) for k in x.keywords}
        yield from (s for x in ast.walk(n) if (s := text(x)) is not None and id(x) not in skip)


def defaults(fn: Func) -> Iterator[tuple[str, ast.expr]]:
    """(parameter name, default) of every parameter of `fn` that has a default."""
    a = fn.args
    positional = [p.arg for p in (*a.posonlyargs, *a.args)]
    yield from zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True)
    yield from ((p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d)


def known_points(pkg: Path) -> set[str]:
    """Fault point names: literal arguments of `fault(...)`, literal values of `fault_*`
    keyword arguments and parameter defaults, and the `*FAULT_POINTS` tuples of faults.py."""
    used: set[str] = set()
    declared: set[str] = set()
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            pairs: list[tuple[str, ast.expr]] = []
            if isinstance(node, ast.Call):
                pairs = [(k.arg, k.value) for k in node.keywords if k.arg]
                if callee(node) == "fault" and node.args:
                    arg = node.args[0]
                    pairs.append(("fault_", arg))
                    if text(arg) is None and not getattr(arg, "id", "").startswith("fault_"):
                        log.warning(
                            "%s:%d: fault(%s) unresolved", path, node.lineno, ast.unparse(arg)
                        )
            elif isinstance(node, Func):
                pairs = list(defaults(node))
            elif path.name == "faults.py" and isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(getattr(t, "id", "").endswith("FAULT_POINTS") for t in targets):
                    declared |= set(literals([node]))
            used |= {s for name, value in pairs if name.startswith("fault_") and (s := text(value))}
    if declared and used != declared:
        log.warning("fault points reached, not in faults.py: %s", sorted(used - declared))
        log.warning("fault points in faults.py, never reached: %s", sorted(declared - used))
    return used | declared


def is_fixture(fn: Func) -> bool:
    decorators = [d.func if isinstance(d, ast.Call) else d for d in fn.decorator_list]
    return any(getattr(d, "attr", getattr(d, "id", None)) == "fixture" for d in decorators)


def reach(
    test: Func, mod: Module, helpers: Module, conftest: Module
) -> tuple[list[Func], list[ast.expr]]:
    """The functions (the test, its fixtures, the module's and helpers.py's functions it
    names) and the module-level constants a test reaches, transitively."""
    funcs: list[Func] = []
    consts: list[ast.expr] = []
    seen: set[int] = set()
    todo: list[tuple[ast.AST, Module]] = [(test, mod)]
    while todo:
        node, m = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, Func):
            funcs.append(node)
            if node is test or is_fixture(node):  # fixtures: arguments named after them
                for arg in (*node.args.args, *node.args.kwonlyargs):
                    owner = next((o for o in (m, conftest) if arg.arg in o.funcs), None)
                    if owner and is_fixture(owner.funcs[arg.arg]):
                        todo.append((owner.funcs[arg.arg], owner))
        elif isinstance(node, ast.expr):
            consts.append(node)
        for x in ast.walk(node):
            if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load):
                for owner in (m, helpers):
                    if x.id in owner.funcs or x.id in owner.consts:
                        todo.append((owner.funcs.get(x.id) or owner.consts[x.id], owner))
                        break
    return funcs, consts


def faults_armed(nodes: list[ast.AST], points: set[str], test: str) -> set[str]:
    armed = {p for s in literals(nodes) if set(s.split(",")) <= points for p in s.split(",")}
    for x in (x for n in nodes for x in ast.walk(n)):
        values: list[ast.expr] = []
        if isinstance(x, ast.Dict):  # env={"RFTPIPE_FAULT": ...}
            values = [
                v for k, v in zip(x.keys, x.values, strict=True) if text(k) == "RFTPIPE_FAULT"
            ]
        elif isinstance(x, ast.Call) and x.args and text(x.args[0]) == "RFTPIPE_FAULT":
            values = x.args[1:2]  # monkeypatch.setenv("RFTPIPE_FAULT", ...)
        for v in values:
            s = text(v)
            if (s is None and not armed) or (s is not None and not set(s.split(",")) <= points):
                log.warning("%s: RFTPIPE_FAULT=%s is no known fault point", test, ast.unparse(v))
    return armed


def kills(funcs: list[Func]) -> set[str]:
    out = {s for s in literals(funcs) if s in SIGNALS or s == "scancel"}
    out |= {f"SIG{s[9:]}" for s in literals(funcs) if s.startswith("--signal=")} & set(SIGNALS)
    for x in (x for fn in funcs for x in ast.walk(fn)):
        if isinstance(x, ast.Attribute) and getattr(x.value, "id", "") == "signal":
            out |= {x.attr} & set(SIGNALS)
        elif isinstance(x, ast.Attribute | ast.keyword) and str(
            getattr(x, "attr", None) or getattr(x, "arg", None)
        ).startswith("kill_"):
            out.add("kill")  # kill_at=, .kill_pgid=: a helper process told what to kill
        elif isinstance(x, ast.Call) and (name := callee(x)) in ("kill", "killpg", "send_signal"):
            at = 0 if name == "send_signal" else 1
            # `pool.kill(episode)`: a method of ours with no signal argument.
            sig = x.args[at] if len(x.args) > at else None
            number = sig.value if isinstance(sig, ast.Constant) and type(sig.value) is int else -1
            if number != 0:  # os.kill(pid, 0) probes a process and sends nothing
                attr = getattr(sig, "attr", "")
                out.add(attr if attr in SIGNALS else SIGNUMS.get(number, "kill"))
        elif isinstance(x, ast.Call) and callee(x) == "terminate" and not x.args:
            out.add("SIGTERM")
    return out


def checks_bad_input(funcs: list[Func]) -> bool:
    for fn in funcs:
        errors = ERRORS | {k for k, d in defaults(fn) if getattr(d, "id", None) in ERRORS}
        for x in ast.walk(fn):
            if isinstance(x, ast.Compare) and all(isinstance(op, ast.Eq) for op in x.ops):
                sides = [x.left, *x.comparators]
                code = any(getattr(s, "attr", "") in ("returncode", "exit_code") for s in sides)
                if code and any(isinstance(s, ast.Constant) and s.value == 2 for s in sides):
                    return True
            elif isinstance(x, ast.Call) and callee(x) == "raises" and x.args:
                kinds = x.args[0].elts if isinstance(x.args[0], ast.Tuple) else [x.args[0]]
                if any(getattr(k, "id", None) in errors for k in kinds):
                    return True
    return False


def elements(node: ast.expr | None, consts: dict[str, ast.expr], depth: int = 0) -> list | None:
    """The items of a parametrize argvalues (or ids) expression, where statically known:
    a literal, a module constant, its ``sorted``/``list``/``tuple``/``.keys()``."""
    if depth > 5 or node is None:
        return None
    if isinstance(node, ast.List | ast.Tuple | ast.Set | ast.Dict):
        return [k for k in node.keys if k] if isinstance(node, ast.Dict) else list(node.elts)
    if isinstance(node, ast.Name):
        return elements(consts.get(node.id), consts, depth + 1)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
        return elements(node.func.value, consts, depth + 1) if callee(node) == "keys" else None
    if isinstance(node, ast.Call) and callee(node) in ("sorted", "list", "tuple") and node.args:
        items = elements(node.args[0], consts, depth + 1)
        if items is not None and callee(node) == "sorted":
            try:
                items.sort(key=ast.literal_eval)
            except (ValueError, TypeError):
                items.sort(key=ast.unparse)
        return items
    return None


def cases(fn: Func, consts: dict[str, ast.expr], test: str) -> list[str]:
    """One label per parametrize case (stacked decorators: their product, as pytest's ids)."""
    axes: list[list[str]] = []
    for dec in reversed(fn.decorator_list):  # pytest's ids start with the innermost decorator
        if not (isinstance(dec, ast.Call) and callee(dec) == "parametrize"):
            continue
        kw = {k.arg: k.value for k in dec.keywords if k.arg}
        values = dec.args[1] if len(dec.args) > 1 else kw.get("argvalues")
        items = elements(values, consts)
        if items is None:
            log.warning("%s: parametrize values unresolved, one case listed", test)
            items = [values or ast.Constant("?")]
        ids = elements(kw.get("ids"), consts) or []
        axis = []
        for i, item in enumerate(items):
            label = text(ids[i]) if i < len(ids) else None
            if isinstance(item, ast.Call) and callee(item) == "param":
                label = label or next((text(k.value) for k in item.keywords if k.arg == "id"), None)
                item = item.args[0] if len(item.args) == 1 else ast.Tuple(elts=item.args)
            label = ast.unparse(item) if label is None else label
            axis.append(label.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")[:80])
        axes.append(axis)
    return ["-".join(c) for c in itertools.product(*axes)] if axes else ["-"]


def inventory(root: Path) -> list[str]:
    points = known_points(root / "rftpipe")
    helpers, conftest = (load(root / "tests" / f, root) for f in ("helpers.py", "conftest.py"))
    lines: set[str] = set()
    for path in sorted((root / "tests").glob("test_*.py")):
        mod = load(path, root)
        for name, fn in mod.tests:
            test = f"{mod.path}::{name}"
            funcs, consts = reach(fn, mod, helpers, conftest)
            lines |= {f"fault\t{test}\t{p}" for p in faults_armed([*funcs, *consts], points, test)}
            lines |= {f"sigkill\t{test}\t{how}" for how in kills(funcs)}
            if checks_bad_input(funcs):
                known = helpers.consts | mod.consts
                lines |= {f"bad_input\t{test}\t{case}" for case in cases(fn, known, test)}
    return sorted(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--check", type=Path, metavar="BEFORE.tsv", help="exit 1 if a line is lost")
    args = parser.parse_args(argv)
    logging.basicConfig(format="test_inventory: %(levelname)s: %(message)s", stream=sys.stderr)
    lines = inventory(args.root.resolve())
    if args.check is None:
        for line in lines:
            print(line)
        return 0
    before = [x for x in args.check.read_text().splitlines() if x.strip() and x[0] != "#"]
    missing = sorted(set(before) - set(lines))
    for line in missing:
        print(line)
    if missing:
        log.error("%d of the %d lines of %s are missing", len(missing), len(before), args.check)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
