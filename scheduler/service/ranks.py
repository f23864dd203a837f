"""Prefill ranks as processes: ``pdlife serve --role prefill --tp-size T --pp-size P --dp-size D``.

Theory of operation
-------------------
A prefill server is ``D`` data-parallel replicas, each a mesh of ``T x P`` ranks running its
own scheduler (SGLang's DP ranks). The ``pdlife serve`` process is the launcher and the first
rank of replica 0: stage 0, TP rank 0, behind the HTTP front (as SGLang's launcher starts its
scheduler processes and keeps the HTTP server). :class:`Ranks` spawns every other rank as a
process (``spawn``, so none inherits the launcher's threads); the ranks of each replica join a
gloo process group of their own (through a store file, over loopback:
:mod:`scheduler.dist.rendezvous`) and build the mesh and the scheduler's groups
(:func:`scheduler.prefill.mesh.build_mesh_control`).

Every rank builds the same scheduler over its own shard
(:class:`~scheduler.model.sharded.ShardedLlama`: its KV heads of its stage's layers), its own
pool and its own KV backend, from the same :class:`~scheduler.service.config.ServeConfig`, and
registers its place (TP, PP and DP rank) at the one bootstrap endpoint rank 0 runs. Within a
replica, each pass opens with the relay's broadcast from the replica's first rank
(:mod:`scheduler.dist.relay`), so the other ranks run its passes in lockstep and, while it is
idle, wait in that broadcast (for at most :data:`MESH_TIMEOUT`, gloo's limit on one
collective).

Requests reach a replica as SGLang routes them: by ``bootstrap_room % D``, the replica the
decode side contacts for that room (:func:`kv.routes.dp_rank_of`). Replica 0's requests go to
rank 0's scheduler, stepped by the service's engine loop; another replica's first rank takes
its requests off a queue from the launcher (:func:`_lead`) and puts its answers on a queue
the launcher reads (:meth:`Ranks.answer_to`). Aborts go to every replica (an abort of a
request a replica does not hold is ignored). A decode peer's refusal of a room (``POST
/refusal`` at rank 0's bootstrap endpoint) goes to the replica of the room
(:meth:`Ranks.refuse`): replica 0's to rank 0's manager, another's over the queue to its first
rank's; the replica's other ranks fail the request with it through the agreements.

Every replica's first rank answers rank 0's scrapes of its metrics over a pipe of its own,
from a thread beside its scheduler's loop, so that ``/metrics`` and ``/server_info`` cover every
replica (:mod:`scheduler.service.metrics`; :meth:`Ranks.delay` puts them on rank 0's registry).

With ``--enable-prefill-delayer``, the replicas' first ranks also join one gloo group of their
own, over which every pass's PrefillDelayer gathers (:mod:`scheduler.prefill.replica_delayer`;
a replica's other ranks receive its first rank's rows): the replicas step in rank 0's
lockstep, waiting in that gather instead of on their inbox, and rank 0 stops that group first
on shutdown.

Start: rank 0 builds its engines (with Mooncake: the bootstrap endpoint for all ``D*T*P``
ranks), then :meth:`Ranks.started` lets every other rank build and register. Shutdown:
:meth:`Ranks.stop_writes` (after rank 0's engine loop stopped and its KV manager closed, before
its bootstrap endpoint closes: :meth:`scheduler.service.engines.Engines.close`) stops every
replica: its first rank's relay stops its mesh, so every rank's next pass raises
:class:`~scheduler.dist.relay.MeshStopped`, and each closes its backends, puts its KV manager's
word on whether its writes stopped on the answers queue
(:attr:`kv.mooncake.MooncakeKVManager.writes_stopped`) and exits 0. A rank process confirms
that its writes stopped only with that word, and an exit 0: one killed (past
:data:`JOIN_TIMEOUT_S`, or because another failed), failed or silent does not (it cannot say
whether its writes concluded: a killed transfer worker may have been mid-write, and the part it
had handed to its kernel is still delivered into decode pages after it is gone).
Rank 0 tells decode peers at its endpoint that the server's writes stopped only where every rank
confirmed it (:class:`~scheduler.service.engines.RanksStopped`); decode then lets the rooms no
``Status`` answered go at once, else at its release bound. :meth:`Ranks.close` then lets the
rest go (stopping the ranks first where :meth:`Ranks.stop_writes` did not run). The rank
processes ignore SIGINT and SIGTERM (a Ctrl-C reaches the whole process group): rank 0 alone
drains and decides when they stop. A rank that fails breaks the next collective of its
replica, whose ranks then fail and exit too; rank 0 watches every rank process
(:func:`watch_ranks`), so one that ends, idle or not, fails rank 0's engine loop and the
service reports it (unhealthy; ``pdlife serve`` exits 1 once stopped).
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import gc
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessContext, start_processes

from kv.mooncake import MooncakeKVManager, WritesStopped
from kv.routes import dp_rank_of
from scheduler.assemble import Closers, build_prefill, close_all, constraint_compiler
from scheduler.dist import rendezvous
from scheduler.dist.relay import MeshStopped
from scheduler.malloc_arena import give_back_freed
from scheduler.messages import AbortRequest, CacheFlushed, FlushCache, NewRequest, Response
from scheduler.model.select import ServedModel, load_model, reference_model
from scheduler.model.sharded import Mesh
from scheduler.prefill.mesh import MeshControl, build_mesh_control
from scheduler.prefill.replica_delayer import (
    MeshFollower,
    ReplicaGather,
    counts_of,
    delay,
    named_counts,
)
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.service import logs
from scheduler.service.config import ServeConfig
from scheduler.service.engines import RanksStopped, prefill_dropped_messages
from scheduler.service.metrics import (
    DroppedMessagesCollector,
    ReplicaMetrics,
    ReplicaScrapes,
    answer_scrapes,
)
from scheduler.service.shedding import holding_pages
from scheduler.stepping import step_or_rest

logger = logging.getLogger(__name__)

#: How long one collective of the scheduler's agreements may wait: the longest a mesh may sit
#: idle.
MESH_TIMEOUT = timedelta(days=7)
#: How long joining the ranks, and one collective of a forward, may take: a rank that never
#: starts fails the launch after this.
START_TIMEOUT = timedelta(minutes=5)
#: How long the launcher waits for the other ranks to exit once it stopped the mesh.
JOIN_TIMEOUT_S = 30.0


def _join(rank: int, world: int, store: str, config: ServeConfig) -> MeshControl:
    rendezvous.join(store, rank, world, START_TIMEOUT)
    control = build_mesh_control(config.tp_size, config.pp_size, timeout=MESH_TIMEOUT)
    assert control is not None  # the mesh holds every rank of this group
    return control


# What the launcher puts on a replica's queue besides requests, aborts and refusals.
_STARTED, _STOP = "started", "stop"


@attrs.frozen
class _Flushed:
    """A replica's answer to a cache flush (on the answers queue)."""

    ticket: int
    outcome: CacheFlushed


