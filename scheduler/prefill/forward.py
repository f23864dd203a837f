"""Forward execution: a planned batch becomes pages, a forward on the device, and results.

:func:`prepare` allocates each chunk's pages (a first chunk where the whole prompt fits, later
ones continuing its run) and marks its requests on the device (:mod:`.on_device`); :func:`start`
runs the forward: inline in the normal loop, on a :class:`Device` in the overlap loop.
:meth:`Results.land` takes a launched batch's results and does its KV side — the full pages of
a non-last chunk go to the sender (a partial page waits for the next chunk); a last chunk writes
the metadata row (with a draft model's hand-off: :mod:`.drafting`) and sends the rest with the
request's state (:func:`kv.state_sends.chunk_send` decides both) — and returns what the pass
must fire. With state pools (:mod:`kv.state_pools`) :func:`prepare` takes the SWA pages of
the chunk's pages and, with a request's first pages, its recurrent-state slot. A forward that
raised, or answered other than one token per item, defers an ``internal`` failure on each of its
requests; whatever was deferred settles as the last batch holding a request lands. A
request's own error on landing (its grammar rejects its first token; its speculative hand-off,
or the metadata row with it, raised) fails that request alone, having sent nothing more: the
rest of the batch lands as if it were not there. A device error
(:func:`scheduler.runner.device_lost`) is not a batch's failure: it leaves the pass. A batch
with requests that sample or want logprobs runs a
:class:`~scheduler.sample.batch.LogitsForward` instead of ``runner.forward``
(:mod:`.sampling`); its per-item results are read here, after the forward's result.

The device is injectable. :class:`DeviceWorker`, the default, is one thread (on CUDA it also
launches on its own stream, so the next batch's kernels queue behind the running ones without
blocking the loop). A test can pass a device that runs forwards when it decides
(``scheduler.testing.device.SteppedDevice``): whatever runs the forward, the scheduler only
sees it through :meth:`DeviceJob.result`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import attrs
import torch

from kv.metadata import MetadataBuffers
from kv.pages import pages_needed
from kv.pool import KVPool
from kv.state_pools import StatePools
from kv.state_sends import StateSender, chunk_send, state_tables
from lifecycle import FailureReason, PrefillRequest
from scheduler.malloc_arena import use_one_arena
from scheduler.messages import TokenLogprob
from scheduler.prefill.adder import Plan
from scheduler.prefill.admission import sender_of
from scheduler.prefill.drafting import HandoffRunner
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.prefill.on_device import (
    defer_failure,
    failure_deferred,
    put_on_device,
    take_off_device,
)
from scheduler.prefill.sampling import PrefillSampling
from scheduler.runner import ForwardBatch, ForwardItem, ModelRunner, answer_error, device_lost
from scheduler.sample.batch import LogitsForward

logger = logging.getLogger(__name__)

Forward = Callable[[ForwardBatch], list[int]]


class DeviceJob(Protocol):
    """A forward handed to a device: ``result()`` waits for its tokens (or raises its error)."""

    def result(self) -> list[int]: ...


class Device(Protocol):
    """Where the overlap loop runs forwards while the loop goes on."""

    def submit(self, forward: Forward, batch: ForwardBatch) -> DeviceJob: ...

    def shutdown(self) -> None:
        """Finish what was submitted; run nothing more."""


class DeviceWorker:
    """The production device: one worker thread; on CUDA, launches go to a side stream. On the
    CPU the process keeps to one malloc arena from here on (:mod:`scheduler.malloc_arena`:
    a thread arena of its own would fault the forward's buffers in again on every forward)."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cpu":
            use_one_arena()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pdlife-device")
        self._stream = (
            # torch.cuda.Stream.__new__ has no annotations in torch's own sources.
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )

    def submit(self, forward: Forward, batch: ForwardBatch) -> DeviceJob:
        return self._executor.submit(self._run, forward, batch)

    def _run(self, forward: Forward, batch: ForwardBatch) -> list[int]:
        if self._stream is None:
            return forward(batch)
        with torch.cuda.stream(self._stream):
            return forward(batch)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)


@attrs.frozen
class Launched:
    """A batch whose forward was started: its result is ``job``'s, or ``tokens``/``error``
    when it ran inline. ``sampled`` holds the per-item results of a sampling forward."""

    plan: Plan
    job: DeviceJob | None
    tokens: list[int] | None
    error: BaseException | None = None
    sampled: LogitsForward | None = None

    def outcome(self) -> tuple[list[int] | None, BaseException | None]:
        """Wait for the forward; (tokens, None) or (None, the error it raised)."""
        if self.job is None:
            return self.tokens, self.error
        try:
            return self.job.result(), None
        except Exception as exc:
            if device_lost(exc):
                raise
            return None, exc


def prepare(plan: Plan, pool: KVPool, page_size: int,
            states: StatePools | None = None) -> ForwardBatch:
    """Allocate the plan's pages (and their state in ``states``) and put its requests on the
    device; the batch to run."""
    items: list[ForwardItem] = []
    for chunk in plan.chunks:
        req = chunk.req
        if chunk.new_pages:
            # A first chunk (after its cached prefix, if any) goes where the rest of the prompt
            # fits; later ones continue its run.
            if chunk.start > req.cached:
                pages = pool.allocator.alloc(chunk.new_pages, after=req.pages[-1])
            else:
                whole = pages_needed(len(req.input_ids), page_size) - len(req.pages)
                pages = pool.allocator.alloc(chunk.new_pages, fit=whole)
            if pages is None:  # the adder counted free pages; this cannot happen
                raise AssertionError(f"{req.rid}: {chunk.new_pages} pages planned, not free")
            if states is not None:
                states.grow(pages, after=req.pages[-1] if req.pages else None)
                if not req.pages:
                    req.state_slot = states.take_slot()
            req.pages.extend(pages)
        req.scheduled = chunk.start + chunk.length
        put_on_device(req)
        swa = states.swa if states is not None else None
        items.append(ForwardItem(
            req.rid, req.input_ids[chunk.start : chunk.start + chunk.length], chunk.start,
            tuple(req.pages), swa_pages=() if swa is None else tuple(swa.translate(req.pages)),
            state_slot=-1 if req.state_slot is None else req.state_slot,
        ))
    return ForwardBatch(tuple(items))


def start(plan: Plan, batch: ForwardBatch, runner: ModelRunner, device: Device | None,
          sampled: LogitsForward | None = None) -> Launched:
    """Run the forward of ``batch`` (``sampled`` when given, else ``runner.forward``) on
    ``device``, or inline when there is none."""
    forward = runner.forward if sampled is None else sampled
    if device is not None:
        return Launched(plan, device.submit(forward, batch), None, sampled=sampled)
    try:
        return Launched(plan, None, forward(batch), sampled=sampled)
    except Exception as exc:  # the batch's requests fail; the loop goes on
        if device_lost(exc):
            raise
        return Launched(plan, None, None, exc, sampled)


@attrs.frozen
class Landed:
    """What a landed batch asks of the pass: the edges to fire, the failures to settle."""

    chunk_done: list[PrefillRequest] = attrs.Factory(list)
    prefilled: list[PrefillRequest] = attrs.Factory(list)
    settle: list[PrefillRequest] = attrs.Factory(list)
    # Requests that fail on landing (their grammar rejected their first token, their
    # hand-off raised), with how they fail; their last chunk was not sent.
    rejected: list[tuple[PrefillRequest, FailureReason, str]] = attrs.Factory(list)


