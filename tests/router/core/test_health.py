"""Passive outlier detection: ejection on failures, probation, growing and decaying penalties."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.health import OutlierConfig, OutlierDetector


def test_every_config_field_has_a_doc() -> None:
    for f in fields(OutlierConfig):
        assert f.metadata.get("doc"), f"OutlierConfig.{f.name} has no doc"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"consecutive_failures": 0}, "consecutive_failures"),
        ({"base_ejection_s": 0}, "base_ejection_s"),
        ({"max_ejection_s": math.inf}, "max_ejection_s"),
        ({"base_ejection_s": 5.0, "max_ejection_s": 1.0}, "max_ejection_s"),
        ({"max_tracked": 0}, "max_tracked"),
    ],
)
def test_config_checks_name_the_field(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        OutlierConfig(**kwargs)  # type: ignore[arg-type]


def test_a_failure_ejects_until_the_ejection_time_is_over() -> None:
    d = OutlierDetector(OutlierConfig(base_ejection_s=2.0))
    assert d.ejected(0.0) == frozenset()
    assert d.failure("a", 10.0, "UNAVAILABLE")
    assert d.ejected(10.0) == {"a"} and d.is_ejected("a", 11.9)
    assert d.ejected(12.0) == frozenset()  # back, on probation
    assert d.in_probation("a")
    assert d.reason("a") == "UNAVAILABLE"


def test_consecutive_failures_threshold() -> None:
    d = OutlierDetector(OutlierConfig(consecutive_failures=3))
    assert not d.failure("a", 0.0, "x")
    assert not d.failure("a", 0.1, "x")
    d.success("a", 0.2)  # the run is broken
    assert not d.failure("a", 0.3, "x")
    assert not d.failure("a", 0.4, "x")
    assert d.failure("a", 0.5, "x")
    assert d.ejected(0.5) == {"a"}


def test_probation_failure_doubles_up_to_the_cap_and_successes_take_doublings_back() -> None:
    d = OutlierDetector(OutlierConfig(consecutive_failures=3, base_ejection_s=1.0, max_ejection_s=3.0))
    for t in (0.0, 0.1, 0.2):
        d.failure("a", t, "x")
    assert d.is_ejected("a", 1.1) and not d.is_ejected("a", 1.2)
    # On probation one failure is enough, and the time doubles ...
    assert d.failure("a", 2.0, "x")
    assert d.is_ejected("a", 3.9) and not d.is_ejected("a", 4.0)
    # ... up to the cap.
    assert d.failure("a", 5.0, "x")
    assert d.is_ejected("a", 7.9) and not d.is_ejected("a", 8.0)
    # Each success on probation ends it and takes one doubling back.
    d.success("a", 9.0)
    assert not d.in_probation("a")
    for t in (10.0, 10.1, 10.2):
        d.failure("a", t, "x")
    assert d.is_ejected("a", 13.1) and not d.is_ejected("a", 13.2)  # 4 s capped at 3 s again: flapping
    d.success("a", 14.0)
    # An instance that stayed healthy for the longest ejection time starts from the base time again.
    for t in (17.0, 17.1, 17.2):
        d.failure("a", t, "x")
    assert d.is_ejected("a", 18.1) and not d.is_ejected("a", 18.3)


def test_failures_of_calls_placed_before_the_ejection_do_not_extend_it() -> None:
    d = OutlierDetector(OutlierConfig(base_ejection_s=2.0))
    assert d.failure("a", 0.0, "x")
    assert not d.failure("a", 1.0, "x")  # a call that was already running on it
    assert not d.is_ejected("a", 2.0)


def test_success_clears_a_recovered_instance_and_forget_drops_it() -> None:
    d = OutlierDetector()
    d.success("never-failed", 0.0)
    assert len(d) == 0
    d.failure("a", 0.0, "x")
    d.success("a", 10.0)  # probation passed, penalty back to zero: nothing to remember
    assert len(d) == 0
    d.failure("b", 20.0, "x")
    d.forget("b")
    assert d.ejected(20.0) == frozenset() and len(d) == 0


def test_memory_is_bounded() -> None:
    d = OutlierDetector(OutlierConfig(max_tracked=4))
    for i in range(100):
        d.failure(f"i{i}", float(i), "x")
    assert len(d) == 4
    assert d.ejected(99.0) <= {"i96", "i97", "i98", "i99"}


_EVENT = st.tuples(st.sampled_from(["a", "b", "c"]), st.booleans(), st.floats(0.0, 5.0))


@settings(max_examples=200, deadline=None)
@given(st.lists(_EVENT, max_size=60), st.integers(1, 3))
def test_ejected_set_matches_the_ejection_times(
    events: list[tuple[str, bool, float]], threshold: int
) -> None:
    """Whatever happens, an instance is ejected exactly while its last ejection runs, never longer than the cap."""
    config = OutlierConfig(consecutive_failures=threshold, base_ejection_s=0.5, max_ejection_s=4.0)
    d = OutlierDetector(config)
    now = 0.0
    until: dict[str, float] = {}
    for instance_id, failed, gap in events:
        now += gap
        if failed:
            if d.failure(instance_id, now, "x"):
                assert instance_id not in until or until[instance_id] <= now
                until[instance_id] = now
        else:
            d.success(instance_id, now)
        ejected = d.ejected(now)
        for i in ("a", "b", "c"):
            if i in ejected:
                assert i in until and now - until[i] < config.max_ejection_s
        assert d.ejections_total >= len(ejected)
    # Past the longest ejection nobody is ejected.
    assert d.ejected(now + config.max_ejection_s) == frozenset()
