"""Per-task entry point: ``python -m rftpipe.run.worker RUN_DIR`` on every rank (SPMD).

The run directory is the only input: its config.yaml was written by ``jobs.submit``, and
its commit markers say where to resume.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rftpipe.checkpoint.folder import prefetch_newest_checkpoint
from rftpipe.config.loader import load_config
from rftpipe.config.schema import RunConfig, refuse_stretched_lr_schedule
from rftpipe.errors import UserError
from rftpipe.events import EventLog, events, set_event_log
from rftpipe.space import EXIT_NO_SPACE, REFUSED, NoSpace, as_no_space, no_space_in
from rftpipe.storage.fresh_start import hold_live_lock
from rftpipe.storage.layout import RunDir

if TYPE_CHECKING:
    from rftpipe.run.preemption import StopFlag

log = logging.getLogger("rftpipe")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rftpipe.run.worker", description=__doc__)
    p.add_argument("run_dir")
    p.add_argument("--repair", action="store_true", help="roll back past corrupt older files")
    p.add_argument(
        "--allow-fingerprint-mismatch",
        action="store_true",
        help="resume although the model or data changed",
    )
    p.add_argument(
        "--slurm",
        action="store_true",
        help="a Slurm task: take ranks from Slurm, stop on USR2/TERM at a stage boundary, requeue",
    )
    return p.parse_args(argv)


def setup_logging(level: str, rank: int) -> None:
    # Library logs go to stdout so that stderr carries only a fatal one-line error.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [r{rank}] %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level if rank == 0 else "WARNING")
    logging.captureWarnings(True)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _quiet_no_space_threads() -> None:
    """A library's background thread that dies of a full disk (TensorBoard's event writer)
    would print its traceback; its owner re-raises the failure on the main thread (the
    next flush), which ends the run with the one line, so the thread's own report goes to
    the debug log instead of stderr."""
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and no_space_in(args.exc_value) is not None:
            log.debug("thread %s: %s", args.thread.name if args.thread else "?", args.exc_value)
            return
        default(args)

    threading.excepthook = hook


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _quiet_no_space_threads()
    run = RunDir(args.run_dir)
    prefetch_newest_checkpoint(run.checkpoints)
    stop = None
    if args.slurm:
        from rftpipe.run.preemption import StopFlag

        # First thing: a signal that arrives while the model loads must not be lost.
        stop = StopFlag()
        stop.install()
    try:
        return _run(args, run, stop)
    except UserError as exc:
        _event("user_error", message=str(exc))
        # Every rank usually meets the same bad input; one line on stderr is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"rftpipe: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        found = no_space_in(exc)
        if found is None or not _ours(found, run):
            raise
        full = as_no_space(found, run.root)
        _event(
            "no_space", path=str(full.path), free=full.free, needed=full.needed, message=str(full)
        )
        # Ranks that agreed on it (the checkpoint's room) say it once.
        if not full.collective or os.environ.get("RANK", "0") == "0":
            print(f"rftpipe: error: {full}", file=sys.stderr, flush=True)
        return EXIT_NO_SPACE


def _ours(found: NoSpace | tuple[int, str | None], run: RunDir) -> bool:
    """Whether the storage fault is the run's: any lack of space; a refusal (read-only,
    permission) only of a path inside the run directory, or of none named."""
    code, path = (found.code, str(found.path)) if isinstance(found, NoSpace) else found
    if code not in REFUSED or path is None:
        return True
    return Path(path).resolve().is_relative_to(run.root.resolve())


def _event(kind: str, **fields: object) -> None:
    """An event on the way out, which a full file system must not turn into a traceback."""
    with contextlib.suppress(Exception):
        events().write(kind, **fields)


def _run(args: argparse.Namespace, run: RunDir, stop: StopFlag | None) -> int:
    if not run.config_path.exists():
        raise UserError(f"run_dir: {run.root} has no config.yaml (create runs with jobs.submit)")
    # Marks the directory live until this process exits (the descriptor stays open), so
    # that no fresh start moves its files meanwhile.
    hold_live_lock(run)
    # The run's own config, perhaps written by an older rftpipe (a requeued job never passes
    # through jobs.submit): retired values migrate.
    cfg = load_config(RunConfig, run.active_config_path(), saved=True)
    if run.pending_config_path.exists():
        # A resume's new config, which replaces config.yaml only once the resume checks
        # pass: checked here, as every launch path starts this, whoever wrote the file.
        old = load_config(RunConfig, run.config_path, saved=True)
        refuse_stretched_lr_schedule(old, cfg)
    from rftpipe.dist import init_from_env

    dist = init_from_env(require_group=cfg.train.backend != "single")
    setup_logging(cfg.logging.level, dist.rank)
    set_event_log(EventLog(run.events_path, dist.rank))
    from rftpipe.run import preemption
    from rftpipe.run.generator import generate_run
    from rftpipe.run.handoff import OtherRoleFailed, channel_of, report_failure
    from rftpipe.run.holder import hold
    from rftpipe.run.loop import train_run
    from rftpipe.run.placement import place

    hold(run, dist)  # its lock stays held while this process lives
    policy = preemption.RequeuePolicy(
        max_requeues=cfg.launch.max_requeues,
        max_idle_requeues=cfg.launch.max_idle_requeues,
        events_path=run.events_path,
    )
    if stop is not None and not preemption.start_job(dist, stop, policy):
        return 1
    placement = place(cfg, dist)
    try:
        if placement.role == "rollout":
            code = generate_run(
                cfg, run, placement, allow_mismatch=args.allow_fingerprint_mismatch, stop=stop
            )
        else:
            code = train_run(
                cfg,
                run,
                placement.dist,
                repair=args.repair,
                allow_mismatch=args.allow_fingerprint_mismatch,
                stop=stop,
                placement=placement,
            )
        if placement.disaggregated:
            dist.barrier()  # both roles end together (neither leaves the other's gloo)
        return code
    except preemption.StopRequested as req:
        return preemption.requeue_after_stop(req, dist, policy)
    except BaseException as exc:
        if placement.disaggregated and not isinstance(exc, OtherRoleFailed):
            report_failure(channel_of(run), placement.role, exc)
        raise


def slurm_task(argv: list[str]) -> None:
    """What submitit runs on every task: the worker, in this process, with `--slurm`."""
    code = main(argv)
    import torch.distributed as tdist

    # Leave no gloo/nccl threads behind: submitit writes its result and the process exits.
    if tdist.is_initialized():
        tdist.destroy_process_group()
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    sys.stdout.flush()
    # Skip interpreter teardown of torch/gloo threads, which can hang after a collective.
    os._exit(code)
