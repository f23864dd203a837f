"""Edges of the speculative hand-off and of a hybrid side's wiring: a prompt that fills the
context (no position past it to propose for), a hand-off that raises for one request of a batch,
state pools that are not the runner's, metadata buffers that cannot carry the decode side's
hand-off, and the wording of a draft of fewer layers on the prefill side."""

from __future__ import annotations

import itertools
import time

import attrs
import pytest

from kv.local import LocalKVManager, LocalTransferHub
from kv.local_decode import LocalDecodeManager
from kv.metadata import MetadataBuffers, SlotAllocator
from kv.state_pools import StatePools
from lifecycle import FailureReason, SamplingParams
from scheduler.assemble import build_decode, build_prefill
from scheduler.decode import DecodeConfig, DecodePeer
from scheduler.messages import NewRequest
from scheduler.model.drafting import DraftingRunner
from scheduler.model.reference import (
    LlamaModel,
    ModelConfig,
    ModelInputError,
    PagedModelRunner,
    ReferenceModel,
)
from scheduler.model.request_kv import RequestKV
from scheduler.model.side_pools import HybridConfig, SideModel, build_side
from scheduler.model.speculative import SpeculativeDecoder, prefill_handoff
from scheduler.prefill.config import SchedulerConfig
from scheduler.prefill.scheduler import PrefillScheduler
from scheduler.runner import ModelRunner
from tests.hybrid_harness import assert_empty, hybrid_pair

PS, PAGES = 4, 64
# The audit's repro: a prompt of max_position tokens is admitted with max_new_tokens=1
# (32 + 1 - 1 <= 32); its first token sits at position 32, past the last the draft can look at.
FULL = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=1), layers=4, max_position=32))
DRAFT = HybridConfig(draft_layers=2)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_prompt_that_fills_the_context_answers_as_without_a_draft(overlap: bool) -> None:
    """It raised out of the pass (the draft's look past the prompt), leaving it and every later
    request of its batch in FORWARD for good. Now its row carries no hand-off, and the
    request after it in the same batch decodes speculatively as before."""
    requests = {
        "fills": (list(range(1, 33)), SamplingParams(max_new_tokens=1, ignore_eos=True)),
        "after": (list(range(1, 9)), SamplingParams(max_new_tokens=6, ignore_eos=True)),
    }
    answers = {}
    for hybrid in (None, DRAFT):
        # One chunk holds both prompts: they land in one batch, "fills" first.
        pair = hybrid_pair(FULL, hybrid, page_size=PS, pages=PAGES, chunk=64, overlap=overlap)
        try:
            for rid, (prompt, params) in requests.items():
                pair.submit(rid, prompt, params)
            out = pair.run_until_done(requests, timeout=60)
            assert all(o.prefill.ok and o.decode.ok for o in out.values()), out
            answers[hybrid is None] = {rid: list(o.decode.output_ids) for rid, o in out.items()}
            assert_empty(pair, PAGES)
            if hybrid is not None:
                assert pair.prefill.runner.kept() == 0  # type: ignore[attr-defined]
                proposed = pair.decode.metrics.registry.get_sample_value(
                    "pdlife_decode_spec_proposed_total")
                assert proposed  # "after" still decoded from its hand-off
        finally:
            pair.close()
    reference = ReferenceModel(FULL)
    assert answers[False] == answers[True] == {
        rid: reference.generate(prompt, p.max_new_tokens, ignore_eos=True)
        for rid, (prompt, p) in requests.items()}


def test_a_colocated_handoff_of_a_prompt_that_fills_the_context_has_no_proposals() -> None:
    side = build_side(FULL, FULL.make_pool(num_pages=16, page_size=PS), DRAFT)
    assert side.draft is not None
    prompt = list(range(1, 33))
    kv = RequestKV("fills")
    handoff = prefill_handoff(side.runner, side.draft, kv, prompt, 16, DRAFT.proposals)
    assert (handoff.top_ids, handoff.top_probs) == ((), ())
    decoder = SpeculativeDecoder(side.runner, side.draft, DRAFT.proposals)
    assert decoder.decode(kv, prompt, handoff, 1, ignore_eos=True) == (
        ReferenceModel(FULL).generate(prompt, 1, ignore_eos=True))


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_handoff_that_raises_fails_its_request_alone(overlap: bool) -> None:
    """Whatever the hand-off of one request raises, the batch lands: that request fails
    ``internal`` saying why, the next one in the batch is served, nothing is held."""
    pair = hybrid_pair(FULL, DRAFT, page_size=PS, pages=PAGES, chunk=64, overlap=overlap)
    runner = pair.prefill.runner
    assert isinstance(runner, DraftingRunner)
    handoff_row = runner.handoff_row

    def failing(rid: str, first_token: int) -> object:
        if rid == "broken":
            raise ModelInputError(rid, "injected: the draft's look failed")
        return handoff_row(rid, first_token)

    runner.handoff_row = failing  # type: ignore[assignment,method-assign]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    prompts = {"broken": list(range(3, 20)), "after": list(range(40, 50))}
    try:
        for rid, prompt in prompts.items():
            pair.submit(rid, prompt, params)
        out = pair.run_until_done(prompts, timeout=60)
        broken = out["broken"].prefill
        assert broken.reason is FailureReason.INTERNAL, broken
        assert "injected: the draft's look failed" in broken.detail
        assert broken.first_token is None
        assert not out["broken"].decode.ok
        assert out["after"].prefill.ok and out["after"].decode.ok, out["after"]
        assert list(out["after"].decode.output_ids) == ReferenceModel(FULL).generate(
            prompts["after"], 5, ignore_eos=True)
        assert_empty(pair, PAGES)
        assert runner.kept() == 0
    finally:
        pair.close()


