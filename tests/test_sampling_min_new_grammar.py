"""``min_new_tokens`` under a grammar: the grammar wins (docs/structured-output.md).

``min_new_tokens`` holds back EOS and stop tokens while the grammar allows something else;
where it allows nothing else (``regex`` ``""`` at the first token, ``a\\n?`` once ``a`` is
written and ``\\n`` is a stop token), the exclusion is lifted and the answer ends, on the
prefill side's first token and on the decode side's later ones, greedy and drawn. A row with
no finite logit never reaches argmax or the draw."""

from __future__ import annotations

import math

import pytest
import torch

from lifecycle import GrammarKind, GrammarSpec, SamplingParams
from scheduler.assemble import constraint_compiler
from scheduler.model.byte_tokenizer import EOS_TOKEN_ID
from scheduler.model.reference import ModelConfig
from scheduler.model.select import ServedModel, reference_model
from scheduler.sample.grammar import LLGuidanceCompiler
from scheduler.sample.sampler import NoTokenToDraw, RowSpec, sample
from tests.service_harness import asgi_client, run, running_service
from tests.test_grammar import pair_answers
from tests.test_openai_api import config

VOCAB = 8
EOS, STOP, A = 7, 6, 2
GREEDY = SamplingParams(max_new_tokens=8, min_new_tokens=4, stop_token_ids=(STOP,),
                        return_logprob=True, top_logprobs_num=2)
DRAWN = SamplingParams(max_new_tokens=8, min_new_tokens=4, stop_token_ids=(STOP,),
                       temperature=1.0, return_logprob=True, top_logprobs_num=2)
NEWLINE = ord("\n")


def allows(*tokens: int) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[list(tokens)] = True
    return mask


def logits() -> torch.Tensor:
    """EOS and the stop token the model's least likely tokens, token 0 its most likely."""
    return torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.5, -1.0, -2.0]])


@pytest.mark.parametrize("params", [GREEDY, DRAWN], ids=["greedy", "drawn"])
def test_a_mask_of_only_banned_tokens_draws_among_them(params: SamplingParams) -> None:
    for seed in range(20):
        only_eos = sample(logits(), [RowSpec(params, seed, 0, allows(EOS), banned=(STOP, EOS))])[0]
        assert only_eos.token == EOS
        assert only_eos.logprob is not None and only_eos.logprob.logprob == 0.0
        ends = sample(logits(), [RowSpec(params, seed, 1, allows(STOP, EOS),
                                         banned=(STOP, EOS))])[0]
        assert ends.token in (STOP, EOS)
        assert ends.logprob is not None and math.isfinite(ends.logprob.logprob)
        assert {t for t, _ in ends.logprob.top} == {STOP, EOS}
        # Where the grammar allows something else, the exclusion holds.
        held = sample(logits(), [RowSpec(params, seed, 1, allows(A, EOS), banned=(STOP, EOS))])[0]
        assert held.token == A
        assert held.logprob is not None and held.logprob.logprob == 0.0
    greedy_ends = sample(logits(), [RowSpec(GREEDY, 0, 1, allows(STOP, EOS), banned=(STOP, EOS))])
    assert greedy_ends[0].token == STOP  # the model's choice between the two


def test_the_other_rows_of_the_batch_sample_as_alone() -> None:
    rows = torch.cat([logits(), logits().flip(-1), logits()])
    specs = [RowSpec(DRAWN, 3, 0, allows(EOS), banned=(STOP, EOS)),
             RowSpec(DRAWN, 11, 2, banned=(STOP, EOS)),
             RowSpec(GREEDY, 5, 1, allows(A, 4), banned=(STOP, EOS))]
    together = sample(rows, specs)
    assert together[0].token == EOS
    for i in (1, 2):
        assert together[i] == sample(rows[i : i + 1], [specs[i]])[0]
    assert together[1].token not in (STOP, EOS)  # no mask: the exclusion holds


def test_a_ban_of_every_token_is_lifted_without_a_grammar_too() -> None:
    every = tuple(range(VOCAB))
    assert sample(logits(), [RowSpec(GREEDY, 0, 0, banned=every)])[0].token == 0


