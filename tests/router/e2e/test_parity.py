"""Parity: one seeded workload through the simulator and through the real router over sim workers.

For every registered dispatcher (``slice``: ``--dispatch-mode slice``) the same plans (arrival times, prompts, lengths, SLOs) run
twice: in virtual time (:func:`sim.cluster.simulate`) and live (an embedded CMS, two neutral sim
workers at ``speed_factor`` :data:`SPEED` and the router, real gRPC on loopback, replayed by the load
generator). What must agree:

- deterministic: a request completed in both has the same number of tokens (every dispatcher,
  whatever it paused or resumed);
- with wall-clock noise (the live run pays gRPC and event-loop time the simulator does not
  model, and its view lags the workers by a status push, so a placement near a threshold may
  go the other way): the same outcome (completed, or refused with the same status code) for
  all but :data:`TOLERANCE` of the requests, and SLO attainment within :data:`TOLERANCE`.

Attainment is compared on what the dispatcher decides, not on the host's speed: a request the
simulation puts within :data:`NEAR` of one of its targets is a near call that a millisecond of
host noise flips, so it is left out of the comparison; and the live run is judged against its
targets stretched by the host's slowdown (the median live/simulated ratio of each latency over
the requests both completed, never below 1), so a host that runs the engines uniformly slower
than their model (a loaded CI machine: every stream a third slower) does not read as the
dispatcher missing SLOs. Both are printed.
"""

from __future__ import annotations

import dataclasses
import random
import statistics

import pytest

from bench.loadgen import LoadConfig, run_load
from router.core.dispatch import DISPATCHERS
from router.core.queue import QueueConfig
from router.core.slicing import SliceConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.slicing import simulate_slices
from tests.router.e2e.cluster import embedded_cluster, sim_config
from tests.sim.test_simulate import policy
from workload.report import RequestResult, slo_met
from workload.spec import RequestPlan, SloTarget

#: Largest difference in SLO attainment (fraction of requests) between the live run and the simulator.
TOLERANCE = 0.15
#: Engines at their profile's speed: engine time, not the live run's gRPC and event-loop time (a
#: few ms a request on a loaded host), decides the latencies, and the router predicts them right.
SPEED = 1.0
#: Targets an idle instance meets and a queue of a few requests on one instance misses.
CHAT = SloTarget(ttft_ms=400.0, tpot_ms=25.0)
BATCH = SloTarget(e2e_ms=6000.0)


def plans(seed: int = 7, n: int = 24) -> list[RequestPlan]:
    """A small mixed workload with bursts (the same for both runs)."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    for k in range(n):
        t += rng.choice((0.005, 0.1, 0.2))
        chat = k % 3 != 0
        out.append(
            RequestPlan(
                index=k,
                arrival_s=t,
                class_name="chat" if chat else "batch",
                prompt_tokens=rng.randint(128, 1024),
                max_tokens=rng.randint(16, 48),
                slo=CHAT if chat else BATCH,
                prompt_seed=seed * 1000 + k,
                priority=1 if chat else 0,
            )
        )
    return out


#: A simulated latency within this fraction of its target is a near call (left out of the comparison).
NEAR = 0.10
#: The latencies an SLO can judge, by the name of their target in :class:`SloTarget`.
LATENCIES = ("ttft_ms", "tpot_ms", "e2e_ms")


def attainment(results: tuple[RequestResult, ...] | list[RequestResult]) -> float:
    return sum(slo_met(r) for r in results) / len(results)


def near_call(r: RequestResult) -> bool:
    """Whether one of ``r``'s latencies lies within :data:`NEAR` of its target."""
    for name in LATENCIES:
        target, value = getattr(r.slo, name), getattr(r, name)
        if target is not None and value is not None and abs(value / target - 1.0) < NEAR:
            return True
    return False


def host_slowdown(simulated: list[RequestResult], live: list[RequestResult]) -> dict[str, float]:
    """Per latency, the median live/simulated ratio over the requests both completed (at least 1)."""
    out = {}
    for name in LATENCIES:
        ratios = [
            getattr(r, name) / getattr(s, name)
            for s, r in zip(simulated, live, strict=True)
            if s.ok and r.ok and getattr(s, name) and getattr(r, name) is not None
        ]
        out[name] = max(1.0, statistics.median(ratios)) if ratios else 1.0
    return out


def met_within(r: RequestResult, slowdown: dict[str, float]) -> bool:
    """:func:`slo_met` against ``r``'s targets stretched by ``slowdown``."""
    if not r.ok:
        return False
    for name in LATENCIES:
        target, value = getattr(r.slo, name), getattr(r, name)
        if target is None:
            continue
        if value is None:
            if name != "tpot_ms":  # fewer than two tokens: no TPOT to judge
                return False
        elif value > target * slowdown[name]:
            return False
    return True


#: Live runs at most per dispatcher: a second only when the first disagrees with the simulation.
LIVE_TRIES = 2


