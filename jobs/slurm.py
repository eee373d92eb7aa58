"""Slurm submission through submitit, and job state without `sacct`.

submitit pickles what it is given, so it gets only strings: the run directory's path and
the resume flags. Everything else (config, progress, what to redo) is read from the run
directory by the task itself, on every (re)start.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rftpipe.errors import UserError
from rftpipe.run.holder import LIVE_STATES
from rftpipe.run.slurm_job import ask_job

#: Seconds between Slurm's USR2 and the time limit (it must fit one stage plus a commit).
DEFAULT_SIGNAL_DELAY_S = 90


def add_slurm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Slurm (with --cluster slurm)")
    g.add_argument("--nodes", type=int, default=1, help="nodes (ranks = nodes x tasks per node)")
    g.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU job)")
    g.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per rank")
    g.add_argument("--mem", default=None, help="memory per node, e.g. 64G (Slurm syntax)")
    g.add_argument("--partition", default=None)
    g.add_argument("--account", default=None)
    g.add_argument("--qos", default=None)
    g.add_argument("--time", default=None, help="time limit: minutes or [D-]HH:MM:SS")
    g.add_argument("--constraint", default=None)
    g.add_argument("--exclusive", action="store_true")
    g.add_argument(
        "--signal-delay",
        type=int,
        default=DEFAULT_SIGNAL_DELAY_S,
        help="seconds before the time limit at which USR2 asks the job to stop and requeue",
    )
    g.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sbatch option, e.g. --sbatch mail-type=END (repeatable)",
    )
    g.add_argument("--job-name", default=None, help="Slurm job name (default: rftpipe-RUN)")
    g.add_argument("--dry-run", action="store_true", help="print the sbatch script and exit")
    g.add_argument("--wait", action="store_true", help="block until the run ends, streaming it")


def time_minutes(value: str) -> int:
    """Slurm's time syntax (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in whole minutes."""
    try:
        days, _, rest = value.rpartition("-")
        parts = [int(x) for x in rest.split(":")]
        d = int(days) if days else 0
        if days:
            h, m, s = (parts + [0, 0])[:3]
        elif len(parts) == 3:
            h, m, s = parts
        else:
            h, (m, s) = 0, (parts + [0])[:2]
    except ValueError:
        raise UserError(f"--time: cannot read {value!r} (minutes or [D-]HH:MM:SS)") from None
    total = d * 1440 + h * 60 + m + (1 if s else 0)
    if total < 1:
        raise UserError(f"--time: {value!r} is under a minute")
    return total


