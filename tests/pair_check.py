"""A disaggregated run checked token for token: an :class:`EmbeddedPair` serves every prompt at
once, and each request's tokens must be the expected ones (its prefill's first token too), both
schedulers' invariants hold, and both pools end entirely free.

The tests that compare a pair with a reference (the reference model, SmolLM2 colocated, in
float32 or bfloat16) differ only in the model, the sizes and what they expect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import attrs
import torch

from kv.mooncake_engine import MooncakeConfig
from kv.pool_layout import DEFAULT_KV_LAYOUT, KVLayout
from lifecycle import SamplingParams
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.reference import LlamaModel
from scheduler.model.select import ServedModel
from scheduler.prefill.config import SchedulerConfig


def pages_for(prompts: Mapping[str, Sequence[int]], max_new: int, page_size: int) -> int:
    """Pool pages for every prompt and its ``max_new`` tokens at once, two spare per request."""
    return sum(len(ids) + max_new for ids in prompts.values()) // page_size + 2 * len(prompts)


def check_pair(prompts: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], *,
               page_size: int, chunk: int | None, overlap: bool, max_new: int, pages: int,
               backend: Literal["local", "mooncake"] = "local",
               max_prefill_tokens: int | None = None,
               model: LlamaModel | None = None, served: ServedModel | None = None,
               pool_dtype: torch.dtype | None = None, timeout: float = 600.0,
               kv_layout: KVLayout = DEFAULT_KV_LAYOUT,
               mooncake: MooncakeConfig | None = None) -> None:
    """Run ``prompts`` (rid → input ids) through a pair of ``pages`` pages a side (pools in
    ``kv_layout``) and check each request's output against ``expected`` (rid → tokens);
    ``pool_dtype``, if given, is both pools' dtype."""
    scheduler = SchedulerConfig(page_size=page_size, chunked_prefill_size=chunk,
                                check_invariants=True)
    if max_prefill_tokens is not None:
        scheduler = attrs.evolve(scheduler, max_prefill_tokens=max_prefill_tokens)
    cfg = PairConfig(scheduler=scheduler, prefill_pages=pages, decode_pages=pages,
                     overlap=overlap, backend=backend, kv_layout=kv_layout, mooncake=mooncake)
    pair = EmbeddedPair(cfg, model=model, served=served)
    try:
        assert pair.prefill_pool.layout == pair.decode_pool.layout == kv_layout
        if pool_dtype is not None:
            assert pair.prefill_pool.dtype == pair.decode_pool.dtype == pool_dtype
        for rid, ids in prompts.items():
            pair.submit(rid, ids, SamplingParams(max_new_tokens=max_new))
        out = pair.run_until_done(prompts, timeout=timeout)
        for rid in prompts:
            got = out[rid]
            assert got.prefill.ok and got.decode is not None and got.decode.ok, got
            assert got.prefill.first_token == expected[rid][0], rid
            assert list(got.decode.output_ids) == list(expected[rid]), rid
        pair.prefill.check_invariants()
        pair.decode.check_invariants()
        assert pair.prefill_pool.allocator.available() == pages
        assert pair.decode_pool.allocator.available() == pages
    finally:
        pair.close()
