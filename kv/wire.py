"""Control messages between the decode peer and a prefill rank, as validated msgpack.

Theory of operation
-------------------
Four messages cross the network, each a msgpack map with a type tag ``"t"``:

decode → prefill
    :class:`Register` once per (decode manager, prefill rank): the decode session id
    (``host:rpc_port`` of its transfer engine), the ZeroMQ endpoint where it wants statuses, and
    the layout of its registered memory (KV pool base pointer, geometry and order, metadata
    buffers), the model whose KV its pool holds (fingerprint and name), and its place: the
    model's KV heads, head dim and MLA, and its TP rank and size (:mod:`kv.mooncake_slices`).
    :class:`Destination` once per room: the decode pages and metadata slot to write into.
    :class:`Abort` when decode gives up on a room.
prefill → decode
    :class:`Status` when a room concludes (SUCCESS or FAILED), with a reason.

Nothing from the network is trusted. :func:`decode` turns bytes into one of these records or
raises :class:`WireError`, and never anything else: size limit, msgpack syntax, the type tag,
every field's type, length and range, and (when peers share a token) the token, compared in
constant time. Checks that need the receiver's state (is the session known, do the pages fit the
decode pool it registered) are :func:`check_destination`. A caller that gets a ``WireError``
logs it, counts it in :class:`DroppedMessages` under ``err.reason`` and drops the message; a bad
message never ends a thread.

Pickle is never used: a pickle from the network runs code.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import msgpack
import numpy as np

from kv.pages import kv_bytes
from kv.pool_layout import KV_LAYOUTS, KVLayout
from kv.transfer import KVPoll

MAX_MESSAGE_BYTES = 16 << 20
MAX_ROOM = (1 << 64) - 1
MAX_PAGES = 1 << 24
MAX_FIELDS = 64
MAX_TP = 1 << 12
_MAX_U64 = (1 << 64) - 1
_MAX_STR = 512

# The KV dtypes a pool may be built with; the name is torch's without the "torch." prefix.
KV_DTYPES = frozenset({"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


class WireError(Exception):
    """A control message was malformed, unauthenticated or does not fit the receiver.

    ``reason`` is a short stable code (``malformed``, ``bad_field``, ``unauthenticated``,
    ``unknown_session``, ``page_out_of_range``, ...) used as the drop counter's key; the message
    says which field and what was expected. The fix is on the sending peer.
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


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


@attrs.frozen
class Abort:
    """decode → prefill: decode gave up on ``room``."""

    room: int
    session: str


@attrs.frozen
class Status:
    """prefill → decode: ``room`` concluded with KVPoll value ``poll``."""

    room: int
    poll: int
    reason: str
    rank: int


