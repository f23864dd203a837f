"""The PrefillDelayer across the DP replicas of ``pdlife serve --role prefill --dp-size D``.

Theory of operation
-------------------
Each replica runs its own :class:`~scheduler.prefill.scheduler.PrefillScheduler`
(:mod:`scheduler.service.ranks`). With the delayer on, the first rank of every replica joins
one gloo group of ``D`` ranks (a group of its own, through its own store file: the replicas'
meshes are separate ``torch.distributed`` worlds), and every scheduler pass negotiates over
it: :class:`ReplicaGather` is the delayer's :class:`~scheduler.dist.gather.RowGather`, so the
replicas step in lockstep, one gather per pass each.

The lockstep is the relay's: the other replicas never rest on their own inbox; each pass they
wait in the gather until rank 0 (the launcher, stepped by the service's engine loop) runs its
pass. Rank 0 routes every request, so it knows what it handed each replica; each row carries,
after the delayer's own columns, how many requests that replica has taken and whether it has
work. Rank 0's scheduler is not idle (:meth:`ReplicaGather.peers_busy`) while a replica has work
or has not yet taken what was routed to it, so its loop keeps stepping, and the replicas with
it. Rank 0 stops the group as it stops the meshes: :meth:`ReplicaGather.stop` contributes a row
that says stop, and every other replica's gather raises
:class:`~scheduler.dist.relay.MeshStopped`.

A replica of several ranks (TP x PP) follows its first rank: the first rank broadcasts the
gathered rows over its mesh's group (:class:`MeshFollower` receives them, at the same point of
the same pass), so every rank of the replica decides as its first rank does; the stop row
reaches them the same way.

Every row also carries its replica's delayer outcome counts so far; they must be equal on every
pass (every replica decided the same on every earlier pass). Rank 0 checks it and logs a split
as an error.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scheduler.dist import rendezvous
from scheduler.dist.gather import Table
from scheduler.dist.relay import MeshStopped
from scheduler.prefill.delayer import DelayerMetrics, PrefillDelayer
from scheduler.prefill.delayer_decision import DelayerConfig
from scheduler.prefill.scheduler import PrefillScheduler

logger = logging.getLogger(__name__)

#: The outcome counts each row carries, in this order.
REASONS = ("none", "no_wait", "wait_success", "wait_timeout", "token_watermark", "delay")
#: Columns after the delayer's own: stop, busy, taken.
_STOP, _BUSY, _TAKEN = 0, 1, 2
_EXTRA = 3 + len(REASONS)


class ReplicaGather:
    """The delayer's gather over the first ranks of ``dp_size`` replicas; this is replica
    ``replica``'s (see the module docstring)."""

    def __init__(self, replica: int, dp_size: int, config: DelayerConfig,
                 mesh: tuple[Any, int] | None = None) -> None:
        """``mesh``: the group of this replica's ranks and its first rank's global rank, when
        the replica has other ranks (they receive each gathered table)."""
        self.replica = replica
        self._mesh = mesh
        self.dp_size = dp_size
        #: The width of the delayer's row (SGLang's 5 fields, plus the wait in bounded mode).
        self.width = 5 + (config.mode == "bounded")
        #: Rank 0: the requests handed to each replica. Another replica: ``taken``.
        self.routed = [0] * dp_size
        self.taken = 0
        self.splits = 0  # passes on which the replicas' outcome counts differed (rank 0)
        self._busy: Callable[[], bool] = lambda: False
        self._outcomes: Counter[str] = Counter()
        self._peers_busy = False
        self._group: Any = None

    def connect(self, store: str, start: timedelta, timeout: timedelta) -> None:
        """Join the group (a rendezvous of every replica through the store file ``store``:
        :mod:`scheduler.dist.rendezvous`); ``timeout`` bounds one gather: how long rank 0 may
        sit idle."""
        self._group = rendezvous.group(store, self.replica, self.dp_size, start, timeout)

    @property
    def connected(self) -> bool:
        return self._group is not None

    def serve(self, scheduler: PrefillScheduler, config: DelayerConfig) -> None:
        """Give ``scheduler`` a delayer over this gather."""
        self._outcomes = delay(scheduler, self, self.dp_size, config).outcomes
        self._busy = lambda: not scheduler.idle()

    def peers_busy(self) -> bool:
        """Rank 0: whether another replica had work, or requests still to take, at the last
        gather (its loop must keep stepping)."""
        return self._peers_busy

    def outcome_counts(self) -> list[int]:
        return counts_of(self._outcomes)

    def gather(self, row: Sequence[int]) -> Table:
        extra = [0, int(self._busy()), self.taken, *self.outcome_counts()]
        gathered = self._all_gather([*row, *extra])
        if self._mesh is not None:  # this replica's other ranks decide from the same rows
            group, src = self._mesh
            dist.broadcast(gathered, src=src, group=group)
        rows: list[list[int]] = gathered.tolist()
        if self.replica == 0:
            self._check(rows)
        return _table(rows, self.width)

    def stop(self) -> None:
        """On rank 0, in place of a pass: every other replica's next gather raises
        :class:`MeshStopped`."""
        stop = [0] * (self.width + _EXTRA)
        stop[self.width + _STOP] = 1
        self._all_gather(stop)

    def _check(self, rows: list[list[int]]) -> None:
        extras = [r[self.width :] for r in rows]
        self._peers_busy = any(
            e[_BUSY] or e[_TAKEN] < self.routed[r] for r, e in enumerate(extras) if r)
        counts = [e[3:] for e in extras]
        if any(c != counts[0] for c in counts):
            self.splits += 1
            logger.error("the replicas' delayer decisions split: outcome counts %s (%s)",
                         counts, ", ".join(REASONS))

    def _all_gather(self, full: list[int]) -> torch.Tensor:
        if self._group is None:
            raise AssertionError("the replicas' delayer group is not connected")
        out = [torch.empty(len(full), dtype=torch.int64) for _ in range(self.dp_size)]
        self._group.allgather([out], [torch.tensor(full, dtype=torch.int64)]).wait()
        return torch.stack(out)


