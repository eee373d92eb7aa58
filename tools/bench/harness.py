"""What the benchmarks share: their command line, measurements in fresh processes, sides
alternated round by round, medians, side-by-side Markdown tables, and the JSON (and
Markdown) they write.

Only the standard library at the top: `tools.bench.agent_calls` is imported by every agent
process it starts, and `list` imports nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

ROOT = Path(__file__).resolve().parents[2]
R = TypeVar("R")

# ---------------------------------------------------------------------------- command line


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """Benchmark `name`'s argument parser: `python -m tools.bench NAME` as its program, its
    module's docstring (as written) as its description."""
    return argparse.ArgumentParser(
        prog=f"python -m tools.bench {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def bench_cmd(name: str, *args: str) -> list[str]:
    """The command that runs benchmark `name` with `args` in a fresh interpreter (a
    benchmark's own child processes: one measurement each, or one rank)."""
    return [sys.executable, "-m", "tools.bench", name, *args]


# ----------------------------------------------------------------------- fresh processes


@dataclass(frozen=True)
class Child:
    """A finished child process: its exit code, wall seconds, the peak resident memory of
    the process tree it waited for (ru_maxrss of a reaped child covers the children it
    reaped in turn: a run's worker), and its output if captured."""

    code: int
    wall_s: float
    peak_rss_gib: float
    stdout: str = ""
    stderr: str = ""


class Started:
    """A child process started in `ROOT` with `env` over this one's environment; with
    `capture`, its stdout and stderr go to temporary files (no pipe to fill and block it)
    read back by `finish`."""

    def __init__(self, cmd: list[str], env: Mapping[str, str] | None, capture: bool) -> None:
        # Open until `finish` reads and closes them: the process writes to them meanwhile.
        self.files: list[IO[bytes]] = [
            tempfile.TemporaryFile()  # noqa: SIM115
            for _ in range(2 * capture)
        ]
        out, err = self.files if capture else (None, None)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=err
        )

    def finish(self) -> Child:
        """Wait for it (`os.wait4`, for its rusage) and return what it did."""
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - self.t0
        texts = []
        for f in self.files:
            with f:
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))
        return Child(self.proc.returncode, wall, usage.ru_maxrss / 2**20, *texts)


def fresh_process(
    cmd: list[str], env: Mapping[str, str] | None = None, capture: bool = False
) -> Child:
    """Run one measurement in a fresh process: nothing of an earlier one (allocator pools,
    imported modules, warm kernels, a peak resident set) carries over."""
    return Started(cmd, env, capture).finish()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_ranks(cmd: list[str], world: int, threads: int, capture: bool = False) -> list[Child]:
    """`cmd` as `world` ranks of one torch.distributed job on this machine (RANK,
    LOCAL_RANK, WORLD_SIZE and a free MASTER_PORT, as torchrun sets them), `threads` OpenMP
    threads each; each rank's result, in rank order."""
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": str(threads),
    }
    ranks = [
        Started(cmd, {**env, "RANK": str(r), "LOCAL_RANK": str(r)}, capture) for r in range(world)
    ]
    return [r.finish() for r in ranks]


class Session:
    """A process in a session of its own (`jobs.submit`, say), so that `kill` reaches what
    it started too (the run's worker). `t0` is the wall-clock time (`time.time()`, as event
    logs stamp theirs) just before the spawn; with `log`, its output goes there."""

    def __init__(self, cmd: list[str], log: Path | None = None) -> None:
        self.log = log
        with open(log, "wb") if log else contextlib.nullcontext() as f:
            self.t0 = time.time()
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT if f else None,
                start_new_session=True,
            )

    def wait_for(self, probe: Callable[[], R | None], interval: float, timeout: float) -> R | None:
        """Call `probe` every `interval` seconds until it returns a value; None if the
        process ends first or `timeout` seconds pass."""
        while True:
            got = probe()
            if got is not None:
                return got
            if self.proc.poll() is not None or time.time() - self.t0 > timeout:
                return None
            time.sleep(interval)

    def kill(self) -> None:
        """SIGKILL the session's process group, and wait until all of it is gone (a worker,
        reparented once its launcher died, may take a moment)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log else ""


# ----------------------------------------------------------------------------- alternation


@dataclass(frozen=True)
class Rounds(Generic[R]):
    """What `alternate` measured: each side's first warm-up result, and its measured runs
    in order."""

    warmup: dict[str, R]
    runs: dict[str, list[R]]


def alternate(
    sides: Mapping[str, Callable[[], R]],
    runs: int,
    warmup: int = 1,
    after_round: Callable[[int, dict[str, R]], None] | None = None,
) -> Rounds[R]:
    """Each side once per round, in the order of `sides`: `warmup` rounds first (not
    counted; the first one's results are kept, to compare the sides' outputs), then `runs`
    measured rounds, so the machine's drift over the rounds falls on every side alike.
    `after_round(i, results)` sees round i's results (to print progress)."""
    first: dict[str, R] = {}
    for _ in range(warmup):
        for name, run in sides.items():
            first.setdefault(name, run())
    results: dict[str, list[R]] = {name: [] for name in sides}
    for i in range(runs):
        for name, run in sides.items():
            results[name].append(run())
        if after_round is not None:
            after_round(i, {name: results[name][-1] for name in sides})
    return Rounds(first, results)


