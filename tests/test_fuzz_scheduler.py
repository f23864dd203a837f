"""The whole prefill scheduler under the Hypothesis machine of ``scheduler.testing.machine``.

Budgets are explicit (they are the point of this file): on two CPU cores the ``ci`` profile
runs about two and a half thousand programs in total in about a minute;
``HYPOTHESIS_PROFILE=dev`` runs eight times as many, longer. ``pdlife fuzz`` runs the same
machine from the command line.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, rule

from scheduler.cli.fuzz import FUZZ, run_fuzz
from scheduler.runner import ForwardBatch
from scheduler.testing.fakes import (
    PageEchoRunner,
    echo_next_token,
    echo_runner_factory,
    tiny_model,
)
from scheduler.testing.machine import scheduler_machine
from scheduler.testing.setup import prompt_of

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
    """A model runner that answers one token too few: the scheduler fails the batch and goes
    on; the machine's guard around the runner reports it."""

    def forward(self, batch: ForwardBatch) -> list[int]:
        return super().forward(batch)[:-1]


def _wrong_length_runner(num_pages: int, page_size: int) -> _WrongLengthRunner:
    echo = echo_runner_factory(num_pages, page_size)
    return _WrongLengthRunner(echo.pool)


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_the_cli_reports_a_runner_that_answers_the_wrong_count_as_the_code_under_test(
        loop: str) -> None:
    """Once, as the code under test's fault, although the scheduler survives it: nothing
    raises out of step() or close()."""
    out = io.StringIO()
    args = _args("--examples", "30", "--steps", "6", "--seed", "4", "--loop", loop)
    status = run_fuzz(
        args, lambda loop: scheduler_machine(loop=loop, runner_factory=_wrong_length_runner),
        out,
    )
    text = out.getvalue()
    assert status == 3, text[-3000:]
    assert f"FAILED: the code under test raised in the {loop} loop (seed 4)" in text
    assert "\n  the model runner answered 0 tokens for a batch of 1 requests" in text, text[-3000:]
    assert "step() raised" not in text and "close() raised" not in text, text[-3000:]
    assert "distinct failures" not in text, text[-3000:]
    assert "broke an invariant" not in text
    assert f"rerun: pdlife fuzz --examples 30 --seed 4 --steps 6 --loop {loop}" in text


class _ShortContextRunner(PageEchoRunner):
    """A model of 8 positions that does not declare ``max_position``: a longer prompt reaches
    it and it raises. The scheduler fails the batch ``internal`` and goes on."""

    def forward(self, batch: ForwardBatch) -> list[int]:
        for item in batch.items:
            if item.start + len(item.input_ids) > 8:
                raise IndexError(f"position {item.start + len(item.input_ids) - 1} of 8")
        return super().forward(batch)


def test_the_cli_reports_a_runner_that_raises_on_its_own_as_the_code_under_test() -> None:
    """Not the machine's injected forward faults (every other search here has them), but a
    runner that raises on a batch the scheduler admitted."""
    out = io.StringIO()
    args = _args("--examples", "30", "--steps", "6", "--seed", "4", "--loop", "normal")
    status = run_fuzz(args, lambda loop: scheduler_machine(
        loop=loop, runner_factory=lambda n, ps: _ShortContextRunner(
            echo_runner_factory(n, ps).pool)), out)
    text = out.getvalue()
    assert status == 3, text[-3000:]
    assert "\n  the model runner raised IndexError('position " in text, text[-3000:]


def test_a_runner_whose_pool_the_scheduler_refuses_is_the_code_under_test() -> None:
    """A runner factory that ignores the page size it is given: the scheduler refuses its pool
    as it is built, a finding about the runner (exit 3), not the machine's own failure."""
    def fixed_page_size(num_pages: int, page_size: int) -> PageEchoRunner:
        return PageEchoRunner(echo_runner_factory(num_pages, page_size + 1).pool)

    out = io.StringIO()
    args = _args("--examples", "5", "--steps", "4", "--seed", "1", "--loop", "normal")
    status = run_fuzz(args, lambda loop: scheduler_machine(
        loop=loop, runner_factory=fixed_page_size), out)
    text = out.getvalue()
    assert status == 3, text[-3000:]
    assert "PrefillScheduler() raised ValueError" in text and "page" in text, text[-3000:]


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


class _StrayWriter:
    """A runner of one's own that breaks the page rule: its answers are the echo runner's, but
    each forward also writes the values of a page its batch does not name (which the echo's
    answers never read: only the guard around every runner can see it)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.echo = echo_runner_factory(num_pages, page_size)
        self.pool = self.echo.pool

    def forward(self, batch: ForwardBatch) -> list[int]:
        out = self.echo.forward(batch)
        named = {p for item in batch.items for p in item.pages}
        stray = [p for p in range(self.pool.num_pages) if p not in named]
        if stray:
            self.pool.v(0)[stray[0]] += 1.0
        return out


def test_a_runner_of_ones_own_that_writes_outside_its_pages_is_caught() -> None:
    out = io.StringIO()
    args = _args("--examples", "60", "--steps", "8", "--seed", "2", "--loop", "normal")
    programs: list[tuple[str, ...]] = []
    status = run_fuzz(args, lambda loop: scheduler_machine(
        loop=loop, runner_factory=_StrayWriter, on_program=programs.append), out)
    text = out.getvalue()
    assert status == 1, text[-3000:]
    assert "invariant 3" in text and "which none of its items names" in text, text[-3000:]


def test_the_forward_fault_rule_runs_on_a_runner_of_ones_own() -> None:
    """A raising forward is fuzzed whatever the runner (the guard raises in its place)."""
    programs: list[tuple[str, ...]] = []
    machine = scheduler_machine(loop="normal", runner_factory=_OwnRunner,
                                on_program=programs.append)
    case = machine.TestCase
    case.settings = _budget(40, 12)
    case().runTest()
    faults = [p for p in programs if any(step.startswith("forward_fault") for step in p)]
    assert faults, "forward_fault never ran"
    # Some programs had a batch that the fault failed.
    assert any(step.startswith("answer") and step.endswith("FAILED internal None")
               for p in faults for step in p)


class _OwnRunner:
    """A runner of one's own that keeps no violations list and has no logits."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.echo = echo_runner_factory(num_pages, page_size)
        self.pool = self.echo.pool

    def forward(self, batch: ForwardBatch) -> list[int]:
        return self.echo.forward(batch)