# -- a side's runner and its state pools ------------------------------------------------------

HYBRID = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=5), layers=4, swa_layers=(2,),
                                 sliding_window=6, recurrent_layers=(3,)))
SWA_ONLY = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=5), layers=3, swa_layers=(1,),
                                   sliding_window=6))
RECURRENT_ONLY = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=5), layers=3,
                                         recurrent_layers=(1,)))
SLOTS = HybridConfig(state_slots=2)
MISMATCHED = {
    "swa": (SWA_ONLY, r"^states: the state pools' SWA pool is not the runner's swa_pool"),
    "recurrent": (RECURRENT_ONLY,
                  r"^states: the state pools' recurrent state is not the runner's states"),
}


def _two_sides(model: LlamaModel) -> tuple[SideModel, StatePools]:
    """A side, and the state pools of another side built on the same pool (so
    ``states.full is runner.pool`` holds)."""
    pool = model.make_pool(num_pages=32, page_size=PS)
    side, other = build_side(model, pool, SLOTS), build_side(model, pool, SLOTS)
    assert other.states is not None
    return side, other.states


_PORTS = itertools.count()


def _prefill(runner: ModelRunner, states: StatePools | None,
             metadata: MetadataBuffers | None = None) -> None:
    """Build a prefill scheduler of ``runner`` over ``states`` (the local backend carrying
    them), and close it."""
    meta = metadata or MetadataBuffers(4)
    kv = LocalKVManager(runner.pool, meta, hub=LocalTransferHub(),
                        bootstrap_addr=f"local:{next(_PORTS)}", states=states)
    try:
        PrefillScheduler(config=SchedulerConfig(page_size=PS), runner=runner, kv=kv,
                         metadata=meta, slots=SlotAllocator(4), states=states).close()
    finally:
        kv.close()


def _decode(runner: ModelRunner, states: StatePools | None,
            metadata: MetadataBuffers | None = None,
            speculative: SpeculativeDecoder | None = None) -> None:
    """Build a decode peer of ``runner`` over ``states`` (the local backend receiving into
    them)."""
    meta = metadata or MetadataBuffers(4)
    kv = LocalDecodeManager(runner.pool, meta, hub=LocalTransferHub(), states=states)
    try:
        DecodePeer(runner=runner, kv=kv, metadata=meta, slots=SlotAllocator(4),
                   config=DecodeConfig(), states=states, speculative=speculative)
    finally:
        kv.close()


@pytest.mark.parametrize("kind", sorted(MISMATCHED))
def test_state_pools_that_are_not_the_runners_are_refused_on_both_sides(kind: str) -> None:
    """Both were built, and decoded garbage without a word."""
    model, message = MISMATCHED[kind]
    side, foreign = _two_sides(model)
    with pytest.raises(ValueError, match=message):
        _prefill(side.runner, foreign)
    with pytest.raises(ValueError, match=message):
        _decode(side.runner, foreign)
    # The runner with its own state pools builds on both sides.
    _prefill(side.runner, side.states)
    _decode(side.runner, side.states)


def test_a_drafting_runner_over_another_sides_state_pools_is_refused() -> None:
    """The drafting runner's target computes in the SWA pool and recurrent states: the draft
    pool's being the state pools' is not enough."""
    hybrid = attrs.evolve(SLOTS, draft_layers=2)
    pool = HYBRID.make_pool(num_pages=32, page_size=PS)
    side, other = build_side(HYBRID, pool, hybrid), build_side(HYBRID, pool, hybrid)
    assert side.draft is not None and side.states is not None and other.states is not None
    foreign = StatePools(pool, swa=other.states.swa, recurrent=other.states.recurrent,
                         draft=side.draft.pool)
    drafting = DraftingRunner(side.runner, side.draft, hybrid.proposals)
    meta = MetadataBuffers(4, speculative_hidden=HYBRID.config.hidden)
    with pytest.raises(ValueError, match=r"^states: the state pools' SWA pool is not"):
        _prefill(drafting, foreign, meta)
    _prefill(drafting, side.states, meta)


