"""Sampling across a PD pair on the reference model: seeded streams, logprobs through the
metadata row, grammars (a hand-written constraint), stop strings, and what is refused.

The prefill scheduler draws output position 0 of a request's seeded stream, the decode peer the
rest; the colocated run (``ReferenceModel.generate`` with the sampler choosing each token) must
give the same tokens, and the same logprobs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import attrs
import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from kv.fake import FakeKVManager
from kv.metadata import MetadataBuffers, SlotAllocator
from lifecycle import (
    DecodeState,
    FailureReason,
    GrammarKind,
    GrammarSpec,
    PrefillState,
    SamplingParams,
)
from lifecycle.testing import FakeClock
from scheduler.decode import DecodePeer
from scheduler.decode.router import DecodeKVRouter, LocalPrefillFake
from scheduler.embedded import EmbeddedPair, Outcome, PairConfig
from scheduler.messages import (
    FAKE_BOOTSTRAP_HOST,
    DecodeResponse,
    NewRequest,
    Response,
    TokenLogprob,
)
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch, ForwardItem
from scheduler.sample.constraint import Constraint, GrammarError
from scheduler.sample.request import Sampling
from scheduler.sample.sampler import RowSpec, sample
from scheduler.stepping import step_until
from scheduler.testing.fakes import ForwardOnly

CONFIG = ModelConfig.tiny(seed=11)
MODEL = LlamaModel(CONFIG)
REFERENCE = ReferenceModel(MODEL)
PROMPTS = {f"p{n}": [(5 * i + n) % 256 for i in range(n)] for n in (3, 9, 17, 30)}
TOP = 3
WARM = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=40, min_p=0.02,
                      ignore_eos=True, return_logprob=True, top_logprobs_num=3)


def make_pair(overlap: bool = False, **kw: object) -> EmbeddedPair:
    config = PairConfig(
        model=CONFIG,
        scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=8, max_prefill_tokens=12,
                                  check_invariants=True),
        prefill_pages=96, decode_pages=96, metadata_slots=8, overlap=overlap)
    return EmbeddedPair(config, model=MODEL, **kw)  # type: ignore[arg-type]


def run(pair: EmbeddedPair, requests: Mapping[str, tuple[Sequence[int], SamplingParams]],
        room0: int = 1000) -> dict[str, Outcome]:
    """Submit each request to both sides with room ``room0 + i``; drive them to the end."""
    try:
        for i, (rid, (prompt, params)) in enumerate(requests.items()):
            pair.submit(rid, prompt, params, room=room0 + i)
        outcomes = pair.run_until_done(list(requests))
        assert_all_released(pair)
        return outcomes
    finally:
        pair.close()


def assert_all_released(pair: EmbeddedPair) -> None:
    for pool in (pair.prefill_pool, pair.decode_pool):
        assert pool.allocator.available() == pool.num_pages
    for slots in (pair.prefill.slots, pair.decode.slots):
        assert slots.available() == slots.num_slots


def colocated(prompt: Sequence[int], params: SamplingParams, seed: int,
              rows: list[torch.Tensor] | None = None) -> list[int]:
    """The colocated run, each token chosen by the sampler at its output position."""

    def choose(logits: torch.Tensor, i: int) -> int:
        if rows is not None:
            rows.append(logits)
        return sample(logits[None], [RowSpec(params, seed, i)])[0].token

    return REFERENCE.generate(prompt, params.max_new_tokens, params.stop_token_ids,
                              params.ignore_eos, choose=choose)


# -- the seeded stream across the pair -------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_the_same_seed_gives_the_same_tokens_disaggregated_and_colocated(overlap: bool) -> None:
    seeded = {rid: (p, SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95,
                                      top_k=40, min_p=0.02, seed=77 + len(p), ignore_eos=True))
              for rid, p in PROMPTS.items()}
    # No seed: the stream's seed is the bootstrap room (run() gives room 1000 + i).
    seedless = {f"{rid}-room": (p, SamplingParams(max_new_tokens=10, temperature=1.2))
                for rid, p in PROMPTS.items()}
    requests = seeded | seedless
    out = run(make_pair(overlap), requests)
    for i, (rid, (prompt, params)) in enumerate(requests.items()):
        seed = params.seed if params.seed is not None else 1000 + i
        decode = out[rid].decode
        assert decode is not None and decode.ok, out[rid]
        assert list(decode.output_ids) == colocated(prompt, params, seed), rid
        assert out[rid].prefill.first_token == decode.output_ids[0]


def colocated_adjusted(prompt: Sequence[int], params: SamplingParams, seed: int) -> list[int]:
    """The colocated run with the logit adjustments made independently of the sampler's:
    transformers' processors for the repetition penalty, ``min_new_tokens`` and the bias,
    OpenAI's formula for the frequency and presence penalties; the sampler then draws from the
    adjusted row as from any other."""
    output: list[int] = []
    eos = [CONFIG.eos_token_id, *params.stop_token_ids]
    drawn = attrs.evolve(params, frequency_penalty=0.0, presence_penalty=0.0,
                         repetition_penalty=1.0, min_new_tokens=0, logit_bias={})

    def choose(logits: torch.Tensor, i: int) -> int:
        row = logits[None].clone()
        for token, count in Counter(output).items():
            row[0, token] -= count * params.frequency_penalty + params.presence_penalty
        if output:
            row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
                torch.tensor([output]), row)
        row = MinNewTokensLengthLogitsProcessor(0, params.min_new_tokens, eos)(
            torch.zeros((1, i), dtype=torch.long), row)
        if params.logit_bias:
            row = SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias})(
                torch.zeros((1, 1), dtype=torch.long), row)
        output.append(sample(row, [RowSpec(drawn, seed, i)])[0].token)
        return output[-1]

    return REFERENCE.generate(prompt, params.max_new_tokens, params.stop_token_ids,
                              params.ignore_eos, choose=choose)


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_min_new_tokens_and_bias_match_an_independent_colocated_run(
        overlap: bool) -> None:
    """The prefill side adjusts the first token's row (the bias, ``min_new_tokens``; no output
    yet for a penalty to see), the decode side every later one over the output so far."""
    stop, eos = 33, CONFIG.eos_token_id
    requests = {
        "warm": (PROMPTS["p17"], SamplingParams(
            max_new_tokens=12, temperature=0.9, seed=5, ignore_eos=True, frequency_penalty=1.2,
            presence_penalty=0.4, repetition_penalty=1.5)),
        "greedy": (PROMPTS["p9"], SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                 repetition_penalty=1.8, presence_penalty=-0.5)),
        "min": (PROMPTS["p30"], SamplingParams(max_new_tokens=10, min_new_tokens=4,
                                               stop_token_ids=(stop,),
                                               logit_bias={stop: 40.0, eos: 40.0})),
        "biased": (PROMPTS["p3"], SamplingParams(max_new_tokens=3, temperature=0.7, seed=9,
                                                 ignore_eos=True, logit_bias={65: 100.0})),
    }
    out = run(make_pair(overlap), requests)
    got = {}
    for rid, (prompt, params) in requests.items():
        decode = out[rid].decode
        assert decode is not None and decode.ok, out[rid]
        assert out[rid].prefill.first_token == decode.output_ids[0]
        got[rid] = list(decode.output_ids)
        assert got[rid] == colocated_adjusted(prompt, params, params.seed or 0), rid
    # The stop token and EOS win as soon as min_new_tokens lets them, and not before.
    assert len(got["min"]) == 5 and got["min"][4] in (stop, eos)
    assert not {stop, eos} & set(got["min"][:4])
    assert got["biased"] == [65, 65, 65]


def test_different_seeds_give_different_tokens_and_a_rerun_the_same() -> None:
    prompt = PROMPTS["p17"]
    requests = {f"s{seed}": (prompt, SamplingParams(max_new_tokens=8, temperature=1.0,
                                                    seed=seed, ignore_eos=True))
                for seed in range(4)}
    first = run(make_pair(), requests)
    again = run(make_pair(overlap=True), requests)
    outputs = {rid: o.decode.output_ids for rid, o in first.items() if o.decode is not None}
    assert len(set(outputs.values())) == 4
    assert outputs == {rid: o.decode.output_ids for rid, o in again.items()
                       if o.decode is not None}


def test_greedy_over_logits_is_forward_for_the_reference_runner() -> None:
    pool = MODEL.make_pool(num_pages=32, page_size=4)
    runner = PagedModelRunner(MODEL, pool)
    items = (ForwardItem("a", tuple(PROMPTS["p17"]), 0, (0, 1, 2, 3, 4)),
             ForwardItem("b", tuple(PROMPTS["p9"][:8]), 0, (8, 9), all_logits=True),
             ForwardItem("c", (3,), 9, (12, 13, 14)))
    tokens = runner.forward(ForwardBatch(items))
    logits = runner.logits(ForwardBatch(items))
    assert logits.shape == (1 + 8 + 1, CONFIG.vocab_size) and logits.dtype == torch.float64
    last = [0, 8, 9]
    assert logits[last].argmax(-1).tolist() == tokens
    plain = sample(logits[last], [RowSpec(SamplingParams())] * 3)
    assert [s.token for s in plain] == tokens
    # Every position of "b" is the logits its greedy continuation of that prefix gives.
    for n in (1, 5, 8):
        assert int(logits[n].argmax()) == REFERENCE.generate(PROMPTS["p9"][:n], 1)[0]


# -- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_output_logprobs_travel_in_the_row_and_match_the_colocated_run(overlap: bool) -> None:
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logprob=True,
                            top_logprobs_num=TOP)
    requests = {"warm": (PROMPTS["p30"], attrs.evolve(WARM, seed=5)),
                "greedy": (PROMPTS["p17"], greedy),
                "plain": (PROMPTS["p17"], SamplingParams(max_new_tokens=6, ignore_eos=True))}
    out = run(make_pair(overlap), requests)
    for rid, (prompt, params) in requests.items():
        rows: list[torch.Tensor] = []
        expected = colocated(prompt, params, params.seed or 0, rows)
        decode = out[rid].decode
        assert decode is not None and list(decode.output_ids) == expected
        if not params.return_logprob:
            assert decode.output_logprobs == () and out[rid].prefill.output_logprob is None
            continue
        assert len(decode.output_logprobs) == len(expected)
        first = out[rid].prefill.output_logprob
        assert first is not None and first.token == expected[0]
        # The row carries float32: the decode side reads the prefill's values, rounded.
        assert decode.output_logprobs[0] == rounded(first)
        for token, row, got in zip(expected, rows, decode.output_logprobs, strict=True):
            scaled = row if params.greedy else row / params.temperature
            want = torch.log_softmax(scaled, -1)
            assert got.token == token
            assert got.logprob == pytest.approx(float(want[token]), abs=1e-5)
            order = sorted(range(len(want)), key=lambda t: (-float(want[t]), t))[:TOP]
            assert [t for t, _ in got.top] == order
            assert [v for _, v in got.top] == pytest.approx(want[order].tolist(), abs=1e-5)
    # A greedy request with logprobs gets the tokens of a plain one.
    assert out["greedy"].decode.output_ids == out["plain"].decode.output_ids  # type: ignore[union-attr]


def rounded(lp: TokenLogprob) -> TokenLogprob:
    def f32(v: float) -> float:
        return float(torch.tensor(v, dtype=torch.float32))

    return TokenLogprob(lp.token, None if lp.logprob is None else f32(lp.logprob),
                        tuple((t, f32(v)) for t, v in lp.top))


def full_prompt_logits(prompt: Sequence[int]) -> torch.Tensor:
    """Every position's logits of ``prompt`` in one unchunked forward on a fresh pool."""
    pool = MODEL.make_pool(num_pages=16, page_size=4)
    runner = PagedModelRunner(MODEL, pool)
    item = ForwardItem("x", tuple(prompt), 0, tuple(range(16)), all_logits=True)
    return runner.logits(ForwardBatch((item,)))


