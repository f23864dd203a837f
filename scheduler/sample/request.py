"""One request's sampling on one side: what admission checks, and the state a side keeps.

Both the prefill scheduler and the decode peer admit a request through
:meth:`Sampling.admit`: a request whose sampling the side cannot honour is refused (a reason
that maps to 400), never served greedily instead — it needs logits and the runner has none, or
a grammar and the side has no compiler, or a grammar that does not compile, or stop strings and
the side cannot detokenize; so is a prompt holding an id outside the runner's vocabulary (its
``vocab_size``, where it has one: such an id would fail its whole batch), and a prompt and
``max_new_tokens`` beyond the runner's context (its ``max_position``, a count of positions,
where it has one). A request that needs more than a runner's greedy
``forward`` gets a :class:`RequestSampling`: its stream's seed, its compiled constraint, and the
logprobs gathered so far. The side keeps it by request id until the request is answered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs

from lifecycle import FailureReason, SamplingParams
from scheduler.messages import TokenLogprob
from scheduler.runner import LogitsRunner, ModelRunner, outside_vocabulary
from scheduler.sample.constraint import (
    Constraint,
    ConstraintCompiler,
    GrammarError,
    GrammarLimitError,
)
from scheduler.sample.logprobs import first_entries, wants_input_logprobs
from scheduler.sample.sampler import RowSpec
from scheduler.sample.stops import Stops
from scheduler.sample.stream import request_seed

#: Turns output token ids into text (for stop strings).
Detokenize = Callable[[Sequence[int]], str]


class SamplingRefused(ValueError):
    """A request's sampling this side cannot honour; the message says why (answered 400)."""


@attrs.define(eq=False)
class RequestSampling:
    """A request's seed, constraint and logprobs on one side."""

    params: SamplingParams
    seed: int
    constraint: Constraint | None = None
    input_logprobs: list[TokenLogprob] = attrs.Factory(list)
    output_logprobs: list[TokenLogprob] = attrs.Factory(list)
    # The stop string, or stop regex's pattern, the decoded output holds (the decode side stops
    # on it).
    matched_stop: str | None = None
    # The constraint is complete: the answer stops.
    grammar_done: bool = False
    # What min_new_tokens excludes while the answer is shorter: stop tokens and EOS ids
    # (where the grammar allows nothing else, the sampler lets them come).
    banned: tuple[int, ...] = ()
    # The stop strings and regexes the decoded output is searched for.
    stops: Stops = attrs.field(default=Stops())
    # The engine could not compute the constraint's mask: the row is drawn unmasked, and
    # accept raises this instead of taking the token.
    limit: GrammarLimitError | None = None

    def row(self, position: int, output: Sequence[int] = ()) -> RowSpec:
        """The spec of output position ``position``'s row (the constraint's mask now), after
        the output tokens ``output`` (those before it). A mask the grammar engine cannot
        compute is kept for :meth:`accept` to raise: the batch runs, the request fails."""
        params = self.params
        mask = None
        if self.constraint is not None and self.limit is None:
            try:
                mask = self.constraint.allowed()
            except GrammarLimitError as exc:
                self.limit = exc
        return RowSpec(params, self.seed, position, mask,
                       history=tuple(output[:position]) if params.penalized else (),
                       banned=self.banned if position < params.min_new_tokens else ())

    def accept(self, token: int) -> None:
        """Feed ``token`` to the constraint (``grammar_done`` says whether it is now complete).
        Raises :class:`GrammarError` when it rejects the token."""
        if self.limit is not None:
            raise self.limit
        if self.constraint is not None:
            self.constraint.accept(token)
            self.grammar_done = self.constraint.finished()


def grammar_failure(exc: GrammarError, token: int, position: int) -> tuple[FailureReason, str]:
    """How a request fails when its grammar raised ``exc`` on token id ``token``, drawn at
    output position ``position`` (0: the first): the request's fault (400) when the engine
    cannot run the grammar, else the server's (500: the sampler drew a token the mask did not
    allow)."""
    at = f"token {token} at output position {position}"
    if isinstance(exc, GrammarLimitError):
        return FailureReason.REJECTED, f"the grammar engine cannot run this grammar ({at}): {exc}"
    return FailureReason.INTERNAL, f"the grammar rejected {at}: {exc}"


def token_set(ids: int | Iterable[int] | None) -> frozenset[int]:
    """A model's end-of-sequence ids as a set: one id, several, or None (none)."""
    if ids is None:
        return frozenset()
    return frozenset((ids,) if isinstance(ids, int) else ids)


def needs_logits(params: SamplingParams, prompt_len: int) -> bool:
    """Whether a request needs a runner's logits, not only its greedy ``forward``."""
    return not params.plain or wants_input_logprobs(params, prompt_len)


