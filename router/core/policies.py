"""The built-in policies, and policies composed from a YAML file — both from the same description.

A policy description names, per stage, its filters and its selector::

    name: my-slo                     # optional (default: the file name)
    adaptive_pd: false               # true: role-agnostic PD stages + reserve election
    prefill:
      filters:
        - schedulability
        - staleness                  # or {name: staleness, max_age_s: 3}
        - {name: metric_threshold, metric: predicted_ttft, slo: ttft, factor: 0.9}
        - failover                   # global filters run after the others, whatever their place
      selector: {name: lowest, metrics: [predicted_ttft]}
    decode:   {...}
    neutral:  {...}                  # required unless adaptive_pd

A filter or selector is a name, or a mapping with ``name`` plus its
parameters (see :mod:`router.core.filters` and :mod:`router.core.selectors`); unknown
names and unknown parameters are errors that list what exists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from router.core import filters as _filters  # noqa: F401  (registers the filters)
from router.core import metrics as _metrics  # noqa: F401  (registers the metrics)
from router.core import packing as _packing
from router.core import selectors as _selectors  # noqa: F401  (registers the selectors)
from router.core.adaptive_pd import DecodeShare, ReserveElection
from router.core.config import SchedulerConfig
from router.core.errors import ConfigError, PolicyFileError
from router.core.plugins import Filter, GlobalFilter, Policy, PolicyHook, StageSpec
from router.core.registry import FILTERS, POLICIES, SELECTORS, Params

_STAGES = ("prefill", "decode", "neutral")
_TOP_KEYS = {"name", "adaptive_pd", *_STAGES}

Description = Mapping[str, Any]


def _named(item: Any, where: str) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, Mapping) and isinstance(item.get("name"), str):
        params = dict(item)
        return params.pop("name"), params
    raise ConfigError(f"{where}: expected a name or a mapping with 'name', got {item!r}")


def stage_from_dict(doc: Any, config: SchedulerConfig, where: str) -> StageSpec:
    """One stage's :class:`StageSpec` from its description (``filters`` list + ``selector``)."""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{where}: a stage must be a mapping with 'filters' and 'selector', got {doc!r}")
    unknown = set(doc) - {"filters", "selector"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))} (accepted: filters, selector)"
        )
    items = doc.get("filters", [])
    if not isinstance(items, list):
        raise ConfigError(f"{where}.filters: must be a list, got {items!r}")
    single: list[Filter] = []
    global_: list[GlobalFilter] = []
    for k, item in enumerate(items):
        name, raw = _named(item, f"{where}.filters[{k}]")
        plugin = FILTERS.create(name, config, Params(f"{where}.filters[{k}] ({name})", raw))
        if isinstance(plugin, GlobalFilter):
            global_.append(plugin)
        else:
            single.append(plugin)
    if "selector" not in doc:
        raise ConfigError(f"{where}: missing 'selector'")
    name, raw = _named(doc["selector"], f"{where}.selector")
    selector = SELECTORS.create(name, config, Params(f"{where}.selector ({name})", raw))
    return StageSpec(tuple(single), tuple(global_), selector)


def policy_from_dict(doc: Any, config: SchedulerConfig, where: str, default_name: str = "custom") -> Policy:
    """A :class:`Policy` from a description (the YAML schema in the module doc)."""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{where}: a policy must be a mapping, got {type(doc).__name__}")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))} (accepted: {', '.join(sorted(_TOP_KEYS))})"
        )
    adaptive = doc.get("adaptive_pd", False)
    if not isinstance(adaptive, bool):
        raise ConfigError(f"{where}: 'adaptive_pd' must be true or false, got {adaptive!r}")
    required = ("prefill", "decode") if adaptive else _STAGES
    missing = [s for s in required if s not in doc]
    if missing:
        raise ConfigError(f"{where}: missing stage(s) {', '.join(missing)}")
    specs = {s: stage_from_dict(doc[s], config, f"{where}.{s}") for s in _STAGES if s in doc}
    hooks: tuple[PolicyHook, ...] = (ReserveElection(), DecodeShare(config)) if adaptive else ()
    return Policy(
        name=str(doc.get("name", default_name)),
        prefill=specs["prefill"],
        decode=specs["decode"],
        neutral=specs.get("neutral"),
        role_agnostic=adaptive,
        hooks=hooks,
    )


