"""``slo-router simulate``: the virtual-time cluster simulation, its sweeps and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from predictor import LatencyPredictor
from router.cli import main
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, SimOutcome, simulate
from sim.fleet import (
    BUNDLED_PROFILES,
    DEFAULT_PROFILE,
    fleet_from_counts,
    parse_fleet,
    parse_fleet_dict,
)
from sim.sweep import SLO_ADAPTIVE_PD, policy_overrides
from workload.report import summarize
from workload.spec import RequestPlan, SloTarget, generate_requests, load_workload

QWEN = BUNDLED_PROFILES / DEFAULT_PROFILE
CHAT = SloTarget(ttft_ms=1000.0, tpot_ms=50.0)


def write_scaled_profile(directory: Path, factor: float) -> Path:
    """A copy of the bundled Qwen profile with every latency ``factor`` times larger (slower hardware)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("ttft.json", "tpot.json"):
        doc = json.loads((QWEN / name).read_text(encoding="utf-8"))
        for row in doc["results"]:
            for key in ("mean", "p50", "p95", "p99"):
                if key in row:
                    row[key] *= factor
        doc["metadata"]["description"] = f"{QWEN.name} with every latency x{factor} (test fixture)"
        (directory / name).write_text(json.dumps(doc), encoding="utf-8")
    return directory


def make_plan(index: int, arrival_s: float, prompt: int, output: int, slo: SloTarget = CHAT) -> RequestPlan:
    return RequestPlan(
        index=index,
        arrival_s=arrival_s,
        class_name="chat",
        prompt_tokens=prompt,
        max_tokens=output,
        slo=slo,
        prompt_seed=index,
    )


def policy(name: str) -> SchedulerConfig:
    return SchedulerConfig(**policy_overrides(name))


def attainment(outcome: SimOutcome) -> float:
    return summarize(outcome.results, outcome.duration_s).overall.slo_attainment


# --------------------------------------------------------------------------- the claim


def test_slo_beats_round_robin_when_half_the_fleet_is_slow() -> None:
    # The heterogeneous example of docs/results.md (Aladdin's comparison), as written there:
    #   slo-router simulate --fleet neutral=2:qwen2.5-7b-2xv100-linear,neutral=2:qwen2.5-7b-2xv100-linear-x4 \
    #       --workload chat --policies round-robin,slo --rates 2 --num-requests 200 --seed 7
    # Two instances are 4x slower than the other two (a bundled profile): their decode steps (~65 ms)
    # can never meet the 50 ms TPOT target. Round-robin sends them every other request regardless;
    # the slo policy predicts each instance with its own profile and keeps to the fast ones.
    slow = "qwen2.5-7b-2xv100-linear-x4"
    fleet = SimFleet(parse_fleet(f"neutral=2:{DEFAULT_PROFILE},neutral=2:{slow}"))
    workload = load_workload("chat").with_arrival(rate_per_s=2.0)
    plans = generate_requests(workload, rng=7, num_requests=200)

    rr = simulate(fleet, policy("round-robin"), plans, seed=7)
    slo = simulate(fleet, policy("slo"), plans, seed=7)

    # The figures docs/results.md prints (the run is deterministic).
    assert attainment(rr) == 0.5 and attainment(slo) == 1.0
    on_slow = [r for r in rr.results if r.prefill_instance_id.startswith(f"neutral-{slow}")]
    assert len(on_slow) == 100 and not any(
        r.ok and r.tpot_ms is not None and r.tpot_ms <= 50 for r in on_slow
    )
    assert not any(r.prefill_instance_id.startswith(f"neutral-{slow}") for r in slo.results)
    assert slo.stats.rejected == 0


def test_the_bundled_slow_profile_is_the_default_one_four_times_slower(tmp_path: Path) -> None:
    scaled = LatencyPredictor.from_files(
        write_scaled_profile(tmp_path / "x4", 4.0) / "ttft.json", tmp_path / "x4" / "tpot.json"
    )
    bundled = BUNDLED_PROFILES / "qwen2.5-7b-2xv100-linear-x4"
    slow = LatencyPredictor.from_files(bundled / "ttft.json", bundled / "tpot.json")
    for tokens in (64, 1000, 8000):
        assert slow.predict_ttft_ms(tokens, 0, 0, 2048) == pytest.approx(
            scaled.predict_ttft_ms(tokens, 0, 0, 2048), rel=1e-3
        )
    assert slow.predict_tpot_ms(16, 16000) == pytest.approx(scaled.predict_tpot_ms(16, 16000), rel=1e-3)


