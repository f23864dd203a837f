"""The decode side's KV managers, one per prefill server, behind one manager interface.

Theory of operation
-------------------
A :class:`~scheduler.decode.DecodePeer` talks to one object with ``ready`` and
``create_receiver(addr, room)``. A decode server, though, receives from every prefill server the
router pairs it with, and a Mooncake decode manager is bound to one prefill bootstrap address.
:class:`DecodeKVRouter` keeps one manager per ``bootstrap_host:bootstrap_port``:

- :meth:`DecodeKVRouter.connect` creates the manager of an address. Creating one looks the
  prefill server up and registers with it, which blocks (up to the connect timeout, which
  bounds the whole look-up), so the HTTP service has it done *before* it submits the request,
  through :meth:`DecodeKVRouter.connect_soon`: one thread per address looked up makes the
  manager and tells every waiting request the outcome, and a request that stops waiting (its
  client went away) withdraws; the engine loop never blocks on a peer. Calls for an address
  already being looked up, either way, wait for that look-up and share its outcome, so
  requests naming a prefill that does not answer fail together after one connect timeout, not
  one after another, and hold no thread each meanwhile.
- :meth:`DecodeKVRouter.create_receiver` (engine loop) hands the room to its address's manager;
  an address that was never connected fails that request's bootstrap, nothing else.
- ``ready`` merges every manager's readiness queue (and rooms put back by the peer).
- A manager whose prefill has counted as gone (its heartbeat) for ``retire_lost_after_s``, with
  no room of this side still open with it, is retired: taken out of the router and closed, on
  the router's own thread (closing joins the manager's threads, and destroying its engine
  pauses the whole process for about a second: :meth:`kv.mooncake_engine.MooncakeEngine.close`).
  A prefill that comes back later at that address gets a new manager from the next request's
  ``connect``, so a decode server that sees prefill servers come and go holds engines only for
  the ones that answer or were lost a short while ago. A lost manager with live rooms waits
  for them: they failed when the prefill was lost, and the decode peer clears them.
- :meth:`DecodeKVRouter.refuse` tells a prefill server of a room this side will never ask for,
  connected or not: through the local manager, or a :class:`~kv.refusal.RefusalPoster` to the
  prefill's bootstrap endpoint (a refused request may be the first one for that server, and
  connecting just to refuse would cost an engine).

Requests for the fake bootstrap host (``2.2.2.2``, SGLang's warm-up and health path) never
reach a prefill server. :class:`LocalPrefillFake` serves them: a fake receiver whose
``send_metadata`` computes the prompt's KV into the decode pool itself and writes the metadata
row, so the decode peer continues exactly as if the KV had been transferred (the answer is the
same as the colocated reference's). The room of such a request is the service's to choose
(:meth:`LocalPrefillFake.expect` registers the prompt under it); no room 0, so the metadata
gate can read the row back. A request registered with its sampling parameters gets its first
token drawn as the prefill side would draw it (its seeded stream's position 0, its grammar's
mask when the fake has the compiler) and its logprob in the row.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from kv.bootstrap import BootstrapError
from kv.fake import FakeDecodeManager, FakeKVReceiver
from kv.metadata import MetadataBuffers
from kv.refusal import RefusalPoster
from kv.transfer import DecodeKVManager, KVReceiver, TransferUsageError
from lifecycle import SamplingParams
from scheduler.messages import FAKE_BOOTSTRAP_HOST
from scheduler.runner import ForwardBatch, ForwardItem, LogitsRunner, ModelRunner
from scheduler.sample.batch import ItemPlan, LogitsForward
from scheduler.sample.constraint import ConstraintCompiler
from scheduler.sample.request import Sampling, token_set

logger = logging.getLogger(__name__)

# A fake request's id, prompt and sampling.
_Prompt = tuple[str, tuple[int, ...], SamplingParams]


class PeerUnreachable(Exception):
    """The prefill server at ``addr`` could not be looked up or registered with; the message
    names the address once and, when nothing answered there, what to check."""

    def __init__(self, addr: str, detail: str) -> None:
        super().__init__(detail if addr in detail else f"prefill bootstrap {addr}: {detail}")
        self.addr = addr

    @classmethod
    def of(cls, addr: str, exc: Exception) -> PeerUnreachable:
        """Why creating ``addr``'s manager failed: the bootstrap endpoint's own answer when
        the look-up failed and ``exc`` only wraps it (not the address again in every wrapper's
        words); ``exc``'s message when it says more (a refused peer token, another model)."""
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, BootstrapError):
            cause = cause.__cause__
        if cause is None or str(cause) not in str(exc):
            return cls(addr, str(exc))
        if cause.status == 0:
            port = addr.rpartition(":")[2]
            return cls(addr, f"unreachable ({cause.detail}); is the prefill server running "
                             f"there with --bootstrap-port {port}?")
        return cls(addr, f"{cause.status}: {cause.detail}")


