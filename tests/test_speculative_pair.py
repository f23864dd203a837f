"""Speculative decoding end to end through an EmbeddedPair: the prefill scheduler runs the draft
beside the target and writes the hand-off into the metadata row; the decode peer decodes
speculatively from it and from the draft K/V that landed in its draft pool, without running the
draft over the prompt again. The output is plain greedy decoding's, and the proposals and
acceptances are those of the same hand-off computed colocated."""

from __future__ import annotations

import logging
import random
from typing import Literal

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv.local import LocalKVManager, LocalTransferHub
from kv.metadata import SPEC_TOP_K, MetadataBuffers, SlotAllocator
from lifecycle import SamplingParams
from scheduler.embedded import EmbeddedPair
from scheduler.model.drafting import DraftingRunner
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.model.request_kv import RequestKV
from scheduler.model.side_pools import HybridConfig, build_side
from scheduler.model.speculative import SpeculativeDecoder, prefill_handoff
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ForwardBatch
from tests.hybrid_harness import assert_empty, hybrid_pair, make_runner

TARGET = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=4), layers=4))
PS, PAGES, CHUNK, DRAFT_LAYERS, K, MAX_NEW = 4, 96, 8, 2, 3, 14
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)


def make_pair(
    hybrid: HybridConfig | None,
    overlap: bool = False,
    backend: Literal["local", "mooncake"] = "local",
) -> EmbeddedPair:
    return hybrid_pair(
        TARGET, hybrid, page_size=PS, pages=PAGES, chunk=CHUNK, overlap=overlap, backend=backend
    )


def assert_greedy(outputs: dict[str, tuple[int, ...]], prompts: dict[str, list[int]]) -> None:
    """Every prompt's output is plain greedy decoding's (the colocated run)."""
    reference = ReferenceModel(TARGET)
    for rid, prompt in prompts.items():
        assert list(outputs[rid]) == reference.generate(prompt, MAX_NEW, ignore_eos=True), rid


def colocated_stats(prompts: dict[str, list[int]], model: LlamaModel = TARGET) -> tuple[int, int]:
    """Proposals made and accepted when each prompt's hand-off is computed colocated."""
    proposed = accepted = 0
    for rid, prompt in prompts.items():
        draft_model = model.draft(DRAFT_LAYERS)
        target = make_runner(model, PAGES, PS, swa_pages=PAGES, slots=1)
        draft = PagedModelRunner(draft_model, draft_model.make_pool(num_pages=PAGES, page_size=PS))
        kv = RequestKV(rid, state_slot=0 if model.config.recurrent_layers else -1)
        handoff = prefill_handoff(target, draft, kv, prompt, chunk=CHUNK, k=K)
        decoder = SpeculativeDecoder(target, draft, K)
        decoder.decode(kv, prompt, handoff, MAX_NEW, ignore_eos=True)
        proposed += decoder.stats.proposed
        accepted += decoder.stats.accepted
    return proposed, accepted


def serve(
    pair: EmbeddedPair,
    requests: dict[str, tuple[list[int], SamplingParams]],
) -> dict[str, tuple[int, ...]]:
    for rid, (prompt, params) in requests.items():
        pair.submit(rid, prompt, params)
    out = pair.run_until_done(requests, timeout=120)
    for got in out.values():
        assert got.prefill.ok and got.decode is not None and got.decode.ok, got
    assert_empty(pair, PAGES)
    return {rid: got.decode.output_ids for rid, got in out.items() if got.decode is not None}