@pytest.mark.parametrize("params", [GREEDY, DRAWN], ids=["greedy", "drawn"])
def test_a_row_without_a_finite_logit_raises_instead_of_drawing(params: SamplingParams) -> None:
    for bad in (torch.full((1, VOCAB), -math.inf), torch.full((1, VOCAB), math.nan)):
        with pytest.raises(NoTokenToDraw, match="output position 3"):
            sample(bad, [RowSpec(params, 0, 3)])
    # The allowed tokens' logits not finite: the mask leaves nothing to draw.
    only = logits()
    only[0, A] = -math.inf
    with pytest.raises(NoTokenToDraw):
        sample(only, [RowSpec(params, 0, 3, allows(A))])


# -- through the pair, with llguidance on the reference model's bytes ----------------------------


@pytest.fixture(scope="module")
def byte_model() -> ServedModel:
    return reference_model(ModelConfig())


@pytest.fixture(scope="module")
def byte(byte_model: ServedModel) -> LLGuidanceCompiler:
    return constraint_compiler(byte_model)


def regex(source: str) -> GrammarSpec:
    return GrammarSpec(GrammarKind.REGEX, source)


def test_the_grammar_ends_the_answer_before_min_new_tokens_on_both_sides(
    byte_model: ServedModel, byte: LLGuidanceCompiler
) -> None:
    prompt = byte_model.encode("grammar", chat=True)
    warm = {"temperature": 1.0, "seed": 5}
    newline = {"min_new_tokens": 5, "stop_token_ids": (NEWLINE,)}
    requests = {
        # The first token: regex "" allows only EOS (the prefill side draws it).
        "empty": SamplingParams(12, min_new_tokens=1, grammar=regex("")),
        "empty-drawn": SamplingParams(12, min_new_tokens=1, grammar=regex(""), **warm),
        "empty-logprob": SamplingParams(12, min_new_tokens=3, grammar=regex(""),
                                        return_logprob=True),
        # A later token: after "a" the grammar allows "\n" (a stop token) and EOS, no more.
        "newline": SamplingParams(12, grammar=regex("a\n?"), **newline),
        "newline-drawn": SamplingParams(12, grammar=regex("a\n?"), **newline, **warm),
        # Where the grammar allows more, min_new_tokens still holds EOS back.
        "held": SamplingParams(12, min_new_tokens=3, grammar=regex("[a-c]{1,6}")),
        "plain": SamplingParams(6, ignore_eos=True, temperature=1.0, seed=9),
    }
    out = pair_answers(byte_model, byte, {rid: (prompt, p) for rid, p in requests.items()})
    for rid, got in out.items():
        assert got.prefill.ok and got.decode is not None and got.decode.ok, (rid, got)
        assert got.decode.output_ids[0] == got.prefill.first_token, rid
    answers = {rid: got.decode for rid, got in out.items()}
    for rid in ("empty", "empty-drawn", "empty-logprob"):
        answer = answers[rid]
        assert answer is not None
        assert (list(answer.output_ids), answer.finish_reason) == ([EOS_TOKEN_ID], "stop"), rid
    logprobs = answers["empty-logprob"].output_logprobs  # type: ignore[union-attr]
    assert [(lp.token, lp.logprob) for lp in logprobs] == [(EOS_TOKEN_ID, 0.0)]
    for rid in ("newline", "newline-drawn"):
        answer = answers[rid]
        assert answer is not None
        assert answer.output_ids[0] == ord("a"), rid
        assert list(answer.output_ids[1:]) in ([NEWLINE], [EOS_TOKEN_ID]), (rid, answer.output_ids)
        assert answer.finish_reason == "stop", rid
        assert answer.matched_stop == (NEWLINE if answer.output_ids[1] == NEWLINE else None)
    held = answers["held"]
    assert held is not None and held.finish_reason == "stop"
    assert len(held.output_ids) >= 3 and set(held.output_ids[:3]) <= set(b"abc")
    plain = answers["plain"]
    assert plain is not None and len(plain.output_ids) == 6


def test_generate_answers_the_empty_regex_with_min_new_tokens_and_no_error() -> None:
    async def main() -> None:
        with running_service(config()) as service:
            async with asgi_client(service) as client:
                for extra in ({}, {"temperature": 0.8, "sampling_seed": 1}):
                    r = await client.post("/generate", json={
                        "text": "hi", "sampling_params": {
                            "max_new_tokens": 8, "regex": "", "min_new_tokens": 1, **extra}})
                    assert r.status_code == 200, r.text
                    got = r.json()
                    assert got["text"] == "" and got["output_ids"] == [EOS_TOKEN_ID], got
                    assert got["meta_info"]["finish_reason"]["type"] == "stop", got

    run(main())
