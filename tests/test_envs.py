"""The environment layer (rftpipe.envs): the interface, its checks, the loader and config,
tool schemas, the tool-call parsers, ToolEnvironment and the skyrl-gym and TRL adapters.
Torch-free and fast; skyrl-gym's own gsm8k_multi_turn environment runs for real."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from rftpipe.config.loader import ConfigError, load_config
from rftpipe.config.schema import EnvConfig, RunConfig, ToolParserName
from rftpipe.envs.base import StepResult, Task, call, checked_reset, checked_step_result
from rftpipe.envs.loader import load_environment_class, make_environment
from rftpipe.envs.tools import (
    CALL_TEXT,
    PARSERS,
    ToolCall,
    ToolEnvironment,
    parse_hermes,
    parse_plain,
    render_plain_tools,
    tool_schema,
    without_calls,
)
from rftpipe.errors import UserError
from tests import env_fixtures as fx
from tests import envs_skyrl_user as skyrl_user

ROOT = Path(__file__).resolve().parent.parent
TASK = Task(prompt_id=7, messages=[{"role": "user", "content": "Guess."}], answer="5")


def one_line_error(fn: Any, *fragments: str, error: type[Exception] = UserError) -> str:
    """Assert `fn()` raises a one-line `error` containing every fragment; its message."""
    with pytest.raises(error) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def play(env: Any, actions: list[str]) -> list[StepResult]:
    """Reset on TASK and step through `actions` until done, checking every return."""
    checked_reset(call(env.reset, TASK, 11), type(env).__name__, "test")
    out = []
    for a in actions:
        out.append(checked_step_result(call(env.step, a), type(env).__name__, "test"))
        if out[-1].done:
            break
    call(env.close)
    return out


# -------------------------------------------------------------------------- interface


@pytest.mark.parametrize("cls", [fx.GuessEnv, fx.AsyncGuessEnv])
def test_plain_and_async_environments_play_the_same_episode(cls: type) -> None:
    results = play(cls(), ["3", "9", "5", "1"])
    assert [r.reward for r in results] == [-0.1, -0.1, 1.0]
    assert [r.done for r in results] == [False, False, True]
    assert [r.observations for r in results[:2]] == [
        [{"role": "user", "content": "higher"}],
        [{"role": "user", "content": "lower"}],
    ]


def test_call_keeps_one_loop_per_thread_across_calls() -> None:
    import asyncio

    async def running_loop() -> object:
        return asyncio.get_running_loop()

    assert call(running_loop) is call(running_loop)
    assert call(lambda x: x + 1, 1) == 2


def test_checked_step_result_takes_mappings_and_keeps_postprocessed_action() -> None:
    r = checked_step_result(
        {
            "observations": [],
            "reward": 1,
            "done": True,
            "metadata": {"k": 1},
            "postprocessed_action": "a",
        },
        "Env",
        "here",
    )
    assert r == StepResult(
        observations=[], reward=1.0, done=True, info={"k": 1}, postprocessed_action="a"
    )


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("text", "str 'text', not a StepResult"),
        ({"observations": [], "done": True}, "without ['reward']"),
        ({"observations": [], "reward": "1", "done": True}, "reward str '1', not a number"),
        ({"observations": [], "reward": float("nan"), "done": True}, "not a finite number"),
        ({"observations": [], "reward": True, "done": True}, "reward bool True, not a number"),
        ({"observations": [], "reward": 0.0, "done": 1}, "done int 1, not a bool"),
        ({"observations": "hi", "reward": 0.0, "done": False}, "observations str 'hi', not a list"),
        ({"observations": [{"role": "user"}], "reward": 0.0, "done": False}, "message 0"),
        (
            {"observations": [{"role": "assistant", "content": "x"}], "reward": 0.0, "done": False},
            "role 'assistant', not one of ['system', 'tool', 'user']",
        ),
        ({"observations": [], "reward": 0.0, "done": True, "info": 3}, "info int 3, not a dict"),
    ],
)
def test_checked_step_result_names_environment_and_problem(value: Any, fragment: str) -> None:
    one_line_error(
        lambda: checked_step_result(value, "MyEnv", "step 2 prompt_id 3"),
        "rollout.env.path: MyEnv.step returned",
        fragment,
        "(step 2 prompt_id 3)",
    )


def test_checked_reset_refuses_what_is_not_messages_and_info() -> None:
    assert checked_reset(([{"role": "system", "content": "s"}], {}), "E", "w")[1] == {}
    one_line_error(
        lambda: checked_reset([], "E", "w"), "E.reset returned list [], not (messages, info)"
    )
    one_line_error(
        lambda: checked_reset(([1], {}), "E", "w"), "E.reset returned messages message 0"
    )


# ---------------------------------------------------------------------- loader, config


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("tests.no_such_module:Env", "cannot import module 'tests.no_such_module'"),
        ("tests.env_fixtures:Missing", "module 'tests.env_fixtures' has no attribute 'Missing'"),
        ("tests.env_fixtures:NOT_A_CLASS", "is a int, not a class"),
        ("tests.env_fixtures:NoStep", "class 'tests.env_fixtures:NoStep' has no step method"),
        ("trl:tests.env_fixtures:TRLNoReset", "has no reset method"),
        ("skyrl:no_such_env", "no skyrl-gym environment 'skyrl:no_such_env' (registered: ["),
        # ... and it says how to name one's own class.
        ("skyrl:no_such_env", "for your own skyrl-gym class, name it 'skyrl:pkg.mod:Class'"),
        # A skyrl-gym class named as a plain one: the hint says how to name it.
        (
            "tests.envs_skyrl_user:GuessNumber",
            "has no reset method: it is a skyrl-gym environment, name it "
            "'skyrl:tests.envs_skyrl_user:GuessNumber'",
        ),
        ("skyrl:tests.no_such_module:Env", "cannot import module 'tests.no_such_module'"),
        (
            "skyrl:tests.envs_skyrl_user:NotAnEnv",
            "'skyrl:tests.envs_skyrl_user:NotAnEnv' is not a skyrl-gym environment (a "
            "skyrl_gym.Env subclass such as BaseTextEnv)",
        ),
        (
            "skyrl:tests.env_fixtures:GuessEnv",
            "'skyrl:tests.env_fixtures:GuessEnv' is not a skyrl-gym environment",
        ),
    ],
)
def test_loader_errors_are_one_line_naming_the_field(path: str, fragment: str) -> None:
    one_line_error(lambda: make_environment(EnvConfig(path=path)), "rollout.env.path: ", fragment)


def test_loader_names_the_error_a_module_raises_on_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_env_mod.py").write_text("raise RuntimeError('no database')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    one_line_error(
        lambda: load_environment_class("broken_env_mod:Env"),
        "rollout.env.path: cannot import module 'broken_env_mod'",
        "RuntimeError: no database",
    )


def test_loader_refuses_kwargs_the_constructor_lacks_and_passes_those_it_takes() -> None:
    one_line_error(
        lambda: make_environment(EnvConfig(path="tests.env_fixtures:GuessEnv", kwargs={"of": 1})),
        "rollout.env.kwargs: GuessEnv does not take ['of']",
    )
    env = make_environment(EnvConfig(path="tests.env_fixtures:GuessEnv", kwargs={"offset": 1}))
    assert [r.reward for r in play(env, ["6"])] == [1.0]
    assert load_environment_class("tests.env_fixtures:GuessEnv") is fx.GuessEnv


def test_user_error_from_a_wrong_step_return_names_the_class() -> None:
    env = make_environment(EnvConfig(path="tests.env_fixtures:ReturnsThis", kwargs={"value": 3}))
    one_line_error(lambda: play(env, ["x"]), "ReturnsThis.step returned int 3")


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["rollout.env.max_turns=0"], ["'rollout.env'", "max_turns must be >= 1, got 0"]),
        (
            ["rollout.env.tool_parser=json"],
            ["'rollout.env.tool_parser' must be one of 'hermes', 'plain'"],
        ),
        (["rollout.env.path=gsm8k"], ["'rollout.env'", "path must be 'pkg.mod:Class'"]),
        (
            ["rollout.env.on_error=skip"],
            ["'rollout.env.on_error' must be one of 'fail', 'end_episode'"],
        ),
    ],
)
def test_env_config_errors_are_one_line_naming_the_field(
    overrides: list[str], fragments: list[str]
) -> None:
    base = ["rollout.env.path=skyrl:gsm8k_multi_turn"]
    one_line_error(
        lambda: load_config(RunConfig, None, base + overrides), *fragments, error=ConfigError
    )


def test_env_config_loads_and_defaults_to_no_environment() -> None:
    assert load_config(RunConfig).rollout.env is None
    cfg = load_config(RunConfig, None, ["rollout.env.path=trl:a.b:C", "rollout.env.kwargs={x: 1}"])
    assert cfg.rollout.env == EnvConfig(path="trl:a.b:C", kwargs={"x": 1})


def test_every_parser_name_has_a_parser() -> None:
    assert set(PARSERS) == set(typing.get_args(ToolParserName))
    assert set(CALL_TEXT) == set(typing.get_args(ToolParserName))


def test_without_calls_removes_what_its_parser_read_and_nothing_else() -> None:
    hermes = 'Adding.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    plain = "Adding.\nCALL add(a=1)\nCALL mul(a=2, b=3)\n"
    assert without_calls(hermes, "hermes") == "Adding."
    assert without_calls(plain, "plain") == "Adding."
    # Each parser's calls are plain text to the other, and stay in the content.
    assert without_calls(hermes, "plain") == hermes.strip()
    assert without_calls(plain, "hermes") == plain.strip()


def test_envs_import_no_torch_or_transformers() -> None:
    code = (
        "import sys, rftpipe.envs.loader\n"
        "print(*sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


# ------------------------------------------------------------------------ tool schemas


def test_tool_schema_reads_types_defaults_and_google_docstring() -> None:
    assert tool_schema(fx.add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {
                        "type": "integer",
                        "description": "The second number, described on two lines.",
                    },
                },
                "required": ["a"],
            },
        },
    }
    props = tool_schema(fx.lookup)["function"]["parameters"]["properties"]
    assert props["keys"] == {
        "type": "array",
        "items": {"type": "string"},
        "description": "Keys to look up.",
    }
    assert props["mode"] == {
        "type": "string",
        "enum": ["first", "last"],
        "description": "Which match to keep.",
    }
    assert props["strict"]["type"] == "boolean"
    assert props["limit"] == {"type": "integer", "nullable": True, "description": "Most matches."}


def test_tool_schema_matches_transformers_on_what_both_read() -> None:
    from transformers.utils import get_json_schema

    for fn in (fx.divide, fx.lookup):
        ours, theirs = tool_schema(fn)["function"], get_json_schema(fn)["function"]
        assert ours["description"] == theirs["description"]
        assert ours["parameters"] == theirs["parameters"]


def test_tool_schema_refuses_unannotated_and_untyped_tools() -> None:
    one_line_error(
        lambda: tool_schema(fx.unannotated),
        "rollout.env.path: tool 'unannotated': parameter 'a' has no type",
    )

    def no_doc(a: int) -> int:
        return a

    one_line_error(lambda: tool_schema(no_doc), "tool 'no_doc' has no docstring")

    def custom(a: Task) -> None:
        """Takes a class."""

    one_line_error(
        lambda: tool_schema(custom), "tool 'custom': parameter 'a': type", "has no JSON schema"
    )


# ---------------------------------------------------------------------------- parsers


def test_hermes_reads_several_calls() -> None:
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 0}"}</tool_call>'
    )
    assert parse_hermes(text) == (
        [ToolCall("add", {"a": 1, "b": 2}), ToolCall("divide", {"a": 1, "b": 0})],
        None,
    )
    assert parse_hermes("The answer is 5.") == ([], None)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',
            "tool call 1 is not valid JSON",
        ),
        ('<tool_call>{"name": "add", "arguments": {}}', "not closed"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'must be {"name": "...", "arguments": {...}}'),
        ('<tool_call>{"name": "a"}</tool_call><tool_call>[1]</tool_call>', "tool call 2 must be"),
        (
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
            "'arguments' must be a JSON object",
        ),
    ],
)
def test_hermes_malformed_gives_an_error_string_and_no_calls(text: str, fragment: str) -> None:
    calls, error = parse_hermes(text)
    assert calls == [] and error is not None and fragment in error


def test_plain_reads_several_calls_with_literals() -> None:
    text = 'I will compute.\nCALL add(a=1, b=-2)\n  CALL lookup(keys=["x", "y"], mode="first", strict=true)\nDone'
    assert parse_plain(text) == (
        [
            ToolCall("add", {"a": 1, "b": -2}),
            ToolCall("lookup", {"keys": ["x", "y"], "mode": "first", "strict": True}),
        ],
        None,
    )
    assert parse_plain("RECALL that 2+2=4") == ([], None)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("CALL add(1, 2)", "name every argument"),
        ("CALL add(a=1", "is not `CALL name(arg=value, ...)`"),
        ("CALL add", "is not `CALL name(arg=value, ...)`"),
        ("CALL add(a=b)", "must be a literal"),
        ("CALL add(a=1)\nCALL os.system(c='x')", "call 2"),
    ],
)
def test_plain_malformed_gives_an_error_string_and_no_calls(text: str, fragment: str) -> None:
    calls, error = parse_plain(text)
    assert calls == [] and error is not None and fragment in error


def test_render_plain_tools_describes_tools_and_the_format() -> None:
    text = render_plain_tools([tool_schema(fx.add), tool_schema(fx.lookup)])
    assert "- add(a: integer, b: integer (optional)): Add two integers." in text
    assert 'mode: "first" | "last"' in text and "keys: list[string]" in text
    assert "CALL name(arg=value, ...)" in text


# ------------------------------------------------------------------- ToolEnvironment


@pytest.mark.parametrize("parser", ["hermes", "plain"])
def test_tool_environment_runs_calls_reports_errors_and_scores_the_answer(
    parser: ToolParserName,
) -> None:
    env = make_environment(EnvConfig(path="tests.env_fixtures:Calculator", tool_parser=parser))
    assert isinstance(env, fx.Calculator)
    messages, info = env.reset(TASK, 0)
    assert [t["function"]["name"] for t in info["tools"]] == ["add", "divide"]
    assert (messages[0]["role"] == "system" and "CALL name(" in messages[0]["content"]) == (
        parser == "plain"
    )
    calls = {
        "hermes": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
        "plain": "CALL add(a=2, b=3)\nCALL divide(a=1, b=0)\nCALL mul()",
    }[parser]
    r = env.step(calls)
    assert not r.done and r.reward == 0.0
    assert r.observations == [
        {"role": "tool", "name": "add", "content": "5"},
        {
            "role": "tool",
            "name": "divide",
            "content": "{'error': 'ZeroDivisionError: division by zero'}",
        },
        {
            "role": "tool",
            "name": "mul",
            "content": "{'error': \"LookupError: no tool named 'mul' (tools: ['add', 'divide'])\"}",
        },
    ]
    assert r.info == {"tool_calls": ["add", "divide", "mul"], "tool_errors": 2}
    broken = env.step({"hermes": "<tool_call>{</tool_call>", "plain": "CALL add(1)"}[parser])
    assert not broken.done and "error" in broken.observations[0]["content"]
    assert broken.info["tool_errors"] == 1 and broken.info["tool_calls"] == []
    assert env.step("4").reward == 0.0
    final = env.step("5")
    assert final.done and final.reward == 1.0 and final.observations == []


def test_tool_environment_refuses_two_tools_of_one_name() -> None:
    one_line_error(
        lambda: ToolEnvironment([fx.add, fx.add], fx.exact_answer), "two tools of one name"
    )


# ------------------------------------------------------------------------- adapters


def test_skyrl_gsm8k_multi_turn_feedback_then_right_answer() -> None:
    env = make_environment(EnvConfig(path="skyrl:gsm8k_multi_turn", max_turns=3))
    task = Task(prompt_id=1, messages=[{"role": "user", "content": "2+2?"}], answer="4")
    messages, _ = env.reset(task, 0)
    assert messages == task.messages
    wrong = env.step("I think #### 5")
    # The env's per-turn format score is 0.2 / max_turns; ours reaches it as its max_turns.
    assert not wrong.done and wrong.reward == pytest.approx(0.2 / 3)
    assert (
        wrong.observations[0]["role"] == "user"
        and "#### ANSWER" in wrong.observations[0]["content"]
    )
    right = env.step("So #### 4")
    assert right.done and right.reward == 1.0 and right.observations == []
    env.close()


def test_skyrl_episode_ends_at_max_turns_and_reads_a_skyrl_format_row() -> None:
    env = make_environment(EnvConfig(path="skyrl:gsm8k_multi_turn", max_turns=2))
    # A skyrl-format row carries its reward_spec; it wins over the task's answer.
    task = Task(
        prompt_id=2,
        messages=TASK.messages,
        answer="4",
        metadata={"reward_spec": {"ground_truth": "9"}},
    )
    env.reset(task, 0)
    first = env.step("#### 4")
    assert not first.done and "only the final numeric answer" in first.observations[0]["content"]
    last = env.step("no answer")
    # Not done: the rollout ends it as `max_turns` (the environment did not end it).
    assert not last.done and last.reward == 0.0


def test_skyrl_last_turn_is_done_only_when_the_environment_ends_it_itself() -> None:
    """gsm8k_multi_turn is told our max_turns and ends every episode on its last turn; the
    adapter asks it with that limit lifted, so a wrong last answer is not `done` (the
    rollout counts it as `max_turns`) and a right one is, with the rewards it gives."""
    env = make_environment(EnvConfig(path="skyrl:gsm8k_multi_turn", max_turns=2))
    task = Task(prompt_id=1, messages=[{"role": "user", "content": "2+2?"}], answer="4")
    for last_answer, done, reward in (("#### 5", False, 0.2 / 2), ("#### 4", True, 1.0)):
        env.reset(task, 0)
        first = env.step("#### 5")
        assert not first.done and first.reward == pytest.approx(0.2 / 2)
        last = env.step(last_answer)
        assert (last.done, last.reward) == (done, pytest.approx(reward)), last_answer
        assert env.env.max_turns == 2  # lifted for that step alone
    env.close()
    # Right on the first turn ends it there, as before.
    env.reset(task, 0)
    assert env.step("#### 4").done


def test_a_users_own_skyrl_class_is_named_by_import_path() -> None:
    """`skyrl:pkg.mod:Class`: a BaseTextEnv subclass outside skyrl-gym, never registered,
    made per episode as skyrl-gym makes its own (`env_config`, the row's `extras`)."""
    cfg = load_config(
        RunConfig, None, ["rollout.env.path=skyrl:tests.envs_skyrl_user:GuessNumber"]
    ).rollout.env
    assert cfg is not None
    env = make_environment(cfg)
    messages, _ = env.reset(TASK, 0)  # TASK's answer, 5, is the number to guess
    assert messages == [{"role": "system", "content": "Guess a number in [1, 50]."}, *TASK.messages]
    steps = play(env, ["I say 9", "then 2", "it is 5"])
    assert [s.observations for s in steps[:2]] == [
        [{"role": "user", "content": "Lower."}],
        [{"role": "user", "content": "Higher."}],
    ]
    assert steps[-1].done and steps[-1].reward == 1.0
    assert steps[0].reward == skyrl_user.reward("I say 9", 5) > 0
    import skyrl_gym

    assert not any("GuessNumber" in str(s.entry_point) for s in skyrl_gym.registry.values())


def test_skyrl_missing_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    one_line_error(
        lambda: make_environment(EnvConfig(path="skyrl:gsm8k_multi_turn")), "pip install skyrl-gym"
    )


def test_trl_style_environment_tools_reset_text_and_reward() -> None:
    env = make_environment(EnvConfig(path="trl:tests.env_fixtures:TRLCounter", kwargs={"start": 1}))
    messages, info = env.reset(TASK, 0)
    assert messages == [{"role": "user", "content": "Guess. (start at 1, answer 5)"}]
    assert [t["function"]["name"] for t in info["tools"]] == ["increment"]
    r = env.step(
        '<tool_call>{"name": "increment", "arguments": {"by": 3}}</tool_call>'
        '<tool_call>{"name": "increment", "arguments": {"by": -1}}</tool_call>'
    )
    assert [m["content"] for m in r.observations] == [
        "4",
        "{'error': 'ValueError: by must be >= 0'}",
    ]
    final = env.step("I am done.")
    assert final.done and final.reward == 4.0  # the async get_reward, from the env's state
    env.reset(TASK, 0)
    assert env.step("done").reward == 1.0  # reset restored the counter
