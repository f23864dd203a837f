"""With the prefix cache on, disaggregated output still equals the colocated run, token for
token: the reference model (both loops, page sizes 1 and 16, chunked) and SmolLM2 (the chat
template's shared system prompt is cached). The decode peer continues from KV whose cached
pages the prefill side never computed for that request: every page still reaches it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from lifecycle import SamplingParams
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from scheduler.prefill.config import SchedulerConfig
from tests.real_prompts import PROMPTS

MODEL = LlamaModel(ModelConfig())
REFERENCE = ReferenceModel(MODEL)
MAX_NEW = 6


def run_cached_pair(prompts: dict[str, list[int]], want: dict[str, list[int]], *,
                    page_size: int, chunk: int | None, overlap: bool, policy: str = "lpm",
                    served: Any = None) -> int:
    """Serve ``prompts`` in arrival order, a few at a time (so later ones find earlier ones
    cached); check every output against ``want``; return the cached tokens reported."""
    pages = sum(len(p) + MAX_NEW for p in prompts.values()) // page_size + 2 * len(prompts) + 8
    cfg = PairConfig(
        scheduler=SchedulerConfig(page_size=page_size, chunked_prefill_size=chunk,
                                  max_prefill_tokens=256, radix_cache=True,
                                  schedule_policy=policy, check_invariants=True),
        prefill_pages=pages, decode_pages=pages, overlap=overlap,
    )
    pair = EmbeddedPair(cfg, model=MODEL if served is None else None, served=served)
    try:
        rids = list(prompts)
        for first in range(0, len(rids), 3):
            for rid in rids[first : first + 3]:
                pair.submit(rid, prompts[rid], SamplingParams(max_new_tokens=MAX_NEW))
            pair.step()
        out = pair.run_until_done(rids, timeout=600)
        for rid in rids:
            got = out[rid]
            assert got.prefill.ok and got.decode is not None and got.decode.ok, got
            assert list(got.decode.output_ids) == want[rid], rid
            assert got.decode.cached_tokens == got.prefill.cached_tokens, rid
        pair.prefill.check_invariants()
        prefix = pair.prefill.prefix
        assert prefix is not None and prefix.tree.evictable == prefix.tree.size
        assert pair.prefill_pool.allocator.available() + prefix.tree.size == pages
        assert prefix.tree.size > 0
        assert pair.decode_pool.allocator.available() == pages
        pair.close()  # the tree gives its pages back: every page of both pools is free
        assert pair.prefill_pool.allocator.available() == pages and prefix.tree.size == 0
        return sum(o.prefill.cached_tokens for o in out.values())
    finally:
        pair.close()


def shared_prompts(seed: int) -> dict[str, list[int]]:
    rnd = random.Random(seed)
    system = [rnd.randrange(256) for _ in range(70)]
    other = [rnd.randrange(256) for _ in range(33)]
    prompts = {}
    for i, n in enumerate([0, 1, 2, 15, 16, 17, 40, 0, 90]):
        base = system if i % 3 else other
        prompts[f"r{i}"] = base + [rnd.randrange(256) for _ in range(n)]
    prompts["whole"] = list(system)  # entirely cached: its last page is computed again
    prompts["part"] = system[:37]
    return prompts


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 23), (16, 32), (16, None)])
def test_reference_model_with_the_cache_equals_colocated(page_size: int, chunk: int | None,
                                                         overlap: bool) -> None:
    prompts = shared_prompts(page_size)
    want = {rid: REFERENCE.generate(p, MAX_NEW) for rid, p in prompts.items()}
    cached = run_cached_pair(prompts, want, page_size=page_size, chunk=chunk, overlap=overlap,
                             policy="fcfs" if overlap else "lpm")
    assert cached > 0


def test_smollm2_with_the_cache_equals_colocated(smollm2: Any) -> None:
    prompts = {f"chat{i}": smollm2.encode(p, chat=True) for i, p in enumerate(PROMPTS[:6])}
    want = {rid: smollm2.generate(ids, MAX_NEW) for rid, ids in prompts.items()}
    cached = run_cached_pair(prompts, want, page_size=4, chunk=16, overlap=False,
                             served=smollm2)
    assert cached >= 4 * 20  # the chat template's shared start, on most requests
