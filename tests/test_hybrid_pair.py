"""A hybrid reference model end to end through an EmbeddedPair over the local backend: each
configuration (sliding-window layers, a recurrent layer, both) decodes exactly the colocated
tokens from the state that landed in the decode peer's own pools, and both sides end with every
page, SWA page and recurrent slot free."""

from __future__ import annotations

import random
from typing import Literal

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv.pages import pages_needed
from kv.state_pools import StatePools
from lifecycle import SamplingParams
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from scheduler.model.side_pools import HybridConfig
from tests.hybrid_harness import assert_empty, hybrid_pair

PS, PAGES, SWA_PAGES, SLOTS = 4, 64, 48, 3
Backend = Literal["local", "mooncake"]
CONFIGS = {
    "swa": dict(layers=3, swa_layers=(0, 2), sliding_window=6),
    "recurrent": dict(layers=3, recurrent_layers=(1,)),
    "both": dict(layers=4, swa_layers=(0, 2), sliding_window=6, recurrent_layers=(1,)),
}


def hybrid_model(name: str) -> LlamaModel:
    return LlamaModel(attrs.evolve(ModelConfig.tiny(seed=3), **CONFIGS[name]))


def make_pair(model: LlamaModel, overlap: bool = False, backend: Backend = "local") -> EmbeddedPair:
    hybrid = HybridConfig(swa_pages=SWA_PAGES, state_slots=SLOTS)
    return hybrid_pair(
        model, hybrid, page_size=PS, pages=PAGES, chunk=8, overlap=overlap, backend=backend
    )


def poison(states: StatePools) -> None:
    """What did not land reads as NaN, or as a wrong recurrent state."""
    states.full.buffer.fill_(float("nan"))
    if states.swa is not None:
        states.swa.pool.buffer.fill_(float("nan"))
    if states.recurrent is not None:
        states.recurrent.buffer.fill_(7777)


@pytest.mark.parametrize(
    ("name", "overlap", "backend"),
    [
        ("swa", False, "local"),
        ("recurrent", False, "local"),
        ("both", False, "local"),
        ("both", True, "local"),
        pytest.param("both", False, "mooncake", marks=pytest.mark.mooncake),
    ],
)
def test_each_hybrid_configuration_decodes_the_colocated_tokens(
    name: str, overlap: bool, backend: Backend
) -> None:
    model = hybrid_model(name)
    rng = random.Random(len(name))
    # More requests than recurrent slots: some wait for a slot on either side.
    prompts = {f"r{n}": [rng.randrange(256) for _ in range(n)] for n in (3, 9, 13, 21, 30)}
    pair = make_pair(model, overlap, backend)
    try:
        assert pair.decode.states is not None
        poison(pair.decode.states)
        for rid, prompt in prompts.items():
            pair.submit(rid, prompt, SamplingParams(max_new_tokens=11, ignore_eos=True))
        out = pair.run_until_done(prompts, timeout=120)
        reference = ReferenceModel(model)
        for rid, prompt in prompts.items():
            got = out[rid]
            assert got.prefill.ok and got.decode is not None and got.decode.ok, got
            assert list(got.decode.output_ids) == reference.generate(prompt, 11, ignore_eos=True), (
                rid
            )
        assert_empty(pair, PAGES)
    finally:
        pair.close()


@st.composite
def hybrid_configs(draw: st.DrawFn) -> ModelConfig:
    """A small hybrid model: some SWA layers (any window), some recurrent, one full at least."""
    layers = draw(st.integers(2, 4))
    kinds = draw(
        st.lists(st.sampled_from("fsr"), min_size=layers, max_size=layers).filter(
            lambda k: "f" in k and k != ["f"] * layers
        )
    )
    swa = tuple(i for i, k in enumerate(kinds) if k == "s")
    return attrs.evolve(
        ModelConfig.tiny(seed=draw(st.integers(0, 3))),
        layers=layers,
        swa_layers=swa,
        sliding_window=draw(st.integers(1, 20)) if swa else 0,
        recurrent_layers=tuple(i for i, k in enumerate(kinds) if k == "r"),
    )


@given(
    config=hybrid_configs(),
    page_size=st.sampled_from([2, 4, 8]),
    chunk_pages=st.sampled_from([None, 1, 3]),
    slots=st.integers(1, 3),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    max_new=st.integers(1, 10),
    spare_swa=st.integers(0, 8),
    aborts=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 25)), max_size=2),
    overlap=st.booleans(),
)
@settings(max_examples=25)
def test_any_hybrid_pair_decodes_the_colocated_tokens_and_frees_everything(
    config: ModelConfig,
    page_size: int,
    chunk_pages: int | None,
    slots: int,
    lengths: list[int],
    max_new: int,
    spare_swa: int,
    aborts: list[tuple[int, int]],
    overlap: bool,
) -> None:
    """Any shape, page size, chunking, slot and SWA-pool pressure, and aborts at any pass:
    every request that finishes decodes the colocated tokens, and both sides end empty."""
    model = LlamaModel(config)
    rng = random.Random(sum(lengths))
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate(lengths)}
    need = [pages_needed(n + max_new, page_size) for n in lengths]
    pages = sum(need) + 2
    chunk = None if chunk_pages is None else chunk_pages * page_size
    hybrid = HybridConfig(swa_pages=max(need) + spare_swa, state_slots=slots)
    pair = hybrid_pair(
        model,
        hybrid,
        page_size=page_size,
        pages=pages,
        chunk=chunk,
        overlap=overlap,
        metadata_slots=4,
    )
    try:
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        for rid, prompt in prompts.items():
            pair.submit(rid, prompt, params)
        when = {f"r{i % len(lengths)}": at for i, at in aborts}
        for step in range(max(when.values(), default=-1) + 1):
            for rid in [r for r, at in when.items() if at == step]:
                pair.abort(rid)
            pair.step()
            pair.prefill.check_invariants()
            pair.decode.check_invariants()
        out = pair.run_until_done(prompts, timeout=120)
        reference = ReferenceModel(model)
        for rid, prompt in prompts.items():
            got = out[rid]
            if rid not in when:
                assert got.prefill.ok and got.decode is not None and got.decode.ok, got
            if got.decode is not None and got.decode.ok:
                assert list(got.decode.output_ids) == reference.generate(
                    prompt, max_new, ignore_eos=True
                ), rid
        assert_empty(pair, pages)
    finally:
        pair.close()