@attrs.frozen
class _Running:
    """How many requests hold KV pages on replica ``replica`` after its last pass (on the
    answers queue, after the answers of that pass: the queue bound counts them as running)."""

    replica: int
    running: int


@attrs.frozen
class _Stopped:
    """Rank process ``process`` (its position among them: replica-major, rank 0 not one)
    closed its backends; ``writes``: its KV manager's word that none of its writes can land any
    more, or None (it could not make sure of it, or had no Mooncake manager). On the answers
    queue, the last thing a rank process puts there."""

    process: int
    writes: WritesStopped | None


@attrs.frozen
class _Refusal:
    """A decode peer will never ask for ``room`` (for the replica that serves it); ``own``:
    this server refused it, and the replica's manager answers decode's destination with that."""

    room: int
    reason: str
    own: bool = False


class Ranks:
    """The launcher's side: rank 0's mesh control, the other ranks' processes, and the queues
    to and from the other replicas' first ranks."""

    def __init__(self, config: ServeConfig) -> None:
        self.world = config.tp_size * config.pp_size
        self.dp_size = config.dp_size
        # One store file per replica's mesh, and one for the delayer's group.
        self._store_files = rendezvous.StoreFiles()
        stores = [*map(self._store_files.path, (f"replica{r}" for r in range(self.dp_size))),
                  self._store_files.path("delayer")]
        self._delayer_store = stores[-1]
        self._delayer_config = config.prefill_delayer
        context = multiprocessing.get_context("spawn")
        self._inboxes: list[Any] = [context.Queue() for _ in range(self.dp_size - 1)]
        self._closing = threading.Event()
        self._answers: Any = context.Queue()
        self._reader: threading.Thread | None = None
        # Each rank process's word on its KV writes, by its position (set by the reader).
        self._stopped: dict[int, WritesStopped | None] = {}
        self._ranks_stopped = False  # stop_ranks ran
        self._flushes: dict[int, concurrent.futures.Future[CacheFlushed]] = {}
        self._tickets = itertools.count(1)
        # A pipe to each other replica's first rank, for its metrics (it keeps the other end).
        pipes = [context.Pipe() for _ in range(self.dp_size - 1)]
        self._scrapes = ReplicaScrapes([mine for mine, _ in pipes], self._replica_alive)
        theirs = [end for _, end in pipes]
        try:
            # torch's start_processes has no annotations.
            self._processes: ProcessContext = start_processes(  # type: ignore[no-untyped-call]
                _rank_main, args=(self.world, stores, *for_ranks(config), self._inboxes,
                                  self._answers, theirs),
                nprocs=self.world * self.dp_size - 1, join=False, start_method="spawn",
            )
        except BaseException:
            self._scrapes.close()
            raise
        finally:
            for end in theirs:  # the rank processes hold them now: a replica's end is its own
                end.close()
        try:
            self.control = _join(0, self.world, stores[0], config)
        except BaseException:
            self._kill()
            self._scrapes.close()
            self._store_files.remove()
            raise
        self.delayer = (None if config.prefill_delayer is None else ReplicaGather(
            0, self.dp_size, config.prefill_delayer, _mesh_of(self.control)))
        logger.info("prefill: DP %d x TP %d x PP %d, rank processes beside this one: %d",
                    self.dp_size, config.tp_size, config.pp_size,
                    self.world * self.dp_size - 1)

    def started(self) -> None:
        """Rank 0's engines are built (with Mooncake: its bootstrap endpoint is up): every
        other rank builds its own and registers. Once, before rank 0's first pass."""
        for inbox in self._inboxes:
            inbox.put(_STARTED)
        self.control.relay.exchange([])

    def delay(self, scheduler: PrefillScheduler) -> None:
        """Rank 0's ``scheduler`` is replica 0's (after :meth:`started`, before its first
        pass): its registry gets the other replicas' metrics (:class:`ReplicaMetrics`, for
        ``/metrics`` and ``/server_info``), and with the delayer on it joins the replicas'
        delayer group and gets its delayer."""
        if self.delayer is not None and self._delayer_config is not None:
            self.delayer.connect(self._delayer_store, START_TIMEOUT, MESH_TIMEOUT)
            self.delayer.serve(scheduler, self._delayer_config)
        if self.dp_size > 1:
            scheduler.metrics.registry.register(ReplicaMetrics(self._scrapes.ask))

    # -- the replicas (thread-safe) ---------------------------------------------------------

    def submit(self, new: NewRequest) -> bool:
        """Hand ``new`` to its replica (``bootstrap_room % dp_size``); False when that is
        replica 0, whose scheduler is rank 0's own."""
        replica = new.bootstrap_room % self.dp_size
        if replica == 0:
            return False
        if self.delayer is not None:
            self.delayer.routed[replica] += 1  # before it is there to take
        self._inboxes[replica - 1].put(new)
        return True

    def abort(self, rid: str, *, shutdown: bool = False) -> None:
        """Abort ``rid`` on the other replicas (those that do not hold it ignore it)."""
        for inbox in self._inboxes:
            inbox.put(AbortRequest(rid, shutdown))

    def refuse(self, room: int, reason: str) -> None:
        """A decode peer refused ``room`` (a bootstrap refusal listener): tell the replica
        that serves it, unless that is replica 0 (rank 0's manager listens itself)."""
        replica = dp_rank_of(room, self.dp_size)
        if replica:
            self._inboxes[replica - 1].put(_Refusal(room, reason))

    def refuse_room(self, room: int, reason: str) -> bool:
        """This server refused a request of ``room`` before any engine saw it: the replica
        that serves the room answers decode's destination with the refusal. False when that
        is replica 0, rank 0's own."""
        replica = dp_rank_of(room, self.dp_size)
        if replica:
            self._inboxes[replica - 1].put(_Refusal(room, reason, own=True))
        return bool(replica)

    def flush_cache(self) -> list[concurrent.futures.Future[CacheFlushed]]:
        """Ask every other replica to empty its prefix cache: one outcome each (set by the
        reader thread of :meth:`answer_to`)."""
        outcomes = []
        for inbox in self._inboxes:
            ticket = next(self._tickets)
            outcome: concurrent.futures.Future[CacheFlushed] = concurrent.futures.Future()
            self._flushes[ticket] = outcome
            inbox.put(FlushCache(ticket))
            outcomes.append(outcome)
        return outcomes

    def answer_to(self, callback: Callable[[Response], None],
                  running: Callable[[int, int], None]) -> None:
        """Hand every answer of the other replicas to ``callback``, and each replica's count of
        requests holding KV pages, as it changes, to ``running(replica, count)`` (both on a
        reader thread, in the order the replica sent them)."""
        if self._inboxes:
            self._start_reader(callback, running)

    def _start_reader(self, callback: Callable[[Response], None],
                      running: Callable[[int, int], None]) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, args=(callback, running),
                                            name="pdlife-replicas", daemon=True)
            self._reader.start()

    def _read(self, callback: Callable[[Response], None],
              running: Callable[[int, int], None]) -> None:
        while (answer := self._answers.get()) is not None:
            if isinstance(answer, _Stopped):
                self._stopped[answer.process] = answer.writes
                continue
            if isinstance(answer, _Flushed):
                flushed = self._flushes.pop(answer.ticket, None)
                if flushed is not None:
                    flushed.set_result(answer.outcome)
                continue
            if isinstance(answer, _Running):
                running(answer.replica, answer.running)
                continue
            try:
                callback(answer)
            except Exception:  # one bad answer must not stop the others'
                logger.exception("handling a replica's answer failed")

    def _replica_alive(self, replica: int) -> bool:
        """Whether the process of replica ``replica``'s first rank (not 0) still runs."""
        processes = self._processes.processes
        index = replica * self.world - 1  # rank processes are replica-major, rank 0 not one
        return index < len(processes) and processes[index].is_alive()

    # -- shutdown ---------------------------------------------------------------------------

    def watch(self, on_exit: Callable[[BaseException], None]) -> None:
        """``on_exit`` when a rank process ends before :meth:`close` (:func:`watch_ranks`)."""
        watch_ranks(self._processes, "prefill", self._closing, on_exit)

    def stop_writes(self) -> RanksStopped:
        """Stop every replica (rank 0's engine loop must have stopped) and wait for the
        ranks; which rank processes confirmed that none of their KV writes can land any more
        (each said so once its backends closed, and exited 0), and why each other did not."""
        self._stop_ranks()
        self._end_reader()
        confirmed: list[WritesStopped] = []
        unconfirmed: list[str] = []
        for index, process in enumerate(self._processes.processes):
            replica, rank = divmod(index + 1, self.world)
            name = f"dp{replica}/rank{rank} (pid {process.pid})"
            code = process.exitcode
            word = self._stopped.get(index)
            if code != 0:
                unconfirmed.append(f"{name} " + ("still runs" if code is None else
                                                 f"ended by signal {-code}" if code < 0 else
                                                 f"exited with code {code}"))
            elif word is None:
                unconfirmed.append(f"{name} " + ("could not make sure of its own" if index
                                                 in self._stopped else "said nothing of them"))
            else:
                confirmed.append(word)
        return RanksStopped(tuple(confirmed), tuple(unconfirmed))

    def close(self) -> None:
        """Stop every replica (rank 0's engine loop must have stopped), unless
        :meth:`stop_writes` did, wait for the ranks and let go what talks to them."""
        try:
            self._stop_ranks()
        finally:
            self._end_reader()
            dist.destroy_process_group()
            self._store_files.remove()
            self._scrapes.close()
            self._release_queues()

    def _stop_ranks(self) -> None:
        if not self._ranks_stopped:
            # Each rank's last word comes on the answers queue: read it (a server of one
            # replica has no reader yet), or a rank's exit would wait on a full pipe.
            self._start_reader(_no_answer, _no_running)
            self._ranks_stopped = True
            self._closing.set()
            stop_ranks(self._processes, self._stop, "prefill")

    def _end_reader(self) -> None:
        """Stop the answers' reader once it read what came before (the rank processes have
        exited, so what they put is there)."""
        if self._answers is not None:
            self._answers.put(None)
        if self._reader is not None:
            self._reader.join(timeout=JOIN_TIMEOUT_S)

    def _release_queues(self) -> None:
        """Let the queues go now. Their locks are named semaphores that multiprocessing's
        resource tracker watches; they are unlinked when the queues are collected, and
        ``pdlife serve`` ends with ``os._exit``, which collects nothing, so the tracker
        warned of "leaked semaphore objects" at every exit. The rank processes' arguments
        hold the queues too."""
        for q in [*self._inboxes, self._answers]:
            q.close()
            q.join_thread()
        self._inboxes, self._answers = [], None
        self._processes.processes.clear()
        gc.collect()

    def _stop(self) -> None:
        if self.delayer is not None and self.delayer.connected:
            # First: a replica that reads _STOP first would never join this last gather.
            self.delayer.stop()
            logger.info("prefill delayer outcomes of replica 0: %s (%d splits)",
                        named_counts(self.delayer.outcome_counts()), self.delayer.splits)
        for inbox in self._inboxes:
            inbox.put(_STOP)
        self.control.relay.stop()

    def _kill(self) -> None:
        kill_ranks(self._processes)


