"""Line coverage (coverage.py) of the fast tier against the whole suite's, per package.

    python -m tools.testing.coverage_tiers --out OUT              # the whole suite
    python -m tools.testing.coverage_tiers --out OUT --tier fast  # one part (keeps the other)
    python -m tools.testing.coverage_tiers --out OUT --report     # the table again from OUT

It runs the fast tier (`python -m tools.test --fast`) and the rest of the suite
(`python -m tools.test -m "not (not slow or tier1)"`), each under coverage.py with its
`subprocess` and `_exit` patches, so the lines the run workers, rank scripts and reward
or environment workers execute count (a process killed by SIGKILL loses its data: what
it ran before is run again by the resume that follows). The whole suite's lines are
those the two parts executed, so it runs once in all. The table has, per package of
`rftpipe` and for `jobs`, the statements, the share of them each tier executes, and the
fast tier's covered lines as a share of the whole suite's: issue 32 asks at least 80 %.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tools.testing.runner import FAST

ROOT = Path(__file__).resolve().parents[2]
TIERS = {"fast": ["-m", FAST], "rest": ["-m", f"not ({FAST})"]}

# Subprocesses print coverage.py's warnings on stderr at exit (a reward server that
# imports no rftpipe module collects no data), and tests read stderr line by line.
RC = """\
[run]
source_pkgs = rftpipe, jobs
parallel = true
patch = subprocess, _exit
data_file = {data}
disable_warnings = no-data-collected, module-not-imported, module-not-measured, couldnt-parse
"""


def run_tier(out: Path, tier: str, pytest_args: list[str]) -> int:
    d = out / tier
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob(".coverage*"):
        old.unlink()
    rc = d / "coveragerc"
    rc.write_text(RC.format(data=d / ".coverage"))
    cov = [sys.executable, "-m", "coverage"]
    cmd = [*cov, "run", f"--rcfile={rc}", "-m", "tools.test", *TIERS[tier]]
    cmd += ["--", *pytest_args] if pytest_args else []
    print(f"tools.testing.coverage_tiers: {' '.join(cmd[1:])}", flush=True)
    # Run workers start as new interpreters, which coverage.py's subprocess patch measures,
    # not as forks of the suite's warm ones (tools/testing/zygote.py).
    env = {**os.environ, "RFTPIPE_TEST_ZYGOTE": "0"}
    code = subprocess.run(cmd, cwd=ROOT, check=False, env=env).returncode
    subprocess.run([*cov, "combine", f"--rcfile={rc}", "-q"], cwd=ROOT, check=True)
    subprocess.run(
        [*cov, "json", f"--rcfile={rc}", "-q", "-o", str(d / "coverage.json")],
        cwd=ROOT,
        check=True,
    )
    return code


def package(path: str) -> str:
    """`rftpipe/engines/train/fsdp.py` -> `rftpipe.engines`; `rftpipe/dist.py` -> `rftpipe`."""
    parts = Path(path).with_suffix("").parts
    top = parts.index("rftpipe") if "rftpipe" in parts else parts.index("jobs")
    mod = parts[top:]
    return ".".join(mod[:2]) if len(mod) > 2 else mod[0]


def lines(report: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(package -> its statements, package -> its executed lines), lines as `file:n`."""
    data = json.loads(report.read_text())["files"]
    stmts: dict[str, set[str]] = defaultdict(set)
    run: dict[str, set[str]] = defaultdict(set)
    for f, d in data.items():
        rel = Path(f).resolve().relative_to(ROOT).as_posix() if Path(f).is_absolute() else f
        pkg = package(rel)
        executed = {f"{rel}:{n}" for n in d["executed_lines"]}
        stmts[pkg] |= executed | {f"{rel}:{n}" for n in d["missing_lines"]}
        run[pkg] |= executed
    return stmts, run


def table(out: Path) -> str:
    stmts, fast = lines(out / "fast" / "coverage.json")
    more, rest = lines(out / "rest" / "coverage.json")
    full = {pkg: fast[pkg] | rest[pkg] for pkg in stmts.keys() | more.keys()}
    for pkg, found in more.items():
        stmts[pkg] |= found
    rows = [
        "| package | statements | whole suite | fast tier | fast / whole |",
        "|---|---:|---:|---:|---:|",
    ]

    def row(name: str, s: int, a: int, b: int) -> str:
        ratio = f"{100 * b / a:.0f} %" if a else "n/a"
        return f"| {name} | {s} | {100 * a / s:.0f} % | {100 * b / s:.0f} % | {ratio} |"

    total = [0, 0, 0]
    for pkg in sorted(stmts):
        s, a, b = len(stmts[pkg]), len(full[pkg]), len(fast[pkg])
        rows.append(row(f"`{pkg}`", s, a, b))
        total = [total[0] + s, total[1] + a, total[2] + b]
    rows.append(row("**all**", *total))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.testing.coverage_tiers", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="where each tier's data goes")
    p.add_argument("--tier", choices=sorted(TIERS), help="run this tier only")
    p.add_argument("--report", action="store_true", help="only print the table from --out")
    p.add_argument("pytest_args", nargs="*", help="passed to every pytest phase after `--`")
    a = p.parse_args(argv)
    code = 0
    if not a.report:
        for tier in [a.tier] if a.tier else list(TIERS):
            code = run_tier(a.out.resolve(), tier, a.pytest_args) or code
    if all((a.out / t / "coverage.json").exists() for t in TIERS):
        print(table(a.out))
    return code


if __name__ == "__main__":
    sys.exit(main())
