"""Load shedding: the bound on queued requests (``--max-queued-requests``, SGLang's flag).

Theory of operation
-------------------
A request is *queued* from the moment the service registers it until an engine gives it KV
pages: on prefill the inbox, BOOTSTRAPPING (the wait for decode's destination counts) and
WAITING; on decode the inbox, BOOTSTRAPPING and PREALLOC. Requests holding pages are bounded
already (``--max-running-requests``, the metadata slots, the KV pool); with this bound every
state has one, so the live requests, and the memory they hold, are bounded too. Beyond it
:meth:`QueueBound.check` raises :class:`Overloaded`: the request is refused before it is
registered, so it leaves nothing behind, and the HTTP answer is 503 with ``Retry-After``.

Engine state is read on the engine thread only; the HTTP side sees the counts the service
publishes after every pass. Between two passes requests may have been given pages (they still
count as queued: the bound errs on refusing) or have finished (the published counts still list
them as running, which would err on admitting). So the bound also counts the requests that ended
since the last publication, and uses

    queued <= live - (running_at_publication - ended_since)

which holds because a request that held pages at the publication still holds them or has ended
since (lifecycles only move forward). A request is admitted only while this upper bound is below
the limit, so the limit holds exactly, whatever the timing. The estimate is exact while nothing
runs (requests waiting for their peer), which is how the tests drive a queue to its bound.

Role ``both`` runs both engines on one request: each side's count of page-holding requests is a
lower bound on the requests that hold pages, and the larger one is used.

A prefill server of DP replicas registers every request, whichever replica runs it; the other
replicas publish their own counts after their passes (:meth:`QueueBound.replica_published`,
sent after the answers of the same pass), and each count is paired with the requests of that
replica that ended since, in the same way.

Every method is called with the service's lock held: :meth:`QueueBound.published` from the
engine thread, :meth:`QueueBound.replica_published` from the replicas' reader,
:meth:`QueueBound.ended` from either, :meth:`QueueBound.check` from HTTP handlers.
"""

from __future__ import annotations

from collections.abc import Mapping

from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.service.config import BadRequest, Unavailable

#: Seconds a refused client is told to wait (``Retry-After``); a queue drains in about that.
RETRY_AFTER_S = 1

#: The lifecycle states, per engine, whose requests hold KV pages (what the bound does not count).
RUNNING_STATES = {
    "prefill": frozenset({"forward", "transferring"}),
    "decode": frozenset({"receiving", "decoding"}),
}


def holding_pages(scheduler: PrefillScheduler) -> int:
    """How many of a prefill scheduler's requests hold KV pages (engine thread)."""
    return sum(n for state, n in scheduler.lifecycle.counts().items()
               if state.name.lower() in RUNNING_STATES["prefill"])


def check_queueable(prompts: int, n: int, limit: int | None) -> None:
    """:class:`BadRequest` when one request's ``prompts`` x ``n`` samples are more than
    ``limit`` (``--max-queued-requests``) queues at once: however long it waited, it would be
    refused. ``n`` beyond the bound on its own is ``bad_sampling`` (each prompt asks for too
    many samples); else a batch too large is ``bad_batch``, which says how many of its prompts
    fit one request."""
    total = prompts * n
    if limit is None or total <= limit:
        return
    bound = f"more than the server queues ({limit}, --max-queued-requests)"
    if n > limit or prompts == 1:
        batch = f" ({total} for a batch of {prompts} prompts)" if prompts > 1 else ""
        raise BadRequest("bad_sampling", f"sampling_params.n={n} asks for {n} requests per "
                         f"prompt{batch}, {bound}")
    each = "" if n == 1 else f" of sampling_params.n={n} samples each"
    raise BadRequest("bad_batch", f"a batch of {prompts} prompts{each} is {total} requests, "
                     f"{bound}: send at most {limit // n} prompts per request")


class Overloaded(BadRequest, Unavailable):
    """The queue is at ``--max-queued-requests``: 503 ``overloaded``, try again later.

    It is a refusal with a reason and a status (routes answer it as they answer a
    :class:`BadRequest`: typed, counted, and told to the request's peer) and an
    :class:`Unavailable` (for callers that only ask whether the server takes requests now).
    """

    def __init__(self, queued: int, limit: int, *, rid: str | None = None) -> None:
        super().__init__(
            "overloaded",
            f"the server is overloaded: {queued} requests queued, the limit is {limit} "
            f"(--max-queued-requests); retry after {RETRY_AFTER_S} s",
            rid=rid, status=503,
        )
        self.retry_after_s = RETRY_AFTER_S


class QueueBound:
    """At most ``limit`` queued requests (None: no bound)."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None, got {limit}")
        self.limit = limit
        self._running = 0
        self._ended = 0
        self._replicas: dict[int, list[int]] = {}  # other DP replica: [running, ended since]

    def published(self, requests: Mapping[str, Mapping[str, int]]) -> None:
        """The engines' live requests per state (``{"prefill": {"forward": 2, ...}, ...}``),
        counted after a pass."""
        self._running = max(
            (sum(n for state, n in states.items() if state in RUNNING_STATES[engine])
             for engine, states in requests.items()),
            default=0,
        )
        self._ended = 0

    def replica_published(self, replica: int, running: int) -> None:
        """Another DP replica's count of requests holding pages, after its last pass."""
        self._replicas[replica] = [running, 0]

    def ended(self, replica: int = 0) -> None:
        """A live request ended (it is no longer registered); ``replica``: the DP replica that
        ran it, 0 for this process's engines."""
        if not replica:
            self._ended += 1
        elif (counts := self._replicas.get(replica)) is not None:
            counts[1] += 1

    def queued(self, live: int) -> int:
        """An upper bound on the queued requests among ``live`` registered ones."""
        elsewhere = sum(max(0, running - ended) for running, ended in self._replicas.values())
        return live - max(0, self._running - self._ended) - elsewhere

    def check(self, live: int, rid: str) -> None:
        """Raise :class:`Overloaded` unless one more request fits the bound."""
        if self.limit is None:
            return
        queued = self.queued(live)
        if queued >= self.limit:
            raise Overloaded(queued, self.limit, rid=rid)
