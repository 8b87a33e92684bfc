"""Each field `bench --help` documents for a workload file does what the help says, in the plan and in
the simulator; a field the simulator does not model is refused there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from router.cli import main
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from tests.sim.test_simulate import policy
from workload.report import slo_met, summarize
from workload.spec import ArrivalProcess, SloTarget, generate_requests, parse_workload_dict


def one(cls: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"classes": [cls], **top}


def plans(doc: dict[str, Any], n: int = 400, seed: int = 0) -> list:  # type: ignore[type-arg]
    return generate_requests(parse_workload_dict(doc), rng=seed, num_requests=n)


@pytest.mark.parametrize("target", ["ttft_ms", "tpot_ms", "e2e_ms"])
def test_an_omitted_target_is_no_target(target: str) -> None:
    # "omit or null: no target" -- for a class written from scratch, each target it does not name.
    spec = parse_workload_dict(one({"name": "x", target: 500}))
    slo = spec.classes[0].slo
    assert getattr(slo, target) == 500
    assert all(getattr(slo, t) is None for t in ("ttft_ms", "tpot_ms", "e2e_ms") if t != target)
    assert parse_workload_dict(one({"name": "x"})).classes[0].slo == SloTarget()


def test_an_e2e_only_class_is_not_judged_on_ttft_in_the_simulator() -> None:
    # An e2e-only class used to keep TTFT <= 1 s and TPOT <= 50 ms from the class defaults.
    doc = one({"name": "batch", "e2e_ms": 600_000, "prompt": "fixed(3000)", "output": "fixed(64)"})
    ps = generate_requests(parse_workload_dict(doc).with_arrival(rate_per_s=20.0), rng=0, num_requests=40)
    out = simulate(SimFleet(fleet_from_counts(neutral=1)), policy("round-robin"), ps, seed=0)
    assert max(r.ttft_ms or 0.0 for r in out.results) > 1000.0  # a queue of long prompts: slow first tokens
    assert all(slo_met(r) for r in out.results)


def test_a_preset_keeps_its_targets_and_null_removes_one() -> None:
    spec = parse_workload_dict(one({"preset": "chat", "ttft_ms": None}))
    assert spec.classes[0].slo == SloTarget(ttft_ms=None, tpot_ms=50.0)
    assert parse_workload_dict(one({"preset": "chat"})).classes[0].slo == SloTarget(1000.0, 50.0)


def test_share_weights_the_classes() -> None:
    doc = {"classes": [{"name": "a", "share": 0.8}, {"name": "b", "share": 0.2}]}
    ps = plans(doc, 2000)
    assert 0.75 < sum(p.class_name == "a" for p in ps) / len(ps) < 0.85


def test_prompt_and_output_lengths_and_the_max_tokens_cap() -> None:
    ps = plans(one({"name": "x", "prompt": "fixed(77)", "output": "uniform(10,20)", "max_tokens": 15}))
    assert {p.prompt_tokens for p in ps} == {77}
    assert {p.max_tokens for p in ps} == {15}
    # The output is the answer's true length, capped by max_tokens.
    assert {p.true_output_tokens for p in ps} == set(range(10, 16))
    default_cap = plans(one({"name": "x", "output": "uniform(10,20)"}))
    assert {p.max_tokens for p in default_cap} == {20}


def test_ignore_eos_and_priority_reach_the_plan() -> None:
    ps = plans(one({"name": "x", "ignore_eos": False, "priority": 7}), 5)
    assert all(not p.ignore_eos and p.priority == 7 for p in ps)


def test_token_id_range() -> None:
    ps = plans(one({"name": "x", "prompt": "fixed(200)"}, token_id_low=40, token_id_high=42), 3)
    assert {t for p in ps for t in p.prompt_token_ids()} == {40, 41}


@pytest.mark.parametrize(
    ("arrival", "check"),
    [
        ({"process": "poisson", "rate_per_s": 8}, lambda a: a.rate_per_s == 8),
        ({"process": "gamma", "rate_per_s": 6, "burstiness": 0.5}, lambda a: a.burstiness == 0.5),
        ({"process": "gamma", "rate_per_s": 6, "cv": 2.0}, lambda a: a.burstiness == 0.25),
        ({"process": "closed", "concurrency": 16}, lambda a: a.process is ArrivalProcess.CLOSED),
    ],
)
def test_arrival_fields(arrival: dict[str, Any], check: Any) -> None:
    assert check(parse_workload_dict(one({"name": "x"}, arrival=arrival)).arrival)


def test_name_and_model() -> None:
    spec = parse_workload_dict(one({"name": "x"}, name="support-bot", model="m1"))
    assert (spec.name, spec.model) == ("support-bot", "m1")


def test_simulate_refuses_a_model_it_does_not_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(one({"name": "x"}, model="m1")))
    assert main(["simulate", "--workload", str(path), "--neutral", "1", "--no-progress"]) == 2
    assert "'model' ('m1') is not simulated" in capsys.readouterr().err


def test_the_help_example_file_loads_and_means_what_it_says(tmp_path: Path) -> None:
    from bench.cli import EPILOG

    start = EPILOG.index("  name: support-bot")
    end = EPILOG.index("\narrivals:")
    text = "\n".join(line[2:] for line in EPILOG[start:end].splitlines())
    path = tmp_path / "help.yaml"
    path.write_text(text)
    from workload.spec import load_workload

    spec = load_workload(str(path))
    chat, code = spec.classes
    assert chat.slo == SloTarget(ttft_ms=800.0, tpot_ms=40.0)
    assert chat.max_tokens == 1024 and chat.ignore_eos and chat.priority == 0
    assert code.slo.e2e_ms == 3000 and spec.arrival.burstiness == 0.5
    report = summarize([], 1.0, class_slos=spec.class_slos())
    assert [c.name for c in report.classes] == ["chat", "code"]
