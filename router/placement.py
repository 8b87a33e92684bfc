"""Between the Router service and the scheduling core: placement over the live view.

:class:`Placer` reads the CMS reader's newest snapshot, asks the
:class:`~router.core.scheduler.Scheduler` for a decision, records real dispatches in
the in-flight account at once (so the next decision sees them), and turns dry
runs into ``ScheduleResponse`` messages. It is synchronous: it never waits on
I/O, so a decision never waits for the CMS.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from slorouter.v1 import cms_pb2, router_pb2

from fleet.prefix import lookup_block_hashes
from fleet.snapshot import ClusterSnapshot
from router.core.calibration import Calibrator, StepSample
from router.core.capacity import InstanceRates, LoadShape, LoadTracker, fleet_instance_rates
from router.core.columns import ClusterView, FloatArray
from router.core.decision import Choice, Decision
from router.core.errors import EmptyClusterError, InvalidRequestError, NoInstanceError, SchedulingError
from router.core.health import OutlierDetector
from router.core.lengths import LengthPredictor
from router.core.lifecycle import Phase, RequestState
from router.core.packing import binpacks, expected_output_tokens, overpacked_mask
from router.core.plugins import Policy
from router.core.protocols import VLLM_GRPC_SCHEME
from router.core.queue import RouterQueue
from router.core.request import ScheduleInput, StageRestriction, Targets, resolve_targets
from router.core.scheduler import Scheduler
from router.core.theta import ThetaFit
from router.core.worker_count import DesiredInstances
from router.route import Route, route_of
from router.telemetry import RequestObserver

logger = logging.getLogger(__name__)

#: The longest a resident leg's expected length goes without being re-estimated while its instance
#: pushes no status (the simulator's agent heartbeat, ``sim.cluster.AGENT_HEARTBEAT_S``).
RESIDENT_REFRESH_S = 1.0


class SnapshotSource(Protocol):
    """Anything with a ``snapshot()`` (a :class:`cms.reader.ClusterReader`)."""

    def snapshot(self) -> ClusterSnapshot: ...


@dataclass(frozen=True)
class PlacementRequest:
    """A validated request as the router places it (token ids, resolved SLO targets)."""

    request_id: str
    #: Read-only; may be the request message's own repeated field (copying it costs ~0.1 µs a token).
    prompt_token_ids: Sequence[int]
    model: str
    #: The request's own targets (ms); 0 = the router's default (e2e: none).
    ttft_slo_ms: float
    tpot_slo_ms: float
    priority: int = 0
    e2e_slo_ms: float = 0.0
    #: The request's output limit (sampling.max_tokens; 0 = unknown).
    max_tokens: int = 0
    slo_class: str = ""
    #: When the request reached the router (the placer's clock); None = not tracked.
    arrival_s: float | None = None

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        model: str,
        ttft_slo_ms: float,
        tpot_slo_ms: float,
        priority: int = 0,
        e2e_slo_ms: float = 0.0,
        max_tokens: int = 0,
        slo_class: str = "",
        arrival_s: float | None = None,
    ) -> None:
        # Written out (the dataclass keeps it): one dict instead of 10 frozen attribute sets, for an
        # object built once per request. The fields and defaults are the dataclass's (tested).
        object.__setattr__(
            self,
            "__dict__",
            {
                "request_id": request_id,
                "prompt_token_ids": prompt_token_ids,
                "model": model,
                "ttft_slo_ms": ttft_slo_ms,
                "tpot_slo_ms": tpot_slo_ms,
                "priority": priority,
                "e2e_slo_ms": e2e_slo_ms,
                "max_tokens": max_tokens,
                "slo_class": slo_class,
                "arrival_s": arrival_s,
            },
        )


@dataclass(frozen=True)
class PrefillTiming:
    """A prefill leg that starts with nothing queued ahead of it on a stock engine.

    A stock vLLM (``vllm-grpc``) tells its agent nothing about its prefill steps: ``GetLoads``
    carries a generation throughput (the agent's decode-step samples) and no prompt one. So the
    router times them itself. A leg dispatched to an engine with no request waiting, no prompt
    left to compute and no other prefill leg of this router in flight there is scheduled into
    the engine's next step beside the ``decode_requests`` running (a prompt up to the chunk
    budget is one step; a longer one is a few chunks, which the calibration's linear prefill
    term sums the same way). Its time to the first token is that mixed step, plus the rest of
    the step running when it arrived (half a decode step on average, taken off at the profile's
    calibrated decode time), plus the engine's and the transport's fixed cost per request, which
    a TTFT prediction carries too. The sample is the mixed step (prefill tokens, batch, context
    tokens, time): the calibration's TTFT factor compares such steps with the profile. Legs
    that queue behind other prompts are not timed: their first token waits for steps that are
    not theirs.
    """

    instance_id: str
    group: str
    started_s: float
    decode_requests: int
    decode_tokens: int


class Placer:
    """Places requests with ``scheduler`` over the snapshots of ``source``."""

    def __init__(
        self,
        scheduler: Scheduler,
        source: SnapshotSource,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: RequestObserver | None = None,
        health: OutlierDetector | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.health = health
        self._observer = observer
        self._source = source
        self._clock = clock
        self._limits: tuple[ClusterSnapshot, frozenset[str], dict[str, int], int] | None = None
        #: The load placed over the last minute (for ``desired_instances``).
        self.load = LoadTracker()
        #: Aladdin's Eq. 7 per role, fitted from the heartbeats of that load (``desired_instances``).
        self.demand = DesiredInstances(
            self._instance_rates,
            default_tpot_ms=scheduler.config.tpot_slo_ms,
            default_ttft_ms=scheduler.config.ttft_slo_ms,
        )
        #: Output lengths learned from the requests that finished here (the policies' length estimate;
        #: a client sends only max_tokens).
        self.lengths = LengthPredictor()
        #: Per resident decode leg placed here: (class, prompt bucket, max_tokens, prompt tokens), the
        #: keys its expected length is re-estimated by (:meth:`refresh_residents`).
        self._leg_keys: dict[str, tuple[str, int, int, int]] = {}
        #: Per instance: the status update and the time its resident legs were last re-estimated at.
        self._refreshed: dict[str, tuple[int, float]] = {}
        self._refreshed_view: tuple[ClusterSnapshot | None, float] = (None, -math.inf)
        predictors = scheduler.predictors
        config = scheduler.config
        learn = config.scheduling_policy == "binpack" and config.binpack_theta_adapt
        if predictors is not None and predictors.theta is None and learn:
            predictors.theta = ThetaFit(config.binpack_theta)
        #: Aladdin's θ learned from the finished requests' TPOT (binpack; None: fixed; service feeds it).
        self.theta: ThetaFit | None = predictors.theta if predictors is not None else None
        #: The scheduler's online calibration, fed the workers' step samples from each new view.
        self.calibration: Calibrator | None = predictors.calibration if predictors is not None else None
        self._fed: ClusterSnapshot | None = None
        self._fed_updates: dict[str, int] = {}
        self._expired_at = -math.inf
        subscribe = getattr(source, "add_snapshot_listener", None)
        if self.calibration is not None and subscribe is not None:
            # Every view update, not only those a decision happens to read: each status
            # carries only the steps since the previous one.
            subscribe(self._on_snapshot)

    def _on_snapshot(self, snapshot: ClusterSnapshot) -> None:
        try:
            self._calibrate(snapshot)
        except Exception:  # a listener must not break the reader: the calibration just misses it
            logger.exception("calibration could not read a view update")

    # ------------------------------------------------------------------ request checks against the fleet

    def _fleet_limits(self) -> tuple[frozenset[str], dict[str, int], int]:
        """Advertised models, max_model_len per model and overall (cached per snapshot)."""
        snapshot = self._source.snapshot()
        cached = self._limits
        if cached is not None and cached[0] is snapshot:
            return cached[1], cached[2], cached[3]
        models: set[str] = set()
        per_model: dict[str, int] = {}
        overall = 0
        for record in snapshot.instances:
            meta = record.metadata
            if meta.model:
                models.add(meta.model)
                per_model[meta.model] = max(per_model.get(meta.model, 0), meta.max_model_len)
            overall = max(overall, meta.max_model_len)
        self._limits = (snapshot, frozenset(models), per_model, overall)
        return frozenset(models), per_model, overall

    def check_model(self, model: str) -> None:
        """Refuse a model no instance serves, when instances advertise their models."""
        models, _, _ = self._fleet_limits()
        if model and models and model not in models:
            raise InvalidRequestError(
                f"model {model!r} is not served by this fleet; serving: {', '.join(sorted(models))}"
            )

    def max_model_len(self, model: str) -> int:
        """The longest prompt + completion any instance for ``model`` accepts (0 = unknown)."""
        _, per_model, overall = self._fleet_limits()
        return per_model.get(model, overall) if model else overall

    # ------------------------------------------------------------------ decisions

    def schedule_input(
        self,
        req: PlacementRequest,
        *,
        exclude: frozenset[str] = frozenset(),
        stages: StageRestriction = StageRestriction.ALL,
        prompt_tokens: int | None = None,
    ) -> ScheduleInput:
        """What the scheduling core sees of ``req``.

        With a prefix source the prompt's block hashes go with it (:mod:`fleet.prefix`), so the
        prediction charges only the tokens each instance's cache lacks; a re-placement of decode
        (its own ``prompt_tokens``) computes no prompt and carries none.
        """
        prefix = self.scheduler.prefix
        hashes: tuple[int, ...] = ()
        if prefix is not None and prompt_tokens is None:
            hashes = lookup_block_hashes(req.prompt_token_ids, prefix.chain_block_tokens, prefix.block_tokens)
        lengths = self.lengths.estimate(req.slo_class, len(req.prompt_token_ids), req.max_tokens)
        censored = 0
        if req.e2e_slo_ms > 0 and req.tpot_slo_ms <= 0 and binpacks(self.scheduler.config):
            censored = self.lengths.censored_bound(
                req.slo_class, len(req.prompt_token_ids), self._class_reached(req.slo_class), req.max_tokens
            )
        return ScheduleInput(
            request_id=req.request_id,
            prompt_tokens=len(req.prompt_token_ids) if prompt_tokens is None else prompt_tokens,
            ttft_slo_ms=req.ttft_slo_ms,
            tpot_slo_ms=req.tpot_slo_ms,
            model=req.model,
            exclude_instance_ids=exclude,
            stages=stages,
            e2e_slo_ms=req.e2e_slo_ms,
            expected_output_tokens=lengths.tokens,
            output_tokens_bound=lengths.bound_tokens,
            output_tokens_prior=lengths.samples == 0,
            output_tokens_pooled=lengths.source == "all",
            output_tokens_bound_censored=censored,
            max_tokens=req.max_tokens,
            priority=req.priority,
            slo_class=req.slo_class,
            arrival_s=req.arrival_s,
            prefix_hashes=hashes,
        )

    def snapshot(self) -> ClusterSnapshot:
        """The newest snapshot; :class:`EmptyClusterError` when no instance is registered."""
        return self._snapshot()

    def commit(self, decision: Decision, now: float) -> Route:
        """Record a decision made elsewhere (the router queue) as a dispatch and return its route."""
        self.scheduler.record(decision, now)
        self._remember_leg(decision)
        self._observe_load(decision, now)
        return route_of(decision)

    def _snapshot(self) -> ClusterSnapshot:
        snapshot = self._source.snapshot()
        if not snapshot.instances and snapshot.version == 0:
            raise EmptyClusterError(
                "the router has no cluster view yet: the CMS has not answered; check --cms and that the CMS runs"
            )
        if self.calibration is not None and snapshot is not self._fed:
            self._calibrate(snapshot)
        if self._leg_keys:
            self.refresh_residents(snapshot, self._clock())
        if not snapshot.instances:
            raise EmptyClusterError(
                "no instances are registered with the CMS (or the router has not reached it yet); "
                "start workers or check --cms"
            )
        return snapshot

    def _calibrate(self, snapshot: ClusterSnapshot) -> None:
        """Feed the step samples of every status not fed yet to the calibration; log drift changes."""
        calibration = self.calibration
        assert calibration is not None
        if snapshot is self._fed:
            return
        self._fed = snapshot
        now = self._clock()
        label = self.scheduler.config.profile_label
        fed = self._fed_updates
        batches: list[tuple[str, str, FloatArray]] = []
        for record in snapshot.instances:
            status = record.status
            if status is None or not status.step_samples:
                continue
            instance_id = record.metadata.instance_id
            if fed.get(instance_id) == status.update_id:
                continue  # the same status in a newer snapshot: its samples are in already
            fed[instance_id] = status.update_id
            steps = np.array(
                [
                    (s.num_prefill_tokens, s.num_decode_requests, s.num_decode_tokens, s.duration_ms)
                    for s in status.step_samples
                ],
                dtype=np.float64,
            )
            batches.append((instance_id, record.metadata.labels.get(label, ""), steps))
        if batches:
            # One call for every instance with new samples: the same outcome as one observe() per
            # instance in this order (see Calibrator.observe_steps), with one profile prediction
            # per group and one set of array operations per view instead of per instance.
            calibration.observe_steps(batches, now)
        if now - self._expired_at >= 1.0:
            self._expired_at = now
            calibration.expire(now)
            if len(fed) > 2 * len(snapshot.instances) + 64:  # instances that left: forget them
                present = {r.metadata.instance_id for r in snapshot.instances}
                for instance_id in [i for i in fed if i not in present]:
                    del fed[instance_id]
                    calibration.forget(instance_id)
        for instance_id, drifted, ttft, tpot in calibration.take_drift_events():
            if drifted:
                logger.warning(
                    "instance %s drifted from its profile: observed/predicted TTFT x%.2f, TPOT x%.2f "
                    "(calibration corrects it; re-profile if it persists: slo-router calibrate)",
                    instance_id,
                    ttft,
                    tpot,
                )
            else:
                logger.info("instance %s is back within its profile's bounds", instance_id)
        if self._observer is not None:
            self._observer.calibration(calibration, snapshot, label)

    def _schedule(
        self,
        req: PlacementRequest,
        now: float,
        exclude: frozenset[str],
        stages: StageRestriction = StageRestriction.ALL,
        prompt_tokens: int | None = None,
    ) -> Decision:
        """A decision for ``req`` over the newest snapshot (see :meth:`decide`)."""
        return self.decide(
            self._snapshot(),
            self.schedule_input(req, exclude=exclude, stages=stages, prompt_tokens=prompt_tokens),
            now,
        )

    def decide(
        self,
        view: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now: float,
        *,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision:
        """A decision that avoids the instances the outlier detector ejected, unless only they remain.

        Falling back to the ejected instances is Envoy's panic mode: evidence
        narrows the choice but never empties a fleet that still has candidates.
        The router queue decides through here too.
        """
        ejected = self.health.ejected(now) if self.health is not None else frozenset()
        exclude = request.exclude_instance_ids
        if ejected and not ejected <= exclude:
            narrowed = dataclasses.replace(request, exclude_instance_ids=exclude | ejected)
            try:
                return self.scheduler.schedule(view, narrowed, now, targets=targets, policy=policy)
            except SchedulingError:
                pass
        return self.scheduler.schedule(view, request, now, targets=targets, policy=policy)

    def place(self, req: PlacementRequest, *, exclude: frozenset[str] = frozenset()) -> Route:
        """Decide prefill and decode (or neutral) for ``req`` and record the dispatch."""
        now = self._clock()
        started = time.perf_counter()
        decision = self._schedule(req, now, exclude)
        self.scheduler.record(decision, now)
        self._remember_leg(decision)
        self._observe_load(decision, now)
        if self._observer is not None:
            self._observer.scheduled(time.perf_counter() - started)
        return route_of(decision)

    def _observe_load(self, decision: Decision, now: float) -> None:
        request = decision.context.request
        if request is not None:
            est = self.lengths.estimate(request.slo_class, request.prompt_tokens, request.max_tokens)
            self.load.observe(now, request.prompt_tokens, est.tokens)
            self.demand.observe(
                now,
                request.prompt_tokens,
                est.mean,
                learned=est.samples > 0,
                tpot_ms=request.tpot_slo_ms,
                e2e_ms=request.e2e_slo_ms,
                paced_tokens=float(est.bound_tokens),
                ttft_ms=request.ttft_slo_ms,
            )

    def place_decode(
        self, req: PlacementRequest, generated_tokens: int, *, exclude: frozenset[str], abandoned: str
    ) -> Choice:
        """Re-place the decode of ``req`` after ``abandoned`` failed; record the new leg."""
        now = self._clock()
        self.scheduler.inflight.release(req.request_id, abandoned)
        context_tokens = len(req.prompt_token_ids) + generated_tokens
        decision = self._schedule(req, now, exclude, StageRestriction.DECODE, context_tokens)
        choice = decision.decode
        if choice is None:  # the core always fills decode for a decode-only request; be explicit anyway
            raise EmptyClusterError(f"no decode instance for request {req.request_id}")
        # The new leg stays resident with the KV the request is still expected to reach.
        final = len(req.prompt_token_ids) + expected_output_tokens(
            decision.context.request, self.scheduler.config.packing_default_output_tokens
        )
        self.scheduler.inflight.record(
            req.request_id,
            None,
            choice.instance_id,
            context_tokens,
            now,
            final_tokens=max(final, context_tokens),
        )
        request = decision.context.request
        if request is not None:
            key = (req.slo_class, self.lengths.bucket(len(req.prompt_token_ids)), req.max_tokens)
            self._leg_keys[req.request_id] = (*key, len(req.prompt_token_ids))
        return choice

    def overpacked(self) -> dict[str, float]:
        """Per instance of the current view: 1 when the safety valve holds new decode off it, else 0."""
        snapshot = self._source.snapshot()
        if not snapshot.instances:
            return {}
        config = self.scheduler.config
        table = self.scheduler.view(snapshot, self._clock()).instances
        values = overpacked_mask(table, config.tpot_slo_ms, config.overpacked_tpot_factor)
        return dict(zip(table.ids, values.tolist(), strict=True))

    def _instance_rates(self, load: LoadShape, tpot_target_ms: float) -> InstanceRates:
        """One instance's service rates for ``load`` (the fleet's median KV capacity and step budget)."""
        predictors = self.scheduler.predictors
        assert predictors is not None
        instances = self._source.snapshot().instances
        return fleet_instance_rates(
            predictors.default,
            mean_prompt_tokens=load.mean_prompt_tokens,
            mean_output_tokens=load.mean_output_tokens,
            tpot_target_ms=tpot_target_ms,
            kv_capacities=[r.metadata.kv_capacity_tokens for r in instances],
            chunk_budgets=[r.metadata.max_num_batched_tokens for r in instances],
            kv_headroom=self.scheduler.config.kv_packing_headroom,
            seq_caps=[r.metadata.max_num_seqs for r in instances],
        )

    def desired_instances(self) -> dict[str, int]:
        """Instances per role the load of the last minute needs: Aladdin's Eq. 7 fitted online over
        the heartbeats of the placed load (:class:`router.core.worker_count.DesiredInstances`).

        PD fleets (prefill- and decode-role instances registered) report
        ``prefill`` and ``decode``, others ``neutral``; the other roles are 0.
        Empty when the router has no latency profile.
        """
        if self.scheduler.predictors is None:
            return {}
        roles = {r.metadata.role for r in self._source.snapshot().instances}
        now = self._clock()
        want = self.demand.desired(now, self.load.shape(now))
        pd = cms_pb2.INSTANCE_ROLE_PREFILL in roles and cms_pb2.INSTANCE_ROLE_DECODE in roles
        return {
            "prefill": want.prefill if pd else 0,
            "decode": want.decode if pd else 0,
            "neutral": 0 if pd else want.neutral,
        }

    def instance_counts(self) -> dict[tuple[str, str], int]:
        """Instances by (role, health) in the current view, for the metrics endpoint.

        ``ejected``: usable as far as the view says, but ejected by the outlier detector.
        """
        snapshot = self._source.snapshot()
        now = self._clock()
        staleness = self.scheduler.config.instance_staleness_s
        ejected = self.health.ejected(now) if self.health is not None else frozenset()
        counts: dict[tuple[str, str], int] = {}
        for role in ("neutral", "prefill", "decode"):
            for health in ("healthy", "unschedulable", "stale", "ejected"):
                counts[(role, health)] = 0
        for record in snapshot.instances:
            role = _ROLE_NAMES.get(record.metadata.role, "neutral")
            if record.status is None or snapshot.age_s(record, now) > staleness:
                health = "stale"
            elif not record.status.schedulable:
                health = "unschedulable"
            elif record.instance_id in ejected:
                health = "ejected"
            else:
                health = "healthy"
            counts[(role, health)] += 1
        return counts

    def advance(self, request_id: str, context_tokens: int) -> None:
        """Request ``request_id``'s decode leg holds ``context_tokens`` now (see ``InflightAccount.advance``)."""
        self.scheduler.inflight.advance(request_id, context_tokens, self._clock())

    def time_prefill(self, choice: Choice) -> PrefillTiming | None:
        """A :class:`PrefillTiming` when ``choice``'s leg, dispatched now, runs in a stock engine's next step.

        Nothing ahead of it: the instance's newest status has no request waiting and no prompt
        token left to compute, and this router's in-flight account (its peers' included) holds
        no other prefill leg there.
        """
        calibration = self.calibration
        if calibration is None or not calibration.enabled or not choice.endpoint.startswith(VLLM_GRPC_SCHEME):
            return None
        snapshot = self._source.snapshot()
        i = self.scheduler.views.table(snapshot).index.get(choice.instance_id)  # the decision's own table
        record = snapshot.instances[i] if i is not None else None
        status = record.status if record is not None else None
        if (
            record is None
            or status is None
            or status.num_waiting_requests
            or status.num_uncomputed_prefill_tokens
        ):
            return None
        if self.scheduler.inflight.totals(choice.instance_id).prefill_requests > 1:
            return None
        group = record.metadata.labels.get(self.scheduler.config.profile_label, "")
        return PrefillTiming(
            choice.instance_id, group, self._clock(), status.num_decode_requests, status.num_decode_tokens
        )

    def now(self) -> float:
        """This placer's clock (the one a :class:`PrefillTiming` is on)."""
        return self._clock()

    def prefill_timed(
        self, timing: PrefillTiming, computed_tokens: int, arrived_s: float | None = None
    ) -> None:
        """The timed leg's first token arrived (at ``arrived_s`` on this placer's clock; None: now):
        its prompt's ``computed_tokens`` make a step sample. The service calls it after the token
        went to the client, with the arrival time it noted, so the calibration is not on the TTFT path."""
        calibration = self.calibration
        predictors = self.scheduler.predictors
        if calibration is None or predictors is None or computed_tokens <= 0:
            return
        now = self._clock() if arrived_s is None else arrived_s
        elapsed_ms = (now - timing.started_s) * 1000.0
        batch, tokens = timing.decode_requests, timing.decode_tokens
        if batch:
            # The step running when the leg arrived: half of it on average, at the calibrated pace.
            _, decode = predictors.step_predictor(timing.group)(
                np.zeros(1), np.array([float(batch)]), np.array([float(tokens)])
            )
            elapsed_ms -= 0.5 * float(decode[0]) * calibration.factors(timing.instance_id)[1]
        if elapsed_ms <= 0:
            return
        sample = StepSample(computed_tokens, batch, tokens, elapsed_ms)
        calibration.observe(timing.instance_id, timing.group, (sample,), now)

    def release(self, request_id: str) -> None:
        """The request ended at the router: its in-flight entries go."""
        self.scheduler.inflight.release(request_id)
        self._leg_keys.pop(request_id, None)

    # ------------------------------------------------------------------ resident legs' lengths

    def _class_reached(self, slo_class: str) -> list[int]:
        """The output tokens each resident leg of ``slo_class`` this router holds has produced so far
        (those with any): the lower bounds of :meth:`LengthPredictor.censored_bound`."""
        inflight, keys = self.scheduler.inflight, self._leg_keys
        out: list[int] = []
        for instance_id in inflight.resident_instances():
            for r, context, _ in inflight.resident_progress(instance_id):
                key = keys.get(r)
                if key is not None and key[0] == slo_class and context > key[3]:
                    out.append(context - key[3])
        return out

    def _remember_leg(self, decision: Decision) -> None:
        """Keep what a placed decode leg's expected length is re-estimated by (see :meth:`refresh_residents`)."""
        request = decision.context.request
        if request is None or decision.decode is None:
            return
        bucket = self.lengths.bucket(request.prompt_tokens)
        self._leg_keys[request.request_id] = (
            request.slo_class,
            bucket,
            request.max_tokens,
            request.prompt_tokens,
        )

    def refresh_residents(self, snapshot: ClusterSnapshot, now: float) -> None:
        """Re-estimate the final length of the resident decode legs of the instances that reported.

        A leg enters the resident tally with its prompt plus the output expected at dispatch. One
        that outlives that estimate would keep saying it is done (no growth left, and its context
        past its final cancels the growth of the others in the instance's sums), so the residents'
        TPOT filter, which spreads a new prompt's prefill stall over the residents' remaining output,
        would see a stall spread over one token and refuse the instance. As the simulator does on
        each status push of an instance (``sim.cluster``'s ``_reestimate_residents``), each of its
        started legs (admitted, or streaming) becomes what it holds now (the tokens this router
        has forwarded) plus the length predictor's conditional remaining output; legs not started
        keep their estimate.
        An instance is refreshed when its status changed since, or every :data:`RESIDENT_REFRESH_S`
        at least. Costs O(instances holding residents) per new snapshot, plus O(legs) on each
        refreshed instance.
        """
        last, swept = self._refreshed_view
        if snapshot is last and now - swept < RESIDENT_REFRESH_S:
            return
        self._refreshed_view = (snapshot, now)
        inflight = self.scheduler.inflight
        keys = self._leg_keys
        refreshed = self._refreshed
        held = inflight.resident_instances()
        if not held:
            return
        index = self.scheduler.views.table(snapshot).index  # the decision's own per-snapshot table
        records = snapshot.instances
        for instance_id in held:
            i = index.get(instance_id)
            status = records[i].status if i is not None else None
            update = status.update_id if status is not None else -1
            seen = refreshed.get(instance_id)
            if seen is not None and seen[0] == update and now - seen[1] < RESIDENT_REFRESH_S:
                continue
            refreshed[instance_id] = (update, now)
            # Started: admitted by its instance (its in-flight entry left at a decision's reconcile)
            # or already streaming tokens through this router (no decision may have run since).
            legs = [
                (r, c, key)
                for r, c, started in inflight.resident_progress(instance_id)
                if (key := keys.get(r)) is not None and (started or c > key[3])
            ]
            if not legs:
                continue
            remaining = self.lengths.remaining_many(
                [k[0] for _, _, k in legs],
                [k[1] for _, _, k in legs],
                [max(c - k[3], 0) for _, c, k in legs],
                [k[2] for _, _, k in legs],
            )
            finals = {r: c + round(rest) for (r, c, _), rest in zip(legs, remaining, strict=True)}
            inflight.set_resident_finals(instance_id, finals)
        # Bounded: requests that never reached release() (their legs expired) and instances gone.
        if len(keys) > 2 * inflight.resident_count() + 1024:
            for request_id in [r for r in keys if not inflight.is_resident(r)]:
                del keys[request_id]
        if len(refreshed) > 2 * len(snapshot.instances) + 64:
            present = {r.metadata.instance_id for r in snapshot.instances}
            for instance_id in [i for i in refreshed if i not in present]:
                del refreshed[instance_id]

    def confirm(self, request_id: str, instance_id: str) -> None:
        """``instance_id`` is running the request now (see ``InflightAccount.confirm``)."""
        self.scheduler.inflight.confirm(request_id, instance_id, int(time.time() * 1000))

    def dry_run(
        self,
        req: PlacementRequest,
        queue: RouterQueue | None = None,
        *,
        explain: bool = False,
        explain_top: int = 0,
    ) -> router_pb2.ScheduleResponse:
        """The decision ``place`` would make now, with its trace when ``explain``; nothing recorded.

        The trace has one entry per candidate of every evaluated stage, so it
        costs time in proportion to the fleet; the decision itself does not
        build it (:attr:`~router.core.decision.Decision.trace` is lazy).
        ``explain_top`` > 0 keeps the trace to that many candidates per stage,
        the most telling first (:meth:`~router.core.decision.Decision.trace_top`). With
        the router ``queue`` the request is tried as the queue would offer it
        (TTFT bound capped by the release limit); when no instance may take it,
        the response says it would be queued and where, instead of an error.
        """
        now = self._clock()
        request = self.schedule_input(req)
        # The request's lifecycle as Generate would start it: it answers which phase it would be in.
        state = RequestState(req.request_id, started=now, prompt_tokens=request.prompt_tokens)
        if queue is not None:
            targets = resolve_targets(request, queue.default_ttft_ms, queue.default_tpot_ms, now)
            bound = min(targets.ttft_ms, queue.release_limit_ms(now, request.priority, targets.full_ttft_ms))
            position = queue.position_of_new(request, now)
            try:
                if bound <= 0:
                    raise NoInstanceError(
                        f"release limit {bound:.0f} ms", stage="prefill", candidates=0, drops={}
                    )
                decision = self.scheduler.schedule(
                    self._snapshot(),
                    request,
                    now,
                    dry_run=True,
                    targets=Targets(bound, targets.tpot_ms, targets.e2e_ms, targets.full_ttft_ms),
                )
            except NoInstanceError as exc:
                return router_pb2.ScheduleResponse(
                    queued=True, queue_position=position, queue_reason=str(exc), phase=state.phase.value
                )
        else:
            decision = self.scheduler.schedule(self._snapshot(), request, now, dry_run=True)
        state.to(Phase.PLACED)
        response = router_pb2.ScheduleResponse(
            phase=state.phase.value, policy=decision.policy, mode=decision.mode.value
        )
        _fill_choice(response.prefill, decision.prefill)
        _fill_choice(response.decode, decision.decode)
        if not explain:
            return response
        response.trace.extend(
            router_pb2.CandidateTrace(
                instance_id=entry.instance_id,
                stage=entry.stage.value,
                selected=entry.selected,
                dropped_by=entry.dropped_by,
                predicted_ttft_ms=_finite(entry.predicted_ttft_ms),
                predicted_tpot_ms=_finite(entry.predicted_tpot_ms),
            )
            for entry in decision.trace_top(explain_top)
        )
        return response


_ROLE_NAMES = {
    cms_pb2.INSTANCE_ROLE_NEUTRAL: "neutral",
    cms_pb2.INSTANCE_ROLE_PREFILL: "prefill",
    cms_pb2.INSTANCE_ROLE_DECODE: "decode",
}


def _fill_choice(out: router_pb2.InstanceChoice, choice: Choice | None) -> None:
    """Write ``choice`` into the response's own submessage (half the cost of building an
    ``InstanceChoice`` and copying it in); nothing for ``None`` (the field stays unset)."""
    if choice is None:
        return
    out.instance_id = choice.instance_id
    out.endpoint = choice.endpoint
    out.predicted_ttft_ms = _finite(choice.predicted_ttft_ms)
    out.predicted_tpot_ms = _finite(choice.predicted_tpot_ms)


def _finite(value: float) -> float:
    """Predictions are NaN without a predictor; the wire carries 0 for "not predicted"."""
    return value if value == value else 0.0
