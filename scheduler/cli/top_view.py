"""What ``pdlife top`` shows of a worker, computed from what it scraped (no I/O here).

Theory of operation
-------------------
Every refresh scrapes each worker's ``/server_info`` (JSON) and ``/metrics`` (Prometheus text)
into a :class:`Scrape`. A worker's :class:`History` keeps its scrapes of the last minute and
turns the newest into a :class:`WorkerView`:

- requests per state, pool usage (prefix-cache pages nobody locks count as free; the cache's
  size is shown beside, with its hit rate since the worker started) and health come from the
  newest ``/server_info`` (the hit rate from ``/metrics``: hit prompt tokens over looked-up
  ones);
- rates (admissions, completions, transfer bytes per second) are differences of counters
  between the two newest scrapes; a request was admitted when it is live or finished, so
  admissions are the growth of ``finished + live``;
- TTFT p50/p99 over the last minute are quantiles of the growth of ``pdlife_ttft_seconds``'s
  buckets since the oldest scrape of that minute, interpolated within a bucket as Prometheus'
  ``histogram_quantile`` does;
- failures and refusals by reason are totals since the worker started.

Counters are read from the side that answers the worker's requests: the prefill scheduler's on
a prefill worker, the decode peer's on a decode worker and on ``--backend local``.

A prefill of several DP replicas (``pdlife serve --dp-size``) labels each replica's series
``dp_rank`` on ``/metrics`` and gives ``/server_info``'s ``requests`` and ``kv_pool`` as
``prefill``, the sums over its replicas, beside ``prefill/dp<rank>``, each replica's
(docs/operations.md, "DP replicas"). Every figure of the view is the whole server's: counters
and histograms are summed over ``dp_rank``, the hit rate is the summed hit tokens over the
summed looked-up ones, metadata slots are counted against ``metadata_slots`` (a replica's
number) times the replicas that report theirs, and requests and pools are ``prefill``'s. The
``prefill/dp<rank>`` entries, with each replica's slots and whether it answered the scrape
(``pdlife_dp_replica_up``, ``pdlife_dp_replica_metrics_age_seconds``), make one
:class:`ReplicaView` each, never a side of their own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from prometheus_client.parser import text_string_to_metric_families

#: How far back the TTFT quantiles look, in seconds.
WINDOW_S = 60.0

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

# The series of each side: live requests by state, finished requests by state and reason.
_LIVE = {"prefill": "pdlife_requests", "decode": "pdlife_decode_requests"}
_FINISHED = {"prefill": "pdlife_requests_finished_total",
             "decode": "pdlife_decode_requests_finished_total"}
_SENT = "pdlife_transfer_bytes_total"  # prefill workers (and local) only
_SLOTS = "pdlife_metadata_slots_used"
_HITS, _LOOKED_UP = "pdlife_prefix_cache_hit_tokens_total", "pdlife_prefix_cache_query_tokens_total"
# A DP replica's label on /metrics, and the prefix of its /server_info entries.
_DP_RANK, _REPLICA_KEY = "dp_rank", "prefill/dp"


def parse_metrics(text: str) -> Samples:
    """Prometheus text as ``{(sample name, sorted labels): value}``."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return samples


def total(samples: Samples, name: str, **match: str) -> float:
    """The sum of the ``name`` samples whose labels include ``match``."""
    want = set(match.items())
    return sum(v for (n, labels), v in samples.items() if n == name and want <= set(labels))


def by_label(samples: Samples, name: str, label: str, **match: str) -> dict[str, float]:
    """The ``name`` samples that match, summed per value of ``label``."""
    want = set(match.items())
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name and want <= set(labels):
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of a histogram given as cumulative counts per upper bound (``le``),
    interpolated linearly within its bucket; ``None`` without observations. A quantile in the
    ``+Inf`` bucket is the largest finite bound."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def histogram(samples: Samples, name: str) -> dict[float, float]:
    """The cumulative bucket counts of histogram ``name`` (all label sets summed), by ``le``."""
    return {float(le): v for le, v in by_label(samples, f"{name}_bucket", "le").items()}


@attrs.frozen
class Scrape:
    """One refresh of one worker: when (monotonic seconds), its ``/server_info``, its
    ``/metrics``."""

    time: float
    info: Mapping[str, Any]
    samples: Samples


