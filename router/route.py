"""A request's route: what the router keeps of a scheduling decision while the request lives.

Shared by placement (which makes routes), the service (which forwards along
them) and telemetry (which labels metrics by them).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.core.decision import Choice, Decision
from router.core.errors import EmptyClusterError
from router.core.request import Mode


@dataclass(frozen=True)
class Route:
    """Where a request runs: what the service keeps of a decision while the request lives.

    (A :class:`~router.core.decision.Decision` holds its whole decision context for
    the lazy trace; a live request keeps only this.) ``*_group`` is the
    instance's profile group, or its stage when the fleet has one profile.
    """

    mode: Mode
    policy: str
    prefill: Choice
    decode: Choice
    prefill_group: str
    decode_group: str


def _group(decision: Decision, choice: Choice) -> str:
    table = decision.context.view.instances
    i = table.index.get(choice.instance_id)
    group = table.groups[i] if i is not None else ""
    return group or choice.stage.value


def route_of(decision: Decision) -> Route:
    """The :class:`Route` of a full placement."""
    if decision.prefill is None or decision.decode is None:
        raise EmptyClusterError(f"the scheduler placed only part of request {decision.request_id}")
    return Route(
        mode=decision.mode,
        policy=decision.policy,
        prefill=decision.prefill,
        decode=decision.decode,
        prefill_group=_group(decision, decision.prefill),
        decode_group=_group(decision, decision.decode),
    )