Message = Register | Destination | Abort | Status


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
        }
    elif isinstance(msg, Destination):
        body = {
            "t": "destination",
            "room": msg.room,
            "session": msg.session,
            "pages": np.ascontiguousarray(msg.pages, dtype="<i4").tobytes(),
            "slot": msg.slot,
        }
    elif isinstance(msg, Abort):
        body = {"t": "abort", "room": msg.room, "session": msg.session}
    elif isinstance(msg, Status):
        body = {
            "t": "status",
            "room": msg.room,
            "poll": msg.poll,
            "reason": msg.reason[: _MAX_STR // 2],
            "rank": msg.rank,
        }
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
            max_str_len=_MAX_STR, max_array_len=MAX_FIELDS, max_map_len=MAX_FIELDS, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise WireError("malformed", f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise WireError("malformed", f"expected a map, got {type(body).__name__}")
    _check_token(body, token)
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
    return reg


class DroppedMessages:
    """Thread-safe count of dropped control messages, by :attr:`WireError.reason`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def record(self, err: WireError) -> None:
        with self._lock:
            self._counts[err.reason] = self._counts.get(err.reason, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


def _check_token(body: dict[Any, Any], token: str | None) -> None:
    if token is None:
        return
    got = body.get("token")
    if not isinstance(got, str) or not hmac.compare_digest(
        got.encode("utf-8", "surrogatepass"), token.encode("utf-8")
    ):
        raise WireError("unauthenticated", "missing or wrong token")


def _int(body: dict[Any, Any], name: str, lo: int, hi: int) -> int:
    value = body.get(name)
    # bool is an int subclass; a True where a count belongs is a malformed message.
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireError("bad_field", f"{name}: expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireError("bad_field", f"{name}: {value} not in {lo}..{hi}")
    return value


def _bool(body: dict[Any, Any], name: str) -> bool:
    value = body.get(name)
    if not isinstance(value, bool):
        raise WireError("bad_field", f"{name}: expected true or false, got {type(value).__name__}")
    return value


def _str(body: dict[Any, Any], name: str, *, allow_empty: bool = False) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise WireError("bad_field", f"{name}: expected a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise WireError("bad_field", f"{name}: must not be empty")
    return value


def _session(body: dict[Any, Any]) -> str:
    session = _str(body, "session")
    host, sep, port = session.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WireError("bad_field", f"session: expected 'host:port', got {session!r}")
    return session


def _int_list(body: dict[Any, Any], name: str, lo: int, hi: int) -> tuple[int, ...]:
    value = body.get(name)
    if not isinstance(value, list) or not 0 < len(value) <= MAX_FIELDS:
        raise WireError("bad_field", f"{name}: expected a list of 1..{MAX_FIELDS} integers")
    return tuple(_int({name: v}, name, lo, hi) for v in value)


def _parse_register(body: dict[Any, Any]) -> Register:
    endpoint = _str(body, "status_endpoint")
    if not endpoint.startswith("tcp://"):
        raise WireError("bad_field", f"status_endpoint: expected 'tcp://...', got {endpoint!r}")
    kv_dtype = _str(body, "kv_dtype")
    if kv_dtype not in KV_DTYPES:
        raise WireError("bad_field", f"kv_dtype: {kv_dtype!r} not one of {sorted(KV_DTYPES)}")
    kv_layout = _str(body, "kv_layout")
    if kv_layout not in KV_LAYOUTS:
        raise WireError("bad_field", f"kv_layout: {kv_layout!r} not one of {list(KV_LAYOUTS)}")
    meta_ptrs = _int_list(body, "meta_ptrs", 1, _MAX_U64)
    meta_item_lens = _int_list(body, "meta_item_lens", 1, 1 << 20)
    if len(meta_ptrs) != len(meta_item_lens):
        raise WireError(
            "bad_field",
            f"meta_ptrs has {len(meta_ptrs)} entries but meta_item_lens {len(meta_item_lens)}",
        )
    reg = Register(
        session=_session(body),
        status_endpoint=endpoint,
        kv_ptr=_int(body, "kv_ptr", 1, _MAX_U64),
        num_layers=_int(body, "num_layers", 1, 4096),
        num_pages=_int(body, "num_pages", 1, MAX_PAGES),
        page_size=_int(body, "page_size", 1, 1 << 16),
        page_bytes=_int(body, "page_bytes", 1, 1 << 32),
        kv_dtype=kv_dtype,
        meta_ptrs=meta_ptrs,
        meta_item_lens=meta_item_lens,
        num_slots=_int(body, "num_slots", 1, 1 << 24),
        model=_str(body, "model", allow_empty=True),
        model_name=_str(body, "model_name", allow_empty=True),
        kv_layout=kv_layout,
        kv_heads=_int(body, "kv_heads", 1, 1 << 16),
        head_dim=_int(body, "head_dim", 1, 1 << 16),
        mla=_bool(body, "mla"),
        tp_rank=_int(body, "tp_rank", 0, MAX_TP - 1),
        tp_size=_int(body, "tp_size", 1, MAX_TP),
    )
    if reg.tp_rank >= reg.tp_size:
        raise WireError("bad_field", f"tp_rank {reg.tp_rank} not in tp_size {reg.tp_size}")
    if reg.kv_ptr + reg.kv_bytes > _MAX_U64:
        raise WireError("bad_field", "kv_ptr: the pool would extend past the address space")
    return reg


def _parse_destination(body: dict[Any, Any]) -> Destination:
    raw = body.get("pages")
    if not isinstance(raw, bytes) or len(raw) % 4 or len(raw) // 4 > MAX_PAGES:
        raise WireError("bad_field", f"pages: expected packed int32, at most {MAX_PAGES} pages")
    pages = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    return Destination(
        room=_int(body, "room", 0, MAX_ROOM),
        session=_session(body),
        pages=pages,
        slot=_int(body, "slot", 0, 1 << 24),
    )


def _parse_abort(body: dict[Any, Any]) -> Abort:
    return Abort(room=_int(body, "room", 0, MAX_ROOM), session=_session(body))


def _parse_status(body: dict[Any, Any]) -> Status:
    poll = _int(body, "poll", 0, 4)
    # Only the two conclusions travel; intermediate states are local to each side.
    if poll not in (KVPoll.FAILED, KVPoll.SUCCESS):
        raise WireError("bad_field", f"poll: {poll} is not FAILED (0) or SUCCESS (4)")
    return Status(
        room=_int(body, "room", 0, MAX_ROOM),
        poll=poll,
        reason=_str(body, "reason", allow_empty=True),
        rank=_int(body, "rank", 0, 1 << 16),
    )


_PARSERS: dict[str, Callable[[dict[Any, Any]], Message]] = {
    "register": _parse_register,
    "destination": _parse_destination,
    "abort": _parse_abort,
    "status": _parse_status,
}
_FIELDS = {
    "register": {f.name for f in attrs.fields(Register)},
    "destination": {f.name for f in attrs.fields(Destination)},
    "abort": {f.name for f in attrs.fields(Abort)},
    "status": {f.name for f in attrs.fields(Status)},
}
