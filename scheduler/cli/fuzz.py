"""``pdlife fuzz``: run the whole-scheduler Hypothesis machine (:mod:`scheduler.testing.machine`).

Each loop (normal, overlap, or both in turn) runs ``--examples`` random programs of up to
``--steps`` rules from ``--seed``. On a failure Hypothesis shrinks the program; the command
prints it (every rule and every value drawn), what kind of failure it is, the seed, and the
command line that reruns exactly this search. Exit status: 0 every program kept the
invariants; 1 an invariant was broken (the report names it); 2 bad arguments; 3 the code under
test raised; 4 the fuzz machine itself failed (an exception in its own code, or data generation
that did not replay). Nothing is written to Hypothesis's example database, the machine runs
no thread beside its rules, and Hypothesis draws from the seed alone
(:func:`without_source_constants`), so a run depends on its arguments only, whatever the process
ran or imported before it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TextIO

from scheduler.cli.command import Subcommand

if TYPE_CHECKING:
    from hypothesis import settings
    from hypothesis.stateful import RuleBasedStateMachine


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=int, default=200,
                        help="random programs per loop (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the search's seed; the same seed replays the same search "
                        "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=50,
                        help="the most rules per program (default: %(default)s)")
    # None: not given (the scheduler's fuzz takes both and echo; --load takes neither).
    parser.add_argument("--loop", choices=("normal", "overlap", "both"), default=None,
                        help="which scheduler loop to fuzz (default: both)")
    parser.add_argument("--model", choices=("echo", "tiny"), default=None,
                        help="echo: a page-checking fake runner (fast); tiny: the reference "
                        "Llama in its tiny shape, first tokens checked against the colocated "
                        "reference (tens of ms per forward) (default: echo)")
    parser.add_argument("--explain", action="store_true",
                        help="run Hypothesis's explain phase on a failure (slow)")
    parser.add_argument("--no-shrink", action="store_true",
                        help="report the first failing program as found, not shrunk (shrinking "
                        "a deep failure can take a minute)")


def _defaults(args: argparse.Namespace) -> None:
    """The scheduler fuzz's defaults for the flags not given."""
    args.loop, args.model = args.loop or "both", args.model or "echo"


def _rerun(args: argparse.Namespace, loop: str) -> str:
    shrink = " --no-shrink" if args.no_shrink else ""
    return (f"pdlife fuzz --examples {args.examples} --seed {args.seed} --steps {args.steps} "
            f"--loop {loop} --model {args.model}{shrink}")


def fuzz_run_settings(args: argparse.Namespace, *, print_blob: bool) -> settings:
    """The Hypothesis settings of a ``pdlife fuzz`` run: ``args``' budget, no example
    database, no deadline, no explain phase unless ``--explain``, no shrinking with
    ``--no-shrink``."""
    from hypothesis import Phase
    from hypothesis import settings as hypothesis_settings

    from lifecycle.testing import fuzz_settings

    run_settings = fuzz_settings(
        explain=args.explain, max_examples=args.examples, stateful_step_count=args.steps,
        database=None, derandomize=False, print_blob=print_blob,
    )
    if args.no_shrink:
        run_settings = hypothesis_settings(run_settings, phases=[
            p for p in run_settings.phases if p is not Phase.shrink])
    return run_settings


@contextlib.contextmanager
def without_source_constants() -> Iterator[None]:
    """Hypothesis draws without the constants of the source code it finds in the process.

    Recent Hypothesis versions (6.170 here) draw about one number in twenty from the literals
    of every module imported from outside site-packages and the standard library, collected
    anew whenever ``sys.modules`` grows. So what a seed draws depends on which of the project's
    modules, or one's own, were imported before the search (importing ``scheduler.service``
    changes the programs a scheduler search draws). Within this block that pool is empty, and a
    seed's search depends on its settings and the machine alone. Hypothesis versions without
    the pool draw that way anyway. It patches a private function of Hypothesis;
    ``tests/test_fuzz_replay.py`` finds out if a release moves it.
    """
    from hypothesis.internal.conjecture import providers

    collect = getattr(providers, "_get_local_constants", None)
    if collect is None:
        yield
        return
    from hypothesis.internal.constants_ast import Constants

    # Hypothesis caches the constants each kind of draw may take, local ones included: cleared
    # on the way in (none from before) and out (the pool counts again after).
    providers.CONSTANTS_CACHE.cache.clear()
    providers._get_local_constants = Constants
    try:
        yield
    finally:
        providers._get_local_constants = collect
        providers.CONSTANTS_CACHE.cache.clear()


