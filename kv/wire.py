"""Control messages between the decode peer and a prefill rank, as validated msgpack.

Theory of operation
-------------------
Seven messages cross the network, each a msgpack map with a type tag ``"t"``:

decode → prefill
    :class:`Register` per (decode manager, prefill rank), then again every ``keepalive_ms``
    while the decode rank runs (its keepalive): the decode session id
    (``host:rpc_port`` of its transfer engine), the ZeroMQ endpoint where it wants statuses, and
    the layout of its registered memory (KV pool base pointer, geometry and order, metadata
    buffers), the model whose KV its pool holds (fingerprint and name), and its place: the
    model's KV heads, head dim and MLA, and its TP rank and size (:mod:`kv.mooncake_slices`);
    with a hybrid model, its state pools (:mod:`kv.wire_state`).
    :class:`Watch` once per room, when decode holds the request but not yet its pages (it waits
    for them in its queue): a prefill rank that fails or refuses the room before the room's
    ``Destination`` comes tells decode at once. Sent only to a prefill server whose bootstrap
    table says ``watch`` (an older one does not know the message).
    :class:`Destination` once per room: the decode pages and metadata slot to write into, and
    the items each state kind goes to.
    :class:`Abort` when decode gives up on a room.
    :class:`Deregister` when the decode manager closes: the prefill rank forgets the session.
prefill → decode
    :class:`Status` when a room concludes (SUCCESS or FAILED), with a reason; and again, marked
    ``again``, answering an ``Abort`` that came after it was sent (it may have been lost).
    :class:`Refused` answering a ``Register`` the prefill rank cannot pair with (another model,
    another pool or metadata layout: a worker built otherwise, or of another pdlife version),
    with why: decode fails the prefill's rooms at once instead of each waiting for its timeout.
    A decode that predates the message drops it (``unknown_type``).

Nothing from the network is trusted. :func:`decode` turns bytes into one of these records or
raises :class:`WireError`, and never anything else: size limit, msgpack syntax, the type tag,
every field's type, length and range (:mod:`kv.wire_fields`), and (when peers share a token)
the token, compared in constant time. Checks that need the receiver's state (is the session
known, do the pages and state items fit the decode pools it registered) are
:func:`check_destination`. A caller that gets a ``WireError`` logs it, counts it in
:class:`DroppedMessages` under ``err.reason`` and drops the message; a bad message never ends a
thread.

Pickle is never used: a pickle from the network runs code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import msgpack
import numpy as np

from kv.pages import kv_bytes
from kv.pool_layout import KV_LAYOUTS, KVLayout
from kv.transfer import KVPoll
from kv.wire_fields import (
    MAX_FIELDS,
    MAX_STR,
    MAX_U64,
    bool_field,
    check_token,
    int_field,
    int_list_field,
    session_field,
    str_field,
)
from kv.wire_fields import WireError as WireError
from kv.wire_state import (
    PoolMemory,
    check_state_items,
    encode_items,
    encode_pools,
    parse_items,
    parse_pools,
)

MAX_MESSAGE_BYTES = 16 << 20
MAX_ROOM = (1 << 64) - 1
MAX_PAGES = 1 << 24
MAX_TP = 1 << 12
MAX_KEEPALIVE_MS = 3_600_000

# The KV dtypes a pool may be built with; the name is torch's without the "torch." prefix.
KV_DTYPES = frozenset({"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


@attrs.frozen
class Register:
    """decode → prefill: who the decode peer is and where its memory lies."""

    session: str
    status_endpoint: str
    kv_ptr: int
    num_layers: int
    num_pages: int
    page_size: int
    page_bytes: int
    kv_dtype: str
    meta_ptrs: tuple[int, ...]
    meta_item_lens: tuple[int, ...]
    num_slots: int
    #: The decode pool's model: its fingerprint (compared) and name (for messages).
    model: str = ""
    model_name: str = ""
    #: The order of the decode pool's tensor (:mod:`kv.pool_layout`).
    kv_layout: str = KVLayout.LAYER_MAJOR.value
    #: The decode rank's place: the model's KV heads (all ranks together) and head dim, whether
    #: they are an MLA latent, and the rank's TP rank and size; its pool holds every layer.
    kv_heads: int = attrs.field(kw_only=True)
    head_dim: int = attrs.field(kw_only=True)
    mla: bool = attrs.field(default=False, kw_only=True)
    tp_rank: int = attrs.field(default=0, kw_only=True)
    tp_size: int = attrs.field(default=1, kw_only=True)
    #: A hybrid model's pools beside the KV pool, registered with the engine, and the sliding
    #: window (0 without an SWA pool): :mod:`kv.wire_state`.
    state_pools: tuple[PoolMemory, ...] = attrs.field(default=(), kw_only=True)
    state_window: int = attrs.field(default=0, kw_only=True)
    #: How often (ms) the decode rank sends this ``Register`` again while it runs, its
    #: keepalive; 0 (and then absent from the message): never, and the prefill rank keeps the
    #: session until a ``Deregister``. A decode rank sends one only to a prefill server whose
    #: bootstrap table says ``keepalive`` (an older one refuses the field).
    keepalive_ms: int = attrs.field(default=0, kw_only=True)

    @property
    def kv_bytes(self) -> int:
        return kv_bytes(self.num_pages, page_bytes=self.page_bytes, num_layers=self.num_layers)


@attrs.frozen(eq=False)
class Destination:
    """decode → prefill: where room ``room``'s pages and metadata row go on ``session``."""

    room: int
    session: str
    pages: np.ndarray = attrs.field(repr=lambda p: f"<{len(p)} pages>")
    slot: int
    #: Where each state kind's items go (:mod:`kv.wire_state`), by kind name.
    state: Mapping[str, np.ndarray] = attrs.field(factory=dict, kw_only=True,
                                                  repr=lambda s: f"<{sorted(s)}>")