def expected_input_logprobs(prompt: Sequence[int], params: SamplingParams) -> list[TokenLogprob]:
    logits = full_prompt_logits(prompt).float()
    scaled = logits if params.greedy else logits / params.temperature
    want = torch.log_softmax(scaled, -1)
    out = [TokenLogprob(prompt[0], None)] if params.logprob_start_len == 0 else []
    for i in range(max(params.logprob_start_len, 1), len(prompt)):
        row = want[i - 1]
        order = sorted(range(len(row)), key=lambda t: (-float(row[t]), t))
        top = tuple((t, float(row[t])) for t in order[: params.top_logprobs_num])
        out.append(TokenLogprob(prompt[i], float(row[prompt[i]]), top))
    return out


def assert_logprobs_close(got: Sequence[TokenLogprob], want: Sequence[TokenLogprob]) -> None:
    assert [g.token for g in got] == [w.token for w in want]
    for g, w in zip(got, want, strict=True):
        assert (g.logprob is None) == (w.logprob is None)
        if w.logprob is not None:
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_input_logprobs_across_chunks_equal_one_unchunked_forward(overlap: bool) -> None:
    prompt = PROMPTS["p30"]  # chunks of 8: positions 0-7, 8-15, 16-23, 24-29
    asks = {
        "all": SamplingParams(max_new_tokens=2, return_logprob=True, logprob_start_len=0,
                              top_logprobs_num=2),
        "from7": SamplingParams(max_new_tokens=2, return_logprob=True, logprob_start_len=7),
        "from8": SamplingParams(max_new_tokens=2, return_logprob=True, logprob_start_len=8,
                                top_logprobs_num=4, temperature=0.7, seed=1),
        "from17": SamplingParams(max_new_tokens=2, return_logprob=True, logprob_start_len=17),
        "last": SamplingParams(max_new_tokens=2, return_logprob=True, logprob_start_len=29),
        "none": SamplingParams(max_new_tokens=2, return_logprob=True, logprob_start_len=30),
    }
    past = SamplingParams(max_new_tokens=2, return_logprob=True, logprob_start_len=31)
    out = run(make_pair(overlap), {rid: (prompt, p) for rid, p in asks.items()}
              | {"past": (prompt, past)})
    for rid, params in asks.items():
        got = out[rid].prefill.input_logprobs
        assert len(got) == max(0, len(prompt) - params.logprob_start_len), rid
        assert_logprobs_close(got, expected_input_logprobs(prompt, params))
    refused = out["past"].prefill  # past the prompt's end: refused, not answered with none
    assert refused.reason is FailureReason.REJECTED and refused.http_status == 400
    assert "logprob_start_len (31) is past the prompt's 30 tokens" in refused.detail


