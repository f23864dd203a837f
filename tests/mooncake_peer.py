"""A decode process for Mooncake tests and benchmarks, driven by JSON lines on stdin.

Started as ``python tests/mooncake_peer.py --bootstrap HOST:PORT [geometry]``. It builds a KV
pool and metadata buffers, starts a :class:`MooncakeDecodeManager` against the prefill's
bootstrap endpoint and prints ``{"event": "ready", ...}`` with its session and pool pointer.
Commands (one JSON object per line):

- ``{"cmd": "recv", "room": R, "num_pages": N}``: allocate pages and a slot, create the
  receiver, send the destination; prints ``posted`` with the pages and slot.
- ``{"cmd": "abort", "room": R}``, ``{"cmd": "release", "room": R}`` (clear, free pages/slot).
- ``{"cmd": "dump", "path": P}``: save the pool (layer-major, whatever ``--layout``), metadata
  rooms and rows; prints ``dumped``.
- ``{"cmd": "exit"}``.

Whenever a room concludes it prints ``{"event": "done", "room", "status", "reason"}``.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from typing import Any

import torch

from kv.metadata import MetadataBuffers, SlotAllocator
from kv.mooncake_decode import MooncakeDecodeManager, MooncakeKVReceiver
from kv.mooncake_engine import MooncakeConfig
from kv.pool import KVPool
from kv.pool_layout import KV_LAYOUTS, KVLayout
from kv.transfer import KVPoll


def _emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _read_commands(out: queue.SimpleQueue[dict[str, Any]]) -> None:
    for line in sys.stdin:
        if line.strip():
            out.put(json.loads(line))
    out.put({"cmd": "exit"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--token", default=None)
    ap.add_argument("--layout", default=KVLayout.LAYER_MAJOR.value, choices=KV_LAYOUTS)
    ap.add_argument("--heartbeat", type=float, default=5.0, help="heartbeat_interval_s")
    args = ap.parse_args()

    pool = KVPool(num_layers=args.layers, num_pages=args.pages, page_size=args.page_size,
                  kv_heads=args.heads, head_dim=args.dim, dtype=getattr(torch, args.dtype),
                  layout=args.layout)
    metadata = MetadataBuffers(args.slots)
    slots = SlotAllocator(args.slots)
    mgr = MooncakeDecodeManager(pool, metadata, args.bootstrap,
                                config=MooncakeConfig(token=args.token,
                                                      heartbeat_interval_s=args.heartbeat))
    _emit(event="ready", session=mgr.session, kv_ptr=pool.buffer.data_ptr(),
          num_pages=pool.num_pages, page_bytes=pool.page_bytes)

    commands: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(commands,), daemon=True).start()
    live: dict[int, tuple[MooncakeKVReceiver, list[int], int]] = {}
    reported: set[int] = set()
    while True:
        try:
            cmd = commands.get(timeout=0.01)
        except queue.Empty:
            cmd = None
        if cmd is not None:
            kind, room = cmd["cmd"], cmd.get("room", 0)
            if kind == "exit":
                break
            if kind == "recv":
                pages = pool.allocator.alloc(cmd["num_pages"])
                slot = slots.alloc()
                if pages is None or slot is None:
                    _emit(event="full", room=room)
                    continue
                metadata.clear(slot)
                rx = mgr.create_receiver(args.bootstrap, room)
                rx.init()
                rx.send_metadata(pages, slot)
                live[room] = (rx, pages, slot)
                _emit(event="posted", room=room, pages=pages, slot=slot)
            elif kind == "abort":
                live[room][0].abort()
            elif kind == "release":
                rx, pages, slot = live.pop(room)
                rx.clear()
                pool.allocator.free(pages)
                slots.free(slot)
                reported.discard(room)
            elif kind == "dump":
                torch.save({"kv": pool.by_layer().contiguous(), "room": metadata.room[:, 0].clone(),
                            "rows": {n: getattr(metadata, n).clone()
                                     for n in MetadataBuffers.FIELDS}}, cmd["path"])
                _emit(event="dumped", path=cmd["path"])
        for room, (rx, _, _) in live.items():
            status = rx.poll()
            if status in (KVPoll.SUCCESS, KVPoll.FAILED) and room not in reported:
                reported.add(room)
                reason = rx.failure_exception().reason if status == KVPoll.FAILED else ""
                _emit(event="done", room=room, status=status.name, reason=reason)
    mgr.close()


if __name__ == "__main__":
    main()