def _no_answer(answer: Response) -> None:
    raise AssertionError(f"an answer from a replica, of a server of one: {answer}")


def _no_running(replica: int, running: int) -> None:
    raise AssertionError(f"replica {replica}'s count, of a server of one replica: {running}")


class RankExited(RuntimeError):
    """A rank process ended while its server was serving."""


def watch_ranks(processes: ProcessContext, what: str, closing: threading.Event,
                on_exit: Callable[[BaseException], None]) -> None:
    """Call ``on_exit`` (on a thread of this function's) when one of the rank ``processes`` of
    a ``what`` server ends before ``closing`` is set: an idle rank 0 runs no collective that
    would fail, and would look healthy with a rank gone."""
    sentinels = {p.sentinel: p for p in processes.processes}

    def watch() -> None:
        (ended, *_) = multiprocessing.connection.wait(list(sentinels))
        if closing.is_set():
            return
        process = sentinels[ended]
        process.join(JOIN_TIMEOUT_S)
        message = (f"a {what} rank process (pid {process.pid}) exited with code "
                   f"{process.exitcode}; its mesh cannot serve")
        logger.critical("%s", message)
        on_exit(RankExited(message))

    threading.Thread(target=watch, name=f"pdlife-{what}-ranks", daemon=True).start()


def stop_ranks(processes: ProcessContext, stop: Callable[[], None], what: str) -> None:
    """``stop()`` the rank ``processes`` of a ``what`` server and wait for them to exit; kill
    them past :data:`JOIN_TIMEOUT_S`, or at once when one failed."""
    try:
        stop()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        # join() returns as each rank exits; True once every one has.
        while not processes.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() < deadline:
                continue
            logger.error("%s ranks still running %g s after the stop; killing them", what,
                         JOIN_TIMEOUT_S)
            kill_ranks(processes)
            break
    except Exception as exc:  # a rank that died: report it, stop the rest
        logger.error("a %s rank failed: %s", what, exc)
        kill_ranks(processes)


