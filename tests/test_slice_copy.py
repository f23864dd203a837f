"""Head slices land byte-exact between pools of different TP sizes (kv.slice_copy).

One process holds a pool per rank. Every prefill rank's pool holds its heads of one random
whole-model KV (and random bytes elsewhere); after every prefill rank copied its slices, each
decode rank's pages must hold exactly its heads of that KV, and nothing else may change.
"""

from __future__ import annotations

import pytest
import torch

from kv.layouts import SlicePlan, TPLayout, plan_slices
from kv.pool import KVGeometryError, KVPool
from kv.pool_layout import KVLayout
from kv.slice_copy import check_sliced_geometry, copy_head_slices

LAYERS, PAGE_SIZE, HEAD_DIM, NUM_PAGES = 3, 4, 8, 40


def _pool(kv_heads: int, seed: int, layout: KVLayout = KVLayout.LAYER_MAJOR) -> KVPool:
    pool = KVPool(num_layers=LAYERS, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                  kv_heads=kv_heads, head_dim=HEAD_DIM, dtype=torch.bfloat16, model="m",
                  layout=layout)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    return pool


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _land(plan: SlicePlan, src_pages: list[int], dst_pages: list[int],
          layout: KVLayout = KVLayout.LAYER_MAJOR) -> None:
    """Copy a request's random whole-model KV from every prefill rank to the decode ranks (pools
    in ``layout``) and check what every decode pool holds afterwards."""
    heads = plan.prefill.kv_heads
    gen = torch.Generator().manual_seed(len(src_pages) * 1000 + heads)
    model_kv = torch.randn((LAYERS, 2, len(src_pages), PAGE_SIZE, heads, HEAD_DIM),
                           generator=gen).to(torch.bfloat16)
    prefill = []
    for p in range(plan.prefill.tp_size):
        pool = _pool(plan.prefill.heads_per_rank, seed=p, layout=layout)
        held = plan.prefill.heads_of(p)
        pool.by_layer()[:, :, src_pages] = model_kv[:, :, :, :, held.start : held.stop]
        prefill.append(pool)
    decode = [_pool(plan.decode.heads_per_rank, seed=100 + d, layout=layout)
              for d in range(plan.decode.tp_size)]
    before = [pool.by_layer().clone() for pool in decode]

    for p, src in enumerate(prefill):
        for d in plan.destinations(p):
            check_sliced_geometry(src, decode[d], plan)
            copy_head_slices(src, decode[d], src_pages, dst_pages, plan.between(p, d))

    others = [i for i in range(NUM_PAGES) if i not in set(dst_pages)]
    for d, pool in enumerate(decode):
        held = plan.decode.heads_of(d)
        want = model_kv[:, :, :, :, held.start : held.stop]
        landed = pool.by_layer()
        assert torch.equal(_bits(landed[:, :, dst_pages]), _bits(want)), f"decode rank {d}"
        assert torch.equal(_bits(landed[:, :, others]), _bits(before[d][:, :, others]))


#: A request's pages in a few runs (one copy per run and slice), and scattered over more runs
#: than the per-run path takes (one gather and one scatter per slice).
FEW_RUNS = ([3, 4, 5, 9, 10, 20, 21, 22], [30, 31, 0, 1, 2, 3, 17, 18])
MANY_RUNS = (list(range(0, 40, 2)), list(range(39, 0, -2)))


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("pages", [FEW_RUNS, MANY_RUNS], ids=["few_runs", "many_runs"])
@pytest.mark.parametrize("decode_tp", [1, 2, 4])
@pytest.mark.parametrize("prefill_tp", [1, 2, 4])
def test_split_heads_land_byte_exact(
    prefill_tp: int, decode_tp: int, pages: tuple[list[int], list[int]], layout: KVLayout
) -> None:
    _land(plan_slices(TPLayout(prefill_tp, 8), TPLayout(decode_tp, 8)), *pages, layout=layout)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"),
                         [(4, 1), (4, 2), (4, 4), (1, 4), (2, 4), (2, 1)])
def test_gqa_replicated_heads_land_byte_exact(prefill_tp: int, decode_tp: int, heads: int) -> None:
    _land(plan_slices(TPLayout(prefill_tp, heads), TPLayout(decode_tp, heads)), *FEW_RUNS)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 4), (2, 4), (4, 2), (4, 1), (2, 2)])
def test_mla_latent_lands_byte_exact(prefill_tp: int, decode_tp: int) -> None:
    plan = plan_slices(TPLayout(prefill_tp, 1, mla=True), TPLayout(decode_tp, 1, mla=True))
    _land(plan, *MANY_RUNS)


def test_pools_that_disagree_beyond_heads_are_refused() -> None:
    plan = plan_slices(TPLayout(2, 8), TPLayout(1, 8))
    src = _pool(4, seed=0)
    wrong_page = KVPool(num_layers=LAYERS, num_pages=NUM_PAGES, page_size=8, kv_heads=8,
                        head_dim=HEAD_DIM, dtype=torch.bfloat16, model="m")
    with pytest.raises(KVGeometryError, match="page_size: 4 vs 8"):
        check_sliced_geometry(src, wrong_page, plan)
    with pytest.raises(KVGeometryError, match="decode kv_heads: pool 4 vs layout 8"):
        check_sliced_geometry(src, _pool(4, seed=1), plan)
    with pytest.raises(KVGeometryError, match="reaches past"):
        copy_head_slices(src, _pool(2, seed=1), [0], [0], plan.between(1, 0))
