"""The decode peer: receives a request's KV from prefill and continues decoding.

Theory of operation
-------------------
The decode peer runs the decode lifecycle (``lifecycle.decode``) with the same framework as the
prefill scheduler. It gets the same request as the prefill server. A request is admitted in
BOOTSTRAPPING with a receiver whose ``init()`` resolves the prefill side; once the handshake is
done it is ``bootstrapped`` into PREALLOC, where it waits for KV pages for its prompt and a
metadata slot (none free, or not room for every page it may take beside what the running
requests may still take: it waits, in arrival order); ``preallocated`` sends the destination to
prefill (RECEIVING). When the receiver reports SUCCESS the metadata row must have landed with the
request's own room (a torn or foreign row fails the request); its first token starts the output
(``received``, DECODING). Every pass runs one decode step for all DECODING requests, growing
their pages as the sequence grows; ``finished`` at max_new_tokens, a stop token, a stop string
or a completed grammar. Tokens are greedy, or sampled from the request's seeded stream, with
logprobs when asked (:mod:`.sampling` holds both rules). A decode step that raised, or whose
runner answered other than one token per request, fails its requests (``internal``) and the
loop goes on; a device error (:func:`scheduler.runner.device_lost`) leaves ``step()`` instead.
Room 0 is refused: it marks an empty metadata row.
A request still waiting for its KV when its waiting deadline passes (:mod:`.deadlines`) fails
``transfer_timeout``; one still in PREALLOC then (this side had no pages, slot or running
place for it, so prefill never got its destination) fails ``bootstrap_timeout`` saying so.
Sending a destination that raised (for a fake-host request, a warm-up or health probe, the
local prompt forward runs there) fails that request (``internal``) and the loop goes on,
except for a device error, as for a decode step.

A request's pages, metadata slot and (for a hybrid model, ``states``) SWA pages and
recurrent-state slot are taken together and given back together by :mod:`.pages`; those of a
request whose receiver may still be written by the prefill side (an abort, a failure) stay
reserved, with its room, until the receiver is quiescent and cleared.

No stranded prefill (invariant 8): a request this peer refuses, or fails before it sent its
destination (BOOTSTRAPPING, PREALLOC: an abort, the waiting timeout, a pool it can never fit),
is refused to its prefill peer through the KV manager (``refuse``), which fails its half at once
instead of at its bootstrap timeout; not when the failure came from the prefill side, and not
for a room a live request holds (the refusal would fail that request's prefill half). A request
the prefill peer refused fails ``bootstrap_failed`` with the peer's reason. A receiver that
fails on its own is ``bootstrap_failed`` before the request's destination went out and
``transfer_failed`` after, each ``*_timeout`` instead when its error says so
(``TransferError.timeout``), as on the prefill side.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable, Iterable, Sequence
from typing import cast

from kv.metadata import MetadataBuffers, MetadataError, SlotAllocator
from kv.refusal import peer_aborted, peer_refusal
from kv.state_pools import StatePools, pages_admissible
from kv.transfer import DecodeKVManager, KVPoll, KVReceiver, TransferError, refusal
from lifecycle import (
    DECODE_TABLE,
    DecodeEvent,
    DecodeRequest,
    DecodeState,
    FailureReason,
    Lifecycle,
)
from scheduler.decode.config import DecodeConfig
from scheduler.decode.deadlines import WaitingDeadlines
from scheduler.decode.metrics import DecodeMetrics
from scheduler.decode.pages import PeerPages, check_state_manager
from scheduler.decode.sampling import DecodeSampling, finish_reason
from scheduler.decode.speculative import DecodeSpeculation
from scheduler.messages import (
    FAKE_BOOTSTRAP_HOST,
    AbortRequest,
    DecodeResponse,
    NewRequest,
    TokenLogprob,
    take_all,
)
from scheduler.model.speculative import SpeculativeDecoder
from scheduler.runner import ForwardBatch, ForwardItem, ModelRunner, answer_error, device_lost
from scheduler.sample.constraint import ConstraintCompiler
from scheduler.sample.request import Detokenize
from scheduler.stepping import OneThread, SteppedByOneThread

logger = logging.getLogger(__name__)
S = DecodeState


def receiver_of(req: DecodeRequest) -> KVReceiver | None:
    """The request's receiver (the record holds it untyped: lifecycle/ does not know kv/)."""
    return cast("KVReceiver | None", req.receiver)


