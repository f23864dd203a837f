"""Sampling on the decode side: each step's tokens, the first token's row, grammars, stop strings.

The decode peer admits a request's sampling as the prefill side does
(:mod:`scheduler.sample.request`: what it cannot honour is refused, 400), and also stop
strings, which need ``detokenize``. Then, per request that needs more than greedy ``forward``:

- the **first token** comes from the metadata row with its logprob and top alternatives; it is
  fed to the request's own constraint (compiled from the same spec as the prefill side's);
- each **decode step** runs ``runner.logits`` and the sampler when any request of the batch
  samples or wants logprobs (else ``runner.forward``, as before); output position ``i`` draws
  the ``i``-th number of the request's seeded stream, the prefill side having drawn position 0;
- after each token the constraint accepts it (a rejection fails the request, naming the
  grammar error: 500, or 400 where the grammar engine cannot run the grammar; a completed
  grammar stops the answer) and the tail of the output that can hold a new match, decoded
  after the tokens before it as the answer's text is, is searched for the stop strings and
  regexes (:mod:`scheduler.sample.stops`; a search for its regexes that runs past its time
  budget fails the request, 400).

A request is finished (:meth:`DecodeSampling.finished`) at ``max_new_tokens``, a stop token, a
matched stop string or regex, a completed grammar or, unless it ignores EOS, one of the model's
end-of-sequence ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kv.metadata import MetadataRow
from lifecycle import DecodeRequest, DecodeState, FailureReason
from scheduler.messages import TokenLogprob
from scheduler.runner import ForwardBatch, LogitsRunner, ModelRunner
from scheduler.sample.batch import ItemPlan, LogitsForward
from scheduler.sample.constraint import ConstraintCompiler, GrammarError
from scheduler.sample.request import (
    Detokenize,
    RequestSampling,
    Sampling,
    grammar_failure,
    token_set,
)
from scheduler.sample.sampler import Sampled
from scheduler.sample.stops import StopRegexTooSlow


class DecodeSampling:
    """The sampling state of the decode peer's live requests, by request id."""

    def __init__(self, runner: ModelRunner, compiler: ConstraintCompiler | None = None,
                 detokenize: Detokenize | None = None,
                 eos_token_id: int | Iterable[int] | None = None) -> None:
        self._runner = runner
        # The model's end-of-sequence ids (a real checkpoint may have several).
        self.eos_token_ids = token_set(eos_token_id)
        self._sampling = Sampling(runner, compiler, detokenize, stop_strings=True,
                                  eos_token_ids=self.eos_token_ids)
        self._detokenize = detokenize
        self._states = self._sampling.states

    def admit(self, req: DecodeRequest) -> str:
        """Why ``req`` is refused (400), or "" when it is admitted."""
        return self._sampling.admit(req.rid, req.sampling, req.bootstrap_room, req.input_ids)

    def first(self, req: DecodeRequest, row: MetadataRow) -> tuple[FailureReason, str] | None:
        """Take the first output token (already appended) from its metadata row; how the
        request fails when its grammar rejects the token (:func:`grammar_failure`) or the
        search for its stop regexes runs past its budget, else None."""
        state = self._states.get(req.rid)
        if state is None:
            return None
        if state.params.return_logprob:
            state.output_logprobs.append(TokenLogprob(row.first_token, row.logprob, row.top,
                                                      row.asked))
        return self._after(req, state)

    def step(self, reqs: Sequence[DecodeRequest],
             batch: ForwardBatch) -> tuple[list[int], list[Sampled] | None]:
        """One decode step's tokens, with what the sampler says of each (None: the batch ran
        the runner's greedy ``forward``)."""
        states = [self._states.get(r.rid) for r in reqs]
        if not any(s is not None and not s.params.plain for s in states):
            return self._runner.forward(batch), None
        assert isinstance(self._runner, LogitsRunner)  # admission refused it otherwise
        forward = LogitsForward(self._runner, [
            ItemPlan() if s is None else ItemPlan(s.row(len(r.output_ids), r.output_ids))
            for r, s in zip(reqs, states, strict=True)])
        tokens = forward(batch)
        assert forward.results is not None
        return tokens, [r.sampled for r in forward.results]

    def landed(self, req: DecodeRequest,
               sampled: Sampled | None) -> tuple[FailureReason, str] | None:
        """Take a decode step's token (already appended); how the request fails when its
        grammar rejects the token or the search for its stop regexes runs past its budget,
        else None."""
        state = self._states.get(req.rid)
        if state is None:
            return None
        if sampled is not None and sampled.logprob is not None:
            state.output_logprobs.append(sampled.logprob)
        return self._after(req, state)

    def _after(self, req: DecodeRequest,
               state: RequestSampling) -> tuple[FailureReason, str] | None:
        token = req.output_ids[-1]
        try:
            state.accept(token)
        except GrammarError as exc:
            return grammar_failure(exc, token, len(req.output_ids) - 1)
        stops = state.stops
        if stops and state.matched_stop is None and self._detokenize is not None:
            # A new match ends in the newest token's text: decode only the tokens it can span,
            # after those before them, as the answer's text is decoded.
            try:
                state.matched_stop = stops.matched(
                    stops.tail_text(self._detokenize, req.input_ids, req.output_ids))
            except StopRegexTooSlow as exc:  # the client's pattern: 400
                return FailureReason.REJECTED, str(exc)
        return None

    def output_logprobs(self, rid: str) -> Sequence[TokenLogprob]:
        """The output logprobs gathered so far for live request ``rid`` (none if it asked for
        none)."""
        state = self._states.get(rid)
        return () if state is None else state.output_logprobs

    def stopped(self, req: DecodeRequest) -> bool:
        """Whether the request's grammar completed or its output holds a stop string."""
        state = self._states.get(req.rid)
        return state is not None and (state.grammar_done or state.matched_stop is not None)

    def plain(self, req: DecodeRequest) -> bool:
        """Whether greedy ``forward`` alone decides the request's tokens (no sampling, logprobs,
        grammar or stop strings)."""
        return req.rid not in self._states

    def finished(self, req: DecodeRequest) -> bool:
        """Whether ``req`` (with at least one output token) has its whole answer."""
        sampling = req.sampling
        if len(req.output_ids) >= sampling.max_new_tokens:
            return True
        last = req.output_ids[-1]
        if last in sampling.stop_token_ids or self.stopped(req):
            return True
        return not sampling.ignore_eos and last in self.eos_token_ids

    def take(self, req: DecodeRequest,
             finish_reason: str) -> tuple[tuple[TokenLogprob, ...], int | str | None]:
        """Forget the request (it is answered); its output logprobs and what matched its stop:
        a stop token id, a stop string, or None."""
        state = self._states.pop(req.rid, None)
        if finish_reason != "stop" or not req.output_ids:
            matched: int | str | None = None
        elif req.output_ids[-1] in req.sampling.stop_token_ids:
            matched = req.output_ids[-1]
        else:
            matched = None if state is None else state.matched_stop
        return (() if state is None else tuple(state.output_logprobs)), matched


def finish_reason(req: DecodeRequest) -> str:
    """Why a request that ended stopped: ``abort`` (it failed), ``length`` or ``stop``."""
    if req.state is DecodeState.FAILED:
        return "abort"
    return "length" if len(req.output_ids) >= req.sampling.max_new_tokens else "stop"
