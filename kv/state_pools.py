"""The state a hybrid model keeps beside its full-attention KV pool, who owns it, and the
description of every buffer a transfer engine reads.

Theory of operation
-------------------
A hybrid model's layers do not all keep the same KV. Beside the full-attention
:class:`~kv.pool.KVPool` (:attr:`StatePools.full`) a rank may hold, each one optional:

``swa`` (:class:`SWAPool`)
    The K/V of the sliding-window layers, in a pool of their own with their own page allocator.
    Every page a request holds in the full pool has one page here, taken and given back with
    it; :meth:`SWAPool.translate` maps full-pool page indices to SWA-pool ones (they differ:
    the SWA pool may hold fewer pages). The decode side needs only the last window: the last
    chunk sends the SWA pages that cover tokens ``[page_floor(len - W), len)``.
``recurrent`` (:class:`RecurrentPool`)
    The state of recurrent (Mamba-style) layers: one slot per request whatever its length,
    from an allocator of its own; the last chunk sends the slot.
``index`` (:class:`IndexPool`)
    NSA-style index keys: one page per full-pool page, at the *same* index (no allocator of
    its own); the last chunk sends every page of the request.
``draft``
    A draft model's KV: a :class:`~kv.pool.KVPool` of the draft's geometry with as many pages
    as the full pool. It shares the target's page indices (its own allocator is never used),
    so every chunk sends the draft's copies of the pages it sends from the full pool.

What each chunk sends is :func:`kv.state_sends.chunk_send`'s answer; between parallel layouts
each rank sends its share (:mod:`kv.state_routes`). A pipeline stage's pools hold some layers of
the whole model's pool of each name: ``StatePools(..., stage={name: layers})`` names them
(:meth:`StatePools.stage_layers`; every layer by default).

Ownership: a request's SWA pages and recurrent slot are its own, like its full pages. The
scheduler takes them with the request's pages (:meth:`StatePools.grow`,
:meth:`StatePools.take_slot`); the releaser gives them back with its pages, once, when no
transfer can read them any more (:meth:`StatePools.release`). A page or slot given back twice
raises. :meth:`StatePools.check_conservation` is the pools' half of invariant 3.

Buffers: :meth:`StatePools.contiguous_buffer_infos` lists the full pool's regions, then the
draft's (what SGLang's ``get_contiguous_buf_infos`` gives); :meth:`StatePools.state_buffer_infos`
each state pool's (``get_state_buf_infos``). Every entry is a pointer, a length and an item
length: item ``i`` (a page, or a slot) of the buffer is ``item_len`` bytes at
``ptr + i * item_len``. Every state buffer has the shape ``[regions, items, item_elems]`` as seen
by :meth:`items_view`, so one copy routine moves items of any kind.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence

import torch

from kv.metadata import BufferInfo, SlotAllocator
from kv.pool import KVPool, KVPoolError
from kv.state_shapes import StateShape

_UNMAPPED = -1


class StateKind(enum.StrEnum):
    """A kind of per-request state the last chunk carries (``state_indices`` by kind)."""

    SWA = "swa"
    RECURRENT = "recurrent"
    INDEX = "index"


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _infos(buffer: torch.Tensor, prefix: str) -> list[BufferInfo]:
    """One entry per region of a ``[regions, items, ...]`` buffer."""
    regions, items = buffer.shape[0], buffer.shape[1]
    length = buffer[0].numel() * buffer.element_size() if regions else 0
    return [
        BufferInfo(f"{prefix}.layer{r}", buffer[r].data_ptr(), length, length // items)
        for r in range(regions)
    ]


class SWAPool:
    """The sliding-window layers' pages (window ``window`` tokens), with the map from the full
    pool's pages (``full_pages`` of them) to its own."""

    def __init__(self, *, window: int, pool: KVPool, full_pages: int) -> None:
        _check_positive(window=window, full_pages=full_pages)
        self.window = window
        self.pool = pool
        self._map = [_UNMAPPED] * full_pages

    @property
    def full_pages(self) -> int:
        """Pages of the full pool this pool maps."""
        return len(self._map)

    def grow(self, full_pages: Sequence[int], after: int | None = None) -> bool:
        """Give each of ``full_pages`` an SWA page (continuing the run of the SWA page of full
        page ``after``, when given); all or nothing: False when too few are free."""
        for p in full_pages:
            if self._map[p] != _UNMAPPED:
                raise KVPoolError(f"full page {p} already has SWA page {self._map[p]}")
        prev = None if after is None else self._map[after]
        got = self.pool.allocator.alloc(len(full_pages), after=prev)
        if got is None:
            return False
        for full, swa in zip(full_pages, got, strict=True):
            self._map[full] = swa
        return True

    def translate(self, full_pages: Iterable[int]) -> list[int]:
        """The SWA page of each of ``full_pages``; KVPoolError for one that has none."""
        out = []
        for p in full_pages:
            swa = self._map[p]
            if swa == _UNMAPPED:
                raise KVPoolError(f"full page {p} has no SWA page (never taken, or freed)")
            out.append(swa)
        return out

    def release(self, full_pages: Sequence[int]) -> None:
        """Free the SWA pages of ``full_pages``; KVPoolError (nothing freed) when one has
        none."""
        swa = self.translate(full_pages)
        self.pool.allocator.free(swa)
        for p in full_pages:
            self._map[p] = _UNMAPPED

    def mapped(self) -> int:
        """Full pages that have an SWA page."""
        return sum(1 for swa in self._map if swa != _UNMAPPED)


