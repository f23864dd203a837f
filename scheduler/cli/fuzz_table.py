"""``pdlife fuzz --load MODULE:TABLE``: fuzz one's own lifecycle table from the command line.

The table's :class:`~lifecycle.fuzzer.LifecycleMachine` (``lifecycle.testing``) fires random
legal and illegal events at records of ``--record`` (default: the class the table was built
with, ``make_table(..., record=...)``), singly and in batches. Its hooks are counting stand-ins:
what is checked is the table and the record's guards (pure, one evaluation each), and that
every hook in the table's ``once`` runs exactly once per request. So that guarded edges are
taken as well as refused, the machine sets the record's plain fields to drawn values before
some guarded events (drawing again, a few times, until the guards hold), or calls
``--satisfy``, a function ``satisfy(record, edge)`` that makes the edge's guards hold.

On a broken rule it prints the report (the rule, the shrunk event program, the request's
timeline) and the command that reruns the search, and exits 1; 3 when the code under test
raised (a guard, the record class, ``--satisfy``); 4 when Hypothesis itself gave up. Nothing
here imports torch or the scheduler.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from lifecycle.errors import InvalidTable
from lifecycle.table import guard_methods
from scheduler.cli.command import UsageError
from scheduler.cli.tables import load_object, load_table, loadable_class


def table_fuzz_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "your own lifecycle table (--load fuzzes it instead of the scheduler; --examples, "
        "--steps and --seed apply)"
    )
    group.add_argument("--load", metavar="MODULE:TABLE",
                       help="the table: a LifecycleTable, a dict of make_table arguments, or "
                       "a function returning one")
    group.add_argument("--record", metavar="MODULE:CLASS",
                       help="the record class, built as CLASS(rid) (default: the table's "
                       "record=)")
    group.add_argument("--satisfy", metavar="MODULE:FUNC",
                       help="satisfy(record, edge) makes the edge's guards hold")


def _record_class(args: argparse.Namespace, table: Any) -> type:
    record: type | None = loadable_class(args.record, "--record") if args.record else table.record
    if record is None:
        raise UsageError(f"--record is needed: table {table.name!r} was built without record=")
    try:
        record("probe")
    except Exception as exc:
        raise UsageError(
            f"--record: {record.__name__}('probe') raised {type(exc).__name__}: {exc}; the "
            f"fuzzer builds records as CLASS(rid)"
        ) from None
    try:
        guard_methods(table, record)
    except InvalidTable as exc:
        raise UsageError(f"--record {record.__name__}: {exc}") from None
    return record


def _rerun(args: argparse.Namespace) -> str:
    parts = [f"pdlife fuzz --load {args.load}"]
    parts += [f"--record {args.record}"] if args.record else []
    parts += [f"--satisfy {args.satisfy}"] if args.satisfy else []
    parts += ["--no-shrink"] if args.no_shrink else []
    parts += ["--explain"] if args.explain else []
    parts.append(f"--examples {args.examples} --steps {args.steps} --seed {args.seed}")
    return " ".join(parts)


def run_table_fuzz(args: argparse.Namespace) -> int:
    """Fuzz the table ``args.load`` names; print the outcome; the exit status."""
    from hypothesis import seed
    from hypothesis.errors import HypothesisException
    from hypothesis.stateful import run_state_machine_as_test

    from lifecycle.testing import CodeRaised, RuleBroken, lifecycle_state_machine
    from scheduler.cli.fuzz import fuzz_run_settings

    try:
        table = load_table(args.load)
    except InvalidTable as exc:
        print(f"pdlife fuzz: invalid lifecycle table: {exc}", file=sys.stderr)
        return 1
    record = _record_class(args, table)
    satisfy: Callable[..., None] | None = None
    if args.satisfy:
        satisfy = load_object(args.satisfy, "--satisfy")
        if not callable(satisfy):
            raise UsageError(f"--satisfy: {args.satisfy} is not callable")
    machine = seed(args.seed)(lifecycle_state_machine(
        table, record, satisfy=satisfy, redraw_fields=satisfy is None, explain=args.explain
    ))
    run_settings = fuzz_run_settings(args, print_blob=False)
    print(f"fuzzing table {table.name!r} with {record.__name__} records: {args.examples} "
          f"programs of up to {args.steps} steps, seed {args.seed}", flush=True)
    started = time.monotonic()
    try:
        try:
            run_state_machine_as_test(machine, settings=run_settings)
        except ExceptionGroup as group:  # several distinct failures: report the most telling
            raise _most_telling(group) from None
    except RuleBroken as exc:
        print(f"\n{exc}\n")
        _print_notes(exc)
        print(f"FAILED after {time.monotonic() - started:.1f} s (seed {args.seed}); rerun: "
              f"{_rerun(args)}")
        return 1
    except CodeRaised as exc:
        if exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__)
        print(f"\n{exc}\n")
        _print_notes(exc)
        print(f"FAILED after {time.monotonic() - started:.1f} s: the code under test raised "
              f"(seed {args.seed}); rerun: {_rerun(args)}")
        return 3
    except HypothesisException as exc:
        traceback.print_exception(exc)
        print(f"\nERROR: Hypothesis gave up ({type(exc).__name__}); this says nothing about "
              "the table.")
        return 4
    except Exception as exc:  # the code under test raised outside a step (rare)
        traceback.print_exception(exc)
        print(f"\nFAILED: the code under test raised {type(exc).__name__}: {exc}")
        print(f"rerun: {_rerun(args)}")
        return 3
    # "ok" covers the table's rules: the hooks were counting stand-ins and no invariant of the
    # embedder's ran (lifecycle_state_machine in pytest takes both).
    print(f"ok: {args.examples} programs kept every rule of the table "
          f"({time.monotonic() - started:.1f} s); the hooks were counting stand-ins and no "
          "invariants of yours ran: lifecycle_state_machine in pytest runs both "
          "(docs/framework.md, section 8)")
    return 0


def _most_telling(group: BaseExceptionGroup[Any]) -> BaseException:
    """Of the distinct failures Hypothesis found in one search, the one to report: a broken
    rule before the code under test raising (exit 1 before 3, as the scheduler's fuzz sorts
    them), and among broken rules an impure guard first, which makes the others follow."""
    from lifecycle.testing import CodeRaised, RuleBroken

    found = _leaves(group)

    def rank(exc: BaseException) -> int:
        if isinstance(exc, RuleBroken):
            return 0 if str(exc).startswith("rule broken: guards are pure") else 1
        return 2 if isinstance(exc, CodeRaised) else 3

    return min(found, key=rank)


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


def _print_notes(exc: BaseException) -> None:
    """The explanation ``--explain`` added to the failure (Hypothesis keeps it in the
    exception's notes, after its own copy of the program, which the report already shows)."""
    notes = list(getattr(exc, "__notes__", ()))
    start = next((i for i, note in enumerate(notes) if note.startswith("Explanation:")), None)
    if start is not None:
        print("\n".join(notes[start:]) + "\n")
