"""Message limits, TLS and the secure defaults of the commands.

- A fleet of 4096 instances whose view is several times the gRPC message
  limit reaches a watching router (chunks) and a ``GetClusterView`` caller.
- TLS on every hop (client→router, router→worker, worker→worker, agent→CMS,
  reader→CMS) with a certificate this test makes; plaintext is refused.
- ``slo-router cms`` refuses a non-loopback address without a token, and
  ``slo-router up`` runs with authentication on.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import cms_pb2, cms_pb2_grpc, router_pb2, router_pb2_grpc

from cms import limits
from cms.memory import MemoryStore
from cms.reader import GrpcClusterReader
from cms.server import start_cms_server
from cms.transport import ClientTls, ServerTls
from router.cli import main
from router.core.config import SchedulerConfig
from router.core.scheduler import Scheduler
from router.server import start_router_server
from tests.cms.helpers import eventually, make_metadata
from tests.faults.secure_fleet import REPO, request, wait_for_lines
from tests.router.e2e.cluster import PREDICTOR, sim_config
from workers.kv_auth import KvSigner
from workers.kv_transfer import GrpcKvPeer
from workers.metadata import WorkerIdentity, WorkerRole
from workers.service import start_worker_server
from workers.sim_engine import SimEngine

FLEET = 4096


def _bulky_status(instance_id: str, update_id: int) -> cms_pb2.InstanceStatus:
    return cms_pb2.InstanceStatus(
        instance_id=instance_id,
        update_id=update_id,
        timestamp_ms=int(time.time() * 1000),
        schedulable=True,
        admitted_request_ids=[f"{instance_id}-request-{i:04d}-" + "x" * 40 for i in range(24)],
    )


@pytest.mark.timeout(300)
async def test_a_4096_instance_view_exceeds_one_message_and_still_arrives() -> None:
    store = MemoryStore()
    for i in range(FLEET):
        iid = f"inst-{i:05d}"
        await store.register(make_metadata(iid, endpoint=f"10.0.{i // 250}.{i % 250 + 1}:9000"), 120.0)
        await store.report(_bulky_status(iid, 1), 120.0)
    server = await start_cms_server(store, watch_refresh_s=1.0, watch_min_interval_s=0.2)
    reader = GrpcClusterReader(server.url, idle_timeout_s=30.0)
    try:
        await reader.start()
        await eventually(
            lambda: len(reader.snapshot().instances) == FLEET, timeout_s=120, what="the whole fleet"
        )
        snapshot = reader.snapshot()
        assert all(
            r.status is not None and len(r.status.admitted_request_ids) == 24 for r in snapshot.instances
        )
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = cms_pb2_grpc.ClusterMetadataStub(channel)
            first = await stub.GetClusterView(cms_pb2.GetClusterViewRequest(), timeout=30)
            total = first.ByteSize()
            ids = [s.metadata.instance_id for s in first.instances]
            for index in range(1, first.chunk_count):
                chunk = await stub.GetClusterView(
                    cms_pb2.GetClusterViewRequest(chunk_index=index), timeout=30
                )
                assert chunk.chunk_count == first.chunk_count
                assert chunk.ByteSize() <= limits.VIEW_MAX_MESSAGE_BYTES
                total += chunk.ByteSize()
                ids.extend(s.metadata.instance_id for s in chunk.instances)
        print(f"\n{FLEET} instances: view of {total / 1e6:.1f} MB in {first.chunk_count} chunks")
        assert total > limits.VIEW_MAX_MESSAGE_BYTES  # one message could not have carried it
        assert first.chunk_count > 1 and len(ids) == FLEET == len(set(ids))
    finally:
        await reader.stop()
        await server.stop(0)


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, made with the openssl CLI."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.timeout(120)
async def test_tls_on_every_hop(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    server_tls = ServerTls.from_files(cert, key)
    client_tls = ClientTls.from_file(cert)
    signer = KvSigner(b"cluster-kv-key-0123456789abcdef")
    cms = await start_cms_server(MemoryStore(), auth_token="cms-token-0123456789", tls=server_tls)
    workers = []
    router = None
    try:
        for instance_id, role in (("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)):
            engine = SimEngine(
                sim_config(), PREDICTOR, kv_peer=GrpcKvPeer(tls=client_tls), rng=random.Random(0)
            )
            workers.append(
                await start_worker_server(
                    engine, "127.0.0.1:0", identity=WorkerIdentity(instance_id=instance_id, role=role),
                    cms=cms.address, cms_auth_token="cms-token-0123456789", kv_signer=signer,
                    tls=server_tls, cms_tls=client_tls, heartbeat_interval_s=0.2,
                )
            )  # fmt: skip
        reader = GrpcClusterReader(cms.url, auth_token="cms-token-0123456789", tls=client_tls)
        router = await start_router_server(
            reader,
            Scheduler(SchedulerConfig(), PREDICTOR, random.Random(0)),
            tls=server_tls,
            worker_tls=client_tls,
        )
        await eventually(
            lambda: sum(r.status is not None for r in reader.snapshot().instances) == 2, timeout_s=30,
            what="both workers registered over TLS",
        )  # fmt: skip
        async with grpc.aio.secure_channel(router.address, client_tls.credentials()) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            tokens = [t async for m in stub.Generate(request("tls-1"), timeout=30) for t in m.token_ids]
            assert len(tokens) == 4
        for address in (router.address, cms.address, workers[0].address):
            async with grpc.aio.insecure_channel(address) as plain:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await router_pb2_grpc.RouterStub(plain).Schedule(
                        router_pb2.ScheduleRequest(request=request()), timeout=5
                    )
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no plaintext on a TLS port
    finally:
        if router is not None:
            await router.stop(0)
        for worker in workers:
            await worker.stop(0)
        await cms.stop(0)


def test_cms_refuses_a_public_address_without_a_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cms", "--listen", "0.0.0.0:0"]) == 2
    err = capsys.readouterr().err
    assert "--auth-token-file" in err and "--insecure" in err


@pytest.mark.timeout(120)
def test_up_runs_with_authentication_on() -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "up", "--prefill", "1", "--decode", "1", "--speed-factor", "20",
         "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        lines = wait_for_lines(up, ["cms listening on ", "router listening on "], 90)
        cms_address = lines.get("cms listening on ", "").split()[-1:] or [""]
        router_address = lines.get("router listening on ", "").split()[-1:] or [""]
        cms_address, router_address = cms_address[0], router_address[0]
        assert cms_address and router_address, "up did not start"
        with grpc.insecure_channel(cms_address) as channel:
            stub = cms_pb2_grpc.ClusterMetadataStub(channel)
            for call in (
                lambda: stub.RegisterInstance(
                    cms_pb2.RegisterInstanceRequest(metadata=make_metadata("evil", endpoint="127.0.0.1:1")),
                    timeout=5,
                ),
                lambda: stub.GetClusterView(cms_pb2.GetClusterViewRequest(), timeout=5),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        with grpc.insecure_channel(router_address) as channel:
            stub_r = router_pb2_grpc.RouterStub(channel)
            tokens = [t for m in stub_r.Generate(request("up-auth"), timeout=30) for t in m.token_ids]
            assert len(tokens) == 4  # the workers, with their own tokens, registered and serve
    finally:
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=30)
