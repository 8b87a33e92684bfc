"""``slo-router schedule`` against a real router on loopback (the command runs in a thread: it has its own loop)."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.cli import main
from tests.router.e2e.cluster import embedded_cluster


async def _schedule(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_schedule_prints_the_choice_and_the_most_telling_candidates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with embedded_cluster(prefill=2, decode=2) as cluster:
        await cluster.wait_for_instances(4)
        target = cluster.router.address
        code, out, err = await _schedule(capsys, "--target", target, "--prompt-tokens", "700", "--top", "1")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == "policy slo, mode pd"
        chosen = {line.split()[0]: line.split()[1] for line in lines[1:3]}
        assert set(chosen) == {"prefill", "decode"}
        assert "predicted TTFT" in lines[1] and "ms" in lines[1]
        # --top 1: exactly the chosen instance of each stage, marked.
        rows = [line.split() for line in lines[5:]]
        assert [(r[0], r[1], r[2]) for r in rows] == [
            ("prefill", chosen["prefill"], "*"),
            ("decode", chosen["decode"], "*"),
        ]
        # Nothing was recorded by the dry run.
        assert not cluster.router.scheduler.inflight

        code, out, err = await _schedule(capsys, "--target", target, "--explain", "--json")
        assert code == 0, err
        response = json.loads(out)
        assert len(response["trace"]) == 4  # every candidate of both stages
        assert sum(1 for t in response["trace"] if t.get("selected")) == 2


async def test_schedule_says_where_a_request_no_instance_may_take_would_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with embedded_cluster(neutral=1) as cluster:
        await cluster.wait_for_instances(1)
        # A 1 ms TTFT target no instance is predicted to meet: the router queue would hold it.
        code, out, err = await _schedule(
            capsys, "--target", cluster.router.address, "--prompt-tokens", "2000", "--ttft-ms", "1"
        )
        assert code == 0, err
        assert out.startswith(
            "no instance may take it now: it would wait in the router queue behind 0 requests"
        )
        assert "predicted_ttft" in out


async def test_schedule_names_the_problem_when_the_router_refuses_or_is_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with embedded_cluster(neutral=1) as cluster:
        await cluster.wait_for_instances(1)
        code, _, err = await _schedule(capsys, "--target", cluster.router.address, "--model", "no-such-model")
        assert code == 1
        assert err.startswith("error: the router refused the request (INVALID_ARGUMENT)")
        assert "no-such-model" in err
    # Nothing listens on port 1 of loopback.
    code, _, err = await _schedule(capsys, "--target", "127.0.0.1:1", "--timeout-s", "2")
    assert code == 1
    assert "no answer from a router at 127.0.0.1:1" in err and "--target" in err
