"""Config documentation and validation, flags, the registry and YAML policy files."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from router.core.config import SchedulerConfig
from router.core.errors import (
    ConfigError,
    DuplicatePluginError,
    PolicyFileError,
    RouterError,
    UnknownPluginError,
)
from router.core.policies import build_policy, load_policy_file
from router.core.registry import FILTERS, METRICS, POLICIES, SELECTORS, Params, Registry
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def test_every_config_field_has_a_doc_and_a_default() -> None:
    for f in dataclasses.fields(SchedulerConfig):
        assert f.metadata.get("doc"), f"SchedulerConfig.{f.name} has no doc"
        assert f.default is not dataclasses.MISSING, f"SchedulerConfig.{f.name} has no default"


def test_defaults_match_the_issue() -> None:
    c = SchedulerConfig()
    assert (c.ttft_slo_ms, c.tpot_slo_ms) == (6000.0, 50.0)
    assert (c.ttft_slo_dispatch_threshold, c.tpot_slo_dispatch_threshold) == (1.0, 1.0)
    assert (c.instance_staleness_s, c.failover_domain, c.dispatch_top_k, c.inflight_expiry_s) == (
        5.0,
        "instance",
        1,
        10.0,
    )
    assert (
        c.dispatch_prefill_load_metric,
        c.dispatch_decode_load_metric,
        c.dispatch_neutral_load_metric,
    ) == (
        "prefill_backlog_tokens",
        "kv_usage_projected",
        "prefill_backlog_tokens",
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"scheduling_policy": "fastest"}, "scheduling_policy"),
        ({"enable_adaptive_pd": True, "scheduling_policy": "load-balance"}, "scheduling_policy"),
        ({"ttft_slo_ms": 0}, "ttft_slo_ms"),
        ({"tpot_slo_ms": float("nan")}, "tpot_slo_ms"),
        ({"ttft_slo_dispatch_threshold": -1}, "ttft_slo_dispatch_threshold"),
        ({"instance_staleness_s": 0}, "instance_staleness_s"),
        ({"inflight_expiry_s": -1}, "inflight_expiry_s"),
        ({"failover_domain": "rack"}, "failover_domain"),
        ({"dispatch_top_k": 0}, "dispatch_top_k"),
        ({"dispatch_decode_load_metric": "vibes"}, "dispatch_decode_load_metric"),
        ({"dispatch_prefill_load_threshold": float("nan")}, "dispatch_prefill_load_threshold"),
        ({"default_max_num_batched_tokens": 0}, "default_max_num_batched_tokens"),
        ({"profile_label": ""}, "profile_label"),
        ({"calibration_update_every_s": -0.5}, "calibration_update_every_s"),
        ({"calibration_update_every_s": float("inf")}, "calibration_update_every_s"),
    ],
)
def test_invalid_values_raise_naming_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}=") as err:
        SchedulerConfig(**overrides)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, RouterError)


def test_flags_round_trip_through_argparse() -> None:
    parser = argparse.ArgumentParser()
    SchedulerConfig.add_arguments(parser)
    ns = parser.parse_args(
        [
            "--scheduling-policy",
            "slo",
            "--enable-adaptive-pd",
            "--ttft-slo",
            "3000",
            "--tpot-slo",
            "40",
            "--ttft-slo-dispatch-threshold",
            "0.9",
            "--instance-staleness-seconds",
            "2.5",
            "--failover-domain",
            "node-unit",
            "--dispatch-top-k",
            "2",
            "--inflight-expiry-s",
            "4",
            "--dispatch-decode-load-threshold",
            "0.8",
        ]
    )
    c = SchedulerConfig.from_namespace(ns)
    assert c.scheduling_policy == "slo" and c.enable_adaptive_pd
    assert (c.ttft_slo_ms, c.tpot_slo_ms, c.ttft_slo_dispatch_threshold) == (3000, 40, 0.9)
    assert (c.instance_staleness_s, c.failover_domain, c.dispatch_top_k, c.inflight_expiry_s) == (
        2.5,
        "node-unit",
        2,
        4,
    )
    assert c.dispatch_decode_load_threshold == 0.8 and c.dispatch_prefill_load_threshold is None
    assert SchedulerConfig.from_namespace(parser.parse_args([])) == SchedulerConfig()


def test_from_namespace_ignores_unrelated_flags_and_accepts_overrides() -> None:
    ns = argparse.Namespace(ttft_slo=1000.0, listen="0.0.0.0:1", seed=3)
    c = SchedulerConfig.from_namespace(ns, tpot_slo_ms=20.0)
    assert c.ttft_slo_ms == 1000 and c.tpot_slo_ms == 20


def test_slo_policies_need_a_predictor() -> None:
    with pytest.raises(ConfigError, match="profiling-data-path"):
        make_scheduler("slo", predictors=None)


# ----------------------------------------------------------------------------- registry


def test_duplicate_names_raise_and_unknown_names_list_the_known_ones() -> None:
    registry: Registry[object] = Registry("widget")
    registry.register("a")(lambda config, params: object())
    with pytest.raises(DuplicatePluginError, match="widget 'a' is already registered"):
        registry.register("a")(lambda config, params: object())
    with pytest.raises(UnknownPluginError, match="unknown widget 'b'; registered widgets: a"):
        registry.create("b", SchedulerConfig())
    for real in (METRICS, FILTERS, SELECTORS, POLICIES):
        with pytest.raises(DuplicatePluginError):
            real.register(real.names()[0])(lambda config, params: None)  # type: ignore[arg-type,return-value]


def test_unknown_parameters_are_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown parameter\\(s\\) max_age_ms"):
        FILTERS.create("staleness", SchedulerConfig(), Params("here", {"max_age_ms": 3}))
    with pytest.raises(ConfigError, match="must be a number"):
        FILTERS.create("staleness", SchedulerConfig(), Params("here", {"max_age_s": "soon"}))


def test_registered_policies_include_the_baselines() -> None:
    assert {
        "load-balance",
        "slo",
        "adaptive-pd",
        "round-robin",
        "random",
        "least-requests",
        "power-of-two",
    } <= set(POLICIES.names())


# ----------------------------------------------------------------------------- policy files

GOOD = """
name: careful-slo
prefill:
  filters:
    - schedulability
    - {name: staleness, max_age_s: 2}
    - {name: metric_threshold, metric: predicted_ttft, slo: ttft, factor: 0.5}
    - {name: failover, domain: node}
  selector: {name: lowest, metrics: [predicted_ttft, decode_batch_size]}
