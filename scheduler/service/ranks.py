"""Prefill ranks as processes: ``pdlife serve --role prefill --tp-size T --pp-size P``.

Theory of operation
-------------------
The ``pdlife serve`` process is the launcher and global rank 0: stage 0, TP rank 0, the rank
behind the HTTP front (as SGLang's launcher starts its scheduler processes and keeps the HTTP
server). :func:`launch_ranks` spawns ranks ``1 .. T*P - 1`` as processes (``spawn``, so
none inherits the launcher's threads), joins them in a gloo process group on a loopback
port, and every rank builds the mesh and the scheduler's groups
(:func:`scheduler.prefill.mesh.build_mesh_control`).

Every rank then builds the same scheduler over its own shard
(:class:`~scheduler.model.sharded.ShardedLlama`: its KV heads of its stage's layers), its
own pool and its own KV backend, from the same :class:`~scheduler.service.config.ServeConfig`.
Rank 0's :class:`~scheduler.service.core.Service` steps its scheduler in its engine loop as
on one rank; the other ranks step theirs in :func:`_follow`. Each pass opens with the relay's
broadcast from rank 0 (:mod:`scheduler.dist.relay`), so the other ranks wait for rank 0's
passes and run them in lockstep; when rank 0 is idle, they wait in that broadcast (for at
most :data:`MESH_TIMEOUT`, gloo's limit on one collective).

Shutdown: :meth:`Ranks.close` (after rank 0's engine loop stopped) has the relay stop the
mesh; every other rank's next pass raises :class:`~scheduler.dist.relay.MeshStopped`, it closes
its backends and exits 0. The other ranks ignore SIGINT and SIGTERM (a Ctrl-C reaches the
whole process group): rank 0 alone drains and decides when they stop. A rank that fails
breaks the next collective on every rank: rank 0's engine loop fails and the service reports
it (unhealthy; ``pdlife serve`` exits 1).
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from datetime import timedelta

import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessContext, start_processes

from scheduler.assemble import Closers, build_prefill, close_all, constraint_compiler
from scheduler.dist.relay import MeshStopped
from scheduler.model.reference import PagedModelRunner
from scheduler.model.select import reference_model
from scheduler.model.sharded import ShardedLlama
from scheduler.prefill.mesh import MeshControl, build_mesh_control
from scheduler.service.config import ServeConfig
from scheduler.stepping import step_or_rest

logger = logging.getLogger(__name__)

#: How long one collective may wait: the longest a mesh may sit idle.
MESH_TIMEOUT = timedelta(days=7)
#: How long the launcher waits for the other ranks to exit once it stopped the mesh.
JOIN_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _join(rank: int, world: int, port: int, config: ServeConfig) -> MeshControl:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=MESH_TIMEOUT)
    control = build_mesh_control(config.tp_size, config.pp_size)
    assert control is not None  # the mesh holds every rank of this group
    return control


class Ranks:
    """The launcher's side: rank 0's mesh control and the other ranks' processes."""

    def __init__(self, config: ServeConfig) -> None:
        self.world = config.tp_size * config.pp_size
        port = _free_port()
        # torch's start_processes has no annotations.
        self._processes: ProcessContext = start_processes(  # type: ignore[no-untyped-call]
            _follow, args=(self.world, port, config), nprocs=self.world - 1, join=False,
            start_method="spawn",
        )
        try:
            self.control = _join(0, self.world, port, config)
        except BaseException:
            self._kill()
            raise
        logger.info("prefill mesh: TP %d x PP %d, %d rank processes beside this one",
                    config.tp_size, config.pp_size, self.world - 1)

    def started(self) -> None:
        """Rank 0's engines are built (with Mooncake: its bootstrap endpoint is up): the other
        ranks build theirs and register. Once, before rank 0's first pass."""
        self.control.relay.exchange([])

    def close(self) -> None:
        """Stop the mesh (rank 0's engine loop must have stopped) and wait for the ranks."""
        try:
            self.control.relay.stop()
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            # join() returns as each rank exits; True once every one has.
            while not self._processes.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() < deadline:
                    continue
                logger.error("prefill ranks still running %g s after the stop; killing them",
                             JOIN_TIMEOUT_S)
                self._kill()
                break
        except Exception as exc:  # a rank that died: report it, stop the rest
            logger.error("a prefill rank failed: %s", exc)
            self._kill()
        finally:
            dist.destroy_process_group()

    def _kill(self) -> None:
        for process in self._processes.processes:
            if process.is_alive():
                process.kill()


def _follow(index: int, world: int, port: int, config: ServeConfig) -> None:
    """Rank ``index + 1``: its scheduler, stepped until rank 0 stops the mesh."""
    # Rank 0 stops the mesh when its drain ends; a Ctrl-C or SIGTERM to the whole process
    # group must not end this rank first, under rank 0's drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank{index + 1} %(name)s: %(message)s")
    control = _join(index + 1, world, port, config)
    closers: Closers = []
    try:
        served = reference_model(config.model, device=config.device)
        control.relay.exchange([])  # Ranks.started: rank 0's bootstrap endpoint is up
        scheduler = build_prefill(
            ShardedLlama(config.model, control.mesh, config.device), backend=config.backend,
            config=config.scheduler, pages=config.pool_pages,
            metadata_slots=config.metadata_slots, runner_factory=PagedModelRunner,
            closers=closers, kv_layout=config.kv_layout, overlap=config.overlap,
            compiler=constraint_compiler(served), mooncake=config.mooncake,
            bootstrap_addr=f"{config.bootstrap_host}:{config.bootstrap_port}",
            place=control.rank_place(config.model.layers, config.model.kv_heads),
            **control.scheduler_options(),
        )
        while True:
            try:
                step_or_rest(scheduler.step)
            except MeshStopped:
                break
    except MeshStopped:
        pass  # rank 0 stopped before this rank's scheduler was built
    finally:
        for exc in close_all(closers):
            logger.error("closing a backend failed", exc_info=exc)
        dist.destroy_process_group()
