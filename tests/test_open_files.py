"""``pdlife serve`` raises its soft open-files limit to the hard one (scheduler.cli.open_files),
checked in child processes started with a lower soft limit."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, resource
from scheduler.cli.open_files import raise_open_files_limit
print(json.dumps([raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)]))
"""


def _run_with_soft_limit(soft: int) -> tuple[list[int], list[int]]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, check=True, capture_output=True, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
    ).stdout
    result, limits = json.loads(out)
    return result, limits


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    soft = 64 if hard == resource.RLIM_INFINITY else min(64, hard - 1)
    (before, after), (now_soft, now_hard) = _run_with_soft_limit(soft)
    assert before == soft
    assert after == now_soft > soft
    assert now_hard == hard
    if hard != resource.RLIM_INFINITY:
        assert now_soft == hard


def test_a_soft_limit_already_at_the_hard_one_is_left() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        hard = int(Path("/proc/sys/fs/nr_open").read_text())
    (before, after), (now_soft, _) = _run_with_soft_limit(hard)
    assert before == after == now_soft == hard
