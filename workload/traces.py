"""Replaying real request traces: one reader for ``slo-router simulate`` and ``slo-router bench``.

A trace is named like any workload, ``--workload trace:FILE``. Its format is recognised from its
first line:

- Azure, as processed (vidur's ``splitwise_conv.csv``): a CSV header
  ``arrived_at,num_prefill_tokens,num_decode_tokens`` (arrival in seconds);
- Azure's public dataset: ``TIMESTAMP,ContextTokens,GeneratedTokens`` (``TIMESTAMP`` a date and
  time such as ``2023-11-16 18:15:46.6805900``, or seconds);
- Mooncake JSONL: one object a line with ``timestamp`` (ms), ``input_length``,
  ``output_length`` and optionally ``hash_ids`` (one id per 512-token prefix block: equal ids
  are equal blocks, so a prefix cache sees the trace's real reuse).

Each record becomes a :class:`workload.spec.RequestPlan`: the trace's prompt length, its output
length as the engine's *true* length (``output_tokens``, never shown to a router), a
``max_tokens`` cap the same for every request (:attr:`TraceOptions.max_tokens`, by default the
longest output of the trace: a client does not know its answer's length), and its arrival time,
relative to the first request of the window, divided by ``speed`` (``--trace-speed K`` replays
K times faster). With ``rate`` the timing is scaled so the mean rate is ``rate`` instead.
Classes (SLO targets and priority) come from a rule (:func:`parse_class_rule`): the trace
carries none.

Every problem is a :class:`workload.spec.WorkloadError` naming the file, the line and the field.
Reading is bounded: at most :data:`MAX_TRACE_REQUESTS` records and :data:`MAX_LINE_BYTES` a line.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as dt
import io
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from workload.spec import (
    CLASS_PRESETS,
    ArrivalSpec,
    RequestPlan,
    SloClass,
    WorkloadError,
    WorkloadSpec,
)

#: Prefix of a ``--workload`` value that names a trace file.
TRACE_PREFIX = "trace:"
#: Bound on the records one trace may hold (the two bundled one-hour traces hold 12-20 thousand).
MAX_TRACE_REQUESTS = 2_000_000
#: Bound on one line of a trace file.
MAX_LINE_BYTES = 1 << 20
#: Bound on a prompt or output length in a trace (tokens).
MAX_TRACE_TOKENS = 10_000_000
#: Tokens per Mooncake ``hash_ids`` entry.
MOONCAKE_BLOCK_TOKENS = 512

AZURE_HEADER = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
AZURE_RAW_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace: arrival (s, as the trace says), prompt and output tokens, prefix blocks."""

    line: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ClassRule:
    """How trace requests get an SLO class: one class for all, or by prompt length.

    ``thresholds[k]`` splits ``classes[k]`` (prompts below it) from what follows.
    """

    classes: tuple[SloClass, ...]
    thresholds: tuple[int, ...] = ()

    def pick(self, prompt_tokens: int) -> SloClass:
        for k, limit in enumerate(self.thresholds):
            if prompt_tokens < limit:
                return self.classes[k]
        return self.classes[-1]

    def describe(self) -> str:
        if not self.thresholds:
            return self.classes[0].name
        parts = [self.classes[0].name]
        for limit, cls in zip(self.thresholds, self.classes[1:], strict=True):
            parts.append(f"<{limit}<= {cls.name}")
        return " ".join(parts)


