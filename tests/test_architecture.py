"""The package layout is the architecture: no import cycle among rftpipe's modules (imports
inside functions included), no import from a higher layer, and the layer table in
docs/architecture.md is this one.

Third-party imports, deferred or not, are not constrained here (the launch path's
torch-freedom is `tests/test_launch.py`'s business).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import ROOT

LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: foundation, importable from anywhere
    (
        "rftpipe.errors",
        "rftpipe.seeding",
        "rftpipe.faults",
        "rftpipe.dist",
        "rftpipe.observe.events",
        "rftpipe.workers",
    ),
    ("rftpipe.algos",),
    ("rftpipe.config",),
    ("rftpipe.storage",),
    ("rftpipe.data", "rftpipe.checkpoint", "rftpipe.envs", "rftpipe.agents"),
    ("rftpipe.engines",),
    ("rftpipe.rewards", "rftpipe.observe"),
    ("rftpipe.stages",),
    ("rftpipe.run",),
    ("rftpipe.inspect",),
    ("jobs",),
)
"""Lowest first. A module may import modules of its own layer or lower ones; the longest
matching prefix places a module (so `rftpipe.observe.events` sits in the foundation while
the rest of `rftpipe.observe` sits above the engines whose throughput it measures)."""

TOP_LEVEL_MODULES = {"errors", "seeding", "faults", "dist"}
"""The only plain modules at rftpipe's top level; everything else is a subpackage."""


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def modules() -> dict[str, Path]:
    files = [*(ROOT / "rftpipe").rglob("*.py"), *(ROOT / "jobs").glob("*.py")]
    return {module_name(p): p for p in files}


def imports(path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project modules `path` imports, anywhere in its body."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            names = [f"{node.module}.{a.name}" for a in node.names]
            names = [n if n in known else node.module for n in names]
        else:
            continue
        yield from (n for n in names if n in known)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: set(imports(p, known)) - {m} for m, p in known.items()}


def layer(module: str) -> int:
    if module == "rftpipe":
        return 0  # the package's empty __init__ (imported for its __file__)
    best, where = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, where = len(p), i
    assert where >= 0, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return where


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_upward_import() -> None:
    upward = [
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, deps in sorted(graph().items())
        for d in sorted(deps)
        if layer(d) > layer(m)
    ]
    assert upward == []


def test_top_level_holds_subpackages_and_a_few_small_modules() -> None:
    pkg = ROOT / "rftpipe"
    plain = {p.stem for p in pkg.glob("*.py")} - {"__init__"}
    assert plain <= TOP_LEVEL_MODULES, plain - TOP_LEVEL_MODULES
    for name in TOP_LEVEL_MODULES:
        assert len((pkg / f"{name}.py").read_text().splitlines()) < 200, name


def layer_table() -> str:
    rows = [
        f"| {i} | {', '.join(f'`{p}`' for p in prefixes)} |" for i, prefixes in enumerate(LAYERS)
    ]
    return "\n".join(["| layer | modules |", "|---|---|", *rows])


def test_docs_show_these_layers() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert layer_table() in doc, (
        "docs/architecture.md's layer table differs from tests/test_architecture.py LAYERS:\n"
        + layer_table()
    )


def private_uses(path: Path) -> list[str]:
    """Private names of rftpipe that the file at `path` reaches into: `from rftpipe.x import
    _y`, or `_y` read off a module imported from rftpipe."""
    tree = ast.parse(path.read_text())
    out: list[str] = []
    modules_bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rftpipe"):
            for a in node.names:
                if a.name.startswith("_"):
                    out.append(f"{node.module}.{a.name}")
                elif f"{node.module}.{a.name}" in modules():
                    modules_bound.add(a.asname or a.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules_bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.append(f"{node.value.id}.{node.attr}")
    return out


def test_tools_use_only_public_api() -> None:
    found = {p.name: private_uses(p) for p in sorted((ROOT / "tools").glob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_private_use_finder_finds_them(tmp_path: Path) -> None:
    f = tmp_path / "t.py"
    f.write_text(
        "from rftpipe.run.runtime import _x\nfrom rftpipe.engines.train import base\nbase._y(1)\n"
    )
    assert private_uses(f) == ["rftpipe.run.runtime._x", "base._y"]
