"""The serving core behind ``pdlife serve``: engines, the engine loop, and request hand-off.

Theory of operation
-------------------
A :class:`Service` builds the engines of its role over one model (:class:`.Engines`: a prefill
scheduler, a decode peer, or both in one process with the ``local`` backend, where one
``/generate`` runs the whole request).

One :class:`.EngineLoop` thread owns and steps the engines. Request handlers
run on the HTTP event loop: :meth:`Service.start` registers a :class:`Pending` under the request
id, submits to the engines and wakes the loop; the engines' ``on_response`` callbacks (engine
thread) find the Pending and resolve its asyncio future with
``loop.call_soon_threadsafe``. Streaming decode requests also get their new tokens, with their
logprobs when asked, after every pass (``after_pass`` runs on the engine thread, the only place
engine state may be read), and their first tokens as soon as the decode side received them,
before that pass's decode forward (``DecodePeer.on_first_tokens``). A snapshot of counts and
pool usage is published after every pass for ``/server_info``.

A request id is live from :meth:`Service.start` until every engine it was submitted to has
answered; ids are unique among live requests. Rooms of fake-host requests, and of every request
of the fake and local backends, are the service's own (no prefill server pairs with them): they
are replaced by a fresh service-local room.

Load shedding: beyond ``max_queued_requests`` requests that hold no KV pages yet,
:meth:`Service.start` refuses new ones (:mod:`.shedding`). Drain: :meth:`Service.begin_drain`
stops admission; :meth:`Service.wait_drained` returns when
no request is live. A failed engine loop fails every live request (500) and makes the service
unhealthy for good; a prefill's bootstrap endpoint says so at once, and that its KV writes
stopped once they have (:meth:`.Engines.stop_writes`: not with other ranks or replicas, which
it says only as it closes, once each confirmed).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from kv.refusal import refused_for_the_client
from kv.routes import dp_rank_of
from lifecycle import FailureReason, GrammarSpec
from scheduler.assemble import Closers, RunnerFactory, close_all, constraint_compiler
from scheduler.decode.mesh import DecodeMeshControl
from scheduler.messages import CacheFlushed, DecodeResponse, NewRequest, Response
from scheduler.model.reference import PagedModelRunner
from scheduler.model.select import reference_model
from scheduler.prefill.mesh import MeshControl
from scheduler.sample.grammar import check as check_grammar
from scheduler.service.config import (
    Answer,
    BadRequest,
    Item,
    ServeConfig,
    Unavailable,
    check_item,
)
from scheduler.service.engine_loop import EngineLoop
from scheduler.service.engines import Engines, RanksStopped
from scheduler.service.metrics import (
    DroppedMessagesCollector,
    GrammarCompilesCollector,
    PeerAuthCollector,
    ServiceMetrics,
)
from scheduler.service.pending import Pending
from scheduler.service.shedding import QueueBound

if TYPE_CHECKING:
    from scheduler.decode.router import Outcome
    from scheduler.service.tracing import LifecycleTracer

__all__ = ["Answer", "BadRequest", "Item", "Pending", "ServeConfig", "Service", "Unavailable"]

logger = logging.getLogger(__name__)

#: What a request the server closed under is answered (503).
CLOSED = "the server closed before the request ended"
#: How long :meth:`Service.close` waits for the engines to end the live requests it aborts.
CLOSE_WAIT_S = 10.0
#: How long a failed pass of a server with rank processes waits for the watcher of those
#: processes to name one that exited (the failure then reported).
RANK_EXIT_GRACE_S = 2.0


class Replicas(Protocol):
    """The other DP replicas of a prefill server (:class:`scheduler.service.ranks.Ranks`)."""

    def submit(self, new: NewRequest) -> bool:
        """Hand ``new`` to the replica of its room; False when that is this process's."""

    def abort(self, rid: str, *, shutdown: bool = False) -> None: ...

    def refuse(self, room: int, reason: str) -> None:
        """A decode peer refused ``room``: tell the replica of the room, if not this one."""

    def refuse_room(self, room: int, reason: str) -> bool:
        """This server refused a request of ``room``: tell the replica of the room, which
        counts it; False when that is this process's."""

    def answer_to(self, callback: Callable[[Response], None],
                  running: Callable[[int, int], None]) -> None:
        """Hand the replicas' answers to ``callback``, and each replica's count of requests
        holding KV pages to ``running(replica, count)`` (from another thread)."""

    def flush_cache(self) -> list[concurrent.futures.Future[CacheFlushed]]:
        """Ask every other replica to empty its prefix cache: one outcome each."""


