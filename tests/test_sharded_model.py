"""The reference model sharded over TP and PP ranks computes what one rank computes, bit for bit.

One launch of four gloo ranks runs every layout: TP 2 on ranks 0-1 while PP 2 runs on ranks 2-3,
then TP 4, then TP 2 x PP 2. Each rank runs the same workload (a chunked prefill with the
logits of every position, a batch of two requests, greedy decoding from the pool, the colocated
twin) and saves its results and its KV pool; the tests compare them with the unsharded model
here: the same logits and tokens, and each rank's pool holding exactly its heads of its layers.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kv.layouts import LayoutError, TPLayout
from scheduler.model.reference import (
    LlamaModel,
    ModelConfig,
    PagedModelRunner,
    ReferenceModel,
    greedy_decode_from_pool,
)
from scheduler.model.sharded import Mesh, ShardedLlama, ShardError, build_mesh, stage_layers
from scheduler.runner import ForwardBatch, ForwardItem
from tests.distributed import free_port, run_ranks

WORLD = 4
LAUNCH_TIMEOUT_S = 180.0
CONFIG = ModelConfig(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                     max_position=256, seed=11)
# name: (tp_size, pp_size, ranks), in the order the launch builds their meshes.
LAYOUTS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "tp2": (2, 1, (0, 1)),
    "pp2": (1, 2, (2, 3)),
    "tp4": (4, 1, (0, 1, 2, 3)),
    "tp2_pp2": (2, 2, (0, 1, 2, 3)),
}
PROMPT_A = [(7 * i + 3) % 250 for i in range(11)]
PROMPT_B = [42, 17, 99, 5, 250, 8]


def workload(model: LlamaModel) -> dict[str, Any]:
    """Prefill A in two chunks (with B beside its first), decode A from the pool, and run B's
    colocated twin; the results and the pool's K and V."""
    pool = model.make_pool(num_pages=12, page_size=4)
    runner = PagedModelRunner(model, pool)
    first = ForwardBatch((
        ForwardItem("a", PROMPT_A[:8], start=0, pages=(0, 1, 2)),
        ForwardItem("b", PROMPT_B, start=0, pages=(5, 6), all_logits=True),
    ))
    logits = runner.logits(first)
    last = runner.forward(ForwardBatch((ForwardItem("a", PROMPT_A[8:], 8, (0, 1, 2)),)))
    spare = iter((3, 4))
    decoded = greedy_decode_from_pool(
        runner, rid="a", pages=[0, 1, 2], seq_len=len(PROMPT_A), first_token=last[0],
        max_new_tokens=6, alloc_page=lambda: next(spare), ignore_eos=True,
    )
    return {
        "logits": logits,
        "decoded": decoded,
        "colocated": ReferenceModel(model).generate(PROMPT_B, 4, ignore_eos=True),
        "k": torch.stack([pool.k(layer) for layer in range(pool.num_layers)]),
        "v": torch.stack([pool.v(layer) for layer in range(pool.num_layers)]),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        meshes = {name: build_mesh(tp, pp, ranks) for name, (tp, pp, ranks) in LAYOUTS.items()}
        for name, mesh in meshes.items():
            if mesh is not None:
                result = workload(ShardedLlama(CONFIG, mesh))
                result.update(tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank)
                torch.save(result, Path(out_dir, f"{name}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    run_ranks(_worker, (free_port(), str(out)), WORLD, LAUNCH_TIMEOUT_S)
    return out


@pytest.fixture(scope="module")
def unsharded() -> dict[str, Any]:
    return workload(LlamaModel(CONFIG))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and bytes (a comparison that prints briefly when it fails)."""
    return (a.shape, a.dtype) == (b.shape, b.dtype) and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_rank_computes_the_unsharded_logits_and_tokens(
    layout: str, results: Path, unsharded: dict[str, Any]
) -> None:
    for rank in LAYOUTS[layout][2]:
        got = torch.load(results / f"{layout}-{rank}.pt")
        assert same_bytes(got["logits"], unsharded["logits"]), f"rank {rank}"
        assert got["decoded"] == unsharded["decoded"]
        assert got["colocated"] == unsharded["colocated"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_rank_writes_its_heads_of_its_layers(
    layout: str, results: Path, unsharded: dict[str, Any]
) -> None:
    tp, pp, ranks = LAYOUTS[layout]
    heads = TPLayout(tp, CONFIG.kv_heads)
    for rank in ranks:
        got = torch.load(results / f"{layout}-{rank}.pt")
        layers = stage_layers(CONFIG.layers, pp, got["pp_rank"])
        mine = heads.heads_of(got["tp_rank"])
        for half in ("k", "v"):
            want = unsharded[half][layers.start : layers.stop, :, :, mine.start : mine.stop]
            assert same_bytes(got[half], want), f"rank {rank} {half}"


def test_one_rank_is_the_whole_model() -> None:
    model, whole = ShardedLlama(CONFIG, Mesh.single()), LlamaModel(CONFIG)
    assert (model.config, model.fingerprint) == (CONFIG, whole.fingerprint)
    assert model.make_pool(num_pages=2, page_size=4).geometry == whole.make_pool(
        num_pages=2, page_size=4).geometry


def test_stages_hold_contiguous_layers() -> None:
    assert [stage_layers(5, 2, s) for s in range(2)] == [range(0, 2), range(2, 5)]
    assert [stage_layers(3, 3, s) for s in range(3)] == [range(i, i + 1) for i in range(3)]
    with pytest.raises(ShardError, match=r"pp_size must be in 1\.\.3"):
        stage_layers(3, 4, 0)


@pytest.mark.parametrize(
    ("mesh", "error", "problem"),
    [
        (Mesh(3, 1, 0, 0, (0, 1, 2)), ShardError, "heads"),
        (Mesh(1, 4, 0, 3, (0, 1, 2, 3)), ShardError, "pp_size"),
        (Mesh(4, 1, 0, 0, (0, 1, 2, 3)), LayoutError, "one must divide the other"),
    ],
)
def test_a_mesh_the_model_cannot_split_over_is_refused(
    mesh: Mesh, error: type[Exception], problem: str
) -> None:
    config = ModelConfig(hidden=32, layers=3, heads=12, kv_heads=3, head_dim=8,
                         intermediate=48) if error is LayoutError else CONFIG
    with pytest.raises(error, match=problem):
        ShardedLlama(config, mesh)
