"""A model runner watched by the fuzz machine: :class:`GuardedRunner`.

The runner protocol's rule is that a forward writes only the KV pages its items name
(docs/embedding.md). The machine cannot see what a runner of yours writes, so it wraps every
runner it builds: each forward's pool is compared with a copy taken before it, and a page that
changed without being named is a breach, kept in :attr:`GuardedRunner.violations` (the
machine's invariant 3 fails on it). The scheduler fails a batch whose forward raised, or
answered other than one token (or row of logits) per item, and goes on; the wrapper keeps each
such fault of the runner in :attr:`GuardedRunner.faults` (the machine reports it as the code
under test's). It can also make the next forward raise (:attr:`GuardedRunner.fail_next`, the
machine's ``forward_fault`` rule: an injected device error, which is not the runner's fault),
whatever the runner. The copy costs a pool's bytes per forward: fuzzing pools are small.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kv.pool import KVPool
from scheduler.runner import ForwardBatch, ModelRunner, answer_error


class GuardedRunner:
    """``inner`` (any :class:`~scheduler.runner.ModelRunner`) with every forward checked; its
    other attributes are ``inner``'s."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.pool: KVPool = inner.pool
        self.fail_next = False  # raise from the next forward (an injected device error)
        self._violations: list[str] = []
        self._faults: list[str] = []
        self._lock = threading.Lock()  # the overlap loop's forwards run on the device worker
        if hasattr(inner, "logits"):  # only a runner that has it offers it
            self.logits = self._logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def violations(self) -> list[str]:
        """Breaches of the page rule seen so far, and the inner runner's own (if it keeps
        any)."""
        with self._lock:
            return [*self._violations, *getattr(self.inner, "violations", [])]

    @property
    def faults(self) -> list[str]:
        """The runner's forwards that raised or answered a batch wrongly, so far."""
        with self._lock:
            return list(self._faults)

    def forward(self, batch: ForwardBatch) -> list[int]:
        before = self._before(batch)
        try:
            out = self.inner.forward(batch)
        except Exception as exc:
            self._fault(batch, f"the model runner raised {exc!r}")
            raise
        self._check(batch, before)
        error = answer_error(out, len(batch.items))
        if error is not None:
            self._fault(batch, str(error))
        return out

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        before = self._before(batch)
        try:
            out: torch.Tensor = self.inner.logits(batch)  # type: ignore[attr-defined]
        except Exception as exc:
            self._fault(batch, f"the model runner raised {exc!r}")
            raise
        self._check(batch, before)
        rows = sum(len(item.input_ids) if item.all_logits else 1 for item in batch.items)
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        if shape is None or len(shape) != 2 or shape[0] != rows:
            self._fault(batch, f"the model runner answered logits of shape {shape} where the "
                               f"batch asks for {rows} rows")
        return out

    def _fault(self, batch: ForwardBatch, what: str) -> None:
        with self._lock:
            self._faults.append(f"{what} (a forward of {[item.rid for item in batch.items]})")

    def _before(self, batch: ForwardBatch) -> torch.Tensor:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected forward failure")
        return self.pool.by_layer().clone()

    def _check(self, batch: ForwardBatch, before: torch.Tensor) -> None:
        after = self.pool.by_layer()
        same = (after == before) | (after.isnan() & before.isnan())
        changed = (~same).flatten(3).any(dim=3).any(dim=1).any(dim=0)  # per page
        named = {p for item in batch.items for p in item.pages}
        stray = sorted(set(torch.nonzero(changed).flatten().tolist()) - named)
        if stray:
            with self._lock:
                self._violations.append(
                    f"a forward of {[item.rid for item in batch.items]} wrote pages {stray}, "
                    f"which none of its items names (they name {sorted(named)})")
