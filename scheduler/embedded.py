"""The embedded default: a prefill scheduler and its decode peer in one process.

Both sides run the same reference model over their own KV pools. With the ``local`` backend
(the default) the pages are copied from the prefill pool into the decode pool in-process; with
``mooncake`` both sides own a Mooncake Transfer Engine and the pages cross loopback TCP, with
the bootstrap endpoint and the ZeroMQ control plane in between, exactly as between two
processes. With ``PairConfig.hybrid`` both sides also hold a hybrid reference model's SWA pool
and recurrent slots, or a draft model's pool (speculative decoding), and the backend moves them
too (:mod:`scheduler.model.side_pools`). :class:`EmbeddedPair` drives both loops from the
calling thread (:meth:`~EmbeddedPair.run_until_done`), which makes it the harness of the demo,
the benchmarks and the end-to-end tests, and the simplest way to embed pdlife; a service steps
it on an engine thread instead (``EngineLoop([pair], after_pass=...)``, which takes the answers
there: docs/embedding.md, "Serving from one process").

A request id is the pair's from :meth:`EmbeddedPair.submit` until :meth:`~EmbeddedPair.take`
(or :meth:`~EmbeddedPair.run_until_done`) hands its :class:`Outcome` over (the pair then
forgets it, so a long-lived pair does not grow and the id may be used again);
:meth:`EmbeddedPair.close` answers what is still live ``shutdown``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Literal

import attrs
from prometheus_client import CollectorRegistry

from kv.bootstrap import BootstrapServer
from kv.fake import FaultPlan
from kv.local import LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import MooncakeConfig
from kv.pool import KVPool
from kv.pool_layout import DEFAULT_KV_LAYOUT, KVLayout, parse_kv_layout
from kv.state_pools import StatePools
from lifecycle import FailureReason, SamplingParams
from lifecycle.validators import one_of, typed_fields
from scheduler.assemble import Closers, RunnerFactory, build_decode, build_prefill, close_all
from scheduler.decode import DecodeConfig, DecodeMetrics
from scheduler.messages import LOCAL_HOST, DecodeResponse, NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, resolve_device
from scheduler.model.select import ServedModel
from scheduler.model.side_pools import HybridConfig
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import PrefillDelayer
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.runner import ModelRunner
from scheduler.sample.constraint import ConstraintCompiler
from scheduler.sample.request import Detokenize
from scheduler.stepping import step_until

logger = logging.getLogger(__name__)


@attrs.frozen(field_transformer=typed_fields)
class PairConfig:
    model: ModelConfig = attrs.field(factory=ModelConfig)
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    prefill_pages: int = attrs.field(default=2048, validator=attrs.validators.gt(0))
    decode_pages: int = attrs.field(default=2048, validator=attrs.validators.gt(0))
    metadata_slots: int = attrs.field(default=64, validator=attrs.validators.gt(0))
    overlap: bool = False
    device: str = "cpu"
    backend: Literal["local", "mooncake"] = attrs.field(
        default="local", validator=one_of(("local", "mooncake"))
    )
    #: Both pools' layout (docs/backends.md#pool-layouts).
    kv_layout: KVLayout = attrs.field(default=DEFAULT_KV_LAYOUT, converter=parse_kv_layout)
    #: What both sides hold beside the full pool: a hybrid reference model's SWA pool and
    #: recurrent slots (from ``model``'s layers), a draft for speculative decoding
    #: (docs/embedding.md#a-hybrid-or-speculative-pair).
    hybrid: HybridConfig | None = None
    #: Both Mooncake engines' settings (the sender's cut, workers, timeouts, a peer token); only
    #: with ``backend="mooncake"``. None: ``MooncakeConfig()``'s defaults.
    mooncake: MooncakeConfig | None = attrs.field(default=None)

    @mooncake.validator
    def _mooncake_needs_its_backend(self, _attr: object, value: MooncakeConfig | None) -> None:
        if value is not None and self.backend != "mooncake":
            raise ValueError(f"PairConfig.mooncake is for backend='mooncake', not "
                             f"{self.backend!r}")


@attrs.frozen
class Outcome:
    """Both sides' answers for one request (a request that failed on prefill is aborted on
    decode, so both sides always answer)."""

    prefill: Response
    decode: DecodeResponse

    @property
    def answer(self) -> Response | DecodeResponse:
        """The answer the client gets: a side's refusal (``rejected``, 400: the request's own
        fault, which the other side only sees as its peer failing), else the prefill side's
        failure (the decode side's is its consequence; a PD router answers with it too),
        else the decode side's answer."""
        for side in (self.prefill, self.decode):
            if side.reason is FailureReason.REJECTED:
                return side
        return self.prefill if not self.prefill.ok else self.decode


class EmbeddedPair:
    def __init__(
        self,
        config: PairConfig,
        *,
        faults: FaultPlan | None = None,
        delayer: PrefillDelayer | None = None,
        model: LlamaModel | None = None,
        served: ServedModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        compiler: ConstraintCompiler | None = None,
        detokenize: Detokenize | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """``served`` (from :func:`scheduler.model.select.load_model`) runs a real checkpoint or
        the reference model on both sides; without it, ``model`` or ``config.model`` is the
        reference model. ``compiler`` (both sides) and ``detokenize`` (decode) serve grammars
        and stop strings; they default to ``served``'s (its grammar compiler, its tokenizer's
        decode), and without them such requests are refused. ``registry``: both sides' metrics
        go into it (one pair per registry: a second raises ``ValueError``, duplicated
        series); without it each side has a registry of its own."""
        self.config = config
        self.served = served
        if served is not None:
            if compiler is None:
                from scheduler.assemble import constraint_compiler

                compiler = constraint_compiler(served)
            detokenize = detokenize or served.stop_text
        runner_factory: RunnerFactory = PagedModelRunner
        eos: int | tuple[int, ...] = config.model.eos_token_id
        if served is not None:
            self.model = served.model
            runner_factory, eos = served.runner, served.eos_token_ids
        else:
            self.model = model or LlamaModel(config.model, device=resolve_device(config.device))
        self.bootstrap: BootstrapServer | None = None
        self._closers: Closers = []
        hub = LocalTransferHub()
        if config.backend == "local":
            self.bootstrap_host, self.bootstrap_port = LOCAL_HOST, 0
        else:
            self.bootstrap = BootstrapServer(
                token=config.mooncake.token if config.mooncake is not None else None)
            self._closers.append(self.bootstrap.close)
            host, port = self.bootstrap.address.rsplit(":", 1)
            self.bootstrap_host, self.bootstrap_port = host, int(port)
        self.prefill_responses: dict[str, Response] = {}
        self.decode_responses: dict[str, DecodeResponse] = {}
        try:
            self.prefill = build_prefill(
                self.model, backend=config.backend, config=config.scheduler,
                pages=config.prefill_pages, metadata_slots=config.metadata_slots,
                runner_factory=runner_factory, closers=self._closers, hub=hub,
                bootstrap=self.bootstrap, faults=faults, kv_layout=config.kv_layout,
                delayer=delayer, clock=clock, on_response=self._on_prefill,
                overlap=config.overlap, compiler=compiler, hybrid=config.hybrid,
                mooncake=config.mooncake, eos_token_id=eos, metrics=SchedulerMetrics(registry),
            )
            self.decode = build_decode(
                self.model, kv_for=functools.partial(self._decode_kv, hub),
                page_size=config.scheduler.page_size, pages=config.decode_pages,
                metadata_slots=config.metadata_slots, runner_factory=runner_factory,
                closers=self._closers, kv_layout=config.kv_layout, eos_token_id=eos,
                clock=clock, on_response=self._on_decode,
                config=DecodeConfig(check_invariants=config.scheduler.check_invariants),
                compiler=compiler, detokenize=detokenize, hybrid=config.hybrid,
                metrics=DecodeMetrics(registry),
            )
        except BaseException:
            close_all(self._closers)
            raise
        self.prefill_pool = self.prefill.runner.pool
        self.decode_pool = self.decode.pool
        self.prefill_kv = self.prefill.kv
        self.decode_kv = self.decode.kv
        self._rooms = itertools.count(1)
        self._lock = threading.Lock()
        # Ids whose outcome is not yet handed over, and their bootstrap rooms.
        self._submitted: dict[str, int] = {}
        self._rooms_in_use: set[int] = set()
        self._propagated: set[str] = set()
        self._closed = False

    def _on_prefill(self, r: Response) -> None:
        if r.rid in self.prefill_responses:
            raise AssertionError(f"request {r.rid!r} answered twice by prefill")
        self.prefill_responses[r.rid] = r

    def _on_decode(self, r: DecodeResponse) -> None:
        if r.rid in self.decode_responses:
            raise AssertionError(f"request {r.rid!r} answered twice by decode")
        self.decode_responses[r.rid] = r

    def submit(self, rid: str, prompt: Iterable[int], sampling: SamplingParams, *,
               room: int | None = None) -> None:
        """Send one request to both sides, as a PD router does, in a bootstrap room of its
        own (``room``, default the pair's next) (thread-safe). Raises ``ValueError`` while
        ``rid`` or ``room`` is the pair's (submitted, its outcome not yet handed over), for room
        0 (it marks an empty metadata row) or one beyond 2**64 - 1, ``TypeError`` for a value
        of the wrong type (a prompt of text, not token ids; sampling not a
        :class:`~lifecycle.SamplingParams`), and ``RuntimeError`` once the pair is closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"request {rid!r}: this EmbeddedPair is closed")
            if self.interrupted is not None:
                raise RuntimeError(f"request {rid!r}: a pass of this EmbeddedPair was "
                                   f"interrupted by {self.interrupted!r}; it serves no more "
                                   "requests: close it")
            if rid in self._submitted:
                raise ValueError(f"request id {rid!r} is in use: it was submitted and its "
                                 f"outcome not yet handed over (run_until_done or take)")
            in_use = self._rooms_in_use
            if room is None:
                room = next(r for r in self._rooms if r not in in_use)
            elif room == 0:
                raise ValueError(f"request {rid!r}: bootstrap room 0 marks an empty metadata "
                                 "row; give a room >= 1")
            elif room in in_use:
                raise ValueError(f"request {rid!r}: bootstrap room {room} is in use: a request "
                                 "submitted in it has not had its outcome handed over")
            new = NewRequest(  # checks the room's range: refused, nothing is recorded
                rid, prompt, bootstrap_host=self.bootstrap_host,
                bootstrap_port=self.bootstrap_port, bootstrap_room=room, sampling=sampling,
            )
            self._submitted[rid] = room
            in_use.add(room)
        self.prefill.submit(new)
        self.decode.submit(new)

    def abort(self, rid: str) -> None:
        """Abort ``rid`` on both sides (thread-safe; ignored once it is finished)."""
        self.prefill.abort(rid)
        self.decode.abort(rid)

    def step(self) -> bool:
        """One pass of each side; True if either did any work. On the stepping thread."""
        worked = self.prefill.step()
        worked |= self.decode.step()
        return worked

    def run_until_done(self, rids: Iterable[str], timeout: float = 120.0, *,
                       idle: bool = True) -> dict[str, Outcome]:
        """Drive both loops until every request in ``rids`` got both answers (failed on
        prefill, its decode side is aborted, as a PD router does) and, with ``idle``, both
        sides are idle (every page back: other requests run to their end too); then hand their
        outcomes over: the pair forgets them. Raises ``TimeoutError`` after ``timeout`` wall
        seconds naming the requests still unanswered."""
        rids = list(rids)
        with self._lock:
            unknown = [r for r in rids if r not in self._submitted]
        if unknown:
            raise ValueError(f"requests {unknown[:5]} were not submitted to this pair (or their "
                             f"outcomes were handed over already)")
        prefill, decode = self.prefill_responses, self.decode_responses

        def answered() -> bool:
            return all(r in decode and r in prefill for r in rids)

        def unanswered() -> str:
            missing = [r for r in rids if r not in decode or r not in prefill]
            if not missing:
                return f"every request answered, but the pair is not idle after {timeout} s"
            return f"{len(missing)} requests unanswered after {timeout} s: {missing[:5]}"

        step_until(self._propagate_and_step,
                   (lambda: answered() and self.idle()) if idle else answered,
                   timeout, unanswered)
        return self.take(rids)

    def take(self, rids: Iterable[str]) -> dict[str, Outcome]:
        """Hand over the outcomes of those of ``rids`` answered on both sides, without
        stepping (a loop that steps the pair itself); the pair forgets them, so their ids may
        come back. The others are left. On the stepping thread."""
        prefill, decode = self.prefill_responses, self.decode_responses
        rids = list(rids)
        done = [r for r in rids if r in decode and r in prefill]
        with self._lock:
            unknown = [r for r in rids if r not in self._submitted]
            if unknown:
                raise ValueError(f"requests {unknown[:5]} were not submitted to this pair (or "
                                 f"their outcomes were handed over already)")
            for r in done:
                self._rooms_in_use.discard(self._submitted.pop(r))
            self._propagated.difference_update(done)
        return {r: Outcome(prefill.pop(r), decode.pop(r)) for r in done}

    def _propagate_and_step(self) -> bool:
        self._propagate_prefill_failures()
        return self.step()

    def _propagate_prefill_failures(self) -> None:
        # A request that failed on prefill before its KV reached decode would leave decode
        # waiting until its timeout; a PD router aborts it on both sides.
        for rid, r in self.prefill_responses.items():
            if not r.ok and rid not in self._propagated and rid not in self.decode_responses:
                self._propagated.add(rid)
                self.decode.abort(rid, peer=r.refusal())

    def idle(self) -> bool:
        """Both sides idle: nothing live, queued, on the device or held back (every page back
        but the prefix cache's); outcomes not yet taken do not count."""
        return self.prefill.idle() and self.decode.idle()

    def _decode_kv(
        self, hub: LocalTransferHub, pool: KVPool, meta: MetadataBuffers, _runner: ModelRunner,
        states: StatePools | None,
    ) -> LocalDecodeManager | MooncakeDecodeManager:
        if self.bootstrap is None:
            return LocalDecodeManager(pool, meta, hub=hub, states=states)
        return MooncakeDecodeManager(pool, meta, self.bootstrap.address, states=states,
                                     config=self.config.mooncake)

    def close(self, timeout: float = 30.0) -> None:
        """Answer every request still live ``shutdown`` (503) on both sides, step them until
        both sides are idle (at most ``timeout`` seconds), then close the schedulers and the
        transfer engines; a second call does nothing. It steps the pair itself: while another
        thread is in a pass it raises ``RuntimeError`` having changed nothing, and a pass begun
        on another thread while it runs raises. After a pass was interrupted (a signal on the
        stepping thread: ``interrupted``) nothing steps: it closes the engines and names the
        requests left unanswered in a warning."""
        with self._lock:
            if self._closed:
                return
        with self.prefill.holding("close()"), self.decode.holding("close()"):
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                live = [r for r in self._submitted if r not in self.decode_responses]
            try:
                self._finish(live, timeout)
            finally:
                errors = close_all(self._closers)
        if errors:
            raise errors[0]

    @property
    def interrupted(self) -> BaseException | None:
        """What interrupted a pass of either side partway, if anything did (then neither
        steps any more: close the pair)."""
        return self.prefill.interrupted or self.decode.interrupted

    def _finish(self, live: list[str], timeout: float) -> None:
        """Answer ``live`` ``shutdown`` and step until both sides are idle (``close``)."""
        if self.interrupted is not None:
            if live:
                logger.warning("closing the pair without answering %d live requests (%s%s): "
                               "a pass was interrupted by %r", len(live), ", ".join(live[:5]),
                               ", ..." if len(live) > 5 else "", self.interrupted)
            return
        for rid in live:
            self.prefill.abort(rid, shutdown=True)
            self.decode.abort(rid, shutdown=True)
        if live or not self.idle():
            step_until(self.step, self.idle, timeout,
                       lambda: f"the pair is not idle {timeout} s after its requests were "
                               f"answered shutdown")