def kill_ranks(processes: ProcessContext) -> None:
    for process in processes.processes:
        if process.is_alive():
            process.kill()


def for_ranks(config: ServeConfig) -> tuple[ServeConfig, tuple[str, str] | None]:
    """What a rank process is given: ``config`` without its loaded checkpoint, and where the
    rank loads it again from (None: the reference model, which ``config.model`` shapes)."""
    if config.served is None:
        return config, None
    # Not evolve: without its checkpoint the config would be checked against the reference
    # model's shape. The copy only crosses to the rank, which puts the checkpoint back.
    bare = copy.copy(config)
    object.__setattr__(bare, "served", None)
    return bare, config.served.source


def in_rank(config: ServeConfig, source: tuple[str, str] | None, mesh: Mesh) -> ServeConfig:
    """A rank process's config: with the checkpoint of ``source`` loaded again, as this rank's
    part of it on ``mesh`` (the whole model is never built in a rank process)."""
    if source is None:
        return config
    name, dtype = source
    served = load_model(name, dtype=dtype, device=config.device, mesh=mesh)
    served.release_checkpoint()  # built as this rank's part: nothing more is built from it
    give_back_freed()
    return attrs.evolve(config, served=served)


def served_by(config: ServeConfig) -> ServedModel:
    """The model ``config`` serves: its loaded checkpoint or the reference model."""
    if config.served is not None:
        served: ServedModel = config.served
        return served
    return reference_model(config.model, device=config.device)


