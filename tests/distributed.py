"""Launching a real process group for a test: spawn the ranks, wait with a deadline."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scheduler.dist.ports import free_port as free_port  # the tests take it from here


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int, timeout_s: float = 120.0) -> Iterator[None]:
    """This process as rank ``rank`` of a gloo group of ``world`` ranks that meet on loopback
    ``port`` (``timeout_s`` bounds one collective), with one torch thread (CI has two cores);
    the group is destroyed on the way out."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        torch.set_num_threads(1)
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(worker: Callable[..., None], args: tuple[Any, ...], world: int,
              timeout: float) -> None:
    """Run ``worker(rank, *args)`` in ``world`` spawned processes. A rank's exception reaches
    the test (and stops the others) as soon as it happens; past ``timeout`` every rank is
    killed and the test fails."""
    context = mp.start_processes(worker, args=args, nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish in {timeout} s")
