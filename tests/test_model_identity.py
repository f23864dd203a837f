"""A decode side refuses a prefill that serves another model (or the same model in another
dtype), naming both, over Mooncake and the local backend: a page of one model's KV means
nothing to another, even when the pool shapes would allow the copy."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from kv import wire
from kv.bootstrap import BootstrapClient, BootstrapServer
from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.mooncake_engine import IncompatiblePeerError
from kv.pool import KVGeometryError, KVPool
from scheduler.model.select import load_model
from tests.transfer_harness import eventually

PAGE_SIZE = 16


@pytest.fixture(scope="module")
def reference() -> Any:
    return load_model("reference")


def pool_of(served: Any, pages: int = 4) -> KVPool:
    pool: KVPool = served.make_pool(num_pages=pages, page_size=PAGE_SIZE)
    return pool


@pytest.fixture
def smollm2_prefill(smollm2: Any) -> Iterator[tuple[BootstrapServer, MooncakeKVManager]]:
    server = BootstrapServer()
    manager = MooncakeKVManager(pool_of(smollm2), MetadataBuffers(4))
    try:
        manager.register_to_bootstrap(server.address)
        yield server, manager
    finally:
        manager.close()
        server.close()


def test_pools_name_their_model(smollm2: Any, smollm2_bf16: Any, reference: Any) -> None:
    fp32, bf16, ref = pool_of(smollm2), pool_of(smollm2_bf16), pool_of(reference)
    assert (fp32.model, fp32.model_name) == (smollm2.fingerprint, "smollm2")
    assert fp32.model.endswith("-float32") and bf16.model.endswith("-bfloat16")
    assert (ref.model, ref.model_name) == (reference.fingerprint, "reference")
    # One checkpoint loaded under two names is one model: only the fingerprint is compared.
    renamed = KVPool(num_layers=fp32.num_layers, num_pages=8, page_size=PAGE_SIZE,
                     kv_heads=fp32.kv_heads, head_dim=fp32.head_dim, model=fp32.model,
                     model_name="/models/SmolLM2.gguf")
    assert fp32.geometry.mismatches(renamed.geometry) == []
    assert fp32.geometry.mismatches(bf16.geometry) == [
        "dtype: torch.float32 vs torch.bfloat16",
        f"model: 'smollm2' ({smollm2.fingerprint}) vs 'smollm2' ({smollm2_bf16.fingerprint})",
    ]


def test_the_bootstrap_table_carries_the_prefills_model(
    smollm2: Any, smollm2_prefill: tuple[BootstrapServer, MooncakeKVManager]
) -> None:
    server, _ = smollm2_prefill
    table = BootstrapClient(server.address).lookup()
    assert (table.model, table.model_name) == (smollm2.fingerprint, "smollm2")
    assert table.ranks[0].model == smollm2.fingerprint


def test_mooncake_decode_of_the_reference_model_is_refused_at_registration(
    smollm2: Any, reference: Any, smollm2_prefill: tuple[BootstrapServer, MooncakeKVManager]
) -> None:
    server, _ = smollm2_prefill
    with pytest.raises(IncompatiblePeerError) as refused:
        MooncakeDecodeManager(pool_of(reference), MetadataBuffers(4), server.address)
    message = str(refused.value)
    assert f"serves model 'smollm2' ({smollm2.fingerprint})" in message
    assert f"this decode serves 'reference' ({reference.fingerprint})" in message
    assert "same --model and --dtype" in message


def test_mooncake_decode_in_another_dtype_is_refused_naming_both(
    smollm2: Any, smollm2_bf16: Any, smollm2_prefill: tuple[BootstrapServer, MooncakeKVManager]
) -> None:
    server, _ = smollm2_prefill
    with pytest.raises(IncompatiblePeerError, match=r"-float32\).*-bfloat16\)"):
        MooncakeDecodeManager(pool_of(smollm2_bf16), MetadataBuffers(4), server.address)


def test_mooncake_decode_of_the_same_model_registers(
    smollm2: Any, smollm2_prefill: tuple[BootstrapServer, MooncakeKVManager],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, prefill = smollm2_prefill
    caplog.set_level(logging.INFO, logger="kv.mooncake")
    decode = MooncakeDecodeManager(pool_of(smollm2, pages=8), MetadataBuffers(4), server.address)
    try:
        assert decode.prefill.model == smollm2.fingerprint
        eventually(lambda: f"decode session {decode.session} registered" in caplog.text,
                   "the prefill rank registered the decode session")
        assert prefill.dropped_messages.total == 0
    finally:
        decode.close()


def test_prefill_drops_a_registration_for_another_model(
    reference: Any, smollm2_prefill: tuple[BootstrapServer, MooncakeKVManager]
) -> None:
    """A decode peer that skipped the bootstrap check is still refused by the prefill rank."""
    _, prefill = smollm2_prefill
    pool = pool_of(reference)
    infos = prefill.metadata.buffer_infos()
    register = wire.Register(
        session="127.0.0.1:9", status_endpoint="tcp://127.0.0.1:9", kv_ptr=1 << 20,
        num_layers=prefill.pool.num_layers, num_pages=4, page_size=PAGE_SIZE,
        page_bytes=prefill.pool.page_bytes, kv_dtype="float32",
        meta_ptrs=tuple(1 << 30 for _ in infos), meta_item_lens=tuple(i.item_len for i in infos),
        num_slots=4, model=pool.model, model_name=pool.model_name,
        kv_heads=prefill.pool.kv_heads, head_dim=prefill.pool.head_dim)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(prefill.endpoint)
        sock.send(wire.encode(register))
        eventually(lambda: prefill.dropped_messages.snapshot().get("incompatible_model") == 1,
                   "the registration dropped as incompatible_model")
        # Not registered: the session's destinations are unknown to the rank.
        sock.send(wire.encode(wire.Destination(7, register.session, np.array([0]), 0)))
        eventually(lambda: prefill.dropped_messages.snapshot().get("unknown_session") == 1,
                   "the destination dropped as unknown_session")
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("decode_model", ["reference", "smollm2_bf16"])
def test_local_decode_of_another_model_is_refused_naming_both(
    request: pytest.FixtureRequest, smollm2: Any, decode_model: str
) -> None:
    other = request.getfixturevalue(decode_model)
    hub = LocalTransferHub()
    prefill = LocalKVManager(pool_of(smollm2), MetadataBuffers(2), hub=hub,
                             bootstrap_addr="local:0")
    decode = LocalDecodeManager(pool_of(other), MetadataBuffers(2), hub=hub)
    try:
        receiver = decode.create_receiver("local:0", 1)
        with pytest.raises(KVGeometryError) as refused:
            receiver.init()
        message = str(refused.value)
        assert (f"model: 'smollm2' ({smollm2.fingerprint}) vs "
                f"'{other.name}' ({other.fingerprint})") in message
        assert "(prefill vs decode)" in message
    finally:
        prefill.close()
        decode.close()
