"""Decode ranks as processes: ``pdlife serve --role decode --tp-size T``.

Theory of operation
-------------------
A decode server at TP ``T`` runs the reference model over ``T`` ranks
(:mod:`scheduler.decode.mesh`). The ``pdlife serve`` process is TP rank 0, behind the HTTP
front; :class:`DecodeRanks` spawns the other ``T - 1`` as processes (``spawn``, so none
inherits the launcher's threads). The ranks join a gloo group of their own (through a store
file, over loopback: :mod:`scheduler.dist.rendezvous`) and build the decode group
(:func:`scheduler.decode.mesh.build_decode_mesh`).

Every rank builds the same engines (:class:`~scheduler.service.engines.Engines`, role
``decode``) over its own shard (:class:`~scheduler.model.sharded.ShardedLlama`), its own pool
and its own KV managers, one per prefill server, each registered with the prefill's ranks with
its place (TP rank and size). Rank 0's engine loop steps its peer; each pass opens with the
relay's broadcast of what reached it, so the other ranks run its passes in lockstep and, while
it is idle, wait in that broadcast (at most :data:`~scheduler.service.ranks.MESH_TIMEOUT`). The
other ranks' answers are the same as rank 0's and go nowhere (each rank's engines only forget,
as a request ends, the fake-host prompt they registered for it when it was relayed).

Start: rank 0 builds its engines, then :meth:`DecodeRanks.started` lets the other ranks build
theirs. Shutdown: :meth:`DecodeRanks.close` (after rank 0's engine loop stopped) stops the
group, so every rank's next pass raises :class:`~scheduler.dist.relay.MeshStopped`; each closes
its backends and exits 0. The rank processes ignore SIGINT and SIGTERM: rank 0 alone drains
and decides when they stop. A rank that dies breaks the next collective: rank 0's engine loop
fails and the service reports it (``/health`` answers 503, waiting requests fail; stopped,
``pdlife serve`` exits 1).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessContext, start_processes

from scheduler.assemble import constraint_compiler
from scheduler.decode.mesh import DecodeMeshControl, build_decode_mesh
from scheduler.dist import rendezvous
from scheduler.dist.relay import MeshStopped
from scheduler.messages import DecodeResponse, Response
from scheduler.service import logs
from scheduler.service.config import ServeConfig
from scheduler.service.engines import Engines
from scheduler.service.ranks import (
    MESH_TIMEOUT,
    START_TIMEOUT,
    for_ranks,
    in_rank,
    kill_ranks,
    served_by,
    stop_ranks,
    watch_ranks,
)
from scheduler.stepping import step_or_rest

logger = logging.getLogger(__name__)


def _join(rank: int, world: int, store: str) -> DecodeMeshControl:
    rendezvous.join(store, rank, world, START_TIMEOUT)
    control = build_decode_mesh(world, range(world), timeout=MESH_TIMEOUT)
    assert control is not None  # the group holds every rank
    return control


class DecodeRanks:
    """The launcher's side: TP rank 0's decode group and the other ranks' processes."""

    def __init__(self, config: ServeConfig) -> None:
        self.world = config.tp_size
        self._closing = threading.Event()
        self._store_files = rendezvous.StoreFiles()
        store = self._store_files.path("decode")
        # torch's start_processes has no annotations.
        self._processes: ProcessContext = start_processes(  # type: ignore[no-untyped-call]
            _rank_main, args=(self.world, store, *for_ranks(config)), nprocs=self.world - 1,
            join=False,
            start_method="spawn",
        )
        try:
            self.control = _join(0, self.world, store)
        except BaseException:
            kill_ranks(self._processes)
            self._store_files.remove()
            raise
        logger.info("decode: TP %d, rank processes beside this one: %d", self.world,
                    self.world - 1)

    def started(self) -> None:
        """Rank 0's engines are built: every other rank builds its own. Once, before rank 0's
        first pass."""
        self.control.relay.exchange([])

    def watch(self, on_exit: Callable[[BaseException], None]) -> None:
        """``on_exit`` when a rank process ends before :meth:`close`."""
        watch_ranks(self._processes, "decode", self._closing, on_exit)

    def close(self) -> None:
        """Stop the group (rank 0's engine loop must have stopped) and wait for the ranks."""
        self._closing.set()
        try:
            stop_ranks(self._processes, self.control.relay.stop, "decode")
        finally:
            dist.destroy_process_group()
            self._store_files.remove()


def _ignore(_answer: Response | DecodeResponse) -> None:
    """Only rank 0 answers (every rank's answers are the same)."""


def _rank_main(index: int, world: int, store: str, config: ServeConfig,
               source: tuple[str, str] | None) -> None:
    """TP rank ``index + 1``: build when rank 0 says so, then step in its lockstep."""
    rank = index + 1
    # Rank 0 stops every rank when its drain ends; a Ctrl-C or SIGTERM to the whole process
    # group must not end this one first, under rank 0's drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.configure(config.log, process=f"decode/rank{rank}")
    control = _join(rank, world, store)
    try:
        control.relay.exchange([])  # rank 0 says: build
        config = in_rank(config, source, control.mesh)
        served = served_by(config)
        engines = Engines(
            config, served.shard(control.mesh, config.device),
            runner_factory=served.runner, compiler=constraint_compiler(served),
            detokenize=served.stop_text, on_prefill=_ignore, on_decode=_ignore,
            decode_mesh=control,
        )
        try:
            assert engines.decode is not None  # the decode role
            while True:
                step_or_rest(engines.decode.step)
        finally:
            engines.close()
    except MeshStopped:
        pass  # rank 0 stopped the group
    except BaseException:
        # torch's spawn hands the traceback to a join that comes only at shutdown: say it now.
        logger.critical("decode rank %d failed", rank, exc_info=True)
        raise
    finally:
        dist.destroy_process_group()
