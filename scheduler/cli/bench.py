"""``pdlife bench``: run the benchmarks of the source tree pdlife is installed from.

The benchmarks (``bench/``) are not part of the installed package: ``pdlife bench`` runs
``python -m bench.NAME`` in the tree that holds the ``scheduler`` package it was imported from,
which is a checkout only for an editable install (``make setup``, ``pip install -e .``), and that
checkout whatever the current directory. Without a ``bench/`` there it refuses (exit 2).

Before it runs anything it shows the plan: which benchmarks, what each measures and about how
long each takes on a 2-core machine; then a progress bar over the estimated total while each
benchmark's own output (its ``RESULT`` line last) scrolls above it.
"""

from __future__ import annotations

import argparse
import ast
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from scheduler.cli.command import Subcommand, UsageError

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "bench"


@attrs.frozen
class Benchmark:
    name: str
    seconds: int  # about how long one run takes on an idle 2-core machine
    measures: str  # the first paragraph of the benchmark module's docstring


#: About how long each takes on an idle 2-core machine, in the order `pdlife bench` runs them
#: with no names given (the quick ones first).
_SECONDS = {"lifecycle": 50, "scale": 35, "delayer": 30, "tracing": 25, "grammar": 15,
            "e2e": 65, "transfer": 300, "soak": 30, "overload": 70, "stream_cost": 45,
            "prefix": 200, "model": 240}


def _measures(name: str) -> str:
    """What a benchmark measures: its module docstring's first paragraph, read without running
    it (importing a benchmark pulls in torch and its model)."""
    path = BENCH_DIR / f"{name}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) if path.is_file() else None
    first = (doc or "").split("\n\n")[0]
    return " ".join(first.replace(":mod:", "").replace("`", "").split())


ALL = tuple(Benchmark(name, seconds, _measures(name)) for name, seconds in _SECONDS.items())
BY_NAME = {b.name: b for b in ALL}


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "names", nargs="*", metavar="NAME",
        help=f"benchmarks to run (default: all of {', '.join(BY_NAME)})",
    )
    parser.add_argument("--list", action="store_true",
                        help="show the plan (what each measures, about how long) and exit")


def plan(names: list[str]) -> list[Benchmark]:
    unknown = [n for n in names if n not in BY_NAME or not (BENCH_DIR / f"{n}.py").is_file()]
    if unknown:
        raise UsageError(f"unknown benchmark(s) {unknown}; choose from {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names] if names else list(ALL)


def _run(args: argparse.Namespace) -> int:
    if not BENCH_DIR.is_dir():
        raise UsageError(
            f"no bench/ folder at {BENCH_DIR}: pdlife bench runs the benchmarks of the source "
            f"tree pdlife is installed from, and this pdlife is not installed from a checkout; "
            f"install it editable from one (make setup, or pip install -e .), or run python -m "
            f"bench.NAME in the checkout")
    chosen = plan(args.names)
    total = sum(b.seconds for b in chosen)
    print(f"pdlife bench: {len(chosen)} benchmark(s) of {ROOT}, about {_duration(total)} on 2 "
          f"idle cores")
    for b in chosen:
        print(f"  {b.name:<10} ~{_duration(b.seconds):>8}  {b.measures}")
    if args.list:
        return 0
    print(flush=True)
    return _run_all(chosen, total)


def _run_all(chosen: list[Benchmark], total: int) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    status = 0
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("", total=total)
        done_before = 0
        for i, b in enumerate(chosen, 1):
            progress.update(task, description=f"[{i}/{len(chosen)}] bench.{b.name}")
            echo(console, f"== python -m bench.{b.name}")
            start = time.monotonic()

            def advance(b: Benchmark = b, start: float = start, before: int = done_before) -> None:
                # The bar moves with the clock, up to just short of the estimate.
                ran = min(time.monotonic() - start, b.seconds * 0.95)
                progress.update(task, completed=before + ran)

            status = _one(b, console, advance) or status
            done_before += b.seconds
            progress.update(task, completed=done_before)
    return status


def echo(console: Any, line: str) -> None:
    """Print ``line`` as it is: never wrapped (a RESULT line stays one line for grep, on a
    terminal or piped), no markup."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def _one(b: Benchmark, console: Any, tick: Callable[[], None]) -> int:
    """Run one benchmark, echoing its output; ``tick`` twice a second."""
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    with subprocess.Popen(
        [sys.executable, "-m", f"bench.{b.name}"], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    ) as proc:
        out = proc.stdout
        assert out is not None

        def pump() -> None:
            for line in out:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, name=f"bench-{b.name}-output", daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                tick()
                continue
            if line is None:
                break
            echo(console, line)
            tick()
    return proc.returncode


BENCH = Subcommand(
    name="bench",
    summary="run benchmarks side by side with their baselines",
    description=(
        "Run the benchmarks in bench/ (each measures pdlife and its baseline in one run and "
        "ends with a RESULT line of ratios). Shows the plan with estimated times first, then "
        "a progress bar. Machines are noisy: compare ratios, not times. The benchmarks are "
        "those of the source tree pdlife is installed from (an editable install, as make setup "
        f"makes; here {ROOT}), whatever the current directory; bench/ is not in the installed "
        "package, so without one there pdlife bench refuses (exit 2)."
    ),
    add_arguments=_arguments,
    run=_run,
)
