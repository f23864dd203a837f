"""The prefill side of speculative decoding: a target runner that runs the draft model beside it.

Theory of operation
-------------------
A prefill server with a draft model hands its decode peer what lets the peer start speculative
decoding without recomputing the draft's prefill (:class:`~scheduler.model.speculative.Handoff`):
the draft's K/V of the prompt, the draft's top-k proposals after the first output token, and
the target's final hidden state at the last prompt position. :class:`DraftingRunner` is the
prefill scheduler's runner then:

- every forward runs the target, then the draft over the same items (the draft's pool has the
  target's page indices), so the draft pages a chunk sends are final when the chunk lands; it
  keeps each item's final hidden state at its last position and the item itself;
- once a request's last chunk has landed and its first token is known (greedy or sampled), the
  scheduler asks for the hand-off (:meth:`DraftingRunner.handoff_row`): the draft looks one
  position past the prompt without writing anything (:meth:`PagedModelRunner.peek`) for its
  top-k, and the kept hidden state goes with them; the scheduler writes both into the metadata
  row (:mod:`kv.metadata`, the room still written last). A prompt that fills the context
  (``max_position`` tokens) has no position past it, so no hand-off: its row carries none, and
  the decode side answers with the first token alone, as without a draft.

The bits are :func:`~scheduler.model.speculative.prefill_handoff`'s: the same model methods over
the same positions, whatever the chunking or batching.

Threads: forwards may run on the scheduler's device thread (the overlap loop) while the loop
asks for the hand-off of an earlier batch's request; the kept items are guarded by a lock, and a
request's hand-off is asked for only after its last batch's forward returned.
"""

from __future__ import annotations

import threading

import torch

from kv.metadata import SPEC_TOP_K, SpeculativeRow
from kv.pool import KVPool
from scheduler.model.reference import PagedModelRunner
from scheduler.model.speculative import Handoff, check_pairing, proposals
from scheduler.runner import ForwardBatch, ForwardItem


class DraftingRunner:
    """``target``'s :class:`~scheduler.runner.LogitsRunner`, with ``draft`` run beside it and
    the hand-off of ``k`` proposals (module docstring)."""

    def __init__(self, target: PagedModelRunner, draft: PagedModelRunner, k: int) -> None:
        if not 1 <= k <= SPEC_TOP_K:
            raise ValueError(f"k (proposals in the hand-off) must be in 1..{SPEC_TOP_K}, got {k}")
        check_pairing(target, draft)
        if draft.model.config.hybrid:
            raise ValueError("a draft with sliding-window or recurrent layers is not built")
        self.target, self.draft, self.k = target, draft, k
        self.pool = target.pool
        # The target's state beside its pool: the scheduler checks its state pools hold them.
        self.swa_pool, self.states = target.swa_pool, target.states
        self.vocab_size = target.vocab_size
        self.max_position = target.max_position
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[torch.Tensor, ForwardItem]] = {}

    @property
    def draft_pool(self) -> KVPool:
        """The draft's pool: the state pools' ``draft``, whose pages go with every chunk."""
        return self.draft.pool

    @property
    def hidden_size(self) -> int:
        """The target's hidden size: the hidden state each hand-off carries."""
        return self.target.model.config.hidden

    def forward(self, batch: ForwardBatch) -> list[int]:
        """The target's greedy next token of every item (the draft's K/V written too)."""
        return self.target.model.next_tokens(self._run(batch))

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The target's logits, as :meth:`PagedModelRunner.logits` (the draft's K/V written
        too)."""
        return self.target.model.logits(self._run(batch, every=True))

    def _run(self, batch: ForwardBatch, every: bool = False) -> torch.Tensor:
        """The target's final hidden rows (each item's last, or with ``every`` all it asks
        for), having run the draft and kept each item's last row."""
        rows = self.target.hidden(batch)
        self.draft.forward(batch)
        last, end = [], 0
        for item in batch.items:
            end += len(item.input_ids) if item.all_logits else 1
            last.append(end - 1)
        with self._lock:
            for item, row in zip(batch.items, rows[last], strict=True):
                self._kept[item.rid] = (row.clone(), item)
        return rows if every else rows[last]

    def handoff_row(self, rid: str, first_token: int) -> SpeculativeRow | None:
        """The hand-off of ``rid``, whose last chunk was the latest item of it computed, after
        ``first_token``, as the metadata row carries it (None when nothing is kept of it, or
        its prompt fills the context: no proposal to hand over)."""
        with self._lock:
            kept = self._kept.pop(rid, None)
        if kept is None:
            return None
        hidden, item = kept
        ids, probs = proposals(self.draft, item, first_token, self.k)
        if not ids:
            return None
        return Handoff(first_token, ids, probs, hidden).row()

    def forget(self, rid: str) -> None:
        """Drop what is kept of ``rid`` (it ended)."""
        with self._lock:
            self._kept.pop(rid, None)

    def kept(self) -> int:
        """Requests something is kept of (for leak checks)."""
        with self._lock:
            return len(self._kept)
