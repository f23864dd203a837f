"""The llguidance grammar backend on both tokenizers: every grammar kind compiles, bad grammars
are refused with llguidance's message, masks cover the model's vocabulary, a rejected token
leaves the matcher as it was, and SmolLM2's greedy answers under a mask parse and validate."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from typing import Any

import jsonschema
import pytest
import torch

from kv.pages import pages_needed
from lifecycle import FailureReason, GrammarKind, GrammarSpec, SamplingParams
from scheduler.assemble import constraint_compiler
from scheduler.embedded import EmbeddedPair, Outcome, PairConfig
from scheduler.model.byte_tokenizer import EOS_TOKEN_ID
from scheduler.model.reference import ModelConfig
from scheduler.model.select import ServedModel, reference_model
from scheduler.prefill.config import SchedulerConfig
from scheduler.runner import ForwardItem
from scheduler.sample.constraint import Constraint, GrammarError, GrammarLimitError
from scheduler.sample.grammar import LLGuidanceCompiler, check
from scheduler.sample.request import RequestSampling, grammar_failure

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
ADA = "Describe Ada, aged 36, as JSON with the fields name and age."
CALL = "Write a phone number like 555-0123."

#: A spec of every kind and a text it matches.
MATCHING = [
    (GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(PERSON)), '{"name": "Ada", "age": 36}'),
    (GrammarSpec(GrammarKind.JSON_OBJECT), '{"x": [1, 2.5, {"y": null}], "z": "w"}'),
    (GrammarSpec(GrammarKind.REGEX, PHONE), "555-0123"),
    (GrammarSpec(GrammarKind.EBNF, 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]+/'),
     "maybe 42"),
    (GrammarSpec(GrammarKind.EBNF, 'root ::= "yes" | "no"'), "no"),  # GBNF, as SGLang writes it
]

#: Specs that do not compile, and a piece of the message that says why.
BAD = [
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object",'), "not valid JSON"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "thing"}'), "Invalid type: thing"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, "[1, 2]"), "must be an object or boolean"),
    (GrammarSpec(GrammarKind.REGEX, "(abc"), "unclosed group"),
    (GrammarSpec(GrammarKind.EBNF, "start: foo"), 'unknown name: "foo"'),
    (GrammarSpec(GrammarKind.EBNF, 'start: "a" <|no_such_token|>'), "unknown special token"),
]


@pytest.fixture(scope="module")
def smol(smollm2: ServedModel) -> LLGuidanceCompiler:
    return constraint_compiler(smollm2)


@pytest.fixture(scope="module")
def byte_model() -> ServedModel:
    return reference_model(ModelConfig())


@pytest.fixture(scope="module")
def byte(byte_model: ServedModel) -> LLGuidanceCompiler:
    return constraint_compiler(byte_model)


@pytest.fixture(params=["smollm2", "byte"])
def served_and_compiler(request: pytest.FixtureRequest) -> tuple[ServedModel, LLGuidanceCompiler]:
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2"), request.getfixturevalue("smol")
    return request.getfixturevalue("byte_model"), request.getfixturevalue("byte")


def _walk(constraint: Constraint, tokens: list[int], vocab_size: int) -> None:
    """Accept ``tokens`` one by one, each allowed by the mask before it."""
    for token in tokens:
        mask = constraint.allowed()
        assert mask is not None
        assert mask.dtype == torch.bool and mask.shape == (vocab_size,)
        assert bool(mask[token]), f"token {token} is masked out"
        constraint.accept(token)


@pytest.mark.parametrize(("spec", "text"), MATCHING, ids=lambda v: getattr(v, "kind", None))
def test_every_kind_compiles_and_accepts_a_matching_text_then_eos(
    served_and_compiler: tuple[ServedModel, LLGuidanceCompiler], spec: GrammarSpec, text: str
) -> None:
    served, compiler = served_and_compiler
    compiler.check(spec)
    check(spec)
    constraint = compiler.compile(spec)
    _walk(constraint, served.encode(text), served.vocab_size)
    (eos,) = served.eos_token_ids
    mask = constraint.allowed()
    assert mask is not None and bool(mask[eos])
    constraint.accept(eos)
    assert constraint.finished()


@pytest.mark.parametrize(("spec", "why"), BAD, ids=[b[1] for b in BAD])
def test_a_spec_that_does_not_compile_raises_with_llguidances_message(
    served_and_compiler: tuple[ServedModel, LLGuidanceCompiler], spec: GrammarSpec, why: str
) -> None:
    _, compiler = served_and_compiler
    with pytest.raises(GrammarError, match=re.escape(why)) as compiled:
        compiler.compile(spec)
    assert str(compiled.value).startswith(spec.kind.value)
    with pytest.raises(GrammarError, match=re.escape(why)):
        compiler.check(spec)


def test_check_without_a_tokenizer_sees_the_grammar_but_not_special_tokens() -> None:
    for spec, why in BAD[:-1]:
        with pytest.raises(GrammarError, match=re.escape(why)):
            check(spec)
    check(BAD[-1][0])  # which special tokens exist is the tokenizer's to say


def test_a_masked_out_token_raises_and_leaves_the_matcher_unchanged(
    served_and_compiler: tuple[ServedModel, LLGuidanceCompiler],
) -> None:
    served, compiler = served_and_compiler
    constraint = compiler.compile(GrammarSpec(GrammarKind.JSON_OBJECT))
    before = constraint.allowed()
    (letter,) = served.encode("x")
    assert not bool(before[letter])
    with pytest.raises(GrammarError, match=f"does not allow token {letter}"):
        constraint.accept(letter)
    with pytest.raises(GrammarError, match="outside the grammar's vocabulary"):
        constraint.accept(served.vocab_size + 5)
    assert torch.equal(constraint.allowed(), before)
    _walk(constraint, served.encode("{}"), served.vocab_size)
    assert constraint.finished()


def test_finished_after_a_complete_json_object_and_only_eos_is_allowed(
    served_and_compiler: tuple[ServedModel, LLGuidanceCompiler],
) -> None:
    served, compiler = served_and_compiler
    constraint = compiler.compile(GrammarSpec(GrammarKind.JSON_OBJECT))
    tokens = served.encode('{"a": {"b": [true]}}')
    _walk(constraint, tokens[:-1], served.vocab_size)
    assert not constraint.finished()
    constraint.accept(tokens[-1])
    assert constraint.finished()
    mask = constraint.allowed()
    assert mask is not None
    assert mask.nonzero().flatten().tolist() == list(served.eos_token_ids)


def test_eos_is_refused_before_the_grammar_is_complete(
    served_and_compiler: tuple[ServedModel, LLGuidanceCompiler],
) -> None:
    served, compiler = served_and_compiler
    constraint = compiler.compile(GrammarSpec(GrammarKind.REGEX, PHONE))
    _walk(constraint, served.encode("555-01"), served.vocab_size)
    (eos,) = served.eos_token_ids
    assert not bool(constraint.allowed()[eos])
    with pytest.raises(GrammarError):
        constraint.accept(eos)
    assert not constraint.finished()


#: A regex llguidance compiles but whose lexer reaches its size limit on the first token.
TOO_BIG = GrammarSpec(GrammarKind.REGEX, "a{1000}{1000}")
#: A grammar whose lexer reaches the limit only at its fifth token, once ``e`` is taken.
TOO_BIG_LATER = GrammarSpec(GrammarKind.EBNF, 'start: "abc" ("x" | B)\nB: /e{1000}{1000}/')


def test_a_grammar_beyond_the_engines_limits_raises_a_limit_error_not_a_rejection(
    byte: LLGuidanceCompiler,
) -> None:
    check(TOO_BIG)  # it compiles: the limit is reached while it runs
    constraint = byte.compile(TOO_BIG)
    assert bool(constraint.allowed()[ord("a")])
    with pytest.raises(GrammarLimitError, match="too many expressions constructed"):
        constraint.accept(ord("a"))
    later = byte.compile(TOO_BIG_LATER)
    for token in b"abce":  # masked first, as the sampler does
        assert bool(later.allowed()[token])
        later.accept(token)
    assert bool(later.allowed()[ord("e")])
    with pytest.raises(GrammarLimitError, match="too many expressions constructed"):
        later.accept(ord("e"))
    healthy = byte.compile(GrammarSpec(GrammarKind.REGEX, "a+"))
    with pytest.raises(GrammarError, match="does not allow token") as refused:
        healthy.accept(ord("b"))
    assert not isinstance(refused.value, GrammarLimitError)  # the sampler's fault: a 500


def test_a_token_refused_by_a_grammar_that_allows_nothing_is_the_grammars_fault(
    byte: LLGuidanceCompiler,
) -> None:
    """A token fed without its mask first (the decode side takes the prefill's first token)."""
    dead = byte.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, '{"$ref": "#"}'))
    with pytest.raises(GrammarLimitError, match="NoExtensionBias"):
        dead.accept(ord("{"))


