"""The logit adjustments before sampling: frequency, presence and repetition penalties over the
output so far, ``min_new_tokens`` and ``logit_bias``, against transformers' logits processors
(repetition, minimum length, sequence bias) and OpenAI's published formula (frequency,
presence); and what a side builds for each output position."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from lifecycle import SamplingParams
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.sample.request import Sampling
from scheduler.sample.sampler import RowSpec, adjust, sample

CONFIG = ModelConfig.tiny(seed=5)
MODEL = LlamaModel(CONFIG)
VOCAB = 12
logit_rows = st.lists(st.floats(-8, 8, allow_nan=False), min_size=VOCAB, max_size=VOCAB)
outputs = st.lists(st.integers(0, VOCAB - 1), max_size=10)


def row_of(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@given(logit_rows, outputs, st.floats(0.05, 2.0))
def test_the_repetition_penalty_is_transformers_over_the_output(
        values: list[float], output: list[int], penalty: float) -> None:
    row = row_of(values)
    spec = RowSpec(SamplingParams(repetition_penalty=penalty), position=len(output),
                   history=tuple(output))
    want = row[None].clone()
    if output:  # transformers' processor penalises the ids it is given: here, the output only
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([output]), want)
    assert torch.allclose(adjust(row, spec), want[0])


@given(logit_rows, outputs, st.floats(-2, 2), st.floats(-2, 2))
def test_frequency_and_presence_follow_the_openai_formula(
        values: list[float], output: list[int], frequency: float, presence: float) -> None:
    row = row_of(values)
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    got = adjust(row, RowSpec(params, position=len(output), history=tuple(output)))
    count = Counter(output)
    want = [v - count[j] * frequency - (count[j] > 0) * presence for j, v in enumerate(values)]
    assert got.tolist() == pytest.approx(want)


def test_the_additive_penalties_come_before_the_repetition_scaling() -> None:
    row = row_of([1.0, 0.5, -1.0, 2.0])
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)
    got = adjust(row, RowSpec(params, position=3, history=(1, 1, 2)))
    # Token 1: 0.5 - 2 = -1.5, then negative: times 2. Token 2: -1 - 1 = -2, times 2.
    assert got.tolist() == [1.0, -3.0, -4.0, 2.0]
    assert row.tolist() == [1.0, 0.5, -1.0, 2.0]  # the caller's row is left alone


@given(logit_rows, st.integers(0, 6), st.integers(0, 6))
def test_min_new_tokens_excludes_stop_and_eos_ids_as_transformers_does(
        values: list[float], min_new: int, position: int) -> None:
    eos, stop = 3, 7
    params = SamplingParams(max_new_tokens=8, min_new_tokens=min_new, stop_token_ids=(stop,))
    runner = PagedModelRunner(MODEL, MODEL.make_pool(num_pages=4, page_size=4))
    state = Sampling(runner, eos_token_ids={eos}).prepare("r", params, 1, [1, 2])
    assert (state is None) == (min_new == 0)  # greedy forward serves a plain request alone
    row = row_of(values)
    got = adjust(row, RowSpec(params) if state is None else state.row(position, [0] * position))
    prompt = torch.zeros((1, 2 + position), dtype=torch.long)  # the prompt, then the output
    want = MinNewTokensLengthLogitsProcessor(2, min_new, [eos, stop])(prompt, row[None].clone())
    assert torch.equal(got, want[0])


@given(logit_rows, st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4))
def test_logit_bias_adds_as_transformers_sequence_bias(values: list[float],
                                                       bias: dict[int, float]) -> None:
    row = row_of(values)
    got = adjust(row, RowSpec(SamplingParams(logit_bias=bias)))
    want = row[None].clone()
    if bias:
        processor = SequenceBiasLogitsProcessor({(token,): b for token, b in bias.items()})
        want = processor(torch.zeros((1, 1), dtype=torch.long), want)
    assert torch.allclose(got, want[0])


def test_greedy_takes_the_argmax_of_the_adjusted_row_and_logprobs_are_its_own() -> None:
    logits = row_of([3.0, 1.0, 2.0, 0.0])
    biased = SamplingParams(logit_bias={3: 5.0}, return_logprob=True, top_logprobs_num=2)
    got = sample(logits[None], [RowSpec(biased)])[0]
    assert got.token == 3 and got.logprob is not None
    want = torch.log_softmax(row_of([3.0, 1.0, 2.0, 5.0]), -1)
    assert got.logprob.logprob == pytest.approx(float(want[3]))
    assert [t for t, _ in got.logprob.top] == [3, 0]
    # Without logprobs the fast argmax path must not skip the bias either.
    assert sample(logits[None], [RowSpec(SamplingParams(logit_bias={3: 5.0}))])[0].token == 3
    penalised = SamplingParams(repetition_penalty=2.0)
    assert sample(logits[None], [RowSpec(penalised, position=1, history=(0,))])[0].token == 2
    assert sample(logits[None], [RowSpec(penalised)])[0].token == 0  # nothing output yet


def test_a_row_spec_carries_the_history_and_the_ban_only_where_they_act() -> None:
    runner = PagedModelRunner(MODEL, MODEL.make_pool(num_pages=4, page_size=4))
    sampling = Sampling(runner, eos_token_ids={2})
    params = SamplingParams(max_new_tokens=6, min_new_tokens=2, stop_token_ids=(5, 2),
                            presence_penalty=0.5)
    state = sampling.prepare("r", params, 1, [1])
    assert state is not None and state.banned == (2, 5)
    first, third = state.row(0), state.row(2, [9, 8, 7])
    assert (first.history, first.banned) == ((), (2, 5))
    assert (third.history, third.banned) == ((9, 8), ())
    # No penalty looks back: no history is kept; no min_new_tokens: nothing is banned.
    plain = sampling.prepare("q", SamplingParams(logit_bias={1: 1.0}), 2, [1])
    assert plain is not None and plain.row(3, [1, 2, 3]).history == () and plain.banned == ()


def test_a_bias_beyond_the_vocabulary_is_refused_at_admission() -> None:
    runner = PagedModelRunner(MODEL, MODEL.make_pool(num_pages=4, page_size=4))
    vocab = CONFIG.vocab_size
    why = Sampling(runner).admit("r", SamplingParams(logit_bias={vocab: 1.0}), 1, [1])
    assert why == (f"request 'r': logit_bias names token {vocab}, beyond the vocabulary of "
                   f"{vocab}")
    assert Sampling(runner).admit("r", SamplingParams(logit_bias={vocab - 1: 1.0}), 1, [1]) == ""


@pytest.mark.parametrize(("fields", "says"), [
    ({"frequency_penalty": 2.1}, "frequency_penalty must be in [-2.0, 2.0]"),
    ({"presence_penalty": -2.1}, "presence_penalty must be in [-2.0, 2.0]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0.0, 2.0]"),
    ({"repetition_penalty": 2.5}, "repetition_penalty must be in (0.0, 2.0]"),
    ({"min_new_tokens": 17}, "min_new_tokens must be in 0..max_new_tokens (16), got 17"),
    ({"min_new_tokens": -1}, "min_new_tokens must be in 0..max_new_tokens"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias: token ids must be >= 0, got -1"),
    ({"logit_bias": [(4, 1.0), (4, 2.0)]}, "logit_bias: a token id is given twice"),
    ({"logit_bias": {4: float("inf")}}, "the bias of token 4 must be finite"),
])
def test_sampling_params_check_the_new_fields(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError) as caught:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert says in str(caught.value)


def test_only_neutral_values_leave_a_request_plain() -> None:
    assert SamplingParams(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                          min_new_tokens=0, logit_bias={}).plain
    for fields in ({"frequency_penalty": 0.1}, {"presence_penalty": -0.1},
                   {"repetition_penalty": 1.1}, {"min_new_tokens": 1}, {"logit_bias": {0: 0.0}}):
        params = SamplingParams(**fields)  # type: ignore[arg-type]
        assert params.adjusts_logits and not params.plain, fields