@attrs.frozen
class Watch:
    """decode → prefill: decode holds ``room`` and sends its destination once it has pages;
    a failure of the room before then is owed to ``session`` at once."""

    room: int
    session: str


@attrs.frozen
class Abort:
    """decode → prefill: decode gave up on ``room``."""

    room: int
    session: str


@attrs.frozen
class Deregister:
    """decode → prefill: the decode rank of ``session`` is closing; it takes no more KV and
    reads no more statuses."""

    session: str


@attrs.frozen
class Status:
    """prefill → decode: ``room`` concluded with KVPoll value ``poll``."""

    room: int
    poll: int
    reason: str
    rank: int
    #: This ``Status`` answers an ``Abort`` of the room that came after the room's ``Status``
    #: was sent: it repeats that one (its first may have been lost), and it is for the use of
    #: the room that sent the ``Abort``, not a later one. False (and then absent from the
    #: message): a room's own ``Status``. A decode that predates the field drops a repeat
    #: (``bad_field``), as it was dropped before it was sent.
    again: bool = attrs.field(default=False, kw_only=True)


@attrs.frozen
class Refused:
    """prefill → decode: prefill rank ``rank`` dropped this decode rank's ``Register`` (it
    cannot pair with it: ``reason``); none of the rooms it would serve will be."""

    reason: str
    rank: int


Message = Register | Watch | Destination | Abort | Deregister | Status | Refused