def test_a_tight_swa_pool_never_leaves_decoding_requests_waiting_for_each_other() -> None:
    # The SWA pool holds the longest request's final pages and a few more. Reserving only the
    # next page of each decoding request left all three waiting for a page (Hypothesis found
    # it); requests start only when everything they may still take fits, so each finishes.
    model = LlamaModel(
        attrs.evolve(ModelConfig.tiny(), layers=3, swa_layers=(2,), sliding_window=1)
    )
    rng = random.Random(1)
    prompts = {f"t{n}": [rng.randrange(256) for _ in range(n)] for n in (1, 10, 38)}
    need = [pages_needed(len(p) + 4, 2) for p in prompts.values()]
    hybrid = HybridConfig(swa_pages=max(need) + 6)
    pair = hybrid_pair(
        model, hybrid, page_size=2, pages=sum(need) + 2, chunk=None, metadata_slots=4
    )
    try:
        for rid, prompt in prompts.items():
            pair.submit(rid, prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
        out = pair.run_until_done(prompts, timeout=60)
        reference = ReferenceModel(model)
        for rid, prompt in prompts.items():
            got = out[rid].decode
            assert got is not None and list(got.output_ids) == reference.generate(
                prompt, 4, ignore_eos=True
            )
        assert_empty(pair, sum(need) + 2)
    finally:
        pair.close()


def test_a_request_the_decode_sides_swa_pool_cannot_hold_is_refused_naming_that_pool() -> None:
    model = LlamaModel(attrs.evolve(ModelConfig.tiny(), **CONFIGS["swa"]))
    pair = hybrid_pair(model, HybridConfig(swa_pages=8), page_size=4, pages=64, chunk=None)
    try:
        # 29 prompt tokens fit the prefill side's 8 SWA pages; with 10 new tokens, 38
        # positions need 10 of the decode side's.
        pair.submit("long", list(range(1, 30)), SamplingParams(max_new_tokens=10))
        out = pair.run_until_done(["long"])["long"]
        assert out.decode is not None and not out.decode.ok
        assert ("prompt of 29 tokens plus 10 new tokens cannot fit the SWA pool "
                "(HybridConfig.swa_pages) of the decode side (8 pages of 4 tokens)"
                in out.decode.detail), out.decode.detail
        assert_empty(pair, 64)
    finally:
        pair.close()


TINY = ModelConfig.tiny()


@pytest.mark.parametrize(
    ("model", "hybrid", "message"),
    [
        (TINY, HybridConfig(swa_pages=256),
         "HybridConfig: the model has no sliding-window or recurrent layers and there is no "
         "draft .* it would change nothing; leave it None"),
        (attrs.evolve(TINY, **CONFIGS["swa"]), HybridConfig(speculative_k=5),
         r"HybridConfig: speculative_k=5 without a draft \(draft_layers=0\)"),
        # The default's value, given: still a draft's setting without a draft.
        (attrs.evolve(TINY, **CONFIGS["swa"]), HybridConfig(speculative_k=3),
         r"HybridConfig: speculative_k=3 without a draft \(draft_layers=0\)"),
        (attrs.evolve(TINY, **CONFIGS["both"]), HybridConfig(draft_layers=2),
         r"a draft of 2 layers \(the target's first\) has sliding-window or recurrent layers "
         r"\[0, 1\]; a hybrid draft is not built"),
        (attrs.evolve(TINY, **CONFIGS["both"]), None,
         r"sliding-window layers \(0, 2\) and recurrent layers \(1,\): each side needs their "
         r"pools; give it a HybridConfig \(PairConfig\(hybrid=HybridConfig\(\)\)"),
    ],
    ids=["nothing", "speculative-k", "speculative-k-default", "hybrid-draft", "no-hybrid"],
)
def test_a_hybrid_setting_the_model_cannot_use_is_refused(
    model: ModelConfig, hybrid: HybridConfig | None, message: str
) -> None:
    """A setting taken without effect reads as one that works: each is refused by name."""
    with pytest.raises(ValueError, match=message):
        EmbeddedPair(PairConfig(model=model, hybrid=hybrid))