def test_the_prefix_cache_leaves_the_scored_positions_to_compute() -> None:
    config = PairConfig(
        model=CONFIG,
        scheduler=SchedulerConfig(page_size=4, chunked_prefill_size=8, radix_cache=True,
                                  check_invariants=True),
        prefill_pages=96, decode_pages=96, metadata_slots=8)
    pair = EmbeddedPair(config, model=MODEL)
    prompt = PROMPTS["p30"]
    try:
        pair.submit("warm", prompt, SamplingParams(max_new_tokens=2))
        pair.run_until_done(["warm"])
        plain, scored = SamplingParams(max_new_tokens=2), SamplingParams(
            max_new_tokens=2, return_logprob=True, logprob_start_len=14)
        pair.submit("plain", prompt, plain)
        pair.submit("scored", prompt, scored)
        out = pair.run_until_done(["plain", "scored"])
    finally:
        pair.close()
    assert out["plain"].prefill.cached_tokens == 28  # whole pages, the last token computed
    # Token 14 is scored by position 13: the match stops at page boundary 12.
    assert out["scored"].prefill.cached_tokens == 12
    assert_logprobs_close(out["scored"].prefill.input_logprobs,
                          expected_input_logprobs(prompt, scored))


# -- grammars (a hand-written constraint) ----------------------------------------------------


