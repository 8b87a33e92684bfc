"""The OpenAI wire format: request parsing bounds and the stream chunk encodings."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from openai_http.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    ApiError,
    ChunkEncoder,
    Kind,
    chunk_body,
    parse_request,
    sse,
)


@given(
    kind=st.sampled_from(list(Kind)),
    include_usage=st.booleans(),
    model=st.text(max_size=20),
    text=st.text(max_size=40),
    reason=st.sampled_from([None, "length", "stop", "abort"]),
)
def test_the_fast_chunk_encoder_is_byte_identical_to_the_generic_path(
    kind: Kind, include_usage: bool, model: str, text: str, reason: str | None
) -> None:
    encoder = ChunkEncoder(kind, "cmpl-1", 1700000000, model, include_usage=include_usage)
    expected = sse(
        chunk_body(kind, "cmpl-1", 1700000000, model, text, reason, first=False, include_usage=include_usage)
    )
    assert encoder.encode(text, reason) == expected
    assert json.loads(expected[6:])["choices"][0]["finish_reason"] == reason


def test_defaults() -> None:
    completion = parse_request(Kind.COMPLETION, {"prompt": "hi"})
    assert completion.sampling.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    assert completion.sampling.temperature == 1.0 and completion.sampling.top_p == 1.0
    assert not completion.stream and not completion.include_usage
    chat = parse_request(Kind.CHAT, {"messages": [{"role": "user", "content": "x"}]}, lambda m: "p")
    assert chat.sampling.max_tokens == DEFAULT_CHAT_MAX_TOKENS and chat.prompt == "p"


def test_prompt_forms() -> None:
    assert parse_request(Kind.COMPLETION, {"prompt": [1, 2, 3]}).prompt_token_ids == (1, 2, 3)
    assert parse_request(Kind.COMPLETION, {"prompt": [[4, 5]]}).prompt_token_ids == (4, 5)
    assert parse_request(Kind.COMPLETION, {"prompt": ["one"]}).prompt == "one"
    parsed = parse_request(
        Kind.CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        },
        lambda m: m[0]["content"],
    )
    assert parsed.prompt == "ab"
    chat = parse_request(
        Kind.CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7}, str
    )
    assert chat.sampling.max_tokens == 7


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (Kind.COMPLETION, {"prompt": [1, True]}, "prompt"),
        (Kind.COMPLETION, {"prompt": [-1]}, "prompt"),
        (Kind.COMPLETION, {"prompt": "a", "seed": -1}, "seed"),
        (Kind.COMPLETION, {"prompt": "a", "top_p": 0}, "top_p"),
        (Kind.COMPLETION, {"prompt": "a", "stream": "yes"}, "stream"),
        (Kind.COMPLETION, {"prompt": "a", "logprobs": 2}, "logprobs"),
        (Kind.COMPLETION, {"prompt": "a", "echo": True}, "echo"),
        (Kind.COMPLETION, {"prompt": "a", "model": 3}, "model"),
        (Kind.CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            Kind.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_fields_name_themselves(kind: Kind, body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request(kind, body, str)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.body()["error"]["param"] == param
