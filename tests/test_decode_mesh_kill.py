"""SIGKILL of one decode rank while a request's transfer is pending.

Two servers, each its own gloo world, as in a deployment: a prefill at TP 2 and a decode at
TP 2 (:class:`scheduler.decode.mesh.MeshDecodePeer`), over Mooncake, with the sharded
reference model. The steps are ordered by events, never by sleeps:

1. the prefill ranks register; the prefill admits one request (its senders exist);
2. only then does the decode take the request; each decode rank gives its destination to
   the prefill rank that writes its heads;
3. each prefill rank waits until its sender holds its decode rank's destination (the
   manager's readiness queue), so the prefill has not computed or written anything yet;
4. the test SIGKILLs decode rank 1 and waits for it to be gone;
5. the prefill ranks step on: rank 1's write into the dead rank fails, and the MIN of the
   two ranks' polls fails the request on both.

Both prefill ranks must answer FAILED (the same reason), and hold no page, metadata slot or
room afterwards. The surviving decode rank's next collective with the dead one fails: the
decode group is broken and its loop ends (a decode TP group does not survive a lost rank).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from kv.transfer import KVPoll
from lifecycle import SamplingParams
from scheduler.decode.mesh import MeshDecodePeer, build_decode_mesh
from scheduler.messages import NewRequest, Response
from scheduler.model.reference import ModelConfig, PagedModelRunner
from scheduler.model.sharded import ShardedLlama
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.mesh import MeshControl, build_mesh_control
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.stepping import step_or_rest
from tests.distributed import free_port, gloo_group

pytestmark = [pytest.mark.mooncake, pytest.mark.multiprocess]

TP = 2
PAGE = 4
SLOTS = 4
PAGES = 32
CONFIG = ModelConfig(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                     max_position=128, seed=29)
PROMPT = [(5 * j + 2) % 250 for j in range(21)]
ROOM = 4242
STEP_TIMEOUT_S = 60.0  # any one phase of a rank
GLOO_TIMEOUT = timedelta(seconds=60)
LAUNCH_TIMEOUT_S = 240.0


def request(port: int) -> NewRequest:
    return NewRequest("victim", PROMPT, bootstrap_host="127.0.0.1", bootstrap_port=port,
                      bootstrap_room=ROOM, sampling=SamplingParams(8, ignore_eos=True))


def _wait(event: Event, what: str) -> None:
    if not event.wait(STEP_TIMEOUT_S):
        raise TimeoutError(f"no {what} within {STEP_TIMEOUT_S} s")


def _prefill(rank: int, port: int, events: dict[str, Event], out_dir: str) -> None:
    control = build_mesh_control(TP, 1)
    assert control is not None
    model = ShardedLlama(CONFIG, control.mesh)
    pool = model.make_pool(num_pages=PAGES, page_size=PAGE)
    metadata = MetadataBuffers(SLOTS)
    slots = SlotAllocator(SLOTS)
    server = BootstrapServer(port=port, expected_ranks=TP) if control.first else None
    kv = MooncakeKVManager(pool, metadata,
                           place=control.rank_place(num_layers=CONFIG.layers,
                                                    kv_heads=CONFIG.kv_heads))
    responses: list[Response] = []
    try:
        dist.barrier()  # the endpoint is up
        kv.register_to_bootstrap(f"127.0.0.1:{port}")
        dist.barrier()
        if control.first:
            events["registered"].set()
        sched = PrefillScheduler(
            config=SchedulerConfig(page_size=PAGE, transfer_timeout=STEP_TIMEOUT_S,
                                   check_invariants=True),
            runner=PagedModelRunner(model, pool), kv=kv, metadata=metadata, slots=slots,
            on_response=responses.append, **control.scheduler_options(),
        )
        if control.first:
            sched.submit(request(port))
        _step_until(sched, control, lambda: "victim" in sched.lifecycle)
        if control.first:
            events["admitted"].set()
        _wait_for_destination(sched, kv)
        if control.all_agree(True) and control.first:
            events["handshaken"].set()
        _wait(events["killed"], "kill of decode rank 1")
        _step_until(sched, control, lambda: len(responses) == 1 and sched.idle())
        sched.close()
        result = {"answer": [(r.state.name, r.reason.value if r.reason else None)
                             for r in responses],
                  "pages": sched.pages_held, "free_slots": slots.available(),
                  "rooms": kv.live_rooms()}
        Path(out_dir, f"prefill-{rank}.json").write_text(json.dumps(result))
    finally:
        kv.close()
        if server is not None:
            server.close()


def _wait_for_destination(sched: PrefillScheduler, kv: MooncakeKVManager) -> None:
    """Block until this rank's sender holds its decode rank's destination, woken by the
    manager's readiness pushes; what was pushed goes back on the queue for the next pass."""
    req = sched.lifecycle.get("victim")
    assert req is not None and req.sender is not None
    end = time.monotonic() + STEP_TIMEOUT_S
    pushed: list[int] = []
    while req.sender.poll() < KVPoll.WAITING_FOR_INPUT:
        pushed.append(kv.ready.get(timeout=max(0.0, end - time.monotonic())))
    for room in pushed:
        kv.ready.put(room)


