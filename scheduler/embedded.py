"""The embedded default: a prefill scheduler and its decode peer in one process.

Both sides run the same reference model over their own KV pools. With the ``local`` backend
(the default) the pages are copied from the prefill pool into the decode pool in-process; with
``mooncake`` both sides own a Mooncake Transfer Engine and the pages cross loopback TCP, with
the bootstrap endpoint and the ZeroMQ control plane in between, exactly as between two
processes. :class:`EmbeddedPair` drives both loops from the calling thread, which makes it the
harness of the demo, the benchmarks and the end-to-end tests, and the simplest way to embed
pdlife.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import attrs

from kv.bootstrap import BootstrapServer
from kv.fake import FakeKVManager, FaultPlan
from kv.local import LocalDecodeManager, LocalKVManager, LocalTransferHub
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from lifecycle import SamplingParams
from scheduler.decode.peer import DecodePeer, DecodeResponse
from scheduler.messages import LOCAL_HOST, NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, resolve_device
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.delayer import PrefillDelayer
from scheduler.prefill.scheduler import PrefillScheduler


def _positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


@attrs.frozen
class PairConfig:
    model: ModelConfig = attrs.field(factory=ModelConfig)
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    prefill_pages: int = attrs.field(default=2048, validator=_positive)
    decode_pages: int = attrs.field(default=2048, validator=_positive)
    metadata_slots: int = attrs.field(default=64, validator=_positive)
    overlap: bool = False
    device: str = "cpu"
    backend: str = attrs.field(
        default="local", validator=attrs.validators.in_(("local", "mooncake"))
    )


@attrs.frozen
class Outcome:
    """Both sides' answers for one request."""

    prefill: Response
    decode: DecodeResponse | None


class EmbeddedPair:
    def __init__(
        self,
        config: PairConfig,
        *,
        faults: FaultPlan | None = None,
        delayer: PrefillDelayer | None = None,
        model: LlamaModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        device = resolve_device(config.device)
        self.model = model or LlamaModel(config.model, device=device)
        ps = config.scheduler.page_size
        self.prefill_pool = self.model.make_pool(num_pages=config.prefill_pages, page_size=ps)
        self.decode_pool = self.model.make_pool(num_pages=config.decode_pages, page_size=ps)
        self.prefill_meta = MetadataBuffers(config.metadata_slots)
        self.decode_meta = MetadataBuffers(config.metadata_slots)
        self.bootstrap: BootstrapServer | None = None
        self.prefill_kv: LocalKVManager | MooncakeKVManager
        self.decode_kv: LocalDecodeManager | MooncakeDecodeManager
        if config.backend == "local":
            hub = LocalTransferHub()
            self.bootstrap_host, self.bootstrap_port = LOCAL_HOST, 0
            self.prefill_kv = LocalKVManager(
                self.prefill_pool, self.prefill_meta, hub=hub, bootstrap_addr=f"{LOCAL_HOST}:0"
            )
            self.decode_kv = LocalDecodeManager(self.decode_pool, self.decode_meta, hub=hub)
        else:
            self.bootstrap = BootstrapServer()
            host, port = self.bootstrap.address.rsplit(":", 1)
            self.bootstrap_host, self.bootstrap_port = host, int(port)
            self.prefill_kv = MooncakeKVManager(self.prefill_pool, self.prefill_meta)
            self.prefill_kv.register_to_bootstrap(self.bootstrap.address)
            self.decode_kv = MooncakeDecodeManager(
                self.decode_pool, self.decode_meta, self.bootstrap.address
            )
        self.prefill_responses: dict[str, Response] = {}
        self.decode_responses: dict[str, DecodeResponse] = {}
        check = config.scheduler.check_invariants
        self.prefill = PrefillScheduler(
            config=config.scheduler,
            runner=PagedModelRunner(self.model, self.prefill_pool),
            kv=self.prefill_kv,
            fake_kv=FakeKVManager(faults, clock=clock),
            metadata=self.prefill_meta,
            slots=SlotAllocator(config.metadata_slots),
            delayer=delayer,
            clock=clock,
            on_response=self._on_prefill,
            overlap=config.overlap,
        )
        self.decode = DecodePeer(
            runner=PagedModelRunner(self.model, self.decode_pool),
            kv=self.decode_kv,
            metadata=self.decode_meta,
            slots=SlotAllocator(config.metadata_slots),
            eos_token_id=config.model.eos_token_id,
            clock=clock,
            on_response=self._on_decode,
            check_invariants=check,
        )
        self._rooms = 0
        self._propagated: set[str] = set()

    def _on_prefill(self, r: Response) -> None:
        if r.rid in self.prefill_responses:
            raise AssertionError(f"request {r.rid!r} answered twice by prefill")
        self.prefill_responses[r.rid] = r

    def _on_decode(self, r: DecodeResponse) -> None:
        if r.rid in self.decode_responses:
            raise AssertionError(f"request {r.rid!r} answered twice by decode")
        self.decode_responses[r.rid] = r

    def submit(self, rid: str, prompt: Iterable[int], sampling: SamplingParams) -> None:
        """Send one request to both sides, as a PD router does."""
        self._rooms += 1
        new = NewRequest(
            rid, tuple(prompt), bootstrap_host=self.bootstrap_host,
            bootstrap_port=self.bootstrap_port, bootstrap_room=self._rooms, sampling=sampling,
        )
        self.prefill.submit(new)
        self.decode.submit(new)

    def abort(self, rid: str) -> None:
        self.prefill.abort(rid)
        self.decode.abort(rid)

    def step(self) -> bool:
        worked = self.prefill.step()
        worked |= self.decode.step()
        return worked

    def run_until_done(self, rids: Iterable[str], timeout: float = 120.0) -> dict[str, Outcome]:
        """Drive both loops until every request in ``rids`` got both answers (or, failed on
        prefill, its decode side was aborted) and both sides are idle."""
        rids = list(rids)
        end = time.monotonic() + timeout
        while True:
            self._propagate_prefill_failures()
            if all(r in self.decode_responses for r in rids) and self.idle():
                break
            if time.monotonic() > end:
                missing = [r for r in rids if r not in self.decode_responses]
                raise TimeoutError(f"{len(missing)} requests unanswered after {timeout} s: "
                                   f"{missing[:5]}")
            if not self.step():
                time.sleep(0.0002)  # idle pass: let the transfer worker run
        return {
            r: Outcome(self.prefill_responses[r], self.decode_responses.get(r)) for r in rids
        }

    def _propagate_prefill_failures(self) -> None:
        # A request that failed on prefill before its KV reached decode would leave decode
        # waiting until its timeout; a PD router aborts it on both sides.
        for rid, r in self.prefill_responses.items():
            if not r.ok and rid not in self._propagated and rid not in self.decode_responses:
                self._propagated.add(rid)
                self.decode.abort(rid)

    def idle(self) -> bool:
        return self.prefill.idle() and self.decode.idle()

    def close(self) -> None:
        self.prefill.close()
        self.decode_kv.close()
        self.prefill_kv.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
