"""`slo-router profile` against a live sim worker reproduces the profile the worker runs with."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from predictor import LatencyPredictor
from workers.profile import ProfilePlan, profile_worker, write_profiles

from .conftest import StartWorker
from .helpers import PREDICTOR


async def test_profiling_a_sim_worker_reproduces_its_profile(
    start_worker: StartWorker, tmp_path: Path
) -> None:
    # Steps run 1.5x faster than the profile; the smallest measured step (~70 ms) keeps the
    # fixed cost of a loopback gRPC call (a few ms on a busy 2-core machine) inside the 10%.
    speed = 1.5
    server = await start_worker(speed_factor=speed)
    plan = ProfilePlan(
        tokens=(512, 1024, 2048),
        batch_sizes=(1, 4),
        tokens_per_request=(128, 1024),
        repeats=5,
        decode_tokens=12,
    )
    progress = io.StringIO()
    ttft, tpot = await profile_worker(server.address, plan, progress_stream=progress)
    ttft_path, tpot_path = write_profiles(tmp_path / "measured", ttft, tpot)

    measured = LatencyPredictor.from_files(ttft_path, tpot_path)  # valid for the predictor
    # Not a terminal: short lines, one per measured point and one at the end, no carriage returns.
    lines = progress.getvalue().splitlines()
    assert "\r" not in progress.getvalue() and progress.getvalue().endswith("\n")
    total = 1 + 3 * 5 + 2 * 2 * 5
    assert lines[0] == f"profiling 1/{total}: warm-up" and lines[-1].startswith(
        f"profiling {total}/{total}: "
    )
    assert len(lines) == 1 + 3 + 2 * 2 + 1 and all(len(line) < 60 for line in lines)
    doc = json.loads(ttft_path.read_text())
    assert doc["metadata"]["model"] == "sim" and doc["metadata"]["timestamp"].endswith("Z")
    assert set(doc["results"][0]) == {"tokens_num", "mean", "p50", "p95", "p99"}
    for n in plan.tokens:
        expected = float(PREDICTOR.ttft_profile.grid(float(n))) / speed
        assert float(measured.ttft_profile.grid(float(n))) == pytest.approx(expected, rel=0.1), n
    for b in plan.batch_sizes:
        for t in plan.tokens_per_request:
            # The gaps are measured at contexts t .. t + decode_tokens.
            expected = PREDICTOR.predict_tpot_ms(b, b * (t + plan.decode_tokens / 2)) / speed
            assert float(measured.tpot_profile.grid(float(b), float(t))) == pytest.approx(
                expected, rel=0.1
            ), (b, t)


async def test_a_grid_that_does_not_fit_the_worker_is_refused(start_worker: StartWorker) -> None:
    server = await start_worker(kv_capacity_tokens=4096, max_model_len=2048)
    with pytest.raises(ValueError, match="KV capacity"):
        await profile_worker(
            server.address, ProfilePlan(tokens=(64,), batch_sizes=(8,), tokens_per_request=(1024,))
        )
    with pytest.raises(ValueError, match="max_model_len"):
        await profile_worker(
            server.address, ProfilePlan(tokens=(4000,), batch_sizes=(1,), tokens_per_request=(64,))
        )


def test_bad_plans_name_the_field() -> None:
    with pytest.raises(ValueError, match="batch_sizes"):
        ProfilePlan(batch_sizes=())
    with pytest.raises(ValueError, match="repeats"):
        ProfilePlan(repeats=0)


def test_progress_on_a_terminal_is_a_bar_redrawn_in_place() -> None:
    from workers.profile import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    bar = Progress(3, out)
    for label in ("warm-up", "ttft 128 tokens", "ttft 128 tokens"):
        bar.advance(label)
    text = out.getvalue()
    assert "\r" in text and "profiling" in text and "3/3" in text and text.endswith("\n")
