"""kv.wire: valid messages round-trip; anything else raises WireError and only WireError."""

from __future__ import annotations

import contextlib

import attrs
import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv import wire
from kv.pool_layout import KV_LAYOUTS
from kv.state_shapes import POOL_NAMES, STATE_KINDS, StateShape
from kv.wire_state import STATE_DTYPES, PoolMemory

sessions = st.builds(
    lambda host, port: f"{host}:{port}",
    st.sampled_from(["127.0.0.1", "10.0.0.7", "decode-3"]),
    st.integers(1, 65535),
)
rooms = st.integers(0, wire.MAX_ROOM)

registers = st.builds(
    wire.Register,
    session=sessions,
    status_endpoint=st.just("tcp://127.0.0.1:5555"),
    kv_ptr=st.integers(1, 1 << 48),
    num_layers=st.integers(1, 64),
    num_pages=st.integers(1, 1 << 16),
    page_size=st.integers(1, 64),
    page_bytes=st.integers(1, 1 << 20),
    kv_dtype=st.sampled_from(sorted(wire.KV_DTYPES)),
    kv_layout=st.sampled_from(KV_LAYOUTS),
    meta_ptrs=st.just((4096, 8192)),
    meta_item_lens=st.just((64, 64)),
    num_slots=st.integers(1, 1024),
    kv_heads=st.integers(1, 128),
    head_dim=st.integers(1, 512),
    mla=st.booleans(),
    tp_rank=st.just(1),
    tp_size=st.integers(2, 64),
    keepalive_ms=st.integers(0, wire.MAX_KEEPALIVE_MS),
)
int32_arrays = st.lists(st.integers(0, (1 << 31) - 1), max_size=64).map(
    lambda p: np.array(p, dtype=np.int64)
)


@st.composite
def _pool_memory(draw: st.DrawFn, name: str, num_pages: int) -> PoolMemory:
    regions = draw(st.integers(1, 8))
    shape = StateShape(
        regions=regions,
        items=num_pages if name == "draft" else draw(st.integers(1, 1 << 16)),
        item_len=draw(st.integers(1, 1 << 16)),
        dtype=draw(st.sampled_from(sorted(STATE_DTYPES))),
        layout=draw(st.sampled_from(["", *KV_LAYOUTS])),
    )
    ptrs = draw(st.lists(st.integers(1, 1 << 47), min_size=regions, max_size=regions))
    return PoolMemory(name, shape, tuple(ptrs))


@st.composite
def _hybrid_registers(draw: st.DrawFn) -> wire.Register:
    """A register with some of the state pools (and a window exactly with an SWA pool)."""
    reg = draw(registers)
    names = draw(st.lists(st.sampled_from(POOL_NAMES), unique=True))
    pools = tuple(draw(_pool_memory(n, reg.num_pages)) for n in POOL_NAMES if n in names)
    window = draw(st.integers(1, 1 << 20)) if "swa" in names else 0
    return attrs.evolve(reg, state_pools=pools, state_window=window)


destinations = st.builds(
    wire.Destination,
    room=rooms,
    session=sessions,
    pages=int32_arrays,
    slot=st.integers(0, 1 << 20),
    state=st.dictionaries(st.sampled_from(STATE_KINDS), int32_arrays, max_size=3),
)
aborts = st.builds(wire.Abort, room=rooms, session=sessions)
watches = st.builds(wire.Watch, room=rooms, session=sessions)
deregisters = st.builds(wire.Deregister, session=sessions)
statuses = st.builds(
    wire.Status,
    room=rooms,
    poll=st.sampled_from([0, 4]),
    reason=st.text(max_size=40),
    rank=st.integers(0, 8),
)
refusals = st.builds(wire.Refused, reason=st.text(min_size=1, max_size=40),
                     rank=st.integers(0, 8))
messages = st.one_of(registers, _hybrid_registers(), destinations, watches, aborts, deregisters,
                     statuses, refusals)


def _same(a: wire.Message, b: wire.Message) -> bool:
    if isinstance(a, wire.Destination) and isinstance(b, wire.Destination):
        return ((a.room, a.session, a.slot) == (b.room, b.session, b.slot)
                and np.array_equal(a.pages, b.pages) and set(a.state) == set(b.state)
                and all(np.array_equal(a.state[k], b.state[k]) for k in a.state))
    return a == b


@given(messages)
def test_valid_messages_round_trip(msg: wire.Message) -> None:
    assert _same(wire.decode(wire.encode(msg)), msg)