def _rank_main(index: int, world: int, stores: Sequence[str], config: ServeConfig,
               source: tuple[str, str] | None, inboxes: Sequence[Any], answers: Any,
               metrics_ends: Sequence[multiprocessing.connection.Connection]) -> None:
    """The rank process at position ``index + 1`` (replica-major): the first rank of a
    replica leads it (:func:`_lead`), any other follows its replica's first rank. Every rank
    process is given every replica's end of its metrics pipe: each keeps its own, if any."""
    replica, rank = divmod(index + 1, world)
    metrics_end = metrics_ends[replica - 1] if rank == 0 else None
    for end in metrics_ends:
        if end is not metrics_end:  # another's: its replica's EOF must not wait for this one
            end.close()
    # Rank 0 stops every rank when its drain ends; a Ctrl-C or SIGTERM to the whole process
    # group must not end this one first, under rank 0's drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.configure(config.log, process=f"dp{replica}/rank{rank}")
    control = _join(rank, world, stores[replica], config)
    closers: Closers = []
    built: list[PrefillScheduler] = []  # this rank's scheduler, once built
    outcomes: Counter[str] | None = None  # a follower's delayer outcomes
    try:
        config = in_rank(config, source, control.mesh)
        if metrics_end is not None:
            _lead(control, config, replica, stores[-1], inboxes[replica - 1], answers,
                  metrics_end, closers, built)
        else:
            control.relay.exchange([])  # the replica's first rank says: build
            scheduler = _build(control, config, replica, closers, None, built)
            if config.prefill_delayer is not None:  # decide as the replica's first rank
                follower = MeshFollower(control.group, control.relay.src, config.dp_size,
                                        config.prefill_delayer)
                outcomes = delay(scheduler, follower, config.dp_size,
                                 config.prefill_delayer).outcomes
            while True:
                step_or_rest(scheduler.step)
    except MeshStopped:  # the replica's first rank stopped it
        if outcomes is not None:
            logger.info("prefill delayer outcomes of replica %d rank %d: %s", replica, rank,
                        named_counts(counts_of(outcomes)))
    except BaseException:
        # torch's spawn hands the traceback to a join that comes only at shutdown: say it now.
        logger.critical("prefill rank %d of replica %d failed", rank, replica, exc_info=True)
        raise
    finally:
        for exc in close_all(closers):
            logger.error("closing a backend failed", exc_info=exc)
        # Once its KV manager closed: whether its writes stopped, for rank 0 to tell decode.
        kv = built[0].kv if built else None
        answers.put(_Stopped(index, kv.writes_stopped
                             if isinstance(kv, MooncakeKVManager) else None))
        dist.destroy_process_group()


