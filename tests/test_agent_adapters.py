"""Agents written against the real agent packages (`rollout.agent`), run unchanged against
the rollout stage's endpoint in front of the real HF engine on the tiny model: an OpenAI
Agents SDK agent (`tests/agents_sdk.py`) and verifiers environments
(`tests/fixtures/verifiers_env/`). The records are checked against the token ids captured
at the engine boundary, and the rewards against what the agents computed and logged.

verifiers 0.4.0 needs openai<3 and the Agents SDK openai>=3, so verifiers runs under a
second interpreter (`rollout.agent.python`): `.venv-agents/`, which `tools/agents_env.sh`
builds (`RFTPIPE_AGENTS_PYTHON` names another). Without it the verifiers tests skip, unless
`CI` is set, where they fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import run_agent_episodes

from rftpipe.config.schema import AgentConfig
from rftpipe.engines.models import load_causal_lm, load_tokenizer, prepare_tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    path = prepare_tiny()
    torch.manual_seed(0)
    return load_causal_lm(path, "float32"), load_tokenizer(path)


def _run(tiny, agent: AgentConfig, n: int = 2, prompts: int = 2, script=None):  # noqa: ANN001
    eps, stats, spy = run_agent_episodes(tiny, agent, n=n, prompts=prompts, script=script)
    return {e.slot: e for e in eps}, stats, spy


def _logged(path: Path) -> dict[tuple[int, int], dict]:
    """The agents' log lines, by (prompt id, sample)."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {(r["prompt_id"], r["sample_idx"]): r for r in rows}


def _sampled(e) -> list[list[int]]:  # noqa: ANN001
    """Each call's sampled tokens in the record: the mask-1 run that starts its span."""
    bounds = [*e.turn_offsets, len(e.response)]
    out = []
    for c in range(len(e.turn_offsets)):
        span = e.loss_mask[bounds[c] : bounds[c + 1]]
        k = span.count(1)
        assert span == [1] * k + [0] * (len(span) - k)
        out.append(e.response[bounds[c] : bounds[c] + k])
    return out


def _even_share(text: str) -> float:
    return sum(1 for c in text if ord(c) % 2 == 0) / max(1, len(text))


# ---------------------------------------------------------------------------------------------
# The OpenAI Agents SDK (openai-agents, in the trainer's venv: the `agents` extra)
# ---------------------------------------------------------------------------------------------


def _sdk_agent(log: Path) -> AgentConfig:
    # Importing the SDK takes seconds (5 on an idle 2-core machine), more on a loaded one,
    # before the first call.
    return AgentConfig(path="agents_sdk:sdk_agent", kwargs={"log": str(log)}, timeout_s=120)


def test_an_agents_sdk_agent_runs_against_the_endpoint(tiny, tmp_path: Path) -> None:
    log = tmp_path / "sdk.jsonl"
    eps, stats, spy = _run(tiny, _sdk_agent(log), n=1)
    seen = _logged(log)
    assert len(eps) == len(seen) == 2
    # No tool call from a random model: one call each, all in one engine call.
    assert stats.engine_calls == [1] and len(spy.calls) == 1
    for slot, e in eps.items():
        assert e.status == "done"
        mine = seen[(e.prompt.prompt_id, e.sample_idx)]
        assert mine["responses"] == len(e.turn_offsets) == 1 and mine["tool_outputs"] == []
        # The record is the engine's prompt and exactly what it sampled.
        assert spy.calls[0][slot] == (e.prompt_ids, *_sampled(e))
        # The reward is what the agent computed from the final output it got.
        assert sum(e.turn_rewards) == pytest.approx(mine["reward"])
        assert mine["reward"] == pytest.approx(_even_share(mine["output"]))
    assert len({r["output"] for r in seen.values()}) == 2


TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_an_agents_sdk_agent_runs_its_function_tool(tiny, tmp_path: Path) -> None:
    """A scripted policy, since a random model calls no tools: episode 0's first answer is
    a hermes tool call (which the stage's parser reads into `tool_calls`), so the SDK runs
    its `add` tool and calls again with the result."""
    _, tok = tiny
    log = tmp_path / "sdk.jsonl"
    scripted = tok(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    eps, stats, spy = _run(tiny, _sdk_agent(log), prompts=1, script={(0, 0): scripted})
    seen = _logged(log)
    e, other = eps[0], eps[1]
    assert e.status == other.status == "done"
    # Two calls for the scripted episode, one for the other: one engine call per index.
    assert len(e.turn_offsets) == 2 and len(other.turn_offsets) == 1
    assert [len(c) for c in spy.calls] == [2, 1] and stats.engine_calls == [1, 1]
    first, second = _sampled(e)
    # The record kept the scripted tokens exactly, and the second call's sampled ones.
    assert first == scripted == spy.calls[0][0][1]
    assert second == spy.calls[1][0][1]
    # The second call's prompt is the record's prompt, first answer and the tool's turn...
    bounds = [*e.turn_offsets, len(e.response)]
    assert spy.calls[1][0][0] == e.prompt_ids + e.response[: bounds[1]]
    # ...whose message carried the tool's result: the SDK ran `add(2, 3)`.
    assert "The sum is 5." in tok.decode(e.response[len(first) : bounds[1]])
    mine = seen[(e.prompt.prompt_id, e.sample_idx)]
    assert mine["tool_outputs"] == ["The sum is 5."] and mine["responses"] == 2
    assert sum(e.turn_rewards) == pytest.approx(mine["reward"])
    assert mine["reward"] == pytest.approx(_even_share(mine["output"]))
    assert seen[(other.prompt.prompt_id, other.sample_idx)]["tool_outputs"] == []


# ---------------------------------------------------------------------------------------------
# verifiers, under its own interpreter
# ---------------------------------------------------------------------------------------------

VERIFIERS_ENV = Path(__file__).resolve().parent / "fixtures" / "verifiers_env"
AGENTS_PYTHON = Path(os.environ.get("RFTPIPE_AGENTS_PYTHON") or ROOT / ".venv-agents/bin/python")


@pytest.fixture
def agents_python(monkeypatch: pytest.MonkeyPatch) -> str:
    """The second interpreter, with verifiers; the environments' directory joins the path
    the agent processes get (the run's source directories)."""
    if not AGENTS_PYTHON.exists():
        why = f"{AGENTS_PYTHON} is absent: build it with `bash tools/agents_env.sh`"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    monkeypatch.syspath_prepend(str(VERIFIERS_ENV))
    return str(AGENTS_PYTHON)


def _verifiers_agent(python: str, log: Path, taskset: str) -> AgentConfig:
    return AgentConfig(
        path="agents_verifiers:verifiers_agent",
        python=python,
        kwargs={"tokenizer": str(prepare_tiny()), "log": str(log), "taskset": taskset},
        # Importing verifiers and starting its harness program take seconds, more on a
        # loaded machine, before the first call.
        timeout_s=120,
        on_error="end_episode",
    )


@pytest.mark.slow
def test_a_verifiers_environment_runs_against_the_endpoint(
    agents_python: str, tiny, tmp_path: Path
) -> None:
    """`rft_even_chat` through verifiers' own machinery for one rollout (`Env.run_episode`:
    its harness program, interception server, train client and `@vf.reward`)."""
    _, tok = tiny
    log = tmp_path / "vf.jsonl"
    eps, stats, spy = _run(tiny, _verifiers_agent(agents_python, log, "rft_even_chat"), prompts=1)
    seen = _logged(log)
    assert len(eps) == len(seen) == 2
    assert stats.engine_calls == [1] and len(spy.calls) == 1
    for slot, e in eps.items():
        assert e.status == "done", e.turn_infos
        mine = seen[(e.prompt.prompt_id, e.sample_idx)]
        assert mine["turns"] == len(e.turn_offsets) == 1 and mine["stop"] == "agent_completed"
        (sampled,) = _sampled(e)
        assert spy.calls[0][slot] == (e.prompt_ids, sampled)
        # verifiers' renderer rendered the prompt as our chat template does...
        assert e.prompt_ids == list(e.prompt.token_ids)
        # ...and its own training sample is our record: the prompt, then the sampled tokens.
        assert mine["token_ids"] == [e.prompt_ids + sampled]
        assert mine["sampled_mask"] == [[False] * len(e.prompt_ids) + [True] * len(sampled)]
        # The reward is the trace's (its one `@vf.reward`), on the reply it was answered.
        assert mine["reply"] == tok.decode(sampled, skip_special_tokens=True).strip()
        assert mine["rewards"] == {"even": pytest.approx(_even_share(mine["reply"]))}
        assert sum(e.turn_rewards) == pytest.approx(mine["reward"])
    assert len({r["reply"] for r in seen.values()}) == 2


@pytest.mark.slow
def test_a_two_turn_verifiers_environment_extends_or_branches_its_episode(
    agents_python: str, tiny, tmp_path: Path
) -> None:
    """`rft_even_dialog`: verifiers' `Agent.interaction` answers the first reply with a
    user turn, and its harness relaunches on the conversation. verifiers' train client
    renders each call's whole conversation from text (renderers' `DefaultRenderer`, the
    fallback for a tokenizer it has no renderer of its own for, never bridges from the
    sampled tokens), so a later call extends the episode only when the answer's text
    tokenizes back to the sampled tokens. A scripted policy: episode 0 answers "Even.",
    which does; episode 1 the same with an invalid UTF-8 byte, which decodes to U+FFFD and
    does not, so its second call starts the episode's second sequence, as verifiers' own
    trace splits it into two branches."""
    _, tok = tiny
    log = tmp_path / "vf.jsonl"
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    said = [*ids("Even."), tok.eos_token_id]
    garbled = [*ids("Ev"), tok.convert_tokens_to_ids("ÿ"), *ids("en."), tok.eos_token_id]
    assert tok.decode(garbled[:-1]) == "Ev\ufffden."
    eps, stats, spy = _run(
        tiny,
        _verifiers_agent(agents_python, log, "rft_even_dialog"),
        prompts=1,
        script={(0, 0): said, (0, 1): garbled},
    )
    e, branched = eps[0], eps[1]
    assert [len(c) for c in spy.calls] == [2, 2] and stats.engine_calls == [1, 1]
    assert sum(len(x.branches) for x in eps.values()) == 1
    # Episode 0: both calls, token-exact, and verifiers' own training sample is our record.
    assert e.status == "done", e.turn_infos
    first, second = _sampled(e)
    assert first == said and second == spy.calls[1][0][1]
    bounds = [*e.turn_offsets, len(e.response)]
    assert spy.calls[1][0][0] == e.prompt_ids + e.response[: bounds[1]]
    assert "Again, more even." in tok.decode(e.response[len(first) : bounds[1]])
    mine = _logged(log)[(e.prompt.prompt_id, e.sample_idx)]
    assert mine["turns"] == 2 and mine["stop"] == "user_closed"
    assert mine["token_ids"] == [e.prompt_ids + e.response]
    assert mine["sampled_mask"] == [[False] * len(e.prompt_ids) + [m == 1 for m in e.loss_mask]]
    assert mine["reply"] == tok.decode(second, skip_special_tokens=True).strip()
    assert mine["rewards"] == {"even": pytest.approx(_even_share(mine["reply"]))}
    assert sum(e.turn_rewards) == pytest.approx(mine["reward"])
    # Episode 1: its second call re-rendered "Ev\ufffden.", so it is a second sequence:
    # each sequence is what the engine saw and sampled, and verifiers' own trace has the
    # same two branches, token for token, mask for mask.
    assert branched.status == "done", branched.turn_infos
    (head,) = branched.branches
    assert len(head.turn_offsets) == len(branched.turn_offsets) == 1
    assert spy.calls[0][1] == (head.prompt_ids, garbled)
    assert spy.calls[1][1] == (branched.prompt_ids, _sampled(branched)[0])
    assert "Ev\ufffden." in tok.decode(branched.prompt_ids)
    mine = _logged(log)[(branched.prompt.prompt_id, branched.sample_idx)]
    assert mine["turns"] == 2
    assert mine["token_ids"] == [s.prompt_ids + s.response for s in (head, branched)]
    assert mine["sampled_mask"] == [
        [False] * len(s.prompt_ids) + [m == 1 for m in s.loss_mask] for s in (head, branched)
    ]
    # The episode's reward, paid on its last call.
    assert sum(branched.turn_rewards) == pytest.approx(mine["reward"])