def test_a_finding_that_does_not_replay_is_still_a_finding() -> None:
    """A runner that answers wrong tokens from its 20th forward in the whole search on, until
    one reaches an answer, and never again (state that outlives the program: as a runner
    reading os.urandom would): Hypothesis cannot replay the failing program, but what it saw
    was a broken invariant, reported as one."""
    # Not one wrong token at one forward: that one is caught only if it is the last forward of
    # a request answered DONE (not a chunk's, not an aborted request's), which depends on the
    # programs the seed draws.
    forwards, wrong = [0], [True]

    class Sometimes(PageEchoRunner):
        def forward(self, batch: ForwardBatch) -> list[int]:
            out = super().forward(batch)
            forwards[0] += 1
            return [t + 1 for t in out] if wrong[0] and forwards[0] >= 20 else out

    def sometimes(num_pages: int, page_size: int) -> Sometimes:
        return Sometimes(echo_runner_factory(num_pages, page_size).pool)

    def machine(loop: str) -> type[RuleBasedStateMachine]:
        base = scheduler_machine(loop=loop, runner_factory=sometimes, reference=echo_next_token)

        class RightOnceCaught(base):  # type: ignore[misc,valid-type]
            def teardown(self) -> None:
                try:
                    super().teardown()
                finally:
                    if any(r.ok and r.first_token != echo_next_token(
                            prompt_of(r.rid, r.prompt_tokens)) for r in self.responses):
                        wrong[0] = False  # answered (and the check raised): right from now on

        return RightOnceCaught

    out = io.StringIO()
    args = _args("--examples", "60", "--steps", "10", "--seed", "1", "--loop", "normal")
    status = run_fuzz(args, machine, out)
    text = out.getvalue()
    assert not wrong[0], "no wrong token reached an answer in the whole search"
    assert status == 1, text[-3000:]
    assert "FAILED: the normal loop broke an invariant" in text, text[-3000:]
    assert "first token" in text and "is not deterministic, so it could not be shrunk" in text


def test_prompts_are_drawn_within_a_smaller_vocabulary_and_unchanged_otherwise() -> None:
    # The draws of runners without a vocab_size, or with 256 ids or more, are the ones the
    # seeds and replays recorded so far were made with (SHA-256 of these prompts, pinned).
    cases = [(f"r{i}", n) for i in range(1, 40) for n in (0, 1, 5, 30, 97)]
    digest = "9a67bf16164b8024df60f32ad72ab1931808fddbafb6c3949b5cd5f26c1cd5d4"
    for vocab_size in (None, 256, 49_152):
        drawn = [prompt_of(rid, n, vocab_size) for rid, n in cases]
        assert hashlib.sha256(repr(drawn).encode()).hexdigest() == digest, vocab_size
    small = [prompt_of(rid, n, 40) for rid, n in cases]
    assert max(max(p, default=0) for p in small) == 39
    assert small == [tuple(t % 40 for t in prompt_of(rid, n)) for rid, n in cases]


class _SmallVocabRunner(PageEchoRunner):
    vocab_size = 40


def test_a_runner_with_a_small_vocabulary_is_fuzzed_not_refused() -> None:
    """Admission refuses a prompt id outside a runner's vocab_size: the machine draws within
    it, so the search serves requests instead of testing refusals."""
    refused: list[str] = []
    done = [0]

    class Machine(scheduler_machine(  # type: ignore[misc]
            loop="normal", reference=echo_next_token,
            runner_factory=lambda n, ps: _SmallVocabRunner(echo_runner_factory(n, ps).pool))):
        def teardown(self) -> None:
            super().teardown()
            refused.extend(r.detail for r in self.responses if "token ids must be" in r.detail)
            done[0] += sum(r.ok for r in self.responses)

    case = Machine.TestCase
    case.settings = _budget(60, 20)
    case().runTest()
    assert refused == []
    assert done[0] > 50  # served, first tokens checked against the echo of the drawn prompt


def test_the_cli_refuses_bad_budgets() -> None:
    from scheduler.cli.command import UsageError

    with pytest.raises(UsageError, match="--examples must be >= 1"):
        FUZZ.run(_args("--examples", "0"))


def test_the_cli_leaves_nothing_in_the_working_directory(tmp_path: Path) -> None:
    """Hypothesis's own cache goes to a directory of the run's, removed after it: a CI
    workspace is left as it was (a fresh process: the cache is written once per process)."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "scheduler.cli", "fuzz", "--examples", "3", "--steps", "3",
         "--loop", "normal"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []
