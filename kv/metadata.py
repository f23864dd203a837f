"""Metadata buffers: per-request rows carrying the first output token to the decode side.

Theory of operation
-------------------
Prefill writes row ``slot`` of each field when the request's last chunk is computed; the
transfer backend copies that row into the decode side's row ``dst_slot`` along with the last
KV chunk. Each field is its own ``[num_slots, items]`` tensor whose rows are padded to a
multiple of 64 bytes (the smallest RDMA-friendly size), so a transfer engine moves row ``i`` of
a field as one write of ``item_len`` bytes at ``ptr + i * item_len`` (see :meth:`buffer_infos`).
The first token's logprob and its top alternatives (ids and values, up to
``lifecycle.TOP_LOGPROBS_MAX`` of them, as SGLang's ``output_top_logprobs_idx``/``_val``) travel
in the row, so the decode side answers with them.

The bootstrap room is written LAST, into a field of its own. A reader therefore treats a row
whose room is 0 as "not landed yet" (a cleared slot, or one whose other fields are still being
written), and a row whose room differs from the one it expects as foreign (a stale row of an
earlier request, or a corrupted write). Rooms are unsigned 64-bit; they are stored as the
int64 with the same bits. Room 0 therefore cannot be read back: requests that carry room 0 (the
fake backend's warm-up requests) never wait for their row.

:class:`SlotAllocator` hands out slots FIFO; when none is free the request waits.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import attrs
import torch

from lifecycle import TOP_LOGPROBS_MAX

# Items per row: 16 x 4 bytes (and 8 x 8 bytes for the room) = 64 bytes.
_ROW_BYTES = 64
# The top-logprob fields hold TOP_LOGPROBS_MAX 4-byte items, padded to a multiple of 64 bytes.
_TOP_ITEMS = -(-TOP_LOGPROBS_MAX * 4 // _ROW_BYTES) * _ROW_BYTES // 4
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


class MetadataError(Exception):
    """A slot was freed twice or is out of range, or a row belongs to another room."""


def _room_to_i64(room: int) -> int:
    if not 0 <= room < _U64:
        raise ValueError(f"room must be in 0 .. 2**64 - 1, got {room}")
    return room - _U64 if room > _I64_MAX else room


def _i64_to_room(value: int) -> int:
    return value + _U64 if value < 0 else value


@attrs.frozen
class MetadataRow:
    """One landed row. ``logprob`` is None when the request did not ask for it; ``top`` holds
    the first token's top alternatives, ``(token, logprob)`` most likely first."""

    first_token: int
    cached_tokens: int
    logprob: float | None
    room: int
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class BufferInfo:
    """Where a field lives, for a transfer engine: row ``i`` is at ``ptr + i * item_len``."""

    name: str
    ptr: int
    length: int
    item_len: int


