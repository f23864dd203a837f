"""The state pools beside the full-attention pool (kv.state_pools): SWA pages and their
translation, recurrent slots, ownership given back exactly once, and the buffer descriptions
a transfer engine reads (checked against the bytes at the addresses they name)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kv.metadata import BufferInfo, MetadataError
from kv.pool import KVPool, KVPoolError
from kv.pool_layout import KVLayout
from kv.state_pools import IndexPool, RecurrentPool, StateKind, StatePools, SWAPool, items_view


def _kv(num_pages: int = 8, layers: int = 2, layout: KVLayout = KVLayout.LAYER_MAJOR,
        heads: int = 2) -> KVPool:
    return KVPool(num_layers=layers, num_pages=num_pages, page_size=4, kv_heads=heads,
                  head_dim=3, layout=layout)


def _pools(full_pages: int = 8, swa_pages: int = 6, slots: int = 3,
           layout: KVLayout = KVLayout.LAYER_MAJOR) -> StatePools:
    full = _kv(full_pages, layout=layout)
    return StatePools(
        full,
        swa=SWAPool(window=6, pool=_kv(swa_pages, layers=1, layout=layout),
                    full_pages=full_pages),
        recurrent=RecurrentPool.zeros(num_layers=2, num_slots=slots, state_size=5,
                                      dtype=torch.int64),
        index=IndexPool(num_layers=2, num_pages=full_pages, page_size=4, dim=3),
        draft=_kv(full_pages, layers=1, heads=1, layout=layout),
    )


def test_swa_pages_follow_full_pages_and_translate() -> None:
    states = _pools()
    assert states.kinds == (StateKind.SWA, StateKind.RECURRENT, StateKind.INDEX)
    assert states.window == 6
    full = states.full.allocator.alloc(3)
    assert full is not None
    states.grow(full)
    assert states.swa is not None
    swa = states.swa.translate(full)
    assert len(set(swa)) == 3 and states.swa.pool.allocator.in_use() == 3
    more = states.full.allocator.alloc(2, after=full[-1])
    assert more is not None
    states.grow(more, after=full[-1])
    # The SWA run continues too, so the window's pages stay one run.
    assert states.swa.translate(more) == [swa[-1] + 1, swa[-1] + 2]
    assert states.pages_available() == min(8 - 5, 6 - 5) == 1
    states.check_conservation([full + more], 0)
    with pytest.raises(KVPoolError, match="already has SWA page"):
        states.grow(full[:1])


def test_release_is_exactly_once_and_the_pools_refill() -> None:
    states = _pools()
    full = states.full.allocator.alloc(2)
    assert full is not None
    states.grow(full)
    slot = states.take_slot()
    assert slot is not None and states.slots_available() == 2
    states.check_conservation([full], 1)
    states.release(full, slot)
    states.full.allocator.free(full)
    assert states.all_free()
    states.check_conservation([], 0)
    with pytest.raises(KVPoolError, match="has no SWA page"):
        states.release(full, None)
    with pytest.raises(MetadataError, match="freed twice"):
        states.release([], slot)


def test_a_taken_slot_starts_zeroed() -> None:
    states = _pools(slots=1)
    assert states.recurrent is not None
    slot = states.take_slot()
    assert slot is not None
    states.recurrent.buffer[:, slot] = 7
    states.release([], slot)
    assert states.take_slot() == slot
    assert int(states.recurrent.buffer[:, slot].abs().sum()) == 0
    with pytest.raises(AssertionError, match="none is free"):
        states.take_slot()


def test_conservation_names_what_leaked() -> None:
    states = _pools()
    full = states.full.allocator.alloc(2)
    assert full is not None
    states.grow(full)
    states.take_slot()
    with pytest.raises(KVPoolError, match="neither free nor held"):
        states.check_conservation([full[:1]], 1)
    with pytest.raises(KVPoolError, match="recurrent slots: free 2 \\+ held 0 != 3"):
        states.check_conservation([full], 0)
    with pytest.raises(KVPoolError, match="has no SWA page"):
        states.check_conservation([[*full, 7]], 1)


def test_state_pools_must_fit_the_full_pool() -> None:
    full = _kv(8)
    with pytest.raises(ValueError, match="swa maps 6 full pages; draft"):
        StatePools(full, swa=SWAPool(window=4, pool=_kv(4, layers=1), full_pages=6),
                   draft=_kv(7))
    with pytest.raises(ValueError, match="window must be > 0"):
        SWAPool(window=0, pool=_kv(4), full_pages=8)
    with pytest.raises(ValueError, match="num_slots must be > 0"):
        RecurrentPool.zeros(num_layers=1, num_slots=0, state_size=4)
    with pytest.raises(ValueError, match="got shape \\(2, 3\\)"):
        RecurrentPool(torch.zeros(2, 3))


def test_no_state_pools_hold_nothing() -> None:
    states = StatePools(_kv())
    assert states.kinds == () and states.window is None
    assert states.slots_available() is None and states.take_slot() is None
    assert states.state_buffer_infos() == {} and states.all_free()
    states.grow([1, 2])  # nothing to take
    states.check_conservation([[1, 2]], 0)
    with pytest.raises(KVPoolError, match="without a recurrent pool"):
        states.check_conservation([], 1)


def _bytes_at(info: BufferInfo, item: int) -> bytes:
    return ctypes.string_at(info.ptr + item * info.item_len, info.item_len)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_buffer_infos_name_the_bytes_of_every_item(layout: KVLayout) -> None:
    states = _pools(layout=layout)
    assert states.swa is not None and states.recurrent is not None
    assert states.index is not None and states.draft is not None
    for tensor in (states.full.buffer, states.draft.buffer, states.swa.pool.buffer,
                   states.index.buffer):
        tensor.copy_(torch.randn(tensor.shape))
    states.recurrent.buffer.copy_(torch.randint(-9, 9, states.recurrent.buffer.shape))
    contiguous = states.contiguous_buffer_infos()
    regions = states.full.regions
    assert len(contiguous) == regions + states.draft.regions
    assert all(i.name.startswith("draft.") for i in contiguous[regions:])
    by_kind = states.state_buffer_infos()
    assert list(by_kind) == [StateKind.SWA, StateKind.RECURRENT, StateKind.INDEX]
    pools = {StateKind.SWA: states.swa.pool, StateKind.RECURRENT: states.recurrent,
             StateKind.INDEX: states.index}
    cases = [(contiguous[:regions], states.full), (contiguous[regions:], states.draft)]
    cases += [(by_kind[kind], pool) for kind, pool in pools.items()]
    for infos, pool in cases:
        view = items_view(pool)
        assert len(infos) == view.shape[0]
        for region, info in enumerate(infos):
            assert info.length == info.item_len * view.shape[1]
            for item in (0, view.shape[1] - 1):
                want = view[region, item].contiguous().view(torch.uint8).numpy().tobytes()
                assert _bytes_at(info, item) == want, (info.name, item)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=40))
def test_grow_and_release_keep_the_pools_conserved(ops: list[tuple[bool, int]]) -> None:
    states = _pools(full_pages=12, swa_pages=9, slots=3)
    held: list[tuple[list[int], int | None]] = []
    for grow, n in ops:
        if grow and n <= states.pages_available() and states.slots_available():
            pages = states.full.allocator.alloc(n)
            assert pages is not None
            states.grow(pages)
            held.append((pages, states.take_slot()))
        elif held:
            pages, slot = held.pop(n % len(held))
            states.release(pages, slot)
            states.full.allocator.free(pages)
        states.check_conservation([p for p, _ in held], len(held))
    for pages, slot in held:
        states.release(pages, slot)
        states.full.allocator.free(pages)
    assert states.all_free()
