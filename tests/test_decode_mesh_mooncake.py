"""End to end over Mooncake: a prefill at TP 1 feeds a decode server at TP 2.

One launch of three gloo ranks: rank 0 is the prefill (one rank, the unsharded reference
model, its own bootstrap endpoint); ranks 1-2 are a decode server at TP 2, each rank running
:class:`scheduler.decode.mesh.MeshDecodePeer` over its shard of the model
(:class:`~scheduler.model.sharded.ShardedLlama`) and its own Mooncake engine, registered with
its place, so the prefill writes each decode rank its head slice of every page. The decode
ranks decode in lockstep (relayed requests, agreed polls, exact TP sums); their outputs must
equal the colocated run of the unsharded model, token for token, on both ranks. One request's
prompt does not fit the prefill's pool: the prefill refuses its room, and the request fails
on both decode ranks. One request reaches only the decode and is aborted by its client while
it waits for its KV: the prefill drops its early destinations and tells both decode ranks, so
they free its pages. At the end no side holds a page, a slot or a room.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from kv.bootstrap import BootstrapServer
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.mooncake import MooncakeKVManager
from kv.mooncake_decode import MooncakeDecodeManager
from lifecycle import DecodeState, SamplingParams
from scheduler.decode.mesh import DecodeMeshControl, MeshDecodePeer, build_decode_mesh
from scheduler.messages import DecodeResponse, NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.model.sharded import ShardedLlama
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.stepping import step_or_rest, step_until
from tests.distributed import free_port, gloo_group, run_ranks

pytestmark = [pytest.mark.mooncake, pytest.mark.multiprocess]

WORLD = 3
DECODE_RANKS = (1, 2)
LAUNCH_TIMEOUT_S = 300.0
PAGE = 4
SLOTS = 8
CONFIG = ModelConfig(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                     max_position=256, seed=23)
NEW_TOKENS = 6
PROMPTS = [[(11 * i + 5 * j + 3) % 250 for j in range(3 + 9 * i)] for i in range(4)]
# Longer than the prefill's pool (PREFILL_PAGES pages), within the decode's.
TOO_LONG = [(7 * j + 1) % 250 for j in range(90)]
PREFILL_PAGES, DECODE_PAGES = 20, 64
SAMPLING = SamplingParams(NEW_TOKENS, ignore_eos=True)
DEADLINE_S = 120.0


def requests(port: int) -> list[NewRequest]:
    prompts = [*PROMPTS, TOO_LONG]
    return [NewRequest(f"r{i}", p, bootstrap_host="127.0.0.1", bootstrap_port=port,
                       bootstrap_room=2000 + i, sampling=SAMPLING)
            for i, p in enumerate(prompts)]


def orphan(port: int) -> NewRequest:
    """A request only the decode gets (the router lost its prefill half), aborted by its
    client once it waits for its KV."""
    return NewRequest("orphan", PROMPTS[1], bootstrap_host="127.0.0.1", bootstrap_port=port,
                      bootstrap_room=2999, sampling=SAMPLING)


def _prefill(port: int) -> list[list[object]]:
    model = LlamaModel(CONFIG)
    pool = model.make_pool(num_pages=PREFILL_PAGES, page_size=PAGE)
    metadata = MetadataBuffers(SLOTS)
    server = BootstrapServer(port=port, expected_ranks=1)
    kv = MooncakeKVManager(pool, metadata)
    responses: list[Response] = []
    try:
        kv.register_to_bootstrap(f"127.0.0.1:{port}")
        server.add_refusal_listener(kv.peer_refused)  # as pdlife serve wires it
        dist.barrier()  # registered before the decode ranks look the prefill up
        sched = PrefillScheduler(
            config=SchedulerConfig(page_size=PAGE, chunked_prefill_size=16,
                                   check_invariants=True),
            runner=PagedModelRunner(model, pool), kv=kv, metadata=metadata,
            slots=SlotAllocator(SLOTS), on_response=responses.append,
        )
        reqs = requests(port)
        for req in reqs:
            sched.submit(req)
        step_until(sched.step, lambda: len(responses) == len(reqs) and sched.idle(), DEADLINE_S,
                   lambda: f"prefill answered {len(responses)} of {len(reqs)} requests "
                           f"({sched.lifecycle.counts()}; control messages dropped: "
                           f"{kv.dropped_messages.snapshot()})")
        sched.close()
        assert sched.pages_held == 0
        assert kv.live_rooms() == 0
    finally:
        dist.barrier()  # the decode ranks have their KV before the engine closes
        kv.close()
        server.close()
    return [[r.rid, r.state.name, r.first_token] for r in responses]


def _decode(control: DecodeMeshControl, port: int) -> dict[str, object]:
    model = ShardedLlama(CONFIG, control.mesh)
    pool = model.make_pool(num_pages=DECODE_PAGES, page_size=PAGE)
    metadata = MetadataBuffers(SLOTS)
    slots = SlotAllocator(SLOTS)
    dist.barrier()
    kv = MooncakeDecodeManager(pool, metadata, f"127.0.0.1:{port}",
                               place=control.rank_place(num_layers=CONFIG.layers,
                                                                  kv_heads=CONFIG.kv_heads))
    responses: list[DecodeResponse] = []
    try:
        peer = MeshDecodePeer(control, runner=PagedModelRunner(model, pool), kv=kv,
                              metadata=metadata, slots=slots, on_response=responses.append)
        reqs = [*requests(port), orphan(port)]
        if control.first:
            for req in reqs:
                peer.submit(req)
        end = time.monotonic() + DEADLINE_S
        while not control.all_agree(len(responses) == len(reqs) and peer.idle()):
            waiting = peer.lifecycle.get("orphan")
            if (control.first and len(responses) == len(reqs) - 1 and waiting is not None
                    and waiting.state is DecodeState.RECEIVING):
                peer.abort("orphan")  # its destination went to a prefill that never had it
            step_or_rest(peer.step)
            peer.check_invariants()
            assert time.monotonic() < end, (
                f"decode answered {len(responses)} of {len(reqs)} ({peer.lifecycle.counts()}; "
                f"control messages dropped: {kv.dropped_messages.snapshot()})")
        assert pool.allocator.in_use() == 0
        assert slots.available() == SLOTS
        assert kv.live_rooms() == 0
    finally:
        dist.barrier()
        kv.close()
    return {"responses": [[r.rid, r.state.name, r.reason.value if r.reason else None,
                           list(r.output_ids)] for r in responses],
            "steps": peer.steps}


def _worker(rank: int, gloo_port: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, WORLD, gloo_port):
        control = build_decode_mesh(len(DECODE_RANKS), DECODE_RANKS)
        result = _prefill(port) if control is None else _decode(control, port)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("decode_mesh_mooncake")
    run_ranks(_worker, (free_port(), free_port(), str(out)), WORLD, LAUNCH_TIMEOUT_S)
    return out


def test_decode_at_tp2_equals_the_colocated_run(results: Path) -> None:
    colocated = ReferenceModel(LlamaModel(CONFIG))
    want = {f"r{i}": colocated.generate(p, NEW_TOKENS, ignore_eos=True)
            for i, p in enumerate(PROMPTS)}
    ranks = [json.loads((results / f"{r}.json").read_text()) for r in DECODE_RANKS]
    assert ranks[0] == ranks[1]  # the same answers and the same number of steps
    decoded = {rid: (state, reason, out) for rid, state, reason, out in ranks[0]["responses"]}
    too_long = f"r{len(PROMPTS)}"
    assert decoded.pop(too_long)[:2] == ("FAILED", "bootstrap_failed")
    assert decoded.pop("orphan") == ("FAILED", "aborted", [])
    assert decoded == {rid: ("DONE", None, out) for rid, out in want.items()}
    prefill = {rid: (state, first) for rid, state, first in
               json.loads((results / "0.json").read_text())}
    assert prefill.pop(too_long)[0] == "FAILED"
    assert prefill == {rid: ("DONE", out[0]) for rid, out in want.items()}
