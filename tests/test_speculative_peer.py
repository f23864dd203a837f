"""The decode peer decodes speculatively from the hand-off in the metadata row: the answers
equal a plain peer's (and the colocated run's), proposals and acceptances are counted, and
requests that sample or stop on strings take the plain path."""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs
import pytest

from kv.metadata import MetadataBuffers, SlotAllocator
from lifecycle import DecodeState, SamplingParams
from scheduler.decode import DecodePeer
from scheduler.decode.router import DecodeKVRouter, LocalPrefillFake, _ComputingReceiver
from scheduler.messages import FAKE_BOOTSTRAP_HOST, DecodeResponse, NewRequest
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner, ReferenceModel
from scheduler.model.request_kv import RequestKV
from scheduler.model.speculative import SpeculativeDecoder, prefill_handoff
from scheduler.stepping import step_until

TARGET = LlamaModel(attrs.evolve(ModelConfig.tiny(), layers=4))
PAGES, PAGE_SIZE = 48, 4


class HandoffFake(LocalPrefillFake):
    """The fake bootstrap host's decode-side prefill, which also runs the draft over the
    prompt (into the draft's pool, at the request's pages) and writes the hand-off into the
    row, as a prefill server with a draft model does."""

    def __init__(self, target: PagedModelRunner, draft: PagedModelRunner,
                 metadata: MetadataBuffers) -> None:
        super().__init__(target, metadata)
        self._target, self._draft, self._rows = target, draft, metadata

    def compute(self, receiver: _ComputingReceiver, pages: Sequence[int], slot: int) -> None:
        rid, input_ids, params = receiver.prompt
        if not params.plain:
            super().compute(receiver, pages, slot)
            return
        kv = RequestKV(rid, pages=list(pages))
        handoff = prefill_handoff(self._target, self._draft, kv, input_ids, chunk=8, k=4)
        self._rows.write(slot, handoff.first_token, 0, None, receiver.room,
                         speculative=handoff.row())
        self.forget(receiver.room)


def serve(requests: dict[str, tuple[list[int], SamplingParams]], k: int | None,
          draft_layers: int = 2) -> tuple[dict[str, DecodeResponse], DecodePeer]:
    """Every request through one decode peer (speculative with ``k`` proposals a round, plain
    without)."""
    target = PagedModelRunner(TARGET, TARGET.make_pool(num_pages=PAGES, page_size=PAGE_SIZE))
    draft_model = TARGET.draft(draft_layers)
    draft = PagedModelRunner(draft_model,
                             draft_model.make_pool(num_pages=PAGES, page_size=PAGE_SIZE))
    metadata = MetadataBuffers(4, speculative_hidden=TARGET.config.hidden)
    fake = HandoffFake(target, draft, metadata)
    answers: list[DecodeResponse] = []
    peer = DecodePeer(runner=target, kv=DecodeKVRouter(fake=fake), metadata=metadata,
                      slots=SlotAllocator(4), on_response=answers.append,
                      speculative=None if k is None else SpeculativeDecoder(target, draft, k))
    for room, (rid, (prompt, params)) in enumerate(requests.items(), start=700):
        fake.expect(room, rid, prompt, params)
        peer.submit(NewRequest(rid, tuple(prompt), bootstrap_host=FAKE_BOOTSTRAP_HOST,
                               bootstrap_room=room, sampling=params))
    step_until(peer.step, lambda: len(answers) == len(requests), 60.0,
               lambda: f"answered: {answers}")
    peer.check_invariants()
    assert peer.pool.allocator.available() == PAGES
    return {a.rid: a for a in answers}, peer


def prompt_of(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(TARGET.config.vocab_size), k=n)


@pytest.mark.parametrize(("k", "draft_layers"), [(1, 2), (3, 2), (3, 4)])
def test_the_peer_decodes_speculatively_from_the_row(k: int, draft_layers: int) -> None:
    """A draft of all four layers is the target: every proposal is accepted, so rounds give
    k + 1 tokens and stop tokens fall inside rounds."""
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    requests = {
        "a": (prompt_of(9, 1), greedy),
        "b": (prompt_of(31, 2), attrs.evolve(greedy, max_new_tokens=7)),
        "c": (prompt_of(4, 3), greedy),
        "sampled": (prompt_of(12, 4), attrs.evolve(greedy, temperature=0.7, seed=5)),
        "one": (prompt_of(5, 5), attrs.evolve(greedy, max_new_tokens=1)),
    }
    full = ReferenceModel(TARGET).generate(requests["c"][0], 20, ignore_eos=True)
    for at in (2, 3, 5, 6):  # first occurrences inside rounds of every phase
        if full.index(full[at]) == at:
            requests[f"stop{at}"] = (requests["c"][0],
                                     attrs.evolve(greedy, stop_token_ids=(full[at],)))
    speculative, peer = serve(requests, k, draft_layers)
    plain, _ = serve(requests, None)
    colocated = ReferenceModel(TARGET)
    for rid, (prompt, params) in requests.items():
        got = speculative[rid]
        assert got.state is DecodeState.DONE, got
        assert got.output_ids == plain[rid].output_ids
        assert got.finish_reason == plain[rid].finish_reason
        if params.plain:
            assert list(got.output_ids) == colocated.generate(
                prompt, params.max_new_tokens, stop_token_ids=params.stop_token_ids,
                ignore_eos=True)
    stopped = [rid for rid in requests if rid.startswith("stop")]
    assert len(stopped) >= 2
    for rid in stopped:
        at = int(rid[4:])
        assert list(speculative[rid].output_ids) == full[: at + 1]
        assert speculative[rid].finish_reason == "stop"
    sample = peer.metrics.registry.get_sample_value
    proposed = sample("pdlife_decode_spec_proposed_total")
    accepted = sample("pdlife_decode_spec_accepted_total")
    # Every plain request with more than one token left proposed; the sampled one did not.
    assert proposed is not None and accepted is not None
    assert proposed > 0 and 0 <= accepted <= proposed
    assert (accepted == proposed) == (draft_layers == TARGET.config.layers)
