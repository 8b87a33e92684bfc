"""Requests no instance could ever serve in time are refused when they arrive, with the reason.

A target below what the fastest instance of the fleet would do with the
request *alone* (an idle instance: its prompt's prefill, a decode step of a
batch of one at its context) cannot be met by waiting: no amount of queueing
frees a faster instance. The router queue used to hold such a request until
its wait limit (``--max-queue-wait-ms``, 60 s: a ``tpot_ms = 1`` request sat a
minute before ``RESOURCE_EXHAUSTED``); :class:`ArrivalCheck` refuses it at
once instead, naming the target and the best prediction.

The predictions are the queue's own best case (:class:`router.core.queue.FleetDrain`:
the profile of each instance's group, calibrated when the scheduler calibrates),
so a request refused here is one the queue would also have judged hopeless,
only later. The drain is built once per cluster view (the idle predictions do
not depend on load), so an arrival costs a few predictor lookups.

Every waiting dispatcher applies it to its arrivals (:mod:`router.core.dispatchers`), under
both drivers: the simulator refuses what the router refuses.
"""

from __future__ import annotations

from collections.abc import Callable

from fleet.snapshot import ClusterSnapshot
from router.core.columns import ClusterView
from router.core.errors import SchedulingError, UnmeetableError
from router.core.queue import FleetDrain
from router.core.request import ScheduleInput, resolve_targets
from router.core.scheduler import Scheduler


class ArrivalCheck:
    """Refuses (:class:`UnmeetableError`) a request whose targets are below the idle-instance best case."""

    def __init__(self, scheduler: Scheduler, source: Callable[[], ClusterView | ClusterSnapshot]) -> None:
        self._scheduler = scheduler
        self._source = source
        self._cached: tuple[ClusterView | ClusterSnapshot, FleetDrain | None] | None = None

    def _drain(self, now_s: float) -> FleetDrain | None:
        source = self._source()
        cached = self._cached
        if cached is not None and cached[0] is source:
            return cached[1]
        try:
            view = self._scheduler.view(source, now_s) if isinstance(source, ClusterSnapshot) else source
            drain = FleetDrain.of(self._scheduler, view, now_s)
        except SchedulingError:  # no fleet to judge by: placement reports that itself
            drain = None
        self._cached = (source, drain)
        return drain

    def warm(self, now_s: float) -> None:
        """Build now what an arrival on the newest view reads first: this check's drain (kept for that
        view), and the drain's load-free parts for the calibration of the moment (a timed prefill may
        have moved it since the view came; the router queue's pass reads them for its own drain)."""
        source = self._source()
        cached = self._cached
        if cached is None or cached[0] is not source:
            self._drain(now_s)  # a new view: its drain builds the load-free parts too
            return
        try:
            view = self._scheduler.view(source, now_s) if isinstance(source, ClusterSnapshot) else source
            FleetDrain.of(self._scheduler, view, now_s)
        except SchedulingError:
            pass

    def check(self, request: ScheduleInput, now_s: float) -> None:
        """Raise :class:`UnmeetableError` when no idle instance could meet ``request``'s targets."""
        drain = self._drain(now_s)
        if drain is None:
            return
        config = self._scheduler.config
        targets = resolve_targets(request, config.ttft_slo_ms, config.tpot_slo_ms)
        prompt = request.prompt_tokens
        only_e2e = request.e2e_slo_ms > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0
        # A prompt mostly cached somewhere costs only its uncached part there (the best case).
        compute = drain.compute_tokens(request)
        idle_ttft = drain.idle_ms(compute)
        if not only_e2e and idle_ttft > targets.ttft_ms:
            cached = f", {prompt - compute} of them cached" if compute < prompt else ""
            raise UnmeetableError(
                f"TTFT target {targets.ttft_ms:g} ms is below the best prediction for this request on an "
                f"idle instance ({idle_ttft:.1f} ms for its {prompt}-token prompt{cached}): no instance can "
                "meet it; raise the target or shorten the prompt"
            )
        min_tpot = drain.min_tpot_ms(prompt)
        if not only_e2e and min_tpot > targets.tpot_ms:
            raise UnmeetableError(
                f"TPOT target {targets.tpot_ms:g} ms is below the best prediction on an idle instance "
                f"({min_tpot:.2f} ms per token, decoding this request alone): no instance can meet it; "
                "raise the target"
            )
        if targets.e2e_ms > 0:
            # Before anything is learned of the class, the expected length is the request's cap (a
            # long max_tokens on a short answer is common) or every class's mean: only the prefill is
            # certain then.
            rest = 0 if request.output_tokens_guessed else max(request.output_tokens_estimate - 1, 0)
            best = idle_ttft + rest * min_tpot
            if best > targets.e2e_ms:
                raise UnmeetableError(
                    f"e2e target {targets.e2e_ms:g} ms is below the best prediction on an idle instance "
                    f"({best:.0f} ms: prefill and {rest} more tokens decoded alone): no instance can meet it"
                )
