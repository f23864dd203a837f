"""Logprobs in streams: every chunk of a ``/generate`` stream carries the logprob fields of the
answer so far (SGLang's ``meta_info``), every OpenAI chunk the logprobs of the tokens whose text
it sends, and either way they add up to the unstreamed answer's.

The decode steps of these services are paced by the stream: a step waits until the client got
one more chunk (:class:`Gate`), so a stream has a chunk for each decode pass whatever the
machine's speed, and a chunk before the last has something to carry.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
import httpx
import httpx2
import openai
import pytest

from lifecycle import SamplingParams
from scheduler.messages import TokenLogprob
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.reference import ModelConfig, PagedModelRunner
from scheduler.prefill.config import SchedulerConfig
from scheduler.runner import ForwardBatch, LogitsRunner
from scheduler.service.answers import LOGPROB_KEYS, answer_text
from scheduler.service.app import create_app
from scheduler.service.config import Answer, AnswerOptions, Item, ServeConfig
from scheduler.service.core import Service
from scheduler.service.openai_format import StreamLogprobs, StreamText
from scheduler.service.openai_schema import CompletionLogprobs
from tests.service_harness import run, running_service, tokens_of_stream

MODEL = ModelConfig.tiny(seed=3)
CONFIG = ServeConfig(role="both", backend="local", model=MODEL,
                     scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=16),
                     pool_pages=64, metadata_slots=8, max_new_tokens_limit=32)
PROMPT = [72, 101, 108, 108, 111, 44, 32, 112, 100, 108, 105, 102, 101]
NEW = 8
TOKENIZER = ByteTokenizer()
#: How long a decode step waits for the client's next chunk before the test fails.
STEP_TIMEOUT_S = 60.0


class Gate:
    """Permits for decode steps: a step takes one; each chunk the client receives adds one.
    Open, it lets every step through (for unstreamed answers)."""

    def __init__(self, permits: int = 1) -> None:
        self._permits = threading.Semaphore(permits)
        self.open = False

    def take(self) -> None:
        if not self.open and not self._permits.acquire(timeout=STEP_TIMEOUT_S):
            raise TimeoutError(f"no stream chunk reached the client within {STEP_TIMEOUT_S} s")

    def give(self) -> None:
        self._permits.release()

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        self.open = True
        try:
            yield
        finally:
            self.open = False


class PacedRunner:
    """A model runner whose decode steps (batches of one-token items; the tests' prompts are
    longer) wait for the gate; its pool and vocabulary are the inner runner's."""

    def __init__(self, inner: LogitsRunner, gate: Gate) -> None:
        self.inner, self.gate = inner, gate
        self.pool, self.vocab_size = inner.pool, inner.vocab_size

    def _pace(self, batch: ForwardBatch) -> None:
        if all(len(item.input_ids) == 1 for item in batch.items):
            self.gate.take()

    def forward(self, batch: ForwardBatch) -> list[int]:
        self._pace(batch)
        return self.inner.forward(batch)

    def logits(self, batch: ForwardBatch) -> Any:
        self._pace(batch)
        return self.inner.logits(batch)


def paced_app(service: Service, gate: Gate) -> Any:
    """The service's app; every body message it sends gives the gate a permit."""
    app = create_app(service)

    async def paced(scope: Any, receive: Any, send: Any) -> None:
        async def sent(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and message.get("body"):
                gate.give()

        await app(scope, receive, sent)

    return paced


@contextlib.contextmanager
def paced_service(config: ServeConfig, make_runner: Any,
                  permits: int = 1) -> Iterator[tuple[Service, Gate]]:
    gate = Gate(permits)
    with running_service(config, runner_factory=lambda model, pool: PacedRunner(
            make_runner(model, pool), gate)) as service:
        yield service, gate


@contextlib.asynccontextmanager
async def client_of(service: Service, gate: Gate) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=paced_app(service, gate))
    async with httpx.AsyncClient(transport=transport, base_url="http://pdlife") as client:
        yield client


# -- /generate ----------------------------------------------------------------------------------


