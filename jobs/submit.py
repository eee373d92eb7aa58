"""Launch an rftpipe run: ``python -m jobs.submit [--cluster auto|local|slurm] [--config PATH]
[--run-dir DIR] [--nodes N] [--tasks-per-node N] [slurm options] [key=value ...]``.

Creating or resuming is decided by the run directory: if it holds a config.yaml, the run
resumes after its fingerprint check, unless it holds no committed work (a start refused or
killed before its first commit): then a changed config starts it afresh
(`rftpipe.storage.fresh_start`). No torch import here, so this is instant on a login node.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from jobs import slurm
from rftpipe.atomic import atomic_write_bytes
from rftpipe.config.loader import diff_keys, dump_yaml, load_config, to_dict
from rftpipe.config.schema import RESUME_SAFE_KEYS, RunConfig, refuse_stretched_lr_schedule
from rftpipe.errors import UserError
from rftpipe.run.holder import DYING_GRACE_S, alive, recorded
from rftpipe.space import EXIT_NO_SPACE, NoSpace
from rftpipe.stages import FINAL
from rftpipe.storage.fresh_start import committed_work, exclusive, refuse_misplaced, set_aside
from rftpipe.storage.layout import RunDir
from rftpipe.storage.stage_store import StageStore

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_smollm2_addition.yaml"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jobs.submit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cluster",
        choices=["auto", "local", "slurm"],
        default="auto",
        help="auto: Slurm if `scontrol ping` answers, else run here and block",
    )
    p.add_argument(
        "--config", type=Path, default=None, help=f"YAML config (default: {DEFAULT_CONFIG.name})"
    )
    p.add_argument(
        "--run-dir", type=Path, default=None, help="run directory; an existing one resumes"
    )
    p.add_argument(
        "--tasks-per-node",
        type=int,
        default=1,
        help="SPMD ranks per node (local: processes on this machine, gloo on CPU)",
    )
    p.add_argument(
        "--repair", action="store_true", help="roll back past corrupt older files on resume"
    )
    p.add_argument(
        "--allow-fingerprint-mismatch",
        action="store_true",
        help="resume although config, model or data fingerprints changed",
    )
    p.add_argument(
        "--submit-anyway",
        action="store_true",
        help="resume although a job of this run is still queued or running: a Slurm job "
        "then waits for it to end (afterany)",
    )
    p.add_argument(
        "--create-only",
        action="store_true",
        help="write RUN/config.yaml and exit (for sbatch/rftpipe.sbatch)",
    )
    slurm.add_slurm_args(p)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace, run_dir: Path) -> tuple[RunConfig, bool]:
    """New run: config file + overrides. Resume: the run's config + overrides, fingerprint-checked.

    Also returns whether the directory starts afresh: a new run, or an earlier start that
    committed nothing (refused or killed) given a config that a resume would refuse; nothing
    was computed with the old one to disagree with. The same config restarts it as before."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        cfg = load_config(RunConfig, args.config or DEFAULT_CONFIG, args.overrides)
        return cfg, committed_work(RunDir(run_dir)) is None
    # The run's own config may predate a field's change of type (`saved=True` migrates it);
    # a config file given on the command line is the user's and gets no such leniency.
    old = load_config(RunConfig, saved, saved=True)
    new = load_config(RunConfig, args.config or saved, args.overrides, saved=not args.config)
    changed = diff_keys(to_dict(old), to_dict(new), exclude=RESUME_SAFE_KEYS)
    if changed and committed_work(RunDir(run_dir)) is None:
        return new, True
    if changed and not args.allow_fingerprint_mismatch:
        raise UserError(
            f"resume: {run_dir} was started with a different config ({', '.join(changed)} changed); "
            "pass --allow-fingerprint-mismatch to resume anyway"
        )
    refuse_stretched_lr_schedule(old, new)
    return new, False


def write_run_config(cfg: RunConfig, run_dir: Path, fresh: bool) -> Path | None:
    """New run: RUN/config.yaml. Resume: RUN/config.next.yaml, which the worker promotes to
    config.yaml only once its resume checks pass, so a refused resume leaves the run as it was.

    A fresh start (see `resolve_config`) first moves an earlier start's files aside; returns
    where (None: there were none)."""
    run = RunDir(run_dir)
    run.root.mkdir(parents=True, exist_ok=True)
    if fresh:
        with exclusive(run):  # refused while a worker of this directory is live
            if committed_work(run) is not None:
                # A run committed since `resolve_config` looked, and has ended since.
                raise UserError(f"run_dir: {run.root} changed while starting; submit again")
            moved = set_aside(run)
            atomic_write_bytes(run.config_path, dump_yaml(cfg).encode())
        return moved
    target = run.pending_config_path if run.config_path.exists() else run.config_path
    atomic_write_bytes(target, dump_yaml(cfg).encode())
    return None


