"""RUN/eval.json: every committed evaluation's metrics, by step, read from its rows."""

from __future__ import annotations

from pathlib import Path

from rftpipe.run.metrics import eval_metrics
from rftpipe.storage.atomic import atomic_write_json
from rftpipe.storage.layout import list_steps
from rftpipe.storage.stage_store import StageStore


def write_summary(store: StageStore, path: Path) -> None:
    """{"steps": {step: eval/* metrics}, "before": step 0's, "after": the newest's}; the
    committed eval stages are the record, this file only gathers them (rewritten whole)."""
    steps = {
        s: {k: v for k, v in eval_metrics(store, s).items() if k.startswith("eval/")}
        for s in list_steps(store.run.stages)
        if store.is_committed(s, "eval")
    }
    if not steps:
        return
    summary = {"steps": {str(s): m for s, m in steps.items()}}
    if 0 in steps:
        summary["before"] = steps[0]
    summary["after"] = steps[max(steps)]
    atomic_write_json(path, summary)