def parse_class_rule(text: str) -> ClassRule:
    """A class rule: ``chat`` (every request is of the ``chat`` class preset), or by prompt length:
    ``chat,2048,summarize`` (prompts under 2048 tokens are chat, the rest summarize), with as many
    ``CLASS,LIMIT,`` pairs as wanted (limits increasing)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    where = f"--trace-classes {text!r}"
    if not parts or len(parts) % 2 == 0:
        raise WorkloadError(
            f"{where}: write CLASS or CLASS,LIMIT,CLASS[,LIMIT,CLASS...] (e.g. chat,2048,summarize)"
        )
    classes: list[SloClass] = []
    limits: list[int] = []
    for k, part in enumerate(parts):
        if k % 2 == 0:
            if part not in CLASS_PRESETS:
                raise WorkloadError(
                    f"{where}: unknown class preset {part!r}; use one of {', '.join(CLASS_PRESETS)}"
                )
            if any(c.name == part for c in classes):
                raise WorkloadError(f"{where}: class {part!r} appears twice")
            classes.append(CLASS_PRESETS[part])
        else:
            try:
                limit = int(part)
            except ValueError:
                raise WorkloadError(f"{where}: {part!r} is not a prompt length in tokens") from None
            if limit < 1 or (limits and limit <= limits[-1]):
                raise WorkloadError(f"{where}: prompt limits must be >= 1 and increasing, got {part}")
            limits.append(limit)
    return ClassRule(tuple(classes), tuple(limits))


DEFAULT_CLASS_RULE = "chat"


@dataclass(frozen=True)
class TraceOptions:
    """What to take from a trace and how to replay it."""

    #: Replay this many times faster than the trace (2.0 halves every gap). Ignored with ``rate``.
    speed: float = 1.0
    #: Take records arriving in [start_s, end_s) of the trace's own clock (from its first record).
    start_s: float = 0.0
    end_s: float = math.inf
    #: SLO classes of the requests.
    classes: str = DEFAULT_CLASS_RULE
    #: The cap every request sends (sampling.max_tokens); 0: the longest output of the window.
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise WorkloadError(f"--trace-speed must be a finite number > 0, got {self.speed!r}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise WorkloadError(f"--trace-window start must be >= 0 s, got {self.start_s!r}")
        if not self.end_s > self.start_s:
            raise WorkloadError(f"--trace-window end ({self.end_s}) must be after its start ({self.start_s})")
        if self.max_tokens < 0:
            raise WorkloadError(f"--trace-max-tokens must be >= 0, got {self.max_tokens}")


def _line_seed(line: int) -> int:
    """A prompt seed per trace line (tokens past the prefix blocks differ from line to line)."""
    return (line * 0x9E3779B97F4A7C15 + 0x5EED) & (2**63 - 1)


def is_trace(workload: str | None) -> bool:
    """Whether a ``--workload`` value names a trace (``trace:FILE``)."""
    return bool(workload) and str(workload).strip().startswith(TRACE_PREFIX)


def parse_window(text: str) -> tuple[float, float]:
    """``START:END`` in seconds of the trace (either may be empty: from the start / to the end)."""
    start_text, sep, end_text = text.partition(":")
    if not sep:
        raise WorkloadError(f"--trace-window {text!r}: write START:END in seconds (e.g. 600:1200, or 600:)")
    try:
        start = float(start_text) if start_text.strip() else 0.0
        end = float(end_text) if end_text.strip() else math.inf
    except ValueError:
        raise WorkloadError(f"--trace-window {text!r}: START and END must be numbers of seconds") from None
    return start, end


# --------------------------------------------------------------------------- reading


def _int_field(value: object, path: str, line: int, name: str) -> int:
    if isinstance(value, bool):
        raise WorkloadError(f"{path}:{line}: field {name!r} must be an integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise WorkloadError(f"{path}:{line}: field {name!r} must be an integer, got {value!r}") from None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value):
        raise WorkloadError(f"{path}:{line}: field {name!r} must be an integer, got {value!r}")
    n = int(value)
    if not 0 <= n <= MAX_TRACE_TOKENS:
        raise WorkloadError(f"{path}:{line}: field {name!r} must be in [0, {MAX_TRACE_TOKENS}], got {n}")
    return n


def _time_field(value: object, path: str, line: int, name: str, scale: float) -> float:
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            try:
                # Azure's public dataset: "2023-11-16 18:15:46.6805900" (7 fraction digits).
                head, _, frac = text.partition(".")
                stamp = dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC)
                seconds = stamp.timestamp() + (float("0." + frac) if frac else 0.0)
            except ValueError:
                raise WorkloadError(
                    f"{path}:{line}: field {name!r} must be a time (seconds or YYYY-MM-DD HH:MM:SS), got {value!r}"
                ) from None
        return seconds * scale
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WorkloadError(f"{path}:{line}: field {name!r} must be a number, got {value!r}")
    return float(value) * scale


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        handle = path.open("r", encoding="utf-8", newline="")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read trace: {exc}") from exc
    with handle:
        for number, text in enumerate(handle, start=1):
            if len(text) > MAX_LINE_BYTES:
                raise WorkloadError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
            yield number, text


def read_trace(path: str | Path) -> tuple[str, list[TraceRecord]]:
    """``(format, records)`` of a trace file, in file order; see the module docstring."""
    path = Path(path)
    lines = _lines(path)
    first = next(lines, None)
    if first is None:
        raise WorkloadError(f"{path}:1: empty trace file")
    first_number, text = first
    stripped = text.strip().lstrip("\ufeff")
    records: list[TraceRecord] = []
    if stripped.startswith("{"):
        fmt = "mooncake"
        for number, line in itertools.chain([(first_number, text)], lines):
            if not line.strip():
                continue
            _check_count(records, path, number)
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{number}: not a JSON object: {exc.msg}") from None
            if not isinstance(doc, dict):
                raise WorkloadError(f"{path}:{number}: expected a JSON object, got {type(doc).__name__}")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in doc:
                    raise WorkloadError(f"{path}:{number}: field {key!r} is missing")
            hashes = doc.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hashes
            ):
                raise WorkloadError(f"{path}:{number}: field 'hash_ids' must be a list of integers >= 0")
            records.append(
                TraceRecord(
                    number,
                    _time_field(doc["timestamp"], str(path), number, "timestamp", 1e-3),
                    _int_field(doc["input_length"], str(path), number, "input_length"),
                    _int_field(doc["output_length"], str(path), number, "output_length"),
                    tuple(hashes),
                )
            )
        return fmt, records
    header = tuple(h.strip() for h in next(csv.reader(io.StringIO(stripped))))
    if header[:3] == AZURE_HEADER:
        fmt, names = "azure", AZURE_HEADER
    elif header[:3] == AZURE_RAW_HEADER:
        fmt, names = "azure-raw", AZURE_RAW_HEADER
    else:
        raise WorkloadError(
            f"{path}:1: unknown trace format: expected a CSV header {','.join(AZURE_HEADER)} or "
            f"{','.join(AZURE_RAW_HEADER)}, or Mooncake JSONL (timestamp, input_length, output_length)"
        )
    for number, line in lines:
        if not line.strip():
            continue
        _check_count(records, path, number)
        row = next(csv.reader(io.StringIO(line)))
        if len(row) < 3:
            raise WorkloadError(f"{path}:{number}: expected {len(header)} fields, got {len(row)}")
        records.append(
            TraceRecord(
                number,
                _time_field(row[0], str(path), number, names[0], 1.0),
                _int_field(row[1], str(path), number, names[1]),
                _int_field(row[2], str(path), number, names[2]),
            )
        )
    return fmt, records


def _check_count(records: Sequence[TraceRecord], path: Path, number: int) -> None:
    if len(records) >= MAX_TRACE_REQUESTS:
        raise WorkloadError(f"{path}:{number}: more than {MAX_TRACE_REQUESTS} records; cut the trace")


# --------------------------------------------------------------------------- the replay


@dataclass(frozen=True)
class Trace:
    """A trace read and windowed, ready to plan: records sorted by arrival, times from the window's first."""

    path: str
    format: str
    records: tuple[TraceRecord, ...]
    options: TraceOptions
    rule: ClassRule

    @property
    def span_s(self) -> float:
        """Seconds from the first to the last arrival, on the trace's own clock."""
        return self.records[-1].arrival_s - self.records[0].arrival_s if self.records else 0.0

    @property
    def native_rate(self) -> float:
        """Mean arrivals per second on the trace's own clock."""
        if len(self.records) < 2 or self.span_s <= 0:
            return 1.0
        return (len(self.records) - 1) / self.span_s

    @property
    def max_tokens(self) -> int:
        return self.options.max_tokens or max((r.output_tokens for r in self.records), default=1) or 1

    def workload(self) -> WorkloadSpec:
        """The classes (for reports) and the trace's mean rate, as a workload spec (arrivals replayed, not drawn)."""
        name = f"trace:{Path(self.path).name}"
        return WorkloadSpec(
            name=name,
            classes=tuple(dataclasses.replace(c, share=1.0) for c in self.rule.classes),
            arrival=ArrivalSpec(rate_per_s=self.native_rate * self.options.speed),
        )

    def plans(self, num_requests: int | None = None, rate: float | None = None) -> list[RequestPlan]:
        """The first ``num_requests`` requests (all: None) as plans; ``rate`` rescales to that mean rate."""
        records = self.records if num_requests is None else self.records[:num_requests]
        if not records:
            return []
        scale = 1.0 / self.options.speed
        if rate is not None:
            if not (math.isfinite(rate) and rate > 0):
                raise WorkloadError(f"rate must be a finite number > 0, got {rate!r}")
            scale = self.native_rate / rate
        t0 = records[0].arrival_s
        cap = self.max_tokens
        out = []
        for k, rec in enumerate(records):
            cls = self.rule.pick(rec.prompt_tokens)
            out.append(
                RequestPlan(
                    index=k,
                    arrival_s=(rec.arrival_s - t0) * scale,
                    class_name=cls.name,
                    prompt_tokens=max(rec.prompt_tokens, 1),
                    max_tokens=max(cap, 1),
                    slo=cls.slo,
                    prompt_seed=_line_seed(rec.line),
                    ignore_eos=True,
                    priority=cls.priority,
                    output_tokens=max(rec.output_tokens, 1),
                    hash_ids=rec.hash_ids,
                    prefix_block_tokens=MOONCAKE_BLOCK_TOKENS,
                )
            )
        return out


