"""Greedy speculative decoding with the reference model: a draft proposes, the target verifies.

Theory of operation
-------------------
The draft (:meth:`~scheduler.model.decoder.LlamaModel.draft`: the target's first layers, same
vocabulary; all of them is allowed: a draft that is the target itself, whose every proposal is
accepted, is never faster but checks the all-accepted path) proposes ``k`` tokens one at a
time; the target computes all of them in one forward and its greedy token at every position;
the longest prefix of proposals that equals the target's tokens is accepted, followed by the
target's own token after it. Each accepted token is the target's greedy token at its position,
computed over exactly the tokens plain greedy decoding would have put before it, and the
reference model computes a position's bits whatever its batch or chunk
(:mod:`scheduler.model.fixed_point`). So the output is plain greedy decoding's, token for
token, always; the draft only decides how many target forwards it takes.

The prefill side hands the decode side what lets it start without recomputing the draft's
prefill (:class:`Handoff`, as EAGLE's PD hand-off carries top-k probabilities, top-k indices
and a hidden state): the draft's K/V of the prompt (in the draft's pools, at the target's page
indices), the draft's top-k proposals for the position after the first output token (a look
past the prompt that writes nothing: :meth:`PagedModelRunner.peek`), with probabilities in
fixed point, and the target's final hidden state at the last prompt position. A prompt that
fills the context (``max_position`` tokens) leaves no position to propose for: its hand-off
has no proposals (:func:`proposals`), and the first token is its whole answer.

Both models share a request's page indices and state slot (:class:`RequestKV`): the draft's
pools have the target's page counts. A model keeps a count of positions whose K/V and state it
holds. Rejected proposals leave K/V past that count, which no query reads before it is
rewritten (attention is causal); a recurrent state cannot be taken back that way, so a model
with recurrent layers snapshots its states before a round and, when a proposal is rejected,
restores them and recomputes the accepted tokens in its next forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

from kv.metadata import MetadataRow, SpeculativeRow
from scheduler.model.fixed_point import PROB_FRAC_BITS, exp_neg, greedy_token_ids
from scheduler.model.reference import ModelInputError, PagedModelRunner
from scheduler.model.request_kv import RequestKV
from scheduler.runner import ForwardBatch, ForwardItem


@attrs.frozen
class Handoff:
    """What the prefill side sends for speculative decoding, beside the two models' K/V.

    ``top_ids``/``top_probs``: the draft's ``k`` most likely tokens after ``first_token``
    (most likely first, ties to the lower id) and their probabilities in units of
    ``2**-PROB_FRAC_BITS``, none when the prompt fills the context (:func:`proposals`; a
    metadata row then carries no hand-off); ``hidden``: the target's final residual stream at
    the last prompt position (float64 on the activation grid, so float32 holds it
    exactly)."""

    first_token: int
    top_ids: tuple[int, ...]
    top_probs: tuple[int, ...]
    hidden: torch.Tensor = attrs.field(eq=False)

    def row(self) -> SpeculativeRow:
        """The hand-off as the metadata row's speculative columns carry it."""
        return SpeculativeRow(self.top_ids, self.top_probs, tuple(self.hidden.tolist()))

    @classmethod
    def from_row(cls, row: MetadataRow) -> Handoff:
        """The hand-off of a landed metadata row (which must carry one)."""
        spec = row.speculative
        if spec is None:
            raise ValueError(f"the row of room {row.room} carries no speculative hand-off")
        return cls(row.first_token, spec.top_ids, spec.top_probs,
                   torch.tensor(spec.hidden, dtype=torch.float64))


def check_pairing(target: PagedModelRunner, draft: PagedModelRunner) -> None:
    """ValueError unless ``draft`` can draft for ``target``: the same vocabulary, and pools of
    the same page count and size (they share page indices)."""
    t, d = target.model.config, draft.model.config
    if t.vocab_size != d.vocab_size:
        raise ValueError(f"the draft's vocabulary ({d.vocab_size}) is not the target's "
                         f"({t.vocab_size})")
    if (target.pool.num_pages, target.pool.page_size) != (
            draft.pool.num_pages, draft.pool.page_size):
        raise ValueError("the draft's pool must have the target's page count and size: "
                         "they share page indices")


