"""``pdlife validate`` and ``pdlife diagram``: the lifecycle tables, shipped or loaded.

``--load MODULE:ATTR`` names one's own table; modules in the working directory are importable,
as with ``python -m``. What cannot be loaded is a one-line usage error (exit 2); a table that
breaks definition rules is exit 1, naming each. Neither command imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from lifecycle import TABLES, LifecycleTable, Tracked, make_table, validate
from lifecycle.errors import InvalidTable
from scheduler.cli.command import Subcommand, UsageError

DOCS_LIFECYCLE = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"
DOCS_DEFAULT = "docs/lifecycle.md"  # --write-docs' FILE, from the working directory

# -- loading ------------------------------------------------------------------------------------


def load_object(spec: str, flag: str = "--load") -> Any:
    """The attribute ``module:ATTR`` names. Import failures are usage errors, except a table
    that breaks a definition rule while its module is imported (InvalidTable, exit 1)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{flag} wants module:ATTR (e.g. mypkg.lifecycles:TABLE), got {spec!r}")
    if module_name.endswith(".py") or "/" in module_name:  # a file where a module goes
        path = module_name.removesuffix(".py")
        dotted = (path.rsplit("/", 1)[-1] if path.startswith("/")  # run from its folder
                  else path.lstrip("./").replace("/", "."))
        raise UsageError(f"{flag}: {module_name!r} is a file (give the module's name, "
                         f"{dotted!r}, not its file; modules are found from the working "
                         f"directory and PYTHONPATH)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"{flag}: cannot import {module_name!r}: {exc}") from None
    except InvalidTable:
        raise
    except Exception as exc:  # the user's module: report it in one line
        raise UsageError(
            f"{flag}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UsageError(f"{flag}: module {module_name!r} has no attribute {attr!r}") from None


def load_table(spec: str) -> LifecycleTable:
    """The table named by ``module:ATTR``: a LifecycleTable, a dict of :func:`make_table`
    arguments, or a function returning either. Raises InvalidTable for a broken definition."""
    obj = load_object(spec)
    expected = "expected a LifecycleTable, a dict of make_table arguments, or a function "
    if isinstance(obj, type):
        raise UsageError(
            f"--load: {spec} is the class {obj.__name__}, not a table; {expected}returning one"
            + (" (a record class goes to --record)" if hasattr(obj, "fire") else "")
        )
    if callable(obj) and not isinstance(obj, LifecycleTable):
        try:
            obj = obj()
        except InvalidTable:
            raise
        except Exception as exc:
            raise UsageError(f"--load: {spec}() raised {type(exc).__name__}: {exc}") from None
    if isinstance(obj, dict):
        try:
            obj = make_table(**obj)
        except TypeError as exc:
            raise UsageError(f"--load: {spec} is not a dict of make_table arguments: {exc}") \
                from None
    if not isinstance(obj, LifecycleTable):
        kind = type(obj).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise UsageError(f"--load: {spec} is {article} {kind}; {expected}returning one")
    return obj


def _tables(args: argparse.Namespace) -> dict[str, LifecycleTable]:
    if args.load:
        table = load_table(args.load)
        return {table.name: table}
    if args.table == "all":
        return dict(TABLES)
    return {args.table: TABLES[args.table]}


def table_arguments(parser: argparse.ArgumentParser, table_help: str) -> None:
    parser.add_argument(
        "--table",
        choices=[*TABLES, "all"],
        default="all",
        help=table_help,
    )
    parser.add_argument(
        "--load",
        metavar="MODULE:ATTR",
        help="use your own table instead: a LifecycleTable, a dict of make_table arguments, "
        "or a function returning one (modules in the working directory are importable)",
    )


def _validate_arguments(parser: argparse.ArgumentParser) -> None:
    table_arguments(parser, "which shipped lifecycle table to check and describe (default: "
                    "all)")


# -- validate ---------------------------------------------------------------------------------


def _names(states: Sequence[Any]) -> str:
    return ", ".join(s.name for s in states)


def _report(name: str, table: LifecycleTable) -> None:
    live = table.live_states()
    finals = [s for s in table.states if s in table.finals]
    failure = ", ".join(table.failure_events) or "none declared"
    print(f"{name}: valid")
    print(f"  states   {len(table.states)}: {_names(list(table.states))}")
    print(f"  initial  {table.initial.name}; finals: {_names(finals)}")
    print(f"  edges    {len(table.edges)} over {len(table.events)} events")
    if table.once:
        print(f"  once     {', '.join(sorted(table.once))} (run exactly once per request)")
    print("  checks passed:")
    print(f"    - one initial state ({table.initial.name}), not final")
    print("    - no edge leaves a final state (final states are absorbing)")
    print("    - at most one edge per (state, event)")
    print(f"    - every state is reachable from {table.initial.name}")
    print(f"    - every live state ({_names(live)}) can reach a final state")
    print(f"    - failure events ({failure}) legal and unguarded from every live state")
    if table.record is not None:
        print(f"    - guards are methods of {table.record.__name__}")


def _refuse_table_with_load(args: argparse.Namespace) -> None:
    if args.load and args.table != "all":
        raise UsageError(f"--table picks a shipped table and --load {args.load} your own: "
                         "give one or the other")


def _validate(args: argparse.Namespace) -> int:
    _refuse_table_with_load(args)
    try:
        tables = _tables(args)
        for table in tables.values():
            validate(table)
    except InvalidTable as exc:
        print(f"pdlife validate: invalid lifecycle table: {exc}", file=sys.stderr)
        return 1
    for name, table in tables.items():
        _report(name, table)
    return 0


VALIDATE = Subcommand(
    name="validate",
    summary="check lifecycle tables against the definition rules",
    description=(
        "Check lifecycle tables against the definition rules (a usable table name; one "
        "initial state, not final; nothing leaves a final state; at most one edge per state "
        "and event; every state reachable; no trap states; failure events legal, unguarded "
        "and final from every live state; event names that can name trigger methods; guards "
        "are methods of the record class) and print, per table, its states, edges and the "
        "checks passed. The shipped tables are checked when imported; --load checks your "
        "own. Exits 1 naming the offending state or edge if a rule is broken, 2 if --load "
        "names something that is not a table."
    ),
    add_arguments=_validate_arguments,
    run=_validate,
)


# -- diagram ----------------------------------------------------------------------------------


def _diagram_arguments(parser: argparse.ArgumentParser) -> None:
    from lifecycle.diagram import FORMATS

    table_arguments(parser, "which shipped lifecycle table (default: all; the dot and svg "
                    "formats draw one table per output, so name one or give --out DIR)")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="mermaid",
        help="mermaid stateDiagram-v2, Graphviz dot source, SVG (needs Graphviz's dot "
        "program), or a markdown transition table (default: mermaid)",
    )
    parser.add_argument(
        "--collapse-failures",
        action="store_true",
        help="draw each failure event once, from one 'any live state' node, instead of once "
        "per live state",
    )
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="write here instead of standard output; an existing directory gets one file per "
        "table (NAME.FORMAT)",
    )
    parser.add_argument(
        "--write-docs",
        metavar="FILE",
        nargs="?",
        const=DOCS_DEFAULT,
        help="regenerate the generated blocks of a doc in place instead of drawing: the "
        "shipped tables' (pdlife's own docs/lifecycle.md) or, with --load, the loaded table's "
        f"(NAME-mermaid, NAME-transitions) (default FILE: {DOCS_DEFAULT}, from the working "
        "directory); exit 2 if FILE lacks a block",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --write-docs: write nothing, exit 1 if the doc is out of date",
    )