class Sampling:
    """A side's admission of sampling (refuses what it cannot honour, prepares the rest) and
    the :class:`RequestSampling` of its live requests, by request id (``states``)."""

    def __init__(
        self,
        runner: ModelRunner,
        compiler: ConstraintCompiler | None = None,
        detokenize: Detokenize | None = None,
        *,
        stop_strings: bool = False,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        """``stop_strings``: this side matches stop strings (the decode peer), so they need
        ``detokenize``. ``eos_token_ids``: the model's end-of-sequence ids, which
        ``min_new_tokens`` excludes with the request's stop tokens."""
        self.logits = isinstance(runner, LogitsRunner)
        # Why a request that needs logits is refused: a runner with ``logits`` but without
        # ``vocab_size`` is no LogitsRunner, and its author should hear which attribute is missing.
        self._no_logits = "" if self.logits else (
            "this one has logits() but no vocab_size attribute, which a logits runner needs "
            "(scheduler.runner.LogitsRunner)" if hasattr(runner, "logits")
            else "this one serves only greedy requests without logprobs")
        self._vocab: int | None = getattr(runner, "vocab_size", None)
        self._context: int | None = getattr(runner, "max_position", None)
        self._eos = frozenset(eos_token_ids)
        self.compiler = compiler
        self.detokenize = detokenize
        self._stop_strings = stop_strings
        self.states: dict[str, RequestSampling] = {}

    def admit(self, rid: str, params: SamplingParams, room: int, prompt: Sequence[int]) -> str:
        """Why the request is refused (400), or "" when it is admitted; its state, when it
        needs one, is kept in ``states`` until the side forgets it."""
        try:
            state = self.prepare(rid, params, room, prompt)
        except SamplingRefused as exc:
            return str(exc)
        if state is not None:
            self.states[rid] = state
        return ""

    def prepare(self, rid: str, params: SamplingParams, room: int,
                prompt: Sequence[int]) -> RequestSampling | None:
        """The request's sampling state, or None when greedy ``forward`` serves it alone.
        Raises :class:`SamplingRefused`."""
        context = self._context
        # The last output token is never fed back: it needs no position.
        if context is not None and len(prompt) + params.max_new_tokens - 1 > context:
            raise SamplingRefused(
                f"request {rid!r}: prompt ({len(prompt)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) - 1 exceeds the model's context of {context} "
                f"positions")
        if params.return_logprob and params.logprob_start_len > len(prompt) > 0:
            raise SamplingRefused(  # past the prompt's end: a client's mistake, said
                f"request {rid!r}: logprob_start_len ({params.logprob_start_len}) is past the "
                f"prompt's {len(prompt)} tokens: give 0..{len(prompt)} ({len(prompt)} or -1: "
                "no input logprobs)")
        vocab = self._vocab
        problem = outside_vocabulary(prompt, vocab) if vocab is not None else None
        if problem:
            # Refused alone: in a batch, an id the model cannot embed fails every request.
            raise SamplingRefused(f"request {rid!r}: {problem}")
        if needs_logits(params, len(prompt)) and not self.logits:
            raise SamplingRefused(
                f"request {rid!r}: sampling, logprobs and grammars need a model runner that "
                f"returns logits; {self._no_logits}")
        bias = params.logit_bias
        if bias and self._vocab is not None and bias[-1][0] >= self._vocab:
            raise SamplingRefused(f"request {rid!r}: logit_bias names token {bias[-1][0]}, "
                                  f"beyond the vocabulary of {self._vocab}")
        stops = self._stop_strings and bool(params.stop or params.stop_regex)
        if stops and self.detokenize is None:
            raise SamplingRefused(f"request {rid!r}: stop strings and regexes need a tokenizer "
                                  f"to decode the output, and this server has none")
        constraint = None
        if params.grammar is not None:
            if self.compiler is None:
                raise SamplingRefused(f"request {rid!r}: this server has no grammar backend "
                                      f"for {params.grammar.kind} constraints: none was "
                                      "given, or llguidance cannot take the model's tokenizer "
                                      "(pdlife serve says why at start-up)")
            try:
                constraint = self.compiler.compile(params.grammar)
            except GrammarError as exc:
                kind = params.grammar.kind
                why = str(exc).removeprefix(f"{kind} does not compile: ")  # said once
                raise SamplingRefused(f"request {rid!r}: the {kind} grammar does not compile: "
                                      f"{why}") from exc
        if not needs_logits(params, len(prompt)) and not stops:
            return None
        try:
            searched = Stops.of(params) if self._stop_strings else Stops()
        except ValueError as exc:  # a stop regex the matcher does not take
            raise SamplingRefused(f"request {rid!r}: {exc}") from exc
        banned = tuple(sorted(self._eos.union(params.stop_token_ids))
                       if params.min_new_tokens else ())
        return RequestSampling(params, request_seed(params, room), constraint,
                               first_entries(params, prompt), banned=banned, stops=searched)
