"""What the sampler asks of a structured-output constraint (a compiled grammar).

A :class:`Constraint` is one request's matcher state: the prefill side compiles the request's
:class:`~lifecycle.GrammarSpec`, masks the first token with :meth:`Constraint.allowed` and feeds
it to :meth:`Constraint.accept`; the decode side compiles the same spec, replays the first token
from the metadata row, and goes on the same way for every later token. A
:class:`ConstraintCompiler` is built once per model (it needs the tokenizer's vocabulary).
"""

from __future__ import annotations

from typing import Protocol

import torch

from lifecycle import GrammarSpec


class GrammarError(ValueError):
    """A grammar that does not compile, or a token it rejects; the message names the problem."""


class Constraint(Protocol):
    def allowed(self) -> torch.Tensor | None:
        """A bool mask over the vocabulary of the tokens allowed next (None: any token)."""

    def accept(self, token: int) -> None:
        """Advance past ``token``; raises :class:`GrammarError` if the grammar rejects it."""

    def finished(self) -> bool:
        """Whether the grammar is complete and allows nothing more (the answer stops)."""


class ConstraintCompiler(Protocol):
    def compile(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for ``spec``; raises :class:`GrammarError` if it does not compile."""