@given(messages, st.text(min_size=1, max_size=20))
def test_token_is_required_and_checked(msg: wire.Message, token: str) -> None:
    assert _same(wire.decode(wire.encode(msg, token), token), msg)
    with pytest.raises(wire.WireError) as missing:
        wire.decode(wire.encode(msg), token)
    assert missing.value.reason == "unauthenticated"
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode(msg, token + "x"), token)


@given(st.binary(max_size=200))
def test_random_bytes_raise_only_wire_error(data: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)


@given(messages, st.data())
def test_mutated_fields_raise_only_wire_error(msg: wire.Message, data: st.DataObject) -> None:
    body = msgpack.unpackb(wire.encode(msg))
    key = data.draw(st.sampled_from(sorted(body)))
    if data.draw(st.booleans()):
        body[key] = data.draw(json_values)
    else:
        del body[key]
    with contextlib.suppress(wire.WireError):
        wire.decode(msgpack.packb(body, use_bin_type=True))


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("room", -1, "bad_field"),
        ("room", True, "bad_field"),
        ("room", 1 << 64, "malformed"),  # msgpack cannot even carry it
        ("session", "no-port", "bad_field"),
        ("session", "h:0", "bad_field"),
        ("pages", b"\x00\x00\x00", "bad_field"),
        ("pages", [1, 2], "bad_field"),
        ("slot", "3", "bad_field"),
        ("t", "launch", "unknown_type"),
        ("extra", 1, "bad_field"),
    ],
)
def test_bad_destination_fields_name_the_reason(field: str, value: object, reason: str) -> None:
    msg = wire.Destination(5, "127.0.0.1:9", np.arange(3), 1)
    body = msgpack.unpackb(wire.encode(msg))
    body[field] = value
    try:
        data = msgpack.packb(body, use_bin_type=True)
    except OverflowError:
        data = b"\xcf" + b"\xff" * 9  # an over-long integer on the wire
    with pytest.raises(wire.WireError) as err:
        wire.decode(data)
    assert err.value.reason == reason


def test_status_carries_only_conclusions() -> None:
    body = msgpack.unpackb(wire.encode(wire.Status(1, 4, "", 0)))
    body["poll"] = 3
    with pytest.raises(wire.WireError, match="poll"):
        wire.decode(msgpack.packb(body))


def test_pickle_is_not_accepted() -> None:
    import pickle

    with pytest.raises(wire.WireError):
        wire.decode(pickle.dumps({"t": "abort", "room": 1, "session": "a:1"}))


def _register(num_pages: int = 16, num_slots: int = 4) -> wire.Register:
    return wire.Register("127.0.0.1:7000", "tcp://127.0.0.1:7001", 4096, 2, num_pages, 4, 256,
                         "float32", (8192,), (64,), num_slots, kv_heads=2, head_dim=8)


def test_check_destination_against_the_registered_pool() -> None:
    reg = _register()
    known = {reg.session: reg}
    ok = wire.Destination(1, reg.session, np.array([0, 15]), 3)
    assert wire.check_destination(ok, known) is reg
    cases = [
        (wire.Destination(1, "127.0.0.1:7999", np.array([0]), 0), "unknown_session"),
        (wire.Destination(1, reg.session, np.array([16]), 0), "page_out_of_range"),
        (wire.Destination(1, reg.session, np.array([-1]), 0), "page_out_of_range"),
        (wire.Destination(1, reg.session, np.array([0]), 4), "slot_out_of_range"),
    ]
    for dest, reason in cases:
        with pytest.raises(wire.WireError) as err:
            wire.check_destination(dest, known)
        assert err.value.reason == reason


def test_register_validates_layout_fields() -> None:
    body = msgpack.unpackb(wire.encode(_register()))
    for field, value in [("kv_dtype", "int4"), ("meta_item_lens", [64, 64]),
                         ("status_endpoint", "ipc:///x"), ("num_pages", 0),
                         ("kv_layout", "head_major"), ("kv_layout", 1), ("kv_heads", 0),
                         ("head_dim", True), ("mla", 1), ("tp_rank", 1), ("tp_size", 0),
                         ("keepalive_ms", 0), ("keepalive_ms", wire.MAX_KEEPALIVE_MS + 1),
                         ("keepalive_ms", 5.0)]:
        bad = dict(body, **{field: value})
        with pytest.raises(wire.WireError):
            wire.decode(msgpack.packb(bad))


