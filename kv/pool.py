"""The paged KV pool and its page allocator.

Layout: one contiguous tensor, in one of two orders (:mod:`kv.pool_layout`): layer-major
``[layers, 2 (K, V), pages, page_size, kv_heads, head_dim]`` (SGLang's), where a run of
consecutive pages is one contiguous region per layer half, or page-major ``[pages, layers, 2,
page_size, kv_heads, head_dim]``, where a run of consecutive pages is one contiguous region. A
transfer moves a run with one write per region (:attr:`KVPool.regions`). That is why
:class:`PageAllocator` works to keep each request's pages consecutive. Whatever the order, the
model reads and writes one layer through :meth:`KVPool.kv_slots` and :meth:`KVPool.slot_rows`,
and :meth:`KVPool.by_layer` shows the pool in layer-major order (strided when it is not).

Ownership: the allocator knows which pages are free; the owner of a request knows which pages
the request holds. :meth:`PageAllocator.check_conservation` compares the two, so invariant
checks can assert that every page is either free or held by exactly one live request.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence

import attrs
import torch

from kv.metadata import BufferInfo
from kv.model_id import MAX_MODEL_NAME, describe_model
from kv.pages import kv_bytes
from kv.pool_layout import KVLayout, parse_kv_layout


class KVPoolError(Exception):
    """A page was freed twice, one that the pool does not own was freed, or the
    pages held by requests and the free list disagree."""


class KVGeometryError(ValueError):
    """Two pools that must exchange pages disagree on their page layout or their model."""


@attrs.frozen
class KVGeometry:
    """What two pools must agree on for a page of one to be copied into a page of the other."""

    num_layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    #: The fingerprint of the model whose K/V the pool holds ("" when unnamed): pages of one
    #: model's KV mean nothing to another with the same shapes.
    model: str = ""
    #: What the model was loaded as (``smollm2``, a path), for messages only: two copies of
    #: one checkpoint loaded under different names are the same model.
    model_name: str = attrs.field(default="", eq=False)
    #: The order of the pool's tensor: the same pages sit at other offsets in another order.
    layout: KVLayout = KVLayout.LAYER_MAJOR

    @property
    def model_label(self) -> str:
        return describe_model(self.model_name, self.model)

    def mismatches(self, other: KVGeometry) -> list[str]:
        """``"field: mine vs theirs"`` for every field that differs (empty when compatible);
        the models are named by :func:`describe_model`."""
        out = []
        for f in attrs.fields(KVGeometry):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.eq and mine != theirs:
                if f.name == "model":
                    mine, theirs = self.model_label, other.model_label
                out.append(f"{f.name}: {mine} vs {theirs}")
        return out


class PageAllocator:
    """Free pages kept as maximal runs of consecutive indices; alloc is all-or-nothing.

    Allocation keeps requests contiguous, because a transfer moves one block per run of
    consecutive pages per layer half (see :mod:`kv.pages`): it takes ``n`` pages from the
    smallest free run that holds them all (best fit, lowest index on ties), and only when no run
    is long enough, from the longest runs first, so a request spans as few runs as possible.
    ``after`` (the last page a request already holds) asks to continue that run: the free run
    starting at ``after + 1`` is used first. ``fit`` (the pages the whole request will need,
    when ``n`` is only its first chunk) picks the run by that size instead (the longest when
    none holds it), so the later chunks find free pages right after the first. Freed pages
    merge with their free neighbours, so the pool does not shred under churn.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._is_free = bytearray(b"\x01") * num_pages
        self._available = 0
        self._runs: dict[int, int] = {}  # start -> length
        self._ends: dict[int, int] = {}  # end (exclusive) -> start
        self._by_length: list[tuple[int, int]] = []  # (length, start), sorted
        self._add_run(0, num_pages)

    def available(self) -> int:
        return self._available

    def free_runs(self) -> list[tuple[int, int]]:
        """The free runs as ``(start, length)``, by start."""
        return sorted(self._runs.items())

    def alloc(
        self, n: int, after: int | None = None, fit: int | None = None
    ) -> list[int] | None:
        """``n`` pages, ascending within each run, or None (and nothing taken) when fewer are
        free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._available:
            return None
        pages: list[int] = []
        if n and after is not None and after + 1 in self._runs:
            pages += self._take(after + 1, min(n, self._runs[after + 1]))
        elif n and fit is not None and fit > n:
            # The best fit for the whole request, else the longest run: the most room to grow.
            i = min(bisect.bisect_left(self._by_length, (fit, -1)), len(self._by_length) - 1)
            length, start = self._by_length[i]
            pages += self._take(start, min(n, length))
        while len(pages) < n:
            need = n - len(pages)
            i = bisect.bisect_left(self._by_length, (need, -1))
            if i < len(self._by_length):
                pages += self._take(self._by_length[i][1], need)
            else:
                length, start = self._by_length[-1]
                pages += self._take(start, length)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return ``pages``; raises :class:`KVPoolError` (and frees nothing) if one is not in
        the pool, is already free, or is listed twice."""
        if not pages:
            return
        ordered = sorted(pages)
        for p in (ordered[0], ordered[-1]):
            if not 0 <= p < self.num_pages:
                raise KVPoolError(f"page {p} is not in this pool (0..{self.num_pages - 1})")
        runs: list[tuple[int, int]] = []
        start = prev = ordered[0]
        for p in itertools.islice(ordered, 1, None):
            if p != prev + 1:
                if p == prev:
                    raise KVPoolError(f"pages {ordered} contain a page twice (freed twice)")
                runs.append((start, prev + 1 - start))
                start = p
            prev = p
        runs.append((start, prev + 1 - start))
        for start, length in runs:
            span = self._is_free[start : start + length]
            if 1 in span:
                raise KVPoolError(f"page {start + span.index(1)} freed twice")
        for start, length in runs:
            self._release(start, length)

    def _take(self, start: int, k: int) -> range:
        """The first ``k`` pages of the free run at ``start``."""
        length = self._runs[start]
        self._drop_run(start, length)
        if k < length:
            self._add_run(start + k, length - k)
        self._is_free[start : start + k] = bytes(k)
        return range(start, start + k)

    def _release(self, start: int, length: int) -> None:
        """Return ``length`` pages from ``start`` to the free runs, merging with neighbours."""
        self._is_free[start : start + length] = b"\x01" * length
        end = start + length
        if start in self._ends:
            left = self._ends[start]
            self._drop_run(left, start - left)
            start = left
        if end in self._runs:
            right = self._runs[end]
            self._drop_run(end, right)
            end += right
        self._add_run(start, end - start)

    def _add_run(self, start: int, length: int) -> None:
        self._runs[start] = length
        self._ends[start + length] = start
        bisect.insort(self._by_length, (length, start))
        self._available += length

    def _drop_run(self, start: int, length: int) -> None:
        del self._runs[start]
        del self._ends[start + length]
        del self._by_length[bisect.bisect_left(self._by_length, (length, start))]
        self._available -= length

    def in_use(self) -> int:
        return self.num_pages - self._available

    def held_pages(self) -> list[int]:
        """Every page not on the free list, ascending."""
        return [p for p in range(self.num_pages) if not self._is_free[p]]

    def check_conservation(self, held: Iterable[Iterable[int]]) -> None:
        """Raise :class:`KVPoolError` unless the pages in ``held`` (one iterable per live
        request) and the free pages partition the pool: no page held twice, no held page free,
        no page lost."""
        seen = bytearray(self.num_pages)
        count = 0
        for pages in held:
            for p in pages:
                if not 0 <= p < self.num_pages:
                    raise KVPoolError(
                        f"held page {p} is not in this pool (0..{self.num_pages - 1})"
                    )
                if seen[p]:
                    raise KVPoolError(f"page {p} is held by two requests")
                if self._is_free[p]:
                    raise KVPoolError(f"page {p} is held by a request and also free")
                seen[p] = 1
                count += 1
        if count + self._available != self.num_pages:
            lost = [p for p in range(self.num_pages) if not seen[p] and not self._is_free[p]]
            raise KVPoolError(
                f"{len(lost)} pages are neither free nor held (first: {lost[:8]}); "
                f"free {self._available} + held {count} != {self.num_pages}"
            )