# --------------------------------------------------------------------------- worked examples


def test_a_lone_neutral_request_takes_the_profiled_step_times() -> None:
    lp = LatencyPredictor.from_files(QWEN / "ttft.json", QWEN / "tpot.json")
    outcome = simulate(SimFleet(fleet_from_counts(neutral=1)), policy("slo"), [make_plan(0, 0.5, 100, 10)])
    (r,) = outcome.results
    ttft = float(lp.prefill_step_ms(100.0))
    # Decode step k runs with the context of prompt + k tokens.
    decode = [lp.predict_tpot_ms(1, 100 + k) for k in range(1, 10)]
    assert r.ok and r.completion_tokens == 10 and r.start_s == 0.5
    assert r.ttft_ms == pytest.approx(ttft)
    assert r.e2e_ms == pytest.approx(ttft + sum(decode))
    assert r.tpot_ms == pytest.approx(sum(decode) / 9)
    assert r.predicted_ttft_ms == pytest.approx(ttft)
    assert outcome.duration_s == pytest.approx(0.5 + (ttft + sum(decode)) / 1000)
    assert outcome.stats.steps == 10


def test_a_pd_request_pays_the_kv_transfer_between_its_first_and_second_token() -> None:
    lp = LatencyPredictor.from_files(QWEN / "ttft.json", QWEN / "tpot.json")
    fleet = SimFleet(fleet_from_counts(prefill=1, decode=1))
    outcome = simulate(fleet, policy("slo"), [make_plan(0, 0.0, 1000, 10)])
    (r,) = outcome.results
    ttft = float(lp.prefill_step_ms(1000.0))
    transfer_ms = fleet.configs[1].kv_transfer_s(1000) * 1000.0
    decode = [lp.predict_tpot_ms(1, 1000 + k) for k in range(1, 10)]
    assert (r.prefill_instance_id, r.decode_instance_id) == ("prefill-000", "decode-000")
    assert r.ttft_ms == pytest.approx(ttft)
    assert r.e2e_ms == pytest.approx(ttft + transfer_ms + sum(decode))
    assert r.completion_tokens == 10
    assert outcome.stats.kv_transfers == 1


def test_a_decode_leg_in_flight_counts_on_its_instance() -> None:
    # The second request arrives while the first is still prefilling: least-requests only sends
    # its decode elsewhere if the first's decode leg counts on its instance before it gets there.
    fleet = SimFleet(fleet_from_counts(prefill=2, decode=2))
    plans = [make_plan(0, 0.0, 2000, 50), make_plan(1, 0.01, 2000, 50)]
    for seed in range(6):
        first, second = simulate(fleet, policy("least-requests"), plans, seed=seed).results
        assert first.decode_instance_id != second.decode_instance_id


def test_requests_no_instance_can_serve_in_time_are_rejected() -> None:
    impossible = SloTarget(ttft_ms=1.0, tpot_ms=50.0)
    plans = [make_plan(k, 0.1 * k, 500, 20, impossible) for k in range(5)]
    fleet = SimFleet(fleet_from_counts(neutral=2))
    outcome = simulate(fleet, policy("slo"), plans)
    assert outcome.stats.rejected == 5
    assert all(r.error_code == "RESOURCE_EXHAUSTED" and r.ttft_ms is None for r in outcome.results)
    assert "predicted_ttft" in outcome.results[0].error_message
    report = summarize(outcome.results, outcome.duration_s)
    assert report.overall.slo_attainment == 0.0 and report.overall.errors_by_code == {"RESOURCE_EXHAUSTED": 5}
    # Round-robin serves them (late).
    assert simulate(fleet, policy("round-robin"), plans).stats.rejected == 0


