"""The hybrid reference model (sliding-window and recurrent layers): chunked, paged and
transferred output equals the colocated twin token for token, for every configuration; a
sliding-window layer reads only its window; the recurrence is exact in pieces; configs are
validated."""

from __future__ import annotations

import random

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv.pages import pages_needed
from scheduler.model.fixed_point import DECAY_RANGE, linear_recurrence
from scheduler.model.reference import (
    LlamaModel,
    ModelConfig,
    ModelInputError,
    PagedModelRunner,
    ReferenceModel,
)
from scheduler.model.reference_config import LayerKind
from scheduler.model.request_kv import RELEASED, RequestKV
from scheduler.model.select import reference_model
from scheduler.model.sharded import Mesh, ShardedLlama, ShardError
from scheduler.runner import ForwardBatch, ForwardItem
from tests.hybrid_harness import make_runner, poison_free_pages, transfer

TINY = ModelConfig.tiny()
CONFIGS = {
    "swa": attrs.evolve(TINY, layers=3, swa_layers=(1,), sliding_window=5),
    "swa-wide": attrs.evolve(TINY, swa_layers=(0,), sliding_window=40),
    "swa-one": attrs.evolve(TINY, layers=3, swa_layers=(0, 2), sliding_window=1),
    "recurrent": attrs.evolve(TINY, layers=3, recurrent_layers=(1,)),
    "mixed": attrs.evolve(TINY, layers=4, swa_layers=(0, 2), sliding_window=7,
                          recurrent_layers=(3,)),
}
MODELS = {name: LlamaModel(config) for name, config in CONFIGS.items()}


def step(runner: PagedModelRunner, items: list[ForwardItem]) -> list[int]:
    poison_free_pages(runner.swa_pool)
    return runner.forward(ForwardBatch(tuple(items)))


def swa_bound(runner: PagedModelRunner, chunk: int) -> int:
    """The most SWA pages a request holds during a forward of ``chunk`` tokens: positions
    ``start - W + 1 .. start + chunk - 1``, in pages, plus one for a page boundary."""
    assert runner.swa_pool is not None
    return pages_needed(runner.model.config.sliding_window - 1 + chunk,
                        runner.swa_pool.page_size) + 1


def prefill(runner: PagedModelRunner, prompts: list[list[int]],
            chunk: int) -> tuple[list[RequestKV], list[int]]:
    """All prompts in chunks of ``chunk`` tokens, one chunk of each per batch: each request's
    pages and state slot, and its first output token."""
    kvs = [RequestKV(f"r{i}", state_slot=2 * i + 1) for i in range(len(prompts))]
    done = [0] * len(prompts)
    firsts: list[int] = [-1] * len(prompts)
    while active := [i for i, p in enumerate(prompts) if done[i] < len(p)]:
        items = []
        for i in active:
            items.append(kvs[i].item(runner, prompts[i][done[i] : done[i] + chunk], done[i]))
            done[i] = min(len(prompts[i]), done[i] + chunk)
            if runner.swa_pool is not None:
                assert len(kvs[i].held_swa_pages()) <= swa_bound(runner, chunk)
        for i, token in zip(active, step(runner, items), strict=True):
            if done[i] == len(prompts[i]):
                firsts[i] = token
    return kvs, firsts


def run_pd(model: LlamaModel, prompts: list[list[int]], page_size: int, chunk: int,
           max_new: int) -> list[list[int]]:
    """Chunked prefill in one set of pools, transfer, batched greedy decode in another."""
    n, longest = len(prompts), max(len(p) for p in prompts) + max_new
    pages = n * pages_needed(longest, page_size) + 2
    swa = n * (pages_needed(model.config.sliding_window + chunk, page_size) + 2)
    prefill_side = make_runner(model, pages, page_size, swa, 2 * n)
    decode_side = make_runner(model, pages + 3, page_size, swa + 3, 3 * n)
    decode_side.pool.allocator.alloc(3)  # the decode side's pages sit elsewhere
    kvs, firsts = prefill(prefill_side, prompts, chunk)
    moved = []
    for i, (kv, prompt) in enumerate(zip(kvs, prompts, strict=True)):
        moved.append(transfer(prefill_side, decode_side, kv, len(prompt), 3 * n - 1 - i))
        kv.release(prefill_side)
    outs = [[first] for first in firsts]
    while active := [i for i in range(n) if len(outs[i]) < max_new]:
        items = [moved[i].item(decode_side, (outs[i][-1],), len(prompts[i]) + len(outs[i]) - 1)
                 for i in active]
        for i, token in zip(active, step(decode_side, items), strict=True):
            outs[i].append(token)
    for kv in moved:
        kv.release(decode_side)
    assert decode_side.pool.allocator.available() == pages
    if decode_side.swa_pool is not None:
        assert decode_side.swa_pool.allocator.available() == swa + 3
    return outs


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(range(TINY.vocab_size), k=n) for n in lengths]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 3), (2, 4), (4, 4), (4, 12), (16, 64)])
def test_disaggregated_hybrid_equals_colocated(name: str, page_size: int, chunk: int) -> None:
    model = MODELS[name]
    prompts = prompts_of([1, 9, 23, 41], seed=page_size * 100 + chunk)
    outs = run_pd(model, prompts, page_size, chunk, max_new=12)
    colocated = ReferenceModel(model)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == colocated.generate(prompt, 12, ignore_eos=True)


