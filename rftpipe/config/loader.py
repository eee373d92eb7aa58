"""Typed YAML config loading for trees of frozen dataclasses.

The config schema (``rftpipe/config/schema.py``, a module per section) is a tree of
``@dataclass(frozen=True, kw_only=True, slots=True)`` classes whose fields carry a
docstring (a string literal statement right below the field). This module turns a
YAML file plus dotted ``key=value`` command-line overrides into an instance of such a
tree, validating types strictly and reporting every problem as a one-line
:class:`ConfigError` that names the dotted field.

A field typed with the base class of an algorithm registry
(:mod:`rftpipe.algos.registry`) selects one of its variants: a name (``sapo``) or a
mapping ``{type: sapo, tau_pos: 1.2}`` builds that variant's own settings class, and
:func:`to_dict` writes it back as such a mapping (``type`` first). A mapping without
``type`` keeps the type of the field's default.

It also provides the helpers needed around a loaded config: a plain-dict view
(:func:`to_dict`, :func:`dump_yaml`), a stable hash used to refuse resuming a run with
a different config (:func:`fingerprint`, :func:`diff_keys`), and introspection for
``--help`` output and documentation tests (:func:`field_docs`, :func:`iter_fields`).

Only the standard library, PyYAML and the torch-free registry module are imported on
purpose: this module runs on Slurm login nodes (validating a config before ``sbatch``)
where importing torch would cost seconds or be impossible.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import difflib
import functools
import hashlib
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

import yaml

from rftpipe.algos.registry import Registry, UnknownVariantError, registry_for, variant_of
from rftpipe.errors import UserError

__all__ = [
    "ConfigError",
    "MovedKey",
    "diff_keys",
    "dump_yaml",
    "field_docs",
    "fingerprint",
    "from_dict",
    "iter_fields",
    "load_config",
    "to_dict",
]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# Only config dataclasses are built (`dataclasses.fields` and the hint cache need one).
T = TypeVar("T", bound="DataclassInstance")

# Longest value representation quoted in an error message; configs can hold long
# strings (prompt templates) and the message must stay a readable single line.
_MAX_REPR = 80


class ConfigError(UserError, ValueError):
    """A one-line, user-facing message naming the dotted field.

    Newlines in the message are collapsed so that the error prints as a single line
    in Slurm logs and CLI output, whatever the origin of the text (e.g. a
    ``__post_init__`` message or a PyYAML problem description).
    """

    def __init__(self, message: str) -> None:
        """Store ``message`` with every line break collapsed into a single space."""
        super().__init__(re.sub(r"\s*[\r\n]+\s*", " ", message).strip())


@dataclasses.dataclass(frozen=True, slots=True)
class _OverrideValue:
    """A command-line override value: its YAML-parsed form and its original text.

    The text is kept because YAML guesses scalar types: ``run_name=2024`` parses as an
    int and ``mode=on`` as a bool. When the target field wants a string we fall back
    to the text the user typed instead of rejecting it.
    """

    text: str
    """The value exactly as written after ``=``, stripped of surrounding spaces."""
    value: Any
    """The value parsed with ``yaml.safe_load``."""


@dataclasses.dataclass(frozen=True, slots=True)
class MovedKey:
    """An old key of a config section whose value now lives in the settings of the section's
    variant field that declares it (field metadata ``{"moved": {old key: MovedKey(...)}}``).

    A user's YAML or override that still uses the old key is refused with the new key's
    name; a saved config (``saved=True``) is migrated: the value moves into the variant's
    settings when the selected variant has that setting, and is dropped otherwise (older
    versions wrote every variant's settings, each read only by its own variant)."""

    into: str
    """The setting's name in the variant's settings class."""

    variants: tuple[str, ...] = ()
    """The variants the old key applied to (empty: every variant that has the setting)."""


# --------------------------------------------------------------------------- loading


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    saved: bool = False,
) -> T:
    """Load a config tree of type ``cls`` from a YAML file and dotted overrides.

    Args:
        cls: The root config dataclass.
        path: YAML file to read; ``None`` starts from an empty mapping (all defaults).
        overrides: ``dotted.key=value`` strings applied on top of the file in order;
            values are parsed as YAML so ``1e-5``, ``true``, ``[1, 2]`` and ``null``
            work.
        saved: the file is a config this program wrote itself earlier (a run
            directory's), perhaps by an older version: its *retired* values are dropped
            and its *moved* keys migrated instead of refused (see :func:`from_dict`).

    Returns:
        The constructed (and ``__post_init__``-validated) config instance.

    Raises:
        ConfigError: For unreadable or malformed YAML, malformed overrides, unknown
            keys, missing required fields, type mismatches and ``__post_init__``
            failures; the message is one line and names the dotted field.
    """
    data: dict[Any, Any] = {} if path is None else _read_yaml(Path(path))
    return from_dict(cls, data, overrides, saved=saved)