def test_generate_stream_chunks_carry_the_logprobs_of_the_answer_so_far() -> None:
    body: dict[str, Any] = {
        "input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
        "logprob_start_len": 0, "return_text_in_logprobs": True, "token_ids_logprob": [5, 9],
        "sampling_params": {"max_new_tokens": NEW, "ignore_eos": True, "temperature": 0.8,
                            "sampling_seed": 11}}

    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with paced_service(CONFIG, PagedModelRunner) as (service, gate):
            async with client_of(service, gate) as client:
                with gate.opened():
                    plain = await client.post("/generate", json=body)
                streamed = await client.post("/generate", json={**body, "stream": True})
        assert plain.status_code == 200, plain.text
        chunks, done = tokens_of_stream(streamed.text)
        assert done
        return plain.json(), chunks

    plain, chunks = run(main())
    want = plain["meta_info"]
    assert len(want["output_token_logprobs"]) == NEW
    assert len(want["input_token_logprobs"]) == len(PROMPT)
    # A decode pass per chunk: all but the last token's come before the answer.
    assert len(chunks) >= NEW - 1
    for chunk in chunks:
        got, n = chunk["meta_info"], len(chunk["output_ids"])
        assert chunk["output_ids"] == plain["output_ids"][:n]
        assert got["completion_tokens"] == n
        assert got["input_token_logprobs"] == want["input_token_logprobs"]
        assert got["input_top_logprobs"] == want["input_top_logprobs"]
        assert got["output_token_logprobs"] == want["output_token_logprobs"][:n]
        assert got["output_top_logprobs"] == want["output_top_logprobs"][:n]
        assert got["input_token_ids_logprobs"] == want["input_token_ids_logprobs"]
        assert got["output_token_ids_logprobs"] == want["output_token_ids_logprobs"][:n]
    assert chunks[-2]["meta_info"]["finish_reason"] is None and len(chunks[-2]["output_ids"]) > 1
    assert {k: chunks[-1]["meta_info"][k] for k in LOGPROB_KEYS} == {
        k: want[k] for k in LOGPROB_KEYS}


def test_the_first_token_is_streamed_before_the_first_decode_step() -> None:
    """No decode step may run before the client got a chunk (no permit to start with): the
    first token, from the metadata row, must come alone, ahead of the decode forward."""
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}

    async def main() -> list[dict[str, Any]]:
        with paced_service(CONFIG, PagedModelRunner, permits=0) as (service, gate):
            async with client_of(service, gate) as client:
                r = await client.post("/generate", json=body)
        chunks, done = tokens_of_stream(r.text)
        assert done
        return chunks

    chunks = run(main())
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3]


