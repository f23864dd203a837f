"""DecodeConfig: the decode peer's limits are validated when built."""

from __future__ import annotations

import math

import pytest

from scheduler.decode import DecodeConfig


def test_defaults() -> None:
    config = DecodeConfig()
    assert (config.max_running_requests, config.waiting_timeout) == (256, 300.0)
    assert not config.check_invariants


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_running_requests", 0), ("waiting_timeout", 0.0), ("waiting_timeout", math.nan)],
)
def test_limits_must_be_positive_and_the_error_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"'{field}' must be > 0"):
        DecodeConfig(**{field: value})  # type: ignore[arg-type]