class Service:
    """Engines of one role, their loop, and the requests waiting on them."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        runner_factory: RunnerFactory = PagedModelRunner,
        tracer: LifecycleTracer | None = None,
        mesh: MeshControl | None = None,
        replicas: Replicas | None = None,
        decode_mesh: DecodeMeshControl | None = None,
    ) -> None:
        """``mesh``: this process is rank 0 of a prefill mesh (:mod:`scheduler.service.ranks`);
        its scheduler runs its shard of the reference model and agrees with the other ranks.
        ``replicas``: the other DP replicas, which take the requests of their rooms.
        ``decode_mesh``: this process is TP rank 0 of a decode server
        (:mod:`scheduler.service.decode_ranks`), its peer on its shard of the reference
        model."""
        self.config = config
        self._replicas = replicas
        # A real checkpoint, or the reference model ``config.model`` shapes: its tokenizer,
        # runner and grammar compiler.
        served = config.served if config.served is not None else reference_model(
            config.model, device=config.device)
        self.tokenizer: Any = served.tokenizer
        self.model: Any = served.model
        for ranks in (mesh, decode_mesh):
            if ranks is not None:
                self.model = served.shard(ranks.mesh, config.device)
        if runner_factory is PagedModelRunner:
            runner_factory = served.runner
        self._lock = threading.Lock()
        self._pending: dict[str, Pending] = {}
        # The live requests a client's request spawned (its samples, its batch's items), by
        # the rid the client sent, which aborts them all (:meth:`abort_request`).
        self._spawned: dict[str, dict[str, None]] = {}
        # Requests not yet started because their prefill server is being looked up, by its
        # bootstrap address (decode over Mooncake).
        self._looking_up: collections.Counter[str] = collections.Counter()
        # Why the server aborted a live request (abort_all with a reason), for its answer.
        self._abort_reasons: dict[str, str] = {}
        self._streams: dict[str, Pending] = {}
        self._rooms = itertools.count(1)
        self._draining = False
        self._closed = False
        self._queue = QueueBound(config.max_queued_requests)
        self._idle = threading.Condition(self._lock)
        self.snapshot: dict[str, Any] = {}
        # One compiler for admission and the engines: admission compiles a request's grammar
        # (off the engine thread) into the matchers the engines take.
        self.compiler = constraint_compiler(served)
        self.engines = engines = Engines(
            config, self.model, runner_factory=runner_factory,
            compiler=self.compiler, detokenize=served.stop_text,
            on_prefill=self._on_prefill, on_decode=self._on_decode,
            prefill_options=None if mesh is None else mesh.scheduler_options(),
            place=None if mesh is None else mesh.rank_place(
                num_layers=config.model_shape.layers, kv_heads=config.model_shape.kv_heads,
                dp_size=config.dp_size),
            decode_mesh=decode_mesh,
        )
        self.bootstrap, self.decode_kv = engines.bootstrap, engines.decode_kv
        if replicas is not None:
            replicas.answer_to(self._on_prefill, self._replica_running)
            if self.bootstrap is not None:
                self.bootstrap.add_refusal_listener(replicas.refuse)
        self.prefill, self.decode = engines.prefill, engines.decode
        engine = self.prefill if self.prefill is not None else self.decode
        self.metrics = ServiceMetrics(engine.metrics.registry if engine is not None else None)
        self.metrics.registry.register(DroppedMessagesCollector(engines.dropped_messages))
        self.metrics.registry.register(PeerAuthCollector(engines.peer_auth_failures))
        if self.compiler is not None:
            compiler = self.compiler
            self.metrics.registry.register(GrammarCompilesCollector(lambda: compiler.stats))
        if tracer is None and config.otlp_traces_endpoint is not None:
            from scheduler.service.tracing import otlp_tracer

            tracer = otlp_tracer(config.otlp_traces_endpoint, role=config.role,
                                 backend=config.backend)
        self.tracer = tracer  # spans of finished requests (scheduler.service.tracing); or off
        stepped: list[Any] = [e for e in (self.prefill, self.decode) if e is not None]
        if self.decode is not None:
            self.decode.on_first_tokens = self._follow_streams
        # With rank processes, a pass that fails because one died waits for the watcher to
        # say which (scheduler.service.ranks.watch_ranks).
        ranked = mesh is not None or replicas is not None or decode_mesh is not None
        self.loop = EngineLoop(stepped, on_crash=self._on_crash, after_pass=self._after_pass,
                               outside_grace_s=RANK_EXIT_GRACE_S if ranked else 0.0)
        self._after_pass()

    def start_loop(self) -> None:
        self.loop.start()

    def close(self, others: Callable[[], RanksStopped] | None = None) -> None:
        """Refuse new requests (:meth:`start`, from the first moment), end the live ones as
        the server's abort (503, ``shutdown``) and wait for them at most
        :data:`CLOSE_WAIT_S`; then stop the loop, end the tracer and release the backends
        (threads, sockets, the bootstrap port). A request the engines did not end in time is
        answered 503 all the same (nothing steps it any more). ``others``: stops a prefill's
        other rank processes once this one's KV writes stopped, before its bootstrap endpoint
        closes (:meth:`.Engines.close`); not called where the loop did not stop (it would
        step beside them), and the caller then stops them."""
        with self._lock:
            self._closed = True
            live = bool(self._pending)
        if live and self.loop.alive:  # the engines end them and give their pages back
            self.abort_all(CLOSED)
            self._wait_idle(CLOSE_WAIT_S)
        stopped = False
        try:
            self.loop.stop()
            stopped = True
        finally:
            closers: Closers = [
                functools.partial(self.engines.close, others if stopped else None)]
            if self.tracer is not None:
                closers.append(self.tracer.close)
            for exc in close_all(closers):
                logger.error("closing the tracer failed", exc_info=exc)
            if not self.loop.alive:  # else it outlived stop(), which raised: it may answer
                self._answer_all(503, FailureReason.SHUTDOWN, CLOSED)

    def _wait_idle(self, timeout: float) -> None:
        """Wait at most ``timeout`` until no request is live and this process's engines are
        idle (their pages back: a page is let go a pass after its answer when a transfer was
        still to quiesce)."""
        deadline = time.monotonic() + timeout
        if not self.wait_drained(timeout):
            return
        engines = [e for e in (self.prefill, self.decode) if e is not None]
        pause = threading.Event()  # never set: an interruptible pause between looks
        while not all(e.idle() for e in engines) and time.monotonic() < deadline:
            self.loop.wake()
            pause.wait(0.005)

    # -- admission (HTTP side) --------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return not self.unhealthy()

    def unhealthy(self) -> str:
        """Why the engine loop takes no requests ("" when it does): the server is closed, the
        loop failed, or it does not run."""
        if self._closed:
            return "the server is closed"
        if self.loop.failure is not None:
            return f"the engine loop failed: {self.loop.failure!r}"
        if not self.loop.alive:
            return "the engine loop is not running (start_loop() starts it)"
        return ""

    @property
    def draining(self) -> bool:
        return self._draining

    def starting(self) -> str:
        """Why the server cannot serve yet ("" when it can): rank processes not all registered
        at its bootstrap endpoint (a decode peer would find no route to them)."""
        bootstrap = self.bootstrap
        if bootstrap is None or bootstrap.registered >= bootstrap.expected_ranks:
            return ""
        return (f"starting: {bootstrap.registered} of {bootstrap.expected_ranks} prefill ranks "
                "registered")

    def check(self, **fields: Any) -> Item:
        """One prompt as an :class:`Item` (see :func:`check_item`); fake and local requests get
        a fresh service-local room."""
        return check_item(self.config, self._rooms, **fields)

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Raises :class:`~scheduler.sample.constraint.GrammarError` if ``spec`` does not
        compile. With a compiler, against the model's vocabulary, into a matcher an engine will
        take (:meth:`~scheduler.sample.grammar.LLGuidanceCompiler.prepare`; call it off the
        event loop, then :meth:`prepare_grammars`); without one, the grammar alone (the engines
        then refuse it)."""
        if self.compiler is None:
            check_grammar(spec)
        else:
            self.compiler.prepare(spec)

    def prepare_grammars(self, items: list[Item]) -> list[Item]:
        """Compile what the checked ``items`` still need: a matcher for each engine of this
        process that runs each item (off the event loop); returns ``items``."""
        if self.compiler is None:
            return items
        engines = (self.prefill is not None) + (self.decode is not None)
        # A decode worker draws a fake-host request's first token itself, the prefill's way.
        drawn_here = self.prefill is None and self.decode is not None
        wanted: collections.Counter[GrammarSpec] = collections.Counter()
        for item in items:
            if item.sampling.grammar is not None:
                wanted[item.sampling.grammar] += engines + (item.fake and drawn_here)
        for spec, n in wanted.items():
            self.compiler.top_up(spec, n)
        return items

    def needs_connect(self, item: Item) -> bool:
        """Whether ``item`` may have to wait for :meth:`connect_peer_soon` (a peer not yet
        connected), or fail before it starts (:meth:`peer_lost`)."""
        kv = self.decode_kv
        return kv is not None and not item.fake and self.config.backend == "mooncake" and (
            item.bootstrap_addr not in kv.peers() or kv.lost(item.bootstrap_addr))

    def peer_lost(self, item: Item) -> str | None:
        """Decode role: why ``item``'s prefill server counts as gone (it stopped answering, or
        answers but cannot be used), or None. The request then fails before it starts, as
        when its look-up fails (500 ``bootstrap_failed``, before a stream's first byte, which
        a router can retry elsewhere), and its room is refused to the prefill once it answers
        again."""
        if self.decode_kv is None or item.fake:
            return None
        return self.decode_kv.refuse_while_lost(item.bootstrap_addr, item.bootstrap_room)

    @contextlib.contextmanager
    def looking_up(self, items: list[Item]) -> Iterator[None]:
        """Count ``items`` as waiting for their prefill servers' look-up while the block runs
        (:meth:`connecting`). They are queued requests: raises
        :class:`~.shedding.Overloaded`, counting none, when they do not all fit
        ``max_queued_requests`` beside the live requests and the others waiting."""
        waiting = collections.Counter(i.bootstrap_addr for i in items)
        with self._lock:
            if items:
                self._queue.check(self._held() + len(items) - 1, items[0].rid)
            self._looking_up.update(waiting)
        try:
            yield
        finally:
            with self._lock:
                self._looking_up.subtract(waiting)
                self._looking_up = +self._looking_up  # drops the addresses at 0

    def connecting(self) -> dict[str, int]:
        """Requests not yet started because their prefill server is being looked up, by its
        bootstrap address (decode over Mooncake): not in :meth:`live_requests`."""
        with self._lock:
            return dict(sorted(self._looking_up.items()))

    def _held(self) -> int:
        """The requests this service holds: the live ones and those waiting for a look-up.
        Under the lock."""
        return len(self._pending) + sum(self._looking_up.values())

    def connect_peer_soon(self, item: Item, on_done: Outcome) -> Callable[[], None] | None:
        """Decode role: have the request's prefill server connected, without blocking
        (:meth:`~scheduler.decode.router.DecodeKVRouter.connect_soon`): None when there is
        nothing to wait for; else ``on_done`` gets the outcome (on the look-up's thread) and
        the call returned stops waiting for it."""
        if self.decode_kv is None or item.fake:
            return None
        return self.decode_kv.connect_soon(item.bootstrap_addr, on_done)

    def start(self, item: Item, *, stream: bool, carrier: dict[str, str] | None = None,
              spawned_by: tuple[str, ...] = ()) -> Pending:
        """Register and submit ``item``; the returned Pending's future gets its Answer.
        ``carrier`` holds the caller's trace headers; ``spawned_by``, the rids of the client's
        request that spawned it (see :meth:`abort_request`). Must be called on the event loop
        the handler awaits on. Raises :class:`Unavailable` (draining, failed),
        :class:`BadRequest` (a live rid) or :class:`~.shedding.Overloaded` (both: the queue is
        at ``max_queued_requests``), having registered nothing."""
        loop = asyncio.get_running_loop()
        sides = {"prefill"} if self.config.role == "prefill" else {"decode"}
        if self.config.role == "both":
            sides = {"prefill", "decode"}
        pending = Pending(
            item=item, loop=loop, future=loop.create_future(), started=time.monotonic(),
            waiting_on=sides, progress=asyncio.Queue() if stream else None, carrier=carrier,
            interval=self.config.stream_interval, spawned_by=spawned_by,
        )
        new = NewRequest(
            item.rid, item.input_ids, bootstrap_host=item.bootstrap_host,
            bootstrap_port=item.bootstrap_port, bootstrap_room=item.bootstrap_room,
            sampling=item.sampling,
        )
        with self._lock:
            unhealthy = self.unhealthy()
            if unhealthy:
                raise Unavailable(unhealthy)
            if self._draining:
                raise Unavailable("the server is draining (shutting down)")
            if item.rid in self._pending:
                raise BadRequest("duplicate_rid", f"request id {item.rid!r} is already live",
                                 rid=item.rid, param="rid")
            self._queue.check(self._held(), item.rid)
            self._pending[item.rid] = pending
            for parent in spawned_by:
                self._spawned.setdefault(parent, {})[item.rid] = None
            if stream and self.decode is not None:
                self._streams[item.rid] = pending
        if item.fake and self.decode_kv is not None:
            self.decode_kv.fake.expect(item.bootstrap_room, item.rid, item.input_ids,
                                      item.sampling)
        try:
            if self.prefill is not None and not (self._replicas and self._replicas.submit(new)):
                self.prefill.submit(new)
            if self.decode is not None:
                self.decode.submit(new)
        except (RuntimeError, ValueError) as exc:  # a closed scheduler or replica queue
            # The server closed between the checks above and here: no engine holds it (a
            # scheduler takes nothing once closed), so it is withdrawn, never answered.
            with self._lock:
                del self._pending[item.rid]
                self._streams.pop(item.rid, None)
                self._forget_spawned(pending)
                self._idle.notify_all()
            if item.fake and self.decode_kv is not None:
                self.decode_kv.fake.forget(item.bootstrap_room)
            raise Unavailable("the server is closed") from exc
        self.loop.wake()
        return pending

    def _forget_spawned(self, pending: Pending) -> None:
        """Drop an ended request from its parents' records. Under the lock."""
        for parent in pending.spawned_by:
            children = self._spawned.get(parent)
            if children is not None:
                children.pop(pending.item.rid, None)
                if not children:
                    del self._spawned[parent]

    def abort_request(self, rid: str) -> int:
        """A client's abort (``/abort_request``): the live request ``rid`` and every live
        request spawned by the request the client sent as ``rid`` (its samples ``<rid>_<i>``,
        its batch's items ``<rid>-<k>``; recorded when they started, not matched by prefix:
        ``r1`` is not ``r10``'s parent). The number of requests aborted; 0 when none is
        live (any thread)."""
        with self._lock:
            rids = [rid] if rid in self._pending else []
            rids += [child for child in self._spawned.get(rid, ()) if child != rid]
        return sum(self.abort(r) for r in rids)

    def abort(self, rid: str, *, shutdown: bool = False) -> bool:
        """Abort a live request (any thread): the client's abort (``aborted``), or with
        ``shutdown`` the server's own (``shutdown``, in metrics and traces). False if ``rid``
        is not live."""
        with self._lock:
            if rid not in self._pending:
                return False
        for engine in (self.prefill, self.decode):
            if engine is not None:
                engine.abort(rid, shutdown=shutdown)
        if self._replicas is not None:
            self._replicas.abort(rid, shutdown=shutdown)
        self.loop.wake()
        return True

    def abort_all(self, reason: str | None = None) -> int:
        """Abort every live request; with ``reason``, as the server shutting down: their
        answers say it (status 503) and they fail ``shutdown``, not as a client's abort."""
        with self._lock:
            rids = list(self._pending)
            if reason is not None:
                self._abort_reasons.update(dict.fromkeys(rids, reason))
        return sum(self.abort(rid, shutdown=reason is not None) for rid in rids)

    def flush_cache(self) -> list[concurrent.futures.Future[CacheFlushed]]:
        """Ask every prefill scheduler of this server (each DP replica's) to empty its prefix
        cache on its next pass, if no request is live there then (any thread): one outcome
        each; none on a decode worker, which keeps no prefix cache."""
        outcomes: list[concurrent.futures.Future[CacheFlushed]] = []
        if self.prefill is not None:
            mine: concurrent.futures.Future[CacheFlushed] = concurrent.futures.Future()
            self.prefill.flush_cache(mine.set_result)
            outcomes.append(mine)
        if self._replicas is not None:
            outcomes += self._replicas.flush_cache()
        self.loop.wake()
        return outcomes

    def live_requests(self) -> int:
        with self._lock:
            return len(self._pending)

    def refuse_on_replica(self, room: int, why: str) -> bool:
        """Prefill role with DP replicas: have the replica that serves ``room`` refuse it to
        its decode peer (counted there, under its ``dp_rank``); False when that is this
        process's replica."""
        if self._replicas is None or self.prefill is None:
            return False
        return self._replicas.refuse_room(room, why)

    def live_rooms(self) -> set[tuple[str, int, int]]:
        """The bootstrap host, port and room of every live request."""
        with self._lock:
            items = [p.item for p in self._pending.values()]
        return {(i.bootstrap_host, i.bootstrap_port, i.bootstrap_room) for i in items}

    def begin_drain(self) -> None:
        with self._lock:
            if not self._draining:
                looking_up = sum(self._looking_up.values())
                logger.info("draining: no new requests; %d in flight%s", len(self._pending),
                            f", {looking_up} waiting for a prefill look-up (refused)"
                            if looking_up else "")
            self._draining = True
        self.metrics.draining.set(1)

    def wait_drained(self, timeout: float) -> bool:
        """Wait until no request is live; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    # -- answers (engine thread) ------------------------------------------------------------

    def _on_prefill(self, resp: Response) -> None:
        pending = self._received(resp, "prefill")
        if pending is None:
            return
        if resp.reason == FailureReason.BOOTSTRAP_TIMEOUT:
            if self.config.role == "both":
                logger.warning("request %r failed: %s: the decode side had no free pages or "
                               "metadata slot for it in that time (more work queued than this "
                               "server ends within --bootstrap-timeout)", resp.rid, resp.detail)
            else:
                logger.warning("request %r failed: %s: no decode peer asked for bootstrap room "
                               "%d (a decode worker too busy to give it pages or a metadata "
                               "slot in that time, one that died, one this worker cannot pair "
                               "with (see its dropped control messages), or a client that sent "
                               "this worker alone its half)", resp.rid, resp.detail,
                               pending.item.bootstrap_room)
        if self.config.role == "both":
            pending.input_logprobs = resp.input_logprobs
            held, pending.held = pending.held, None
            if held is not None:  # the decode side answered first (it had the KV already)
                held = attrs.evolve(held, input_logprobs=resp.input_logprobs)
            elif not resp.ok:
                # The decode side cannot get this request's KV any more.
                pending.prefill_failure = resp
                assert self.decode is not None
                self.decode.abort(resp.rid, peer=resp.refusal())
            self._done(pending, "prefill", held)
            return
        ok = resp.ok
        first = () if resp.first_token is None else (resp.first_token,)
        kind, status = _refused_or(resp.http_status, None if ok else resp.detail)
        self._done(pending, "prefill", Answer(
            rid=resp.rid,
            status=status,
            output_ids=first if ok else (),
            finish_reason="length" if ok else "abort",
            message=resp.detail,
            reason=resp.reason,
            prompt_tokens=resp.prompt_tokens,
            e2e_latency=time.monotonic() - pending.started,
            cached_tokens=resp.cached_tokens,
            input_logprobs=resp.input_logprobs if ok else (),
            output_logprobs=(resp.output_logprob,) if ok and resp.output_logprob else (),
            kind=kind,
        ))

    def _on_decode(self, resp: DecodeResponse) -> None:
        pending = self._received(resp, "decode")
        if pending is None:
            return
        status, reason, message = resp.http_status, resp.reason, resp.detail
        failed = pending.prefill_failure
        if failed is not None and not resp.ok:
            status, reason, message = failed.http_status, failed.reason, failed.detail
        kind, status = _refused_or(status, None if resp.ok else message)
        answer = Answer(
            rid=resp.rid,
            status=status,
            output_ids=resp.output_ids,
            finish_reason=resp.finish_reason,
            message=message,
            reason=reason,
            prompt_tokens=resp.prompt_tokens,
            e2e_latency=time.monotonic() - pending.started,
            cached_tokens=resp.cached_tokens,
            input_logprobs=pending.input_logprobs,
            output_logprobs=resp.output_logprobs,
            matched_stop=self._matched_stop(resp),
            kind=kind,
        )
        if self.config.role == "both" and "prefill" in pending.waiting_on:
            # A short answer can end before the prefill side's answer is read: it brings the
            # input logprobs, and the answer waits for them (engine thread: no race).
            pending.held = answer
            self._done(pending, "decode", None)
            return
        self._done(pending, "decode", answer)

    def _matched_stop(self, resp: DecodeResponse) -> int | str | None:
        """The stop token or string that ended ``resp``: the decode side's, or an EOS (a
        completed grammar that ended on another token matched none)."""
        ids = resp.output_ids
        if resp.matched_stop is None and resp.finish_reason == "stop" and ids and (
                ids[-1] in self.config.eos_token_ids):
            return ids[-1]
        return resp.matched_stop

    def _received(self, resp: Response | DecodeResponse, side: str) -> Pending | None:
        """The request ``side`` answered with ``resp`` (kept for its trace when tracing), or
        None when it is not waiting on that side."""
        with self._lock:
            pending = self._pending.get(resp.rid)
        if pending is None or side not in pending.waiting_on:
            logger.warning("%s answered request %r, which is not waiting on it", side, resp.rid)
            return None
        if self.tracer is not None:
            pending.answers.append(resp)
        return pending

    def _done(self, pending: Pending, side: str, answer: Answer | None) -> None:
        if answer is not None:
            if answer.reason is FailureReason.INTERNAL:  # the server's fault: say it here
                logger.error("request %r failed on the %s side (500 internal): %s",
                             pending.item.rid, side, answer.message)
            if pending.item.options.prompt_only and answer.status == 200:
                answer = attrs.evolve(answer, output_ids=(), output_logprobs=(),
                                      finish_reason="length", matched_stop=None)
            why = self._abort_reasons.get(pending.item.rid)  # one lookup: atomic
            if why is not None and answer.finish_reason == "abort":
                answer = attrs.evolve(answer, message=why, status=503, kind="draining")
            pending.resolve(answer)
        item = pending.item
        with self._lock:
            pending.waiting_on.discard(side)
            if pending.waiting_on or self._pending.get(item.rid) is not pending:
                return  # the other side's answer is to come, or a failed loop answered it
            del self._pending[item.rid]
            self._forget_spawned(pending)
            self._abort_reasons.pop(item.rid, None)
            self._queue.ended(0 if self._replicas is None
                              else dp_rank_of(item.bootstrap_room, self.config.dp_size))
            self._streams.pop(item.rid, None)
            self._idle.notify_all()
        if self.tracer is not None:
            self.tracer.finished(pending)
        if item.fake and self.decode_kv is not None:
            self.decode_kv.fake.forget(item.bootstrap_room)

    def _on_crash(self, exc: BaseException) -> None:
        reason = f"the prefill server's engine failed: {exc}"
        if self.bootstrap is not None:  # decode peers count this prefill lost (not stopped)
            self.bootstrap.mark_unhealthy(reason)
        self.metrics.healthy.set(0)
        self._answer_all(500, FailureReason.INTERNAL,
                         f"internal error: the engine loop failed ({type(exc).__name__}: {exc})")
        # Then, where the KV manager makes sure its writes stopped and no other rank writes,
        # decode peers are told so (they let its rooms go at once).
        self.engines.stop_writes(reason)

    def _answer_all(self, status: int, reason: FailureReason, message: str) -> None:
        """Answer every live request ``status`` (the loop that steps them has ended)."""
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
            self._spawned.clear()
            self._streams.clear()
            self._idle.notify_all()
        # Every live request is answered below: none is live in the ended engines any more,
        # whatever state their last pass left it in.
        self.snapshot = {**self.snapshot, "requests": {
            side: dict.fromkeys(states, 0)
            for side, states in self.snapshot.get("requests", {}).items()}}
        for p in pending:
            p.resolve(Answer(
                rid=p.item.rid, status=status, output_ids=(), finish_reason="abort",
                message=message, reason=reason,
                prompt_tokens=len(p.item.input_ids), e2e_latency=time.monotonic() - p.started,
            ))

    def _replica_running(self, replica: int, running: int) -> None:
        with self._lock:
            self._queue.replica_published(replica, running)

    # -- per pass (engine thread) -----------------------------------------------------------

    def _after_pass(self) -> None:
        self._follow_streams()
        snapshot = self.engines.snapshot()
        with self._lock:
            self._queue.published(snapshot["requests"])
        self.snapshot = snapshot

    def _follow_streams(self) -> None:
        """Push each streamed request's new tokens (after a pass, and within one as soon as
        the decode side received first tokens)."""
        if not self._streams or self.decode is None:
            return
        with self._lock:
            streams = list(self._streams.values())
        for p in streams:
            req = self.decode.lifecycle.get(p.item.rid)
            if req is not None and p.due(len(req.output_ids)):
                p.follow(req.output_ids, self.decode.output_logprobs(req.rid)
                         if req.sampling.return_logprob else None, req.cached_tokens)


def _refused_or(status: int, failure: str | None) -> tuple[str | None, int]:
    """The error type and status of a failure the peer's refusal caused and the client can act
    on (what the peer's client got), else no type and ``status``."""
    refused = None if failure is None else refused_for_the_client(failure)
    return (None, status) if refused is None else refused
