from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.model.byte_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, ByteTokenizer

tok = ByteTokenizer()


@given(st.text())
def test_round_trip(text: str) -> None:
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_special_ids_are_documented_and_in_vocab() -> None:
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (256, 257, 258)
    assert BOS_TOKEN_ID < VOCAB_SIZE and EOS_TOKEN_ID < VOCAB_SIZE


def test_bos_is_prepended_and_specials_are_dropped_on_decode() -> None:
    ids = tok.encode("héllo", add_bos=True)
    assert ids[0] == BOS_TOKEN_ID
    assert tok.decode([*ids, EOS_TOKEN_ID]) == "héllo"


def test_invalid_utf8_is_replaced() -> None:
    # A generation cut in the middle of a two-byte character.
    cut = tok.encode("é")[:1]
    assert tok.decode([*tok.encode("ab"), *cut]) == "ab\ufffd"


@pytest.mark.parametrize("bad", [-1, VOCAB_SIZE, 10_000])
def test_ids_outside_vocab_are_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match=f"token id {bad} is outside"):
        tok.decode([65, bad])
