"""The model-runner protocol of ``scheduler/runner.py``: what a runner of one's own must have,
and how the scheduler tells a runner that lacks something from one that has it."""

from __future__ import annotations

import torch

from kv.pool import KVPool
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.runner import ForwardBatch, LogitsRunner, ModelRunner

MODEL = LlamaModel(ModelConfig.tiny(seed=3))


class ForwardOnly:
    """A runner of one's own with ``pool`` and ``forward`` alone."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._inner = PagedModelRunner(MODEL, pool)

    def forward(self, batch: ForwardBatch) -> list[int]:
        return self._inner.forward(batch)


class NoPool:
    def forward(self, batch: ForwardBatch) -> list[int]:
        return []


def test_isinstance_tells_a_model_runner_and_a_logits_runner() -> None:
    pool = MODEL.make_pool(num_pages=4, page_size=4)
    reference, plain = PagedModelRunner(MODEL, pool), ForwardOnly(pool)
    assert isinstance(reference, ModelRunner) and isinstance(reference, LogitsRunner)
    assert isinstance(plain, ModelRunner) and not isinstance(plain, LogitsRunner)
    assert not isinstance(NoPool(), ModelRunner)
    assert not isinstance(torch.zeros(1), ModelRunner)
