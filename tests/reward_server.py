"""A real reward server for the remote-reward tests, with faults on a schedule.

Each request's row is keyed `step/prompt_id/sample_idx`; the k-th request for a row
(k = 1, 2, ...) gets the k-th action of its schedule (`rows[key]`, else `default`; past
the end of the list, its last action). Actions: `ok` (score the row), an HTTP status
such as `503` or `400`, `slow` (answer after `slow_s`, beyond the client's timeout) and
`drop` (close the connection without a reply). With `kill_at` = N, the N-th request of
all SIGKILLs the process group `kill_pgid` before its reply: a run dying mid-score. Every
request is appended to a JSON-lines log: time, row key, its attempt number, the action,
whether the bearer token matched and the keys of each of its images.

The score of a row is a pure function of its response text, so tests can recompute it.
A row with images is answered with how many it had (`images`) and how many of them the
server read whose bytes hash to their `sha256` (`verified`): from the file at `path`, or
from `base64`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def score_of(response: str) -> float:
    """The server's reward: the share of characters with an even code point."""
    return sum(ord(c) % 2 == 0 for c in response) / max(1, len(response))


def verified(images: list[dict[str, str]]) -> int:
    """How many of a request's images the server reads with bytes matching `sha256`."""
    n = 0
    for im in images:
        data = base64.b64decode(im["base64"]) if "base64" in im else Path(im["path"]).read_bytes()
        n += hashlib.sha256(data).hexdigest() == im["sha256"]
    return n


@dataclass
class Schedule:
    default: list[str] = field(default_factory=lambda: ["ok"])
    rows: dict[str, list[str]] = field(default_factory=dict)
    slow_s: float = 3.0
    kill_at: int | None = None
    kill_pgid: int | None = None
    token: str | None = None
    """Expected bearer token (None: not checked); a mismatch is answered 401."""


class RewardServer:
    """`with RewardServer(schedule, log_path) as srv:` serves on `srv.url` in a thread."""

    def __init__(self, schedule: Schedule, log_path: Path) -> None:
        self.schedule = schedule
        self.log_path = log_path
        self.attempts: dict[str, int] = {}
        self.requests = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def __enter__(self) -> RewardServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def log(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return [json.loads(x) for x in self.log_path.read_text().splitlines()]

    def _action(self, key: str) -> tuple[int, str]:
        with self._lock:
            k = self.attempts[key] = self.attempts.get(key, 0) + 1
            plan = self.schedule.rows.get(key, self.schedule.default)
            action = plan[min(k, len(plan)) - 1]
            self.requests += 1
            if self.requests == self.schedule.kill_at:
                action = "kill"
            return k, action

    def _record(self, rec: dict[str, Any]) -> None:
        with self._lock, open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = f"{body['step']}/{body['prompt_id']}/{body['sample_idx']}"
                auth = self.headers.get("Authorization")
                token_ok = (
                    server.schedule.token is None or auth == f"Bearer {server.schedule.token}"
                )
                attempt, action = server._action(key)
                if not token_ok:
                    action = "401"
                server._record(
                    {
                        "t": round(time.time(), 3),
                        "row": key,
                        "attempt": attempt,
                        "action": action,
                        "token_ok": token_ok,
                        "header_row": self.headers.get("X-Rftpipe-Row"),
                        "image_keys": [sorted(im) for im in body.get("images", [])],
                    }
                )
                if action == "kill":
                    os.killpg(server.schedule.kill_pgid, signal.SIGKILL)
                    action = "ok"
                if action == "drop":
                    self.close_connection = True
                    return
                if action == "slow":
                    time.sleep(server.schedule.slow_s)
                    action = "ok"
                if action == "ok":
                    s = score_of(body["response"])
                    reply = {"score": s, "length": len(body["response"])}
                    if images := body.get("images"):
                        reply |= {"images": len(images), "verified": verified(images)}
                    self._reply(200, reply)
                else:
                    self._reply(int(action), {"error": f"scheduled {action}"})

            def _reply(self, code: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a `slow` reply past its timeout)

        return Handler
