"""The one place that wires a side: pool, metadata buffers, KV backend, and the engine on top.

``pdlife serve`` (:mod:`scheduler.service.core`) and the embedded pair
(:mod:`scheduler.embedded`) both build a prefill scheduler and a decode peer from a model, a
backend name and sizes; they differ only in how the decode side finds its prefill (one known
bootstrap address, or a router that connects to whichever prefill a request names), which the
caller passes as ``kv_for``.

Everything built here that holds a thread, a socket or a port is appended to ``closers`` as soon
as it exists, so a caller whose construction fails half-way can release what was built.

What only tunes an engine (its clock, its answer callback, the grammar compiler, ...) passes
through to :class:`~scheduler.prefill.scheduler.PrefillScheduler` or
:class:`~scheduler.decode.DecodePeer` as given (:class:`PrefillOptions`,
:class:`DecodeOptions`), so each default is the engine's own.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, Protocol, Required, TypedDict, Unpack

from kv.bootstrap import BootstrapServer
from kv.fake import FakeKVManager, FaultPlan
from kv.local import LocalKVManager, LocalTransferHub
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.mooncake import MooncakeKVManager
from kv.mooncake_engine import MooncakeConfig
from kv.pool import KVPool
from kv.pool_layout import DEFAULT_KV_LAYOUT, KVLayout
from kv.rank_table import RankPlace
from kv.state_pools import StatePools
from kv.transfer import DecodeKVManager, KVManager
from scheduler.decode import DecodeConfig, DecodeMetrics, DecodePeer
from scheduler.decode.mesh import DecodeMeshControl, MeshDecodePeer
from scheduler.messages import LOCAL_HOST, DecodeResponse, Response
from scheduler.model.drafting import DraftingRunner
from scheduler.model.reference import LlamaModel
from scheduler.model.side_pools import HybridConfig, SideModel, build_side
from scheduler.model.speculative import SpeculativeDecoder
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import PrefillDelayer
from scheduler.prefill.mesh import MeshOptions
from scheduler.prefill.metrics import SchedulerMetrics
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ModelRunner
from scheduler.sample.constraint import ConstraintCompiler
from scheduler.sample.request import Detokenize

if TYPE_CHECKING:
    from scheduler.model.select import ServedModel
    from scheduler.sample.grammar import LLGuidanceCompiler

logger = logging.getLogger(__name__)

Backend = Literal["local", "mooncake", "fake"]
Closers = list[Callable[[], None]]


class PoolModel(Protocol):
    """A model that sizes the KV pool it writes into."""

    def make_pool(self, *, num_pages: int, page_size: int, layout: KVLayout) -> KVPool: ...


#: Builds a side's model runner over its pool (the model is the caller's).
RunnerFactory = Callable[[Any, KVPool], ModelRunner]
#: Builds the decode side's KV manager over its pool and buffers (given the side's runner, and
#: the state pools it must receive into: None but for a hybrid or speculative model).
DecodeKVFactory = Callable[[KVPool, MetadataBuffers, ModelRunner, StatePools | None],
                           DecodeKVManager]


class PrefillOptions(MeshOptions, total=False):
    """What :func:`build_prefill` passes to the prefill scheduler unchanged (with, on a mesh
    rank, its agreements: :class:`~scheduler.prefill.mesh.MeshOptions`). ``eos_token_id`` is
    required, as the decode peer's is (``min_new_tokens`` excludes it from the first token)."""

    eos_token_id: Required[int | Iterable[int] | None]
    delayer: PrefillDelayer | None
    clock: Callable[[], float]
    on_response: Callable[[Response], None] | None
    metrics: SchedulerMetrics | None
    overlap: bool
    compiler: ConstraintCompiler | None


class DecodeOptions(TypedDict, total=False):
    """What :func:`build_decode` passes to the decode peer unchanged. ``eos_token_id`` is
    required, so no caller forgets it (None, said outright, never stops at an end of sequence)."""

    eos_token_id: Required[int | Iterable[int] | None]
    config: DecodeConfig | None
    clock: Callable[[], float]
    on_response: Callable[[DecodeResponse], None] | None
    metrics: DecodeMetrics | None
    compiler: ConstraintCompiler | None
    detokenize: Detokenize | None


