"""The calibration's one-instance path (``Correction.ttft_ms_at``/``tpot_ms_at``) equals its columns.

A route's predicted TTFT and TPOT are computed for one instance on Python floats; the
seeded-decision digests compare those floats, so they must be the column's entry bit for bit
(sign of zero and NaN included), for every correction a calibrator can build and beyond.
"""

from __future__ import annotations

import random
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.calibration import Correction, StepSample
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same_float(a: float, b: float) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    if a != a or b != b:
        return a != a and b != b
    return struct.pack("<d", a) == struct.pack("<d", b)


_finite = st.floats(-1e6, 1e7, allow_nan=False, allow_infinity=False)
_value = st.one_of(
    _finite,
    st.sampled_from([0.0, -0.0, 1.0, 512.0, 1024.0, 2048.0, float("nan"), float("inf"), -float("inf")]),
)
_positive = st.one_of(st.floats(1e-3, 1e4), st.sampled_from([0.0, 1.0, 3.0, float("nan")]))
_coef = st.one_of(st.floats(-50.0, 50.0), st.sampled_from([0.0, 1e-3, -1e-3, 1e6]))
_instance = st.tuples(
    st.floats(0.05, 20.0),  # TTFT factor
    st.floats(0.05, 20.0),  # TPOT factor
    st.one_of(st.just(0.0), st.floats(0.0, 30.0)),  # interleave ms
    st.lists(_coef, min_size=6, max_size=6),
    st.booleans(),  # has a fit
)


@st.composite
def _corrections(draw: st.DrawFn) -> Correction:
    rows = draw(st.lists(_instance, min_size=1, max_size=6))
    low = draw(st.floats(0.05, 1.0))
    return Correction(
        ttft_factor=np.array([r[0] for r in rows]),
        tpot_factor=np.array([r[1] for r in rows]),
        interleave_ms=np.array([r[2] for r in rows]),
        coefs=None if draw(st.booleans()) and draw(st.booleans()) else np.array([r[3] for r in rows]),
        has_fit=np.array([r[4] for r in rows]),
        min_factor=low,
        max_factor=draw(st.floats(1.0, 100.0)),
    )


def _column(correction: Correction, data: st.DataObject, values: st.SearchStrategy[float]) -> np.ndarray:
    return np.array(
        data.draw(
            st.lists(values, min_size=len(correction.ttft_factor), max_size=len(correction.ttft_factor))
        )
    )


@PROPS
@given(st.data())
def test_one_instance_ttft_equals_the_column(data: st.DataObject) -> None:
    correction = data.draw(_corrections())
    n = len(correction.ttft_factor)
    profile = _column(correction, data, _positive)
    backlog = _column(correction, data, st.one_of(_value, st.integers(0, 9000).map(float)))
    batch = _column(correction, data, st.one_of(_value, st.integers(0, 64).map(float)))
    tokens = _column(correction, data, _value)
    budget = _column(correction, data, st.sampled_from([512.0, 2048.0, 8192.0, 1.0, 0.0, 100.5]))
    decode = _column(correction, data, _positive)
    with np.errstate(all="ignore"):
        column = correction.ttft_ms(profile, backlog, batch, tokens, budget, decode)
    for i in range(n):
        args = (profile, backlog, batch, tokens, budget, decode)
        with np.errstate(all="ignore"):
            one = correction.ttft_ms_at(i, *(float(a[i]) for a in args))
        assert isinstance(one, float)
        assert same_float(one, float(column[i])), (i, one, column[i])


@PROPS
@given(st.data())
def test_one_instance_tpot_equals_the_column(data: st.DataObject) -> None:
    correction = data.draw(_corrections())
    n = len(correction.ttft_factor)
    profile = _column(correction, data, _positive)
    batch = _column(correction, data, st.one_of(_value, st.integers(0, 64).map(float)))
    tokens = _column(correction, data, _value)
    with np.errstate(all="ignore"):
        column = correction.tpot_ms(profile, batch, tokens)
    for i in range(n):
        with np.errstate(all="ignore"):
            one = correction.tpot_ms_at(i, float(profile[i]), float(batch[i]), float(tokens[i]))
        assert isinstance(one, float)
        assert same_float(one, float(column[i])), (i, one, column[i])


