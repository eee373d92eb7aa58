"""Tools as plain typed Python functions: their function-calling schema (`tool_schema`),
the tool-call parsers (`PARSERS`, keyed by `rollout.env.tool_parser`), and
`ToolEnvironment`, an environment built from tools and a reward of the final answer.

Two tool-call formats are read:

- `hermes` (Hermes, Qwen 2.5/3 chat templates): one block per call,
  ``<tool_call>\\n{"name": "add", "arguments": {"a": 1, "b": 2}}\\n</tool_call>``.
- `plain`, for a model without tool support: one line per call,
  ``CALL add(a=1, b=2)``, each value a Python literal (`true`/`false`/`null` also
  accepted); `render_plain_tools` describes the tools and this format for a system prompt.

A parse returns `(calls, error)`: a malformed call gives an error string, which the
environment answers to the model, and no calls (all or nothing), never an exception.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rftpipe.config.schema import ToolParserName
from rftpipe.envs.base import FIELD, StepResult, Task, call
from rftpipe.errors import UserError

# ------------------------------------------------------------------------ tool schemas

_JSON_TYPES: dict[Any, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    dict: "object",
}

_SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI / Hugging Face function schema of `fn`, from its annotations (int, float,
    str, bool, list[...], dict, Literal[...], X | None) and its Google-style docstring: the
    first paragraph is the description, the `Args:` section the per-argument ones. A
    parameter without an annotation, or a type JSON cannot say, is a one-line UserError."""
    name = getattr(fn, "__name__", repr(fn))
    doc = inspect.getdoc(fn)
    if not doc:
        raise UserError(
            f"{FIELD}: tool '{name}' has no docstring (its first paragraph describes it)"
        )
    description, arg_docs = _parse_docstring(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an annotation naming something undefined
        raise UserError(f"{FIELD}: tool '{name}': cannot read its annotations ({exc})") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise UserError(f"{FIELD}: tool '{name}': parameter '{p.name}' must be a named one")
        if p.name not in hints:
            raise UserError(f"{FIELD}: tool '{name}': parameter '{p.name}' has no type annotation")
        prop = _json_type(hints[p.name], f"tool '{name}': parameter '{p.name}'")
        if p.name in arg_docs:
            prop["description"] = arg_docs[p.name]
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _json_type(hint: Any, what: str) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if hint is Any:
        return {}
    if origin is Literal:
        kinds = sorted({_JSON_TYPES[type(a)] for a in args if type(a) in _JSON_TYPES})
        if len(kinds) != 1:
            raise UserError(
                f"{FIELD}: {what}: Literal values must share one of int, float, str, bool"
            )
        return {"type": kinds[0], "enum": list(args)}
    if origin is list:
        return {"type": "array", **({"items": _json_type(args[0], what)} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return {**_json_type(rest[0], what), "nullable": True}
    raise UserError(
        f"{FIELD}: {what}: type {hint!r} has no JSON schema here (use int, float, str, bool, "
        "list[...], dict, Literal[...] or X | None)"
    )


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, argument -> description) of a Google-style docstring."""
    lines = doc.splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        first.append(line.strip())
    args: dict[str, str] = {}
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:"))
    except StopIteration:
        return " ".join(first), args
    indent: int | None = None
    current: str | None = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # the next section (or text) at the docstring's own indent
            break
        if indent is None:
            indent = depth
        m = _ARG_LINE.match(line.strip())
        if depth == indent and m:
            current = m.group(1).lstrip("*")
            args[current] = m.group(3).strip()
        elif current is not None:  # a continuation line, deeper than the argument's
            args[current] = f"{args[current]} {line.strip()}".strip()
    return " ".join(first), args


# ---------------------------------------------------------------------------- parsers


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model asked for."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


Parsed = tuple[list[ToolCall], str | None]
"""(calls, error): the calls in the text, or none and why the text is malformed."""

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> Parsed:
    """Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""
    bodies = _HERMES.findall(text)
    outside = _HERMES.sub("", text)
    if "<tool_call>" in outside or "</tool_call>" in outside:
        return [], "a <tool_call> block is not closed by </tool_call> (or not opened)"
    calls: list[ToolCall] = []
    for i, body in enumerate(bodies, 1):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return [], f"tool call {i} is not valid JSON ({exc.msg} at char {exc.pos})"
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return [], f'tool call {i} must be {{"name": "...", "arguments": {{...}}}}'
        if not isinstance(args, dict):
            return [], f"tool call {i}: 'arguments' must be a JSON object"
        calls.append(ToolCall(obj["name"], args))
    return calls, None


_PLAIN = re.compile(r"^[ \t]*CALL\b(.*)$", re.MULTILINE)
_JSON_NAMES = {"true": True, "false": False, "null": None}


def parse_plain(text: str) -> Parsed:
    """Lines `CALL name(arg=value, ...)`, each value a Python literal (or true/false/null)."""
    calls: list[ToolCall] = []
    for i, m in enumerate(_PLAIN.finditer(text), 1):
        source = m.group(1).strip()
        try:
            node = ast.parse(source, mode="eval").body
        except SyntaxError:
            return [], f"call {i} `CALL {source}` is not `CALL name(arg=value, ...)`"
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            return [], f"call {i} `CALL {source}` is not `CALL name(arg=value, ...)`"
        if node.args or any(k.arg is None for k in node.keywords):
            return [], f"call {i} `CALL {source}`: name every argument (arg=value)"
        try:
            args = {str(k.arg): _literal(k.value) for k in node.keywords}
        except ValueError:
            return (
                [],
                f'call {i} `CALL {source}`: each value must be a literal (number, "text", list)',
            )
        calls.append(ToolCall(node.func.id, args))
    return calls, None


def _literal(node: ast.expr) -> Any:
    class _JsonNames(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            if n.id in _JSON_NAMES:
                return ast.copy_location(ast.Constant(_JSON_NAMES[n.id]), n)
            return n

    return ast.literal_eval(_JsonNames().visit(node))


#: `rollout.env.tool_parser` -> its parser (a test holds that every ToolParserName is here).
PARSERS: dict[ToolParserName, Callable[[str], Parsed]] = {
    "hermes": parse_hermes,
    "plain": parse_plain,
}

#: The text each parser reads as its calls (a test holds that every ToolParserName is here).
CALL_TEXT: dict[ToolParserName, re.Pattern[str]] = {"hermes": _HERMES, "plain": _PLAIN}


def without_calls(text: str, parser: ToolParserName) -> str:
    """`text` less what `parser` read as calls: the `content` of an answer whose calls go
    back as OpenAI `tool_calls` (the endpoint, `rftpipe.stages.agents`)."""
    return CALL_TEXT[parser].sub("", text).strip()


def render_plain_tools(schemas: Sequence[Mapping[str, Any]]) -> str:
    """A system-prompt text describing `schemas`' tools and the `plain` call format."""
    lines = [
        "You can call these tools:",
        "",
    ]
    for s in schemas:
        fn = s["function"]
        props = fn["parameters"]["properties"]
        required = set(fn["parameters"].get("required", ()))
        sig = ", ".join(
            f"{k}: {_type_text(v)}" + ("" if k in required else " (optional)")
            for k, v in props.items()
        )
        lines.append(f"- {fn['name']}({sig}): {fn['description']}")
        lines += [f"    {k}: {v['description']}" for k, v in props.items() if v.get("description")]
    lines += [
        "",
        "To call a tool, write a line of its own:",
        "CALL name(arg=value, ...)",
        'Values are literals: 3, 2.5, "text", true, false, [1, 2]. Write one line per call;',
        "the results come back in the next message. When you have the final answer, reply",
        "without any CALL line.",
    ]
    return "\n".join(lines)


def _type_text(prop: Mapping[str, Any]) -> str:
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if prop.get("type") == "array" and "items" in prop:
        return f"list[{_type_text(prop['items'])}]"
    return str(prop.get("type", "any"))


# ------------------------------------------------------------------- tool environment


def tool_message(name: str, content: str) -> dict[str, str]:
    """A `tool` chat message answering the call of `name`."""
    return {"role": "tool", "name": name, "content": content}


def run_calls(
    calls: Sequence[ToolCall], tools: Mapping[str, Callable[..., Any]]
) -> tuple[list[dict[str, str]], int]:
    """One tool message per call, in order: the tool's result as text, or (like TRL) its
    exception as `{'error': 'Type: message'}`, so the model sees what went wrong; and how
    many of the calls failed."""
    out = []
    errors = 0
    for c in calls:
        try:
            if c.name not in tools:
                raise LookupError(f"no tool named {c.name!r} (tools: {sorted(tools)})")
            content = str(call(tools[c.name], **c.arguments))
        except Exception as exc:  # the tool's failure is the model's observation
            content = str({"error": f"{type(exc).__name__}: {exc}"})
            errors += 1
        out.append(tool_message(c.name, content))
    return out, errors


def with_tools_prompt(messages: Sequence[Mapping[str, Any]], text: str) -> list[dict[str, Any]]:
    """`messages` with `text` added to the system message (one is put first if none)."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        return out
    return [{"role": "system", "content": text}, *out]


AnswerReward = Callable[[str, Task], Any]
"""The reward of a final answer (the response without tool calls) for the task; may be
`async def`."""


class ToolEnvironment:
    """An environment of tools: each response's tool calls are run and answered with `tool`
    messages; a response without calls is the final answer, scored by `reward`, and ends
    the episode. A malformed call is answered with the parser's error (reward 0).

    `reset`'s info holds the tools' schemas under `"tools"` (for a chat template's
    `tools=`); with the `plain` parser the tools and the call format are also added to the
    system message. Subclass it and give `parser` through to `__init__` to load it by path:
    the loader passes `rollout.env.tool_parser` as `parser`."""

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        reward: AnswerReward,
        parser: ToolParserName = "hermes",
    ) -> None:
        self.tools = {getattr(fn, "__name__", repr(fn)): fn for fn in tools}
        if len(self.tools) != len(tools):
            raise UserError(f"{FIELD}: {type(self).__name__} has two tools of one name")
        self.schemas = [tool_schema(fn) for fn in tools]
        self.reward = reward
        self.parse = PARSERS[parser]
        self.parser: ToolParserName = parser
        self.task: Task | None = None

    def reset(self, task: Task, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.task = task
        messages = [dict(m) for m in task.messages]
        if self.parser == "plain":
            messages = with_tools_prompt(messages, render_plain_tools(self.schemas))
        return messages, {"tools": self.schemas}

    def step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError(f"{type(self).__name__}.step before reset")
        calls, error = self.parse(action_text)
        if error is not None:
            return StepResult(
                observations=[{"role": "tool", "content": str({"error": error})}],
                reward=0.0,
                done=False,
                # A malformed call is a call that failed.
                info={"parse_error": error, "tool_calls": [], "tool_errors": 1},
            )
        if not calls:
            reward = call(self.reward, action_text, self.task)
            return StepResult(observations=[], reward=reward, done=True)
        messages, errors = run_calls(calls, self.tools)
        return StepResult(
            observations=messages,
            reward=0.0,
            done=False,
            info={"tool_calls": [c.name for c in calls], "tool_errors": errors},
        )

    def close(self) -> None:
        self.task = None
