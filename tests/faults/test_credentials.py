"""Credentials mean what they say: a read token only reads, a worker token writes only its own id,
and one token cannot register instances without limit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms.auth import read_client_token
from tests.cms.helpers import make_metadata
from tests.faults.secure_fleet import spawn
from tests.faults.up_cluster import UpCluster, wait_serving


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_up_read_token_reads_and_is_refused_every_write(shared_up: UpCluster) -> None:
    cluster = shared_up
    wait_serving(cluster.router)
    read = _bearer(read_client_token(cluster.read_token_file))
    worker = _bearer(read_client_token(cluster.read_token_file.parent / "prefill-0.token"))
    with grpc.insecure_channel(cluster.cms) as channel:
        stub = cms_pb2_grpc.ClusterMetadataStub(channel)
        view = stub.GetClusterView(cms_pb2.GetClusterViewRequest(), metadata=read, timeout=5)
        real = {s.metadata.instance_id: s for s in view.instances}
        assert set(real) == {"prefill-0", "decode-0"}
        fake = cms_pb2.RegisterInstanceRequest(metadata=make_metadata("fake-prefill", endpoint="127.0.0.1:1"))
        status = cms_pb2.ReportStatusRequest(status=real["prefill-0"].status)
        batch = cms_pb2.ReportStatusesRequest(statuses=[real["prefill-0"].status])
        writes = {
            "register a new id": lambda: stub.RegisterInstance(fake, metadata=read, timeout=5),
            "re-register a real id": lambda: stub.RegisterInstance(
                cms_pb2.RegisterInstanceRequest(metadata=real["prefill-0"].metadata),
                metadata=read,
                timeout=5,
            ),
            "report for a real id": lambda: stub.ReportStatus(status, metadata=read, timeout=5),
            "batch-report for a real id": lambda: stub.ReportStatuses(batch, metadata=read, timeout=5),
            "deregister a real id": lambda: stub.DeregisterInstance(
                cms_pb2.DeregisterInstanceRequest(instance_id="decode-0"), metadata=read, timeout=5
            ),
        }
        for name, write in writes.items():
            assert _code(write) == grpc.StatusCode.PERMISSION_DENIED, name
        # A worker's token writes its own id only: no fake prefill with it either.
        assert (
            _code(lambda: stub.RegisterInstance(fake, metadata=worker, timeout=5))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert (
            _code(
                lambda: stub.DeregisterInstance(
                    cms_pb2.DeregisterInstanceRequest(instance_id="decode-0"), metadata=worker, timeout=5
                )
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
        # ... nor a batch that carries another instance's status beside its own.
        both = cms_pb2.ReportStatusesRequest(statuses=[real["prefill-0"].status, real["decode-0"].status])
        assert (
            _code(lambda: stub.ReportStatuses(both, metadata=worker, timeout=5))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        view = stub.GetClusterView(cms_pb2.GetClusterViewRequest(), metadata=read, timeout=5)
        assert {s.metadata.instance_id for s in view.instances} == {"prefill-0", "decode-0"}
    wait_serving(cluster.router, timeout_s=10)


def test_registrations_per_token_are_limited(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("anyone any-token-0123456789 write\n")
    cms = spawn(
        "cms",
        [
            "cms",
            "--listen",
            "127.0.0.1:0",
            "--auth-token-file",
            str(tokens),
            "--max-instances-per-token",
            "5",
        ],
        "cms listening on",
        tmp_path,
    )
    try:
        with grpc.insecure_channel(cms.address) as channel:
            stub = cms_pb2_grpc.ClusterMetadataStub(channel)
            auth = _bearer("any-token-0123456789")
            codes = [
                _code(
                    lambda i=i: stub.RegisterInstance(
                        cms_pb2.RegisterInstanceRequest(
                            metadata=make_metadata(f"i{i}", endpoint=f"127.0.0.1:{1000 + i}")
                        ),
                        metadata=auth,
                        timeout=5,
                    )
                )
                for i in range(50)
            ]
            assert codes[:5] == [grpc.StatusCode.OK] * 5
            assert set(codes[5:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            # Re-registering an id it holds is fine; deregistering frees a place.
            again = cms_pb2.RegisterInstanceRequest(metadata=make_metadata("i0", endpoint="127.0.0.1:1000"))
            assert _code(lambda: stub.RegisterInstance(again, metadata=auth, timeout=5)) == grpc.StatusCode.OK
            stub.DeregisterInstance(
                cms_pb2.DeregisterInstanceRequest(instance_id="i1"), metadata=auth, timeout=5
            )
            new = cms_pb2.RegisterInstanceRequest(metadata=make_metadata("i99", endpoint="127.0.0.1:1099"))
            assert _code(lambda: stub.RegisterInstance(new, metadata=auth, timeout=5)) == grpc.StatusCode.OK
    finally:
        cms.stop()
