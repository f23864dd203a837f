"""How a worker's rank processes meet (:mod:`scheduler.dist.rendezvous`): through store files
in a private directory, with gloo on loopback, so no rank listens on every interface."""

from __future__ import annotations

import json
import os
import stat
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kv.listeners import listening
from scheduler.dist import rendezvous
from tests.distributed import run_ranks

WORLD = 2
TIMEOUT = timedelta(seconds=120)


def _rank(rank: int, mesh: str, side: str, out: str) -> None:
    os.environ.pop(rendezvous.GLOO_INTERFACE, None)
    rendezvous.join(mesh, rank, WORLD, TIMEOUT)
    try:
        whole = torch.tensor([rank + 1])
        dist.all_reduce(whole)
        sub = dist.new_group([0, 1])  # as the meshes build theirs, through the same store
        in_sub = torch.tensor([10 * (rank + 1)])
        dist.all_reduce(in_sub, group=sub)
        apart = rendezvous.group(side, rank, WORLD, TIMEOUT, TIMEOUT)  # the delayer's
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
        apart.allgather([gathered], [torch.tensor([rank + 100])]).wait()
        dist.barrier()  # every rank has built every group before any looks at its sockets
        Path(out, f"{rank}.json").write_text(json.dumps({
            "sums": [int(whole), int(in_sub)],
            "gathered": [int(t) for t in gathered],
            "interface": os.environ.get(rendezvous.GLOO_INTERFACE),
            "listeners": [[lst.host, lst.port] for lst in listening()],
        }))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_ranks_meet_through_store_files_and_listen_on_loopback_only(tmp_path: Path) -> None:
    files = rendezvous.StoreFiles()
    try:
        assert stat.S_IMODE(files.directory.stat().st_mode) == 0o700
        run_ranks(_rank, (files.path("mesh"), files.path("delayer"), str(tmp_path)), WORLD,
                  120.0)
        assert {p.name for p in files.directory.iterdir()} <= {"delayer", "mesh"}
    finally:
        files.remove()
    assert not files.directory.exists()
    for rank in range(WORLD):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["sums"] == [3, 30]
        assert seen["gathered"] == [100, 101]
        assert seen["interface"] == rendezvous.loopback_interface() == "lo"
        assert seen["listeners"], "gloo listens for its peers"
        # A TCP store would listen on every interface (0.0.0.0 or ::), on rank 0.
        assert all(host in ("127.0.0.1", "::1") for host, _ in seen["listeners"]), seen


def _interface(root: Path, name: str, flags: int) -> None:
    (root / name).mkdir()
    (root / name / "flags").write_text(f"{flags:#x}\n")


def test_the_loopback_interface_is_the_one_flagged_loopback(tmp_path: Path) -> None:
    _interface(tmp_path, "eth0", 0x1003)
    _interface(tmp_path, "loop9", 0x9)  # IFF_UP | IFF_LOOPBACK, whatever its name
    (tmp_path / "odd").mkdir()  # no flags file: skipped
    assert rendezvous.loopback_interface(tmp_path) == "loop9"
    (tmp_path / "loop9" / "flags").write_text("0x1003\n")
    assert rendezvous.loopback_interface(tmp_path) is None
    assert rendezvous.loopback_interface(tmp_path / "absent") is None


def test_an_interface_the_environment_names_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rendezvous.GLOO_INTERFACE, "eth7")
    rendezvous.gloo_on_loopback()
    assert os.environ[rendezvous.GLOO_INTERFACE] == "eth7"
    monkeypatch.delenv(rendezvous.GLOO_INTERFACE)
    rendezvous.gloo_on_loopback()
    assert os.environ[rendezvous.GLOO_INTERFACE] == "lo"
