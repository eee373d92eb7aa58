"""Render the config reference (``docs/config.md``) from the schema's field docstrings.

``python -m rftpipe.config.reference > docs/config.md`` regenerates it;
``tests/test_docs.py`` fails when the committed file differs from :func:`render`.

The walk is :func:`rftpipe.config.loader.iter_fields` and the text is
:func:`rftpipe.config.loader.field_docs` (the docstring under each field), so the
reference says exactly what ``--help``-style errors say. A variant field (one typed with
an algorithm registry's base class) gets a section listing every registered variant and
the keys of its settings class. Torch-free, like the loader.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from typing import Any, Literal, Union

from rftpipe.algos.registry import Registry, registry_for, variant_of
from rftpipe.config.loader import _sub_config, field_docs, iter_fields, to_dict
from rftpipe.config.schema import RESUME_SAFE_KEYS, SCHEMA_VERSION, RunConfig

__all__ = ["REGENERATE", "render"]

REGENERATE = "python -m rftpipe.config.reference > docs/config.md"
"""The command that rewrites ``docs/config.md``."""


@dataclasses.dataclass
class _Section:
    """One config component: its dotted path, its dataclass and its fields' rows."""

    path: str
    cls: type
    rows: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)
    """Markdown cells (dotted key, type, default, description) per field, in order."""


def _element_config(hint: Any) -> type | None:
    """The dataclass among the elements of a ``tuple[X | Sub, ...]`` hint, if any."""
    if not (hint is tuple or typing.get_origin(hint) is tuple):
        return None
    for arg in typing.get_args(hint):
        members = (
            typing.get_args(arg) if typing.get_origin(arg) in (Union, types.UnionType) else (arg,)
        )
        for member in members:
            if isinstance(member, type) and dataclasses.is_dataclass(member):
                return member
    return None


@dataclasses.dataclass
class _VariantField:
    """A field selecting a variant of ``registry`` (``train.policy_loss``)."""

    path: str
    registry: Registry


def _variants_title(path: str) -> str:
    return f"`{path}` variants"


def _sections(root: type, variants: list[_VariantField] | None = None) -> list[_Section]:
    """Every component of the tree, in depth-first declaration order (the variant fields
    met on the way are appended to ``variants``)."""
    sections: dict[str, _Section] = {"": _Section("", root)}

    def visit(cls: type, prefix: str) -> None:
        for name, hint, default in iter_fields(cls, prefix):
            parent, _, leaf = name.rpartition(".")
            owner = sections[parent]
            doc = field_docs(owner.cls).get(leaf, "")
            type_cell = _cell(_type_text(hint))
            sub = _sub_config(hint)
            element = _element_config(hint)
            registry = registry_for(hint)
            if sub is not None:
                sections[name] = _Section(name, sub)
                type_cell = f"[{type_cell}]({_anchor(_title(name))})"
            elif registry is not None:
                if variants is not None:
                    variants.append(_VariantField(name, registry))
                type_cell = f"[{type_cell}]({_anchor(_variants_title(name))})"
            elif element is not None:
                type_cell = f"[{type_cell}]({_anchor(_title(name + '[]'))})"
            owner.rows.append((name, type_cell, _cell(_default_text(default)), _cell(doc)))
            if element is not None:
                key = f"{name}[]"
                sections[key] = _Section(key, element)
                visit(element, key)

    visit(root, "")
    return list(sections.values())


def _type_text(hint: Any) -> str:
    """A field type as a YAML user reads it (``list[int]``, ``"a" | "b"``, ``str | null``)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        return " | ".join("null" if a is type(None) else _type_text(a) for a in args)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if hint is tuple or origin is tuple:
        return f"list[{_type_text(args[0] if args else Any)}]"
    if hint is dict or origin is dict:
        return "mapping"
    if hint is Any:
        return "any"
    if (registry := registry_for(hint)) is not None:
        return registry.family
    if isinstance(hint, type):
        return hint.__name__
    return str(hint)


def _default_text(default: Any) -> str:
    """The default as YAML-ish JSON; ``required`` when there is none."""
    if default is dataclasses.MISSING:
        return "required"
    if (variant := variant_of(default)) is not None:
        return f"`{json.dumps(variant)}`"
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        return "(below)"
    value = to_dict(default) if dataclasses.is_dataclass(default) else default
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value, default=str)}`"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text (lowercase, punctuation dropped, dashes)."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return "#" + text.replace(" ", "-")


def _cell(text: str) -> str:
    """One table cell: whitespace collapsed to single spaces, pipes escaped."""
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def _class_doc(cls: type) -> str:
    """The class's own docstring, not the signature dataclasses makes up without one."""
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return re.sub(r"\s+", " ", doc).strip()


