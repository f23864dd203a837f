"""Configurations refuse values of the wrong type where they are built
(:func:`lifecycle.validators.typed_fields`): a config is often read from text, where ``"no"`` is
a true bool and ``"16"`` fails far from the field that holds it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs
import pytest
import torch

from kv.mooncake_engine import MooncakeConfig
from lifecycle.validators import typed_fields
from scheduler.decode import DecodeConfig
from scheduler.embedded import PairConfig
from scheduler.model.reference import ModelConfig
from scheduler.model.side_pools import HybridConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.config import ServeConfig


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SchedulerConfig(radix_cache="no"),
         "SchedulerConfig.radix_cache must be a bool, got 'no' .str."),
        (lambda: SchedulerConfig(radix_cache=1), "radix_cache must be a bool, got 1 .int."),
        (lambda: SchedulerConfig(check_invariants="yes"), "check_invariants must be a bool"),
        (lambda: SchedulerConfig(page_size="16"), "page_size must be an integer, got '16'"),
        (lambda: SchedulerConfig(page_size=16.0), "page_size must be an integer, got 16.0"),
        (lambda: SchedulerConfig(chunked_prefill_size=True),
         "chunked_prefill_size must be an integer or None, got True"),
        (lambda: SchedulerConfig(bootstrap_timeout="5"), "bootstrap_timeout must be a number"),
        (lambda: SchedulerConfig(schedule_policy=1), "schedule_policy must be a string"),
        (lambda: PairConfig(scheduler={"radix_cache": True}),
         "PairConfig.scheduler must be a SchedulerConfig, got {'radix_cache': True} .dict."),
        (lambda: PairConfig(hybrid={"swa_pages": 256}),
         "PairConfig.hybrid must be a HybridConfig or None, got"),
        (lambda: PairConfig(model="smollm2"), "PairConfig.model must be a ModelConfig"),
        (lambda: PairConfig(prefill_pages="8"), "prefill_pages must be an integer, got '8'"),
        (lambda: PairConfig(overlap="false"), "PairConfig.overlap must be a bool"),
        (lambda: PairConfig(backend=1), "PairConfig.backend must be a string"),
        (lambda: HybridConfig(draft_layers=2.0), "HybridConfig.draft_layers must be an integer"),
        (lambda: DecodeConfig(max_running_requests="8"), "max_running_requests must be an"),
        (lambda: MooncakeConfig(tcp_lanes=4.0), "MooncakeConfig.tcp_lanes must be an integer"),
        (lambda: ModelConfig(layers=2.0), "ModelConfig.layers must be an integer"),
        (lambda: ModelConfig(dtype="float32"), "ModelConfig.dtype must be a dtype"),
        (lambda: ModelConfig(swa_layers=[0], sliding_window=4),
         "swa_layers must be a tuple of integers, got .0. .list."),
        (lambda: ServeConfig(role="both", backend="local", bootstrap_port="8998"),
         "ServeConfig.bootstrap_port must be an integer"),
    ],
)
def test_a_wrong_type_is_refused_naming_the_field(build: Callable[[], object],
                                                  message: str) -> None:
    with pytest.raises(TypeError, match=message):
        build()


def test_the_types_a_field_takes() -> None:
    # An int where a float is annotated, None where it is optional, a Literal's string (which
    # strings, the field's validator says).
    assert SchedulerConfig(bootstrap_timeout=5).bootstrap_timeout == 5
    assert SchedulerConfig(chunked_prefill_size=None).chunked_prefill_size is None
    assert PairConfig(backend="mooncake").backend == "mooncake"
    with pytest.raises(ValueError, match="must be one of"):
        PairConfig(backend="tcp")
    assert ModelConfig(dtype=torch.float64, swa_layers=(0,), sliding_window=4,
                       layers=2).swa_layers == (0,)


@attrs.frozen(field_transformer=typed_fields)
class _Everything:
    anything: Any = None
    call: Callable[[int], int] | None = None
    pair: tuple[int, str] = (1, "a")
    mode: Literal["a", "b"] | int = "a"
    ratio: float = 0.5
    later: _Later | None = None  # defined below: resolved when first checked


@attrs.frozen
class _Later:
    pass


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"call": 3}, "call must be a Callable or None, got 3"),
        ({"pair": (1, 2)}, r"pair must be a tuple of an integer, a string, got \(1, 2\)"),
        ({"pair": (1, "a", 2)}, "pair must be a tuple of"),
        ({"mode": 2.5}, "mode must be a string or an integer, got 2.5"),
        ({"ratio": False}, "ratio must be a number, got False"),
        ({"later": object()}, "later must be a _Later or None"),
    ],
)
def test_the_annotations_typed_fields_understands(changes: dict[str, Any], message: str) -> None:
    fine = _Everything(anything=object(), call=abs, pair=(2, "b"), mode=3, ratio=1,
                       later=_Later())
    assert fine.mode == 3 and fine.ratio == 1
    with pytest.raises(TypeError, match=message):
        _Everything(**changes)
