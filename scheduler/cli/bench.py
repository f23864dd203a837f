"""``pdlife bench``: run the benchmarks of a source checkout."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from scheduler.cli.command import Subcommand, UsageError

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "bench"
# In the order `pdlife bench` runs them with no names given (the quick ones first).
ALL = ("lifecycle", "scale", "transfer", "e2e", "delayer", "soak")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "names", nargs="*", metavar="NAME",
        help=f"benchmarks to run (default: all of {', '.join(ALL)})",
    )


def _run(args: argparse.Namespace) -> int:
    if not BENCH_DIR.is_dir():
        raise UsageError(f"no bench/ folder at {BENCH_DIR}: run from a source checkout")
    names = args.names or list(ALL)
    unknown = [n for n in names if not (BENCH_DIR / f"{n}.py").is_file()]
    if unknown:
        raise UsageError(f"unknown benchmark(s) {unknown}; choose from {', '.join(ALL)}")
    status = 0
    for name in names:
        print(f"== python -m bench.{name}", flush=True)
        done = subprocess.run([sys.executable, "-m", f"bench.{name}"], cwd=ROOT, check=False)
        status = status or done.returncode
    return status


BENCH = Subcommand(
    name="bench",
    summary="run benchmarks side by side with their baselines",
    description=(
        "Run the benchmarks in bench/ (each measures pdlife and its baseline in one run and "
        "ends with a RESULT line of ratios). Machines are noisy: compare ratios, not times."
    ),
    add_arguments=_arguments,
    run=_run,
)