async def live_results(
    name: str, workload: list[RequestPlan], queue: QueueConfig, slicing: SliceConfig | None
) -> tuple[RequestResult, ...]:
    """``workload`` through the real router over two sim workers (loopback gRPC)."""
    async with embedded_cluster(
        neutral=2,
        queue=queue,
        slice_config=slicing,
        dispatch_mode="auto" if name == "auto" else "",
        engine_overrides={"speed_factor": SPEED},
        scheduler_overrides={"calibration": "off"},
    ) as cluster:
        return (
            await run_load(
                workload,
                LoadConfig(target=cluster.router.address, request_timeout_s=30.0),
                channel=cluster.channel,
            )
        ).results


def compare(
    name: str, simulated: tuple[RequestResult, ...], live: tuple[RequestResult, ...]
) -> tuple[list[str], str]:
    """What the live run broke of :data:`TOLERANCE` (empty: it agrees), and a line describing it.

    Deterministic disagreements (a completed request of another length) fail at once.
    """
    assert len(live) == len(simulated)
    same = 0
    for s, r in zip(simulated, live, strict=True):
        if s.ok and r.ok:
            assert s.completion_tokens == r.completion_tokens, (name, s.index)
        same += s.error_code == r.error_code
    # Attainment over the requests the simulation does not put on a threshold, the live run
    # judged with the host's slowdown taken out (module docstring).
    slowdown = host_slowdown(list(simulated), list(live))
    clear = [k for k, s in enumerate(simulated) if not near_call(s)]
    assert len(clear) >= len(simulated) // 2, "the workload is mostly near calls: it tests nothing"
    sim_met = sum(slo_met(simulated[k]) for k in clear)
    live_met = sum(met_within(live[k], slowdown) for k in clear)
    apart = [
        (s.index, s.error_code, r.error_code)
        for s, r in zip(simulated, live, strict=True)
        if s.error_code != r.error_code
    ]
    line = (
        f"{name}: same outcome {same}/{len(simulated)} (apart: index, simulated, live {apart}),"
        f" attainment simulated {attainment(simulated):.2f}, live {attainment(live):.2f};"
        f" over {len(clear)} clear calls simulated {sim_met / len(clear):.2f}, live {live_met / len(clear):.2f}"
        " with the host's slowdown " + ", ".join(f"{k} {v:.2f}x" for k, v in slowdown.items())
    )
    broken = []
    if same < (1 - TOLERANCE) * len(simulated):
        broken.append("outcomes")
    # Compared in calls, not as fractions: 3 of 20 calls is the tolerance exactly, and as floats
    # (0.60 against 0.75) their difference came out at 0.15000000000000002 and failed it.
    if abs(sim_met - live_met) > TOLERANCE * len(clear) + 1e-9:
        broken.append("attainment")
    return broken, line


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", DISPATCHERS.names())
async def test_simulator_and_live_router_agree(name: str) -> None:
    """The live run agrees with the simulation within :data:`TOLERANCE`, in one of :data:`LIVE_TRIES` runs.

    A second live run is for the host, not the dispatcher: on a machine whose two cores also run
    other work, the event loops of the router, the workers and the load generator stall for tens
    of milliseconds, a dispatch pass comes that much later and a chat request placed at 200 ms in
    the simulation waits past its 400 ms TTFT deadline and is refused (``qlm``, 4 busy loops on 2
    cores: 1-3 of 24 outcomes apart in 8 of 12 runs, the same before and after the policy's last
    change; one CI run 4 of 24). A dispatcher whose decisions differ between the two drivers
    disagrees in both runs.
    """
    workload = plans()
    fleet = SimFleet(fleet_from_counts(neutral=2, engine=sim_config(speed_factor=SPEED)))
    # Calibration off in both: live, it learns the host's own overhead per step (a loaded machine's
    # steps run slower than the engine's model), which is wall-clock noise, not the dispatcher.
    config = dataclasses.replace(policy("slo"), calibration="off")
    slicing: SliceConfig | None = None
    if name == "slice":  # --dispatch-mode slice (simulate --dispatch-modes slice)
        queue = QueueConfig()
        slicing = SliceConfig()
        simulated = simulate_slices(fleet, workload, slicing).results
    elif name == "auto":  # --dispatch-mode auto: its pilot outlasts this workload, so edf throughout
        queue = QueueConfig()
        slicing = SliceConfig()
        simulated = simulate(
            fleet, config, workload, queue=queue, slicing=slicing, dispatch_mode=name
        ).results
    else:
        queue = QueueConfig(queue_policy=name)
        simulated = simulate(fleet, config, workload, queue=queue).results
    assert len(simulated) == len(workload)
    lines = []
    for _ in range(LIVE_TRIES):
        broken, line = compare(name, simulated, await live_results(name, workload, queue, slicing))
        print(line)
        lines.append(line)
        if not broken:
            return
    pytest.fail(
        f"live and simulated runs disagree beyond {TOLERANCE:.0%} ({', '.join(broken)}):\n" + "\n".join(lines)
    )
