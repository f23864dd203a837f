"""The pipeline-stage consensus: the verdict of a table by hand, a Hypothesis run over random
per-stage poll orders and failures (in process), and two stages agreeing over gloo."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import attrs
import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from kv.transfer import KVPoll
from scheduler.dist.stages import (
    Failure,
    InProcessStages,
    Phase,
    SingleStage,
    StageConsensus,
    StageOutcome,
    StageTableError,
    TorchStageGather,
    Verdict,
    decide,
)
from tests.distributed import free_port, run_ranks

F, W, S = int(KVPoll.FAILED), int(KVPoll.WAITING_FOR_INPUT), int(KVPoll.SUCCESS)


# -- the verdict of a table ---------------------------------------------------------------------


def test_stage_zero_orders_and_every_stage_must_be_ready() -> None:
    table = [[5, 3, W, 1, W, 2, W], [5, 1, W, 2, W]]
    assert decide(table) == Verdict(bootstrapped=(1, 2))
    table = [[5, 3, W, 1, W, 2, W], [5, 2, W, 3, W, 1, W]]
    assert decide(table) == Verdict(bootstrapped=(3, 1, 2))


def test_the_walk_stops_at_the_first_key_without_a_slot() -> None:
    # Stage 1 has two free slots: keys 3 and 1 take them; 2 waits, and so does 4 behind it.
    table = [[9, 3, W, 1, W, 2, W, 4, W], [2, 4, W, 2, W, 1, W, 3, W]]
    assert decide(table) == Verdict(bootstrapped=(3, 1))
    # A key that is not ready everywhere takes no slot and does not stop the walk.
    table = [[2, 3, W, 1, W, 2, W], [2, 1, W, 2, W]]
    assert decide(table) == Verdict(bootstrapped=(1, 2))


def test_a_failure_on_any_stage_fails_the_key_and_a_transfer_needs_every_stage() -> None:
    table = [[0, 1, S, 2, S, 3, W, 4, S], [0, 7, F, 2, S, 3, F, 1, S]]
    assert decide(table) == Verdict(
        failed=(Failure(7, 1), Failure(3, 1)), transferred=(1, 2)
    )
    table = [[0, 5, F], [0, 5, F], [0]]
    assert decide(table) == Verdict(failed=(Failure(5, 0),))


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ([], "no stage"),
        ([[0, 1]], "row must be"),
        ([[-1]], "free slots"),
        ([[0, 1, W, 1, W]], "twice"),
        ([[0, 1, int(KVPoll.TRANSFERRING)]], "poll"),
        ([[0, 1, W], [0, 1, S]], "left bootstrapping"),
    ],
)
def test_impossible_tables_are_refused(table: list[list[int]], problem: str) -> None:
    with pytest.raises(StageTableError, match=problem):
        decide(table)


def test_one_stage_walks_a_request_through_every_phase() -> None:
    stage, gather = StageConsensus(0, 1), SingleStage()
    assert stage.admit(7) is None
    assert stage.agree(gather, free_slots=1) == StageOutcome(Verdict(), ())
    stage.report(7, KVPoll.WAITING_FOR_INPUT)
    assert stage.agree(gather, free_slots=0).bootstrapped == ()
    assert stage.phase(7) is Phase.BOOTSTRAP
    assert stage.agree(gather, free_slots=1).bootstrapped == (7,)
    assert stage.phase(7) is Phase.FORWARD
    stage.report(7, KVPoll.SUCCESS)  # before the forward's end: kept, not yet decisive
    assert stage.row(0) == [0]
    stage.forwarded(7)
    assert stage.row(0) == [0, 7, S]
    assert stage.agree(gather, free_slots=0).transferred == (7,)
    assert (stage.phase(7), len(stage)) == (None, 0)
    with pytest.raises(StageTableError, match="no key 7"):
        stage.report(7, KVPoll.FAILED)


def test_a_failure_is_never_taken_back_and_waits_for_a_late_stage() -> None:
    group = InProcessStages(2)
    first, late = group.stages
    first.admit(1)
    first.report(1, KVPoll.FAILED)
    first.report(1, KVPoll.WAITING_FOR_INPUT)
    outcomes = group.agree([1, 1])
    assert outcomes[0].failed == ((Failure(1, 0), Phase.BOOTSTRAP),)
    assert outcomes[1].failed == ()
    assert late.early_failures == {1}
    assert late.admit(1) == Failure(1, 0)
    assert (late.early_failures, len(late)) == (frozenset(), 0)
    with pytest.raises(StageTableError, match="twice"):
        first.admit(2) or first.admit(2)


# -- random poll orders and failures ------------------------------------------------------------


@attrs.define
class Sim:
    """One stage's scheduler, as far as the consensus sees it."""

    consensus: StageConsensus
    slots: int
    admitted: int = 0
    held: set[int] = attrs.Factory(set)
    poll: dict[int, KVPoll] = attrs.Factory(dict)
    outcome: dict[int, str] = attrs.Factory(dict)
    injected: set[int] = attrs.Factory(set)
    succeeded: set[int] = attrs.Factory(set)

    def finish(self, key: int, how: str) -> None:
        assert key not in self.outcome, f"stage {self.consensus.stage}: {key} ended twice"
        self.outcome[key] = how
        self.held.discard(key)

    def state(self, key: int) -> str:
        """The state every stage must agree on after an agreement step."""
        if key in self.outcome or key in self.consensus.early_failures:
            return self.outcome.get(key, "failed")
        phase = self.consensus.phase(key)
        return "bootstrapping" if phase in (None, Phase.BOOTSTRAP) else "admitted"


