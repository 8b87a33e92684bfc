"""Fleet specs for ``slo-router simulate``: instance groups, each with a role, a count, a profile and engine knobs.

A fleet is a list of *groups*. Every instance of a group has the same role
(``prefill``, ``decode`` or ``neutral``), runs the ``sim`` engine model
(:class:`engine.model.SimCore`) with the same :class:`engine.model.SimConfig`,
and steps at the speed of the group's TTFT/TPOT profile. The router predicts
with the same profile: the group's name is the instance's profile group
(:class:`router.core.predictors.PredictorSet`), so heterogeneous fleets are
predicted per group, as a real router configured with one profile per
hardware type would.

Where a spec comes from:

- role counts and one profile: ``--prefill 4 --decode 4`` or ``--neutral 8``
  with ``--profile DIR`` (:func:`fleet_from_counts`);
- a compact string (``--fleet``): ``ROLE=COUNT[:PROFILE]`` groups separated by
  commas, e.g. ``prefill=4:qwen2.5-7b-2xv100-linear,decode=4:llama3-70b-4xh100-roofline``
  (:func:`parse_fleet`);
- a JSON or YAML file (``--fleet my-fleet.yaml``)::

      engine:                        # defaults for every group (SimConfig fields)
        max_num_batched_tokens: 2048
        kv_capacity_tokens: 65536
      groups:
        - role: prefill
          count: 4
          profile: qwen2.5-7b-2xv100-linear
        - role: decode
          count: 4
          profile: profiling_data/llama3-70b-4xh100-roofline
          name: d-llama              # optional; instance ids are NAME-000, NAME-001, ...
          engine: {kv_bytes_per_token: 327680}
        - role: decode
          count: 2
          profile: qwen2.5-7b-2xv100-linear          # what the router predicts with
          true_profile: llama3-70b-4xh100-roofline   # what the engine actually runs at
          engine: {speed_factor: 0.7, noise: 0.05, kv_slowdown: 0.3}

Ground truth: every engine steps at the speed of its *true* profile
(``true_profile``, default: the group's ``profile``), loaded as a model object
of its own, never the router's predictor, and shaped by the engine knobs
``speed_factor``, ``noise`` (seeded per step) and ``kv_slowdown``. A group whose
truth differs from its profile is hardware the router was not profiled on:
what online calibration (:mod:`router.core.calibration`) has to correct.

A profile is a directory holding ``ttft.json`` and ``tpot.json``: a path
(relative to the working directory, or to the fleet file), or the name of a
bundled profile under ``profiling_data/``. The engine fields of a file (and the
engine flags of the command line, which are the file's base) are those of
:class:`engine.model.SimConfig`.

A fleet is either neutral (only ``neutral`` groups) or disaggregated (at least
one ``prefill`` and one ``decode`` group, no ``neutral`` one): the router would
leave the neutral instances of a mixed fleet idle. Every problem is a
:class:`FleetError` (a ``ValueError``) naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.model import SimConfig
from router.core.request import Role

#: The bundled profiles (the repository's ``profiling_data/``).
BUNDLED_PROFILES = Path(__file__).resolve().parent.parent / "profiling_data"

#: The profile used when none is named.
DEFAULT_PROFILE = "qwen2.5-7b-2xv100-linear"

#: Most instances one fleet may hold (bounds every per-instance loop).
MAX_INSTANCES = 100_000

_ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "neutral": Role.NEUTRAL}
_GROUP_KEYS = frozenset({"role", "count", "profile", "true_profile", "name", "engine"})
_FLEET_KEYS = frozenset({"engine", "groups"})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

#: SimConfig fields a fleet may set (every one: they are all engine knobs).
ENGINE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SimConfig))


class FleetError(ValueError):
    """A fleet spec is unusable; the message names the field, the value and the fix."""


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


def role_name(role: Role) -> str:
    """``prefill``, ``decode`` or ``neutral``."""
    return role.name.lower()


@dataclass(frozen=True)
class GroupSpec:
    """Instances that share a role, a profile and an engine configuration."""

    name: str = field(metadata=_doc("group name: the profile group label and the prefix of instance ids"))
    role: Role = field(metadata=_doc("the instances' registered role"))
    count: int = field(metadata=_doc("number of instances, >= 1"))
    profile: Path = field(metadata=_doc("directory holding ttft.json and tpot.json"))
    engine: SimConfig = field(default_factory=SimConfig, metadata=_doc("the sim engine's knobs"))
    true_profile: Path | None = field(
        default=None,
        metadata=_doc("profile directory the engines really step at (None: the group's profile)"),
    )

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise FleetError(f"group name must be letters, digits, '_', '.', '-', got {self.name!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise FleetError(f"group {self.name!r}: count must be an integer >= 1, got {self.count!r}")

    def instance_ids(self) -> tuple[str, ...]:
        return tuple(f"{self.name}-{k:03d}" for k in range(self.count))

    @property
    def truth(self) -> Path:
        """The profile directory the group's engines step at."""
        return self.true_profile if self.true_profile is not None else self.profile

    @property
    def mismatched(self) -> bool:
        """Whether the engines differ from the profile the router predicts them with."""
        e = self.engine
        return self.truth != self.profile or e.speed_factor != 1.0 or e.noise > 0.0 or e.kv_slowdown > 0.0

    def describe(self) -> str:
        text = f"{self.count} x {role_name(self.role)} ({self.profile.name}"
        if self.mismatched:
            e = self.engine
            truth = [] if self.truth == self.profile else [self.truth.name]
            truth += [] if e.speed_factor == 1.0 else [f"speed {e.speed_factor:g}"]
            truth += [] if e.noise == 0.0 else [f"noise {e.noise:g}"]
            truth += [] if e.kv_slowdown == 0.0 else [f"kv slowdown {e.kv_slowdown:g}"]
            text += "; true: " + ", ".join(truth)
        return text + ")"


