"""An OpenAI Agents SDK agent for the adapter tests (`rollout.agent.path=agents_sdk:sdk_agent`;
tests/ is on the path of the test processes and of the runs they launch).

Written as an Agents SDK user writes one, with no rftpipe import: an `agents.Agent` with a
`@function_tool`, on the SDK's chat-completions model class over the client the episode is
given, run by `Runner.run`. Tracing is off: the SDK would otherwise upload its traces to
OpenAI (no network here, and nothing of an episode leaves the machine).

A random-init tiny model earns no reward on a real task, so the reward is dense and
synthetic: the share of even code points in the agent's final output text.
"""

from __future__ import annotations

import json
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

set_tracing_disabled(True)


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers."""
    return f"The sum is {a + b}."


def even_share(text: str) -> float:
    """The share of even code points in `text` (0 for no text)."""
    return sum(1 for c in text if ord(c) % 2 == 0) / max(1, len(text))


async def sdk_agent(
    task: dict[str, Any],
    client: Any,
    model: str,
    max_tokens: int = 6,
    max_turns: int = 3,
    log: str | None = None,
) -> dict[str, Any]:
    """One `Runner.run` of an SDK agent with the `add` tool on the episode's messages; the
    reward is `even_share` of its final output. `log` (a path) gets one JSON line of what
    the agent saw, for the tests to compare."""
    system = [m["content"] for m in task["messages"] if m["role"] == "system"]
    agent = Agent(
        name="even",
        instructions="\n".join(system) or None,
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=max_tokens),
        tools=[add],
    )
    turns = [{"role": m["role"], "content": m["content"]} for m in task["messages"]]
    turns = [m for m in turns if m["role"] != "system"]
    result = await Runner.run(agent, turns, max_turns=max_turns)
    output = str(result.final_output or "")
    reward = even_share(output)
    tools = [
        item.output for item in result.new_items if type(item).__name__ == "ToolCallOutputItem"
    ]
    if log:
        with open(log, "a") as f:
            record = {
                "prompt_id": task["prompt_id"],
                "sample_idx": task["sample_idx"],
                "output": output,
                "reward": reward,
                "tool_outputs": [str(t) for t in tools],
                "responses": len(result.raw_responses),
            }
            f.write(json.dumps(record) + "\n")
    return {"reward": reward, "info": {"output": output, "tool_outputs": len(tools)}}
