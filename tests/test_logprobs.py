"""SmolLM2's logprobs against transformers' log-softmax on the same inputs.

A chat prompt of a few dozen tokens goes through an embedded pair (prefill chunks of 16 tokens,
so the prompt is split across chunks) with ``return_logprob``, input logprobs from token 0 and
top alternatives; transformers (fp32, the same GGUF file) scores the prompt plus pdlife's output
in one forward. Input logprobs (prefill, across chunks), the first output token's (prefill,
carried to decode in the metadata row) and every later one's (decode) must match its
``log_softmax`` — unscaled for a greedy request, divided by the temperature for a sampled one —
and so must the logprobs of the ids a request names (``token_ids_logprob``) at every position.
The real model is loaded once per session (``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from lifecycle import SamplingParams
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.messages import TokenLogprob
from scheduler.model.llama import LlamaRunner
from scheduler.prefill.config import SchedulerConfig
from scheduler.runner import ForwardBatch, ForwardItem
from tests.real_prompts import PROMPTS

#: Logprobs of pdlife's float32 runner and of transformers' differ by float rounding only.
TOLERANCE = 2e-3
TOP = 5
#: Named ids (token_ids_logprob): EOS, " Paris", a rare id, and the same id twice.
ASKED = (2, 7042, 40000, 7042)


def check(got: Sequence[TokenLogprob], want: torch.Tensor, tokens: Sequence[int],
          asked: Sequence[int] = ()) -> None:
    """``got[i]`` is token ``tokens[i]``'s logprob under row ``want[i]`` (a log-softmax), with
    top alternatives that are the row's largest (near ties may swap), and the ``asked`` ids'
    logprobs under the same row, in their order."""
    assert [g.token for g in got] == list(tokens)
    for g, row, token in zip(got, want, tokens, strict=True):
        assert g.logprob == pytest.approx(float(row[token]), abs=TOLERANCE)
        assert [t for t, _ in g.asked] == list(asked)
        assert [v for _, v in g.asked] == pytest.approx([float(row[t]) for t in asked],
                                                         abs=TOLERANCE)
        assert len(g.top) == TOP
        values = [v for _, v in g.top]
        assert values == sorted(values, reverse=True)
        for t, v in g.top:
            assert v == pytest.approx(float(row[t]), abs=TOLERANCE)
        # Nothing left out is more likely than the last listed (up to rounding).
        assert float(row.topk(TOP).values[-1]) <= values[-1] + TOLERANCE


@pytest.fixture(scope="module")
def answers(smollm2: Any) -> dict[str, Any]:
    prompt = smollm2.encode(PROMPTS[4], chat=True)
    assert len(prompt) > 32  # three chunks of 16 at least
    requests = {
        "greedy": SamplingParams(max_new_tokens=6, return_logprob=True, logprob_start_len=0,
                                 top_logprobs_num=TOP, ignore_eos=True),
        "warm": SamplingParams(max_new_tokens=6, temperature=0.7, seed=9, return_logprob=True,
                               logprob_start_len=11, top_logprobs_num=TOP, ignore_eos=True,
                               token_ids_logprob=ASKED),
    }
    config = PairConfig(scheduler=SchedulerConfig(page_size=16, chunked_prefill_size=16,
                                                  max_prefill_tokens=16),
                        prefill_pages=64, decode_pages=64, metadata_slots=4)
    pair = EmbeddedPair(config, served=smollm2)
    try:
        for rid, params in requests.items():
            pair.submit(rid, prompt, params)
        out = pair.run_until_done(list(requests))
    finally:
        pair.close()
    return {"prompt": prompt, "requests": requests, "out": out}


def hf_logprobs(hf_smollm2: Any, ids: Sequence[int], temperature: float) -> torch.Tensor:
    model, _ = hf_smollm2
    with torch.inference_mode():
        logits = model(torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits if temperature == 0 else logits / temperature, -1)


@pytest.mark.parametrize("rid", ["greedy", "warm"])
def test_logprobs_equal_transformers_log_softmax(answers: dict[str, Any], hf_smollm2: Any,
                                                 rid: str) -> None:
    prompt, params = answers["prompt"], answers["requests"][rid]
    outcome = answers["out"][rid]
    decode = outcome.decode
    assert outcome.prefill.ok and decode is not None and decode.ok
    output = list(decode.output_ids)
    want = hf_logprobs(hf_smollm2, prompt + output, params.temperature)
    # Input logprobs: token i scored by position i-1, from logprob_start_len on.
    start = params.logprob_start_len
    inputs = outcome.prefill.input_logprobs
    assert len(inputs) == len(prompt) - start
    if start == 0:
        assert inputs[0] == TokenLogprob(prompt[0], None)
        inputs = inputs[1:]
        start = 1
    asked = params.token_ids_logprob
    check(inputs, want[start - 1 : len(prompt) - 1], prompt[start:], asked)
    # Output logprobs: one per token, the first from the metadata row.
    assert len(decode.output_logprobs) == len(output)
    first = outcome.prefill.output_logprob
    assert first is not None and first.token == output[0]
    assert decode.output_logprobs[0].logprob == pytest.approx(first.logprob, abs=1e-6)
    # The named ids' logprobs of the first token came in the metadata row too.
    row_asked = decode.output_logprobs[0].asked
    assert [t for t, _ in row_asked] == [t for t, _ in first.asked] == list(asked)
    assert [v for _, v in row_asked] == pytest.approx([v for _, v in first.asked], abs=1e-6)
    check(decode.output_logprobs, want[len(prompt) - 1 : -1], output, asked)


def test_the_greedy_answer_is_the_top_token_at_every_step(answers: dict[str, Any]) -> None:
    decode = answers["out"]["greedy"].decode
    assert decode is not None
    for lp in decode.output_logprobs:
        assert lp.top[0][0] == lp.token


def test_greedy_over_logits_is_forward_for_the_llama_runner(smollm2: Any) -> None:
    prompts = [smollm2.encode(p) for p in PROMPTS[:3]]
    pool = smollm2.make_pool(num_pages=16, page_size=16)
    runner = LlamaRunner(smollm2.model, pool)
    items = tuple(ForwardItem(f"r{i}", tuple(p), 0, (4 * i, 4 * i + 1), all_logits=i == 1)
                  for i, p in enumerate(prompts))
    tokens = runner.forward(ForwardBatch(items))
    logits = runner.logits(ForwardBatch(items))
    sizes = [1, len(prompts[1]), 1]
    assert logits.shape == (sum(sizes), smollm2.vocab_size)
    last = [0, sizes[0] + sizes[1] - 1, sum(sizes) - 1]
    assert logits[last].argmax(-1).tolist() == tokens
    # A non-last position's row is the logits the prefix alone gives (batch invariance).
    prefix = prompts[1][:5]
    alone = runner.logits(ForwardBatch((ForwardItem("p", tuple(prefix), 0, (8,)),)))
    assert torch.equal(alone[0], logits[1 + 4])


@pytest.mark.parametrize(("top", "temperature"), [(0, 0.0), (3, 0.0), (2, 0.7)])
def test_input_logprobs_of_a_long_chunk_are_its_rows_log_softmax(top: int,
                                                                 temperature: float) -> None:
    """A chunk of 600 scored positions (taken a block of rows at a time) gives, for every
    position, the prompt token's and the top alternatives' log-softmax of the whole row, and
    the asked ids'."""
    from scheduler.sample.logprobs import chunk_input_logprobs

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(600, 40, generator=gen) * 4
    prompt = torch.randint(0, 40, (601,), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=1, temperature=temperature, return_logprob=True,
                            logprob_start_len=0, top_logprobs_num=top,
                            token_ids_logprob=(7, 3))
    got = chunk_input_logprobs(logits, params, prompt, 0)
    want = torch.log_softmax(logits / (temperature or 1.0), -1)
    assert [e.token for e in got] == prompt[1:]
    assert [e.logprob for e in got] == pytest.approx(
        [want[p, prompt[p + 1]].item() for p in range(600)], abs=1e-5)
    for p, entry in enumerate(got):
        values, ids = want[p].topk(top) if top else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert [t for t, _ in entry.asked] == [7, 3]
        assert [v for _, v in entry.asked] == pytest.approx(
            [want[p, 7].item(), want[p, 3].item()], abs=1e-5)