@runtime_checkable
class LosesPeer(Protocol):
    """A manager that can tell that its prefill server is gone (the router may retire it)."""

    @property
    def lost_since(self) -> float | None:
        """When (``time.monotonic()``) the prefill came to count as gone, or None."""

    def live_rooms(self) -> int: ...

    def refuse_while_lost(self, room: int) -> str | None:
        """Why the prefill counts as gone (``room`` is then refused to it once it answers
        again), or None."""


def is_fake(bootstrap_addr: str) -> bool:
    return bootstrap_addr.partition(":")[0] == FAKE_BOOTSTRAP_HOST


class _MergedReady:
    """``get_nowait``/``put`` over the readiness queues of several managers."""

    def __init__(self, managers: Callable[[], Sequence[DecodeKVManager]]) -> None:
        self._managers = managers
        self._own: queue.SimpleQueue[int] = queue.SimpleQueue()

    def put(self, room: int) -> None:
        self._own.put(room)

    def get_nowait(self) -> int:
        try:
            return self._own.get_nowait()
        except queue.Empty:
            pass
        for manager in self._managers():
            try:
                return manager.ready.get_nowait()
            except queue.Empty:
                continue
        raise queue.Empty


#: What a waiter of :meth:`DecodeKVRouter.connect_soon` is told: None (connected), or why not.
Outcome = Callable[[PeerUnreachable | None], None]


