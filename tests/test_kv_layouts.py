"""The two KV pool layouts: the views the models and backends read agree with the tensor, and the
models compute bit-for-bit the same logits over either layout (the reference model and SmolLM2).

The backends' byte-exact transfers in both layouts are in test_local_backend.py,
test_mooncake.py and the contract suite (test_transfer_contract.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import pytest
import torch

from kv.pool import KVGeometryError, KVPool
from kv.pool_layout import DEFAULT_KV_LAYOUT, KV_LAYOUTS, KVLayout, parse_kv_layout
from scheduler.cli.main import build_parser
from scheduler.cli.serve import serve_config
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.runner import ForwardBatch, ForwardItem
from tests.test_model import random_prompt

GEOMETRY = {"num_layers": 3, "num_pages": 5, "page_size": 4, "kv_heads": 2, "head_dim": 3}


def _numbered(layout: KVLayout) -> KVPool:
    """A pool whose every element holds its own index in layer-major order, so that the same
    value sits at the same (layer, K/V, page, slot, head, dim) in both layouts."""
    pool = KVPool(**GEOMETRY, layout=layout)
    layer_major = torch.arange(pool.buffer.numel(), dtype=torch.float32).view(
        KVLayout.LAYER_MAJOR.shape(**GEOMETRY))
    pool.by_layer().copy_(layer_major)
    return pool


@pytest.mark.parametrize("layout", list(KVLayout))
def test_every_view_reads_the_same_elements_in_both_layouts(layout: KVLayout) -> None:
    pool, reference = _numbered(layout), _numbered(KVLayout.LAYER_MAJOR)
    assert pool.buffer.shape == layout.shape(**GEOMETRY) and pool.buffer.is_contiguous()
    assert torch.equal(pool.by_layer(), reference.buffer)
    slots = torch.arange(pool.num_pages * pool.page_size)
    rows = pool.slot_rows(slots)
    for layer in range(pool.num_layers):
        assert pool.k(layer).shape == (5, 4, 2, 3)
        assert torch.equal(pool.k(layer), reference.buffer[layer, 0])
        assert torch.equal(pool.v(layer), reference.buffer[layer, 1])
        kv = pool.kv_slots(layer)
        assert torch.equal(kv[0][rows], reference.buffer[layer, 0].reshape(-1, 2, 3))
        assert torch.equal(kv[1][rows], reference.buffer[layer, 1].reshape(-1, 2, 3))


@pytest.mark.parametrize("layout", list(KVLayout))
def test_a_write_through_kv_slots_lands_in_that_layer_and_slot_only(layout: KVLayout) -> None:
    pool = KVPool(**GEOMETRY, layout=layout)
    slots = torch.tensor([0, 5, 19])  # page 0, page 1 offset 1, the last slot of the pool
    values = torch.ones(3, 2, 3)
    pool.kv_slots(1)[1].index_copy_(0, pool.slot_rows(slots), values)
    written = pool.by_layer().nonzero()[:, :4].unique(dim=0).tolist()
    assert written == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 4, 3]]  # layer, V, page, offset
    assert pool.buffer.sum() == values.sum()


@pytest.mark.parametrize("layout", list(KVLayout))
def test_a_run_of_pages_is_one_region_page_major_and_one_per_layer_half_layer_major(
    layout: KVLayout,
) -> None:
    pool = _numbered(layout)
    view = pool.page_view()
    assert pool.regions == (1 if layout is KVLayout.PAGE_MAJOR else 2 * pool.num_layers)
    assert view.shape == (pool.regions, pool.num_pages,
                          pool.region_page_bytes // pool.buffer.element_size())
    assert pool.region_page_bytes * pool.regions == pool.bytes_of_pages(1)
    flat = pool.buffer.view(-1)
    elems = view.shape[2]
    for region, page in itertools.product(range(pool.regions), range(pool.num_pages)):
        start = (region * pool.num_pages + page) * elems  # where the Mooncake writer looks
        assert torch.equal(view[region, page], flat[start : start + elems])
    assert view[0, 1:4].is_contiguous()  # a run of three pages is one region


def test_layouts_are_named_and_an_unknown_one_is_refused() -> None:
    assert KV_LAYOUTS == ("layer_major", "page_major")
    assert parse_kv_layout("page_major") is KVLayout.PAGE_MAJOR
    with pytest.raises(ValueError, match="layer_major, page_major, got 'head_major'"):
        KVPool(**GEOMETRY, layout="head_major")


def test_the_geometry_names_both_layouts_when_they_differ() -> None:
    page = KVPool(**GEOMETRY, layout=KVLayout.PAGE_MAJOR).geometry
    layer = KVPool(**GEOMETRY).geometry
    assert page.mismatches(layer) == ["layout: page_major vs layer_major"]
    assert page.mismatches(page) == []
    assert isinstance(KVGeometryError("x"), ValueError)


# -- the models read either layout alike --------------------------------------------------


def _chunked_logits(forward: Any, pool: KVPool, prompt: list[int], other: list[int]
                    ) -> list[torch.Tensor]:
    """Logits of ``prompt`` in three chunks over scattered pages, each chunk batched with
    another request's item; every position's logits of the last chunk."""
    ps = pool.page_size
    pages = tuple(range(pool.num_pages - 1, 1, -2))[: -(-len(prompt) // ps)]
    assert len(pages) * ps >= len(prompt) > 2 * ps + 1, "the pool or the prompt is too small"
    cuts = [0, 5, 2 * ps + 1, len(prompt)]
    out = []
    for a, b in itertools.pairwise(cuts):
        items = (ForwardItem("o", tuple(other), 0, (0, 2)),
                 ForwardItem("p", tuple(prompt[a:b]), a, pages, all_logits=b == len(prompt)))
        out.append(forward(pool, items))
    return out


def test_reference_model_logits_are_bit_identical_across_layouts() -> None:
    model = LlamaModel(ModelConfig.tiny())
    prompt = random_prompt(37, 1, model.config.vocab_size)
    other = random_prompt(6, 2, model.config.vocab_size)
    runs = {}
    for layout in KVLayout:
        pool = model.make_pool(num_pages=24, page_size=4, layout=layout)
        assert pool.layout is layout

        def forward(pool: KVPool, items: tuple[ForwardItem, ...]) -> torch.Tensor:
            return PagedModelRunner(model, pool).logits(ForwardBatch(items))

        runs[layout] = (_chunked_logits(forward, pool, prompt, other), pool)
    (page, page_pool), (layer, layer_pool) = runs[KVLayout.PAGE_MAJOR], runs[KVLayout.LAYER_MAJOR]
    assert all(torch.equal(a, b) for a, b in zip(page, layer, strict=True))
    assert page[-1].shape[0] == 1 + 37 - 9  # the other item's last position, every position
    assert torch.equal(page_pool.by_layer(), layer_pool.buffer)


def test_smollm2_logits_are_bit_identical_across_layouts(smollm2: Any) -> None:
    model = smollm2.model
    prompt = smollm2.encode("The capital of France is", chat=True)
    other = smollm2.encode("Hello")
    runs = {}
    for layout in KVLayout:
        pool = smollm2.make_pool(num_pages=40, page_size=4, layout=layout)
        runs[layout] = (_chunked_logits(model.logits, pool, prompt, other), pool)
    (page, page_pool), (layer, layer_pool) = runs[KVLayout.PAGE_MAJOR], runs[KVLayout.LAYER_MAJOR]
    assert all(torch.equal(a, b) for a, b in zip(page, layer, strict=True))
    assert torch.equal(page_pool.by_layer(), layer_pool.buffer)


# -- who picks the layout ---------------------------------------------------------------------


def test_serve_defaults_to_the_pair_layout_and_takes_either() -> None:
    parser = build_parser("serve")
    default = serve_config(parser.parse_args(["serve", "--backend", "local"]))
    layer = serve_config(parser.parse_args(["serve", "--backend", "local",
                                            "--kv-layout", "layer_major"]))
    assert default.kv_layout is DEFAULT_KV_LAYOUT is KVLayout.PAGE_MAJOR
    assert layer.kv_layout is KVLayout.LAYER_MAJOR
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--backend", "local", "--kv-layout", "head_major"])


@pytest.mark.parametrize("layout", [None, *KVLayout])
def test_the_embedded_pair_builds_both_pools_in_its_layout(layout: KVLayout | None) -> None:
    config = PairConfig(model=ModelConfig.tiny(), prefill_pages=8, decode_pages=8)
    if layout is not None:
        config = attrs.evolve(config, kv_layout=layout)
    pair = EmbeddedPair(config)
    try:
        want = DEFAULT_KV_LAYOUT if layout is None else layout
        assert pair.prefill_pool.layout is pair.decode_pool.layout is want
    finally:
        pair.close()
