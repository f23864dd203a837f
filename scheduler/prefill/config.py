"""Scheduler configuration, validated when built."""

from __future__ import annotations

from typing import TypeVar

import attrs

# An int attribute that may be None (attrs types the field by its default: int for 8192).
_OptionalInt = TypeVar("_OptionalInt", bound=int | None)


def _positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


def _optional_positive(
    _inst: object, attr: attrs.Attribute[_OptionalInt], value: _OptionalInt
) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attr.name} must be > 0 or None, got {value}")


def _positive_float(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attr.name} must be > 0 seconds, got {value}")


@attrs.frozen
class SchedulerConfig:
    """Budgets and timeouts of the prefill scheduler (SGLang's names and defaults).

    ``chunked_prefill_size`` None disables chunking: a request is computed in one forward.
    Chunk cuts are page-aligned. ``max_running_requests`` caps the requests holding KV pages
    (in FORWARD or TRANSFERRING); ``prefill_max_requests`` caps the requests of one batch.
    """

    page_size: int = attrs.field(default=16, validator=_positive)
    max_prefill_tokens: int = attrs.field(default=16384, validator=_positive)
    chunked_prefill_size: int | None = attrs.field(default=8192, validator=_optional_positive)
    max_running_requests: int = attrs.field(default=256, validator=_positive)
    prefill_max_requests: int | None = attrs.field(default=None, validator=_optional_positive)
    bootstrap_timeout: float = attrs.field(default=300.0, validator=_positive_float)
    transfer_timeout: float = attrs.field(default=300.0, validator=_positive_float)
    # Check the lifecycle invariants after every event (tests and fuzzing; costs time).
    check_invariants: bool = False

    def __attrs_post_init__(self) -> None:
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be at least "
                f"page_size ({self.page_size}): chunks are cut at page boundaries"
            )
