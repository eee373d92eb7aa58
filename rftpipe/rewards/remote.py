"""The `remote` reward: each row POSTed to a reward server, with retries and a circuit.

A request that fails transiently (5xx, 408/429, a timeout, a refused or dropped
connection) is retried with exponential backoff and full jitter (tenacity) up to
`reward.remote.attempts` tries; a row whose tries all fail gets `reward_status` timeout or
error, for `reward.on_error` to decide. Any other 4xx means the request itself is wrong
(no retry can fix it) and fails the run naming the row. Every failed try counts towards
the circuit; `circuit_after` of them in a row, over all rows, stop the run instead of
hammering a server that is down. The bearer token is read from the environment variable
`reward.remote.token_env` and never logged or written.

A row's images travel in its request's `images` list as {sha256, path}, the file's
absolute path under the run directory, or, with `reward.remote.image_payload: base64`,
as {sha256, base64} for a server that does not share the file system.

The score stage commits what the server returned with its rows, so a committed row is
never requested again, whatever instant the run dies (`rftpipe.stages.score`).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Literal

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from rftpipe.config.schema import RemoteRewardConfig, RewardFunctionConfig
from rftpipe.errors import UserError
from rftpipe.rewards.types import Outcome, RewardSample

log = logging.getLogger(__name__)

ImagePayload = Literal["path", "base64"]
"""`reward.remote.image_payload`: how a request carries the row's images."""

#: Client errors that say "not now" rather than "wrong request": retried like a 5xx.
RETRIED_4XX = frozenset({408, 429})


class Transient(Exception):
    """A try that may succeed if repeated."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class BadRequest(Exception):
    """The server refused the request itself (4xx): never retried."""


class CircuitOpen(Exception):
    """Too many consecutive failures: the run stops."""


class _Aborted(Exception):
    """The stage already failed on another row: stop this one's tries."""


class Circuit:
    """Consecutive failed tries over all rows and threads; a success closes it again."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.failures = 0
        self.last = ""
        self._lock = threading.Lock()

    def check(self) -> None:
        with self._lock:
            if self.failures >= self.bound:
                raise CircuitOpen(self.last)

    def failed(self, why: str) -> None:
        with self._lock:
            self.failures += 1
            self.last = why

    def succeeded(self) -> None:
        with self._lock:
            self.failures = 0


def image_entries(s: RewardSample, how: ImagePayload) -> list[dict[str, str]]:
    """The row's images as its request lists them (`reward.remote.image_payload`): each
    {sha256, path} (`path`) or {sha256, base64} of the file's bytes (`base64`)."""
    if how == "path":
        return [{"sha256": im.sha256, "path": im.path} for im in s.images]
    return [
        {"sha256": im.sha256, "base64": base64.b64encode(data).decode("ascii")}
        for im, data in zip(s.images, s.image_bytes("reward.remote"), strict=True)
    ]


def payload(s: RewardSample, how: ImagePayload = "path") -> dict[str, Any]:
    """The JSON body of one row's request (`how`: `reward.remote.image_payload`)."""
    return {
        "step": s.step,
        "prompt_id": s.prompt_id,
        "sample_idx": s.sample_idx,
        "prompt": s.prompt,
        "response": s.response,
        "answer": s.answer,
        "data_source": s.data_source,
        "metadata": s.metadata,
        "finish_reason": s.finish_reason,
        "images": image_entries(s, how),
    }


def _safe_url(url: str) -> str:
    """The URL without user info or query (neither belongs in a log line)."""
    p = urllib.parse.urlsplit(url)
    host = p.hostname or ""
    return f"{p.scheme}://{host}{':' + str(p.port) if p.port else ''}{p.path}"