class Pipeline:
    def __init__(self, keys: int, slots: list[int]) -> None:
        self.keys = keys
        self.group = InProcessStages(len(slots))
        self.sims = [Sim(c, n) for c, n in zip(self.group.stages, slots, strict=True)]

    def actions(self, failures: bool) -> list[tuple[str, int, int]]:
        out: list[tuple[str, int, int]] = []
        for s, sim in enumerate(self.sims):
            if sim.admitted < self.keys:
                out.append(("admit", s, sim.admitted))
            for key, poll in sim.poll.items():
                phase = sim.consensus.phase(key)
                if phase is Phase.BOOTSTRAP and poll == KVPoll.BOOTSTRAPPING:
                    out.append(("ready", s, key))
                if phase is Phase.FORWARD:
                    out.append(("forward", s, key))
                if phase is Phase.TRANSFER and poll == KVPoll.TRANSFERRING:
                    out.append(("succeed", s, key))
                if failures and phase is not None and poll != KVPoll.FAILED:
                    out.append(("fail", s, key))
        return out

    def act(self, action: str, s: int, key: int) -> None:
        sim = self.sims[s]
        c = sim.consensus
        if action == "admit":
            sim.admitted += 1
            if c.admit(key) is not None:
                sim.finish(key, "failed")
            else:
                sim.poll[key] = KVPoll.BOOTSTRAPPING
            return
        poll = {
            "ready": KVPoll.WAITING_FOR_INPUT,
            "forward": KVPoll.TRANSFERRING,
            "succeed": KVPoll.SUCCESS,
            "fail": KVPoll.FAILED,
        }[action]
        if action == "forward":
            c.forwarded(key)
        if action == "fail":
            sim.injected.add(key)
        if action == "succeed":
            sim.succeeded.add(key)
        sim.poll[key] = poll
        c.report(key, poll)

    def agree(self) -> None:
        free = [sim.slots - len(sim.held) for sim in self.sims]
        outcomes = self.group.agree(free)
        verdicts = {o.verdict for o in outcomes}
        assert len(verdicts) == 1
        verdict = outcomes[0].verdict
        assert len(verdict.bootstrapped) <= min(free)
        for sim, outcome in zip(self.sims, outcomes, strict=True):
            for failure, _phase in outcome.failed:
                assert any(failure.key in other.injected for other in self.sims)
                sim.finish(failure.key, "failed")
                del sim.poll[failure.key]
            for key in outcome.bootstrapped:
                sim.held.add(key)
            for key in outcome.transferred:
                assert all(key in other.succeeded for other in self.sims)
                sim.finish(key, "done")
                del sim.poll[key]
        self.check()

    def check(self) -> None:
        for key in range(self.keys):
            states = {sim.state(key) for sim in self.sims}
            assert len(states) == 1, f"key {key}: stages disagree: {states}"
        for sim in self.sims:
            live = {k for k in sim.poll if sim.consensus.phase(k) in (Phase.FORWARD,
                                                                     Phase.TRANSFER)}
            assert sim.held == live
            assert len(sim.held) <= sim.slots

    def drain(self) -> None:
        """Every sender finishes: no request may stay behind."""
        for _ in range(4 * self.keys + 8):
            for action, s, key in self.actions(failures=False):
                self.act(action, s, key)
            self.agree()
            if all(len(sim.outcome) == self.keys for sim in self.sims):
                return
        raise AssertionError("requests were lost: the stages never finished them")


