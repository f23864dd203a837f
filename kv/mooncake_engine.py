"""The Mooncake Transfer Engine as both sides of the Mooncake backend use it.

One ``TransferEngine`` per side, initialised with the ``P2PHANDSHAKE`` metadata mode (no
metadata server: peers exchange segment descriptors directly), TCP here and RDMA where the
hardware has it; the KV pool tensor and the metadata buffers are registered whole.
"""

from __future__ import annotations

from typing import Any

import attrs
import zmq

from kv.metadata import MetadataBuffers
from kv.pool import KVPool
from kv.transfer import KVPoll

TERMINAL = (KVPoll.SUCCESS, KVPoll.FAILED)


class MooncakeError(Exception):
    """The transfer engine could not start, register memory, or reach its peer's setup."""


class IncompatiblePeerError(MooncakeError):
    """The prefill server's page size or KV dtype differs from the decode pool's."""


@attrs.frozen
class MooncakeConfig:
    """Engine and control-plane settings of one side."""

    hostname: str = "127.0.0.1"
    protocol: str = attrs.field(default="tcp", validator=attrs.validators.in_(("tcp", "rdma")))
    device: str = ""
    num_workers: int = attrs.field(
        default=2, validator=[attrs.validators.ge(1), attrs.validators.le(64)]
    )
    bootstrap_timeout_s: float = attrs.field(default=300.0, validator=attrs.validators.gt(0))
    connect_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    max_blocks_per_write: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    max_early_destinations: int = attrs.field(default=4096, validator=attrs.validators.ge(1))
    token: str | None = None


def kv_dtype_name(pool: KVPool) -> str:
    return str(pool.dtype).removeprefix("torch.")




class Engine:
    """One TransferEngine with its registered regions; ``session`` is ``host:rpc_port``."""

    def __init__(self, config: MooncakeConfig) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise MooncakeError(
                "the Mooncake backend needs `pip install mooncake-transfer-engine-non-cuda` and "
                f"Debian's libibverbs1: {exc}"
            ) from exc
        self._engine = TransferEngine()
        rc = self._engine.initialize(
            config.hostname, "P2PHANDSHAKE", config.protocol, config.device
        )
        if rc != 0:
            raise MooncakeError(
                f"TransferEngine.initialize({config.hostname!r}, P2PHANDSHAKE, "
                f"{config.protocol!r}, {config.device!r}) returned {rc}"
            )
        self.session = f"{config.hostname}:{self._engine.get_rpc_port()}"
        self._regions: list[int] = []

    def register(self, ptr: int, length: int) -> None:
        rc = self._engine.register_memory(ptr, length)
        if rc != 0:
            raise MooncakeError(f"register_memory({ptr:#x}, {length}) returned {rc}")
        self._regions.append(ptr)

    def write(self, session: str, src: list[int], dst: list[int], lens: list[int]) -> int:
        rc: int = self._engine.batch_transfer_sync_write(session, src, dst, lens)
        return rc

    def close(self) -> None:
        for ptr in self._regions:
            self._engine.unregister_memory(ptr)
        self._regions.clear()


def register_all(engine: Engine, pool: KVPool, metadata: MetadataBuffers) -> None:
    if not pool.buffer.is_contiguous():
        raise MooncakeError("the KV pool buffer must be contiguous to be registered")
    engine.register(pool.buffer.data_ptr(), pool.buffer.numel() * pool.buffer.element_size())
    for info in metadata.buffer_infos():
        engine.register(info.ptr, info.length)


def push_socket(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    return sock
