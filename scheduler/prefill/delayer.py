"""The PrefillDelayer: a cross-rank gate that holds prefill back so ranks prefill together.

Theory of operation
-------------------
With data-parallel attention, a prefill on one DP replica stalls decoding on every replica (they
run forward passes in lock step), so a prefill that only some replicas are ready for wastes the
others' pass, and a prefill squeezed into a nearly full decode batch fragments the decode batch.
The delayer gates prefill so that it happens when it pays.

Once per scheduler pass every rank contributes a row ``[prefillable, watermark_force_allow,
running_batch, max_prefill_bs, waiting_queue_len]`` (plus ``wait_elapsed_us`` in bounded mode) to
an all-gather (``dist.gather``). The decision reads only the attention-TP-rank-0 row of each
DP replica, so every TP rank of a replica follows its rank 0, and is the pure function ``decide``
of those rows, the previous ``DelayerState`` and a clock reading. Every rank therefore reaches the
same outcome on the same pass, provided every rank negotiates exactly once per pass: that is what
``DelayerPass`` guarantees (``finalize`` negotiates with ``prefillable=False`` if nothing asked).

The decision, its configuration and its state are in ``delayer_decision`` (re-exported here).

Mode ``"sglang"`` reproduces SGLang exactly, including two hazards: the slot condition can delay
forever, and the queue trigger's deadline is read from each rank's own clock, so ranks whose clocks
drift apart can release on different passes. Mode ``"bounded"`` (opt-in) bounds every delay path by
``max_delay_passes`` (then ``wait_timeout``) and carries each rank's elapsed wait in its row, the
decision using the MIN over the gathered rows, so all ranks cross the deadline on the same pass.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter

from scheduler.dist.gather import GatherShapeError, RowGather, Table
from scheduler.prefill.delayer_decision import (
    ROW_WIDTH,
    DelayerConfig,
    DelayerConfigError,
    DelayerPassError,
    DelayerState,
    NegotiateOutput,
    decide,
)

__all__ = [
    "ROW_WIDTH",
    "DelayerConfig",
    "DelayerConfigError",
    "DelayerMetrics",
    "DelayerPass",
    "DelayerPassError",
    "DelayerState",
    "NegotiateOutput",
    "PrefillDelayer",
    "decide",
]

logger = logging.getLogger(__name__)


def _forward_passes_buckets(max_delay_passes: int) -> list[float]:
    wanted = {0, max_delay_passes - 1, *(b for b in (5, 20, 50, 100, 200) if b < max_delay_passes)}
    return [float(b) for b in sorted(wanted)]


WAIT_SECONDS_BUCKETS = [0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]


class DelayerMetrics:
    """The delayer's Prometheus metrics, registered on ``registry``.

    Buckets default to SGLang's: forward passes ``{0, 5, 20, 50, 100, 200} < max_delay_passes``
    plus ``max_delay_passes - 1``; seconds ``0, 1, 2, 5, ..., 500``. ``max_delay_passes`` is
    the delayer's (an integer >= 1, as in ``DelayerConfig``).

    The wait histograms observe one value per pass that allowed prefill and ran a batch: the
    delay that pass ended, 0 when there was none (as on a pass that only continued a chunked
    prefill while no replica offered a new request), so their ``_count`` is not a count of
    prefills.
    """

    def __init__(
        self, registry: CollectorRegistry, max_delay_passes: int,
        forward_passes_buckets: Sequence[float] | None = None,
        wait_seconds_buckets: Sequence[float] | None = None,
    ) -> None:
        if not isinstance(max_delay_passes, int) or isinstance(max_delay_passes, bool):
            raise TypeError(f"max_delay_passes must be an integer, got {max_delay_passes!r}")
        if max_delay_passes < 1:
            raise DelayerConfigError(
                f"max_delay_passes must be an integer >= 1 (the delayer's, as in "
                f"DelayerConfig), got {max_delay_passes}"
            )
        self.wait_forward_passes = Histogram(
            "pdlife_prefill_delayer_wait_forward_passes",
            "Passes of delay ended by a pass that allowed prefill and ran a batch (0 when none "
            "was held back, as on a pass that only continued a chunked prefill).",
            buckets=list(forward_passes_buckets or _forward_passes_buckets(max_delay_passes)),
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "pdlife_prefill_delayer_wait_seconds",
            "Seconds of delay ended by a pass that allowed prefill and ran a batch (0 when "
            "none was held back, as on a pass that only continued a chunked prefill).",
            buckets=list(wait_seconds_buckets or WAIT_SECONDS_BUCKETS),
            registry=registry,
        )
        self.outcomes = PromCounter(
            "pdlife_prefill_delayer_outcomes",
            "PrefillDelayer decisions, one per scheduler pass.",
            ["input_estimation", "output_allow", "output_reason", "actual_execution"],
            registry=registry,
        )

    def observe(self, output: NegotiateOutput, actual_execution: bool) -> None:
        # Only a wait that ended in a prefill that really ran is a wait worth measuring.
        if output.allow and actual_execution:
            self.wait_forward_passes.observe(output.wait_forward_passes)
            self.wait_seconds.observe(output.wait_seconds)
        self.outcomes.labels(
            input_estimation=output.input_estimation,
            output_allow=str(output.allow).lower(),
            output_reason=output.reason,
            actual_execution=str(actual_execution).lower(),
        ).inc()


class PrefillDelayer:
    """The stateful delayer of one rank: keeps the state between passes and runs the gather.

    ``dp_size`` is the number of DP replicas. With DP attention the gathered table has
    ``dp_size`` entries, one per replica; without it the table has a single entry (this
    replica's ranks: give its gather ``dp_size=1``) and ``dp_size`` only divides
    ``max_running_requests`` into each replica's share. Each entry holds ``attn_tp_size`` rows.
    ``outcomes`` counts recorded passes by reason, with ``"none"`` for the empty reason (no
    replica had anything to prefill).
    """

    def __init__(
        self, config: DelayerConfig, gather: RowGather, dp_size: int, attn_tp_size: int,
        enable_dp_attention: bool, clock: Callable[[], float] = time.perf_counter,
        metrics: DelayerMetrics | None = None,
    ) -> None:
        if not isinstance(config, DelayerConfig):
            raise TypeError(
                f"config must be a DelayerConfig, got {type(config).__name__} {config!r}: "
                f"build one, e.g. DelayerConfig(max_delay_passes=30)"
            )
        if dp_size < 1 or attn_tp_size < 1:
            raise DelayerConfigError(
                f"dp_size and attn_tp_size must be >= 1, got {dp_size} and {attn_tp_size}"
            )
        self.config = config
        self.dp_size = dp_size
        self.attn_tp_size = attn_tp_size
        self.enable_dp_attention = enable_dp_attention
        self.state: DelayerState | None = None
        self.skip_first = True
        self.outcomes: Counter[str] = Counter()
        self._gather = gather
        self._clock = clock
        self._metrics = metrics
        self._table_dp = dp_size if enable_dp_attention else 1
        logger.info("PrefillDelayer: %s dp_size=%d attn_tp_size=%d enable_dp_attention=%s",
                    config, dp_size, attn_tp_size, enable_dp_attention)

    def local_row(
        self, local_prefillable: bool, token_usage: float, running_batch: int = 0,
        max_prefill_bs: int = 0, waiting_queue_len: int = 0, *, now: float,
    ) -> list[int]:
        """This rank's row for the gather (first half of ``negotiate``), built at ``now`` on
        this rank's clock (bounded mode reads its elapsed wait from it). The slot condition's
        ``max_running_requests`` is not in the row: ``decide_table`` takes it."""
        watermark = self.config.token_usage_low_watermark
        force_allow = local_prefillable and watermark is not None and token_usage < watermark
        row = [int(local_prefillable), int(force_allow), running_batch, max_prefill_bs,
               waiting_queue_len]
        if self.config.mode == "bounded":
            elapsed = 0.0 if self.state is None else now - self.state.start_time
            row.append(max(0, int(elapsed * 1e6)))
        return row

    def decide_table(
        self, table: Table, max_running_requests: int, *, now: float,
    ) -> NegotiateOutput:
        """Decide from a gathered ``table[dp][tp]`` at ``now`` (this rank's clock) and advance
        the state (second half of ``negotiate``). ``GatherShapeError`` unless the table has
        ``dp_size`` entries with DP attention (one without) of ``attn_tp_size`` rows each."""
        if len(table) != self._table_dp or any(len(r) != self.attn_tp_size for r in table):
            raise GatherShapeError(
                f"expected a [{self._table_dp}][{self.attn_tp_size}] table, got "
                f"[{len(table)}]{[len(r) for r in table]}; check the gather's group"
            )
        out, self.skip_first = decide(
            [replica[0] for replica in table], self.state, now, self.config,
            skip_first=self.skip_first, dp_size=self.dp_size,
            enable_dp_attention=self.enable_dp_attention,
            max_running_requests=max_running_requests,
        )
        self.state = out.next_state
        return out

    def negotiate(
        self, local_prefillable: bool, token_usage: float, running_batch: int = 0,
        max_prefill_bs: int = 0, max_running_requests: int = 0, waiting_queue_len: int = 0,
    ) -> NegotiateOutput:
        """Run one collective negotiation. Every rank must call this once per pass.

        A caller that passes ``running_batch`` or ``max_prefill_bs`` must pass its
        ``max_running_requests`` too: the default 0 (SGLang's) makes the slot condition
        ``0 - running_batch < max_prefill_bs`` hold whenever either is positive."""
        row = self.local_row(local_prefillable, token_usage, running_batch, max_prefill_bs,
                             waiting_queue_len, now=self._clock())
        table = self._gather.gather(row)
        # Read the clock after the gather: waiting for slower ranks is part of the wait.
        return self.decide_table(table, max_running_requests, now=self._clock())

    def peers_busy(self) -> bool:
        """Whether the last gather said another rank still has work (:meth:`RowGather.peers_busy`:
        only :class:`~scheduler.prefill.replica_delayer.ReplicaGather` says yes); a scheduler
        that must keep the others in lockstep is then not idle."""
        return self._gather.peers_busy()

    def record(self, output: NegotiateOutput, actual_execution: bool) -> None:
        """Count one pass's outcome and feed the metrics (``DelayerPass.finalize`` calls this)."""
        self.outcomes[output.reason or "none"] += 1
        if self._metrics is not None:
            self._metrics.observe(output, actual_execution)
        if self.config.debug_log and output.reason in ("wait_timeout", "token_watermark"):
            logger.info(
                "PrefillDelayer allowed prefill (%s): num_prefillable=%d "
                "num_token_watermark_force_allow=%d waited=%d passes %.3f s actual_execution=%s",
                output.reason, output.num_prefillable, output.num_token_watermark_force_allow,
                output.wait_forward_passes, output.wait_seconds, actual_execution,
            )


class DelayerPass:
    """One scheduler pass's use of the delayer: at most one negotiation, always exactly one.

    ``allow`` negotiates on its first call and returns the cached answer afterwards, whatever the
    arguments. ``finalize`` negotiates with ``local_prefillable=False`` if nothing asked (so the
    collective stays aligned across ranks), then records the outcome once.
    """

    def __init__(self, delayer: PrefillDelayer, token_usage: float) -> None:
        self._delayer = delayer
        self._token_usage = token_usage
        self._result: NegotiateOutput | None = None
        self._finalized = False

    @property
    def result(self) -> NegotiateOutput | None:
        return self._result

    def allow(
        self, local_prefillable: bool, running_batch: int = 0, max_prefill_bs: int = 0,
        max_running_requests: int = 0, waiting_queue_len: int = 0,
    ) -> bool:
        if self._finalized:
            raise DelayerPassError("DelayerPass.allow after finalize; use a new DelayerPass")
        if self._result is None:
            self._result = self._delayer.negotiate(
                local_prefillable, self._token_usage, running_batch, max_prefill_bs,
                max_running_requests, waiting_queue_len,
            )
        return self._result.allow

    def finalize(self, actual_prefill: bool) -> NegotiateOutput:
        if self._finalized:
            raise DelayerPassError("DelayerPass.finalize called twice; use a new DelayerPass")
        if self._result is None:
            self._result = self._delayer.negotiate(False, self._token_usage)
        self._finalized = True
        self._delayer.record(self._result, actual_prefill)
        return self._result
