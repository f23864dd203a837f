"""The examples in examples/ run as documented (a subprocess each) and say what they should."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_embed_minimal() -> None:
    out = _run("embed_minimal.py")
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for rid in ("short", "chunked"):
        assert re.search(r"DONE .*http=200 first_token=(\d+) \(expected \1\)", lines[rid])
    assert re.search(r"FAILED .*reason=aborted .*http=200", lines["aborted"])
    assert re.search(r"FAILED .*reason=transfer_failed .*http=500", lines["doomed"])
    assert re.search(r"FAILED .*reason=rejected .*http=400", lines["too-long"])
    # short, chunked and doomed are computed (6 + 30 + 6); the failing send comes after.
    assert re.search(r"prefill tokens computed: 42 in \d+ batches", out)
    assert out.splitlines()[-1] == "ok"


@pytest.mark.parametrize("backend", ["local", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_embed_pair(backend: str) -> None:
    out = _run("embed_pair.py", "--backend", backend)
    served = [line for line in out.splitlines() if "prefill DONE, decode DONE" in line]
    assert len(served) == 3 and all("matches the reference" in line for line in served)
    assert re.search(r"^stop .*\(stop, [1-6] tokens\)", out, re.MULTILINE), out
    assert re.search(rf"handed to the {backend} transfer backend: [1-9]\d* bytes", out)
    assert out.splitlines()[-1] == "ok"