def _lead(control: MeshControl, config: ServeConfig, replica: int, delayer_store: str,
          inbox: Any, answers: Any, metrics_end: multiprocessing.connection.Connection,
          closers: Closers, built: list[PrefillScheduler]) -> None:
    """The first rank of replica ``replica`` (not 0): its scheduler takes the launcher's
    requests off ``inbox`` and puts its answers on ``answers``; its metrics go to the
    launcher's scrapes on ``metrics_end``."""
    delayer: ReplicaGather | None = None
    stopped = False
    published = 0  # the count of requests holding pages the launcher last heard of
    try:
        if inbox.get() != _STARTED:
            return  # stopped before it started
        control.relay.exchange([])  # the other ranks of this replica build now
        if config.prefill_delayer is not None:
            delayer = ReplicaGather(replica, config.dp_size, config.prefill_delayer,
                                    _mesh_of(control))
            delayer.connect(delayer_store, START_TIMEOUT, MESH_TIMEOUT)
        scheduler = _build(control, config, replica, closers, answers.put, built)
        if delayer is not None and config.prefill_delayer is not None:
            delayer.serve(scheduler, config.prefill_delayer)
        registry = scheduler.metrics.registry
        # Its manager's, as rank 0 exports replica 0's.
        registry.register(DroppedMessagesCollector(
            functools.partial(prefill_dropped_messages, scheduler)))
        answer_scrapes(metrics_end, registry, replica)
        while True:
            # Idle: wait for the launcher; otherwise take what is there and run a pass. With
            # the delayer every pass waits in its gather for rank 0's instead.
            items = [inbox.get()] if scheduler.idle() and delayer is None else []
            while True:
                try:
                    items.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item == _STOP:
                    return
                if isinstance(item, AbortRequest):
                    scheduler.abort(item.rid)
                elif isinstance(item, NewRequest):
                    scheduler.submit(item)
                    if delayer is not None:
                        delayer.taken += 1
                elif isinstance(item, FlushCache):
                    scheduler.flush_cache(functools.partial(_answer_flush, answers, item.ticket))
                elif isinstance(item, _Refusal) and isinstance(scheduler.kv, MooncakeKVManager):
                    if item.own:
                        scheduler.kv.refuse(item.room, item.reason)
                        # This replica answers decode with the refusal: its count, as for
                        # the rooms its own scheduler refuses.
                        scheduler.metrics.peer_refusals.labels(direction="sent").inc()
                    else:
                        scheduler.kv.peer_refused(item.room, item.reason)
            step_or_rest(scheduler.step)
            running = holding_pages(scheduler)
            if running != published:  # after the pass's answers, on the same queue
                answers.put(_Running(replica, running))
                published = running
    except MeshStopped:  # from the delayer's gather: this replica's other ranks stopped too
        stopped = True
        if delayer is not None:
            logger.info("prefill delayer outcomes of replica %d: %s", replica,
                        named_counts(delayer.outcome_counts()))
        raise
    except Exception:
        logger.critical("prefill replica %d failed; its requests are not answered", replica,
                        exc_info=True)
        raise
    finally:
        if not stopped:
            control.relay.stop()


