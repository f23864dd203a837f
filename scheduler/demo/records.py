"""The records a demo run produces and its report reads: the planned requests, mismatches
against the colocated reference, and the finished run."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from lifecycle import PrefillState, SamplingParams
from scheduler.messages import DecodeResponse, Response


@attrs.frozen
class DemoRequest:
    """One request of the workload and what it is meant to do.

    ``fault`` names the failure injected on the fake backend (its ``room`` is chosen so that the
    fault plan decides exactly that); ``abort_in`` the prefill state to abort it in.
    """

    rid: str
    prompt: tuple[int, ...] = attrs.field(repr=False)
    sampling: SamplingParams
    fault: str = ""
    room: int = 0
    abort_in: PrefillState | None = None
    #: The question as typed, when the prompt is a chat message (real models).
    text: str = ""

    @property
    def disaggregated(self) -> bool:
        """Served by prefill and decode (not sent to the fake backend)."""
        return not self.fault

    @property
    def expected(self) -> str:
        """The prefill outcome planned for it: ``done``, ``aborted`` or the injected fault."""
        if self.fault:
            return self.fault
        return "aborted" if self.abort_in is not None else "done"


@attrs.frozen
class Mismatch:
    """A served output that differs from the colocated reference: the first differing
    position, the tokens there (None past an end), and the prefill's first token."""

    rid: str
    position: int
    expected: int | None
    got: int | None
    expected_len: int
    got_len: int
    first_token: int | None

    @classmethod
    def of(
        cls, rid: str, want: Sequence[int], got: Sequence[int], first_token: int | None
    ) -> Mismatch:
        common = min(len(want), len(got))
        pos = next((i for i in range(common) if want[i] != got[i]), common)
        if want == got:
            pos = 0  # only the prefill's first token differs
        return cls(
            rid, pos, want[pos] if pos < len(want) else None,
            got[pos] if pos < len(got) else None, len(want), len(got), first_token,
        )

    def describe(self) -> str:
        if self.expected == self.got:
            return (f"{self.rid}: decode output matches, but prefill's first token is "
                    f"{self.first_token}, not {self.expected}")
        return (f"{self.rid}: token {self.position} is {self.got}, the reference has "
                f"{self.expected} ({self.got_len} tokens vs {self.expected_len})")


@attrs.frozen
class RunData:
    """A finished demo run: the workload, both sides' answers by rid, and the figures."""

    requests: int
    backend: str
    loop: str
    seed: int
    workload: Sequence[DemoRequest]
    prefill: dict[str, Response]
    decode: dict[str, DecodeResponse]
    serve_seconds: float
    prefill_tokens: int
    kv_bytes: float
    kv_copy_seconds: float | None
    delayer_outcomes: dict[str, int]
    checked: int
    mismatches: list[Mismatch]
    problems: list[str]
    #: A few served requests as text, ``(prompt, answer)`` (real models only).
    examples: list[tuple[str, str]] = attrs.field(factory=list)
    model: str = "reference"

    @property
    def passed(self) -> bool:
        return not self.mismatches and not self.problems
