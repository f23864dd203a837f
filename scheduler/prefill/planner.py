"""Step 4 of the pass, *plan*: which requests the next batch holds.

The :class:`Planner` turns the scheduler's queues into the PrefillAdder's inputs
(:func:`.adder.plan_batch`): the WAITING requests (in the prefix cache's order when it is on),
the running count, the free pages, the budgets of the config and the PrefillDelayer's gate. With
state pools (:mod:`kv.state_pools`) a page is free when the full and the SWA pool both have one,
and no more requests start holding pages than there are free recurrent slots. It
owns the two facts that planning carries from one pass to the next:

- the request in the middle of a chunked prefill, which the next batch continues first (and
  which is dropped when the request left FORWARD or a failure waits to settle on it);
- the largest batch so far (SGLang's ``max_prefill_bs``, which the delayer's slot and queue
  conditions compare against).

It fires no edge and allocates nothing: the pass launches the plan (:mod:`.forward`) and tells
the planner with :meth:`Planner.launched`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kv.pool import KVPool
from kv.state_pools import StatePools
from lifecycle import Lifecycle, PrefillRequest, PrefillState
from scheduler.prefill.adder import Plan, Stop, plan_batch
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import DelayerPass
from scheduler.prefill.on_device import failure_deferred
from scheduler.prefill.prefix import PrefixCache

S = PrefillState


class Planner:
    """The plan of each pass, and the chunked request it continues first."""

    def __init__(
        self,
        *,
        lifecycle: Lifecycle[PrefillRequest],
        config: SchedulerConfig,
        pool: KVPool,
        prefix: PrefixCache | None,
        states: StatePools | None = None,
    ) -> None:
        self.lifecycle, self.config, self.pool, self.prefix = lifecycle, config, pool, prefix
        self.states = states
        self.continuing: PrefillRequest | None = None  # mid-chunk, continued first
        self.max_prefill_bs = 0

    def plan(self, delayer_pass: DelayerPass | None) -> Plan:
        """The next batch; an empty plan when nothing waits and nothing continues, or when the
        delayer holds back new requests and no chunked request must go on."""
        waiting = self.lifecycle.in_state(S.WAITING)
        continuing = self.continuing
        if continuing is not None and (
            continuing.state is not S.FORWARD or failure_deferred(continuing)
        ):
            continuing = self.continuing = None
        if not waiting and continuing is None:
            return Plan()
        running = len(self.lifecycle.in_state(S.FORWARD)) + len(
            self.lifecycle.in_state(S.TRANSFERRING)
        )
        cfg, prefix = self.config, self.prefix
        queue: Iterable[PrefillRequest] = waiting.values()
        if prefix is not None:
            queue = prefix.begin_pass(queue, len(waiting))
        free_pages = self.pool.allocator.available()
        max_running = cfg.max_running_requests
        if prefix is not None:
            free_pages = prefix.pages_available()
        elif self.states is not None:
            free_pages = self.states.pages_available()
            slots = self.states.slots_available()
            if slots is not None:  # each request that starts holding pages takes one
                max_running = min(max_running, running + slots)
        plan = plan_batch(
            continuing=continuing, waiting=queue, waiting_len=len(waiting), running=running,
            free_pages=free_pages,
            page_size=cfg.page_size, max_prefill_tokens=cfg.max_prefill_tokens,
            chunked_prefill_size=cfg.chunked_prefill_size,
            max_running_requests=max_running,
            prefill_max_requests=cfg.prefill_max_requests,
            gate=self._gate(delayer_pass), lookup=None if prefix is None else prefix.lookup,
        )
        if plan.stop is Stop.DELAYED and continuing is None:
            return Plan(stop=Stop.DELAYED)
        return plan

    def launched(self, plan: Plan) -> None:
        """``plan`` went to the device: its non-last chunk (if any) is continued next."""
        self.continuing = next((c.req for c in plan.chunks if not c.last), None)
        self.max_prefill_bs = max(self.max_prefill_bs, len(plan.chunks))

    def forget(self, req: PrefillRequest) -> None:
        """``req`` ended: it is continued no more."""
        if self.continuing is req:
            self.continuing = None

    def _gate(self, delayer_pass: DelayerPass | None) -> Callable[[int, int], bool] | None:
        if delayer_pass is None:
            return None

        def gate(running_now: int, waiting_len: int) -> bool:
            return delayer_pass.allow(
                local_prefillable=True, running_batch=running_now,
                max_prefill_bs=self.max_prefill_bs,
                max_running_requests=self.config.max_running_requests,
                waiting_queue_len=waiting_len,
            )

        return gate
