"""The engine loop: what a failed pass reports when another thread finds the cause; a loop
runs once."""

from __future__ import annotations

import threading

import pytest

from scheduler.service.engine_loop import EngineLoop
from tests.service_harness import wait_for


class _FailingEngine:
    """A pass fails as a mesh's collective does when a rank died; ``failed`` is set first."""

    def __init__(self) -> None:
        self.failed = threading.Event()

    def step(self) -> bool:
        self.failed.set()
        raise RuntimeError("[gloo] Connection closed by peer")

    def idle(self) -> bool:
        return False


def _run(grace_s: float, outside: BaseException | None) -> BaseException:
    engine = _FailingEngine()
    crashed: list[BaseException] = []
    loop = EngineLoop([engine], on_crash=crashed.append, outside_grace_s=grace_s)
    loop.start()
    if outside is not None:  # the watcher of the rank processes, after the pass failed
        assert engine.failed.wait(60)
        loop.fail(outside)
    wait_for(lambda: bool(crashed), 60, "the loop's failure")
    loop.stop()
    assert loop.failure is crashed[0]
    return crashed[0]


def test_a_failed_pass_reports_the_rank_exit_another_thread_finds_within_the_grace() -> None:
    exited = RuntimeError("a prefill rank process (pid 7) exited with code -9")
    reported = _run(60.0, exited)
    assert reported is exited
    assert isinstance(reported.__cause__, RuntimeError)
    assert "Connection closed by peer" in str(reported.__cause__)


def test_without_a_grace_a_failed_pass_reports_its_own_failure() -> None:
    reported = _run(0.0, None)
    assert "Connection closed by peer" in str(reported)


def test_a_loop_runs_once_and_says_so_when_started_again() -> None:
    loop = EngineLoop([_FailingEngine()], on_crash=lambda exc: None)
    loop.start()
    loop.stop()
    with pytest.raises(RuntimeError, match="was started already: a loop runs once"):
        loop.start()
