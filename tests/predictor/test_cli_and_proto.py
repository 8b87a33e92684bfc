"""The predict subcommand and the generated-code freshness check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.cli import main
from tests.predictor.helpers import worked_files, write_json

REPO = Path(__file__).resolve().parents[2]


def test_predict_prints_both_predictions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ttft, tpot = worked_files(tmp_path)
    code = main(
        [
            "predict",
            "--ttft-profiling-data-path",
            str(ttft),
            "--tpot-profiling-data-path",
            str(tpot),
            "--prefill-tokens",
            "300",
            "--decode-requests",
            "4",
            "--decode-tokens",
            "400",
            "--max-num-batched-tokens",
            "8192",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "predicted_ttft_ms: 79.875" in out
    assert "predicted_tpot_ms: 13.000" in out


def test_predict_exits_non_zero_on_bad_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ttft, _ = worked_files(tmp_path)
    bad = write_json(tmp_path / "bad_tpot.json", {"results": []})
    code = main(
        [
            "predict",
            "--ttft-profiling-data-path",
            str(ttft),
            "--tpot-profiling-data-path",
            str(bad),
            "--prefill-tokens",
            "300",
        ]
    )
    assert code != 0
    err = capsys.readouterr().err
    assert "bad_tpot.json" in err and "empty" in err


def test_generated_protobuf_modules_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_generated_modules_import_with_the_contract_names() -> None:
    from slorouter.v1 import cms_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc

    assert hasattr(router_pb2_grpc, "RouterStub") and hasattr(worker_pb2_grpc, "WorkerStub")
    request = router_pb2.GenerateRequest(
        prompt_token_ids=[1, 2], sampling={"max_tokens": 4}, slo={"ttft_ms": 100}
    )
    assert request.sampling.max_tokens == 4
    assert cms_pb2.InstanceRole.Name(cms_pb2.INSTANCE_ROLE_DECODE) == "INSTANCE_ROLE_DECODE"
    fields = {f.name for f in cms_pb2.InstanceStatus.DESCRIPTOR.fields}
    assert {"update_id", "timestamp_ms", "admitted_request_ids", "step_samples"} <= fields
