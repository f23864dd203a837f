"""The prefill side: the scheduler pass and its loops, the PrefillAdder, the PrefillDelayer,
budgets and metrics."""

from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import DelayerConfig, PrefillDelayer
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.prefill.scheduler import PrefillScheduler

__all__ = ["DelayerConfig", "PrefillDelayer", "PrefillScheduler", "SchedulerConfig",
           "SchedulerMetrics"]
