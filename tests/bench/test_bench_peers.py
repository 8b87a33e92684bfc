"""`python -m bench peers`: a missing peer is skipped with a message saying how to install it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_peers
from router.cli import build_parser


@pytest.mark.parametrize("kind", ["vllm-router", "smg"])
def test_a_missing_peer_names_the_make_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setattr(bench_peers, "PEER_VENV", tmp_path / "no-such-venv")
    why = bench_peers.peer_missing(kind)
    assert why is not None
    assert kind in why and "make peers-venv" in why


def test_this_router_is_never_missing() -> None:
    assert bench_peers.peer_missing("ours") is None


def test_every_router_kind_is_known() -> None:
    assert {r.kind for r in bench_peers.ROUTERS} == {"ours", "vllm-router", "smg"}
    assert len({r.name for r in bench_peers.ROUTERS}) == len(bench_peers.ROUTERS)


def _row(name: str, attainment: float, cpu_ms: float) -> dict[str, object]:
    return {"router": name, "slo_attainment": attainment, "router_cpu_ms_per_request": cpu_ms}


def test_readme_figures_compare_the_best_of_each_side_and_name_every_cpu_figure() -> None:
    rows = [
        _row("slo-router slo", 0.667, 28.1),
        _row("slo-router load-balance", 0.57, 26.0),
        _row("vllm-router power_of_two", 0.701, 8.0),
        _row("smg power_of_two", 0.73, 9.7),
    ]
    attainment, cpu = bench_peers._figures(rows)
    assert "slo-router slo 66.7 %" in attainment.measured
    assert "best peer (smg power_of_two) 73.0 %" in attainment.measured
    # Each of this router's policies by name (the cheapest one alone read as if it were slo's).
    assert cpu.measured == "slo-router slo 28.1 ms, load-balance 26.0 ms; peers 8.0-9.7 ms"
    assert bench_peers._figures(rows[:2]) == []


def test_every_configuration_of_this_router_is_one_the_router_command_accepts() -> None:
    parser = build_parser()
    ours = [r for r in bench_peers.ROUTERS if r.kind == "ours"]
    assert {"slo-router slo", "slo-router slo+qlm", "slo-router slo+sa"} <= {r.name for r in ours}
    for spec in ours:
        args = parser.parse_args(
            ["router", "--cms", "grpc://127.0.0.1:1", "--http-listen", "127.0.0.1:0", *spec.args]
        )
        assert args.scheduling_policy in ("slo", "load-balance")
        if "--queue-policy" in spec.args:
            assert args.queue_policy == spec.args[spec.args.index("--queue-policy") + 1]


def test_each_request_carries_the_cap_and_a_stop_string_that_ends_the_sim_answer_at_its_length() -> None:
    """Every router sees only the cap; the sim worker (the byte tokenizer, seed 0) stops each answer
    at its planned length, so every router's fleet generates the same tokens (without the stop
    string every answer ran to the cap: three times the planned tokens)."""
    from engine.outputs import output_text, prompt_digest, request_key
    from engine.tokenizer import encode
    from workload.spec import iter_requests, load_workload

    spec = load_workload("mixed").with_arrival(rate_per_s=9.0)
    plans = list(iter_requests(spec, 0, max_requests=60))
    shorter = 0
    for plan in plans:
        body = bench_peers._body(plan)
        assert body["max_tokens"] == plan.max_tokens or "stop" not in body
        length = plan.true_output_tokens
        if length >= plan.max_tokens:
            assert "stop" not in body
            continue
        shorter += 1
        (stop,) = body["stop"]
        key = request_key(0, prompt_digest(encode(body["prompt"])))
        text = output_text(key, plan.max_tokens)
        assert text.find(stop) + len(stop) == length
    assert shorter > 30


def test_held_back_requests_are_judged_by_the_same_request_in_the_peers_run() -> None:
    from bench import bench_peers_prefix
    from workload.report import RequestResult
    from workload.spec import SloTarget

    slo = SloTarget(ttft_ms=1000.0, tpot_ms=50.0)

    def result(index: int, ttft_ms: float, tpot_ms: float = 40.0) -> RequestResult:
        return RequestResult(
            index=index, class_name="c", slo=slo, prompt_tokens=10, max_tokens=10, completion_tokens=10,
            ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=ttft_ms + 9 * tpot_ms,
        )  # fmt: skip

    ours = [result(0, 300.0), result(1, 7000.0), result(2, 30000.0), result(3, 6001.0)]
    # The peer met request 1 and 0, missed 2 on TTFT and 3 on TPOT; request 3 is 1 ms past the margin.
    peer = [result(0, 200.0), result(1, 400.0), result(2, 1500.0), result(3, 300.0, tpot_ms=60.0)]
    assert bench_peers_prefix.held_back_against(ours, peer) == (3, 1, 0)
    assert bench_peers_prefix.held_back_against(ours[:1], peer) == (0, 0, 0)


def test_peers_prefix_runs_routers_in_the_order_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import bench_peers_prefix as prefix

    def order(only: str) -> list[str]:
        monkeypatch.setenv("BENCH_PEERS_ONLY", only)
        return [r.name for r in prefix.in_named_order(bench_peers.selected(prefix.ROUTERS))]

    assert order("slo cache exact,smg cache_aware,slo cache approx") == [
        "slo-router slo cache exact",
        "smg cache_aware",
        "slo-router slo cache approx",
    ]
    # One part naming several keeps their order in ROUTERS.
    assert order("smg cache_aware,slo cache") == [
        "smg cache_aware",
        "slo-router slo cache approx",
        "slo-router slo cache exact",
    ]
