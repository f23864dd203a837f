"""The prefill scheduler on a TP x PP mesh of gloo ranks, with the fake transfer backend.

One launch of four ranks runs three meshes: TP 2 on ranks 0-1 beside PP 2 on ranks 2-3, then TP
2 x PP 2 on all four (in the overlap loop). On each mesh only the first rank takes requests (the
relay hands them to the others); one rank of each mesh injects bootstrap and transfer failures
and delays its handshakes. Every rank records its lifecycle after every pass, its answers and,
for each request it sent, the KV of its pool; the tests compare them with each other and with
the unsharded model here: every rank of a mesh takes the same transitions on the same pass, a
failure on one rank or stage fails the request on every rank, the requests that succeed have the
colocated model's first token, each rank's KV is exactly its heads of its layers of the
unsharded KV, and no page or slot is left held.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kv.fake import FakeKVManager, FaultPlan
from kv.layouts import TPLayout
from kv.metadata import MetadataBuffers, SlotAllocator
from lifecycle import PrefillState
from scheduler.dist.relay import InboxRelay, RelayError, decode_items, encode_items
from scheduler.messages import AbortRequest, FlushCache, InboxItem, NewRequest, Response
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.model.sharded import ShardedLlama, stage_layers
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.mesh import MeshControl, build_mesh_control
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch, ForwardItem
from tests.distributed import free_port, run_ranks

WORLD = 4
LAUNCH_TIMEOUT_S = 240.0
PAGE = 4
CONFIG = ModelConfig(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                     max_position=256, seed=13)
# name: (tp_size, pp_size, ranks, the rank that injects faults), in the order of the launch.
MESHES: dict[str, tuple[int, int, tuple[int, ...], int]] = {
    "tp2": (2, 1, (0, 1), 1),
    "pp2": (1, 2, (2, 3), 3),
    "tp2_pp2": (2, 2, (0, 1, 2, 3), 2),
}
# Meshes that run the overlap loop: the forward's collectives on the device thread, the
# scheduler's agreements on the loop's.
OVERLAP = {"tp2_pp2"}
REQUESTS = 14
ABORTED = "r3"  # aborted by its client on the pass it arrives
FAULTS = FaultPlan(seed=21, bootstrap_failure=0.2, transfer_failure=0.2,
                   handshake_delay_polls=2, transfer_delay_polls=1)


def prompt(i: int) -> list[int]:
    return [(11 * i + 5 * j + 1) % 250 for j in range(3 + 5 * i % 37)]


def room(i: int) -> int:
    return 100 + i


def _run(control: MeshControl, faulty: bool, overlap: bool) -> dict[str, Any]:
    model = ShardedLlama(CONFIG, control.mesh)
    pool = model.make_pool(num_pages=48, page_size=PAGE)
    responses: list[Response] = []
    sched = PrefillScheduler(
        config=SchedulerConfig(page_size=PAGE, chunked_prefill_size=16, max_prefill_tokens=48,
                               check_invariants=True),
        runner=PagedModelRunner(model, pool),
        kv=FakeKVManager(FAULTS if faulty else None),
        metadata=MetadataBuffers(4),
        slots=SlotAllocator(4),
        on_response=responses.append,
        overlap=overlap,
        **control.scheduler_options(),
    )
    if control.first:
        for i in range(REQUESTS):
            sched.submit(NewRequest(f"r{i}", prompt(i), bootstrap_host="decode",
                                    bootstrap_room=room(i)))
        sched.abort(ABORTED)
    passes: list[list[list[str]]] = []
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    while True:
        sched.step()
        sched.check_invariants()
        live = sorted(sched.lifecycle.live(), key=lambda r: r.rid)
        passes.append([[r.rid, r.state.name] for r in live])
        for req in live:
            if req.state is PrefillState.TRANSFERRING and req.rid not in kv:
                n, pages = len(req.input_ids), list(req.pages)
                kv[req.rid] = tuple(  # type: ignore[assignment]
                    half[:, pages].flatten(1, 2)[:, :n].clone()
                    for half in (pool.by_layer()[:, 0], pool.by_layer()[:, 1]))
        if control.all_agree(sched.idle()):
            break
    sched.close()
    return {
        "responses": [[r.rid, r.state.name, r.reason and r.reason.value, r.first_token]
                      for r in responses],
        "passes": passes,
        "kv": kv,
        "pages_held": sched.pages_held,
        "slots_free": sched.slots.available(),
        "tp_rank": control.mesh.tp_rank,
        "pp_rank": control.mesh.pp_rank,
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        controls = {name: build_mesh_control(tp, pp, ranks)
                    for name, (tp, pp, ranks, _) in MESHES.items()}
        for name, control in controls.items():
            if control is not None:
                result = _run(control, faulty=rank == MESHES[name][3],
                              overlap=name in OVERLAP)
                torch.save(result, Path(out_dir, f"{name}-{rank}.pt"))
        # A rank that is not the first cannot take requests itself.
        relay = InboxRelay(dist.group.WORLD, src=0)
        if rank == 1:
            try:
                relay.exchange([AbortRequest("x")])
            except RelayError as exc:
                Path(out_dir, "refused.txt").write_text(str(exc))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mesh")
    run_ranks(_worker, (free_port(), str(out)), WORLD, LAUNCH_TIMEOUT_S)
    return out


def unsharded_kv(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded model's K and V of prompt ``i``, ``[layers, tokens, heads, head_dim]``."""
    ids = prompt(i)
    pages = -(-len(ids) // PAGE)
    model = LlamaModel(CONFIG)
    pool = model.make_pool(num_pages=pages, page_size=PAGE)
    PagedModelRunner(model, pool).forward(
        ForwardBatch((ForwardItem("x", ids, 0, tuple(range(pages))),)))
    return tuple(  # type: ignore[return-value]
        half.flatten(1, 2)[:, : len(ids)] for half in (pool.by_layer()[:, 0],
                                                       pool.by_layer()[:, 1]))


def expected(i: int) -> tuple[str, str | None]:
    if f"r{i}" == ABORTED:
        return "FAILED", "aborted"
    faults = FAULTS.decide(room(i))
    if faults.bootstrap_failure:
        return "FAILED", "bootstrap_failed"
    if faults.transfer_failure:
        return "FAILED", "transfer_failed"
    return "DONE", None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(MESHES))