def second_job(run_dir: Path, args: argparse.Namespace) -> None:
    """A resume of a run that a live job still holds submits nothing (that job resumes by
    itself) unless `--submit-anyway`: then a Slurm job waits for it (`afterany`), and a
    local run is refused by its workers while it holds the run (`rftpipe.run.holder`)."""
    live = slurm.live_jobs(run_dir)
    if live and args.submit_anyway:
        args.sbatch.append("dependency=afterany:" + ":".join(job for job, _ in live))
        return
    if live:
        jobs = ", ".join(f"slurm job {job} ({state})" for job, state in live)
        raise UserError(
            f"run_dir: {run_dir} already has {jobs}, which resumes by itself; pass "
            "--submit-anyway to submit another that starts once it has ended"
        )
    holder = recorded(RunDir(run_dir))
    if holder is None or args.submit_anyway:
        return
    holding = alive(holder, DYING_GRACE_S)
    if holding:
        raise UserError(f"run_dir: {run_dir} is held by {holder.describe()}, which is still live")
    if holding is None and holder.job and shutil.which("scontrol"):  # never taken for ended
        raise UserError(
            f"run_dir: {run_dir} is held by {holder.describe()} and Slurm did not answer "
            "about it; try again when it does, or pass --submit-anyway"
        )


def slurm_available() -> bool:
    if shutil.which("scontrol") is None:
        return False
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "UP" in out.stdout


@contextlib.contextmanager
def local_rank_env(world: int) -> Iterator[dict[str, str]]:
    """The environment of `world` ranks on this machine, less RANK and LOCAL_RANK.

    Rank 0 publishes its store's port in a rendezvous file of this launch
    (`rftpipe.dist._store`): no port is chosen here and bound later, which another process
    (a second run, a test beside this one) could take in between."""
    with tempfile.TemporaryDirectory(prefix="rftpipe-rdzv-") as rdzv:
        yield {
            **os.environ,
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "RFTPIPE_RENDEZVOUS": str(Path(rdzv) / "port"),
        }


def run_local(run_dir: Path, args: argparse.Namespace) -> int:
    """Run `--tasks-per-node` worker processes here and block until they end.

    If one rank fails, the others are stopped: they would otherwise wait forever in the
    next collective (after `USER_ERROR_GRACE_S` if it exited 2, time for the rank that
    reports its error to do so). The first failing exit code is returned.
    """
    # RFTPIPE_WORKER_VIA=MODULE starts each rank as `python -m MODULE rftpipe.run.worker ...`,
    # a stand-in that becomes that process: the test suite's warm forks (tools/testing/zygote.py).
    via = os.environ.get("RFTPIPE_WORKER_VIA")
    cmd = [sys.executable, "-m", *([via] if via else []), "rftpipe.run.worker", str(run_dir)]
    cmd += ["--repair"] if args.repair else []
    cmd += ["--allow-fingerprint-mismatch"] if args.allow_fingerprint_mismatch else []
    _adopt_orphans()
    with local_rank_env(args.tasks_per_node) as base:
        procs = [
            subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(args.tasks_per_node)
        ]
        try:
            return _wait_all(procs)
        finally:
            _end_adopted(procs)