def add_trace_arguments(parser: argparse._ActionsContainer) -> None:
    """The trace flags, the same on ``simulate`` and ``bench``."""
    group = parser.add_argument_group("trace replay (--workload trace:FILE)")
    group.add_argument(
        "--trace-speed",
        type=float,
        default=1.0,
        metavar="K",
        help="replay the trace K times faster (ignored when a rate is given) (default: %(default)s)",
    )
    group.add_argument(
        "--trace-window",
        default=None,
        metavar="START:END",
        help="take the requests arriving from START to END seconds into the trace (e.g. 600:1200)",
    )
    group.add_argument(
        "--trace-classes",
        default=DEFAULT_CLASS_RULE,
        metavar="RULE",
        help="SLO class of each request: a class preset for all, or by prompt length, e.g. "
        "chat,2048,summarize (default: %(default)s)",
    )
    group.add_argument(
        "--trace-max-tokens",
        type=int,
        default=0,
        metavar="N",
        help="the max_tokens every request sends (default: the longest output of the trace)",
    )


def trace_options(args: argparse.Namespace) -> TraceOptions:
    """The :class:`TraceOptions` of the trace flags."""
    start, end = (0.0, math.inf) if args.trace_window is None else parse_window(args.trace_window)
    return TraceOptions(
        speed=args.trace_speed,
        start_s=start,
        end_s=end,
        classes=args.trace_classes,
        max_tokens=args.trace_max_tokens,
    )


def load_trace(workload: str, options: TraceOptions | None = None) -> Trace:
    """The trace a ``trace:FILE`` workload names, windowed and sorted by arrival (stable)."""
    options = options or TraceOptions()
    text = workload.strip()
    if not text.startswith(TRACE_PREFIX):
        raise WorkloadError(f"workload {workload!r}: a trace is named trace:FILE")
    path = text[len(TRACE_PREFIX) :]
    if not path:
        raise WorkloadError("--workload trace:FILE: the file name is missing")
    rule = parse_class_rule(options.classes)
    fmt, records = read_trace(path)
    if not records:
        raise WorkloadError(f"{path}: the trace holds no requests")
    records.sort(key=lambda r: r.arrival_s)
    origin = records[0].arrival_s
    window = [r for r in records if options.start_s <= r.arrival_s - origin < options.end_s]
    if not window:
        raise WorkloadError(
            f"{path}: no request arrives in the window [{options.start_s:g}, {options.end_s:g}) s "
            f"(the trace spans {records[-1].arrival_s - origin:.0f} s)"
        )
    return Trace(path, fmt, tuple(window), options, rule)
