"""The `pdlife validate` and `pdlife diagram` subcommands, in process and as the console script."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lifecycle import PREFILL_TABLE, TABLES
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

def RAISES():
    raise ValueError("no table today")

NOT_A_TABLE = 42
BAD_SPEC = {"colour": "blue"}
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
    assert err.startswith(
        "pdlife validate: invalid lifecycle table: toy: edge 'revive' leaves final state DONE")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "--load wants module:ATTR"),
        ("no_such_module_xyz:T", "cannot import 'no_such_module_xyz'"),
        ("user_tables:MISSING", "has no attribute 'MISSING'"),
        ("user_tables:NOT_A_TABLE", "is an int; expected a LifecycleTable"),
        ("user_tables:S", "is the class S, not a table; expected a LifecycleTable"),
        ("user_tables:RAISES", "user_tables:RAISES() raised ValueError: no table today"),
        ("user_tables:BAD_SPEC", "is not a dict of make_table arguments"),
        ("user_tables.py:TABLE", "(give the module's name, 'user_tables', not its file; "
                                 "modules are found from the working directory and "
                                 "PYTHONPATH)"),
        ("./pkg/user_tables.py:TABLE", "give the module's name, 'pkg.user_tables'"),
        ("/abs/pkg/user_tables.py:TABLE", "give the module's name, 'user_tables'"),
    ],
)
def test_bad_load_targets_are_usage_errors(
    user_module: str, spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate", "--load", spec])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line


def test_validate_refuses_a_record_class_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate", "--load", "examples.orders:Order"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "pdlife validate: --load: examples.orders:Order is the class Order, not a table; "
        "expected a LifecycleTable, a dict of make_table arguments, or a function returning "
        "one (a record class goes to --record)\n"
    )


def test_diagram_formats(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["diagram", "--format", "mermaid"]) == 0
    out = capsys.readouterr().out
    assert "title: prefill lifecycle" in out and "title: decode lifecycle" in out
    assert main(["diagram", "--table", "prefill", "--format", "md"]) == 0
    assert capsys.readouterr().out == markdown(PREFILL_TABLE)
    target = tmp_path / "prefill.svg"
    assert main(["diagram", "--table", "prefill", "--format", "svg", "--out", str(target)]) == 0
    assert "<svg" in target.read_text()
    assert capsys.readouterr().out == f"{target}\n"  # what it wrote, as for a directory


def test_diagram_into_a_missing_folder_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing" / "prefill.md"
    with pytest.raises(SystemExit) as info:
        main(["diagram", "--table", "prefill", "--format", "md", "--out", str(target)])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"pdlife diagram: --out {target}: there is no directory {target.parent} to write it "
        f"in\n")
    assert not target.parent.exists()


@pytest.mark.parametrize("fmt", ["dot", "svg"])
def test_one_table_per_dot_or_svg_output(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["diagram", "--format", fmt])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--format {fmt} draws one table per output: add --table prefill or --table decode" \
        in err
    assert main(["diagram", "--format", fmt, "--out", str(tmp_path)]) == 0
    for name in ("prefill", "decode"):
        text = (tmp_path / f"{name}.{fmt}").read_text()
        assert text.count("digraph") == 1 if fmt == "dot" else text.count("<svg") == 1
        assert name in text


def test_diagram_collapses_failures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--table", "decode", "--collapse-failures"]) == 0
    out = capsys.readouterr().out
    assert "ANY_LIVE --> FAILED: fail | abort" in out and "PREALLOC --> FAILED" not in out
    assert main(["diagram", "--table", "decode", "--format", "md", "--collapse-failures"]) == 0
    assert "| `abort` | any live state | FAILED |" in capsys.readouterr().out


def test_diagram_of_a_user_table(user_module: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagram", "--load", f"{user_module}:TABLE", "--format", "dot"]) == 0
    assert capsys.readouterr().out.startswith("digraph toy {")
    assert main(["diagram", "--load", f"{user_module}:BROKEN"]) == 1


def test_write_docs_syncs_a_loaded_tables_blocks(
        user_module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "mine.md"
    doc.write_text("".join(f"<!-- BEGIN GENERATED: toy-{kind} -->\nold\n"
                           f"<!-- END GENERATED: toy-{kind} -->\n"
                           for kind in ("mermaid", "transitions")))
    load = f"{user_module}:TABLE"
    assert main(["diagram", "--load", load, "--write-docs", str(doc), "--check"]) == 1
    assert f"run: pdlife diagram --load {load} --write-docs {doc}" in capsys.readouterr().err
    assert main(["diagram", "--load", load, "--write-docs", str(doc)]) == 0
    assert "stateDiagram-v2" in doc.read_text() and "old" not in doc.read_text()
    assert main(["diagram", "--load", load, "--write-docs", str(doc), "--check"]) == 0
    # A document without the markers: which file, and the lines to paste.
    bare = tmp_path / "bare.md"
    bare.write_text("# my lifecycle\n")
    with pytest.raises(SystemExit) as info:  # not "out of date" (exit 1): a usage error
        main(["diagram", "--load", load, "--write-docs", str(bare), "--check"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"pdlife diagram: {bare}: the document has no generated block for ['toy-mermaid', "
        "'toy-transitions']: put a pair of marker lines where each goes, e.g. "
        "'<!-- BEGIN GENERATED: toy-mermaid -->' and '<!-- END GENERATED: toy-mermaid -->', "
        "each on a line of its own\n")
    # A file that is not there is a usage error, not a traceback.
    with pytest.raises(SystemExit) as info:
        main(["diagram", "--load", load, "--write-docs", str(tmp_path / "none.md")])
    assert info.value.code == 2
    assert "none.md: No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--format", "dot"], "--format draws a diagram, and --write-docs regenerates"),
        (["--out", "x.md", "--collapse-failures"], "--out and --collapse-failures draw a"),
        (["--table", "prefill", "--load", "user_tables:TABLE"], "--table picks a shipped table"),
        (["--table", "prefill"], "--table draws a diagram"),
    ],
)
def test_write_docs_refuses_drawing_flags(
        user_module: str, tmp_path: Path, extra: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "lifecycle.md"
    with pytest.raises(SystemExit) as info:
        main(["diagram", "--write-docs", str(doc), *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_write_docs_defaults_to_the_working_directorys_doc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    repo_doc = Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "lifecycle.md"
    doc.write_text(repo_doc.read_text().replace(mermaid(PREFILL_TABLE), "stale\n"))
    monkeypatch.chdir(tmp_path)
    assert main(["diagram", "--write-docs", "--check"]) == 1
    assert "docs/lifecycle.md: out of date" in capsys.readouterr().err
    assert main(["diagram", "--write-docs"]) == 0
    assert doc.read_text() == repo_doc.read_text()


def test_out_ending_in_a_slash_is_a_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "new" / "diagrams"
    assert main(["diagram", "--out", f"{folder}/"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{name}.mermaid" for name in TABLES)


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


def test_version_names_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"pdlife {version('pdlife')}\n"


def test_an_unknown_option_is_refused_with_its_subcommands_usage(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate", "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pdlife validate")
    assert err.endswith("pdlife validate: error: unrecognized arguments: --bogus\n")
    with pytest.raises(SystemExit):
        main(["demo", "--requests", "3"])
    assert capsys.readouterr().err == "pdlife demo: --requests must be an integer >= 6, got 3\n"


def test_validate_without_torch_or_the_scheduler() -> None:
    # The CLI's start-up for validate imports neither torch nor fastapi nor the scheduler's
    # loop: building the parser declares only the arguments of the command that runs.
    probe = (
        "import sys; from scheduler.cli.main import main; status = main(['validate']); "
        "heavy = [m for m in ('torch', 'fastapi', 'scheduler.prefill', 'hypothesis') "
        "if m in sys.modules]; print('heavy:', heavy); sys.exit(status)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
        check=False, cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "heavy: []"


@pytest.mark.parametrize(("args", "status"), [
    (["validate"], {141}),
    (["diagram", "--format", "md"], {141}),
    # argparse ignores an error writing its help: 0 if the write failed, 141 if the flush did.
    (["validate", "--help"], {0, 141}),
])
def test_a_closed_pipe_ends_the_command_quietly(args: list[str], status: set[int]) -> None:
    """`pdlife validate | head -1`: the reader goes away before the output is written."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write fails
    try:
        done = subprocess.run(
            [sys.executable, "-m", "scheduler.cli", *args], stdout=write,
            stderr=subprocess.PIPE, text=True, timeout=60, check=False,
            cwd=Path(__file__).resolve().parent.parent,
        )
    finally:
        os.close(write)
    assert done.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored"
    assert done.returncode in status


