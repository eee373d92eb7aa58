"""The benchmarks: one harness (`tools.bench.harness`), each benchmark a module.

    python -m tools.bench list               # each benchmark: what it runs, what it measures
    python -m tools.bench NAME [ARGS ...]    # run one (`NAME --help` for its flags)
    python -m tools.bench [--pairs 5 ...]    # no name: the TRL comparison (`trl`), as ever

A benchmark module (`tools/bench/NAME.py`, or a folder `tools/bench/NAME/` whose
`__init__.py` does it) declares itself once, at module level:

    BENCHMARK = Benchmark(name="NAME", runs="...", measures="...", main=main)

with literal strings, and `BENCHMARKS` below names its module. `list` reads those
declarations from the modules' source, without importing them (most import torch); running
one imports only its module.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    """A benchmark's identity: its name on the command line, what it runs and what it
    measures (a sentence each, for `list`), and its entry point (`main(argv)`, argv without
    the name; its exit status, None for 0)."""

    name: str
    runs: str
    measures: str
    main: Callable[[list[str] | None], int | None]


BENCHMARKS: dict[str, str] = {
    "trl": "tools.bench.trl",
    "restart": "tools.bench.restart",
    "staleness": "tools.bench.staleness",
    "turns": "tools.bench.turns",
    "agent_calls": "tools.bench.agent_calls",
    "packing": "tools.bench.packing",
    "forward": "tools.bench.forward",
    "sp": "tools.bench.sp",
    "memory": "tools.bench.memory",
    "mfu": "tools.bench.mfu",
    "offload": "tools.bench.offload",
    "handoff": "tools.bench.handoff",
    "inspect": "tools.bench.inspect",
    "vision": "tools.bench.vision",
    "vision_step": "tools.bench.vision_step",
    "vllm_vision": "tools.bench.vllm_vision",
    "overhead": "tools.bench.overhead",
    "moe": "tools.bench.moe",
    "decode_batch": "tools.bench.decode_batch",
}
"""Name -> module, in the order `list` prints them. `trl` is the default benchmark."""

DEFAULT = "trl"


def load(name: str) -> Benchmark:
    """Import benchmark `name`'s module and return its declaration."""
    declared = importlib.import_module(BENCHMARKS[name]).BENCHMARK
    assert isinstance(declared, Benchmark), f"{BENCHMARKS[name]}.BENCHMARK is not a Benchmark"
    return declared


def source(module: str) -> Path:
    """The file that holds `module`'s top level (a folder's `__init__.py`)."""
    path = HERE.parent.parent / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def declaration(path: Path) -> dict[str, str] | None:
    """The literal keywords (`name`, `runs`, `measures`) of the module-level
    `BENCHMARK = Benchmark(...)` in the file at `path`, read without importing it; None if
    it declares none."""
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "BENCHMARK"
            and isinstance(node.value, ast.Call)
        ):
            return {
                k.arg: ast.literal_eval(k.value)
                for k in node.value.keywords
                if k.arg in ("name", "runs", "measures")
            }
    return None


def listing() -> str:
    """`list`'s text: two lines per benchmark, its name and what it runs, then what it
    measures."""
    width = max(map(len, BENCHMARKS)) + 2
    lines = []
    for name, module in BENCHMARKS.items():
        d = declaration(source(module)) or {}
        lines.append(f"{name:{width}}runs: {d.get('runs', '?')}")
        lines.append(f"{'':{width}}measures: {d.get('measures', '?')}")
    return "\n".join(lines)


USAGE = f"""usage: python -m tools.bench list
       python -m tools.bench NAME [ARGS ...]   (NAME: {", ".join(BENCHMARKS)})
       python -m tools.bench [TRL COMPARISON FLAGS ...]   (python -m tools.bench --help)"""


def main(argv: list[str] | None = None) -> int:
    """`list`, a benchmark by name with its arguments, or (no name: no arguments or a first
    one that is a flag) the TRL comparison with all of them."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["list"]:
        print(listing())
        return 0
    if args and args[0] in BENCHMARKS:
        return load(args[0]).main(args[1:]) or 0
    if not args or args[0].startswith("-"):
        return load(DEFAULT).main(args) or 0
    print(f"unknown benchmark {args[0]!r}\n{USAGE}", file=sys.stderr)
    return 2
