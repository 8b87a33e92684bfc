"""Policies end to end through Scheduler.schedule: mode, slo, load-balance, baselines, errors."""

from __future__ import annotations

import pytest

from router.core.errors import EmptyClusterError, NoInstanceError
from router.core.request import Mode, Stage, StageRestriction, Targets
from router.core.rng import PeekableRandom
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

PD_FLEET = make_snapshot(
    inst("p1", "prefill", prefill_tokens=2000),
    inst("p2", "prefill"),
    inst("d1", "decode", decode_requests=8, decode_tokens=4000),
    inst("d2", "decode", decode_requests=2, decode_tokens=400),
    inst("n1", "neutral"),
)


# ----------------------------------------------------------------------------- mode


def test_pd_mode_when_prefill_and_decode_roles_exist() -> None:
    d = make_scheduler("slo").schedule(PD_FLEET, make_request(), NOW)
    assert d.mode is Mode.PD and d.policy == "slo"
    assert d.prefill is not None and d.prefill.instance_id == "p2" and d.prefill.stage is Stage.PREFILL
    assert d.decode is not None and d.decode.instance_id == "d2" and d.decode.stage is Stage.DECODE
    assert d.prefill.endpoint == "p2.local:50051"
    # Neutral instances are not candidates in PD mode.
    assert {e.instance_id for e in d.trace} == {"p1", "p2", "d1", "d2"}


def test_neutral_mode_otherwise_with_one_instance_for_both() -> None:
    snap = make_snapshot(inst("n1", prefill_tokens=3000), inst("n2"), inst("p", "prefill"))
    d = make_scheduler("slo").schedule(snap, make_request(), NOW)
    assert d.mode is Mode.NEUTRAL
    assert d.prefill is d.decode and d.decode is not None and d.decode.instance_id == "n2"
    assert d.decode.stage is Stage.NEUTRAL
    assert d.instance_ids == ("n2",)


def test_unspecified_role_counts_as_neutral() -> None:
    d = make_scheduler("slo").schedule(make_snapshot(inst("u", "unspecified")), make_request(), NOW)
    assert d.mode is Mode.NEUTRAL and d.instance_ids == ("u",)


def test_prefill_only_fleet_cannot_serve() -> None:
    with pytest.raises(EmptyClusterError, match="no neutral instance and no prefill\\+decode pair"):
        make_scheduler("slo").schedule(make_snapshot(inst("p", "prefill")), make_request(), NOW)


def test_empty_view_and_unusable_view_are_empty_cluster_errors() -> None:
    s = make_scheduler("slo")
    with pytest.raises(EmptyClusterError, match="no instance in the cluster view"):
        s.schedule(make_snapshot(), make_request(), NOW)
    dead = make_snapshot(inst("a", age_s=99.0), inst("b", schedulable=False), inst("c", status=False))
    with pytest.raises(
        EmptyClusterError, match="1 without a status yet, 1 unschedulable, 1 with a status older"
    ):
        s.schedule(dead, make_request(), NOW)


def test_model_restricts_the_candidates() -> None:
    snap = make_snapshot(
        inst("llama", meta={"model": "llama"}),
        inst("qwen", meta={"model": "qwen"}, prefill_tokens=5000),
        inst("any"),
    )
    s = make_scheduler("slo")
    d = s.schedule(snap, make_request(model="qwen", exclude_instance_ids=frozenset({"any"})), NOW)
    assert d.instance_ids == ("qwen",)
    with pytest.raises(EmptyClusterError, match="serves model 'mistral'"):
        s.schedule(make_snapshot(inst("llama", meta={"model": "llama"})), make_request(model="mistral"), NOW)


def test_pd_is_all_or_nothing() -> None:
    s = make_scheduler("slo", tpot_slo_ms=10)  # nobody meets a 10 ms TPOT
    with pytest.raises(NoInstanceError) as err:
        s.schedule(PD_FLEET, make_request(), NOW)
    assert err.value.stage == "decode"
    assert s.inflight.is_empty()


def test_stage_restriction_places_only_the_decode() -> None:
    d = make_scheduler("slo").schedule(PD_FLEET, make_request(stages=StageRestriction.DECODE), NOW)
    assert d.prefill is None and d.decode is not None and d.decode.instance_id == "d2"
    assert {e.stage for e in d.trace} == {Stage.DECODE}
    d = make_scheduler("slo").schedule(PD_FLEET, make_request(stages=StageRestriction.PREFILL), NOW)
    assert d.decode is None and d.prefill is not None