class _Attempt:
    """One look-up of a prefill server in progress: how many calls wait for it (the one that
    began it included), and the waiters to tell its outcome."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.callers = 1
        self.error: PeerUnreachable | None = None
        self.told: list[Outcome] = []


class LocalPrefillFake(FakeDecodeManager):
    """Decode-side fake: computes the prompt locally instead of receiving its KV."""

    def __init__(self, runner: ModelRunner, metadata: MetadataBuffers,
                 compiler: ConstraintCompiler | None = None,
                 eos_token_id: int | Iterable[int] | None = None) -> None:
        """``compiler`` and ``eos_token_id`` as the prefill side's (grammars; what
        ``min_new_tokens`` excludes from the first token)."""
        super().__init__()
        self._runner = runner
        self._metadata = metadata
        self._sampling = Sampling(runner, compiler, eos_token_ids=token_set(eos_token_id))
        self._lock = threading.Lock()
        self._prompts: dict[int, _Prompt] = {}

    def expect(self, room: int, rid: str, input_ids: Sequence[int],
               sampling: SamplingParams | None = None) -> None:
        """Register the prompt of a fake request, and how its first token is chosen (None:
        greedy), before it is submitted (any thread)."""
        if room == 0:
            raise ValueError("room 0 cannot be read back from a metadata row; choose another")
        with self._lock:
            self._prompts[room] = (rid, tuple(input_ids), sampling or SamplingParams())

    def forget(self, room: int) -> None:
        """Drop the prompt of a finished fake request (any thread)."""
        with self._lock:
            self._prompts.pop(room, None)

    def create_receiver(self, bootstrap_addr: str, room: int) -> _ComputingReceiver:
        with self._lock:
            prompt = self._prompts.get(room)
        if prompt is None:
            raise TransferUsageError(room, "no prompt registered for this fake room")
        return _ComputingReceiver(self, bootstrap_addr, room, prompt)

    def compute(self, receiver: _ComputingReceiver, pages: Sequence[int], slot: int) -> None:
        """Write the KV of the receiver's prompt into ``pages`` and its first token into
        metadata row ``slot``, as the transfer would have; the prompt is forgotten."""
        rid, input_ids, params = receiver.prompt
        batch = ForwardBatch((ForwardItem(rid, input_ids, 0, tuple(pages)),))
        # The decode peer admitted the request under the same rules: nothing is refused here.
        state = self._sampling.prepare(rid, params, receiver.room, input_ids)
        if state is None or not isinstance(self._runner, LogitsRunner):
            self._metadata.write(slot, self._runner.forward(batch)[0], 0, None, receiver.room)
        else:
            forward = LogitsForward(self._runner, [ItemPlan(state.row(0))])
            forward(batch)
            assert forward.results is not None
            sampled = forward.results[0].sampled
            lp = sampled.logprob
            self._metadata.write(slot, sampled.token, 0, None if lp is None else lp.logprob,
                                 receiver.room, () if lp is None else lp.top,
                                 asked=() if lp is None else lp.asked)
        self.forget(receiver.room)


class _ComputingReceiver(FakeKVReceiver):
    """A fake receiver whose ``send_metadata`` writes the KV and the row the transfer would."""

    def __init__(
        self, owner: LocalPrefillFake, bootstrap_addr: str, room: int, prompt: _Prompt,
    ) -> None:
        super().__init__(owner, bootstrap_addr, room)
        self._owner = owner
        self.prompt = prompt

    def send_metadata(self, pages: Sequence[int], slot: int) -> None:
        self._owner.compute(self, pages, slot)
        super().send_metadata(pages, slot)

    def clear(self) -> None:
        self._owner.forget(self.room)
        super().clear()


class DecodeKVRouter:
    """One decode KV manager per prefill bootstrap address, plus the fake one.

    ``factory(addr)`` builds the manager of a prefill server; with ``default`` instead, that one
    manager serves every real request (the in-process local backend); with neither, only fake
    requests are served (the fake backend). ``refusals`` delivers refusals to prefill servers
    when managers come from ``factory``. ``connect_in_place``: a receiver for a prefill without
    a manager yet connects first, on the calling thread (the ranks of a decode TP group other
    than the first, which no HTTP front connects for). ``retire_lost_after_s`` (with
    ``factory``): how long a manager's prefill may count as gone, with no live room, before the
    manager is retired (see the module); None never retires one.
    """

    def __init__(
        self,
        *,
        fake: LocalPrefillFake,
        factory: Callable[[str], DecodeKVManager] | None = None,
        default: DecodeKVManager | None = None,
        refusals: RefusalPoster | None = None,
        connect_in_place: bool = False,
        retire_lost_after_s: float | None = None,
    ) -> None:
        if factory is not None and default is not None:
            raise ValueError("give factory (one manager per peer) or default, not both")
        if retire_lost_after_s is not None and retire_lost_after_s <= 0:
            raise ValueError(f"retire_lost_after_s must be > 0, got {retire_lost_after_s}")
        self.fake = fake
        self._factory = factory
        self._default = default
        self._refusals = refusals
        self._connect_in_place = connect_in_place
        self._lock = threading.Lock()
        self._connecting: dict[str, _Attempt] = {}  # look-ups in progress
        self._managers: dict[str, DecodeKVManager] = {}
        self._snapshot: tuple[DecodeKVManager, ...] = self._all()
        self.ready = _MergedReady(lambda: self._snapshot)
        self._retire_after = retire_lost_after_s if factory is not None else None
        self._stop = threading.Event()
        self._retirer: threading.Thread | None = None
        if self._retire_after is not None:
            self._retirer = threading.Thread(target=self._retire_loop, name="decode-retire",
                                             daemon=True)
            self._retirer.start()

    def _all(self) -> tuple[DecodeKVManager, ...]:
        extra = () if self._default is None else (self._default,)
        return (self.fake, *extra, *self._managers.values())

    def connect(self, bootstrap_addr: str) -> None:
        """Make sure ``bootstrap_addr`` has a manager; blocks while one is created (any thread
        but the engine loop). Raises :class:`PeerUnreachable` if the peer cannot be reached.

        Calls for an address whose manager is being created wait for that one attempt and
        share its outcome (they do not each look the peer up again, one after another); it
        ends by the factory's own timeout (a Mooncake manager's ``connect_timeout_s``)."""
        with self._lock:
            joined = self._join(bootstrap_addr)
        if joined is None:
            return
        attempt, first = joined
        if first:
            self._make(bootstrap_addr, attempt)
            return
        attempt.done.wait()
        if attempt.error is not None:
            raise PeerUnreachable(bootstrap_addr, str(attempt.error))

    def connect_soon(self, bootstrap_addr: str, on_done: Outcome) -> Callable[[], None] | None:
        """:meth:`connect` without blocking: None when there is nothing to wait for (the
        address has a manager, or gets none); else ``on_done`` is called once, on the
        look-up's thread, with None (connected) or the :class:`PeerUnreachable`, and the call
        returned withdraws it (its caller stops waiting; the look-up goes on for the others,
        and a later call finds its manager). The first call for an address starts the one
        thread that looks it up; the others add a waiter to it."""
        with self._lock:
            joined = self._join(bootstrap_addr)
            if joined is None:
                return None
            attempt, first = joined
            attempt.told.append(on_done)
        if first:
            threading.Thread(target=self._make_for_waiters, args=(bootstrap_addr, attempt),
                             name="pdlife-connect", daemon=True).start()

        def withdraw() -> None:
            with self._lock:
                if on_done in attempt.told:  # else the outcome is being told already
                    attempt.told.remove(on_done)
                    attempt.callers -= 1
        return withdraw

    def _join(self, bootstrap_addr: str) -> tuple[_Attempt, bool] | None:
        """The look-up of ``bootstrap_addr`` to wait for, and whether this call begins it (it
        then makes the manager); None when none is needed. Under the lock."""
        if self._factory is None or is_fake(bootstrap_addr) or bootstrap_addr in self._managers:
            return None
        attempt = self._connecting.get(bootstrap_addr)
        if attempt is None:
            self._connecting[bootstrap_addr] = attempt = _Attempt()
            return attempt, True
        attempt.callers += 1
        return attempt, False

    def _make_for_waiters(self, bootstrap_addr: str, attempt: _Attempt) -> None:
        """:meth:`_make` on a look-up's own thread: the outcome goes to the waiters."""
        with contextlib.suppress(PeerUnreachable):
            self._make(bootstrap_addr, attempt)

    def _make(self, bootstrap_addr: str, attempt: _Attempt) -> None:
        """Create the manager of ``bootstrap_addr`` for ``attempt`` and tell its waiters the
        outcome; raises its :class:`PeerUnreachable`."""
        assert self._factory is not None
        try:
            manager = self._factory(bootstrap_addr)
        except Exception as exc:
            attempt.error = PeerUnreachable.of(bootstrap_addr, exc)
            # A look-up that closing cut short is part of shutting down, not a lost peer.
            logger.log(logging.INFO if self._stop.is_set() else logging.WARNING,
                       "cannot connect: %s", attempt.error)
            raise attempt.error from exc
        else:
            with self._lock:
                closed = self._stop.is_set()
                if not closed:
                    self._managers[bootstrap_addr] = manager
                    self._snapshot = self._all()
            if closed:  # the router closed during the look-up: nobody would close it
                self._close(manager)
                attempt.error = PeerUnreachable(bootstrap_addr, "the decode side is closing")
                raise attempt.error
            logger.info("connected to prefill %s", bootstrap_addr)
        finally:
            with self._lock:
                del self._connecting[bootstrap_addr]
                told, attempt.told = attempt.told, []
            attempt.done.set()
            for on_done in told:  # each its own exception: each waiter raises it
                error = attempt.error
                try:
                    on_done(None if error is None else PeerUnreachable(bootstrap_addr,
                                                                       str(error)))
                except Exception:  # the other waiters are still to be told
                    logger.exception("telling a waiter the look-up of %s failed",
                                     bootstrap_addr)

    @property
    def closing(self) -> threading.Event:
        """Set once :meth:`close` is called: a factory's look-up in progress may stop on it."""
        return self._stop

    def connecting(self) -> dict[str, int]:
        """The prefill addresses being looked up now, each with how many calls of
        :meth:`connect` or :meth:`connect_soon` wait for that look-up besides the first."""
        with self._lock:
            return {addr: max(a.callers - 1, 0) for addr, a in sorted(self._connecting.items())}

    def peers(self) -> list[str]:
        with self._lock:
            return sorted(self._managers)

    def lost(self, bootstrap_addr: str) -> bool:
        """Whether the prefill at ``bootstrap_addr`` has a manager and counts as gone."""
        with self._lock:
            m = self._managers.get(bootstrap_addr)
        return isinstance(m, LosesPeer) and m.lost_since is not None

    def refuse_while_lost(self, bootstrap_addr: str, room: int) -> str | None:
        """Why the prefill at ``bootstrap_addr`` counts as gone, or None; when it does, its
        manager refuses ``room`` to it once it answers again and checks it now."""
        with self._lock:
            m = self._managers.get(bootstrap_addr)
        return m.refuse_while_lost(room) if isinstance(m, LosesPeer) else None

    def managers(self) -> tuple[DecodeKVManager, ...]:
        """Every manager requests may be routed to (the fake one first)."""
        return self._snapshot

    def create_receiver(self, bootstrap_addr: str, room: int) -> KVReceiver:
        if is_fake(bootstrap_addr):
            return self.fake.create_receiver(bootstrap_addr, room)
        if self._default is not None:
            return self._default.create_receiver(bootstrap_addr, room)
        if self._connect_in_place:
            self.connect(bootstrap_addr)
        # Under the lock, so that a manager is never retired between its look-up here and
        # the room it gets (a retired manager's queue is no longer read).
        with self._lock:
            manager = self._managers.get(bootstrap_addr)
            if manager is None:
                raise TransferUsageError(
                    room, f"no KV manager for prefill {bootstrap_addr} (never connected, or "
                          "retired after it was lost)")
            return manager.create_receiver(bootstrap_addr, room)

    def retire_lost(self, now: float | None = None) -> list[str]:
        """Retire the managers whose prefill has counted as gone since ``now -
        retire_lost_after_s`` or earlier (``now``: ``time.monotonic()`` by default) and that
        hold no live room: out of the router, then closed (blocks while they close). Returns
        their addresses. The router's thread calls it; a caller may too."""
        if self._retire_after is None:
            return []
        cutoff = (time.monotonic() if now is None else now) - self._retire_after
        with self._lock:
            gone = {addr: m for addr, m in self._managers.items()
                    if isinstance(m, LosesPeer) and (since := m.lost_since) is not None
                    and since <= cutoff and m.live_rooms() == 0}
            for addr in gone:
                del self._managers[addr]
            if gone:
                self._snapshot = self._all()
        for addr, manager in gone.items():
            logger.info("retired the KV manager of prefill %s, gone for %.0f s or more",
                        addr, self._retire_after)
            self._close(manager)
        return sorted(gone)

    def _retire_loop(self) -> None:
        assert self._retire_after is not None
        while not self._stop.wait(min(self._retire_after / 4, 5.0)):
            try:
                self.retire_lost()
            except Exception:  # an error must not end the thread; the next round tries again
                logger.exception("retiring lost prefill managers failed")

    def refuse(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """Tell the prefill at ``bootstrap_addr`` that ``room`` will never be asked for (any
        thread; never blocks)."""
        if is_fake(bootstrap_addr):
            return
        if self._default is not None:
            self._default.refuse(bootstrap_addr, room, reason)
        elif self._refusals is not None:
            self._refusals.tell(bootstrap_addr, room, reason)

    def close(self) -> None:
        self._stop.set()
        if self._retirer is not None:
            self._retirer.join()
        if self._refusals is not None:
            self._refusals.close()
        with self._lock:
            managers = self._all()
            self._managers.clear()
        for manager in managers:
            self._close(manager)

    @staticmethod
    def _close(manager: DecodeKVManager) -> None:
        try:
            manager.close()
        except Exception:  # closing the rest matters more than one failure
            logger.exception("closing a decode KV manager failed")
