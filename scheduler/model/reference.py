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
from scheduler.model.decoder import same_device as same_device
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
        states = torch.zeros((len(c.recurrent_layers), c.recurrent_width), dtype=torch.int64,
                             device=m.device)
        stops = m.stop_ids(stop_token_ids, ignore_eos)
        pick = choose or (lambda logits, _i: int(greedy_token_ids(logits)))
        out = [pick(self._forward(list(prompt_ids), 0, cache_k, cache_v, states), 0)]
        while len(out) < max_new_tokens and out[-1] not in stops:
            position = len(prompt_ids) + len(out) - 1
            logits = self._forward([out[-1]], position, cache_k, cache_v, states)
            out.append(pick(logits, len(out)))
        return out

    def _forward(
        self, token_ids: list[int], start: int, cache_k: torch.Tensor, cache_v: torch.Tensor,
        states: torch.Tensor,
    ) -> torch.Tensor:
        m, end = self.model, start + len(token_ids)
        x = m.embed(torch.tensor(token_ids, dtype=torch.int64, device=m.device))
        positions = torch.arange(start, end, device=m.device)
        for layer in range(m.config.layers):
            if layer in m.config.recurrent_layers:
                row = m.config.pool_index(layer)
                attn, h = m.recurrent(layer, x, states[row])
                states[row] = h[-1]
            else:
                # Every position's K/V is kept; a sliding-window layer's mask hides the old ones.
                q, k, v = m.attention_inputs(layer, x, positions)
                cache_k[layer, start:end] = k
                cache_v[layer, start:end] = v
                keys = cache_k[layer, :end].to(torch.float64)
                attn = m.attend(layer, q, keys, cache_v[layer, :end].to(torch.float64), start)
            x = m.layer_output(layer, x, attn)
        return m.logits(x[-1])


