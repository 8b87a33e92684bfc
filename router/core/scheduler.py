"""The scheduling core's entry point: :class:`Scheduler`.

::

    scheduler = Scheduler(SchedulerConfig.from_namespace(args), predictors, random.Random(args.seed))
    decision = scheduler.schedule(cms_reader.snapshot(), ScheduleInput("req-1", prompt_tokens=812), now_s)
    scheduler.record(decision, now_s)          # at dispatch: the next decision sees the load
    ...
    scheduler.inflight.release("req-1")        # when the request ends at the router

``schedule`` is synchronous, I/O-free and cheap (columns cached per snapshot
and per in-flight version). ``dry_run=True`` (the ``Schedule`` RPC) makes the
same decision without changing anything: the RNG is restored and policy state
(round-robin position, adaptive-PD reserves) is not committed, so a following
real decision on the same state picks the same instances.
"""

from __future__ import annotations

import logging
import random

from fleet.snapshot import ClusterSnapshot
from predictor import LatencyPredictor
from router.core import chain
from router.core.calibration import CalibrationConfig, Calibrator
from router.core.columns import ClusterView
from router.core.config import SchedulerConfig
from router.core.decision import Decision
from router.core.errors import ConfigError
from router.core.inflight import InflightAccount
from router.core.packing import expected_output_tokens, resident_tpot_pacing
from router.core.plugins import DecisionContext, Metric, Policy
from router.core.policies import build_policy
from router.core.predictors import PredictorSet
from router.core.prefix import ApproximatePrefixIndex, AutoPrefixIndex, ExactPrefixIndex, PrefixRouting
from router.core.registry import METRICS
from router.core.request import ScheduleInput, Targets, resolve_targets
from router.core.rng import dry_run_random
from router.core.view import ViewBuilder

logger = logging.getLogger(__name__)


