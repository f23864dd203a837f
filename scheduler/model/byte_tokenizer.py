"""A byte-level tokenizer: one token per UTF-8 byte, plus two special tokens.

Ids ``0 .. 255`` are the byte values; ``BOS_TOKEN_ID`` (256) and ``EOS_TOKEN_ID`` (257) are the
begin- and end-of-sequence markers. Any text encodes, so there is no unknown token. Decoding
drops the special tokens and replaces byte sequences that are not valid UTF-8 (a generation
may stop in the middle of a character) with U+FFFD.
"""

from __future__ import annotations

from collections.abc import Iterable

BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
VOCAB_SIZE = 258


class ByteTokenizer:
    """Text to UTF-8 byte ids and back."""

    vocab_size = VOCAB_SIZE
    bos_token_id = BOS_TOKEN_ID
    eos_token_id = EOS_TOKEN_ID

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``, preceded by BOS when ``add_bos``."""
        ids = list(text.encode("utf-8"))
        return [BOS_TOKEN_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of the byte ids, special tokens dropped, invalid UTF-8 replaced.

        Raises ``ValueError`` naming the first id outside ``0 .. vocab_size - 1``.
        """
        data = bytearray()
        for i in ids:
            if 0 <= i < 256:
                data.append(i)
            elif i not in (BOS_TOKEN_ID, EOS_TOKEN_ID):
                raise ValueError(f"token id {i} is outside the vocabulary 0..{VOCAB_SIZE - 1}")
        return data.decode("utf-8", errors="replace")
