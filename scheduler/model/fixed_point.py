"""The reference model's arithmetic: a fixed-point grid, exact reductions, and causal attention.

Theory of operation
-------------------
Disaggregated serving computes a prompt in chunks over a paged KV pool and continues decoding in
another pool; the colocated reference computes the same prompt in one shot over a contiguous
cache. Their outputs must agree token for token, always. Floating point alone cannot promise
that: a sum depends on the order of its terms, and BLAS picks the order from the shapes, which
differ between a 4096-token prefill and a 512-token chunk. Computing in float64 would make a
disagreement rare, not impossible.

So every value the model carries is a fixed-point number held in a float64: an integer multiple
of ``2**-frac_bits`` with a bounded magnitude (:func:`to_grid`). A dot product of two such
vectors is a sum of integer multiples of ``2**-(a+b)`` whose every partial sum stays below
``2**53`` times that unit, so each addition is exact and the result is the same in every order,
blocking and device: matrix products, RMSNorm's sum of squares, the softmax denominator and the
probability-weighted sum of values are all exact. The bounds that keep them exact are enforced
by ``ModelConfig``'s ranges.

What is not exact is elementwise: one IEEE operation (``+ - * /``, ``sqrt``), which rounds
correctly and so depends only on its operands, never on a tensor's shape or on an element's
place in it; or a lookup in a table that is built once, on the CPU, from Python's scalar
``math`` functions, so vectorised and scalar code paths (which may disagree in the last bit)
never meet. ``torch.exp`` is therefore never called on activations: ``exp(-x)`` is a lookup in
:func:`exp_table`, indexed by ``x`` on the grid. After each inexact step the result is put back
on the grid, so the next reduction is exact again.

Hence the same position computes the same bits whether it is part of a one-shot prefill, a
chunk, or a decode step, on CPU or CUDA, and argmax ties (which are then genuine ties) break to
the lowest token id.
"""

from __future__ import annotations

import math

import torch

# Activations, queries, keys and values: multiples of 2**-12, magnitude at most 2**8. 20
# significant bits, so float32 KV storage holds them exactly.
ACT_FRAC_BITS = 12
ACT_LIMIT = 2.0**8
# Weights: multiples of 2**-12 in [-1, 1].
WEIGHT_FRAC_BITS = 12
WEIGHT_LIMIT = 1.0
# Softmax numerators and sigmoid's exp(-|x|): multiples of 2**-16 in [0, 1].
PROB_FRAC_BITS = 16
# exp(-x) for x = i * 2**-12; beyond EXP_RANGE it rounds to 0 on the probability grid.
_EXP_INDEX_SCALE = 2.0**ACT_FRAC_BITS
_EXP_RANGE = 12.0

# Score tensors of one query block are capped at about this many float64 elements (4 MiB), so
# the passes over them run in cache.
_BLOCK_ELEMENTS = 1 << 19


def to_grid(x: torch.Tensor, frac_bits: int, limit: float) -> torch.Tensor:
    """``x`` rounded to the nearest multiple of ``2**-frac_bits`` and clamped to ``±limit``.

    Scaling by a power of two is exact, so the result depends on each element alone.
    """
    scale = 2.0**frac_bits
    return torch.round(x * scale).clamp_(-limit * scale, limit * scale).div_(scale)


