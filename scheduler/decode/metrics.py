"""Prometheus metrics of a decode peer (names prefixed ``pdlife_decode_``).

As the prefill scheduler's :class:`~scheduler.prefill.metrics.SchedulerMetrics`: each peer owns
its own registry unless it is given one (``pdlife serve`` gives it the registry ``/metrics``
serves). Counters are fed from the answers the peer gives; the gauges are set once per pass from
counts the peer already keeps.

A request failed because its prefill server refused it while draining (``peer refused:
draining (503): ...``, a planned drain: its client got 503 ``draining``, which a router retries
elsewhere) ends ``bootstrap_failed`` like any other refusal, but is counted under the reason
:data:`PREFILL_DRAINING` instead, so that an alert on failing decode requests can leave a
planned drain out, as the prefill's alert leaves ``bootstrap_failed`` out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from kv.refusal import refused_for_the_client
from lifecycle import FailureReason
from lifecycle.reasons import OUTCOMES
from scheduler.messages import DecodeResponse

#: The ``reason`` label of a request whose prefill server refused it because it is draining
#: (a ``bootstrap_failed`` answer, counted apart: see the module's docstring).
PREFILL_DRAINING = "prefill_draining"


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Gauge(
            "pdlife_decode_requests", "Live decode requests by lifecycle state.", ["state"],
            registry=r,
        )
        self.finished = Counter(
            "pdlife_decode_requests_finished", "Decode requests that ended, by final state "
            "and reason.", ["state", "reason"], registry=r,
        )
        # At 0 before the first (see the prefill's).
        for state, reason in (*OUTCOMES, ("failed", PREFILL_DRAINING)):
            self.finished.labels(state=state, reason=reason)
        self.output_tokens = Counter(
            "pdlife_decode_output_tokens", "Output tokens of finished decode requests.",
            registry=r,
        )
        self.kv_pages_used = Gauge(
            "pdlife_decode_kv_pages_used", "Decode KV pages held.", registry=r
        )
        self.kv_pages_total = Gauge(
            "pdlife_decode_kv_pool_pages", "Decode KV pages in the pool.", registry=r
        )
        self.peer_refusals = Counter(
            "pdlife_decode_peer_refusals", "Rooms this decode side refused or gave up before "
            "asking for their KV, told to the prefill peer (sent), and rooms the prefill peer "
            "refused (received).", ["direction"], registry=r,
        )
        for direction in ("sent", "received"):  # at 0 before the first (see the prefill's)
            self.peer_refusals.labels(direction=direction)

        self.spec_proposed = Counter(
            "pdlife_decode_spec_proposed", "Draft tokens proposed by speculative decoding.",
            registry=r,
        )
        self.spec_accepted = Counter(
            "pdlife_decode_spec_accepted", "Proposed draft tokens the target accepted (over "
            "pdlife_decode_spec_proposed: the acceptance rate).", registry=r,
        )
        self.spec_acceptance_rate = Gauge(
            "pdlife_decode_spec_acceptance_rate", "Accepted over proposed draft tokens since "
            "the peer started (0 before any proposal).", registry=r,
        )

    def on_answer(self, resp: DecodeResponse) -> None:
        """Count one answer (every request gets exactly one)."""
        self.finished.labels(state=resp.state.name.lower(), reason=_reason_label(resp)).inc()
        self.output_tokens.inc(len(resp.output_ids))

    def set_gauges(self, counts: Mapping[enum.IntEnum, int], pages_used: int) -> None:
        for state, n in counts.items():
            self.requests.labels(state=state.name.lower()).set(n)
        self.kv_pages_used.set(pages_used)


def _reason_label(resp: DecodeResponse) -> str:
    """``resp``'s reason as its ``reason`` label: the wire name ("" when done), or
    :data:`PREFILL_DRAINING` for a refusal of a draining prefill."""
    if resp.reason is None:
        return ""
    if (resp.reason is FailureReason.BOOTSTRAP_FAILED
            and refused_for_the_client(resp.detail) == ("draining", 503)):
        return PREFILL_DRAINING
    return resp.reason.value