class DecodePeer(SteppedByOneThread):
    """The decode side of one rank. Not thread-safe except :meth:`submit` and :meth:`abort`."""

    def __init__(
        self,
        *,
        runner: ModelRunner,
        kv: DecodeKVManager,
        metadata: MetadataBuffers,
        slots: SlotAllocator,
        eos_token_id: int | Iterable[int] | None = None,
        config: DecodeConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_response: Callable[[DecodeResponse], None] | None = None,
        metrics: DecodeMetrics | None = None,
        compiler: ConstraintCompiler | None = None,
        detokenize: Detokenize | None = None,
        speculative: SpeculativeDecoder | None = None,
        states: StatePools | None = None,
    ) -> None:
        """``compiler`` compiles grammars and ``detokenize`` decodes output for stop strings;
        without them, requests with grammars or stop strings are refused. ``speculative``:
        :mod:`.speculative`. ``states``: a hybrid model's state pools (or a draft's pool) on
        the runner's pool, which ``kv`` receives into (:mod:`.pages`)."""
        check_state_manager(states, runner, kv)
        self._one_thread = OneThread(type(self).__name__)
        self.runner = runner
        self.pool = runner.pool
        self.states = states
        self.kv = kv
        self.metadata = metadata
        self.slots = slots
        self.config = config = config or DecodeConfig()
        self.clock = clock
        self.on_response = on_response
        self.lifecycle: Lifecycle[DecodeRequest] = Lifecycle(
            DECODE_TABLE,
            {"release": self._release, "respond": self._respond},
            clock=clock,
            check=config.check_invariants,
        )
        self._inbox: queue.SimpleQueue[NewRequest | AbortRequest] = queue.SimpleQueue()
        self._rooms: dict[int, DecodeRequest] = {}
        self._deadlines = WaitingDeadlines()
        self._pages = PeerPages(self.pool, slots, metadata, states)
        self._sampling = DecodeSampling(runner, compiler, detokenize, eos_token_id)
        self.steps = 0
        self.metrics = metrics or DecodeMetrics()
        self.metrics.kv_pages_total.set(self.pool.num_pages)
        self.speculative = speculative
        self._speculation = DecodeSpeculation(speculative, runner, self.metrics, self._pages)
        #: Called within a pass once requests received their first token (from the metadata
        #: row), before the pass's decode forward: a streaming server sends those tokens
        #: without waiting for the next one.
        self.on_first_tokens: Callable[[], None] | None = None
        self._received = False  # requests received their first token in this pass

    def submit(self, req: NewRequest) -> None:
        self._inbox.put(req)

    def abort(self, rid: str, *, shutdown: bool = False, peer: str = "") -> None:
        """End live request ``rid`` (thread-safe; ignored once it is unknown or finished):
        ``aborted`` (200), or with ``shutdown`` ``shutdown`` (503): its server is closing;
        with ``peer`` (:meth:`Response.refusal <scheduler.messages.Response.refusal>`) as its
        prefill half's failure, as if the prefill peer had refused it."""
        self._inbox.put(AbortRequest(rid, shutdown, peer))

    def refuse_room(self, host: str, port: int, room: int, why: str) -> None:
        """Tell the prefill peer at ``host:port`` that this side will never ask for ``room``'s
        KV, so it fails its half of the request at once (thread-safe; the fake host has no
        peer). For requests refused before they reach the peer, and by the peer itself."""
        if host == FAKE_BOOTSTRAP_HOST:
            return
        self.kv.refuse(f"{host}:{port}", room, why)
        self.metrics.peer_refusals.labels(direction="sent").inc()

    def output_logprobs(self, rid: str) -> Sequence[TokenLogprob]:
        """The output logprobs live request ``rid`` has so far, one per output token when it
        asked for logprobs (else none). Engine thread only; the list grows as it decodes."""
        return self._sampling.output_logprobs(rid)

    def idle(self) -> bool:
        return (len(self.lifecycle) == 0 and not self._pages.holding_back()
                and self._inbox.empty())

    # -- the pass ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one pass; True if it did any work. ``RuntimeError`` on a thread that calls it
        while another thread is in a pass, and once a pass was interrupted
        (:attr:`interrupted`)."""
        with self._one_thread:
            return self._pass()

    def _pass(self) -> bool:
        worked = self._receive()
        worked |= self._poll()
        worked |= self._preallocate()
        if self._received and self.on_first_tokens is not None:
            self.on_first_tokens()  # before this pass's forward: a stream sends them now
        worked |= self._decode()
        worked |= self._pages.reap()
        self.metrics.set_gauges(self.lifecycle.counts(), self.pool.allocator.in_use())
        return worked

    def _receive(self) -> bool:
        items = take_all(self._inbox)
        for item in items:
            if not isinstance(item, AbortRequest):
                self._admit(item)
            elif (req := self.lifecycle.get(item.rid)) is None:
                continue
            elif item.peer:
                # Once it decodes, every page and its row are here: the prefill half's end
                # no longer matters to it.
                if req.state is not S.DECODING:
                    self._fail_from_peer(req, TransferError(req.bootstrap_room,
                                                            refusal(item.peer)))
            else:
                self._fail(req, *item.failure())
        return bool(items)

    def _admit(self, new: NewRequest) -> None:
        req = DecodeRequest(new.rid, **new.record_fields())
        if new.bootstrap_room == 0:
            # Room 0 marks an empty metadata row: the first token could never be read back.
            self._refuse(new, "bootstrap_room must be non-zero")
            return
        if new.rid in self.lifecycle:
            self._refuse(new, f"request id {new.rid!r} is already live")
            return
        if new.bootstrap_room in self._rooms:
            self._refuse(new, f"bootstrap room {new.bootstrap_room} is in use by a live "
                              "request")
            return
        self.lifecycle.admit(req)
        n = len(req.input_ids)
        if n == 0:
            self._fail(req, FailureReason.REJECTED,
                       "the prompt is empty; it needs at least one token")
            return
        admissible, bound_by = pages_admissible(self.states, self.pool.num_pages)
        if self._pages.final_pages(req) > admissible:
            self._fail(req, FailureReason.REJECTED,
                       f"prompt of {n} tokens plus {req.sampling.max_new_tokens} new tokens "
                       f"cannot fit {bound_by} of the decode side ({admissible} pages of "
                       f"{self.pool.page_size} tokens)")
            return
        refused = self._sampling.admit(req)
        if refused:
            self._fail(req, FailureReason.REJECTED, refused)
            return
        self._rooms[req.bootstrap_room] = req
        try:
            receiver = self.kv.create_receiver(
                f"{req.bootstrap_host}:{req.bootstrap_port}", req.bootstrap_room
            )
            req.receiver = receiver
            receiver.init()
        except Exception as exc:
            # A peer that cannot be reached fails this request only; one whose pools cannot
            # exchange with ours was told by the KV layer, which found it.
            logger.warning("request %r: bootstrap failed: %s", req.rid, exc)
            self._fail(req, FailureReason.BOOTSTRAP_FAILED, str(exc), tell_peer=False)
            return
        self._deadlines.arm(req, self.clock() + self.config.waiting_timeout)

    def _refuse(self, new: NewRequest, why: str) -> None:
        # Refused before admission (its id or room cannot be tracked): answered directly.
        logger.warning("request %r refused: %s", new.rid, why)
        if new.bootstrap_room not in self._rooms:  # a live request's room is its own
            self.refuse_room(new.bootstrap_host, new.bootstrap_port, new.bootstrap_room, why)
        self._answer(DecodeResponse(
            new.rid, S.FAILED, FailureReason.REJECTED, why, (), "abort", len(new.input_ids)))

    def _fail(self, req: DecodeRequest, reason: FailureReason, detail: str, *,
              tell_peer: bool = True) -> None:
        """Fail ``req``; before its destination went out, tell the prefill peer unless the
        failure came from there (``tell_peer``): the client's abort as one, which the prefill
        half ends as too."""
        receiver = receiver_of(req)
        if receiver is not None:
            receiver.abort()
        if tell_peer and req.state in (S.BOOTSTRAPPING, S.PREALLOC):
            why = (peer_refusal(str(reason), reason.http_status, detail)
                   if reason is FailureReason.ABORTED else detail)
            self.refuse_room(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room, why)
        event = DecodeEvent.ABORT if reason is FailureReason.ABORTED else DecodeEvent.FAIL
        self.lifecycle.fire(event, [req], reason=reason, detail=detail)

    def _poll(self) -> bool:
        changed: dict[str, DecodeRequest] = {}
        for room in take_all(self.kv.ready):
            req = self._rooms.get(room)
            if req is not None:
                changed[req.rid] = req
        for req in self._deadlines.expired(self.clock(), self.lifecycle):
            timeout = self.config.waiting_timeout
            if req.state is S.PREALLOC:
                # Its destination never went out: prefill was not the one that kept it waiting.
                self._fail(req, FailureReason.BOOTSTRAP_TIMEOUT,
                           f"no decode pages for it within {timeout:g} s (the decode side's "
                           "pages, metadata slots or max_running_requests were held by other "
                           "requests): its destination was never sent to prefill")
            else:
                self._fail(req, FailureReason.TRANSFER_TIMEOUT,
                           f"no KV from prefill within {timeout:g} s")
        bootstrapped: list[DecodeRequest] = []
        received: list[DecodeRequest] = []
        for req in changed.values():
            receiver = receiver_of(req)
            if req.is_final or receiver is None:
                continue
            poll = receiver.poll()
            if poll == KVPoll.FAILED:
                self._fail_from_peer(req, receiver.failure_exception())
            elif req.state is S.BOOTSTRAPPING and poll >= KVPoll.WAITING_FOR_INPUT:
                bootstrapped.append(req)
            elif req.state is S.RECEIVING and poll == KVPoll.SUCCESS:
                assert req.slot is not None  # held from PREALLOC on
                try:
                    row = self.metadata.read(req.slot, expected_room=req.bootstrap_room)
                except MetadataError as exc:
                    self._fail(req, FailureReason.TRANSFER_FAILED, str(exc))
                    continue
                if row is None:
                    # The transfer reported success but the metadata row has not landed (or
                    # was torn): look again on the next pass.
                    self.kv.ready.put(req.bootstrap_room)
                    continue
                req.output_ids.append(row.first_token)
                req.cached_tokens = row.cached_tokens
                rejected = self._sampling.first(req, row)
                if rejected is not None:
                    self._fail(req, *rejected)
                    continue
                self._speculation.start(req, row, self._sampling.plain(req))
                received.append(req)
        self.lifecycle.fire(DecodeEvent.BOOTSTRAPPED, bootstrapped)
        self.lifecycle.fire(DecodeEvent.RECEIVED, received)
        self._received = bool(received)
        self.lifecycle.fire(DecodeEvent.FINISHED,
                            [r for r in received if self._sampling.finished(r)])
        return bool(changed)

    def _fail_from_peer(self, req: DecodeRequest, err: TransferError) -> None:
        """The receiver failed: the prefill side refused the room, the transfer failed, or the
        prefill is gone. Nothing to tell the peer. The client's abort of the prefill half ends
        this half as an abort (200, finish reason ``abort``), as an abort here would."""
        R = FailureReason
        if err.refused and peer_aborted(err.reason):
            self._fail(req, R.ABORTED, str(err), tell_peer=False)
            return
        if err.refused:
            self.metrics.peer_refusals.labels(direction="received").inc()
        if req.state is S.BOOTSTRAPPING or err.refused:  # before the destination went out
            reason = R.BOOTSTRAP_TIMEOUT if err.timeout else R.BOOTSTRAP_FAILED
        else:
            reason = R.TRANSFER_TIMEOUT if err.timeout else R.TRANSFER_FAILED
        self._fail(req, reason, str(err), tell_peer=False)

    def _preallocate(self) -> bool:
        prealloc = self.lifecycle.in_state(S.PREALLOC)
        if not prealloc:
            return False
        running = len(self.lifecycle) - len(prealloc) - len(
            self.lifecycle.in_state(S.BOOTSTRAPPING)
        )
        ready: list[DecodeRequest] = []
        # Every page a running request may still take stays free, so decoding cannot deadlock.
        for req in prealloc.values():
            if running + len(ready) >= self.config.max_running_requests:
                break
            if not self._pages.take(req):
                break
            ready.append(req)
        sent: list[DecodeRequest] = []
        for req in ready:
            receiver = receiver_of(req)
            assert receiver is not None
            try:
                # For a fake request (warm-up, /health_generate) this runs its prompt forward.
                self._pages.send_destination(req, receiver)
            except Exception as exc:  # the request fails; the loop goes on
                if device_lost(exc):
                    self.lifecycle.fire(DecodeEvent.PREALLOCATED, sent)
                    raise
                what = ("the local prompt forward" if req.bootstrap_host == FAKE_BOOTSTRAP_HOST
                        else "sending the destination to prefill")
                logger.error("request %r: %s failed: %r", req.rid, what, exc)
                self._fail(req, FailureReason.INTERNAL, f"{what} failed: {exc!r}")
                continue
            sent.append(req)
        self.lifecycle.fire(DecodeEvent.PREALLOCATED, sent)
        return bool(ready)

    def _decode(self) -> bool:
        decoding = self.lifecycle.in_state(S.DECODING)
        if not decoding:
            return False
        items: list[ForwardItem] = []
        reqs: list[DecodeRequest] = []
        speculating: list[DecodeRequest] = []
        for req in decoding.values():
            if req.rid in self._speculation:
                speculating.append(req)
                continue
            pos = len(req.input_ids) + len(req.output_ids) - 1
            if not self._pages.grow(req, pos):
                continue  # wait for a page; finishing requests free theirs
            items.append(self._pages.item(req, req.output_ids[-1], pos))
            reqs.append(req)
        worked = any([self._speculate(req) for req in speculating])
        if not items:
            return worked
        try:
            tokens, sampled = self._sampling.step(reqs, ForwardBatch(tuple(items)))
            malformed = answer_error(tokens, len(reqs))
            if malformed is not None:
                raise malformed
        except Exception as exc:  # the batch's requests fail; the loop goes on
            if device_lost(exc):
                raise
            logger.error("decode step of %d requests failed: %r", len(reqs), exc)
            self.lifecycle.fire(DecodeEvent.FAIL, reqs, reason=FailureReason.INTERNAL,
                                detail=f"the model forward failed: {exc!r}")
            return True
        self.steps += 1
        for i, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
            req.output_ids.append(token)
            rejected = self._sampling.landed(req, None if sampled is None else sampled[i])
            if rejected is not None:
                self._fail(req, *rejected)
        finished = self._sampling.finished
        self.lifecycle.fire(DecodeEvent.FINISHED,
                            [r for r in reqs if r.state is S.DECODING and finished(r)])
        return True

    def _speculate(self, req: DecodeRequest) -> bool:
        try:
            worked = self._speculation.step(req, self._sampling.finished)
        except Exception as exc:  # the request fails; the loop goes on
            if device_lost(exc):
                raise
            self._fail(req, FailureReason.INTERNAL, f"a speculative round failed: {exc!r}")
            return True
        if self._sampling.finished(req):
            self.lifecycle.fire(DecodeEvent.FINISHED, [req])
        return worked

    # -- hooks ------------------------------------------------------------------------------

    def _release(self, req: DecodeRequest) -> None:
        self._speculation.forget(req.rid)
        room = req.bootstrap_room
        if req.receiver is None:
            self._rooms.pop(room, None)
            forget_room = None
        else:
            # Reserved until the receiver is cleared (prefill may still write its pages).
            forget_room = functools.partial(self._rooms.pop, room, None)
        self._pages.release(req, receiver_of(req), forget_room)
        req.receiver = None

    def _respond(self, req: DecodeRequest) -> None:
        state = req.state
        assert isinstance(state, DecodeState)
        finish = finish_reason(req)
        logprobs, matched = self._sampling.take(req, finish)
        self._answer(
            DecodeResponse(
                req.rid, state, req.reason, req.detail, tuple(req.output_ids), finish,
                len(req.input_ids), tuple(req.timeline), req.cached_tokens, logprobs, matched,
            )
        )

    def _answer(self, resp: DecodeResponse) -> None:
        self.metrics.on_answer(resp)
        if self.on_response is not None:
            self.on_response(resp)

    def check_invariants(self) -> None:
        self.lifecycle.check_index()
        self._pages.check(self.lifecycle.live())
