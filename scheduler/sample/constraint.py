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


class GrammarLimitError(GrammarError):
    """The grammar compiled but the grammar engine could not run it (one of its limits, such as
    the lexer's size, reached while masking or consuming a token): the request's grammar is at
    fault, not the server (a 400), unlike a token the mask allowed and the grammar rejects."""


class Constraint(Protocol):
    def allowed(self) -> torch.Tensor | None:
        """A bool mask over the vocabulary of the tokens allowed next (None: any token); raises
        :class:`GrammarLimitError` if the engine cannot run the grammar further."""

    def accept(self, token: int) -> None:
        """Advance past ``token``; raises :class:`GrammarError` if the grammar rejects it
        (:class:`GrammarLimitError` if the engine cannot run the grammar further)."""

    def finished(self) -> bool:
        """Whether the grammar is complete and allows nothing more (the answer stops)."""


class ConstraintCompiler(Protocol):
    def compile(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for ``spec``; raises :class:`GrammarError` if it does not compile."""
