"""Disaggregated output equals the colocated reference, token for token.

The prefill scheduler and the decode peer run in one process (EmbeddedPair) over the local
backend (pages copied between pools) and over Mooncake (pages cross loopback TCP through the
bootstrap endpoint and the ZeroMQ control plane), with both loops, page sizes 1, 16 and 64,
several chunk sizes, and both pool layouts.
"""

from __future__ import annotations

import random
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv.mooncake_engine import MooncakeConfig
from kv.pool_layout import DEFAULT_KV_LAYOUT, KVLayout
from scheduler.embedded import PairConfig
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from tests.pair_check import check_pair

MODEL = LlamaModel(ModelConfig())
REFERENCE = ReferenceModel(MODEL)
MAX_NEW = 6


def run_pair(prompts: dict[str, list[int]], *, page_size: int, chunk: int | None,
             overlap: bool, backend: Literal["local", "mooncake"] = "local",
             max_new: int = MAX_NEW, kv_layout: KVLayout = DEFAULT_KV_LAYOUT,
             mooncake: MooncakeConfig | None = None) -> None:
    expected = {rid: REFERENCE.generate(prompt, max_new) for rid, prompt in prompts.items()}
    check_pair(prompts, expected, page_size=page_size, chunk=chunk, overlap=overlap,
               max_new=max_new, pages=8192 // page_size + 8, backend=backend, model=MODEL,
               timeout=240, kv_layout=kv_layout, mooncake=mooncake)


def prompts_of(lengths: list[int], seed: int) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    return {f"r{i}": [rnd.randrange(256) for _ in range(n)] for i, n in enumerate(lengths)}


LENGTHS = [1, 2, 15, 16, 17, 64, 65, 300]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 37), (16, 256), (64, 128), (16, None)])
def test_local_backend_matches_reference(page_size, chunk, overlap):
    run_pair(prompts_of(LENGTHS, page_size), page_size=page_size, chunk=chunk, overlap=overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_long_prompt_in_many_chunks_matches_reference(overlap):
    run_pair(prompts_of([3000, 5], 11), page_size=16, chunk=512, overlap=overlap, max_new=3)


@pytest.mark.mooncake
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_mooncake_backend_matches_reference(overlap):
    run_pair(prompts_of([1, 17, 200, 1200], 7), page_size=16, chunk=512, overlap=overlap,
             backend="mooncake")


@pytest.mark.mooncake
def test_a_mooncake_pair_takes_its_engine_settings():
    """``PairConfig.mooncake`` reaches both sides: with a peer token (only the two sides
    agreeing on it lets a transfer through) and a 4 KiB cut (every page of a run a block of
    its own, cut further), the pair still serves the reference's tokens."""
    run_pair(prompts_of([1, 300, 1200], 5), page_size=16, chunk=512, overlap=False,
             backend="mooncake",
             mooncake=MooncakeConfig(max_block_bytes=4096, token="t0k3n-0123456789abcdef"))


def test_mooncake_settings_need_the_mooncake_backend():
    with pytest.raises(ValueError, match="backend='mooncake'"):
        PairConfig(mooncake=MooncakeConfig())
    assert PairConfig(backend="mooncake", mooncake=MooncakeConfig()).mooncake is not None


@pytest.mark.parametrize("backend", ["local", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_the_other_pool_layout_matches_reference(backend):
    """The layout a pair does not default to serves alike (the tests above run the default)."""
    other = next(layout for layout in KVLayout if layout is not DEFAULT_KV_LAYOUT)
    run_pair(prompts_of([1, 17, 200, 1200], 8), page_size=16, chunk=256, overlap=False,
             backend=backend, kv_layout=other)


@settings(max_examples=6)
@given(
    lengths=st.lists(st.integers(1, 600), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 16, 64]),
    chunk_pages=st.integers(1, 8),
    overlap=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_shapes_match_reference(lengths, page_size, chunk_pages, overlap, seed):
    run_pair(prompts_of(lengths, seed), page_size=page_size,
             chunk=max(chunk_pages * page_size, 16), overlap=overlap, max_new=3)