class PagedModelRunner:
    """The :class:`~scheduler.runner.ModelRunner` of the reference model over a paged pool.

    A hybrid model (:class:`~scheduler.model.reference_config.LayerKind`) also needs
    ``swa_pool`` (its sliding-window layers' K/V, own page indices: ``ForwardItem.swa_pages``)
    and ``states`` (its recurrent layers' int64 states, :meth:`LlamaModel.make_states`:
    ``ForwardItem.state_slot``); ``pool`` then holds the full-attention layers only.
    """

    def __init__(
        self, model: LlamaModel, pool: KVPool, device: str | torch.device | None = None, *,
        swa_pool: KVPool | None = None, states: torch.Tensor | None = None,
    ) -> None:
        c = model.config
        if device is not None and not same_device(resolve_device(device), pool.device):
            raise ValueError(f"the pool is on {pool.device}, not on the requested {device}")
        check_pool_fits(pool, len(c.full_layers), c.kv_heads, c.head_dim, c.dtype)
        if bool(c.swa_layers) != (swa_pool is not None):
            raise ValueError(f"a model with swa_layers {c.swa_layers!r} needs an SWA pool "
                             "(make_swa_pool) exactly when it has sliding-window layers")
        if swa_pool is not None:
            check_pool_fits(swa_pool, len(c.swa_layers), c.kv_heads, c.head_dim, c.dtype)
        if bool(c.recurrent_layers) != (states is not None):
            raise ValueError(f"a model with recurrent_layers {c.recurrent_layers!r} needs "
                             "states (make_states) exactly when it has recurrent layers")
        if states is not None and (
            states.dtype != torch.int64 or states.dim() != 3
            or (states.shape[0], states.shape[2]) != (len(c.recurrent_layers), c.recurrent_width)
            or not same_device(states.device, pool.device)
        ):
            raise ValueError(f"states {tuple(states.shape)} {states.dtype} on {states.device} "
                             "do not fit the model; build them with make_states on its device")
        self.model = model.to(pool.device)
        self.pool = pool
        self.swa_pool = swa_pool
        self.states = states
        self.vocab_size = c.vocab_size
        self.max_position = c.max_position

    def forward(self, batch: ForwardBatch) -> list[int]:
        """Write every item's K/V into the pool; return each item's greedy next token, from
        the exact float64 logits of its last position."""
        if not batch.items:
            return []
        x, sizes = self._run(batch)
        last = torch.tensor(sizes, device=self.pool.device).cumsum(0) - 1
        return self.model.next_tokens(x[last])

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Write every item's K/V into the pool; the exact float64 logits of each item's last
        position, or of all its positions when ``all_logits``."""
        return self.model.logits(self.hidden(batch))

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Write every item's K/V into the pool; the final residual stream (on the activation
        grid) of each item's last position, or of all its positions when ``all_logits``."""
        if not batch.items:
            return torch.empty((0, self.model.config.hidden), dtype=torch.float64,
                               device=self.pool.device)
        x, sizes = self._run(batch)
        rows: list[int] = []
        end = 0
        for item, n in zip(batch.items, sizes, strict=True):
            end += n
            rows.extend(range(end - n, end) if item.all_logits else (end - 1,))
        return x[torch.tensor(rows, device=self.pool.device)]

    def peek(self, item: ForwardItem) -> torch.Tensor:
        """The exact float64 logits of ``item``'s last position, computed over the pools'
        K/V of the positions before ``item.start`` without writing anything: no K/V, no
        recurrent state, and no page is needed for ``item``'s own positions (the prefill side's
        look past the prompt, :mod:`scheduler.model.speculative`)."""
        x, _ = self._run(ForwardBatch((item,)), write=False)
        return self.model.logits(x[-1:])

    def _run(self, batch: ForwardBatch, write: bool = True) -> tuple[torch.Tensor, list[int]]:
        """The final residual stream of every position of the batch, and the items' sizes.
        Without ``write``, each item's own K/V joins the keys read from the pools instead of
        being written, and recurrent states are left as they were."""
        m, c, dev = self.model, self.model.config, self.pool.device
        sizes = [len(item.input_ids) for item in batch.items]
        history = [self._slots(item, write) for item in batch.items]
        # Sliding-window layers read positions from the first query's window start only.
        swa_from = [m.window_start(c.swa_layers[0], i.start) if c.swa_layers else 0
                    for i in batch.items]
        swa_history = [self._swa_slots(i, lo, write)
                       for i, lo in zip(batch.items, swa_from, strict=True)]
        tokens = torch.tensor(
            [t for item in batch.items for t in item.input_ids], dtype=torch.int64, device=dev
        )
        positions = torch.cat(
            [
                torch.arange(i.start, i.start + n, device=dev)
                for i, n in zip(batch.items, sizes, strict=True)
            ]
        )
        x = m.embed(tokens)
        for layer in range(c.layers):
            if layer in c.recurrent_layers:
                x = m.layer_output(layer, x, self._recurrent(layer, x, batch.items, sizes, write))
                continue
            q, k, v = m.attention_inputs(layer, x, positions)
            if layer in c.swa_layers:
                assert self.swa_pool is not None  # __init__ checked it
                pool, slots, key_from = self.swa_pool, swa_history, swa_from
            else:
                pool, slots, key_from = self.pool, history, [0] * len(sizes)
            k_slots, v_slots = pool.kv_slots(c.pool_index(layer))
            if write:
                written = torch.cat([s[i.start - lo :] for i, s, lo in zip(
                    batch.items, slots, key_from, strict=True)])
                k_slots.index_copy_(0, written, k.to(pool.dtype))
                v_slots.index_copy_(0, written, v.to(pool.dtype))
            parts, offset = [], 0
            for item, item_slots, lo, n in zip(batch.items, slots, key_from, sizes, strict=True):
                keys = k_slots.index_select(0, item_slots)
                values = v_slots.index_select(0, item_slots)
                if not write:  # the pool's dtype holds the grid exactly: the same bits
                    keys = torch.cat([keys, k[offset : offset + n].to(pool.dtype)])
                    values = torch.cat([values, v[offset : offset + n].to(pool.dtype)])
                parts.append(m.attend(layer, q[offset : offset + n], keys.to(torch.float64),
                                      values.to(torch.float64), item.start, lo))
                offset += n
            x = m.layer_output(layer, x, torch.cat(parts))
        return x, sizes

    def _recurrent(self, layer: int, x: torch.Tensor, items: Sequence[ForwardItem],
                   sizes: list[int], write: bool) -> torch.Tensor:
        """Recurrent ``layer`` for every item, each from its slot's state (zeros at position
        0), leaving the state after its last position in the slot when ``write``."""
        assert self.states is not None  # __init__ checked it
        states = self.states[self.model.config.pool_index(layer)]
        parts, offset = [], 0
        for item, n in zip(items, sizes, strict=True):
            start = torch.zeros_like(states[0]) if item.start == 0 else states[item.state_slot]
            attn, h = self.model.recurrent(layer, x[offset : offset + n], start)
            if write:
                states[item.state_slot] = h[-1]
            parts.append(attn)
            offset += n
        return torch.cat(parts)

    def _slots(self, item: ForwardItem, write: bool = True) -> torch.Tensor:
        """The rows of :meth:`KVPool.kv_slots` that hold positions ``0 .. start+n-1`` (only
        ``0 .. start-1`` without ``write``)."""
        n = len(item.input_ids)
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
        self.model.check_tokens(item.rid, item.input_ids)
        if self.states is not None and not 0 <= item.state_slot < self.states.shape[1]:
            raise ModelInputError(item.rid, f"state_slot must be in "
                                  f"0..{self.states.shape[1] - 1}, got {item.state_slot}")
        last = end if write else item.start
        return _page_slots(self.pool, item.rid, "pages", item.pages, 0, last)

    def _swa_slots(self, item: ForwardItem, lo: int, write: bool = True) -> torch.Tensor:
        """The rows of the SWA pool's ``kv_slots`` that hold positions ``lo .. start+n-1``
        (only ``lo .. start-1`` without ``write``)."""
        if self.swa_pool is None:
            return torch.empty(0, dtype=torch.int64)
        end = item.start + len(item.input_ids) if write else item.start
        return _page_slots(self.swa_pool, item.rid, "swa_pages", item.swa_pages, lo, end)


def _page_slots(pool: KVPool, rid: str, name: str, pages: Sequence[int], lo: int,
                end: int) -> torch.Tensor:
    """The slot rows of ``pool`` that hold positions ``lo .. end-1``, whose page ``i`` is
    ``pages[i]``; :class:`ModelInputError` unless those pages are listed and in the pool."""
    ps = pool.page_size
    needed = pages_needed(end, ps)
    if len(pages) < needed:
        raise ModelInputError(rid, f"{end} tokens need {needed} {name} of {ps}, got {len(pages)}")
    used = list(pages[lo // ps : needed])
    if not used:
        return torch.empty(0, dtype=torch.int64, device=pool.device)
    if not 0 <= min(used) <= max(used) < pool.num_pages:
        raise ModelInputError(
            rid, f"page indices ({name}) of positions {lo}..{end - 1} must be in "
            f"0..{pool.num_pages - 1}, got {used}")
    page_table = torch.tensor(used, dtype=torch.int64, device=pool.device)
    pos = torch.arange(lo, end, device=pool.device)
    return pool.slot_rows(page_table[pos // ps - lo // ps] * ps + pos % ps)


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