def test_a_worked_refit_example() -> None:
    """One backlog of 2.5 chunks, by hand: scale the prefill and decode parts, add the fitted remainder."""
    correction = Correction(
        ttft_factor=np.array([2.0]),
        tpot_factor=np.array([3.0]),
        interleave_ms=np.array([0.5]),
        coefs=np.array([[0.01, 1.0, 0.0, 0.5, 0.0, 0.0]]),
        has_fit=np.array([True]),
        min_factor=0.1,
        max_factor=10.0,
    )
    # 2.5 chunks of 100: two full, a tail of 50; three steps carry the 4 ms decode batch.
    decode_part = 3 * 4.0
    baseline = (60.0 - decode_part) * 2.0 + decode_part * 3.0
    remainder = 2 * (0.01 * 100 + 1.0 + 0.5 * 2) + (0.01 * 50 + 1.0 + 0.5 * 2)
    assert correction.ttft_ms_at(0, 60.0, 250.0, 2.0, 400.0, 100.0, 4.0) == baseline + remainder
    assert (
        correction.ttft_ms_at(0, 60.0, 250.0, 2.0, 400.0, 100.0, 4.0)
        == correction.ttft_ms(*(np.array([v]) for v in (60.0, 250.0, 2.0, 400.0, 100.0, 4.0)))[0]
    )
    # The clip: a remainder far above the profile is held at max_factor times it.
    assert correction.ttft_ms_at(0, 1.0, 250.0, 2.0, 400.0, 100.0, 4.0) == 10.0
    # No fit at the instance: the scaled profile, whatever the coefficients say.
    plain = Correction(**{**correction.__dict__, "has_fit": np.array([False])})
    assert plain.ttft_ms_at(0, 60.0, 250.0, 2.0, 400.0, 100.0, 4.0) == 120.0
    assert plain.tpot_ms_at(0, 5.0, 2.0, 400.0) == 15.5


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(0, 40),  # decode requests
            st.integers(1, 2000),  # tokens per decode request
            st.sampled_from([0, 0, 300, 5000]),  # status prefill backlog
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 6000),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["scale", "refit"]),
)
def test_a_routes_predictions_equal_the_columns_under_calibration(rows, prompt, seed, mode) -> None:  # type: ignore[no-untyped-def]
    """Through the metrics: ``metric_at`` of a calibrated scheduler equals the column's entry."""
    snap = make_snapshot(
        *(
            inst(
                f"i{k:02d}",
                decode_requests=batch,
                decode_tokens=batch * per,
                prefill_tokens=backlog,
                meta={"max_num_batched_tokens": 512},
            )
            for k, (batch, per, backlog) in enumerate(rows)
        )
    )
    s = make_scheduler("slo", calibration=mode)
    assert s.predictors is not None and s.predictors.calibration is not None
    rng = random.Random(seed)
    slow = rng.uniform(0.5, 3.0)
    # Steps slower than the profile, and not in its shape: the calibration scales and (refit) fits.
    for k in range(len(rows)):
        samples = []
        for _ in range(rng.randint(0, 120)):
            b = rng.randint(0, 32)
            p = rng.choice([0, rng.randint(1, 1500)]) or (0 if b else 64)
            t = b * rng.randint(16, 2000)
            samples.append(StepSample(p, b, t, slow * (0.02 * p + 0.5 * b + 1e-4 * t + 3.0)))
        s.predictors.calibration.observe(f"i{k:02d}", "", samples, NOW)
    request = make_request(prompt_tokens=prompt, expected_output_tokens=rng.randint(0, 500))
    columns = s.context(s.view(snap, NOW), request)
    for name in ("predicted_ttft", "predicted_tpot"):
        column = columns.metric(name)
        for i in range(len(rows)):
            one = s.context(s.view(snap, NOW), request)  # a fresh context: no column cached yet
            assert same_float(one.metric_at(name, i), float(column[i])), (name, i)