def test_a_mask_the_engine_cannot_compute_is_drawn_unmasked_and_fails_the_token() -> None:
    """The limit reached while masking: the row runs unmasked in its batch, and the token it
    draws is not taken (the request fails as the client's, its batch mates are unharmed)."""

    class Unmaskable:
        def allowed(self) -> torch.Tensor | None:
            raise GrammarLimitError("regex grammar: lexer error: too many expressions")

        def accept(self, token: int) -> None:
            raise AssertionError("a token was fed past the limit")

        def finished(self) -> bool:
            return False

    state = RequestSampling(SamplingParams(4), seed=1, constraint=Unmaskable())
    assert state.row(0).mask is None
    assert state.row(1).mask is None  # asked once: the error is kept
    with pytest.raises(GrammarLimitError, match="too many expressions") as limit:
        state.accept(7)
    reason, detail = grammar_failure(limit.value, 7, 3)
    assert reason is FailureReason.REJECTED and "token 7 at output position 3" in detail, detail
    reason, _ = grammar_failure(GrammarError("regex grammar does not allow token 7"), 7, 3)
    assert reason is FailureReason.INTERNAL


def test_a_model_vocabulary_wider_than_the_tokenizer_is_padded_with_false() -> None:
    wide = reference_model(ModelConfig(vocab_size=300))
    constraint = constraint_compiler(wide).compile(GrammarSpec(GrammarKind.REGEX, "a+"))
    constraint.accept(ord("a"))
    mask = constraint.allowed()
    assert mask.shape == (300,)
    assert mask.nonzero().flatten().tolist() == [ord("a"), EOS_TOKEN_ID]


