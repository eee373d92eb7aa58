"""The package layout is the architecture: no import cycle among rftpipe's modules (imports
inside functions included), no import from a higher layer, and the layer table in
docs/architecture.md is this one.

Third-party imports, deferred or not, are not constrained here (the launch path's
torch-freedom is `tests/test_launch.py`'s business).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import ROOT

LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: foundation, importable from anywhere
    (
        "rftpipe.errors",
        "rftpipe.seeding",
        "rftpipe.events",
        "rftpipe.faults",
        "rftpipe.space",
        "rftpipe.atomic",
        "rftpipe.dist",
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
"""Lowest first, one entry per folder (a subpackage of rftpipe, or jobs) or top-level module:
a module's layer is its folder's, as a newcomer reads the tree. A module may import modules
of its own layer or lower ones."""

TOP_LEVEL_MODULES = {"errors", "seeding", "events", "faults", "space", "atomic", "dist"}
"""The only plain modules at rftpipe's top level; everything else is a subpackage."""

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 80
"""What a newcomer reads at once: no file in rftpipe/, jobs/ or tools/ is longer, and no
function (decorators excluded, docstring included)."""


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


def folder(module: str) -> str:
    """The folder (or top-level module) that holds `module`: `rftpipe.X` or `jobs`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "rftpipe" else parts[0]


def layer(module: str) -> int:
    if module == "rftpipe":
        return 0  # the package's empty __init__ (imported for its __file__)
    where = [i for i, folders in enumerate(LAYERS) if folder(module) in folders]
    assert where, f"{folder(module)} is in no layer: add it to LAYERS and docs/architecture.md"
    return where[0]


def test_layers_are_folders() -> None:
    """Each entry of LAYERS is a folder or a top-level module, once: none places a module by a
    longer prefix than its folder, and each is on disk."""
    entries = [f for folders in LAYERS for f in folders]
    assert len(entries) == len(set(entries))
    assert all(folder(f) == f for f in entries), [f for f in entries if folder(f) != f]
    on_disk = {folder(m) for m in modules()} - {"rftpipe"}
    assert on_disk == set(entries), on_disk ^ set(entries)


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


def doc_path(entry: str) -> str:
    """How docs/architecture.md spells a LAYERS entry: `rftpipe/algos/`, `rftpipe/dist.py`."""
    path = entry.replace(".", "/")
    return f"{path}.py" if (ROOT / f"{path}.py").exists() else f"{path}/"


def test_docs_show_these_layers() -> None:
    """The page's layer table lists every folder, in LAYERS' order, with its layer."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `([^`]+)` \| [^|]+ \|$", doc, flags=re.M)
    expected = [(str(i), doc_path(f)) for i, folders in enumerate(LAYERS) for f in folders]
    assert rows == expected, (
        "docs/architecture.md's layer table differs from tests/test_architecture.py LAYERS;"
        " its rows should be:\n" + "\n".join(f"| {i} | `{f}` | ... |" for i, f in expected)
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
    found = {
        p.relative_to(ROOT).as_posix(): private_uses(p)
        for p in sorted((ROOT / "tools").rglob("*.py"))
    }
    assert {k: v for k, v in found.items() if v} == {}


def test_private_use_finder_finds_them(tmp_path: Path) -> None:
    f = tmp_path / "t.py"
    f.write_text(
        "from rftpipe.run.runtime import _x\nfrom rftpipe.engines.train import base\nbase._y(1)\n"
    )
    assert private_uses(f) == ["rftpipe.run.runtime._x", "base._y"]


def python_files() -> list[Path]:
    return sorted(p for d in ("rftpipe", "jobs", "tools") for p in (ROOT / d).rglob("*.py"))


def too_long(path: Path) -> list[str]:
    """The file at `path` if over MAX_FILE_LINES, and its functions over MAX_FUNCTION_LINES."""
    src = path.read_text()
    out = (
        [f"{path.name}: {len(src.splitlines())} lines"]
        if len(src.splitlines()) > MAX_FILE_LINES
        else []
    )
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path.name}::{node.name} (line {node.lineno}): {n} lines")
    return out


def test_no_file_or_function_a_newcomer_cannot_read_at_once() -> None:
    found = {p.relative_to(ROOT).as_posix(): too_long(p) for p in python_files()}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_size_check_finds_long_files_and_functions(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    f = tmp_path / "long.py"
    f.write_text(f"def fits():\n{body[: body.rindex(chr(10))]}\n\n\ndef grows():\n{body}\n")
    assert too_long(f) == [f"long.py::grows (line {MAX_FUNCTION_LINES + 3}): 81 lines"]
    f.write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert too_long(f) == [f"long.py: {MAX_FILE_LINES + 1} lines"]


def test_docs_show_tools_folders() -> None:
    """The page's tools/ table has a row per folder of tools/, and tools/ holds no benchmark,
    runner or cluster script loose beside the install and the test command."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `(tools/[a-z_/]*)` \| [^|]+ \|$", doc, flags=re.M))
    tools = ROOT / "tools"
    folders = {f"tools/{p.name}/" for p in tools.iterdir() if (p / "__init__.py").exists()}
    assert rows == {"tools/", *folders}
    loose = {p.name for p in tools.iterdir() if p.is_file()}
    assert loose <= {"__init__.py", "setup.sh", "agents_env.sh", "test.py", "inspect.py"}, loose