def _step_until(sched: PrefillScheduler, control: MeshControl, done: Any) -> None:
    end = time.monotonic() + STEP_TIMEOUT_S
    while not control.all_agree(done()):
        step_or_rest(sched.step)
        if time.monotonic() > end:
            raise TimeoutError(f"prefill: {sched.lifecycle.counts()} after {STEP_TIMEOUT_S} s")


def _decode(rank: int, port: int, events: dict[str, Event], out_dir: str) -> None:
    control = build_decode_mesh(TP, range(TP), timeout=GLOO_TIMEOUT)
    assert control is not None
    model = ShardedLlama(CONFIG, control.mesh)
    pool = model.make_pool(num_pages=PAGES, page_size=PAGE)
    metadata = MetadataBuffers(SLOTS)
    _wait(events["registered"], "prefill registration")
    kv = MooncakeDecodeManager(pool, metadata, f"127.0.0.1:{port}",
                               place=control.rank_place(num_layers=CONFIG.layers,
                                                                  kv_heads=CONFIG.kv_heads))
    peer = MeshDecodePeer(control, runner=PagedModelRunner(model, pool), kv=kv,
                          metadata=metadata, slots=SlotAllocator(SLOTS))
    if control.first:
        _wait(events["admitted"], "admission on the prefill")
        peer.submit(request(port))
    end = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while time.monotonic() < end:  # rank 1 is killed in here; rank 0's group breaks
            step_or_rest(peer.step)
    except Exception as exc:  # the collective with the killed rank failed
        Path(out_dir, f"decode-{rank}.json").write_text(json.dumps(type(exc).__name__))
    finally:
        kv.close()


def _rank(role: str, rank: int, gloo_port: int, port: int, events: dict[str, Event],
          out_dir: str) -> None:
    with gloo_group(rank, TP, gloo_port, GLOO_TIMEOUT.total_seconds()):
        (_prefill if role == "prefill" else _decode)(rank, port, events, out_dir)


def _all_alive(procs: dict[tuple[str, int], Any]) -> None:
    dead = {k: p.exitcode for k, p in procs.items() if p.exitcode is not None}
    assert not dead, f"ranks ended early: {dead}"


def test_sigkill_of_one_decode_rank_fails_the_request_on_every_prefill_rank(
    tmp_path: Path,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    events = {name: ctx.Event() for name in ("registered", "admitted", "handshaken", "killed")}
    port, gloo = free_port(), {"prefill": free_port(), "decode": free_port()}
    procs = {(role, r): ctx.Process(target=_rank, name=f"{role}-{r}",
                                    args=(role, r, gloo[role], port, events, str(tmp_path)))
             for role in ("prefill", "decode") for r in range(TP)}
    try:
        for p in procs.values():
            p.start()
        end = time.monotonic() + LAUNCH_TIMEOUT_S
        while not events["handshaken"].wait(1.0):
            _all_alive(procs)
            assert time.monotonic() < end, "the prefill never held both destinations"
        victim = procs[("decode", 1)]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(STEP_TIMEOUT_S)
        assert victim.exitcode == -signal.SIGKILL
        events["killed"].set()
        for key in [("prefill", 0), ("prefill", 1), ("decode", 0)]:
            procs[key].join(max(1.0, end - time.monotonic()))
            assert procs[key].exitcode == 0, f"{key} ended with {procs[key].exitcode}"
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    answers = [json.loads((tmp_path / f"prefill-{r}.json").read_text()) for r in range(TP)]
    assert answers[0] == answers[1]
    (state, reason), = answers[0]["answer"]
    assert (state, reason) == ("FAILED", "transfer_failed")  # at once, not at a timeout
    assert answers[0]["pages"] == 0 and answers[0]["rooms"] == 0
    assert answers[0]["free_slots"] == SLOTS
    # The surviving decode rank saw its group break and ended its loop.
    assert (tmp_path / "decode-0.json").exists()