@given(
    stages=st.integers(min_value=2, max_value=3),
    keys=st.integers(min_value=1, max_value=8),
    failures=st.booleans(),
    data=st.data(),
)
def test_stages_never_disagree_and_lose_nothing(
    stages: int, keys: int, failures: bool, data: st.DataObject
) -> None:
    slots = data.draw(st.lists(st.integers(1, 3), min_size=stages, max_size=stages))
    pipe = Pipeline(keys, slots)
    for _ in range(data.draw(st.integers(0, 80))):
        choices = [("agree", 0, 0), *pipe.actions(failures)]
        action, s, key = data.draw(st.sampled_from(choices))
        if action == "agree":
            pipe.agree()
        else:
            pipe.act(action, s, key)
    pipe.drain()
    for key in range(keys):
        failed = any(key in sim.injected for sim in pipe.sims)
        assert {sim.outcome[key] for sim in pipe.sims} == {"failed" if failed else "done"}
    for sim in pipe.sims:
        assert (len(sim.consensus), sim.consensus.early_failures, sim.held) == (
            0, frozenset(), set())


# -- two stages over gloo -----------------------------------------------------------------------

GLOO_KEYS = 6
LAUNCH_TIMEOUT_S = 120.0


def _stage_worker(rank: int, port: int, out_dir: str) -> None:
    """Stage 1 fails key 2's bootstrap and is late to see key 0's destination; stage 0 fails key
    4's transfer. Every other key is done on both."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )
    try:
        stage, gather = StageConsensus(rank, 2), TorchStageGather()
        log: list[list[object]] = []
        for key in range(GLOO_KEYS):
            stage.admit(key)
        for step in range(12):
            for key in range(GLOO_KEYS):
                phase = stage.phase(key)
                if phase is Phase.BOOTSTRAP:
                    if rank == 1 and key == 2:
                        stage.report(key, KVPoll.FAILED)
                    elif rank == 0 or key != 0 or step >= 3:
                        stage.report(key, KVPoll.WAITING_FOR_INPUT)
                elif phase is Phase.FORWARD:
                    stage.forwarded(key)
                elif phase is Phase.TRANSFER:
                    failing = rank == 0 and key == 4
                    stage.report(key, KVPoll.FAILED if failing else KVPoll.SUCCESS)
            outcome = stage.agree(gather, free_slots=3)
            log.append([step, list(outcome.bootstrapped),
                        [[f.key, f.stage, p.name] for f, p in outcome.failed],
                        list(outcome.transferred)])
        Path(out_dir, f"stage{rank}.json").write_text(json.dumps(log))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_stages_agree_over_gloo(tmp_path: Path) -> None:
    run_ranks(_stage_worker, (free_port(), str(tmp_path)), 2, LAUNCH_TIMEOUT_S)
    logs = [json.loads((tmp_path / f"stage{r}.json").read_text()) for r in range(2)]
    assert logs[0] == logs[1]
    bootstrapped = [k for _, b, _, _ in logs[0] for k in b]
    failed = {f[0]: f[1] for _, _, fs, _ in logs[0] for f in fs}
    transferred = [k for _, _, _, t in logs[0] for k in t]
    # Stage 0 orders; three slots per pass; key 0 waits for stage 1's late destination.
    assert logs[0][0][1] == [1, 3, 4]
    assert sorted(bootstrapped) == [0, 1, 3, 4, 5]
    assert failed == {2: 1, 4: 0}
    assert sorted(transferred) == [0, 1, 3, 5]
