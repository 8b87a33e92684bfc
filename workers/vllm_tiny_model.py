"""Build a tiny random-weight Llama and a locally trained tokenizer (no downloads).

Tests and benchmarks of the ``vllm`` engine need a real model directory that
vLLM can load in seconds on a CPU. This writes one::

    slo-router vllm-tiny-model OUT_DIR     # or: .venv-vllm/bin/python -m workers.vllm_tiny_model OUT_DIR

The shape is chosen for vLLM's CPU backend: head size 64 (the CPU attention
kernels reject 16), two layers, hidden size 128. The tokenizer is a word-level
vocabulary of made-up words, so every token decodes to printable text. Weights
are seeded, so two builds give the same model.

Runs only in the vLLM environment (needs torch, transformers, tokenizers).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

#: Special tokens, in id order: <s>=0, </s>=1, <pad>=2, <unk>=3.
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")
EOS_TOKEN_ID = 1
VOCAB_SIZE = 1000
HIDDEN_SIZE = 128
NUM_HEADS = 2  # head size 64
NUM_LAYERS = 2
MAX_POSITIONS = 4096


def _words(n: int, seed: int) -> list[str]:
    """``n`` distinct pronounceable made-up words."""
    rng = random.Random(seed)
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: set[str] = set()
    while len(words) < n:
        syllables = rng.randint(1, 3)
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables)))
    return sorted(words)


def build(out_dir: Path, seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer files into ``out_dir``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a one-shard progress bar is noise in logs

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_words = _words(VOCAB_SIZE - len(SPECIAL_TOKENS), seed)
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS))
    # Every word once is enough for a word-level vocabulary to contain it.
    tokenizer.train_from_iterator([" ".join(vocab_words)], trainer=trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    assert tokenizer.token_to_id("</s>") == EOS_TOKEN_ID
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=2,
        tie_word_embeddings=False,
        # Large initial weights make the output depend strongly on the whole
        # context, so a test can tell transferred KV from garbage KV.
        initializer_range=0.5,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build(args.out_dir, args.seed)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