def top_k(logits: torch.Tensor, k: int, table: torch.Tensor) -> tuple[list[int], list[int]]:
    """The ``k`` most likely ids of float64 ``logits`` (ties to the lower id) and their
    probabilities in units of ``2**-PROB_FRAC_BITS``: ``exp`` from the model's table, so the
    same bits everywhere (the sum of table values is exact)."""
    weights = exp_neg(logits.max() - logits, table)
    probs = torch.round(weights / weights.sum() * 2.0**PROB_FRAC_BITS).to(torch.int64)
    order = torch.sort(logits, descending=True, stable=True).indices[:k]
    return order.tolist(), probs[order].tolist()


def prefill_handoff(target: PagedModelRunner, draft: PagedModelRunner, kv: RequestKV,
                    prompt: Sequence[int], chunk: int, k: int) -> Handoff:
    """Prefill ``prompt`` into both models' pools in chunks of ``chunk`` tokens (the draft
    computes the same items as the target) and return the hand-off."""
    if not prompt or chunk < 1 or k < 1:
        raise ModelInputError(kv.rid, f"needs a prompt, chunk >= 1 and k >= 1, got "
                              f"{len(prompt)} tokens, chunk {chunk}, k {k}")
    for start in range(0, len(prompt), chunk):
        item = kv.item(target, prompt[start : start + chunk], start)
        hidden = target.hidden(_batch(item))[-1]
        draft.forward(_batch(item))
    first = int(greedy_token_ids(target.model.logits(hidden)))
    return Handoff(first, *proposals(draft, item, first, k), hidden)