def load_policy_file(path: str | Path, config: SchedulerConfig) -> Policy:
    """A policy from a YAML file; every problem is a :class:`PolicyFileError` naming the file."""
    source = str(path)
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyFileError(f"{source}: cannot read policy file: {exc}") from exc
    except yaml.YAMLError as exc:
        raise PolicyFileError(f"{source}: invalid YAML: {exc}") from exc
    try:
        return policy_from_dict(doc, config, source, default_name=Path(path).stem)
    except PolicyFileError:
        raise
    except ConfigError as exc:
        raise PolicyFileError(str(exc)) from exc


def build_policy(config: SchedulerConfig) -> Policy:
    """The policy ``config`` asks for: the policy file if set, else adaptive PD or the named policy."""
    if config.policy_config_path is not None:
        return load_policy_file(config.policy_config_path, config)
    name = "adaptive-pd" if config.enable_adaptive_pd else config.scheduling_policy
    return POLICIES.create(name, config)


def _builtin(name: str, doc: Description | Callable[[SchedulerConfig], Description]) -> None:
    """Register a built-in policy described by ``doc`` (a function of the config, or fixed)."""

    @POLICIES.register(name)
    def factory(config: SchedulerConfig, params: Params) -> Policy:
        described = doc(config) if callable(doc) else doc
        return policy_from_dict({"name": name, **described}, config, f"policy {name!r}")


# ----------------------------------------------------------------------------- built-ins

HEALTH: list[Any] = ["schedulability", "staleness"]


def _same_everywhere(filters: list[Any], selector: Any) -> dict[str, Any]:
    stage = {"filters": filters, "selector": selector}
    return {"prefill": stage, "decode": stage, "neutral": stage}


def _ttft(**extra: Any) -> dict[str, Any]:
    return {"name": "metric_threshold", "metric": "predicted_ttft", "slo": "ttft", **extra}


def _tpot(**extra: Any) -> dict[str, Any]:
    return {"name": "metric_threshold", "metric": "predicted_tpot", "slo": "tpot", **extra}


def _lowest(*metrics: str) -> dict[str, Any]:
    return {"name": "lowest", "metrics": list(metrics)}


def _load_balance(config: SchedulerConfig) -> dict[str, Any]:
    def stage(kind: str) -> dict[str, Any]:
        metric = getattr(config, f"dispatch_{kind}_load_metric")
        limit = getattr(config, f"dispatch_{kind}_load_threshold")
        threshold = (
            []
            if limit is None
            else [{"name": "metric_threshold", "metric": metric, "limit": limit, "droppable": True}]
        )
        return {"filters": [*HEALTH, *threshold, "failover"], "selector": _lowest(metric)}

    return {s: stage(s) for s in _STAGES}


_builtin("load-balance", _load_balance)


def health_only(config: SchedulerConfig, name: str) -> Policy:
    """A policy that checks only that an instance can take work (schedulable, fresh, not failing).

    For a queue that chose the instance itself (``--queue-policy qlm``): the SLO thresholds
    are its planner's job, and one that refused the chosen instance would refuse a request
    the plan had already placed.
    """
    stages = _same_everywhere([*HEALTH, "failover"], _lowest("predicted_ttft"))
    return policy_from_dict({"name": name, **stages}, config, f"policy {name!r}")


