"""Aladdin's (d) at the late edge of a request's TTFT budget: ``binpack``'s last pass on neutral instances.

Aladdin (seed 001) holds its placement constraints as constraints: a request no worker admits
opens a new bin. On a fixed fleet there is no new bin; the router queue holds the request, and a
TTFT-judged request held until its first token is out of reach is a sure miss (refused by the
queue's late path) whatever the residents gain by it. Traced on 5 neutral instances of chat at
16 req/s: every such refusal was a long prompt (1,700-4,096 tokens, 270-600 ms of prefill alone)
that (d) kept off every instance, its stall over θ of some resident's ATGT slack, until its budget
ran out. θ is headroom against the error of the predicted stall and step; what the residents'
TPOT needs is the stall within their slack (ratio 1).

``late_edge`` gates the last fallback pass, where (d) is dropped. It keeps:

* every instance meeting (d) with its θ (or empty). Outside the edge that pass then places
  nothing the earlier passes did not, so nothing changes there;
* at the edge only, the instance whose (d) ratio over its TPOT-judged residents' slack is least,
  if it is at most :data:`EDGE_CAP` (half of θ's headroom spent: no resident is predicted to miss)
  and every deadline-paced resident there still meets (d) within θ (its slack is already counted
  against the pace its deadline needs: a long answer's tail has none to give), among the
  instances meeting the request's TTFT bound and KV over life. (b) stays a constraint throughout.

The edge: the TTFT budget left (from arrival: :func:`~router.core.request.resolve_targets`) less
the best TTFT predicted among those instances is within :data:`EDGE_MARGIN` of the whole target.
Measured variants (docs/papers.md, Aladdin): relaxing (b) as well, or without a cap, cost the
residents far more than the refusals (chat, 5 instances: 57.3 % with no cap).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from router.core.columns import FloatArray
from router.core.config import SchedulerConfig
from router.core.packing import atgt_slack_ms, live_theta, prefill_stall_ms
from router.core.plugins import DecisionContext, FilterResult
from router.core.registry import FILTERS, Params
from router.core.request import resolve_targets

#: (d)'s metric, held below θ (``binpack_theta``) in the earlier passes.
SLACK = "prefill_over_atgt_slack"

#: The edge: the TTFT budget left less the best predicted TTFT, as a share of the whole TTFT target.
EDGE_MARGIN = 0.25

#: The most (d) may be violated at the edge: the stall over the TPOT-judged residents' least slack.
#: θ (0.7) is the headroom the earlier passes keep; this spends half of it (1 would let a resident
#: be predicted to end exactly at its target).
EDGE_CAP = 0.85


@dataclass(frozen=True, eq=False)
class LateEdge:
    """The gate of ``binpack``'s last pass on neutral instances (see the module doc)."""

    config: SchedulerConfig
    margin: float = EDGE_MARGIN
    cap: float = EDGE_CAP
    relax_pass: int = 0
    label: str = "late_edge"

    def apply(self, ctx: DecisionContext) -> FilterResult:
        theta = self.config.binpack_theta
        keep = (ctx.metric(SLACK) < theta) | (
            (ctx.metric("num_requests") == 0)
            & (ctx.metric("decode_batch_size") == 0)
            & (ctx.metric("kv_usage_projected") == 0)
        )
        edge = self.at_edge(ctx)
        if edge is None:
            return FilterResult(keep=keep)
        ratio = np.where(edge, self.edge_ratio(ctx), np.inf)
        least = float(ratio.min())
        if not least <= self.cap:
            return FilterResult(keep=keep)
        return FilterResult(keep=keep | (ratio <= least))

    def at_edge(self, ctx: DecisionContext) -> np.ndarray | None:
        """The instances the request may take at its late edge (its TTFT bound and KV over life
        met), or None when it is not at the edge (or none is)."""
        request = ctx.request
        if request is None or request.arrival_s is None:
            return None
        ttft = ctx.metric("predicted_ttft")
        eligible = (ttft < ctx.ttft_slo_ms) & (ctx.metric("kv_peak_exact") < self.config.kv_packing_headroom)
        if not np.count_nonzero(eligible):
            return None
        config = self.config
        targets = resolve_targets(request, config.ttft_slo_ms, config.tpot_slo_ms, ctx.view.now_s)
        if targets.ttft_ms - float(ttft[eligible].min()) > self.margin * targets.full_ttft_ms:
            return None
        return eligible

    def edge_ratio(self, ctx: DecisionContext) -> FloatArray:
        """(d) at the edge: the stall over the TPOT-judged residents' least slack (0 where none
        decodes); inf where a deadline-paced resident would not keep (d) within θ."""
        n = ctx.view.n
        stall = prefill_stall_ms(ctx)
        theta = live_theta(ctx, self.config)
        tpot = atgt_slack_ms(ctx, self.config.tpot_slo_ms, theta, legs_of="tpot")
        paced = atgt_slack_ms(ctx, self.config.tpot_slo_ms, theta, legs_of="paced")
        ratio: FloatArray = np.divide(stall, tpot, out=np.full(n, np.inf), where=tpot > 0)
        ratio[np.isinf(tpot)] = 0.0
        paced_ratio = np.divide(stall, paced, out=np.full(n, np.inf), where=paced > 0)
        paced_ratio[np.isinf(paced)] = 0.0
        out: FloatArray = np.where(paced_ratio < self.config.binpack_theta, ratio, np.inf)
        return out


@FILTERS.register("late_edge")
def _late_edge(config: SchedulerConfig, params: Params) -> LateEdge:
    return LateEdge(
        config=config,
        margin=params.number("margin", EDGE_MARGIN),
        cap=params.number("cap", EDGE_CAP),
        label=params.text("label", "late_edge"),
    )
