"""An agent module that takes longer to import than the agent's `timeout_s` (tests/test_agents.py):
the import is part of its process's start, which that limit does not count."""

import time
from typing import Any

time.sleep(4)


async def returns_at_once(task: dict[str, Any], client: Any, model: str) -> float:
    return 1.0
