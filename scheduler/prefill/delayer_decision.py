"""The PrefillDelayer's decision: its configuration, its state between passes, and the pure
function ``decide`` of the gathered rows (``scheduler.prefill.delayer`` runs it every pass).

Outcomes (SGLang's semantics; docs/delayer.md has the full table):

* ``all`` replicas prefillable: allow ``token_watermark`` if any replica's KV usage is below the
  low watermark; otherwise delay while the *slot* condition (too few free decode slots for a
  prefill batch) or the *queue* condition (opt-in: the waiting queue is short compared with the
  running batch, until ``max_delay_ms`` has passed since the first delay) holds; the very first
  time a condition holds it is skipped once. Allow ``wait_success`` after a delay, else ``no_wait``.
* ``none`` prefillable: allow, reason ``""`` (nothing to gate).
* ``mixed``: allow ``token_watermark`` as above; delay up to ``max_delay_passes - 1`` passes in a
  row, then allow ``wait_timeout``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import attrs

from lifecycle.validators import typed_fields
from scheduler.dist.gather import GatherShapeError

Mode = Literal["sglang", "bounded"]
Estimation = Literal["all", "none", "mixed"]
Reason = Literal["no_wait", "wait_success", "wait_timeout", "token_watermark", "delay", ""]

# Column indices of a gathered row.
PREFILLABLE, WATERMARK_FORCE_ALLOW, RUNNING_BATCH, MAX_PREFILL_BS, WAITING_QUEUE_LEN = range(5)
WAIT_ELAPSED_US = 5
ROW_WIDTH: dict[Mode, int] = {"sglang": 5, "bounded": 6}


class DelayerConfigError(ValueError):
    """A ``DelayerConfig`` field is out of range; the message names the field and the range."""


class DelayerPassError(RuntimeError):
    """A ``DelayerPass`` was used after ``finalize``; build a new one for every scheduler pass."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise DelayerConfigError(message)


def _validate_passes(_: object, a: attrs.Attribute[int], v: int) -> None:
    _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
           f"{a.name} must be an integer >= 1, got {v!r}")


def _validate_watermark(_: object, a: attrs.Attribute[float | None], v: float | None) -> None:
    _check(v is None or 0.0 <= v <= 1.0, f"{a.name} must be None or in [0, 1], got {v!r}")


def _validate_ratio(_: object, a: attrs.Attribute[float | None], v: float | None) -> None:
    _check(v is None or 0.0 < v <= 1.0, f"{a.name} must be None or in (0, 1], got {v!r}")


def _validate_delay_ms(_: object, a: attrs.Attribute[float], v: float) -> None:
    _check(math.isfinite(v) and v > 0.0, f"{a.name} must be a finite number > 0, got {v!r}")


def _validate_mode(_: object, a: attrs.Attribute[str], v: str) -> None:
    _check(v in ROW_WIDTH, f"{a.name} must be one of {sorted(ROW_WIDTH)}, got {v!r}")


def _delay_ms_or_default(v: float | None) -> float:
    # SGLang treats an unset max_delay_ms as a local 5 s safety cap.
    return 5000.0 if v is None else float(v)


@attrs.frozen(field_transformer=typed_fields)
class DelayerConfig:
    """PrefillDelayer settings (SGLang's ``--prefill-delayer-*`` server arguments).

    ``max_delay_ms`` bounds the queue trigger only; ``None`` means 5000. ``mode="bounded"`` bounds
    every delay path by ``max_delay_passes`` and synchronises the wait clock across ranks.
    """

    max_delay_passes: int = attrs.field(default=30, validator=_validate_passes)
    token_usage_low_watermark: float | None = attrs.field(
        default=None, validator=_validate_watermark)
    queue_min_ratio: float | None = attrs.field(default=None, validator=_validate_ratio)
    max_delay_ms: float = attrs.field(
        default=None, converter=_delay_ms_or_default, validator=_validate_delay_ms)
    mode: Mode = attrs.field(default="sglang", validator=_validate_mode)
    debug_log: bool = False


@attrs.frozen
class DelayerState:
    """The delay in progress: passes delayed so far and when (local clock) the first one was."""

    start_time: float
    delayed_count: int = 0

    def bump(self) -> DelayerState:
        return attrs.evolve(self, delayed_count=self.delayed_count + 1)


@attrs.frozen
class NegotiateOutput:
    """One pass's decision. ``wait_*`` describe the delay that this pass releases (0 otherwise)."""

    next_state: DelayerState | None
    input_estimation: Estimation
    allow: bool
    reason: Reason
    num_prefillable: int
    num_token_watermark_force_allow: int
    wait_forward_passes: int = 0
    wait_seconds: float = 0.0


