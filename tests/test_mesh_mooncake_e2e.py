"""End to end over Mooncake: a prefill mesh feeds a decode server of another layout.

One launch of three gloo ranks runs two cases: a prefill at TP 2 (ranks 0-1), then a prefill
at PP 2 (ranks 0-1), each feeding a decode at TP 1 x PP 1 (rank 2). Every prefill rank runs
the mesh scheduler over its shard of the reference model and its own Mooncake engine,
registered at rank 0's bootstrap endpoint with its place; it writes its heads (TP) or its
stage's layers (PP) into the decode rank's pages, which completes a room once every source
reported. The decode server decodes from the KV it received; its outputs must equal the
colocated run of the unsharded model, token for token, the prefill ranks' answers must agree,
and no side holds a page at the end.
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
from kv.rank_table import RankPlace
from lifecycle import SamplingParams
from scheduler.decode import DecodePeer
from scheduler.messages import DecodeResponse, NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.model.sharded import ShardedLlama
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.mesh import MeshControl, build_mesh_control
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.stepping import step_until
from tests.distributed import free_port, gloo_group, run_ranks

pytestmark = [pytest.mark.mooncake, pytest.mark.multiprocess]

WORLD = 3
LAUNCH_TIMEOUT_S = 300.0
PAGE = 4
CONFIG = ModelConfig(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                     max_position=256, seed=17)
# name: (tp_size, pp_size) of the prefill on ranks 0-1; the decode (rank 2) is one rank.
CASES = {"tp2": (2, 1), "pp2": (1, 2)}
NEW_TOKENS = 6
PROMPTS = [[(13 * i + 7 * j + 2) % 250 for j in range(3 + 11 * i)] for i in range(4)]
SAMPLING = SamplingParams(NEW_TOKENS, ignore_eos=True)
DEADLINE_S = 120.0


def request(i: int, port: int) -> NewRequest:
    return NewRequest(f"r{i}", PROMPTS[i], bootstrap_host="127.0.0.1", bootstrap_port=port,
                      bootstrap_room=1000 + i, sampling=SAMPLING)


def _prefill(control: MeshControl, port: int) -> list[list[object]]:
    mesh = control.mesh
    model = ShardedLlama(CONFIG, mesh)
    pool = model.make_pool(num_pages=64, page_size=PAGE)
    metadata = MetadataBuffers(8)
    place = RankPlace(tp_rank=mesh.tp_rank, tp_size=mesh.tp_size, pp_rank=mesh.pp_rank,
                      pp_size=mesh.pp_size, kv_heads=CONFIG.kv_heads, num_layers=CONFIG.layers,
                      layer_start=model.layers.start, layer_stop=model.layers.stop)
    server = (BootstrapServer(port=port, expected_ranks=mesh.tp_size * mesh.pp_size)
              if control.first else None)
    kv = MooncakeKVManager(pool, metadata, place=place)
    responses: list[Response] = []
    try:
        dist.barrier()  # the endpoint is up before any rank registers
        kv.register_to_bootstrap(f"127.0.0.1:{port}")
        if server is not None:
            server.add_refusal_listener(kv.peer_refused)  # as pdlife serve wires it
        dist.barrier()  # every prefill rank registered before the decode rank looks them up
        sched = PrefillScheduler(
            config=SchedulerConfig(page_size=PAGE, chunked_prefill_size=16,
                                   check_invariants=True),
            runner=PagedModelRunner(model, pool), kv=kv, metadata=metadata,
            slots=SlotAllocator(8), on_response=responses.append,
            **control.scheduler_options(),
        )
        if control.first:
            for i in range(len(PROMPTS)):
                sched.submit(request(i, port))
        step_until_idle(sched, control, kv)
        sched.close()
        assert sched.pages_held == 0
    finally:
        dist.barrier()  # the decode rank has its KV before any engine closes
        kv.close()
        if server is not None:
            server.close()
    return [[r.rid, r.state.name, r.first_token] for r in responses]


def step_until_idle(sched: PrefillScheduler, control: MeshControl,
                    kv: MooncakeKVManager) -> None:
    end = time.monotonic() + DEADLINE_S
    started = False
    while True:
        sched.step()
        started |= len(sched.lifecycle) > 0
        if control.all_agree(started and sched.idle()):
            return
        if time.monotonic() > end:
            raise TimeoutError(
                f"the prefill mesh did not finish in {DEADLINE_S} s: {sched.lifecycle.counts()}"
                f"; control messages dropped: {kv.dropped_messages.snapshot()}")


def _decode(port: int) -> list[list[object]]:
    model = LlamaModel(CONFIG)
    pool = model.make_pool(num_pages=64, page_size=PAGE)
    metadata = MetadataBuffers(8)
    dist.barrier()
    dist.barrier()
    kv = MooncakeDecodeManager(pool, metadata, f"127.0.0.1:{port}")
    responses: list[DecodeResponse] = []
    try:
        peer = DecodePeer(runner=PagedModelRunner(model, pool), kv=kv, metadata=metadata,
                          slots=SlotAllocator(8), eos_token_id=None,
                          on_response=responses.append)
        for i in range(len(PROMPTS)):
            peer.submit(request(i, port))
        step_until(peer.step, lambda: len(responses) == len(PROMPTS), DEADLINE_S,
                   lambda: f"decode answered {len(responses)} of {len(PROMPTS)} requests")
        step_until(peer.step, peer.idle, DEADLINE_S, lambda: "the decode peer kept requests")
        assert pool.allocator.in_use() == 0
    finally:
        dist.barrier()
        kv.close()
    return [[r.rid, r.state.name, list(r.output_ids)] for r in responses]


def _worker(rank: int, gloo_port: int, ports: dict[str, int], out_dir: str) -> None:
    with gloo_group(rank, WORLD, gloo_port):
        controls = {name: build_mesh_control(tp, pp, (0, 1)) for name, (tp, pp) in CASES.items()}
        for name, control in controls.items():
            port = ports[name]
            result = _decode(port) if control is None else _prefill(control, port)
            Path(out_dir, f"{name}-{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mesh_mooncake")
    ports = {name: free_port() for name in CASES}
    run_ranks(_worker, (free_port(), ports, str(out)), WORLD, LAUNCH_TIMEOUT_S)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_from_a_prefill_mesh_equals_the_colocated_run(name: str, results: Path) -> None:
    colocated = ReferenceModel(LlamaModel(CONFIG))
    want = {f"r{i}": colocated.generate(p, NEW_TOKENS, ignore_eos=True)
            for i, p in enumerate(PROMPTS)}
    decoded = json.loads((results / f"{name}-2.json").read_text())
    assert {rid: (state, out) for rid, state, out in decoded} == {
        rid: ("DONE", out) for rid, out in want.items()}
    prefill = [json.loads((results / f"{name}-{r}.json").read_text()) for r in (0, 1)]
    assert prefill[0] == prefill[1]
    assert sorted(prefill[0]) == sorted([rid, "DONE", out[0]] for rid, out in want.items())
