"""Peak memory of each stage: host high-water resident set (and the GPU's peak allocation).

Before a stage, the process's high-water mark is reset to its current resident set (Linux:
writing 5 to /proc/self/clear_refs); after it, VmHWM in /proc/self/status is the stage's
own peak. Its increment is that peak's anonymous part over the post-load baseline, the
anonymous resident set once the model and engines were built (`mark_baseline`). Freed
host memory stays resident (`launch.retain_host_memory` keeps it in glibc's heap for
reuse), so a stage that needs less than an earlier one reads that earlier peak; one that
needs more shows its own::

    from rftpipe.observe import memory
    memory.mark_baseline()
    memory.reset_peak()
    ...  # the stage
    figures = memory.stage_figures("train")  # {"perf/train_mem_peak_gib": 3.1, ...}

Elsewhere than Linux the host figures are absent (empty dicts), never wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from rftpipe.observe.events import events

GIB = 2.0**30
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_baseline: float | None = None


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


@contextlib.contextmanager
def measured(step: int, phase: str) -> Iterator[None]:
    """Record a phase outside the stages (the last checkpoint, the export) as a
    `stage_memory` event, as the executor records each stage."""
    reset_peak()
    try:
        yield
    finally:
        events().write("stage_memory", step=step, stage=phase, **stage_figures(phase))
