"""The router counts text prompts with the tokenizer the engines use."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from engine.tokenizer import SimpleTokenizer
from router.tokenize import HfTokenizer, load_tokenizer


def _train(directory: Path) -> Path:
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(["the fleet serves the tokens", "tokens flow to the router"], trainer)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_hugging_face_tokenizer_from_file_or_directory(tmp_path: Path) -> None:
    path = _train(tmp_path)
    for source in (path, tmp_path):
        tok = load_tokenizer(source)
        assert isinstance(tok, HfTokenizer)
        ids = tok.encode("the router serves tokens")
        assert len(ids) == 4
        assert tok.decode(ids) == "the router serves tokens"


def test_default_is_the_built_in_byte_tokenizer() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, SimpleTokenizer)
    assert tok.encode("héllo") == list("héllo".encode())


def test_unreadable_tokenizer_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(tmp_path / "missing.json")
