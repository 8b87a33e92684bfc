"""Config dataclasses whose fields are command-line flags.

A field declares its flag and one-line doc in its metadata
(``field(default=..., metadata={"flag": "--max-queue-size", "doc": "..."})``);
:class:`FlagFields` derives the argparse arguments, the namespace round trip
and the field -> flag map that error messages use (``name_flags``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self

_KINDS: dict[str, type] = {"int": int, "float": float}


class FlagFields:
    """Mixin for a ``@dataclass`` whose every field carries ``flag`` and ``doc`` metadata."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    #: Field name -> the values its flag accepts (argparse ``choices``).
    FLAG_CHOICES: ClassVar[dict[str, list[str]]] = {}

    @classmethod
    def _flag_fields(cls) -> tuple[dataclasses.Field[Any], ...]:
        # dataclasses.fields, not __dataclass_fields__: that also lists the ClassVars.
        return dataclasses.fields(cls)

    @classmethod
    def doc(cls, name: str) -> str:
        """The one-line doc of field ``name``."""
        for f in cls._flag_fields():
            if f.name == name:
                return str(f.metadata.get("doc", ""))
        raise KeyError(name)

    @classmethod
    def flags(cls) -> dict[str, str]:
        """Field name -> the command-line flag that sets it (``max_queue_size`` -> ``--max-queue-size``)."""
        return {f.name: str(f.metadata["flag"]) for f in cls._flag_fields()}

    @classmethod
    def add_arguments(cls, parser: Any) -> None:
        """One flag per field, helped by its doc."""
        for f in cls._flag_fields():
            parser.add_argument(
                f.metadata["flag"],
                type=_KINDS.get(str(f.type), str),
                default=f.default,
                choices=cls.FLAG_CHOICES.get(f.name),
                help=f"{f.metadata['doc']} (default: %(default)s)",
            )

    @classmethod
    def from_namespace(cls, ns: Any, **overrides: Any) -> Self:
        """Build from parsed flags (missing attributes keep their defaults; ``overrides`` win)."""
        values: dict[str, Any] = {}
        for f in cls._flag_fields():
            dest = str(f.metadata["flag"]).lstrip("-").replace("-", "_")
            if hasattr(ns, dest):
                values[f.name] = getattr(ns, dest)
        values.update(overrides)
        return cls(**values)