class KVPool:
    """The KV cache of one rank: the tensor and the allocator of its pages."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        model: str = "",
        model_name: str = "",
        layout: KVLayout | str = KVLayout.LAYER_MAJOR,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.model = model
        self.model_name = model_name[:MAX_MODEL_NAME]
        self.layout = parse_kv_layout(layout)
        shape = self.layout.shape(num_layers=num_layers, num_pages=num_pages,
                                  page_size=page_size, kv_heads=kv_heads, head_dim=head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.kv_heads * self.head_dim * self.buffer.element_size()

    def bytes_of_pages(self, num_pages: int) -> int:
        """Bytes of ``num_pages`` pages over every layer, K and V: what moving them copies."""
        return kv_bytes(num_pages, page_bytes=self.page_bytes, num_layers=self.num_layers)

    @property
    def regions(self) -> int:
        """Contiguous regions a run of consecutive pages occupies (``2 x layers`` layer-major,
        1 page-major): what a transfer moves per run."""
        return self.layout.regions(self.num_layers)

    @property
    def region_page_bytes(self) -> int:
        """Bytes of one page within one region; region ``r`` of page ``p`` starts at byte
        ``(r * num_pages + p) * region_page_bytes`` of the buffer."""
        return self.page_bytes * 2 * self.num_layers // self.regions

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(
            num_layers=self.num_layers,
            page_size=self.page_size,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            model=self.model,
            model_name=self.model_name,
            layout=self.layout,
        )

    def usage(self) -> float:
        """Fraction of pages in use (not free: held by requests, or held back until their
        transfer is quiescent), 0.0 .. 1.0."""
        return self.allocator.in_use() / self.num_pages

    def buffer_infos(self, prefix: str = "") -> list[BufferInfo]:
        """Every region of the buffer for a transfer engine, in memory order: page ``p`` of
        region ``r`` is at ``ptr + p * item_len`` (``layer<l>.k``/``.v`` layer-major, one
        ``pages`` page-major); ``prefix`` goes before each name."""
        if self.layout is KVLayout.PAGE_MAJOR:
            names = ["pages"]
        else:
            names = [f"layer{r // 2}.{'kv'[r % 2]}" for r in range(self.regions)]
        item, base = self.region_page_bytes, self.buffer.data_ptr()
        length = item * self.num_pages
        return [BufferInfo(prefix + name, base + r * length, length, item)
                for r, name in enumerate(names)]

    def page_view(self) -> torch.Tensor:
        """``[regions, pages, region_page_elems]`` view: a run of pages is a slice of dimension
        1 in each region (see :attr:`regions`). Copies of whole pages across all layers index
        dimension 1."""
        return self.buffer.view(self.regions, self.num_pages, -1)

    def by_layer(self) -> torch.Tensor:
        """``[layers, 2, pages, page_size, kv_heads, head_dim]`` view, whatever the layout
        (strided when page-major)."""
        if self.layout is KVLayout.LAYER_MAJOR:
            return self.buffer
        return self.buffer.permute(1, 2, 0, 3, 4, 5)

    def k(self, layer: int) -> torch.Tensor:
        """``[pages, page_size, kv_heads, head_dim]`` view of one layer's keys."""
        return self.by_layer()[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.by_layer()[layer, 1]

    def kv_slots(self, layer: int) -> torch.Tensor:
        """``[2 (K, V), rows, kv_heads, head_dim]`` view of one layer, for gathering and
        scattering token slots: the K and V of slot ``s`` (``page * page_size + offset``) are
        row ``slot_rows(s)`` of ``[0]`` and ``[1]``. Each half alone has no overlapping rows,
        so it can be written with ``index_copy_``.

        Layer-major, the rows are the layer's slots themselves. Page-major, the rows step
        through the buffer one token at a time from this layer's first key, so a row index
        skips the other layers' parts of each page; rows between a page's slots belong to
        other layers and are never named by :meth:`slot_rows`.
        """
        heads, dim, ps = self.kv_heads, self.head_dim, self.page_size
        if self.layout is KVLayout.LAYER_MAJOR:
            return self.buffer[layer].view(2, -1, heads, dim)
        token = heads * dim
        page_rows = 2 * self.num_layers * ps
        rows = (self.num_pages - 1) * page_rows + ps
        return self.buffer.as_strided(
            (2, rows, heads, dim), (ps * token, token, dim, 1),
            self.buffer.storage_offset() + layer * 2 * ps * token,
        )

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of :meth:`kv_slots` that hold the token slots ``slots`` (int64, any shape;
        the same rows in every layer)."""
        if self.layout is KVLayout.LAYER_MAJOR:
            return slots
        ps = self.page_size
        return slots // ps * (2 * self.num_layers * ps) + slots % ps