def close_all(closers: Closers) -> list[BaseException]:
    """Run ``closers`` newest first, each even if an earlier one raised; returns the errors."""
    errors: list[BaseException] = []
    while closers:
        try:
            closers.pop()()
        except Exception as exc:  # release the rest even if one fails
            errors.append(exc)
    return errors


def constraint_compiler(served: ServedModel) -> LLGuidanceCompiler | None:
    """The grammar compiler over ``served``'s vocabulary, for both sides to share (build it once
    per model: about 0.2 s for a 49k vocabulary), or None where llguidance cannot take the
    checkpoint's tokenizer (no EOS id to end on, a vocabulary it cannot index): the server
    then runs without structured output, says so at WARNING, and refuses requests with a
    grammar. The reference model's byte tokenizer is given to llguidance as its 256 bytes plus
    BOS and EOS as special tokens (byte 255 reads as special too: it never occurs in UTF-8 text,
    which is all a grammar describes)."""
    from scheduler.sample.grammar import SPECIAL_MARK, hf_compiler, vocabulary_compiler

    if not served.is_reference:
        try:
            return hf_compiler(served.tokenizer.tokenizer, eos_token_ids=served.eos_token_ids,
                               vocab_size=served.vocab_size)
        except BaseException as exc:
            # llguidance's Rust core panics on some vocabularies: pyo3's PanicException is a
            # BaseException, which must not take the server down with it.
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            logger.warning("structured output is off for %s: llguidance cannot take its "
                           "tokenizer (%s: %s); requests with a grammar are refused",
                           served.name, type(exc).__name__, exc)
            return None
    from scheduler.model.byte_tokenizer import BOS_TOKEN_ID, VOCAB_SIZE

    eos = served.eos_token_ids[0]
    names = {BOS_TOKEN_ID: b"<s>", eos: b"</s>"}
    tokens = [
        SPECIAL_MARK + names.get(i, b"<unused%d>" % i) if i >= 256 or i == eos else bytes([i])
        for i in range(max(VOCAB_SIZE, eos + 1))
    ]
    return vocabulary_compiler(
        tokens, eos_token_id=eos,
        special_token_ids=[i for i in range(len(tokens)) if i >= 256 or i == eos],
        encode=list, vocab_size=served.vocab_size)


def build_prefill(
    model: PoolModel,
    *,
    backend: Backend,
    config: SchedulerConfig,
    pages: int,
    metadata_slots: int,
    runner_factory: RunnerFactory,
    closers: Closers,
    hub: LocalTransferHub | None = None,
    bootstrap: BootstrapServer | None = None,
    bootstrap_addr: str | None = None,
    place: RankPlace | None = None,
    mooncake: MooncakeConfig | None = None,
    faults: FaultPlan | None = None,
    kv_layout: KVLayout = DEFAULT_KV_LAYOUT,
    hybrid: HybridConfig | None = None,
    **options: Unpack[PrefillOptions],
) -> PrefillScheduler:
    """A prefill scheduler over a fresh pool (in ``kv_layout``) and ``backend``'s KV manager.
    ``local`` needs the ``hub`` its decode peer shares; ``mooncake`` needs the ``bootstrap``
    endpoint its rank registers at (on a mesh rank other than the first, its
    ``bootstrap_addr``; ``place`` is the rank's place in the mesh, default a single rank).
    Requests for the fake bootstrap host always get the fake backend, on the scheduler's
    clock. ``hybrid``: the reference model's pools beside the full pool and its draft
    (:func:`hybrid_side`; the local and Mooncake backends carry them)."""
    pool = model.make_pool(num_pages=pages, page_size=config.page_size, layout=kv_layout)
    side = hybrid_side(model, pool, hybrid)
    states = None if side is None else side.states
    metadata = MetadataBuffers(metadata_slots, speculative_hidden=speculative_hidden(side))
    fake_kv = FakeKVManager(faults, clock=options.get("clock", time.monotonic))
    kv: KVManager
    if backend == "mooncake":
        addr = bootstrap.address if bootstrap is not None else bootstrap_addr
        if addr is None:
            raise ValueError("the mooncake backend needs the bootstrap endpoint to register at")
        mooncake_kv = MooncakeKVManager(pool, metadata, place=place, config=mooncake,
                                        states=states)
        closers.append(mooncake_kv.close)
        mooncake_kv.register_to_bootstrap(addr)
        if bootstrap is not None:
            bootstrap.add_refusal_listener(mooncake_kv.peer_refused)
        kv = mooncake_kv
    elif backend == "local":
        if hub is None:
            raise ValueError("the local backend needs the hub its decode peer shares")
        local_kv = LocalKVManager(pool, metadata, hub=hub, bootstrap_addr=f"{LOCAL_HOST}:0",
                                  states=states)
        closers.append(local_kv.close)
        kv = local_kv
    else:
        kv = fake_kv
    runner: ModelRunner
    if side is None or hybrid is None:
        runner = runner_factory(model, pool)
    elif side.draft is None:
        runner = side.runner
    else:
        runner = DraftingRunner(side.runner, side.draft, hybrid.proposals)
    scheduler = PrefillScheduler(
        config=config, runner=runner, kv=kv, fake_kv=fake_kv,
        metadata=metadata, slots=SlotAllocator(metadata_slots), states=states, **options,
    )
    closers.append(scheduler.close)
    return scheduler


