"""Pipeline stages in the prefill pass: no stage acts on its own polls.

With pipeline parallelism each stage runs its own scheduler over its layers and its senders
(one per TP rank of the stage). Step 2 of the pass (:mod:`.scheduler`) first combines its TP
ranks' polls by MIN (:mod:`.readiness`), as without stages; :class:`StagePolls` then hands
those polls to the stage agreement (:class:`scheduler.dist.stages.StageConsensus`) instead of
acting on them, runs one agreement step with every other stage, and returns what every stage
does this pass:

- handshaken: the requests the verdict bootstrapped, in stage 0's order, and no more than the
  fewest free metadata slots on any stage allow (so each takes a slot on every stage);
- transferred: the requests every stage finished sending;
- failed: the requests any stage failed, with this stage's own reason when it saw the failure
  itself, else ``bootstrap_failed`` or ``transfer_failed`` naming the stage that did.

The key of a request is its admission number, the same on every rank because every rank
admits the same relayed requests in the same order (:mod:`scheduler.dist.relay`). The pass
tells :class:`StagePolls` when a request is admitted, when its last chunk was sent
(``forwarded``) and when it ended (``ended``: the verdict's own keys are forgotten already; a
client's abort reaches every stage on the same pass, so each forgets it before the next
agreement step).
"""

from __future__ import annotations

from typing import Protocol

from kv.transfer import REASON_OTHER_RANK, KVPoll
from lifecycle import FailureReason, PrefillRequest, PrefillState
from scheduler.dist.stages import Failure, StageConsensus, StageGather
from scheduler.prefill.readiness import Polled


class Registry(Protocol):
    """The admission registry, as far as the stages need it."""

    def by_seq(self, seq: int) -> PrefillRequest | None: ...

    def seq_of(self, req: PrefillRequest) -> int: ...


class StagePolls:
    """This stage's side of the agreement, in the pass's terms (see the module docstring)."""

    def __init__(self, consensus: StageConsensus, gather: StageGather) -> None:
        if consensus.num_stages < 2:
            raise ValueError("StagePolls is for two or more stages; one stage acts on its polls")
        self.consensus = consensus
        self.gather = gather
        self._early: list[tuple[PrefillRequest, Failure]] = []

    @property
    def stage(self) -> int:
        return self.consensus.stage

    def admitted(self, req: PrefillRequest, seq: int) -> None:
        """``req`` entered BOOTSTRAPPING as ``seq``. If the stages failed it already (possible
        only when stages admit out of step), it fails on the next agreement."""
        failure = self.consensus.admit(seq)
        if failure is not None:
            self._early.append((req, failure))

    def forwarded(self, seq: int) -> None:
        """The last chunk of ``seq`` was computed and sent on this stage."""
        self.consensus.forwarded(seq)

    def ended(self, seq: int) -> None:
        self.consensus.drop(seq)

    def agree(self, polled: Polled, registry: Registry, free_slots: int) -> Polled:
        """Report this stage's TP-combined ``polled``, agree with every stage, and return the
        verdict as the pass acts on it."""
        seen: dict[int, tuple[FailureReason, str]] = {}
        for req in polled.handshaken:
            self.consensus.report(registry.seq_of(req), KVPoll.WAITING_FOR_INPUT)
        for req in polled.transferred:
            self.consensus.report(registry.seq_of(req), KVPoll.SUCCESS)
        for req, reason, detail in polled.failed:
            seq = registry.seq_of(req)
            self.consensus.report(seq, KVPoll.FAILED)
            seen[seq] = (reason, detail)
        outcome = self.consensus.agree(self.gather, free_slots)
        out = Polled(
            handshaken=[_known(registry, k) for k in outcome.bootstrapped],
            transferred=[_known(registry, k) for k in outcome.transferred],
        )
        early, self._early = self._early, []
        for req, failure in early:
            out.failed.append((req, *_stage_failure(req, failure)))
        for failure, _phase in outcome.failed:
            req = _known(registry, failure.key)
            out.failed.append((req, *seen.get(failure.key, _stage_failure(req, failure))))
        return out


def _known(registry: Registry, seq: int) -> PrefillRequest:
    req = registry.by_seq(seq)
    if req is None:
        raise AssertionError(f"the stages' verdict names request {seq}, which is not live here")
    return req


def _stage_failure(req: PrefillRequest, failure: Failure) -> tuple[FailureReason, str]:
    reason = (FailureReason.BOOTSTRAP_FAILED if req.state is PrefillState.BOOTSTRAPPING
              else FailureReason.TRANSFER_FAILED)
    return reason, f"{REASON_OTHER_RANK} (pipeline stage {failure.stage})"
