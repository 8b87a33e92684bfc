"""Tokenizers the router counts prompt tokens with.

The router works in tokens: a text prompt is tokenized here and the token ids
are what the workers receive, so the prefill backlog the router accounts is
exactly what the engines compute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """Text <-> token ids."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class HfTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HfTokenizer  # imported only when --tokenizer is given

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        try:
            self._tok = _HfTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for unreadable files
            raise ValueError(f"--tokenizer: cannot load {file}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids))


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer at ``path`` (a ``tokenizer.json`` or a directory holding one), else the built-in one."""
    if path:
        return HfTokenizer(path)
    from engine.tokenizer import SimpleTokenizer

    return SimpleTokenizer()
