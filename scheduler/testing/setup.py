"""What a scheduler fuzzing machine runs: the loops, the fake host's faults, the budgets drawn
when none is given, and the prompts submissions carry (:class:`MachineSetup`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
from hypothesis import strategies as st

from kv.fake import FaultPlan
from kv.pool import KVPool
from kv.state_pools import StatePools
from lifecycle.validators import one_of
from scheduler.prefill.config import SchedulerConfig
from scheduler.testing.fakes import Reference, RunnerFactory, echo_next_token, echo_runner_factory

LOOPS = ("normal", "overlap", "both")
#: The fake host's faults by default: every kind, often, with delays on the clock.
FAKE_HOST_FAULTS = FaultPlan(
    seed=1, bootstrap_failure=0.2, bootstrap_timeout=0.1, transfer_failure=0.2,
    handshake_delay_polls=1, transfer_delay_s=0.5,
)


def iter_loops(loop: str) -> Iterator[str]:
    """The loops ``loop`` names: ``both`` is normal then overlap."""
    yield from (("normal", "overlap") if loop == "both" else (loop,))


@attrs.frozen
class MachineSetup:
    """What a :class:`SchedulerMachine` runs; fields left None are drawn per example."""

    config: SchedulerConfig | None = None
    runner_factory: RunnerFactory = echo_runner_factory
    reference: Reference | None = echo_next_token
    pages: int | None = attrs.field(default=None)
    slots: int | None = None
    loop: str = attrs.field(default="both", validator=one_of(LOOPS))
    faults: FaultPlan = attrs.field(factory=lambda: FAKE_HOST_FAULTS)
    # Called at the end of every example with its program (SchedulerMachine.program).
    on_program: Callable[[tuple[str, ...]], None] | None = None
    # Builds the state pools beside the runner's pool (None: a model without them); the
    # prefix cache is then off, whatever the config drawn.
    states: Callable[[KVPool], StatePools] | None = None

    @pages.validator
    def _check_pages(self, _attr: object, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"MachineSetup.pages must be >= 1 or None, got {value}")


def scheduler_configs(page_size: int = 4) -> st.SearchStrategy[SchedulerConfig]:
    """Small budgets that make chunking, page exhaustion and the batch caps likely; the prefix
    cache off, on (fcfs) or on (lpm)."""
    caching = st.sampled_from([(False, "fcfs"), (True, "fcfs"), (True, "lpm")])
    return st.tuples(st.builds(
        SchedulerConfig,
        page_size=st.just(page_size),
        chunked_prefill_size=st.sampled_from([None, page_size, 2 * page_size, 3 * page_size]),
        max_prefill_tokens=st.sampled_from([page_size, 4 * page_size, 16384]),
        max_running_requests=st.sampled_from([1, 2, 8]),
        prefill_max_requests=st.sampled_from([None, 1, 2]),
        bootstrap_timeout=st.just(10.0),
        transfer_timeout=st.just(10.0),
        check_invariants=st.just(True),
    ), caching).map(lambda drawn: attrs.evolve(
        drawn[0], radix_cache=drawn[1][0], schedule_policy=drawn[1][1]))


def prompt_of(rid: str, length: int, vocab_size: int | None = None) -> tuple[int, ...]:
    """The prompt a submission of ``rid`` with ``length`` tokens carries (reproducible, so a
    response can be checked against the reference from its rid and token count). The first
    0 to 24 tokens are one of three families', so prompts share prefixes (the prefix cache).
    Ids are in ``0 .. 255``, or ``0 .. vocab_size - 1`` for a runner whose ``vocab_size`` is
    smaller (its prompts are then the same ones modulo its vocabulary, not refused)."""
    salt = sum(map(ord, rid))
    family, shared = salt % 3, 4 * (salt % 7)
    ids = 256 if vocab_size is None else min(256, vocab_size)
    return tuple(((family if i < shared else salt) * 31 + 7 * i * i + 3 * i) % 256 % ids
                 for i in range(length))