@attrs.frozen
class ReplicaView:
    """One DP replica of a prefill worker; ``live``, ``kv_pool`` and ``slots`` are ``None``
    while it has given no figures."""

    rank: int
    live: int | None = None  # live requests, every state
    kv_pool: tuple[int, int] | None = None  # (used, total) pages
    slots: tuple[int, int] | None = None  # metadata slots (used, total)
    # Whether it answered this scrape (else its figures are an earlier answer's), and how old
    # its figures are in seconds (``None`` when /metrics did not say).
    answered: bool = True
    age_s: float | None = None


@attrs.frozen
class WorkerView:
    """One worker as ``pdlife top`` shows it; ``error`` says why it could not be read, and
    then the rest is empty. Rates and quantiles are ``None`` until two scrapes exist."""

    url: str
    error: str | None = None
    role: str = ""
    # ``TP t x PP p x DP d`` for a worker of several rank processes ("" for one); its figures
    # are the whole server's.
    layout: str = ""
    healthy: bool = False
    draining: bool = False
    requests: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)
    admissions_per_s: float | None = None
    completions_per_s: float | None = None
    failures: Mapping[str, int] = attrs.field(factory=dict)
    # Requests the HTTP service refused before an engine took them, by reason (a prefill
    # server a decode could not look up, ``bootstrap_failed``, among them).
    refusals: Mapping[str, int] = attrs.field(factory=dict)
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    kv_pool: Mapping[str, tuple[int, int]] = attrs.field(factory=dict)  # side: (used, total)
    prefix_cache_pages: Mapping[str, int] = attrs.field(factory=dict)  # sides with a cache
    prefix_hit_rate: float | None = None  # hit prompt tokens over looked-up ones, since start
    slots: tuple[int, int] | None = None  # prefill metadata slots (used, total)
    transfer_bytes_per_s: float | None = None
    replicas: tuple[ReplicaView, ...] = ()  # a prefill of several DP replicas: each of them


class History:
    """The scrapes of one worker over the last :data:`WINDOW_S` seconds."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._scrapes: deque[Scrape] = deque()

    def add(self, scrape: Scrape) -> WorkerView:
        """Record ``scrape`` and return the worker's view as of it."""
        self._scrapes.append(scrape)
        # Keep the newest scrape older than the window too: the window's baseline.
        while len(self._scrapes) > 2 and self._scrapes[1].time <= scrape.time - WINDOW_S:
            self._scrapes.popleft()
        return self._view()

    def unreachable(self, error: str) -> WorkerView:
        return WorkerView(url=self.url, error=error)

    def _view(self) -> WorkerView:
        new = self._scrapes[-1]
        info, now = new.info, new.samples
        side = "prefill" if info.get("role") == "prefill" else "decode"
        failed = by_label(now, _FINISHED[side], "reason", state="failed")
        pools = _sides(info.get("kv_pool", {}))
        view = WorkerView(
            url=self.url,
            role=str(info.get("role", "?")),
            layout=_layout(info),
            healthy=bool(info.get("healthy")),
            draining=bool(info.get("draining")),
            requests=_sides(info.get("requests", {})),
            failures={reason or "?": int(n) for reason, n in sorted(failed.items()) if n},
            refusals={reason: int(n) for reason, n in sorted(by_label(
                now, "pdlife_http_rejected_total", "reason").items()) if n},
            kv_pool={s: (p["used_pages"], p["total_pages"]) for s, p in pools.items()},
            prefix_cache_pages={s: p["prefix_cache_pages"] for s, p in pools.items()
                                if "prefix_cache_pages" in p},
            slots=_slots(info, now),
            prefix_hit_rate=(_hit_rate(now)
                             if "prefill" in pools and "prefix_cache_pages" in pools["prefill"]
                             else None),
            replicas=_replicas(info, now),
        )
        if len(self._scrapes) < 2:
            return view
        old = self._scrapes[-2]
        dt = new.time - old.time
        if dt <= 0:
            return view
        window = _growth(histogram(now, "pdlife_ttft_seconds"),
                         histogram(self._scrapes[0].samples, "pdlife_ttft_seconds"))

        def rate(read: Callable[[Samples], float]) -> float:
            return max(read(new.samples) - read(old.samples), 0.0) / dt

        return attrs.evolve(
            view,
            admissions_per_s=rate(lambda s: total(s, _FINISHED[side]) + total(s, _LIVE[side])),
            completions_per_s=rate(lambda s: total(s, _FINISHED[side], state="done")),
            ttft_p50=quantile(0.5, window),
            ttft_p99=quantile(0.99, window),
            transfer_bytes_per_s=(rate(lambda s: total(s, _SENT))
                                  if any(name == _SENT for name, _ in now) else None),
        )


