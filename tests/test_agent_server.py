"""The agents' OpenAI-compatible endpoint (`rftpipe.agents.server`) as the official `openai`
client sees it: each call reaches the stage tagged with its key's episode, each answer its
own request, many calls wait at once, and what the server cannot or must not serve is
refused with the status and field an OpenAI client expects, never echoing a key.

A helper thread plays the rollout stage: it answers each call with an `Answer` built from
the call itself, so a call routed to the wrong request or formatted wrongly shows."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from rftpipe.agents.server import (
    Answer,
    ChatCall,
    Endpoint,
    Limits,
    PendingCall,
    TokenCall,
)

MODEL = "policy"
USER = [{"role": "user", "content": "hello"}]
WAIT_S = 10.0
"""How long a test waits for something that takes milliseconds (a loaded machine)."""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]


def echo(pending: PendingCall) -> Answer:
    """An answer made from the call: its episode and message count are in the content, the
    token ids and the tool call's arguments."""
    call = pending.call
    if isinstance(call, TokenCall):
        ids = [t + 100 for t in call.prompt_token_ids]
        texts = [f"<{t}>" for t in ids]
        return Answer(
            prompt_token_ids=call.prompt_token_ids,
            token_ids=ids,
            logprobs=[-0.25] * len(ids),
            token_texts=texts,
            text="".join(texts),
            content="".join(texts),
            tool_calls=[],
            finish_reason="length",
        )
    assert isinstance(call, ChatCall)
    n = len(call.messages)
    text = f"{pending.episode}: {n} messages"
    common: dict[str, Any] = {
        "prompt_token_ids": list(range(10 * n)),
        "token_ids": [n, 7, 9],
        "logprobs": [-0.5, -1.0, float("-inf")],
        "token_texts": ["é", " b", "c"],
    }
    if call.tools:
        args = json.dumps({"episode": str(pending.episode), "messages": n})
        return Answer(
            **common,
            text=f"<tool>{args}</tool>",
            content=None,
            tool_calls=[(f"call_{pending.episode}_{n}", call.tools[0]["function"]["name"], args)],
            finish_reason="tool_calls",
        )
    return Answer(**common, text=text, content=text, tool_calls=[], finish_reason="stop")


@contextlib.contextmanager
def serving(
    limits: Limits | None = None,
) -> Iterator[tuple[Endpoint, queue.Queue[PendingCall]]]:
    inbox: queue.Queue[PendingCall] = queue.Queue()
    endpoint = Endpoint(model=MODEL, inbox=inbox, limits=limits or Limits())
    endpoint.start()
    try:
        yield endpoint, inbox
    finally:
        endpoint.stop()
        while CLIENTS:
            CLIENTS.pop().close()


@contextlib.contextmanager
def stage(
    inbox: queue.Queue[PendingCall], answer: Callable[[PendingCall], Answer] = echo
) -> Iterator[list[PendingCall]]:
    """A thread answering every call in `inbox`; yields the calls it answered."""
    seen: list[PendingCall] = []
    stopping = threading.Event()

    def loop() -> None:
        while not stopping.is_set():
            try:
                pending = inbox.get(timeout=0.02)
            except queue.Empty:
                continue
            seen.append(pending)
            pending.answer(answer(pending))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stopping.set()
        thread.join()


@pytest.fixture
def served() -> Iterator[tuple[Endpoint, queue.Queue[PendingCall]]]:
    with serving() as pair:
        yield pair


CLIENTS: list[openai.OpenAI] = []
"""The clients `client` made, closed with their server."""


def client(endpoint: Endpoint, key: str) -> openai.OpenAI:
    CLIENTS.append(openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0))
    return CLIENTS[-1]