@dataclass(frozen=True)
class FleetSpec:
    """A whole simulated fleet: its groups, in instance order."""

    groups: tuple[GroupSpec, ...] = field(metadata=_doc("the instance groups, in order"))

    def __post_init__(self) -> None:
        if not self.groups:
            raise FleetError("the fleet has no instance group; give --prefill/--decode, --neutral or --fleet")
        names = [g.name for g in self.groups]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise FleetError(f"fleet groups: duplicate names {dupes}; give each group its own 'name'")
        roles = {g.role for g in self.groups}
        if Role.NEUTRAL in roles and roles != {Role.NEUTRAL}:
            raise FleetError(
                "a fleet is either neutral or prefill+decode: the router would leave neutral instances idle "
                "beside prefill/decode ones; drop the neutral groups or the prefill/decode groups"
            )
        if Role.NEUTRAL not in roles and roles != {Role.PREFILL, Role.DECODE}:
            missing = "decode" if Role.PREFILL in roles else "prefill"
            raise FleetError(f"a disaggregated fleet needs both roles: add at least one {missing} group")
        if self.num_instances > MAX_INSTANCES:
            raise FleetError(
                f"the fleet has {self.num_instances} instances; at most {MAX_INSTANCES} are supported"
            )

    @property
    def num_instances(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def disaggregated(self) -> bool:
        return self.groups[0].role is not Role.NEUTRAL

    def describe(self) -> str:
        return ", ".join(g.describe() for g in self.groups)


# --------------------------------------------------------------------------- profiles


def resolve_profile(text: str | Path, *, base_dir: Path | None = None) -> Path:
    """The profile directory ``text`` names: a path (as given, or under ``base_dir``) or a bundled name."""
    raw = Path(text)
    candidates = [raw]
    if base_dir is not None and not raw.is_absolute():
        candidates.append(base_dir / raw)
    candidates.append(BUNDLED_PROFILES / raw)
    for path in candidates:
        if path.is_dir() and (path / "ttft.json").is_file() and (path / "tpot.json").is_file():
            return path.resolve()
    bundled = sorted(p.name for p in BUNDLED_PROFILES.iterdir() if p.is_dir() and (p / "ttft.json").is_file())
    raise FleetError(
        f"profile {str(text)!r}: not a directory holding ttft.json and tpot.json, nor a bundled profile "
        f"(bundled: {', '.join(bundled)})"
    )


# --------------------------------------------------------------------------- engine knobs


def engine_config(base: SimConfig, overrides: Any, where: str) -> SimConfig:
    """``base`` with the fields of the mapping ``overrides`` replaced; errors name ``where``."""
    if overrides is None:
        return base
    if not isinstance(overrides, Mapping):
        raise FleetError(f"{where}: must be a mapping of engine fields, got {overrides!r}")
    unknown = sorted(set(overrides) - set(ENGINE_FIELDS))
    if unknown:
        raise FleetError(
            f"{where}: unknown engine field(s) {', '.join(map(str, unknown))} (accepted: {', '.join(ENGINE_FIELDS)})"
        )
    try:
        return dataclasses.replace(base, **dict(overrides))
    except (TypeError, ValueError) as exc:
        raise FleetError(f"{where}: {exc}") from exc


# --------------------------------------------------------------------------- builders


def _role(text: Any, where: str) -> Role:
    role = _ROLES.get(str(text).strip().lower()) if isinstance(text, str) else None
    if role is None:
        raise FleetError(f"{where}: role must be prefill, decode or neutral, got {text!r}")
    return role


def _default_names(entries: list[tuple[Role, Path, str | None]]) -> list[str]:
    """Group names: the given one, else ``ROLE`` when the role has one group, else ``ROLE-PROFILE[-k]``."""
    per_role: dict[Role, int] = {}
    for role, _, _ in entries:
        per_role[role] = per_role.get(role, 0) + 1
    names: list[str] = []
    for role, profile, given in entries:
        if given is not None:
            names.append(given)
            continue
        name = role_name(role) if per_role[role] == 1 else f"{role_name(role)}-{profile.name}"
        k, unique = 2, name
        while unique in names:
            unique, k = f"{name}-{k}", k + 1
        names.append(unique)
    return names


def fleet_from_counts(
    *,
    prefill: int = 0,
    decode: int = 0,
    neutral: int = 0,
    profile: str | Path = DEFAULT_PROFILE,
    engine: SimConfig | None = None,
    true_profile: str | Path | None = None,
) -> FleetSpec:
    """A homogeneous fleet: ``prefill`` + ``decode`` instances, or ``neutral`` ones, on one profile.

    ``true_profile`` (default: ``profile``) is what the engines really step at.
    """
    path = resolve_profile(profile)
    truth = None if true_profile is None else resolve_profile(true_profile)
    config = engine if engine is not None else SimConfig()
    if neutral and (prefill or decode):
        raise FleetError("give --neutral K, or --prefill N with --decode M, not both")
    counts = ((Role.NEUTRAL, neutral),) if neutral else ((Role.PREFILL, prefill), (Role.DECODE, decode))
    for role, count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise FleetError(f"--{role_name(role)} must be an integer >= 1, got {count!r}")
    return FleetSpec(
        tuple(GroupSpec(role_name(role), role, count, path, config, truth) for role, count in counts)
    )


def with_true_profile(spec: FleetSpec, true_profile: str | Path) -> FleetSpec:
    """``spec`` with every group that names no true profile stepping at ``true_profile``."""
    truth = resolve_profile(true_profile)
    return FleetSpec(
        tuple(
            g if g.true_profile is not None else dataclasses.replace(g, true_profile=truth)
            for g in spec.groups
        )
    )


def parse_fleet(text: str, *, engine: SimConfig | None = None) -> FleetSpec:
    """A fleet from ``ROLE=COUNT[:PROFILE[:TRUE_PROFILE]],...`` (profile default: the bundled default)."""
    config = engine if engine is not None else SimConfig()
    entries: list[tuple[Role, Path, str | None]] = []
    counts: list[int] = []
    truths: list[Path | None] = []
    for k, part in enumerate(p.strip() for p in text.split(",")):
        where = f"fleet {text!r}, group {k + 1} ({part!r})"
        role_text, eq, rest = part.partition("=")
        if not eq:
            raise FleetError(f"{where}: write ROLE=COUNT[:PROFILE], e.g. prefill=4:{DEFAULT_PROFILE}")
        count_text, _, profile_text = rest.partition(":")
        profile_text, _, truth_text = profile_text.partition(":")
        try:
            count = int(count_text)
        except ValueError:
            raise FleetError(f"{where}: COUNT must be an integer >= 1, got {count_text!r}") from None
        if count < 1:
            raise FleetError(f"{where}: COUNT must be an integer >= 1, got {count}")
        entries.append((_role(role_text, where), resolve_profile(profile_text or DEFAULT_PROFILE), None))
        counts.append(count)
        truths.append(resolve_profile(truth_text) if truth_text else None)
    names = _default_names(entries)
    return FleetSpec(
        tuple(
            GroupSpec(name, role, count, profile, config, truth)
            for name, (role, profile, _), count, truth in zip(names, entries, counts, truths, strict=True)
        )
    )


def parse_fleet_dict(
    doc: Any, source: str = "<fleet>", *, engine: SimConfig | None = None, base_dir: Path | None = None
) -> FleetSpec:
    """A fleet from its JSON/YAML document (the schema in the module doc)."""
    if not isinstance(doc, Mapping):
        raise FleetError(f"{source}: a fleet file must be a mapping with 'groups', got {type(doc).__name__}")
    unknown = sorted(set(doc) - _FLEET_KEYS)
    if unknown:
        raise FleetError(
            f"{source}: unknown key(s) {', '.join(map(str, unknown))} (accepted: engine, groups)"
        )
    base = engine_config(
        engine if engine is not None else SimConfig(), doc.get("engine"), f"{source}: engine"
    )
    groups = doc.get("groups")
    if not isinstance(groups, list) or not groups:
        raise FleetError(f"{source}: 'groups' must be a non-empty list of groups")
    entries: list[tuple[Role, Path, str | None]] = []
    rest: list[tuple[int, SimConfig, Path | None]] = []
    for k, group in enumerate(groups):
        where = f"{source}: groups[{k}]"
        if not isinstance(group, Mapping):
            raise FleetError(
                f"{where}: a group must be a mapping with role, count and profile, got {group!r}"
            )
        bad = sorted(set(group) - _GROUP_KEYS)
        if bad:
            raise FleetError(
                f"{where}: unknown key(s) {', '.join(map(str, bad))} (accepted: {', '.join(sorted(_GROUP_KEYS))})"
            )
        if "role" not in group or "count" not in group:
            raise FleetError(f"{where}: a group needs 'role' and 'count'")
        count = group["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise FleetError(f"{where}: count must be an integer >= 1, got {count!r}")
        name = group.get("name")
        if name is not None and not isinstance(name, str):
            raise FleetError(f"{where}: name must be a string, got {name!r}")
        profile = resolve_profile(str(group.get("profile", DEFAULT_PROFILE)), base_dir=base_dir)
        entries.append((_role(group["role"], where), profile, name))
        truth_text = group.get("true_profile")
        truth = None if truth_text is None else resolve_profile(str(truth_text), base_dir=base_dir)
        rest.append((count, engine_config(base, group.get("engine"), f"{where}.engine"), truth))
    names = _default_names(entries)
    return FleetSpec(
        tuple(
            GroupSpec(name, role, count, profile, config, truth)
            for name, (role, profile, _), (count, config, truth) in zip(names, entries, rest, strict=True)
        )
    )


def load_fleet(text: str, *, engine: SimConfig | None = None) -> FleetSpec:
    """A fleet from ``--fleet``: a ``.json``/``.yaml``/``.yml`` file, or the compact string form."""
    path = Path(text)
    if path.suffix.lower() in (".json", ".yaml", ".yml"):
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FleetError(f"{text}: cannot read fleet file: {exc}") from exc
        try:
            doc = json.loads(raw) if path.suffix.lower() == ".json" else yaml.safe_load(raw)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise FleetError(f"{text}: invalid {path.suffix.lstrip('.').upper()}: {exc}") from exc
        return parse_fleet_dict(doc, text, engine=engine, base_dir=path.resolve().parent)
    return parse_fleet(text, engine=engine)


def profile_label(path: Path) -> str:
    """A bundled profile's name, or the directory's path (what a fleet file may name it by)."""
    return path.name if path.parent == BUNDLED_PROFILES.resolve() else str(path)


def fleet_to_dict(spec: FleetSpec) -> dict[str, Any]:
    """The fleet as a document :func:`parse_fleet_dict` reads back (every engine field spelled out)."""
    return {
        "groups": [
            {
                "name": g.name,
                "role": role_name(g.role),
                "count": g.count,
                "profile": profile_label(g.profile),
                **({} if g.true_profile is None else {"true_profile": profile_label(g.true_profile)}),
                "engine": dataclasses.asdict(g.engine),
            }
            for g in spec.groups
        ]
    }