def from_dict(
    cls: type[T], data: Mapping[str, Any], overrides: Sequence[str] = (), *, saved: bool = False
) -> T:
    """Build a config tree of type ``cls`` from an in-memory mapping.

    Same validation as :func:`load_config`; useful to rebuild a config from a saved
    :func:`to_dict` result (e.g. a run's ``config.json`` on resume).
    ``data`` is not modified.

    A field whose type changed declares the types of its old values in its metadata,
    ``{"retired": {type: explanation}}``. Such a value is refused with the explanation
    (a plain type error would not say what the field means now), except in ``data``
    with ``saved=True``: a config written by an older version is migrated by dropping
    the value, so the field takes its default. Likewise a key that moved into a variant
    field's settings (see :class:`MovedKey`) is refused with its new name, except in
    ``data`` with ``saved=True``, which is migrated. Overrides are always refused. A field
    added with a default that changes what a run computes declares the value that means
    "as before" in ``{"before_it_existed": value}``: a saved config without the key gets it.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type, got {cls!r}")
    # A bare string is a Sequence[str] too; iterating it would yield one bogus
    # override per character, so catch the mistake at the API boundary.
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not a str")
    if not isinstance(data, Mapping):
        raise ConfigError(f"top level of the config must be a mapping, got {_describe(data)}")
    tree = _migrate(cls, data) if saved else _copy_tree(data)
    for item in overrides:
        _apply_override(tree, item, cls)
    return _build(cls, tree, "")


def _retired(f: dataclasses.Field, value: Any) -> str | None:
    """The explanation ``f`` declares for ``value``'s type, if that type is retired."""
    retired = f.metadata.get("retired")
    if not retired:
        return None
    if isinstance(value, _OverrideValue):
        value = value.value
    return retired.get(type(value))


def _migrate(cls: type, data: Mapping[str, Any]) -> dict[Any, Any]:
    """A copy of the raw ``data`` without the retired values of ``cls``'s tree, and with its
    moved keys inside the variant fields that now hold them."""
    out = _copy_tree(data)
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("moved"):
            _move_into_variant(out, f, hints[f.name])
        if f.name not in out and "before_it_existed" in f.metadata:
            # A saved config holds every key of its version: one without this key was
            # written before it existed, and resumes doing what that version did.
            out[f.name] = f.metadata["before_it_existed"]
        if f.name not in out:
            continue
        if _retired(f, out[f.name]) is not None:
            del out[f.name]
        elif (sub := _sub_config(hints[f.name])) is not None and isinstance(out[f.name], Mapping):
            out[f.name] = _migrate(sub, out[f.name])
    return out


def _move_into_variant(out: dict[Any, Any], f: dataclasses.Field, hint: Any) -> None:
    """Move the old keys ``f`` declares (``MovedKey``) from ``out`` into ``out[f.name]``,
    the raw variant selection, where its variant has the setting; drop them elsewhere."""
    moved: dict[str, MovedKey] = f.metadata["moved"]
    old = {key: out.pop(key) for key in list(moved) if key in out}
    registry = registry_for(hint)
    if not old or registry is None:
        return
    node = out.get(f.name)
    if node is None:
        node = {}
    elif isinstance(node, str):
        node = {"type": node}
    elif isinstance(node, Mapping):
        node = dict(node)
    else:
        return  # not a selection at all: _build says so
    name = node.setdefault("type", _default_variant(f))
    if not isinstance(name, str) or name not in registry:
        out[f.name] = node
        return  # _build names the unknown variant
    settings = registry[name].setting_names()
    for key, value in old.items():
        rule = moved[key]
        if rule.into in settings and (not rule.variants or name in rule.variants):
            node.setdefault(rule.into, value)
    out[f.name] = node


