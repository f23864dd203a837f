"""CPU load beside a test: a busy process and a busy thread, stopped when the block ends.

Tests that must not depend on thread timing run under it, so a dependency shows up as a
difference between two runs instead of hiding on an idle machine.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


@contextlib.contextmanager
def cpu_load() -> Iterator[None]:
    """Run the block with a spinning process (a core) and a spinning thread (the GIL)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), name="cpu-load", daemon=True)
    spinner.start()
    try:
        yield
    finally:
        stop.set()
        spinner.join()
        proc.kill()
        proc.wait()