def proposals(draft: PagedModelRunner, last: ForwardItem, first_token: int,
              k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The hand-off's ``k`` proposals after ``first_token``, which follows ``last`` (the item
    of the prompt's last chunk): their ids and probabilities, from the draft's look one
    position past the prompt, which writes nothing. None (two empty tuples) when the prompt
    fills the context: the first token then sits at ``max_position``, which no model computes,
    and no output token can follow it."""
    end = last.start + len(last.input_ids)
    if end >= draft.max_position:
        return (), ()
    look = attrs.evolve(last, input_ids=(first_token,), start=end, all_logits=False)
    ids, probs = top_k(draft.peek(look)[0], k, draft.model.exp_table)
    return tuple(ids), tuple(probs)


@attrs.define
class _Model:
    """One model's side of a request: how many positions its pools hold, and for a model with
    recurrent layers the states it had when the round began."""

    runner: PagedModelRunner
    computed: int
    saved_at: int = 0
    snapshot: torch.Tensor | None = None

    def save(self, slot: int) -> None:
        self.saved_at = self.computed
        if self.runner.states is not None:
            self.snapshot = self.runner.states[:, slot].clone()

    def settle(self, slot: int, valid: int) -> None:
        """Positions below ``valid`` hold accepted tokens; a model that computed past them
        keeps what it computed below ``valid``, or, with recurrent layers, goes back to its
        states at the round's beginning."""
        if self.computed <= valid:
            return
        if self.snapshot is None:
            self.computed = valid
            return
        assert self.runner.states is not None
        self.runner.states[:, slot] = self.snapshot
        self.computed = self.saved_at


@attrs.define
class SpeculativeStats:
    """Rounds run, proposals made and proposals accepted (``acceptance_rate`` their ratio)."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class SpeculativeDecoder:
    """Greedy speculative decoding of one request at a time with ``target`` and ``draft``
    runners whose pools have the same page counts (and state slots)."""

    def __init__(self, target: PagedModelRunner, draft: PagedModelRunner, k: int) -> None:
        if k < 1:
            raise ValueError(f"k (proposals per round) must be >= 1, got {k}")
        check_pairing(target, draft)
        self.target, self.draft, self.k = target, draft, k
        self.stats = SpeculativeStats()

    def start(self, kv: RequestKV, prompt: Sequence[int], handoff: Handoff) -> Speculation:
        """A request to decode round by round (a decode loop runs one :meth:`Speculation.round`
        per pass); both models' pools hold the prompt's K/V at ``kv``'s pages."""
        return Speculation(self, kv, prompt, handoff)

    def decode(self, kv: RequestKV, prompt: Sequence[int], handoff: Handoff,
               max_new_tokens: int, stop_token_ids: Iterable[int] = (),
               ignore_eos: bool = False) -> list[int]:
        """Output tokens after ``prompt``, ``handoff.first_token`` first, as plain greedy
        decoding gives them; both models' pools hold the prompt's K/V at ``kv``'s pages."""
        if max_new_tokens < 1:
            raise ModelInputError(kv.rid, f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stops = self.target.model.stop_ids(stop_token_ids, ignore_eos)
        request = self.start(kv, prompt, handoff)
        out = [handoff.first_token]
        while len(out) < max_new_tokens and out[-1] not in stops:
            for token in request.round(max_new_tokens - len(out)):
                out.append(token)
                if token in stops:
                    break
        return out


class Speculation:
    """One request's speculative decoding, a round at a time (:meth:`SpeculativeDecoder.start`)."""

    def __init__(self, decoder: SpeculativeDecoder, kv: RequestKV, prompt: Sequence[int],
                 handoff: Handoff) -> None:
        self._decoder, self.kv = decoder, kv
        self.tokens = [*prompt, handoff.first_token]  # the prompt and the output so far
        self._target = _Model(decoder.target, len(prompt))
        self._draft = _Model(decoder.draft, len(prompt))
        self._handed = list(handoff.top_ids[:1])

    def round(self, budget: int) -> list[int]:
        """The next 1 .. ``min(k + 1, budget)`` output tokens: accepted proposals, then the
        target's own token (a caller that stops at a stop token drops what follows it).
        Raises :class:`~scheduler.model.request_kv.PoolExhausted`, having changed nothing but
        the pages the request holds, when a pool has no page for the round."""
        d = self._decoder
        if budget < 1:
            raise ValueError(f"a round needs a budget of >= 1 tokens, got {budget}")
        last = len(self.tokens) - 1  # the position of the newest token, not yet computed
        k = min(d.k, budget - 1, d.target.model.config.max_position - 1 - last)
        # Every page of the round first: a pool that runs out fails the round before any
        # model computed anything (PoolExhausted; the round can be retried).
        self.kv.reserve(d.target, last + k + 1)
        chain = self._propose(self._handed[:k], k)
        self._handed = []
        new = self._verify(chain)
        self.tokens += new
        return new

    def _propose(self, chain: list[int], k: int) -> list[int]:
        """``k`` proposals after the tokens, starting from those already known (``chain``)."""
        draft, kv = self._draft, self.kv
        draft.save(kv.state_slot)
        while len(chain) < k:
            ext = self.tokens + chain
            item = kv.item(self._decoder.target, ext[draft.computed :], draft.computed,
                           keep_from=self._target.computed)
            chain.append(self._decoder.draft.forward(_batch(item))[0])
            draft.computed = len(ext)
        return chain

    def _verify(self, chain: list[int]) -> list[int]:
        """The target's tokens for the round: the accepted proposals, then its own."""
        target, draft, kv, stats = self._target, self._draft, self.kv, self._decoder.stats
        last, start = len(self.tokens) - 1, target.computed
        target.save(kv.state_slot)
        ext = self.tokens + chain
        item = kv.item(target.runner, ext[start:], start, all_logits=True,
                       keep_from=draft.saved_at)
        greedy = greedy_token_ids(target.runner.logits(_batch(item))).tolist()[last - start :]
        accepted = 0
        while accepted < len(chain) and chain[accepted] == greedy[accepted]:
            accepted += 1
        stats.rounds += 1
        stats.proposed += len(chain)
        stats.accepted += accepted
        # Positions last .. last+accepted held accepted inputs; the rest were proposals.
        valid = last + accepted + 1
        target.computed = len(ext)
        target.settle(kv.state_slot, valid)
        draft.settle(kv.state_slot, valid)
        return [*chain[:accepted], int(greedy[accepted])]


def _batch(item: ForwardItem) -> ForwardBatch:
    return ForwardBatch((item,))