@pytest.mark.parametrize("backend", ["local", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_a_speculative_pair_decodes_plain_greedy_from_the_prefill_handoff(
    backend: Literal["local", "mooncake"],
) -> None:
    rng = random.Random(8)
    prompts = {f"g{n}": [rng.randrange(256) for _ in range(n)] for n in (2, 7, 8, 19, 33)}
    requests = {rid: (p, GREEDY) for rid, p in prompts.items()}
    # A request that samples takes the plain path on decode (and the logits path on prefill).
    requests["sampled"] = (prompts["g19"], attrs.evolve(GREEDY, temperature=0.8, seed=2))
    pair = make_pair(HybridConfig(draft_layers=DRAFT_LAYERS, speculative_k=K), backend=backend)
    try:
        decoder = pair.decode.speculative
        assert decoder is not None and pair.decode.states is not None
        assert pair.decode.states.draft is decoder.draft.pool
        # Draft K/V that did not land reads as NaN: proposals from it would differ.
        decoder.draft.pool.buffer.fill_(float("nan"))
        starts: dict[str, int] = {}
        draft_forward = decoder.draft.forward

        def recording(batch: ForwardBatch) -> list[int]:
            for item in batch.items:
                starts[item.rid] = min(starts.get(item.rid, item.start), item.start)
            return draft_forward(batch)

        decoder.draft.forward = recording  # type: ignore[method-assign]
        speculative = serve(pair, requests)
        sample = pair.decode.metrics.registry.get_sample_value
        proposed = sample("pdlife_decode_spec_proposed_total")
        accepted = sample("pdlife_decode_spec_accepted_total")
        rate = sample("pdlife_decode_spec_acceptance_rate")
        assert pair.prefill.runner.kept() == 0  # type: ignore[attr-defined]
    finally:
        pair.close()
    assert_greedy(speculative, prompts)
    for rid, prompt in prompts.items():
        # The decode side's draft ran only past the prompt: its prefill came from prefill.
        assert starts[rid] >= len(prompt), rid
    assert "sampled" not in starts
    assert (proposed, accepted) == colocated_stats(prompts)
    assert proposed is not None and accepted is not None and 0 < accepted < proposed
    assert rate == accepted / proposed
    plain_pair = make_pair(None)
    try:
        assert serve(plain_pair, requests) == speculative
    finally:
        plain_pair.close()


def test_the_overlap_loop_hands_off_the_same_and_an_abort_keeps_nothing() -> None:
    rng = random.Random(9)
    prompts = {f"o{n}": [rng.randrange(256) for _ in range(n)] for n in (5, 17, 26)}
    pair = make_pair(HybridConfig(draft_layers=DRAFT_LAYERS, speculative_k=K), overlap=True)
    try:
        # A long prompt aborted between chunks: what the runner kept of it goes with it.
        pair.submit("aborted", [rng.randrange(256) for _ in range(60)], GREEDY)
        while (req := pair.prefill.lifecycle.get("aborted")) is None or req.computed == 0:
            pair.step()
        pair.abort("aborted")
        got = serve(pair, {rid: (p, GREEDY) for rid, p in prompts.items()})
        assert not pair.run_until_done(["aborted"])["aborted"].prefill.ok
        assert pair.prefill.runner.kept() == 0  # type: ignore[attr-defined]
    finally:
        pair.close()
    assert_greedy(got, prompts)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_hybrid_target_decodes_speculatively_from_its_landed_state(overlap: bool) -> None:
    """A target with a recurrent and a sliding-window layer past the draft's two: the peer's
    rounds take their pages with SWA pages and restore the recurrent slot after a rejected
    proposal; the output is plain greedy decoding's, the counts the colocated hand-off's."""
    model = LlamaModel(
        attrs.evolve(TARGET.config, recurrent_layers=(2,), swa_layers=(3,), sliding_window=5)
    )
    rng = random.Random(10)
    prompts = {f"h{n}": [rng.randrange(256) for _ in range(n)] for n in (3, 11, 24)}
    hybrid = HybridConfig(
        draft_layers=DRAFT_LAYERS, speculative_k=K, state_slots=2, swa_pages=PAGES // 2
    )
    pair = hybrid_pair(model, hybrid, page_size=PS, pages=PAGES, chunk=CHUNK, overlap=overlap)
    try:
        got = serve(pair, {rid: (p, GREEDY) for rid, p in prompts.items()})
        sample = pair.decode.metrics.registry.get_sample_value
        counts = (
            sample("pdlife_decode_spec_proposed_total"),
            sample("pdlife_decode_spec_accepted_total"),
        )
        assert pair.prefill.states is not None and pair.decode.states is not None
    finally:
        pair.close()
    reference = ReferenceModel(model)
    for rid, prompt in prompts.items():
        assert list(got[rid]) == reference.generate(prompt, MAX_NEW, ignore_eos=True), rid
    assert counts == colocated_stats(prompts, model)
    assert counts[0] is not None and counts[1] is not None and 0 < counts[1] < counts[0]


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    draft_layers=st.integers(1, 4),
    k=st.integers(1, 4),
    max_new=st.integers(1, 12),
    chunk_pages=st.sampled_from([None, 1, 3]),
    overlap=st.booleans(),
    abort_at=st.one_of(st.none(), st.integers(0, 12)),
    seed=st.integers(0, 99),
    above=st.lists(st.sampled_from("fsr"), min_size=3, max_size=3),
    window=st.integers(1, 12),
)
@settings(max_examples=20)
def test_any_speculative_pair_decodes_plain_greedy(
    lengths: list[int],
    draft_layers: int,
    k: int,
    max_new: int,
    chunk_pages: int | None,
    overlap: bool,
    abort_at: int | None,
    seed: int,
    above: list[str],
    window: int,
) -> None:
    """Any prompts, draft, k, chunking and loop, sliding-window (``s``) or recurrent (``r``)
    target layers past the draft's, the first request maybe aborted at any pass: every answer
    that finished is plain greedy decoding's, and both sides end empty."""
    kinds = ["f"] * draft_layers + above[: 4 - draft_layers]
    swa = tuple(i for i, kind in enumerate(kinds) if kind == "s")
    model = LlamaModel(
        attrs.evolve(
            TARGET.config,
            swa_layers=swa,
            sliding_window=window if swa else 0,
            recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "r"),
        )
    )
    rng = random.Random(seed)
    prompts = {f"s{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate(lengths)}
    chunk = None if chunk_pages is None else chunk_pages * PS
    pair = hybrid_pair(
        model,
        HybridConfig(draft_layers=draft_layers, speculative_k=k, state_slots=2),
        page_size=PS,
        pages=PAGES,
        chunk=chunk,
        overlap=overlap,
    )
    params = attrs.evolve(GREEDY, max_new_tokens=max_new)
    try:
        for rid, prompt in prompts.items():
            pair.submit(rid, prompt, params)
        for _ in range(abort_at or 0):
            pair.step()
        if abort_at is not None:
            pair.abort("s0")
        out = pair.run_until_done(prompts, timeout=120)
        assert pair.prefill.runner.kept() == 0  # type: ignore[attr-defined]
        assert_empty(pair, PAGES)
    finally:
        pair.close()
    reference = ReferenceModel(model)
    for rid, prompt in prompts.items():
        got = out[rid]
        if rid != "s0" or abort_at is None:
            assert got.decode is not None and got.decode.ok, got
        if got.decode is not None and got.decode.ok:
            assert list(got.decode.output_ids) == reference.generate(
                prompt, max_new, ignore_eos=True
            ), rid


def test_a_prefill_whose_state_pools_hold_a_draft_warns_without_the_drafting_runner(
        caplog: pytest.LogCaptureFixture) -> None:
    """A plain runner over state pools with a draft's pool ships an empty draft pool with
    every chunk and no hand-off: the decode side never speculates, which is said (test
    runners that move state pools do this on purpose)."""
    model = LlamaModel(ModelConfig.tiny())
    pool = model.make_pool(num_pages=16, page_size=4)
    hybrid = HybridConfig(draft_layers=1)
    side = build_side(model, pool, hybrid)
    assert side.states is not None and side.draft is not None
    meta = MetadataBuffers(4, speculative_hidden=model.config.hidden)
    kv = LocalKVManager(pool, meta, hub=LocalTransferHub(), bootstrap_addr="local:0",
                        states=side.states)
    try:
        with caplog.at_level(logging.WARNING, logger="scheduler.prefill.drafting"):
            PrefillScheduler(config=SchedulerConfig(page_size=4), runner=PagedModelRunner(
                model, pool), kv=kv, metadata=meta, slots=SlotAllocator(4),
                states=side.states).close()
            assert "computes no draft KV and no hand-off" in caplog.text, caplog.text
            caplog.clear()
            drafting = DraftingRunner(side.runner, side.draft, hybrid.proposals)
            PrefillScheduler(config=SchedulerConfig(page_size=4), runner=drafting, kv=kv,
                             metadata=meta, slots=SlotAllocator(4), states=side.states).close()
            assert "computes no draft KV" not in caplog.text
    finally:
        kv.close()


@pytest.mark.parametrize("k", [0, -1, SPEC_TOP_K + 1])
def test_a_speculative_k_out_of_range_is_refused_naming_it(k: int) -> None:
    """0 was taken and failed when the pair was built, in the drafting runner, with a message
    that named no field of HybridConfig."""
    with pytest.raises(ValueError, match=(
            rf"^HybridConfig\.speculative_k must be in 1\.\.{SPEC_TOP_K} \(proposals per round, "
            rf"at most the {SPEC_TOP_K} a hand-off carries\) or None \(3 with a draft\), "
            rf"got {k}$")):
        HybridConfig(draft_layers=DRAFT_LAYERS, speculative_k=k)


@pytest.mark.parametrize("k", [1, SPEC_TOP_K])
def test_the_speculative_k_range_is_what_a_side_builds(k: int) -> None:
    hybrid = HybridConfig(draft_layers=DRAFT_LAYERS, speculative_k=k)
    side = build_side(TARGET, TARGET.make_pool(num_pages=16, page_size=PS), hybrid)
    assert side.draft is not None
    assert DraftingRunner(side.runner, side.draft, hybrid.proposals).k == k
    assert SpeculativeDecoder(side.runner, side.draft, hybrid.proposals).k == k


def test_a_draft_of_more_layers_than_the_target_is_refused_naming_it() -> None:
    """It failed in the model's truncation, naming no field of HybridConfig."""
    layers = TARGET.config.layers
    pool = TARGET.make_pool(num_pages=16, page_size=PS)
    with pytest.raises(ValueError, match=(
            rf"^HybridConfig\.draft_layers must be in 0\.\.{layers} \(0: no draft; the draft is "
            rf"the target's first layers, of {layers}\), got {layers + 1}$")):
        build_side(TARGET, pool, HybridConfig(draft_layers=layers + 1))
    assert build_side(TARGET, pool, HybridConfig(draft_layers=layers)).draft is not None