def test_every_rank_of_a_mesh_takes_the_same_transitions(name: str, results: Path) -> None:
    ranks = [torch.load(results / f"{name}-{r}.pt") for r in MESHES[name][2]]
    first = ranks[0]
    for got in ranks[1:]:
        assert got["passes"] == first["passes"]
        assert got["responses"] == first["responses"]
    for got in ranks:
        assert (got["pages_held"], got["slots_free"]) == (0, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(MESHES))
def test_a_failure_on_one_rank_fails_the_request_everywhere(name: str, results: Path) -> None:
    got = torch.load(results / f"{name}-{MESHES[name][2][0]}.pt")
    outcome = {rid: (state, reason) for rid, state, reason, _ in got["responses"]}
    assert len(got["responses"]) == len(outcome) == REQUESTS
    assert outcome == {f"r{i}": expected(i) for i in range(REQUESTS)}
    reasons = {reason for _, reason in outcome.values()}
    assert {"bootstrap_failed", "transfer_failed", None} <= reasons, "no fault was injected"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(MESHES))
def test_first_tokens_and_kv_slices_equal_the_unsharded_model(name: str, results: Path) -> None:
    tp, pp, members, _ = MESHES[name]
    colocated = ReferenceModel(LlamaModel(CONFIG))
    heads = TPLayout(tp, CONFIG.kv_heads)
    done = [i for i in range(REQUESTS) if expected(i)[0] == "DONE"]
    for rank in members:
        got = torch.load(results / f"{name}-{rank}.pt")
        tokens = {rid: token for rid, state, _, token in got["responses"] if state == "DONE"}
        layers = stage_layers(CONFIG.layers, pp, got["pp_rank"])
        mine = heads.heads_of(got["tp_rank"])
        for i in done:
            assert [tokens[f"r{i}"]] == colocated.generate(prompt(i), 1, ignore_eos=True)
            for half, want in zip(got["kv"][f"r{i}"], unsharded_kv(i), strict=True):
                part = want[layers.start : layers.stop, :, mine.start : mine.stop]
                assert same_bytes(half, part), f"rank {rank} r{i}"


@pytest.mark.multiprocess
def test_only_the_first_rank_takes_requests(results: Path) -> None:
    assert "only rank 0 takes them" in (results / "refused.txt").read_text()


def test_relayed_requests_keep_every_field() -> None:
    from lifecycle import GrammarSpec, SamplingParams

    items: list[InboxItem] = [
        NewRequest("a", [1, 2, 3], bootstrap_host="h", bootstrap_port=7, bootstrap_room=9,
                   sampling=SamplingParams(5, (2,), temperature=0.5, seed=3, stop=("x",),
                                           grammar=GrammarSpec("regex", "a+"))),
        AbortRequest("b"),
        FlushCache(7),
        AbortRequest("d", shutdown=True),
        AbortRequest("e", peer="bootstrap_timeout (500): no destination"),
        NewRequest("c", [4], bootstrap_host="2.2.2.2"),
    ]
    assert decode_items(encode_items(items)) == items
    with pytest.raises(RelayError, match="does not decode"):
        decode_items(b"\x91\x93\xa3new")