# -- grammars compiled ahead ---------------------------------------------------------------------

def _fresh(served: ServedModel, prepared_limit: int = 8) -> LLGuidanceCompiler:
    compiler = constraint_compiler(served)
    assert compiler is not None
    return LLGuidanceCompiler(compiler.tokenizer, vocab_size=compiler.vocab_size,
                              prepared_limit=prepared_limit)


def _counts(compiler: LLGuidanceCompiler) -> tuple[int, int, int]:
    return compiler.stats.prepared, compiler.stats.inline, compiler.stats.refused


def test_the_engines_take_the_matchers_admission_prepared_each_its_own(
    byte_model: ServedModel,
) -> None:
    compiler = _fresh(byte_model)
    spec = GrammarSpec(GrammarKind.EBNF, 'start: "ab" | "ac" | "b"')
    compiler.prepare(spec, 2)  # admission: one for each engine of a colocated pair
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert _counts(compiler) == (2, 0, 0)
    _walk(first, list(b"a"), byte_model.vocab_size)
    assert bool(second.allowed()[ord("b")]) and not bool(first.allowed()[ord("a")])
    _walk(second, list(b"b"), byte_model.vocab_size)
    assert second.finished() and not first.finished()
    _walk(first, list(b"c"), byte_model.vocab_size)
    assert first.finished()
    compiler.compile(spec)  # nothing prepared waits: the engine compiles it itself
    assert _counts(compiler) == (2, 1, 0)
    compiler.prepare(spec)  # a request of three samples, checked once
    compiler.top_up(spec, 6)  # then one matcher for each engine of each sample
    assert _counts(compiler) == (8, 1, 0) and "prepared=6" in repr(compiler)
    compiler.top_up(spec, 4)  # enough wait
    assert _counts(compiler) == (8, 1, 0)


