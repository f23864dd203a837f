"""The reference model: a small Llama-style decoder over the paged KV pool, and its colocated twin.

Theory of operation
-------------------
:class:`LlamaModel` (:mod:`scheduler.model.decoder`) holds seeded weights and the per-position
arithmetic of a Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, untied output
head). This module holds the two drivers that run it, and re-exports the model, its config and
:class:`ModelInputError`, so ``scheduler.model.reference`` stays the one import of the model:

- :class:`PagedModelRunner` is the scheduler's :class:`~scheduler.runner.ModelRunner`. For each
  batch item it writes the K/V of the item's tokens into the pool at ``pages[p // page_size]``,
  offset ``p % page_size``, then attends over positions ``0 .. start+n-1`` read back from the
  pool: earlier chunks, and the current chunk causally. A decode step is an item of one token at
  ``start = seq_len``. :func:`greedy_decode_from_pool` drives it for a decode peer that received
  a prompt's KV into its own pool.
- :class:`ReferenceModel` is the colocated run: the whole prompt in one forward over a
  contiguous cache, then one token at a time, with no pages and no transfer.

Disaggregated output must equal the reference token for token, always. Both drivers call the
same :class:`LlamaModel` methods, and those compute every position's bits independently of how
positions are batched or chunked (``fixed_point`` explains the fixed-point arithmetic
that makes this hold by construction rather than with high probability). So chunking, paging,
batching and the transfer between pools cannot change a token; a difference means the wrong
K/V was written or read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from kv.pages import pages_needed
from kv.pool import KVPool
from scheduler.model.decoder import LlamaModel as LlamaModel
from scheduler.model.decoder import ModelInputError as ModelInputError
from scheduler.model.decoder import resolve_device as resolve_device
from scheduler.model.decoder import same_device
from scheduler.model.fixed_point import greedy_token_ids
from scheduler.model.reference_config import ModelConfig as ModelConfig
from scheduler.runner import ForwardBatch, ForwardItem, check_pool_fits


class ReferenceModel:
    """The colocated run: one-shot prefill over a contiguous cache, then token-by-token decode."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        rid: str = "reference",
        choose: Callable[[torch.Tensor, int], int] | None = None,
    ) -> list[int]:
        """Output tokens after ``prompt_ids``: up to ``max_new_tokens``, ending early after
        (and including) a stop token. ``choose(logits, i)`` picks output position ``i``'s
        token from its float64 logits (default: greedy)."""
        m, c = self.model, self.model.config
        if not prompt_ids:
            raise ModelInputError(rid, "the prompt is empty; it needs at least one token")
        if max_new_tokens < 1:
            raise ModelInputError(rid, f"max_new_tokens must be >= 1, got {max_new_tokens}")
        m.check_tokens(rid, prompt_ids)
        # The last generated token is never fed back, so it needs no position.
        positions = len(prompt_ids) + max_new_tokens - 1
        if positions > c.max_position:
            raise ModelInputError(
                rid,
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) - 1 "
                f"exceeds max_position {c.max_position}",
            )
        shape = (c.layers, positions, c.kv_heads, c.head_dim)
        cache_k = torch.zeros(shape, dtype=c.dtype, device=m.device)
        cache_v = torch.zeros(shape, dtype=c.dtype, device=m.device)
        stops = m.stop_ids(stop_token_ids, ignore_eos)
        pick = choose or (lambda logits, _i: int(greedy_token_ids(logits)))
        out = [pick(self._forward(list(prompt_ids), 0, cache_k, cache_v), 0)]
        while len(out) < max_new_tokens and out[-1] not in stops:
            logits = self._forward([out[-1]], len(prompt_ids) + len(out) - 1, cache_k, cache_v)
            out.append(pick(logits, len(out)))
        return out

    def _forward(
        self, token_ids: list[int], start: int, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> torch.Tensor:
        m, end = self.model, start + len(token_ids)
        x = m.embed(torch.tensor(token_ids, dtype=torch.int64, device=m.device))
        positions = torch.arange(start, end, device=m.device)
        for layer in range(m.config.layers):
            q, k, v = m.attention_inputs(layer, x, positions)
            cache_k[layer, start:end] = k
            cache_v[layer, start:end] = v
            keys = cache_k[layer, :end].to(torch.float64)
            attn = m.attend(q, keys, cache_v[layer, :end].to(torch.float64), start)
            x = m.layer_output(layer, x, attn)
        return m.logits(x[-1])


class PagedModelRunner:
    """The :class:`~scheduler.runner.ModelRunner` of the reference model over a paged pool."""

    def __init__(
        self, model: LlamaModel, pool: KVPool, device: str | torch.device | None = None
    ) -> None:
        c = model.config
        if device is not None and not same_device(resolve_device(device), pool.device):
            raise ValueError(f"the pool is on {pool.device}, not on the requested {device}")
        check_pool_fits(pool, c.layers, c.kv_heads, c.head_dim, c.dtype)
        self.model = model.to(pool.device)
        self.pool = pool

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def forward(self, batch: ForwardBatch) -> list[int]:
        """Write every item's K/V into the pool; return each item's greedy next token."""
        if not batch.items:
            return []
        x, sizes = self._run(batch)
        last = torch.tensor(sizes, device=self.pool.device).cumsum(0) - 1
        return self.model.next_tokens(x[last])

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Write every item's K/V into the pool; the exact float64 logits of each item's last
        position, or of all its positions when ``all_logits``."""
        if not batch.items:
            return torch.empty((0, self.vocab_size), dtype=torch.float64)
        x, sizes = self._run(batch)
        rows: list[int] = []
        end = 0
        for item, n in zip(batch.items, sizes, strict=True):
            end += n
            rows.extend(range(end - n, end) if item.all_logits else (end - 1,))
        return self.model.logits(x[torch.tensor(rows, device=self.pool.device)])

    def _run(self, batch: ForwardBatch) -> tuple[torch.Tensor, list[int]]:
        """The final residual stream of every position of the batch, and the items' sizes."""
        m, c, dev = self.model, self.model.config, self.pool.device
        history = [self._slots(item) for item in batch.items]
        sizes = [len(item.input_ids) for item in batch.items]
        tokens = torch.tensor(
            [t for item in batch.items for t in item.input_ids], dtype=torch.int64, device=dev
        )
        positions = torch.cat(
            [
                torch.arange(i.start, i.start + n, device=dev)
                for i, n in zip(batch.items, sizes, strict=True)
            ]
        )
        new_slots = torch.cat([s[i.start :] for i, s in zip(batch.items, history, strict=True)])
        x = m.embed(tokens)
        for layer in range(c.layers):
            q, k, v = m.attention_inputs(layer, x, positions)
            k_slots, v_slots = self.pool.kv_slots(layer)
            k_slots.index_copy_(0, new_slots, k.to(self.pool.dtype))
            v_slots.index_copy_(0, new_slots, v.to(self.pool.dtype))
            parts, offset = [], 0
            for item, slots, n in zip(batch.items, history, sizes, strict=True):
                keys = k_slots.index_select(0, slots).to(torch.float64)
                values = v_slots.index_select(0, slots).to(torch.float64)
                parts.append(m.attend(q[offset : offset + n], keys, values, item.start))
                offset += n
            x = m.layer_output(layer, x, torch.cat(parts))
        return x, sizes

    def _slots(self, item: ForwardItem) -> torch.Tensor:
        """The rows of :meth:`KVPool.kv_slots` that hold positions ``0 .. start+n-1``."""
        ps, n = self.pool.page_size, len(item.input_ids)
        end = item.start + n
        if n == 0 or item.start < 0:
            raise ModelInputError(
                item.rid, f"needs >= 1 input token at start >= 0, got {n} at {item.start}"
            )
        if end > self.model.config.max_position:
            raise ModelInputError(
                item.rid,
                f"positions up to {end - 1} exceed max_position {self.model.config.max_position}",
            )
        needed = pages_needed(end, ps)
        if len(item.pages) < needed:
            raise ModelInputError(
                item.rid, f"{end} tokens need {needed} pages of {ps}, got {len(item.pages)}"
            )
        pages = list(item.pages[:needed])
        if not 0 <= min(pages) <= max(pages) < self.pool.num_pages:
            raise ModelInputError(
                item.rid, f"page indices must be in 0..{self.pool.num_pages - 1}, got {pages}"
            )
        self.model.check_tokens(item.rid, item.input_ids)
        page_table = torch.tensor(pages, dtype=torch.int64, device=self.pool.device)
        pos = torch.arange(end, device=self.pool.device)
        return self.pool.slot_rows(page_table[pos // ps] * ps + pos % ps)


def greedy_decode_from_pool(
    runner: PagedModelRunner,
    *,
    rid: str,
    pages: list[int],
    seq_len: int,
    first_token: int,
    max_new_tokens: int,
    alloc_page: Callable[[], int],
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
) -> list[int]:
    """Continue greedy decoding from the K/V of positions ``0 .. seq_len-1`` already in
    ``runner.pool`` at ``pages``, after ``first_token`` (the prefill's output).

    Returns the output tokens, ``first_token`` first, as :meth:`ReferenceModel.generate` does.
    New pages come from ``alloc_page`` and are appended to ``pages`` in place, so the caller
    holds every page it must free even if decoding raises.
    """
    if max_new_tokens < 1:
        raise ModelInputError(rid, f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stops = runner.model.stop_ids(stop_token_ids, ignore_eos)
    ps = runner.pool.page_size
    out = [first_token]
    while len(out) < max_new_tokens and out[-1] not in stops:
        position = seq_len + len(out) - 1
        if position // ps >= len(pages):
            pages.append(alloc_page())
        item = ForwardItem(rid=rid, input_ids=(out[-1],), start=position, pages=tuple(pages))
        out.append(runner.forward(ForwardBatch((item,)))[0])
    return out
