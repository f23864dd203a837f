"""One glibc malloc arena for the whole process: :func:`use_one_arena`; and freed memory handed
back to the kernel: :func:`give_back_freed`.

glibc gives threads that allocate arenas of their own (up to eight per core) and hands the free
top of a thread arena's heap back to the kernel as the heap shrinks. A thread that allocates and
frees large buffers over and over, as the overlap loop's device thread does running a CPU
forward, then faults those pages in again on every forward: a SmolLM2 forward of 1,024 tokens
(one torch thread) took 120,000-130,000 page faults and 0.2 s of system time on a worker
thread, and ran 6-7% slower than on the main thread, which faulted none after its first
forward. With one arena every thread allocates from the main arena, whose freed memory stays
mapped, and the forward runs as fast on the device thread as on the main one
(docs/benchmarks.md, *e2e*).

The limit counts only from when it is set: glibc hands later threads the arenas that exist by
then, so it works fully when set before a second thread allocates (what ``pdlife serve`` does
with ``--overlap``); set later, later threads share the arenas made before. Setting
``MALLOC_ARENA_MAX`` in the environment, which glibc reads at start-up, does the same from the
first allocation on; when it is set, :func:`use_one_arena` leaves the choice to it.

glibc keeps what the process frees for its next allocations: after a large one-off release (the
checkpoint a model was built from, about 470 MB of SmolLM2's) the resident size stays where it
was until :func:`give_back_freed` asks glibc to return the free pages of every arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: glibc's ``mallopt`` parameter for the most arenas.
_M_ARENA_MAX = -8


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def give_back_freed() -> bool:
    """Hand the memory the process freed back to the kernel (glibc's ``malloc_trim``); True
    when some was. Does nothing (False) where the C library is not glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    return trim is not None and bool(trim(0))


def use_one_arena() -> bool:
    """Limit glibc's malloc to one arena from now on; True once the limit is set (by this call
    or an earlier one). Does nothing (False) when ``MALLOC_ARENA_MAX`` is set in the environment
    or the C library is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, 1))
