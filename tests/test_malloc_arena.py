"""One malloc arena: once :func:`use_one_arena` is called, a new thread allocates from the main
arena instead of an arena of its own (scheduler.malloc_arena; docs/benchmarks.md measures what
that saves the overlap loop's device thread); ``pdlife serve --overlap`` sets it on a device that
resolves to the CPU, however named. A served SmolLM2's checkpoint, released and given back, leaves
the resident set."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from scheduler.cli.serve import SERVE, one_arena_applies
from scheduler.malloc_arena import use_one_arena

# A fresh process: a thread allocates (and keeps) a MiB, then glibc's malloc_stats() lists the
# arenas on stderr, one "Arena N:" line each.
_PROBE = """
import argparse, ctypes, sys, threading
from scheduler.cli.serve import SERVE, one_arena_applies
from scheduler.malloc_arena import use_one_arena
if sys.argv[1] == "one":
    assert use_one_arena()
elif sys.argv[1] != "default":  # what `pdlife serve --overlap --device ARG` does first
    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    if one_arena_applies(parser.parse_args(["--overlap", "--device", sys.argv[1]])):
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


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize(("flags", "applies"), [
    (("--overlap", "--device", "cpu"), True),
    (("--overlap", "--device", "cpu:0"), True),
    (("--overlap", "--device", "auto"), not torch.cuda.is_available()),
    (("--overlap",), True),  # --device's default
    (("--device", "cpu"), False),  # the normal loop has no device thread
    (("--device", "cpu:0"), False),
    (("--overlap", "--device", "meta"), False),  # refused later, by serve_config
])
def test_serve_takes_one_arena_with_overlap_on_a_cpu(flags: tuple[str, ...],
                                                      applies: bool) -> None:
    assert one_arena_applies(_serve_args(*flags)) is applies


@pytest.mark.parametrize("device", ["cpu:0", "auto"])
def test_serve_sets_the_arena_before_a_thread_allocates(device: str) -> None:
    """Resolving the device imports torch, which starts a thread of its own: the arena is still
    set before any thread allocates, so the next thread's allocation lands in the main arena."""
    if device == "auto" and torch.cuda.is_available():
        pytest.skip("auto resolves to CUDA here")
    assert _arenas(device) == 1


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
