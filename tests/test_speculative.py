"""Greedy speculative decoding: the output equals plain greedy decoding exactly, for every
hybrid configuration, after the prefill side's hand-off travelled to other pools; the hand-off
holds what it says; the decode side does not recompute the draft's prefill."""

from __future__ import annotations

import random

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv.metadata import MetadataBuffers, MetadataError, MetadataRow, SpeculativeRow
from kv.pages import pages_needed
from scheduler.model.fixed_point import PROB_FRAC_BITS, greedy_token_ids
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.model.request_kv import PoolExhausted, RequestKV
from scheduler.model.speculative import (
    Handoff,
    SpeculativeDecoder,
    SpeculativeStats,
    prefill_handoff,
    top_k,
)
from scheduler.runner import ForwardBatch
from tests.hybrid_harness import copy_state, make_runner, transfer

TINY = ModelConfig.tiny()
TARGETS = {
    "full": LlamaModel(attrs.evolve(TINY, layers=4)),
    "swa": LlamaModel(attrs.evolve(TINY, layers=4, swa_layers=(1, 3), sliding_window=6)),
    "recurrent": LlamaModel(attrs.evolve(TINY, layers=4, recurrent_layers=(1,))),
    "mixed": LlamaModel(attrs.evolve(TINY, layers=4, swa_layers=(1,), sliding_window=5,
                                     recurrent_layers=(2,))),
}


class RecordingRunner(PagedModelRunner):
    """A paged runner that remembers where each of its forwards started."""

    starts: list[int]

    def forward(self, batch: ForwardBatch) -> list[int]:
        self.starts.extend(item.start for item in batch.items)
        return super().forward(batch)


def pair(target: LlamaModel, draft_layers: int, pages: int, page_size: int,
         slots: int) -> tuple[PagedModelRunner, RecordingRunner]:
    """A target runner and a draft runner whose pools have the target's page counts."""
    draft = target.draft(draft_layers)
    d = make_runner(draft, pages, page_size, pages, slots)
    recording = RecordingRunner(draft, d.pool, swa_pool=d.swa_pool, states=d.states)
    recording.starts = []
    return make_runner(target, pages, page_size, pages, slots), recording


def speculative_pd(target: LlamaModel, prompt: list[int], *, draft_layers: int, k: int,
                   chunk: int, page_size: int, max_new: int, stops: tuple[int, ...] = (),
                   ) -> tuple[list[int], Handoff, SpeculativeStats, list[int]]:
    """Prefill with the hand-off in one set of pools, move both models' state to another, and
    decode speculatively there: the output, the hand-off, the stats and the draft's forward
    starts on the decode side."""
    pages = pages_needed(len(prompt) + max_new + k + 1, page_size) + 1
    p_target, p_draft = pair(target, draft_layers, pages, page_size, 2)
    kv = RequestKV("r", state_slot=1)
    handoff = prefill_handoff(p_target, p_draft, kv, prompt, chunk, k=4)
    d_target, d_draft = pair(target, draft_layers, pages + 2, page_size, 3)
    d_target.pool.allocator.alloc(2)
    if d_target.swa_pool is not None:
        d_target.swa_pool.allocator.alloc(1)
    moved = transfer(p_target, d_target, kv, len(prompt), dst_slot=2)
    copy_state(p_draft, d_draft, kv, moved, len(prompt))
    decoder = SpeculativeDecoder(d_target, d_draft, k)
    out = decoder.decode(moved, prompt, handoff, max_new, stop_token_ids=stops,
                         ignore_eos=True)
    return out, handoff, decoder.stats, d_draft.starts


def prompt_of(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(TINY.vocab_size), k=n)


@pytest.mark.parametrize("name", list(TARGETS))
@pytest.mark.parametrize(("draft_layers", "k"), [(1, 1), (2, 3), (3, 5)])
def test_speculative_equals_greedy(name: str, draft_layers: int, k: int) -> None:
    target = TARGETS[name]
    colocated = ReferenceModel(target)
    for n, seed in ((1, 0), (13, 1), (40, 2)):
        prompt = prompt_of(n, seed)
        out, _, stats, _ = speculative_pd(target, prompt, draft_layers=draft_layers, k=k,
                                          chunk=6, page_size=4, max_new=24)
        assert out == colocated.generate(prompt, 24, ignore_eos=True)
        assert stats.proposed > 0 and 0.0 <= stats.acceptance_rate <= 1.0


@settings(max_examples=20)
@given(name=st.sampled_from(list(TARGETS)), draft_layers=st.integers(1, 4),
       k=st.integers(1, 6), chunk=st.integers(1, 16), page_size=st.sampled_from([1, 2, 5]),
       n=st.integers(1, 30), max_new=st.integers(1, 16), seed=st.integers(0, 1000),
       stop_count=st.integers(0, 20))