def build_decode(
    model: PoolModel,
    *,
    kv_for: DecodeKVFactory,
    page_size: int,
    pages: int,
    metadata_slots: int,
    runner_factory: RunnerFactory,
    closers: Closers,
    kv_layout: KVLayout = DEFAULT_KV_LAYOUT,
    hybrid: HybridConfig | None = None,
    decode_mesh: DecodeMeshControl | None = None,
    **options: Unpack[DecodeOptions],
) -> DecodePeer:
    """A decode peer over a fresh pool (in ``kv_layout``, the prefill side's); ``kv_for``
    builds its KV manager. ``hybrid``: as :func:`build_prefill`'s (the same on both sides);
    with a draft the peer decodes speculatively. ``decode_mesh``: this rank's place in a decode
    TP group (``model`` its shard), whose ranks decode in lockstep
    (:mod:`scheduler.decode.mesh`)."""
    pool = model.make_pool(num_pages=pages, page_size=page_size, layout=kv_layout)
    side = hybrid_side(model, pool, hybrid)
    metadata = MetadataBuffers(metadata_slots, speculative_hidden=speculative_hidden(side))
    runner: ModelRunner = runner_factory(model, pool) if side is None else side.runner
    states = None if side is None else side.states
    kv = kv_for(pool, metadata, runner, states)
    closers.append(kv.close)
    speculative = None
    if side is not None and side.draft is not None and hybrid is not None:
        speculative = SpeculativeDecoder(side.runner, side.draft, hybrid.proposals)
    peer: Callable[..., DecodePeer] = (
        DecodePeer if decode_mesh is None else functools.partial(MeshDecodePeer, decode_mesh))
    return peer(runner=runner, kv=kv, metadata=metadata, slots=SlotAllocator(metadata_slots),
                states=states, speculative=speculative, **options)


def hybrid_side(model: object, pool: KVPool, hybrid: HybridConfig | None) -> SideModel | None:
    """The reference model's side over ``pool`` for ``hybrid`` (None without it); ValueError
    for another model, and for a hybrid model without it."""
    if hybrid is None:
        if isinstance(model, LlamaModel) and model.config.hybrid:
            c = model.config
            kinds = [f"{what} layers {layers}" for what, layers in (
                ("sliding-window", c.swa_layers), ("recurrent", c.recurrent_layers)) if layers]
            raise ValueError(
                f"the model has {' and '.join(kinds)}: each side needs their pools; give it a "
                "HybridConfig (PairConfig(hybrid=HybridConfig()), or hybrid= when building a "
                "side)")
        return None
    if not isinstance(model, LlamaModel):
        raise ValueError(f"hybrid state and drafts are built for the reference model, not "
                         f"{type(model).__name__}")
    return build_side(model, pool, hybrid)


def speculative_hidden(side: SideModel | None) -> int:
    """The metadata rows' speculative columns: the target's hidden size with a draft, else 0."""
    if side is None or side.draft is None:
        return 0
    return side.runner.model.config.hidden
