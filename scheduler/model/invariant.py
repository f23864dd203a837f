"""Batch-invariant arithmetic: a token's floats do not depend on what it is batched with.

Theory of operation
-------------------
Disaggregated serving computes a prompt in chunks, batched with other requests' chunks, and
decodes it batched with other requests; the colocated run computes the same prompt alone in one
forward. Both must give the same tokens, so every float of every position must be the same bits
in both. Floating-point sums are not associative, so that holds only if no reduction's order
depends on the batch. Three rules make it so:

1. **Row-wise matmuls with at least** :data:`MIN_ROWS` **rows.** A BLAS matmul computes each
   output row with a reduction order that depends on its kernel, and the kernel it picks depends
   on the number of rows M: with very few rows it takes other paths (on the machines measured,
   rows computed with M = 1..11 differ from the same rows computed in a larger batch; with
   M >= 12 every row matched, for M up to 4096, at any offset, with 1 or 2 threads). So every
   matmul over tokens is padded to at least 16 rows (:func:`pad_rows`). RMSNorm, SiLU, the
   rotary products and the residual adds are row-wise elementwise ops or per-row reductions of a
   fixed length, which are row-independent too. ``tests/test_invariance.py`` checks all of this
   on the machine at hand.
2. **Attention over fixed, absolute key blocks.** A query at position ``p`` attends over keys
   ``0..p`` read back from the paged pool. The scores ``q @ k^T`` reduce over ``head_dim`` only
   (fixed). The softmax max is exact whatever the order. The weighted sum over keys is where the
   order could depend on the batch (how many keys the chunk sees, how many queries are batched),
   so keys are cut into blocks of :data:`KEY_BLOCK` *absolute* positions (block ``b`` holds
   ``b*KEY_BLOCK .. (b+1)*KEY_BLOCK-1``, the last padded and masked); each block's partial sums
   come from a matmul of fixed inner length, and the blocks are added in block order by a
   sequential scan (``cumsum``). Blocks past a query's position hold exact zeros, and adding
   zero changes nothing, so a query sees the same sums whether its chunk ends right after it
   or a thousand positions later.
3. **The same code for every shape.** Prefill chunks, one-token chunks and decode steps go
   through the same functions; grouping items (the decode steps of a batch share one batched
   matmul, a long prompt is cut into query tiles) only changes which rows share a matmul,
   never a row's arithmetic.

K/V is always written to the pool first and read back from it, so the current chunk's keys are
the pool's bits (the same bits a later chunk or the decode side reads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

#: Fewest rows of any matmul over tokens (rule 1).
MIN_ROWS = 16
#: Keys per attention block, in absolute positions (rule 2).
KEY_BLOCK = 128
#: Most query positions of one item computed in one attention matmul (bounds the score memory).
QUERY_TILE = 256
#: Items with at most this many query positions share one batched attention matmul.
SMALL_ITEM = 16


def pad_rows(x: torch.Tensor, rows: int = MIN_ROWS) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (itself when it has that many)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


@attrs.frozen(eq=False)
class Span:
    """Query positions ``start .. start+n-1`` of one item, at rows ``row .. row+n-1`` of the
    packed batch; ``slots`` are the pool slots of positions ``0 .. start+n-1``."""

    row: int
    start: int
    n: int
    slots: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.n


def tiles(spans: Sequence[Span], tile: int = QUERY_TILE) -> list[Span]:
    """Every span cut into pieces of at most ``tile`` query positions."""
    out: list[Span] = []
    for s in spans:
        for t in range(0, s.n, tile):
            n = min(tile, s.n - t)
            out.append(Span(s.row + t, s.start + t, n, s.slots[: s.start + t + n]))
    return out


def groups(spans: Sequence[Span]) -> list[list[Span]]:
    """Spans batched into one attention matmul: all the small ones together, each big one alone."""
    small = [s for s in spans if s.n <= SMALL_ITEM]
    big = [[s] for s in spans if s.n > SMALL_ITEM]
    return ([small] if small else []) + big


def paged_attention(
    q: torch.Tensor, spans: Sequence[Span], kv: torch.Tensor, kv_heads: int
) -> torch.Tensor:
    """Causal attention of the packed queries ``q`` (``[rows, heads, head_dim]``) over the keys
    and values in ``kv`` (``[2, slots, kv_heads, head_dim]``, the pool's layer); rows outside
    every span are left zero."""
    out = torch.zeros_like(q)
    for group in groups(tiles(spans)):
        rows = torch.cat([torch.arange(s.row, s.row + s.n) for s in group]).to(q.device)
        attended = _attend(q, group, kv, kv_heads)
        out.index_copy_(0, rows, attended)
    return out


def _attend(
    q: torch.Tensor, group: Sequence[Span], kv: torch.Tensor, kv_heads: int
) -> torch.Tensor:
    """One batched attention over the spans of ``group``; returns their rows, in span order."""
    dev, (_, heads, d) = q.device, q.shape
    share = heads // kv_heads
    n_pad = max(max(s.n for s in group), math.ceil(MIN_ROWS / share))
    keys = math.ceil(max(s.end for s in group) / KEY_BLOCK) * KEY_BLOCK
    count = len(group)
    # Gather rows (a row index past the end of q reads a zero row) and key slots (slot 0 pads).
    zero_row = q.shape[0]
    row_index = torch.full((count, n_pad), zero_row, dtype=torch.int64)
    slot_table = torch.zeros((count, keys), dtype=torch.int64, device=dev)
    qpos = torch.zeros((count, n_pad), dtype=torch.int64)
    for i, s in enumerate(group):
        row_index[i, : s.n] = torch.arange(s.row, s.row + s.n)
        qpos[i, : s.n] = torch.arange(s.start, s.end)
        slot_table[i, : s.end] = s.slots
    padded = torch.cat([q, q.new_zeros((1, heads, d))])
    queries = padded.index_select(0, row_index.view(-1).to(dev)).view(
        count, n_pad, kv_heads, share, d).permute(0, 2, 3, 1, 4).reshape(
        count, kv_heads, share * n_pad, d)
    gathered = kv.index_select(1, slot_table.view(-1)).view(2, count, keys, kv_heads, d)
    k = gathered[0].transpose(1, 2)  # [count, kv_heads, keys, d]
    v = gathered[1].transpose(1, 2).reshape(count, kv_heads, keys // KEY_BLOCK, KEY_BLOCK, d)
    scores = (queries @ k.transpose(-1, -2)).float() * (1.0 / math.sqrt(d))
    masked = torch.arange(keys, device=dev)[None, None, :] > qpos.to(dev)[:, :, None]
    masked = masked[:, None].expand(count, share, n_pad, keys).reshape(count, 1, -1, keys)
    scores.masked_fill_(masked, -math.inf)
    probs = (scores - scores.amax(-1, keepdim=True)).exp_()
    blocks = probs.view(count, kv_heads, share * n_pad, keys // KEY_BLOCK, KEY_BLOCK)
    sums = blocks.sum(-1).cumsum(-1)[..., -1:]  # [count, kv_heads, rows, 1], block order
    partial = blocks.transpose(2, 3).to(v.dtype) @ v  # [count, kv_heads, blocks, rows, d]
    total = partial.float().cumsum(2)[:, :, -1]  # the blocks added in block order
    attended = (total / sums).to(q.dtype).view(count, kv_heads, share, n_pad, d)
    attended = attended.permute(0, 3, 1, 2, 4).reshape(count, n_pad, heads, d)
    return torch.cat([attended[i, : s.n] for i, s in enumerate(group)])