def _kv_fits(config: SchedulerConfig, **extra: Any) -> dict[str, Any]:
    """KV over the life of the instance's requests (and this one) within the headroom."""
    return {
        "name": "metric_threshold",
        "metric": "kv_peak_projected",
        "limit": config.kv_packing_headroom,
        "label": "kv_over_life",
        **extra,
    }


def _not_overpacked(**extra: Any) -> dict[str, Any]:
    """The safety valve: no new decode on an instance measured over its TPOT target or preempting."""
    return {"name": "metric_threshold", "metric": "overpacked", "limit": 0.5, "label": "overpacked", **extra}


def _tpot_horizon(config: SchedulerConfig, **extra: Any) -> dict[str, Any]:
    """TPOT at the packing horizon (γ) below the bin-packing share of the target."""
    return _tpot(
        metric="predicted_tpot_horizon",
        slo="tpot_packing",
        factor=config.tpot_binpack_threshold,
        label="tpot_horizon",
        **extra,
    )


#: The label of the residents' TPOT check (:func:`_residents`), which a queue policy may waive.
RESIDENTS_TPOT_LABEL = "tpot_residents"


def _residents(**extra: Any) -> dict[str, Any]:
    """The TPOT of the requests already on a colocated instance, once this prompt joins them."""
    return _tpot(metric="predicted_tpot_residents", slo="tpot_residents", label=RESIDENTS_TPOT_LABEL, **extra)


def _kv_promise(config: SchedulerConfig) -> list[dict[str, Any]]:
    """KV over life as ``slo`` keeps it: the promise held in every pass, the sums' slack preferred.

    The promise is the exact peak over the residents' life (``kv_peak_exact``,
    as binpack's (e) and adaptive PD's decode): a request no instance can take
    within it gets no placement and waits in the router queue (is refused at
    once with ``--queue-policy none``). Dropped in the fallback pass, as it
    was, it placed requests past the KV on fleets whose KV binds, and the
    engines' preemptions (each a whole context recomputed as prefill, stalling
    every co-resident decode) cost more than the wait: 62.7 against 95.9 % on
    5 neutral instances at 20k tokens of KV (docs/results.md). Without a queue
    refusing is still the better answer there (45.5 against 94.0 %): the client
    can retry, the requests already running keep their pace. The sums' bound
    (``kv_peak_projected``, every resident at its final length at once) is the
    first pass's preference, dropped in the fallback: its slack keeps room for
    lengths longer than predicted, and held hard it refused overloaded fleets
    placements that never preempted (Azure trace on PD 2 + 4 at 24 req/s:
    60.8 % with the exact peak alone in every pass, 66.2 % before, 66.5 % so).
    As under binpack, an instance holding no request passes regardless
    (``empty_passes``): a request whose own prompt and expected output exceed
    the headroom of an idle instance's KV (a long prompt whose client sent a
    large ``max_tokens`` before any answer of its class was learned) is served
    alone there, where without it every such request waited until refused
    (2 idle instances with 8k of KV, 6k-token prompts: 5 of 20 refused).
    The exact peak is judged at the selector's best candidates only
    (``at_best``): its column, rebuilt after every placement, was most of
    what the promise added to a decision, and the sums' bound beside it
    keeps nearly every instance it would drop.
    """
    return [
        _kv_fits(config, metric="kv_peak_exact", empty_passes=True, at_best=True),
        _kv_fits(config, label="kv_all_alive", droppable=True),
    ]


#: The decode stage's TPOT: with the wait for a running slot on a full engine spread over the answer.
_DECODE_TPOT = "predicted_tpot_after_slot_wait"