class RecurrentPool:
    """One state slot per request: row ``slot`` of a ``[layers, slots, state_size]`` tensor
    (a model's own, e.g. ``LlamaModel.make_states``, or :meth:`zeros`)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        if buffer.dim() != 3 or 0 in buffer.shape:
            raise ValueError(f"a recurrent state tensor is [layers, slots, state_size], none "
                             f"empty; got shape {tuple(buffer.shape)}")
        self.buffer = buffer
        self.num_slots = buffer.shape[1]
        self.allocator = SlotAllocator(self.num_slots)

    @classmethod
    def zeros(cls, *, num_layers: int, num_slots: int, state_size: int,
              dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> RecurrentPool:
        _check_positive(num_layers=num_layers, num_slots=num_slots, state_size=state_size)
        return cls(torch.zeros((num_layers, num_slots, state_size), dtype=dtype, device=device))

    def items_view(self) -> torch.Tensor:
        return self.buffer


class IndexPool:
    """NSA-style index keys: ``[layers, pages, page_size, dim]``, at the full pool's page
    indices."""

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        _check_positive(num_layers=num_layers, num_pages=num_pages, page_size=page_size, dim=dim)
        self.num_pages, self.page_size = num_pages, page_size
        self.buffer = torch.zeros((num_layers, num_pages, page_size, dim), dtype=dtype,
                                  device=device)

    def items_view(self) -> torch.Tensor:
        return self.buffer.view(self.buffer.shape[0], self.num_pages, -1)


def items_view(pool: KVPool | RecurrentPool | IndexPool) -> torch.Tensor:
    """``[regions, items, item_elems]``: what a transfer copies item by item (a page of a
    :class:`KVPool` over one region, a slot, an index page)."""
    return pool.page_view() if isinstance(pool, KVPool) else pool.items_view()


def layer_count(pool: KVPool | RecurrentPool | IndexPool) -> int:
    """The layers ``pool`` holds (its first dimension's, for a state pool)."""
    return pool.num_layers if isinstance(pool, KVPool) else pool.buffer.shape[0]


def shape_of(pool: KVPool | RecurrentPool | IndexPool) -> StateShape:
    """What another side's pool must match for items to move between them."""
    view = items_view(pool)
    return StateShape(regions=view.shape[0], items=view.shape[1],
                      item_len=view.shape[2] * view.element_size(),
                      dtype=str(view.dtype).removeprefix("torch."),
                      layout=pool.layout.value if isinstance(pool, KVPool) else "")


class StatePools:
    """The full-attention pool and the optional state pools beside it (module docstring)."""

    def __init__(self, full: KVPool, *, swa: SWAPool | None = None,
                 recurrent: RecurrentPool | None = None, index: IndexPool | None = None,
                 draft: KVPool | None = None, stage: Mapping[str, range] | None = None) -> None:
        problems = []
        if swa is not None:
            if swa.pool.page_size != full.page_size:
                problems.append(f"swa page_size {swa.pool.page_size}")
            if swa.full_pages != full.num_pages:
                problems.append(f"swa maps {swa.full_pages} full pages")
        for name, other in (("index", index), ("draft", draft)):
            if other is not None and (other.num_pages, other.page_size) != (
                    full.num_pages, full.page_size):
                problems.append(f"{name} (num_pages, page_size) "
                                f"{(other.num_pages, other.page_size)}")
        self.full, self.swa, self.recurrent, self.index, self.draft = (
            full, swa, recurrent, index, draft)
        self._stage = dict(stage or {})
        for name, held in self._stage.items():
            pool = self.named_pools().get(name)
            if pool is None or len(held) != layer_count(pool) or held.start < 0:
                problems.append(f"stage {name} layers {held.start}..{held.stop} "
                                f"({'no such pool' if pool is None else layer_count(pool)})")
        if problems:
            raise ValueError(
                f"state pools do not fit the full pool ({full.num_pages} pages of "
                f"{full.page_size} tokens): {'; '.join(problems)}")

    @property
    def kinds(self) -> tuple[StateKind, ...]:
        """The state kinds the last chunk carries, in :class:`StateKind` order."""
        present = {StateKind.SWA: self.swa, StateKind.RECURRENT: self.recurrent,
                   StateKind.INDEX: self.index}
        return tuple(kind for kind, pool in present.items() if pool is not None)

    def stage_layers(self) -> dict[str, range]:
        """Each pool of :meth:`named_pools` by the layers of the whole model's pool of that name
        this rank holds: a pipeline stage's (``StatePools(..., stage=)``), else every layer."""
        return {name: self._stage.get(name, range(layer_count(pool)))
                for name, pool in self.named_pools().items()}

    @property
    def recurrent_width(self) -> int:
        """The channels of this rank's recurrent state (0 without a recurrent pool)."""
        return 0 if self.recurrent is None else self.recurrent.buffer.shape[2]

    @property
    def window(self) -> int | None:
        return None if self.swa is None else self.swa.window

    # -- ownership -------------------------------------------------------------------------

    def pages_available(self) -> int:
        """Pages a new chunk can take: the fewer free of the full and the SWA pool."""
        free = self.full.allocator.available()
        return free if self.swa is None else min(free, self.swa.pool.allocator.available())

    def slots_available(self) -> int | None:
        """Free recurrent slots (None without a recurrent pool)."""
        return None if self.recurrent is None else self.recurrent.allocator.available()

    def grow(self, full_pages: Sequence[int], after: int | None = None) -> None:
        """``full_pages`` were just taken for a request: take their SWA pages. The caller
        counted :meth:`pages_available`, so they are there."""
        if self.swa is not None and full_pages and not self.swa.grow(full_pages, after):
            raise AssertionError(f"{len(full_pages)} SWA pages planned, not free")

    def take_slot(self) -> int | None:
        """A recurrent slot, zeroed (a fresh request's state), for a request that starts
        holding pages (None without a recurrent pool); AssertionError when none is free (the
        planner counted them)."""
        if self.recurrent is None:
            return None
        slot = self.recurrent.allocator.alloc()
        if slot is None:
            raise AssertionError("a recurrent slot was planned, none is free")
        self.recurrent.buffer[:, slot].zero_()
        return slot

    def release(self, full_pages: Sequence[int], slot: int | None) -> None:
        """Give back the SWA pages of ``full_pages`` and the recurrent ``slot``, before the full
        pages themselves (their translation is still known)."""
        if self.swa is not None and full_pages:
            self.swa.release(full_pages)
        if slot is not None:
            if self.recurrent is None:
                raise KVPoolError(f"recurrent slot {slot} released without a recurrent pool")
            self.recurrent.allocator.free(slot)

    def check_conservation(self, held_pages: Iterable[Sequence[int]], held_slots: int) -> None:
        """Raise KVPoolError unless the SWA pages of the full pages in ``held_pages`` (one list
        per holder) and the free SWA pages partition the SWA pool, and ``held_slots`` plus the
        free slots are every recurrent slot."""
        lists = [list(pages) for pages in held_pages]
        if self.swa is not None:
            swa = self.swa
            swa.pool.allocator.check_conservation(swa.translate(p) for p in lists)
            if swa.mapped() != sum(map(len, lists)):
                raise KVPoolError(f"{swa.mapped()} full pages have an SWA page, "
                                  f"{sum(map(len, lists))} are held")
        rec = self.recurrent
        if rec is None:
            if held_slots:
                raise KVPoolError(f"{held_slots} recurrent slots held without a recurrent pool")
        elif rec.allocator.available() + held_slots != rec.num_slots:
            raise KVPoolError(f"recurrent slots: free {rec.allocator.available()} + held "
                              f"{held_slots} != {rec.num_slots}")

    def all_free(self) -> bool:
        """No SWA page and no recurrent slot is held."""
        rec = self.recurrent
        return (self.swa is None or self.swa.pool.allocator.in_use() == 0) and (
            rec is None or rec.allocator.available() == rec.num_slots)

    # -- buffers ---------------------------------------------------------------------------

    def contiguous_buffer_infos(self) -> list[BufferInfo]:
        """The full pool's regions, then the draft pool's (names ``draft.``...)."""
        infos = self.full.buffer_infos()
        if self.draft is not None:
            infos += self.draft.buffer_infos("draft.")
        return infos

    def state_buffer_infos(self) -> dict[StateKind, list[BufferInfo]]:
        """Each state pool's regions, by kind: an SWA page, a recurrent slot or an index page
        per item."""
        out: dict[StateKind, list[BufferInfo]] = {}
        if self.swa is not None:
            out[StateKind.SWA] = self.swa.pool.buffer_infos("swa.")
        if self.recurrent is not None:
            out[StateKind.RECURRENT] = _infos(self.recurrent.buffer, "recurrent")
        if self.index is not None:
            out[StateKind.INDEX] = _infos(self.index.items_view(), "index")
        return out

    def named_pools(self) -> dict[str, KVPool | RecurrentPool | IndexPool]:
        """The draft pool and each state pool, by name (``kv.state_shapes.POOL_NAMES``)."""
        out: dict[str, KVPool | RecurrentPool | IndexPool] = {}
        if self.draft is not None:
            out["draft"] = self.draft
        out |= {str(kind): self.state_pool(kind) for kind in self.kinds}
        return out

    def shapes(self) -> dict[str, StateShape]:
        """Each pool of :meth:`named_pools` as the other side must match it."""
        return {name: shape_of(pool) for name, pool in self.named_pools().items()}

    def state_pool(self, kind: StateKind) -> KVPool | RecurrentPool | IndexPool:
        """The pool that holds ``kind``'s state (KeyError when there is none)."""
        pool = {StateKind.SWA: None if self.swa is None else self.swa.pool,
                StateKind.RECURRENT: self.recurrent, StateKind.INDEX: self.index}[kind]
        if pool is None:
            raise KeyError(f"no {kind} pool")
        return pool


def pages_admissible(states: StatePools | None, num_pages: int) -> tuple[int, str]:
    """The most pages one request can ever hold, and the pool that bounds them: the full
    pool's, or fewer with a smaller SWA pool (a longer prompt is refused when admitted, not
    left waiting)."""
    if states is None or states.swa is None or states.swa.pool.num_pages >= num_pages:
        return num_pages, "the KV pool"
    return states.swa.pool.num_pages, "the SWA pool (HybridConfig.swa_pages)"
