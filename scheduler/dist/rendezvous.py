"""How one host's rank processes meet: store files in a private directory, gloo on loopback.

The ranks of a ``pdlife serve`` worker (TP, PP and DP ranks, and the DP replicas' delayer
group) are processes of one host. torch's TCP store would listen on every interface, whatever
address it is given, and answer anyone unauthenticated; the groups meet through a
``FileStore`` instead, a file in a directory only this user may open (:class:`StoreFiles`,
mode 0700), which the launcher removes when the ranks are gone. Gloo's connections between the
ranks are bound to the loopback interface (:func:`join`): by default gloo binds them to the
address the host name resolves to, on most servers an external one. An environment that names
an interface in ``GLOO_SOCKET_IFNAME`` keeps it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

#: The environment variable gloo takes the interface of its connections from.
GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"
#: Where Linux lists the network interfaces, each with its flags.
_INTERFACES = Path("/sys/class/net")
_IFF_LOOPBACK = 0x8


class StoreFiles:
    """A private directory of store files, one per group; :meth:`remove` deletes it."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="pdlife-ranks-"))  # mode 0700

    def path(self, group: str) -> str:
        """The store file of ``group`` (created by the first rank that joins)."""
        return str(self.directory / group)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def loopback_interface(interfaces: Path = _INTERFACES) -> str | None:
    """The name of this host's loopback interface, None where none is listed."""
    try:
        entries = sorted(interfaces.iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            flags = int((entry / "flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & _IFF_LOOPBACK:
            return entry.name
    return None


def gloo_on_loopback() -> None:
    """Have the gloo groups this process creates from now on connect over loopback (unless
    the environment names an interface)."""
    if GLOO_INTERFACE not in os.environ and (name := loopback_interface()) is not None:
        os.environ[GLOO_INTERFACE] = name


def join(path: str, rank: int, world: int, timeout: timedelta) -> None:
    """Join the default gloo group of ``world`` ranks through the store file ``path``;
    ``timeout`` bounds the rendezvous and each collective."""
    gloo_on_loopback()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world, timeout=timeout)


def group(path: str, rank: int, world: int, start: timedelta, timeout: timedelta) -> Any:
    """A gloo group of its own (outside the default one) through the store file ``path``:
    ``start`` bounds the rendezvous, ``timeout`` each collective."""
    gloo_on_loopback()
    store = dist.FileStore(path, world)  # type: ignore[attr-defined]  # exported at run time
    store.set_timeout(start)
    return dist.ProcessGroupGloo(store, rank, world, timeout)