def _slot_free() -> dict[str, Any]:
    """A bin ends at its engine's sequence cap: an instance running ``max_num_seqs`` requests is full
    whatever room its KV and TPOT leave (``slot_wait_ms`` is 0 exactly where a slot is free; "below half
    a millisecond" is that). Held in every pass; an empty instance passes.

    Packing (best fit, adaptive PD's fullest decoder first) otherwise filled the engine queue of the
    fullest instance while others had free slots, behind completions the router can only guess:
    under ``binpack`` 4 neutral 4-sequence engines, chat at 1 req/s, met 97.2 % against slo's 100 (TTFT
    p99 2.0 s) and 2 + 2 P/D with 4-sequence decoders 20 % against 99.4 (docs/papers.md, Seed 001);
    under ``adaptive-pd`` the same P/D fleet met 16.8 % (docs/real-traces.md, Decoders at their cap).
    Engines of 256 sequences seldom reach it: the fixed-fleet and plan rows did not move.
    """
    return {
        "name": "metric_threshold",
        "metric": "slot_wait_ms",
        "limit": _packing.SLOT_FREE_MS,
        "label": "slot_free",
        "empty_passes": True,
    }


def _slo(config: SchedulerConfig) -> dict[str, Any]:
    # Decode also keeps KV over life (_kv_promise) and the safety valve; only the valve and the
    # sums' bound are droppable: when every instance meeting the TPOT target is over-packed, the
    # fallback places as plain slo would, onto one whose KV still holds its requests' life.
    return {
        # Among the instances that meet the TTFT target, the prompt goes where it costs the fleet the
        # least work (its longest cached prefix), then the lowest TTFT: spreading a prefix over the
        # fleet to shave a TTFT already within target spends the capacity later requests need. Without
        # cache knowledge every instance computes the whole prompt, and the TTFT decides as before.
        "prefill": {
            "filters": [*HEALTH, _ttft(), "failover"],
            "selector": _lowest("prompt_compute_tokens", "predicted_ttft"),
        },
        # A leg that finds its decoder at the engine's sequence cap waits for a slot before its
        # second token: the TPOT target is judged with that wait spread over the answer
        # (metrics.predicted_tpot_after_slot_wait; predicted_tpot itself where no engine is full).
        "decode": {
            "filters": [
                *HEALTH,
                _tpot(metric=_DECODE_TPOT, label="metric_threshold:predicted_tpot"),
                *_kv_promise(config),
                _not_overpacked(droppable=True),
                "failover",
            ],
            "selector": _lowest(_DECODE_TPOT),
        },
        # A colocated instance runs this prompt's prefill chunks between the decode steps of every
        # request already there: besides its own TPOT, the placement must keep theirs.
        "neutral": {
            "filters": [
                *HEALTH,
                _ttft(),
                _tpot(),
                _residents(),
                *_kv_promise(config),
                "failover",
            ],
            "selector": _lowest("prompt_compute_tokens", "predicted_ttft", "predicted_tpot"),
        },
    }


_builtin("slo", _slo)


def _adaptive_pd(config: SchedulerConfig) -> dict[str, Any]:
    return {
        "adaptive_pd": True,
        # The promises hold in every pass, as under slo: a request no instance can take within its
        # TTFT target (prefill), its TPOT target or its KV over life (decode) gets no placement and
        # waits in the router queue (is refused without one). Placing it anyway in overload put
        # prefill chunks on decoders and decode past its KV, stalling every co-resident decode
        # (docs/user-guide.md, packing). Prefill goes to a decode-idle instance while one exists.
        "prefill": {
            "filters": [
                *HEALTH,
                {"name": "exclude_reserved", "reserve": "decode", "relax_pass": 2},
                _ttft(),
                "decode_idle",
                "failover",
            ],
            "selector": _lowest("predicted_ttft", "-reserved_prefill"),
        },
        # Decode is bin-packed, but only onto instances that keep their promises over the life of
        # their requests: TPOT now (admission) and at the γ horizon (bin-packing target), KV over
        # life, and not over-packed. Pass 1 drops the γ horizon (the selector then opens a
        # decode-idle instance, or fills the fullest decoder still within the admission target);
        # pass 2 also the reserve and the valve. The prefill-room guard (and the decode-set size it
        # applies, adaptive_pd.DecodeShare) holds in every pass: relaxed in overload, it opened
        # decoders and fed the ones draining back to prefill, so the prefill side shrank on a fleet
        # whose bottleneck was prefill (docs/results.md, adaptive PD in overload); the request waits instead.
        "decode": {
            "filters": [
                *HEALTH,
                {"name": "exclude_reserved", "reserve": "prefill", "relax_pass": 2},
                _not_overpacked(relax_pass=2),
                {"name": "prefill_room"},
                # KV over life from each resident leg's progress (packing.kv_peak_exact): the sums'
                # bound, every resident at its final length at once, refused the long prompts of
                # overload that plain slo serves through its fallback pass (docs/user-guide.md, packing).
                _kv_fits(config, metric="kv_peak_exact"),
                # (As under slo: a full decoder's slot wait spread over the answer.)
                _tpot(metric=_DECODE_TPOT, label="metric_threshold:predicted_tpot"),
                _slot_free(),
                _tpot_horizon(config, droppable=True),
                "failover",
            ],
            "selector": {"name": "binpack", "keep_prefill_room": True},
        },
    }


