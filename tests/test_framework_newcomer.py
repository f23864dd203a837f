"""Traps a newcomer to the framework fell into, written from docs/framework.md alone: a broken
rule the others are checked from reported with misleading follow-ups by `pdlife validate
--load`, and test paths that printed as a wall of attrs fields."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from lifecycle import PREFILL_TABLE, PrefillState
from lifecycle.paths import TestPath, edge_paths, shortest_paths_to
from scheduler.cli.main import main

UPLOADS = """
import enum
from lifecycle import Edge

class S(enum.IntEnum):
    FAILED = 0
    ABORTED = 1
    QUEUED = 2
    UPLOADING = 3
    DONE = 4

LIVE = (S.QUEUED, S.UPLOADING)
SPEC = dict(
    name="upload", states=S, initial=S.QUEUED, finals=(S.DONE, S.FAILED, S.ABORTED),
    edges=(Edge("start", S.QUEUED, S.UPLOADING), Edge("uploaded", S.UPLOADING, S.DONE),
           *(Edge("abort", s, S.ABORTED) for s in LIVE),
           *(Edge("fail", s, S.FAILED) for s in LIVE)),
    failure_events=("abort", "fail"),
    on_enter={f: ("release",) for f in (S.DONE, S.FAILED, S.ABORTED)},
)
NO_FINAL = dict(SPEC, finals=())
INITIAL_FINAL = dict(SPEC, initial=S.DONE)
"""


@pytest.fixture
def uploads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "uploads_spec.py").write_text(textwrap.dedent(UPLOADS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "uploads_spec"


@pytest.mark.parametrize(("attr", "message"), [
    # Was followed by "failure event 'abort' is not legal from states FAILED, ABORTED, DONE"
    # and "failure event 'abort' from QUEUED leads to non-final ABORTED", for each event.
    ("NO_FINAL", "upload: no final state"),
    # Was followed by "state ... is unreachable from DONE" for every other state, and DONE's
    # on_enter hooks reported as "on_enter hooks on the initial state".
    ("INITIAL_FINAL", "upload: the initial state DONE is final"),
])
def test_validate_load_names_a_foundational_rule_alone(
    uploads: str, attr: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", "--load", f"{uploads}:{attr}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pdlife validate: invalid lifecycle table: {message}"), err
    assert len(err.splitlines()) == 1, err


def test_a_test_path_prints_as_its_walk() -> None:
    (to_forward,) = shortest_paths_to(PREFILL_TABLE, PrefillState.FORWARD)
    assert repr(to_forward) == (
        "TestPath(BOOTSTRAPPING --bootstrapped--> WAITING --schedule--> FORWARD)")
    assert repr(TestPath(())) == "TestPath()"
    # Every path of the table, each on its own short line: no Edge(...) fields.
    for path in edge_paths(PREFILL_TABLE):
        assert "Edge(" not in repr(path) and len(repr(path)) < 200
        assert repr(path).count("-->") == len(path.edges)