def test_speculative_equals_greedy_with_stops(
    name: str, draft_layers: int, k: int, chunk: int, page_size: int, n: int, max_new: int,
    seed: int, stop_count: int,
) -> None:
    target = TARGETS[name]
    prompt = prompt_of(n, seed)
    stops = tuple(random.Random(seed).sample(range(TINY.vocab_size), stop_count))
    out, _, _, _ = speculative_pd(target, prompt, draft_layers=draft_layers, k=k, chunk=chunk,
                                  page_size=page_size, max_new=max_new, stops=stops)
    expected = ReferenceModel(target).generate(prompt, max_new, stop_token_ids=stops,
                                               ignore_eos=True)
    assert out == expected


def test_a_draft_that_is_the_target_is_always_accepted() -> None:
    target = TARGETS["mixed"]
    prompt = prompt_of(20, 3)
    out, _, stats, _ = speculative_pd(target, prompt, draft_layers=4, k=3, chunk=8,
                                      page_size=4, max_new=21)
    assert out == ReferenceModel(target).generate(prompt, 21, ignore_eos=True)
    # 20 tokens after the first: 5 rounds of 3 accepted proposals + the target's own token.
    assert (stats.rounds, stats.proposed, stats.accepted) == (5, 15, 15)
    assert stats.acceptance_rate == 1.0


@pytest.mark.parametrize("name", list(TARGETS))
def test_the_handoff_holds_the_draft_proposals_and_the_hidden_state(name: str) -> None:
    target = TARGETS[name]
    draft = target.draft(2)
    prompt = prompt_of(17, 4)
    out, handoff, _, starts = speculative_pd(target, prompt, draft_layers=2, k=2, chunk=5,
                                             page_size=2, max_new=6)
    assert handoff.first_token == out[0]
    # The hidden state is on the activation grid (float32 holds it) and gives the first token.
    assert torch.equal(handoff.hidden.float().double(), handoff.hidden)
    assert int(greedy_token_ids(target.logits(handoff.hidden))) == handoff.first_token
    # The proposals are the colocated draft's distribution after prompt + first token.
    seen: list[torch.Tensor] = []

    def capture(logits: torch.Tensor, _i: int) -> int:
        seen.append(logits)
        return int(greedy_token_ids(logits))

    ReferenceModel(draft).generate([*prompt, handoff.first_token], 1, choose=capture)
    ids, probs = top_k(seen[0], 4, draft.exp_table)
    assert (list(handoff.top_ids), list(handoff.top_probs)) == (ids, probs)
    assert list(handoff.top_probs) == sorted(handoff.top_probs, reverse=True)
    assert 0 < sum(handoff.top_probs) <= 2**PROB_FRAC_BITS + 4
    # The decode side's first draft forward starts at the first output token's position: it
    # reads the prompt's draft K/V that came with the hand-off instead of recomputing it.
    assert starts and min(starts) == len(prompt)