class Scheduler:
    """Places requests on a fleet; holds the in-flight account and the policy's state.

    ``predictors`` is one :class:`~predictor.LatencyPredictor`, a
    :class:`~router.core.predictors.PredictorSet` (heterogeneous fleets), or
    ``None`` (then predictions are NaN: fine for load-based policies only).
    ``rng`` is the only source of randomness (a :class:`~router.core.rng.PeekableRandom`
    makes dry runs cheaper: they read its next draws instead of copying its
    state). ``inflight`` and ``policy``
    default to a fresh account and to the policy ``config`` names.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        predictors: LatencyPredictor | PredictorSet | None,
        rng: random.Random,
        *,
        inflight: InflightAccount | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.config = config
        self.predictors = PredictorSet.of(predictors)
        self.rng = rng
        self.inflight = inflight if inflight is not None else InflightAccount(config.inflight_expiry_s)
        self.policy = policy if policy is not None else build_policy(config)
        if self.predictors is None and (config.enable_adaptive_pd or config.scheduling_policy == "slo"):
            raise ConfigError(
                "the slo policy and adaptive PD predict latency: pass a LatencyPredictor "
                "(--ttft-profiling-data-path and --tpot-profiling-data-path)"
            )
        if (
            self.predictors is not None
            and config.calibration != "off"
            and self.predictors.calibration is None
        ):
            # The calibration belongs to the predictions: the set carries it to every metric.
            self.predictors.calibration = Calibrator(
                CalibrationConfig(mode=config.calibration, update_every_s=config.calibration_update_every_s),
                self.predictors.step_predictor,
            )
        self.metrics: dict[str, Metric] = {name: METRICS.create(name, config) for name in METRICS.names()}
        self.views = ViewBuilder(
            default_max_num_batched_tokens=config.default_max_num_batched_tokens,
            profile_label=config.profile_label,
        )
        self._reconciled: ClusterSnapshot | None = None
        #: What the router knows of the instances' prefix caches (None: off). ``auto`` starts
        #: approximate; a caller with an event stream calls :meth:`use_exact_prefix_index`.
        self.prefix: ApproximatePrefixIndex | ExactPrefixIndex | AutoPrefixIndex | None = None
        mode = PrefixRouting(config.prefix_cache_routing)
        if mode is PrefixRouting.EXACT:
            self.use_exact_prefix_index()
        elif mode is not PrefixRouting.OFF:
            self.prefix = ApproximatePrefixIndex(
                config.prefix_block_tokens,
                max_blocks_per_instance=config.prefix_index_max_blocks,
                chain_block_tokens=config.prefix_chain_block_tokens,
            )

    def use_exact_prefix_index(self) -> ExactPrefixIndex:
        """Switch to an index fed by the engines' KV events (the caller feeds it) and return it."""
        index = ExactPrefixIndex(
            self.config.prefix_block_tokens,
            max_blocks_per_instance=self.config.prefix_index_max_blocks,
            chain_block_tokens=self.config.prefix_chain_block_tokens,
        )
        self.prefix = index
        return index

    def use_auto_prefix_index(self) -> AutoPrefixIndex:
        """Switch to exact-where-events-arrive, approximate elsewhere (a live router with an event feed)."""
        index = AutoPrefixIndex(
            self.config.prefix_block_tokens,
            max_blocks_per_instance=self.config.prefix_index_max_blocks,
            chain_block_tokens=self.config.prefix_chain_block_tokens,
        )
        self.prefix = index
        return index

    def view(self, snapshot: ClusterSnapshot, now_s: float) -> ClusterView:
        """The view a decision at ``now_s`` sees.

        Reconciles the in-flight account with ``snapshot`` (once per snapshot
        object) and expires old entries first. While the snapshot's source is
        lost nothing expires: no status can confirm an entry, so the router's
        own account (released when requests end) is the load it knows of.
        """
        if snapshot is not self._reconciled:
            self.inflight.reconcile(snapshot, self.views.table(snapshot).index)
            self._reconciled = snapshot
        if snapshot.source_lost_at_s is None:
            self.inflight.expire(now_s)
        return self.views.build(snapshot, self.inflight, now_s)

    def context(
        self,
        view: ClusterView,
        request: ScheduleInput | None,
        now_s: float | None = None,
        targets: Targets | None = None,
        *,
        rng: random.Random | None = None,
    ) -> DecisionContext:
        """A decision context for ``request`` (``None``: metrics without a request, e.g. for observability).

        The targets are :func:`~router.core.request.resolve_targets`'s (the
        remaining TTFT budget when ``now_s`` and the request's arrival are known),
        or ``targets`` when given (the router queue bounds them itself).
        """
        ttft, tpot = self.config.ttft_slo_ms, self.config.tpot_slo_ms
        if request is not None and targets is None:
            targets = resolve_targets(request, ttft, tpot, now_s)
        if targets is not None:
            ttft, tpot = targets.ttft_ms, targets.tpot_ms
        return DecisionContext(
            view,
            request,
            metrics=self.metrics,
            predictors=self.predictors,
            rng=self.rng if rng is None else rng,
            ttft_slo_ms=ttft,
            tpot_slo_ms=tpot,
            max_status_age_s=self.config.instance_staleness_s,
            prefix=self.prefix,
            margin_waived=targets is not None and targets.margin_waived,
        )

    def schedule(
        self,
        view_or_snapshot: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now_s: float,
        *,
        dry_run: bool = False,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision:
        """Place ``request``; raises :class:`~router.core.errors.SchedulingError` when it cannot.

        A snapshot goes through :meth:`view` at ``now_s``; a prebuilt view is
        used as it is (its own ``now_s`` decides status ages). Nothing is
        recorded in the in-flight account: call :meth:`record` at dispatch.
        ``policy`` replaces the scheduler's own for this decision (a queue that
        chose the instance itself checks only its health).
        """
        policy = self.policy if policy is None else policy
        if isinstance(view_or_snapshot, ClusterView):
            view = view_or_snapshot
        else:
            view = self.view(view_or_snapshot, now_s)
        if not dry_run:
            ctx = self.context(view, request, now_s, targets)
            decision = chain.run(policy, ctx, now_s)
            ctx.commit()
        else:
            # Same draws as a real decision would see, without consuming them.
            ctx = self.context(view, request, now_s, targets, rng=dry_run_random(self.rng))
            decision = chain.run(policy, ctx, now_s)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s: %s %s prefill=%s decode=%s%s",
                request.request_id,
                decision.policy,
                decision.mode.value,
                decision.prefill,
                decision.decode,
                " (dry run)" if dry_run else "",
            )
        return decision

    def dispatched(self, decision: Decision, now_s: float) -> None:
        """Tell the policy's hooks that ``decision`` was dispatched (:meth:`record` does it; a caller
        keeping its own in-flight account, as the simulator does, calls it at dispatch)."""
        request = decision.context.request
        if request is not None:
            for hook in self.policy.hooks:
                hook.dispatched(request, now_s)
            prefix = self.prefix
            if prefix is not None and request.prefix_hashes and decision.prefill is not None:
                table = decision.context.view.instances
                i = table.index.get(decision.prefill.instance_id)
                capacity = float(table.kv_capacity_tokens[i]) if i is not None else 0.0
                private = request.prompt_tokens - len(request.prefix_hashes) * prefix.block_tokens
                private += expected_output_tokens(request, self.config.packing_default_output_tokens)
                prefix.dispatched(decision.prefill.instance_id, request.prefix_hashes, capacity, private)
            calibration = self.predictors.calibration if self.predictors is not None else None
            if calibration is not None and calibration.follows_dispatches and decision.prefill is not None:
                # What the prompt computes there, for the calibrated interleave (its coming prefill).
                instance_id = decision.prefill.instance_id
                cached = cached_at(decision.context, instance_id) if request.prefix_hashes else 0
                calibration.dispatched(instance_id, request.prompt_tokens, cached, now_s)

    def record(self, decision: Decision, now_s: float, prompt_tokens: int | None = None) -> None:
        """Account ``decision``'s dispatch in the in-flight account (and tell the policy's hooks).

        ``prompt_tokens`` defaults to the request's (a decode re-placement of
        prompt + generated tokens passes its own count; it is no new load, so
        the hooks do not hear of it).
        """
        if prompt_tokens is None:
            self.dispatched(decision, now_s)
        request = decision.context.request
        tokens = prompt_tokens
        if tokens is None:
            tokens = request.prompt_tokens if request is not None else 0
        # The decode leg stays resident until the request ends, with the KV it is expected to reach.
        final = tokens + expected_output_tokens(request, self.config.packing_default_output_tokens)
        cached = 0
        if prompt_tokens is None and decision.prefill is not None:
            cached = cached_at(decision.context, decision.prefill.instance_id)
        need, paced, paced_tokens = resident_tpot_pacing(decision.context, self.config)
        self.inflight.record(
            decision.request_id,
            decision.prefill.instance_id if decision.prefill is not None else None,
            decision.decode.instance_id if decision.decode is not None else None,
            tokens,
            now_s,
            final_tokens=final if request is not None else 0,
            cached_prefill_tokens=cached,
            tpot_need_ms=need,
            tpot_paced=paced,
            paced_tokens=paced_tokens,
        )


def cached_at(ctx: DecisionContext, instance_id: str) -> int:
    """The prompt tokens ``ctx``'s decision counted as cached at ``instance_id`` (0 when it counted none)."""
    values = ctx.computed_metrics().get("cached_prompt_tokens")
    i = ctx.view.instances.index.get(instance_id)
    if values is None or i is None:
        return 0
    return int(values[i])
