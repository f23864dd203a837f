"""What a ``pdlife`` subcommand is: the record every subcommand module defines."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import attrs


@attrs.frozen
class Subcommand:
    """One ``pdlife`` subcommand: its name, a one-line summary, the description ``--help``
    shows, a function that declares its arguments, and one that runs it and returns the exit
    status; ``epilog`` closes its ``--help`` (what it does not do, for instance)."""

    name: str
    summary: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    epilog: str = ""


class UsageError(Exception):
    """Bad command-line input; the message says what to pass instead (exit status 2)."""