def test_a_generate_stream_without_logprobs_has_no_logprob_fields() -> None:
    async def main() -> list[dict[str, Any]]:
        with paced_service(CONFIG, PagedModelRunner) as (service, gate):
            async with client_of(service, gate) as client:
                r = await client.post("/generate", json={
                    "input_ids": PROMPT, "stream": True,
                    "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        chunks, _ = tokens_of_stream(r.text)
        return chunks

    chunks = run(main())
    assert len(chunks) >= 3
    assert all(not set(LOGPROB_KEYS) & set(c["meta_info"]) for c in chunks)


# -- /v1/completions ----------------------------------------------------------------------------


def test_completion_stream_logprobs_add_up_to_the_unstreamed_answers() -> None:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0,
                            "ignore_eos": True, "logprobs": 3}

    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with paced_service(CONFIG, PagedModelRunner) as (service, gate):
            async with client_of(service, gate) as client:
                with gate.opened():
                    plain = await client.post("/v1/completions", json=body)
                streamed = await client.post("/v1/completions", json={**body, "stream": True})
        assert plain.status_code == 200, plain.text
        chunks, done = tokens_of_stream(streamed.text)
        assert done
        return plain.json()["choices"][0], chunks

    want, chunks = run(main())
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == want["text"]
    joined: dict[str, list[Any]] = {k: [] for k in want["logprobs"]}
    for choice in choices:
        for key, values in choice["logprobs"].items():
            joined[key].extend(values)
    assert joined == want["logprobs"]
    # The chunks before the last carried logprobs of their own.
    early = [c["logprobs"]["tokens"] for c in choices[:-1] if c["logprobs"]["tokens"]]
    assert len(early) >= 2


def _entries(ids: list[int]) -> list[TokenLogprob]:
    return [TokenLogprob(t, -0.5 - i, ((t, -0.5 - i),)) for i, t in enumerate(ids)]


def _streamed(item: Item, ids: list[int], matched: int | str | None) -> list[tuple[str, list[str]]]:
    """(text, token texts of the logprobs) per chunk, one token a pass, as the route sends."""
    text = StreamText(TOKENIZER, item)
    logprobs = StreamLogprobs(TOKENIZER, item, chat=False)
    sent: list[tuple[str, list[str]]] = []
    for token, entry in zip(ids, _entries(ids), strict=True):
        logprobs.more([entry])
        delta = text.more([token])
        if delta:
            got = logprobs.upto(text.released)
            assert isinstance(got, CompletionLogprobs)
            sent.append((delta, list(got.tokens)))
    answer = Answer(rid="s", status=200, output_ids=tuple(ids), finish_reason="stop",
                    message="", reason=None, prompt_tokens=1, e2e_latency=0.0,
                    output_logprobs=tuple(_entries(ids)), matched_stop=matched)
    rest = logprobs.rest(answer)
    assert isinstance(rest, CompletionLogprobs)
    sent.append((text.rest(answer_text(TOKENIZER, item, ids, matched)), list(rest.tokens)))
    return sent


def _item(**sampling: Any) -> Item:
    return Item("s", (1,), SamplingParams(16, return_logprob=True, **sampling), "local", 0, 1)


def test_held_back_text_carries_its_logprobs_when_released() -> None:
    # A character of three bytes goes out whole, with the logprobs of its three tokens.
    ids = TOKENIZER.encode("a☃b")
    chunks = _streamed(_item(), ids, None)
    snowman = [TOKENIZER.decode([t]) for t in TOKENIZER.encode("☃")]
    assert chunks == [("a", ["a"]), ("☃", snowman), ("b", ["b"]), ("", [])]
    # A possible stop token waits for the next token; the stop token itself, whose text is
    # trimmed, comes with the last chunk.
    ids = TOKENIZER.encode("ab!")
    assert _streamed(_item(stop_token_ids=(ord("!"),)), ids, ord("!")) == [
        ("a", ["a"]), ("b", ["b"]), ("", ["!"])]
    # The tail that may become a stop string is held; what the stop cut off comes last.
    ids = TOKENIZER.encode("abXcQQXY")
    item = _item(stop=("XY", "QQQ"))
    chunks = _streamed(item, ids, "XY")
    assert "".join(t for t, _ in chunks) == "abXcQQ"
    assert [tok for _, toks in chunks for tok in toks] == list("abXcQQXY")
    for text, toks in chunks[:-1]:
        assert "".join(toks) == text
    kept = attrs.evolve(item, options=AnswerOptions(no_stop_trim=True))
    chunks = _streamed(kept, ids, "XY")
    assert "".join(t for t, _ in chunks) == "abXcQQXY"
    assert [tok for _, toks in chunks for tok in toks] == list("abXcQQXY")


# -- chat on SmolLM2, through the official client ----------------------------------------------


@pytest.fixture(scope="module")
def chat_config(smollm2: Any) -> ServeConfig:
    return ServeConfig(role="both", backend="local", served=smollm2, model_name="smollm2",
                       scheduler=SchedulerConfig(page_size=16, chunked_prefill_size=64),
                       pool_pages=64, metadata_slots=8)


QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_stream_chunks_carry_the_logprobs_of_their_text(
        smollm2: Any, chat_config: ServeConfig) -> None:
    async def main() -> tuple[Any, list[Any]]:
        with paced_service(chat_config, smollm2.runner) as (service, gate):
            transport = httpx2.ASGITransport(app=paced_app(service, gate))
            async with httpx2.AsyncClient(transport=transport, base_url="http://pdlife/v1") as h:
                client = openai.AsyncOpenAI(base_url="http://pdlife/v1", api_key="none",
                                            http_client=h, max_retries=0)
                ask: Any = {"model": "smollm2", "messages": QUESTION, "max_tokens": 16,
                            "temperature": 0, "logprobs": True, "top_logprobs": 2}
                with gate.opened():
                    plain = await client.chat.completions.create(**ask)
                stream = await client.chat.completions.create(**ask, stream=True)
                return plain, [c async for c in stream]

    plain, chunks = run(main())
    want = plain.choices[0].logprobs.content
    assert want and plain.choices[0].message.content == "The capital of France is Paris."
    got = [e for c in chunks for e in (c.choices[0].logprobs.content
                                       if c.choices[0].logprobs else [])]
    assert [e.model_dump() for e in got] == [e.model_dump() for e in want]
    texts = [c for c in chunks[1:-1] if c.choices[0].delta.content]
    assert len(texts) >= 3  # paced: the answer came in pieces
    for chunk in texts:  # each piece carries the logprobs of the tokens that make its text
        entries = chunk.choices[0].logprobs.content
        assert "".join(e.token for e in entries) == chunk.choices[0].delta.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert [e.token for e in chunks[-1].choices[0].logprobs.content] == [want[-1].token]
