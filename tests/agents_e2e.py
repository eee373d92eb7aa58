"""Agents for the agent-episode tests (`rollout.agent.path=agents_e2e:NAME`; tests/ is on
the path of the test processes and of the runs they launch).

Written as users write them: plain `openai` client code, no rftpipe import. A random-init
tiny model earns no reward on a real task, so `even_tokens` pays a dense synthetic reward,
the share of even token ids among the tokens it was answered with, which a policy can
learn call by call.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any


def _log(path: str | None, record: dict[str, Any]) -> None:
    """Append what the agent saw (one JSON line per call) for the test to compare."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


async def even_tokens(
    task: dict[str, Any],
    client: Any,
    model: str,
    calls: int = 2,
    max_tokens: int = 6,
    log: str | None = None,
    tools: bool = False,
    fail_if: str = "",
    summarize_odd: bool = False,
    odd_prompts_only: bool = False,
    stop: list[str] | None = None,
) -> float:
    """`calls` chat calls, each answer appended as returned and followed by a user turn;
    the reward is the mean share of even token ids in the answers. Raises before its first
    call while the file `fail_if` exists. With `summarize_odd`, an odd sample's agent
    replaces its history by a summary before its second call (a rewritten history: the
    episode's next sequence); with `odd_prompts_only` too, only those of odd prompt ids.
    `stop` is every call's stop strings."""
    if fail_if and os.path.exists(fail_if):
        raise RuntimeError("told to fail")
    messages: list[dict[str, Any]] = [dict(m) for m in task["messages"]]
    schema = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    score = 0.0
    for i in range(calls):
        odd = task["sample_idx"] % 2 and (task["prompt_id"] % 2 or not odd_prompts_only)
        if summarize_odd and i == 1 and odd:
            summary = f"Summary: one answer, {score:.2f} of its ids even. Go on."
            messages = [*(dict(m) for m in task["messages"]), {"role": "user", "content": summary}]
        r = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            tools=schema if tools else None,
            stop=stop,
            extra_body={"return_token_ids": True},
        )
        choice = r.choices[0]
        extra = choice.model_extra or {}
        ids = extra["token_ids"]
        _log(
            log,
            {
                "prompt_id": task["prompt_id"],
                "sample_idx": task["sample_idx"],
                "call": i,
                "prompt_token_ids": (r.model_extra or {})["prompt_token_ids"],
                "token_ids": ids,
                "content": choice.message.content,
                "tool_calls": [c.function.name for c in choice.message.tool_calls or []],
                "finish_reason": choice.finish_reason,
            },
        )
        score += sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))
        messages.append(choice.message.model_dump(exclude_none=True))
        for c in choice.message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": "42"})
        messages.append({"role": "user", "content": f"Again, more even ({i + 1})."})
    return score / calls


async def flaky(task: dict[str, Any], client: Any, model: str, state: str = "") -> float:
    """Nondeterministic: its second call's user turn holds a random number, unless
    `state` names a file that says otherwise; for the divergence policies."""
    messages: list[dict[str, Any]] = [dict(m) for m in task["messages"]]
    r = await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": f"Roll {random.randrange(10**9)}."})
    r = await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    return float(len(r.choices[0].message.content or ""))


async def rewrites_history(task: dict[str, Any], client: Any, model: str) -> float:
    """Its second call drops the first answer (a summarising agent): not an extension."""
    messages: list[dict[str, Any]] = [dict(m) for m in task["messages"]]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    messages.append({"role": "user", "content": "Summary: nothing yet."})
    await client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    return 1.0


async def sleeps(task: dict[str, Any], client: Any, model: str, pid_file: str = "") -> float:
    """Spawns a child process, records its pid, then never calls or returns."""
    import asyncio
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    if pid_file:
        Path(pid_file).write_text(f"{os.getpid()} {child.pid}")
    await asyncio.sleep(3600)
    return 0.0
