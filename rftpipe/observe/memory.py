"""Peak memory of each stage and of the whole run.

Each stage: the process's high-water resident set (VmHWM: anonymous and file-backed
pages, the mapped libraries and weights included) and the GPU's peak allocation. Before
a stage the high-water mark is reset to the current resident set (Linux: writing 5 to
/proc/self/clear_refs); after it, VmHWM in /proc/self/status is the stage's own peak
since that reset. Its increment is that peak's anonymous part over the post-load
baseline, the anonymous resident set once the model and engines were built
(`mark_baseline`). Nothing orders the stages' peaks: `launch.retain_host_memory` keeps
freed blocks under 16 MiB (on a CPU train device, up to the largest parameter's gradient)
in glibc's heap for reuse, but larger ones are unmapped when freed, so a stage after the
train stage may read less than the train stage did::

    from rftpipe.observe import memory
    memory.mark_baseline()
    memory.reset_peak()
    ...  # the stage
    figures = memory.stage_figures("train")  # {"perf/train_mem_peak_gib": 3.1, ...}

The whole run: the reset also clears the kernel's lifetime peak of the process (what
`getrusage`'s ru_maxrss and `/usr/bin/time -v` report), and a stage's figures never see
its child processes (reward and environment workers, engine processes). So
`start_run_sampler` starts a thread that sums VmRSS over the process and all its
descendants every `SAMPLE_S` seconds, and `reset_peak` notes the process's own VmHWM
before clearing it; `run_peak_gib` is the highest of these since the process started::

    memory.start_run_sampler()
    ...
    memory.run_figures()  # {"perf/run_mem_peak_gib": 4.13}

Elsewhere than Linux the host figures are absent (empty dicts), never wrong.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from rftpipe.events import events

GIB = 2.0**30
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_baseline: float | None = None

SAMPLE_S = 0.2
"""Seconds between two samples of the process tree's resident set. One sample reads
/proc/PID/task/TID/children of every thread and /proc/PID/statm of every process of the
tree: 0.45-0.5 ms of the thread's CPU time in a tiny run's rank process with one reward
worker (0.031-0.034 s over 68-69 samples, 2026-11-27, 2-core CPU machine), i.e. about
0.25 % of one core. A child's peak shorter than this may fall between two samples; the
rank process's own peak never does (VmHWM)."""


def _status_kib(key: str) -> int | None:
    """A `VmXXX:  N kB` line of /proc/self/status, in KiB (None where there is none)."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def rss_gib() -> float | None:
    """The process's resident set now (VmRSS)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024 / GIB


def anon_gib() -> float | None:
    """The process's anonymous resident memory now (RssAnon: heap and tensors, without the
    mapped files that the kernel may evict and fault back in under memory pressure)."""
    kib = _status_kib("RssAnon")
    return None if kib is None else kib * 1024 / GIB


def _anon_peak_gib() -> float | None:
    """The high-water mark less the file-backed and shared pages resident now: the anonymous
    peak, as long as the mapped files stayed put during the stage."""
    peak, file, shmem = (_status_kib(k) for k in ("VmHWM", "RssFile", "RssShmem"))
    if peak is None or file is None:
        return None
    return (peak - file - (shmem or 0)) * 1024 / GIB


def peak_gib() -> float | None:
    """The resident set's high-water mark since the last `reset_peak` (VmHWM)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024 / GIB


def reset_peak() -> None:
    """Start a new high-water mark at the current resident set (and the GPU's allocation)."""
    # The reset loses the peak so far for the kernel too (ru_maxrss): keep it for the run.
    _RUN.note_kib(_status_kib("VmHWM"))
    # Not Linux, or a kernel without it: VmHWM then spans the whole process.
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def mark_baseline() -> float | None:
    """Record the post-load resident set that stage increments are measured from."""
    global _baseline
    _baseline = anon_gib()
    return _baseline


def baseline_gib() -> float | None:
    return _baseline


def stage_figures(stage: str) -> dict[str, float]:
    """`perf/<stage>_mem_peak_gib` (host high-water mark since `reset_peak`),
    `perf/<stage>_mem_increment_gib` (its anonymous part over the baseline's, once marked:
    on a shared machine the kernel evicts and re-reads the pages of mapped libraries and
    weights, which moved the total by up to 0.3 GiB between identical runs) and, on a GPU,
    `perf/<stage>_gpu_peak_gib` (torch's peak allocation)."""
    out: dict[str, float] = {}
    peak = peak_gib()
    if peak is not None:
        out[f"perf/{stage}_mem_peak_gib"] = round(peak, 4)
        anon = _anon_peak_gib()
        if _baseline is not None and anon is not None:
            out[f"perf/{stage}_mem_increment_gib"] = round(anon - _baseline, 4)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"perf/{stage}_gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 4)
    return out


def _children(pid: int) -> list[int]:
    """The child processes of ``pid``, whichever of its threads started them."""
    out: list[int] = []
    with contextlib.suppress(OSError):  # the process has exited meanwhile
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(c) for c in f.read().split()]
    return out


