"""One malloc arena: once :func:`use_one_arena` is called, a new thread allocates from the main
arena instead of an arena of its own (scheduler.malloc_arena; docs/benchmarks.md measures what
that saves the overlap loop's device thread). A served SmolLM2's checkpoint, released and given
back, leaves the resident set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scheduler.malloc_arena import use_one_arena

# A fresh process: a thread allocates (and keeps) a MiB, then glibc's malloc_stats() lists the
# arenas on stderr, one "Arena N:" line each.
_PROBE = """
import ctypes, sys, threading
from scheduler.malloc_arena import use_one_arena
if sys.argv[1] == "one":
    assert use_one_arena()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
kept = []
t = threading.Thread(target=lambda: kept.append(libc.malloc(1 << 20)))
t.start()
t.join()
libc.malloc_stats()
"""


def _arenas(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return sum(line.startswith("Arena ") for line in done.stderr.splitlines())


def test_a_new_thread_allocates_from_the_main_arena() -> None:
    assert _arenas("default") == 2  # the thread made an arena of its own
    assert _arenas("one") == 1


def test_the_environment_decides_when_it_sets_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert use_one_arena() is False


_RELEASE = """
import sys
from scheduler.malloc_arena import give_back_freed
from scheduler.model.select import load_model
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10
served = load_model("smollm2", dtype=sys.argv[1])
loaded = rss_mb()
served.release_checkpoint()
assert give_back_freed()
print(loaded, rss_mb())
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_released_checkpoint_leaves_the_resident_set(dtype: str) -> None:
    """What ``pdlife serve`` does once its model is built: SmolLM2's checkpoint is 513 MiB of
    float32 tensors, which the model copied (fused, transposed, in its dtype) all but the
    embedding and norms in float32, all of it in bfloat16."""
    done = subprocess.run([sys.executable, "-c", _RELEASE, dtype], capture_output=True,
                          text=True, timeout=300, check=True)
    loaded, released = map(int, done.stdout.split())
    assert loaded - released > 350, (loaded, released)
