"""The checks the scheduler fuzzing machine (:mod:`.machine`) runs that need no memory of
earlier steps (or keep it in what they are given): pages and who may touch them, the requests
seen live, the answers, the deadlines and the aborts after a pass, and what quiescence leaves.
Each raises :class:`~scheduler.testing.verdicts.InvariantViolation` naming its invariant."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kv.pages import pages_needed
from kv.pool import KVPool
from lifecycle import PREFILL_TABLE, FailureReason, PrefillRequest, PrefillState
from lifecycle.invariants import resource_violations, timeline_violations
from scheduler.messages import Response
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ModelRunner
from scheduler.testing.fakes import Reference, ScriptedKVManager
from scheduler.testing.setup import prompt_of
from scheduler.testing.verdicts import invariant

S = PrefillState


def check_pages(sched: PrefillScheduler, scripted: ScriptedKVManager, runner: ModelRunner) -> None:
    """Invariant 3: no page held twice or held while free; none free while a transfer reads it
    or a forward writes it (the runner's own record)."""
    with invariant(3):
        held = set(sched.pool.allocator.held_pages())
        # A request's own pages (with the prefix cache, the tree's are shared and checked by
        # invariant 7).
        owned = [p for r in sched.lifecycle.live() for p in sched.owned_pages(r)]
        assert len(owned) == len(set(owned)), "a page is held by two live requests"
        assert set(owned) <= held, f"live requests hold free pages {set(owned) - held}"
        read = {p for s in scripted.senders for p in s.reading}
        assert read <= held, f"pages {sorted(read - held)} are free while a transfer reads them"
        for sender in scripted.senders:
            free = scripted.free_state(sender.reading_state)
            assert not free, f"state {free} is free while room {sender.room}'s transfer reads it"
        violations = getattr(runner, "violations", []) + scripted.violations
        assert not violations, violations


def check_requests(sched: PrefillScheduler, seen: dict[int, PrefillRequest]) -> None:
    """Invariants 1 to 4 for every request object ``seen`` live and not yet checked final: its
    timeline replays through the table, it holds what its state owns, only FORWARD requests are
    on the device, a final one is out of the lifecycle (and leaves ``seen``: it is checked once
    more through its response), a live one is filed under its state; no slot is held twice."""
    live = {r.rid: r for r in sched.lifecycle.live()}
    for key, req in list(seen.items()):
        with invariant(2):
            assert timeline_violations(req, PREFILL_TABLE) == [], req
        with invariant(3):
            assert resource_violations(req) == [], resource_violations(req)
            if req.on_device:
                assert req.state is S.FORWARD and sched.overlap, req
        if req.is_final:
            with invariant(1):
                assert live.get(req.rid) is not req and req.on_device == 0, req
            del seen[key]
            continue
        with invariant(4):
            assert req.state is not None and live[req.rid] is req
            assert sched.lifecycle.in_state(req.state)[req.rid] is req
    with invariant(3):
        slots = [r.slot for r in live.values() if r.slot is not None]
        assert len(slots) == len(set(slots)), f"a metadata slot is held twice: {sorted(slots)}"


def check_answer_counts(responses: Sequence[Response], submitted: collections.Counter[str]) -> None:
    """Invariant 1 so far: no request id is answered more often than it was submitted."""
    answered = collections.Counter(r.rid for r in responses)
    with invariant(1):
        for rid, n in answered.items():
            assert n <= submitted[rid], f"{rid!r} answered {n} times, submitted {submitted[rid]}"


def check_response(resp: Response, pool: KVPool, reference: Reference | None,
                   vocab_size: int | None = None) -> None:
    """Invariants 1 and 2 for one answer: a final state with a reason exactly when FAILED,
    ``rejected`` for a prompt that can never fit, the reference's first token when DONE (of
    :func:`prompt_of` the prompt, drawn within ``vocab_size``), and a timeline that replays
    through the table."""
    with invariant(1):
        assert resp.state in (S.DONE, S.FAILED), resp
        assert (resp.state is S.DONE) == (resp.reason is None), resp
        never_fits = resp.prompt_tokens == 0 or pages_needed(
            resp.prompt_tokens, pool.page_size) > pool.num_pages
        if never_fits:
            assert resp.reason is FailureReason.REJECTED, resp
        if not resp.timeline:  # refused before admission: only a duplicate id
            assert resp.reason is FailureReason.REJECTED and "already live" in resp.detail, resp
        if resp.ok and reference is not None:
            want = reference(prompt_of(resp.rid, resp.prompt_tokens, vocab_size))
            assert resp.first_token == want, (
                f"{resp.rid}: first token {resp.first_token} != {want}"
            )
    if resp.timeline:
        replay = PrefillRequest(resp.rid, state=resp.state, timeline=list(resp.timeline))
        with invariant(2):
            assert timeline_violations(replay, PREFILL_TABLE) == [], resp


def check_deadlines(sched: PrefillScheduler, now: float) -> None:
    """Invariant 5 after a pass: nothing live is past its state's deadline."""
    cfg = sched.config
    with invariant(5):
        for req in sched.lifecycle.live():
            if req.state is S.BOOTSTRAPPING:
                assert now < req.timeline[0][0] + cfg.bootstrap_timeout, req
            elif req.state is S.TRANSFERRING:
                assert now < _entered(req, "prefilled") + cfg.transfer_timeout, req


def check_aborts(pending: Sequence[tuple[PrefillRequest, FailureReason | None]]) -> None:
    """Invariant 5 after a pass: each request aborted while live before it (with the failure it
    already had) ended aborted, or failed earlier, or waits for its batch to leave the device
    with the abort deferred."""
    with invariant(5):
        for req, earlier in pending:
            if req.is_final:
                assert req.reason is FailureReason.ABORTED or earlier is not None, (
                    f"{req.rid}: aborted while live, ended {req.reason}"
                )
            else:
                assert req.pending_abort is not None and req.on_device > 0, (
                    f"{req.rid}: an abort was received but {req.state!r} stays live, "
                    f"on_device={req.on_device}"
                )


def check_all_answered(
    sched: PrefillScheduler,
    responses: Sequence[Response],
    submitted: collections.Counter[str],
    passes: int,
) -> None:
    """Invariant 1 once the scheduler was driven to rest for ``passes`` passes: it is idle and
    every submission was answered exactly once."""
    with invariant(1):
        assert sched.idle(), f"the scheduler did not quiesce in {passes} passes"
        answered = collections.Counter(r.rid for r in responses)
        assert answered == submitted, f"answers {answered} != submissions {submitted}"


def check_all_free(sched: PrefillScheduler, scripted: ScriptedKVManager) -> None:
    """Invariant 3 at rest, once the prefix cache is drained: every page and slot is free
    again and every scripted sender was cleared."""
    with invariant(3):
        assert sched.pool.allocator.available() == sched.pool.num_pages, "pages leaked"
        assert sched.slots.available() == sched.slots.num_slots, "metadata slots leaked"
        assert sched.states is None or sched.states.all_free(), "SWA pages or state slots leaked"
        assert sched.pages_held == 0
        uncleared = [s.room for s in scripted.senders if not s.cleared]
        assert not uncleared, f"senders of rooms {uncleared} never cleared"


def _entered(req: PrefillRequest, event: str) -> float:
    return next(t for t, e in reversed(req.timeline) if e == event)
