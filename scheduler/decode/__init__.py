"""The decode peer: the decode lifecycle over a KV receiver, and the router that gives a
decode peer one KV manager per prefill server."""

from scheduler.decode.config import DecodeConfig
from scheduler.decode.metrics import DecodeMetrics
from scheduler.decode.peer import DecodePeer
from scheduler.messages import DecodeResponse

__all__ = ["DecodeConfig", "DecodeMetrics", "DecodePeer", "DecodeResponse"]