@attrs.define(eq=False)
class Results:
    """Does the KV side of a landed batch: page sends, the metadata row, the metrics."""

    _pool: KVPool
    _page_size: int
    _metadata: MetadataBuffers
    _metrics: SchedulerMetrics
    _sampling: PrefillSampling
    _states: StatePools | None = None
    _handoffs: HandoffRunner | None = None
    # The bytes of one metadata row, counted as sent with each last chunk.
    _row_bytes: int = attrs.field(init=False)

    @_row_bytes.default
    def _metadata_row_bytes(self) -> int:
        return sum(b.item_len for b in self._metadata.buffer_infos())

    def land(self, launched: Launched) -> Landed:
        tokens, error = launched.outcome()
        chunks = launched.plan.chunks
        if error is None:
            # An answer of the wrong length fails the batch as a forward that raised would.
            error = answer_error(tokens, len(chunks))
        if error is not None:
            logger.error("forward of a %d-request batch failed: %r", len(chunks), error)
            for chunk in chunks:
                # Its pages are free to reuse once it lands: the forward has ended.
                defer_failure(chunk.req, FailureReason.INTERNAL,
                                f"the model forward failed: {error!r}")
        else:
            self._metrics.batches.inc()
            self._metrics.prefill_tokens.inc(launched.plan.num_tokens)
        out = Landed()
        results = None if launched.sampled is None else launched.sampled.results
        for i, chunk in enumerate(chunks):
            req = chunk.req
            due = take_off_device(req)
            if error is None:
                req.computed = chunk.start + chunk.length
            if failure_deferred(req):
                if due:
                    out.settle.append(req)
                continue
            assert tokens is not None  # a failed forward deferred a failure on every request
            logprob = None
            if results is not None:
                rejected = self._sampling.land(req, chunk.last, results[i])
                if rejected is not None:
                    out.rejected.append((req, *rejected))
                    continue
                logprob = results[i].sampled.logprob
            if chunk.last:
                failed = self._send_last(req, tokens[i], logprob)
                if failed is not None:
                    out.rejected.append((req, *failed))
                    continue
                out.prefilled.append(req)
            else:
                self._send(req, False)
                out.chunk_done.append(req)
        return out

    def _send_last(self, req: PrefillRequest, token: int,
                   logprob: TokenLogprob | None) -> tuple[FailureReason, str] | None:
        """Write the metadata row (with the draft model's hand-off, if any) and send the last
        chunk; how ``req`` fails, its last chunk unsent, when its hand-off or row raised (a
        device error leaves the pass)."""
        assert req.slot is not None
        try:
            handoff = (None if self._handoffs is None
                       else self._handoffs.handoff_row(req.rid, token))
            self._metadata.write(req.slot, token, req.cached,
                                 None if logprob is None else logprob.logprob,
                                 req.bootstrap_room, () if logprob is None else logprob.top,
                                 speculative=handoff,
                                 asked=() if logprob is None else logprob.asked)
        except Exception as exc:
            if device_lost(exc):
                raise
            logger.error("request %r: the speculative hand-off or metadata row failed: %r",
                         req.rid, exc)
            return (FailureReason.INTERNAL,
                    f"the speculative hand-off or metadata row failed: {exc!r}")
        req.first_token = token
        self._send(req, True)
        self._metrics.transfer_bytes.inc(self._row_bytes)
        return None

    def _send(self, req: PrefillRequest, last: bool) -> None:
        """Hand the sender what this chunk sends (only full pages unless ``last``: a partial
        page waits for the next chunk; the state on the last)."""
        send = chunk_send(
            req.pages, length=len(req.input_ids), sent=req.sent, computed=req.computed,
            last=last, page_size=self._page_size,
            tables=state_tables(self._states, req.pages, req.state_slot, last),
        )
        if not send.goes:
            return
        sender = sender_of(req)
        assert sender is not None
        if send.state and isinstance(sender, StateSender):
            sender.send_state(send.state)
        sender.send(list(send.pages), last)
        self._metrics.transfer_bytes.inc(self._bytes(len(send.pages)))
        req.sent = send.sent

    def _bytes(self, num_pages: int) -> int:
        return self._pool.bytes_of_pages(num_pages)
