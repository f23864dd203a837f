"""The admission registry: the inbox, the numbering of admitted requests, and their rooms.

Requests and aborts arrive on a thread-safe inbox (the only state another thread touches).
Admitting a request gives it an *admission number* — the same on every rank, since every rank
admits the same requests in the same order — which names it in the ranks' agreement on what to
poll and in the deadline heap. A request is refused (``rejected``, 400) when its prompt can never
fit the KV pool or is empty, when its sampling cannot be honoured (``vet``: no logits, no
grammar backend, a grammar that does not compile), when its id is live (it never enters the
lifecycle: ids are its keys) or when its bootstrap room is held by a live request or a sender
not yet cleared.
Otherwise it gets its KV sender — from the fake backend for the bootstrap host ``2.2.2.2``,
SGLang's warm-up path — and a bootstrap deadline.

A room stays reserved until the sender of the request that held it is cleared (the scheduler's
releaser calls the function :meth:`Admission.forget` returns): a new sender for the room before
then would meet one the backend still tracks.

A refused request's room is refused to the decode peer too (:meth:`Admission.refuse_room`, the
KV manager's ``refuse``), so decode fails its half of the request at once instead of waiting for
KV that will never come (invariant 8). That holds for a room in use as well: the live request
keeps its own destination, and only a second one is answered with the refusal.
"""

from __future__ import annotations

import functools
import logging
import queue
from collections.abc import Callable
from typing import cast

from kv.pages import pages_needed
from kv.transfer import KVManager, KVSender
from lifecycle import FailureReason, Lifecycle, PrefillEvent, PrefillRequest, PrefillState
from scheduler.messages import (
    FAKE_BOOTSTRAP_HOST,
    AbortRequest,
    FlushCache,
    InboxItem,
    NewRequest,
    Response,
    take_all,
)
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.metrics import SchedulerMetrics

logger = logging.getLogger(__name__)


def sender_of(req: PrefillRequest) -> KVSender | None:
    """The request's KV sender. The lifecycle record holds it as a plain object (the lifecycle
    knows nothing of ``kv``); only :meth:`Admission.admit` stores one, a manager's
    ``create_sender``."""
    return cast("KVSender | None", req.sender)


