"""The prefill scheduler: the pass that drives requests through the prefill lifecycle.

Theory of operation
-------------------
The scheduler owns a :class:`~lifecycle.Lifecycle` on the prefill table; its per-state
collections are the scheduler's queues (bootstrap queue = BOOTSTRAPPING, waiting queue =
WAITING, inflight queue = TRANSFERRING). This module is the pass: it decides which edges fire
and fires them; the work around each step lives in its own module. One pass
(``docs/architecture.md`` numbers it the same way):

1. **receive** — new requests and aborts come off the thread-safe inbox; a request is admitted
   into BOOTSTRAPPING with its KV sender, or refused (:mod:`.admission`);
2. **poll** — only the senders the KV layer pushed and those whose deadline passed, agreed and
   MIN-combined across ranks (:mod:`.readiness`): ``transferred``, ``fail`` (``abort`` when the
   decode peer aborted the room), or a handshake into the slot queue;
3. **promote** — handshaken requests take a metadata slot in arrival order (none free: they
   wait, never fail) and fire ``bootstrapped``;
4. **plan** — the PrefillAdder (:mod:`.adder`) picks the batch, behind the PrefillDelayer gate,
   a chunked request's next chunk first (:mod:`.planner`);
5. **launch** — pages are allocated, new requests fire ``schedule``, the forward starts
   (:mod:`.forward`): inline in the normal loop, on the device in the overlap loop;
6. **land** — a batch's results: this pass's in the normal loop, the *previous* pass's in the
   overlap loop (so the host work hides behind the device). Non-last chunks fire
   ``chunk_done``, last chunks ``prefilled`` (with a transfer deadline; with a runner that runs
   a draft model, :mod:`.drafting`, the row carries the speculative hand-off); failures
   deferred while the batch was on the device settle now;
7. **reap** — the releaser frees the pages and slots of finished requests whose transfer has
   stopped touching them.

The prefix cache (:mod:`.prefix`) takes part in steps 4 to 7: match, lock and evict, insert,
unlock.

Two sub-states the table does not draw have one owner each: BOOTSTRAPPING·handshaken (the
destination arrived, no metadata slot yet) is :class:`~.readiness.SlotQueue`;
FORWARD·on-device (a batch holding the request is on the device, and a failure that arrives
meanwhile is deferred) is :mod:`.on_device`. A failure goes through :meth:`_fail`, which
defers it or fires it; a deferred one goes through :meth:`_settle`, once.

Resources are returned by the ``release`` hook on entering DONE or FAILED, exactly once, through
a :class:`~kv.release.Releaser`: the pages (with their SWA pages and the recurrent-state slot,
when the model keeps state beside full attention: ``states``, :mod:`kv.state_pools`), the
metadata slot and the bootstrap room of a request whose sender may still be reading stay
reserved until the sender is quiescent and cleared, so a transfer never reads freed pages and a
room is never reused under a live sender.

A pass touches what changed: inbox items, pushed rooms, expired deadlines (a heap), the head
of the slot queue, and the waiting requests the adder considers — never every request.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.refusal import for_the_client, peer_refusal
from kv.release import Releaser
from kv.state_pools import StatePools, pages_admissible
from kv.transfer import KVManager
from lifecycle import (
    PREFILL_TABLE,
    FailureReason,
    Lifecycle,
    PrefillEvent,
    PrefillRequest,
    PrefillState,
)
from scheduler.dist.gather import min_reduce
from scheduler.dist.ranks import RankSync, SingleRank
from scheduler.dist.relay import InboxRelay
from scheduler.messages import (
    FAKE_BOOTSTRAP_HOST,
    AbortRequest,
    CacheFlushed,
    FlushCache,
    NewRequest,
    Response,
)
from scheduler.prefill.adder import Plan
from scheduler.prefill.admission import Admission, sender_of
from scheduler.prefill.checks import check_arguments, check_state_conservation
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import DelayerPass, PrefillDelayer
from scheduler.prefill.drafting import handoff_runner
from scheduler.prefill.forward import Device, DeviceWorker, Launched, Results, prepare, start
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.prefill.on_device import defer_failure, settle_failure
from scheduler.prefill.pipeline import StagePolls
from scheduler.prefill.planner import Planner
from scheduler.prefill.prefix import PrefixCache
from scheduler.prefill.readiness import Deadlines, Readiness, SlotQueue
from scheduler.prefill.sampling import PrefillSampling
from scheduler.runner import ModelRunner
from scheduler.sample.constraint import ConstraintCompiler
from scheduler.stepping import OneThread, SteppedByOneThread, step_until

logger = logging.getLogger(__name__)

S = PrefillState


class PrefillScheduler(SteppedByOneThread):
    """The prefill side of one rank. Not thread-safe except :meth:`submit` and :meth:`abort`.

    ``overlap`` selects the overlap loop; its forwards run on ``device`` (default: a
    :class:`~.forward.DeviceWorker` thread on the pool's device). ``compiler`` compiles the
    grammars of structured-output requests (None: such requests are refused);
    ``eos_token_id`` is the model's end-of-sequence id(s), which a request's ``min_new_tokens``
    excludes from its first token.

    On a mesh (``docs/backends.md#the-prefill-scheduler-on-a-mesh``): ``ranks`` agrees polls
    over the stage's TP ranks, ``relay`` hands every rank the first rank's requests, and with
    pipeline stages ``stages`` agrees with the other stages before any poll takes effect.
    """

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
        device: Device | None = None,
        compiler: ConstraintCompiler | None = None,
        relay: InboxRelay | None = None,
        stages: StagePolls | None = None,
        states: StatePools | None = None,
        eos_token_id: int | Iterable[int] | None = None,
    ) -> None:
        check_arguments(config, runner, overlap, device, states, kv)
        self.states = states
        self.config, self.runner, self.pool = config, runner, runner.pool
        self.kv, self.fake_kv = kv, fake_kv
        self.metadata, self.slots = metadata, slots
        self.delayer = delayer
        self.ranks = ranks or SingleRank()
        self.clock = clock
        self.on_response = on_response
        self.metrics = metrics or SchedulerMetrics()
        self.overlap = overlap
        self.stages = stages
        self.lifecycle: Lifecycle[PrefillRequest] = Lifecycle(
            PREFILL_TABLE, {"release": self._release, "respond": self._respond},
            clock=clock, check=config.check_invariants,
        )
        self.metrics.count_transitions(self.lifecycle.fired_by_event)
        self._deadlines = Deadlines()
        self._sampling = PrefillSampling(runner, compiler, eos_token_id)
        admissible, bound_by = pages_admissible(states, self.pool.num_pages)
        self._admission = Admission(
            lifecycle=self.lifecycle, config=config, kv=kv,
            num_pages=admissible, pool_name=bound_by,
            fake_kv=fake_kv, arm_deadline=self._admitted, clock=clock,
            metrics=self.metrics, respond=self._emit, vet=self._sampling.admit,
            relay=None if relay is None else relay.exchange,
        )
        self._readiness = Readiness(
            admission=self._admission, deadlines=self._deadlines, ranks=self.ranks, config=config,
        )
        self._slot_queue = SlotQueue()
        self._handoffs = handoff_runner(runner, metadata, states)
        self._results = Results(self.pool, config.page_size, metadata, self.metrics,
                                self._sampling, states, self._handoffs)
        # On a mesh every rank frees a request's pages and slot on the same pass.
        self._releaser = Releaser(self.pool, slots, metadata, states, agree=None if relay is None
                                  else functools.partial(min_reduce, group=relay.group))
        self.prefix = (PrefixCache(self.pool, self.metrics.prefix, config.schedule_policy)
                       if config.radix_cache else None)
        self._device = (device or DeviceWorker(self.pool.device)) if overlap else None
        self._inflight: Launched | None = None  # overlap: the batch on the device
        self._planner = Planner(lifecycle=self.lifecycle, config=config, pool=self.pool,
                                prefix=self.prefix, states=states)
        self.passes = 0
        self._closed = False
        self._one_thread = OneThread("PrefillScheduler")
        # Cache flushes asked on this rank, by ticket: who gets the outcome.
        self._flushes: dict[int, Callable[[CacheFlushed], None]] = {}
        self._tickets = itertools.count(1)
        self.last_batch_size = 0  # requests in the batch launched by the latest pass
        self.metrics.kv_pages_total.set(self.pool.num_pages)

    # -- the thread-safe surface ------------------------------------------------------------

    def submit(self, req: NewRequest) -> None:
        """Queue ``req`` for the next pass (thread-safe). Raises ``RuntimeError`` once the
        scheduler is closed."""
        if self._closed:
            raise RuntimeError("this PrefillScheduler is closed: it takes no more requests")
        self._admission.put(req)

    def abort(self, rid: str, *, shutdown: bool = False) -> None:
        """End live request ``rid`` (thread-safe; ignored once it is unknown or finished):
        ``aborted`` (200), or with ``shutdown`` ``shutdown`` (503): its server is closing."""
        self._admission.put(AbortRequest(rid, shutdown))

    def refuse_room(self, host: str, port: int, room: int, why: str) -> None:
        """A request this scheduler never saw was refused before it (a service's own checks):
        tell its decode peer, which then fails the room at once. Thread-safe."""
        self._admission.refuse_room(host, port, room, why)

    def flush_cache(self, done: Callable[[CacheFlushed], None]) -> None:
        """Empty the prefix cache on the next pass if no request is live then, nor any ended
        request's transfer still reading cached pages (SGLang's ``/flush_cache``: a cache that
        is warm or not changes what a benchmark measures); thread-safe. ``done`` gets the
        outcome on the stepping thread: ``live`` counts both kinds of request that refused it.
        On a mesh every rank flushes on the same pass (the first rank relays it); ask the
        first rank."""
        if self._closed:
            raise RuntimeError("this PrefillScheduler is closed: it takes no more requests")
        ticket = next(self._tickets)
        self._flushes[ticket] = done
        self._admission.put(FlushCache(ticket))

    # -- the pass ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one pass (steps 1 to 7 of the module docstring); True if it did any work.
        Raises ``RuntimeError`` once the scheduler is closed, on a thread that calls it while
        another thread is in a pass, and once a pass was interrupted (:attr:`interrupted`)."""
        with self._one_thread:
            return self._pass()

    def _pass(self) -> bool:
        if self._closed:
            raise RuntimeError("this PrefillScheduler is closed: it runs no more passes")
        self.passes += 1
        worked = self._admission.receive(self._abort, self._flush)  # 1
        worked |= self._poll()  # 2
        worked |= self._promote()  # 3
        delayer_pass = (
            DelayerPass(self.delayer, self.pool_usage()) if self.delayer is not None else None
        )
        plan = self._planner.plan(delayer_pass)  # 4
        launched = self._launch(plan) if plan.chunks else None  # 5
        self.last_batch_size = len(plan.chunks)
        if self.overlap:  # 6
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                self._land(previous)
                worked = True
        elif launched is not None:
            self._land(launched)
        if delayer_pass is not None:
            delayer_pass.finalize(actual_prefill=launched is not None)
        worked |= launched is not None
        worked |= self._releaser.reap()  # 7
        self._set_gauges()
        return worked

    def _set_gauges(self) -> None:
        m = self.metrics
        m.set_counts(self.lifecycle.counts())
        m.kv_pages_used.set(self.pages_held)
        m.kv_usage.set(self.pool_usage())
        m.slots_used.set(self.slots.num_slots - self.slots.available())
        if self.prefix is not None:
            self.prefix.set_gauges()

    def idle(self) -> bool:
        """Nothing live, nothing in flight, nothing held back by the releaser, nothing queued,
        and no other replica the delayer keeps in lockstep with this one still working."""
        return (
            len(self.lifecycle) == 0
            and self._inflight is None
            and not self._releaser
            and self._admission.inbox_empty()
            and not (self.delayer is not None and self.delayer.peers_busy())
        )

    def run_until(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        """Step until ``done()``; raise TimeoutError after ``timeout`` wall seconds."""
        step_until(self.step, done, timeout,
                   lambda: f"scheduler did not reach the condition in {timeout} s")

    def close(self) -> None:
        """Land what is in flight, stop the device worker and give the prefix cache's unlocked
        pages back to the pool (nothing reuses them once the scheduler is closed). Requests
        still live keep their pages: fail them first (``abort(rid, shutdown=True)`` and a
        pass) to have every page back. Later calls do nothing; ``submit`` and ``step`` raise."""
        if self._closed:
            return
        self._closed = True
        if live := len(self.lifecycle):
            logger.warning("closing a PrefillScheduler with %d live requests (%s%s): their "
                           "pages stay held and they are not answered; abort them "
                           "(shutdown=True) and step before close() to end them", live,
                           ", ".join(r.rid for r in itertools.islice(self.lifecycle.live(), 5)),
                           ", ..." if live > 5 else "")
        if self._inflight is not None:
            self._land(self._inflight)
            self._inflight = None
        if self._device is not None:
            self._device.shutdown()
        if self.prefix is not None:
            self.prefix.tree.evict(self.prefix.tree.evictable)

    @property
    def pages_held(self) -> int:
        """Pages held by live requests, by the releaser and by the prefix cache."""
        return self.pool.allocator.in_use()

    def pool_usage(self) -> float:
        """The fraction of the pool in use; evictable prefix-cache pages count as free."""
        if self.prefix is None:
            return self.pool.usage()
        return 1.0 - self.prefix.pages_available() / self.pool.num_pages

    def prefix_violations(self) -> list[str]:
        """How the prefix cache breaks invariant 7 now (nothing with the cache off)."""
        held_back = self._releaser.held_prefix_holds()
        return [] if self.prefix is None else self.prefix.violations(self.lifecycle.live(),
                                                                     held_back)

    def owned_pages(self, req: PrefillRequest) -> list[int]:
        """The pages of ``req``'s page table that are its own: all of them, or with the prefix
        cache on those it has not inserted (the rest are the tree's, maybe shared)."""
        return req.pages if self.prefix is None else self.prefix.owned_pages(req)

    # -- failing: now, or deferred while on the device ---------------------------------------

    def _flush(self, flush: FlushCache) -> None:
        live, reading, pages, flushed = len(self.lifecycle), 0, 0, False
        if self.prefix is None:
            logger.info("prefix cache not flushed: there is none")
        else:
            tree = self.prefix.tree
            # A request that ended while its transfer still reads its pages keeps its path
            # locked until the releaser lets go (SGLang keeps it in its inflight queue, which
            # refuses a flush too): a flush then would leave those pages cached.
            reading = sum(1 for hold in self._releaser.held_prefix_holds()
                          if hold.node is not tree.root)
            flushed = live == reading == 0
            if flushed:
                pages = tree.evict(tree.evictable)
                if tree.size:
                    raise AssertionError(f"a flush left {tree.size} pages in the prefix cache "
                                         "with no request live and no transfer reading")
                logger.info("prefix cache flushed: %d pages back in the pool", pages)
            else:
                logger.info("prefix cache not flushed: %d requests are live, %d ended requests' "
                            "transfers still read cached pages; flush it when the server is "
                            "idle", live, reading)
        done = self._flushes.pop(flush.ticket, None)  # None on a mesh's other ranks
        if done is not None:
            done(CacheFlushed(flushed, pages, live + reading))

    def _abort(self, abort: AbortRequest) -> None:
        req = self.lifecycle.get(abort.rid)
        if req is None:  # routine: a colocated server aborts both sides, one may be done
            logger.debug("abort of unknown or finished request %r ignored", abort.rid)
            return
        self._fail(req, *abort.failure())

    def _fail(self, req: PrefillRequest, reason: FailureReason, detail: str) -> None:
        """Fail ``req`` now, or once the batches holding it are off the device. An abort (the
        client's or the decode peer's) takes the ``abort`` edge, anything else ``fail``."""
        if defer_failure(req, reason, detail):
            return
        sender = sender_of(req)
        if sender is not None:
            sender.abort(self._told(req, reason, detail))
        event = PrefillEvent.ABORT if reason is FailureReason.ABORTED else PrefillEvent.FAIL
        self.lifecycle.fire(event, [req], reason=reason, detail=detail)

    @staticmethod
    def _told(req: PrefillRequest, reason: FailureReason, detail: str) -> str:
        """What the decode peer is told of ``req``'s failure (its sender's ``abort(why)``):
        the failure, where its client is to act on it, or where it came before the handshake
        ended (a bootstrap timeout: the other half, maybe not there yet, learns only this of
        it), or where it is the client's abort (the decode half ends as an abort too, not as a
        failed transfer a router would retry, undoing the abort); else nothing, and the peer
        reads a plain abort."""
        status = reason.http_status
        if (for_the_client(status) or reason is FailureReason.ABORTED
                or req.state is S.BOOTSTRAPPING):
            return peer_refusal(str(reason), status, detail)
        return ""

    def _settle(self, req: PrefillRequest) -> None:
        """Apply the failure deferred while ``req`` was on the device (it is off now)."""
        reason, detail = settle_failure(req)
        self._fail(req, reason, detail)

    # -- 2. poll and 3. promote -------------------------------------------------------------

    def _admitted(self, req: PrefillRequest, seq: int, deadline: float) -> None:
        self._deadlines.arm(req, seq, deadline)
        if self.stages is not None:
            self.stages.admitted(req, seq)

    def _poll(self) -> bool:
        polled = self._readiness.poll(self.clock())
        if self.stages is not None:  # act only on what every stage agreed
            polled = self.stages.agree(polled, self._admission, self.slots.available())
        queued = [self._slot_queue.add(req) for req in polled.handshaken]
        self.lifecycle.fire(PrefillEvent.TRANSFERRED, polled.transferred)
        for req, reason, detail in polled.failed:
            self._slot_queue.discard(req)
            self._fail(req, reason, detail)
        # Polls that changed nothing (a sender still held back) are not work: the loop may rest.
        return any(queued) or bool(polled.transferred or polled.failed)

    def _promote(self) -> bool:
        if not len(self._slot_queue):
            return False
        ready = self._slot_queue.take(self.slots, self.config.page_size)
        # Probes bootstrap on the fake host at once: counted apart, so that an alert on
        # requests no decode sends destinations for reads real traffic.
        self.metrics.probe_bootstraps.inc(
            sum(req.bootstrap_host == FAKE_BOOTSTRAP_HOST for req in ready))
        self.lifecycle.fire(PrefillEvent.BOOTSTRAPPED, ready)
        return bool(ready)

    # -- 5. launch, 6. land --------------------------------------------------------------

    def _launch(self, plan: Plan) -> Launched:
        new = [c.req for c in plan.chunks if c.req.state is S.WAITING]
        self._planner.launched(plan)
        if self.prefix is not None:
            self.prefix.admit([(c.req, c.prefix) for c in plan.chunks if c.prefix is not None],
                              sum(c.new_pages for c in plan.chunks))
        batch, sampled = self._sampling.forward_for(
            plan, prepare(plan, self.pool, self.config.page_size, self.states))
        self.lifecycle.fire(PrefillEvent.SCHEDULE, new)
        return start(plan, batch, self.runner, self._device, sampled)

    def _land(self, launched: Launched) -> None:
        landed = self._results.land(launched)
        if self.prefix is not None:
            self.prefix.insert_landed(launched.plan.chunks, landed.chunk_done + landed.prefilled)
        self.lifecycle.fire(PrefillEvent.CHUNK_DONE, landed.chunk_done)
        self.lifecycle.fire(PrefillEvent.PREFILLED, landed.prefilled)
        deadline = self.clock() + self.config.transfer_timeout
        for req in landed.prefilled:
            seq = self._admission.seq_of(req)
            self._deadlines.arm(req, seq, deadline)
            if self.stages is not None:
                self.stages.forwarded(seq)
        for req in landed.settle:
            self._settle(req)
        for req, reason, detail in landed.rejected:
            self._fail(req, reason, detail)

    # -- release and respond (lifecycle hooks) ----------------------------------------------

    def _release(self, req: PrefillRequest) -> None:
        if self.stages is not None:
            self.stages.ended(self._admission.seq_of(req))
        forget_room = self._admission.forget(req)
        self._slot_queue.discard(req)
        self._planner.forget(req)
        if self._handoffs is not None:
            self._handoffs.forget(req.rid)
        own, hold = (req.pages, None) if self.prefix is None else self.prefix.release_of(req)
        self._releaser.release(sender_of(req), own, req.slot, forget_room, hold, req.state_slot)
        req.sender, req.pages, req.slot, req.prefix, req.state_slot = None, [], None, None, None

    def _respond(self, req: PrefillRequest) -> None:
        self.metrics.on_finished(req)
        state = req.state
        assert isinstance(state, PrefillState)
        output_logprob, input_logprobs = self._sampling.take(req.rid, state is S.DONE)
        self._emit(Response(
            req.rid, state, req.reason, req.detail, req.first_token, len(req.input_ids),
            tuple(req.timeline), req.cached, output_logprob, input_logprobs,
        ))

    def _emit(self, response: Response) -> None:
        if self.on_response is not None:
            self.on_response(response)

    # -- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Conservation (invariant 3), the index (invariant 4) and, with the prefix cache on,
        its ownership and locks (invariant 7); cheap enough for tests."""
        self.lifecycle.check_index()
        live = list(self.lifecycle.live())
        held = [self.owned_pages(r) for r in live] + self._releaser.held_page_lists()
        if self.prefix is not None:
            held.append(list(self.prefix.tree.pages()))
            problems = self.prefix_violations()
            if problems:
                raise AssertionError("prefix cache: " + "; ".join(problems))
        self.pool.allocator.check_conservation(held)
        check_state_conservation(self.states, live, self._releaser.held_page_lists(),
                                 self._releaser.held_state_slots)
        slots_held = sum(1 for r in live if r.slot is not None) + self._releaser.held_slots
        if self.slots.available() + slots_held != self.slots.num_slots:
            raise AssertionError(
                f"slots: free {self.slots.available()} + held {slots_held} "
                f"!= {self.slots.num_slots}"
            )

