"""The scheduling core's configuration: one documented dataclass mirroring the router's flags.

Build it from parsed flags with :meth:`SchedulerConfig.from_namespace` (and add
the flags themselves with :meth:`SchedulerConfig.add_arguments`), or directly in
code and tests. Every field has a default, a unit in its name where it has one,
and a one-line doc (``field(metadata={"doc": ...})``) that doubles as the flag's
help. Invalid values raise :class:`router.core.errors.ConfigError` (a ``ValueError``)
naming the field.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from router.core.calibration import CALIBRATION_MODES
from router.core.errors import ConfigError
from router.core.prefix import PREFIX_ROUTING_MODES
from router.core.registry import METRICS, POLICIES

FAILOVER_DOMAINS = ("instance", "node", "unit", "node-unit")


def _doc(doc: str, flag: str | None = None) -> dict[str, Any]:
    return {"doc": doc, "flag": flag}


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the scheduling core reads from flags."""

    scheduling_policy: str = field(
        default="load-balance",
        metadata=_doc(
            "registered policy: load-balance, slo, binpack, round-robin, random, least-requests or "
            "power-of-two. binpack (Aladdin, seed 001) packs requests onto the fullest instances whose "
            "TTFT, TPOT at the packing horizon (for every request there: each keeps its own target, or the "
            "pace its e2e deadline needs for a long answer), prefill-vs-ATGT slack and KV over life "
            "constraints all hold; a request none admits waits in the router queue (run it with "
            "--queue-policy fcfs or edf; with none it is refused), and on colocated instances one that can "
            "no longer afford to wait is offered without theta's margin. Use it where the KV is short: it keeps "
            "its KV plan (at most a twentieth of least-requests' preemptions, up to 26 points above slo on "
            "KV-limited fleets) and slo-router plan needs fewer instances there; with ample KV and one "
            "TPOT-judged class it only ties slo and least-requests. Not for a target above 95 per cent with a class "
            "judged by its deadline alone whose answers run long-tailed: such a request is packed at the pace "
            "of its class's 90th-percentile length (its running answers counted as lower bounds), so the answers "
            "longer than that miss however large the fleet (plan --policy binpack may then find no fleet; slo "
            "spreads them). Near capacity on a P/D fleet whose decoders' KV binds it is 1.4-2.9 points under slo "
            "(best fit packs the decoders: residents stay longer and hold the KV later arrivals need); prefer slo "
            "on a small P/D fleet (2 + 2) whose prompts mostly share long (3k-token) prefixes, up to 2.9 points",
            "--scheduling-policy",
        ),
    )
    enable_adaptive_pd: bool = field(
        default=False,
        metadata=_doc(
            "with the slo policy: every instance may take either PD role per request", "--enable-adaptive-pd"
        ),
    )
    ttft_slo_ms: float = field(
        default=6000.0, metadata=_doc("default TTFT target (ms) when a request sets none", "--ttft-slo")
    )
    tpot_slo_ms: float = field(
        default=50.0, metadata=_doc("default TPOT target (ms) when a request sets none", "--tpot-slo")
    )
    ttft_slo_dispatch_threshold: float = field(
        default=1.0,
        metadata=_doc(
            "fraction of the TTFT target a predicted TTFT must stay below (ratio)",
            "--ttft-slo-dispatch-threshold",
        ),
    )
    tpot_slo_dispatch_threshold: float = field(
        default=1.0,
        metadata=_doc(
            "fraction of the TPOT target a predicted TPOT must stay below (ratio)",
            "--tpot-slo-dispatch-threshold",
        ),
    )
    instance_staleness_s: float = field(
        default=5.0,
        metadata=_doc(
            "an instance whose status is older than this (s) is skipped and fails over its domain",
            "--instance-staleness-seconds",
        ),
    )
    failover_domain: str = field(
        default="instance",
        metadata=_doc(
            "what an unschedulable or stale instance takes down with it: instance, node, unit or node-unit",
            "--failover-domain",
        ),
    )
    dispatch_top_k: int = field(
        default=1,
        metadata=_doc(
            "pick uniformly at random among the K best instances (1 = the best)", "--dispatch-top-k"
        ),
    )
    inflight_expiry_s: float = field(
        default=10.0,
        metadata=_doc(
            "a dispatch the instance never reports leaves the in-flight account after this long (s)",
            "--inflight-expiry-s",
        ),
    )
    dispatch_prefill_load_metric: str = field(
        default="prefill_backlog_tokens",
        metadata=_doc(
            "load-balance: metric minimised for the prefill stage", "--dispatch-prefill-load-metric"
        ),
    )
    dispatch_decode_load_metric: str = field(
        default="kv_usage_projected",
        metadata=_doc("load-balance: metric minimised for the decode stage", "--dispatch-decode-load-metric"),
    )
    dispatch_neutral_load_metric: str = field(
        default="prefill_backlog_tokens",
        metadata=_doc(
            "load-balance: metric minimised for the neutral stage", "--dispatch-neutral-load-metric"
        ),
    )
    dispatch_prefill_load_threshold: float | None = field(
        default=None,
        metadata=_doc(
            "load-balance: droppable limit on the prefill load metric (its unit; unset = none)",
            "--dispatch-prefill-load-threshold",
        ),
    )
    dispatch_decode_load_threshold: float | None = field(
        default=None,
        metadata=_doc(
            "load-balance: droppable limit on the decode load metric (its unit; unset = none)",
            "--dispatch-decode-load-threshold",
        ),
    )
    dispatch_neutral_load_threshold: float | None = field(
        default=None,
        metadata=_doc(
            "load-balance: droppable limit on the neutral load metric (its unit; unset = none)",
            "--dispatch-neutral-load-threshold",
        ),
    )
    default_max_num_batched_tokens: int = field(
        default=2048,
        metadata=_doc(
            "chunked-prefill budget (tokens per step) assumed for an instance whose metadata gives none",
            "--default-max-num-batched-tokens",
        ),
    )
    profile_label: str = field(
        default="profile",
        metadata=_doc(
            "instance metadata label naming its profile group (heterogeneous fleets)", "--profile-label"
        ),
    )
    tpot_packing_strictness: float = field(
        default=0.5,
        metadata=_doc(
            "packing: how far into their remaining output the decode contexts are projected when checking "
            "the TPOT target (Aladdin's gamma: 0 = now, 1 = the last token)",
            "--tpot-packing-strictness",
        ),
    )
    tpot_binpack_threshold: float = field(
        default=0.85,
        metadata=_doc(
            "packing: fraction of the TPOT target the TPOT projected at that horizon must stay below (ratio)",
            "--tpot-binpack-threshold",
        ),
    )
    kv_packing_headroom: float = field(
        default=0.95,
        metadata=_doc(
            "packing: fraction of an instance's KV capacity its projected peak over the life of its "
            "requests may reach (ratio)",
            "--kv-packing-headroom",
        ),
    )
    packing_default_output_tokens: int = field(
        default=256,
        metadata=_doc(
            "packing: output tokens assumed for a request that gives neither an expected length nor "
            "max_tokens, and for resident requests the router did not place",
            "--packing-default-output-tokens",
        ),
    )
    binpack_max_batch: int = field(
        default=256,
        metadata=_doc(
            "packing: decode batch that counts as a full instance in capacity_norm (requests)",
            "--binpack-max-batch",
        ),
    )
    binpack_theta: float = field(
        default=0.7,
        metadata=_doc(
            "binpack: Aladdin's theta, the share of the TPOT target its packing horizon (b) and of the "
            "residents' ATGT slack its prefill (d) may use (ratio in (0, 1]); below 1 to absorb output-length "
            "prediction error",
            "--binpack-theta",
        ),
    )
    binpack_prefill_empty_bin: bool = field(
        default=True,
        metadata=_doc(
            "binpack: an empty PD prefill instance passes the TTFT constraint (c) as an empty bin; off: "
            "(c) holds on the prefill stage as under slo, so the router queue's TTFT bounds keep loose "
            "prompts off the idle prefill instances a tight-TTFT class needs",
            "--binpack-prefill-empty-bin",
        ),
    )
    binpack_prefill_empty_bin_wait: float = field(
        default=0.5,
        metadata=_doc(
            "binpack: with --binpack-prefill-empty-bin, the share of its TTFT target (an e2e-only request's "
            "as derived from its deadline) a request has waited since arrival before an empty PD prefill "
            "instance takes it as an empty bin; until then (c) holds there as under slo (ratio in [0, 1]; "
            "0: at once)",
            "--binpack-prefill-empty-bin-wait",
        ),
    )
    binpack_theta_adapt: bool = field(
        default=True,
        metadata=_doc(
            "binpack: learn theta online from the finished requests' realized TPOT against their targets "
            "(Aladdin's theta adapts to the output-length prediction error), starting from --binpack-theta; "
            "off: --binpack-theta fixed",
            "--binpack-theta-adapt",
        ),
    )
    overpacked_tpot_factor: float = field(
        default=1.0,
        metadata=_doc(
            "safety valve: a decoder whose measured decode step exceeds this fraction of the TPOT target "
            "gets no new decode until it recovers (ratio)",
            "--overpacked-tpot-factor",
        ),
    )
    calibration: str = field(
        default="refit",
        metadata=_doc(
            "online calibration of the predictions from the workers' step samples: off, scale or refit",
            "--calibration",
        ),
    )
    calibration_update_every_s: float = field(
        default=0.0,
        metadata=_doc(
            "recompute an instance's calibration at most once per this many seconds (0: after every 4 "
            "new step samples). The refit is the calibration's main CPU cost: 0.25 s cut it by about "
            "two thirds per view in the router and a fifth of the simulator's CPU on 32-instance fleets at "
            "the same attainment, but lost up to 1.3 points on a 4-instance fleet",
            "--calibration-update-every-s",
        ),
    )
    prefix_cache_routing: str = field(
        default="auto",
        metadata=_doc(
            "what the router knows of the instances' prefix caches, for predicting TTFT from the tokens "
            "still to compute: exact (the engines' KV events), approximate (its own routing history), "
            "off (every prompt charged in full), auto (exact where the engines publish events, else "
            "approximate, which assumes the engines cache prefixes as vLLM does by default; `up` "
            "without --prefix-cache-block-tokens: off)",
            "--prefix-cache-routing",
        ),
    )
    prefix_block_tokens: int = field(
        default=256,
        metadata=_doc(
            "tokens per prefix block the router looks prompts up in; with exact routing a multiple of the "
            "engines' prefix-cache block (--prefix-chain-block-tokens)",
            "--prefix-block-tokens",
        ),
    )
    prefix_chain_block_tokens: int = field(
        default=0,
        metadata=_doc(
            "tokens per block of the engines' prefix cache, the block their KV events name: the router "
            "chains prompt hashes in these and looks up every block that ends on a --prefix-block-tokens "
            "boundary (which must be a multiple of it); 0 = the same as --prefix-block-tokens",
            "--prefix-chain-block-tokens",
        ),
    )
    prefix_index_max_blocks: int = field(
        default=65536,
        metadata=_doc(
            "bound on the prefix-block hashes the router keeps per instance (memory: this many entries "
            "times the instances)",
            "--prefix-index-max-blocks",
        ),
    )
    policy_config_path: str | None = field(
        default=None,
        metadata=_doc(
            "YAML file composing metrics, filters and selectors per stage (replaces the named policy)",
            "--policy-config",
        ),
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"{name}={getattr(self, name)!r}: {why}")

        if self.policy_config_path is None and self.scheduling_policy not in POLICIES:
            raise bad("scheduling_policy", f"unknown policy; registered: {', '.join(POLICIES.names())}")
        if self.enable_adaptive_pd and self.policy_config_path is None and self.scheduling_policy != "slo":
            raise bad("scheduling_policy", "adaptive PD needs the slo policy")
        for name in (
            "ttft_slo_ms",
            "tpot_slo_ms",
            "ttft_slo_dispatch_threshold",
            "tpot_slo_dispatch_threshold",
            "tpot_binpack_threshold",
            "binpack_theta",
            "kv_packing_headroom",
            "overpacked_tpot_factor",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise bad(name, "must be a finite number > 0")
        for name in ("instance_staleness_s", "inflight_expiry_s"):
            value = getattr(self, name)
            if not (value > 0):  # inf is allowed: never stale / never expires
                raise bad(name, "must be > 0 seconds")
        if self.failover_domain not in FAILOVER_DOMAINS:
            raise bad("failover_domain", f"must be one of {', '.join(FAILOVER_DOMAINS)}")
        if not (math.isfinite(self.tpot_packing_strictness) and 0.0 <= self.tpot_packing_strictness <= 1.0):
            raise bad("tpot_packing_strictness", "must be within [0, 1]")
        if self.kv_packing_headroom > 1.0:
            raise bad("kv_packing_headroom", "must be <= 1 (a fraction of the KV capacity)")
        if self.packing_default_output_tokens < 1:
            raise bad("packing_default_output_tokens", "must be >= 1 token")
        if self.binpack_theta > 1.0:
            raise bad("binpack_theta", "must be within (0, 1]")
        if not (0.0 <= self.binpack_prefill_empty_bin_wait <= 1.0):
            raise bad("binpack_prefill_empty_bin_wait", "must be within [0, 1]")
        if self.binpack_max_batch < 1:
            raise bad("binpack_max_batch", "must be >= 1 request")
        if self.dispatch_top_k < 1:
            raise bad("dispatch_top_k", "must be >= 1")
        if self.default_max_num_batched_tokens < 1:
            raise bad("default_max_num_batched_tokens", "must be >= 1 token")
        for stage in ("prefill", "decode", "neutral"):
            metric = getattr(self, f"dispatch_{stage}_load_metric")
            if metric not in METRICS:
                raise bad(
                    f"dispatch_{stage}_load_metric",
                    f"unknown metric; registered: {', '.join(METRICS.names())}",
                )
            limit = getattr(self, f"dispatch_{stage}_load_threshold")
            if limit is not None and math.isnan(limit):
                raise bad(f"dispatch_{stage}_load_threshold", "must be a number or unset")
        if not self.profile_label:
            raise bad("profile_label", "must not be empty")
        if self.calibration not in CALIBRATION_MODES:
            raise bad("calibration", f"must be one of {', '.join(CALIBRATION_MODES)}")
        every = self.calibration_update_every_s
        if isinstance(every, bool) or not (math.isfinite(every) and 0.0 <= every <= 3600.0):
            raise bad("calibration_update_every_s", "must be within [0, 3600] seconds")
        if self.prefix_cache_routing not in PREFIX_ROUTING_MODES:
            raise bad("prefix_cache_routing", f"must be one of {', '.join(PREFIX_ROUTING_MODES)}")
        if not 1 <= self.prefix_block_tokens <= 1 << 20:
            raise bad("prefix_block_tokens", "must be within [1, 1048576] tokens")
        chain = self.prefix_chain_block_tokens
        if not 0 <= chain <= 1 << 20 or (chain and self.prefix_block_tokens % chain):
            raise bad(
                "prefix_chain_block_tokens",
                f"must be 0 or divide prefix_block_tokens ({self.prefix_block_tokens}) evenly",
            )
        if not 1 <= self.prefix_index_max_blocks <= 1 << 24:
            raise bad("prefix_index_max_blocks", "must be within [1, 16777216] blocks")

    @classmethod
    def doc(cls, name: str) -> str:
        """The one-line doc of field ``name``."""
        for f in fields(cls):
            if f.name == name:
                return str(f.metadata.get("doc", ""))
        raise KeyError(name)

    @classmethod
    def flags(cls) -> dict[str, str]:
        """Field name -> the command-line flag that sets it (``ttft_slo_ms`` -> ``--ttft-slo``)."""
        return {f.name: f.metadata["flag"] for f in fields(cls) if f.metadata.get("flag")}

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (``--ttft-slo``, ``--failover-domain``, ...), helped by its doc."""
        for f in fields(cls):
            flag = f.metadata.get("flag")
            if flag is None:
                continue
            help_text = f"{f.metadata['doc']} (default: %(default)s)"
            if f.type in ("bool", bool):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
                )
                continue
            kind: Any = {"float": float, "int": int, "float | None": float}.get(str(f.type), str)
            choices = {
                "failover_domain": FAILOVER_DOMAINS,
                "calibration": CALIBRATION_MODES,
                "prefix_cache_routing": PREFIX_ROUTING_MODES,
            }.get(f.name)
            parser.add_argument(flag, type=kind, default=f.default, choices=choices, help=help_text)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, **overrides: Any) -> SchedulerConfig:
        """Build from parsed flags: each field reads the attribute its flag stores into.

        Attributes missing from ``ns`` keep their defaults; ``overrides`` win over both.
        """
        values: dict[str, Any] = {}
        for f in fields(cls):
            flag = f.metadata.get("flag")
            dest = flag.lstrip("-").replace("-", "_") if flag else f.name
            if hasattr(ns, dest):
                values[f.name] = getattr(ns, dest)
        values.update(overrides)
        return cls(**values)


def name_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with every config field name in ``flags`` replaced by its command-line flag.

    Config objects name their fields in errors (``tpot_slo_ms=-5.0: ...``); a
    command line should name the flag the user typed (``--tpot-slo=-5.0: ...``).
    Works for any config whose fields map to flags (see :meth:`SchedulerConfig.flags`).
    """
    if not flags:
        return message
    names = sorted(flags, key=len, reverse=True)  # longest first: no field is cut by a shorter one
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    return pattern.sub(lambda m: flags[m.group(1)], message)