decode:
  filters: [schedulability, staleness, failover]
  selector: {name: lowest, metrics: [-decode_batch_size], top_k: 1}
neutral:
  filters: [schedulability, failover]
  selector: random
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_policy_file_composes_plugins_per_stage(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    s = make_scheduler("slo", policy_config_path=str(path))
    assert s.policy.name == "careful-slo"
    assert [f.label for f in s.policy.prefill.filters] == [
        "schedulability",
        "staleness",
        "metric_threshold:predicted_ttft",
    ]
    assert [g.label for g in s.policy.prefill.global_filters] == ["failover"]
    snap = make_snapshot(
        inst("p", "prefill"), inst("d1", "decode", decode_requests=1, decode_tokens=10), inst("d2", "decode")
    )
    d = s.schedule(snap, make_request(), NOW)
    assert d.policy == "careful-slo" and d.instance_ids == ("p", "d1")  # decode: highest batch first
    assert build_policy(s.config).name == "careful-slo"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prefill: {}\n", "missing stage"),
        ("[1, 2]\n", "a policy must be a mapping"),
        (
            "name: x\nprefill: {filters: [], selector: random}\ndecode: {filters: [], selector: random}\n"
            "neutral: {filters: [teleport], selector: random}\n",
            "unknown filter 'teleport'; registered filters: ",
        ),
        (
            "name: x\nprefill: {filters: [], selector: fastest}\ndecode: {filters: [], selector: random}\n"
            "neutral: {filters: [], selector: random}\n",
            "unknown selector 'fastest'",
        ),
        (
            "name: x\nprefill: {filters: [], selector: {name: lowest, metrics: [vibes]}}\n"
            "decode: {filters: [], selector: random}\nneutral: {filters: [], selector: random}\n",
            "unknown metric 'vibes'",
        ),
        (
            "name: x\nprefill: {filters: [{name: staleness, max_age: 1}], selector: random}\n"
            "decode: {filters: [], selector: random}\nneutral: {filters: [], selector: random}\n",
            "prefill.filters\\[0\\] \\(staleness\\): unknown parameter",
        ),
        (
            "name: x\nprefill: {filters: [], selector: random, extra: 1}\ndecode: {filters: [], selector: random}\n"
            "neutral: {filters: [], selector: random}\n",
            "unknown key\\(s\\) extra",
        ),
        ("name: x\nbogus: 1\n", "unknown key\\(s\\) bogus"),
        ("prefill: [\n", "invalid YAML"),
        (
            "name: x\nprefill: {filters: [{name: metric_threshold, metric: predicted_ttft}], selector: random}\n"
            "decode: {filters: [], selector: random}\nneutral: {filters: [], selector: random}\n",
            "exactly one of",
        ),
    ],
)
def test_policy_file_errors_name_the_file_and_the_entry(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyFileError, match=message) as err:
        load_policy_file(path, SchedulerConfig())
    assert str(path) in str(err.value)


def test_a_missing_policy_file_is_a_policy_file_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyFileError, match="cannot read policy file"):
        load_policy_file(tmp_path / "nope.yaml", SchedulerConfig())


def test_an_adaptive_policy_file_needs_no_neutral_stage(tmp_path: Path) -> None:
    text = (
        "adaptive_pd: true\n"
        "prefill: {filters: [schedulability, {name: exclude_reserved, reserve: decode, relax_pass: 2}],"
        " selector: {name: lowest, metrics: [predicted_ttft]}}\n"
        "decode: {filters: [schedulability], selector: adaptive_decode}\n"
    )
    policy = load_policy_file(write(tmp_path, text), SchedulerConfig())
    assert (
        policy.role_agnostic and policy.neutral is None and len(policy.hooks) == 2
    )  # reserves, decode share
