"""The retry task of `configs/multiturn_smollm2_retry.yaml` written as an agent users would
write: plain `openai` client code and no rftpipe import (`configs/agent_smollm2_retry.yaml`
trains it with `rollout.agent.path=examples.agents.retry_arithmetic:solve`).

The model answers a math problem; a wrong final number is answered "not right, try again"
and the model gets another try. A right answer on try t (0-based) earns `decay ** t`.
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FEEDBACK = "That is not right. Check the arithmetic and reply with only the final number."


def right(text: str, answer: str) -> bool:
    """Whether the last number in `text` is the answer."""
    numbers = NUMBER.findall(text)
    if not numbers:
        return False
    try:
        return float(numbers[-1]) == float(answer)
    except ValueError:
        return numbers[-1] == answer.strip()


async def solve(
    task: dict[str, Any], client: Any, model: str, tries: int = 2, decay: float = 0.5
) -> float:
    """Up to `tries` answers to the task's messages; the reward of the first right one."""
    messages = [dict(m) for m in task["messages"]]
    for t in range(tries):
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=16)
        message = reply.choices[0].message
        if right(message.content or "", str(task["answer"])):
            return decay**t
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": FEEDBACK})
    return 0.0