def run_fuzz(
    args: argparse.Namespace,
    make_machine: Callable[[str], type[RuleBasedStateMachine]],
    out: TextIO = sys.stdout,
) -> int:
    """Fuzz every loop ``args.loop`` names with the machine ``make_machine(loop)``; print the
    report to ``out``. Returns the exit status: 0 if every program kept the invariants, else
    the :class:`~scheduler.testing.verdicts.Kind` of the failure (1 an invariant broken, 3 the
    code under test raised, 4 the fuzz machine itself failed)."""
    _defaults(args)
    from hypothesis import seed
    from hypothesis.stateful import run_state_machine_as_test

    from scheduler.testing.setup import iter_loops
    from scheduler.testing.verdicts import EXIT_OK, classify

    run_settings = fuzz_run_settings(args, print_blob=True)
    for loop in iter_loops(args.loop):
        machine = seed(args.seed)(make_machine(loop))
        started = time.monotonic()
        print(f"fuzzing the {loop} loop: {args.examples} programs of up to {args.steps} "
              f"rules, seed {args.seed}", file=out, flush=True)
        try:
            with without_source_constants():
                run_state_machine_as_test(machine, settings=run_settings)
        except Exception as exc:  # the report is the point: print it all
            traceback.print_exception(exc, file=out)
            verdict = classify(exc)
            print(f"\n{_HEADLINES[verdict.kind].format(loop=loop, seed=args.seed)}", file=out)
            print(f"  {verdict.summary}", file=out)
            print(f"rerun: {_rerun(args, loop)}", file=out)
            return int(verdict.kind)
        print(f"  ok: {args.examples} programs in {time.monotonic() - started:.1f} s",
              file=out, flush=True)
    print(f"ok: every program kept the invariants (loop {args.loop}, seed {args.seed})",
          file=out)
    return EXIT_OK


# The first line of a failure's report, by its kind (scheduler.testing.verdicts.Kind).
_HEADLINES = {
    1: "FAILED: the {loop} loop broke an invariant (seed {seed}); the shrunk program is above.",
    3: "FAILED: the code under test raised in the {loop} loop (seed {seed}); the shrunk "
       "program is above.",
    4: "ERROR: the fuzz machine itself failed on the {loop} loop (seed {seed}); this says "
       "nothing about the scheduler.",
}


def _fuzz(args: argparse.Namespace) -> int:
    from scheduler.cli.command import UsageError

    for name in ("examples", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    _defaults(args)
    from scheduler.testing.fakes import tiny_model
    from scheduler.testing.machine import scheduler_machine

    # The scheduler logs every injected failure; the report is what matters here.
    logging.disable(logging.CRITICAL)
    factory, reference = tiny_model() if args.model == "tiny" else (None, None)
    return run_fuzz(
        args,
        lambda loop: scheduler_machine(loop=loop, runner_factory=factory, reference=reference),
    )


FUZZ = Subcommand(
    name="fuzz",
    summary="fuzz the whole prefill scheduler under injected faults (Hypothesis)",
    description=(
        "Run random programs of submits (any length, reused rooms and ids), passes, aborts in "
        "every state, handshakes, bootstrap and transfer failures and timeouts, forward "
        "errors and clock jumps against a real prefill scheduler, checking the lifecycle "
        "invariants after every step and that every pool is full again at the end. On a "
        "failure prints the shrunk program and the command that reruns it. Exit status: 0 "
        "ok, 1 an invariant broken, 2 bad arguments, 3 the code under test raised, 4 the fuzz "
        "machine itself failed."
    ),
    add_arguments=_arguments,
    run=_fuzz,
)