@attrs.frozen
class _Reading:
    """What the gathered rows say, and the two answers a pass can give from them."""

    estimation: Estimation
    num_prefillable: int
    num_force_allow: int
    prev_state: DelayerState | None
    now: float
    waited: float

    @classmethod
    def of(
        cls, rows: Sequence[Sequence[int]], prev_state: DelayerState | None, now: float,
        config: DelayerConfig,
    ) -> _Reading:
        prefillable = [r[PREFILLABLE] for r in rows]
        estimation: Estimation = (
            "all" if min(prefillable) > 0 else "none" if max(prefillable) == 0 else "mixed"
        )
        if prev_state is None:
            waited = 0.0
        elif config.mode == "bounded":
            waited = min(r[WAIT_ELAPSED_US] for r in rows) / 1e6
        else:
            waited = now - prev_state.start_time
        return cls(estimation, sum(prefillable), sum(r[WATERMARK_FORCE_ALLOW] for r in rows),
                   prev_state, now, waited)

    @property
    def prev_count(self) -> int:
        return self.prev_state.delayed_count if self.prev_state is not None else 0

    def release(self, reason: Reason) -> NegotiateOutput:
        return NegotiateOutput(
            next_state=None, input_estimation=self.estimation, allow=True, reason=reason,
            num_prefillable=self.num_prefillable,
            num_token_watermark_force_allow=self.num_force_allow,
            wait_forward_passes=self.prev_count, wait_seconds=self.waited,
        )

    def delay(self) -> NegotiateOutput:
        state = self.prev_state if self.prev_state is not None else DelayerState(self.now)
        return NegotiateOutput(
            next_state=state.bump(), input_estimation=self.estimation, allow=False,
            reason="delay", num_prefillable=self.num_prefillable,
            num_token_watermark_force_allow=self.num_force_allow,
        )


def _holds_back(
    rows: Sequence[Sequence[int]], reading: _Reading, config: DelayerConfig,
    max_running_requests: int,
) -> bool:
    """The slot condition (too few free decode slots for a prefill batch) or the queue
    condition (a short waiting queue, until ``max_delay_ms`` has passed)."""
    running = max(r[RUNNING_BATCH] for r in rows)
    prefill_bs = max(r[MAX_PREFILL_BS] for r in rows)
    waiting = max(r[WAITING_QUEUE_LEN] for r in rows)
    queue_condition = False
    if config.queue_min_ratio is not None and running > 0:
        queue_min = min(int(running * config.queue_min_ratio), prefill_bs)
        queue_condition = queue_min > 0 and waiting < queue_min
        if (queue_condition and reading.prev_state is not None
                and reading.waited * 1000.0 >= config.max_delay_ms):
            queue_condition = False
    slot_condition = max_running_requests - running < prefill_bs
    return slot_condition or queue_condition


def decide(
    table_rows_of_tp0: Sequence[Sequence[int]],
    prev_state: DelayerState | None,
    now: float,
    config: DelayerConfig,
    *,
    skip_first: bool,
    dp_size: int,
    enable_dp_attention: bool,
    max_running_requests: int,
) -> tuple[NegotiateOutput, bool]:
    """Decide one pass from the attention-TP-rank-0 rows of the gathered table.

    ``table_rows_of_tp0`` is ``[table[dp][0] for dp in range(len(table))]``: with DP attention
    one row per DP replica (``dp_size`` rows); without it the table has a single replica entry,
    so one row, and ``dp_size`` only divides ``max_running_requests`` (each replica's share).
    Returns the output and the new value of the skip-first flag. Pure: the same arguments give
    the same result on every rank. Rows of another count or width raise ``GatherShapeError``.
    """
    rows = table_rows_of_tp0
    width = ROW_WIDTH[config.mode]
    if dp_size < 1:
        raise GatherShapeError(f"decide needs dp_size >= 1, got {dp_size}")
    count = dp_size if enable_dp_attention else 1
    if len(rows) != count or any(len(r) != width for r in rows):
        which = (
            f"one per DP replica (dp_size={dp_size}; its TP rank 0's: table[dp][0], not the "
            f"gathered table)" if enable_dp_attention else
            f"the single replica entry's TP rank 0's (table[0][0], not the gathered table): "
            f"without DP attention the table has one entry whatever dp_size ({dp_size})"
        )
        raise GatherShapeError(
            f"decide needs {count} row{'s' if count > 1 else ''} of width {width} "
            f"(mode {config.mode!r}), {which}, got rows of lengths {[len(r) for r in rows]}"
        )
    reading = _Reading.of(rows, prev_state, now, config)
    if reading.estimation == "none":
        # Nobody can prefill, so the answer does not matter; allowing keeps it simple.
        return reading.release(""), skip_first
    if reading.num_force_allow > 0:
        # Low KV usage somewhere means a device is underused: never hold prefill back then.
        return reading.release("token_watermark"), skip_first
    if reading.estimation == "mixed":
        if reading.prev_count < config.max_delay_passes - 1:
            return reading.delay(), skip_first
        return reading.release("wait_timeout"), skip_first

    if not enable_dp_attention:
        # Without DP attention each replica gets its share of the global request budget.
        max_running_requests = -(-max_running_requests // dp_size)
    if _holds_back(rows, reading, config, max_running_requests):
        if skip_first:
            # The first merge after start-up cannot fill the decode batch anyway; let it through.
            skip_first = False
        elif config.mode == "bounded" and reading.prev_count >= config.max_delay_passes - 1:
            return reading.release("wait_timeout"), skip_first
        else:
            return reading.delay(), skip_first
    return reading.release("wait_success" if prev_state is not None else "no_wait"), skip_first
