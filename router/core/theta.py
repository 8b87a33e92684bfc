"""Aladdin's θ learned online (seed 001's re-balancing for output-length error): :class:`ThetaFit`.

Apart from :mod:`router.core.packing`, which reads it, so the predictor set can carry one without
importing the packing metrics (no import cycle through the registry).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np


class ThetaFit:
    """Aladdin's θ learned online: the share of a request's TPOT need the packing horizon may use.

    The paper leaves θ (constraints (b) and (d)) as a knob that "adapts to the
    prediction error of output length": small, the constraints leave room for
    answers longer than predicted and need more workers; large, they pack
    tighter and risk the SLO. A fixed θ cannot be right for every workload:
    on chat the γ-horizon (every resident taken γ through its remaining
    output, the batch as it is now) is pessimistic -- residents finish and
    are replaced by shorter contexts -- and at θ = 0.7 the decoders ran at
    34 ms against a 50 ms target while ``least-requests`` ran them up to the
    target with fewer instances.

    So θ is fitted from what the error does to the requests: every finished
    request with a TPOT target of its own reports its realized TPOT over that
    target, with its SLO class (``observe``); every :data:`THETA_EVERY`
    reports θ moves by the ratio that would bring the highest of the classes'
    :data:`THETA_QUANTILE` quantiles (each over that class's last
    :data:`THETA_WINDOW` ratios, read at the θ in force: below) to 1 (a step bounded to ×0.9 down and ×1.05
    up: down fast when requests miss, up slowly when there is room), kept
    between the configured θ (``--binpack-theta``, the cautious bound) and
    :data:`THETA_MAX`. Larger length errors spread the ratios and pull θ
    back; a pessimistic horizon lets θ above 1 (the horizon's bias is an
    error of the same kind). Not below the configured θ: on a colocated
    fleet in overload the residents' TPOT also carries the prefill stalls
    of the prompts placed beside them, which θ does not control; allowed to
    fall, θ went from 0.9 to 0.3 in 150 requests, the queue grew and
    attainment halved (chat on 4 neutral instances at 12 req/s: 48.8 %
    against 92.9 % with θ fixed). Requests judged only end to end do not
    report: their misses also come from queue waits, which a tighter θ
    would make worse, not better.

    The live router and the simulator each keep one per run (on the
    predictor set, beside the step calibration); ``tpot_horizon_over_need``
    reads :attr:`theta`.

    Two readings keep the fit from cycling. Per class, not pooled: one θ bounds
    every decoder, and the class it binds is the one with the tightest target,
    whose tail a pooled quantile dilutes with a looser class's room. And each
    ratio is kept per unit of the θ in force when it is reported, the quantile
    scaled back by the θ in force now: the window spans many moves of θ, and
    read raw, the room of reports made under a lower θ let θ climb past the
    point the tight class misses, then the misses, kept 256 reports, pulled θ
    to the floor. Measured (review/complete/chat, 2 prefill + 4 decode, 9 req/s,
    seed 4242): pooled and raw, θ 0.7 → 1.08 → 0.7 → 1.20 over 820 reports and
    76.6 % of the 40 ms ``complete`` answers met; read both ways, 82.4 %.
    """

    __slots__ = ("_classes", "_since", "floor", "theta", "updates")

    def __init__(self, theta: float) -> None:
        if not (math.isfinite(theta) and theta > 0):
            raise ValueError(f"theta must be a finite number > 0, got {theta}")
        self.theta = min(max(theta, THETA_MIN), THETA_MAX)
        #: The configured θ is the cautious bound: the fit loosens from it where the errors leave
        #: room and never tightens below it (misses θ does not cause -- a colocated instance's prefill
        #: stalls -- would otherwise drive it down without end while the queue grows).
        self.floor = self.theta
        #: Per SLO class, its last ratios: each class's tail is read on its own.
        self._classes: dict[str, deque[float]] = {}
        self._since = 0
        self.updates = 0

    def observe(self, realized_tpot_ms: float, target_tpot_ms: float, slo_class: str = "") -> None:
        """A finished request's realized mean TPOT against its TPOT target (both ms; others ignored),
        and its SLO class."""
        if not (target_tpot_ms > 0 and math.isfinite(target_tpot_ms)):
            return
        if not (realized_tpot_ms >= 0 and math.isfinite(realized_tpot_ms)):
            return
        ratios = self._classes.get(slo_class)
        if ratios is None:
            # The class label is the client's: past THETA_MAX_CLASSES labels, new ones share one window,
            # so the fit's memory stays bounded whatever labels arrive.
            if len(self._classes) >= THETA_MAX_CLASSES:
                slo_class = _OVERFLOW_CLASS
            ratios = self._classes.get(slo_class)
            if ratios is None:
                ratios = self._classes[slo_class] = deque(maxlen=THETA_WINDOW)
        # Read at the θ in force: the window then holds reports made under other θ as what they say
        # of the error (TPOT over target per unit of θ), not as room or misses of a θ no longer in force.
        ratios.append(realized_tpot_ms / target_tpot_ms / self.theta)
        self._since += 1
        if self._since < THETA_EVERY:
            return
        highs = [
            float(np.quantile(np.fromiter(r, float, len(r)), THETA_QUANTILE))
            for r in self._classes.values()
            if len(r) >= THETA_EVERY
        ]
        if not highs:
            return
        self._since = 0
        high = max(highs) * self.theta
        step = 1.0 / high if high > 0 else THETA_STEP_UP
        step = min(max(step, THETA_STEP_DOWN), THETA_STEP_UP)
        self.theta = min(max(self.theta * step, self.floor), THETA_MAX)
        self.updates += 1


#: ThetaFit: the share of requests whose TPOT should stay within target, the reports kept, how often
#: θ moves, its bounds, and the largest step down / up per move.
THETA_QUANTILE = 0.98
THETA_WINDOW = 256
THETA_EVERY = 16
THETA_MIN = 0.3
THETA_MAX = 1.25
THETA_STEP_DOWN = 0.9
THETA_STEP_UP = 1.05
#: ThetaFit: the most SLO classes read on their own; later labels share :data:`_OVERFLOW_CLASS`.
THETA_MAX_CLASSES = 64
_OVERFLOW_CLASS = "\x00overflow"