def in_background(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run `fn` in a thread; the returned function waits for its result (or raises its
    exception)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result() -> Any:
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the call did not return"
        if "error" in box:
            raise box["error"]
        return box["result"]

    return result


def post(url: str, key: str | None, body: Any, timeout: float = WAIT_S) -> tuple[int, Any]:
    """A plain HTTP POST: the status and the decoded JSON body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def test_models_lists_the_served_model(served: tuple[Endpoint, Any]) -> None:
    endpoint, _ = served
    models = client(endpoint, endpoint.open_episode("e")).models.list()
    assert [(m.id, m.owned_by) for m in models.data] == [(MODEL, "rftpipe")]
    assert endpoint.base_url == f"http://127.0.0.1:{endpoint.port}/v1"
    assert endpoint.root_url == f"http://127.0.0.1:{endpoint.port}"


def test_chat_without_tools(served: tuple[Endpoint, queue.Queue[PendingCall]]) -> None:
    endpoint, inbox = served
    messages = [{"role": "system", "content": "be brief"}, *USER]
    with stage(inbox) as seen:
        r = client(endpoint, endpoint.open_episode("e1")).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, temperature=0.3, stop="END"
        )
    (choice,) = r.choices
    assert choice.message.content == "e1: 2 messages"
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert choice.logprobs is None
    assert r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (20, 3, 23)
    # Without return_token_ids, no token ids.
    assert "prompt_token_ids" not in r.to_dict()
    assert "token_ids" not in r.choices[0].to_dict()
    (pending,) = seen
    call = pending.call
    assert isinstance(call, ChatCall)
    assert call.messages == messages
    assert (call.max_tokens, call.temperature, call.stop, call.n) == (64, 0.3, ["END"], 1)
    assert (call.logprobs, call.return_token_ids, call.tools) == (False, False, None)
    assert pending.done


def test_chat_with_tools_gives_tool_calls_and_takes_their_results(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    agent = client(endpoint, endpoint.open_episode("e2"))
    with stage(inbox) as seen:
        r = agent.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice="auto"
        )
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.tool_calls is not None
        (tool_call,) = choice.message.tool_calls
        assert tool_call.id == "call_e2_1"
        assert tool_call.function.name == "lookup"
        assert json.loads(tool_call.function.arguments) == {"episode": "e2", "messages": 1}
        # The next turn carries the assistant's message as the client built it, and the
        # tool's result.
        messages = [
            *USER,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "a greeting"},
        ]
        again = agent.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert json.loads(again.choices[0].message.tool_calls[0].function.arguments)["messages"] == 3
    first = seen[0].call
    assert isinstance(first, ChatCall)
    assert first.tools == TOOLS and first.tool_choice == "auto"


def test_return_token_ids_and_logprobs(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    with stage(inbox) as seen:
        r = client(endpoint, endpoint.open_episode("e3")).chat.completions.create(
            model=MODEL,
            messages=USER,
            logprobs=True,
            top_logprobs=0,
            extra_body={"return_token_ids": True},
        )
    body = r.to_dict()
    assert body["prompt_token_ids"] == list(range(10))
    assert r.choices[0].model_extra is not None
    assert r.choices[0].model_extra["token_ids"] == [1, 7, 9]
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [(c.token, c.logprob, c.bytes) for c in logprobs.content] == [
        ("é", -0.5, [195, 169]),
        (" b", -1.0, [32, 98]),
        ("c", -9999.0, [99]),  # -inf, which JSON cannot carry, as vLLM sends it
    ]
    call = seen[0].call
    assert isinstance(call, ChatCall) and call.logprobs and call.return_token_ids


def test_token_endpoint_mirrors_vllm_generate(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    key = endpoint.open_episode("t")
    url = f"{endpoint.root_url}/inference/v1/generate"
    request = {
        "model": MODEL,
        "token_ids": [5, 6, 7],
        "sampling_params": {
            "max_tokens": 8,
            "temperature": 1.0,
            "top_p": 0.9,
            "stop": "\n",
            "logprobs": 1,
            "stop_token_ids": [2],
            "skip_special_tokens": False,
        },
        "request_id": "r1",
        "return_token_ids": True,
    }
    with stage(inbox) as seen:
        status, body = post(url, key, request)
        assert status == 200, body
        assert body["request_id"] == "generate-tokens-r1"
        assert (body["model"], body["output_mode"]) == (MODEL, "tokens")
        assert body["prompt_token_ids"] == [5, 6, 7]
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        (choice,) = body["choices"]
        assert choice["token_ids"] == [105, 106, 107]
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"]["content"][0] == {
            "token_id": 105,
            "logprob": -0.25,
            "rank": None,
            "top_logprobs": [],
            "token": "token_id:105",
        }
        call = seen[0].call
        assert call == TokenCall(
            prompt_token_ids=[5, 6, 7],
            max_tokens=8,
            temperature=1.0,
            top_p=0.9,
            stop=["\n"],
            logprobs=True,
        )

        # Text mode, no model named, no logprobs, no prompt ids asked for.
        status, body = post(
            url, key, {"token_ids": [1], "sampling_params": {}, "output_mode": "text"}
        )
        assert status == 200, body
        (choice,) = body["choices"]
        assert (choice["text"], choice["logprobs"], body["prompt_token_ids"]) == (
            "<101>",
            None,
            None,
        )
        assert body["request_id"].startswith("generate-tokens-")

        status, body = post(url, key, {"token_ids": [1], "sampling_params": {"logprobs": 5}})
        assert (status, body["error"]["param"]) == (400, "sampling_params.logprobs")
        status, body = post(url, key, {"token_ids": [1], "sampling_params": {"max_tokens": 9999}})
        assert (status, body["error"]["param"]) == (400, "sampling_params.max_tokens")
        status, body = post(url, key, {"token_ids": [], "sampling_params": {}})
        assert (status, body["error"]["param"]) == (400, "token_ids")
        status, body = post(url, key, {"model": "other", "token_ids": [1], "sampling_params": {}})
        assert (status, body["error"]["code"]) == (404, "model_not_found")
        status, body = post(url, None, {"token_ids": [1], "sampling_params": {}})
        assert status == 401
    assert len(seen) == 2


def test_concurrent_calls_all_wait_together_and_get_their_own_answers(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    episodes = [f"ep{i}" for i in range(8)]
    keys = {episode: endpoint.open_episode(episode) for episode in episodes}
    arrived: list[PendingCall] = []

    def play_stage() -> None:
        # Answers only once every call has arrived, last first.
        while len(arrived) < len(episodes):
            arrived.append(inbox.get(timeout=WAIT_S))
        assert not any(p.done for p in arrived)
        for pending in reversed(arrived):
            pending.answer(echo(pending))

    async def agent(episode: str) -> str:
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=keys[episode], max_retries=0
        ) as agent_client:
            messages = USER * (1 + episodes.index(episode))
            r = await agent_client.chat.completions.create(model=MODEL, messages=messages)
            return r.choices[0].message.content or ""

    async def agents() -> list[str]:
        return await asyncio.gather(*(agent(e) for e in episodes))

    answered = in_background(play_stage)
    contents = asyncio.run(agents())
    answered()
    assert contents == [f"{e}: {i + 1} messages" for i, e in enumerate(episodes)]
    assert sorted(str(p.episode) for p in arrived) == episodes


def test_keys_authenticate_and_tag_their_episode(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    key_a, key_b = endpoint.open_episode("a"), endpoint.open_episode(("b", 2))
    closed = endpoint.open_episode("closed")
    endpoint.close_episode("closed")
    endpoint.close_episode("never opened")  # nothing to do
    errors: list[str] = []

    def refused(api: openai.OpenAI, **extra: Any) -> openai.AuthenticationError:
        with pytest.raises(openai.AuthenticationError) as caught:
            api.chat.completions.create(model=MODEL, messages=USER, **extra)
        errors.append(caught.value.response.text)
        return caught.value

    with stage(inbox) as seen:
        refused(client(endpoint, "x"), extra_headers={"Authorization": openai.Omit()})
        wrong = "W" * 43
        assert "not valid" in refused(client(endpoint, wrong)).message
        refused(client(endpoint, closed))
        a = client(endpoint, key_a).chat.completions.create(model=MODEL, messages=USER)
        b = client(endpoint, key_b).chat.completions.create(model=MODEL, messages=USER * 2)
        # The models list needs a key too.
        with pytest.raises(openai.AuthenticationError) as caught:
            client(endpoint, wrong).models.list()
        errors.append(caught.value.response.text)
    assert [p.episode for p in seen] == ["a", ("b", 2)]
    assert a.choices[0].message.content == "a: 1 messages"
    assert b.choices[0].message.content == "('b', 2): 2 messages"
    for text in errors:
        for key in (key_a, key_b, closed, wrong):
            assert key not in text
    with pytest.raises(ValueError, match="already open"):
        endpoint.open_episode("a")


def test_refusals_name_the_field_and_never_reach_the_stage(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    key = endpoint.open_episode("e")
    agent = client(endpoint, key)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    cases: list[tuple[type[openai.APIStatusError], dict[str, Any], str | None, str]] = [
        (openai.NotFoundError, {"model": "gpt-4o"}, "model", "The model 'gpt-4o' does not exist"),
        (openai.BadRequestError, {"max_tokens": 4097}, "max_tokens", "limit of 4096"),
        (openai.BadRequestError, {"max_completion_tokens": 10**6}, "max_completion_tokens", "4096"),
        (openai.BadRequestError, {"n": 2}, "n", "not supported yet"),
        (openai.BadRequestError, {"top_logprobs": 3, "logprobs": True}, "top_logprobs", ""),
        (openai.BadRequestError, {"stream": "yes"}, "stream", ""),
        (openai.BadRequestError, {"temperature": "hot"}, "temperature", "number"),
        (
            openai.BadRequestError,
            {"messages": [{"role": "user", "content": [image]}]},
            "messages[0].content[0].type",
            "content part type image_url is not supported",
        ),
        (
            openai.BadRequestError,
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages[0].role",
            "",
        ),
        (openai.BadRequestError, {"messages": []}, "messages", ""),
        (
            openai.BadRequestError,
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            "",
        ),
        (openai.BadRequestError, {"messages": USER * 257}, "messages", "limit of 256"),
    ]
    for error, fields, param, message in cases:
        request = {"model": MODEL, "messages": USER, **fields}
        with pytest.raises(error) as caught:
            agent.chat.completions.create(**request)
        assert caught.value.param == param, fields
        assert message in caught.value.message
        assert "\n" not in caught.value.message
        assert key not in caught.value.response.text
    assert json.loads(caught.value.response.text)["error"] == {
        "message": "257 `messages` are over this server's limit of 256",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }
    assert inbox.empty()
    # Not a JSON object.
    status, body = post(f"{endpoint.base_url}/chat/completions", key, b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    # Temperature is never refused: the stage decides what it samples at.
    with stage(inbox) as seen:
        agent.chat.completions.create(model=MODEL, messages=USER, temperature=0.0, top_p=0.1)
    call = seen[0].call
    assert isinstance(call, ChatCall) and (call.temperature, call.top_p) == (0.0, 0.1)


def test_a_body_over_the_limit_is_refused_413() -> None:
    with serving(Limits(max_body_bytes=4096)) as (endpoint, inbox):
        key = endpoint.open_episode("e")
        big = [{"role": "user", "content": "x" * 10_000}]
        with pytest.raises(openai.APIStatusError) as caught:
            client(endpoint, key).chat.completions.create(model=MODEL, messages=big)
        assert caught.value.status_code == 413
        assert key not in caught.value.response.text
        # Without a Content-Length (chunked), the bytes actually read count.
        chunks = iter([b'{"model": "policy", "messages": [', b" " * 5000, b"]}"])
        url = f"{endpoint.base_url}/chat/completions"
        request = urllib.request.Request(
            url, data=chunks, headers={"Authorization": f"Bearer {key}"}, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as http_error:
            urllib.request.urlopen(request, timeout=WAIT_S)
        assert http_error.value.code == 413
        http_error.value.close()
        assert inbox.empty()


def test_one_call_at_a_time_per_episode(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    agent = client(endpoint, endpoint.open_episode("e"))
    first = in_background(lambda: agent.chat.completions.create(model=MODEL, messages=USER))
    pending = inbox.get(timeout=WAIT_S)
    with pytest.raises(openai.ConflictError) as caught:
        agent.chat.completions.create(model=MODEL, messages=USER * 2)
    assert "one call at a time" in caught.value.message
    pending.answer(echo(pending))
    assert first().choices[0].message.content == "e: 1 messages"
    pending.answer(echo(pending))  # settled already: nothing happens
    with stage(inbox):  # answered, the episode may call again
        again = agent.chat.completions.create(model=MODEL, messages=USER * 2)
    assert again.choices[0].message.content == "e: 2 messages"


def test_a_client_gone_leaves_its_call_done(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    key = endpoint.open_episode("e")
    url = f"{endpoint.base_url}/chat/completions"
    request = {"model": MODEL, "messages": USER}
    gone = in_background(lambda: post(url, key, request, timeout=0.5))
    pending = inbox.get(timeout=WAIT_S)
    with pytest.raises(TimeoutError):
        gone()
    deadline = time.monotonic() + WAIT_S
    while not pending.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pending.done
    pending.answer(echo(pending))  # nobody waits: a no-op
    with stage(inbox):  # and the episode may call again
        assert post(url, key, request)[0] == 200


def test_close_episode_refuses_its_waiting_call(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    agent = client(endpoint, endpoint.open_episode("e"))
    waiting = in_background(lambda: agent.chat.completions.create(model=MODEL, messages=USER))
    pending = inbox.get(timeout=WAIT_S)
    endpoint.close_episode("e")
    with pytest.raises(openai.APIStatusError) as caught:
        waiting()
    assert caught.value.status_code == 410
    assert pending.done
    with pytest.raises(openai.AuthenticationError):
        agent.chat.completions.create(model=MODEL, messages=USER)


def test_a_malformed_answer_is_the_stage_s_error_and_a_500(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    endpoint, inbox = served
    agent = client(endpoint, endpoint.open_episode("e"))
    waiting = in_background(
        lambda: agent.chat.completions.create(model=MODEL, messages=USER, logprobs=True)
    )
    pending = inbox.get(timeout=WAIT_S)
    short = echo(pending)
    with pytest.raises(ValueError, match="3 token ids, 1 logprobs"):
        pending.answer(
            Answer(
                prompt_token_ids=short.prompt_token_ids,
                token_ids=short.token_ids,
                logprobs=[-1.0],
                token_texts=short.token_texts,
                text=short.text,
                content=short.content,
                tool_calls=[],
                finish_reason="stop",
            )
        )
    with pytest.raises(openai.InternalServerError) as caught:
        waiting()
    assert caught.value.status_code == 500


def test_stop_refuses_waiting_calls_and_closes_the_port() -> None:
    with serving() as (endpoint, inbox):
        agent = client(endpoint, endpoint.open_episode("e"))
        waiting = in_background(lambda: agent.chat.completions.create(model=MODEL, messages=USER))
        pending = inbox.get(timeout=WAIT_S)
        endpoint.stop()
        with pytest.raises(openai.InternalServerError) as caught:
            waiting()
        assert caught.value.status_code == 503
        assert pending.done
        pending.answer(echo(pending))  # the server is gone: a no-op
        with (
            pytest.raises(ConnectionRefusedError),
            socket.create_connection(("127.0.0.1", endpoint.port), timeout=WAIT_S),
        ):
            pass
        endpoint.stop()  # again: nothing to do


def test_a_streamed_chat_completion_is_the_same_answer(
    served: tuple[Endpoint, queue.Queue[PendingCall]],
) -> None:
    """`stream: true` (what many agent frameworks and verifiers' eval client send): the
    official client assembles the chunks into the answer a plain call gets."""
    endpoint, inbox = served
    agent = client(endpoint, endpoint.open_episode("e9"))
    with stage(inbox):
        plain = agent.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        chunks = list(
            agent.chat.completions.create(
                model=MODEL,
                messages=USER,
                tools=TOOLS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    (want,) = plain.choices[0].message.tool_calls or []
    assert [(t.id, t.function.name, t.function.arguments) for t in calls] == [
        (want.id, want.function.name, want.function.arguments)
    ]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == plain.choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage == plain.usage