@pytest.mark.parametrize("model", [SWA_ONLY, RECURRENT_ONLY, HYBRID],
                         ids=["swa", "recurrent", "both"])
def test_a_hybrid_runner_without_state_pools_is_refused_on_both_sides(model: LlamaModel) -> None:
    """It was built, and then failed every request ``internal``."""
    side, _ = _two_sides(model)
    message = r"^states: the runner PagedModelRunner has its .*but no state pools were given"
    with pytest.raises(ValueError, match=message):
        _prefill(side.runner, None)
    with pytest.raises(ValueError, match=message):
        _decode(side.runner, None)


# -- the decode side's metadata buffers ---------------------------------------------------------

@pytest.mark.parametrize("speculative_hidden", [0, 16])
def test_decode_metadata_that_cannot_carry_its_handoff_is_refused_when_built(
        speculative_hidden: int) -> None:
    """It was caught per request, once the prefill side had computed the request."""
    model = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=2), layers=4))
    hidden = model.config.hidden
    assert hidden not in (0, speculative_hidden)
    pool = model.make_pool(num_pages=32, page_size=PS)
    side = build_side(model, pool, DRAFT)
    assert side.draft is not None
    decoder = SpeculativeDecoder(side.runner, side.draft, DRAFT.proposals)
    with pytest.raises(ValueError, match=(
            rf"^metadata: the speculative decoder's hand-off carries the target's hidden state "
            rf"\({hidden} values\), but the metadata buffers have speculative_hidden="
            rf"{speculative_hidden} \(build them with MetadataBuffers\(\.\.\., "
            rf"speculative_hidden={hidden}\)\)$")):
        _decode(side.runner, side.states,
                MetadataBuffers(4, speculative_hidden=speculative_hidden), decoder)
    _decode(side.runner, side.states, MetadataBuffers(4, speculative_hidden=hidden), decoder)


@pytest.mark.parametrize("speculative_hidden", [0, 16])
def test_prefill_metadata_that_cannot_carry_its_handoff_is_refused_when_built(
        speculative_hidden: int) -> None:
    """Buffers of another nonzero size were built, and each request failed ``internal`` as its
    row was written."""
    model = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=2), layers=4))
    hidden = model.config.hidden
    pool = model.make_pool(num_pages=32, page_size=PS)
    side = build_side(model, pool, DRAFT)
    assert side.draft is not None
    drafting = DraftingRunner(side.runner, side.draft, DRAFT.proposals)
    with pytest.raises(ValueError, match=(
            rf"^metadata: a runner with a draft model hands off the target's hidden state "
            rf"\({hidden} values\), but the metadata buffers have speculative_hidden="
            rf"{speculative_hidden} ")):
        _prefill(drafting, side.states, MetadataBuffers(4, speculative_hidden=speculative_hidden))
    _prefill(drafting, side.states, MetadataBuffers(4, speculative_hidden=hidden))


# -- a draft of fewer layers on the prefill side ----------------------------------------------

def test_a_prefill_draft_of_fewer_layers_is_refused_in_draft_layers_not_stages() -> None:
    """It said "the prefill stages hold 0..1 of the decode's 2" with no stage anywhere; the
    other direction says "draft layers: prefill 0..2 vs decode 1"."""
    model = LlamaModel(attrs.evolve(ModelConfig.tiny(seed=2), layers=4))
    hub, closers = LocalTransferHub(), []
    prefill_answers, decode_answers = [], []
    try:
        prefill = build_prefill(
            model, backend="local", config=SchedulerConfig(page_size=PS, chunked_prefill_size=8),
            pages=32, metadata_slots=4, runner_factory=PagedModelRunner, closers=closers,
            hub=hub, hybrid=HybridConfig(draft_layers=1), on_response=prefill_answers.append)
        decode = build_decode(
            model, kv_for=lambda pool, meta, runner, states: LocalDecodeManager(
                pool, meta, hub=hub, states=states),
            page_size=PS, pages=32, metadata_slots=4, runner_factory=PagedModelRunner,
            closers=closers, hybrid=HybridConfig(draft_layers=2), config=DecodeConfig(),
            on_response=decode_answers.append)
        new = NewRequest("a", tuple(range(3, 24)), bootstrap_host="local", bootstrap_port=0,
                         bootstrap_room=1,
                         sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
        prefill.submit(new)
        decode.submit(new)
        deadline = time.monotonic() + 30
        while not (prefill_answers and decode_answers) and time.monotonic() < deadline:
            prefill.step()
            decode.step()
        assert prefill_answers and decode_answers, "no answer after 30 s"
        for answer in (prefill_answers[0], decode_answers[0]):
            assert answer.reason is FailureReason.BOOTSTRAP_FAILED, answer
            assert "draft layers: prefill 0..1 vs decode 2" in answer.detail, answer.detail
            assert "stages" not in answer.detail
    finally:
        for close in reversed(closers):
            close()
