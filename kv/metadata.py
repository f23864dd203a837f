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
in the row, so the decode side answers with them; so do the logprobs of the ids the request
named (``token_ids_logprob``, up to ``lifecycle.TOKEN_IDS_LOGPROB_MAX``: ``asked_logprob_ids``
and ``_vals``, pdlife's own fields).

With ``speculative_hidden`` (the target model's hidden size), the buffers also carry the
speculative-decoding hand-off, as SGLang's EAGLE PD rows do: the draft model's top-k proposals
after the first token (``spec_top_ids``, ``spec_top_probs`` in fixed-point units of
``2**-16``, up to ``SPEC_TOP_K`` of them) and the target's last hidden state (``spec_hidden``,
float32, padded to a multiple of 16 items). Both sides of a pair must build their buffers with
the same ``speculative_hidden``: the rows are moved byte for byte.

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

from lifecycle import TOKEN_IDS_LOGPROB_MAX, TOP_LOGPROBS_MAX

# Items per row: 16 x 4 bytes (and 8 x 8 bytes for the room) = 64 bytes.
_ROW_BYTES = 64
# The top-logprob fields hold TOP_LOGPROBS_MAX 4-byte items, padded to a multiple of 64 bytes,
# and the asked-logprob fields TOKEN_IDS_LOGPROB_MAX.
_TOP_ITEMS = -(-TOP_LOGPROBS_MAX * 4 // _ROW_BYTES) * _ROW_BYTES // 4
_ASKED_ITEMS = -(-TOKEN_IDS_LOGPROB_MAX * 4 // _ROW_BYTES) * _ROW_BYTES // 4
#: The most speculative proposals a row carries (one 64-byte row of int32).
SPEC_TOP_K = _ROW_BYTES // 4
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


#: The fields of the named ids' logprobs (``token_ids_logprob``), which a row of a request that
#: named none does not need to carry.
ASKED_FIELDS = ("asked_logprob_ids", "asked_logprob_vals")


class MetadataError(Exception):
    """A slot was freed twice or is out of range, or a row belongs to another room."""


def _room_to_i64(room: int) -> int:
    if not 0 <= room < _U64:
        raise ValueError(f"room must be in 0 .. 2**64 - 1, got {room}")
    return room - _U64 if room > _I64_MAX else room


def _i64_to_room(value: int) -> int:
    return value + _U64 if value < 0 else value


@attrs.frozen
class SpeculativeRow:
    """The speculative hand-off of one request: the draft's proposals after the first token
    (ids, most likely first, and probabilities in units of ``2**-16``) and the target's last
    hidden state (float32 values)."""

    top_ids: tuple[int, ...]
    top_probs: tuple[int, ...]
    hidden: tuple[float, ...]


@attrs.frozen
class MetadataRow:
    """One landed row. ``logprob`` is None when the request did not ask for it; ``top`` holds
    the first token's top alternatives, ``(token, logprob)`` most likely first, and ``asked``
    the logprobs of the ids the request named, in its order; ``speculative`` the hand-off when
    the buffers carry it and the prefill side wrote one."""

    first_token: int
    cached_tokens: int
    logprob: float | None
    room: int
    top: tuple[tuple[int, float], ...] = ()
    speculative: SpeculativeRow | None = None
    asked: tuple[tuple[int, float], ...] = ()


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
    ``top_logprob_ids`` (int32, -1 = absent) and ``top_logprob_vals`` (float32),
    ``asked_logprob_ids`` (int32, -1 = absent) and ``asked_logprob_vals`` (float32), with
    ``speculative_hidden`` ``spec_top_ids`` (int32, -1 = absent), ``spec_top_probs`` (int32)
    and ``spec_hidden`` (float32), then ``room`` (int64 bits of the uint64 room; written
    last)."""

    FIELDS = ("output_ids", "cached_tokens", "logprob", "top_logprob_ids", "top_logprob_vals",
              "asked_logprob_ids", "asked_logprob_vals", "room")

    SPEC_FIELDS = ("spec_top_ids", "spec_top_probs", "spec_hidden")

    def __init__(self, num_slots: int, device: str | torch.device = "cpu", *,
                 speculative_hidden: int = 0) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        if not 0 <= speculative_hidden <= 1 << 16:
            raise ValueError(f"speculative_hidden must be in 0..{1 << 16} (the target's hidden "
                             f"size; 0 for no speculative columns), got {speculative_hidden}")
        self.num_slots = num_slots
        self.speculative_hidden = speculative_hidden
        self.fields = self.FIELDS[:-1] + (self.SPEC_FIELDS if speculative_hidden else ()) + (
            "room",)
        items = -(-speculative_hidden // 16) * 16
        self.spec_top_ids = torch.full((num_slots, SPEC_TOP_K if items else 0), -1,
                                       dtype=torch.int32, device=device)
        self.spec_top_probs = torch.zeros_like(self.spec_top_ids)
        self.spec_hidden = torch.zeros((num_slots, items), dtype=torch.float32, device=device)
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
        self.asked_logprob_ids = torch.full(
            (num_slots, _ASKED_ITEMS), -1, dtype=torch.int32, device=device)
        self.asked_logprob_vals = torch.full(
            (num_slots, _ASKED_ITEMS), math.nan, dtype=torch.float32, device=device)
        self.room = torch.zeros((num_slots, _ROW_BYTES // 8), dtype=torch.int64, device=device)

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.fields)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise MetadataError(f"slot {slot} is not in these buffers (0..{self.num_slots - 1})")

    def write(
        self, slot: int, first_token: int, cached_tokens: int, logprob: float | None, room: int,
        top: Sequence[tuple[int, float]] = (), speculative: SpeculativeRow | None = None,
        asked: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Fill row ``slot``. The room is zeroed first and written last, so a concurrent reader
        sees either the old row, "not landed", or the whole new row."""
        self._check_slot(slot)
        if len(top) > TOP_LOGPROBS_MAX:
            raise ValueError(f"at most {TOP_LOGPROBS_MAX} top logprobs fit a row, got {len(top)}")
        if len(asked) > TOKEN_IDS_LOGPROB_MAX:
            raise ValueError(f"at most {TOKEN_IDS_LOGPROB_MAX} asked logprobs fit a row, got "
                             f"{len(asked)}")
        if speculative is not None:
            self._check_speculative(speculative)
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
        self.asked_logprob_ids[slot].fill_(-1)
        self.asked_logprob_vals[slot].fill_(math.nan)
        if asked:
            self.asked_logprob_ids[slot, : len(asked)] = torch.tensor([t for t, _ in asked])
            self.asked_logprob_vals[slot, : len(asked)] = torch.tensor([v for _, v in asked])
        self._clear_speculative(slot)
        if speculative is not None:
            k = len(speculative.top_ids)
            self.spec_top_ids[slot, :k] = torch.tensor(speculative.top_ids, dtype=torch.int32)
            self.spec_top_probs[slot, :k] = torch.tensor(speculative.top_probs,
                                                         dtype=torch.int32)
            self.spec_hidden[slot, : len(speculative.hidden)] = torch.tensor(speculative.hidden)
        self.room[slot, 0] = stored_room

    def names_ids(self, slot: int) -> bool:
        """Whether row ``slot`` carries the logprobs of named ids (its request asked)."""
        return bool(self.asked_logprob_ids[slot, 0] >= 0)

    def _check_speculative(self, row: SpeculativeRow) -> None:
        if not self.speculative_hidden:
            raise ValueError("these buffers carry no speculative columns; build them with "
                             "speculative_hidden=<the target's hidden size>")
        k = len(row.top_ids)
        if not 1 <= k <= SPEC_TOP_K or len(row.top_probs) != k or min(row.top_ids) < 0:
            raise ValueError(f"a speculative row needs 1..{SPEC_TOP_K} proposal ids (>= 0) and "
                             f"as many probabilities, got {row.top_ids!r}, {row.top_probs!r}")
        if len(row.hidden) != self.speculative_hidden:
            raise ValueError(f"the hidden state must have {self.speculative_hidden} values, "
                             f"got {len(row.hidden)}")

    def _clear_speculative(self, slot: int) -> None:
        self.spec_top_ids[slot].fill_(-1)
        self.spec_top_probs[slot].zero_()
        self.spec_hidden[slot].zero_()

    def _read_speculative(self, slot: int) -> SpeculativeRow | None:
        ids: list[int] = self.spec_top_ids[slot].tolist()
        k = sum(1 for i in ids if i >= 0)
        if not k:
            return None
        probs: list[int] = self.spec_top_probs[slot, :k].tolist()
        hidden: list[float] = self.spec_hidden[slot, : self.speculative_hidden].tolist()
        return SpeculativeRow(tuple(ids[:k]), tuple(probs), tuple(hidden))

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
        asked_ids: list[int] = self.asked_logprob_ids[slot].tolist()
        asked_vals: list[float] = self.asked_logprob_vals[slot].tolist()
        speculative = self._read_speculative(slot) if self.speculative_hidden else None
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
            speculative=speculative,
            asked=tuple((t, v) for t, v in zip(asked_ids, asked_vals, strict=True) if t >= 0),
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
        self.asked_logprob_ids[slot].fill_(-1)
        self.asked_logprob_vals[slot].fill_(math.nan)
        self._clear_speculative(slot)

    def copy_row_from(self, src: MetadataBuffers, src_slot: int, dst_slot: int) -> None:
        """Copy ``src`` row ``src_slot`` into row ``dst_slot`` of these buffers, room last."""
        src._check_slot(src_slot)
        self._check_slot(dst_slot)
        if src.speculative_hidden != self.speculative_hidden:
            raise MetadataError(
                f"rows with speculative_hidden {src.speculative_hidden} do not fit buffers "
                f"with {self.speculative_hidden}: build both sides' buffers alike")
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
            for name, t in zip(self.fields, self._fields(), strict=True)
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

    def is_free(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._is_free[slot])

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
