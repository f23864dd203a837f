"""The boundaries the scheduler fuzzing machine (:mod:`.machine`) drives: a transfer
backend whose every move a rule decides, and a cheap model runner whose output depends on every
K/V page it reads.

:class:`ScriptedSender` follows the transfer contract (``kv/transfer.py``) but changes state only
when told: handshake, bootstrap failure or timeout, transfer failure, the engine finishing its
reads, success; it keeps "reading" the pages it was sent until drained, so aborts and failures
land mid-transfer. It carries state pools (``kv/state_pools.py``) too: the SWA pages and the
recurrent slot of a last chunk are read until drained like pages. :class:`PageEchoRunner` writes
each token id into its K/V slot and derives the next token from the pages it reads back, so a
page freed too early or overwritten changes the answer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence

from kv.pages import pages_needed
from kv.pool import KVPool
from kv.state_pools import StateKind, StatePools
from kv.transfer import (
    REASON_ABORTED,
    REASON_PEER_ABORTED,
    KVPoll,
    SendCursor,
    TransferError,
    TransferUsageError,
)
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.runner import ForwardBatch, ModelRunner

DECODE_HOST = "decode"
RunnerFactory = Callable[[int, int], ModelRunner]  # (num_pages, page_size) -> runner
Reference = Callable[[Sequence[int]], int]  # prompt -> the first output token

# -- the scripted transfer backend -----------------------------------------------------------


class ScriptedSender:
    """A sender that follows the transfer contract and moves only when told to.

    Contract breaches by the scheduler (a call after ``clear()``, ``clear()`` while reading,
    ``send`` of a page that is free) raise :class:`~kv.transfer.TransferUsageError` out of the
    pass, which fails the example.
    """

    def __init__(self, manager: ScriptedKVManager, addr: str, room: int) -> None:
        self.manager, self.addr, self.room = manager, addr, room
        self.status = KVPoll.BOOTSTRAPPING
        self.reason = ""
        self.timeout = False
        self.cursor = SendCursor(room)
        self.reading: list[int] = []  # pages the engine may still read
        self.reading_state: dict[StateKind, list[int]] = {}  # and state items (the last chunk)
        self.cleared = False

    def __repr__(self) -> str:  # how a shrunk program names the sender a rule moved
        return f"ScriptedSender(room={self.room}, {self.status.name})"

    def _usable(self, what: str) -> None:
        if self.cleared:
            raise TransferUsageError(self.room, f"{what} after clear()")

    def _set(self, status: KVPoll, reason: str = "", timeout: bool = False) -> None:
        self.status, self.reason, self.timeout = status, reason, timeout
        self.manager.ready.put(self.room)

    def init(self, num_pages: int, slot: int) -> None:
        self._usable("init()")
        if self.status == KVPoll.FAILED:
            return
        if self.status != KVPoll.WAITING_FOR_INPUT:
            raise TransferUsageError(self.room, f"init() while {self.status.name}")
        self.cursor.init(num_pages, slot)

    def send_state(self, state: Mapping[StateKind, Sequence[int]]) -> None:
        self._usable("send_state()")
        if self.status == KVPoll.FAILED:
            return
        if self.cursor.finished or self.reading_state:
            raise TransferUsageError(self.room, "send_state() twice or after the last chunk")
        free = self.manager.free_state(state)
        if free:
            raise TransferUsageError(self.room, f"send_state() of free state items {free}")
        self.reading_state = {kind: list(items) for kind, items in state.items()}

    def send(self, pages: Sequence[int], last: bool) -> None:
        self._usable("send()")
        if self.status == KVPoll.FAILED:
            return
        kinds = self.manager.states.kinds if self.manager.states is not None else ()
        if last and set(kinds) != set(self.reading_state):
            held = sorted(self.reading_state)
            raise TransferUsageError(self.room, f"last chunk with state {held}, the pools "
                                     f"hold {sorted(kinds)}")
        self.cursor.advance(len(pages), last)
        free = [p for p in pages if self.manager.is_free(p)]
        if free:
            raise TransferUsageError(self.room, f"send() of free pages {free}")
        self.reading.extend(pages)
        self.status = KVPoll.TRANSFERRING

    def poll(self) -> KVPoll:
        self._usable("poll()")
        return self.status

    def failure_exception(self) -> TransferError:
        self._usable("failure_exception()")
        return TransferError(self.room, self.reason or "failed on another rank", self.addr,
                             timeout=self.timeout)

    def abort(self, why: str = "") -> None:
        self._usable("abort()")  # ``why`` has no peer to go to
        if self.status not in (KVPoll.SUCCESS, KVPoll.FAILED):
            self._set(KVPoll.FAILED, REASON_ABORTED)

    def clear(self) -> None:
        if self.reading or self.reading_state:
            raise TransferUsageError(self.room, f"clear() while pages {self.reading} or state "
                                     f"{self.reading_state} are read")
        self.cleared = True
        self.manager.live.pop(self.room, None)

    def quiescent(self) -> bool:
        return not self.reading and not self.reading_state

    # -- what the rules make happen ---------------------------------------------------------

    def actions(self) -> list[str]:
        """The backend events that may happen to this sender now."""
        if self.cleared:
            return []
        out = ["drain"] if self.reading or self.reading_state else []
        if self.status == KVPoll.BOOTSTRAPPING:
            out += ["handshake", "bootstrap_failure", "bootstrap_timeout", "peer_abort"]
        elif self.status in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING):
            out += ["transfer_failure", "transfer_timeout", "peer_abort"]
            if self.status == KVPoll.TRANSFERRING and self.cursor.finished:
                out.append("success")
        return out

    def act(self, action: str) -> None:
        if action == "drain":
            self.reading, self.reading_state = [], {}
            self.manager.ready.put(self.room)  # a failed room became quiescent
        elif action == "handshake":
            self._set(KVPoll.WAITING_FOR_INPUT)
        elif action == "success":
            self.reading, self.reading_state = [], {}
            self._set(KVPoll.SUCCESS)
        elif action == "peer_abort":
            self._set(KVPoll.FAILED, REASON_PEER_ABORTED)
        else:
            self._set(KVPoll.FAILED, f"injected {action.replace('_', ' ')}",
                      timeout=action.endswith("timeout"))


class ScriptedKVManager:
    """Creates :class:`ScriptedSender`s; one live (not cleared) sender per room. It carries the
    state of ``states`` (the scheduler's state pools, if any)."""

    carries_state = True

    def __init__(self, pool: KVPool, states: StatePools | None = None) -> None:
        self.pool = pool
        self.states = states
        self.ready: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.live: dict[int, ScriptedSender] = {}
        self.senders: list[ScriptedSender] = []
        self.violations: list[str] = []  # contract breaches the scheduler survived
        self.refused: list[tuple[int, str]] = []  # rooms refused to the decode peer, with why

    def is_free(self, page: int) -> bool:
        return page not in self._held()

    def _held(self) -> set[int]:
        return set(self.pool.allocator.held_pages())

    def free_state(self, state: Mapping[StateKind, Sequence[int]]) -> list[str]:
        """The items of ``state`` that are free now (``kind:item``): SWA pages and recurrent
        slots are read from their own pools, index pages at the full pool's indices."""
        states = self.states
        if states is None:
            return [f"{kind}:{item}" for kind, items in state.items() for item in items]
        free = []
        for kind, items in state.items():
            for item in items:
                if kind is StateKind.SWA and states.swa is not None:
                    taken = item in states.swa.pool.allocator.held_pages()
                elif kind is StateKind.RECURRENT and states.recurrent is not None:
                    taken = not states.recurrent.allocator.is_free(item)
                else:
                    taken = kind is StateKind.INDEX and not self.is_free(item)
                if not taken:
                    free.append(f"{kind}:{item}")
        return free

    def create_sender(self, bootstrap_addr: str, room: int) -> ScriptedSender:
        if room in self.live:
            # The scheduler would answer the request with the error; the breach is the bug.
            self.violations.append(f"create_sender() for room {room}, whose sender is live")
            raise TransferUsageError(room, "the room already has a live sender; clear() it")
        sender = ScriptedSender(self, bootstrap_addr, room)
        self.live[room] = sender
        self.senders.append(sender)
        return sender

    def refuse(self, room: int, reason: str) -> None:
        self.refused.append((room, reason))

    def close(self) -> None:
        """Nothing to release."""


# -- model runners ---------------------------------------------------------------------------


def echo_next_token(prompt: Sequence[int]) -> int:
    """What :class:`PageEchoRunner` answers for ``prompt``: a position-weighted checksum."""
    return sum((i + 1) * t for i, t in enumerate(prompt)) % 251


class ForwardOnly:
    """A runner of one's own with ``pool`` and ``forward`` alone (no logits, no
    ``vocab_size``): ``inner``'s tokens over ``inner``'s pool. It serves greedy requests only."""

    def __init__(self, inner: PagedModelRunner) -> None:
        self.inner = inner
        self.pool = inner.pool

    def forward(self, batch: ForwardBatch) -> list[int]:
        return self.inner.forward(batch)


class PageEchoRunner:
    """A cheap :class:`~scheduler.runner.ModelRunner`: stores each token id in its KV slot
    and answers :func:`echo_next_token` of the prefix read back from the pages, so a page that
    was freed, shared or overwritten under a request changes its first token. Every page of a
    batch must be held (not free) while the forward runs; breaches are kept in
    :attr:`violations` (the forward may run on the device worker thread)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.violations: list[str] = []
        self.fail_next = False  # raise from the next forward (an injected device error)
        self._lock = threading.Lock()

    def forward(self, batch: ForwardBatch) -> list[int]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected forward failure")
        ps = self.pool.page_size
        keys = self.pool.k(0)
        out = []
        for item in batch.items:
            end = item.start + len(item.input_ids)
            held = set(self.pool.allocator.held_pages())
            problems = [p for p in item.pages if p not in held]
            if problems or len(item.pages) < pages_needed(end, ps):
                with self._lock:
                    self.violations.append(
                        f"{item.rid}: forward over pages {list(item.pages)} (free: {problems}) "
                        f"for {end} tokens"
                    )
            for pos, tok in enumerate(item.input_ids, start=item.start):
                keys[item.pages[pos // ps], pos % ps, 0, 0] = float(tok)
            prefix = [int(keys[item.pages[p // ps], p % ps, 0, 0]) for p in range(end)]
            out.append(echo_next_token(prefix))
        return out


def echo_runner_factory(num_pages: int, page_size: int) -> PageEchoRunner:
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=page_size, kv_heads=1,
                  head_dim=1)
    return PageEchoRunner(pool)


def tiny_model(seed: int = 0) -> tuple[RunnerFactory, Reference]:
    """The reference Llama in :meth:`ModelConfig.tiny` shape: a runner factory and the
    colocated reference of the first token (slow: tens of ms per forward)."""
    model = LlamaModel(ModelConfig.tiny(seed))
    reference = ReferenceModel(model)

    def factory(num_pages: int, page_size: int) -> ModelRunner:
        return PagedModelRunner(model, model.make_pool(num_pages=num_pages, page_size=page_size))

    return factory, lambda prompt: reference.generate(list(prompt), 1)[0]
