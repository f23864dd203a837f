"""``pdlife bench`` shows its plan, refuses unknown names, finds the checkout's files, and echoes
every line whole."""

from __future__ import annotations

import argparse
import importlib
import io

import pytest

from scheduler.cli.bench import ALL, BENCH_DIR
from scheduler.cli.main import DOCS_LIFECYCLE, main


def test_the_plan_lists_every_benchmark_with_an_estimate(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pdlife bench: {len(ALL)} benchmark(s), about ")
    for b in ALL:
        assert f"  {b.name:<10} ~" in out
        assert b.measures in out
    assert "RESULT" not in out  # --list runs nothing


def test_an_unknown_benchmark_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "lifecycle", "nope"])
    assert exited.value.code == 2
    assert "unknown benchmark(s) ['nope']" in capsys.readouterr().err


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
    bare = [action.option_strings[0] for action in parsed.value.parser._actions
            if action.option_strings and not action.help]
    assert bare == [], f"bench.{name}: flags without help: {bare}"
