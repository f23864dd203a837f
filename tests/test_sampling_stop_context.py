"""Stop strings on a SentencePiece-style tokenizer (Llama 2's: the decoder strips the space a
text starts with): the decode side searches the tail of the output decoded after the tokens
before it, so a stop that begins with a space matches at the answer's very start, as it stands
in the answer's text (SGLang and OpenAI answer ``""`` with the stop matched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle import SamplingParams
from scheduler.model.byte_tokenizer import ByteTokenizer
from scheduler.model.select import ServedModel, load_model
from scheduler.prefill.config import SchedulerConfig
from scheduler.sample.stops import Stops
from scheduler.service.config import ServeConfig
from tests.service_harness import asgi_client, run, running_service
from tests.test_checkpoint import tiny_hf_model
from tests.test_hf_tokenizer import _sentencepiece_style

PROMPT = "How is the weather"


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    """A tiny random Llama with a SentencePiece-style tokenizer."""
    where: Path = tmp_path_factory.mktemp("spm")
    _sentencepiece_style(where)
    vocab = 600  # the tokenizer's, as _sentencepiece_style trains it
    tiny_hf_model(vocab_size=vocab, bos_token_id=1, eos_token_id=2).save_pretrained(where)
    served = load_model(str(where))
    assert served.tokenizer.vocab_size == vocab
    return served


def test_the_tail_is_decoded_after_what_precedes_it(spm: ServedModel) -> None:
    prompt = spm.encode(PROMPT)
    output = spm.encode(f"{PROMPT} the weather and the weather")[len(prompt):]
    leading = spm.tokenizer.token(output[0])
    assert leading.startswith("▁") and not spm.stop_text(output[:1]).startswith(" ")
    for stops in (Stops.of(SamplingParams(stop=(" the",))),  # a tail of 17 tokens
                  Stops.of(SamplingParams(stop_regex=(r"^ the",)))):  # the whole output
        for n in range(1, len(output) + 1):
            text = stops.tail_text(spm.stop_text, prompt, output[:n])
            whole = spm.stop_text([*prompt, *output[:n]])
            assert whole.endswith(text) and text.startswith(" "), (n, text)
        assert stops.matched(stops.tail_text(spm.stop_text, prompt, output[:1])) is not None
    # A tail that starts inside the output is decoded after the output tokens before it.
    short = Stops.of(SamplingParams(stop=("x",)))  # a tail of 5 tokens
    assert len(short.tail_tokens(output)) < len(output)
    whole = spm.stop_text([*prompt, *output])
    assert short.tail_text(spm.stop_text, prompt, output) == whole[
        len(spm.stop_text([*prompt, *output[:-5]])):]


def test_a_tail_that_does_not_join_its_context_at_a_character_is_decoded_alone() -> None:
    byte = ByteTokenizer()
    stops = Stops.of(SamplingParams(stop=("é",)))
    e_acute = list("é".encode())
    for prompt, output in (([*b"caf", e_acute[0]], [e_acute[1], *b"!"]),  # split character
                           ([], [*b"caf", *e_acute]), ([*b"caf"], [])):
        text = stops.tail_text(byte.decode, prompt, output)
        assert text == byte.decode(stops.tail_tokens(output)), (prompt, output)
    # Joined at a character: the tail's text as it continues the prompt's.
    assert stops.tail_text(byte.decode, [*b"caf"], e_acute) == "é"


def test_a_stop_with_a_leading_space_matches_at_the_start_of_the_answer(
    spm: ServedModel
) -> None:
    cfg = ServeConfig(role="both", backend="local", served=spm, model_name="spm",
                      scheduler=SchedulerConfig(page_size=16, chunked_prefill_size=64),
                      pool_pages=64, metadata_slots=8)
    grammar = {"max_new_tokens": 8, "regex": " the weather"}

    async def main() -> None:
        with running_service(cfg) as service:
            async with asgi_client(service) as client:
                for stop, regexes, kept in (
                    (" the", [], ""),  # in the first token (the prefill side's)
                    (" the w", [], ""),  # ends in the second (a decode step)
                    (None, [r"^ the"], ""),  # a regex whose tail is the whole output
                    (" weather", [], " the"),  # not at the start: as before
                ):
                    sp = {**grammar, "stop_regex": regexes, **({"stop": stop} if stop else {})}
                    r = await client.post("/generate", json={"text": PROMPT,
                                                             "sampling_params": sp})
                    assert r.status_code == 200, r.text
                    got = r.json()
                    finish = got["meta_info"]["finish_reason"]
                    assert (got["text"], finish["type"]) == (kept, "stop"), (sp, got)
                    assert finish["matched"] == (stop or regexes[0]), (sp, got)
                r = await client.post("/v1/completions", json={
                    "model": "spm", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                    "regex": " the weather", "stop": [" the"]})
                assert r.status_code == 200, r.text
                (choice,) = r.json()["choices"]
                assert (choice["text"], choice["finish_reason"]) == ("", "stop"), choice

    run(main())
