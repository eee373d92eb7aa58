"""Environments in worker processes (`rollout.env.workers`), every call under a timeout that
really stops it.

Environments keep state across turns, so unlike the reward pool's stateless calls each
environment lives in one worker for its whole episode; a worker holds many. A turn's steps
go out together (`step_all`): each worker answers its own queue one call at a time, the
workers in parallel. A call that outlives `rollout.env.timeout_s` cannot be stopped from
inside Python, so its worker is SIGKILLed and replaced, and the worker's other environments
are rebuilt in the new one by replaying their recorded actions through `reset` and `step`
(each answer checked against the record, as after a restart); the timed-out call, and its
episode, fail with `EnvTimeout` and the run's `rollout.env.on_error` policy decides.

A worker is a `rftpipe.workers` process running ``python -m rftpipe.envs.worker``: it
imports the user's module, never the run's torch, and it dies with the run.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import selectors
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rftpipe.config.schema import EnvConfig
from rftpipe.envs.base import Environment, Task, call
from rftpipe.envs.worker import encode
from rftpipe.errors import UserError
from rftpipe.workers import WorkerGone, WorkerProcess

WORKER_START_S = 120.0
"""How long a new worker may take to start (not a call's time)."""


class EnvTimeout(Exception):
    """An environment call outlived `rollout.env.timeout_s`; its worker was killed."""


class EnvFailed(Exception):
    """An environment raised inside its worker (the message is its `Type: message`)."""


class _Worker(WorkerProcess):
    """One environment worker (`rftpipe.envs.worker`), started and ready."""

    def __init__(self) -> None:
        super().__init__("rftpipe.envs.worker", encode, json.loads)
        self.send(["init", list(sys.path)])
        reply = self.wait(WORKER_START_S)
        if reply is None or reply[0] != "ready":
            self.kill()
            raise RuntimeError(f"environment worker {self.pid} did not start")


@dataclass
class _Record:
    """What rebuilds an environment in a fresh worker: how it was made and reset, and every
    step since with its answer."""

    worker: int
    config: dict[str, Any]
    """What `make` built it from (`_config`: the pool's environment, or a row's)."""
    task: dict[str, Any] | None = None
    seed: int = 0
    steps: list[tuple[str, Any]] = field(default_factory=list)
    lost: str | None = None
    """Why it cannot be called any more (its call timed out)."""
    replayable: bool = True


class EnvPool:
    """`workers` processes holding the environments of `cfg`."""

    def __init__(self, cfg: EnvConfig, workers: int, timeout_s: float) -> None:
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.workers = [_Worker() for _ in range(workers)]
        self.records: dict[int, _Record] = {}
        self._next = 0

    # -- environments --------------------------------------------------------------------
    def make(self, cfg: EnvConfig | None = None) -> RemoteEnv:
        """A new environment in a worker: the pool's, or the one `cfg` names (a dataset
        row's `env_class`, `rftpipe.envs.loader.row_env`)."""
        env_id, self._next = self._next, self._next + 1
        config = _config(cfg or self.cfg)
        self.records[env_id] = _Record(worker=env_id % len(self.workers), config=config)
        (out,) = self.call_many([(env_id, "make", [config])])
        if isinstance(out, EnvFailed):
            # Building it is the config's business (the loader's one-line errors).
            raise UserError(str(out).removeprefix("UserError: "))
        if isinstance(out, BaseException):
            raise out
        self.records[env_id].replayable = bool(out["replayable"])
        return RemoteEnv(self, env_id, self.records[env_id].replayable, str(out["name"]))

    def call_many(self, calls: Sequence[tuple[int, str, list[Any]]]) -> list[Any]:
        """Each call's answer, or its EnvTimeout / EnvFailed; the workers run in parallel,
        each one call at a time."""
        out: list[Any] = [None] * len(calls)
        queues: dict[int, list[int]] = {}
        for i, (env_id, _, _) in enumerate(calls):
            rec = self.records[env_id]
            if rec.lost is not None:
                out[i] = EnvTimeout(rec.lost)
            else:
                queues.setdefault(rec.worker, []).append(i)
        busy: dict[int, tuple[int, float]] = {}  # worker -> (call index, deadline)
        with selectors.DefaultSelector() as sel:
            while queues or busy:
                for w in [w for w in queues if w not in busy]:
                    i = queues[w].pop(0)
                    if not queues[w]:
                        del queues[w]
                    env_id, kind, args = calls[i]
                    self.workers[w].send([kind, env_id, *args])
                    busy[w] = (i, time.monotonic() + self.timeout_s)
                    sel.register(self.workers[w].fd, selectors.EVENT_READ, w)
                now = time.monotonic()
                sel.select(timeout=max(0.0, min(d for _, d in busy.values()) - now))
                for w, (i, deadline) in list(busy.items()):
                    try:
                        reply = self.workers[w].poll()
                    except WorkerGone as exc:
                        reply, deadline = None, 0.0  # died on its own: as a timeout
                        why = str(exc)
                    else:
                        why = f"{calls[i][1]} took over rollout.env.timeout_s={self.timeout_s}"
                    if reply is not None:
                        out[i] = self._answer(calls[i], reply)
                    elif time.monotonic() >= deadline:
                        out[i] = EnvTimeout(why)
                        sel.unregister(self.workers[w].fd)
                        self._replace(w, lost=calls[i][0], why=why)
                        del busy[w]
                        continue
                    else:
                        continue
                    sel.unregister(self.workers[w].fd)
                    del busy[w]
        return out

    def _answer(self, c: tuple[int, str, list[Any]], reply: list[Any]) -> Any:
        env_id, kind, args = c
        if reply[0] != "ok":
            return EnvFailed(reply[1])
        rec = self.records[env_id]
        if kind == "reset":
            rec.task, rec.seed, rec.steps = args[0], args[1], []
        elif kind == "step":
            rec.steps.append((args[0], reply[1]))
        elif kind == "close":
            del self.records[env_id]
        return reply[1]

    def _replace(self, w: int, lost: int, why: str) -> None:
        """Kill worker `w`, start another, and rebuild its environments there (all but the
        one whose call timed out, which is lost)."""
        self.workers[w].kill()
        self.workers[w] = _Worker()
        self.records[lost].lost = why
        for env_id, rec in self.records.items():
            if rec.worker != w or rec.lost is not None:
                continue
            if not rec.replayable:
                # Its state lived in the killed worker and it cannot be replayed.
                rec.lost = f"lost with worker {w}, killed on another call's timeout"
                continue
            self._rebuild(env_id, rec)

    def _rebuild(self, env_id: int, rec: _Record) -> None:
        worker = self.workers[rec.worker]

        path = rec.config["path"]

        def ask(msg: list[Any]) -> Any:
            worker.send(msg)
            reply = worker.wait(self.timeout_s)
            if reply is None or reply[0] != "ok":
                raise UserError(
                    f"rollout.env.path {path}: rebuilding an environment in a new "
                    f"worker failed at {msg[0]}: {reply[1] if reply else 'timed out'}"
                )
            return reply[1]

        ask(["make", env_id, rec.config])
        if rec.task is None:
            return
        ask(["reset", env_id, rec.task, rec.seed])
        for action, recorded in rec.steps:
            if ask(["step", env_id, action]) != recorded:
                raise UserError(
                    f"rollout.env.path {path}: replaying an environment's recorded "
                    "actions in a new worker (its old one was killed on a timeout) gave "
                    "another answer: the environment is not deterministic given its seed"
                )

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []


def _config(cfg: EnvConfig) -> dict[str, Any]:
    return {
        "path": cfg.path,
        "max_turns": cfg.max_turns,
        "kwargs": dict(cfg.kwargs),
        "tool_parser": cfg.tool_parser,
    }


class RemoteEnv:
    """An environment in a worker process, called like a local one."""

    def __init__(self, pool: EnvPool, env_id: int, replayable: bool, class_name: str) -> None:
        self.pool, self.env_id = pool, env_id
        self.class_name = class_name
        """The environment's class in the worker (what errors name)."""
        self.replayable = replayable
        """What the environment in the worker declares (`replayable = False`: see
        `rftpipe.stages.episodes`)."""

    def _one(self, kind: str, args: list[Any]) -> Any:
        (out,) = self.pool.call_many([(self.env_id, kind, args)])
        if isinstance(out, BaseException):
            raise out
        return out

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        messages, info = self._one("reset", [dataclasses.asdict(task), seed])
        return messages, info

    def step(self, action_text: str) -> Any:
        return self._one("step", [action_text])

    def restore(self, messages: list[dict[str, Any]], turn_infos: list[str]) -> None:
        self._one("restore", [messages, turn_infos])

    def close(self) -> None:
        if self.env_id in self.pool.records and self.pool.records[self.env_id].lost is None:
            self._one("close", [])
        else:
            self.pool.records.pop(self.env_id, None)


def env_name(env: Environment) -> str:
    """The environment's class name, as errors name it (the remote one's, for a worker's)."""
    return env.class_name if isinstance(env, RemoteEnv) else type(env).__name__


def step_all(pairs: Sequence[tuple[Environment, str]]) -> list[Any]:
    """Each environment's answer to its action, or the exception it raised: the remote ones
    together (their workers in parallel), the local ones in this process, in turn."""
    out: list[Any] = [None] * len(pairs)
    remote: dict[int, list[int]] = {}
    pools: dict[int, EnvPool] = {}
    for i, (env, action) in enumerate(pairs):
        if isinstance(env, RemoteEnv):
            remote.setdefault(id(env.pool), []).append(i)
            pools[id(env.pool)] = env.pool
            continue
        try:
            out[i] = call(env.step, action)
        except Exception as exc:  # the environment's own failure: the caller's policy decides
            out[i] = exc
    for key, idx in remote.items():
        answers = pools[key].call_many(
            [(pairs[i][0].env_id, "step", [pairs[i][1]]) for i in idx]  # type: ignore[attr-defined]  # RemoteEnv, checked above
        )
        for i, a in zip(idx, answers, strict=True):
            out[i] = a
    return out


_POOLS: dict[str, EnvPool] = {}


def shared_pool(cfg: EnvConfig) -> EnvPool:
    """This process's pool for `cfg` (started once, closed at exit)."""
    key = json.dumps([_config(cfg), cfg.workers, cfg.timeout_s], sort_keys=True, default=str)
    if key not in _POOLS:
        if not _POOLS:
            atexit.register(_close_all)
        _POOLS[key] = EnvPool(cfg, cfg.workers, cfg.timeout_s)
    return _POOLS[key]


def _close_all() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
