"""The Mooncake engine's own log lines, caught while it starts and passed on through logging.

Theory of operation
-------------------
The transfer engine logs through glog straight to file descriptor 2, not through Python's
``logging``. While it initialises it prints a few lines that look alarming and are not:

- ``E... transfer_metadata.cpp:...] Local segment descriptor not found``: the first transport
  an engine installs asks the metadata for a descriptor of its own segment, to extend one that
  may exist, before it creates it; in ``P2PHANDSHAKE`` mode that lookup logs this ERROR and the
  transport then creates the descriptor (Mooncake's ``TcpTransport::allocateLocalSegmentID``).
  Transfers work after it; every engine start prints it.
- ``W... topology.cpp:...] No RDMA devices found``: expected when the protocol is ``tcp`` (with
  ``rdma`` it is a real warning and stays one).
- ``W... Using default malloc/free for protocol: tcp``: which allocator the engine uses.
- ``W... Memory allocator already initialized with: tcp``: the allocator is one per process,
  chosen by the first engine's protocol; every later engine in the process (a pair in one
  process, a decode's engine per prefill server) logs that it keeps it. TCP and RDMA both use
  malloc/free, so it is the one the later engine would have chosen.
- ``WARNING: Logging before InitGoogleLogging() is written to STDERR``: glog's banner.

:func:`engine_log_captured` points descriptor 2 at a temporary file for the duration of a
block (the engine's start), then hands every line written there to :func:`relog`: a glog line
is logged on ``logger`` at its own level, except the known harmless ones above, which go to
DEBUG; any other line (another thread's output during the block) is written back to the real
standard error unchanged. Nothing is dropped; only the harmless lines lose their alarm.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from typing import BinaryIO

#: ``E1130 19:37:19.390807 14374 transfer_metadata.cpp:1098] message``
_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([\w.]+:\d+)\] (.*)$")
_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
_BANNER = "WARNING: Logging before InitGoogleLogging() is written to STDERR"

Harmless = tuple[tuple[str, str, str], ...]
#: (source file, message start, why it is harmless) of the lines every engine start prints.
HARMLESS: Harmless = (
    ("transfer_metadata.cpp", "Local segment descriptor not found",
     "the first transport looks its own segment up before creating it"),
    ("transfer_engine_py.cpp", "Using default malloc/free for protocol",
     "the engine's allocator"),
    ("transfer_engine_py.cpp", "Memory allocator already initialized",
     "the process's allocator, chosen by its first engine, is kept"),
)
#: What an engine start on ``tcp`` also prints.
HARMLESS_ON_TCP: Harmless = (
    *HARMLESS, ("topology.cpp", "No RDMA devices found", "the protocol is tcp"),
)


def _harmless(where: str, message: str, harmless: Harmless) -> str:
    source = where.partition(":")[0]
    for file, start, why in harmless:
        if source == file and message.startswith(start):
            return why
    return ""


def relog(
    lines: Iterable[str], logger: logging.Logger, passthrough: BinaryIO,
    harmless: Harmless = HARMLESS,
) -> None:
    """Log the engine's glog ``lines`` on ``logger`` (the ``harmless`` ones at DEBUG); write
    every other line to ``passthrough`` as it was."""
    for line in lines:
        if not line.strip():
            continue
        if line == _BANNER:
            logger.debug("mooncake: %s", line)
            continue
        match = _GLOG.match(line)
        if match is None:
            passthrough.write(line.encode(errors="replace") + b"\n")
            continue
        level, where, message = match.groups()
        why = _harmless(where, message, harmless)
        if why:
            logger.debug("mooncake %s] %s (harmless: %s)", where, message, why)
        else:
            logger.log(_LEVELS[level], "mooncake %s] %s", where, message)
    passthrough.flush()


@contextlib.contextmanager
def engine_log_captured(
    logger: logging.Logger, harmless: Harmless = HARMLESS
) -> Iterator[None]:
    """Catch what is written to file descriptor 2 inside the block and :func:`relog` it."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode(errors="replace")
            with open(2, "wb", closefd=False) as stderr:
                relog(text.splitlines(), logger, stderr, harmless)
