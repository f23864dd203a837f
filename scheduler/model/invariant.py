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
   matmul over tokens is padded to at least 16 rows (:func:`pad_rows`); the batched attention
   matmuls (where only M <= 3 differed) to at least :data:`MIN_ATTENTION_ROWS`. With several
   threads a BLAS may also split a long reduction between them for some row counts (MKL on
   one 2-core machine: with K = 1536, rows computed with M = 17..192 differed from the same
   rows in a batch of 193 or more; with K <= 768 none did), so :func:`token_matmul` cuts a
   reduction longer than :data:`MAX_INNER` into blocks of at most that length and adds their
   products in block order. RMSNorm, SiLU, the
   rotary products and the residual adds are row-wise elementwise ops or per-row reductions of a
   fixed length, which are row-independent too. ``tests/test_invariance.py`` checks all of this
   on the machine at hand.
2. **Attention over fixed, absolute key blocks.** A query at position ``p`` attends over keys
   ``0..p`` read back from the paged pool. The scores ``q @ k^T`` reduce over ``head_dim`` only
   (fixed). The softmax max is exact whatever the order. The weighted sum over keys is where the
   order could depend on the batch (how many keys the chunk sees, how many queries are batched),
   so keys are cut into blocks of :data:`KEY_BLOCK` *absolute* positions (block ``b`` holds
   ``b*KEY_BLOCK .. (b+1)*KEY_BLOCK-1``, the last padded and masked); each block's partial sums
   come from a matmul of fixed inner length, and the blocks are added one after another, in
   block order. Blocks past a query's position hold exact zeros, and adding
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
#: Longest reduction one BLAS call over tokens runs (rule 1): longer ones are cut into blocks.
MAX_INNER = 768
#: Fewest query rows of an attention matmul (one per head sharing a KV head and position): the
#: batched matmul keeps a row's arithmetic from 4 rows up, on the machines measured.
MIN_ATTENTION_ROWS = 8
#: Keys per attention block, in absolute positions (rule 2).
KEY_BLOCK = 128
#: Most query positions of one item computed in one attention matmul (bounds the score memory).
QUERY_TILE = 128
#: Items with at most this many query positions share one batched attention matmul.
SMALL_ITEM = 16


