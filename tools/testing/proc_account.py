"""Where a command's CPU time goes, by kind of process: the test suite's time table.

    python -m tools.testing.proc_account --out acct.json -- python -m tools.test
    python -m tools.testing.proc_account --report acct.json

Samples /proc every `--interval` seconds and keeps, for each process started after this
tool (the command's descendants and anything they start, daemons included), its command
line and its last CPU time (user + system). Processes that live shorter than one
interval are missed, so the figures are lower bounds; `--report` groups them by the kind
of process (`KINDS`: pytest workers, `jobs.submit` launchers, run workers, the test
suite's rank scripts, vLLM, Slurm daemons, the browser, mypy, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")

# (kind, substring of the command line): the first match names a process.
KINDS: list[tuple[str, str]] = [
    ("this sampler", "tools.testing.proc_account"),
    ("run worker (rftpipe.run.worker)", "rftpipe.run.worker"),
    ("launcher (jobs.submit)", "jobs.submit"),
    ("rank scripts (tests/*_worker.py)", "_worker.py"),
    ("pytest (in-process tests)", "pytest"),
    ("pytest (in-process tests)", "exec(eval(sys.stdin.readline()))"),  # an xdist worker
    ("the tiny models' builds", "rftpipe.engines.models"),
    ("reward workers", "rftpipe.rewards.worker"),
    ("tools.bench (its smoke test)", "tools.bench"),
    ("environment and reward workers", "rftpipe.envs"),
    ("Slurm daemons and commands", "slurm"),
    ("Slurm daemons and commands", "munged"),
    ("Slurm daemons and commands", "srun"),
    ("Slurm daemons and commands", "sbatch"),
    ("Slurm daemons and commands", "squeue"),
    ("Slurm daemons and commands", "scontrol"),
    ("submitit (Slurm job bodies)", "submitit"),
    ("the browser (chromium)", "chrom"),
    ("mypy", "mypy"),
    ("setup (pip)", "-m pip"),
    ("ruff", "ruff"),
]


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def _sample(since: float, boot: float, seen: dict[str, dict]) -> None:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            # The command name may hold spaces and parentheses: fields follow the last ')'.
            fields = stat[stat.rindex(")") + 2 :].split()
            started = boot + int(fields[19]) / TICK
            if started < since:
                continue
            key = f"{pid}:{started:.2f}"  # a pid may be reused
            rec = seen.get(key)
            if rec is None:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                cmd = " ".join(a.decode(errors="replace") for a in argv if a)
                rec = seen[key] = {"cmd": cmd[:300], "start": started}
            rec["cpu"] = (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, ValueError, IndexError):
            continue  # ended between the listing and the read


def _kind(cmd: str) -> str:
    for kind, needle in KINDS:
        if needle in cmd:
            return kind
    if "vllm" in cmd.lower():
        return "vLLM"
    return "other: " + (cmd.split()[0].rsplit("/", 1)[-1] if cmd else "?")


def report(path: Path) -> str:
    data = json.loads(path.read_text())
    groups: dict[str, list[float]] = {}
    for rec in data["processes"].values():
        groups.setdefault(_kind(rec["cmd"]), []).append(rec["cpu"])
    total = sum(sum(v) for v in groups.values())
    lines = [
        f"wall {data['wall_s']:.0f} s, CPU {total:.0f} s in {len(data['processes'])} processes",
        "| kind | processes | CPU s | share |",
        "|---|---:|---:|---:|",
    ]
    for kind, cpus in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        share = sum(cpus) / total if total else 0.0
        lines.append(f"| {kind} | {len(cpus)} | {sum(cpus):.0f} | {share:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.testing.proc_account")
    p.add_argument("--out", type=Path, help="where to write the samples (JSON)")
    p.add_argument("--report", type=Path, help="print the table of an earlier --out")
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument(
        "--pid", type=int, help="instead of a command: a running process, from its start"
    )
    p.add_argument("command", nargs="*")
    a = p.parse_args(argv)
    if a.report:
        print(report(a.report))
        return 0
    if not a.out or bool(a.command) == bool(a.pid):
        p.error("give --out FILE and either -- COMMAND... or --pid PID; or --report FILE")
    boot = _boot_time()
    seen: dict[str, dict] = {}
    if a.pid:
        fields = Path(f"/proc/{a.pid}/stat").read_text().rsplit(")", 1)[1].split()
        since = boot + int(fields[19]) / TICK - 1.0

        def alive() -> bool:
            return Path(f"/proc/{a.pid}").exists()

        code = 0
    else:
        since = time.time() - 1.0
        proc = subprocess.Popen(a.command)

        def alive() -> bool:
            return proc.poll() is None

    t0 = time.time()
    while alive():
        _sample(since, boot, seen)
        time.sleep(a.interval)
    code = 0 if a.pid else proc.returncode
    wall = time.time() - (since + 1.0 if a.pid else t0)
    a.out.write_text(json.dumps({"wall_s": wall, "rc": code, "processes": seen}))
    print(report(a.out))
    return code


if __name__ == "__main__":
    sys.exit(main())