def test_a_request_that_reaches_the_lexers_limit_leaves_the_next_one_of_its_grammar_whole(
    byte_model: ServedModel,
) -> None:
    """Matchers never share a lexer across requests (copies of one matcher would): one that
    exhausted the lexer's states does not fail the next request of the same grammar."""
    compiler = _fresh(byte_model)
    compiler.prepare(TOO_BIG, 2)
    for _ in range(3):  # two prepared, then one compiled inline
        constraint = compiler.compile(TOO_BIG)
        assert bool(constraint.allowed()[ord("a")])
        with pytest.raises(GrammarLimitError, match="too many expressions constructed"):
            constraint.accept(ord("a"))
    assert _counts(compiler) == (2, 1, 0)


def test_a_grammar_that_does_not_compile_prepares_nothing(byte_model: ServedModel) -> None:
    compiler = _fresh(byte_model)
    for spec, why in BAD[:-1]:
        with pytest.raises(GrammarError, match=re.escape(why)) as refused:
            compiler.prepare(spec, 2)
        assert str(refused.value).startswith(spec.kind.value)
    assert _counts(compiler) == (0, 0, len(BAD) - 1)
    assert "prepared=0" in repr(compiler)


def test_prepared_matchers_no_engine_took_are_dropped_oldest_first(
    byte_model: ServedModel,
) -> None:
    """A request refused after admission never takes its matchers: they are bounded."""
    compiler = _fresh(byte_model, prepared_limit=2)
    a, b, c = (GrammarSpec(GrammarKind.REGEX, r) for r in ("a+", "b+", "c+"))
    for spec in (a, b, c):
        compiler.prepare(spec)
    assert "prepared=2" in repr(compiler)
    with pytest.raises(ValueError, match="prepared_limit must be >= 0"):
        _fresh(byte_model, prepared_limit=-1)
    for spec in (b, c, a):  # a's was dropped for c's
        _walk(compiler.compile(spec), list(spec.source[0].encode()), byte_model.vocab_size)
    assert _counts(compiler) == (3, 1, 0)


def test_threads_preparing_and_compiling_at_once_get_one_matcher_each(
    smollm2: ServedModel,
) -> None:
    compiler = _fresh(smollm2, prepared_limit=64)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(PERSON))
    barrier = threading.Barrier(4)

    def request() -> list[int]:
        barrier.wait(timeout=30)
        compiler.prepare(spec, 2)
        masks = [compiler.compile(spec).allowed().nonzero().flatten().tolist()
                 for _ in range(2)]
        assert masks[0] == masks[1]
        return masks[0]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        masks = list(pool.map(lambda _: request(), range(4)))
    assert all(m == masks[0] for m in masks) and masks[0]
    assert _counts(compiler) == (8, 0, 0)
    assert "prepared=0" in repr(compiler)


# -- SmolLM2's greedy answers under a mask -------------------------------------------------------

