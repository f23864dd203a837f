"""The field checks every control message is parsed with (:mod:`kv.wire`), and the error a bad
message raises.

Each check takes the decoded msgpack map and a field name, and returns the field's value or
raises :class:`WireError` naming the field and what was expected: nothing from the network is
trusted, and a boolean never passes for an integer.
"""

from __future__ import annotations

import hmac
from typing import Any

import numpy as np

MAX_FIELDS = 64
MAX_U64 = (1 << 64) - 1
MAX_STR = 512


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


def check_token(body: dict[Any, Any], token: str | None) -> None:
    if token is None:
        return
    got = body.get("token")
    if not isinstance(got, str) or not hmac.compare_digest(
        got.encode("utf-8", "surrogatepass"), token.encode("utf-8")
    ):
        raise WireError("unauthenticated", "missing or wrong token")


def int_field(body: dict[Any, Any], name: str, lo: int, hi: int) -> int:
    value = body.get(name)
    # bool is an int subclass; a True where a count belongs is a malformed message.
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireError("bad_field", f"{name}: expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireError("bad_field", f"{name}: {value} not in {lo}..{hi}")
    return value


def bool_field(body: dict[Any, Any], name: str) -> bool:
    value = body.get(name)
    if not isinstance(value, bool):
        raise WireError("bad_field", f"{name}: expected true or false, got {type(value).__name__}")
    return value


def str_field(body: dict[Any, Any], name: str, *, allow_empty: bool = False) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise WireError("bad_field", f"{name}: expected a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise WireError("bad_field", f"{name}: must not be empty")
    return value


def session_field(body: dict[Any, Any]) -> str:
    session = str_field(body, "session")
    host, sep, port = session.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WireError("bad_field", f"session: expected 'host:port', got {session!r}")
    return session


def int_list_field(body: dict[Any, Any], name: str, lo: int, hi: int) -> tuple[int, ...]:
    value = body.get(name)
    if not isinstance(value, list) or not 0 < len(value) <= MAX_FIELDS:
        raise WireError("bad_field", f"{name}: expected a list of 1..{MAX_FIELDS} integers")
    return tuple(int_field({name: v}, name, lo, hi) for v in value)


def packed_field(body: dict[Any, Any], name: str, dtype: str, most: int) -> np.ndarray:
    """A packed array of at most ``most`` items of numpy ``dtype`` (``"<i4"``, ``"<u8"``), as
    int64 (uint64 values above int64's range are not accepted)."""
    raw = body.get(name)
    size = np.dtype(dtype).itemsize
    if not isinstance(raw, bytes) or len(raw) % size or len(raw) // size > most:
        raise WireError("bad_field", f"{name}: expected packed {dtype}, at most {most} items")
    values = np.frombuffer(raw, dtype=dtype)
    if values.dtype.kind == "u" and len(values) and int(values.max()) > np.iinfo(np.int64).max:
        raise WireError("bad_field", f"{name}: a value past {np.iinfo(np.int64).max}")
    return values.astype(np.int64)
