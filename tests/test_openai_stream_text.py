"""What an OpenAI stream sends of its text (:class:`StreamText`), against its rules stated on the
whole output's text.

A stream keeps its output's text as it grows (:class:`~scheduler.service.answers.IncrementalText`)
and decodes only the tokens after a settled run each pass; what it sends must be what the rules
give when every text is the whole output's (or its first few tokens') decoded again:
:class:`Expected` states them so, on :func:`continuation`. Random outputs are fed in random-size
pieces to both, on the byte tokenizer, SmolLM2's byte-level BPE and a SentencePiece byte-fallback
tokenizer, with stop strings (some leading with a space), stop regexes, stop token ids, special
tokens skipped or not, and logprobs asked (so the stream counts the tokens its text released);
after every piece the deltas, ``sent``, ``released`` and ``released_within`` agree.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from lifecycle import SamplingParams
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.sample.stops import Stops
from scheduler.service.answers import continuation, decode
from scheduler.service.config import AnswerOptions, Item
from scheduler.service.openai_format import StreamText
from tests.stream_tokenizers import TEXTS, byte_pieces, encoded, sentencepiece, vocab_size


@attrs.define
class Expected:
    """:class:`StreamText`'s rules, each text decoded whole: send the text of the output's
    tokens but a last one that may be a stop token and a trailing run of byte-fallback pieces,
    less a trailing incomplete character and what a stop can still claim, once it extends what
    was sent; count the most leading tokens whose text is all sent (or shown)."""

    tokenizer: Any
    item: Item
    ids: list[int] = attrs.field(factory=list)
    sent: str = ""
    released: int = 0
    within: int = 0

    def _text(self, end: int) -> str:
        return continuation(self.tokenizer, self.item, self.ids[:end])

    def more(self, tokens: Sequence[int]) -> str:
        self.ids += tokens
        trim = not self.item.options.no_stop_trim
        end = len(self.ids)
        if trim and self.item.sampling.stop_token_ids and end:
            end -= 1
        held = getattr(self.tokenizer, "byte_pieces", frozenset())
        while end and self.ids[end - 1] in held:
            end -= 1
        text = self._text(end).rstrip("\ufffd")
        stops = Stops.of(self.item.sampling) if trim else Stops()
        if stops:
            text = text[:stops.settled(text)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        if self.item.sampling.return_logprob:
            self.released = self._longest(self.sent, self.released)
        return delta

    def released_within(self, shown: str) -> int:
        if self.item.sampling.return_logprob:
            self.within = self._longest(shown, self.within)
        return self.within

    def _longest(self, shown: str, known: int) -> int:
        return max((end for end in range(known + 1, len(self.ids) + 1)
                    if shown.startswith(self._text(end))), default=known)


def _item(rng: random.Random, tokenizer: Any, prompt: Sequence[int], output: Sequence[int],
          alphabet: Sequence[int], spaced: Sequence[str]) -> Item:
    """A request with random stops: strings cut out of the output's text (so they match), ones
    in ``spaced`` (leading with a space), and maybe a regex, a stop token, logprobs."""
    text = decode(tokenizer, output, skip_special_tokens=False)
    stops: list[str] = []
    for _ in range(rng.randrange(3)):
        if text and rng.random() < 0.7:
            at = rng.randrange(len(text))
            stops.append(text[at:at + rng.randrange(1, 5)])
        else:
            stops.append(rng.choice([*spaced, "zz", "é"]))
    regexes = rng.choice([(), (), (), ("t.e",), (r"\d+",), ("a+",)])
    stop_tokens = (rng.choice(alphabet),) if rng.random() < 0.4 else ()
    sampling = SamplingParams(64, stop=tuple(stops), stop_regex=regexes,
                              stop_token_ids=stop_tokens, return_logprob=rng.random() < 0.8)
    return Item("s", tuple(prompt), sampling, "local", 0, 1, options=AnswerOptions(
        no_stop_trim=rng.random() < 0.2, skip_special_tokens=rng.random() < 0.5))


def _check(tokenizer: Any, prompts: Sequence[Sequence[int]], alphabet: Sequence[int],
           spaced: Sequence[str], cases: int) -> None:
    for seed in range(cases):
        rng = random.Random(seed)
        output = [rng.choice(alphabet) for _ in range(rng.randrange(1, 40))]
        item = _item(rng, tokenizer, rng.choice(prompts), output, alphabet, spaced)
        text, expected = StreamText(tokenizer, item), Expected(tokenizer, item)
        done = 0
        while done < len(output):
            tokens = output[done:done + rng.choice([1, 1, 1, 2, 3, 8])]
            done += len(tokens)
            where = (seed, done, item)
            assert text.more(tokens) == expected.more(tokens), where
            assert (text.sent, text.released) == (expected.sent, expected.released), where
            shown = text.sent[:rng.randrange(len(text.sent) + 1)]
            for part in (shown, text.sent):  # a tool stream shows a part of what was sent
                assert text.released_within(part) == expected.released_within(part), where
        assert text.ids == output


def test_a_byte_tokenizer_stream_sends_what_its_rules_give() -> None:
    tok = ByteTokenizer()
    alphabet = [*(b for text in TEXTS for b in text.encode()), 0xFF, 0x20, 0x20,
                tok.eos_token_id, 256]
    _check(tok, [list(b"Say "), [*b"caf", 0xC3]], alphabet, [" the", " a"], cases=200)


def test_a_smollm2_stream_sends_what_its_rules_give(smollm2: Any) -> None:
    tok = smollm2.tokenizer
    rng = random.Random(7)
    alphabet = [*(t for text in TEXTS for t in encoded(tok, text)), *[tok.eos_token_id] * 4,
                *(rng.randrange(vocab_size(tok)) for _ in range(8))]
    _check(tok, [encoded(tok, "Write it in Chinese:")], alphabet, [" the", " capital"],
           cases=120)


def test_a_sentencepiece_stream_sends_what_its_rules_give(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = sentencepiece(tmp_path_factory.mktemp("spm"))
    words = encoded(tok, " the capital")
    alphabet = [*sorted(tok.byte_pieces), *[tok.eos_token_id] * 8, *words, *words,
                *encoded(tok, " ☃ naïve  x"), *encoded(tok, TEXTS[1])]
    prompts = [tok.encode("Say"), [*tok.encode("Say"), byte_pieces(tok)[0xE2]]]
    _check(tok, prompts, alphabet, [" the", " capital", " ☃"], cases=200)


class _Counting:
    """A tokenizer that counts the tokens it decodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids: Sequence[int], **options: Any) -> str:
        self.decoded += len(ids)
        text: str = self.tokenizer.decode(ids, **options)
        return text

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_a_pass_decodes_the_tokens_after_the_settled_text_not_the_whole_output(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """One token a pass, with a stop token held, stop strings held back and the released tokens
    counted: each pass decodes a few tokens, however long the output (decoding it whole, a pass
    would decode them all)."""
    tok = sentencepiece(tmp_path_factory.mktemp("spm"))
    counting = _Counting(tok)
    byte = byte_pieces(tok)
    output = [*encoded(tok, TEXTS[1]), byte[0xE2], byte[0x98], byte[0x83],
              *encoded(tok, " naïve")] * 30
    item = Item("s", tuple(tok.encode("Say")), SamplingParams(
        64, stop=("never said",), stop_token_ids=(tok.eos_token_id,), return_logprob=True),
        "local", 0, 1)
    text = StreamText(counting, item)
    for token in output:
        text.more([token])
        text.released_within(text.sent)
    assert text.sent and text.released > len(output) - 20
    assert counting.decoded < 150 * len(output), (counting.decoded, len(output))
