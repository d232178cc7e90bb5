"""One shape for every extension point: a registry of named entries, each a decorated
definition with typed options.

    @lab.register_estimator("opo_len", options=MyOptions)   # or register_policy_loss, register_dataset,
    def opo_len(x): ...                                     #    register_algorithm, register_schedule

- A name is registered once; a second, different definition under it is an error naming both.
- `options` is a pydantic model (`lab.Options`: unknown keys forbidden); `Registry.options(name, raw)`
  parses a config's dict into it, and a wrong or unknown key is a ConfigError naming the entry and the key.
- `facts` are the entry's declared properties (an algorithm's estimators, a loss's needs, ...).
- A config may also name an entry by import path, "package.module:name" (scripts and the CLI, where no
  notebook cell ran): the module is imported, which registers its decorated definitions, and the path
  becomes another name of the entry whose object is `module.name`.
- An entry defined outside the library (a notebook cell, a script) travels to the workers by value:
  the session sends `user_entries()` with each worker's set-up, and the worker `install`s them before
  it resolves anything, so a name registered in a notebook means the same thing on every process.

The built-in entries register themselves the same way, where they are defined; no other list names them.
"""
from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Generic, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from distflow_lab.core.errors import ConfigError

T = TypeVar("T")
LIBRARY = "distflow_lab."
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # "package.module:attribute"


def import_object(path: str) -> Any:
    """The object a "package.module:attribute" path names; a ConfigError says which part is missing."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module {module_name!r} for {path!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r} ({path!r})")
        obj = getattr(obj, part)
    return obj


class Options(BaseModel):
    """Base of every registered entry's options: unknown keys are an error, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoOptions(Options):
    """An entry that takes no options."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    obj: T  # the function or class
    options: type[BaseModel] = NoOptions
    facts: Mapping[str, Any] = field(default_factory=dict)
    origin: str = ""  # the module that registered it (a notebook's "__main__": the entry travels by value)

    @property
    def builtin(self) -> bool:
        return self.origin.startswith(LIBRARY)


_REGISTRIES: dict[str, "Registry"] = {}
_PENDING: dict[str, dict[str, Entry]] = {}  # installed on a worker before the registry's module was imported


class Registry(Generic[T]):
    """Named entries of one kind ("estimator", "policy loss", ...)."""

    def __init__(self, kind: str, config_key: str) -> None:
        if kind in _REGISTRIES:
            raise ConfigError(f"registry {kind!r} is defined twice")
        self.kind, self.config_key = kind, config_key  # config_key: where a config names an entry (errors say so)
        self._entries: dict[str, Entry[T]] = dict(_PENDING.pop(kind, {}))
        _REGISTRIES[kind] = self

    def register(self, name: str, *, options: type[BaseModel] | None = None, origin: str | None = None,
                 **facts: Any) -> Callable[[T], T]:
        """Decorator: `obj` becomes this registry's entry `name`. `origin`: the registering module (default:
        the caller; a wrapper such as register_estimator passes its own caller's)."""
        origin = origin if origin is not None else caller_module()

        def add(obj: T) -> T:
            self.add(Entry(name, obj, options or NoOptions, MappingProxyType(dict(facts)), origin))
            return obj
        return add

    def add(self, entry: Entry[T]) -> None:
        if not isinstance(entry.name, str) or not entry.name:
            raise ConfigError(f"a {self.kind} needs a non-empty name, got {entry.name!r}")
        if not (isinstance(entry.options, type) and issubclass(entry.options, BaseModel)):
            raise ConfigError(f"{self.kind} {entry.name!r}: options must be a pydantic model (lab.Options), "
                              f"got {entry.options!r}")
        if entry.options.model_config.get("extra") != "forbid":
            raise ConfigError(f"{self.kind} {entry.name!r}: options {entry.options.__name__} must forbid unknown "
                              "keys (derive it from lab.Options)")
        old = self._entries.get(entry.name)
        if old is not None and (old.origin, _qualname(old.obj)) != (entry.origin, _qualname(entry.obj)):
            raise ConfigError(f"{self.kind} {entry.name!r} is registered twice (in {old.origin or '?'} and in "
                              f"{entry.origin or '?'}); pick another name")
        self._entries[entry.name] = entry  # the same definition again (a notebook cell run twice): the newest

    def __contains__(self, name: object) -> bool:
        try:
            self.get(name)  # an import path resolves (and registers) here too
        except ConfigError:
            return False
        return True

    def _by_path(self, path: str) -> Entry[T]:
        """The entry whose object `path` ("module:name") names, registered under the path too."""
        try:
            obj = import_object(path)  # importing the module runs its registrations
        except ConfigError as e:
            raise ConfigError(f"{self.config_key}: {e}") from None
        found = [e for e in self._entries.values() if e.obj is obj]
        if not found:
            raise ConfigError(f"{self.config_key}: {path!r} is not a registered {self.kind}: decorate it with "
                              f"lab.register_{self.kind.replace(' ', '_')}")
        self._entries[path] = replace(found[0], name=path)
        return self._entries[path]

    def __iter__(self):
        return iter(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> Entry[T]:
        if name not in self._entries and isinstance(name, str) and IMPORT_PATH.match(name):
            return self._by_path(name)
        if name not in self._entries:
            raise ConfigError(f"{self.config_key}: {name!r} is not a registered {self.kind}; registered: "
                              f"{self.names()} (add one with lab.register_{self.kind.replace(' ', '_')})")
        return self._entries[name]

    def options(self, name: str, raw: Mapping[str, Any] | BaseModel | None, where: str = "") -> BaseModel:
        """The entry's typed options from a config's dict; errors name the entry and the key."""
        return typed_options(self.get(name).options, raw, f"{where or self.config_key}: {self.kind} {name!r}")

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


def typed_options(cls: type[BaseModel], raw: Mapping[str, Any] | BaseModel | None, owner: str) -> BaseModel:
    """`raw` parsed into `cls`; a wrong or unknown key is a ConfigError naming `owner` and the key."""
    if isinstance(raw, cls):
        return raw
    try:
        return cls(**dict(raw or {}))
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(map(str, err["loc"]))
        what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise ConfigError(f"{owner}: option {key!r}: {what} (its options: {sorted(cls.model_fields) or 'none'})") \
            from None


def caller_module(depth: int = 2) -> str:
    """The module of the code that called the function calling this (where a registration is written)."""
    return sys._getframe(depth).f_globals.get("__name__", "")


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def user_entries() -> dict[str, dict[str, Entry]]:
    """Every entry defined outside the library, by registry: what a session sends its workers."""
    out = {kind: {n: e for n, e in r._entries.items() if not e.builtin} for kind, r in _REGISTRIES.items()}
    return {k: v for k, v in out.items() if v}


def install(entries: Mapping[str, Mapping[str, Entry]]) -> None:
    """On a worker: register the driver's user entries (before any stage resolves a name)."""
    for kind, named in entries.items():
        for entry in named.values():
            if kind in _REGISTRIES:
                _REGISTRIES[kind].add(entry)
            else:
                _PENDING.setdefault(kind, {})[entry.name] = entry
