"""Pipeline stages of one prefill server agree on which requests left bootstrapping, which failed,
and which finished their transfer.

Theory of operation
-------------------
With pipeline parallelism every stage runs its own scheduler over its own layers and its own
senders: each stage learns a room's destination, and later the end of its transfer, on its own
time. The stages must still move every request together. If stage 0 let a request leave
bootstrapping while stage 1's sender had no destination yet, stage 1 would compute layers it
could not send; if one stage's transfer failed and another reported success, decode would hold a
room with missing layers. So no stage acts on its own polls. Each pass the stages exchange what
they know and every stage applies the same verdict (SGLang's ``pop_bootstrapped(
return_failed_reqs, rids_to_check)`` and ``get_transferred_rids``, where stage 0 passes its lists
down and later stages act only on them).

A stage knows each of its requests in one local **phase** (:class:`Phase`): BOOTSTRAP (admitted,
no agreed destination yet), FORWARD (agreed bootstrapped, its layers being computed) or TRANSFER
(its layers computed, the last chunk sent). Its scheduler reports the (TP-combined) poll of each
request's sender when it changes (:meth:`StageConsensus.report`). A poll is **decisive** when it
could end the phase: WAITING_FOR_INPUT in BOOTSTRAP, SUCCESS in TRANSFER, FAILED in any phase.

The agreement step: every stage contributes one **row** of ints, ``[free_slots, key, poll, key,
poll, ...]``, its free metadata slots and its decisive requests in the order their polls became
decisive (this stage's poll order). The rows are all-gathered into a **table**, one row per
stage, and :func:`decide`, a pure function of the table, gives the **verdict**:

- failed: every key some stage reports FAILED. A failure seen by one stage fails the request
  on every stage, in whatever phase each holds it.
- bootstrapped: the keys of **stage 0's row**, in stage 0's order, that every stage reports
  WAITING_FOR_INPUT, taken while metadata slots remain (the fewest free on any stage); at the
  first key with no slot left the walk stops, as SGLang's bootstrap queue does. Stage 0 decides
  the set and its order; the other stages can only hold a key back (not ready yet) or fail it.
- transferred: the keys of stage 0's row that every stage reports SUCCESS: a room is done only
  when every stage finished sending its layers.

Every stage computes the verdict from the same table, so no second round trip carries stage 0's
decision down the pipeline, and no two stages can disagree. A decisive poll stays in the row
until a verdict consumes it (polls never go back), so a key that one stage is late to report is
decided on a later pass, never lost. A stage that has not admitted a key yet (the requests reach
the stages one after another) keeps the key's failure and hands it over in :meth:`admit`; a key
cannot be bootstrapped or transferred without every stage's report, so nothing else can be
early.

The ranks of a stage's TP group first combine their polls by MIN (:mod:`scheduler.dist.ranks`),
so they report the same rows; each TP rank then agrees with the same TP rank of the other
stages (a group of one rank per stage), and all of them reach the same verdict.

This module decides; it moves no KV and fires no lifecycle event. The caller does both.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from kv.transfer import KVPoll
from scheduler.dist.gather import all_gather_rows


class StageTableError(ValueError):
    """A stage row or table that no set of stages following this protocol can produce."""


class Phase(enum.Enum):
    """Where a request is on one stage."""

    BOOTSTRAP = "bootstrap"
    FORWARD = "forward"
    TRANSFER = "transfer"


#: The polls that can end each phase.
DECISIVE: dict[Phase, frozenset[KVPoll]] = {
    Phase.BOOTSTRAP: frozenset({KVPoll.WAITING_FOR_INPUT, KVPoll.FAILED}),
    Phase.FORWARD: frozenset({KVPoll.FAILED}),
    Phase.TRANSFER: frozenset({KVPoll.SUCCESS, KVPoll.FAILED}),
}


@attrs.frozen
class Failure:
    """Request ``key`` failed; ``stage`` is the lowest stage that reported it."""

    key: int
    stage: int


@attrs.frozen
class Verdict:
    """What every stage does with the requests of one agreement step."""

    bootstrapped: tuple[int, ...] = ()
    failed: tuple[Failure, ...] = ()
    transferred: tuple[int, ...] = ()


@attrs.frozen
class StageRow:
    """One stage's contribution, parsed."""

    free_slots: int
    polls: dict[int, KVPoll]

    @classmethod
    def parse(cls, stage: int, row: Sequence[int]) -> StageRow:
        if not row or len(row) % 2 == 0:
            raise StageTableError(
                f"stage {stage}'s row must be [free_slots, key, poll, ...], got {len(row)} ints"
            )
        if row[0] < 0:
            raise StageTableError(f"stage {stage} reports {row[0]} free slots")
        polls: dict[int, KVPoll] = {}
        for key, poll in zip(row[1::2], row[2::2], strict=True):
            if key in polls:
                raise StageTableError(f"stage {stage} reports key {key} twice")
            if poll not in (KVPoll.FAILED, KVPoll.WAITING_FOR_INPUT, KVPoll.SUCCESS):
                raise StageTableError(f"stage {stage} reports key {key} with poll {poll}")
            polls[int(key)] = KVPoll(poll)
        return cls(free_slots=int(row[0]), polls=polls)