def _growth(now: Mapping[float, float], before: Mapping[float, float]) -> dict[float, float]:
    """Bucket counts added since ``before`` (all of ``now`` if the worker restarted since)."""
    if any(now.get(le, 0.0) < v for le, v in before.items()):
        return dict(now)
    return {le: v - before.get(le, 0.0) for le, v in now.items()}


def _layout(info: Mapping[str, Any]) -> str:
    sizes = [int(info.get(f"{k}_size", 1)) for k in ("tp", "pp", "dp")]
    if sizes == [1, 1, 1]:
        return ""
    tp, pp, dp = sizes
    return f"TP {tp} x PP {pp} x DP {dp}" + (", whole-server figures" if dp > 1 else "")


def _sides(by_key: Mapping[str, Any]) -> dict[str, Any]:
    """``/server_info``'s ``requests`` or ``kv_pool`` without a DP server's per-replica
    entries (``prefill/dp<rank>``), which ``prefill`` already sums."""
    return {key: value for key, value in by_key.items() if not key.startswith(_REPLICA_KEY)}


def _hit_rate(samples: Samples) -> float | None:
    """Prompt tokens found in the prefix cache over those looked up, since the start: what
    ``pdlife_prefix_cache_hit_rate`` says of one replica, of a DP server's replicas together;
    ``None`` when ``/metrics`` has no such counters."""
    if not any(name == _LOOKED_UP for name, _ in samples):
        return None
    looked_up = total(samples, _LOOKED_UP)
    return total(samples, _HITS) / looked_up if looked_up else 0.0


def _slots(info: Mapping[str, Any], samples: Samples) -> tuple[int, int] | None:
    """Metadata slots (used, total) of the replicas whose ``pdlife_metadata_slots_used``
    ``/metrics`` has, ``metadata_slots`` (a replica's) each; one replica when it has none."""
    if "prefill" not in info.get("requests", {}) or "metadata_slots" not in info:
        return None
    replicas = len(by_label(samples, _SLOTS, _DP_RANK)) or 1
    return int(total(samples, _SLOTS)), replicas * int(info["metadata_slots"])


def _replicas(info: Mapping[str, Any], samples: Samples) -> tuple[ReplicaView, ...]:
    """Each DP replica of a prefill worker of several (none otherwise): those ``/server_info``
    lists under ``prefill/dp<rank>`` and those ``/metrics`` says answered or not."""
    requests, pools = info.get("requests", {}), info.get("kv_pool", {})

    def by_replica(name: str) -> dict[int, float]:
        return {int(r): v for r, v in by_label(samples, name, _DP_RANK).items() if r}

    up, ages = by_replica("pdlife_dp_replica_up"), by_replica(
        "pdlife_dp_replica_metrics_age_seconds")
    slots = by_replica(_SLOTS)
    listed = {int(key.removeprefix(_REPLICA_KEY)) for key in requests
              if key.startswith(_REPLICA_KEY)}
    per_replica = int(info.get("metadata_slots", 0))
    views = []
    for rank in sorted(listed | set(up)):
        key = f"{_REPLICA_KEY}{rank}"
        pool = pools.get(key)
        views.append(ReplicaView(
            rank=rank,
            live=sum(requests[key].values()) if key in requests else None,
            kv_pool=None if pool is None else (pool["used_pages"], pool["total_pages"]),
            slots=(int(slots[rank]), per_replica) if rank in slots else None,
            answered=up.get(rank, 1.0) == 1.0,
            age_s=ages.get(rank),
        ))
    return tuple(views)