class SetConstraint:
    """Allows the tokens of a fixed set; complete after ``length`` tokens. With ``mask``
    False it masks nothing, so the sampler may pick a token that ``accept`` rejects."""

    def __init__(self, allowed: frozenset[int], length: int, mask: bool, reject_at: int) -> None:
        self.allowed_ids, self.length, self.mask = allowed, length, mask
        self.reject_at = reject_at
        self.accepted: list[int] = []

    def allowed(self) -> torch.Tensor | None:
        if not self.mask:
            return None
        mask = torch.zeros(CONFIG.vocab_size, dtype=torch.bool)
        mask[sorted(self.allowed_ids)] = True
        return mask

    def accept(self, token: int) -> None:
        if token not in self.allowed_ids or len(self.accepted) == self.reject_at:
            raise GrammarError(f"token {token} is not in the set at position "
                               f"{len(self.accepted)}")
        self.accepted.append(token)

    def finished(self) -> bool:
        return len(self.accepted) >= self.length


class SetCompiler:
    """Compiles ``"ids;length;mask;reject_at"`` (a regex kind, for the test's own syntax)."""

    def __init__(self) -> None:
        self.compiled: list[SetConstraint] = []

    def compile(self, spec: GrammarSpec) -> Constraint:
        try:
            ids, length, mask, reject_at = spec.source.split(";")
            constraint = SetConstraint(frozenset(int(i) for i in ids.split(",")), int(length),
                                       mask == "mask", int(reject_at))
        except ValueError as exc:
            raise GrammarError(f"cannot parse {spec.source!r}") from exc
        self.compiled.append(constraint)
        return constraint