def decide(table: Sequence[Sequence[int]]) -> Verdict:
    """The verdict of the gathered ``table`` (one row per stage, stage 0 first)."""
    if not table:
        raise StageTableError("the table has no stage")
    rows = [StageRow.parse(s, row) for s, row in enumerate(table)]
    failed: dict[int, int] = {}
    for stage, row in enumerate(rows):
        for key, poll in row.polls.items():
            if poll == KVPoll.FAILED:
                failed.setdefault(key, stage)
    slots = min(row.free_slots for row in rows)
    bootstrapped: list[int] = []
    transferred: list[int] = []
    for key, poll in rows[0].polls.items():
        if key in failed:
            continue
        others = [row.polls.get(key) for row in rows[1:]]
        if any(p is not None and p != poll for p in others):
            raise StageTableError(
                f"key {key} is {poll.name} on stage 0 but {[p and p.name for p in others]} on "
                "the others: one stage left bootstrapping without the rest"
            )
        if None in others:
            continue
        if poll == KVPoll.SUCCESS:
            transferred.append(key)
        elif len(bootstrapped) < slots:
            bootstrapped.append(key)
        else:
            # Out of slots: the walk stops here, so no later key overtakes this one.
            slots = len(bootstrapped)
    return Verdict(
        bootstrapped=tuple(bootstrapped),
        failed=tuple(Failure(key, stage) for key, stage in failed.items()),
        transferred=tuple(transferred),
    )


@attrs.frozen
class StageOutcome:
    """What one stage does after an agreement step: the verdict, applied to its own requests.

    ``failed`` pairs each failure with the phase the request was in on this stage (what it must
    release); failures of keys this stage has not admitted yet wait for
    :meth:`StageConsensus.admit`.
    """

    verdict: Verdict
    failed: tuple[tuple[Failure, Phase], ...]

    @property
    def bootstrapped(self) -> tuple[int, ...]:
        """Leave BOOTSTRAP for FORWARD, in this order (each takes a metadata slot)."""
        return self.verdict.bootstrapped

    @property
    def transferred(self) -> tuple[int, ...]:
        """Done: every stage sent its layers."""
        return self.verdict.transferred


class StageGather(Protocol):
    """All-gathers one row of ints per stage, of any length, into a list indexed by stage."""

    def gather(self, row: Sequence[int]) -> list[list[int]]: ...


class SingleStage:
    """A pipeline of one stage: nothing to agree with."""

    def gather(self, row: Sequence[int]) -> list[list[int]]:
        return [[int(v) for v in row]]


