"""The ``pdlife demo`` command: options and arguments.

The run itself is :func:`scheduler.demo.run.run_demo`, imported when the command runs, so
building the ``pdlife`` parser does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import attrs

from lifecycle.validators import one_of

Backend = Literal["local", "mooncake"]
Loop = Literal["normal", "overlap"]

#: The smallest workload that still holds its two injected failures and three aborts.
MIN_REQUESTS = 6
#: Prompt length bounds of ``--max-prompt`` (the reference model's positions bound the top).
MAX_PROMPT_RANGE = (64, 4096)


def _at_least(low: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"DemoOptions.{attr.name} must be an integer >= {low}, got {value!r}")

    return check


def _max_prompt(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    lo, hi = MAX_PROMPT_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"DemoOptions.{attr.name} must be an integer in {lo}..{hi}, "
                         f"got {value!r}")


@attrs.frozen
class DemoOptions:
    """What ``pdlife demo`` runs. ``requests`` counts the injected failures and aborts too;
    prompts are 16 to ``max_prompt`` byte tokens; ``timeout_s`` bounds the serving phase
    (wall seconds)."""

    requests: int = attrs.field(default=48, validator=_at_least(MIN_REQUESTS))
    backend: Backend = attrs.field(
        default="local", validator=one_of(("local", "mooncake"))
    )
    loop: Loop = attrs.field(
        default="normal", validator=one_of(("normal", "overlap"))
    )
    seed: int = attrs.field(default=0, validator=_at_least(0))
    max_prompt: int = attrs.field(default=2048, validator=_max_prompt)
    out: Path = attrs.field(default=Path("pdlife-out"), converter=Path)
    timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))
    #: ``reference`` (byte prompts of generated text), ``smollm2`` or a checkpoint path (chat
    #: questions through the checkpoint's template, answered in readable text).
    model: str = "reference"
