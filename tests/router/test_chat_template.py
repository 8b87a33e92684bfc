"""Chat templates: the tokenizer's own (Jinja) when it ships one, else the documented fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.chat_template import FallbackChatTemplate, JinjaChatTemplate, load_chat_template
from router.core.errors import InvalidRequestError

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]


def _tokenizer_dir(tmp_path: Path, config: object) -> Path:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_tokenizers_template_is_rendered(tmp_path: Path) -> None:
    directory = _tokenizer_dir(
        tmp_path, {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    )
    for path in (directory, directory / "tokenizer.json"):
        template = load_chat_template(path)
        assert isinstance(template, JinjaChatTemplate)
        assert template.render(MESSAGES) == "<s><|system|>terse</s><|user|>hi</s><|assistant|>"


def test_a_named_default_template_is_used(tmp_path: Path) -> None:
    directory = _tokenizer_dir(
        tmp_path,
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]},
    )
    assert load_chat_template(directory).render(MESSAGES).endswith("<|assistant|>")


@pytest.mark.parametrize("config", [{}, {"chat_template": ""}, {"chat_template": [{"name": "tool_use"}]}])
def test_without_a_template_the_fallback_is_used(tmp_path: Path, config: object) -> None:
    template = load_chat_template(_tokenizer_dir(tmp_path, config))
    assert isinstance(template, FallbackChatTemplate)
    assert template.render(MESSAGES) == "system: terse\nuser: hi\nassistant:"
    assert isinstance(load_chat_template(None), FallbackChatTemplate)


def test_a_template_that_refuses_the_conversation_is_an_invalid_request() -> None:
    template = JinjaChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    with pytest.raises(InvalidRequestError, match="user first"):
        template.render(MESSAGES)


def test_a_broken_template_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenizer"):
        load_chat_template(_tokenizer_dir(tmp_path, {"chat_template": "{% for %}"}))


def test_the_sandbox_refuses_unsafe_access() -> None:
    template = JinjaChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        template.render(MESSAGES)
