"""Scheduler configuration, validated when built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from attrs.validators import gt, optional

from lifecycle.validators import one_of, typed_fields

# attrs types a field by its default (int for 8192), so an optional field's validator is typed
# for any value.
_optional_positive: Callable[[Any, attrs.Attribute[Any], Any], Any] = optional(gt(0))

#: How the waiting queue is ordered (SGLang's ``--schedule-policy`` names).
SCHEDULE_POLICIES = ("fcfs", "lpm")


@attrs.frozen(field_transformer=typed_fields)
class SchedulerConfig:
    """Budgets and timeouts of the prefill scheduler (SGLang's names and defaults).

    ``chunked_prefill_size`` None disables chunking: a request is computed in one forward.
    Chunk cuts are page-aligned. ``max_running_requests`` caps the requests holding KV pages
    (in FORWARD or TRANSFERRING); ``prefill_max_requests`` caps the requests of one batch.
    ``radix_cache`` turns the prefix cache on (docs/prefix-cache.md; ``pdlife serve`` turns it
    on unless ``--disable-radix-cache``); ``schedule_policy`` orders the waiting queue:
    ``fcfs`` (arrival order) or ``lpm`` (longest cached prefix first; needs the cache).
    """

    page_size: int = attrs.field(default=16, validator=gt(0))
    max_prefill_tokens: int = attrs.field(default=16384, validator=gt(0))
    chunked_prefill_size: int | None = attrs.field(default=8192, validator=_optional_positive)
    max_running_requests: int = attrs.field(default=256, validator=gt(0))
    prefill_max_requests: int | None = attrs.field(default=None, validator=_optional_positive)
    bootstrap_timeout: float = attrs.field(default=300.0, validator=gt(0))
    transfer_timeout: float = attrs.field(default=300.0, validator=gt(0))
    radix_cache: bool = False
    schedule_policy: str = attrs.field(default="fcfs", validator=one_of(SCHEDULE_POLICIES))
    # Check the lifecycle invariants after every event (tests and fuzzing; costs time).
    check_invariants: bool = False

    def __attrs_post_init__(self) -> None:
        if self.schedule_policy == "lpm" and not self.radix_cache:
            raise ValueError("schedule_policy 'lpm' (longest prefix match) needs radix_cache: "
                             "without the prefix cache there is no prefix to match")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be at least "
                f"page_size ({self.page_size}): chunks are cut at page boundaries"
            )
