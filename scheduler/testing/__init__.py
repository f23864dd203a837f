"""The whole-scheduler Hypothesis machine and the fakes at its boundaries (public; see
``docs/fuzzing.md``)."""

from scheduler.testing.device import SteppedDevice
from scheduler.testing.fakes import tiny_model
from scheduler.testing.machine import SchedulerMachine, scheduler_machine
from scheduler.testing.setup import LOOPS, MachineSetup, iter_loops, scheduler_configs
from scheduler.testing.verdicts import CodeUnderTestError, InvariantViolation

__all__ = [
    "LOOPS",
    "CodeUnderTestError",
    "InvariantViolation",
    "MachineSetup",
    "SchedulerMachine",
    "SteppedDevice",
    "iter_loops",
    "scheduler_configs",
    "scheduler_machine",
    "tiny_model",
]