_builtin("adaptive-pd", _adaptive_pd)


def _atgt_slack(config: SchedulerConfig, **extra: Any) -> dict[str, Any]:
    """Aladdin's (d): this prompt's prefill within θ of the least ATGT slack of the residents."""
    return {
        "name": "metric_threshold",
        "metric": "prefill_over_atgt_slack",
        "limit": config.binpack_theta,
        "label": "atgt_slack",
        **extra,
    }


def _binpack(config: SchedulerConfig) -> dict[str, Any]:
    """Aladdin's placement (seed 001, Algorithm 1): best fit by capacity_norm among the instances that
    meet every constraint, the constraints held as constraints.

    (b) TPOT at the γ horizon within θ (``binpack_theta``) of the least TPOT
    need of the requests the instance would hold, this one and its residents
    (``tpot_horizon``: each request's own target, or the pace its e2e deadline
    needs for the high quantile of its predicted length), (c)
    TTFT (``predicted_ttft``; on a colocated instance also within what is left
    of the request's own TTFT target, ``ttft_own``, which the bound a late
    request is offered no longer is), (d) on a colocated instance the prompt's
    prefill within θ of the residents' ATGT slack (``atgt_slack``), (e) KV
    over the life of the instance's requests (``kv_over_life``), and a free
    sequence slot on the engine (``slot_free``: a bin is full at its
    ``max_num_seqs``). None is
    droppable: when no instance meets them the request gets no placement and
    waits in the router queue (refused at once with ``--queue-policy none``),
    where the paper's scheduler would open a new bin. An instance holding no
    request is that new bin and passes every constraint (``empty_passes``):
    a request only an empty instance can take is served alone there rather
    than waiting for ever. Only the safety valve (``overpacked``: measured
    over target or preempting) is relaxed, in pass 2, when nothing else is
    left. ``slo`` holds TTFT, TPOT and (e) hard too, but not (b) at the
    horizon nor (d), and places by the lowest prediction, not best fit. With
    ``binpack_prefill_empty_bin`` off a PD prefill instance is no bin: (c)
    holds there as under ``slo``; on (the default) an empty one is a bin only
    for a request that has waited ``binpack_prefill_empty_bin_wait`` of its own
    TTFT target (see the return below).

    On a colocated instance a request judged by a TPOT target of its own also
    keeps it at the step with the measured interleaving of prompts
    (``tpot_own``), and best fit ranks first by the prompt tokens the instance
    would compute (``cached_first``: the longest cached prefix the router
    knows; constant without one), then by ``capacity_norm_life``: the
    paper's load (batch and context) with the context taken as the KV over the
    life of every request the instance holds, its prompts still in prefill
    included, where the decode context (``capacity_norm``, the decode stage's)
    counts only the requests decoding already (:mod:`router.core.packing`).
    """
    hard = {"empty_passes": True}
    # (e) as the paper writes it: the KV footprint at every future iteration (each resident leg
    # from its progress and expected remaining output, packing.kv_peak_exact), not every resident
    # at its final length at once (kv_peak_projected), which refused most of what a decoder could
    # hold (2,414 of 2,830 refusals of chat on 1 + 1 at 6 req/s).
    kv = _kv_fits(config, metric="kv_peak_exact", **hard)
    # On a decoder, (e) leaves the last share of the KV to requests whose first token cannot wait: one
    # judged by its e2e deadline alone is held within headroom² (packing.kv_peak_exact_yielding). Not
    # on colocated instances: there it cost 0.5-1.9 points on four fixed-fleet rows (docs/papers.md,
    # Seed 001).
    kv_decode = {**kv, "metric": "kv_peak_exact_yielding"}
    # (b) for every request the instance would hold: the γ-horizon TPOT within θ of the least TPOT
    # need of its residents and of this request (packing.tpot_horizon_over_need).
    horizon = {
        "name": "metric_threshold",
        "metric": "tpot_horizon_over_need",
        "limit": config.binpack_theta,
        "label": "tpot_horizon",
        **hard,
    }
    # (b) on a colocated instance: a deadline-paced resident already out of reach of its deadline
    # sets no bound (packing.tpot_horizon_over_need_live); before the fallback passes it does, as
    # (d)'s paced form bounds a paced resident behind its pace.
    horizon_live = {**horizon, "metric": "tpot_horizon_over_need_live"}
    horizon_lost = {**horizon, "label": "tpot_horizon_lost", "relax_pass": 1}
    # (c) at the request's own TTFT target as well, not only at the bound it is offered: the router
    # queue serves a request whose target it can no longer meet (late) best-effort under a looser
    # bound, and such a request is a miss wherever it goes. Aladdin's (c) admits none where its TTFT
    # SLO is out of reach and opens a new bin for it (Algorithm 1, line 12); here an empty instance
    # is that bin, and otherwise it lapses in the router queue (packing.predicted_ttft_over_own_budget).
    # Placed on loaded instances, such prompts spent the prefill and the residents' (d) slack the
    # on-time ones needed (support + summaries + codegen, seed 7170, 6 req/s: 10 late summaries,
    # 42,659 prompt tokens, none met; docs/papers.md, Seed 001). Below 1: the first token within
    # what is left of the target.
    ttft_own = {
        "name": "metric_threshold",
        "metric": "predicted_ttft_over_own_budget",
        "limit": 1.0,
        "label": "ttft_own",
        **hard,
    }
    decode = {
        "filters": [
            *HEALTH,
            _not_overpacked(relax_pass=2),
            _slot_free(),
            kv_decode,
            horizon,
            "failover",
        ],
        # Best fit, except for a request whose deadline is paced over its expected length because no
        # decoder keeps its cautious length's pace now: the decoder with the lowest step (selectors
        # ``_paced_short``). Decoders only: on colocated instances it moved the fixed-fleet rows by
        # -0.6 to +1.0 points, -1.0 in all, and no `plan` point (docs/papers.md, Seed 001).
        "selector": {"name": "binpack", "fastest_when_paced_short": True},
    }
    neutral = {
        "filters": [
            *HEALTH,
            # (c) with the prompt behind the step its instance's queued prompts are running.
            _ttft(metric="predicted_ttft_behind_step", label="metric_threshold:predicted_ttft", **hard),
            ttft_own,
            _not_overpacked(relax_pass=2),
            _slot_free(),
            kv,
            horizon_live,
            horizon_lost,
            _atgt_slack(config, **hard),
            # The request's own TPOT with the measured interleaving of the prompts to come, as slo
            # holds it: (b)'s step is the decode alone (packing.predicted_tpot_own).
            _tpot(metric="predicted_tpot_own", label="tpot_own", **hard),
            # (d) with a deadline-paced resident behind its pace bounding its instance, as the
            # paper's (d) bounds every ongoing request: the prompt goes to another bin (an empty
            # instance passes). Dropped from fallback pass 1 on (packing docstring).
            _atgt_slack(
                config,
                metric="prefill_over_atgt_slack_paced",
                label="atgt_slack_paced",
                relax_pass=1,
                **hard,
            ),
            "failover",
        ],
        # Best fit by the KV over life of all it holds, its prompts in prefill included
        # (packing.capacity_norm_life): on a colocated instance the decode context misses them.
        "selector": {"name": "binpack", "load": "capacity_norm_life", "cached_first": True},
    }
    # The empty-bin pass on a PD prefill instance opens only for a request that has waited
    # --binpack-prefill-empty-bin-wait (half) of its own TTFT target; before that (c) holds there as
    # slo holds it. Aladdin's empty bin is a new instance for a request no loaded bin can take; on a
    # fixed fleet an idle prefill instance is the room the router queue's TTFT bound (release control,
    # a yielding or late entry's bound) keeps for tighter traffic. Opened at once, a loose review on
    # sa-review-complete-chat (PD 2 + 4, 9 req/s) began a 3,000-token prefill on the idle instance and
    # the 300 ms-TTFT short answers arriving next shared its 2,048-token steps (first token 310 ms
    # against 105 predicted). Never opened (--no-binpack-prefill-empty-bin), the held e2e-only prompts
    # of an overloaded fleet (pd-autofill-summary-chat at 12 req/s) wait for two idle prefill instances
    # that seldom come, turn late, and miss their deadline. A hold that has spent half the request's
    # own budget has kept the room as long as the request can afford: the rest is its own
    # (docs/papers.md, Seed 001).
    prefill_ttft = (
        _ttft(**hard, empty_after_wait=config.binpack_prefill_empty_bin_wait)
        if config.binpack_prefill_empty_bin
        else _ttft()
    )
    return {
        "prefill": {
            "filters": [*HEALTH, prefill_ttft, "failover"],
            # The paper schedules a prefill by its input length, the work it costs: among the prefill
            # instances meeting (c), the one that would compute the fewest prompt tokens (its longest
            # cached prefix), then the lowest TTFT; without cache knowledge the column is constant and
            # the TTFT decides as before.
            "selector": _lowest("prompt_compute_tokens", "predicted_ttft"),
        },
        "decode": decode,
        "neutral": neutral,
    }