@st.composite
def hybrid_configs(draw: st.DrawFn) -> ModelConfig:
    layers = draw(st.integers(1, 4))
    kinds = draw(st.lists(st.sampled_from(list(LayerKind)), min_size=layers, max_size=layers))
    full = draw(st.integers(0, layers - 1))
    kinds[full] = LayerKind.FULL
    swa = tuple(i for i, k in enumerate(kinds) if k is LayerKind.SWA)
    return attrs.evolve(
        TINY, layers=layers, seed=draw(st.integers(0, 3)), swa_layers=swa,
        sliding_window=draw(st.integers(1, 12)) if swa else 0,
        recurrent_layers=tuple(i for i, k in enumerate(kinds) if k is LayerKind.RECURRENT))


@settings(max_examples=25)
@given(config=hybrid_configs(), page_size=st.sampled_from([1, 2, 3, 8]),
       chunk=st.integers(1, 20), lengths=st.lists(st.integers(1, 30), min_size=1, max_size=3),
       max_new=st.integers(1, 6), seed=st.integers(0, 1000))
def test_any_hybrid_config_chunked_equals_unchunked(
    config: ModelConfig, page_size: int, chunk: int, lengths: list[int], max_new: int,
    seed: int,
) -> None:
    model = LlamaModel(config)
    prompts = prompts_of(lengths, seed)
    outs = run_pd(model, prompts, page_size, chunk, max_new)
    colocated = ReferenceModel(model)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out == colocated.generate(prompt, max_new, ignore_eos=True)


def test_chunked_logits_are_bit_identical_for_every_position() -> None:
    """Every position's logits, chunked with boundaries inside the window, equal one shot."""
    model = MODELS["mixed"]
    prompt = prompts_of([50], seed=5)[0]
    one = make_runner(model, 8, 8, 8, 1)
    kv = RequestKV("one", state_slot=0)
    whole = one.logits(ForwardBatch((kv.item(one, prompt, 0, all_logits=True),)))
    chunked = make_runner(model, 32, 2, 16, 2)
    kv = RequestKV("chunked", state_slot=1)
    parts = [chunked.logits(ForwardBatch((kv.item(chunked, prompt[s : s + 6], s, True),)))
             for s in range(0, len(prompt), 6)]
    assert torch.equal(whole, torch.cat(parts))
    # The states left behind are the same integers too.
    assert one.states is not None and chunked.states is not None
    assert torch.equal(one.states[:, 0], chunked.states[:, 1])


def test_swa_layers_hold_only_the_window() -> None:
    """A request keeps at most the window's SWA pages however long it gets, and decoding needs
    nothing else: the SWA pool is far smaller than the prompt."""
    model = MODELS["swa"]
    prompt = prompts_of([200], seed=9)[0]
    runner = make_runner(model, 128, 2, 6, 1)  # 6 SWA pages of 2 tokens against 200 tokens
    kv = RequestKV("long")
    tokens = [step(runner, [kv.item(runner, prompt[s : s + 4], s)])[0]
              for s in range(0, 200, 4)][-1:]
    while len(tokens) < 10:
        tokens += step(runner, [kv.item(runner, (tokens[-1],), 199 + len(tokens))])
        assert len(kv.held_swa_pages()) <= 4
    assert tokens == ReferenceModel(model).generate(prompt, 10, ignore_eos=True)
    assert kv.swa_pages[:90] == [RELEASED] * 90


def test_a_released_window_page_is_refused() -> None:
    model = MODELS["swa"]
    runner = make_runner(model, 8, 2, 8, 1)
    item = ForwardItem("x", [1, 2, 3], 6, (0, 1, 2, 3, 4), swa_pages=(RELEASED, RELEASED, 2, 3, 4))
    with pytest.raises(ModelInputError, match=r"swa_pages"):
        runner.forward(ForwardBatch((item,)))
    with pytest.raises(ModelInputError, match=r"need 5 swa_pages"):
        runner.forward(ForwardBatch((attrs.evolve(item, swa_pages=(0,)),)))


def test_a_bad_state_slot_is_refused() -> None:
    runner = make_runner(MODELS["recurrent"], 8, 2, 8, 2)
    with pytest.raises(ModelInputError, match=r"state_slot must be in 0\.\.1"):
        runner.forward(ForwardBatch((ForwardItem("x", [1], 0, (0,)),)))