def encode(msg: Message, token: str | None = None) -> bytes:
    """msgpack bytes of ``msg``, carrying ``token`` when peers authenticate."""
    body: dict[str, Any]
    if isinstance(msg, Register):
        body = {
            "t": "register",
            "session": msg.session,
            "status_endpoint": msg.status_endpoint,
            "kv_ptr": msg.kv_ptr,
            "num_layers": msg.num_layers,
            "num_pages": msg.num_pages,
            "page_size": msg.page_size,
            "page_bytes": msg.page_bytes,
            "kv_dtype": msg.kv_dtype,
            "meta_ptrs": list(msg.meta_ptrs),
            "meta_item_lens": list(msg.meta_item_lens),
            "num_slots": msg.num_slots,
            "model": msg.model,
            "model_name": msg.model_name,
            "kv_layout": msg.kv_layout,
            "kv_heads": msg.kv_heads,
            "head_dim": msg.head_dim,
            "mla": msg.mla,
            "tp_rank": msg.tp_rank,
            "tp_size": msg.tp_size,
            "state_pools": encode_pools(msg.state_pools),
            "state_window": msg.state_window,
        }
        if msg.keepalive_ms:  # absent otherwise: what a prefill that predates keepalives reads
            body["keepalive_ms"] = msg.keepalive_ms
    elif isinstance(msg, Destination):
        body = {
            "t": "destination",
            "room": msg.room,
            "session": msg.session,
            "pages": np.ascontiguousarray(msg.pages, dtype="<i4").tobytes(),
            "slot": msg.slot,
            "state": encode_items(msg.state),
        }
    elif isinstance(msg, Watch):
        body = {"t": "watch", "room": msg.room, "session": msg.session}
    elif isinstance(msg, Abort):
        body = {"t": "abort", "room": msg.room, "session": msg.session}
    elif isinstance(msg, Deregister):
        body = {"t": "deregister", "session": msg.session}
    elif isinstance(msg, Status):
        body = {
            "t": "status",
            "room": msg.room,
            "poll": msg.poll,
            "reason": msg.reason[: MAX_STR // 2],
            "rank": msg.rank,
        }
        if msg.again:  # absent otherwise: what a decode that predates repeats reads
            body["again"] = True
    elif isinstance(msg, Refused):
        body = {"t": "refused", "reason": msg.reason[: MAX_STR // 2], "rank": msg.rank}
    else:
        raise AssertionError(f"not a wire message: {msg!r}")
    if token is not None:
        body["token"] = token
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def decode(data: bytes, token: str | None = None) -> Message:
    """The message in ``data``; raises :class:`WireError` and nothing else when it is bad."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError("too_large", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE_BYTES,
            max_str_len=MAX_STR, max_array_len=MAX_FIELDS, max_map_len=MAX_FIELDS, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise WireError("malformed", f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise WireError("malformed", f"expected a map, got {type(body).__name__}")
    check_token(body, token)
    kind = body.get("t")
    if not isinstance(kind, str) or kind not in _PARSERS:
        raise WireError("unknown_type", f"type tag {kind!r}")
    parse = _PARSERS[kind]
    allowed = _FIELDS[kind]
    extra = set(body) - allowed - {"t", "token"}
    if extra:
        raise WireError("bad_field", f"{kind}: unexpected fields {sorted(map(str, extra))}")
    return parse(body)


def check_destination(dest: Destination, sessions: Mapping[str, Register]) -> Register:
    """The registration of ``dest``'s session, after checking that ``dest`` fits it.

    Raises ``WireError`` when the session never registered, the slot is not one of its metadata
    rows, or a page index lies outside the decode pool it registered.
    """
    reg = sessions.get(dest.session)
    if reg is None:
        raise WireError("unknown_session", f"room {dest.room}: session {dest.session!r}")
    if dest.slot >= reg.num_slots:
        raise WireError(
            "slot_out_of_range", f"room {dest.room}: slot {dest.slot} not in 0..{reg.num_slots - 1}"
        )
    pages = dest.pages
    if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= reg.num_pages):
        raise WireError(
            "page_out_of_range",
            f"room {dest.room}: pages must lie in 0..{reg.num_pages - 1}, "
            f"got {int(pages.min())}..{int(pages.max())}",
        )
    check_state_items(dest.room, dest.state, reg.state_pools)
    return reg


class DroppedMessages:
    """Thread-safe count of dropped control messages, by :attr:`WireError.reason`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def record(self, err: WireError) -> int:
        """Count ``err``; how many of its reason were dropped so far."""
        with self._lock:
            n = self._counts[err.reason] = self._counts.get(err.reason, 0) + 1
            return n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


def _parse_register(body: dict[Any, Any]) -> Register:
    endpoint = str_field(body, "status_endpoint")
    if not endpoint.startswith("tcp://"):
        raise WireError("bad_field", f"status_endpoint: expected 'tcp://...', got {endpoint!r}")
    kv_dtype = str_field(body, "kv_dtype")
    if kv_dtype not in KV_DTYPES:
        raise WireError("bad_field", f"kv_dtype: {kv_dtype!r} not one of {sorted(KV_DTYPES)}")
    kv_layout = str_field(body, "kv_layout")
    if kv_layout not in KV_LAYOUTS:
        raise WireError("bad_field", f"kv_layout: {kv_layout!r} not one of {list(KV_LAYOUTS)}")
    meta_ptrs = int_list_field(body, "meta_ptrs", 1, MAX_U64)
    meta_item_lens = int_list_field(body, "meta_item_lens", 1, 1 << 20)
    if len(meta_ptrs) != len(meta_item_lens):
        raise WireError(
            "bad_field",
            f"meta_ptrs has {len(meta_ptrs)} entries but meta_item_lens {len(meta_item_lens)}",
        )
    num_pages = int_field(body, "num_pages", 1, MAX_PAGES)
    state_pools, state_window = parse_pools(body, num_pages)
    reg = Register(
        session=session_field(body),
        status_endpoint=endpoint,
        kv_ptr=int_field(body, "kv_ptr", 1, MAX_U64),
        num_layers=int_field(body, "num_layers", 1, 4096),
        num_pages=num_pages,
        page_size=int_field(body, "page_size", 1, 1 << 16),
        page_bytes=int_field(body, "page_bytes", 1, 1 << 32),
        kv_dtype=kv_dtype,
        meta_ptrs=meta_ptrs,
        meta_item_lens=meta_item_lens,
        num_slots=int_field(body, "num_slots", 1, 1 << 24),
        model=str_field(body, "model", allow_empty=True),
        model_name=str_field(body, "model_name", allow_empty=True),
        kv_layout=kv_layout,
        kv_heads=int_field(body, "kv_heads", 1, 1 << 16),
        head_dim=int_field(body, "head_dim", 1, 1 << 16),
        mla=bool_field(body, "mla"),
        tp_rank=int_field(body, "tp_rank", 0, MAX_TP - 1),
        tp_size=int_field(body, "tp_size", 1, MAX_TP),
        state_pools=state_pools,
        state_window=state_window,
        keepalive_ms=(int_field(body, "keepalive_ms", 1, MAX_KEEPALIVE_MS)
                      if "keepalive_ms" in body else 0),  # absent: a decode without keepalives
    )
    if reg.tp_rank >= reg.tp_size:
        raise WireError("bad_field", f"tp_rank {reg.tp_rank} not in tp_size {reg.tp_size}")
    if reg.kv_ptr + reg.kv_bytes > MAX_U64:
        raise WireError("bad_field", "kv_ptr: the pool would extend past the address space")
    return reg


def _parse_destination(body: dict[Any, Any]) -> Destination:
    raw = body.get("pages")
    if not isinstance(raw, bytes) or len(raw) % 4 or len(raw) // 4 > MAX_PAGES:
        raise WireError("bad_field", f"pages: expected packed int32, at most {MAX_PAGES} pages")
    pages = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    return Destination(
        room=int_field(body, "room", 0, MAX_ROOM),
        session=session_field(body),
        pages=pages,
        slot=int_field(body, "slot", 0, 1 << 24),
        state=parse_items(body),
    )


def _parse_watch(body: dict[Any, Any]) -> Watch:
    return Watch(room=int_field(body, "room", 0, MAX_ROOM), session=session_field(body))


def _parse_abort(body: dict[Any, Any]) -> Abort:
    return Abort(room=int_field(body, "room", 0, MAX_ROOM), session=session_field(body))


def _parse_deregister(body: dict[Any, Any]) -> Deregister:
    return Deregister(session=session_field(body))


def _parse_status(body: dict[Any, Any]) -> Status:
    poll = int_field(body, "poll", 0, 4)
    # Only the two conclusions travel; intermediate states are local to each side.
    if poll not in (KVPoll.FAILED, KVPoll.SUCCESS):
        raise WireError("bad_field", f"poll: {poll} is not FAILED (0) or SUCCESS (4)")
    return Status(
        room=int_field(body, "room", 0, MAX_ROOM),
        poll=poll,
        reason=str_field(body, "reason", allow_empty=True),
        rank=int_field(body, "rank", 0, 1 << 16),
        again=bool_field(body, "again") if "again" in body else False,
    )


def _parse_refused(body: dict[Any, Any]) -> Refused:
    return Refused(reason=str_field(body, "reason"), rank=int_field(body, "rank", 0, 1 << 16))


_PARSERS: dict[str, Callable[[dict[Any, Any]], Message]] = {
    "register": _parse_register,
    "watch": _parse_watch,
    "destination": _parse_destination,
    "abort": _parse_abort,
    "deregister": _parse_deregister,
    "status": _parse_status,
    "refused": _parse_refused,
}
_FIELDS = {
    "register": {f.name for f in attrs.fields(Register)},
    "watch": {f.name for f in attrs.fields(Watch)},
    "destination": {f.name for f in attrs.fields(Destination)},
    "abort": {f.name for f in attrs.fields(Abort)},
    "deregister": {f.name for f in attrs.fields(Deregister)},
    "status": {f.name for f in attrs.fields(Status)},
    "refused": {f.name for f in attrs.fields(Refused)},
}
