"""The same seed replays the same search: the scheduler machine depends on its drawn choices
only, under either loop, whatever else the machine is doing.

Each search runs with CPU load beside it (a busy process and a busy thread), so a rule or a draw
that depended on thread timing — a forward on a device thread finishing before or after the
next rule, as it did before the overlap loop's device was stepped — would make the two runs
differ. The programs are compared one by one: every rule, every value drawn, every answer.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import run_state_machine_as_test

from scheduler.testing.device import SteppedDevice
from scheduler.testing.machine import scheduler_machine
from scheduler.testing.verdicts import CodeUnderTestError, InvariantViolation, Kind, classify
from tests.cpu_load import cpu_load

_SETTINGS = settings(
    max_examples=120, stateful_step_count=30, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(autouse=True)
def _quiet_injected_failures() -> Iterator[None]:
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


def _search(loop: str, at_seed: int) -> list[tuple[str, ...]]:
    programs: list[tuple[str, ...]] = []
    machine = scheduler_machine(loop=loop, on_program=programs.append)
    run_state_machine_as_test(seed(at_seed)(machine), settings=_SETTINGS)
    return programs


@pytest.mark.parametrize("loop", ["overlap", "normal"])
def test_the_same_seed_runs_the_same_programs_under_load(loop: str) -> None:
    with cpu_load():
        first = _search(loop, 11)
        second = _search(loop, 11)
    # (Hypothesis also counts runs it discards, so there may be more than max_examples.)
    assert len(first) == len(second) >= _SETTINGS.max_examples
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a == b, f"program {i} differs"
    # The search exercised what makes the overlap loop timing-prone.
    rules = {line.split()[0] for program in first for line in program if line[0] != " "}
    assert {"submit", "step", "abort", "backend", "answer"} <= rules
    if loop == "overlap":
        assert "device_finishes" in rules


def test_a_different_seed_runs_a_different_search() -> None:
    assert _search("overlap", 11) != _search("overlap", 12)


# Run in a process of its own: the constants of a module once imported stay in Hypothesis's
# pool for the rest of the process, and would change what later searches in it draw.
_SEARCHES_AROUND_AN_IMPORT = """
import argparse, hashlib, importlib, io, json, logging
from hypothesis import seed
from hypothesis.stateful import run_state_machine_as_test
from scheduler.cli.fuzz import FUZZ, fuzz_run_settings, run_fuzz
from scheduler.testing.machine import scheduler_machine

logging.disable(logging.ERROR)
parser = argparse.ArgumentParser()
FUZZ.add_arguments(parser)
args = parser.parse_args("--examples 60 --steps 10 --seed 1 --loop normal".split())

def digest(programs):
    return hashlib.sha256(repr(programs).encode()).hexdigest()

def fuzz():
    programs = []
    assert run_fuzz(args, lambda loop: scheduler_machine(loop=loop, on_program=programs.append),
                    io.StringIO()) == 0
    return digest(programs)

def bare():
    programs = []
    machine = seed(args.seed)(scheduler_machine(loop="normal", on_program=programs.append))
    run_state_machine_as_test(machine, settings=fuzz_run_settings(args, print_blob=False))
    return digest(programs)

searches = {"fuzz": [fuzz()], "bare": [bare()]}
importlib.import_module("many_constants")
searches["fuzz"].append(fuzz())
searches["bare"].append(bare())
print(json.dumps(searches))
"""


def test_a_seeded_fuzz_draws_the_same_programs_whatever_was_imported_before(
        tmp_path: Path) -> None:
    """Hypothesis draws some numbers from the literals of the modules imported from outside
    site-packages and the standard library: after importing one more, the same seeded search
    drew other programs (``pdlife fuzz``'s own tests failed when the service's tests had run
    before them). ``run_fuzz`` draws from the seed alone, whatever the process imported."""
    (tmp_path / "many_constants.py").write_text(f"VALUES = {list(range(100, 400))}\n")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", _SEARCHES_AROUND_AN_IMPORT], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(tmp_path)])},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    searches = json.loads(done.stdout)
    before, after = searches["bare"]
    assert before != after, "the import no longer changes what a bare Hypothesis search draws"
    before, after = searches["fuzz"]
    assert before == after, "pdlife fuzz drew other programs after the import"


def test_the_stepped_device_runs_forwards_in_order_when_told_or_waited_for() -> None:
    from scheduler.runner import ForwardBatch, ForwardItem

    ran: list[str] = []

    def forward(batch: ForwardBatch) -> list[int]:
        ran.append(batch.items[0].rid)
        if batch.items[0].rid == "bad":
            raise RuntimeError("device error")
        return [len(ran)]

    def batch(rid: str) -> ForwardBatch:
        return ForwardBatch((ForwardItem(rid, [1], 0, [0]),))

    device = SteppedDevice()
    a, b, bad = (device.submit(forward, batch(r)) for r in ("a", "b", "bad"))
    assert ran == [] and device.busy
    device.finish_next()
    assert ran == ["a"]
    assert b.result() == [2]  # waiting for b runs what is due before it, in order
    assert ran == ["a", "b"] and a.result() == [1] and ran == ["a", "b"]
    with pytest.raises(RuntimeError, match="device error"):
        bad.result()
    assert not device.busy
    device.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        device.submit(forward, batch("late"))


def test_failures_are_classified_by_what_raised() -> None:
    from hypothesis.errors import FailedHealthCheck, FlakyStrategyDefinition

    assert classify(InvariantViolation(3, "pages leaked")).kind is Kind.INVARIANT
    assert "invariant 3 (conservation" in str(InvariantViolation(3, "pages leaked"))
    assert classify(CodeUnderTestError("step() raised ValueError")).kind is Kind.CODE
    assert classify(FlakyStrategyDefinition("inconsistent")).kind is Kind.MACHINE
    assert classify(FailedHealthCheck("too slow")).kind is Kind.MACHINE
    assert classify(KeyError("a bug in a rule")).kind is Kind.MACHINE
    group_type = getattr(builtins, "ExceptionGroup", None)
    if group_type is None:  # Python 3.10: Hypothesis raises the backport's groups
        group_type = pytest.importorskip("exceptiongroup").ExceptionGroup
    group = group_type("two", [KeyError("x"), InvariantViolation(1, "twice")])
    assert classify(group).kind is Kind.INVARIANT  # the worst member decides
