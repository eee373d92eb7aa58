"""Import-path reward functions, run in worker processes with a hard timeout.

A call that outlives its timeout cannot be stopped from inside Python (`signal.alarm`
works only in the main thread and not while C code holds the GIL; a thread cannot be
killed), so each call runs in a worker process (`rftpipe.rewards.worker`) that is
SIGKILLed on timeout and replaced. A worker is a plain ``python -m`` subprocess rather
than a multiprocessing child: it imports only the user's module, never the run's
``__main__`` (torch), and its pid is ours to kill.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import selectors
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rftpipe
from rftpipe.config.schema import RewardFunctionConfig, RewardSignature
from rftpipe.errors import UserError
from rftpipe.observe.events import events
from rftpipe.rewards.signatures import batches, split_batch
from rftpipe.rewards.types import Outcome, RewardSample
from rftpipe.rewards.worker import HEADER, frame

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(rftpipe.__file__).resolve().parent.parent)


class _WorkerDied(Exception):
    pass


WORKER_START_S = 120.0
"""How long a new worker may take to start (a Python start and our imports)."""


class _Worker:
    """One worker process and the bytes of its next reply read so far."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rftpipe.rewards.worker", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # The user's prints and tracebacks join the run's log (stdout): stderr carries
            # only the run's one-line fatal error.
            stderr=1,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = bytearray()
        self.send(("init", list(sys.path)))
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Block until the worker has started (its start-up is not a call's time)."""
        deadline = time.monotonic() + WORKER_START_S
        with selectors.DefaultSelector() as sel:
            sel.register(self.fd, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                sel.select(timeout=max(0.0, deadline - time.monotonic()))
                if (reply := self.poll_reply()) is not None:
                    if reply[0] != "ready":
                        raise _WorkerDied(f"worker {self.pid} answered {reply[0]!r} to init")
                    return
        self.kill()
        raise _WorkerDied(f"worker {self.pid} did not start within {WORKER_START_S} s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: Any) -> None:
        try:
            self.stdin.write(frame(pickle.dumps(msg)))
            self.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise _WorkerDied(f"worker {self.pid} is gone") from exc

    def poll_reply(self) -> Any | None:
        """The reply if it has fully arrived, else None; _WorkerDied at end of output."""
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return None
        if not chunk:
            code = self.proc.wait()
            raise _WorkerDied(f"the worker process died (exit code {code})")
        self.buf += chunk
        if len(self.buf) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self.buf)
        if len(self.buf) < HEADER.size + size:
            return None
        data = bytes(self.buf[HEADER.size : HEADER.size + size])
        del self.buf[: HEADER.size + size]
        return pickle.loads(data)

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: the call is abandoned wherever it is
        self.proc.wait()

    def close(self) -> None:
        self.stdin.close()  # an idle worker exits at end of input
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.kill()


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