_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _adopt_orphans() -> None:
    """Make the processes a rank leaves behind this process's children (Linux): a rank
    that ends without its interpreter's teardown, or is killed, leaves vLLM's engine core
    process running (`launch.rollout_ranks`), which would otherwise go to init."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _adopted(ranks: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """(pid, state letter) of every child of this process that is not a rank: what the
    ranks left, adopted (`_adopt_orphans`)."""
    mine = str(os.getpid())
    ranks_pids = {p.pid for p in ranks}
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        if fields[1] == mine and pid not in ranks_pids:
            out.append((pid, fields[0]))
    return out


def _end_adopted(ranks: list[subprocess.Popen]) -> None:
    """Kill and reap every child of this process that is not a rank: what ranks left."""
    for pid, _ in _adopted(ranks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _reap_adopted(ranks: list[subprocess.Popen]) -> None:
    """Reap the adopted processes that have exited (not the ranks, whose status Popen
    reads): an agent's processes end by the dozen each step (`rollout.agent`), and
    unreaped they would hold their pids for the whole run."""
    for pid, state in _adopted(ranks):
        if state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


#: Seconds the other ranks get to end by themselves after a rank exits 2 (`UserError`).
USER_ERROR_GRACE_S = 10.0


def _wait_all(procs: list[subprocess.Popen]) -> int:
    code = 0
    polls = 0
    stop_at: float | None = None
    # Every process polled each time (not `any`, which stops at the first still running):
    # a rank that died while rank 0 runs must be seen.
    while None in [p.poll() for p in procs]:
        polls += 1
        if polls % 5 == 0:  # every second
            _reap_adopted(procs)
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and not code:
            code = failed[0]
            # A rank that exits 2 met a bad input or a failing user function, and may not be
            # the rank that prints it: a rollout rank's error is printed by the trainers'
            # first rank, which sees it within a poll (`rftpipe.run.handoff.wait`) and then
            # ends by itself. Stopped at once, it would end with nothing printed.
            stop_at = time.monotonic() + (USER_ERROR_GRACE_S if code == 2 else 0.0)
        if stop_at is not None and time.monotonic() >= stop_at:
            stop_at = None
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    return code or next((p.returncode for p in procs if p.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = (args.run_dir or Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")).resolve()
    try:
        for flag in ("nodes", "tasks_per_node"):
            if getattr(args, flag) < 1:
                raise UserError(
                    f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}"
                )
        refuse_misplaced(run_dir)
        cfg, fresh = resolve_config(args, run_dir)
        if not (fresh or args.create_only or args.dry_run):
            second_job(run_dir, args)
        cluster = args.cluster
        if cluster == "auto":
            cluster = "slurm" if slurm_available() else "local"
        if cluster == "local" and args.nodes != 1:
            raise UserError(
                f"--nodes: a local run has one node, not {args.nodes}; use --cluster slurm"
            )
        world = args.nodes * args.tasks_per_node
        # The workers refuse these too; here they cost no launch and write nothing.
        groups = {
            "train.sp_size": cfg.train.sp_size,
            "rollout.inference.tensor_parallel_size": cfg.rollout.inference.tensor_parallel_size,
        }
        for field, size in groups.items():
            if world % size:
                raise UserError(
                    f"{field}={size} does not divide the world size {world} "
                    "(--nodes x --tasks-per-node)"
                )
        cfg.launch.rollout_rank_count(world, args.tasks_per_node)
        if args.dry_run:
            if cluster != "slurm":
                raise UserError("--dry-run: only Slurm jobs have an sbatch script")
            print(slurm.dry_run_script(args, run_dir))
            return 0
        if cluster == "slurm" and not args.create_only:
            slurm.require_client()  # before anything is written
        moved = write_run_config(cfg, run_dir, fresh)
        if moved is not None:
            print(
                f"nothing was committed in {run_dir}: starting it afresh (the earlier "
                f"start's files are in {moved})",
                flush=True,
            )
        if args.create_only:
            print(f"run directory: {run_dir}")
            return 0
        job = slurm.submit(args, run_dir) if cluster == "slurm" else None
    except UserError as exc:
        print(f"rftpipe: error: {exc}", file=sys.stderr)
        return 2
    except NoSpace as exc:  # the run's config or fingerprints found no space: the machine's
        print(f"rftpipe: error: {exc}", file=sys.stderr)
        return EXIT_NO_SPACE
    print(f"run directory: {run_dir}", flush=True)
    if job is None:
        return run_local(run_dir, args)
    print(f"slurm job: {job.job_id}\nstdout: {job.stdout}\nstderr: {job.stderr}", flush=True)
    print(f"status: python -m jobs.status {run_dir}", flush=True)
    if not args.wait:
        return 0
    state = slurm.wait(job.job_id, run_dir)
    done = StageStore(RunDir(run_dir)).newest_complete_step(FINAL)
    finished = done >= cfg.total_steps
    print(f"job {job.job_id} ended: {state}; {done}/{cfg.total_steps} steps")
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