def _rss_pages(pid: int) -> int:
    """The resident set of ``pid`` in pages (statm: cheaper to read than status)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0  # exited meanwhile


def tree_rss_gib(root: int | None = None) -> float | None:
    """The resident sets of ``root`` (default: this process) and all its descendants,
    summed now: what a job's memory limit (a cgroup, Slurm's accounting) sees of them."""
    root = os.getpid() if root is None else root
    if not Path(f"/proc/{root}/task").is_dir():
        return None
    pids, seen = [root], {root}
    for pid in pids:  # grows while walked: breadth first
        for child in _children(pid):
            if child not in seen:
                seen.add(child)
                pids.append(child)
    return sum(_rss_pages(pid) for pid in pids) * _PAGE / GIB


class _RunPeak:
    """The highest resident set seen in this process's run: the process tree's samples and
    the process's own high-water marks (each noted before its reset)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.peak_gib: float | None = None
        self.samples = 0
        self.sampler_cpu_s = 0.0
        self.thread: threading.Thread | None = None

    def note(self, gib: float | None) -> None:
        if gib is None:
            return
        with self.lock:
            self.peak_gib = gib if self.peak_gib is None else max(self.peak_gib, gib)

    def note_kib(self, kib: int | None) -> None:
        self.note(None if kib is None else kib * 1024 / GIB)

    def sample(self, interval: float) -> None:
        while True:
            self.note(tree_rss_gib())
            self.samples += 1
            # The thread's own CPU time: what sampling costs the run (the `run_memory` event).
            self.sampler_cpu_s = time.thread_time()
            time.sleep(interval)


_RUN = _RunPeak()


def start_run_sampler(interval: float = SAMPLE_S) -> None:
    """Sample the process tree's resident set every ``interval`` seconds from now on, in a
    daemon thread (once per process; nothing where there is no /proc)."""
    if _RUN.thread is not None or tree_rss_gib() is None:
        return
    _RUN.thread = threading.Thread(
        target=_RUN.sample, args=(interval,), name="rftpipe-memory", daemon=True
    )
    _RUN.thread.start()


def run_peak_gib() -> float | None:
    """The highest resident set of this process's run so far: the process tree's summed
    VmRSS as sampled, and this process's own VmHWM, now and before every reset."""
    _RUN.note_kib(_status_kib("VmHWM"))
    return _RUN.peak_gib


def run_figures() -> dict[str, float]:
    """`perf/run_mem_peak_gib`: :func:`run_peak_gib` (absent where it is unknown)."""
    peak = run_peak_gib()
    return {} if peak is None else {"perf/run_mem_peak_gib": round(peak, 4)}


def run_event() -> dict[str, float | int]:
    """The `run_memory` event's fields: the run's peak and what sampling it cost."""
    return {
        **run_figures(),
        "samples": _RUN.samples,
        "sampler_cpu_s": round(_RUN.sampler_cpu_s, 4),
    }


@contextlib.contextmanager
def measured(step: int, phase: str) -> Iterator[None]:
    """Record a phase outside the stages (the last checkpoint, the export) as a
    `stage_memory` event, as the executor records each stage."""
    reset_peak()
    try:
        yield
    finally:
        events().write("stage_memory", step=step, stage=phase, **stage_figures(phase))
