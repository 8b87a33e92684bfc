"""The OpenAI completions and chat-completions wire format: parsing and building.

Parsing is strict where it matters and lenient where clients differ: every
field this server uses is type-checked and bounded, and a bad one raises
:class:`ApiError` (HTTP 400) naming the field as the client spelled it;
fields it cannot honour with a non-default value (``n`` > 1, ``echo``,
``logprobs``) are refused rather than silently ignored; other fields clients
commonly send (``user``, penalties at 0, vLLM's extras) are ignored.

The builders return plain ``dict`` objects shaped like OpenAI's responses and
stream chunks (``text_completion`` / ``chat.completion`` and their ``.chunk``
forms), so the official client parses them unchanged.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_string
from typing import Any

from slorouter.v1 import common_pb2

#: Bounds of the request fields (inclusive).
MAX_TOKENS_LIMIT = 1 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MODEL_NAME_CHARS = 256
MAX_MESSAGES = 4096
MAX_PROMPT_TOKEN_ID = (1 << 32) - 1
#: ``max_tokens`` when a request sets none: OpenAI's default for completions, and a
#: bounded default for chat (OpenAI's is "up to the context length").
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class Kind(str, enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class ApiError(Exception):
    """An error to return in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, error_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


_ERROR_TYPES = {
    400: "invalid_request_error",
    408: "invalid_request_error",
    431: "invalid_request_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completions or chat request (chat messages are already rendered into ``prompt``)."""

    kind: Kind
    model: str
    #: Exactly one of ``prompt`` / ``prompt_token_ids`` is non-empty.
    prompt: str
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams
    stream: bool
    include_usage: bool
    #: The raw JSON body, for fields a particular server adds (the router's ``slo`` object).
    body: Mapping[str, Any] = field(repr=False)


# ---------------------------------------------------------------------- field readers


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"must be a number, got {json.dumps(value)[:40]}")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise bad(name, f"must be within [{lo:g}, {hi:g}], got {value!r}")
    return value