def test_a_run_ends_with_its_last_request_not_with_a_queue_timer_set_while_it_waited() -> None:
    # A burst the single prefill instance takes one by one: the router queue holds the rest and sets
    # a timer for the earliest moment one would turn late (their 30 s TTFT target). Every request is
    # done within a few seconds; the timer, still pending, used to end the run at about 30 s, which
    # diluted the busy-instance means (stepped and fast-forwarded runs differed by 0.9 busy decode
    # instances at 20 req/s) and goodput.
    loose = SloTarget(ttft_ms=30_000.0, tpot_ms=50.0)
    # A tight request first: under edf the loose ones then yield to its class (release limit).
    plans = [make_plan(0, 0.0, 100, 20), *(make_plan(k, 0.001, 3000, 20, loose) for k in range(1, 7))]
    fleet = SimFleet(fleet_from_counts(prefill=1, decode=1))
    outcome = simulate(fleet, policy("slo"), plans, queue=QueueConfig(queue_policy="edf"))
    assert outcome.stats.queued > 0 and all(r.ok for r in outcome.results)
    last = max(r.start_s + (r.e2e_ms or 0.0) / 1000.0 for r in outcome.results)
    assert outcome.duration_s == pytest.approx(last)
    assert outcome.duration_s < 10.0


def test_a_request_longer_than_the_model_allows_is_invalid() -> None:
    fleet = SimFleet(
        parse_fleet_dict({"engine": {"max_model_len": 1024}, "groups": [{"role": "neutral", "count": 1}]})
    )
    (r,) = simulate(fleet, policy("round-robin"), [make_plan(0, 0.0, 1000, 100)]).results
    assert r.error_code == "INVALID_ARGUMENT" and "max_model_len=1024" in r.error_message


# --------------------------------------------------------------------------- speed-ups change nothing


@pytest.mark.parametrize(
    ("fleet_doc", "name"),
    [
        ({"groups": [{"role": "prefill", "count": 2}, {"role": "decode", "count": 2}]}, "slo"),
        ({"groups": [{"role": "prefill", "count": 2}, {"role": "decode", "count": 3}]}, SLO_ADAPTIVE_PD),
        ({"groups": [{"role": "neutral", "count": 3}]}, "load-balance"),
        # The packing valve reads the measured step, which must not depend on fast-forwarding.
        ({"groups": [{"role": "neutral", "count": 2}]}, "binpack"),
        # Small KV caches: preemptions, and decode runs cut short by missing blocks.
        (
            {
                "engine": {"kv_capacity_tokens": 8192, "block_size": 8, "max_model_len": 8192},
                "groups": [{"role": "neutral", "count": 2}],
            },
            "round-robin",
        ),
        # Step-time noise on one group: those engines are always stepped.
        (
            {
                "groups": [
                    {"role": "prefill", "count": 1},
                    {"role": "decode", "count": 2, "engine": {"noise": 0.1, "seed": 3}},
                ]
            },
            "power-of-two",
        ),
    ],
)
def test_fast_forward_and_reused_columns_give_the_same_results(
    fleet_doc: dict[str, object], name: str
) -> None:
    fleet = SimFleet(parse_fleet_dict(fleet_doc))
    plans = generate_requests(load_workload("mixed").with_arrival(rate_per_s=6.0), rng=1, num_requests=150)
    fast = simulate(fleet, policy(name), plans, seed=1)
    plain = simulate(fleet, policy(name), plans, seed=1, fast_forward=False, reuse_static_memo=False)
    assert fast.results == plain.results
    assert fast.duration_s == plain.duration_s
    assert (fast.stats.steps, fast.stats.preemptions) == (plain.stats.steps, plain.stats.preemptions)
    assert fast.stats.events < plain.stats.events or fleet_doc.get("engine") is None


