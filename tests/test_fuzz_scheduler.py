"""The whole prefill scheduler under the Hypothesis machine of ``scheduler.testing.machine``.

Budgets are explicit (they are the point of this file): on two CPU cores the ``ci`` profile
runs about two and a half thousand programs in total in about a minute;
``HYPOTHESIS_PROFILE=dev`` runs eight times as many, longer. ``pdlife fuzz`` runs the same
machine from the command line.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, rule

from scheduler.cli.fuzz import FUZZ, run_fuzz
from scheduler.runner import ForwardBatch
from scheduler.testing.fakes import PageEchoRunner, echo_runner_factory, tiny_model
from scheduler.testing.machine import scheduler_machine

_DEV = os.environ.get("HYPOTHESIS_PROFILE") == "dev"
# (programs, rules per program) for each machine below.
_ECHO = (10_000, 60) if _DEV else (1200, 40)
_TINY = (300, 25) if _DEV else (200, 20)


@pytest.fixture(autouse=True)
def _quiet_injected_failures() -> Iterator[None]:
    # Every injected failure is logged by the scheduler; thousands of programs inject many.
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


def _budget(examples: int, steps: int) -> settings:
    return settings(settings.default, max_examples=examples, stateful_step_count=steps)


TestNormalLoop = scheduler_machine(loop="normal").TestCase
TestNormalLoop.settings = _budget(*_ECHO)

TestOverlapLoop = scheduler_machine(loop="overlap").TestCase
TestOverlapLoop.settings = _budget(*_ECHO)

# The reference Llama: first tokens of chunked, aborted and failed-around requests must equal
# the colocated reference. Few programs: a forward costs tens of milliseconds.
_factory, _reference = tiny_model(seed=5)
TestTinyModel = scheduler_machine(runner_factory=_factory, reference=_reference, pages=24,
                                  loop="both").TestCase
TestTinyModel.settings = _budget(*_TINY)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    FUZZ.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_cli_passes_and_names_what_it_ran() -> None:
    out = io.StringIO()
    args = _args("--examples", "10", "--steps", "15", "--seed", "4")
    assert run_fuzz(args, lambda loop: scheduler_machine(loop=loop), out) == 0
    text = out.getvalue()
    assert "fuzzing the normal loop: 10 programs of up to 15 rules, seed 4" in text
    assert "fuzzing the overlap loop" in text
    assert text.rstrip().endswith("(loop both, seed 4)")


def test_the_cli_reports_a_broken_scheduler_with_its_program_and_rerun_line() -> None:
    # A reference that disagrees with the runner stands in for a scheduler that corrupts
    # a request's pages: the first DONE response breaks the first-token check.
    out = io.StringIO()
    args = _args("--examples", "50", "--steps", "10", "--seed", "2", "--loop", "overlap")
    status = run_fuzz(
        args, lambda loop: scheduler_machine(loop=loop, reference=lambda prompt: -1), out
    )
    text = out.getvalue()
    assert status == 1
    assert "first token" in text
    assert "Failing test case" in text and "state.submit(" in text  # the shrunk program
    assert "FAILED: the overlap loop broke an invariant (seed 2)" in text
    assert "invariant 1 (every admission is answered once" in text  # names the invariant
    assert ("rerun: pdlife fuzz --examples 50 --seed 2 --steps 10 --loop overlap "
            "--model echo") in text


def test_the_cli_reports_unshrunk_with_no_shrink_and_says_so_in_the_rerun_line() -> None:
    out = io.StringIO()
    args = _args("--examples", "50", "--steps", "10", "--seed", "2", "--loop", "normal",
                 "--no-shrink")
    status = run_fuzz(
        args, lambda loop: scheduler_machine(loop=loop, reference=lambda prompt: -1), out
    )
    text = out.getvalue()
    assert status == 1
    assert "first token" in text and "state.submit(" in text
    assert ("rerun: pdlife fuzz --examples 50 --seed 2 --steps 10 --loop normal "
            "--model echo --no-shrink") in text


class _WrongLengthRunner(PageEchoRunner):
    """A model runner that answers one token too few: the scheduler's results step raises."""

    def forward(self, batch: ForwardBatch) -> list[int]:
        return super().forward(batch)[:-1]


def _wrong_length_runner(num_pages: int, page_size: int) -> _WrongLengthRunner:
    echo = echo_runner_factory(num_pages, page_size)
    return _WrongLengthRunner(echo.pool)


def test_the_cli_reports_an_exception_of_the_code_under_test_as_such() -> None:
    out = io.StringIO()
    args = _args("--examples", "30", "--steps", "6", "--seed", "4", "--loop", "normal")
    status = run_fuzz(
        args, lambda loop: scheduler_machine(loop=loop, runner_factory=_wrong_length_runner),
        out,
    )
    text = out.getvalue()
    assert status == 3
    assert "FAILED: the code under test raised in the normal loop (seed 4)" in text
    assert "step() raised ValueError" in text
    assert "broke an invariant" not in text
    assert "rerun: pdlife fuzz --examples 30 --seed 4 --steps 6 --loop normal" in text


def test_the_cli_reports_an_error_of_the_fuzz_machine_itself() -> None:
    # A rule whose behaviour depends on something outside the drawn choices (here a counter
    # that survives between runs of the same program): Hypothesis cannot replay it.
    calls = [0]

    def flaky_machine(loop: str) -> type[RuleBasedStateMachine]:
        base = scheduler_machine(loop=loop)

        class Flaky(base):  # type: ignore[misc,valid-type]
            @rule()
            def not_replayable(self) -> None:
                calls[0] += 1
                if calls[0] == 5:
                    raise RuntimeError("a bug in the machine")

        return Flaky

    out = io.StringIO()
    args = _args("--examples", "50", "--steps", "10", "--seed", "1", "--loop", "normal")
    status = run_fuzz(args, flaky_machine, out)
    text = out.getvalue()
    assert status == 4, text[-2000:]
    assert "ERROR: the fuzz machine itself failed on the normal loop (seed 1)" in text
    assert "broke an invariant" not in text


def test_the_cli_refuses_bad_budgets() -> None:
    from scheduler.cli.command import UsageError

    with pytest.raises(UsageError, match="--examples must be >= 1"):
        FUZZ.run(_args("--examples", "0"))