def test_the_console_script() -> None:
    script = Path(sys.executable).with_name("pdlife")
    done = subprocess.run(
        [str(script), "validate", "--table", "prefill"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("prefill: valid\n")


def test_a_search_of_several_failures_reports_a_broken_rule_impure_guards_first(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Hypothesis raises an ExceptionGroup when one search finds distinct failures (a guard
    that answers at random breaks several rules): it was reported as the code under test
    raising an ExceptionGroup (exit 3), 270 lines of traceback."""
    from lifecycle.testing import CodeRaised, RuleBroken
    from scheduler.cli.fuzz_table import _most_telling, _print_notes

    follows = RuleBroken("rule broken: illegal events are refused\n  fire ship [r3] was accepted")
    cause = RuleBroken("rule broken: guards are pure\n  answered differently")
    raised = CodeRaised("a guard raised")
    group = ExceptionGroup("3 distinct failures", [raised, ExceptionGroup("2", [follows, cause])])
    assert _most_telling(group) is cause
    assert _most_telling(ExceptionGroup("2", [raised, follows])) is follows
    assert _most_telling(ExceptionGroup("1", [raised])) is raised
    # --explain's explanation is in the notes, after Hypothesis's copy of the program.
    cause.add_note("Falsifying example:")
    cause.add_note("state.admit(n=1)")
    _print_notes(cause)
    assert capsys.readouterr().out == ""
    cause.add_note("Explanation:")
    cause.add_note("    These lines were always and only run by failing examples:")
    _print_notes(cause)
    assert capsys.readouterr().out == (
        "Explanation:\n    These lines were always and only run by failing examples:\n\n")


def test_validate_has_help_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "which shipped lifecycle table to check and describe (default: all)" in text
    assert "svg" not in text and "--out" not in text  # diagram's, not validate's
    with pytest.raises(SystemExit):
        main(["diagram", "--help"])
    assert "the dot and svg formats draw one table per output" in " ".join(
        capsys.readouterr().out.split())
