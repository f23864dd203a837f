"""The model-runner protocol: what the scheduler asks of a model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

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


@attrs.frozen
class ForwardBatch:
    items: tuple[ForwardItem, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(i.input_ids) for i in self.items)


class ModelRunner(Protocol):
    """Runs a batch: writes the K/V of every item's tokens into ``pool`` and returns, per item,
    the greedy next token after its last input token."""

    pool: KVPool

    def forward(self, batch: ForwardBatch) -> list[int]: ...