class RemoteReward:
    """The `remote` component: one POST per row, `concurrency` in flight."""

    def __init__(self, spec: RewardFunctionConfig, cfg: RemoteRewardConfig) -> None:
        self.spec = spec
        self.cfg = cfg
        self.where = _safe_url(cfg.url)
        self.circuit = Circuit(cfg.circuit_after)
        self._abort = threading.Event()
        if not os.environ.get(cfg.token_env):
            log.warning("reward.remote: $%s is not set: requests carry no token", cfg.token_env)

    def _headers(self, s: RewardSample) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            # Lets a server deduplicate or log by row.
            "X-Rftpipe-Row": f"{s.step}/{s.prompt_id}/{s.sample_idx}",
        }
        # Read at each request, never stored: the token stays out of every object we log.
        if token := os.environ.get(self.cfg.token_env):
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _try(self, s: RewardSample, body: bytes) -> Any:
        """One request of `s` with JSON `body`; the decoded reply, or Transient /
        BadRequest."""
        if self._abort.is_set():
            raise _Aborted
        self.circuit.check()
        req = urllib.request.Request(
            self.cfg.url,
            data=body,
            headers=self._headers(s),
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                reply = resp.read()
        except urllib.error.HTTPError as exc:
            detail = " ".join(exc.read(300).decode(errors="replace").split())
            exc.close()
            why = f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
            if 400 <= exc.code < 500 and exc.code not in RETRIED_4XX:
                raise BadRequest(why) from None
            self.circuit.failed(why)
            raise Transient(why) from None
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            timeout = isinstance(reason, TimeoutError)
            why = (
                f"timed out after {self.cfg.timeout_s:g} s"
                if timeout
                else f"{type(reason).__name__}: {reason}"
            )
            self.circuit.failed(why)
            raise Transient(why, timeout=timeout) from None
        self.circuit.succeeded()
        try:
            return json.loads(reply)
        except ValueError:
            raise Transient(f"reply is not JSON: {reply[:80]!r}") from None

    def _score_row(self, s: RewardSample) -> Outcome:
        def before_sleep(state: RetryCallState) -> None:
            log.info(
                "reward.remote: %s on %s (try %d of %d); retrying in %.2f s",
                state.outcome.exception() if state.outcome else "?",
                s.where,
                state.attempt_number,
                self.cfg.attempts,
                state.next_action.sleep if state.next_action else 0.0,
            )

        retrying = Retrying(
            stop=stop_after_attempt(self.cfg.attempts),
            wait=wait_random_exponential(multiplier=self.cfg.backoff_s, max=self.cfg.backoff_max_s),
            retry=retry_if_exception_type(Transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        # Built once, outside the tries: base64 reads the images' files a single time.
        body = json.dumps(payload(s, self.cfg.image_payload)).encode()
        try:
            return Outcome("ok", retrying(self._try, s, body))
        except Transient as exc:
            return Outcome(
                "timeout" if exc.timeout else "error",
                error=f"{exc} ({self.cfg.attempts} tries)",
            )

    def score(self, samples: Sequence[RewardSample], fail_fast: bool) -> list[Outcome | None]:
        out: list[Outcome | None] = [None] * len(samples)
        self._abort.clear()
        with ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="reward-remote") as ex:
            futures = {ex.submit(self._score_row, s): i for i, s in enumerate(samples)}
            try:
                for f in as_completed(futures):
                    i = futures[f]
                    try:
                        out[i] = o = f.result()
                    except BadRequest as exc:
                        raise UserError(
                            f"reward.remote: {self.where} refused the request of "
                            f"{samples[i].where}: {exc} (a 4xx is not retried)"
                        ) from None
                    except CircuitOpen as exc:
                        raise UserError(
                            f"reward.remote: circuit open after {self.cfg.circuit_after} "
                            f"consecutive failed requests to {self.where} (last: {exc}); the "
                            "run stopped, every committed step kept: start it again when the "
                            "server is back"
                        ) from None
                    if fail_fast and o.status != "ok":
                        break
            finally:
                # Requests not started yet are dropped; those in flight end after their try.
                self._abort.set()
                for f in futures:
                    f.cancel()
        return out