def _default_variant(f: dataclasses.Field) -> str | None:
    """The variant name of a variant field's default settings."""
    default = _field_default(f)
    return None if default is dataclasses.MISSING else variant_of(default)


def _field_default(f: dataclasses.Field) -> Any:
    """``f``'s default value (built by its factory), or ``dataclasses.MISSING``."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _moved_message(cls: type, key: str, path: str) -> str | None:
    """Where the old key ``key`` of section ``cls`` went, if it moved into a variant field."""
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        rule = f.metadata.get("moved", {}).get(key)
        registry = registry_for(hints[f.name])
        if rule is None or registry is None:
            continue
        dest = _join(path, f.name)
        owners = [
            name
            for name in registry
            if (not rule.variants or name in rule.variants)
            and rule.into in registry[name].setting_names()
        ]
        which = f"={owners[0]}" if len(owners) == 1 else f" one of {', '.join(owners)}"
        return (
            f"config key '{_join(path, key)}' was moved: use {dest}.{rule.into} "
            f"(with {dest}.type{which})"
        )
    return None


def _read_yaml(path: Path) -> dict[Any, Any]:
    """Read ``path`` with ``yaml.safe_load``; the top level must be a mapping or empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: '{path}'") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid UTF-8: {exc.reason}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file '{path}': {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"invalid YAML in '{path}'{_yaml_location(exc)}: {_yaml_problem(exc)}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}': top level must be a mapping, got {_describe(data)}"
        )
    return data


