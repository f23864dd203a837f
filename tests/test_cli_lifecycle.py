"""The `pdlife validate` and `pdlife diagram` subcommands, in process and as the console script."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lifecycle import PREFILL_TABLE
from lifecycle.diagram import markdown, mermaid
from scheduler.cli.main import SUBCOMMANDS, main

GOOD_MODULE = """
import enum
from lifecycle import Edge, make_table

class S(enum.IntEnum):
    LOST = 0
    NEW = 1
    DONE = 2

EDGES = (Edge("finish", S.NEW, S.DONE), Edge("lose", S.NEW, S.LOST))
TABLE = make_table("toy", S, initial=S.NEW, finals=(S.DONE, S.LOST), edges=EDGES,
                   failure_events=("lose",))
SPEC = dict(name="toy", states=S, initial=S.NEW, finals=(S.DONE, S.LOST), edges=EDGES)
BROKEN = dict(SPEC, edges=EDGES + (Edge("revive", S.DONE, S.NEW),))

def build():
    return TABLE

NOT_A_TABLE = 42
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_tables.py").write_text(textwrap.dedent(GOOD_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_tables"


def test_validate_shipped_tables_shows_the_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    assert "prefill: valid" in out and "decode: valid" in out
    assert "states   6: FAILED, BOOTSTRAPPING, WAITING, FORWARD, TRANSFERRING, DONE" in out
    assert "every state is reachable from BOOTSTRAPPING" in out
    assert "failure events (fail, abort) legal and unguarded from every live state" in out
    assert main(["validate", "--table", "decode"]) == 0
    assert "prefill" not in capsys.readouterr().out


@pytest.mark.parametrize("attr", ["TABLE", "SPEC", "build"])
def test_validate_a_user_table(
    user_module: str, attr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", "--load", f"{user_module}:{attr}"]) == 0
    assert "toy: valid" in capsys.readouterr().out


def test_validate_a_broken_user_table_names_the_edge(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", "--load", f"{user_module}:BROKEN"]) == 1
    err = capsys.readouterr().err
    assert "invalid lifecycle table: toy: edge 'revive' leaves final state DONE" in err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "--load wants module:ATTR"),
        ("no_such_module_xyz:T", "cannot import 'no_such_module_xyz'"),
        ("user_tables:MISSING", "has no attribute 'MISSING'"),
        ("user_tables:NOT_A_TABLE", "is a int; expected a LifecycleTable"),
    ],
)
def test_bad_load_targets_are_usage_errors(
    user_module: str, spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate", "--load", spec])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_diagram_formats(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["diagram", "--format", "mermaid"]) == 0
    out = capsys.readouterr().out
    assert "title: prefill lifecycle" in out and "title: decode lifecycle" in out
    assert main(["diagram", "--table", "prefill", "--format", "md"]) == 0
    assert capsys.readouterr().out == markdown(PREFILL_TABLE)
    target = tmp_path / "prefill.svg"
    assert main(["diagram", "--table", "prefill", "--format", "svg", "--out", str(target)]) == 0
    assert "<svg" in target.read_text()
    with pytest.raises(SystemExit) as info:
        main(["diagram", "--format", "svg"])
    assert info.value.code == 2
    assert "an SVG shows one table" in capsys.readouterr().err


def test_diagram_of_a_user_table(user_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--load", f"{user_module}:TABLE", "--format", "dot"]) == 0
    assert capsys.readouterr().out.startswith("digraph toy {")
    assert main(["diagram", "--load", f"{user_module}:BROKEN"]) == 1


def test_write_docs_regenerates_and_checks(tmp_path: Path) -> None:
    doc = tmp_path / "lifecycle.md"
    repo_doc = Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"
    stale = repo_doc.read_text().replace(mermaid(PREFILL_TABLE), "stale\n")
    doc.write_text(stale)
    assert main(["diagram", "--write-docs", str(doc), "--check"]) == 1
    assert doc.read_text() == stale
    assert main(["diagram", "--write-docs", str(doc)]) == 0
    assert doc.read_text() == repo_doc.read_text()
    assert main(["diagram", "--write-docs", str(doc), "--check"]) == 0


@pytest.mark.parametrize("name", [c.name for c in SUBCOMMANDS])
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([name, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pdlife {name}")
    assert next(c for c in SUBCOMMANDS if c.name == name).description.split()[0] in out


def test_the_console_script() -> None:
    script = Path(sys.executable).with_name("pdlife")
    done = subprocess.run(
        [str(script), "validate", "--table", "prefill"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("prefill: valid\n")
