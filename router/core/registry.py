"""Registries of the scheduling plugins, one per kind, filled by name through factories.

A factory takes the scheduler's config and the parameters of one use (from a
policy file, or from the built-in policies) and returns a plugin::

    @FILTERS.register("staleness")
    def _staleness(config: SchedulerConfig, params: Params) -> Filter:
        return Staleness(params.number("max_age_s", config.instance_staleness_s))

Registering a name twice raises :class:`DuplicatePluginError`; creating an
unknown name raises :class:`UnknownPluginError` listing the known ones; a
parameter the factory did not read raises :class:`ConfigError`. The built-in
plugins live in :mod:`router.core.metrics`, :mod:`router.core.filters`,
:mod:`router.core.packing`, :mod:`router.core.selectors` and :mod:`router.core.policies`; :func:`load_builtins`
imports them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from router.core.errors import ConfigError, DuplicatePluginError, UnknownPluginError
from router.core.plugins import Filter, GlobalFilter, Metric, Policy, Selector

T = TypeVar("T")

_BUILTIN_MODULES = (
    "router.core.metrics",
    "router.core.packing",
    "router.core.filters",
    "router.core.selectors",
    "router.core.policies",
    "router.core.dispatchers",
    "router.core.slice_dispatch",
    "router.core.auto_dispatch",
)


class Params:
    """The parameters of one plugin use, read through typed getters.

    ``where`` names the use in error messages (e.g. ``"policy.yaml: prefill.filters[2]"``).
    Call :meth:`finish` after reading: it rejects parameters nobody read.
    """

    def __init__(self, where: str, raw: Mapping[str, Any] | None = None) -> None:
        self.where = where
        self._raw = dict(raw or {})
        self._read: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self._raw

    def _get(self, key: str, default: Any) -> Any:
        self._read.add(key)
        return self._raw.get(key, default)

    def text(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise ConfigError(f"{self.where}: '{key}' must be a string, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConfigError(f"{self.where}: '{key}' must be a number, got {value!r}")
        return float(value)

    def optional_number(self, key: str) -> float | None:
        if self._raw.get(key) is None:
            self._read.add(key)
            return None
        return self.number(key, 0.0)

    def integer(self, key: str, default: int) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.where}: '{key}' must be an integer, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}: '{key}' must be true or false, got {value!r}")
        return value

    def names(self, key: str, default: list[str]) -> list[str]:
        value = self._get(key, default)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{self.where}: '{key}' must be a non-empty list of names, got {value!r}")
        return list(value)

    def finish(self) -> None:
        unknown = sorted(set(self._raw) - self._read)
        if unknown:
            known = ", ".join(sorted(self._read)) or "none"
            raise ConfigError(f"{self.where}: unknown parameter(s) {', '.join(unknown)} (accepted: {known})")


# The config parameter is the scheduler's ``SchedulerConfig``. It is typed ``Any`` here because
# ``router.core.config`` imports this module (to check plugin names when a config is built), and
# the registry must not import it back.
Factory = Callable[[Any, Params], T]


class Registry(Generic[T]):
    """Factories of one kind of plugin, by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Factory[T]] = {}

    def register(self, name: str) -> Callable[[Factory[T]], Factory[T]]:
        """Decorator registering ``factory`` under ``name``; a second registration raises."""

        def decorator(factory: Factory[T]) -> Factory[T]:
            if name in self._factories:
                raise DuplicatePluginError(f"{self.kind} {name!r} is already registered")
            self._factories[name] = factory
            return factory

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests that register temporary plugins)."""
        self._factories.pop(name, None)

    def create(self, name: str, config: Any, params: Params | None = None) -> T:
        """Build the plugin registered as ``name``; unknown names and unread parameters raise."""
        load_builtins()
        factory = self._factories.get(name)
        if factory is None:
            where = f"{params.where}: " if params is not None else ""
            raise UnknownPluginError(
                f"{where}unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(self.names())}"
            )
        used = params if params is not None else Params(f"{self.kind} {name!r}")
        plugin = factory(config, used)
        used.finish()
        return plugin

    def names(self) -> tuple[str, ...]:
        load_builtins()
        return tuple(sorted(self._factories))

    def __contains__(self, name: object) -> bool:
        load_builtins()
        return name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


METRICS: Registry[Metric] = Registry("metric")
FILTERS: Registry[Filter | GlobalFilter] = Registry("filter")
SELECTORS: Registry[Selector] = Registry("selector")
POLICIES: Registry[Policy] = Registry("policy")

_loaded = False


def load_builtins() -> None:
    """Import the modules that register the built-in plugins (idempotent)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
