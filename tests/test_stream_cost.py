"""What a ``/generate`` stream costs, and SGLang's two flags that change its chunks.

A chunk of a stream that is not incremental is the answer so far; it is built from what each
pass adds (the text after the settled tokens' text, the new tokens' logprob entries, the JSON of
the chunk before), and must be, byte for byte, the JSON of the whole answer so far dumped again:
:func:`whole_chunk` writes that as the route did before, and every chunk is compared with it,
for the byte tokenizer of the reference model, SmolLM2's byte-level BPE and a SentencePiece
byte-fallback tokenizer, over tokens that split characters and lead with spaces.

``--stream-interval N`` sends a chunk once N tokens are new (the first at once, the rest with the
answer); ``--incremental-streaming-output`` makes each chunk carry only what it adds.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from lifecycle import SamplingParams
from scheduler.cli.main import build_parser
from scheduler.cli.serve import serve_config
from scheduler.messages import TokenLogprob
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.reference import ModelConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.answers import (
    LOGPROB_KEYS,
    IncrementalText,
    answer_body,
    answer_text,
    continuation,
)
from scheduler.service.config import AnswerOptions, Item, ServeConfig
from scheduler.service.pending import Pending, Progress
from scheduler.service.routes_generate import _CumulativeBody
from tests.service_harness import asgi_client, run, running_service, tokens_of_stream
from tests.stream_tokenizers import byte_pieces, outputs, sentencepiece, vocab_size

MODEL = ModelConfig.tiny(seed=5)
CONFIG = ServeConfig(role="both", backend="local", model=MODEL,
                     scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16),
                     pool_pages=64, metadata_slots=8, max_new_tokens_limit=64)
LATENCY = re.compile(r'"e2e_latency": [0-9.e+-]+')


def whole_chunk(tokenizer: Any, pending: Pending, ids: Sequence[int],
                logprobs: Sequence[TokenLogprob], cached_tokens: int) -> str:
    """A chunk as the route wrote it before it kept anything between chunks: the whole answer
    so far decoded, converted and dumped."""
    item = pending.item
    return json.dumps(answer_body(
        tokenizer, item, ids=ids, text=answer_text(tokenizer, item, ids, None).rstrip("\ufffd"),
        prompt_tokens=len(item.input_ids), latency=0.0, finish=None,
        cached_tokens=cached_tokens, input_logprobs=pending.input_logprobs,
        output_logprobs=logprobs))


def _pending(item: Item, loop: asyncio.AbstractEventLoop,
             inputs: tuple[TokenLogprob, ...]) -> Pending:
    return Pending(item=item, loop=loop, future=loop.create_future(), started=0.0,
                   waiting_on=set(), input_logprobs=inputs)


def _entry(rng: random.Random, token: int, vocab: int) -> TokenLogprob:
    alternatives = tuple((rng.randrange(vocab), -rng.random() * 5) for _ in range(3))
    return TokenLogprob(token, rng.choice([-rng.random() * 4, float("-inf")]), alternatives,
                        ((7, -1.5), (9, float("-inf"))))


def _check_chunks(tokenizer: Any, prompt: Sequence[int], output: Sequence[int], seed: int, *,
                  logprobs: bool, skip_special: bool = True) -> None:
    """Feed ``output`` a random number of tokens at a time; every chunk is the whole one."""
    rng = random.Random(seed)
    vocab = vocab_size(tokenizer)
    sampling = SamplingParams(64, return_logprob=logprobs, top_logprobs_num=2 if logprobs else 0,
                              token_ids_logprob=(7, 9) if logprobs else ())
    item = Item("s", tuple(prompt), sampling, "local", 0, 1,
                options=AnswerOptions(False, skip_special, rng.random() < 0.5))
    inputs = tuple(_entry(rng, t, vocab) for t in prompt) if logprobs else ()
    loop = asyncio.new_event_loop()
    try:
        pending = _pending(item, loop, inputs)
        body = _CumulativeBody(tokenizer, pending)
        done: list[int] = []
        entries: list[TokenLogprob] = []
        while len(done) < len(output):
            tokens = output[len(done):len(done) + rng.choice([1, 1, 1, 2, 3])]
            new = tuple(_entry(rng, t, vocab) for t in tokens) if logprobs else ()
            done += tokens
            entries += new
            chunk = body.more(Progress(tuple(tokens), new, cached_tokens=len(prompt) // 2)).json
            whole = whole_chunk(tokenizer, pending, done, entries, len(prompt) // 2)
            assert LATENCY.sub("", chunk) == LATENCY.sub("", whole), (len(done), output)
    finally:
        loop.close()


def test_cumulative_chunks_are_the_whole_answer_dumped_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    rng = random.Random(1)
    # Bytes that open characters never closed, a prompt that ends inside one.
    cases = [*outputs(tok, rng), [0xE2, 0x98, 0x41, 0xF0, 0x9F, 0x8E, 0x89, 0xFF, 0x20]]
    for prompt in (list(b"Say "), [*b"caf", 0xC3]):
        for k, output in enumerate(cases):
            for logprobs in (False, True):
                _check_chunks(tok, prompt, output, k, logprobs=logprobs)


def test_cumulative_chunks_are_the_whole_answer_dumped_smollm2(smollm2: Any) -> None:
    tok = smollm2.tokenizer
    rng = random.Random(2)
    special = [tok.eos_token_id] if tok.eos_token_id is not None else []
    prompt = tok.encode("Write it in Chinese:", add_special_tokens=False)
    for k, output in enumerate(outputs(tok, rng, special=special)):
        for skip in (True, False):
            _check_chunks(tok, prompt, output, k, logprobs=k % 2 == 0, skip_special=skip)


def test_cumulative_chunks_are_the_whole_answer_dumped_sentencepiece(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = sentencepiece(tmp_path_factory.mktemp("spm"))
    rng = random.Random(3)
    byte = byte_pieces(tok)
    words = tok.encode(" the capital", add_special_tokens=False)
    groups = [[*words, byte[0x49], byte[0xDD], *words],  # a byte group that ends invalid
              [*words, byte[0xE2], byte[0x98], byte[0x83], *words],  # ☃ from three bytes
              [byte[0x49], byte[0xDD]], [byte[0xE2], byte[0x98], byte[0x83]]]
    special = [tok.eos_token_id] * 6 if tok.eos_token_id is not None else []
    for prompt in (tok.encode("Say"), [*tok.encode("Say"), byte[0xE2]]):
        for k, output in enumerate([*groups, *outputs(tok, rng, special=special)]):
            for skip in (True, False):
                _check_chunks(tok, prompt, output, k, logprobs=k % 2 == 1, skip_special=skip)
    # Byte-fallback groups with special tokens inside (skipped, they do not close a group: its
    # bytes join across them), lone spaces, words; a pass adds up to 8 tokens.
    alphabet = [*sorted(tok.byte_pieces), *[tok.eos_token_id] * 8, *words,
                *tok.encode(" ☃ naïve  x", add_special_tokens=False)]
    for seed in range(300):
        rng = random.Random(seed)
        output = [rng.choice(alphabet) for _ in range(rng.randrange(1, 30))]
        _check_text(tok, [*tok.encode("Say"), *rng.choice([[], [byte[0xE2]]])], output, rng,
                    skip_special=rng.random() < 0.5)


def _check_text(tokenizer: Any, prompt: Sequence[int], output: Sequence[int],
                rng: random.Random, *, skip_special: bool) -> None:
    """The text kept between passes is the whole output's, after every pass, and so is the text
    of each of its prefixes."""
    item = Item("s", tuple(prompt), SamplingParams(64), "local", 0, 1,
                options=AnswerOptions(False, skip_special, False))
    text = IncrementalText(tokenizer, item)
    done: list[int] = []
    while len(done) < len(output):
        tokens = output[len(done):len(done) + rng.randrange(1, 9)]
        done += tokens
        assert text.more(tokens) == answer_text(tokenizer, item, done, None), (prompt, output)
        for end in range(len(done) + 1):
            assert text.upto(end) == continuation(tokenizer, item, done[:end]), (end, output)


# -- served -------------------------------------------------------------------------------------


def _stream_body(**extra: Any) -> dict[str, Any]:
    return {"rid": "streamed", "input_ids": [72, 101, 108, 108, 111, 44, 32], "stream": True,
            "return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0.9,
                                "sampling_seed": 3}, **extra}


def _served_chunks(config: ServeConfig, body: dict[str, Any]
                   ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """The stream's raw body and chunks, and the same request's unstreamed answer."""
    async def main() -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        with running_service(config) as service:
            async with asgi_client(service) as client:
                streamed = await client.post("/generate", json=body)
                assert streamed.status_code == 200, streamed.text
                whole = await client.post("/generate", json={**body, "stream": False,
                                                             "rid": "whole"})
                assert whole.status_code == 200, whole.text
        chunks, done = tokens_of_stream(streamed.text)
        assert done
        return streamed.text, chunks, whole.json()

    result: tuple[str, list[dict[str, Any]], dict[str, Any]] = run(main())
    return result


def test_a_served_stream_writes_each_chunk_as_the_whole_answer_so_far() -> None:
    raw, chunks, whole = _served_chunks(CONFIG, _stream_body(return_text_in_logprobs=True))
    item = Item("streamed", (72, 101, 108, 108, 111, 44, 32), SamplingParams(
        24, return_logprob=True, top_logprobs_num=5), "local", 0, 1,
        options=AnswerOptions(False, True, True))
    meta = whole["meta_info"]
    lines = [line for line in raw.split("\n\n") if line][:-2]  # not the last chunk, nor [DONE]
    assert len(lines) == len(chunks) - 1 > 1
    outputs = [TokenLogprob(tok, lp) for lp, tok, _ in meta["output_token_logprobs"]]
    tops = [tuple((tok, lp) for lp, tok, _ in top) for top in meta["output_top_logprobs"]]
    inputs = tuple(TokenLogprob(tok, lp, tuple((t, p) for p, t, _ in top or ()))
                   for (lp, tok, _), top in zip(meta["input_token_logprobs"],
                                                meta["input_top_logprobs"], strict=True))
    loop = asyncio.new_event_loop()
    try:
        pending = _pending(item, loop, inputs)
        for line, chunk in zip(lines, chunks, strict=False):
            n = len(chunk["output_ids"])
            entries = [TokenLogprob(e.token, e.logprob, top)
                       for e, top in zip(outputs[:n], tops[:n], strict=True)]
            expected = whole_chunk(ByteTokenizer(), pending, chunk["output_ids"], entries,
                                   chunk["meta_info"]["cached_tokens"])
            assert LATENCY.sub("", line.removeprefix("data: ")) == LATENCY.sub("", expected)
    finally:
        loop.close()
    assert chunks[-1] == {**whole, "meta_info": {
        **meta, "id": "streamed", "e2e_latency": chunks[-1]["meta_info"]["e2e_latency"]}}


def test_stream_interval_sends_the_first_token_then_every_n() -> None:
    n = 5
    _, chunks, whole = _served_chunks(attrs.evolve(CONFIG, stream_interval=n), _stream_body())
    # One token a pass: chunks at 1, 1 + n, 1 + 2n, ... tokens (SGLang's cadence), the answer.
    assert [len(c["output_ids"]) for c in chunks] == [*range(1, 24, n), 24]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    for chunk in chunks[:-1]:  # cumulative: each the answer's beginning
        assert whole["output_ids"][:len(chunk["output_ids"])] == chunk["output_ids"]


def test_stream_interval_batches_the_openai_chunks_too() -> None:
    config = attrs.evolve(CONFIG, stream_interval=6)
    body = {"model": "m", "prompt": "Hello, ", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0.9, "seed": 3}

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        with running_service(config) as service:
            async with asgi_client(service) as client:
                streamed = await client.post("/v1/completions", json={**body, "stream": True})
                whole = await client.post("/v1/completions", json=body)
        chunks, _ = tokens_of_stream(streamed.text)
        return chunks, whole.json()

    chunks, whole = run(main())
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert len(chunks) <= 2 + 23 // 6, len(chunks)


def test_incremental_chunks_carry_only_what_they_add() -> None:
    config = attrs.evolve(CONFIG, incremental_streaming_output=True, stream_interval=2)
    for extra in ({}, {"sampling_params": {"max_new_tokens": 24, "temperature": 0.9,
                                            "sampling_seed": 3, "ignore_eos": True,
                                            "stop": ["e", "a"]}}):
        _, chunks, whole = _served_chunks(config, _stream_body(**extra))
        meta, last = whole["meta_info"], chunks[-1]["meta_info"]
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
        for key in LOGPROB_KEYS:
            if key in meta:
                assert [e for c in chunks for e in c["meta_info"][key]] == meta[key], key
        assert chunks[0]["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
        assert all(not c["meta_info"]["input_token_logprobs"] for c in chunks[1:])
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == [
            sum(len(c["output_ids"]) for c in chunks[:k + 1]) for k in range(len(chunks))]
        assert last["finish_reason"] == meta["finish_reason"]
        assert last["completion_tokens"] == meta["completion_tokens"]
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        assert len(chunks) > 2


def test_the_flags_set_the_configuration() -> None:
    def config(*flags: str) -> ServeConfig:
        return serve_config(build_parser("serve").parse_args(
            ["serve", "--backend", "local", *flags]))

    assert (config().stream_interval, config().incremental_streaming_output) == (
        ServeConfig(role="both", backend="local").stream_interval, False)
    given = config("--stream-interval", "8", "--incremental-streaming-output")
    assert (given.stream_interval, given.incremental_streaming_output) == (8, True)
    with pytest.raises(SystemExit):
        config("--stream-interval", "0")
    with pytest.raises(ValueError, match="stream_interval"):
        ServeConfig(role="both", backend="local", stream_interval=0)
