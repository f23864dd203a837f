"""``pdlife bench`` shows its plan, refuses unknown names and a tree without benchmarks, finds
the checkout's files, and echoes every line whole; each benchmark's ``--help`` describes it and
every flag, defaults included; the parts of ``bench.transfer`` refuse to run on their own."""

from __future__ import annotations

import argparse
import importlib
import io
import runpy
import sys
from pathlib import Path

import pytest

from scheduler.cli.bench import ALL, BENCH_DIR, ROOT
from scheduler.cli.main import DOCS_LIFECYCLE, main


def test_the_plan_lists_every_benchmark_with_an_estimate(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pdlife bench: {len(ALL)} benchmark(s) of {ROOT}, about ")
    for b in ALL:
        assert f"  {b.name:<10} ~" in out
        assert b.measures in out
    assert "RESULT" not in out  # --list runs nothing


def test_an_unknown_benchmark_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "lifecycle", "nope"])
    assert exited.value.code == 2
    assert "unknown benchmark(s) ['nope']" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--list"], ["lifecycle"]])
def test_a_tree_without_benchmarks_is_a_usage_error(
        args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """pdlife installed from a wheel (no bench/ beside its packages) refuses and says why."""
    monkeypatch.setattr("scheduler.cli.bench.BENCH_DIR", tmp_path / "bench")
    with pytest.raises(SystemExit) as exited:
        main(["bench", *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"no bench/ folder at {tmp_path / 'bench'}" in err
    assert "installed from" in err and "pip install -e ." in err
    assert "Traceback" not in err


def test_default_paths_point_into_the_checkout() -> None:
    assert all((BENCH_DIR / f"{b.name}.py").is_file() for b in ALL)
    # Every benchmark module is in the plan (the transfer_* modules are parts of transfer).
    modules = {p.stem for p in BENCH_DIR.glob("*.py")
               if p.stem != "__init__" and not p.stem.startswith("transfer_")}
    assert modules == {b.name for b in ALL}
    assert DOCS_LIFECYCLE.is_file()


def test_a_long_result_line_is_echoed_whole_at_any_width() -> None:
    from rich.console import Console

    from scheduler.cli.bench import echo

    out = io.StringIO()
    line = "RESULT tracing " + " ".join(f"field_{i}=0.{i:03d}" for i in range(20))
    echo(Console(file=out, width=40), line)
    assert out.getvalue() == line + "\n"


class _Parsed(Exception):
    """Raised in place of parsing: carries the parser a benchmark's main built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


@pytest.mark.parametrize("name", sorted(b.name for b in ALL))
def test_every_benchmark_flag_says_what_it_does(name: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m bench.NAME --help`` describes every flag (the parser each main builds, caught
    before it parses anything or runs)."""

    def caught(parser: argparse.ArgumentParser, *_args: object, **_kw: object) -> None:
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(_Parsed) as parsed:
        module.main()
    parser = parsed.value.parser
    assert parser.description == module.__doc__.split("\n\n")[0]  # the whole first paragraph
    flags = [action for action in parser._actions
             if action.option_strings and not isinstance(action, argparse._HelpAction)]
    bare = [action.option_strings[0] for action in flags if not action.help]
    assert bare == [], f"bench.{name}: flags without help: {bare}"

    def hides_its_default(action: argparse.Action) -> bool:
        if action.default is False:  # a switch: off unless given
            return False
        shown = (action.help or "") % {"default": action.default}
        return "default" not in shown or (action.default is not None
                                          and str(action.default) not in shown)

    hidden = [action.option_strings[0] for action in flags if hides_its_default(action)]
    assert hidden == [], f"bench.{name}: flags whose help hides the default: {hidden}"


@pytest.mark.parametrize(("module", "flag"), [
    ("transfer_sliced", "--prefill-tp 2 --decode-tp 1"), ("transfer_cuts", "--cuts"),
    ("transfer_lanes", "--lanes"), ("transfer_plans", "python -m bench.transfer")])
def test_a_part_of_transfer_run_alone_names_the_transfer_flag(
        module: str, flag: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", [f"{module}.py", "--help"])
    # Run as ``python -m`` runs it: a fresh module, not the one an earlier import left behind.
    monkeypatch.delitem(sys.modules, f"bench.{module}", raising=False)
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(f"bench.{module}", run_name="__main__")
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"bench.{module} is a part of bench.transfer")
    assert flag in captured.err
