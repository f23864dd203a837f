"""A batch that samples: the runner's logits, then the sampler and the input logprobs per item.

:class:`LogitsForward` is called like a runner's ``forward`` (a batch in, one token per item
out), so the prefill scheduler hands it to its device in place of ``runner.forward``, and the
decode peer calls it inline. It keeps each item's :class:`ItemResult` (the token, its logprob,
the input logprobs of its chunk) for the loop to read once the call has returned; it reads only
the immutable :class:`ItemPlan` of each item, never a request record, so it may run on the
device thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from lifecycle import SamplingParams
from scheduler.messages import TokenLogprob
from scheduler.runner import ForwardBatch, LogitsRunner
from scheduler.sample.logprobs import chunk_input_logprobs
from scheduler.sample.sampler import RowSpec, Sampled, sample

#: The row spec of an item whose token nobody reads (a non-last chunk): the plain argmax.
UNREAD = RowSpec(SamplingParams())


@attrs.frozen(eq=False)
class Scoring:
    """A request whose prompt tokens get input logprobs: its parameters and its prompt."""

    params: SamplingParams
    prompt: Sequence[int]


@attrs.frozen(eq=False)
class ItemPlan:
    """What to compute for one item: how its last row becomes a token, and, for an item whose
    runner returns every position (``all_logits``), the prompt it scores."""

    row: RowSpec = UNREAD
    scoring: Scoring | None = None


@attrs.frozen
class ItemResult:
    sampled: Sampled
    input_logprobs: tuple[TokenLogprob, ...] = ()


class LogitsForward:
    """``runner.logits`` and the sampler over one batch; ``results`` once it has run."""

    def __init__(self, runner: LogitsRunner, plans: Sequence[ItemPlan]) -> None:
        self.runner = runner
        self.plans = tuple(plans)
        self.results: list[ItemResult] | None = None

    def __call__(self, batch: ForwardBatch) -> list[int]:
        if len(batch.items) != len(self.plans):
            raise ValueError(f"{len(self.plans)} plans for a batch of {len(batch.items)} items")
        logits = self.runner.logits(batch)
        last: list[int] = []
        inputs: list[tuple[TokenLogprob, ...]] = []
        row = 0
        for item, plan in zip(batch.items, self.plans, strict=True):
            n = len(item.input_ids) if item.all_logits else 1
            if plan.scoring is not None and item.all_logits:
                scored = chunk_input_logprobs(logits[row : row + n], plan.scoring.params,
                                              plan.scoring.prompt, item.start)
                inputs.append(tuple(scored))
            else:
                inputs.append(())
            row += n
            last.append(row - 1)
        if row != logits.shape[0]:
            raise ValueError(f"the runner returned {logits.shape[0]} rows of logits, "
                             f"the batch asks for {row}")
        sampled = sample(logits[last], [p.row for p in self.plans])
        self.results = [ItemResult(s, i) for s, i in zip(sampled, inputs, strict=True)]
        return [s.token for s in sampled]