def pad_rows(x: torch.Tensor, rows: int = MIN_ROWS) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (itself when it has that many)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def token_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a matmul over tokens (``x`` padded by :func:`pad_rows`), each row's
    arithmetic independent of how many rows ``x`` has: a reduction (``w``'s rows) longer than
    :data:`MAX_INNER` is computed in blocks of at most that length, added in order (rule 1)."""
    inner = w.shape[0]
    if inner <= MAX_INNER:
        return x @ w
    out = x[:, :MAX_INNER] @ w[:MAX_INNER]
    for start in range(MAX_INNER, inner, MAX_INNER):
        out += x[:, start:start + MAX_INNER] @ w[start:start + MAX_INNER]
    return out


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


def tiles(span: Span, tile: int | None = None) -> list[Span]:
    """``span`` cut into pieces of at most ``tile`` (:data:`QUERY_TILE`) query positions."""
    tile = tile or QUERY_TILE
    return [Span(span.row + t, span.start + t, min(tile, span.n - t),
                 span.slots[: span.start + t + min(tile, span.n - t)])
            for t in range(0, span.n, tile)]


def paged_attention(
    q: torch.Tensor, spans: Sequence[Span], kv: torch.Tensor, kv_heads: int
) -> torch.Tensor:
    """Causal attention of the packed queries ``q`` (``[rows, heads, head_dim]``) over the keys
    and values in ``kv`` (``[2, slots, kv_heads, head_dim]``, the pool's layer); rows outside
    every span are left zero.

    The small spans (decode steps, short chunks) of similar lengths share one batched matmul;
    a long span is cut into query tiles that share its gathered keys."""
    out = torch.zeros_like(q)
    # Scaled once, with a zero row at the end for the padding rows of a matmul to read. The
    # scale carries log2(e): the softmax is computed as powers of two, exp(s) = 2^(s log2 e),
    # because torch's exp2 is about four times faster than its exp on the CPU.
    scale = math.log2(math.e) / math.sqrt(q.shape[-1])
    scaled = q.new_empty((q.shape[0] + 1, *q.shape[1:]))
    torch.mul(q, scale, out=scaled[:-1])
    scaled[-1].zero_()
    q = scaled
    for group in _by_length([s for s in spans if s.n <= SMALL_ITEM]):
        _attend(q, group, _gather(kv, group), out)
    for span in spans:
        if span.n > SMALL_ITEM:
            keys = _gather(kv, [span])
            for tile in tiles(span):
                _attend(q, [tile], keys[:, :, : _blocks(tile.end) * KEY_BLOCK], out)
    return out


def _by_length(spans: Sequence[Span]) -> list[list[Span]]:
    """Small spans in groups of similar key lengths (the longest at most twice the shortest,
    in key blocks), so that padding every span to its group's longest wastes little."""
    groups: list[list[Span]] = []
    for s in sorted(spans, key=lambda s: s.end):
        if groups and _blocks(s.end) <= 2 * _blocks(groups[-1][0].end):
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _blocks(positions: int) -> int:
    return math.ceil(positions / KEY_BLOCK)


def _gather(kv: torch.Tensor, group: Sequence[Span]) -> torch.Tensor:
    """``[2, len(group), keys, kv_heads, head_dim]``: each span's keys and values read from
    the pool, padded with slot 0 (masked) to whole key blocks."""
    keys = _blocks(max(s.end for s in group)) * KEY_BLOCK
    table = torch.zeros((len(group), keys), dtype=torch.int64, device=kv.device)
    for i, s in enumerate(group):
        table[i, : s.end] = s.slots
    # Advanced indexing, not index_select: on a strided view of the pool (page-major's
    # kv_slots) index_select copies the whole view first, hundreds of times slower.
    return kv[:, table.view(-1)].view(2, len(group), keys, *kv.shape[2:])


def _attend(q: torch.Tensor, group: Sequence[Span], kv: torch.Tensor, out: torch.Tensor) -> None:
    """One batched attention of the spans of ``group`` (their keys and values gathered in
    ``kv``); writes their rows of ``out``."""
    dev, (_, heads, d), (_, count, keys, kv_heads, _) = q.device, q.shape, kv.shape
    share, blocks = heads // kv_heads, kv.shape[2] // KEY_BLOCK
    n_pad = max(max(s.n for s in group), math.ceil(MIN_ATTENTION_ROWS / share))
    # Rows past a span's end read q's last (zero) row and attend to every key (finite,
    # discarded).
    row_index = torch.full((count, n_pad), q.shape[0] - 1, dtype=torch.int64)
    qpos = torch.full((count, n_pad), keys, dtype=torch.int64)
    for i, s in enumerate(group):
        row_index[i, : s.n] = torch.arange(s.row, s.row + s.n)
        qpos[i, : s.n] = torch.arange(s.start, s.end)
    rows = share * n_pad
    queries = q.index_select(0, row_index.view(-1).to(dev)).view(
        count, n_pad, kv_heads, share, d).permute(2, 0, 3, 1, 4).reshape(
        kv_heads, count, rows, d)
    # Per KV head, the gathered keys and values are strided [count, keys, d] matrices that the
    # matmuls read in place (no copy into another layout).
    scores = q.new_empty((kv_heads, count, rows, keys))
    for h in range(kv_heads):
        torch.bmm(queries[h], kv[0, :, :, h].transpose(1, 2), out=scores[h])
    scores = scores.float()
    # Keys before the earliest query are visible to every row: mask only from there on.
    lo = min(s.start for s in group) + 1
    if lo < keys:
        masked = torch.arange(lo, keys)[None, None, :] > qpos[:, :, None]
        masked = masked[:, None].expand(count, share, n_pad, keys - lo).reshape(
            1, count, rows, keys - lo)
        scores[..., lo:].masked_fill_(masked.to(dev), -math.inf)
    probs = scores.sub_(scores.amax(-1, keepdim=True)).exp2_().to(q.dtype)
    sums = probs.float().view(kv_heads, count, rows, blocks, KEY_BLOCK).sum(-1)
    # The key blocks added in block order: a query sees the same sums whatever follows it.
    total = torch.zeros((kv_heads * count, rows, d), dtype=torch.float32, device=dev)
    for b in range(blocks):
        part = slice(b * KEY_BLOCK, (b + 1) * KEY_BLOCK)
        values = kv[1, :, part].permute(2, 0, 1, 3).reshape(kv_heads * count, KEY_BLOCK, d)
        total += torch.bmm(probs[..., part].reshape(kv_heads * count, rows, KEY_BLOCK),
                           values).float()
    total = total.view(kv_heads, count, rows, d)
    norm = sums[..., 0]
    for b in range(1, blocks):
        norm = norm + sums[..., b]
    attended = (total / norm[..., None]).to(q.dtype).view(kv_heads, count, share, n_pad, d)
    attended = attended.permute(1, 3, 0, 2, 4).reshape(count, n_pad, heads, d)
    for i, s in enumerate(group):
        out[s.row : s.row + s.n] = attended[i, : s.n]
