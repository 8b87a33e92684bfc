"""SIGTERM under load: health goes NOT_SERVING, queued requests are refused at once with a retryable
code, short streams finish, and every unfinished HTTP SSE stream ends with an error event and [DONE]."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.faults.up_cluster import up_cluster, wait_serving

DRAIN_S = 3.0


def _sse(http: str, max_tokens: int, out: dict[str, object]) -> None:
    """One streamed completion; records every event, and when the stream ended."""
    body = json.dumps({"prompt": "tell me", "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    req = urllib.request.Request(
        f"http://{http}/v1/completions", body.encode(), {"content-type": "application/json"}
    )
    events: list[str] = []
    out["events"] = events
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            out["status"] = response.status
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
        out["clean"] = True
    except (OSError, urllib.error.URLError) as exc:  # a cut connection
        out["clean"] = False
        out["error"] = repr(exc)
    out["ended_at"] = time.monotonic()


def _queued(router: str, i: int, out: dict[str, object]) -> None:
    request = router_pb2.GenerateRequest(
        request_id=f"queued-{i}",
        prompt_token_ids=[1 + k % 400 for k in range(6000)],
        sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        # ~1.4x the prompt's prefill on an idle instance: one at a time meets it, so the rest wait.
        slo=common_pb2.SloTarget(ttft_ms=1000.0, tpot_ms=60_000.0),
    )
    with grpc.insecure_channel(router) as channel:
        try:
            for _ in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120):
                pass
            out["code"] = "OK"
        except grpc.RpcError as exc:
            out["code"] = exc.code().name  # type: ignore[attr-defined]
            out["details"] = exc.details()  # type: ignore[attr-defined]
    out["ended_at"] = time.monotonic()


def _queue_length(http: str) -> float:
    """Requests waiting in the router queue, summed over classes (the router's own gauge)."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("slo_router_queue_requests{")
    )


def test_sigterm_under_load_drains_and_ends_every_stream_cleanly(tmp_path: Path) -> None:
    # --late-allowance: the queued requests turn late while they wait (one prefill at a time); they
    # must still be waiting when the signal comes, not refused as late before it.
    flags = ["--speed-factor", "1", "--drain-timeout-s", str(DRAIN_S), "--late-allowance", "1000"]
    with up_cluster(tmp_path, *flags) as cluster:
        wait_serving(cluster.router)
        long_streams = [{} for _ in range(4)]  # ~36 s each at this speed: cut by the drain
        short_streams = [{} for _ in range(2)]  # done within the drain
        queued = [{} for _ in range(20)]  # ~0.7 s of prefill each, one at a time
        threads = [
            threading.Thread(target=_sse, args=(cluster.http, 2000, o), daemon=True) for o in long_streams
        ]
        threads += [
            threading.Thread(target=_sse, args=(cluster.http, 60, o), daemon=True) for o in short_streams
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        # Every stream has begun before the queued requests come (on a slow host a short one may
        # still be waiting for its prefill; it would then be refused as queued, a different promise).
        while time.monotonic() < deadline and not all(o.get("events") for o in long_streams + short_streams):
            time.sleep(0.1)
        assert all(o.get("status") == 200 for o in long_streams), (long_streams, cluster.tail())
        queued_threads = [threading.Thread(target=_queued, args=(cluster.router, i, o), daemon=True) for i, o in enumerate(queued)]  # fmt: skip
        for thread in queued_threads:
            thread.start()
        threads += queued_threads
        # The signal comes while most of them still wait in the router queue (its own gauge says so),
        # not after a fixed sleep that a fast host outruns by serving them all.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _queue_length(cluster.http) < 10:
            time.sleep(0.05)
        assert _queue_length(cluster.http) >= 5, cluster.tail()
        sigterm_at = time.monotonic()
        cluster.popen.send_signal(15)
        # Health first: a load balancer stops sending (polled, bounded: the signal is handled
        # asynchronously).
        with grpc.insecure_channel(cluster.router) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 5
            while True:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                if status.status == health_pb2.HealthCheckResponse.NOT_SERVING or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            try:
                for _ in router_pb2_grpc.RouterStub(channel).Generate(
                    router_pb2.GenerateRequest(
                        prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=2)
                    ),
                    timeout=5,
                ):
                    pass
                raise AssertionError("a new request was served while draining")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc  # type: ignore[attr-defined]
        try:
            urllib.request.urlopen(f"http://{cluster.http}/health", timeout=5)
            raise AssertionError("/health said ok while draining")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
        for thread in threads:
            thread.join(DRAIN_S + 15)
        code = cluster.popen.wait(30)
        assert code == 0, cluster.tail()
        # Queued requests: refused at once, retryable.
        # (One already running when the signal came may still be cut at the drain's end on a slow host.)
        refused = [o for o in queued if "had not started" in str(o.get("details", ""))]
        assert len(refused) >= 5, queued
        for o in refused:
            assert o["code"] == "UNAVAILABLE", o
            assert float(o["ended_at"]) - sigterm_at < 1.0, o  # type: ignore[arg-type]
        assert all(o["code"] in ("OK", "UNAVAILABLE") for o in queued), queued
        # Short streams finished normally within the drain.
        for o in short_streams:
            assert o["clean"] and o["events"][-1] == "[DONE]", o  # type: ignore[index]
            assert not any('"error"' in e for e in o["events"]), o["events"][-3:]  # type: ignore[attr-defined]
        # Long streams: cut at the drain's end with an OpenAI-shaped error event, then [DONE], cleanly.
        for o in long_streams:
            events = o["events"]
            assert o["clean"], o
            assert events[-1] == "[DONE]", events[-3:]  # type: ignore[index]
            error = json.loads(events[-2])["error"]  # type: ignore[index]
            assert set(error) >= {"message", "type", "code"} and error["code"] == 503, error
            assert DRAIN_S - 0.5 < float(o["ended_at"]) - sigterm_at < DRAIN_S + 6.0, o["ended_at"]  # type: ignore[arg-type]
        assert "Traceback" not in cluster.tail(20000)
        ends = sorted(float(o["ended_at"]) - sigterm_at for o in long_streams)  # type: ignore[arg-type]
        refusals = sorted(float(o["ended_at"]) - sigterm_at for o in refused)  # type: ignore[arg-type]
        print(
            f"{len(refused)} queued requests refused {refusals[0]:.2f}-{refusals[-1]:.2f} s after SIGTERM; "
            f"long streams ended with the error event {ends[0]:.2f}-{ends[-1]:.2f} s after it (drain {DRAIN_S:g} s)"
        )
