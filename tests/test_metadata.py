"""Metadata buffers (first-token rows, room written last) and the slot allocator."""

from __future__ import annotations

import math

import pytest
import torch

from kv.metadata import MetadataBuffers, MetadataError, MetadataRow, SlotAllocator
from lifecycle import TOKEN_IDS_LOGPROB_MAX, TOP_LOGPROBS_MAX

BIG_ROOM = (1 << 64) - 3  # rooms are unsigned 64-bit; this one is negative as int64


def test_a_written_row_reads_back_with_its_room() -> None:
    buf = MetadataBuffers(4)
    buf.write(2, first_token=42, cached_tokens=16, logprob=-1.25, room=BIG_ROOM)
    assert buf.read(2) == MetadataRow(42, 16, -1.25, BIG_ROOM)
    assert buf.read(2, expected_room=BIG_ROOM) is not None
    buf.write(1, first_token=7, cached_tokens=0, logprob=None, room=5)
    row = buf.read(1)
    assert row is not None and row.logprob is None


def test_unlanded_rows_read_as_none() -> None:
    buf = MetadataBuffers(3)
    assert buf.read(0) is None
    # A torn row: fields written, the room (written last) not yet.
    buf.output_ids[0, 0] = 99
    buf.cached_tokens[0, 0] = 3
    assert buf.read(0) is None
    buf.write(1, first_token=1, cached_tokens=0, logprob=None, room=8)
    buf.clear(1)
    assert buf.read(1) is None
    assert int(buf.output_ids[1, 0]) == 0


def test_a_foreign_row_is_detected() -> None:
    buf = MetadataBuffers(2)
    buf.write(0, first_token=3, cached_tokens=0, logprob=None, room=1111)
    with pytest.raises(MetadataError, match="holds room 1111, expected room 2222"):
        buf.read(0, expected_room=2222)


def test_bad_slots_and_rooms_are_rejected() -> None:
    buf = MetadataBuffers(2)
    with pytest.raises(MetadataError, match="slot 2"):
        buf.read(2)
    with pytest.raises(ValueError, match="room"):
        buf.write(0, first_token=1, cached_tokens=0, logprob=None, room=1 << 64)
    with pytest.raises(ValueError, match="num_slots"):
        MetadataBuffers(0)


def test_rows_are_padded_and_buffer_infos_describe_them() -> None:
    buf = MetadataBuffers(5)
    infos = buf.buffer_infos()
    assert [i.name for i in infos] == ["output_ids", "cached_tokens", "logprob",
                                       "top_logprob_ids", "top_logprob_vals",
                                       "asked_logprob_ids", "asked_logprob_vals", "room"]
    tensors = (buf.output_ids, buf.cached_tokens, buf.logprob, buf.top_logprob_ids,
               buf.top_logprob_vals, buf.asked_logprob_ids, buf.asked_logprob_vals, buf.room)
    for info, tensor in zip(infos, tensors, strict=True):
        assert info.item_len >= 64 and info.item_len % 64 == 0
        assert info.length == 5 * info.item_len
        assert info.ptr == tensor.data_ptr()
    buf.write(3, first_token=77, cached_tokens=0, logprob=None, room=9)
    # Row 3 of a field is at ptr + 3 * item_len: read it through a flat byte view.
    flat = buf.output_ids.view(torch.uint8).flatten()
    row = flat[3 * infos[0].item_len : 4 * infos[0].item_len].view(torch.int32)
    assert int(row[0]) == 77


def test_copy_row_from_moves_the_whole_row() -> None:
    src, dst = MetadataBuffers(2), MetadataBuffers(4)
    src.write(1, first_token=5, cached_tokens=2, logprob=-0.5, room=BIG_ROOM,
              top=[(5, -0.5), (8, -1.5)], asked=[(8, -1.5), (3, -math.inf)])
    dst.write(3, first_token=9, cached_tokens=9, logprob=None, room=17, top=[(1, -0.25)] * 3,
              asked=[(1, -0.25)] * 4)
    dst.copy_row_from(src, 1, 3)
    assert dst.read(3, expected_room=BIG_ROOM) == MetadataRow(
        5, 2, -0.5, BIG_ROOM, top=((5, -0.5), (8, -1.5)), asked=((8, -1.5), (3, -math.inf)))


def test_top_logprobs_fill_the_row_up_to_the_limit() -> None:
    buf = MetadataBuffers(2)
    top = [(1000 + i, -0.5 * i) for i in range(TOP_LOGPROBS_MAX)]  # halves: exact in float32
    buf.write(0, first_token=1000, cached_tokens=0, logprob=0.0, room=3, top=top)
    row = buf.read(0, expected_room=3)
    assert row is not None and row.top == tuple(top)
    # TOP_LOGPROBS_MAX int32/float32 items, padded to whole 64-byte blocks.
    assert buf.top_logprob_ids.shape[1] * 4 == -(-TOP_LOGPROBS_MAX * 4 // 64) * 64
    with pytest.raises(ValueError, match="top logprobs"):
        buf.write(1, first_token=1, cached_tokens=0, logprob=None, room=4, top=[*top, (1, 0.0)])
    # A shorter list replaces the whole old one; clearing drops it.
    buf.write(0, first_token=1, cached_tokens=0, logprob=None, room=3, top=[(7, -1.0)])
    row = buf.read(0)
    assert row is not None and row.top == ((7, -1.0),)
    buf.clear(0)
    buf.write(0, first_token=1, cached_tokens=0, logprob=None, room=3)
    row = buf.read(0)
    assert row is not None and row.top == ()


def test_named_ids_logprobs_fill_the_row_up_to_the_limit() -> None:
    buf = MetadataBuffers(2)
    asked = [(i % 5, -0.25 * i) for i in range(TOKEN_IDS_LOGPROB_MAX)]  # ids may repeat
    buf.write(0, first_token=3, cached_tokens=0, logprob=-1.0, room=3, asked=asked)
    row = buf.read(0, expected_room=3)
    assert row is not None and row.asked == tuple(asked) and row.top == ()
    with pytest.raises(ValueError, match="asked logprobs"):
        buf.write(1, first_token=1, cached_tokens=0, logprob=None, room=4,
                  asked=[*asked, (1, 0.0)])
    buf.clear(0)
    buf.write(0, first_token=1, cached_tokens=0, logprob=None, room=3)
    row = buf.read(0)
    assert row is not None and row.asked == ()


def test_slot_allocator_is_fifo_and_waits_when_exhausted() -> None:
    slots = SlotAllocator(3)
    assert [slots.alloc(), slots.alloc(), slots.alloc()] == [0, 1, 2]
    assert slots.alloc() is None
    assert slots.available() == 0
    slots.free(1)
    slots.free(0)
    assert slots.available() == 2
    assert slots.alloc() == 1
    assert slots.alloc() == 0


def test_slot_allocator_detects_double_free_and_foreign_slots() -> None:
    slots = SlotAllocator(2)
    slot = slots.alloc()
    assert slot is not None
    slots.free(slot)
    with pytest.raises(MetadataError, match="freed twice"):
        slots.free(slot)
    with pytest.raises(MetadataError, match="not in this allocator"):
        slots.free(5)
    assert slots.available() == 2
