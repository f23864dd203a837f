"""A hybrid reference model end to end through an EmbeddedPair over the local backend: each
configuration (sliding-window layers, a recurrent layer, both) decodes exactly the colocated
tokens from the state that landed in the decode peer's own pools, and both sides end with every
page, SWA page and recurrent slot free."""

from __future__ import annotations

import random

import attrs
import pytest

from kv.state_pools import StatePools
from lifecycle import SamplingParams
from scheduler.embedded import EmbeddedPair, PairConfig
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from scheduler.model.side_pools import HybridConfig
from scheduler.prefill.config import SchedulerConfig

PS, PAGES, SWA_PAGES, SLOTS = 4, 64, 48, 3
CONFIGS = {
    "swa": dict(layers=3, swa_layers=(0, 2), sliding_window=6),
    "recurrent": dict(layers=3, recurrent_layers=(1,)),
    "both": dict(layers=4, swa_layers=(0, 2), sliding_window=6, recurrent_layers=(1,)),
}


def hybrid_model(name: str) -> LlamaModel:
    return LlamaModel(attrs.evolve(ModelConfig.tiny(seed=3), **CONFIGS[name]))


def make_pair(model: LlamaModel, overlap: bool = False) -> EmbeddedPair:
    return EmbeddedPair(
        PairConfig(
            model=model.config,
            scheduler=SchedulerConfig(page_size=PS, chunked_prefill_size=8, check_invariants=True),
            prefill_pages=PAGES,
            decode_pages=PAGES,
            metadata_slots=8,
            overlap=overlap,
            hybrid=HybridConfig(swa_pages=SWA_PAGES, state_slots=SLOTS),
        ),
        model=model,
    )


def poison(states: StatePools) -> None:
    """What did not land reads as NaN, or as a wrong recurrent state."""
    states.full.buffer.fill_(float("nan"))
    if states.swa is not None:
        states.swa.pool.buffer.fill_(float("nan"))
    if states.recurrent is not None:
        states.recurrent.buffer.fill_(7777)


def all_free(pair: EmbeddedPair) -> None:
    for side in (pair.prefill, pair.decode):
        assert side.states is not None
        assert side.pool.allocator.available() == PAGES
        assert side.states.all_free()
    pair.prefill.check_invariants()
    pair.decode.check_invariants()


@pytest.mark.parametrize(
    ("name", "overlap"), [("swa", False), ("recurrent", False), ("both", False), ("both", True)]
)
def test_each_hybrid_configuration_decodes_the_colocated_tokens(name: str, overlap: bool) -> None:
    model = hybrid_model(name)
    rng = random.Random(len(name))
    # More requests than recurrent slots: some wait for a slot on either side.
    prompts = {f"r{n}": [rng.randrange(256) for _ in range(n)] for n in (3, 9, 13, 21, 30)}
    pair = make_pair(model, overlap)
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
        all_free(pair)
    finally:
        pair.close()


def test_a_hybrid_pair_refuses_pools_that_cannot_carry_its_state() -> None:
    model = hybrid_model("both")
    with pytest.raises(ValueError, match="does not carry state pools"):
        EmbeddedPair(
            PairConfig(
                model=model.config,
                backend="mooncake",
                scheduler=SchedulerConfig(page_size=PS),
                prefill_pages=PAGES,
                decode_pages=PAGES,
                hybrid=HybridConfig(),
            ),
            model=model,
        )
