"""The engines of one ``pdlife serve`` role and the backends under them: built, observed, closed.

:class:`Engines` builds what :class:`~scheduler.service.config.ServeConfig` asks for through
:mod:`scheduler.assemble`:

- ``prefill``: a :class:`~scheduler.prefill.PrefillScheduler` whose KV manager is the chosen
  backend's (Mooncake: it also runs the bootstrap endpoint and registers its rank there); a fake
  manager serves requests for the fake bootstrap host ``2.2.2.2``.
- ``decode``: a :class:`~scheduler.decode.DecodePeer` over a
  :class:`~scheduler.decode.router.DecodeKVRouter` (one Mooncake manager per prefill server).
  On a decode TP group every rank registers the prompt of each relayed fake-host request with
  its fake prefill, as rank 0's front does, and forgets it when its peer answers the request,
  however it ended.
- ``both`` (the ``local`` backend): both engines, the local backend copying pages from one pool
  to the other.

A Mooncake prefill server tells decode peers at its bootstrap endpoint when its KV writes stopped,
so a decode peer lets the pages it holds for the server go at its next health check rather than
at its release bound: on close, once every rank behind the endpoint confirmed it, and where this
process is the one rank, also once its engine failed (:meth:`Engines.stop_writes`). A rank
confirms once its KV manager closed with every transfer worker ended and its engines destroyed
(:attr:`kv.mooncake.MooncakeKVManager.writes_stopped`). With rank processes or DP replicas, the
caller of :meth:`Engines.close` hands it what stops them (``others``,
:meth:`scheduler.service.ranks.Ranks.stop_writes`): it runs after this process's KV manager
closed and before the endpoint closes, and the endpoint says that the writes stopped only where
each rank process confirmed it (:class:`RanksStopped`: none killed, failed or silent) and every
rank registered there is among them. On close the endpoint then stays up, at most
``MooncakeConfig.writes_stopped_wait_s`` (bounded by the heartbeat interval of each peer
concerned), until each decode rank left holding pages for a destination no ``Status`` of any
rank answered has read it; a close that left none waits for nothing. A failed engine with other
ranks says nothing more at once (they may still write); its server's close says it where they
all confirm. Nor is it said where a manager could not make sure of its own writes (a transfer
worker still running).

It also reads what the service publishes about them: request counts and pool occupancy after
every pass (:meth:`Engines.snapshot`, engine thread), peers refused for their token, control
messages dropped. The engines' answers go to the callbacks the caller gives; what a request
becomes once answered is the caller's (:class:`~scheduler.service.core.Service`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kv.bootstrap import BootstrapServer
from kv.listeners import ExposureCheck
from kv.local import LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager, WritesStopped
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import PeerAuthError
from kv.pool import KVPool
from kv.rank_table import RankPlace
from kv.refusal import RefusalPoster
from kv.state_pools import StatePools
from kv.wire import DroppedMessages
from scheduler.assemble import (
    Closers,
    RunnerFactory,
    build_decode,
    build_prefill,
    close_all,
)
from scheduler.decode import DecodeConfig, DecodeMetrics, DecodePeer
from scheduler.decode.mesh import DecodeMeshControl, MeshDecodePeer
from scheduler.decode.router import DecodeKVRouter, LocalPrefillFake
from scheduler.messages import FAKE_BOOTSTRAP_HOST, DecodeResponse, NewRequest, Response
from scheduler.prefill.mesh import MeshOptions
from scheduler.prefill.prefix import PrefixCache
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ModelRunner
from scheduler.sample.constraint import ConstraintCompiler
from scheduler.sample.request import Detokenize
from scheduler.service.config import ServeConfig

logger = logging.getLogger(__name__)

#: Why a prefill server's bootstrap endpoint answers unhealthy as it closes.
SHUT_DOWN = "the prefill server shut down"
#: Seconds added to a decode rank's heartbeat interval for its next health check to come and
#: be answered.
_READ_MARGIN_S = 1.0


@attrs.frozen
class RanksStopped:
    """What a prefill server's other rank processes said of their KV writes as they stopped
    (:meth:`scheduler.service.ranks.Ranks.stop_writes`)."""

    #: The word of each rank process that confirmed that none of its writes can land any more.
    confirmed: tuple[WritesStopped, ...]
    #: Each rank process that did not, and why (empty: every one confirmed).
    unconfirmed: tuple[str, ...]


def _unanswered_of(words: Sequence[WritesStopped]) -> dict[str, float]:
    """The decode sessions that any of ``words`` left holding pages for an unanswered
    destination, each with its heartbeat interval (0, not known, where any rank knew none)."""
    unanswered: dict[str, float] = {}
    for word in words:
        for session, interval in word.unanswered.items():
            known = unanswered.setdefault(session, interval)
            if known and (not interval or interval > known):
                unanswered[session] = interval
    return unanswered


def pool_view(pool: KVPool, prefix: PrefixCache | None = None) -> dict[str, int]:
    """Occupancy as a new request sees it: prefix-cache pages nobody locks count as free
    (eviction frees them on demand); ``prefix_cache_pages`` is the cache's size."""
    evictable = 0 if prefix is None else prefix.tree.evictable
    view = {"free_pages": pool.allocator.available() + evictable,
            "used_pages": pool.allocator.in_use() - evictable, "total_pages": pool.num_pages}
    if prefix is not None:
        view["prefix_cache_pages"] = prefix.tree.size
    return view