def timed(fn: Callable[[], R], cuda: bool = False) -> tuple[float, R]:
    """(seconds, result) of `fn()`; on CUDA between two synchronisations, so the seconds
    hold the kernels it queued."""
    if cuda:
        import torch

        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def status_kib(field: str) -> int:
    """A `/proc/self/status` field in KiB (`VmRSS`, `VmHWM`)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_rss_peak() -> int:
    """Set this process's resident-set high-water mark to its resident set now (through
    /proc/self/clear_refs); that resident set, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return status_kib("VmRSS") * 1024


def rss_peak_since(start: int) -> int:
    """Bytes the resident set's high-water mark rose above `start` (`reset_rss_peak`'s)."""
    return status_kib("VmHWM") * 1024 - start


# ---------------------------------------------------------------------------------- medians


def medians(runs: Sequence[Mapping[str, Any]], key: str, count: int) -> list[float]:
    """The median over `runs` of each of the first `count` entries of their list `key` (a
    per-turn or per-call figure), to 4 decimals."""
    return [round(statistics.median(r[key][c] for r in runs), 4) for c in range(count)]


def pooled_median(runs: Iterable[Mapping[str, Any]], key: str) -> float | None:
    """The median of the lists `key` of all `runs` taken together (per-step figures of
    several runs); None if no run recorded any."""
    xs = [x for r in runs for x in r.get(key, ())]
    return statistics.median(xs) if xs else None


def key_medians(rows: Sequence[Mapping[str, float]], keys: Iterable[str]) -> dict[str, float]:
    """Per key, its median over `rows`."""
    return {k: statistics.median(r[k] for r in rows) for k in keys}


# ----------------------------------------------------------------------------------- tables


def markdown_row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown_table(header: Sequence[object], rows: Iterable[Iterable[object]] = ()) -> str:
    """A Markdown table (its header alone, with no rows: then print rows as they come with
    `markdown_row`)."""
    lines = [markdown_row(header), "|" + "---|" * len(header)]
    return "\n".join([*lines, *map(markdown_row, rows)])


def comparison_table(
    values: Mapping[str, Mapping[str, float]],
    sides: Sequence[str],
    fmt: str = ".3f",
    what: str = "",
) -> str:
    """Sides side by side: a Markdown table with a row per entry of `values` (a figure:
    {side: value}), a column per side, and with two sides their ratio (first / second)."""
    ratio = [f"{sides[0]} / {sides[1]}"] if len(sides) == 2 else []
    rows = []
    for label, by_side in values.items():
        cells = [label, *(format(by_side[s], fmt) for s in sides)]
        if ratio:
            cells.append(f"{by_side[sides[0]] / by_side[sides[1]]:.2f}")
        rows.append(cells)
    return markdown_table([what, *sides, *ratio], rows)


# ---------------------------------------------------------------------------------- reports


def write_json(path: Path, data: Any) -> None:
    """`data` as indented JSON at `path` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_report(path: Path, data: Any, markdown: str, title: str) -> Path:
    """The JSON record at `path` and, beside it (`.md`), the report a reader opens: `title`
    and `markdown`. Returns the Markdown file's path."""
    write_json(path, data)
    md = path.with_suffix(".md")
    md.write_text(f"# {title}\n\n{markdown.rstrip()}\n")
    return md


def fenced(text: str) -> str:
    """Fixed-width text (a column-aligned printout) as a Markdown code block."""
    return f"```\n{text.rstrip()}\n```"
