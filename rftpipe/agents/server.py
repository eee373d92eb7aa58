"""The OpenAI-compatible endpoint the rollout stage serves while it runs (`rollout.agent`), so
that an agent written against ``openai.AsyncOpenAI(base_url=..., api_key=...)`` is trained
unchanged.

The server does not generate. It parses and validates each request, hands it to the rollout
stage as a `PendingCall` through a `queue.Queue` (the inbox), and writes the HTTP response
when the stage answers. The stage batches the calls of many episodes into one engine call,
so any number of requests wait at once: each handler awaits its own answer on the server's
event loop, which runs in a daemon thread of its own (aiohttp) so that the stage's thread
never blocks on a socket.

Each episode's agent gets its own bearer key (`Endpoint.open_episode`): the key is how a
call is tagged with its episode, so a key must never reach another episode, a log line, an
error body or an exception's text. Keys are held as SHA-256 digests only, looked up by
digest (no comparison whose time depends on how much of a guessed key is right). An episode
has at most one call in flight: an agent loop calls, waits and calls again, and a second
concurrent call would make its turns' order ambiguous (409).

The served policy always samples at the run's own temperature and top_p: RL must train on
the distribution it sampled from. The request's sampling values are passed through in the
call for the stage to decide on (it honours `stop` and `max_tokens`), never refused; other
sampling knobs (top_k, penalties, seed, response_format, structured outputs, ...) are
ignored for the same reason. What the
server refuses is what it cannot answer truthfully: more than `Limits.max_n`
choices, top-k logprobs, prompt logprobs, images and audio.

Routes (every one needs ``Authorization: Bearer <key>``):

- ``GET /v1/models``: the served model.
- ``POST /v1/chat/completions``: OpenAI's chat completion, with vLLM's ``return_token_ids``
  extension (``prompt_token_ids`` on the response, ``token_ids`` on its choice). With
  ``stream: true`` the whole answer goes as server-sent chunks (the stage answers a call
  index at once, so nothing is gained by streaming token by token).
- ``POST /inference/v1/generate``: vLLM's token-in/token-out endpoint
  (``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``; `renderers.client` posts
  to it through an ``AsyncOpenAI`` client with its ``/v1`` suffix removed). Request:
  ``token_ids`` (the prompt, required), ``sampling_params`` (required: ``max_tokens``,
  ``temperature``, ``top_p``, ``stop`` and ``n`` honoured as in the chat route;
  ``logprobs`` null for none, 0 or 1 for the sampled token's; the rest ignored),
  ``model`` (optional; checked when given), ``request_id`` (echoed, as vLLM does, as
  ``generate-tokens-<id>``; an ``X-Request-Id`` header wins), ``return_token_ids``,
  ``output_mode`` (``"tokens"`` or ``"text"``). Refused: ``stream: true``, ``features`` and
  ``content_parts`` (multimodal), ``sampling_params.logprobs`` above 1,
  ``prompt_logprobs``, ``prompt_logprob_token_ids``, ``logprob_token_ids``, ``n`` above
  `Limits.max_n`. Ignored: ``stop_token_ids`` (the stage stops at the model's own end
  tokens), ``cache_salt``, ``priority``, ``kv_transfer_params`` and the other sampling
  knobs. Response: ``request_id``, ``model``, ``created``, ``output_mode``, ``usage``,
  ``prompt_token_ids`` (only with ``return_token_ids``) and one choice with ``index``,
  ``finish_reason`` (``stop`` or ``length``: the token route has no tool calls),
  ``stop_reason`` (null), ``token_ids``, ``logprobs`` and, in ``text`` mode, ``text``.
  ``logprobs.content[i]`` is vLLM's tokens-mode entry (``token_id``, ``logprob``, ``rank``
  null, ``top_logprobs`` empty) plus ``token: "token_id:<id>"``, the older shape that
  `renderers.client` checks; in ``text`` mode it is the chat route's entry.

Every error is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, its
message one line naming the field at fault.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import math
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles a chat call may carry."""

FINISH_REASONS = ("stop", "length", "tool_calls")
"""What an `Answer` may give as its finish reason."""

_SHUTDOWN_S = 5.0
"""How long `Endpoint.stop` lets a request still being read finish before its connection is
cut (every waiting call has been refused by then, so their answers are written at once)."""