# ----------------------------------------------------------------------------- slo


def test_slo_prefill_picks_the_lowest_predicted_ttft_and_decode_the_lowest_tpot() -> None:
    d = make_scheduler("slo").schedule(PD_FLEET, make_request(prompt_tokens=512), NOW)
    trace = {(e.instance_id, e.stage): e for e in d.trace}
    assert trace[("p2", Stage.PREFILL)].predicted_ttft_ms < trace[("p1", Stage.PREFILL)].predicted_ttft_ms
    assert trace[("d2", Stage.DECODE)].predicted_tpot_ms < trace[("d1", Stage.DECODE)].predicted_tpot_ms
    assert (
        d.prefill is not None
        and d.prefill.predicted_ttft_ms == trace[("p2", Stage.PREFILL)].predicted_ttft_ms
    )
    assert [e.selected for e in d.trace].count(True) == 2


def test_slo_drops_instances_predicted_over_the_target() -> None:
    # p1's 2000-token backlog puts it over 200 ms; p2 (60 ms) passes.
    d = make_scheduler("slo", ttft_slo_ms=200).schedule(PD_FLEET, make_request(), NOW)
    dropped = {e.instance_id: e.dropped_by for e in d.trace}
    assert dropped["p1"] == "metric_threshold:predicted_ttft" and dropped["p2"] == ""


def test_per_request_slo_overrides_the_router_default() -> None:
    s = make_scheduler("slo", ttft_slo_ms=10_000, tpot_slo_ms=100)
    with pytest.raises(NoInstanceError, match=r"best predicted_ttft 60\.0 vs limit 30\.0"):
        s.schedule(PD_FLEET, make_request(ttft_slo_ms=30), NOW)
    with pytest.raises(NoInstanceError, match="decode"):
        s.schedule(PD_FLEET, make_request(tpot_slo_ms=5), NOW)
    assert s.schedule(PD_FLEET, make_request(ttft_slo_ms=0, tpot_slo_ms=0), NOW).mode is Mode.PD


def test_slo_neutral_applies_both_thresholds_and_orders_ttft_then_tpot() -> None:
    snap = make_snapshot(
        inst("slow-decode", decode_requests=15, decode_tokens=15000),
        inst("a"),
        inst("b"),
    )
    s = make_scheduler("slo", tpot_slo_ms=20)
    d = s.schedule(snap, make_request(), NOW)
    assert d.decode is not None and d.decode.instance_id in {"a", "b"}
    assert {e.instance_id: e.dropped_by for e in d.trace}["slow-decode"].startswith("metric_threshold")


def test_slo_error_message_explains_what_to_do() -> None:
    s = make_scheduler("slo", ttft_slo_ms=50)
    with pytest.raises(NoInstanceError) as err:
        s.schedule(PD_FLEET, make_request(), NOW)
    message = str(err.value)
    assert "no prefill instance" in message and "2 candidate(s)" in message
    assert "relax the request's SLO" in message


# ----------------------------------------------------------------------------- load-balance


def test_load_balance_default_metrics_per_stage() -> None:
    snap = make_snapshot(
        inst("p1", "prefill", prefill_tokens=100),
        inst("p2", "prefill", prefill_tokens=50),
        inst("d1", "decode", used_kv_tokens=50_000),
        inst("d2", "decode", used_kv_tokens=10_000),
    )
    d = make_scheduler("load-balance").schedule(snap, make_request(), NOW)
    assert d.instance_ids == ("p2", "d2")
    neutral = make_snapshot(inst("a", prefill_tokens=10), inst("b"))
    assert make_scheduler("load-balance").schedule(neutral, make_request(), NOW).instance_ids == ("b",)


def test_load_balance_metric_flags_and_droppable_thresholds() -> None:
    snap = make_snapshot(inst("a", waiting=5), inst("b", waiting=1, prefill_tokens=900))
    s = make_scheduler("load-balance", dispatch_neutral_load_metric="num_waiting_requests")
    assert s.schedule(snap, make_request(), NOW).instance_ids == ("b",)
    s = make_scheduler("load-balance", dispatch_neutral_load_threshold=500)
    d = s.schedule(snap, make_request(), NOW)
    assert d.instance_ids == ("a",) and d.decode is not None and d.decode.fallback_pass == 0
    s = make_scheduler("load-balance", dispatch_neutral_load_threshold=1)
    d = s.schedule(
        make_snapshot(inst("a", prefill_tokens=30), inst("b", prefill_tokens=20)), make_request(), NOW
    )
    assert d.instance_ids == ("b",) and d.decode is not None and d.decode.fallback_pass == 1