def prefill_dropped_messages(prefill: PrefillScheduler) -> Iterator[tuple[str, DroppedMessages]]:
    """The count of control messages ``prefill``'s KV manager dropped, as ``("prefill",
    count)`` (none for a backend that drops none: the fake and local ones)."""
    dropped = getattr(prefill.kv, "dropped_messages", None)
    if dropped is not None:
        yield "prefill", dropped


class Engines:
    """The prefill scheduler, the decode peer (or both) of ``config.role`` over ``model``, and
    everything that holds a thread, a socket or a port under them. A construction that fails
    half-way releases what it built."""

    def __init__(
        self,
        config: ServeConfig,
        model: Any,
        *,
        runner_factory: RunnerFactory,
        compiler: ConstraintCompiler | None,
        detokenize: Detokenize | None,
        on_prefill: Callable[[Response], None],
        on_decode: Callable[[DecodeResponse], None],
        prefill_options: MeshOptions | None = None,
        place: RankPlace | None = None,
        decode_mesh: DecodeMeshControl | None = None,
    ) -> None:
        """``prefill_options`` go to the prefill scheduler as they are and ``place`` to its
        Mooncake manager (rank 0 of a mesh: :mod:`scheduler.service.ranks`). ``decode_mesh``:
        this rank's place in a decode TP group (:mod:`scheduler.service.decode_ranks`)."""
        self.config = config
        self._decode_mesh = decode_mesh
        self._prefill_options: MeshOptions = prefill_options or {}
        self._place = place
        self.bootstrap: BootstrapServer | None = None
        self.prefill: PrefillScheduler | None = None
        self.decode: DecodePeer | None = None
        self.decode_kv: DecodeKVRouter | None = None
        self._closers: Closers = []
        # What stops the server's other rank processes as this one closes (:meth:`close`).
        self._others: Callable[[], RanksStopped] | None = None
        self._lock = threading.Lock()
        self._decode_auth_refused = 0  # prefill servers that refused this decode's peer token
        # On a decode mesh: the room of each relayed fake request whose prompt this rank
        # registered (:meth:`_expect_fake`), by request id, until the decode peer answers it
        # (engine thread only: the relay and the answers both come within a pass).
        self._relayed_fakes: dict[str, int] = {}
        # Warns if a transfer engine listens beyond the configured addresses (it binds all).
        self._exposure = ExposureCheck(config.bootstrap_host, config.mooncake.hostname)
        c = self.config
        hub = LocalTransferHub()
        try:
            if c.role in ("prefill", "both"):
                self.prefill = self._build_prefill(model, runner_factory, hub, compiler,
                                                   on_prefill)
            if c.role in ("decode", "both"):
                self.decode = build_decode(
                    model, kv_for=functools.partial(self._decode_router, hub, compiler),
                    page_size=c.scheduler.page_size, pages=c.pool_pages,
                    metadata_slots=c.metadata_slots, runner_factory=runner_factory,
                    closers=self._closers, kv_layout=c.kv_layout, eos_token_id=c.eos_token_ids,
                    config=DecodeConfig(max_running_requests=c.scheduler.max_running_requests,
                                        waiting_timeout=c.waiting_timeout),
                    on_response=on_decode if decode_mesh is None else functools.partial(
                        self._forget_relayed_fake, on_decode),
                    compiler=compiler, detokenize=detokenize,
                    # One registry for /metrics: the prefill scheduler's, when there is one.
                    metrics=DecodeMetrics(self.prefill.metrics.registry if self.prefill else None),
                    decode_mesh=decode_mesh,
                )
                if isinstance(self.decode, MeshDecodePeer):
                    self.decode.on_relayed = self._expect_fake
        except BaseException:
            self.close()
            raise

    def _build_prefill(self, model: Any, runner_factory: RunnerFactory, hub: LocalTransferHub,
                       compiler: ConstraintCompiler | None,
                       on_response: Callable[[Response], None]) -> PrefillScheduler:
        """The prefill scheduler, and with Mooncake its bootstrap endpoint (rank 0 registers
        there)."""
        c = self.config
        if c.backend == "mooncake":
            self.bootstrap = BootstrapServer(
                c.bootstrap_host, c.bootstrap_port, token=c.mooncake.token,
                expected_ranks=c.dp_size * c.tp_size * c.pp_size,
            )
            self._closers.append(self.bootstrap.close)
            # Closers run newest first: this one after the KV manager's, before the endpoint's.
            self._closers.append(self._shut_down_writes)
        prefill = build_prefill(
            model, backend=c.backend, config=c.scheduler, pages=c.pool_pages,
            metadata_slots=c.metadata_slots, runner_factory=runner_factory,
            closers=self._closers, hub=hub, bootstrap=self.bootstrap, mooncake=c.mooncake,
            place=self._place,
            kv_layout=c.kv_layout, on_response=on_response, overlap=c.overlap, compiler=compiler,
            eos_token_id=c.eos_token_ids, **self._prefill_options,
        )
        if self.bootstrap is not None:
            logger.info("bootstrap endpoint on %s; rank 0 registered", self.bootstrap.address)
            self._exposure()
        return prefill

    def _decode_router(
        self, hub: LocalTransferHub, compiler: ConstraintCompiler | None, pool: KVPool,
        meta: MetadataBuffers, runner: ModelRunner, states: StatePools | None,
    ) -> DecodeKVRouter:
        """Decode's KV layer: one Mooncake manager per prefill server a request names, the
        local hub's manager, and the fake prefill of fake-host requests (the service builds no
        state pools: it runs no hybrid or speculative model)."""
        if states is not None:
            raise AssertionError("pdlife serve builds no state pools")
        c = self.config
        fake = LocalPrefillFake(runner, meta, compiler, c.eos_token_ids)
        if c.backend == "mooncake":
            router = DecodeKVRouter(
                fake=fake,
                factory=lambda addr: self._mooncake_decode(pool, meta, addr),
                refusals=RefusalPoster(token=c.mooncake.token),
                connect_in_place=self._decode_mesh is not None,
                retire_lost_after_s=c.mooncake.retire_lost_after_s,
            )
        elif c.backend == "local":
            router = DecodeKVRouter(fake=fake, default=LocalDecodeManager(pool, meta, hub=hub))
        else:
            router = DecodeKVRouter(fake=fake)
        self.decode_kv = router
        return router

    def _expect_fake(self, new: NewRequest) -> None:
        """A decode TP rank registers a fake request's prompt as rank 0's front did; it is
        forgotten when the decode peer answers the request (:meth:`_forget_relayed_fake`)."""
        if (self.decode_kv is not None and new.bootstrap_host == FAKE_BOOTSTRAP_HOST
                and new.bootstrap_room != 0):
            self.decode_kv.fake.expect(new.bootstrap_room, new.rid, new.input_ids,
                                       new.sampling)
            self._relayed_fakes[new.rid] = new.bootstrap_room

    def _forget_relayed_fake(self, on_decode: Callable[[DecodeResponse], None],
                             resp: DecodeResponse) -> None:
        """The decode peer answered ``resp`` on this mesh rank: forget its fake prompt, if
        :meth:`_expect_fake` registered one, then hand the answer on.

        Every request the peer takes ends in exactly one answer, however it ends (finished,
        refused or failed at admission, aborted, failed), on the same pass on every rank; the
        fake receiver forgets the prompt too, but a request refused at its admission gets no
        receiver, and no service answers on the other ranks. Keyed by request id: rank 0's
        front refuses an id while it is live (until its decode answer), and every rank answers
        a request before any later relay, so an id names one request here at a time. (Were
        the peer given a live id again, it would refuse the newcomer and this would forget the
        newcomer's prompt; the live request's receiver, made at its admission, forgets its
        own.) On rank 0 the service forgets the prompt too: ``forget`` of a forgotten room
        does nothing."""
        room = self._relayed_fakes.pop(resp.rid, None)
        if room is not None and self.decode_kv is not None:
            self.decode_kv.fake.forget(room)
        on_decode(resp)

    def _mooncake_decode(self, pool: KVPool, meta: MetadataBuffers,
                         addr: str) -> MooncakeDecodeManager:
        try:
            mesh, model = self._decode_mesh, self.config.model_shape
            place = None if mesh is None else mesh.rank_place(
                num_layers=model.layers, kv_heads=model.kv_heads)
            closing = None if self.decode_kv is None else self.decode_kv.closing
            manager = MooncakeDecodeManager(pool, meta, addr, config=self.config.mooncake,
                                            place=place, closing=closing)
        except PeerAuthError:
            with self._lock:
                self._decode_auth_refused += 1
            raise
        self._exposure()
        return manager

    def stop_writes(self, reason: str) -> None:
        """The prefill engine failed (``reason``): where this process is the one rank behind
        its bootstrap endpoint, close its Mooncake KV manager (on a thread of its own: the
        transfer workers may take seconds to end), then tell decode peers there that its writes
        stopped, if the manager made sure of it. The endpoint stays up; nothing else changes."""
        if (self.bootstrap is None or self.bootstrap.expected_ranks != 1
                or self._prefill_kv() is None):
            return
        threading.Thread(target=self._stop_writes, args=(reason,), name="pdlife-stop-writes",
                         daemon=True).start()

    def _stop_writes(self, reason: str) -> None:
        kv = self._prefill_kv()
        assert kv is not None
        try:
            kv.close()
            self._tell_writes_stopped(reason, wait=False)
        except Exception:  # the endpoint keeps saying the server is unhealthy, not stopped
            logger.exception("stopping the KV writes of the failed prefill engine failed")

    def _prefill_kv(self) -> MooncakeKVManager | None:
        kv = None if self.prefill is None else self.prefill.kv
        return kv if isinstance(kv, MooncakeKVManager) else None

    def _shut_down_writes(self) -> None:
        """On close, after this process's KV manager closed: the other rank processes stop
        (``others`` of :meth:`close`), then decode peers are told that the writes stopped where
        every rank confirmed it, and the endpoint stays up until they read it (bounded)."""
        others = None if self._others is None else self._others()
        self._tell_writes_stopped(SHUT_DOWN, wait=True, others=others)

    def _tell_writes_stopped(self, reason: str, *, wait: bool,
                             others: RanksStopped | None = None) -> None:
        """Say at the bootstrap endpoint that no prefill rank behind it writes KV any more
        (``reason``, unless it answers unhealthy already), where this process knows it: its
        KV manager closed having made sure none of its writes can land any more, and so did
        every other rank registered there (``others``, each rank process's word). With
        ``wait``, then wait until every decode session left holding pages for a destination no
        ``Status`` answered read it, for at most the longest of their heartbeat intervals (and
        a margin), and at most ``MooncakeConfig.writes_stopped_wait_s``."""
        bootstrap, kv = self.bootstrap, self._prefill_kv()
        if bootstrap is None or kv is None:
            return
        words, problem = _confirmed(bootstrap, kv, others)
        if problem is not None:
            logger.info("decode peers are not told that this prefill server's KV writes "
                        "stopped: %s", problem)
            return
        unanswered = _unanswered_of(words)
        if not bootstrap.writes_stopped:
            bootstrap.mark_unhealthy(bootstrap.unhealthy or reason, writes_stopped=True)
            logger.info("told decode peers that this prefill server's KV writes stopped (%d "
                        "decode ranks hold pages for rooms it did not answer)",
                        len(unanswered))
        cap = self.config.mooncake.writes_stopped_wait_s
        if not wait or not unanswered or cap == 0:
            return
        bound = min(cap, max(interval or cap for interval in unanswered.values())
                    + _READ_MARGIN_S)
        missed = bootstrap.wait_read(unanswered, bound)
        if missed:
            logger.warning("decode ranks %s did not check this prefill server's health within "
                           "%g s of its saying that its KV writes stopped: they hold the pages "
                           "of its rooms until their lost-prefill release bound",
                           ", ".join(sorted(missed)), bound)

    def close(self, others: Callable[[], RanksStopped] | None = None) -> None:
        """Release the backends (threads, sockets, the bootstrap port), newest first; a failure
        is logged and the rest are still released. ``others``: stops the server's other rank
        processes and says which confirmed that their KV writes stopped (called once, after
        this process's KV manager closed and before its bootstrap endpoint closes: never while
        this process's engine loop may step)."""
        self._others = others
        for exc in close_all(self._closers):
            logger.error("closing a backend failed", exc_info=exc)

    # -- what the service publishes ---------------------------------------------------------

    def peer_auth_failures(self) -> dict[str, int]:
        """Peers refused for their token: by this prefill's bootstrap endpoint, and prefill
        servers that refused this decode's."""
        failures = {}
        if self.bootstrap is not None:
            failures["prefill"] = self.bootstrap.unauthorized
        if self.decode_kv is not None and self.config.backend == "mooncake":
            with self._lock:
                failures["decode"] = self._decode_auth_refused
        return failures

    def dropped_messages(self) -> Iterator[tuple[str, DroppedMessages]]:
        """Each side's count of control messages dropped, by side."""
        if self.prefill is not None:
            yield from prefill_dropped_messages(self.prefill)
        if self.decode_kv is not None:
            for manager in self.decode_kv.managers():
                dropped = getattr(manager, "dropped_messages", None)
                if dropped is not None:
                    yield "decode", dropped

    def snapshot(self) -> dict[str, Any]:
        """Requests by state and pool occupancy, per side (engine thread: the only place engine
        state may be read)."""
        requests: dict[str, dict[str, int]] = {}
        pools: dict[str, dict[str, int]] = {}
        if self.prefill is not None:
            counts = self.prefill.lifecycle.counts()
            requests["prefill"] = {s.name.lower(): n for s, n in counts.items()}
            pools["prefill"] = pool_view(self.prefill.pool, self.prefill.prefix)
        if self.decode is not None:
            decode_counts = self.decode.lifecycle.counts()
            requests["decode"] = {s.name.lower(): n for s, n in decode_counts.items()}
            pools["decode"] = pool_view(self.decode.pool)
        return {"requests": requests, "kv_pool": pools}


def _confirmed(bootstrap: BootstrapServer, kv: MooncakeKVManager,
               others: RanksStopped | None) -> tuple[list[WritesStopped], str | None]:
    """The word of every rank behind ``bootstrap`` that its writes stopped (``kv``'s, this
    process's, and ``others``'), or why not every rank's: a word missing, or a rank
    registered there that gave none."""
    own = kv.writes_stopped
    if own is None:
        return [], "its KV manager could not make sure of its own"
    words = [own, *(() if others is None else others.confirmed)]
    if others is not None and others.unconfirmed:
        return words, ("rank processes did not confirm that theirs stopped: "
                       + "; ".join(others.unconfirmed))
    ranks = {word.rank for word in words}
    if len(ranks) != bootstrap.expected_ranks:
        return words, (f"{bootstrap.expected_ranks} ranks serve it and {len(ranks)} confirmed "
                       "(a server of rank processes says it only as it closes)")
    strangers = sorted(set(bootstrap.ranks()) - ranks)
    if strangers:
        return words, f"ranks {strangers} registered at its endpoint gave no word"
    return words, None
