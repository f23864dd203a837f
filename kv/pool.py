"""The paged KV pool and its page allocator.

Layout: one contiguous tensor ``[layers, 2 (K, V), pages, page_size, kv_heads, head_dim]``.
For a given layer and K/V half, the pages are contiguous and page-major, so one page of one
layer is a contiguous run of ``page_bytes`` bytes and a run of consecutive pages is one
contiguous region: a transfer engine moves a run with one write per layer half.
"""

from __future__ import annotations

import torch


class KVPoolError(Exception):
    """A page was freed twice, or a page that the pool does not own was freed."""


class PageAllocator:
    """Free list of page indices; alloc is all-or-nothing."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, or None (and nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise KVPoolError(f"page {p} is not in this pool (0..{self.num_pages - 1})")
            if self._is_free[p]:
                raise KVPoolError(f"page {p} freed twice")
        for p in pages:
            self._is_free[p] = 1
        self._free.extend(reversed(pages))


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
        self.buffer = torch.zeros(
            (num_layers, 2, num_pages, page_size, kv_heads, head_dim), dtype=dtype, device=device
        )
        self.allocator = PageAllocator(num_pages)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.kv_heads * self.head_dim * self.buffer.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def k(self, layer: int) -> torch.Tensor:
        """``[pages, page_size, kv_heads, head_dim]`` view of one layer's keys."""
        return self.buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1]
