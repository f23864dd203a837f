"""The prefill scheduler: the loop that drives requests through the prefill lifecycle.

Theory of operation
-------------------
The scheduler owns a :class:`~lifecycle.Lifecycle` on the prefill table; its per-state
collections are the scheduler's queues (bootstrap queue = BOOTSTRAPPING, waiting queue =
WAITING, inflight queue = TRANSFERRING). One pass:

1. take new requests and aborts from the thread-safe inbox; admit (a prompt that can never fit
   is answered ``rejected`` at once) and create each request's KV sender;
2. poll only the senders whose state may have changed (the KV layer pushes their rooms) and
   those whose deadline passed; with TP > 1 the ranks agree on the list and MIN-combine the
   results first; fire ``bootstrapped`` (metadata slot permitting: no slot means wait, never
   fail), ``transferred``, or ``fail`` (``abort`` when the decode peer aborted the room);
3. plan a batch with the PrefillAdder (PrefillDelayer gate), allocate its pages, ``schedule``;
4. run the forward — in the normal loop at once; in the overlap loop on a device worker, and
   the *previous* batch's results are processed while it runs;
5. process results: non-last chunks send their full pages (``chunk_done``); the last chunk
   writes the metadata row, sends the rest (``prefilled``); failures recorded while the batch
   was on the device take effect now. A forward that raised fails its batch's requests
   (``internal``) and the loop goes on.

Resources are returned by the ``release`` hook on entering DONE or FAILED, exactly once, through
a :class:`~kv.release.Releaser`: the pages, the metadata slot and the bootstrap room of a request
whose sender may still be reading stay reserved until the sender is quiescent and cleared, so a
transfer never reads freed pages and a room is never reused under a live sender.

A pass touches what changed: inbox items, pushed rooms, expired deadlines (a heap), the head
of the handshaken queue, and the waiting requests the adder considers — never every request.
"""

from __future__ import annotations

import functools
import heapq
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import attrs
import torch

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.pages import pages_needed
from kv.release import Releaser
from kv.transfer import REASON_OTHER_RANK, REASON_PEER_ABORTED, KVManager, KVPoll, KVSender
from lifecycle import PREFILL_TABLE, FailureReason, Lifecycle, PrefillRequest, PrefillState
from scheduler.dist.ranks import RankSync, SingleRank
from scheduler.messages import FAKE_BOOTSTRAP_HOST, AbortRequest, NewRequest, Response, take_all
from scheduler.prefill.adder import Plan, Stop, plan_batch
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import DelayerPass, PrefillDelayer
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.runner import ForwardBatch, ForwardItem, ModelRunner

logger = logging.getLogger(__name__)

S = PrefillState


def _sender_of(req: PrefillRequest) -> KVSender | None:
    """The request's KV sender. The lifecycle record holds it as a plain object (the lifecycle
    knows nothing of ``kv``); the scheduler only ever stores a manager's ``create_sender``."""
    return cast("KVSender | None", req.sender)


@attrs.frozen
class _Launched:
    plan: Plan
    future: Future[list[int]] | None
    tokens: list[int] | None
    error: BaseException | None = None