def test_the_decoder_refuses_what_it_cannot_pair() -> None:
    target = TARGETS["full"]
    t, d = pair(target, 2, 8, 4, 1)
    with pytest.raises(ValueError, match=r"k \(proposals per round\) must be >= 1"):
        SpeculativeDecoder(t, d, 0)
    other = LlamaModel(attrs.evolve(TINY, vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(t, make_runner(other, 8, 4, 8, 1), 2)
    with pytest.raises(ValueError, match="page count"):
        SpeculativeDecoder(t, make_runner(target.draft(2), 9, 4, 9, 1), 2)
    with pytest.raises(ValueError, match="draft"):
        target.draft(2).draft(1)


def test_the_handoff_travels_in_the_metadata_row() -> None:
    """Written into the prefill side's row, copied row to row (what a backend does), read on
    the decode side: the decode starts from it and gives plain greedy decoding's tokens."""
    target = TARGETS["swa"]
    prompt = prompt_of(29, 6)
    pages = pages_needed(len(prompt) + 20, 4) + 1
    p_target, p_draft = pair(target, 2, pages, 4, 1)
    kv = RequestKV("r", state_slot=0)
    handoff = prefill_handoff(p_target, p_draft, kv, prompt, 8, k=3)
    hidden = target.config.hidden
    src, dst = MetadataBuffers(2, speculative_hidden=hidden), MetadataBuffers(
        3, speculative_hidden=hidden)
    src.write(1, handoff.first_token, 0, None, room=77, speculative=handoff.row())
    dst.copy_row_from(src, 1, 2)
    row = dst.read(2, expected_room=77)
    assert row is not None and row.speculative == handoff.row()
    landed = Handoff.from_row(row)
    assert landed == handoff and torch.equal(landed.hidden, handoff.hidden)
    d_target, d_draft = pair(target, 2, pages, 4, 1)
    moved = transfer(p_target, d_target, kv, len(prompt), dst_slot=0)
    copy_state(p_draft, d_draft, kv, moved, len(prompt))
    out = SpeculativeDecoder(d_target, d_draft, 3).decode(moved, prompt, landed, 20,
                                                          ignore_eos=True)
    assert out == ReferenceModel(target).generate(prompt, 20, ignore_eos=True)


def test_speculative_columns_sit_before_the_room() -> None:
    plain, spec = MetadataBuffers(2), MetadataBuffers(2, speculative_hidden=20)
    assert [i.name for i in plain.buffer_infos()] == list(MetadataBuffers.FIELDS)
    names = [i.name for i in spec.buffer_infos()]
    assert names == [*MetadataBuffers.FIELDS[:-1], *MetadataBuffers.SPEC_FIELDS, "room"]
    lens = {i.name: i.item_len for i in spec.buffer_infos()}
    assert (lens["spec_top_ids"], lens["spec_top_probs"], lens["spec_hidden"]) == (64, 64, 128)
    row = SpeculativeRow((5, 9), (40000, 1000), tuple(float(i) / 4 for i in range(20)))
    spec.write(0, 3, 0, None, room=5, speculative=row)
    assert spec.read(0) == MetadataRow(3, 0, None, 5, speculative=row)
    spec.write(0, 4, 0, None, room=6)  # a row without a hand-off clears the old one
    assert spec.read(0) == MetadataRow(4, 0, None, 6)
    spec.write(1, 3, 0, None, room=5, speculative=row)
    spec.clear(1)
    assert spec.read(1) is None and int(spec.spec_top_ids[1].max()) == -1


@pytest.mark.parametrize(
    ("buffers", "row", "problem"),
    [
        (MetadataBuffers(1), SpeculativeRow((1,), (1,), (0.0,) * 4), "no speculative columns"),
        (MetadataBuffers(1, speculative_hidden=4), SpeculativeRow((1,), (1,), (0.0,) * 3),
         "must have 4 values"),
        (MetadataBuffers(1, speculative_hidden=4), SpeculativeRow((), (), (0.0,) * 4),
         "1..16 proposal ids"),
        (MetadataBuffers(1, speculative_hidden=4),
         SpeculativeRow(tuple(range(17)), tuple(range(17)), (0.0,) * 4), "1..16"),
        (MetadataBuffers(1, speculative_hidden=4), SpeculativeRow((1, 2), (1,), (0.0,) * 4),
         "as many probabilities"),
    ],
)
def test_speculative_rows_are_checked(buffers: MetadataBuffers, row: SpeculativeRow,
                                      problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        buffers.write(0, 1, 0, None, room=1, speculative=row)
    assert buffers.read(0) is None


def test_rows_move_only_between_alike_buffers() -> None:
    with pytest.raises(MetadataError, match="speculative_hidden 8"):
        MetadataBuffers(1).copy_row_from(MetadataBuffers(1, speculative_hidden=8), 0, 0)
    with pytest.raises(ValueError, match="speculative_hidden must be"):
        MetadataBuffers(1, speculative_hidden=-1)


def test_round_by_round_with_any_budget() -> None:
    """A decode loop drives one round per pass; a budget of one token is a plain greedy step
    (no proposals), larger budgets cap what a round returns."""
    target = TARGETS["recurrent"]
    prompt = prompt_of(15, 8)
    expected = ReferenceModel(target).generate(prompt, 18, ignore_eos=True)
    for budgets in ([1], [2, 5, 1, 3]):
        pages = pages_needed(len(prompt) + 30, 4) + 1
        t, d = pair(target, 2, pages, 4, 1)
        kv = RequestKV("r", state_slot=0)
        handoff = prefill_handoff(t, d, kv, prompt, 4, k=2)
        decoder = SpeculativeDecoder(t, d, 4)
        speculation = decoder.start(kv, prompt, handoff)
        out, turn = [handoff.first_token], 0
        while len(out) < 18:
            budget = min(budgets[turn % len(budgets)], 18 - len(out))
            new = speculation.round(budget)
            assert 1 <= len(new) <= budget
            out += new
            turn += 1
        assert out == expected and speculation.tokens == [*prompt, *out]
        assert (decoder.stats.proposed == 0) == (budgets == [1])
    with pytest.raises(ValueError, match="budget of >= 1"):
        speculation.round(0)


def test_a_round_without_pages_changes_nothing_and_can_be_retried() -> None:
    target = TARGETS["mixed"]
    prompt = prompt_of(16, 9)
    expected = ReferenceModel(target).generate(prompt, 12, ignore_eos=True)
    t, d = pair(target, 2, 20, 2, 1)
    kv = RequestKV("r", state_slot=0)
    handoff = prefill_handoff(t, d, kv, prompt, 8, k=2)
    speculation = SpeculativeDecoder(t, d, 3).start(kv, prompt, handoff)
    out, refused = [handoff.first_token], 0
    while len(out) < 12:
        budget = min(4, 12 - len(out))
        # The round computes positions up to the newest token's + budget - 1.
        if pages_needed(len(speculation.tokens) - 1 + budget, 2) > len(kv.pages):
            taken = t.pool.allocator.alloc(t.pool.allocator.available())
            assert taken is not None
            with pytest.raises(PoolExhausted):
                speculation.round(budget)  # no page for its proposals: nothing computed
            t.pool.allocator.free(taken)
            refused += 1
        out += speculation.round(budget)
    assert out == expected and refused >= 2