class TorchStageGather:
    """:class:`StageGather` over a ``torch.distributed`` gloo group holding one rank per stage,
    in stage order."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def gather(self, row: Sequence[int]) -> list[list[int]]:
        return all_gather_rows(row, self.group)


class StageConsensus:
    """One stage's side of the agreement: its requests' phases and decisive polls.

    Keys name requests the same way on every stage (the admission number, or the bootstrap
    room). Drive it with :meth:`admit`, :meth:`report` and :meth:`forwarded` as the stage's
    scheduler learns things, and :meth:`agree` once per pass on every stage.
    """

    def __init__(self, stage: int, num_stages: int) -> None:
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is not in 0..{num_stages - 1}")
        self.stage = stage
        self.num_stages = num_stages
        self._phase: dict[int, Phase] = {}
        self._poll: dict[int, KVPoll] = {}
        # Decisive polls in the order they became decisive: this stage's row.
        self._decisive: dict[int, KVPoll] = {}
        self._early: dict[int, Failure] = {}

    def phase(self, key: int) -> Phase | None:
        """The phase of ``key`` on this stage; None when it is not (or no longer) here."""
        return self._phase.get(key)

    def __len__(self) -> int:
        return len(self._phase)

    @property
    def early_failures(self) -> frozenset[int]:
        """Keys the stages failed before this stage admitted them."""
        return frozenset(self._early)

    def admit(self, key: int) -> Failure | None:
        """``key`` arrives here in BOOTSTRAP. Returns the failure when the stages already
        failed it (the caller fails it at once, and it is not tracked)."""
        if key in self._phase:
            raise StageTableError(f"stage {self.stage} admitted key {key} twice")
        early = self._early.pop(key, None)
        if early is None:
            self._phase[key] = Phase.BOOTSTRAP
            self._poll[key] = KVPoll.BOOTSTRAPPING
        return early

    def report(self, key: int, poll: KVPoll) -> None:
        """This stage's (TP-combined) poll of ``key``'s sender is now ``poll``. A failure is
        never taken back."""
        if key not in self._phase:
            raise StageTableError(f"stage {self.stage} has no key {key} to report {poll.name}")
        if self._poll[key] != KVPoll.FAILED:
            self._poll[key] = poll
            self._classify(key)

    def forwarded(self, key: int) -> None:
        """This stage computed the last chunk of ``key`` and sent its layers' KV."""
        if self._phase.get(key) != Phase.FORWARD:
            raise StageTableError(
                f"stage {self.stage}: key {key} is {self._phase.get(key)}, not in FORWARD"
            )
        self._phase[key] = Phase.TRANSFER
        self._classify(key)

    def drop(self, key: int) -> None:
        """``key`` ended on this stage for a reason every stage sees on the same pass (a
        client's abort, relayed to every rank; a verdict already applied): forget it without
        an agreement step. A no-op for a key this stage no longer holds."""
        self._forget(key)

    def _classify(self, key: int) -> None:
        poll = self._poll[key]
        if poll in DECISIVE[self._phase[key]]:
            self._decisive[key] = poll
        else:
            self._decisive.pop(key, None)

    def row(self, free_slots: int) -> list[int]:
        """This stage's contribution to the next agreement step."""
        row = [free_slots]
        for key, poll in self._decisive.items():
            row += (key, int(poll))
        return row

    def conclude(self, table: Sequence[Sequence[int]]) -> StageOutcome:
        """Apply the verdict of the gathered ``table`` to this stage's requests."""
        if len(table) != self.num_stages:
            raise StageTableError(f"a table of {len(table)} rows for {self.num_stages} stages")
        verdict = decide(table)
        failed: list[tuple[Failure, Phase]] = []
        for failure in verdict.failed:
            phase = self._forget(failure.key)
            if phase is None:
                self._early[failure.key] = failure
            else:
                failed.append((failure, phase))
        for key in verdict.bootstrapped:
            self._expect(key, Phase.BOOTSTRAP)
            self._phase[key] = Phase.FORWARD
            self._classify(key)
        for key in verdict.transferred:
            self._expect(key, Phase.TRANSFER)
            self._forget(key)
        return StageOutcome(verdict=verdict, failed=tuple(failed))

    def agree(self, gather: StageGather, free_slots: int) -> StageOutcome:
        """One agreement step: every stage calls it on the same pass (it is a collective)."""
        return self.conclude(gather.gather(self.row(free_slots)))

    def _expect(self, key: int, phase: Phase) -> None:
        # The verdict only moves keys every stage, this one included, reported as decisive.
        if self._phase.get(key) != phase or key not in self._decisive:
            raise AssertionError(
                f"stage {self.stage}: the verdict moves key {key} out of {phase.name}, but here "
                f"it is {self._phase.get(key)} with poll {self._poll.get(key)}"
            )

    def _forget(self, key: int) -> Phase | None:
        self._decisive.pop(key, None)
        self._poll.pop(key, None)
        return self._phase.pop(key, None)


class InProcessStages:
    """The stages of one pipeline in one process, for tests: one agreement step runs every
    stage's row through the same table, stage by stage, as the gloo gather would."""

    def __init__(self, num_stages: int) -> None:
        self.stages = [StageConsensus(s, num_stages) for s in range(num_stages)]

    def agree(self, free_slots: Sequence[int]) -> list[StageOutcome]:
        """One agreement step; ``free_slots[s]`` is stage ``s``'s free metadata slots."""
        table = [st.row(free) for st, free in zip(self.stages, free_slots, strict=True)]
        return [st.conclude(table) for st in self.stages]
