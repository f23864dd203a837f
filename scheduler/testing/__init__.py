"""The whole-scheduler Hypothesis machine and the fakes at its boundaries (public; see
``docs/fuzzing.md``)."""

from scheduler.testing.fakes import tiny_model
from scheduler.testing.machine import (
    LOOPS,
    SchedulerMachine,
    iter_loops,
    scheduler_configs,
    scheduler_machine,
)

__all__ = [
    "LOOPS",
    "SchedulerMachine",
    "iter_loops",
    "scheduler_configs",
    "scheduler_machine",
    "tiny_model",
]