def grammar(source: str) -> GrammarSpec:
    return GrammarSpec(GrammarKind.REGEX, source)


def test_a_constraint_masks_every_token_on_both_sides_and_stops_the_answer() -> None:
    allowed = "65,66,67,200"
    requests = {
        "greedy": (PROMPTS["p17"], SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                  grammar=grammar(f"{allowed};5;mask;-1"))),
        "warm": (PROMPTS["p30"], attrs.evolve(WARM, seed=3, max_new_tokens=8,
                                              grammar=grammar(f"{allowed};99;mask;-1"))),
    }
    compiler = SetCompiler()
    out = run(make_pair(compiler=compiler), requests)
    greedy, warm = out["greedy"].decode, out["warm"].decode
    assert greedy is not None and warm is not None
    assert set(greedy.output_ids) <= {65, 66, 67, 200} and set(warm.output_ids) <= {65, 66, 67, 200}
    # Five tokens complete the grammar: a "stop" with nothing matched.
    assert (len(greedy.output_ids), greedy.finish_reason, greedy.matched_stop) == (5, "stop", None)
    assert (len(warm.output_ids), warm.finish_reason) == (8, "length")
    # Each side compiled its own constraint; the decode one was fed every token.
    assert len(compiler.compiled) == 4
    assert sorted(len(c.accepted) for c in compiler.compiled) == [1, 1, 5, 8]
    # Masked tokens have no probability: the warm request's logprobs list allowed tokens only.
    for lp in warm.output_logprobs:
        assert {t for t, _ in lp.top} <= {65, 66, 67, 200}


def test_a_first_token_the_grammar_rejects_fails_the_request_and_releases_everything() -> None:
    # No mask: the greedy first token is not in the set, and accept() rejects it on prefill.
    requests = {"bad": (PROMPTS["p17"], SamplingParams(max_new_tokens=4,
                                                      grammar=grammar("1,2;5;nomask;-1"))),
                "good": (PROMPTS["p9"], SamplingParams(max_new_tokens=4, ignore_eos=True))}
    out = run(make_pair(compiler=SetCompiler()), requests)  # run() checks everything is free
    bad = out["bad"].prefill
    assert (bad.state, bad.reason, bad.http_status) == (
        PrefillState.FAILED, FailureReason.INTERNAL, 500)
    assert "the grammar rejected token 105 at output position 0" in bad.detail
    assert "is not in the set" in bad.detail
    assert out["bad"].decode is not None and not out["bad"].decode.ok
    assert out["good"].decode is not None and out["good"].decode.ok


def test_a_later_token_the_grammar_rejects_fails_the_decode_side() -> None:
    # Masked, but the constraint rejects its third token whatever it is.
    requests = {"bad": (PROMPTS["p9"], SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                     grammar=grammar("65,66;9;mask;2")))}
    out = run(make_pair(compiler=SetCompiler()), requests)
    assert out["bad"].prefill.ok
    decode = out["bad"].decode
    assert decode is not None
    assert (decode.state, decode.reason, decode.http_status) == (
        DecodeState.FAILED, FailureReason.INTERNAL, 500)
    assert "grammar rejected token" in decode.detail
    assert "at output position 2" in decode.detail, decode.detail
    assert len(decode.output_ids) == 3