def _yaml_location(exc: yaml.YAMLError) -> str:
    """Return ``" at line L, column C"`` (1-based) for a PyYAML error, or ``""``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is None:
        return ""
    # PyYAML marks are 0-based; editors count from 1.
    return f" at line {mark.line + 1}, column {mark.column + 1}"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Return the short problem description of a PyYAML error (without the snippet)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        parts = [p for p in (exc.context, exc.problem) if p]
        if parts:
            return "; ".join(parts)
    return str(exc)


# ------------------------------------------------------------------------- overrides


def _apply_override(tree: dict[Any, Any], item: str, cls: type) -> None:
    """Set the dotted key of one ``key=value`` override inside the raw ``tree`` of ``cls``.

    Intermediate mappings are created as needed: whether the key is actually valid is
    checked later by :func:`_build`, which knows the schema and can suggest the
    closest key. This is also what lets overrides create new keys inside free-form
    ``dict[str, Any]`` fields. A variant field given by name (``policy_loss: sapo``) becomes
    ``{type: sapo}`` when an override sets one of its settings.
    """
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    parts = key.split(".")
    if not key or not all(parts):
        raise ConfigError(f"override '{item}' has an empty key or an empty dotted segment")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"override '{item}': value of '{key}' is not valid YAML ({_yaml_problem(exc)})"
        ) from None

    node = tree
    owner: type | None = cls  # the dataclass of `node`, while the path follows the schema
    for depth, part in enumerate(parts[:-1]):
        hint = _type_hints(owner).get(part) if owner is not None else None
        owner = _sub_config(hint)
        child = node.get(part)
        if isinstance(child, _OverrideValue):
            # An earlier override set this whole subtree; descend into its value.
            child = child.value
        if child is None:
            # ``section:`` with nothing under it loads as None; treat it as empty so
            # that ``section.key=value`` still works.
            child = {}
        if isinstance(child, str) and registry_for(hint) is not None:
            # A variant by name alone is that variant with default settings.
            child = {"type": child}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"override '{item}': '{where}' is {_describe(child)}, not a mapping")
        node[part] = child
        node = child
    node[parts[-1]] = _OverrideValue(text.strip(), value)


def _copy_tree(value: Any) -> Any:
    """Copy nested dicts/lists so that overrides never mutate the caller's data."""
    if isinstance(value, Mapping):
        return {k: _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy_tree(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    """Deep-copy ``value`` with every override wrapper replaced by its parsed value."""
    if isinstance(value, _OverrideValue):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# -------------------------------------------------------------------------- building


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """Resolve the (string, because of ``from __future__ import annotations``) hints."""
    return typing.get_type_hints(cls)


def _join(prefix: str, name: str) -> str:
    """Dotted path of ``name`` under ``prefix`` (``prefix`` may be the empty root)."""
    return f"{prefix}.{name}" if prefix else name


def _build(cls: type[T], data: Any, path: str, variant: tuple[Registry, str] | None = None) -> T:
    """Construct dataclass ``cls`` from the raw mapping ``data`` found at ``path``
    (``variant``: ``cls`` is the settings class of this registry's variant)."""
    if isinstance(data, _OverrideValue):
        data = data.value
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        where = f"config section '{path}'" if path else "top level of the config"
        raise ConfigError(f"{where} must be a mapping, got {_describe(data)}")

    init_fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in init_fields]
    for key in data:
        if key not in names:
            if variant is not None:
                raise ConfigError(_unknown_setting_message(str(key), names, path, *variant))
            raise ConfigError(
                _moved_message(cls, str(key), path) or _unknown_key_message(str(key), names, path)
            )

    hints = _type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in init_fields:
        dotted = _join(path, f.name)
        if f.name in data:
            if (why := _retired(f, data[f.name])) is not None:
                raise ConfigError(f"config field '{dotted}' {why}")
            registry = registry_for(hints[f.name])
            if registry is not None:
                kwargs[f.name] = _coerce_variant(
                    data[f.name], registry, dotted, _default_variant(f)
                )
            else:
                kwargs[f.name] = _coerce(data[f.name], hints[f.name], dotted)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config field '{dotted}'")

    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        # Cross-field checks live in __post_init__; prefix them with the section so the
        # user knows where to look.
        where = f" in '{path}'" if path else ""
        raise ConfigError(f"config error{where}: {exc}") from exc


def _unknown_setting_message(
    key: str, names: list[str], path: str, registry: Registry, variant: str
) -> str:
    """Error text for a key the selected variant's settings lack: the variants that have
    it, else the closest setting of this one."""
    owners = [name for name in registry if key in registry[name].setting_names()]
    where = f"unknown config key '{_join(path, key)}' for {path}.type={variant}"
    if owners:
        return f"{where}; it is a setting of {', '.join(owners)} (set {path}.type)"
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return f"{where}; did you mean '{_join(path, close[0])}'?"
    return f"{where}; its keys: {', '.join(['type', *names])}"


def _coerce_variant(value: Any, registry: Registry, path: str, default: str | None) -> Any:
    """Build the settings of the variant ``value`` selects: a name, a mapping with ``type``
    and settings (without ``type``: the variant ``default``), or a settings instance."""
    text = value.text if isinstance(value, _OverrideValue) else None
    if isinstance(value, _OverrideValue):
        value = value.value
    if isinstance(value, registry.base):
        if registry.name_of(type(value)) is None:
            raise ConfigError(
                f"config field '{path}': {type(value).__name__} is not the settings class of "
                f"a registered {registry.family}"
            )
        return value
    if isinstance(value, str) or (text is not None and _is_scalar(value)):
        name: Any = text if text is not None else value
        settings: dict[Any, Any] = {}
    elif isinstance(value, Mapping):
        settings = dict(value)
        name = settings.pop("type", default)
        if isinstance(name, _OverrideValue):
            name = name.text
    else:
        raise ConfigError(
            f"config field '{path}' expects a {registry.family} name, or a mapping with its "
            f"type and settings, got {_describe(value)}"
        )
    if name is None:
        raise ConfigError(f"config field '{path}' needs a type: one of {', '.join(registry)}")
    if not isinstance(name, str):
        raise ConfigError(
            f"config field '{path}.type' expects a {registry.family} name, got {_describe(name)}"
        )
    try:
        entry = registry[name]
    except UnknownVariantError as exc:
        raise ConfigError(f"config field '{path}': {exc}") from None
    return _build(entry.settings, settings, path, (registry, name))


def _unknown_key_message(key: str, names: list[str], path: str) -> str:
    """Error text for an unknown key, with the closest valid sibling if there is one."""
    dotted = _join(path, key)
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return f"unknown config key '{dotted}'; did you mean '{_join(path, close[0])}'?"
    valid = ", ".join(names) if names else "(none)"
    return f"unknown config key '{dotted}'; valid keys here: {valid}"


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Validate ``value`` against the type ``hint`` of the field at ``path``."""
    text: str | None = None
    if isinstance(value, _OverrideValue):
        text, value = value.text, value.value

    if hint is Any:
        return _plain(value)

    origin = typing.get_origin(hint)
    args = typing.get_args(hint)

    if origin is Union or origin is types.UnionType:
        return _coerce_union(value, text, args, hint, path)
    if origin is Literal:
        return _coerce_literal(value, text, args, path)
    if value is None:
        raise ConfigError(f"config field '{path}' must not be null (expected {_type_name(hint)})")
    if hint is tuple or origin is tuple:
        return _coerce_tuple(value, args, path)
    if hint is dict or origin is dict:
        return _coerce_dict(value, args, path)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if (registry := registry_for(hint)) is not None:
        return _coerce_variant(
            value if text is None else _OverrideValue(text, value), registry, path, None
        )
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(
            f"config field '{path}' expects a bool (true/false), got {_describe(value)}"
        )
    if hint is int:
        # bool is a subclass of int and would silently become 0/1.
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config field '{path}' expects an int, got {_describe(value)}")
    if hint is float:
        return _coerce_float(value, path)
    if hint is str:
        if isinstance(value, str):
            return value
        if text is not None and _is_scalar(value):
            # ``name=2024`` on the command line: the user meant the text.
            return text
        raise ConfigError(
            f"config field '{path}' expects a str, got {_describe(value)}{_quote_hint(value)}"
        )
    # The schema, not the user's YAML, is wrong here.
    raise TypeError(f"unsupported config field type {hint!r} for '{path}'")


def _coerce_union(value: Any, text: str | None, args: tuple[Any, ...], hint: Any, path: str) -> Any:
    """Handle ``X | None`` (and, generally, unions tried left to right)."""
    members = [a for a in args if a is not type(None)]
    if value is None:
        if len(members) < len(args):
            return None
        raise ConfigError(f"config field '{path}' must not be null (expected {_type_name(hint)})")
    # Re-wrap so that the str fallback for overrides still applies inside the union.
    raw = value if text is None else _OverrideValue(text, value)
    if len(members) == 1:
        # Propagate the member's own, more specific error (e.g. an unknown key inside
        # an optional sub-config).
        return _coerce(raw, members[0], path)
    mapping_error: ConfigError | None = None
    for member in members:
        try:
            return _coerce(raw, member, path)
        except ConfigError as exc:
            if isinstance(value, Mapping) and dataclasses.is_dataclass(member):
                mapping_error = exc
    if mapping_error is not None:
        # A mapping was meant for the sub-config (`str | Sub`): its own error names the key.
        raise mapping_error
    raise ConfigError(f"config field '{path}' expects {_type_name(hint)}, got {_describe(value)}")


def _coerce_literal(value: Any, text: str | None, allowed: tuple[Any, ...], path: str) -> Any:
    """Accept exactly one of the ``Literal`` values (compared with type, not just ==)."""
    for option in allowed:
        if type(value) is type(option) and value == option:
            return option
    # ``mode=on`` parses as True in YAML 1.1; the user typed the literal "on".
    if text is not None and text in allowed:
        return text
    options = ", ".join(repr(o) for o in allowed)
    if text is not None:
        # Show what the user typed; "bool True" would be confusing for ``mode=on``.
        got = repr(text)
    else:
        quote = _quote_hint(value) if any(isinstance(o, str) for o in allowed) else ""
        got = _describe(value) + quote
    raise ConfigError(f"config field '{path}' must be one of {options}; got {got}")


def _coerce_float(value: Any, path: str) -> float:
    """Accept floats, ints and numeric strings.

    Numeric strings matter because YAML 1.1 only reads ``1.0e-5`` as a float: the
    common spelling ``1e-5`` (no dot) loads as the string ``"1e-5"``.
    """
    if isinstance(value, bool):
        raise ConfigError(f"config field '{path}' expects a float, got {_describe(value)}")
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"config field '{path}': {value} is too large for a float") from None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"config field '{path}' expects a float, got {_describe(value)}")


def _coerce_tuple(value: Any, args: tuple[Any, ...], path: str) -> tuple[Any, ...]:
    """Accept a YAML list for ``tuple[X, ...]`` (or a fixed-length ``tuple[X, Y]``)."""
    # A str is iterable; accepting it would silently split "abc" into characters.
    if not isinstance(value, list | tuple):
        raise ConfigError(f"config field '{path}' expects a list, got {_describe(value)}")
    if not args:
        return tuple(_plain(v) for v in value)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(
            f"config field '{path}' expects a list of {len(args)} items, got {len(value)}"
        )
    return tuple(
        _coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
    )


def _coerce_dict(value: Any, args: tuple[Any, ...], path: str) -> dict[Any, Any]:
    """Accept a mapping for ``dict[K, V]``; ``dict[str, Any]`` keeps YAML values as-is."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"config field '{path}' expects a mapping, got {_describe(value)}")
    key_type, value_type = args if args else (Any, Any)
    out: dict[Any, Any] = {}
    for key, item in value.items():
        dotted = _join(path, str(key))
        if key_type is str and not isinstance(key, str):
            raise ConfigError(f"config field '{path}' has a non-string key {_describe(key)}")
        out[key] = _coerce(item, value_type, dotted)
    return out


def _is_scalar(value: Any) -> bool:
    """True for YAML scalars other than str and null (numbers, bools, dates)."""
    return isinstance(value, int | float | bool | datetime.date)


def _quote_hint(value: Any) -> str:
    """Suggest quoting when YAML turned text such as ``on`` or ``2024`` into a non-str."""
    return " (quote it in YAML to make it a string)" if _is_scalar(value) else ""


def _describe(value: Any) -> str:
    """Short ``type value`` description of a user value for error messages."""
    if value is None:
        return "null"
    shown = repr(value)
    if len(shown) > _MAX_REPR:
        shown = shown[: _MAX_REPR - 3] + "..."
    return f"{type(value).__name__} {shown}"


def _type_name(hint: Any) -> str:
    """Human-readable name of a field type for error messages."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is tuple or origin is tuple:
        return "a list"
    if hint is dict or origin is dict:
        return "a mapping"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"a mapping ({hint.__name__})"
    if (registry := registry_for(hint)) is not None:
        return f"a {registry.family} (its name, or a mapping with its type)"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint)


# --------------------------------------------------------------- dumping and hashing


def to_dict(cfg: Any) -> dict[str, Any]:
    """Return ``cfg`` as a plain nested dict (tuples become lists).

    Only ``init`` fields are included so that the result can be fed back to
    :func:`from_dict` (or dumped and reloaded) to rebuild an equal config.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"expected a dataclass instance, got {cfg!r}")
    return typing.cast(dict[str, Any], _to_plain(cfg))