def _answer_flush(answers: Any, ticket: int, outcome: CacheFlushed) -> None:
    answers.put(_Flushed(ticket, outcome))


def _mesh_of(control: MeshControl) -> tuple[Any, int] | None:
    """A replica's group and first rank, for its delayer's table (None: a replica of one)."""
    if control.mesh.tp_size * control.mesh.pp_size == 1:
        return None
    return control.group, control.relay.src


def _build(control: MeshControl, config: ServeConfig, replica: int, closers: Closers,
           on_response: Callable[[Response], None] | None,
           built: list[PrefillScheduler]) -> PrefillScheduler:
    """This rank's scheduler, as rank 0 builds its own (registered at rank 0's endpoint),
    also put on ``built``."""
    served, shape = served_by(config), config.model_shape
    scheduler = build_prefill(
        served.shard(control.mesh, config.device), backend=config.backend,
        config=config.scheduler, pages=config.pool_pages, metadata_slots=config.metadata_slots,
        runner_factory=served.runner, closers=closers, kv_layout=config.kv_layout,
        overlap=config.overlap, compiler=constraint_compiler(served), mooncake=config.mooncake,
        bootstrap_addr=f"{config.bootstrap_host}:{config.bootstrap_port}",
        place=control.rank_place(num_layers=shape.layers, kv_heads=shape.kv_heads,
                                 dp_rank=replica, dp_size=config.dp_size),
        on_response=on_response, eos_token_id=served.eos_token_ids,
        **control.scheduler_options(),
    )
    built.append(scheduler)
    return scheduler