class MetadataBuffers:
    """Rows of first-token metadata, one per slot. Fields, in the order they are written:
    ``output_ids`` (int32), ``cached_tokens`` (int32), ``logprob`` (float32, NaN = absent),
    ``top_logprob_ids`` (int32, -1 = absent) and ``top_logprob_vals`` (float32), ``room``
    (int64 bits of the uint64 room; written last)."""

    FIELDS = ("output_ids", "cached_tokens", "logprob", "top_logprob_ids", "top_logprob_vals",
              "room")

    def __init__(self, num_slots: int, device: str | torch.device = "cpu") -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self.output_ids = torch.zeros(
            (num_slots, _ROW_BYTES // 4), dtype=torch.int32, device=device
        )
        self.cached_tokens = torch.zeros_like(self.output_ids)
        self.logprob = torch.full(
            (num_slots, _ROW_BYTES // 4), math.nan, dtype=torch.float32, device=device
        )
        self.top_logprob_ids = torch.full(
            (num_slots, _TOP_ITEMS), -1, dtype=torch.int32, device=device)
        self.top_logprob_vals = torch.full(
            (num_slots, _TOP_ITEMS), math.nan, dtype=torch.float32, device=device)
        self.room = torch.zeros((num_slots, _ROW_BYTES // 8), dtype=torch.int64, device=device)

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.output_ids, self.cached_tokens, self.logprob, self.top_logprob_ids,
                self.top_logprob_vals, self.room)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise MetadataError(f"slot {slot} is not in these buffers (0..{self.num_slots - 1})")

    def write(
        self, slot: int, first_token: int, cached_tokens: int, logprob: float | None, room: int,
        top: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Fill row ``slot``. The room is zeroed first and written last, so a concurrent reader
        sees either the old row, "not landed", or the whole new row."""
        self._check_slot(slot)
        if len(top) > TOP_LOGPROBS_MAX:
            raise ValueError(f"at most {TOP_LOGPROBS_MAX} top logprobs fit a row, got {len(top)}")
        stored_room = _room_to_i64(room)
        self.room[slot, 0] = 0
        self.output_ids[slot, 0] = first_token
        self.cached_tokens[slot, 0] = cached_tokens
        self.logprob[slot, 0] = math.nan if logprob is None else logprob
        self.top_logprob_ids[slot].fill_(-1)
        self.top_logprob_vals[slot].fill_(math.nan)
        if top:
            self.top_logprob_ids[slot, : len(top)] = torch.tensor([t for t, _ in top])
            self.top_logprob_vals[slot, : len(top)] = torch.tensor([v for _, v in top])
        self.room[slot, 0] = stored_room

    def read(self, slot: int, expected_room: int | None = None) -> MetadataRow | None:
        """The row in ``slot``, or None while it has not landed (room 0, or the room changed
        while the row was read). Raises :class:`MetadataError` when ``expected_room`` is given
        and the row carries another room."""
        self._check_slot(slot)
        before = int(self.room[slot, 0])
        if before == 0:
            return None
        first_token = int(self.output_ids[slot, 0])
        cached = int(self.cached_tokens[slot, 0])
        logprob = float(self.logprob[slot, 0])
        top_ids: list[int] = self.top_logprob_ids[slot].tolist()
        top_vals: list[float] = self.top_logprob_vals[slot].tolist()
        if int(self.room[slot, 0]) != before:
            return None
        room = _i64_to_room(before)
        if expected_room is not None and room != expected_room:
            raise MetadataError(
                f"slot {slot} holds room {room}, expected room {expected_room}: "
                "a stale or corrupted row; fail the request"
            )
        return MetadataRow(
            first_token=first_token,
            cached_tokens=cached,
            logprob=None if math.isnan(logprob) else logprob,
            room=room,
            top=tuple((t, v) for t, v in zip(top_ids, top_vals, strict=True) if t >= 0),
        )

    def clear(self, slot: int) -> None:
        """Mark the row not landed; the room goes first so no reader sees a mixed row."""
        self._check_slot(slot)
        self.room[slot].zero_()
        self.output_ids[slot].zero_()
        self.cached_tokens[slot].zero_()
        self.logprob[slot].fill_(math.nan)
        self.top_logprob_ids[slot].fill_(-1)
        self.top_logprob_vals[slot].fill_(math.nan)

    def copy_row_from(self, src: MetadataBuffers, src_slot: int, dst_slot: int) -> None:
        """Copy ``src`` row ``src_slot`` into row ``dst_slot`` of these buffers, room last."""
        src._check_slot(src_slot)
        self._check_slot(dst_slot)
        self.room[dst_slot].zero_()
        for mine, theirs in zip(self._fields(), src._fields(), strict=True):
            mine[dst_slot].copy_(theirs[src_slot])

    def buffer_infos(self) -> list[BufferInfo]:
        """One entry per field, in write order (the room last)."""
        return [
            BufferInfo(
                name=name,
                ptr=t.data_ptr(),
                length=t.numel() * t.element_size(),
                item_len=t.shape[1] * t.element_size(),
            )
            for name, t in zip(self.FIELDS, self._fields(), strict=True)
        ]


class SlotAllocator:
    """FIFO allocator of metadata slots; :meth:`alloc` returns None when none is free."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._is_free = bytearray(b"\x01") * num_slots

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.popleft()
        self._is_free[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise MetadataError(f"slot {slot} is not in this allocator (0..{self.num_slots - 1})")
        if self._is_free[slot]:
            raise MetadataError(f"slot {slot} freed twice")
        self._is_free[slot] = 1
        self._free.append(slot)
