"""A decode TP rank other than the first forgets each relayed fake-host prompt (a warm-up, a
``/health_generate`` probe) when its request ends there, however it ends.

No HTTP front runs on such a rank: its :class:`~scheduler.service.engines.Engines` registers the
prompt of each relayed fake request with its fake prefill (``MeshDecodePeer.on_relayed``), and
must forget it again, also for a request that ends before the rank made its receiver (refused
at admission), which no receiver forgets.

The engines are the real ones of ``pdlife serve --role decode`` (fake backend, reference
model) on a decode mesh of which this process is rank 1. The collectives are what rank 1 of
a group of two in lockstep gets: the relay hands it the list rank 0 broadcast for the pass (the
test's), the clock is rank 0's, and every agreement is this rank's own values (the other rank's
are the same).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from lifecycle import DecodeState, FailureReason, SamplingParams
from scheduler.dist.ranks import SingleRank
from scheduler.dist.relay import Item
from scheduler.messages import FAKE_BOOTSTRAP_HOST, AbortRequest, DecodeResponse, NewRequest
from scheduler.model.reference import LlamaModel, ModelConfig, PagedModelRunner
from scheduler.prefill.config import SchedulerConfig
from scheduler.service.config import ServeConfig
from scheduler.service.engines import Engines
from scheduler.stepping import step_until

S = DecodeState
MODEL = ModelConfig.tiny(seed=5)
PAGE = 4
PAGES = 16  # 64 tokens: a request of more cannot fit the decode pool
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)
TIMEOUT_S = 30.0


class Broadcast:
    """The inbox relay as a rank other than the first sees it: each pass's exchange returns
    what rank 0 broadcast for that pass (:meth:`send`), and this rank offers nothing."""

    def __init__(self) -> None:
        self._next: list[Item] = []

    def send(self, *items: Item) -> None:
        self._next.extend(items)

    def exchange(self, items: Sequence[Item]) -> list[Item]:
        assert not items, "no front submits on a rank other than the first"
        sent, self._next = self._next, []
        return sent


def _rank_one(relay: Broadcast) -> SimpleNamespace:
    return SimpleNamespace(relay=relay, share_clock=lambda now: now, ranks=SingleRank(),
                           first=False)


@pytest.fixture
def rank() -> Iterator[tuple[Engines, Broadcast, dict[str, DecodeResponse]]]:
    config = ServeConfig(role="decode", backend="fake", model=MODEL,
                         scheduler=SchedulerConfig(page_size=PAGE, check_invariants=True),
                         pool_pages=PAGES, metadata_slots=8)
    relay = Broadcast()
    answers: dict[str, DecodeResponse] = {}
    engines = Engines(
        config, LlamaModel(MODEL), runner_factory=PagedModelRunner, compiler=None,
        detokenize=None, on_prefill=lambda _: None,
        on_decode=lambda r: answers.__setitem__(r.rid, r),
        decode_mesh=_rank_one(relay),  # type: ignore[arg-type]
    )
    try:
        yield engines, relay, answers
    finally:
        engines.close()


def fake(rid: str, room: int, prompt: Sequence[int] = PROMPT, max_new_tokens: int = 4,
         **sampling: Any) -> NewRequest:
    """A warm-up or probe as rank 0's front relays it (its room the front's own)."""
    return NewRequest(rid, list(prompt), bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=0,
                      bootstrap_room=room,
                      sampling=SamplingParams(max_new_tokens, ignore_eos=True, **sampling))


def _settle(engines: Engines, answers: dict[str, DecodeResponse], rids: Sequence[str]) -> None:
    """Step the rank until every one of ``rids`` is answered and its peer holds nothing."""
    peer = engines.decode
    assert peer is not None

    def done() -> bool:
        return all(rid in answers for rid in rids) and peer.idle()
    step_until(peer.step, done, TIMEOUT_S,
               lambda: f"answered {sorted(answers)} of {list(rids)}; "
                       f"{peer.lifecycle.counts()}")
    peer.check_invariants()


def _assert_nothing_held(engines: Engines) -> None:
    """The rank holds no fake prompt any more: neither its fake prefill nor its engines' note
    of the requests whose prompt they registered."""
    assert engines.decode_kv is not None
    assert engines.decode_kv.fake._prompts == {}
    assert engines._relayed_fakes == {}


# How a relayed fake request ends on the rank: the items rank 0 broadcast, and its answer.
ENDINGS: dict[str, tuple[list[Item], DecodeState, FailureReason | None]] = {
    "answered": ([fake("a", 11)], S.DONE, None),
    "cannot_fit_the_pool": ([fake("a", 11, max_new_tokens=200)], S.FAILED,
                            FailureReason.REJECTED),
    "sampling_refused": ([fake("a", 11, stop=("end",))], S.FAILED, FailureReason.REJECTED),
    "empty_prompt": ([fake("a", 11, prompt=())], S.FAILED, FailureReason.REJECTED),
    "aborted_at_admission": ([fake("a", 11), AbortRequest("a")], S.FAILED,
                             FailureReason.ABORTED),
    "shut_down_at_admission": ([fake("a", 11), AbortRequest("a", shutdown=True)], S.FAILED,
                               FailureReason.SHUTDOWN),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_relayed_fake_prompt_is_forgotten_however_its_request_ends(
    rank: tuple[Engines, Broadcast, dict[str, DecodeResponse]], ending: str,
) -> None:
    engines, relay, answers = rank
    items, state, reason = ENDINGS[ending]
    relay.send(*items)
    _settle(engines, answers, ["a"])
    assert (answers["a"].state, answers["a"].reason) == (state, reason), answers["a"]
    _assert_nothing_held(engines)


def test_a_rank_forgets_every_prompt_of_a_mix_and_of_a_reused_request_id(
    rank: tuple[Engines, Broadcast, dict[str, DecodeResponse]],
) -> None:
    engines, relay, answers = rank
    # Warm-ups and probes in one pass: two decode, two are refused at admission, one aborted
    # while it decodes.
    relay.send(fake("ok-1", 1), fake("too-long", 2, max_new_tokens=200),
               fake("ok-2", 3, max_new_tokens=8), fake("stop", 4, stop=("x",)),
               fake("abort", 5, max_new_tokens=40))
    peer = engines.decode
    assert peer is not None

    def decoding() -> bool:
        req = peer.lifecycle.get("abort")
        return req is not None and req.state is S.DECODING
    step_until(peer.step, decoding, TIMEOUT_S)
    relay.send(AbortRequest("abort"))
    _settle(engines, answers, ["ok-1", "too-long", "ok-2", "stop", "abort"])
    assert {rid: a.state for rid, a in answers.items()} == {
        "ok-1": S.DONE, "too-long": S.FAILED, "ok-2": S.DONE, "stop": S.FAILED,
        "abort": S.FAILED}
    _assert_nothing_held(engines)
    # Once answered, an id may come again (the front refuses it only while it is live): the
    # new request's prompt, under its own room, is forgotten as well.
    answers.clear()
    relay.send(fake("ok-1", 6, max_new_tokens=200))
    _settle(engines, answers, ["ok-1"])
    assert answers["ok-1"].reason is FailureReason.REJECTED
    _assert_nothing_held(engines)
