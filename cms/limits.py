"""Bounds of every field of every public message, and the checks that enforce them.

One module for the whole fleet: the router (``Generate`` and ``Schedule``
alike), the workers and the CMS call these checks at the edge of the process,
before anything is dispatched or stored, so the same input gets the same
verdict everywhere. A violation raises :class:`FieldLimitError` (a
``ValueError``) whose message names the field and its limit; each service
turns it into ``INVALID_ARGUMENT`` through its own error tree.

Identifiers (request ids, instance ids) are at most :data:`MAX_ID_BYTES`
bytes of ``[A-Za-z0-9._:-]``: they end up in Redis keys, logs and status
reports, so neither their size nor their characters may be the client's choice.
The bounds are picked so that no message the fleet builds from client input
can grow past a fixed size: a status report is at most
``MAX_ADMITTED_REQUEST_IDS * MAX_ID_BYTES`` of ids plus a bounded number of
step samples, and the CMS sends views larger than one message in chunks.

The limits table of docs/security-and-failures.md lists these constants; keep the two in step.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence

from slorouter.v1 import cms_pb2, common_pb2, router_pb2, worker_pb2

#: Request ids and instance ids: length in bytes (ASCII only, see ``ID_CHARS``).
MAX_ID_BYTES = 256
#: The characters an id may use.
ID_CHARS = "A-Za-z0-9._:-"
#: ``host:port`` of a worker (DNS names are at most 253 bytes).
MAX_ENDPOINT_BYTES = 256
#: Model names, node and unit ids.
MAX_NAME_BYTES = 256
#: Labels per instance, and the size of each key and value.
MAX_LABELS = 32
MAX_LABEL_KEY_BYTES = 64
MAX_LABEL_VALUE_BYTES = 256
#: Stop strings per request, and the size of each.
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
#: A text prompt, UTF-8 bytes.
MAX_PROMPT_TEXT_BYTES = 1 << 20
#: Token ids in one prompt (or in ``generated_token_ids``), before the serving limit
#: (``max_model_len``, ``--max-prompt-tokens``) narrows it further.
MAX_TOKEN_IDS = 1 << 20
#: ``sampling.max_tokens``.
MAX_OUTPUT_TOKENS = 1 << 20
#: A kv handle as the router forwards it (the engine's handle plus its signature).
MAX_KV_HANDLE_BYTES = 8192
#: Legs running at once on one ``Worker.Streams`` stream (one router connection); a start
#: beyond it fails that leg with RESOURCE_EXHAUSTED.
MAX_STREAM_LEGS = 4096
#: Commands one ``Worker.Streams`` message may carry in ``batched``; a client also keeps
#: such a message below :data:`STREAM_COMMANDS_BATCH_BYTES` (a larger command goes alone).
MAX_STREAM_BATCHED_COMMANDS = 256
STREAM_COMMANDS_BATCH_BYTES = 1 << 20
#: Request ids one status report may list.
MAX_ADMITTED_REQUEST_IDS = 256
#: Step samples one status report may carry.
MAX_STEP_SAMPLES = 256
#: Statuses one ReportStatuses call may carry (the call must also fit CMS_MAX_RECEIVE_BYTES).
MAX_REPORT_BATCH = 512
#: Largest message a CMS accepts (a status or a registration is a few hundred KB at most).
CMS_MAX_RECEIVE_BYTES = 1 << 20
#: Largest message of the Router and Worker services (a prompt of MAX_TOKEN_IDS ids fits).
SERVING_MAX_MESSAGE_BYTES = 8 << 20
#: Largest view message a CMS sends, and what its readers accept.
VIEW_MAX_MESSAGE_BYTES = 4 << 20
#: A CMS cuts a view into chunks of about this many bytes (well below the message limit;
#: one instance is far smaller, see ``max_instance_state_bytes``).
VIEW_CHUNK_BYTES = 1 << 20

_ID = re.compile(rf"[{ID_CHARS}]+")
_LABEL_KEY = re.compile(r"[A-Za-z0-9._/-]+")
_SLO_CLASS = re.compile(r"[A-Za-z0-9_.-]{0,64}")
_MAX_TOKEN_ID = 2**32 - 1


class FieldLimitError(ValueError):
    """A field is outside its documented bound; the message names the field and the limit."""


def check_id(value: str, field: str, *, allow_empty: bool = False) -> None:
    """An id: 1..MAX_ID_BYTES characters of ``[A-Za-z0-9._:-]`` (empty only if allowed)."""
    if not value:
        if allow_empty:
            return
        raise FieldLimitError(f"{field}: must not be empty")
    if len(value) > MAX_ID_BYTES:
        raise FieldLimitError(f"{field}: {len(value)} characters; the limit is {MAX_ID_BYTES}")
    if not _ID.fullmatch(value):
        raise FieldLimitError(f"{field}: only the characters {ID_CHARS} are allowed")


def check_text(value: str, field: str, max_bytes: int) -> None:
    """A free-form string of at most ``max_bytes`` UTF-8 bytes."""
    if len(value) * 4 <= max_bytes:
        return  # cheap: no string this short can be over
    size = len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise FieldLimitError(f"{field}: {size} bytes; the limit is {max_bytes}")


def check_endpoint(value: str, field: str) -> None:
    """``host:port`` of at most MAX_ENDPOINT_BYTES printable ASCII bytes (parsed by the caller)."""
    if not value:
        raise FieldLimitError(f"{field}: must not be empty; give the worker's host:port")
    check_text(value, field, MAX_ENDPOINT_BYTES)
    if not value.isascii() or not value.isprintable():
        raise FieldLimitError(f"{field}: only printable ASCII is allowed in host:port")


def check_token_ids(ids: Sequence[int], field: str) -> None:
    """At most MAX_TOKEN_IDS ids (protobuf already keeps each within uint32)."""
    if len(ids) > MAX_TOKEN_IDS:
        raise FieldLimitError(f"{field}: {len(ids)} token ids; the limit is {MAX_TOKEN_IDS}")


def check_sampling(sampling: common_pb2.SamplingParams, field: str = "sampling") -> None:
    """Every bound and value rule of ``SamplingParams`` (max_tokens is required)."""
    # Each field is read once: a read of a message field builds a Python value.
    max_tokens, temperature, top_p = sampling.max_tokens, sampling.temperature, sampling.top_p
    if max_tokens == 0:
        raise FieldLimitError(f"{field}.max_tokens: must be > 0")
    if max_tokens > MAX_OUTPUT_TOKENS:
        raise FieldLimitError(f"{field}.max_tokens: {max_tokens}; the limit is {MAX_OUTPUT_TOKENS}")
    if not math.isfinite(temperature) or temperature < 0:
        raise FieldLimitError(f"{field}.temperature: must be a finite number >= 0, got {temperature!r}")
    if not math.isfinite(top_p) or not 0 <= top_p <= 1:
        raise FieldLimitError(f"{field}.top_p: must be within [0, 1] (0 = default), got {top_p!r}")
    if sampling.top_k < 0:
        raise FieldLimitError(f"{field}.top_k: must be >= 0 (0 = default), got {sampling.top_k}")
    stops = sampling.stop
    if not stops:
        return
    if len(stops) > MAX_STOP_STRINGS:
        raise FieldLimitError(f"{field}.stop: {len(stops)} strings; the limit is {MAX_STOP_STRINGS}")
    for i, stop in enumerate(stops):
        if not stop:
            raise FieldLimitError(f"{field}.stop[{i}]: stop strings must not be empty")
        check_text(stop, f"{field}.stop[{i}]", MAX_STOP_BYTES)


def check_slo(slo: common_pb2.SloTarget, field: str = "slo") -> None:
    for name, value in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms), ("e2e_ms", slo.e2e_ms)):
        # (0 <= value < inf is false for NaN too: the common case costs one comparison)
        if not 0 <= value < math.inf:
            raise FieldLimitError(
                f"{field}.{name}: must be a finite number >= 0 (0 = default), got {value!r}"
            )


def derived_id(base: str, suffix: str) -> str:
    """A valid id made of an id and a suffix of id characters (e.g. a request's slice ``:s3``).

    Stays within MAX_ID_BYTES: a base too long for the suffix is cut and a
    digest of the whole base keeps derived ids of different bases apart.
    """
    if len(base) + len(suffix) <= MAX_ID_BYTES:
        return base + suffix
    digest = hashlib.blake2b(base.encode(), digest_size=8).hexdigest()
    return f"{base[: MAX_ID_BYTES - len(suffix) - len(digest) - 1]}.{digest}{suffix}"


def _check_prompt(text: str, ids: Sequence[int]) -> None:
    if bool(text) == bool(len(ids)):
        raise FieldLimitError(
            "prompt: exactly one of prompt and prompt_token_ids must be non-empty"
            + (" (both are set)" if text else " (neither is set)")
        )
    check_text(text, "prompt", MAX_PROMPT_TEXT_BYTES)
    check_token_ids(ids, "prompt_token_ids")


def check_generate_request(request: router_pb2.GenerateRequest) -> None:
    """``Router.Generate`` and ``Router.Schedule``: everything that needs no cluster state."""
    # Checked once per request: the empty strings most requests carry skip the calls.
    request_id, model, slo_class = request.request_id, request.model, request.slo_class
    if request_id:
        check_id(request_id, "request_id")
    if model:
        check_text(model, "model", MAX_NAME_BYTES)
    _check_prompt(request.prompt, request.prompt_token_ids)
    check_sampling(request.sampling)
    check_slo(request.slo)
    if slo_class:
        check_slo_class(slo_class)


def check_slo_class(label: str, field: str = "slo_class") -> None:
    """A class name for the queue's fairness and the per-class metrics (a Prometheus label)."""
    if label and not _SLO_CLASS.fullmatch(label):  # ("" is valid: no class)
        raise FieldLimitError(
            f"{field}: must be at most 64 letters, digits, '_', '.' or '-', got {label[:80]!r}"
        )


def check_worker_request(
    request: worker_pb2.WorkerGenerateRequest
    | worker_pb2.PrefillRequest
    | worker_pb2.DecodeRequest
    | worker_pb2.AbortRequest,
) -> None:
    """The bounds of a Worker RPC's request (value rules are the engine's ``validate_request``)."""
    check_id(request.request_id, "request_id")
    if isinstance(request, worker_pb2.AbortRequest):
        return
    if isinstance(request, worker_pb2.DecodeRequest):
        check_token_ids(request.prompt_token_ids, "prompt_token_ids")
        check_token_ids(request.generated_token_ids, "generated_token_ids")
        if len(request.kv_handle) > MAX_KV_HANDLE_BYTES:
            raise FieldLimitError(
                f"kv_handle: {len(request.kv_handle)} bytes; the limit is {MAX_KV_HANDLE_BYTES}"
            )
    else:
        check_text(request.prompt, "prompt", MAX_PROMPT_TEXT_BYTES)
        check_token_ids(request.prompt_token_ids, "prompt_token_ids")
    check_sampling(request.sampling)


def check_stream_message(message: worker_pb2.StreamCommand) -> None:
    """The bounds of one ``Worker.Streams`` message as a whole: its ``batched`` commands (each
    command is checked with :func:`check_stream_command`)."""
    if len(message.batched) > MAX_STREAM_BATCHED_COMMANDS:
        raise FieldLimitError(
            f"batched: {len(message.batched)} commands in one message; the limit is {MAX_STREAM_BATCHED_COMMANDS}"
        )
    if any(command.batched for command in message.batched):
        raise FieldLimitError(
            "batched: a batched command carries batched commands of its own; nest one level only"
        )


def check_stream_command(command: worker_pb2.StreamCommand) -> None:
    """The bounds of one ``Worker.Streams`` command: the bounds of the request it carries."""
    kind = command.WhichOneof("command")
    if kind is None:
        raise FieldLimitError("command: a StreamCommand must carry generate, decode or abort")
    payload = getattr(command, kind)
    try:
        check_worker_request(payload)
    except FieldLimitError as exc:
        raise FieldLimitError(f"{kind}.{exc}") from None


#: The values of ``InstanceMetadata.worker_protocol``: "" and "worker" are this project's Worker
#: service, "vllm-grpc" vLLM's own (``vllm.grpc.engine.VllmEngine``).
WORKER_PROTOCOLS = ("", "worker", "vllm-grpc")


def check_metadata(metadata: cms_pb2.InstanceMetadata, field: str = "metadata") -> None:
    """The bounds of ``InstanceMetadata`` (the endpoint's syntax is checked by the CMS)."""
    check_id(metadata.instance_id, f"{field}.instance_id")
    check_endpoint(metadata.endpoint, f"{field}.endpoint")
    for name in ("model", "node_id", "unit_id"):
        check_text(getattr(metadata, name), f"{field}.{name}", MAX_NAME_BYTES)
    if metadata.worker_protocol not in WORKER_PROTOCOLS:
        raise FieldLimitError(
            f"{field}.worker_protocol: {metadata.worker_protocol[:40]!r} is not one of "
            + ", ".join(repr(p) for p in WORKER_PROTOCOLS)
        )
    if len(metadata.labels) > MAX_LABELS:
        raise FieldLimitError(f"{field}.labels: {len(metadata.labels)} labels; the limit is {MAX_LABELS}")
    for key, value in metadata.labels.items():
        if not key or len(key) > MAX_LABEL_KEY_BYTES or not _LABEL_KEY.fullmatch(key):
            raise FieldLimitError(
                f"{field}.labels: key {key[:40]!r} must be 1..{MAX_LABEL_KEY_BYTES} characters of A-Za-z0-9._/-"
            )
        check_text(value, f"{field}.labels[{key}]", MAX_LABEL_VALUE_BYTES)


def check_status(status: cms_pb2.InstanceStatus, field: str = "status") -> None:
    """The bounds of ``InstanceStatus``."""
    check_id(status.instance_id, f"{field}.instance_id")
    if len(status.admitted_request_ids) > MAX_ADMITTED_REQUEST_IDS:
        raise FieldLimitError(
            f"{field}.admitted_request_ids: {len(status.admitted_request_ids)} entries; "
            f"the limit is {MAX_ADMITTED_REQUEST_IDS} (send the most recent ones)"
        )
    for i, rid in enumerate(status.admitted_request_ids):
        check_id(rid, f"{field}.admitted_request_ids[{i}]")
    if len(status.step_samples) > MAX_STEP_SAMPLES:
        raise FieldLimitError(
            f"{field}.step_samples: {len(status.step_samples)} entries; the limit is {MAX_STEP_SAMPLES}"
        )
    rate = status.cache_hit_rate
    if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
        raise FieldLimitError(f"{field}.cache_hit_rate: {rate}; it must be a finite share in [0, 1]")
    for i, sample in enumerate(status.step_samples):
        if not math.isfinite(sample.duration_ms) or sample.duration_ms < 0:
            raise FieldLimitError(
                f"{field}.step_samples[{i}].duration_ms: {sample.duration_ms}; it must be finite and >= 0"
            )


def max_instance_state_bytes() -> int:
    """An upper bound on one ``InstanceState`` in a view, from the limits above."""
    per_string = 3 + MAX_NAME_BYTES
    metadata = (
        2 * (3 + MAX_ID_BYTES)
        + 3 * per_string
        + MAX_LABELS * (6 + MAX_LABEL_KEY_BYTES + MAX_LABEL_VALUE_BYTES)
    )
    status = (3 + MAX_ID_BYTES) * (1 + MAX_ADMITTED_REQUEST_IDS) + MAX_STEP_SAMPLES * 40 + 200
    return metadata + status + 64
