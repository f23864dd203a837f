"""Speculative decoding on the decode peer: requests whose metadata row carries a hand-off.

A decode peer given a :class:`~scheduler.model.speculative.SpeculativeDecoder` (its target
runner is the peer's runner; its draft runner's pools mirror the peer's page indices) decodes a
received request speculatively when the request is plain greedy (no sampling, logprobs, grammar
or stop strings: the tokens then come from greedy verification alone) and its metadata row
carries the prefill side's hand-off (:class:`kv.metadata.SpeculativeRow`). Each pass runs one
round for each such request (:meth:`~scheduler.model.speculative.Speculation.round`), which
appends one or more tokens; every other request takes the batched one-token step as before. The
draft's prefill is not recomputed: the round starts from the hand-off's proposal over the
draft K/V of the prompt that came with the request's pages (into the draft pool of the peer's
``states``, at the request's page indices). For a hybrid target a round's pages come through
the peer's :class:`~scheduler.decode.pages.PeerPages` with their SWA pages, and its recurrent
slot is the request's (the decoder snapshots and restores it around a rejected proposal).

A round that finds no free page for its proposals is retried as a one-token round, so
speculation never stalls a request the plain path could serve (a round's pages stay within the
request's ``max_new_tokens``, which the peer keeps free for every running request).
Proposals made and accepted are counted in the peer's metrics
(``pdlife_decode_spec_proposed``/``_accepted``; their ratio, the acceptance rate, is
``pdlife_decode_spec_acceptance_rate``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from kv.metadata import MetadataRow
from kv.pages import pages_needed
from lifecycle import DecodeRequest
from scheduler.decode.metrics import DecodeMetrics
from scheduler.decode.pages import PeerPages
from scheduler.model.reference import PagedModelRunner
from scheduler.model.request_kv import PoolExhausted, RequestKV
from scheduler.model.speculative import Handoff, Speculation, SpeculativeDecoder
from scheduler.runner import ForwardItem, ModelRunner


@attrs.define
class _PeerKV(RequestKV):
    """A speculative request's pages as the peer holds them: a round's pages come through the
    peer's :class:`PeerPages` (each with its SWA page), every SWA page stays the request's
    until it ends (none is trimmed early), and the recurrent slot is the peer's."""

    peer: PeerPages = attrs.field(kw_only=True)
    req: DecodeRequest = attrs.field(kw_only=True)

    def item(self, runner: PagedModelRunner, input_ids: Sequence[int], start: int,
             all_logits: bool = False, keep_from: int | None = None) -> ForwardItem:
        self.reserve(runner, start + len(input_ids))
        item = self.peer.item(self.req, 0, start)
        return attrs.evolve(item, input_ids=tuple(input_ids), all_logits=all_logits)

    def reserve(self, runner: PagedModelRunner, end: int) -> None:
        ps = runner.pool.page_size
        while pages_needed(end, ps) > len(self.pages):
            if not self.peer.grow(self.req, len(self.pages) * ps):
                raise PoolExhausted(self.rid, "KV")


class DecodeSpeculation:
    """The peer's speculative requests, by request id (none without a ``decoder``)."""

    def __init__(self, decoder: SpeculativeDecoder | None, runner: ModelRunner,
                 metrics: DecodeMetrics, pages: PeerPages) -> None:
        if decoder is not None and decoder.target is not runner:
            raise ValueError("the speculative decoder's target runner must be the decode "
                             "peer's runner (they share the pool and its pages)")
        if decoder is not None and pages.states is not None and (
                pages.states.draft is not decoder.draft.pool):
            raise ValueError("states: the draft pool must be the speculative decoder's "
                             "draft pool (the prefill side's draft K/V lands there)")
        hidden = 0 if decoder is None else decoder.target.model.config.hidden
        if hidden and pages.metadata.speculative_hidden != hidden:
            # A prefill side whose rows differ still fails per request, when its row lands.
            raise ValueError(
                f"metadata: the speculative decoder's hand-off carries the target's hidden "
                f"state ({hidden} values), but the metadata buffers have speculative_hidden="
                f"{pages.metadata.speculative_hidden} (build them with "
                f"MetadataBuffers(..., speculative_hidden={hidden}))")
        self.decoder = decoder
        self._pages = pages
        self._metrics = metrics
        self._live: dict[str, Speculation] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def start(self, req: DecodeRequest, row: MetadataRow, plain: bool) -> bool:
        """Decode ``req`` speculatively from now on when it is ``plain`` greedy and ``row``
        carries a hand-off; whether it does."""
        if self.decoder is None or not plain or row.speculative is None:
            return False
        # The request's page list itself: pages a round takes are the request's, freed with it.
        kv = _PeerKV(req.rid, pages=req.pages, state_slot=self._pages.state_slot(req),
                     peer=self._pages, req=req)
        self._live[req.rid] = self.decoder.start(kv, req.input_ids, Handoff.from_row(row))
        return True

    def step(self, req: DecodeRequest, finished: Callable[[DecodeRequest], bool]) -> bool:
        """One round of ``req``: its tokens appended to ``req.output_ids`` up to the first
        that ``finished`` it; False when not even a one-token round found a page (the peer
        tries again next pass)."""
        speculation = self._live[req.rid]
        budget = req.sampling.max_new_tokens - len(req.output_ids)
        assert self.decoder is not None  # start() took no request without one
        stats = self.decoder.stats
        proposed, accepted = stats.proposed, stats.accepted
        try:
            try:
                new = speculation.round(budget)
            except PoolExhausted:
                new = speculation.round(1)
        except PoolExhausted:
            return False
        self._metrics.spec_proposed.inc(stats.proposed - proposed)
        self._metrics.spec_accepted.inc(stats.accepted - accepted)
        self._metrics.spec_acceptance_rate.set(stats.acceptance_rate)
        for token in new:
            req.output_ids.append(token)
            if finished(req):
                break
        return True

    def forget(self, rid: str) -> None:
        self._live.pop(rid, None)