def test_grammars_without_a_compiler_or_that_do_not_compile_are_refused() -> None:
    requests = {"nocompiler": (PROMPTS["p9"], SamplingParams(grammar=grammar("1;1;mask;-1")))}
    out = run(make_pair(), requests)
    refused = out["nocompiler"]
    assert refused.decode is not None
    for answer in (refused.prefill, refused.decode):
        assert answer.reason is FailureReason.REJECTED and answer.http_status == 400
    assert "no grammar backend" in refused.prefill.detail
    out = run(make_pair(compiler=SetCompiler()), {
        "broken": (PROMPTS["p9"], SamplingParams(grammar=grammar("not a set")))})
    assert out["broken"].prefill.reason is FailureReason.REJECTED
    assert "does not compile" in out["broken"].prefill.detail
    assert "cannot parse" in out["broken"].prefill.detail


# -- stop strings and stop tokens ------------------------------------------------------------


def bracketed(ids: Sequence[int]) -> str:
    """A toy detokenizer: every token is ``<id>``, so a stop string can span tokens."""
    return "".join(f"<{i}>" for i in ids)


def test_stop_strings_and_stop_tokens_end_the_answer_and_say_what_matched() -> None:
    prompt = PROMPTS["p17"]
    free = REFERENCE.generate(prompt, 12, ignore_eos=True)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    spanning = f"{free[3]}><{free[4]}"  # ends inside token 4's text
    requests = {
        "spanning": (prompt, attrs.evolve(params, stop=("never", spanning))),
        "first": (prompt, attrs.evolve(params, stop=(f"<{free[0]}>",))),
        "token": (prompt, attrs.evolve(params, stop_token_ids=(free[2],))),
        "unmatched": (prompt, attrs.evolve(params, stop=("<999>",))),
    }
    out = run(make_pair(detokenize=bracketed), requests)
    answers = {rid: o.decode for rid, o in out.items()}
    assert all(a is not None and a.ok for a in answers.values())
    first_stop = free.index(free[2])
    # The first output whose text holds the string (token 4, unless it came earlier).
    ends = next(k for k in range(len(free)) if spanning in bracketed(free[: k + 1]))
    assert ends <= 4
    expected = {
        "spanning": (free[: ends + 1], "stop", spanning),
        "first": (free[:1], "stop", f"<{free[0]}>"),
        "token": (free[: first_stop + 1], "stop", free[2]),
        "unmatched": (free, "length", None),
    }
    for rid, (ids, finish, matched) in expected.items():
        a = answers[rid]
        assert a is not None
        assert (list(a.output_ids), a.finish_reason, a.matched_stop) == (ids, finish, matched)


def test_stop_strings_and_regexes_need_a_detokenizer_on_the_decode_side() -> None:
    out = run(make_pair(), {"s": (PROMPTS["p9"], SamplingParams(stop=("x",))),
                            "r": (PROMPTS["p9"], SamplingParams(stop_regex=("x+",)))})
    for rid in ("s", "r"):
        decode = out[rid].decode
        assert decode is not None and decode.reason is FailureReason.REJECTED
        assert "stop strings and regexes need a tokenizer" in decode.detail