def _write_docs(path: Path, check: bool, args: argparse.Namespace) -> int:
    """Regenerate ``path``'s blocks: those of the table ``--load`` gives (``NAME-mermaid``,
    ``NAME-transitions``), or of every shipped table and the prefill ownership table."""
    from lifecycle.diagram import pdlife_doc_extra, sync_docs

    try:
        old = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--write-docs {path}: {exc.strerror or exc}") from None
    tables, extra = (_tables(args), None) if args.load else (TABLES, pdlife_doc_extra())
    new = sync_docs(old, tables, extra)
    if new == old:
        print(f"{path}: up to date")
        return 0
    if check:
        load = f" --load {args.load}" if args.load else ""
        print(f"{path}: out of date; run: pdlife diagram{load} --write-docs {path}",
              file=sys.stderr)
        return 1
    path.write_text(new, encoding="utf-8")
    print(f"{path}: regenerated")
    return 0


def _render(args: argparse.Namespace) -> int:
    from lifecycle.diagram import render

    tables = _tables(args)
    out = Path(args.out) if args.out else None
    if out is not None and args.out.endswith(("/", os.sep)):  # a folder, made if need be
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out {args.out}: {exc.strerror or exc}") from None
    texts = {
        name: render(t, args.format, collapse_failures=args.collapse_failures)
        for name, t in _checked(tables, args, out).items()
    }
    if out is not None and out.is_dir():
        for name, text in texts.items():
            _write(out / f"{name}.{args.format}", text)
    elif out is not None:
        _write(out, "\n".join(texts.values()))
    else:
        sys.stdout.write("\n".join(texts.values()))
    return 0


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--out {path}: {exc.strerror or exc}") from None
    print(path)