def _greedy(served: ServedModel, prompt: str, constraint: Constraint, max_new: int) -> list[int]:
    """Greedy decoding with the constraint's mask applied to every step's logits, until the
    grammar is finished (or EOS, or ``max_new`` tokens): the colocated constrained run."""
    ids = served.encode(prompt, chat=True)
    model: Any = served.model
    pool = model.make_pool(num_pages=pages_needed(len(ids) + max_new, 16), page_size=16)
    pages = tuple(range(pool.num_pages))
    item = ForwardItem("grammar", tuple(ids), 0, pages)
    out: list[int] = []
    while len(out) < max_new:
        logits = model.logits(pool, [item])[0]
        mask = constraint.allowed()
        assert mask is not None
        token = int(logits.masked_fill(~mask, float("-inf")).argmax())
        constraint.accept(token)
        out.append(token)
        if constraint.finished() or token in served.eos_token_ids:
            break
        item = ForwardItem("grammar", (token,), len(ids) + len(out) - 1, pages)
    assert constraint.finished(), f"unfinished after {len(out)} tokens: {served.decode(out)!r}"
    return out


def test_smollm2_greedy_json_under_the_schema_validates(
    smollm2: ServedModel, smol: LLGuidanceCompiler
) -> None:
    constraint = smol.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(PERSON)))
    text = smollm2.decode(_greedy(smollm2, ADA, constraint, max_new=60))
    jsonschema.validate(json.loads(text), PERSON)


def test_smollm2_greedy_text_under_a_regex_matches_it(
    smollm2: ServedModel, smol: LLGuidanceCompiler
) -> None:
    constraint = smol.compile(GrammarSpec(GrammarKind.REGEX, PHONE))
    text = smollm2.decode(_greedy(smollm2, CALL, constraint, max_new=20))
    assert re.fullmatch(PHONE, text)


# -- through the embedded pair: the prefill masks the first token, the decode side the rest -----

def pair_answers(served: ServedModel, compiler: LLGuidanceCompiler,
                  requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Outcome]:
    config = PairConfig(scheduler=SchedulerConfig(page_size=16, check_invariants=True),
                        prefill_pages=64, decode_pages=64)
    pair = EmbeddedPair(config, served=served, compiler=compiler)
    try:
        for rid, (prompt, params) in requests.items():
            pair.submit(rid, prompt, params)
        out = pair.run_until_done(requests, timeout=600)
        assert pair.prefill_pool.allocator.available() == 64
        assert pair.decode_pool.allocator.available() == 64
        return out
    finally:
        pair.close()


def test_a_grammar_that_names_the_eos_token_ends_on_it(
    smollm2: ServedModel, smol: LLGuidanceCompiler
) -> None:
    """``<|im_end|>`` is SmolLM2's EOS: llguidance's ``validate_tokens`` refuses it where the
    grammar asks for it, the mask allows it, and the answer ends on it (it was a 500)."""
    spec = GrammarSpec(GrammarKind.EBNF, 'start: "ok" <|im_end|>')
    (eos,) = smollm2.eos_token_ids
    constraint = smol.compile(spec)
    _walk(constraint, smollm2.encode("ok"), smollm2.vocab_size)
    assert constraint.allowed().nonzero().flatten().tolist() == [eos]
    constraint.accept(eos)
    assert constraint.finished()
    early = smol.compile(spec)
    with pytest.raises(GrammarError, match=f"does not allow token {eos}"):
        early.accept(eos)  # before "ok": refused by the mask, computed for the check
    out = pair_answers(smollm2, smol, {
        "ok": (smollm2.encode("Say ok.", chat=True), SamplingParams(8, grammar=spec)),
        "drawn": (smollm2.encode("Say ok.", chat=True),
                  SamplingParams(8, grammar=spec, temperature=1.0, seed=3)),
    })
    for rid, got in out.items():
        assert got.decode is not None and got.decode.ok, (rid, got)
        assert got.decode.finish_reason == "stop", got.decode
        assert list(got.decode.output_ids) == [*smollm2.encode("ok"), eos], got.decode


