"""How every rank of a mesh receives the same requests: the first rank relays its inbox.

Theory of operation
-------------------
The ranks of a tensor- or pipeline-parallel mesh run one model together: every forward is a
collective, so every rank must form the same batches in the same order, and for that every rank
must admit the same requests and aborts on the same pass. Only one rank, the mesh's first (the
one behind the HTTP front), takes requests. At the start of each pass it takes what arrived on
its inbox and broadcasts it to the mesh; every rank, the first included, then admits exactly
that list (SGLang's TP workers receive their inputs the same way, broadcast from TP rank 0).

The wire form is msgpack (never pickle): the requests' plain fields, encoded by
:func:`encode_items` and rebuilt, with their validators run again, by :func:`decode_items`.
A pass with nothing new costs one broadcast of an eight-byte length. A negative length is the
first rank's :meth:`InboxRelay.stop`: the other ranks' next exchange raises :class:`MeshStopped`,
which ends their loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import msgpack
import torch
import torch.distributed as dist

from lifecycle import GrammarSpec, SamplingParams
from scheduler.messages import AbortRequest, FlushCache, InboxItem, NewRequest

Item = InboxItem


class RelayError(ValueError):
    """A relay used against its protocol: requests submitted on a rank that only receives, or
    a payload that does not decode."""


def _sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    fields = attrs.asdict(sampling, recurse=False)
    grammar = sampling.grammar
    fields["grammar"] = None if grammar is None else [grammar.kind.value, grammar.source]
    return fields


def encode_items(items: Sequence[Item]) -> bytes:
    """The msgpack form of ``items`` (requests with all their fields, aborts by id, whether
    the server is shutting down and the prefill half's failure, cache flushes by ticket)."""
    rows: list[list[Any]] = []
    for item in items:
        if isinstance(item, AbortRequest):
            rows.append(["abort", item.rid, item.shutdown, item.peer])
        elif isinstance(item, FlushCache):
            rows.append(["flush", item.ticket])
        else:
            rows.append(["new", item.rid, list(item.input_ids), item.bootstrap_host,
                         item.bootstrap_port, item.bootstrap_room,
                         _sampling_fields(item.sampling)])
    out: bytes = msgpack.packb(rows, use_bin_type=True)
    return out


def decode_items(payload: bytes) -> list[Item]:
    """The items :func:`encode_items` encoded, rebuilt (and validated) as records."""
    try:
        rows = msgpack.unpackb(payload, raw=False)
        items: list[Item] = []
        for row in rows:
            if row[0] == "abort":
                items.append(AbortRequest(row[1], bool(row[2]), str(row[3])))
                continue
            if row[0] == "flush":
                items.append(FlushCache(int(row[1])))
                continue
            _, rid, input_ids, host, port, room, sampling = row
            grammar = sampling.pop("grammar")
            items.append(NewRequest(
                rid, tuple(input_ids), bootstrap_host=host, bootstrap_port=port,
                bootstrap_room=room,
                sampling=SamplingParams(
                    **sampling, grammar=None if grammar is None else GrammarSpec(*grammar)),
            ))
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise RelayError(f"a relayed payload of {len(payload)} bytes does not decode: "
                         f"{exc}") from exc
    return items


class MeshStopped(Exception):
    """The mesh's first rank stopped: this rank's loop ends (nothing more will come)."""


_STOP = -1


class InboxRelay:
    """Broadcasts the inbox of global rank ``src`` to every rank of ``group`` (a collective:
    every rank calls :meth:`exchange` once per pass)."""

    def __init__(self, group: Any, src: int) -> None:
        self.group = group
        self.src = src
        self.rank = dist.get_rank()

    def exchange(self, items: Sequence[Item]) -> list[Item]:
        """On ``src``: broadcast ``items`` and return them. Elsewhere: ``items`` must be empty
        (only ``src`` takes requests); return what ``src`` broadcast."""
        if self.rank != self.src and items:
            raise RelayError(
                f"rank {self.rank} got {len(items)} requests or aborts, but only rank "
                f"{self.src} takes them: submit to the mesh's first rank"
            )
        payload = encode_items(items) if self.rank == self.src and items else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=self.src, group=self.group)
        n = int(size.item())
        if n == _STOP:
            raise MeshStopped(f"rank {self.src} stopped the mesh")
        if n == 0:
            return []
        if self.rank == self.src:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buffer = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buffer, src=self.src, group=self.group)
        if self.rank == self.src:
            return list(items)
        return decode_items(buffer.numpy().tobytes())

    def stop(self) -> None:
        """On ``src``, in place of a pass: every other rank's next :meth:`exchange` raises
        :class:`MeshStopped`."""
        if self.rank != self.src:
            raise RelayError(f"rank {self.rank} cannot stop the mesh; rank {self.src} does")
        dist.broadcast(torch.tensor([_STOP], dtype=torch.int64), src=self.src, group=self.group)