class Admission:
    """Admits requests into BOOTSTRAPPING and keeps the registry of live admissions: number
    ↔ request, (manager, room) → number. Not thread-safe except :meth:`put`."""

    def __init__(
        self,
        *,
        lifecycle: Lifecycle[PrefillRequest],
        config: SchedulerConfig,
        num_pages: int,
        kv: KVManager,
        fake_kv: KVManager | None,
        arm_deadline: Callable[[PrefillRequest, int, float], None],
        clock: Callable[[], float],
        metrics: SchedulerMetrics,
        respond: Callable[[Response], None],
        vet: Callable[[PrefillRequest], str] = lambda _req: "",
        pool_name: str = "the KV pool",
        relay: Callable[[list[InboxItem]], list[InboxItem]] | None = None,
    ) -> None:
        """``num_pages``: the most pages one request can hold, in the pool ``pool_name`` (a
        longer prompt is refused). ``vet(req)`` says why a request's sampling is refused (""
        when it is not).
        ``relay`` turns what arrived on this rank's inbox into what every rank of a mesh
        admits this pass (:class:`scheduler.dist.relay.InboxRelay`); None: a rank alone."""
        self.lifecycle = lifecycle
        self._vet = vet
        self.config = config
        self.num_pages = num_pages
        self._pool_name = pool_name
        self.managers = tuple(m for m in (kv, fake_kv) if m is not None)
        self._kv, self._fake_kv = kv, fake_kv
        self._arm_deadline = arm_deadline
        self._clock = clock
        self._metrics = metrics
        self._respond = respond
        self._relay = relay
        self._inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._next = 0
        self._by_seq: dict[int, PrefillRequest] = {}
        self._seq_of: dict[str, int] = {}
        self._rooms: dict[tuple[int, int], int] = {}  # (id(manager), room) -> number

    # -- the inbox (thread-safe) --------------------------------------------------------------

    def put(self, item: InboxItem) -> None:
        self._inbox.put(item)

    def inbox_empty(self) -> bool:
        return self._inbox.empty()

    def receive(self, abort: Callable[[AbortRequest], None],
                flush: Callable[[FlushCache], None]) -> bool:
        """Admit what arrived, in order, and hand each abort to ``abort`` and each cache flush
        to ``flush``; True if anything did."""
        items = take_all(self._inbox)
        if self._relay is not None:
            items = self._relay(items)
        for item in items:
            if isinstance(item, AbortRequest):
                abort(item)
            elif isinstance(item, FlushCache):
                flush(item)
            else:
                self.admit(item)
        return bool(items)

    # -- admitting ----------------------------------------------------------------------------

    def admit(self, new: NewRequest) -> None:
        req = PrefillRequest(new.rid, **new.record_fields())
        if new.rid in self.lifecycle:
            logger.warning("request id %r is already live; refused", new.rid)
            self._refuse_duplicate(req)
            self.refuse_room(new.bootstrap_host, new.bootstrap_port, new.bootstrap_room,
                             f"request id {new.rid!r} is already live")
            return
        self.lifecycle.admit(req)
        seq = self._next
        self._next += 1
        self._by_seq[seq] = req
        self._seq_of[req.rid] = seq
        why = self._never_fits(req) or self._vet(req)
        manager = self.manager_for(req)
        key = (id(manager), req.bootstrap_room)
        if not why and key in self._rooms:
            why = f"bootstrap room {req.bootstrap_room} is in use by a live request"
        if why:
            self.lifecycle.fire(
                PrefillEvent.FAIL, [req], reason=FailureReason.REJECTED, detail=why
            )
            self.refuse_room(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room, why)
            return
        addr = f"{req.bootstrap_host}:{req.bootstrap_port}"
        try:
            req.sender = manager.create_sender(addr, req.bootstrap_room)
        except Exception as exc:  # a backend refusing a sender fails the request, not the loop
            logger.exception("creating the sender of %r failed", req.rid)
            self.lifecycle.fire(
                PrefillEvent.FAIL, [req], reason=FailureReason.BOOTSTRAP_FAILED, detail=str(exc)
            )
            self.refuse_room(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room,
                             str(exc))
            return
        self._rooms[key] = seq
        self._arm_deadline(req, seq, self._clock() + self.config.bootstrap_timeout)

    def refuse_room(self, host: str, port: int, room: int, why: str) -> None:
        """Tell the decode peer of ``room`` that this side will not serve it (thread-safe; the
        fake host has no peer)."""
        if host == FAKE_BOOTSTRAP_HOST and self._fake_kv is not None:
            return
        self._kv.refuse(room, why)
        self._metrics.peer_refusals.labels(direction="sent").inc()

    def _refuse_duplicate(self, req: PrefillRequest) -> None:
        # A duplicate id cannot enter the lifecycle (ids are its keys); answer it directly.
        self._metrics.rejected_input.labels(reason="duplicate_rid").inc()
        self._respond(Response(
            req.rid, PrefillState.FAILED, FailureReason.REJECTED,
            f"request id {req.rid!r} is already live", None, len(req.input_ids),
        ))

    def _never_fits(self, req: PrefillRequest) -> str:
        n = len(req.input_ids)
        if n == 0:
            return "the prompt is empty; it needs at least one token"
        if pages_needed(n, self.config.page_size) > self.num_pages:
            return (
                f"the prompt has {n} tokens; {self._pool_name} holds at most "
                f"{self.num_pages * self.config.page_size}"
            )
        return ""

    def manager_for(self, req: PrefillRequest) -> KVManager:
        if req.bootstrap_host == FAKE_BOOTSTRAP_HOST and self._fake_kv is not None:
            return self._fake_kv
        return self._kv

    # -- the registry -------------------------------------------------------------------------

    def __len__(self) -> int:
        """Live admissions: admitted and not yet forgotten."""
        return len(self._by_seq)

    def by_seq(self, seq: int) -> PrefillRequest | None:
        return self._by_seq.get(seq)

    def seq_of(self, req: PrefillRequest) -> int:
        return self._seq_of[req.rid]

    def seq_of_room(self, manager: KVManager, room: int) -> int | None:
        """The admission number of the request holding ``room`` of ``manager``, if any."""
        return self._rooms.get((id(manager), room))

    def forget(self, req: PrefillRequest) -> Callable[[], object] | None:
        """Drop a finished request from the registry. Returns what frees its room, to be
        called once its sender is cleared (None: it never held one)."""
        seq = self._seq_of.pop(req.rid)
        del self._by_seq[seq]
        if req.sender is None:
            return None
        key = (id(self.manager_for(req)), req.bootstrap_room)
        return functools.partial(self._rooms.pop, key, None)
