"""The ``pdlife`` command line.

Every subcommand is one :class:`Subcommand` record (name, one-line summary, description, a
function that declares its arguments, a function that runs it and returns the exit status),
listed once in :data:`SUBCOMMANDS`; :func:`main` builds the parser from that list. Commands
import what they need when they run, so ``pdlife --help`` stays fast.

Exit statuses: 0 success, 1 the thing checked is wrong (an invalid table, stale docs),
2 bad usage (argparse's convention, also for a ``--load`` target that cannot be loaded).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lifecycle import TABLES, LifecycleTable, make_table, validate
from lifecycle.errors import InvalidTable
from scheduler.cli.bench import BENCH
from scheduler.cli.command import Subcommand, UsageError
from scheduler.cli.demo import DEMO
from scheduler.cli.fuzz import FUZZ
from scheduler.cli.serve import GENERATE, SERVE

DOCS_LIFECYCLE = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"


# -- loading tables ---------------------------------------------------------------------------


def load_table(spec: str) -> LifecycleTable:
    """The table named by ``module:ATTR``: a LifecycleTable, a dict of :func:`make_table`
    arguments, or a callable returning either. Raises InvalidTable for a broken definition."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--load wants module:ATTR (e.g. mypkg.lifecycles:TABLE), got {spec!r}")
    # As `python -m` does: modules in the working directory are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--load: cannot import {module_name!r}: {exc}") from exc
    try:
        obj: Any = getattr(module, attr)
    except AttributeError:
        raise UsageError(f"--load: module {module_name!r} has no attribute {attr!r}") from None
    if callable(obj) and not isinstance(obj, LifecycleTable):
        obj = obj()
    if isinstance(obj, dict):
        obj = make_table(**obj)
    if not isinstance(obj, LifecycleTable):
        raise UsageError(
            f"--load: {spec} is a {type(obj).__name__}; expected a LifecycleTable, a dict of "
            f"make_table arguments, or a callable returning one"
        )
    return obj


def _tables(args: argparse.Namespace) -> dict[str, LifecycleTable]:
    if args.load:
        table = load_table(args.load)
        return {table.name: table}
    if args.table == "all":
        return dict(TABLES)
    return {args.table: TABLES[args.table]}


def _table_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--table",
        choices=[*TABLES, "all"],
        default="all",
        help="which shipped lifecycle table (default: all)",
    )
    parser.add_argument(
        "--load",
        metavar="MODULE:ATTR",
        help="use your own table instead: a LifecycleTable, a dict of make_table arguments, "
        "or a callable returning one (modules in the working directory are importable)",
    )


# -- validate ---------------------------------------------------------------------------------


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    _table_arguments(parser)


def _names(states: Sequence[Any]) -> str:
    return ", ".join(s.name for s in states)


def _validate(args: argparse.Namespace) -> int:
    try:
        tables = _tables(args)
        for table in tables.values():
            validate(table)
    except InvalidTable as exc:
        print(f"invalid lifecycle table: {exc}", file=sys.stderr)
        return 1
    for name, table in tables.items():
        live = table.live_states()
        finals = [s for s in table.states if s in table.finals]
        failure = ", ".join(table.failure_events) or "none declared"
        print(f"{name}: valid")
        print(f"  states   {len(table.states)}: {_names(list(table.states))}")
        print(f"  initial  {table.initial.name}; finals: {_names(finals)}")
        print(f"  edges    {len(table.edges)} over {len(table.events)} events")
        print("  checks passed:")
        print(f"    - one initial state ({table.initial.name}), not final")
        print("    - no edge leaves a final state (final states are absorbing)")
        print("    - at most one edge per (state, event)")
        print(f"    - every state is reachable from {table.initial.name}")
        print(f"    - every live state ({_names(live)}) can reach a final state")
        print(f"    - failure events ({failure}) legal and unguarded from every live state")
    return 0


VALIDATE = Subcommand(
    name="validate",
    summary="check lifecycle tables against the definition rules",
    description=(
        "Check lifecycle tables: one initial state, nothing leaves a final state, every state "
        "reachable, no trap states, failure events legal from every live state. The shipped "
        "tables are checked when imported; --load checks your own. Exits 1 naming the "
        "offending state or edge if a rule is broken."
    ),
    add_arguments=_validate_arguments,
    run=_validate,
)


# -- diagram ----------------------------------------------------------------------------------


def _diagram_arguments(parser: argparse.ArgumentParser) -> None:
    from lifecycle.diagram import FORMATS

    _table_arguments(parser)
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="mermaid",
        help="mermaid stateDiagram-v2, Graphviz dot source, SVG (needs Graphviz's dot "
        "program), or a markdown transition table (default: mermaid)",
    )
    parser.add_argument("--out", metavar="FILE", help="write here instead of standard output")
    parser.add_argument(
        "--write-docs",
        metavar="FILE",
        nargs="?",
        const=str(DOCS_LIFECYCLE),
        help="regenerate the generated blocks of the lifecycle doc in place "
        f"(default FILE: {DOCS_LIFECYCLE.relative_to(DOCS_LIFECYCLE.parents[1])})",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --write-docs: write nothing, exit 1 if the doc is out of date",
    )


def _write_docs(path: Path, check: bool) -> int:
    from lifecycle.diagram import sync_docs

    old = path.read_text(encoding="utf-8")
    new = sync_docs(old, TABLES)
    if new == old:
        print(f"{path}: up to date")
        return 0
    if check:
        print(f"{path}: out of date; run: pdlife diagram --write-docs", file=sys.stderr)
        return 1
    path.write_text(new, encoding="utf-8")
    print(f"{path}: regenerated")
    return 0


def _diagram(args: argparse.Namespace) -> int:
    from lifecycle.diagram import DiagramError, render

    if args.check and not args.write_docs:
        raise UsageError("--check goes with --write-docs")
    try:
        if args.write_docs:
            return _write_docs(Path(args.write_docs), args.check)
        tables = _tables(args)
        if args.format == "svg" and len(tables) > 1:
            raise UsageError("an SVG shows one table: add --table prefill or --table decode")
        text = "\n".join(render(t, args.format) for t in tables.values())
    except InvalidTable as exc:
        print(f"invalid lifecycle table: {exc}", file=sys.stderr)
        return 1
    except DiagramError as exc:
        print(f"pdlife diagram: {exc}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


DIAGRAM = Subcommand(
    name="diagram",
    summary="draw the lifecycle tables (mermaid, dot, svg, markdown)",
    description=(
        "Render lifecycle tables, generated from the same table the machine runs on. "
        "Output is deterministic, so it can be diffed. --write-docs regenerates the "
        "diagrams and tables embedded in the lifecycle doc."
    ),
    add_arguments=_diagram_arguments,
    run=_diagram,
)


# -- the command ------------------------------------------------------------------------------

#: Every subcommand, in the order ``pdlife --help`` lists them. Add new ones here.
SUBCOMMANDS: tuple[Subcommand, ...] = (
    DEMO, SERVE, GENERATE, DIAGRAM, VALIDATE, FUZZ, BENCH
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdlife",
        description="pdlife: the prefill side of prefill/decode-disaggregated LLM serving, "
        "as explicit, table-driven state machines.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in SUBCOMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.summary, description=cmd.description,
                           epilog=cmd.epilog or None)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.run(args)
    except UsageError as exc:
        parser.exit(2, f"pdlife {args.command}: {exc}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
