"""The machine's arithmetic is batch-invariant where the Llama runner relies on it.

``scheduler.model.invariant`` explains the rules; these tests check them on the BLAS and torch
build at hand, with SmolLM2's shapes, so that a machine whose library breaks them fails here
and not as a rare token difference.
"""

from __future__ import annotations

import pytest
import torch

from scheduler.model.invariant import (
    KEY_BLOCK,
    MIN_ATTENTION_ROWS,
    MIN_ROWS,
    Span,
    pad_rows,
    paged_attention,
    token_matmul,
)

# SmolLM2-135M: hidden 576, Q+K+V 960, gate+up 3072, intermediate 1536, vocabulary 49152.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize(("inner", "outer"), SHAPES)
def test_matmul_rows_do_not_depend_on_the_batch(inner, outer, threads):
    """K = 1536 with two threads: MKL split the reduction between them for 17..192 rows on one
    machine, so rows differed from the same rows of a larger batch; token_matmul's blocks
    keep every reduction short enough."""
    gen = torch.Generator().manual_seed(inner + outer)
    w = torch.randn(inner, outer, generator=gen) / inner**0.5
    x = torch.randn(1200, inner, generator=gen)
    full = token_matmul(x, w)
    for rows in (1, 2, 3, 5, 7, 11, 15, 16, 17, 40, 100, 192, 193, 300):
        for offset in (0, 13, 1200 - rows):
            part = token_matmul(pad_rows(x[offset : offset + rows]), w)
            assert torch.equal(part[:rows], full[offset : offset + rows]), (rows, offset)


@pytest.mark.parametrize("keys", [KEY_BLOCK, 4 * KEY_BLOCK])
def test_batched_attention_matmul_rows_do_not_depend_on_the_batch(keys, threads):
    gen = torch.Generator().manual_seed(keys)
    q = torch.randn(6, 3, 300, 64, generator=gen)
    k = torch.randn(6, 3, 64, keys, generator=gen)
    full = q @ k
    for rows in (MIN_ATTENTION_ROWS, 9, 17, 100):
        for batch in (1, 2, 6):
            assert torch.equal(q[:batch, :, :rows] @ k[:batch], full[:batch, :, :rows])


def test_the_output_head_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(1)
    head = torch.randn(49152, 576, generator=gen)
    x = torch.randn(64, 576, generator=gen)
    full = x @ head.T
    for rows in (1, 3, 9):
        assert torch.equal((pad_rows(x[:rows]) @ head.T)[:rows], full[:rows])


def _kv(length: int, kv_heads: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(2, length, kv_heads, d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [1, 17, KEY_BLOCK, KEY_BLOCK + 1, 700])
def test_attention_of_a_position_does_not_depend_on_chunks_or_company(length, threads):
    heads, kv_heads, d = 9, 3, 64
    kv = _kv(1000, kv_heads, d, length)
    q = torch.randn(length, heads, d, generator=torch.Generator().manual_seed(7))
    slots = torch.arange(length)
    whole = paged_attention(q, [Span(0, 0, length, slots)], kv, kv_heads)
    # The same positions one at a time (decode steps), batched with an unrelated item.
    other_slots = torch.arange(500, 1000)
    for p in range(0, length, max(1, length // 7)):
        packed = torch.cat([q[p : p + 1], torch.randn(3, heads, d)])
        spans = [Span(0, p, 1, slots[: p + 1]), Span(1, 497, 3, other_slots)]
        step = paged_attention(packed, spans, kv, kv_heads)
        assert torch.equal(step[0], whole[p]), p
    # In two chunks cut off the block boundaries.
    cut = length // 3
    if cut:
        second = paged_attention(q[cut:], [Span(0, cut, length - cut, slots)], kv, kv_heads)
        assert torch.equal(second, whole[cut:])


def test_padding_rows_reach_the_minimum():
    x = torch.ones(3, 4)
    padded = pad_rows(x)
    assert padded.shape == (MIN_ROWS, 4)
    assert torch.equal(padded[:3], x) and not padded[3:].any()
    assert pad_rows(torch.ones(20, 4)).shape == (20, 4)