class PrefillScheduler:
    """The prefill side of one rank. Not thread-safe except :meth:`submit` and :meth:`abort`."""

    def __init__(
        self,
        *,
        config: SchedulerConfig,
        runner: ModelRunner,
        kv: KVManager,
        metadata: MetadataBuffers,
        slots: SlotAllocator,
        fake_kv: KVManager | None = None,
        delayer: PrefillDelayer | None = None,
        ranks: RankSync | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_response: Callable[[Response], None] | None = None,
        metrics: SchedulerMetrics | None = None,
        overlap: bool = False,
    ) -> None:
        if runner.pool.page_size != config.page_size:
            raise ValueError(
                f"page_size: the config says {config.page_size}, the KV pool has "
                f"{runner.pool.page_size}"
            )
        self.config = config
        self.runner = runner
        self.pool = runner.pool
        self.kv = kv
        self.fake_kv = fake_kv
        self.metadata = metadata
        self.slots = slots
        self.delayer = delayer
        self.ranks = ranks or SingleRank()
        self.clock = clock
        self.on_response = on_response
        self.metrics = metrics or SchedulerMetrics()
        self.overlap = overlap
        self.lifecycle: Lifecycle[PrefillRequest] = Lifecycle(
            PREFILL_TABLE,
            {"release": self._release, "respond": self._respond},
            clock=clock,
            check=config.check_invariants,
        )
        self._inbox: queue.SimpleQueue[NewRequest | AbortRequest] = queue.SimpleQueue()
        # Admission numbers name requests across ranks (the same on every rank).
        self._seq = 0
        self._by_seq: dict[int, PrefillRequest] = {}
        self._seq_of: dict[str, int] = {}
        self._rooms: dict[tuple[int, int], int] = {}  # (id(manager), room) -> seq
        self._handshaken: dict[str, PrefillRequest] = {}  # awaiting a metadata slot, FIFO
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, seq, state)
        self._releaser = Releaser(self.pool, slots, metadata)
        self._continuing: PrefillRequest | None = None
        # The largest batch so far (SGLang's max_prefill_bs, which the delayer's slot and
        # queue conditions compare against).
        self._max_prefill_bs = 0
        self._inflight: _Launched | None = None
        # The overlap loop's device worker. On CUDA it also launches on its own stream, so
        # the next batch's kernels queue behind the running ones without blocking this thread.
        self._device = (
            ThreadPoolExecutor(1, thread_name_prefix="pdlife-device") if overlap else None
        )
        self._stream = (
            # torch.cuda.Stream.__new__ has no annotations in torch's own sources.
            torch.cuda.Stream(device=self.pool.device)  # type: ignore[no-untyped-call]
            if overlap and self.pool.device.type == "cuda"
            else None
        )
        self._row_bytes = sum(b.item_len for b in metadata.buffer_infos())
        self.passes = 0
        self.last_batch_size = 0  # requests in the batch launched by the latest pass
        self.metrics.kv_pages_total.set(self.pool.num_pages)

    # -- the thread-safe surface ------------------------------------------------------------

    def submit(self, req: NewRequest) -> None:
        self._inbox.put(req)

    def abort(self, rid: str) -> None:
        self._inbox.put(AbortRequest(rid))

    # -- the pass ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one pass; True if it did any work."""
        self.passes += 1
        worked = self._receive()
        worked |= self._poll()
        worked |= self._promote()
        delayer_pass = (
            DelayerPass(self.delayer, self.pool_usage()) if self.delayer is not None else None
        )
        plan = self._plan(delayer_pass)
        launched = self._launch(plan) if plan.chunks else None
        self.last_batch_size = len(plan.chunks)
        if self.overlap:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                self._process(previous)
                worked = True
        elif launched is not None:
            self._process(launched)
        if delayer_pass is not None:
            delayer_pass.finalize(actual_prefill=launched is not None)
        worked |= launched is not None
        worked |= self._releaser.reap()
        self._set_gauges()
        return worked

    def _set_gauges(self) -> None:
        m = self.metrics
        m.set_counts(self.lifecycle.counts())
        m.kv_pages_used.set(self.pages_held)
        m.kv_usage.set(self.pool_usage())
        m.slots_used.set(self.slots.num_slots - self.slots.available())

    def idle(self) -> bool:
        """Nothing live, nothing in flight, nothing held back by the releaser, nothing queued."""
        return (
            len(self.lifecycle) == 0
            and self._inflight is None
            and not self._releaser
            and self._inbox.empty()
        )

    def run_until(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        """Step until ``done()``; raise TimeoutError after ``timeout`` wall seconds."""
        end = time.monotonic() + timeout
        while not done():
            if time.monotonic() > end:
                raise TimeoutError(f"scheduler did not reach the condition in {timeout} s")
            if not self.step():
                # Idle pass: yield the core to transfer workers instead of spinning.
                time.sleep(0.0002)

    def close(self) -> None:
        if self._inflight is not None:
            self._process(self._inflight)
            self._inflight = None
        if self._device is not None:
            self._device.shutdown(wait=True)

    @property
    def pages_held(self) -> int:
        """Pages held by live requests and by the releaser."""
        return self.pool.num_pages - self.pool.allocator.available()

    def pool_usage(self) -> float:
        return self.pages_held / self.pool.num_pages

    # -- 1. receive -------------------------------------------------------------------------

    def _receive(self) -> bool:
        items = take_all(self._inbox)
        for item in items:
            if isinstance(item, AbortRequest):
                self._abort(item.rid)
            else:
                self._admit(item)
        return bool(items)

    def _admit(self, new: NewRequest) -> None:
        req = PrefillRequest(new.rid, **new.record_fields())
        if new.rid in self.lifecycle:
            logger.warning("request id %r is already live; refused", new.rid)
            self._reject_unadmitted(req, f"request id {new.rid!r} is already live")
            return
        self.lifecycle.admit(req)
        seq = self._seq
        self._seq += 1
        self._by_seq[seq] = req
        self._seq_of[req.rid] = seq
        why = self._never_fits(req)
        if why:
            self.lifecycle.fire("fail", [req], reason=FailureReason.REJECTED, detail=why)
            return
        manager = self._manager_for(req)
        key = (id(manager), req.bootstrap_room)
        if key in self._rooms:
            self.lifecycle.fire(
                "fail", [req], reason=FailureReason.REJECTED,
                detail=f"bootstrap room {req.bootstrap_room} is in use by a live request",
            )
            return
        addr = f"{req.bootstrap_host}:{req.bootstrap_port}"
        try:
            req.sender = manager.create_sender(addr, req.bootstrap_room)
        except Exception as exc:  # a backend refusing a sender fails the request, not the loop
            logger.exception("creating the sender of %r failed", req.rid)
            self.lifecycle.fire(
                "fail", [req], reason=FailureReason.BOOTSTRAP_FAILED, detail=str(exc)
            )
            return
        self._rooms[key] = seq
        req.deadline = self.clock() + self.config.bootstrap_timeout
        heapq.heappush(self._deadlines, (req.deadline, seq, int(S.BOOTSTRAPPING)))

    def _reject_unadmitted(self, req: PrefillRequest, why: str) -> None:
        # A duplicate id cannot enter the lifecycle (ids are its keys); answer it directly.
        self.metrics.rejected_input.labels(reason="duplicate_rid").inc()
        if self.on_response is not None:
            self.on_response(
                Response(req.rid, S.FAILED, FailureReason.REJECTED, why, None, len(req.input_ids))
            )

    def _never_fits(self, req: PrefillRequest) -> str:
        n = len(req.input_ids)
        if n == 0:
            return "the prompt is empty"
        if pages_needed(n, self.config.page_size) > self.pool.num_pages:
            return (
                f"the prompt has {n} tokens; the KV pool holds at most "
                f"{self.pool.num_pages * self.config.page_size}"
            )
        return ""

    def _manager_for(self, req: PrefillRequest) -> KVManager:
        if req.bootstrap_host == FAKE_BOOTSTRAP_HOST and self.fake_kv is not None:
            return self.fake_kv
        return self.kv

    def _abort(self, rid: str) -> None:
        req = self.lifecycle.get(rid)
        if req is None:
            logger.info("abort of unknown or finished request %r ignored", rid)
            return
        self._fail(req, FailureReason.ABORTED, "aborted by the client")

    def _fail(self, req: PrefillRequest, reason: FailureReason, detail: str) -> None:
        """Fail now, or once the batches holding the request are off the device. An abort
        (the client's or the decode peer's) takes the ``abort`` edge, anything else ``fail``."""
        if req.on_device:
            if req.pending_abort is None:
                req.pending_abort = reason
                req.detail = detail
            return
        sender = _sender_of(req)
        if sender is not None:
            sender.abort()
        event = "abort" if reason is FailureReason.ABORTED else "fail"
        self.lifecycle.fire(event, [req], reason=reason, detail=detail)

    # -- 2. poll ----------------------------------------------------------------------------

    def _poll(self) -> bool:
        now = self.clock()
        changed: set[int] = set()
        for manager in (self.kv, self.fake_kv):
            if manager is None:
                continue
            mid = id(manager)
            for room in take_all(manager.ready):
                seq = self._rooms.get((mid, room))
                if seq is not None:
                    changed.add(seq)
        expired: set[int] = set()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, seq, state = heapq.heappop(heap)
            req = self._by_seq.get(seq)
            if req is not None and req.state == state and req.deadline == deadline:
                expired.add(seq)
        keys = self.ranks.agree_keys(sorted(changed | expired))
        if not keys:
            return False
        reqs: list[PrefillRequest | None] = [self._by_seq.get(k) for k in keys]
        local = [
            int(KVPoll.FAILED) if k in expired else self._poll_one(r)
            for k, r in zip(keys, reqs, strict=True)
        ]
        polls = self.ranks.min_reduce(local)
        failed: list[tuple[PrefillRequest, FailureReason, str]] = []
        done: list[PrefillRequest] = []
        handshaken = False
        for key, req, poll in zip(keys, reqs, polls, strict=True):
            if req is None or req.state is None or req.is_final:
                continue
            if poll == KVPoll.FAILED:
                reason, detail = self._failure_of(req, key in expired)
                failed.append((req, reason, detail))
            elif req.state is S.BOOTSTRAPPING and poll >= KVPoll.WAITING_FOR_INPUT:
                handshaken |= req.rid not in self._handshaken
                self._handshaken[req.rid] = req
            elif req.state is S.TRANSFERRING and poll == KVPoll.SUCCESS:
                done.append(req)
        self.lifecycle.fire("transferred", done)
        for req, reason, detail in failed:
            self._handshaken.pop(req.rid, None)
            self._fail(req, reason, detail)
        # Polls that changed nothing (a sender still held back) are not work: the loop may rest.
        return handshaken or bool(done or failed)

    def _poll_one(self, req: PrefillRequest | None) -> int:
        sender = None if req is None else _sender_of(req)
        if req is None or sender is None or req.is_final:
            # Finished here (or unknown): nothing to add to the consensus.
            return int(KVPoll.SUCCESS)
        return int(sender.poll())

    def _failure_of(self, req: PrefillRequest, expired: bool) -> tuple[FailureReason, str]:
        bootstrapping = req.state is S.BOOTSTRAPPING
        if expired:
            if bootstrapping:
                return (
                    FailureReason.BOOTSTRAP_TIMEOUT,
                    f"no destination from the decode peer within "
                    f"{self.config.bootstrap_timeout:g} s",
                )
            return (
                FailureReason.TRANSFER_TIMEOUT,
                f"the transfer did not conclude within {self.config.transfer_timeout:g} s",
            )
        sender = _sender_of(req)
        detail = REASON_OTHER_RANK
        timeout = False
        if sender is not None and int(sender.poll()) == KVPoll.FAILED:
            err = sender.failure_exception()
            if err.reason == REASON_PEER_ABORTED:
                # The decode side aborted the room: the client went away, not a failure.
                return FailureReason.ABORTED, f"aborted by the decode peer ({err})"
            detail, timeout = str(err), bool(getattr(err, "timeout", False))
        if bootstrapping:
            reason = FailureReason.BOOTSTRAP_TIMEOUT if timeout else FailureReason.BOOTSTRAP_FAILED
        else:
            reason = FailureReason.TRANSFER_TIMEOUT if timeout else FailureReason.TRANSFER_FAILED
        return reason, detail

    # -- promote ----------------------------------------------------------------------------

    def _promote(self) -> bool:
        if not self._handshaken:
            return False
        ready: list[PrefillRequest] = []
        for rid in list(self._handshaken):
            req = self._handshaken[rid]
            if req.state is not S.BOOTSTRAPPING:
                del self._handshaken[rid]
                continue
            slot = self.slots.alloc()
            if slot is None:
                break  # no slot: wait, never fail
            del self._handshaken[rid]
            req.slot = slot
            sender = _sender_of(req)
            assert sender is not None  # handshaken: its sender reported the destination
            sender.init(pages_needed(len(req.input_ids), self.config.page_size), slot)
            req.deadline = None
            ready.append(req)
        self.lifecycle.fire("bootstrapped", ready)
        return bool(ready)

    # -- 3. plan and launch -----------------------------------------------------------------

    def _plan(self, delayer_pass: DelayerPass | None) -> Plan:
        waiting = self.lifecycle.in_state(S.WAITING)
        continuing = self._continuing
        if continuing is not None and (
            continuing.state is not S.FORWARD or continuing.pending_abort is not None
        ):
            continuing = self._continuing = None
        if not waiting and continuing is None:
            return Plan()
        running = len(self.lifecycle.in_state(S.FORWARD)) + len(
            self.lifecycle.in_state(S.TRANSFERRING)
        )

        gate = None
        if delayer_pass is not None:
            max_running = self.config.max_running_requests

            def gate(running_now: int, waiting_len: int) -> bool:
                return delayer_pass.allow(
                    local_prefillable=True,
                    running_batch=running_now,
                    max_prefill_bs=self._max_prefill_bs,
                    max_running_requests=max_running,
                    waiting_queue_len=waiting_len,
                )

        plan = plan_batch(
            continuing=continuing,
            waiting=waiting.values(),
            waiting_len=len(waiting),
            running=running,
            free_pages=self.pool.allocator.available(),
            page_size=self.config.page_size,
            max_prefill_tokens=self.config.max_prefill_tokens,
            chunked_prefill_size=self.config.chunked_prefill_size,
            max_running_requests=self.config.max_running_requests,
            prefill_max_requests=self.config.prefill_max_requests,
            gate=gate,
        )
        if plan.stop is Stop.DELAYED and continuing is None:
            return Plan(stop=Stop.DELAYED)
        return plan

    def _launch(self, plan: Plan) -> _Launched:
        new: list[PrefillRequest] = []
        items: list[ForwardItem] = []
        self._continuing = None
        for chunk in plan.chunks:
            req = chunk.req
            if chunk.new_pages:
                # A first chunk goes where the whole prompt fits; later ones continue its run.
                if req.pages:
                    pages = self.pool.allocator.alloc(chunk.new_pages, after=req.pages[-1])
                else:
                    whole = pages_needed(len(req.input_ids), self.config.page_size)
                    pages = self.pool.allocator.alloc(chunk.new_pages, fit=whole)
                if pages is None:  # the adder counted free pages; this cannot happen
                    raise AssertionError(f"{req.rid}: {chunk.new_pages} pages planned, not free")
                req.pages.extend(pages)
            if req.state is S.WAITING:
                new.append(req)
            req.scheduled = chunk.start + chunk.length
            req.on_device += 1
            if not chunk.last:
                self._continuing = req
            items.append(
                ForwardItem(
                    req.rid,
                    req.input_ids[chunk.start : chunk.start + chunk.length],
                    chunk.start,
                    tuple(req.pages),
                )
            )
        self.lifecycle.fire("schedule", new)
        self._max_prefill_bs = max(self._max_prefill_bs, len(plan.chunks))
        batch = ForwardBatch(tuple(items))
        if self._device is not None:
            return _Launched(plan, self._device.submit(self._device_forward, batch), None)
        try:
            return _Launched(plan, None, self.runner.forward(batch))
        except Exception as exc:  # the batch's requests fail; the loop goes on
            return _Launched(plan, None, None, exc)

    def _device_forward(self, batch: ForwardBatch) -> list[int]:
        if self._stream is None:
            return self.runner.forward(batch)
        with torch.cuda.stream(self._stream):
            return self.runner.forward(batch)

    # -- 5. results -------------------------------------------------------------------------

    def _process(self, launched: _Launched) -> None:
        tokens, error = launched.tokens, launched.error
        if launched.future is not None:
            try:
                tokens = launched.future.result()
            except Exception as exc:
                error = exc
        if error is not None:
            self._forward_failed(launched.plan, error)
            return
        assert tokens is not None
        self.metrics.batches.inc()
        self.metrics.prefill_tokens.inc(launched.plan.num_tokens)
        chunk_done: list[PrefillRequest] = []
        prefilled: list[PrefillRequest] = []
        failing: list[PrefillRequest] = []
        ps = self.config.page_size
        for chunk, token in zip(launched.plan.chunks, tokens, strict=True):
            req = chunk.req
            req.on_device -= 1
            req.computed = chunk.start + chunk.length
            if req.pending_abort is not None:
                if not req.on_device:
                    failing.append(req)
                continue
            sender = _sender_of(req)
            assert sender is not None and req.slot is not None
            if chunk.last:
                req.first_token = token
                self.metadata.write(req.slot, token, 0, None, req.bootstrap_room)
                pages = req.pages[req.sent // ps :]
                req.sent = req.computed
                sender.send(pages, True)
                self.metrics.transfer_bytes.inc(self._bytes(len(pages)) + self._row_bytes)
                prefilled.append(req)
            else:
                # Only full pages: a partial page waits for the next chunk.
                upto = req.computed // ps * ps
                if upto > req.sent:
                    pages = req.pages[req.sent // ps : upto // ps]
                    sender.send(pages, False)
                    self.metrics.transfer_bytes.inc(self._bytes(len(pages)))
                    req.sent = upto
                chunk_done.append(req)
        self.lifecycle.fire("chunk_done", chunk_done)
        self.lifecycle.fire("prefilled", prefilled)
        deadline = self.clock() + self.config.transfer_timeout
        for req in prefilled:
            req.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, self._seq_of[req.rid], int(S.TRANSFERRING)))
        for req in failing:
            reason = req.pending_abort
            assert reason is not None
            req.pending_abort = None
            self._fail(req, reason, req.detail)

    def _forward_failed(self, plan: Plan, error: BaseException) -> None:
        """A forward raised: its requests fail (``internal``); the scheduler carries on. Their
        pages are free to reuse: the forward that could write them has ended."""
        logger.error("forward of a %d-request batch failed: %r", len(plan.chunks), error)
        detail = f"the model forward failed: {error!r}"
        for chunk in plan.chunks:
            req = chunk.req
            req.on_device -= 1
            if req.pending_abort is None:
                req.pending_abort = FailureReason.INTERNAL
                req.detail = detail
            if not req.on_device and req.state is S.FORWARD:
                reason = req.pending_abort
                req.pending_abort = None
                self._fail(req, reason, req.detail)

    def _bytes(self, num_pages: int) -> int:
        return num_pages * self.pool.page_bytes * 2 * self.pool.num_layers

    # -- release and respond (lifecycle hooks) ----------------------------------------------

    def _release(self, req: PrefillRequest) -> None:
        seq = self._seq_of.pop(req.rid)
        del self._by_seq[seq]
        self._handshaken.pop(req.rid, None)
        if self._continuing is req:
            self._continuing = None
        sender = _sender_of(req)
        forget_room = None
        if sender is not None:
            # The room stays reserved until the sender is cleared: a new request for it
            # before then would meet a sender the backend still tracks.
            key = (id(self._manager_for(req)), req.bootstrap_room)
            forget_room = functools.partial(self._rooms.pop, key, None)
        self._releaser.release(sender, req.pages, req.slot, forget_room)
        req.sender, req.pages, req.slot = None, [], None

    def _respond(self, req: PrefillRequest) -> None:
        self.metrics.on_finished(req)
        if self.on_response is not None:
            state = req.state
            assert isinstance(state, PrefillState)
            self.on_response(
                Response(
                    req.rid, state, req.reason, req.detail, req.first_token,
                    len(req.input_ids), tuple(req.timeline),
                )
            )

    # -- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Conservation (invariant 3) and the index (invariant 4); cheap enough for tests."""
        self.lifecycle.check_index()
        live = list(self.lifecycle.live())
        self.pool.allocator.check_conservation(
            [r.pages for r in live] + self._releaser.held_page_lists()
        )
        slots_held = sum(1 for r in live if r.slot is not None) + self._releaser.held_slots
        if self.slots.available() + slots_held != self.slots.num_slots:
            raise AssertionError(
                f"slots: free {self.slots.available()} + held {slots_held} "
                f"!= {self.slots.num_slots}"
            )