def test_load_balance_sees_inflight_dispatches() -> None:
    s = make_scheduler("load-balance")
    snap = make_snapshot(inst("a"), inst("b"))
    first = s.schedule(snap, make_request("r1", 500), NOW)
    s.record(first, NOW)
    second = s.schedule(snap, make_request("r2", 500), NOW)
    assert first.instance_ids != second.instance_ids


# ----------------------------------------------------------------------------- baselines


def test_round_robin_cycles_per_stage() -> None:
    s = make_scheduler("round-robin")
    picks = []
    for k in range(4):
        d = s.schedule(PD_FLEET, make_request(f"r{k}"), NOW)
        picks.append(d.instance_ids)
    assert picks == [("p1", "d1"), ("p2", "d2"), ("p1", "d1"), ("p2", "d2")]


def test_round_robin_dry_run_does_not_advance() -> None:
    s = make_scheduler("round-robin")
    snap = make_snapshot(inst("a"), inst("b"))
    assert s.schedule(snap, make_request(), NOW, dry_run=True).instance_ids == ("a",)
    assert s.schedule(snap, make_request(), NOW).instance_ids == ("a",)
    assert s.schedule(snap, make_request(), NOW).instance_ids == ("b",)


def test_least_requests_counts_waiting_running_and_inflight() -> None:
    s = make_scheduler("least-requests")
    snap = make_snapshot(inst("a", waiting=1, running=1), inst("b", running=1))
    assert s.schedule(snap, make_request("r1"), NOW).instance_ids == ("b",)
    s.inflight.record("x", "b", "b", 10, NOW)
    s.inflight.record("y", "b", "b", 10, NOW)
    assert s.schedule(snap, make_request("r2"), NOW).instance_ids == ("a",)


def test_random_and_power_of_two_are_reproducible_for_a_seed() -> None:
    for policy in ("random", "power-of-two"):
        runs = []
        for _ in range(2):
            s = make_scheduler(policy, seed=7)
            runs.append([s.schedule(PD_FLEET, make_request(f"r{k}"), NOW).instance_ids for k in range(10)])
        assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "policy", ["round-robin", "random", "least-requests", "power-of-two", "load-balance"]
)
def test_baselines_respect_schedulability_staleness_and_failover(policy: str) -> None:
    snap = make_snapshot(
        inst("down", schedulable=False, meta={"node_id": "n1"}),
        inst("stale", age_s=60.0),
        inst("same-node", meta={"node_id": "n1"}),
        inst("ok", running=50, waiting=50, prefill_tokens=10_000, used_kv_tokens=90_000),
    )
    s = make_scheduler(policy, failover_domain="node", predictors=None)
    for k in range(8):
        assert s.schedule(snap, make_request(f"r{k}"), NOW).instance_ids == ("ok",)


# ----------------------------------------------------------------------------- determinism and dry runs


@pytest.mark.parametrize("peekable", [False, True])
def test_dry_run_makes_the_same_decision_without_consuming_randomness(peekable: bool) -> None:
    snap = make_snapshot(inst("a"), inst("b"), inst("c"))  # all tied: the RNG decides
    s = make_scheduler("slo", seed=3)
    if peekable:
        s.rng = PeekableRandom(3)
    dry = [s.schedule(snap, make_request(f"r{k}"), NOW, dry_run=True).instance_ids for k in range(3)]
    assert len(set(dry)) == 1
    real = s.schedule(snap, make_request("r9"), NOW).instance_ids
    assert real == dry[0]


def test_decisions_are_deterministic_for_a_fixed_seed() -> None:
    def run() -> list[tuple[str, ...]]:
        s = make_scheduler("slo", seed=11)
        out = []
        for k in range(12):
            d = s.schedule(PD_FLEET, make_request(f"r{k}", 100 + 50 * k), NOW + k * 0.01)
            s.record(d, NOW + k * 0.01)
            out.append(d.instance_ids)
        return out

    assert run() == run()


def test_reconcile_through_the_scheduler_removes_admitted_requests() -> None:
    s = make_scheduler("slo")
    snap = make_snapshot(inst("p", "prefill"), inst("d", "decode"))
    d = s.schedule(snap, make_request("r1"), NOW)
    s.record(d, NOW)
    assert len(s.inflight.entries("r1")) == 2
    later = make_snapshot(inst("p", "prefill", admitted=["r1"]), inst("d", "decode"), version=2)
    s.schedule(later, make_request("r2"), NOW + 0.1)
    assert [e.instance_id for e in s.inflight.entries("r1")] == ["d"]
    s.view(later, NOW + 20)  # the decode leg was never admitted: it expires
    assert s.inflight.is_empty()


