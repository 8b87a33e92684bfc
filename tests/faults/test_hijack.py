"""Hijack attempts on a running fleet are refused, and normal traffic is untouched by them.

Fake registration, endpoint replacement, writes with another worker's
credential, a poisoned update id / timestamp, and a forged kv handle — each
tried as an attacker would, against real processes.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import grpc
import pytest
from slorouter.v1 import cms_pb2, cms_pb2_grpc, common_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from tests.cms.helpers import make_metadata
from tests.faults.secure_fleet import Fleet, auth, generate_ok

U64_MAX = 2**64 - 1


def _cms(fleet: Fleet) -> tuple[grpc.Channel, cms_pb2_grpc.ClusterMetadataStub]:
    channel = grpc.insecure_channel(fleet.cms.address)
    return channel, cms_pb2_grpc.ClusterMetadataStub(channel)


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


def _view(stub: cms_pb2_grpc.ClusterMetadataStub) -> dict[str, cms_pb2.InstanceState]:
    view = stub.GetClusterView(cms_pb2.GetClusterViewRequest(), metadata=auth("router"), timeout=5)
    return {s.metadata.instance_id: s for s in view.instances}


def _traffic_ok(fleet: Fleet, n: int, tag: str) -> None:
    with grpc.insecure_channel(fleet.router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(n):
            assert len(generate_ok(stub, f"{tag}-{i}")) == 4


def test_registration_and_reads_need_a_token(fleet: Fleet) -> None:
    channel, stub = _cms(fleet)
    with channel:
        fake = cms_pb2.RegisterInstanceRequest(metadata=make_metadata("evil-p", endpoint="127.0.0.1:1"))
        for metadata in (None, (("authorization", "Bearer not-a-token"),)):
            assert _code(lambda m=metadata: stub.RegisterInstance(fake, metadata=m, timeout=5)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            assert (
                _code(
                    lambda m=metadata: stub.GetClusterView(
                        cms_pb2.GetClusterViewRequest(), metadata=m, timeout=5
                    )
                )
                == grpc.StatusCode.UNAUTHENTICATED
            )
        assert "evil-p" not in _view(stub)


def test_endpoint_replacement_and_foreign_writes_are_refused(fleet: Fleet) -> None:
    channel, stub = _cms(fleet)
    with channel:
        real = _view(stub)["d0"]
        real_endpoint = real.metadata.endpoint
        # Another credential moving d0 to its own endpoint: the id is live elsewhere.
        moved = cms_pb2.InstanceMetadata()
        moved.CopyFrom(real.metadata)
        moved.endpoint = "127.0.0.1:1"
        for principal in ("fuzz", "worker.p0", "worker.d0"):
            code = _code(
                lambda p=principal: stub.RegisterInstance(
                    cms_pb2.RegisterInstanceRequest(metadata=moved), metadata=auth(p), timeout=5
                )
            )
            assert code == grpc.StatusCode.ALREADY_EXISTS, principal
        # Same endpoint, another worker's credential: not its owner.
        assert (
            _code(
                lambda: stub.RegisterInstance(
                    cms_pb2.RegisterInstanceRequest(metadata=real.metadata),
                    metadata=auth("worker.p0"),
                    timeout=5,
                )
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
        bogus = cms_pb2.InstanceStatus(
            instance_id="d0", update_id=U64_MAX, timestamp_ms=int(time.time() * 1000)
        )
        assert (
            _code(
                lambda: stub.ReportStatus(
                    cms_pb2.ReportStatusRequest(status=bogus), metadata=auth("worker.p0"), timeout=5
                )
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert (
            _code(
                lambda: stub.DeregisterInstance(
                    cms_pb2.DeregisterInstanceRequest(instance_id="d0"), metadata=auth("fuzz"), timeout=5
                )
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
        after = _view(stub)["d0"]
        assert after.metadata.endpoint == real_endpoint
        assert after.status.update_id != U64_MAX
    _traffic_ok(fleet, 20, "after-hijack")


def test_poisoned_update_id_never_locks_a_restarted_worker_out(fleet: Fleet) -> None:
    channel, stub = _cms(fleet)
    with channel:
        now_ms = int(time.time() * 1000)
        future = cms_pb2.InstanceStatus(instance_id="d0", update_id=U64_MAX, timestamp_ms=now_ms + 10**9)
        try:
            stub.ReportStatus(
                cms_pb2.ReportStatusRequest(status=future), metadata=auth("worker.d0"), timeout=5
            )
            raise AssertionError("a far-future timestamp was accepted")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "clock" in exc.details()  # type: ignore[attr-defined]
        # With d0's own credential (a leaked token, or a buggy agent), the highest update id there is.
        poison = cms_pb2.InstanceStatus(
            instance_id="d0", update_id=U64_MAX, timestamp_ms=now_ms, schedulable=True
        )
        assert stub.ReportStatus(
            cms_pb2.ReportStatusRequest(status=poison), metadata=auth("worker.d0"), timeout=5
        ).accepted
        # The worker restarts under the same id: a new registration, a new epoch.
        fleet.workers.pop("d0").stop()
        fleet.start_worker("d0", "decode")
        deadline = time.monotonic() + 30
        while True:
            state = _view(stub).get("d0")
            if state is not None and state.has_status and state.status.update_id != U64_MAX:
                break
            assert time.monotonic() < deadline, f"d0 stayed locked out: {state}"
            time.sleep(0.05)
        assert state.status_age_ms < 2000
    _traffic_ok(fleet, 10, "after-restart")


class _Trap:
    """A listening socket that counts who connects to it (the attacker's endpoint)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.mark.timeout(120)
def test_forged_kv_handle_never_makes_a_worker_call_out(fleet: Fleet) -> None:
    trap = _Trap()
    sampling = common_pb2.SamplingParams(max_tokens=4)
    prompt = list(range(1, 33))
    forged_sim = json.dumps(
        {"format": "slo-router.sim-kv.v1", "endpoint": f"127.0.0.1:{trap.port}", "engine_id": "e",
         "request_id": "victim", "nonce": "n", "num_tokens": 32, "prompt_digest": "0"}
    ).encode()  # fmt: skip
    try:
        with (
            grpc.insecure_channel(fleet.workers["p0"].address) as pch,
            grpc.insecure_channel(fleet.workers["d0"].address) as dch,
        ):
            prefill = worker_pb2_grpc.WorkerStub(pch)
            decode = worker_pb2_grpc.WorkerStub(dch)
            genuine = prefill.Prefill(
                worker_pb2.PrefillRequest(request_id="kv-a", prompt_token_ids=prompt, sampling=sampling),
                timeout=10,
            ).kv_handle
            attempts = {
                "unsigned sim handle": ("victim", forged_sim),
                "wrong signature": ("victim", b"srkv1" + bytes(32) + forged_sim),
                "genuine handle, another request id": ("kv-b", genuine),
                "genuine handle, altered": ("kv-a", genuine[:-1] + bytes([genuine[-1] ^ 1])),
            }
            for what, (rid, handle) in attempts.items():
                call = decode.Decode(
                    worker_pb2.DecodeRequest(
                        request_id=rid, prompt_token_ids=prompt, sampling=sampling, kv_handle=handle,
                        generated_token_ids=[7],
                    ),
                    timeout=10,
                )  # fmt: skip
                try:
                    list(call)
                    raise AssertionError(f"{what}: accepted")
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, what  # type: ignore[attr-defined]
                    assert "kv_handle" in exc.details(), what  # type: ignore[attr-defined]
            # The genuine handle still works for its own request.
            tokens = [t for m in decode.Decode(
                worker_pb2.DecodeRequest(request_id="kv-a", prompt_token_ids=prompt, sampling=sampling,
                                         kv_handle=genuine, generated_token_ids=[7]),
                timeout=10,
            ) for t in m.token_ids]  # fmt: skip
            assert len(tokens) == 3
        time.sleep(0.2)
        assert trap.connections == 0
    finally:
        trap.close()
