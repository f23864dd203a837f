"""The ``pdlife`` command line.

Every subcommand is one :class:`Subcommand` record (name, one-line summary, description, a
function that declares its arguments, a function that runs it and returns the exit status),
listed once in :data:`SUBCOMMANDS`; :func:`main` builds the parser from that list. Only the
subcommand being run declares its arguments (some defaults come from modules that import
torch), and commands import what they need when they run, so ``pdlife --help``, ``pdlife
validate``, ``pdlife diagram`` and ``pdlife fuzz --load`` start without torch.

Exit statuses: 0 success, 1 the thing checked is wrong (an invalid table, stale docs),
2 bad usage (argparse's convention, also for a ``--load`` target that cannot be loaded),
141 the reader of standard output went away before the command finished writing
(``pdlife fuzz ... | head -1``): the shell's status for a command ended by SIGPIPE, without a
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence

import attrs

from scheduler.cli.bench import BENCH
from scheduler.cli.command import Subcommand, UsageError
from scheduler.cli.demo import DEMO
from scheduler.cli.fuzz import FUZZ as SCHEDULER_FUZZ
from scheduler.cli.generate import GENERATE
from scheduler.cli.serve import SERVE
from scheduler.cli.tables import DIAGRAM, DOCS_LIFECYCLE, VALIDATE, load_table
from scheduler.cli.top import TOP

__all__ = ["DOCS_LIFECYCLE", "SUBCOMMANDS", "build_parser", "load_table", "main"]


def _fuzz_arguments(parser: argparse.ArgumentParser) -> None:
    from scheduler.cli.fuzz_table import table_fuzz_arguments

    SCHEDULER_FUZZ.add_arguments(parser)
    table_fuzz_arguments(parser)


def _fuzz(args: argparse.Namespace) -> int:
    # Hypothesis keeps a cache of its own (.hypothesis/ in the working directory) even
    # without an example database; a fuzz run from a CI workspace leaves nothing there.
    from hypothesis.configuration import set_hypothesis_home_dir

    with tempfile.TemporaryDirectory(prefix="pdlife-fuzz-") as home:
        set_hypothesis_home_dir(home)
        try:
            return _fuzz_in(args)
        finally:
            set_hypothesis_home_dir(None)


def _fuzz_in(args: argparse.Namespace) -> int:
    # --load fuzzes one's own lifecycle table; otherwise the whole prefill scheduler.
    if args.load is None:
        for flag in ("record", "satisfy"):
            if getattr(args, flag):
                raise UsageError(f"--{flag.replace('_', '-')} goes with --load")
        return SCHEDULER_FUZZ.run(args)
    from scheduler.cli.fuzz_table import run_table_fuzz

    for flag in ("loop", "model"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} picks what the scheduler's fuzz runs; --load fuzzes "
                             "the table alone: drop it")
    for name in ("examples", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    return run_table_fuzz(args)


FUZZ = attrs.evolve(
    SCHEDULER_FUZZ,
    summary="fuzz the prefill scheduler under injected faults, or your own lifecycle table "
            "(--load) (Hypothesis)",
    add_arguments=_fuzz_arguments,
    run=_fuzz,
    description=SCHEDULER_FUZZ.description
    + " With --load MODULE:TABLE it fuzzes your own lifecycle table instead (its record "
    "class from --record or the table), checking pure guards, once-only hooks and the "
    "table's rules; exit status 1 names the rule broken.",
)

#: Every subcommand, in the order ``pdlife --help`` lists them. Add new ones here.
SUBCOMMANDS: tuple[Subcommand, ...] = (
    DEMO, SERVE, GENERATE, TOP, DIAGRAM, VALIDATE, FUZZ, BENCH
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdlife")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command``, only that subcommand declares its arguments."""
    parser = argparse.ArgumentParser(
        prog="pdlife",
        description="pdlife: the prefill side of prefill/decode-disaggregated LLM serving, "
        "as explicit, table-driven state machines.",
    )
    parser.add_argument("--version", action="version", version=f"pdlife {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in SUBCOMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.summary, description=cmd.description,
                           epilog=cmd.epilog or None)
        if command is None or cmd.name == command:
            cmd.add_arguments(p)
        p.set_defaults(run=cmd.run, parser=p)
    return parser


def _command_of(argv: Sequence[str]) -> str:
    # The subcommand is the first argument that is not an option; "" when there is none
    # (then no subcommand's arguments are needed: the top-level help or a usage error).
    names = {cmd.name for cmd in SUBCOMMANDS}
    first = next((a for a in argv if not a.startswith("-")), "")
    return first if first in names else ""


#: The exit status when standard output's reader closed it: 128 + SIGPIPE, as a shell reports
#: a command SIGPIPE ended (Python ignores the signal and raises BrokenPipeError instead).
BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            # A closed pipe shows when the buffer is written: here, not at the interpreter's
            # exit, where it would be reported as an exception ignored.
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's recipe: what is still buffered goes to devnull, so that the flush at exit
        # finds no pipe to fail on.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_of(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        status: int = args.run(args)
    except UsageError as exc:
        parser.exit(2, f"pdlife {args.command}: {exc}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
