"""What a failed fuzzing run means: an invariant broken, the code under test raising, or the
fuzz machine itself at fault — and the exit status ``pdlife fuzz`` gives each.

The scheduler machine (:mod:`.machine`) checks the invariants of ``docs/architecture.md`` inside
``with invariant(n):`` blocks, so a broken one raises :class:`InvariantViolation` naming it, and
drives the scheduler inside ``with under_test(...):`` blocks, so anything the scheduler (or a
backend on its behalf) raises becomes :class:`CodeUnderTestError`. Anything else — an exception
in the machine's own code, or Hypothesis refusing the search (data generation that did not
replay the same way, a failed health check) — is an error of the fuzz machine, not a finding
about the scheduler. :func:`classify` sorts an exception a search raised into these kinds.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import attrs

from kv.pool import KVPoolError

#: The invariants the machine checks, by their number in docs/architecture.md.
INVARIANTS: dict[int, str] = {
    1: "every admission is answered once and reaches one final state, once",
    2: "only edges of the table are taken; final states are absorbing",
    3: "conservation and ownership of pages and metadata slots",
    4: "the per-state collections are exactly the requests in each state",
    5: "timelines are monotone; deadlines and aborts take effect",
    7: "prefix cache: a page is free, the tree's, or one request's; locks equal their users",
}


class InvariantViolation(AssertionError):
    """A check of the fuzz machine failed: the code under test broke invariant ``number``."""

    def __init__(self, number: int, message: str) -> None:
        super().__init__(f"invariant {number} ({INVARIANTS[number]}): {message}")
        self.number = number


class CodeUnderTestError(Exception):
    """The code under test raised while the fuzz machine drove it (the cause is chained)."""


class _Invariant:
    """The context manager :func:`invariant` returns (a class, not a generator: the machine
    enters thousands of these per example)."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object,
    ) -> None:
        if exc is None or isinstance(exc, InvariantViolation):
            return
        if isinstance(exc, (AssertionError, KVPoolError)):
            raise InvariantViolation(self.number, str(exc) or type(exc).__name__) from exc


_INVARIANTS = {n: _Invariant(n) for n in INVARIANTS}


def invariant(number: int) -> _Invariant:
    """Checks inside a ``with invariant(number):`` block belong to that invariant: a failed
    ``assert`` (or the pool's conservation check) there is reported as an
    :class:`InvariantViolation`."""
    return _INVARIANTS[number]


@contextlib.contextmanager
def under_test(what: str) -> Iterator[None]:
    """The block calls the code under test (``what`` names the call): what it raises is the
    code's error, reported as :class:`CodeUnderTestError`."""
    try:
        yield
    except Exception as exc:
        raise CodeUnderTestError(f"{what} raised {type(exc).__name__}: {exc}") from exc


class Kind(enum.IntEnum):
    """The kinds of failure, worst first; the value is ``pdlife fuzz``'s exit status."""

    INVARIANT = 1
    CODE = 3
    MACHINE = 4


#: Exit status of ``pdlife fuzz`` when every program kept the invariants.
EXIT_OK = 0


@attrs.frozen
class Verdict:
    kind: Kind
    summary: str


def classify(exc: BaseException) -> Verdict:
    """What a failed search's exception means. A group of failures (Hypothesis found several
    distinct ones) is judged by its worst member."""
    from hypothesis.errors import Flaky, HypothesisException

    members = getattr(exc, "exceptions", None)  # an exception group (a backport on 3.10)
    if isinstance(exc, Flaky):
        # A failure that did not happen again on replay: if it was a finding (a broken
        # invariant, the code under test raising), it is one still, of code that is not
        # deterministic (a runner drawing from os.urandom, a thread's timing).
        findings = [v for v in map(classify, members if isinstance(members, tuple) else ())
                    if v.kind in (Kind.INVARIANT, Kind.CODE)]
        if findings:
            worst = min(findings, key=lambda v: v.kind)
            return Verdict(worst.kind, f"{worst.summary} (it did not happen again when the "
                                       "same choices were replayed: something under test is "
                                       "not deterministic, so it could not be shrunk)")
        return Verdict(Kind.MACHINE, f"the fuzz machine is not deterministic: the same choices "
                                     f"did not replay the same way ({type(exc).__name__})")
    if isinstance(members, tuple) and members:
        return min((classify(e) for e in members), key=lambda v: v.kind)
    if isinstance(exc, InvariantViolation):
        return Verdict(Kind.INVARIANT, str(exc))
    if isinstance(exc, CodeUnderTestError):
        return Verdict(Kind.CODE, str(exc))
    if isinstance(exc, HypothesisException):
        return Verdict(Kind.MACHINE, f"Hypothesis refused the search: "
                                     f"{type(exc).__name__}: {exc}")
    return Verdict(Kind.MACHINE, f"the fuzz machine's own code raised "
                                 f"{type(exc).__name__}: {exc}")
