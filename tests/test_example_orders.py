"""The order lifecycle of docs/framework.md: the example runs as documented, its table is
fuzzed here as an embedder would in CI, and ``pdlife fuzz --load`` finds a double release
planted in a copy of it, naming the hook, without importing torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from examples.orders import ORDER_TABLE, Order, Shop, holds_nothing_once_ended, satisfy
from lifecycle import Lifecycle
from lifecycle.diagram import mermaid
from lifecycle.testing import fuzz_settings, lifecycle_state_machine

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "orders.py"


def test_the_example_runs_as_documented() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=ROOT, capture_output=True, text=True, timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert out[0] == ("table order: 6 states, 9 edges, events pay, ship, deliver, cancel, fail; "
                      "valid")
    assert out[1] == ("refused: request 'a' in state CREATED cannot take event 'pay': "
                      "paid_in_full is false")
    assert out[2] == ("refused: request 'c' in state PAID cannot take event 'ship': "
                      "has_address is false")
    lines = {line.split(":")[0]: line for line in out[3:7]}
    assert re.match(r"a: DELIVERED .*\[pay:PAID -> ship:SHIPPED -> deliver:DELIVERED\]", lines["a"])
    assert "b: FAILED    reason=lost_in_transit detail='the van was stolen'" in lines["b"]
    assert "c: CANCELLED reason=- detail='customer changed mind'" in lines["c"]
    assert "d: FAILED    reason=payment_declined detail='card expired' [fail:FAILED]" in lines["d"]
    assert "refunds: b, c; stock 9 of 10" in out
    assert "perfetto trace: 18 events, process 'order'" in out
    assert "  ANY_LIVE --> CANCELLED: cancel" in out
    assert out[-1] == "ok"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_the_guide_shows_the_examples_code_and_diagram() -> None:
    guide = (ROOT / "docs" / "framework.md").read_text()
    source = EXAMPLE.read_text()
    blocks = _python_blocks(guide)
    # The enums, the table and the shop's hooks are the example's own lines.
    for start in ("class OrderState(", "ORDER_TABLE = make_table(", "    def release(",
                  "def satisfy(", "def holds_nothing_once_ended("):
        block = next(b for b in blocks if start in b)
        snippet = block[block.index(start):].split("\n\n")[0]
        assert snippet in source, snippet
    assert f"```mermaid\n{mermaid(ORDER_TABLE, collapse_failures=True)}```" in guide
    readme = (ROOT / "README.md").read_text()
    assert "docs/framework.md" in readme


def test_the_guides_fake_clock_example_runs() -> None:
    guide = (ROOT / "docs" / "framework.md").read_text()
    (block,) = [b for b in _python_blocks(guide) if "clock = FakeClock()" in b]
    exec(block, {"ORDER_TABLE": ORDER_TABLE, "Order": Order, "Shop": Shop,
                 "Lifecycle": Lifecycle})  # its own assert checks the times


# Fuzzing the order lifecycle in CI, with the shop's own hooks (a fresh shop for every
# program) and an invariant of its own.
def _shop_hooks() -> dict[str, Callable[..., None]]:
    shop = Shop(stock=10**6)
    return {"release": shop.release, "notify": shop.notify, "refund": shop.refund}


TestOrderLifecycle = lifecycle_state_machine(
    ORDER_TABLE,
    lambda rid: Order(rid, total=30),
    hooks=_shop_hooks,
    satisfy=satisfy,
    invariants=[holds_nothing_once_ended],
).TestCase
TestOrderLifecycle.settings = fuzz_settings(stateful_step_count=30)


_PROBE = """
import sys
from scheduler.cli.main import main
status = main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(status)
"""


def test_pdlife_fuzz_finds_a_planted_double_release_naming_the_hook(tmp_path: Path) -> None:
    source = EXAMPLE.read_text()
    planted = source.replace('doc="handed to the carrier"',
                             'after="release", doc="handed to the carrier"')
    assert planted != source
    (tmp_path / "orders_bug.py").write_text(planted)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "fuzz", "--load", "orders_bug:ORDER_TABLE",
         "--record", "orders_bug:Order", "--examples", "300"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "rule broken: once-hook 'release' runs exactly once per request" in out
    assert re.search(r"hook 'release' ran 2 times for r\d+, which is finished in", out)
    assert "event program:\n  1. admit r1" in out and "ship: PAID -> SHIPPED" in out
    assert "rerun: pdlife fuzz --load orders_bug:ORDER_TABLE --record orders_bug:Order " \
           "--examples 300 --steps 50 --seed 0" in out
    assert "Traceback" not in out + done.stderr and "Order(" not in out
    assert out.splitlines()[-1] == "torch imported: False"


def test_pdlife_fuzz_no_shrink_reports_the_program_as_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from scheduler.cli.main import main

    planted = EXAMPLE.read_text().replace('doc="handed to the carrier"',
                                          'after="release", doc="handed to the carrier"')
    (tmp_path / "orders_unshrunk.py").write_text(planted)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["fuzz", "--load", "orders_unshrunk:ORDER_TABLE", "--record",
            "orders_unshrunk:Order", "--examples", "300", "--no-shrink", "--explain"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "rule broken: once-hook 'release' runs exactly once per request" in out
    assert "ship: PAID -> SHIPPED" in out
    assert ("rerun: pdlife fuzz --load orders_unshrunk:ORDER_TABLE --record "
            "orders_unshrunk:Order --no-shrink --explain --examples 300 --steps 50 --seed 0") in out
    with pytest.raises(SystemExit) as info:
        main(["fuzz", "--satisfy", "orders_unshrunk:satisfy"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "pdlife fuzz: --satisfy goes with --load\n"


def test_pdlife_fuzz_shows_the_program_when_a_guard_raises(tmp_path: Path) -> None:
    (tmp_path / "orders_raise.py").write_text(
        "import attrs\n"
        "import examples.orders as base\n"
        "from examples.orders import ORDER_TABLE\n"
        "@attrs.define(slots=True, eq=False, weakref_slot=False)\n"
        "class Order(base.Order):\n"
        "    def has_address(self, event):\n"
        "        if self.address == 'x':\n"
        "            raise ValueError('no such street')\n"
        "        return bool(self.address)\n")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, "fuzz", "--load", "orders_raise:ORDER_TABLE",
         "--record", "orders_raise:Order", "--examples", "100"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"},
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert ("the code under test raised\n  a guard of 'ship' (has_address) on r1 raised "
            "ValueError: no such street\nevent program:\n  1. admit r1") in done.stdout
    assert "FAILED after" in done.stdout and "rerun: pdlife fuzz --load orders_raise" in done.stdout
    # The guard's own traceback, for the line that raised; none of Hypothesis's machinery.
    assert 'orders_raise.py", line 8, in has_address' in done.stderr
    assert "hypothesis" not in done.stderr


def test_pdlife_fuzz_passes_the_example_and_refuses_what_is_not_a_record(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-c", _PROBE, "fuzz", "--load", "examples.orders:ORDER_TABLE",
         "--satisfy", "examples.orders:satisfy", "--examples", "30", "--steps", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok: 30 programs kept every rule" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-c", _PROBE, "fuzz", "--load", "examples.orders:ORDER_TABLE",
         "--record", "examples.orders:satisfy"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr == ("pdlife fuzz: --record: examples.orders:satisfy is a function, not a "
                          "class\n")


@pytest.mark.parametrize(("flags", "message"), [
    # A class, not a record's: said of the class (it was said of the table's first guard).
    (("--record", "examples.orders:Shop"),
     "--record: examples.orders:Shop is not a record class: a record is an attrs class that "
     "subclasses lifecycle.Tracked"),
    (("--record", "lifecycle:Tracked"),
     "--record Tracked: order: guard 'paid_in_full' of event 'pay' is not a method of Tracked"),
    (("--loop", "overlap"), "--loop picks what the scheduler's fuzz runs; --load fuzzes the "
                            "table alone: drop it"),
])
def test_pdlife_fuzz_refuses_before_the_search_what_cannot_fuzz_the_table(
        flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler.cli.main import main

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as info:
        main(["fuzz", "--load", "examples.orders:ORDER_TABLE", *flags])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"pdlife fuzz: {message}\n"