def _to_plain(value: Any) -> Any:
    """Recursively convert dataclasses, mappings and sequences to dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        plain = {
            f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
        # A variant's settings say which variant they are, so they load back as it.
        name = variant_of(value)
        return plain if name is None else {"type": name, **plain}
    if isinstance(value, Mapping):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    return value


def dump_yaml(cfg: Any) -> str:
    """Serialize ``cfg`` to YAML in field order; :func:`load_config` reads it back."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _as_dict(cfg: Any) -> Mapping[str, Any]:
    """Accept either a config instance or an existing :func:`to_dict` result."""
    return cfg if isinstance(cfg, Mapping) else to_dict(cfg)


def _prune(node: Mapping[str, Any], prefix: str, exclude: frozenset[str]) -> dict[str, Any]:
    """Copy ``node`` without the dotted keys in ``exclude`` (and their subtrees)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        dotted = _join(prefix, str(key))
        if dotted in exclude:
            continue
        out[key] = _prune(value, dotted, exclude) if isinstance(value, Mapping) else value
    return out


def _canonical_json(value: Any) -> str:
    """Deterministic JSON text: sorted keys, no whitespace, tuples as lists.

    ``default=str`` covers the odd non-JSON YAML scalar (a date inside a free-form
    dict) without making hashing fail.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def fingerprint(cfg: Any, exclude: Iterable[str] = ()) -> str:
    """Return the sha256 hex digest of the canonical JSON of ``cfg``.

    Args:
        cfg: A config instance or a :func:`to_dict` result (e.g. a saved run config).
        exclude: Dotted keys to leave out; a prefix such as ``"logging"`` removes the
            whole subtree. Keys that do not exist are ignored, because free-form
            dict fields may legitimately lack them.
    """
    pruned = _prune(_as_dict(cfg), "", frozenset(exclude))
    return hashlib.sha256(_canonical_json(pruned).encode("utf-8")).hexdigest()


