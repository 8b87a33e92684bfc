"""Views cut into chunks and put back together."""

from __future__ import annotations

from slorouter.v1 import cms_pb2

from cms import limits
from cms.view import ViewAssembler, chunk_view
from tests.cms.helpers import make_metadata


def _view(n: int, version: int = 7) -> cms_pb2.ClusterView:
    view = cms_pb2.ClusterView(version=version, generated_at_ms=123)
    for i in range(n):
        view.instances.add().metadata.CopyFrom(make_metadata(f"i{i:04d}", labels={"pad": "x" * 200}))
    return view


def test_a_small_view_is_one_message() -> None:
    view = _view(3)
    assert chunk_view(view, limits.VIEW_CHUNK_BYTES) == [view]


def test_chunks_respect_the_budget_and_reassemble_in_order() -> None:
    view = _view(500)
    chunks = chunk_view(view, 8192)
    assert len(chunks) > 10
    assert all(c.ByteSize() <= 8192 + 300 for c in chunks)  # at most one instance over the cut
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    assembler = ViewAssembler()
    results = [assembler.add(c) for c in chunks]
    assert results[:-1] == [None] * (len(chunks) - 1)
    assert results[-1] == view


def test_a_broken_sequence_is_dropped_and_the_next_view_wins() -> None:
    first = chunk_view(_view(200, version=1), 8192)
    second = chunk_view(_view(200, version=2), 8192)
    assembler = ViewAssembler()
    assert assembler.add(first[0]) is None
    assert assembler.add(second[1]) is None  # another version: what was gathered is dropped
    assert assembler.add(first[1]) is None  # no start any more
    results = [assembler.add(c) for c in second]
    assert results[-1] is not None and results[-1].version == 2 and len(results[-1].instances) == 200
    assert assembler.add(cms_pb2.ClusterView(chunk_index=5, chunk_count=3)) is None  # nonsense


def test_one_instance_at_its_limits_fits_a_chunk_with_room_to_spare() -> None:
    assert limits.max_instance_state_bytes() * 4 < limits.VIEW_CHUNK_BYTES
    assert limits.VIEW_CHUNK_BYTES + limits.max_instance_state_bytes() < limits.VIEW_MAX_MESSAGE_BYTES