def test_runner_needs_the_pools_the_config_asks_for() -> None:
    swa, rec = MODELS["swa"], MODELS["recurrent"]
    with pytest.raises(ValueError, match="needs an SWA pool"):
        PagedModelRunner(swa, swa.make_pool(num_pages=4, page_size=2))
    with pytest.raises(ValueError, match="needs states"):
        PagedModelRunner(rec, rec.make_pool(num_pages=4, page_size=2))
    with pytest.raises(ValueError, match="do not fit"):
        PagedModelRunner(rec, rec.make_pool(num_pages=4, page_size=2),
                         states=torch.zeros((1, 2, 3), dtype=torch.int64))
    # The full pool holds the full-attention layers only.
    assert swa.make_pool(num_pages=4, page_size=2).num_layers == 2
    assert swa.make_swa_pool(num_pages=4, page_size=2).num_layers == 1
    assert rec.make_states(5).shape == (1, 5, TINY.heads * TINY.head_dim)


@given(n=st.integers(1, 40), cut=st.integers(0, 40), seed=st.integers(0, 100))
def test_the_recurrence_in_pieces_is_the_recurrence_at_once(n: int, cut: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    width = 5
    inputs = torch.randint(-(1 << 20), 1 << 20, (n, width), generator=gen)
    decay = torch.randint(DECAY_RANGE[0], DECAY_RANGE[1] + 1, (width,), generator=gen)
    zero = torch.zeros(width, dtype=torch.int64)
    whole = linear_recurrence(inputs, decay, zero)
    cut = min(cut, n)
    first = linear_recurrence(inputs[:cut], decay, zero)
    rest = linear_recurrence(inputs[cut:], decay, first[-1] if cut else zero)
    assert torch.equal(whole, torch.cat([first, rest]))
    assert whole.abs().max() <= 1 << 20


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"swa_layers": (1,)}, "sliding_window"),
        ({"sliding_window": 4}, "sliding_window"),
        ({"swa_layers": (2,), "sliding_window": 4}, r"swa_layers must hold layer indices"),
        ({"swa_layers": (1, 0), "sliding_window": 4}, "ascending"),
        ({"swa_layers": [0], "sliding_window": 4}, "swa_layers must be a tuple of integers"),
        ({"swa_layers": (True,), "sliding_window": 4}, "tuple of integers, got .True"),
        ({"recurrent_layers": (0, 1)}, "at least one layer must be full attention"),
        ({"swa_layers": (1,), "sliding_window": 2, "recurrent_layers": (1,)}, "both"),
        ({"swa_layers": (1,), "sliding_window": -1}, "ModelConfig.sliding_window"),
    ],
)
def test_hybrid_config_validation(changes: dict[str, object], problem: str) -> None:
    wrong_type = "tuple of integers" in problem  # refused by the fields' types
    with pytest.raises(TypeError if wrong_type else ValueError, match=problem):
        attrs.evolve(TINY, **changes)  # type: ignore[arg-type]


def test_layer_kinds_and_pool_indices() -> None:
    c = CONFIGS["mixed"]
    assert [c.kind(i) for i in range(4)] == [
        LayerKind.SWA, LayerKind.FULL, LayerKind.SWA, LayerKind.RECURRENT]
    assert c.full_layers == (1,)
    assert [c.pool_index(i) for i in range(4)] == [0, 0, 1, 0]
    assert c.truncated(2) == attrs.evolve(c, layers=2, swa_layers=(0,), recurrent_layers=())


def test_fingerprints() -> None:
    """A config without hybrid layers keeps the fingerprint it had before they existed; each
    hybrid config and each draft has its own."""
    assert LlamaModel(ModelConfig()).fingerprint == "reference-e53f8e8ec281231f"
    prints = {m.fingerprint for m in MODELS.values()}
    assert len(prints) == len(MODELS) and LlamaModel(TINY).fingerprint not in prints
    target = LlamaModel(attrs.evolve(TINY, layers=3))
    assert target.draft(1).fingerprint == f"{target.fingerprint}-draft1"
    assert target.draft(1).fingerprint != LlamaModel(attrs.evolve(TINY, layers=1)).fingerprint


def test_a_hybrid_config_is_not_sharded() -> None:
    with pytest.raises(ShardError, match="hybrid config"):
        ShardedLlama(CONFIGS["mixed"], Mesh.single())


def test_served_hybrid_model_sizes_its_pool_by_the_full_layers() -> None:
    served = reference_model(CONFIGS["mixed"])
    assert served.kv_bytes_per_token == 1 * 2 * TINY.kv_heads * TINY.head_dim * 4
    assert served.make_pool(num_pages=2, page_size=4).num_layers == 1