def sbatch_extras(items: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not key:
            raise UserError(f"--sbatch: {item!r} is not KEY=VALUE")
        out[key] = value if sep else True
    return out


def require_client() -> None:
    if shutil.which("srun") is None:
        raise UserError("--cluster slurm: srun not found on PATH (run on a Slurm login node)")


def make_executor(args: argparse.Namespace, run_dir: Path, *, dry_run: bool = False):
    import submitit

    class _ScriptOnly(submitit.SlurmExecutor):
        # A dry run only renders the script, so it works where Slurm is not installed.
        @classmethod
        def affinity(cls) -> int:
            return 2

    if not dry_run:
        require_client()
    logs = run_dir / "slurm"
    executor = _ScriptOnly if dry_run else submitit.SlurmExecutor
    ex = executor(folder=str(logs / "%j"), max_num_timeout=0)
    params: dict = {
        "job_name": args.job_name or f"rftpipe-{run_dir.name}",
        "nodes": args.nodes,
        "ntasks_per_node": args.tasks_per_node,
        "signal_delay_s": args.signal_delay,
        "stderr_to_stdout": False,
        # One failed rank ends the step rather than leaving the others in a collective.
        "srun_args": ["--kill-on-bad-exit=1"],
        # Slurm may requeue the job itself (preemption in REQUEUE mode, node failure).
        "additional_parameters": {"requeue": True, **sbatch_extras(args.sbatch)},
    }
    # None leaves `--time` out of the script: the partition's default limit applies.
    params["time"] = time_minutes(args.time) if args.time is not None else None
    optional = {
        "gpus_per_node": args.gpus_per_node or None,
        "cpus_per_task": args.cpus_per_task,
        "mem": args.mem,
        "partition": args.partition,
        "account": args.account,
        "qos": args.qos,
        "constraint": args.constraint,
        "exclusive": True if args.exclusive else None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    try:
        ex.update_parameters(**params)
    except ValueError as exc:
        raise UserError(f"slurm options: {str(exc).splitlines()[0]}") from None
    return ex


def worker_argv(run_dir: Path, args: argparse.Namespace) -> list[str]:
    argv = [str(run_dir), "--slurm"]
    argv += ["--repair"] if args.repair else []
    argv += ["--allow-fingerprint-mismatch"] if args.allow_fingerprint_mismatch else []
    return argv


def dry_run_script(args: argparse.Namespace, run_dir: Path) -> str:
    ex = make_executor(args, run_dir, dry_run=True)
    # The same text submitit would write, with its per-job command shown symbolically.
    command = [sys.executable, "-u", "-m", "submitit.core._submit", str(run_dir / "slurm" / "%j")]
    return ex._make_submission_file_text(shlex.join(command), "dry-run")


@dataclass(frozen=True, kw_only=True, slots=True)
class Submitted:
    job_id: str
    stdout: Path
    stderr: Path


def submit(args: argparse.Namespace, run_dir: Path) -> Submitted:
    # Imported here, on the login node: submitit pickles the function by reference, so
    # rftpipe.run.worker must stay torch-free at import (its torch imports are inside main).
    from rftpipe.run.worker import slurm_task

    ex = make_executor(args, run_dir)
    job = ex.submit(slurm_task, worker_argv(run_dir, args))
    (run_dir / "slurm").mkdir(exist_ok=True)
    with open(run_dir / "slurm" / "jobs.txt", "a") as fh:
        fh.write(f"{job.job_id}\n")
    return Submitted(job_id=job.job_id, stdout=job.paths.stdout, stderr=job.paths.stderr)


# -- state without sacct ------------------------------------------------------------------------
def squeue_state(job_id: str) -> str | None:
    """The job's state while Slurm still lists it (pending, running, requeued...), else None."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = out.stdout.split()
    return states[0] if out.returncode == 0 and states else None


def job_state(job_id: str) -> str:
    """The job's state: squeue's while it is listed, else slurmctld's memory (kept
    `MinJobAge` seconds after the job ends); GONE once Slurm says it no longer knows the
    job, UNKNOWN while Slurm does not answer (a loaded or restarting controller, or no
    Slurm client here). UNKNOWN is not an end: `wait` keeps polling through it."""
    listed = squeue_state(job_id)
    if listed:
        return listed
    info = ask_job(job_id)
    if info is None:
        return "UNKNOWN"
    return info.get("JobState", "UNKNOWN") if info else "GONE"


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE"}


def live_jobs(run_dir: Path) -> list[tuple[str, str]]:
    """(job id, state) of the jobs submitted for `run_dir` that Slurm still holds: queued,
    running or requeued (RUN/slurm/jobs.txt, where `submit` lists them)."""
    listed = run_dir / "slurm" / "jobs.txt"
    if not listed.exists() or shutil.which("scontrol") is None:
        return []
    states = []
    for job in dict.fromkeys(listed.read_text().split()):
        info = ask_job(job)
        if info is None:  # never taken for ended: a second job would run beside it
            raise UserError(
                f"run_dir: Slurm did not answer about job {job} of {run_dir} (scontrol show "
                "job); try again when it does"
            )
        states.append((job, info.get("JobState") or "GONE"))
    # The states in which a job holds its run directory, as the workers judge a holder.
    return [(job, state) for job, state in states if state in LIVE_STATES]


def wait(job_id: str, run_dir: Path, poll_s: float = 5.0) -> str:
    """Block until the job has ended for good (requeues included); stream committed steps."""
    from rftpipe.stages import FINAL
    from rftpipe.storage.layout import RunDir
    from rftpipe.storage.stage_store import StageStore

    store = StageStore(RunDir(run_dir))
    seen = 0
    while True:
        state = job_state(job_id)
        newest = store.newest_complete_step(FINAL)
        if newest > seen:
            seen = newest
            print(f"job {job_id}: {state}, step {seen} committed", flush=True)
        if state in TERMINAL:
            return state
        time.sleep(poll_s)