# -- runners without logits ------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.5),
    SamplingParams(return_logprob=True),
    SamplingParams(return_logprob=True, logprob_start_len=0),
    SamplingParams(grammar=grammar("1;1;mask;-1")),
])
def test_a_runner_without_logits_refuses_what_needs_them(params: SamplingParams) -> None:
    pool = MODEL.make_pool(num_pages=16, page_size=4)
    plain = ForwardOnly(PagedModelRunner(MODEL, pool))
    refused = Sampling(plain, SetCompiler()).admit("r", params, 1, [1, 2, 3])
    assert "need a model runner that returns logits" in refused
    clock, responses = FakeClock(), list[Response]()
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=4, chunked_prefill_size=8, check_invariants=True),
        runner=plain, kv=FakeKVManager(clock=clock), metadata=MetadataBuffers(2),
        slots=SlotAllocator(2), clock=clock, on_response=responses.append)
    sched.submit(NewRequest("r", (1, 2, 3), bootstrap_host="decode", bootstrap_room=1,
                            sampling=params))
    sched.submit(NewRequest("plain", (1, 2, 3), bootstrap_host="decode", bootstrap_room=2))
    sched.run_until(lambda: len(responses) == 2)
    answers: dict[str, Response] = {r.rid: r for r in responses}
    assert answers["r"].reason is FailureReason.REJECTED and answers["r"].http_status == 400
    assert "logits" in answers["r"].detail
    assert answers["plain"].ok
    sched.close()


# -- the fake bootstrap host: the decode side computes the prompt itself ----------------------


def _warm_up_peer() -> tuple[DecodePeer, LocalPrefillFake, list[DecodeResponse]]:
    """A decode peer whose requests all take the fake host (it computes their prompts), the
    fake, and the peer's answers."""
    pool = MODEL.make_pool(num_pages=32, page_size=4)
    runner = PagedModelRunner(MODEL, pool)
    metadata = MetadataBuffers(4)
    fake = LocalPrefillFake(runner, metadata)
    answers: list[DecodeResponse] = []
    peer = DecodePeer(runner=runner, kv=DecodeKVRouter(fake=fake), metadata=metadata,
                      slots=SlotAllocator(4), on_response=answers.append)
    return peer, fake, answers


def test_the_warm_up_path_draws_the_first_token_as_the_prefill_side_would() -> None:
    peer, fake, answers = _warm_up_peer()
    requests = {"warm": attrs.evolve(WARM, seed=21), "room": attrs.evolve(WARM, seed=None),
                "plain": SamplingParams(max_new_tokens=5, ignore_eos=True),
                "biased": SamplingParams(max_new_tokens=4, ignore_eos=True,
                                         logit_bias={7: 100.0})}
    for i, (rid, params) in enumerate(requests.items()):
        room = 500 + i
        fake.expect(room, rid, PROMPTS["p17"], params)
        peer.submit(NewRequest(rid, tuple(PROMPTS["p17"]), bootstrap_host=FAKE_BOOTSTRAP_HOST,
                               bootstrap_room=room, sampling=params))
    step_until(peer.step, lambda: len(answers) == 4, 30.0, lambda: f"answered: {answers}")
    got = {a.rid: a for a in answers}
    for i, (rid, params) in enumerate(requests.items()):
        rows: list[torch.Tensor] = []
        seed = 500 + i if params.seed is None else params.seed
        assert list(got[rid].output_ids) == colocated(PROMPTS["p17"], params, seed, rows), rid
        if params.return_logprob:
            first = got[rid].output_logprobs[0]
            want = torch.log_softmax(rows[0] / params.temperature, -1)
            assert first.logprob == pytest.approx(float(want[first.token]), abs=1e-5)
            assert len(first.top) == TOP
    assert list(got["biased"].output_ids) == [7, 7, 7, 7]  # the first token from the fake too


def test_the_decode_peer_says_whether_the_id_or_the_room_is_in_use() -> None:
    peer, fake, answers = _warm_up_peer()
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    fake.expect(500, "a", PROMPTS["p17"], params)
    for rid, room in (("a", 500), ("a", 501), ("b", 500)):
        peer.submit(NewRequest(rid, tuple(PROMPTS["p17"]), bootstrap_host=FAKE_BOOTSTRAP_HOST,
                               bootstrap_room=room, sampling=params))
    step_until(peer.step, lambda: len(answers) == 3, 30.0, lambda: f"answered: {answers}")
    refused = [(a.rid, a.reason, a.detail) for a in answers if not a.ok]
    assert refused == [("a", FailureReason.REJECTED, "request id 'a' is already live"),
                       ("b", FailureReason.REJECTED,
                        "bootstrap room 500 is in use by a live request")], answers
    assert [a.rid for a in answers if a.ok] == ["a"]