def test_schedule_input_rejects_bad_values() -> None:
    from router.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prompt_tokens"):
        make_request(prompt_tokens=-1)
    with pytest.raises(InvalidRequestError, match="ttft_slo_ms"):
        make_request(ttft_slo_ms=float("nan"))
    with pytest.raises(InvalidRequestError, match="tpot_slo_ms"):
        make_request(tpot_slo_ms=-3)


def test_mode_compares_equal_to_its_wire_string() -> None:
    d = make_scheduler("slo").schedule(PD_FLEET, make_request(), NOW)
    assert d.mode == "pd" and Mode.NEUTRAL == "neutral"


# ----------------------------------------------------------------------------- binpack's prefill stage


def test_binpack_prefill_empty_bin_off_holds_ttft_on_an_idle_prefill_instance() -> None:
    """An idle prefill instance is binpack's empty bin: it takes a prompt whose TTFT it cannot meet.
    With --no-binpack-prefill-empty-bin (c) holds there as under slo, so the request is refused
    (it waits in the router queue, whose bound keeps it off the idle instance tighter work needs)."""
    fleet = make_snapshot(
        inst("p1", "prefill", prefill_tokens=8000),
        inst("p2", "prefill"),
        inst("d1", "decode"),
    )
    request = make_request(prompt_tokens=3000, ttft_slo_ms=5.0)  # (arrival unknown: no wait to judge)
    d = make_scheduler("binpack").schedule(fleet, request, NOW)
    assert d.prefill is not None and d.prefill.instance_id == "p2"
    for policy, overrides in (("binpack", {"binpack_prefill_empty_bin": False}), ("slo", {})):
        with pytest.raises(NoInstanceError) as err:
            make_scheduler(policy, **overrides).schedule(fleet, request, NOW)
        assert err.value.stage == "prefill"


@pytest.mark.parametrize(
    ("waited_s", "ttft_ms", "e2e_ms", "opens"),
    [
        (0.1, 0.0, 30_000.0, False),  # an e2e-only review: its TTFT target is the default 6 s
        (2.9, 0.0, 30_000.0, False),
        (3.0, 0.0, 30_000.0, True),  # half of it spent waiting: the empty bin opens
        (0.01, 40.0, 0.0, False),  # its own 40 ms target
        (0.025, 40.0, 0.0, True),
    ],
)
def test_binpack_prefill_empty_bin_opens_after_half_the_ttft_target_waited(
    waited_s: float, ttft_ms: float, e2e_ms: float, opens: bool
) -> None:
    """An idle PD prefill instance takes a request its TTFT bound refuses as an empty bin only once
    the request has waited --binpack-prefill-empty-bin-wait (half) of its own TTFT target (an
    e2e-only request's derived from its deadline): before that (c) holds as under slo. With the
    share at 0 it opens at once, as it did before."""
    fleet = make_snapshot(
        inst("p1", "prefill", prefill_tokens=8000),
        inst("p2", "prefill"),
        inst("d1", "decode"),
    )
    # The bound the queue offers (targets=) is below what the idle instance can do for this prompt.
    request = make_request(
        prompt_tokens=3000, ttft_slo_ms=ttft_ms, e2e_slo_ms=e2e_ms, arrival_s=NOW - waited_s
    )
    targets = Targets(5.0, 50.0, e2e_ms, ttft_ms or 6000.0)
    if opens:
        d = make_scheduler("binpack").schedule(fleet, request, NOW, targets=targets)
        assert d.prefill is not None and d.prefill.instance_id == "p2"
    else:
        with pytest.raises(NoInstanceError) as err:
            make_scheduler("binpack").schedule(fleet, request, NOW, targets=targets)
        assert err.value.stage == "prefill"
    d = make_scheduler("binpack", binpack_prefill_empty_bin_wait=0.0).schedule(
        fleet, request, NOW, targets=targets
    )
    assert d.prefill is not None and d.prefill.instance_id == "p2"


def test_binpack_prefill_empty_bin_wait_must_be_a_share() -> None:
    from router.core.config import SchedulerConfig
    from router.core.errors import ConfigError

    with pytest.raises(ConfigError, match="binpack_prefill_empty_bin_wait"):
        SchedulerConfig(scheduling_policy="binpack", binpack_prefill_empty_bin_wait=1.5)