def fix(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the activation grid."""
    return to_grid(x, ACT_FRAC_BITS, ACT_LIMIT)


def exp_table() -> torch.Tensor:
    """``exp(-i / 2**12)`` on the probability grid for ``i = 0 ..``; the last entry is 0.

    Built on the CPU from scalar ``math.exp`` so every process and device gets the same bits.
    """
    n = int(_EXP_RANGE * _EXP_INDEX_SCALE) + 1
    values = torch.tensor([math.exp(-i / _EXP_INDEX_SCALE) for i in range(n)], dtype=torch.float64)
    table = to_grid(values, PROB_FRAC_BITS, 1.0)
    if table[-1].item() != 0.0:
        raise AssertionError("exp table must end at 0 so masked and distant keys weigh nothing")
    return table


def exp_neg(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``exp(-x)`` for ``x >= 0`` (``+inf`` allowed), by table lookup at ``floor(x * 2**12)``."""
    return _lookup(table, (x * _EXP_INDEX_SCALE).clamp_(max=table.numel() - 1))


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[floor(index)]`` for float ``index`` in range; int32 indices and ``index_select``
    are several times faster on the CPU than int64 advanced indexing."""
    flat = index.to(torch.int32).view(-1)
    return table.index_select(0, flat).view(index.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; the sum of squares is exact."""
    mean_square = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return fix(x / torch.sqrt(mean_square + eps) * weight)


def silu(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` with ``exp(-|x|)`` from the table (no overflow on either side)."""
    e = exp_neg(x.abs(), table)
    sigmoid = torch.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return x * sigmoid


def rope_tables(
    head_dim: int, theta: float, max_position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``position * theta**(-2i/head_dim)``, ``[max_position, head_dim/2]``.

    Built from the binary digits of the position by angle addition, with scalar ``math``
    values for ``freq * 2**bit``: elementwise IEEE steps only, so the tables have the same bits
    in every process.
    """
    half = head_dim // 2
    freqs = [theta ** (-2.0 * i / head_dim) for i in range(half)]
    positions = torch.arange(max_position)
    cos = torch.ones((max_position, half), dtype=torch.float64)
    sin = torch.zeros((max_position, half), dtype=torch.float64)
    for bit in range((max_position - 1).bit_length()):
        c = torch.tensor([math.cos(f * 2**bit) for f in freqs], dtype=torch.float64)
        s = torch.tensor([math.sin(f * 2**bit) for f in freqs], dtype=torch.float64)
        on = ((positions >> bit) & 1).bool().unsqueeze(1)
        cos, sin = torch.where(on, cos * c - sin * s, cos), torch.where(on, sin * c + cos * s, sin)
    return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last dimension of ``x``, its two halves rotated as pairs."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension; ties go to the lowest id."""
    best = logits.amax(-1, keepdim=True)
    vocab = logits.shape[-1]
    ids = torch.arange(vocab, device=logits.device).expand_as(logits)
    return torch.where(logits == best, ids, vocab).amin(-1)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    table: torch.Tensor,
    *,
    key_start: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """Softmax attention of queries at positions ``q_start ..`` over keys ``key_start ..``,
    causally; with ``window``, a query at ``p`` sees only keys ``p - window + 1 .. p``.

    ``q``: ``[n, heads, head_dim]``, already scaled by ``1/sqrt(head_dim)`` and on the grid;
    ``k``, ``v``: ``[q_start + n - key_start, kv_heads, head_dim]`` on the grid (the history
    from ``key_start``, then this call's own positions). Query heads are grouped onto key heads
    (GQA). Returns ``[n, heads * head_dim]`` on the grid.

    A key outside a query's window weighs exactly 0 and leaves the row's minimum alone, so
    dropping keys that no query of the call can see (``key_start`` up to the first query's
    window) changes no bit: every sum here is exact.
    """
    n, heads, head_dim = q.shape
    total, kv_heads, _ = k.shape
    if total != q_start + n - key_start:
        raise ValueError(
            f"{total} keys from position {key_start} for queries at positions "
            f"{q_start}..{q_start + n - 1}"
        )
    if window and key_start > max(0, q_start - window + 1):
        raise ValueError(
            f"keys from position {key_start} miss the window of {window} of the query at "
            f"{q_start}"
        )
    if not window and key_start:
        raise ValueError(f"full attention needs keys from position 0, got {key_start}")
    first = q_start - key_start  # the first query's index among the keys
    group = heads // kv_heads
    # Each key head multiplies its whole query group in one bmm: rows are (group member, query).
    # Scaling queries by -2**12 (exact) makes scores come out as negated table positions, so
    # ``score - row_min`` is directly the (exact) exp-table index of ``max - score``.
    qg = (q * -_EXP_INDEX_SCALE).reshape(n, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kt = k.permute(1, 2, 0)  # [kv_heads, head_dim, total]
    # A ones column after each value makes the second bmm also return the softmax denominator.
    ones = torch.ones((total, kv_heads, 1), dtype=v.dtype, device=v.device)
    vt = torch.cat((v, ones), dim=-1).permute(1, 0, 2)  # [kv_heads, total, head_dim + 1]
    out = torch.empty((kv_heads, group, n, head_dim), dtype=q.dtype, device=q.device)
    block = max(1, _BLOCK_ELEMENTS // (heads * total))
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        rows, visible = r1 - r0, first + r1
        q_block = qg[:, :, r0:r1].reshape(kv_heads, group * rows, head_dim)
        scores = torch.bmm(q_block, kt[..., :visible])
        # Only the block's own positions can lie in a row's future: mask that square alone.
        future = torch.ones((rows, rows), dtype=torch.bool, device=q.device).triu_(1)
        by_row = scores.view(kv_heads, group, rows, visible)
        by_row[..., first + r0 :].masked_fill_(future, math.inf)
        if window:
            # Key index j is position key_start + j; row r's query is at q_start + r0 + r.
            keys = torch.arange(visible, device=q.device) + key_start
            queries = torch.arange(r0, r1, device=q.device) + q_start
            by_row.masked_fill_(keys[None, :] <= queries[:, None] - window, math.inf)
        # Masked keys become +inf and look up exp(-inf) = 0.
        scores.sub_(scores.amin(-1, keepdim=True)).clamp_(max=table.numel() - 1)
        weights = _lookup(table, scores)
        mixed = torch.bmm(weights, vt[:, :visible])
        mixed = mixed[..., :head_dim] / mixed[..., head_dim:]
        out[:, :, r0:r1] = mixed.view(kv_heads, group, rows, head_dim)
    return fix(out.permute(2, 0, 1, 3).reshape(n, heads * head_dim))


# The recurrence's decay per channel: ``a = decay / 2**DECAY_BITS``, in ``DECAY_RANGE``.
DECAY_BITS = 8
DECAY_RANGE = (1 << (DECAY_BITS - 1), (1 << DECAY_BITS) - 1)
_STATE_LIMIT = int(ACT_LIMIT * 2**ACT_FRAC_BITS)


def to_units(x: torch.Tensor) -> torch.Tensor:
    """Activation-grid values as int64 counts of ``2**-ACT_FRAC_BITS`` (exact)."""
    return (x * 2.0**ACT_FRAC_BITS).to(torch.int64)


def from_units(units: torch.Tensor) -> torch.Tensor:
    """int64 counts of ``2**-ACT_FRAC_BITS`` back to float64 grid values (exact)."""
    return units.to(torch.float64) / 2.0**ACT_FRAC_BITS


def linear_recurrence(
    inputs: torch.Tensor, decay: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The states ``h_t = floor(decay * h_{t-1} / 2**DECAY_BITS) + u_t``, clamped to the
    activation range, for ``u_t`` = row ``t`` of ``inputs``, from ``h_{-1} = state``.

    Everything is int64 (counts of the activation unit; ``decay`` per channel in
    ``DECAY_RANGE``), so the states are the same integers whether a sequence is scanned at once
    or in pieces that hand the last state on: chunked equals unchunked by construction.
    ``inputs``: ``[n, width]``; ``state``: ``[width]``. Returns ``[n, width]``.
    """
    out = torch.empty_like(inputs)
    h = state
    for t in range(inputs.shape[0]):
        h = torch.div(decay * h, 1 << DECAY_BITS, rounding_mode="floor").add_(inputs[t])
        h = h.clamp_(-_STATE_LIMIT, _STATE_LIMIT)
        out[t] = h
    return out