def test_a_fast_forwarded_run_counts_each_of_its_steps_in_the_measured_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The measured decode step the router reads is the same whether an engine's runs are fast-forwarded.

    An engine reports every decode step it finishes; a fast-forwarded run of pure decode steps
    is as many steps as stepping it would be, not one sample (which would leave the window to
    the slower steps carrying prefill chunks).
    """
    import sim.cluster as cluster

    view = cluster._Simulation._view

    def record(seen: dict[float, list[float]]) -> object:
        def wrapped(self: cluster._Simulation, now: float) -> object:
            result = view(self, now)
            measured = result.instances.measured_decode_step_ms
            assert measured is not None
            seen[now] = measured.tolist()
            return result

        return wrapped

    fleet = SimFleet(parse_fleet_dict({"groups": [{"role": "neutral", "count": 2}]}))
    plans = generate_requests(load_workload("mixed").with_arrival(rate_per_s=4.0), rng=3, num_requests=60)
    views: list[dict[float, list[float]]] = []
    events = []
    for fast in (True, False):
        seen: dict[float, list[float]] = {}
        monkeypatch.setattr(cluster._Simulation, "_view", record(seen))
        outcome = simulate(fleet, policy("binpack"), plans, seed=1, fast_forward=fast)
        views.append(seen)
        events.append(outcome.stats.events)
    assert events[0] < events[1] / 2  # most decode steps were fast-forwarded
    fast_views, plain_views = views
    assert fast_views.keys() == plain_views.keys()
    assert sum(x == x for v in plain_views.values() for x in v) > len(plain_views)  # measured, not NaN
    differ = [t for t in fast_views if str(fast_views[t]) != str(plain_views[t])]
    assert not differ, f"{len(differ)} of {len(fast_views)} views differ, first at {differ[0]} s"


# --------------------------------------------------------------------------- the command


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["simulate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


SMALL = ("--prefill", "1", "--decode", "2", "--workload", "chat", "--num-requests", "40", "--rates", "2,5")


POLICIES = f"round-robin,slo,{SLO_ADAPTIVE_PD}"


def test_cli_smoke_prints_a_table_and_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    code, stdout, stderr = run_cli(capsys, *SMALL, "--policies", POLICIES, "--plot", str(png))
    assert code == 0, stderr
    assert "rate/s" in stdout and "TTFT p99" in stdout and "[6/6]" in stderr
    table = stdout.split("attain: share")[0]  # the policy table (the prediction-error table follows it)
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["2"], ["5"])]
    assert [(row[0], row[1], row[2], row[3]) for row in rows] == [
        (rate, name, "edf", "40") for rate in ("2", "5") for name in POLICIES.split(",")
    ]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_json_holds_one_result_per_policy_and_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    code, _, stderr = run_cli(capsys, *SMALL, "--policies", POLICIES, "--output", str(out))
    assert code == 0, stderr
    doc = json.loads(out.read_text(encoding="utf-8"))
    results = doc["results"]
    assert [(r["rate"], r["policy"]) for r in results] == [
        (rate, name) for rate in (2.0, 5.0) for name in POLICIES.split(",")
    ]
    for r in results:
        assert isinstance(r["policy"], str) and isinstance(r["rate"], float)
        assert 0.0 <= r["slo_attainment"] <= 1.0
        assert r["goodput"] >= 0.0 and r["goodput"] == r["goodput_rps"]
        for key in ("ttft_p99_ms", "tpot_p99_ms", "e2e_p99_ms"):
            assert isinstance(r[key], float) and r[key] > 0
        assert r["requests"] == 40 and r["completed"] + r["errors"] == 40 and r["rejected"] <= r["errors"]
        assert r["duration_s"] > 0 and isinstance(r["errors_by_code"], dict)
        assert set(r["classes"]) == {"chat"} and 0.0 <= r["classes"]["chat"]["slo_attainment"] <= 1.0
        assert r["sim"]["decisions"] == 40 and r["sim"]["steps"] > 0
    meta = doc["meta"]
    assert meta["policies"] == POLICIES.split(",") and meta["rates"] == [2.0, 5.0]
    assert meta["num_requests"] == 40 and meta["seed"] == 0
    assert meta["scheduler"][SLO_ADAPTIVE_PD]["enable_adaptive_pd"] is True
    assert meta["workload"]["name"] == "chat"
    assert [(g["name"], g["role"], g["count"], g["profile"]) for g in meta["fleet_spec"]["groups"]] == [
        ("prefill", "prefill", 1, DEFAULT_PROFILE),
        ("decode", "decode", 2, DEFAULT_PROFILE),
    ]


def test_same_seed_same_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [tmp_path / f"run{k}.json" for k in range(3)]
    for path, seed in zip(paths, ("5", "5", "6"), strict=True):
        code, _, stderr = run_cli(
            capsys, *SMALL, "--policies", "random,power-of-two", "--seed", seed, "--output", str(path)
        )
        assert code == 0, stderr
    first, again, other = (p.read_bytes() for p in paths)
    assert first == again
    assert first != other


def test_a_heterogeneous_fleet_file_and_scheduler_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_scaled_profile(tmp_path / "profiles" / "slow", 3.0)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "engine: {max_num_batched_tokens: 1024}\n"
        "groups:\n"
        f"  - {{role: prefill, count: 1, profile: {DEFAULT_PROFILE}}}\n"
        "  - {role: decode, count: 1, profile: profiles/slow, name: d-slow, engine: {kv_capacity_tokens: 32768}}\n",
        encoding="utf-8",
    )
    out = tmp_path / "sim.json"
    code, stdout, stderr = run_cli(
        capsys,
        "--fleet",
        str(fleet),
        "--policies",
        "slo",
        "--rates",
        "1",
        "--num-requests",
        "20",
        "--workload",
        "chat",
        "--tpot-slo-dispatch-threshold",
        "2.0",
        "--output",
        str(out),
    )
    assert code == 0, stderr
    doc = json.loads(out.read_text(encoding="utf-8"))
    groups = doc["meta"]["fleet_spec"]["groups"]
    assert [g["name"] for g in groups] == ["prefill", "d-slow"]
    assert (
        groups[1]["engine"]["kv_capacity_tokens"] == 32768
        and groups[1]["engine"]["max_num_batched_tokens"] == 1024
    )
    assert doc["meta"]["scheduler"]["slo"]["tpot_slo_dispatch_threshold"] == 2.0
    assert "1 x decode (slow)" in stdout


def test_a_policy_file_is_a_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "shortest-queue.yaml"
    stage = (
        "{filters: [schedulability, staleness, failover], selector: {name: lowest, metrics: [num_requests]}}"
    )
    path.write_text(f"prefill: {stage}\ndecode: {stage}\nneutral: {stage}\n", encoding="utf-8")
    code, stdout, stderr = run_cli(capsys, *SMALL, "--policies", f"{path},least-requests")
    assert code == 0, stderr
    table = stdout.split("attain: share")[0]  # the policy table (the prediction-error table follows it)
    rows = [line.split() for line in table.splitlines() if str(path) in line or "least-requests" in line]
    assert len(rows) == 4
    # The file composes what least-requests does: the same results.
    assert rows[0][2:] == rows[1][2:] and rows[2][2:] == rows[3][2:]


def test_print_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    code, stdout, _ = run_cli(
        capsys, "--fleet", "prefill=3,decode=1:llama3-70b-4xh100-roofline", "--print-fleet"
    )
    assert code == 0
    doc = json.loads(stdout)
    assert [(g["role"], g["count"], g["profile"]) for g in doc["groups"]] == [
        ("prefill", 3, DEFAULT_PROFILE),
        ("decode", 1, "llama3-70b-4xh100-roofline"),
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--policies", "fastest"), "unknown policy"),
        (("--policies", "slo,slo"), "listed twice"),
        (("--policies", "missing-policy.yaml"), "cannot read policy file"),
        (("--rates", "2,zero"), "not a number"),
        (("--rates", "-1"), "> 0"),
        (("--neutral", "2", "--prefill", "1"), "not both"),
        (("--prefill", "2"), "go together"),
        (("--fleet", "gpu=2"), "role must be prefill, decode or neutral"),
        (("--fleet", "prefill=2"), "add at least one decode group"),
        (("--profile", "no-such-profile"), "bundled"),
        (("--max-num-seqs", "4096"), "--max-num-seqs (4096) must not exceed --max-num-batched-tokens"),
        (("--workload", "nonsense"), "not a preset"),
        (("--num-requests", "0"), "--num-requests"),
    ],
)
def test_bad_flags_exit_2_saying_what_to_fix(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, stderr = run_cli(capsys, *args)
    assert code == 2
    assert message in stderr