def _flatten(node: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """Map every leaf of ``node`` to its dotted key (empty mappings are leaves)."""
    for key, value in node.items():
        dotted = _join(prefix, str(key))
        if isinstance(value, Mapping) and value:
            _flatten(value, dotted, out)
        else:
            out[dotted] = value
    return out


def diff_keys(a: Mapping[str, Any], b: Mapping[str, Any], exclude: Iterable[str] = ()) -> list[str]:
    """Return the sorted dotted keys whose values differ between two config dicts.

    A key present on one side only counts as different. Leaves are compared through
    their canonical JSON, exactly as :func:`fingerprint` sees them, so ``1`` vs
    ``1.0`` is reported even though Python considers them equal: the point is to
    explain a fingerprint mismatch. Config instances are accepted too.
    """
    excluded = frozenset(exclude)
    flat_a = _flatten(_prune(_as_dict(a), "", excluded), "", {})
    flat_b = _flatten(_prune(_as_dict(b), "", excluded), "", {})
    missing = object()
    changed = []
    for key in flat_a.keys() | flat_b.keys():
        va, vb = flat_a.get(key, missing), flat_b.get(key, missing)
        if va is missing or vb is missing or _canonical_json(va) != _canonical_json(vb):
            changed.append(key)
    return sorted(changed)


# --------------------------------------------------------------------- introspection


def field_docs(cls: type) -> dict[str, str]:
    """Return ``{field name: docstring}`` for the documented fields of ``cls``.

    A field's docstring is the string literal statement directly following its
    annotated assignment in the class body (read from the source with ``ast``,
    since Python discards these strings at runtime). Inherited fields are included;
    a subclass's docstring wins. Undocumented fields are absent from the result, and
    classes whose source is unavailable contribute nothing.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            docs.update(_class_field_docs(klass))
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        docs = {k: v for k, v in docs.items() if k in names}
    return docs


@functools.cache
def _class_field_docs(klass: type) -> dict[str, str]:
    """Field docstrings declared directly in ``klass``'s own body."""
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):
        return {}
    module = ast.parse(textwrap.dedent(source))
    node = next((n for n in module.body if isinstance(n, ast.ClassDef)), None)
    if node is None:
        return {}
    docs: dict[str, str] = {}
    for stmt, following in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs


def iter_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Walk the config tree in field order, yielding ``(dotted name, type hint, default)``.

    Every ``init`` field is yielded, sub-config fields included (their default is
    the default sub-config instance), followed by the fields inside them (also for
    ``SubConfig | None`` fields). ``default`` is ``dataclasses.MISSING`` for
    required fields. ``prefix`` is prepended (with a dot) to every name.
    """
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        name = _join(prefix, f.name)
        hint = hints[f.name]
        default = _field_default(f)
        yield name, hint, default
        sub = _sub_config(hint)
        if sub is not None:
            yield from iter_fields(sub, name)


def _sub_config(hint: Any) -> type | None:
    """The dataclass behind ``hint`` (``Sub`` or ``Sub | None``), if any."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = members[0] if len(members) == 1 else None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    return None