class MeshFollower:
    """The delayer's gather on a replica's other ranks: the rows its first rank gathered,
    broadcast over the replica's ``group`` from global rank ``src``."""

    def __init__(self, group: Any, src: int, dp_size: int, config: DelayerConfig) -> None:
        self._group = group
        self._src = src
        self._width = 5 + (config.mode == "bounded")
        self._rows = torch.empty((dp_size, self._width + _EXTRA), dtype=torch.int64)

    def peers_busy(self) -> bool:
        return False  # only a replica's first rank runs an engine loop that could idle

    def gather(self, row: Sequence[int]) -> Table:
        dist.broadcast(self._rows, src=self._src, group=self._group)
        return _table(self._rows.tolist(), self._width)


def delay(scheduler: PrefillScheduler, gather: ReplicaGather | MeshFollower, dp_size: int,
          config: DelayerConfig) -> PrefillDelayer:
    """Give ``scheduler`` a delayer over ``gather`` (metrics on its registry)."""
    scheduler.delayer = PrefillDelayer(
        config, gather, dp_size=dp_size, attn_tp_size=1,
        # Every replica has its own max_running_requests: no share to divide.
        enable_dp_attention=True,
        metrics=DelayerMetrics(scheduler.metrics.registry, config.max_delay_passes))
    return scheduler.delayer


def counts_of(outcomes: Counter[str]) -> list[int]:
    """A delayer's outcome counts (:attr:`PrefillDelayer.outcomes`) in :data:`REASONS` order."""
    return [outcomes[reason] for reason in REASONS]


def named_counts(counts: Sequence[int]) -> str:
    """Outcome counts in :data:`REASONS` order, as a log line names them
    (``delay=3 wait_success=1 ...``)."""
    return " ".join(f"{reason}={n}" for reason, n in zip(REASONS, counts, strict=True))


def _table(rows: list[list[int]], width: int) -> Table:
    """The delayer's table of gathered ``rows``; :class:`MeshStopped` on a stop row."""
    if any(r[width + _STOP] for r in rows):
        raise MeshStopped("rank 0 stopped the replicas' delayer group")
    return [[r[:width]] for r in rows]