def _title(path: str) -> str:
    """A section's heading: its dotted path, or "Top level" for the root."""
    return f"`{path}`" if path else "Top level"


def _variant_lines(field: _VariantField) -> list[str]:
    """The section of one variant field: its variants, then each one's settings."""
    path, registry = field.path, field.registry
    lines = [
        "",
        f"### {_variants_title(path)}",
        "",
        f"The {registry.family} selected by `{path}` (`{path}.type` in a mapping), and the "
        f"keys of its settings (`rftpipe/algos/variants.py`).",
        "",
        "| type | settings |",
        "|---|---|",
    ]
    for name in registry:
        keys = registry[name].setting_names()
        heading = f"`{path}.type={name}`"
        cells = ", ".join(f"`{k}`" for k in keys) or "none"
        lines.append(f"| [`{name}`]({_anchor(heading)}) | {cells} |")
    for name in registry:
        settings = registry[name].settings
        lines += ["", f"#### `{path}.type={name}`", ""]
        doc = _class_doc(settings)
        if doc:
            lines += [doc, ""]
        lines.append(f"`{settings.__name__}`")
        docs = field_docs(settings)
        rows = [
            f"| `{path}.{key}` | {_cell(_type_text(hint))} | {_cell(_default_text(default))} "
            f"| {_cell(docs.get(key, ''))} |"
            for key, hint, default in iter_fields(settings)
        ]
        if rows:
            lines += ["", "| key | type | default | description |", "|---|---|---|---|", *rows]
    return lines


def render(root: type = RunConfig) -> str:
    """The Markdown text of ``docs/config.md`` for the config tree rooted at ``root``."""
    variants: list[_VariantField] = []
    sections = _sections(root, variants)
    lines = [
        "# Config reference",
        "",
        "<!-- Generated: do not edit. Regenerate with",
        f"     {REGENERATE}",
        "     tests/test_docs.py::test_config_reference_is_current fails when it is stale. -->",
        "",
        "Generated from the field docstrings of `rftpipe/config/schema.py` (config schema "
        f"version {SCHEMA_VERSION}). Every key can be set in the YAML file given to "
        "`--config` or as a dotted `key=value` override on the command line "
        "(`python -m jobs.submit ... train.lr=1e-5 rollout.n=8`); values are parsed as YAML. "
        "An unknown key names the closest valid one; a bad value names the field. "
        "`list[...]` fields take a YAML list; `key[]` sections describe one element of a list "
        "field written as a mapping. An algorithm variant (`advantage.estimator`, "
        "`kl.estimator`, `train.policy_loss`) is its name (`train.policy_loss: sapo`, the "
        "variant with default settings) or a mapping of its `type` and settings "
        "(`{type: sapo, tau_pos: 1.2}`; without `type`, the default's type); on the command "
        "line `train.policy_loss=sapo train.policy_loss.tau_pos=1.2`. Each variant has its own "
        "settings ([Variants](#variants)); another variant's settings are refused naming it.",
        "",
        "Sections:",
        "",
    ]
    for s in sections:
        depth = s.path.count(".") + (1 if s.path else 0)
        indent = "  " * max(depth - 1, 0)
        lines.append(f"{indent}- [{_title(s.path)}]({_anchor(_title(s.path))})")
    lines.append("- [Variants](#variants)")
    for v in variants:
        lines.append(f"  - [{_variants_title(v.path)}]({_anchor(_variants_title(v.path))})")
    for s in sections:
        lines += ["", f"## {_title(s.path)}", ""]
        doc = _class_doc(s.cls)
        if doc:
            lines += [doc, ""]
        lines += [
            f"`{s.cls.__name__}`",
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| `{key}` | {type_cell} | {default} | {doc} |"
            for key, type_cell, default, doc in s.rows
        ]
    lines += ["", "## Variants"]
    for v in variants:
        lines += _variant_lines(v)
    lines += [
        "",
        "## Keys that may change on resume",
        "",
        "Resuming a run (`--run-dir` of an existing run) refuses a config whose other keys "
        "differ from the ones the run started with (exit code 2, unless "
        "`--allow-fingerprint-mismatch`). A prefix covers its whole subtree. Some keys have "
        "further conditions, checked at submit (e.g. `total_steps` may change only under a "
        "constant LR schedules).",
        "",
    ]
    lines += [f"- `{key}`" for key in RESUME_SAFE_KEYS]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Print the reference (``python -m rftpipe.config.reference > docs/config.md``)."""
    print(render(), end="")


if __name__ == "__main__":
    main()