def _checked(
    tables: dict[str, LifecycleTable], args: argparse.Namespace, out: Path | None
) -> dict[str, LifecycleTable]:
    if out is not None and not out.is_dir() and not out.parent.is_dir():
        raise UsageError(f"--out {out}: there is no directory {out.parent} to write it in")
    # A dot graph or an SVG holds one table: several need a directory to go into.
    if len(tables) > 1 and args.format in ("dot", "svg") and not (out and out.is_dir()):
        raise UsageError(
            f"--format {args.format} draws one table per output: add --table "
            f"{' or --table '.join(tables)}, or --out DIR for one file per table"
        )
    return tables


def _diagram(args: argparse.Namespace) -> int:
    from lifecycle.diagram import DiagramError

    if args.check and not args.write_docs:
        raise UsageError("--check goes with --write-docs")
    _refuse_table_with_load(args)
    if args.write_docs:
        # The doc's blocks have their own formats: drawing flags would be silently dropped.
        drawing = [flag for flag, given in (
            ("--format", args.format != "mermaid"), ("--out", args.out is not None),
            ("--collapse-failures", args.collapse_failures),
            ("--table", args.table != "all")) if given]
        if drawing:
            verb = "draws" if len(drawing) == 1 else "draw"
            raise UsageError(f"{' and '.join(drawing)} {verb} a diagram, and --write-docs "
                             "regenerates a doc's blocks in their own formats: give one or "
                             "the other")
    try:
        if args.write_docs:
            return _write_docs(Path(args.write_docs), args.check, args)
        return _render(args)
    except InvalidTable as exc:
        print(f"pdlife diagram: invalid lifecycle table: {exc}", file=sys.stderr)
        return 1
    except DiagramError as exc:
        if args.write_docs:  # the document lacks a block, or names one that is not drawn
            raise UsageError(f"{args.write_docs}: {exc}") from None
        print(f"pdlife diagram: {exc}", file=sys.stderr)
        return 1


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


def loadable_class(spec: str, flag: str) -> type:
    """The class ``module:ATTR`` names (for ``--record``)."""
    obj = load_object(spec, flag)
    if not inspect.isclass(obj):
        raise UsageError(f"{flag}: {spec} is a {type(obj).__name__}, not a class")
    if not issubclass(obj, Tracked) or not attrs.has(obj):
        raise UsageError(f"{flag}: {spec} is not a record class: a record is an attrs class "
                         f"that subclasses lifecycle.Tracked")
    return obj
