"""The model-runner protocol: what the scheduler asks of a model."""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Protocol, runtime_checkable

import attrs
import torch

from kv.pool import KVPool


@attrs.frozen
class ForwardItem:
    """One request's slice of a batch.

    ``input_ids`` are the tokens computed now, at positions ``start .. start+len-1``; the K/V of
    positions ``0 .. start-1`` are already in the pool. ``pages`` cover positions
    ``0 .. start+len-1`` (token position p lives in page ``pages[p // page_size]`` at offset
    ``p % page_size``).
    """

    rid: str
    input_ids: Sequence[int]
    start: int
    pages: Sequence[int]
    # Whether :meth:`LogitsRunner.logits` returns the logits of every position of this item
    # (input logprobs), not only its last one.
    all_logits: bool = False
    # Hybrid models only. ``swa_pages[i]``: the sliding-window pool's page of the positions of
    # ``pages[i]`` (-1 for a page wholly before every window this item's queries see);
    # ``state_slot``: the request's slot of the recurrent state.
    swa_pages: Sequence[int] = ()
    state_slot: int = -1


@attrs.frozen
class ForwardBatch:
    items: tuple[ForwardItem, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(i.input_ids) for i in self.items)


@runtime_checkable
class ModelRunner(Protocol):
    """Runs a batch: writes the K/V of every item's tokens into ``pool`` and returns, per item,
    the greedy next token after its last input token.

    Two optional attributes (the shipped runners have both) let admission refuse what the
    model cannot run (:mod:`scheduler.sample.request`): ``vocab_size``, a prompt holding an id
    outside ``0 .. vocab_size - 1``; ``max_position``, the count of positions the model has, a
    request whose prompt and answer need more."""

    pool: KVPool

    def forward(self, batch: ForwardBatch) -> list[int]: ...


@runtime_checkable
class LogitsRunner(ModelRunner, Protocol):
    """A runner that can also hand back logits, for sampling, logprobs and grammars; it needs
    ``vocab_size`` (the width of a row of logits) besides :meth:`logits`.

    :meth:`logits` writes the K/V as :meth:`forward` does and returns float32 logits (float64
    for the exact reference model) of shape ``[rows, vocab]``: per item in batch order, one row
    for its last position, or one row for each of its positions when ``item.all_logits``. The
    greedy token of an item's last row (the lowest id among ties) is :meth:`forward`'s. Greedy
    requests with nothing else asked (``SamplingParams.plain``) only need :meth:`forward`; a
    runner without :meth:`logits` serves only those.
    """

    vocab_size: int

    def logits(self, batch: ForwardBatch) -> torch.Tensor: ...


def outside_vocabulary(token_ids: Sequence[int], vocab_size: int) -> str | None:
    """What is wrong with ``token_ids`` against a vocabulary of ``vocab_size`` ids (the first
    three outside ``0 .. vocab_size - 1``), or None when every id is inside."""
    outside = [t for t in token_ids if not 0 <= t < vocab_size]
    if not outside:
        return None
    shown = ", ".join(str(t) for t in outside[:3]) + (", ..." if len(outside) > 3 else "")
    return f"token ids must be in 0..{vocab_size - 1}, got {shown}"


class RunnerAnswerError(ValueError):
    """A model runner's forward answered other than one token per item of its batch."""


def answer_error(tokens: object, batch_size: int) -> RunnerAnswerError | None:
    """What is wrong with ``tokens``, a forward's answer to a batch of ``batch_size`` items, or
    None when it holds one token per item. The scheduler and the decode peer fail the batch on
    it as on a forward that raised."""
    if isinstance(tokens, Sized):
        if len(tokens) == batch_size:
            return None
        got = f"{len(tokens)} tokens"
    else:
        got = repr(tokens) if tokens is None else f"a {type(tokens).__name__}"
    return RunnerAnswerError(f"the model runner answered {got} for a batch of {batch_size} "
                             f"requests")


def device_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is the accelerator's own error (a device-side assert, an illegal memory
    access, a device gone): ``torch.AcceleratorError``, or before torch 2.8 a ``RuntimeError``
    that says ``CUDA error:``. The device's context does not recover from one, so a scheduler
    lets it leave ``step()`` (a service's engine loop fails, and its health check with it)
    instead of failing one batch after another. Running out of device memory is not one: the
    batch fails and the loop goes on."""
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(exc, accelerator):
        return True
    return isinstance(exc, RuntimeError) and str(exc).startswith("CUDA error:")


def check_pool_fits(pool: KVPool, layers: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> None:
    """:class:`ValueError` unless ``pool`` holds K/V of a model of this shape (as the model's
    ``make_pool`` builds it)."""
    geometry = (pool.num_layers, pool.kv_heads, pool.head_dim, pool.dtype)
    if geometry != (layers, kv_heads, head_dim, dtype):
        raise ValueError(
            f"pool (layers, kv_heads, head_dim, dtype) = {geometry} does not fit the model's "
            f"{(layers, kv_heads, head_dim, dtype)}; build it with the model's make_pool")