_builtin("binpack", _binpack)

_builtin("round-robin", _same_everywhere([*HEALTH, "failover"], "round_robin"))
_builtin("random", _same_everywhere([*HEALTH, "failover"], "random"))
_builtin("least-requests", _same_everywhere([*HEALTH, "failover"], _lowest("num_requests")))
_builtin(
    "power-of-two",
    _same_everywhere([*HEALTH, "failover"], {"name": "power_of_two", "metric": "num_requests"}),
)


def _cache_affinity(config: SchedulerConfig) -> dict[str, Any]:
    """Pure cache affinity, the baseline prefix-aware ``slo`` is measured against: the prompt goes
    where the router knows the longest cached prefix beyond what most instances hold
    (``cache_affinity_tokens``: a prefix common to the fleet, or a fleet whose load has run out of
    balance, leaves the choice to load), ties to the fewest requests; no SLO filter. Decode (PD)
    has no prompt to reuse: fewest requests."""
    affinity = {
        "filters": [*HEALTH, "failover"],
        "selector": _lowest("-cache_affinity_tokens", "num_requests"),
    }
    return {
        "prefill": affinity,
        "decode": {"filters": [*HEALTH, "failover"], "selector": _lowest("num_requests")},
        "neutral": affinity,
    }


_builtin("cache-affinity", _cache_affinity)
