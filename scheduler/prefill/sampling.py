"""Sampling on the prefill side: admission, the forward a batch runs, and what its results leave.

- **receive** — :meth:`PrefillSampling.admit` refuses a request whose sampling this server
  cannot honour (400: :mod:`scheduler.sample.request`) and compiles its grammar; a request that
  needs more than greedy ``forward`` gets a :class:`~scheduler.sample.request.RequestSampling`,
  kept by request id until it is answered.
- **launch** — a batch whose requests all need only greedy ``forward`` runs ``runner.forward``
  exactly as before. Otherwise :meth:`PrefillSampling.forward_for` turns it into a
  :class:`~scheduler.sample.batch.LogitsForward`: ``runner.logits`` and the sampler, on the
  device. A chunk asks for the logits of all its positions when they score prompt tokens the
  request wants logprobs of; a last chunk's row is masked by the request's constraint (computed
  here, on the loop thread) and drawn at output position 0 of its seeded stream.
- **land** — :meth:`PrefillSampling.land` keeps a chunk's input logprobs and, for a last chunk,
  feeds the token to the constraint (a rejection fails the request, naming the grammar error:
  500, or 400 where the grammar engine cannot run the grammar) and keeps its logprob, which
  the metadata row carries to the decode side.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from lifecycle import FailureReason, PrefillRequest
from scheduler.messages import TokenLogprob
from scheduler.prefill.adder import Plan
from scheduler.runner import ForwardBatch, LogitsRunner, ModelRunner
from scheduler.sample.batch import UNREAD, ItemPlan, ItemResult, LogitsForward, Scoring
from scheduler.sample.constraint import ConstraintCompiler, GrammarError
from scheduler.sample.logprobs import needs_all_logits
from scheduler.sample.request import Sampling, grammar_failure, token_set


class PrefillSampling:
    """The sampling state of the prefill side's live requests, by request id."""

    def __init__(self, runner: ModelRunner, compiler: ConstraintCompiler | None = None,
                 eos_token_id: int | Iterable[int] | None = None) -> None:
        self._runner = runner
        self._sampling = Sampling(runner, compiler, eos_token_ids=token_set(eos_token_id))
        self._states = self._sampling.states

    def admit(self, req: PrefillRequest) -> str:
        """Why ``req`` is refused (400), or "" when it is admitted."""
        return self._sampling.admit(req.rid, req.sampling, req.bootstrap_room, req.input_ids)

    def forward_for(self, plan: Plan, batch: ForwardBatch) -> tuple[ForwardBatch,
                                                                     LogitsForward | None]:
        """The batch to run and the sampling forward that runs it (None: ``runner.forward``)."""
        states = self._states
        if not states or not any(c.req.rid in states for c in plan.chunks):
            return batch, None
        assert isinstance(self._runner, LogitsRunner)  # admission refused it otherwise
        items, plans = [], []
        for chunk, item in zip(plan.chunks, batch.items, strict=True):
            state = states.get(chunk.req.rid)
            if state is None:
                items.append(item)
                plans.append(ItemPlan())
                continue
            prompt = chunk.req.input_ids
            every = needs_all_logits(state.params, len(prompt), chunk.start,
                                     chunk.start + chunk.length)
            items.append(attrs.evolve(item, all_logits=True) if every else item)
            plans.append(ItemPlan(state.row(0) if chunk.last else UNREAD,
                                  Scoring(state.params, prompt) if every else None))
        return ForwardBatch(tuple(items)), LogitsForward(self._runner, plans)

    def land(self, req: PrefillRequest, last: bool,
             result: ItemResult) -> tuple[FailureReason, str] | None:
        """Keep what a landed chunk of ``req`` computed; for its last chunk, feed the sampled
        token to the constraint. Returns how the request fails when its grammar rejects the
        token (:func:`~scheduler.sample.request.grammar_failure`), else None."""
        state = self._states.get(req.rid)
        if state is None:
            return None
        state.input_logprobs.extend(result.input_logprobs)
        if not last:
            return None
        try:
            state.accept(result.sampled.token)
        except GrammarError as exc:
            return grammar_failure(exc, result.sampled.token, 0)
        if result.sampled.logprob is not None:
            state.output_logprobs.append(result.sampled.logprob)
        return None

    def take(self, rid: str, done: bool) -> tuple[TokenLogprob | None, tuple[TokenLogprob, ...]]:
        """Forget the request (it is answered); the first output token's logprob and the input
        logprobs its answer carries (when ``done`` and asked for)."""
        state = self._states.pop(rid, None)
        if state is None or not done:
            return None, ()
        output = state.output_logprobs[0] if state.output_logprobs else None
        return output, tuple(state.input_logprobs)
