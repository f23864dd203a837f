"""The prefill scheduler's part in speculative decoding: the hand-off its runner computes goes
into the metadata row.

A runner that runs a draft model beside the target
(:class:`~scheduler.model.drafting.DraftingRunner` for the reference model) is a
:class:`HandoffRunner`. The scheduler then writes, with a request's first token, the runner's
hand-off for it into the row's speculative columns (the room still last, so the decode side
never reads a torn row), and tells the runner to forget a request that ended. The draft's pages
travel with every chunk as the state pools' ``draft`` (:mod:`kv.state_pools`), so the draft's
pool must be that one.
"""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from kv.metadata import MetadataBuffers, SpeculativeRow
from kv.pool import KVPool
from kv.state_pools import StatePools
from scheduler.runner import ModelRunner

logger = logging.getLogger(__name__)


@runtime_checkable
class HandoffRunner(Protocol):
    """A runner that computes a draft model beside its own and the speculative hand-off."""

    @property
    def draft_pool(self) -> KVPool:
        """The draft's pool (the state pools' ``draft``)."""
        ...

    @property
    def hidden_size(self) -> int:
        """The hidden size of the state each hand-off carries (the target's)."""
        ...

    def handoff_row(self, rid: str, first_token: int) -> SpeculativeRow | None:
        """The hand-off of ``rid`` after ``first_token``, once its last chunk landed."""
        ...

    def forget(self, rid: str) -> None:
        """``rid`` ended: drop what is kept of it."""
        ...


def handoff_runner(
    runner: ModelRunner, metadata: MetadataBuffers, states: StatePools | None
) -> HandoffRunner | None:
    """``runner`` when it computes a hand-off, else None (with a warning when the state pools
    hold a draft's pool that ``runner`` never fills: the decode side will not speculate);
    ValueError when the metadata buffers cannot hold its hand-off or the state pools do
    not send the draft's pages."""
    if not isinstance(runner, HandoffRunner):
        if states is not None and states.draft is not None:
            logger.warning(
                "states: the state pools hold a draft's pool, but the runner %s computes no "
                "draft KV and no hand-off: the decode side will not speculate (give the "
                "drafting runner the side was built with, or state pools without a draft)",
                type(runner).__name__)
        return None
    if metadata.speculative_hidden != runner.hidden_size:
        raise ValueError(
            f"metadata: a runner with a draft model hands off the target's hidden state "
            f"({runner.hidden_size} values), but the metadata buffers have speculative_hidden="
            f"{metadata.speculative_hidden} (build them with MetadataBuffers(..., "
            f"speculative_hidden={runner.hidden_size}))"
        )
    if states is None or states.draft is not runner.draft_pool:
        raise ValueError(
            "states: the draft's pool must be the state pools' draft, so its "
            "pages go with every chunk"
        )
    return runner