def test_smollm2_disaggregated_grammar_answers_validate_and_equal_the_colocated_walk(
    smollm2: ServedModel, smol: LLGuidanceCompiler
) -> None:
    person = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(PERSON))
    phone = GrammarSpec(GrammarKind.REGEX, PHONE)
    requests = {
        "json": (smollm2.encode(ADA, chat=True), SamplingParams(60, grammar=person)),
        "phone": (smollm2.encode(CALL, chat=True), SamplingParams(20, grammar=phone)),
        "drawn": (smollm2.encode(CALL, chat=True),
                  SamplingParams(20, grammar=phone, temperature=1.5, seed=7)),
    }
    out = pair_answers(smollm2, smol, requests)
    for got in out.values():
        assert got.prefill.ok and got.decode is not None and got.decode.ok, got
        assert got.decode.output_ids[0] == got.prefill.first_token
        assert got.decode.finish_reason == "stop", got.decode
    answer = out["json"].decode
    assert answer is not None
    jsonschema.validate(json.loads(smollm2.decode(answer.output_ids)), PERSON)
    assert list(answer.output_ids) == _greedy(smollm2, ADA, smol.compile(person), 60)
    for rid in ("phone", "drawn"):
        drawn = out[rid].decode
        assert drawn is not None
        assert re.fullmatch(PHONE, smollm2.decode(drawn.output_ids)), rid


def test_the_reference_model_answers_under_a_grammar_through_the_pair(
    byte_model: ServedModel, byte: LLGuidanceCompiler
) -> None:
    """The untrained reference model's bytes, masked, still spell what the grammar says."""
    grammar = GrammarSpec(GrammarKind.EBNF, 'start: ("ab" | "c")+ "."')
    prompt = byte_model.encode("grammar", chat=True)
    out = pair_answers(byte_model, byte, {
        f"r{seed}": (prompt, SamplingParams(40, grammar=grammar, temperature=1.0, seed=seed))
        for seed in range(3)})
    for rid, got in out.items():
        assert got.decode is not None and got.decode.ok, got
        assert got.decode.finish_reason == "stop", got.decode
        assert re.fullmatch(r"(ab|c)+\.", byte_model.decode(got.decode.output_ids)), rid


def test_a_grammar_beyond_the_engines_limits_fails_as_the_clients_on_either_side(
    byte_model: ServedModel, byte: LLGuidanceCompiler
) -> None:
    """The limit on the first token fails the request on the prefill side, on a later token
    on the decode side; either is ``rejected`` (400) naming the limit, every page comes back
    and a healthy request beside them answers."""
    prompt = byte_model.encode("grammar", chat=True)
    healthy = GrammarSpec(GrammarKind.REGEX, "[a-c]{4}")
    out = pair_answers(byte_model, byte, {
        "first": (prompt, SamplingParams(8, grammar=TOO_BIG)),
        # A large bias takes B's "e" over "x" after "abc".
        "later": (prompt, SamplingParams(8, grammar=TOO_BIG_LATER,
                                         logit_bias=((ord("e"), 100.0),))),
        "healthy": (prompt, SamplingParams(8, grammar=healthy)),
    })
    first = out["first"].prefill
    assert first.reason is FailureReason.REJECTED, first
    assert "grammar engine cannot run" in first.detail
    assert "(token 97 at output position 0)" in first.detail, first.detail
    # The decode side is told why (a refusal the client is to see); the client gets the
    # prefill's answer.
    refused = out["first"].decode
    assert refused.reason is FailureReason.BOOTSTRAP_FAILED, refused
    assert "peer refused: rejected (400): " in refused.detail, refused.detail
    assert "grammar engine cannot run" in refused.detail, refused.detail
    assert out["first"].answer is first
    assert out["later"].prefill.reason is None, out["later"].prefill
    later = out["later"].decode
    assert later is not None and later.reason is FailureReason.REJECTED, later
    assert "too many expressions" in later.detail
    assert "(token 101 at output position 4)" in later.detail, later.detail
    assert list(later.output_ids[:4]) == list(b"abce")
    assert out["later"].answer is later
    answer = out["healthy"].decode
    assert answer is not None and answer.ok, answer
    assert out["healthy"].answer is answer
    assert re.fullmatch("[a-c]{4}", byte_model.decode(answer.output_ids))