_READ_CHUNK = 1 << 16

_dumps = functools.partial(json.dumps, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """What one request may ask for; a request over a limit is refused, never truncated."""

    max_body_bytes: int = 1 << 20
    """A larger body: 413 (its Content-Length, or the bytes actually read)."""
    max_messages: int = 256
    """More messages in one chat call: 400 naming ``messages``."""
    max_tokens: int = 4096
    """A call's ``max_tokens`` (or ``max_completion_tokens``) above it: 400 naming it."""
    max_n: int = 1
    """``n`` above it: 400 naming ``n`` (each choice would be another sample of the episode;
    not supported yet)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatCall:
    """A parsed and validated ``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    """As sent: roles among `ROLES`, content a string, null or a list of text parts
    (``{"type": "text", "text": str}``); an assistant message may carry ``tool_calls``, a
    tool message carries its ``tool_call_id``."""
    tools: list[dict[str, Any]] | None
    """As sent (each ``{"type": "function", "function": {"name": ..., ...}}``)."""
    tool_choice: Any
    """As sent (None when absent)."""
    max_tokens: int | None
    """``max_completion_tokens`` if given, else ``max_tokens``; None: the run's own."""
    temperature: float | None
    """As asked; the stage decides what it samples at (the run's own, for RL)."""
    top_p: float | None
    """As asked; the stage decides, as for `temperature`."""
    stop: list[str]
    """Stop strings (the request's string or list; none when absent)."""
    n: int
    """Choices asked for (at most `Limits.max_n`)."""
    logprobs: bool
    """Whether the response carries each sampled token's logprob."""
    return_token_ids: bool
    """vLLM's extension (clients send it in ``extra_body``): the response carries the
    prompt's and the sample's token ids."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenCall:
    """A parsed and validated ``POST /inference/v1/generate`` (vLLM's token-in/token-out
    shape): the prompt already rendered to tokens by the agent."""

    prompt_token_ids: list[int]
    """The request's ``token_ids``."""
    max_tokens: int | None
    """``sampling_params.max_tokens``; None: the run's own."""
    temperature: float | None
    """As asked; the stage decides, as for `ChatCall.temperature`."""
    top_p: float | None
    """As asked; the stage decides."""
    stop: list[str]
    """``sampling_params.stop``, as a list."""
    logprobs: bool
    """Whether the response carries the sampled tokens' logprobs (``sampling_params.logprobs``
    0 or 1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Answer:
    """What the stage answers a call with. With logprobs asked for, `logprobs` and
    `token_texts` have one entry per sampled token."""

    prompt_token_ids: list[int]
    """The whole sequence the engine saw."""
    token_ids: list[int]
    """The sampled tokens."""
    logprobs: list[float]
    """One per sampled token (a non-finite one is sent as -9999.0, as vLLM does)."""
    token_texts: list[str]
    """Each sampled token's text (``logprobs.content[i].token``)."""
    text: str
    """The sampled text, decoded."""
    content: str | None
    """The message content: `text` with tool-call markup removed (None when only tool
    calls)."""
    tool_calls: list[tuple[str, str, str]]
    """``(id, function name, arguments JSON string)``; the ids are the stage's
    (deterministic), the server never invents them."""
    finish_reason: str
    """One of `FINISH_REASONS`."""


class _Refusal(Exception):
    """An error response to send: status, one-line message, the field at fault."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        if self.status == 401:
            kind = "authentication_error"
        elif self.status >= 500:
            kind = "server_error"
        else:
            kind = "invalid_request_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=self.status, dumps=_dumps)


class PendingCall:
    """One call waiting for the stage: take it from the inbox, then `answer` or `refuse`
    it, from any thread. The first of those (or the client going away, or the server
    stopping) settles it; anything later is a no-op."""

    __slots__ = ("episode", "call", "_loop", "_future", "_lock", "_done", "_release")

    episode: Hashable
    """What the call's key was opened for (`Endpoint.open_episode`)."""
    call: ChatCall | TokenCall
    """The parsed request."""

    def __init__(
        self,
        *,
        episode: Hashable,
        call: ChatCall | TokenCall,
        loop: asyncio.AbstractEventLoop,
        release: Callable[[PendingCall], None],
    ) -> None:
        self.episode = episode
        self.call = call
        self._loop = loop
        # Created here, on the server's loop (the handler's thread); settled only through
        # `call_soon_threadsafe`.
        self._future: asyncio.Future[Answer | _Refusal] = loop.create_future()
        self._lock = threading.Lock()
        self._done = False
        self._release = release

    @property
    def done(self) -> bool:
        """Answered, refused, or nobody waits any more (the client went away, the server
        stopped)."""
        return self._done

    def answer(self, a: Answer) -> None:
        """Send `a` as the 200 response. A malformed answer (a stage bug) is refused with
        500 and raises ValueError here, whether or not the client still waits."""
        problem = _answer_problem(self.call, a)
        if problem is not None:
            self._settle(_Refusal(500, "the rollout stage gave a malformed answer"))
            raise ValueError(f"malformed answer: {problem}")
        self._settle(a)

    def refuse(self, status: int, message: str) -> None:
        """Send an OpenAI-shaped error: `status` (4xx or 5xx) and a one-line `message`."""
        if not 400 <= status <= 599:
            raise ValueError(f"an error status is 4xx or 5xx, not {status}")
        self._settle(_Refusal(status, " ".join(message.split())))

    def _settle(self, outcome: Answer | _Refusal) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._release(self)
        # A closed loop: the server has stopped and nobody waits for this any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, outcome)

    def _deliver(self, outcome: Answer | _Refusal) -> None:
        if not self._future.done():  # cancelled: the client went away meanwhile
            self._future.set_result(outcome)

    def _abandon(self) -> None:
        """The client went away: nothing to send any more."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._release(self)

    def __repr__(self) -> str:
        return f"PendingCall(episode={self.episode!r}, call={type(self.call).__name__})"


class Endpoint:
    """The server: `start` it, open a key per episode, take `PendingCall`s from `inbox`,
    `stop` it at the end of the stage."""

    def __init__(
        self,
        *,
        model: str,
        inbox: queue.Queue[PendingCall],
        limits: Limits = Limits(),
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.model = model
        """The served model's name: the one `model` a request may name."""
        self.inbox = inbox
        """Where each validated call goes for the stage to answer."""
        self.limits = limits
        """What one request may ask for."""
        self.host = host
        """The address listened on."""
        self.port = port
        """The port asked for (0: one the OS picks at bind time); the bound one after
        `start`."""
        self._lock = threading.Lock()
        self._episodes: dict[bytes, Hashable] = {}  # key digest -> episode
        self._digests: dict[Hashable, bytes] = {}  # episode -> its key's digest
        self._pending: dict[Hashable, PendingCall] = {}
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    # --- the stage's side ---

    def start(self) -> None:
        """Start the server thread; return once it listens. Raises what binding raised."""
        if self._thread is not None or self._stopped:
            raise RuntimeError("an Endpoint starts once")
        bound: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(bound,), name="rftpipe-agent-endpoint", daemon=True
        )
        self._thread.start()
        try:
            self.port = bound.result()
        except BaseException:
            self._thread.join()
            raise

    @property
    def root_url(self) -> str:
        """``http://HOST:PORT``: where ``/inference/v1/generate`` is."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1``: an OpenAI client's ``base_url``."""
        return f"{self.root_url}/v1"

    def open_episode(self, episode: Hashable) -> str:
        """A new random bearer key bound to `episode` (one key per episode at a time)."""
        key = secrets.token_urlsafe(32)
        digest = _digest(key)
        with self._lock:
            if self._stopped:
                raise RuntimeError("the endpoint is stopped")
            if episode in self._digests:
                raise ValueError(f"episode {episode!r} is already open")
            self._digests[episode] = digest
            self._episodes[digest] = episode
        return key

    def close_episode(self, episode: Hashable) -> None:
        """`episode`'s key stops working (401); its waiting call, if any, is refused (410).
        Closing an episode that is not open does nothing."""
        with self._lock:
            digest = self._digests.pop(episode, None)
            if digest is not None:
                del self._episodes[digest]
            pending = self._pending.pop(episode, None)
        if pending is not None:
            pending.refuse(410, "the call's episode ended before it was answered")

    def stop(self) -> None:
        """Refuse the waiting calls (503), close the server, join its thread. Idempotent."""
        with self._lock:
            stopping = not self._stopped
            self._stopped = True
            pending = list(self._pending.values())
            self._episodes.clear()
            self._digests.clear()
        for call in pending:
            call.refuse(503, "the server is shutting down")
        loop, event, thread = self._loop, self._stopping, self._thread
        if stopping and loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(event.set)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # --- the server's thread ---

    def _run(self, bound: concurrent.futures.Future[int]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(bound))
        except BaseException as exc:
            if bound.done():
                raise
            bound.set_exception(exc)  # a failed start: `start`'s caller sees why
        finally:
            # What is left (a handler still reading when the shutdown timed out) ends here.
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self, bound: concurrent.futures.Future[int]) -> None:
        self._stopping = asyncio.Event()
        app = web.Application(middlewares=[_http_errors])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/inference/v1/generate", self._generate)
        runner = web.AppRunner(
            app,
            handle_signals=False,  # not the main thread; the run owns its signals
            access_log=None,  # one line per call would flood the run's log
            # A client that goes away cancels its handler, which marks its call done.
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_S,
        )
        await runner.setup()
        try:
            # Port 0 is bound here, by the OS: no window between choosing and binding.
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            bound.set_result(int(runner.addresses[0][1]))
            await self._stopping.wait()
        finally:
            await runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._authenticate(request)
        except _Refusal as refusal:
            return refusal.response()
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "rftpipe"}
        return web.json_response({"object": "list", "data": [card]}, dumps=_dumps)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_call(request, self._parse_chat, self._chat_body)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_call(request, self._parse_tokens, self._tokens_body)

    async def _serve_call(
        self,
        request: web.Request,
        parse: Callable[[dict[str, Any]], tuple[ChatCall | TokenCall, dict[str, Any]]],
        render: Callable[[Any, dict[str, Any], Answer], dict[str, Any]],
    ) -> web.StreamResponse:
        """Authenticate, read, validate, hand the call to the stage and wait for its answer;
        the checks in the order the module docstring's errors list them."""
        try:
            digest = self._authenticate(request)
            body = await self._read_json(request)
            call, shape = parse(body)
            shape["request_id"] = request.headers.get("X-Request-Id", shape.get("request_id"))
            pending = self._register(digest, call)
        except _Refusal as refusal:
            return refusal.response()
        try:
            outcome = await pending._future
        except asyncio.CancelledError:
            pending._abandon()
            raise
        if isinstance(outcome, _Refusal):
            return outcome.response()
        body = render(call, shape, outcome)
        if shape.get("stream"):
            return await _streamed(request, body, bool(shape.get("stream_usage")))
        return web.json_response(body, dumps=_dumps)

    def _authenticate(self, request: web.Request) -> bytes:
        """The digest of the request's live key; 401 otherwise (the key never echoed)."""
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise _Refusal(401, "missing bearer key: send the header `Authorization: Bearer <key>`")
        digest = _digest(key)
        with self._lock:
            if digest not in self._episodes:
                raise _Refusal(401, "the bearer key is not valid (unknown, or its episode ended)")
        return digest

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        limit = self.limits.max_body_bytes
        too_large = _Refusal(413, f"the request body is over this server's limit of {limit} bytes")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        # Read by hand rather than `request.read()`: the limit holds for a chunked body too,
        # and for what a compressed one inflates to.
        data = bytearray()
        while chunk := await request.content.read(_READ_CHUNK):
            data += chunk
            if len(data) > limit:
                raise too_large
        try:
            body = json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            raise _Refusal(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _Refusal(400, "the request body is not a JSON object")
        return body

    def _register(self, digest: bytes, call: ChatCall | TokenCall) -> PendingCall:
        """Hand `call` to the stage as its episode's one call in flight."""
        with self._lock:
            if self._stopped:
                raise _Refusal(503, "the server is shutting down")
            # Checked again: the episode may have ended while the body was read.
            episode = self._episodes.get(digest)
            if episode is None:
                raise _Refusal(401, "the bearer key is not valid (unknown, or its episode ended)")
            if episode in self._pending:
                raise _Refusal(
                    409, "this episode already has a call waiting: one call at a time per episode"
                )
            assert self._loop is not None
            pending = PendingCall(
                episode=episode, call=call, loop=self._loop, release=self._release
            )
            self._pending[episode] = pending
        try:
            self.inbox.put_nowait(pending)
        except queue.Full:
            pending._abandon()
            raise _Refusal(503, "the rollout stage has too many calls waiting") from None
        return pending

    def _release(self, call: PendingCall) -> None:
        with self._lock:
            if self._pending.get(call.episode) is call:
                del self._pending[call.episode]

    # --- requests and responses ---

    def _check_model(self, body: dict[str, Any], *, required: bool) -> None:
        model = body.get("model")
        if model is None:
            if required:
                raise _Refusal(400, "missing field `model`", param="model")
            return
        if model != self.model:
            name = " ".join(str(model).split())[:200]
            raise _Refusal(
                404, f"The model '{name}' does not exist", param="model", code="model_not_found"
            )

    def _parse_chat(self, body: dict[str, Any]) -> tuple[ChatCall, dict[str, Any]]:
        self._check_model(body, required=True)
        stream = _bool(body.get("stream"), "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _Refusal(400, "`stream_options` must be an object", param="stream_options")
        messages = _messages(body.get("messages"), self.limits.max_messages)
        # OpenAI's newer name wins; the older one is what most agents still send.
        field = (
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        max_tokens = _max_tokens(body, field, self.limits.max_tokens)
        n = _n(body.get("n"), "n", self.limits.max_n)
        top_logprobs = _int(body.get("top_logprobs"), "top_logprobs", minimum=0)
        if top_logprobs:
            raise _Refusal(
                400, "`top_logprobs` is not supported (only 0 or null)", param="top_logprobs"
            )
        call = ChatCall(
            messages=messages,
            tools=_tools(body.get("tools")),
            tool_choice=body.get("tool_choice"),
            max_tokens=max_tokens,
            temperature=_number(body.get("temperature"), "temperature"),
            top_p=_number(body.get("top_p"), "top_p"),
            stop=_stop(body.get("stop"), "stop"),
            n=n,
            logprobs=_bool(body.get("logprobs"), "logprobs"),
            return_token_ids=_bool(body.get("return_token_ids"), "return_token_ids"),
        )
        usage = _bool(options.get("include_usage"), "stream_options.include_usage")
        return call, {"stream": stream, "stream_usage": usage}

    def _parse_tokens(self, body: dict[str, Any]) -> tuple[TokenCall, dict[str, Any]]:
        self._check_model(body, required=False)
        if body.get("stream") not in (None, False):
            raise _Refusal(
                400, "streaming is not supported: `stream` must be false", param="stream"
            )
        for name in ("features", "content_parts"):
            if body.get(name) is not None:
                raise _Refusal(400, f"multimodal input (`{name}`) is not supported", param=name)
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise _Refusal(
                400, "`token_ids` must be a non-empty list of token ids", param="token_ids"
            )
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            raise _Refusal(400, "`sampling_params` must be an object", param="sampling_params")
        max_tokens = _max_tokens(
            sp, "max_tokens", self.limits.max_tokens, prefix="sampling_params."
        )
        _n(sp.get("n"), "sampling_params.n", self.limits.max_n)
        logprobs = _int(sp.get("logprobs"), "sampling_params.logprobs", minimum=-1)
        if logprobs is not None and logprobs not in (0, 1):
            raise _Refusal(
                400,
                "top logprobs are not supported: `sampling_params.logprobs` may be null, 0 or 1",
                param="sampling_params.logprobs",
            )
        for name in ("prompt_logprobs", "prompt_logprob_token_ids", "logprob_token_ids"):
            if sp.get(name) is not None:
                raise _Refusal(
                    400,
                    f"`sampling_params.{name}` is not supported",
                    param=f"sampling_params.{name}",
                )
        mode = body.get("output_mode", "tokens")
        if mode not in ("tokens", "text"):
            raise _Refusal(400, "`output_mode` must be 'tokens' or 'text'", param="output_mode")
        request_id = body.get("request_id")
        if request_id is not None and not isinstance(request_id, str):
            raise _Refusal(400, "`request_id` must be a string", param="request_id")
        call = TokenCall(
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            temperature=_number(sp.get("temperature"), "sampling_params.temperature"),
            top_p=_number(sp.get("top_p"), "sampling_params.top_p"),
            stop=_stop(sp.get("stop"), "sampling_params.stop"),
            logprobs=logprobs is not None,
        )
        shape = {
            "output_mode": mode,
            "return_token_ids": _bool(body.get("return_token_ids"), "return_token_ids"),
            "request_id": request_id,
        }
        return call, shape

    def _chat_body(self, call: ChatCall, shape: dict[str, Any], a: Answer) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": a.content}
        if a.tool_calls:
            message["tool_calls"] = [
                {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
                for id_, name, args in a.tool_calls
            ]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": a.finish_reason,
            "logprobs": {"content": _text_logprobs(a)} if call.logprobs else None,
        }
        body: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": _usage(a),
        }
        if call.return_token_ids:
            choice["token_ids"] = a.token_ids
            body["prompt_token_ids"] = a.prompt_token_ids
        return body

    def _tokens_body(self, call: TokenCall, shape: dict[str, Any], a: Answer) -> dict[str, Any]:
        text_mode = shape["output_mode"] == "text"
        logprobs: dict[str, Any] | None = None
        if call.logprobs:
            content = (
                _text_logprobs(a)
                if text_mode
                else [
                    {
                        "token_id": t,
                        "logprob": _finite(lp),
                        "rank": None,
                        "top_logprobs": [],
                        # What vLLM sent before `token_id` (return_tokens_as_token_ids), and
                        # what `renderers.client` checks.
                        "token": f"token_id:{t}",
                    }
                    for t, lp in zip(a.token_ids, a.logprobs, strict=True)
                ]
            )
            logprobs = {"content": content}
        choice: dict[str, Any] = {
            "index": 0,
            # vLLM's generate never says "tool_calls": tool calls are the client's parsing.
            "finish_reason": "stop" if a.finish_reason == "tool_calls" else a.finish_reason,
            "stop_reason": None,
            "token_ids": a.token_ids,
            "logprobs": logprobs,
        }
        if text_mode:
            choice["text"] = a.text
        return {
            "request_id": f"generate-tokens-{shape['request_id'] or uuid.uuid4().hex}",
            "model": self.model,
            "created": int(time.time()),
            "output_mode": shape["output_mode"],
            "choices": [choice],
            "usage": _usage(a),
            "prompt_token_ids": a.prompt_token_ids if shape["return_token_ids"] else None,
        }


@web.middleware
async def _http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (no such route, wrong method) OpenAI-shaped too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _Refusal(exc.status, exc.reason).response()


async def _streamed(request: web.Request, body: dict[str, Any], usage: bool) -> web.StreamResponse:
    """A whole chat completion sent as server-sent events (`stream: true`): the answer
    exists in full before it is sent (the stage answers a call index at once), so it goes
    as one chunk with the message, one with the finish reason (and, with
    `stream_options.include_usage`, one with the usage), then `[DONE]`, the frames
    OpenAI's clients assemble."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    choice = body["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    head = {k: body[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    first: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
    first["logprobs"] = choice["logprobs"]
    if "token_ids" in choice:
        first["token_ids"] = choice["token_ids"]
    chunks: list[dict[str, Any]] = [{**head, "choices": [first]}]
    if "prompt_token_ids" in body:
        chunks[0]["prompt_token_ids"] = body["prompt_token_ids"]
    last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    chunks.append({**head, "choices": [last]})
    if usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    for chunk in chunks:
        await out.write(b"data: " + _dumps(chunk).encode() + b"\n\n")
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(x: float) -> float:
    """vLLM's floor for a logprob JSON cannot carry: -inf and NaN become -9999.0."""
    return -9999.0 if math.isnan(x) else max(float(x), -9999.0)


def _text_logprobs(a: Answer) -> list[dict[str, Any]]:
    return [
        {
            "token": t,
            "logprob": _finite(lp),
            "bytes": list(t.encode("utf-8", "replace")),
            "top_logprobs": [],
        }
        for t, lp in zip(a.token_texts, a.logprobs, strict=True)
    ]


def _usage(a: Answer) -> dict[str, int]:
    prompt, completion = len(a.prompt_token_ids), len(a.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _answer_problem(call: ChatCall | TokenCall, a: Answer) -> str | None:
    """Why `a` cannot answer `call`, or None."""
    if a.finish_reason not in FINISH_REASONS:
        return f"finish_reason {a.finish_reason!r} is not one of {FINISH_REASONS}"
    if call.logprobs and not len(a.logprobs) == len(a.token_texts) == len(a.token_ids):
        return (
            f"{len(a.token_ids)} token ids, {len(a.logprobs)} logprobs and "
            f"{len(a.token_texts)} token texts"
        )
    if not all(len(tc) == 3 and all(isinstance(s, str) for s in tc) for tc in a.tool_calls):
        return "each tool call is (id, name, arguments), three strings"
    return None


# --- field validation: each failure a 400 naming the field ---


def _int(value: Any, param: str, *, minimum: int) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise _Refusal(400, f"`{param}` must be an integer of at least {minimum}", param=param)
    return value


def _max_tokens(body: dict[str, Any], name: str, limit: int, *, prefix: str = "") -> int | None:
    param = prefix + name
    value = _int(body.get(name), param, minimum=1)
    if value is not None and value > limit:
        raise _Refusal(
            400, f"`{param}` {value} is above this server's limit of {limit}", param=param
        )
    return value


def _n(value: Any, param: str, limit: int) -> int:
    n = _int(value, param, minimum=1)
    if n is not None and n > limit:
        raise _Refusal(
            400,
            f"`{param}` {n} is above this server's limit of {limit} (each choice would be "
            "another sample of the episode; not supported yet)",
            param=param,
        )
    return 1 if n is None else n


def _number(value: Any, param: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Refusal(400, f"`{param}` must be a number", param=param)
    return float(value)


def _bool(value: Any, param: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _Refusal(400, f"`{param}` must be true or false", param=param)
    return value


def _stop(value: Any, param: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _Refusal(400, f"`{param}` must be a string or a list of strings", param=param)
    return value


def _messages(value: Any, limit: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _Refusal(400, "`messages` must be a non-empty list", param="messages")
    if len(value) > limit:
        raise _Refusal(
            400,
            f"{len(value)} `messages` are over this server's limit of {limit}",
            param="messages",
        )
    for i, message in enumerate(value):
        _message(message, f"messages[{i}]")
    return value


def _message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise _Refusal(400, f"`{where}` must be an object", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise _Refusal(
            400, f"`{where}.role` must be one of {', '.join(ROLES)}", param=f"{where}.role"
        )
    _content(message.get("content"), f"{where}.content")
    if message.get("name") is not None and not isinstance(message["name"], str):
        raise _Refusal(400, f"`{where}.name` must be a string", param=f"{where}.name")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise _Refusal(
                400,
                f"`{where}.tool_calls`: only assistant messages carry tool calls",
                param=f"{where}.tool_calls",
            )
        if not isinstance(tool_calls, list):
            raise _Refusal(400, f"`{where}.tool_calls` must be a list", param=f"{where}.tool_calls")
        for j, tool_call in enumerate(tool_calls):
            at = f"{where}.tool_calls[{j}]"
            function = tool_call.get("function") if isinstance(tool_call, dict) else None
            if (
                not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str)
                or not isinstance(tool_call.get("id", ""), str)
            ):
                raise _Refusal(
                    400,
                    f"`{at}` must be {{id, type: function, function: {{name, arguments}}}} with "
                    "string name and arguments",
                    param=at,
                )
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise _Refusal(
            400,
            f"`{where}.tool_call_id` must be a string (the tool call answered)",
            param=f"{where}.tool_call_id",
        )


def _content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _Refusal(
            400, f"`{where}` must be a string, null or a list of text parts", param=where
        )
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise _Refusal(400, f"`{at}` must be an object with a `type`", param=f"{at}.type")
        if kind != "text":
            name = " ".join(kind.split())[:100]
            raise _Refusal(400, f"content part type {name} is not supported", param=f"{at}.type")
        if not isinstance(part.get("text"), str):
            raise _Refusal(400, f"`{at}.text` must be a string", param=f"{at}.text")


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _Refusal(400, "`tools` must be a list", param="tools")
    for j, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise _Refusal(
                400,
                f"`tools[{j}]` must be {{type: function, function: {{name, ...}}}}",
                param=f"tools[{j}]",
            )
    return value