def test_a_register_without_keepalive_reads_as_it_did_before_keepalives() -> None:
    """``keepalive_ms`` 0 leaves the field out (a prefill that predates keepalives refuses
    unknown fields), and a message without it (an older decode's) reads as 0."""
    old = _register()
    assert old.keepalive_ms == 0 and "keepalive_ms" not in msgpack.unpackb(wire.encode(old))
    assert wire.decode(wire.encode(old)) == old
    new = attrs.evolve(old, keepalive_ms=5000)
    assert msgpack.unpackb(wire.encode(new))["keepalive_ms"] == 5000


def test_dropped_messages_count_by_reason() -> None:
    dropped = wire.DroppedMessages()
    for data in (b"\xc1", b"\x01", msgpack.packb({"t": "x"})):
        try:
            wire.decode(data)
        except wire.WireError as err:
            dropped.record(err)
    assert dropped.snapshot() == {"malformed": 2, "unknown_type": 1}
    assert dropped.total == 3


def _hybrid_register() -> wire.Register:
    shape = StateShape(regions=2, items=3, item_len=40, dtype="int64")
    draft = StateShape(regions=1, items=16, item_len=96, dtype="float32", layout="page_major")
    return attrs.evolve(_register(), state_window=9, state_pools=(
        PoolMemory("draft", draft, (1 << 20,)),
        PoolMemory("swa", attrs.evolve(draft, items=5), (1 << 21,)),
        PoolMemory("recurrent", shape, (1 << 22, 1 << 23))))


def test_register_validates_state_fields() -> None:
    body = msgpack.unpackb(wire.encode(_hybrid_register()))
    assert wire.decode(msgpack.packb(body)) == _hybrid_register()
    pools = body["state_pools"]
    cases = [
        ("state_window", 0),  # an SWA pool needs its window
        ("state_window", True),
        ("state_pools", []),
        ("state_pools", dict(pools, mamba=pools["swa"])),
        ("state_pools", dict(pools, draft=dict(pools["draft"], items=15))),  # not num_pages
        ("state_pools", dict(pools, swa=dict(pools["swa"], ptrs=b""))),
        ("state_pools", dict(pools, swa=dict(pools["swa"], ptrs=b"\0" * 7))),
        ("state_pools", dict(pools, swa=dict(pools["swa"], ptrs=b"\0" * 8))),  # address 0
        ("state_pools", dict(pools, swa=dict(pools["swa"], ptrs=b"\xff" * 8))),
        ("state_pools", dict(pools, swa=dict(pools["swa"], dtype="int4"))),
        ("state_pools", dict(pools, swa=dict(pools["swa"], layout="head_major"))),
        ("state_pools", dict(pools, swa=dict(pools["swa"], items=0))),
        ("state_pools", dict(pools, swa=dict(pools["swa"], extra=1))),
        ("state_pools", dict(pools, swa={k: v for k, v in pools["swa"].items() if k != "dtype"})),
    ]
    for field, value in cases:
        with pytest.raises(wire.WireError) as err:
            wire.decode(msgpack.packb(dict(body, **{field: value})))
        assert err.value.reason == "bad_field", (field, value)
    no_swa = {k: v for k, v in pools.items() if k != "swa"}
    with pytest.raises(wire.WireError, match="state_window: 9, but no swa pool"):
        wire.decode(msgpack.packb(dict(body, state_pools=no_swa)))


def test_check_destination_against_the_registered_state_pools() -> None:
    reg = _hybrid_register()
    known = {reg.session: reg}
    dest = wire.Destination(1, reg.session, np.array([0]), 0,
                            state={"swa": np.array([0, 4]), "recurrent": np.array([2])})
    assert wire.check_destination(dest, known) is reg
    for state, reason in [({"index": np.array([0])}, "unknown_state"),
                          ({"swa": np.array([5])}, "state_out_of_range"),
                          ({"recurrent": np.array([-1])}, "state_out_of_range")]:
        with pytest.raises(wire.WireError) as err:
            wire.check_destination(attrs.evolve(dest, state=state), known)
        assert err.value.reason == reason
    body = msgpack.unpackb(wire.encode(dest))
    for value in ({"mamba": b""}, {"swa": [1]}, {"swa": b"\0" * 3}, [b""]):
        with pytest.raises(wire.WireError) as err:
            wire.decode(msgpack.packb(dict(body, state=value)))
        assert err.value.reason == "bad_field"
