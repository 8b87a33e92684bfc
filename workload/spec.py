"""Workload specs shared by ``slo-router bench`` and the virtual-time simulator.

A workload is a mix of SLO classes (each with a share, latency targets and its own
prompt/output length distributions), an arrival process, and the token-id range
prompts are drawn from. :func:`generate_requests` turns a spec and a seeded RNG
into a list of :class:`RequestPlan` — pure and deterministic, no sockets, no
clock — so the load generator replays it over gRPC and the simulator replays it
in virtual time, and both see exactly the same requests for a seed.

Where a spec comes from (:func:`load_workload`):

- a preset name: ``mixed`` (the default), ``mixed-priority`` (mixed + 20 % priority-10 chat), ``chat``, ``code``, ``summarize``, ``tiny``, ``interactive-batch``,
  ``code-chat`` (seed 000's code + chat mix);
- a weighted mix of class presets: ``chat=0.7,code=0.3`` (weights are normalised);
- a JSON or YAML file (``*.json``, ``*.yaml``, ``*.yml``); see :func:`parse_workload_dict`.

Every problem is a :class:`WorkloadError` (a ``ValueError``) whose message names
the field, the value and what to write instead.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml

#: Requests are drawn in blocks of this size so that a plan of N requests is a prefix
#: of the plan of M > N requests for the same seed (sweeps can grow N without
#: changing the first requests).
PLAN_BLOCK_SIZE = 1024

#: Upper bound on the requests one plan may hold; bounds every generation loop.
MAX_PLAN_REQUESTS = 10_000_000

#: Largest token id a ``uint32`` proto field can carry, plus one.
_TOKEN_ID_LIMIT = 2**32


class WorkloadError(ValueError):
    """A workload spec is unusable; the message names the field, the value and the fix."""


def doc(text: str) -> dict[str, str]:
    """Field metadata carrying a one-line doc: ``field(default=..., metadata=doc("..."))``."""
    return {"doc": text}


def field_docs(cls: type[Any]) -> dict[str, str]:
    """The one-line doc of every field of the dataclass ``cls`` ('' when missing)."""
    return {f.name: str(f.metadata.get("doc", "")) for f in dataclasses.fields(cls)}


def _check_int(name: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise WorkloadError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise WorkloadError(f"{name} must be a finite number > 0, got {value!r}")


# --------------------------------------------------------------------------- lengths


@dataclass(frozen=True)
class FixedLength:
    """Every request gets exactly ``tokens`` tokens."""

    tokens: int = field(default=128, metadata=doc("the token count, >= 1"))

    def __post_init__(self) -> None:
        _check_int("fixed.tokens", self.tokens, minimum=1)

    @property
    def bounds(self) -> tuple[int, int]:
        """Smallest and largest value a sample can take (inclusive)."""
        return self.tokens, self.tokens

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        """``n`` token counts; consumes nothing from ``rng``."""
        return np.full(n, self.tokens, dtype=np.int64)

    def describe(self) -> str:
        """The compact form :func:`parse_length` reads back."""
        return f"fixed({self.tokens})"


@dataclass(frozen=True)
class UniformLength:
    """Token counts uniform over the integers ``min_tokens..max_tokens`` (both included)."""

    min_tokens: int = field(default=32, metadata=doc("smallest token count, >= 1"))
    max_tokens: int = field(default=512, metadata=doc("largest token count, >= min_tokens"))

    def __post_init__(self) -> None:
        _check_int("uniform.min_tokens", self.min_tokens, minimum=1)
        _check_int("uniform.max_tokens", self.max_tokens, minimum=self.min_tokens)

    @property
    def bounds(self) -> tuple[int, int]:
        return self.min_tokens, self.max_tokens

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        return rng.integers(self.min_tokens, self.max_tokens + 1, size=n, dtype=np.int64)

    def describe(self) -> str:
        return f"uniform({self.min_tokens},{self.max_tokens})"


@dataclass(frozen=True)
class LognormalLength:
    """Log-normal token counts (the long right tail of chat traffic), rounded and clipped.

    ``median_tokens`` is ``exp(mu)``; ``sigma`` is the standard deviation of the log.
    The mean before clipping is ``median_tokens * exp(sigma**2 / 2)``. Samples outside
    ``min_tokens..max_tokens`` are clipped to the nearer bound (not redrawn), so the
    bounds carry a little probability mass each.
    """

    median_tokens: float = field(
        default=256.0, metadata=doc("median token count, exp(mu) of the underlying normal, > 0")
    )
    sigma: float = field(
        default=0.8, metadata=doc("standard deviation of log(tokens), > 0 (0.5 narrow, 1.0 wide)")
    )
    min_tokens: int = field(default=1, metadata=doc("lower clip bound in tokens, >= 1"))
    max_tokens: int = field(default=4096, metadata=doc("upper clip bound in tokens, >= min_tokens"))

    def __post_init__(self) -> None:
        _check_positive("lognormal.median_tokens", self.median_tokens)
        _check_positive("lognormal.sigma", self.sigma)
        _check_int("lognormal.min_tokens", self.min_tokens, minimum=1)
        _check_int("lognormal.max_tokens", self.max_tokens, minimum=self.min_tokens)

    @property
    def bounds(self) -> tuple[int, int]:
        return self.min_tokens, self.max_tokens

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        raw = rng.lognormal(mean=math.log(self.median_tokens), sigma=self.sigma, size=n)
        return np.clip(np.rint(raw), self.min_tokens, self.max_tokens).astype(np.int64)

    def describe(self) -> str:
        return f"lognormal({self.median_tokens:g},{self.sigma:g},{self.min_tokens},{self.max_tokens})"


LengthDist = FixedLength | UniformLength | LognormalLength

#: Compact-form names and, in order, the parameters their positional arguments fill.
_LENGTH_KINDS: Mapping[str, tuple[type[Any], tuple[str, ...], Mapping[str, str]]] = {
    "fixed": (FixedLength, ("tokens",), {"value": "tokens"}),
    "uniform": (UniformLength, ("min_tokens", "max_tokens"), {"min": "min_tokens", "max": "max_tokens"}),
    "lognormal": (
        LognormalLength,
        ("median_tokens", "sigma", "min_tokens", "max_tokens"),
        {"median": "median_tokens", "min": "min_tokens", "max": "max_tokens"},
    ),
}

_CALL_RE = re.compile(r"^\s*([a-z_]+)\s*\((.*)\)\s*$")


def _number(text: str, where: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise WorkloadError(f"{where}: {text!r} is not a number") from None


def _build_length(kind: str, params: Mapping[str, Any], where: str) -> LengthDist:
    if kind not in _LENGTH_KINDS:
        raise WorkloadError(
            f"{where}: unknown length distribution {kind!r}; use one of {', '.join(_LENGTH_KINDS)}"
        )
    cls, _, aliases = _LENGTH_KINDS[kind]
    allowed = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        name = aliases.get(key, key)
        if name not in allowed:
            raise WorkloadError(
                f"{where}: {kind} has no parameter {key!r}; it takes {', '.join(sorted(allowed))}"
            )
        if name.endswith("_tokens") and name != "median_tokens" and isinstance(value, float):
            if not value.is_integer():
                raise WorkloadError(f"{where}: {kind}.{name} must be an integer, got {value!r}")
            value = int(value)
        kwargs[name] = value
    try:
        dist: LengthDist = cls(**kwargs)
    except WorkloadError as exc:
        raise WorkloadError(f"{where}: {exc}") from None
    return dist


def parse_length(value: Any, where: str = "length") -> LengthDist:
    """A length distribution from its compact form, a mapping, or a plain integer.

    Compact forms (positional or ``key=value`` arguments)::

        fixed(128)                      128 tokens every time
        uniform(32,512)                 32..512 inclusive
        lognormal(384,1.0,16,4096)      median 384, sigma 1.0, clipped to 16..4096
        lognormal(median=384,sigma=1.0,min=16,max=4096)

    Mappings name the kind and the dataclass fields:
    ``{"kind": "uniform", "min_tokens": 32, "max_tokens": 512}``. An integer ``n`` is
    ``fixed(n)``.
    """
    if isinstance(value, (FixedLength, UniformLength, LognormalLength)):
        return value
    if isinstance(value, bool):
        raise WorkloadError(f"{where}: expected a length distribution, got {value!r}")
    if isinstance(value, int):
        return _build_length("fixed", {"tokens": value}, where)
    if isinstance(value, Mapping):
        params = dict(value)
        kind = params.pop("kind", None)
        if not isinstance(kind, str):
            raise WorkloadError(f"{where}: a length mapping needs 'kind': one of {', '.join(_LENGTH_KINDS)}")
        return _build_length(kind, params, where)
    if not isinstance(value, str):
        raise WorkloadError(f"{where}: expected e.g. 'lognormal(384,1.0,16,4096)', got {value!r}")
    match = _CALL_RE.match(value)
    if match is None:
        raise WorkloadError(
            f"{where}: cannot read {value!r}; write fixed(N), uniform(MIN,MAX) or "
            "lognormal(MEDIAN,SIGMA,MIN,MAX)"
        )
    kind, arg_text = match.group(1), match.group(2)
    if kind not in _LENGTH_KINDS:
        raise WorkloadError(
            f"{where}: unknown length distribution {kind!r}; use one of {', '.join(_LENGTH_KINDS)}"
        )
    positional = _LENGTH_KINDS[kind][1]
    parsed: dict[str, Any] = {}
    args = [a.strip() for a in arg_text.split(",")] if arg_text.strip() else []
    for i, arg in enumerate(args):
        if "=" in arg:
            key, _, text = arg.partition("=")
            parsed[key.strip()] = _number(text.strip(), where)
        elif i < len(positional):
            parsed[positional[i]] = _number(arg, where)
        else:
            raise WorkloadError(f"{where}: {kind} takes at most {len(positional)} arguments, got {value!r}")
    return _build_length(kind, parsed, where)


def _length_to_dict(dist: LengthDist) -> dict[str, Any]:
    kind = next(k for k, (cls, _, _) in _LENGTH_KINDS.items() if isinstance(dist, cls))
    return {"kind": kind, **dataclasses.asdict(dist)}


# --------------------------------------------------------------------------- SLOs and classes


@dataclass(frozen=True, slots=True)
class SloTarget:
    """Latency targets of one request; ``None`` means "no target" (not checked by the report).

    On the wire (``SloTarget`` in common.proto) ``None`` is sent as 0, which the router
    reads as "use the router's default" for TTFT/TPOT and "no target" for e2e.
    """

    ttft_ms: float | None = field(
        default=None, metadata=doc("time to first token target in ms, > 0, or None")
    )
    tpot_ms: float | None = field(
        default=None, metadata=doc("mean time per output token (after the first) target in ms, or None")
    )
    e2e_ms: float | None = field(default=None, metadata=doc("end-to-end latency target in ms, > 0, or None"))

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None:
                _check_positive(f"slo.{name}", value)

    def describe(self) -> str:
        parts = [
            f"{label}<={value:g}ms"
            for label, value in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2e", self.e2e_ms))
            if value is not None
        ]
        return " ".join(parts) if parts else "none"


@dataclass(frozen=True)
class SloClass:
    """One kind of traffic: its share of requests, its SLO and its length distributions."""

    name: str = field(default="chat", metadata=doc("class name used in reports; unique within a workload"))
    share: float = field(
        default=1.0, metadata=doc("relative weight of this class among all requests (normalised), > 0")
    )
    slo: SloTarget = field(
        default=SloTarget(ttft_ms=1000.0, tpot_ms=50.0), metadata=doc("latency targets of the class")
    )
    prompt: LengthDist = field(
        default=LognormalLength(384.0, 1.0, 16, 4096), metadata=doc("prompt length distribution in tokens")
    )
    output: LengthDist = field(
        default=LognormalLength(192.0, 0.8, 8, 1024),
        metadata=doc(
            "length of the answer the engine really generates, in tokens (never shown to the router)"
        ),
    )
    max_tokens: int | None = field(
        default=None,
        metadata=doc(
            "the cap a client sends (sampling.max_tokens); omit or null: the output distribution's largest value"
        ),
    )
    ignore_eos: bool = field(
        default=True,
        metadata=doc("the engine ignores its own EOS (eos_probability): answers have the output length"),
    )
    priority: int = field(
        default=0, metadata=doc("GenerateRequest.priority sent with every request of the class")
    )
    prefix_groups: int = field(
        default=0,
        metadata=doc(
            "shared prefixes (system prompts, documents) the class's prompts start with, one drawn per "
            "request; 0 = none"
        ),
    )
    prefix_tokens: int = field(
        default=0,
        metadata=doc(
            "tokens of the shared prefix, before the prompt's own tokens (whole 512-token blocks are reusable)"
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise WorkloadError(f"class name must be letters, digits, '_', '.', '-', got {self.name!r}")
        _check_positive(f"class {self.name!r}: share", self.share)
        if self.max_tokens is not None:
            _check_int(f"class {self.name!r}: max_tokens", self.max_tokens, minimum=1)
        _check_int(f"class {self.name!r}: prefix_groups", self.prefix_groups, minimum=0)
        _check_int(f"class {self.name!r}: prefix_tokens", self.prefix_tokens, minimum=0)
        if self.prefix_groups > 1_000_000 or self.prefix_tokens > 1_000_000:
            raise WorkloadError(
                f"class {self.name!r}: prefix_groups and prefix_tokens must be <= 1000000, got "
                f"{self.prefix_groups} and {self.prefix_tokens}"
            )
        if (self.prefix_groups > 0) != (self.prefix_tokens > 0):
            raise WorkloadError(
                f"class {self.name!r}: give prefix_groups and prefix_tokens together (both > 0), got "
                f"{self.prefix_groups} and {self.prefix_tokens}"
            )

    @property
    def cap_tokens(self) -> int:
        """The ``max_tokens`` a request of the class carries: ``max_tokens``, else the output's largest value."""
        return self.max_tokens if self.max_tokens is not None else self.output.bounds[1]

    def prefix_hash_ids(self, group: int, block_tokens: int) -> tuple[int, ...]:
        """The prefix-block ids of shared prefix ``group``: one per whole block, distinct per class."""
        out = []
        for j in range(self.prefix_tokens // block_tokens):
            digest = hashlib.blake2b(f"{self.name}/{group}/{j}".encode(), digest_size=7).digest()
            out.append(int.from_bytes(digest, "little"))
        return tuple(out)

    def describe(self) -> str:
        return (
            f"{self.name}: share {self.share:g}, SLO {self.slo.describe()}, prompt {self.prompt.describe()}, "
            f"output {self.output.describe()}, max_tokens {self.cap_tokens}"
        )


class ArrivalProcess(enum.Enum):
    """How requests arrive."""

    #: Open loop, exponential gaps (a Poisson process) at ``rate_per_s``.
    POISSON = "poisson"
    #: Open loop, gamma gaps with mean ``1/rate_per_s`` and shape ``burstiness``.
    GAMMA = "gamma"
    #: Closed loop: ``concurrency`` clients, each sends its next request when the last one ends.
    CLOSED = "closed"


@dataclass(frozen=True)
class ArrivalSpec:
    """The arrival process of a workload.

    Gamma gaps have shape ``burstiness`` and mean ``1/rate_per_s``, so their
    coefficient of variation is ``1/sqrt(burstiness)``: 1 is Poisson, below 1 is
    burstier (clumps and lulls), above 1 is smoother (towards a constant rate).
    """

    process: ArrivalProcess = field(default=ArrivalProcess.POISSON, metadata=doc("poisson | gamma | closed"))
    rate_per_s: float = field(
        default=2.0, metadata=doc("mean arrival rate in requests per second (open loop)")
    )
    burstiness: float = field(
        default=1.0, metadata=doc("gamma shape of the gaps, > 0; 1 = Poisson, < 1 burstier")
    )
    concurrency: int = field(
        default=8, metadata=doc("number of clients each with one request in flight (closed loop)")
    )

    def __post_init__(self) -> None:
        if not isinstance(self.process, ArrivalProcess):
            raise WorkloadError(f"arrival.process must be an ArrivalProcess, got {self.process!r}")
        _check_positive("arrival.rate_per_s", self.rate_per_s)
        _check_positive("arrival.burstiness", self.burstiness)
        _check_int("arrival.concurrency", self.concurrency, minimum=1)
        if self.process is ArrivalProcess.POISSON and self.burstiness != 1.0:
            raise WorkloadError(
                f"arrival.burstiness={self.burstiness!r} needs process 'gamma' (poisson is burstiness 1)"
            )

    @property
    def open_loop(self) -> bool:
        """True when arrivals follow planned offsets rather than completions."""
        return self.process is not ArrivalProcess.CLOSED

    @property
    def cv(self) -> float:
        """Coefficient of variation of the inter-arrival gaps (open loop)."""
        return 1.0 / math.sqrt(self.burstiness)

    def describe(self) -> str:
        if self.process is ArrivalProcess.CLOSED:
            return f"closed loop, concurrency {self.concurrency}"
        if self.process is ArrivalProcess.POISSON:
            return f"poisson, {self.rate_per_s:g} req/s"
        return f"gamma, {self.rate_per_s:g} req/s, burstiness {self.burstiness:g} (cv {self.cv:.2f})"


# --------------------------------------------------------------------------- presets

#: Class presets. Targets are sized for the bundled 7B-on-2xV100 profile (about 160 ms to
#: prefill 1k tokens, 16-40 ms per decode step): an interactive class judged on TTFT and
#: TPOT, and two classes judged only end to end because their output is useful when whole.
CLASS_PRESETS: Mapping[str, SloClass] = {
    # Chat: people read as it streams, so the first token and the pace matter, not the total.
    "chat": SloClass(
        name="chat",
        share=0.6,
        slo=SloTarget(ttft_ms=1000.0, tpot_ms=50.0),
        prompt=LognormalLength(384.0, 1.0, 16, 4096),
        output=LognormalLength(192.0, 0.8, 8, 1024),
    ),
    # Code completion: a file's worth of context, a short answer, useful only when complete.
    "code": SloClass(
        name="code",
        share=0.25,
        slo=SloTarget(e2e_ms=4000.0),
        prompt=LognormalLength(1024.0, 0.6, 64, 4096),
        output=LognormalLength(64.0, 0.7, 4, 256),
    ),
    # Summarisation: long documents in, a paragraph out, loose end-to-end target.
    "summarize": SloClass(
        name="summarize",
        share=0.15,
        slo=SloTarget(e2e_ms=15000.0),
        prompt=LognormalLength(3072.0, 0.4, 512, 6144),
        output=LognormalLength(192.0, 0.4, 32, 512),
    ),
    # Code assistant traffic as slice-level scheduling studies it: most answers well under 512
    # tokens, a thin tail running to the 2048-token generation limit; judged end to end.
    "codegen": SloClass(
        name="codegen",
        share=1.0,
        slo=SloTarget(e2e_ms=60000.0),
        prompt=LognormalLength(384.0, 0.9, 16, 2048),
        output=LognormalLength(128.0, 1.0, 4, 2048),
    ),
    # Premium chat: chat traffic from paying users, sent with a higher priority (20 % of mixed-priority).
    "chat-priority": SloClass(
        name="chat-priority",
        share=0.25,
        slo=SloTarget(ttft_ms=1000.0, tpot_ms=50.0),
        prompt=LognormalLength(384.0, 1.0, 16, 4096),
        output=LognormalLength(192.0, 0.8, 8, 1024),
        priority=10,
    ),
    # Interactive assistant traffic beside a batch job (queue-management studies): people wait for
    # the first token, so the TTFT target is tight.
    "interactive": SloClass(
        name="interactive",
        share=0.5,
        slo=SloTarget(ttft_ms=1000.0, tpot_ms=50.0),
        prompt=LognormalLength(256.0, 0.8, 16, 2048),
        output=LognormalLength(128.0, 0.7, 8, 512),
    ),
    # Offline batch work (summaries, evaluations): long outputs, only the whole answer matters, by a
    # loose deadline.
    "batch": SloClass(
        name="batch",
        share=0.5,
        slo=SloTarget(e2e_ms=60000.0),
        prompt=LognormalLength(512.0, 0.6, 32, 2048),
        output=LognormalLength(640.0, 0.5, 64, 2048),
    ),
    # Shaped like Python-Code-23k-ShareGPT (seed 000's code task): a short question, a few hundred
    # tokens of code back, useful only when complete. Its e2e target is 10x the time one average
    # request takes alone on the bundled 7B-on-2xV100 profile (about 6 s), as in seed 000.
    "python-code": SloClass(
        name="python-code",
        share=0.5,
        slo=SloTarget(e2e_ms=60000.0),
        prompt=LognormalLength(160.0, 0.6, 16, 1024),
        output=LognormalLength(320.0, 0.5, 32, 1536),
    ),
    # Shaped like ShareGPT_Vicuna_unfiltered (seed 000's chat task): wide prompt and answer lengths,
    # judged on TTFT and TPOT (the paper's 10 s and 50 ms).
    "sharegpt": SloClass(
        name="sharegpt",
        share=0.5,
        slo=SloTarget(ttft_ms=10000.0, tpot_ms=50.0),
        prompt=LognormalLength(256.0, 1.0, 8, 1536),
        output=LognormalLength(224.0, 0.9, 8, 1536),
    ),
    # Smoke tests: tiny requests that any fleet serves quickly.
    "tiny": SloClass(
        name="tiny",
        share=1.0,
        slo=SloTarget(ttft_ms=2000.0, tpot_ms=100.0),
        prompt=UniformLength(16, 64),
        output=FixedLength(16),
    ),
    # An assistant behind a few long system prompts (tools, instructions, a RAG document): 3 kB-token
    # shared prefixes out of 8, then the user's own turn. Prefix-cache heavy.
    "shared-prefix": SloClass(
        name="shared-prefix",
        share=1.0,
        slo=SloTarget(ttft_ms=1000.0, tpot_ms=50.0),
        prompt=LognormalLength(256.0, 0.8, 16, 2048),
        output=LognormalLength(128.0, 0.8, 8, 1024),
        prefix_groups=8,
        prefix_tokens=3072,
    ),
}

#: Workload presets: name -> class presets (with their default shares).
WORKLOAD_PRESETS: Mapping[str, tuple[str, ...]] = {
    "mixed": ("chat", "code", "summarize"),
    # mixed plus 20 % premium chat at priority 10 (shares 0.6/0.25/0.15/0.25, normalised).
    "mixed-priority": ("chat", "code", "summarize", "chat-priority"),
    "chat": ("chat",),
    "code": ("code",),
    "summarize": ("summarize",),
    "tiny": ("tiny",),
    "codegen": ("codegen",),
    # A tight interactive class beside a loose batch class, half and half.
    "interactive-batch": ("interactive", "batch"),
    # Seed 000's mix: code and chat in equal shares, each judged its own way.
    "code-chat": ("python-code", "sharegpt"),
    # Prompts behind shared system prompts (prefix caching pays).
    "prefix-heavy": ("shared-prefix",),
}

DEFAULT_WORKLOAD = "mixed"


@dataclass(frozen=True)
class WorkloadSpec:
    """A complete workload: SLO classes, arrivals, and the prompt token-id range."""

    name: str = field(default=DEFAULT_WORKLOAD, metadata=doc("label used in reports"))
    classes: tuple[SloClass, ...] = field(
        default=tuple(CLASS_PRESETS[c] for c in WORKLOAD_PRESETS[DEFAULT_WORKLOAD]),
        metadata=doc("the SLO classes and their shares"),
    )
    arrival: ArrivalSpec = field(default=ArrivalSpec(), metadata=doc("arrival process"))
    token_id_low: int = field(default=0, metadata=doc("smallest prompt token id (inclusive)"))
    token_id_high: int = field(
        default=256, metadata=doc("prompt token ids are < this (the built-in tokenizer is byte level)")
    )
    model: str = field(
        default="", metadata=doc("GenerateRequest.model; empty lets the router pick any instance")
    )

    def __post_init__(self) -> None:
        if not self.classes:
            raise WorkloadError("workload.classes is empty; give at least one SLO class")
        names = [c.name for c in self.classes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise WorkloadError(f"workload.classes: duplicate class names {dupes}; names must be unique")
        _check_int("workload.token_id_low", self.token_id_low, minimum=0)
        _check_int("workload.token_id_high", self.token_id_high, minimum=self.token_id_low + 1)
        if self.token_id_high > _TOKEN_ID_LIMIT:
            raise WorkloadError(f"workload.token_id_high must be <= 2**32, got {self.token_id_high}")

    def shares(self) -> npt.NDArray[np.float64]:
        """Class shares normalised to sum to 1, in class order."""
        raw = np.array([c.share for c in self.classes], dtype=np.float64)
        normalised: npt.NDArray[np.float64] = raw / raw.sum()
        return normalised

    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    def class_slos(self) -> dict[str, SloTarget]:
        """Class name -> targets, in class order (what ``report.summarize`` takes as ``class_slos``)."""
        return {c.name: c.slo for c in self.classes}

    def with_arrival(self, **changes: Any) -> WorkloadSpec:
        """A copy with arrival fields replaced (e.g. ``rate_per_s`` for a rate sweep)."""
        return dataclasses.replace(self, arrival=dataclasses.replace(self.arrival, **changes))

    def describe(self) -> str:
        lines = [f"workload {self.name}: {self.arrival.describe()}"]
        for cls, share in zip(self.classes, self.shares(), strict=True):
            lines.append(f"  {cls.describe()} ({share:.0%})")
        return "\n".join(lines)


# --------------------------------------------------------------------------- parsing

_CLASS_KEYS = frozenset(
    {
        "name",
        "preset",
        "share",
        "ttft_ms",
        "tpot_ms",
        "e2e_ms",
        "prompt",
        "output",
        "max_tokens",
        "ignore_eos",
        "priority",
        "prefix_groups",
        "prefix_tokens",
    }
)
_ARRIVAL_KEYS = frozenset({*(f.name for f in dataclasses.fields(ArrivalSpec)), "cv"})
_WORKLOAD_KEYS = frozenset({"name", "classes", "arrival", "token_id_low", "token_id_high", "model"})


def _check_keys(doc: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise WorkloadError(f"{where}: unknown keys {unknown}; allowed: {', '.join(sorted(allowed))}")


def _parse_class(doc: Any, where: str) -> SloClass:
    if not isinstance(doc, Mapping):
        raise WorkloadError(f"{where}: a class must be a mapping, got {type(doc).__name__}")
    _check_keys(doc, _CLASS_KEYS, where)
    # A class written from scratch has no target it does not name ("omit or null: no target");
    # one started from a preset keeps the preset's targets it does not override.
    base = SloClass(slo=SloTarget())
    if "preset" in doc:
        preset = doc["preset"]
        if preset not in CLASS_PRESETS:
            raise WorkloadError(f"{where}: unknown preset {preset!r}; use one of {', '.join(CLASS_PRESETS)}")
        base = CLASS_PRESETS[preset]
    elif "name" not in doc:
        raise WorkloadError(f"{where}: a class needs a 'name' (or a 'preset' to start from)")
    slo_changes = {k: doc[k] for k in ("ttft_ms", "tpot_ms", "e2e_ms") if k in doc}
    changes: dict[str, Any] = {
        k: doc[k]
        for k in ("name", "share", "max_tokens", "ignore_eos", "priority", "prefix_groups", "prefix_tokens")
        if k in doc
    }
    if "ignore_eos" in changes and not isinstance(changes["ignore_eos"], bool):
        raise WorkloadError(f"{where}: ignore_eos must be true or false, got {changes['ignore_eos']!r}")
    if "priority" in changes:
        _check_int(f"{where}: priority", changes["priority"], minimum=-(2**31))
    if "share" in changes:
        _check_positive(f"{where}: share", changes["share"])
    try:
        if slo_changes:
            changes["slo"] = dataclasses.replace(base.slo, **slo_changes)
        if "prompt" in doc:
            changes["prompt"] = parse_length(doc["prompt"], f"{where}: prompt")
        if "output" in doc:
            changes["output"] = parse_length(doc["output"], f"{where}: output")
        return dataclasses.replace(base, **changes)
    except WorkloadError as exc:
        if str(exc).startswith(where):
            raise
        raise WorkloadError(f"{where}: {exc}") from None


def _parse_arrival(doc: Any, where: str) -> ArrivalSpec:
    if not isinstance(doc, Mapping):
        raise WorkloadError(f"{where}: arrival must be a mapping, got {type(doc).__name__}")
    _check_keys(doc, _ARRIVAL_KEYS, where)
    changes = dict(doc)
    if "cv" in changes:
        # The coefficient of variation of the gaps is the other common way to say how bursty.
        if "burstiness" in changes:
            raise WorkloadError(f"{where}: give burstiness or cv, not both (burstiness = 1 / cv**2)")
        cv = changes.pop("cv")
        _check_positive(f"{where}: cv", cv)
        changes["burstiness"] = 1.0 / (cv * cv)
    if "process" in changes:
        try:
            changes["process"] = ArrivalProcess(changes["process"])
        except ValueError:
            raise WorkloadError(
                f"{where}: process {changes['process']!r} unknown; use one of "
                f"{', '.join(p.value for p in ArrivalProcess)}"
            ) from None
    try:
        return dataclasses.replace(ArrivalSpec(), **changes)
    except WorkloadError as exc:
        raise WorkloadError(f"{where}: {exc}") from None


def parse_workload_dict(doc: Any, source: str = "<workload>") -> WorkloadSpec:
    """A workload from a decoded JSON/YAML document.

    Keys: ``name``, ``classes`` (a list of class mappings, required), ``arrival``
    (``process``, ``rate_per_s``, ``burstiness`` or ``cv``, ``concurrency``), ``token_id_low``,
    ``token_id_high``, ``model``. A class mapping has ``name`` or ``preset`` (start from
    a class preset and override), ``share``, ``ttft_ms``, ``tpot_ms``, ``e2e_ms`` (omitted
    or null: no target; with a preset, omitted keeps the preset's), ``prompt`` and ``output``
    (see :func:`parse_length`; ``output`` is the answer's true length), ``max_tokens`` (the cap
    a request sends), ``ignore_eos``, ``priority``.
    """
    if not isinstance(doc, Mapping):
        raise WorkloadError(f"{source}: the workload must be a mapping, got {type(doc).__name__}")
    _check_keys(doc, _WORKLOAD_KEYS, source)
    raw_classes = doc.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise WorkloadError(f"{source}: 'classes' must be a non-empty list of SLO classes")
    classes = tuple(_parse_class(c, f"{source}: classes[{i}]") for i, c in enumerate(raw_classes))
    changes: dict[str, Any] = {"classes": classes}
    if "arrival" in doc:
        changes["arrival"] = _parse_arrival(doc["arrival"], f"{source}: arrival")
    for key in ("name", "token_id_low", "token_id_high", "model"):
        if key in doc:
            changes[key] = doc[key]
    if not isinstance(changes.get("name", ""), str) or not isinstance(changes.get("model", ""), str):
        raise WorkloadError(f"{source}: 'name' and 'model' must be strings")
    try:
        return dataclasses.replace(WorkloadSpec(name=Path(source).stem), **changes)
    except WorkloadError as exc:
        raise WorkloadError(f"{source}: {exc}") from None


def workload_to_dict(spec: WorkloadSpec) -> dict[str, Any]:
    """A JSON-ready document that :func:`parse_workload_dict` reads back to an equal spec."""
    return {
        "name": spec.name,
        "arrival": {
            "process": spec.arrival.process.value,
            "rate_per_s": spec.arrival.rate_per_s,
            "burstiness": spec.arrival.burstiness,
            "concurrency": spec.arrival.concurrency,
        },
        "token_id_low": spec.token_id_low,
        "token_id_high": spec.token_id_high,
        "model": spec.model,
        "classes": [
            {
                "name": c.name,
                "share": c.share,
                "ttft_ms": c.slo.ttft_ms,
                "tpot_ms": c.slo.tpot_ms,
                "e2e_ms": c.slo.e2e_ms,
                "prompt": _length_to_dict(c.prompt),
                "output": _length_to_dict(c.output),
                "max_tokens": c.max_tokens,
                "ignore_eos": c.ignore_eos,
                "priority": c.priority,
                "prefix_groups": c.prefix_groups,
                "prefix_tokens": c.prefix_tokens,
            }
            for c in spec.classes
        ],
    }


def _parse_mix(text: str) -> WorkloadSpec:
    classes = []
    for part in text.split(","):
        name, sep, weight = part.strip().partition("=")
        name = name.strip()
        if name not in CLASS_PRESETS:
            raise WorkloadError(
                f"workload {text!r}: unknown class preset {name!r}; use {', '.join(CLASS_PRESETS)} "
                "(e.g. chat=0.7,code=0.3)"
            )
        share = CLASS_PRESETS[name].share
        if sep:
            value = _number(weight.strip(), f"workload {text!r}: weight of {name!r}")
            _check_positive(f"workload {text!r}: weight of {name!r}", value)
            share = float(value)
        classes.append(dataclasses.replace(CLASS_PRESETS[name], share=share))
    return WorkloadSpec(name=text.replace(" ", ""), classes=tuple(classes))


def load_workload(spec: str | None = None) -> WorkloadSpec:
    """A workload from a preset name, a ``class=weight,...`` mix, or a JSON/YAML file path.

    ``None`` or an empty string gives the default (``mixed``).
    """
    text = (spec or DEFAULT_WORKLOAD).strip()
    path = Path(text)
    if path.suffix.lower() in (".json", ".yaml", ".yml") or path.is_file():
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise WorkloadError(f"{text}: cannot read workload file: {exc}") from exc
        try:
            doc = json.loads(raw) if path.suffix.lower() == ".json" else yaml.safe_load(raw)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise WorkloadError(
                f"{text}: invalid {path.suffix.lstrip('.').upper() or 'YAML'}: {exc}"
            ) from exc
        return parse_workload_dict(doc, text)
    if "=" in text or "," in text:
        return _parse_mix(text)
    if text in WORKLOAD_PRESETS:
        classes = tuple(CLASS_PRESETS[c] for c in WORKLOAD_PRESETS[text])
        if len(classes) == 1:
            classes = (dataclasses.replace(classes[0], share=1.0),)
        return WorkloadSpec(name=text, classes=classes)
    raise WorkloadError(
        f"workload {text!r}: not a preset ({', '.join(WORKLOAD_PRESETS)}), a mix like chat=0.7,code=0.3, "
        "or a .json/.yaml file"
    )


# --------------------------------------------------------------------------- plans

#: Tokens per prefix-block id of a synthetic shared prefix (Mooncake's block).
PREFIX_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request of a plan: when it arrives, what it asks for, and its SLO.

    Prompt token ids are not stored (a long plan would hold hundreds of millions of
    them); :meth:`prompt_token_ids` regenerates them from ``prompt_seed``, always the
    same for the same plan. A simulator needs only ``prompt_tokens``.
    """

    index: int
    """Position in the plan, from 0."""
    arrival_s: float
    """Planned arrival, seconds after the run starts (0 for every closed-loop request)."""
    class_name: str
    prompt_tokens: int
    max_tokens: int
    slo: SloTarget
    prompt_seed: int
    token_id_low: int = 0
    token_id_high: int = 256
    ignore_eos: bool = True
    priority: int = 0
    output_tokens: int | None = None
    """Tokens the engine really generates before it stops (end of sequence); ``None``: it
    runs to ``max_tokens``. Ground truth for the engine only: nothing a router or a policy
    sees may read it (a client sends ``max_tokens``, never its answer's length)."""
    hash_ids: tuple[int, ...] = ()
    """Prefix-block ids, one per ``prefix_block_tokens`` tokens of the prompt from its start
    (a trace's ``hash_ids``): equal ids give equal token blocks, so a prefix cache sees the
    reuse. Tokens past the last block come from ``prompt_seed``."""
    prefix_block_tokens: int = 512
    """Tokens per entry of ``hash_ids``."""

    @property
    def true_output_tokens(self) -> int:
        """What the engine generates: ``output_tokens`` capped by ``max_tokens``."""
        if self.output_tokens is None:
            return self.max_tokens
        return min(self.output_tokens, self.max_tokens)

    def prompt_token_ids(self) -> list[int]:
        """The prompt, ``prompt_tokens`` ids in ``token_id_low..token_id_high-1``.

        Each entry of ``hash_ids`` covers the next ``prefix_block_tokens`` tokens with ids drawn
        from that hash id alone, so two prompts sharing their first k hash ids share their
        first k blocks token for token; the rest is drawn from ``prompt_seed``.
        """
        low, high, block = self.token_id_low, self.token_id_high, self.prefix_block_tokens
        ids: list[int] = []
        for hash_id in self.hash_ids:
            if len(ids) >= self.prompt_tokens:
                break
            take = min(block, self.prompt_tokens - len(ids))
            rng = np.random.default_rng((0x5EED, hash_id))
            ids.extend(rng.integers(low, high, size=block, dtype=np.int64)[:take].tolist())
        rest = self.prompt_tokens - len(ids)
        if rest > 0:
            rng = np.random.default_rng(self.prompt_seed)
            ids.extend(rng.integers(low, high, size=rest, dtype=np.int64).tolist())
        return ids


RngLike = np.random.Generator | random.Random | int


def as_generator(rng: RngLike) -> np.random.Generator:
    """A numpy Generator from a Generator (used as is), a seeded ``random.Random`` or an int seed."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, random.Random):
        return np.random.default_rng(rng.getrandbits(128))
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(
        f"rng must be a numpy Generator, a random.Random or an int seed, got {type(rng).__name__}"
    )


def iter_requests(
    spec: WorkloadSpec, rng: RngLike, *, max_requests: int = MAX_PLAN_REQUESTS
) -> Iterator[RequestPlan]:
    """Lazily yield up to ``max_requests`` planned requests, in arrival order.

    Deterministic for a seed. Arrival gaps, class choices, lengths and prompt seeds
    come from independent child streams drawn in blocks of :data:`PLAN_BLOCK_SIZE`,
    so the first requests do not depend on how many are taken.
    """
    _check_int("max_requests", max_requests, minimum=0)
    gen = as_generator(rng)
    arrival_rng, class_rng, length_rng, seed_rng = gen.spawn(4)
    cumulative = np.cumsum(spec.shares())
    arrival = spec.arrival
    shape = arrival.burstiness
    scale = 1.0 / (arrival.rate_per_s * shape)
    last_class = len(spec.classes) - 1
    base_s = 0.0
    index = 0
    num_blocks = -(-max_requests // PLAN_BLOCK_SIZE)
    for _ in range(num_blocks):
        n = PLAN_BLOCK_SIZE
        if arrival.open_loop:
            gaps = arrival_rng.gamma(shape, scale, size=n)
            ends = np.cumsum(gaps)
            # The first request of a run arrives at 0. An exclusive prefix sum, not
            # ``ends - gaps``: with very bursty gaps (shape 0.1: many near 0 next to
            # huge ones) that subtraction rounds below the previous arrival.
            offsets = np.empty(n)
            offsets[0] = 0.0
            offsets[1:] = ends[:-1]
            offsets += base_s  # float addition is monotonic: the order survives
            base_s += float(ends[-1])
        else:
            offsets = np.zeros(n)
        choice = np.minimum(np.searchsorted(cumulative, class_rng.random(n), side="right"), last_class)
        prompts = np.stack([c.prompt.sample(length_rng, n) for c in spec.classes])
        outputs = np.stack([c.output.sample(length_rng, n) for c in spec.classes])
        seeds = seed_rng.integers(0, 2**63 - 1, size=n, dtype=np.int64)
        caps = [c.cap_tokens for c in spec.classes]
        for j in range(n):
            if index >= max_requests:
                return
            k = int(choice[j])
            cls = spec.classes[k]
            prompt_tokens = int(prompts[k, j])
            hash_ids: tuple[int, ...] = ()
            if cls.prefix_groups:
                # The shared prefix comes first; the group from the request's own seed (no new stream).
                group = int(seeds[j]) % cls.prefix_groups
                hash_ids = cls.prefix_hash_ids(group, PREFIX_BLOCK_TOKENS)
                prompt_tokens += cls.prefix_tokens
            yield RequestPlan(
                index=index,
                arrival_s=float(offsets[j]),
                class_name=cls.name,
                prompt_tokens=prompt_tokens,
                max_tokens=caps[k],
                output_tokens=min(int(outputs[k, j]), caps[k]),
                slo=cls.slo,
                prompt_seed=int(seeds[j]),
                token_id_low=spec.token_id_low,
                token_id_high=spec.token_id_high,
                ignore_eos=cls.ignore_eos,
                priority=cls.priority,
                hash_ids=hash_ids,
                prefix_block_tokens=PREFIX_BLOCK_TOKENS,
            )
            index += 1


def generate_requests(
    spec: WorkloadSpec,
    *,
    rng: RngLike,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[RequestPlan]:
    """The plan of a run: pure and deterministic for a seed (no clock, no sockets).

    Open loop: requests arriving before ``duration_s``, at most ``num_requests`` of
    them (at least one bound is required). Closed loop: exactly ``num_requests``
    requests, all with ``arrival_s == 0`` (a closed-loop run is bounded in time by
    the load generator, not by the plan).
    """
    if num_requests is None and duration_s is None:
        raise WorkloadError("give num_requests or duration_s to bound the plan")
    if num_requests is not None:
        _check_int("num_requests", num_requests, minimum=0)
        if num_requests > MAX_PLAN_REQUESTS:
            raise WorkloadError(f"num_requests must be <= {MAX_PLAN_REQUESTS}, got {num_requests}")
    if duration_s is not None:
        _check_positive("duration_s", duration_s)
    if not spec.arrival.open_loop and num_requests is None:
        raise WorkloadError("a closed-loop plan needs num_requests (duration bounds the run, not the plan)")
    limit = MAX_PLAN_REQUESTS if num_requests is None else num_requests
    plans: list[RequestPlan] = []
    for plan in iter_requests(spec, rng, max_requests=limit):
        if duration_s is not None and spec.arrival.open_loop and plan.arrival_s >= duration_s:
            break
        plans.append(plan)
    return plans


def plan_summary(plans: list[RequestPlan]) -> dict[str, Any]:
    """Counts and token totals of a plan, per class (for reports and logs)."""
    per_class: dict[str, dict[str, int]] = {}
    for p in plans:
        entry = per_class.setdefault(
            p.class_name, {"requests": 0, "prompt_tokens": 0, "max_tokens": 0, "output_tokens": 0}
        )
        entry["requests"] += 1
        entry["prompt_tokens"] += p.prompt_tokens
        entry["max_tokens"] += p.max_tokens
        entry["output_tokens"] += p.true_output_tokens
    return {
        "requests": len(plans),
        "last_arrival_s": max((p.arrival_s for p in plans), default=0.0),
        "classes": per_class,
    }
