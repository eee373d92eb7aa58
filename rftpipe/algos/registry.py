"""Registries of named algorithm variants, each entry with its own settings class and traits.

A family of variants (advantage estimators, policy losses, KL estimators) is one
:class:`Registry`. Every entry is a :class:`Variant`: its name, its settings class (a frozen
``kw_only`` dataclass whose fields carry docstrings and whose ``__post_init__`` checks them),
the traits the config checks read, and the function that computes it. The config holds an
instance of the chosen variant's settings class and the function receives it unchanged, so a
variant's settings and their defaults are written once, in that class.

The entries are declared in the torch-free :mod:`rftpipe.algos.variants`, so the config
schema and the launch layer can load and check a config without torch; the torch modules
attach the functions with :meth:`Registry.implements`. User code registers a variant the
same way, at runtime::

    @dataclass(frozen=True, kw_only=True, slots=True)
    class MyLossSettings(PolicyLossSettings):
        scale: float = 1.0
        \"\"\"What it scales.\"\"\"

    POLICY_LOSSES.register("my_loss", settings=MyLossSettings, fn=my_loss)

after which ``train.policy_loss: {type: my_loss, scale: 2.0}`` selects it.

Each settings class belongs to exactly one variant, which is how the config finds the
variant's name (the YAML key ``type``) from the settings instance it holds.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

__all__ = [
    "Registry",
    "UnknownVariantError",
    "Variant",
    "registry_for",
    "variant_of",
]

S = TypeVar("S")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# The family base class of each registry: the config schema types a variant field with it,
# and the loader finds the registry from that type (as it finds a sub-config from a dataclass).
_BY_BASE: dict[type, Registry[Any, Any, Any]] = {}


class UnknownVariantError(ValueError):
    """A name no entry of the registry has (the message names the closest ones)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Variant(Generic[S, T, F]):
    """One registry entry."""

    name: str
    """The key users select it by (`type` in the config)."""

    settings: type[S]
    """Its settings class; an instance is what the config holds and the function receives."""

    traits: T
    """What it needs from the rest of the config, checked at load."""

    fn: F | None = None
    """The function computing it (None until its torch module attached it)."""

    def setting_names(self) -> tuple[str, ...]:
        """Its settings' names: the config keys next to `type`."""
        # register() checked that `settings` is a dataclass; S itself is unbounded.
        return tuple(f.name for f in dataclasses.fields(cast(Any, self.settings)))


class Registry(Generic[S, T, F]):
    """The variants of one family, by name.

    Args:
        family: what an entry is, for messages (``"policy loss"``).
        base: the class every settings class of the family derives from; the config types
            its variant field with it.
        traits: the family's traits class; an entry registered without traits gets its
            defaults.
    """

    def __init__(self, family: str, *, base: type[S], traits: type[T]) -> None:
        if base in _BY_BASE:
            raise ValueError(f"{base.__name__} is already the base of the {family} registry")
        self.family = family
        self.base = base
        self.traits_type = traits
        self._entries: dict[str, Variant[S, T, F]] = {}
        self._by_settings: dict[type, str] = {}
        _BY_BASE[base] = self

    def register(
        self, name: str, *, settings: type[S], traits: T | None = None, fn: F | None = None
    ) -> Variant[S, T, F]:
        """Add the variant ``name`` with its own settings class (and, optionally, already
        its function); returns the entry."""
        if not name or name in self._entries:
            raise ValueError(f"{self.family} {name!r} is already registered (or empty)")
        if not (
            isinstance(settings, type)
            and dataclasses.is_dataclass(settings)
            and issubclass(settings, self.base)
        ):
            raise TypeError(
                f"{self.family} {name!r}: settings must be a dataclass deriving from "
                f"{self.base.__name__}, got {settings!r}"
            )
        if settings in self._by_settings:
            raise ValueError(
                f"{self.family} {name!r}: {settings.__name__} already holds the settings of "
                f"{self._by_settings[settings]!r}; give each variant its own class (a subclass "
                "of a shared one is fine)"
            )
        # A bare name in the config means the variant with default settings, so every
        # setting needs a default (and a valid one: this runs the class's checks).
        settings()
        entry: Variant[S, T, F] = Variant(
            name=name,
            settings=settings,
            traits=self.traits_type() if traits is None else traits,
            fn=fn,
        )
        self._entries[name] = entry
        self._by_settings[settings] = name
        return entry

    def implements(self, name: str) -> Callable[[F], F]:
        """Decorator attaching the function of the registered variant ``name``."""

        def attach(fn: F) -> F:
            entry = self[name]
            if entry.fn is not None:
                raise ValueError(f"{self.family} {name!r} already has a function")
            self._entries[name] = dataclasses.replace(entry, fn=fn)
            return fn

        return attach

    def unregister(self, name: str) -> None:
        """Remove the variant ``name`` (a test's own variant, at teardown)."""
        entry = self._entries.pop(name)
        del self._by_settings[entry.settings]

    def __getitem__(self, name: str) -> Variant[S, T, F]:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownVariantError(self._unknown(name)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order."""
        return tuple(self._entries)

    def name_of(self, settings_class: type) -> str | None:
        """The variant whose settings class this is, if any."""
        return self._by_settings.get(settings_class)

    def of(self, settings: S) -> Variant[S, T, F]:
        """The entry whose settings class ``settings`` is an instance of (exactly)."""
        name = self._by_settings.get(type(settings))
        if name is None:
            raise UnknownVariantError(
                f"{type(settings).__name__} is not the settings class of a registered {self.family}"
            )
        return self._entries[name]

    def function(self, settings: S) -> F:
        """The function of the variant ``settings`` selects."""
        entry = self.of(settings)
        if entry.fn is None:
            raise LookupError(
                f"{self.family} {entry.name!r} is registered without a function; import "
                "the module that implements it"
            )
        return entry.fn

    def _unknown(self, name: str) -> str:
        close = difflib.get_close_matches(name, list(self._entries), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.family} {name!r}{hint} (known: {', '.join(self._entries)})"


def registry_for(hint: Any) -> Registry[Any, Any, Any] | None:
    """The registry whose family base class the type ``hint`` is, if any."""
    return _BY_BASE.get(hint) if isinstance(hint, type) else None


def variant_of(settings: object) -> str | None:
    """The variant name of a settings instance of any registry (None: not one)."""
    for klass in type(settings).__mro__:
        registry = _BY_BASE.get(klass)
        if registry is not None:
            return registry.name_of(type(settings))
    return None
