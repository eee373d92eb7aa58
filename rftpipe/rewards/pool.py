"""Import-path reward functions, run in worker processes with a hard timeout.

Each call runs in a worker process (`rftpipe.rewards.worker`, a `rftpipe.workers`
process) that is SIGKILLed on timeout and replaced.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import selectors
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rftpipe.config.schema import RewardFunctionConfig, RewardSignature
from rftpipe.errors import UserError
from rftpipe.events import events
from rftpipe.rewards.signatures import batches, split_batch
from rftpipe.rewards.types import Outcome, RewardSample
from rftpipe.workers import WorkerGone, WorkerProcess

log = logging.getLogger(__name__)


_WorkerDied = WorkerGone


WORKER_START_S = 120.0
"""How long a new worker may take to start (a Python start and our imports)."""


class _Worker(WorkerProcess):
    """One reward worker (`rftpipe.rewards.worker`), started and ready."""

    def __init__(self) -> None:
        # Our own requests and replies between our own processes (import paths and rows),
        # never data at rest.
        super().__init__("rftpipe.rewards.worker", pickle.dumps, pickle.loads)
        self.send(("init", list(sys.path)))
        reply = self.wait(WORKER_START_S)
        if reply is None or reply[0] != "ready":
            self.kill()
            what = "did not start" if reply is None else f"answered {reply[0]!r} to init"
            raise _WorkerDied(f"worker {self.pid} {what} within {WORKER_START_S} s")

    def poll_reply(self) -> Any | None:
        return self.poll()


@dataclass(frozen=True, slots=True)
class Call:
    """One call of a function on some rows: its outcome has a list of values."""

    path: str
    signature: RewardSignature
    samples: list[RewardSample]


class WorkerPool:
    """Up to `size` worker processes, started on first use, each running one call at a time."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[_Worker] = []

    def run(self, calls: Sequence[Call], timeout_s: float, fail_fast: bool) -> list[Outcome | None]:
        """An outcome per call: ok with its value, timeout (the worker was killed) or error.
        With `fail_fast`, stop at the first failed call (None for calls not finished)."""
        results: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        busy: dict[int, tuple[_Worker, float]] = {}  # call index -> worker, deadline
        sel = selectors.DefaultSelector()
        try:
            while pending or busy:
                while pending and len(busy) < self.size:
                    i = pending.popleft()
                    w = self._send(calls[i])
                    busy[i] = (w, time.monotonic() + timeout_s)
                    sel.register(w.fd, selectors.EVENT_READ, i)
                nearest = min(deadline for _, deadline in busy.values())
                for key, _ in sel.select(timeout=max(0.0, nearest - time.monotonic())):
                    self._collect(key.data, busy, sel, results)
                for i in [i for i, (_, d) in busy.items() if d <= time.monotonic()]:
                    w, _ = busy.pop(i)
                    sel.unregister(w.fd)
                    w.kill()
                    results[i] = Outcome("timeout", error=f"timed out after {timeout_s:g} s")
                    _log_timeout(calls[i], w.pid, timeout_s)
                if fail_fast and any(r is not None and r.status != "ok" for r in results):
                    break
        finally:
            for w, _ in busy.values():  # abandoned calls: their replies must never be read
                w.kill()
            sel.close()
        return results

    def _send(self, call: Call) -> _Worker:
        msg = (call.path, call.signature, call.samples)
        w = self._idle.pop() if self._idle else _Worker()
        try:
            w.send(msg)
        except _WorkerDied:  # it died while idle (killed from outside): one fresh try
            w.proc.wait()
            w = _Worker()
            w.send(msg)
        return w

    def _collect(
        self,
        i: int,
        busy: dict[int, tuple[_Worker, float]],
        sel: selectors.BaseSelector,
        results: list[Outcome | None],
    ) -> None:
        w, _ = busy[i]
        try:
            reply = w.poll_reply()
        except _WorkerDied as exc:
            busy.pop(i)
            sel.unregister(w.fd)
            results[i] = Outcome("error", error=f"WorkerDied: {exc}")
            return
        if reply is None:
            return
        busy.pop(i)
        sel.unregister(w.fd)
        self._idle.append(w)
        status, value = reply
        results[i] = Outcome("ok", value) if status == "ok" else Outcome("error", error=value)

    def close(self) -> None:
        for w in self._idle:
            w.close()
        self._idle.clear()


def _log_timeout(call: Call, pid: int, timeout_s: float) -> None:
    first = call.samples[0]
    log.warning(
        "reward %s timed out after %g s on %s: worker %d killed",
        call.path,
        timeout_s,
        first.where,
        pid,
    )
    events().write(
        "reward_timeout",
        function=call.path,
        pid=pid,
        step=first.step,
        prompt_id=first.prompt_id,
        sample_idx=[s.sample_idx for s in call.samples],
    )


_shared: dict[int, WorkerPool] = {}


def shared_pool(size: int) -> WorkerPool:
    """The process's pool of `size` workers (they outlive a step: each costs a Python start)."""
    if size not in _shared:
        _shared[size] = WorkerPool(size)
        atexit.register(_shared[size].close)
    return _shared[size]


@dataclass(slots=True)
class Pooled:
    """An import-path function, each call in a worker process bounded by `timeout_s`."""

    spec: RewardFunctionConfig
    timeout_s: float
    pool: WorkerPool

    def score(self, samples: Sequence[RewardSample], fail_fast: bool) -> list[Outcome | None]:
        groups = batches(self.spec.signature, samples)
        calls = [Call(self.spec.path, self.spec.signature, [samples[i] for i in g]) for g in groups]
        out: list[Outcome | None] = [None] * len(samples)
        for g, call, r in zip(
            groups, calls, self.pool.run(calls, self.timeout_s, fail_fast), strict=True
        ):
            if r is None:
                continue
            if r.status != "ok":
                for i in g:
                    out[i] = r
                continue
            try:
                values = split_batch(self.spec.signature, r.value, len(g))
            except TypeError as exc:
                raise UserError(
                    f"reward.functions: {self.spec.path} {exc} on {call.samples[0].where}"
                ) from exc
            for i, v in zip(g, values, strict=True):
                out[i] = Outcome("ok", v)
        return out
