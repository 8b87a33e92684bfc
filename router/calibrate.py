"""``slo-router calibrate``: turn a running fleet's observations into a new profile directory.

Two kinds of input (``--from``):

- step samples: a JSON list or JSON-lines file of engine steps as the workers
  report them (``num_prefill_tokens``, ``num_decode_requests``,
  ``num_decode_tokens``, ``duration_ms``; optional ``group`` to pick with
  ``--group``). They are fed to the router's own calibration
  (:class:`router.core.calibration.Calibrator`) over the base profile, and the
  new profile is the calibrated prediction at every point of the base
  profile's grids (``--mode refit``: the least-squares step model where it was
  fitted; ``scale``: the base profile times the robust factors);
- the router's Prometheus metrics (a file, or an ``http://`` URL of
  ``--metrics-port``): the ``slo_router_calibration_factor_ratio`` gauges of
  ``--group``; the new profile is the base profile times those factors.

The output directory holds ``ttft.json`` and ``tpot.json`` in the profile
schema (``--ttft-profiling-data-path`` / ``--tpot-profiling-data-path`` or
``--profile-group NAME=DIR`` take it as is) and ``coefficients.json``, the
closed-form fit of the new profile (:mod:`predictor.fit`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import re
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fleet.flags import error_line
from predictor import LatencyPredictor, ProfileError
from predictor.fit import write_coefficients
from predictor.profile import load_tpot_profile, load_ttft_profile
from router.core.calibration import CalibrationConfig, Calibrator, StepSample
from router.core.predictors import PredictorSet

#: Bundled profiles (the default base).
BUNDLED = Path(__file__).resolve().parent.parent / "profiling_data"
DEFAULT_BASE = BUNDLED / "qwen2.5-7b-2xv100-linear"

#: Most samples read from one file (bounds memory and the fit).
MAX_SAMPLES = 1_000_000
#: Largest metrics document read (bytes).
MAX_METRICS_BYTES = 16 * 1024 * 1024

_FACTOR = re.compile(
    r"^slo_router_calibration_factor_ratio\{(?P<labels>[^}]*)\}\s+(?P<value>[-+0-9.eEinfINFaN]+)\s*$"
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


#: ``--help``'s text: the module docstring's content, in words for a terminal (no reST markup).
DESCRIPTION = """\
Turn a running fleet's observations into a new profile directory.

Two kinds of input (--from):

- step samples: a JSON list or JSON-lines file of engine steps as the workers
  report them (num_prefill_tokens, num_decode_requests, num_decode_tokens,
  duration_ms; optional group, picked with --group). They are fed to the
  router's own calibration over the base profile (--profile), and the new
  profile is the calibrated prediction at every point of the base profile's
  grids (--mode refit: the least-squares step model where it was fitted;
  scale: the base profile times the robust factors);
- the router's Prometheus metrics (a file, or an http:// URL of the router's
  --metrics-port): the slo_router_calibration_factor_ratio gauges of --group;
  the new profile is the base profile times those factors.

