"""``python -m bench.vllm_stock_trace``'s hook still fits the router it patches.

The hook wraps router internals by name (the HTTP/2 reader's ``start``, ``_send`` and
``_data_end``, the stream's ``ready`` flag, ``RouterService.generate``, ``Admission.place``).
When one of them was renamed, the hook raised inside the reader's ``data_received``, the engine's
connection dropped, and every traced call failed ``RESOURCE_EXHAUSTED``. Here the hook is loaded
as the router's interpreter would load it, a real stream goes through the reader, and the marks
it takes are checked.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.vllm_stock_trace import HOOK
from router import admission, service, vllm_h2
from tests.router.test_vllm_h2 import _client, _collect, _engine, _request, _Target

pytest.importorskip("hpack")


def _load_hook(monkeypatch: pytest.MonkeyPatch, out: Path, *, noop: bool = False) -> dict[str, Any]:
    """Run the hook's module code as the router's ``sitecustomize`` would; pytest undoes its patches."""
    patched = [
        (service.RouterService, "generate"),
        (admission.Admission, "place"),
        (vllm_h2.H2Connection, "start"),
        (vllm_h2.H2Connection, "_send"),
        (vllm_h2.H2Connection, "_data_end"),
    ]
    for owner, name in patched:
        # Recorded as they are (pytest reads a class's own __dict__: a static method stays one, an
        # inherited method is deleted again), so the hook's replacements are undone at teardown.
        monkeypatch.setattr(owner, name, owner.__dict__.get(name, getattr(owner, name)))
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "router.cli", "router"])
    monkeypatch.setenv("SLO_ROUTER_BENCH_TRACE", str(out))
    if noop:
        monkeypatch.setenv("SLO_ROUTER_BENCH_NOOP", "1")
    else:
        monkeypatch.delenv("SLO_ROUTER_BENCH_NOOP", raising=False)
    monkeypatch.delenv("SLO_ROUTER_BENCH_PROFILE", raising=False)
    namespace: dict[str, Any] = {"__name__": "sitecustomize"}
    exec(compile(HOOK, "sitecustomize.py", "exec"), namespace)
    atexit.unregister(namespace["_dump"])
    return namespace


async def test_the_hook_marks_a_streamed_call_without_breaking_the_reader(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hook = _load_hook(monkeypatch, tmp_path / "trace.json")
    async with _engine() as (_, _, endpoint), _client("h2") as client:
        target = _Target("v", endpoint)
        ids = await _collect(client, target, _request("ok-traced", 5, 12))
    assert ids == list(range(5, 17))  # every token, in order: the reader kept its connection
    marks = hook["_times"]["ok-traced"]
    assert set(marks) == {"sent", "back"}  # (enter, placed and out are the service's, not run here)
    (sent_at, _), (back_at, _) = marks["sent"], marks["back"]
    assert sent_at <= back_at


async def test_the_noop_hook_answers_in_the_path_both_fronts_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _load_hook(monkeypatch, tmp_path / "trace.json", noop=True)
    from slorouter.v1 import router_pb2

    steps = [
        step
        async for step in service.RouterService.generate(None, router_pb2.GenerateRequest(request_id="x"))  # type: ignore[arg-type]
    ]
    assert [step.message().token_ids for step in steps] == [[5]]
    assert steps[0].message().finished
