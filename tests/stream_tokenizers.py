"""The tokenizers and outputs the stream-text tests feed: the byte tokenizer of the reference
model, SmolLM2's byte-level BPE (the ``smollm2`` fixture's) and a SentencePiece byte-fallback
tokenizer, over tokens that split characters, lead with spaces and hold special tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler.model.byte_tokenizer import ByteTokenizer

TEXTS = ("héllo wörld, 世界 ☃ and 🎉 done", " the capital is  Paris.\n\n  indented",
         "naïve café — “quoted” ½")

#: The bytes whose byte-fallback pieces :func:`byte_pieces` names: "I" then 0xDD (a group that
#: ends invalid), and ☃'s three.
BYTES = (0x49, 0xDD, 0xE2, 0x98, 0x83)


def sentencepiece(where: Path) -> Any:
    """A Llama 2-style tokenizer (``▁`` for spaces, byte fallback), built in ``where``."""
    from scheduler.model.checkpoint import TokenizerSource
    from scheduler.model.hf_tokenizer import load_tokenizer
    from tests.test_hf_tokenizer import _sentencepiece_style

    _sentencepiece_style(where)
    tok = load_tokenizer(TokenizerSource(directory=where))
    assert tok.metaspace and tok.byte_pieces
    return tok


def byte_pieces(tok: Any) -> dict[int, int]:
    """The SentencePiece tokenizer's byte-fallback pieces of :data:`BYTES`, by byte."""
    return {b: tok.tokenizer.token_to_id(f"<0x{b:02X}>") for b in BYTES}


def vocab_size(tokenizer: Any) -> int:
    return 256 if isinstance(tokenizer, ByteTokenizer) else int(tokenizer.vocab_size)


def encoded(tokenizer: Any, text: str) -> list[int]:
    """``text``'s tokens, with no special ones."""
    if isinstance(tokenizer, ByteTokenizer):
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, add_special_tokens=False))


def outputs(tokenizer: Any, rng: random.Random, *, special: Sequence[int] = ()
            ) -> list[list[int]]:
    """Outputs that split characters over tokens, lead with spaces, hold special tokens, and
    random ones."""
    vocab = vocab_size(tokenizer)
    texts = [encoded(tokenizer, text) for text in TEXTS]
    mixed = [*texts[0][:5], *special, *texts[1], *special, *special, *texts[2]]
    return [*texts, mixed, [rng.randrange(vocab) for _ in range(60)],
            [rng.randrange(vocab) for _ in range(60)]]