The output directory (--out) holds ttft.json and tpot.json in the profile
schema (router --profile DIR takes it as is, as do --profile-group NAME=DIR and
--ttft-/--tpot-profiling-data-path) and coefficients.json, the closed-form fit
of the new profile.
"""


class CalibrateError(ValueError):
    """The input cannot be turned into a profile; the message names the flag and the fix."""


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "calibrate",
        help="write a new profile directory from a running fleet's step samples or calibration metrics",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="METRICS_OR_SAMPLES",
        help="step samples (.json / .jsonl) or the router's Prometheus metrics (file or http:// URL)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write the new profile into")
    parser.add_argument(
        "--profile",
        default=str(DEFAULT_BASE),
        metavar="DIR",
        help="base profile (ttft.json + tpot.json) the fleet was predicted with (default: the bundled "
        f"{DEFAULT_BASE.name})",
    )
    parser.add_argument(
        "--group", default=None, metavar="NAME", help="only this profile group's samples / factors"
    )
    parser.add_argument(
        "--mode",
        choices=("scale", "refit"),
        default="refit",
        help="from samples: robust factors only, or the least-squares step model (default: %(default)s)",
    )
    parser.set_defaults(func=run)


# --------------------------------------------------------------------------- inputs


def read_samples(path: Path, group: str | None) -> list[StepSample]:
    """Step samples from a JSON list or JSON-lines file (``group`` keeps only that group's)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrateError(f"--from {path}: cannot read: {exc}") from exc
    stripped = text.lstrip()
    try:
        docs = (
            json.loads(text)
            if stripped.startswith("[")
            else [json.loads(x) for x in text.splitlines() if x.strip()]
        )
    except json.JSONDecodeError as exc:
        raise CalibrateError(f"--from {path}: not JSON or JSON lines: {exc}") from exc
    if not isinstance(docs, list):
        raise CalibrateError(f"--from {path}: expected a list of step samples")
    if len(docs) > MAX_SAMPLES:
        raise CalibrateError(f"--from {path}: {len(docs)} samples; at most {MAX_SAMPLES} are read")
    samples = []
    for k, doc in enumerate(docs):
        where = f"--from {path}: sample {k + 1}"
        if not isinstance(doc, dict):
            raise CalibrateError(f"{where}: must be an object, got {doc!r}")
        if group is not None and doc.get("group", "") != group:
            continue
        try:
            sample = StepSample(
                int(doc["num_prefill_tokens"]),
                int(doc["num_decode_requests"]),
                int(doc["num_decode_tokens"]),
                float(doc["duration_ms"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrateError(
                f"{where}: needs integer num_prefill_tokens, num_decode_requests, num_decode_tokens "
                f"and a number duration_ms ({exc})"
            ) from exc
        if min(sample.num_prefill_tokens, sample.num_decode_requests, sample.num_decode_tokens) < 0 or not (
            math.isfinite(sample.duration_ms) and sample.duration_ms >= 0
        ):
            raise CalibrateError(f"{where}: counts and duration_ms must be >= 0, got {doc!r}")
        samples.append(sample)
    return samples


def read_metrics(source: str) -> str:
    """The text of a metrics file or URL."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=10) as response:  # an operator-given URL
                data: bytes = response.read(MAX_METRICS_BYTES + 1)
        except OSError as exc:
            raise CalibrateError(f"--from {source}: cannot fetch: {exc}") from exc
    else:
        try:
            data = Path(source).read_bytes()[: MAX_METRICS_BYTES + 1]
        except OSError as exc:
            raise CalibrateError(f"--from {source}: cannot read: {exc}") from exc
    if len(data) > MAX_METRICS_BYTES:
        raise CalibrateError(f"--from {source}: larger than {MAX_METRICS_BYTES} bytes")
    return data.decode("utf-8", errors="replace")


def factors_from_metrics(text: str, group: str | None, source: str) -> tuple[float, float]:
    """(TTFT factor, TPOT factor) of ``group`` from the router's calibration gauges."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _FACTOR.match(line.strip())
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group("labels")))
        value = float(m.group("value"))
        if math.isfinite(value) and value > 0:
            found.setdefault(labels.get("group", ""), {})[labels.get("prediction", "")] = value
    if not found:
        raise CalibrateError(
            f"--from {source}: no slo_router_calibration_factor_ratio gauges (is the router running with "
            "--calibration scale or refit, and --metrics-port?)"
        )
    if group is None:
        if len(found) > 1:
            raise CalibrateError(
                f"--from {source}: several groups ({', '.join(sorted(found))}); pick one with --group"
            )
        group = next(iter(found))
    if group not in found:
        raise CalibrateError(f"--group {group!r}: not in the metrics (groups: {', '.join(sorted(found))})")
    values = found[group]
    return values.get("ttft", 1.0), values.get("tpot", 1.0)


# --------------------------------------------------------------------------- the new profile


def calibrated_profile(
    base: LatencyPredictor,
    ttft_doc: dict[str, Any],
    tpot_doc: dict[str, Any],
    samples: Sequence[StepSample],
    mode: str,
) -> tuple[dict[str, Any], dict[str, Any], tuple[float, float]]:
    """The base documents with every p50 replaced by the calibrated prediction; also the factors."""
    config = CalibrationConfig(
        mode=mode,
        window_samples=max(64, min(len(samples), 100_000)),
        refit_min_samples=48,
        stale_after_s=1e9,
        # Offline: jump straight to the window's figures (no rate limit to protect live decisions).
        max_change_per_update=99.0,
        update_every_samples=max(1, len(samples)),
        update_every_s=0.0,  # one pass over the samples: no time between updates to space
    )
    predictors = PredictorSet(base)
    calibrator = Calibrator(config, predictors.step_predictor)
    calibrator.observe("fleet", "", samples, 0.0)
    correction = calibrator.correction(("fleet",), ("",))
    if correction is None:
        raise CalibrateError(
            f"--from: {len(samples)} usable step samples; at least {config.min_samples} are needed"
        )
    correction = dataclasses.replace(correction, interleave_ms=np.zeros(1))

    def one(values: list[float]) -> np.ndarray[Any, Any]:
        return np.array(values, dtype=np.float64)

    for row in ttft_doc["results"]:
        p = float(row["tokens_num"])
        profile = float(base.prefill_step_ms(p))
        new = float(
            correction.ttft_ms(
                one([profile]), one([p]), one([0.0]), one([0.0]), one([max(p, 1.0)]), one([0.0])
            )[0]
        )
        _rescale(row, new)
    for row in tpot_doc["results"]:
        b, per_request = float(row["batch_size"]), float(row["tokens_per_request"])
        profile = float(base.predict_tpot_ms(b, b * per_request))
        new = float(correction.tpot_ms(one([profile]), one([b]), one([b * per_request]))[0])
        _rescale(row, new)
    return ttft_doc, tpot_doc, calibrator.factors("fleet")


def _rescale(row: dict[str, Any], new_p50: float) -> None:
    old = float(row["p50"])
    ratio = new_p50 / old if old > 0 else 1.0
    for key in ("mean", "p95", "p99"):
        if key in row:
            row[key] = round(float(row[key]) * ratio, 4)
    row["p50"] = round(new_p50, 4)


def scaled_profile(
    ttft_doc: dict[str, Any], tpot_doc: dict[str, Any], factors: tuple[float, float]
) -> tuple[dict[str, Any], dict[str, Any]]:
    for row in ttft_doc["results"]:
        _rescale(row, float(row["p50"]) * factors[0])
    for row in tpot_doc["results"]:
        _rescale(row, float(row["p50"]) * factors[1])
    return ttft_doc, tpot_doc


def run(args: argparse.Namespace) -> int:
    base_dir = Path(args.profile)
    try:
        ttft_doc = json.loads((base_dir / "ttft.json").read_text(encoding="utf-8"))
        tpot_doc = json.loads((base_dir / "tpot.json").read_text(encoding="utf-8"))
        base = LatencyPredictor.from_files(base_dir / "ttft.json", base_dir / "tpot.json")
    except (OSError, json.JSONDecodeError, ProfileError) as exc:
        print(error_line(f"--profile {base_dir}: {exc}"), file=sys.stderr)
        return 2
    source: str = args.source
    try:
        is_samples = Path(source).suffix.lower() in (".json", ".jsonl") and not source.startswith("http")
        if is_samples:
            samples = read_samples(Path(source), args.group)
            ttft_doc, tpot_doc, factors = calibrated_profile(base, ttft_doc, tpot_doc, samples, args.mode)
            how = f"{len(samples)} step samples ({args.mode})"
        else:
            factors = factors_from_metrics(read_metrics(source), args.group, source)
            ttft_doc, tpot_doc = scaled_profile(ttft_doc, tpot_doc, factors)
            how = "the router's calibration factors"
    except CalibrateError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    note = (
        f" Recalibrated by `slo-router calibrate` from {how} of {source} over {base_dir.name} "
        f"(TTFT x{factors[0]:.3f}, TPOT x{factors[1]:.3f})."
    )
    for doc in (ttft_doc, tpot_doc):
        meta = doc.setdefault("metadata", {})
        meta["timestamp"] = stamp
        meta["description"] = str(meta.get("description", "")) + note
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ttft.json").write_text(json.dumps(ttft_doc, indent=1) + "\n", encoding="utf-8")
        (out / "tpot.json").write_text(json.dumps(tpot_doc, indent=1) + "\n", encoding="utf-8")
        coefficients = write_coefficients(
            out, load_ttft_profile(out / "ttft.json"), load_tpot_profile(out / "tpot.json")
        )
    except (OSError, ProfileError) as exc:
        print(error_line(f"--out {out}: {exc}"), file=sys.stderr)
        return 2
    print(
        f"wrote {out / 'ttft.json'}, {out / 'tpot.json'} and {coefficients} "
        f"(TTFT x{factors[0]:.3f}, TPOT x{factors[1]:.3f} vs {base_dir.name})"
    )
    return 0
