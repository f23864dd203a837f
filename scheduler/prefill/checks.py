"""What the prefill scheduler checks of its arguments when built, and of its state pools
(``kv.state_pools``) when its invariants are checked."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kv.state_pools import StateKind, StatePools
from kv.transfer import KVManager
from lifecycle import PrefillRequest
from scheduler.model.side_pools import check_runner_states
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.forward import Device
from scheduler.runner import ModelRunner


def check_arguments(
    config: SchedulerConfig, runner: ModelRunner, overlap: bool, device: Device | None,
    states: StatePools | None = None, kv: KVManager | None = None,
) -> None:
    """ValueError naming the argument that does not fit the others."""
    if runner.pool.page_size != config.page_size:
        raise ValueError(
            f"page_size: the config says {config.page_size}, the KV pool has "
            f"{runner.pool.page_size}"
        )
    if device is not None and not overlap:
        raise ValueError("device: only the overlap loop runs forwards on a device; "
                         "pass overlap=True or leave device out")
    check_runner_states(runner, states)
    if states is None:
        return
    if states.full is not runner.pool:
        raise ValueError("states: the state pools must be built on the runner's KV pool")
    if config.radix_cache:
        held = [_HELD[kind] for kind in states.kinds]
        held += ["a draft's KV pages (speculative decoding)"] if states.draft is not None else []
        raise ValueError(f"states: the prefix cache keeps the full pool's pages only, not "
                         f"{' or '.join(held) or 'state pools'}; turn radix_cache off with "
                         "state pools")
    moves = states.kinds or states.draft is not None
    if moves and not getattr(kv, "carries_state", False):
        raise ValueError(f"states: the transfer backend {type(kv).__name__} does not carry "
                         "state pools (KVManager.carries_state)")


_HELD = {StateKind.SWA: "SWA pages", StateKind.RECURRENT: "recurrent state",
         StateKind.INDEX: "index pages"}


def check_state_conservation(
    states: StatePools | None, live: Sequence[PrefillRequest],
    held_back: Iterable[Sequence[int]], held_back_slots: int,
) -> None:
    """Invariant 3 for the state pools: the SWA pages of the pages live requests hold and the
    releaser holds back, and the free ones, partition the SWA pool; so do the recurrent slots;
    a request holds a recurrent slot exactly when it holds pages and there is a recurrent
    pool. KVPoolError or AssertionError naming what differs."""
    if states is None:
        return
    want_slot = states.recurrent is not None
    for req in live:
        if (req.state_slot is not None) != (want_slot and bool(req.pages)):
            raise AssertionError(f"{req.rid} holds {len(req.pages)} pages and recurrent slot "
                                 f"{req.state_slot} (recurrent pool: {want_slot})")
    held = [r.pages for r in live] + list(held_back)
    slots = sum(1 for r in live if r.state_slot is not None) + held_back_slots
    states.check_conservation(held, slots)
