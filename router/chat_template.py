"""Turning chat messages into one prompt, for ``/v1/chat/completions``.

When the tokenizer directory given with ``--tokenizer`` has a
``tokenizer_config.json`` with a ``chat_template`` (the Jinja template Hugging
Face models ship), that template is rendered in a sandbox with the messages,
``add_generation_prompt=True`` and the tokenizer's ``bos_token`` /
``eos_token``, the way ``transformers`` renders it. Otherwise a plain fallback
is used (see :data:`FALLBACK_TEMPLATE_DOC`): one ``<role>: <content>`` line per
message, then ``assistant:`` for the reply. The fallback suits the byte-level
tokenizer of the sim workers, which has no template of its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

FALLBACK_TEMPLATE_DOC = "one '<role>: <content>' line per message, then 'assistant:'"


class ChatTemplate(Protocol):
    """Renders a validated list of messages (``{"role": str, "content": str}``) to a prompt."""

    def render(self, messages: Sequence[Mapping[str, str]]) -> str: ...


class FallbackChatTemplate:
    """The template used when the tokenizer has none."""

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        lines.append("assistant:")
        return "\n".join(lines)


class JinjaChatTemplate:
    """A Hugging Face chat template (Jinja), rendered in a sandboxed environment."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"--tokenizer: the chat_template does not compile: {exc}") from exc
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        from jinja2 import TemplateError

        from router.core.errors import InvalidRequestError

        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=True,
                    bos_token=self._bos,
                    eos_token=self._eos,
                )
            )
        except TemplateError as exc:  # templates refuse some conversations (e.g. roles out of order)
            raise InvalidRequestError(f"messages: the model's chat template refused them: {exc}") from exc


def _token_text(value: Any) -> str:
    # tokenizer_config.json stores special tokens as a string or as {"content": ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def load_chat_template(tokenizer_path: str | Path | None) -> ChatTemplate:
    """The template of the tokenizer at ``tokenizer_path`` when it has one, else the fallback."""
    if not tokenizer_path:
        return FallbackChatTemplate()
    directory = Path(tokenizer_path)
    if directory.is_file():
        directory = directory.parent
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return FallbackChatTemplate()
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer: cannot read {config_file}: {exc}") from exc
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # several named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return FallbackChatTemplate()
    return JinjaChatTemplate(
        source, bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token"))
    )