def _integer(body: Mapping[str, Any], name: str, lo: int, hi: int, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise bad(name, f"must be within [{lo}, {hi}], got {value}")
    return value


def _flag(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {json.dumps(value)[:40]}")
    return value


def _stop(body: Mapping[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", "must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad("stop", f"each stop string must have 1..{MAX_STOP_CHARS} characters")
    return list(items)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("n", 1) not in (1, None):
        raise bad("n", "only n = 1 is supported; send several requests instead")
    if body.get("best_of", 1) not in (1, None):
        raise bad("best_of", "only best_of = 1 is supported")
    if body.get("echo"):
        raise bad("echo", "echo is not supported")
    if body.get("logprobs") not in (None, False, 0):
        raise bad("logprobs", "logprobs are not supported")


def _sampling(body: Mapping[str, Any], kind: Kind) -> common_pb2.SamplingParams:
    default = DEFAULT_CHAT_MAX_TOKENS if kind is Kind.CHAT else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _integer(body, "max_tokens", 1, MAX_TOKENS_LIMIT, 0)
    if kind is Kind.CHAT and not max_tokens:
        max_tokens = _integer(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT, 0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p", "must be > 0")
    top_k = _integer(body, "top_k", -1, 1 << 20, 0)  # vLLM extra; -1 and 0 both mean "off"
    return common_pb2.SamplingParams(
        max_tokens=max_tokens or default,
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=_integer(body, "seed", 0, (1 << 63) - 1, 0),
        stop=_stop(body),
        ignore_eos=_flag(body, "ignore_eos"),  # vLLM extra, used by `vllm bench serve`
    )


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    return _flag(options, "include_usage") if "include_usage" in options else False


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model", "")
    if model is None:
        return ""
    if not isinstance(model, str) or len(model) > MAX_MODEL_NAME_CHARS:
        raise bad("model", f"must be a string of at most {MAX_MODEL_NAME_CHARS} characters")
    return model


def _token_ids(value: list[Any], param: str) -> tuple[int, ...]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad(param, "a token-id prompt must be a list of integers")
    if not all(0 <= t <= MAX_PROMPT_TOKEN_ID for t in value):
        raise bad(param, f"token ids must be within [0, {MAX_PROMPT_TOKEN_ID}]")
    return tuple(value)


def _prompt(body: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "must not be empty")
        return value, ()
    if isinstance(value, list) and value and not isinstance(value[0], (str, list)):
        return "", _token_ids(value, "prompt")
    if isinstance(value, list) and len(value) > 1:
        raise bad("prompt", f"batches are not supported: send one prompt per request (got {len(value)})")
    raise bad("prompt", "must be a non-empty string or a list of token ids")


def _content(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for i, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(f"{param}[{i}]", "only text parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    if value is None:
        return ""
    raise bad(param, "must be a string or a list of text parts")


def parse_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    """The chat messages as ``{"role", "content"}`` pairs, validated."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}")
        out.append({"role": str(role), "content": _content(message.get("content"), f"messages[{i}].content")})
    return out


def parse_request(kind: Kind, body: Any, render_chat: Any = None) -> ParsedRequest:
    """Validate a request body. ``render_chat(messages) -> str`` renders chat messages into a prompt."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_unsupported(body)
    stream = _flag(body, "stream")
    include_usage = _stream_options(body, stream)
    sampling = _sampling(body, kind)
    if kind is Kind.CHAT:
        messages = parse_messages(body)
        prompt = str(render_chat(messages)) if render_chat is not None else ""
        if not prompt:
            raise bad("messages", "render to an empty prompt")
        ids: tuple[int, ...] = ()
    else:
        prompt, ids = _prompt(body)
    return ParsedRequest(
        kind=kind,
        model=_model(body),
        prompt=prompt,
        prompt_token_ids=ids,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        body=body,
    )


#: A ``\\uD800``-``\\uDFFF`` escape: JSON allows it, UTF-8 (and so protobuf) cannot carry it alone.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def decode_json(raw: bytes) -> Any:
    """The body as JSON; ``ApiError(400)`` for anything that is not valid JSON text.

    Beyond syntax: nesting too deep for the parser (a 100k-deep array) and a
    string holding a lone surrogate (``"\\ud800"``: valid JSON escapes, but
    no UTF-8 text) are 400s too, not failures further in.
    """
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(raw):
        _check_text(value)
    return value


def _check_text(value: Any) -> None:
    """``ApiError(400)`` when a string (key or value) anywhere in ``value`` is not valid Unicode text."""
    stack = [value]
    while stack:  # iterative: bounded by the body's size, never by the stack
        item = stack.pop()
        if isinstance(item, str):
            strings: list[Any] = [item]
        elif isinstance(item, dict):
            strings = list(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(
                    400, "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text"
                ) from None


# ---------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Usage:
    """The ``usage`` object: OpenAI's token counts, then what the server adds (``extra``).

    The router adds whether the request was served late (``late``) and how long it waited in its
    queue (``queue_wait_ms``): OpenAI clients keep unknown usage fields (``usage.model_extra``).
    """

    prompt_tokens: int
    completion_tokens: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            **self.extra,
        }


def _choice(kind: Kind, text: str, finish_reason: str | None, *, chunk: bool, first: bool) -> dict[str, Any]:
    reason = finish_reason or None
    if kind is Kind.COMPLETION:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if chunk:
        delta: dict[str, str] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": reason,
    }


def response_body(
    kind: Kind, response_id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage
) -> dict[str, Any]:
    """A whole (non-streamed) response."""
    return {
        "id": response_id,
        "object": "text_completion" if kind is Kind.COMPLETION else "chat.completion",
        "created": created,
        "model": model,
        "choices": [_choice(kind, text, finish_reason, chunk=False, first=True)],
        "usage": usage.body(),
    }


def chunk_body(
    kind: Kind,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    *,
    first: bool,
    include_usage: bool,
) -> dict[str, Any]:
    """One stream chunk carrying ``text`` (and the finish reason on the last one)."""
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": "text_completion" if kind is Kind.COMPLETION else "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [_choice(kind, text, finish_reason, chunk=True, first=first)],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


class ChunkEncoder:
    """``sse(chunk_body(...))`` for the chunks after the first, without building and encoding a dict.

    The fields that do not change within a stream are encoded once; each chunk
    then costs one string encode. Byte-identical to the generic path (a test
    holds it to that).
    """

    def __init__(
        self, kind: Kind, response_id: str, created: int, model: str, *, include_usage: bool
    ) -> None:
        template = chunk_body(
            kind, response_id, created, model, "\x00TEXT\x00", None, first=False, include_usage=include_usage
        )
        choice = template["choices"][0]
        choice["finish_reason"] = "\x00REASON\x00"
        encoded = json.dumps(template, separators=(",", ":"))
        text_at = encoded.index('"\\u0000TEXT\\u0000"')
        reason_at = encoded.index('"\\u0000REASON\\u0000"')
        self._head = b"data: " + encoded[:text_at].encode()
        self._middle = encoded[text_at + len('"\\u0000TEXT\\u0000"') : reason_at].encode()
        self._tail = encoded[reason_at + len('"\\u0000REASON\\u0000"') :].encode() + b"\n\n"

    def encode(self, text: str, finish_reason: str | None) -> bytes:
        # What json.dumps does with a str under its defaults (ensure_ascii), minus its Python
        # layers: the C string encoder straight away.
        reason = b"null" if not finish_reason else _json_string(finish_reason).encode()
        return b"".join((self._head, _json_string(text).encode(), self._middle, reason, self._tail))


def usage_chunk_body(kind: Kind, response_id: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
    """The final chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": response_id,
        "object": "text_completion" if kind is Kind.COMPLETION else "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.body(),
    }


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event; ``data`` is a JSON object or the literal ``[DONE]``."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return b"data: " + payload.encode() + b"\n\n"


def models_body(models: Sequence[tuple[str, int]], created: int, owner: str) -> dict[str, Any]:
    """``GET /v1/models``: (name, max_model_len) pairs; a length of 0 is left out."""
    data = []
    for name, max_len in models:
        card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": owner}
        if max_len:
            card["max_model_len"] = max_len
        data.append(card)
    return {"object": "list", "data": data}
