"""The fewest instances any placement could serve a load with: its fluid demand at full use.

For each ``WORKLOAD:RATE[:SEED[:KV]]`` (a preset, a mix, or ``trace:FILE`` with its gaps scaled to
RATE; ``--num-requests`` = 60 × RATE by default, as the steady-state ``plan`` grid draws them), the
mean prompt and answer of the seeded requests, and the instances they keep busy when every prefill
instance runs full chunks all the time and every decoder runs the batch with the most tokens a
second whose step keeps the TPOT target (``router.core.capacity.instance_rates`` with no
utilisation cap and the whole KV). No placement serves the load on fewer: a count below the
figure leaves work that no instance has time for, whatever goes where.

    python scripts/fluid_bound.py mixed:12:17 chat:16:23 trace:../shared/traces/azure-conv-2023.csv:24

Read against ``slo-router plan``: where the planned count is the bound rounded up, no policy can
save an instance there; where it is well above, the fleet is sized by latency (queues, prefill
stalls beside decodes), which is where placement can matter.

``--step-ms S`` adds the requests judged end to end whose deadline their own prompt and answer
cannot keep: the prompt's prefill alone plus one decode step per further token, on an idle
instance (batch 1) and at a step of S ms (a loaded fleet's, e.g. its measured TPOT p50). Those
miss wherever they go once every instance steps at S: a floor on the misses of that fleet.
"""

from __future__ import annotations

import argparse

from engine.model import SimConfig
from router.core.capacity import LoadShape, fluid_demand, instance_rates
from router.core.config import SchedulerConfig
from sim.cluster import SimFleet
from sim.fleet import fleet_from_counts
from sim.sweep import open_loop
from workload.spec import generate_requests, load_workload
from workload.traces import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("points", nargs="+", metavar="WORKLOAD:RATE[:SEED[:KV]]")
    parser.add_argument("--num-requests", type=int, help="requests drawn per point (default: 60 x the rate)")
    parser.add_argument(
        "--step-ms",
        type=float,
        help="also count the e2e-judged requests too long for their deadline at this decode step (ms)",
    )
    args = parser.parse_args()
    if args.step_ms is not None and not (0 < args.step_ms < 1e5):
        parser.error(f"--step-ms {args.step_ms}: must be within (0, 1e5) ms")
    predictor = SimFleet(fleet_from_counts(neutral=1)).predictors.default
    tpot_ms = SchedulerConfig().tpot_slo_ms
    for point in args.points:
        head, sep, tail = point.partition("trace:")
        text = tail if sep else head
        fields = text.split(":")
        if len(fields) < 2:
            parser.error(f"{point!r}: expected WORKLOAD:RATE[:SEED[:KV]]")
        name = ("trace:" + fields[0]) if sep else fields[0]
        try:
            rate = float(fields[1])
            seed = int(fields[2]) if len(fields) > 2 else 0
            kv = int(fields[3]) if len(fields) > 3 else SimConfig().kv_capacity_tokens
        except ValueError:
            parser.error(f"{point!r}: RATE must be a number, SEED and KV whole numbers")
        if not (0 < rate < 1e6) or kv < 1:
            parser.error(f"{point!r}: RATE must be within (0, 1e6) req/s and KV >= 1 token")
        n = args.num_requests or max(int(60 * rate), 1)
        if n < 1:
            parser.error(f"--num-requests {n}: must be >= 1")
        if sep:
            plans = load_trace(name).plans(n, rate)
        else:
            spec = open_loop(load_workload(name)).with_arrival(rate_per_s=rate)
            plans = generate_requests(spec, rng=seed, num_requests=n)
        prompt = sum(p.prompt_tokens for p in plans) / len(plans)
        output = sum(p.true_output_tokens for p in plans) / len(plans)
        rates = instance_rates(
            predictor,
            mean_prompt_tokens=prompt,
            mean_output_tokens=output,
            tpot_target_ms=tpot_ms,
            kv_capacity_tokens=float(kv),
            kv_headroom=1.0,
            prefill_utilisation=1.0,
        )
        prefill, decode = fluid_demand(LoadShape(rate, prompt, output), rates)
        print(
            f"{name} @ {rate:g} req/s (seed {seed}, KV {kv}): prompt {prompt:.0f}, answer {output:.0f} tokens; "
            f"decoder batch {rates.decode_batch} at {rates.decode_step_ms:.1f} ms a step; at full use "
            f"{prefill:.2f} prefill + {decode:.2f} decode instances, {prefill + decode:.2f} neutral",
            flush=True,
        )
        if args.step_ms is not None:
            judged = [p for p in plans if p.slo.e2e_ms]
            idle = at_step = 0
            for p in judged:
                prefill_ms = float(predictor.ttft_profile.grid(float(p.prompt_tokens)))
                steps = max(p.true_output_tokens - 1, 0)
                alone = float(predictor.predict_tpot_ms(1.0, float(p.prompt_tokens + p.true_output_tokens)))
                idle += prefill_ms + steps * alone > (p.slo.e2e_ms or 0.0)
                at_step += prefill_ms + steps * args.step_ms > (p.slo.e2e_ms or 0.0)
            print(
                f"  judged end to end: {len(judged)} of {len(plans)}; past their deadline on an idle instance "
                f"{idle}, at a {args.step_ms:g} ms step {at_step}",
                flush=True,
            )


if __name__ == "__main__":
    main()
