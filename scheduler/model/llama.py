"""A Llama-family decoder in torch over the paged KV pool, for real checkpoints.

Theory of operation
-------------------
:class:`RealModel` holds a checkpoint's weights (float32 by default, bfloat16 by option), fused
for speed (Q, K and V in one matmul; gate and up in one), and computes a packed batch of items:
the tokens of every item are concatenated (not padded to a common length), run through RMSNorm,
the fused projections, RoPE (theta and scaling from the checkpoint), grouped-query attention and
the SwiGLU MLP; each item writes its K/V into the pool at its pages and attends over the earlier
chunks read back from the pool plus its own tokens, causally. A decode step is an item of one
token. Only each item's last position (every position, for an item that asks for all logits)
goes through the output head (tied to the embedding or not), and through the last layer's
attention and MLP: the other positions of the last layer only write their K/V.

The arithmetic is batch-invariant (:mod:`scheduler.model.invariant`): a token's floats do not
depend on which items share its batch, how its prompt was chunked, or whether it was computed
by the prefill server or by the decode peer. So a disaggregated run gives the tokens of the
colocated run (:func:`generate`: the whole prompt in one forward, then one token at a time).

:class:`LlamaRunner` is the scheduler's :class:`~scheduler.runner.ModelRunner` over one pool.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence

import attrs
import torch

from kv.pages import pages_needed
from kv.pool import KVPool
from kv.pool_layout import KVLayout
from scheduler.model.checkpoint import Checkpoint, LlamaConfig, rope_inv_freq
from scheduler.model.invariant import MIN_ROWS, Span, pad_rows, paged_attention, token_matmul
from scheduler.model.reference import ModelInputError, resolve_device, same_device
from scheduler.runner import ForwardBatch, ForwardItem, check_pool_fits, outside_vocabulary

logger = logging.getLogger(__name__)

#: Rows of the MLP computed together (their intermediate activations stay small; 512 rows
#: ran the MLP's matmuls a few percent faster than 256 or 1,024 on the machines measured).
ROW_CHUNK = 512
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``float32`` or ``bfloat16`` (the compute and KV cache dtype)."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype must be float32 or bfloat16, got {name}")
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@attrs.frozen(eq=False)
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [hidden, q + 2 kv], transposed for x @ w
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [hidden, 2 intermediate]
    down: torch.Tensor


class RealModel:
    """A checkpoint's weights on a device, and the batched forward over a paged pool."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        eos_token_ids: Sequence[int] = (),
        name: str | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        #: What the model was loaded as (``--model``), naming it in messages.
        self.name = checkpoint.name if name is None else name
        self.eos_token_ids = tuple(eos_token_ids)
        self.config: LlamaConfig = checkpoint.config
        self.dtype = parse_dtype(dtype)
        self.device = resolve_device(device)
        # The checkpoint's weights and the dtype they run in name the KV this model writes.
        self.fingerprint = f"{checkpoint.fingerprint}-{str(self.dtype).removeprefix('torch.')}"
        t, c = checkpoint.tensors, self.config

        def weight(name: str) -> torch.Tensor:
            return t[name].to(self.device, self.dtype)

        def for_matmul(*names: str) -> torch.Tensor:
            """``[in, out]`` for ``x @ w``, the rows of the named ``[out, in]`` tensors fused.
            float32 keeps it contiguous; bfloat16 keeps ``[out, in]`` contiguous and reads
            it transposed: CPU bfloat16 matmuls without native bfloat16 instructions take a
            path about ten times slower for a contiguous ``[in, out]`` operand."""
            w = torch.cat([self._part(n, t[n]) for n in names]).to(self.device, self.dtype)
            return w.contiguous().T if self.dtype == torch.bfloat16 else w.T.contiguous()

        self._layers = [
            _Layer(
                attn_norm=weight(f"layers.{i}.attn_norm"),
                qkv=for_matmul(f"layers.{i}.q", f"layers.{i}.k", f"layers.{i}.v"),
                o=for_matmul(f"layers.{i}.o"),
                mlp_norm=weight(f"layers.{i}.mlp_norm"),
                gate_up=for_matmul(f"layers.{i}.gate", f"layers.{i}.up"),
                down=for_matmul(f"layers.{i}.down"),
            )
            for i in range(c.layers)
        ]
        self._embed = weight("embed")
        self._head = weight("lm_head") if "lm_head" in t else self._embed
        self._norm = weight("norm")
        self._released = False
        inv_freq = rope_inv_freq(c, t.get("rope_freqs"))
        freqs = torch.arange(c.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self._cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(self.device, self.dtype)
        # The sine with the rotation's sign folded in (see _rotate).
        self._sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(self.device, self.dtype)

    def _part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a layer's projection ``name`` this model holds: all of it (a shard
        holds its heads' and MLP rows' part: :mod:`scheduler.model.sharded_checkpoint`)."""
        return tensor

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A product over what a shard splits (attention heads, MLP rows), summed over the
        shards; one model holds all of it."""
        return partial

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        return c.layers * 2 * c.kv_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    def make_pool(self, *, num_pages: int, page_size: int,
                  layout: KVLayout = KVLayout.LAYER_MAJOR) -> KVPool:
        """An empty KV pool shaped for this model (layers, KV heads, head dim, dtype), in
        ``layout``."""
        c = self.config
        return KVPool(num_layers=c.layers, num_pages=num_pages, page_size=page_size,
                      kv_heads=c.kv_heads, head_dim=c.head_dim, dtype=self.dtype,
                      device=self.device, model=self.fingerprint, model_name=self.name,
                      layout=layout)

    def stop_ids(self, stop_token_ids: Iterable[int], ignore_eos: bool) -> frozenset[int]:
        stops = set(stop_token_ids)
        if not ignore_eos:
            stops.update(self.eos_token_ids)
        return frozenset(stops)

    def release_weights(self) -> None:
        """Let this model's weights go, keeping its configuration, dtype and pool shape: for a
        process that computes with another model built from the same checkpoint (a TP rank 0,
        its part). A forward afterwards raises."""
        empty = torch.empty(0)
        self._layers, self._embed, self._head, self._norm = [], empty, empty, empty
        self._released = True

    # -- the forward ---------------------------------------------------------------------------

    def logits(self, pool: KVPool, items: Sequence[ForwardItem]) -> torch.Tensor:
        """Write every item's K/V into ``pool``; the float32 logits after each item's last
        token, or after each of its tokens when ``item.all_logits`` (rows in item order)."""
        if self._released:
            raise RuntimeError(f"{self.name}: this model's weights were released "
                               "(release_weights): compute with the model built in its place")
        with torch.inference_mode():
            spans, tokens, positions, new_slots = self._plan(pool, items)
            x = pad_rows(self._embed[tokens])
            cos = pad_rows(self._cos[positions])[:, None, :]
            sin = pad_rows(self._sin[positions])[:, None, :]
            last = self.config.layers - 1
            for layer in range(last):
                x = self._layer(layer, x, cos, sin, pool, spans, new_slots)
            # The last layer's output is read only where logits are asked for: every item
            # writes its K/V there, but only those positions attend and go through the MLP.
            wanted = [s if item.all_logits else Span(s.row + s.n - 1, s.end - 1, 1, s.slots)
                      for s, item in zip(spans, items, strict=True)]
            rows = [r for s in wanted for r in range(s.row, s.row + s.n)]
            x = self._layer(last, x, cos, sin, pool, wanted, new_slots, rows)
            h = _rms_norm(x, self._norm, self.config.rms_eps)
            return token_matmul(h, self._head.T).float()[: len(rows)]

    def _layer(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool,
        spans: list[Span], new_slots: torch.Tensor, rows: list[int] | None = None,
    ) -> torch.Tensor:
        """One decoder layer over the packed rows ``x``: every row's K/V goes into the pool,
        the rows of ``spans`` attend. Returns every row's output, or with ``rows`` only
        theirs (in that order, padded to :data:`MIN_ROWS`)."""
        c, w, n_rows = self.config, self._layers[layer], x.shape[0]
        q_dim, kv_dim = c.heads * c.head_dim, c.kv_heads * c.head_dim
        qkv = token_matmul(_rms_norm(x, w.attn_norm, c.rms_eps), w.qkv)
        qk = _rotate(qkv[:, : q_dim + kv_dim].view(n_rows, c.heads + c.kv_heads, c.head_dim),
                     cos, sin)
        q, k = qk[:, : c.heads], qk[:, c.heads :]
        v = qkv[:, q_dim + kv_dim :].view(n_rows, c.kv_heads, c.head_dim)
        kv = pool.kv_slots(layer)
        n = new_slots.shape[0]
        kv[0].index_copy_(0, new_slots, k[:n].to(pool.dtype))
        kv[1].index_copy_(0, new_slots, v[:n].to(pool.dtype))
        attn = paged_attention(q, spans, kv, c.kv_heads).view(n_rows, q_dim)
        if rows is not None:
            picked = torch.tensor(rows, device=self.device)
            x = pad_rows(x.index_select(0, picked))
            attn = pad_rows(attn.index_select(0, picked))
        # Each slice of rows reads its own rows of x before it overwrites them: x is the
        # layer's output too.
        for part in row_chunks(x.shape[0]):
            self._mlp(w, x[part], attn[part], x[part])
        return x

    def _mlp(self, w: _Layer, x: torch.Tensor, attn: torch.Tensor, out: torch.Tensor) -> None:
        """The output projection and the SwiGLU MLP of some rows (a slice of the layer's, so
        the MLP's intermediate activations stay small), written into ``out``."""
        c = self.config
        x = x + self._reduce(token_matmul(attn, w.o))
        gate_up = token_matmul(_rms_norm(x, w.mlp_norm, c.rms_eps), w.gate_up)
        act = torch.nn.functional.silu(gate_up[:, : c.intermediate])
        act.mul_(gate_up[:, c.intermediate :])
        torch.add(x, self._reduce(token_matmul(act, w.down)), out=out)

    def _plan(
        self, pool: KVPool, items: Sequence[ForwardItem]
    ) -> tuple[list[Span], torch.Tensor, torch.Tensor, torch.Tensor]:
        spans: list[Span] = []
        tokens: list[int] = []
        positions: list[torch.Tensor] = []
        new_slots: list[torch.Tensor] = []
        for item in items:
            slots = self._slots(pool, item)
            spans.append(Span(len(tokens), item.start, len(item.input_ids), slots))
            tokens.extend(item.input_ids)
            positions.append(torch.arange(item.start, item.start + len(item.input_ids)))
            new_slots.append(slots[item.start :])
        dev = self.device
        return (spans, torch.tensor(tokens, dtype=torch.int64, device=dev),
                torch.cat(positions).to(dev), torch.cat(new_slots))

    def _slots(self, pool: KVPool, item: ForwardItem) -> torch.Tensor:
        """The rows of :meth:`KVPool.kv_slots` that hold positions ``0 .. start+n-1``."""
        ps, n = pool.page_size, len(item.input_ids)
        end = item.start + n
        if n == 0 or item.start < 0:
            raise ModelInputError(
                item.rid, f"needs >= 1 input token at start >= 0, got {n} at {item.start}")
        if end > self.config.max_position:
            raise ModelInputError(
                item.rid, f"positions up to {end - 1} exceed the model's context "
                f"{self.config.max_position}")
        needed = pages_needed(end, ps)
        if len(item.pages) < needed:
            raise ModelInputError(
                item.rid, f"{end} tokens need {needed} pages of {ps}, got {len(item.pages)}")
        pages = list(item.pages[:needed])
        if not 0 <= min(pages) <= max(pages) < pool.num_pages:
            raise ModelInputError(
                item.rid, f"page indices must be in 0..{pool.num_pages - 1}, got {pages}")
        problem = outside_vocabulary(item.input_ids, self.config.vocab_size)
        if problem:
            raise ModelInputError(item.rid, problem)
        table = torch.tensor(pages, dtype=torch.int64, device=self.device)
        pos = torch.arange(end, device=self.device)
        return pool.slot_rows(table[pos // ps] * ps + pos % ps)


def row_chunks(rows: int, size: int = ROW_CHUNK) -> list[slice]:
    """``0 .. rows`` cut into slices of ``size`` rows; a short tail joins the slice before it,
    so every slice keeps at least ``MIN_ROWS`` rows (batch invariance, rule 1)."""
    cuts = [*range(0, rows, size), rows]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < MIN_ROWS:
        del cuts[-2]
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype).mul_(weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with rotated halves: ``x * cos + cat(-x2, x1) * sin``, computed as ``x * cos +
    cat(x2, x1) * sin`` with the sign folded into the first half of ``sin`` (the same bits:
    ``-x2 * s == x2 * -s``)."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    out = x * cos
    return out.add_(swapped.mul_(sin))


class LlamaRunner:
    """The :class:`~scheduler.runner.ModelRunner` of a :class:`RealModel` over one pool."""

    def __init__(self, model: RealModel, pool: KVPool) -> None:
        c = model.config
        check_pool_fits(pool, c.layers, c.kv_heads, c.head_dim, model.dtype)
        # Not ``!=``: torch.device("cuda") != torch.device("cuda:0"), and a model on "cuda"
        # makes pools whose tensors report cuda:0.
        if not same_device(pool.device, model.device):
            raise ValueError(f"the pool is on {pool.device}, the model on {model.device}")
        self.model = model
        self.pool = pool
        self.vocab_size = c.vocab_size
        self.max_position = c.max_position

    def forward(self, batch: ForwardBatch) -> list[int]:
        """Write every item's K/V into the pool; return each item's greedy next token, the
        argmax of its last position's float32 logits."""
        if not batch.items:
            return []
        last = [attrs.evolve(item, all_logits=False) if item.all_logits else item
                for item in batch.items]
        ids: list[int] = self.model.logits(self.pool, last).argmax(-1).tolist()
        return ids

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Write every item's K/V into the pool; the float32 logits of each item's last
        position, or of all its positions when ``all_logits``."""
        if not batch.items:
            return torch.empty((0, self.vocab_size), device=self.model.device)
        return self.model.logits(self.pool, batch.items)


def generate_batch(
    model: RealModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    page_size: int = 16,
    logits_out: list[list[torch.Tensor]] | None = None,
) -> list[list[int]]:
    """Greedy continuations of every prompt, batched: all prompts in one prefill forward, then
    one decode step for all of them per forward (no stop tokens: exactly ``max_new_tokens``
    each). Batch invariance makes each equal :func:`generate` of that prompt alone."""
    if max_new_tokens < 1 or not prompts or not all(prompts):
        raise ModelInputError("generate", "needs prompts of >= 1 token and max_new_tokens >= 1")
    needs = [pages_needed(len(p) + max_new_tokens - 1, page_size) for p in prompts]
    pool = model.make_pool(num_pages=sum(needs), page_size=page_size)
    starts = [sum(needs[:i]) for i in range(len(prompts))]
    pages = [tuple(range(s, s + n)) for s, n in zip(starts, needs, strict=True)]
    items = [ForwardItem(f"p{i}", tuple(p), 0, pages[i]) for i, p in enumerate(prompts)]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        logits = model.logits(pool, items)
        for i, row in enumerate(logits):
            outs[i].append(int(row.argmax()))
            if logits_out is not None:
                logits_out[i].append(row)
        items = [ForwardItem(it.rid, (outs[i][-1],), len(prompts[i]) + len(outs[i]) - 1,
                             it.pages) for i, it in enumerate(items)]
    return outs


def generate(
    model: RealModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    page_size: int = 16,
    logits_out: list[torch.Tensor] | None = None,
) -> list[int]:
    """The colocated run: the whole prompt in one forward over a private pool, then one token at
    a time; greedy, ending after (and including) a stop token. Each step's logits are appended
    to ``logits_out`` when given."""
    if not prompt_ids:
        raise ModelInputError("generate", "the prompt is empty; it needs at least one token")
    if max_new_tokens < 1:
        raise ModelInputError("generate", f"max_new_tokens must be >= 1, got {max_new_tokens}")
    total = len(prompt_ids) + max_new_tokens - 1  # the last token is never fed back
    if total > model.config.max_position:
        raise ModelInputError(
            "generate", f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) - 1 "
            f"exceeds max_position {model.config.max_position}")
    pool = model.make_pool(num_pages=max(1, pages_needed(total, page_size)), page_size=page_size)
    pages = tuple(range(pool.num_pages))
    stops = model.stop_ids(stop_token_ids, ignore_eos)
    out: list[int] = []
    item = ForwardItem("generate", tuple(prompt_ids), 0, pages)
    while True:
        logits = model.logits(pool, [item])[0]
        if logits_out is not None:
            logits_out.append(logits)
        out.append(int(logits.argmax()))
        if len(out) >= max_new_tokens or out[-1] in stops:
            return out
        item = ForwardItem("generate", (out[-1],), len(prompt_ids) + len(out) - 1, pages)

