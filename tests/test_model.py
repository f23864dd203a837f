"""The reference model: disaggregated (paged, chunked, transferred) output equals the colocated
reference token for token; determinism; input validation."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv.pages import pages_needed
from kv.pool import KVPool
from scheduler.model.fixed_point import greedy_token_ids
from scheduler.model.reference import (
    LlamaModel,
    ModelConfig,
    ModelInputError,
    PagedModelRunner,
    ReferenceModel,
    greedy_decode_from_pool,
    resolve_device,
)
from scheduler.runner import ForwardBatch, ForwardItem

TINY = LlamaModel(ModelConfig.tiny())


@attrs.define
class Req:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    chunk_budgets: list[int]
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = True
    done: int = 0
    chunks: int = 0
    pages: list[int] = attrs.Factory(list)
    output: list[int] = attrs.Factory(list)


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    return random.Random(seed).choices(range(vocab), k=n)


def next_chunk(req: Req, page_size: int) -> int:
    """Page-aligned cuts as the scheduler makes them; the last chunk takes the remainder."""
    budget = req.chunk_budgets[req.chunks % len(req.chunk_budgets)]
    length = max(page_size, budget // page_size * page_size)
    return min(length, len(req.prompt) - req.done)


def prefill(runner: PagedModelRunner, reqs: list[Req]) -> None:
    """Chunked prefill of all requests in mixed batches, one chunk of each per forward; each
    request's output starts with the token sampled after its last chunk."""
    pool = runner.pool
    while active := [r for r in reqs if r.done < len(r.prompt)]:
        items = []
        for r in active:
            n = next_chunk(r, pool.page_size)
            grow = pages_needed(r.done + n, pool.page_size) - len(r.pages)
            new_pages = pool.allocator.alloc(grow)
            assert new_pages is not None, "test pool too small"
            r.pages += new_pages
            items.append(ForwardItem(r.rid, r.prompt[r.done : r.done + n], r.done, tuple(r.pages)))
            r.done += n
            r.chunks += 1
        for r, token in zip(active, runner.forward(ForwardBatch(tuple(items))), strict=True):
            if r.done == len(r.prompt):
                r.output = [token]


def transfer(src: KVPool, dst: KVPool, src_pages: Sequence[int], dst_pages: Sequence[int]) -> None:
    """What a transfer backend does: page ``src_pages[i]`` lands in ``dst_pages[i]``."""
    s = torch.tensor(src_pages, dtype=torch.int64)
    d = torch.tensor(dst_pages, dtype=torch.int64)
    dst.buffer[:, :, d] = src.buffer[:, :, s]


def decode_batched(runner: PagedModelRunner, reqs: list[Req]) -> None:
    """Decode steps for all unfinished requests together (mixed positions in one batch)."""
    pool = runner.pool

    def unfinished(r: Req) -> bool:
        stops = runner.model.stop_ids(r.stop_token_ids, r.ignore_eos)
        return len(r.output) < r.max_new_tokens and r.output[-1] not in stops

    while active := [r for r in reqs if unfinished(r)]:
        items = []
        for r in active:
            position = len(r.prompt) + len(r.output) - 1
            if position // pool.page_size >= len(r.pages):
                page = pool.allocator.alloc(1)
                assert page is not None, "test pool too small"
                r.pages += page
            items.append(ForwardItem(r.rid, (r.output[-1],), position, tuple(r.pages)))
        for r, token in zip(active, runner.forward(ForwardBatch(tuple(items))), strict=True):
            r.output.append(token)


def disaggregated(
    model: LlamaModel,
    reqs: list[Req],
    page_size: int,
    decode_offset: int,
    permute: Callable[[list[int]], list[int]],
    batched_decode: bool,
) -> None:
    """Prefill in one pool, move the pages into different indices of a second pool, decode there."""
    total = sum(pages_needed(len(r.prompt) + r.max_new_tokens, page_size) for r in reqs)
    prefill_pool = model.make_pool(num_pages=total + 1, page_size=page_size)
    decode_pool = model.make_pool(num_pages=total + decode_offset + 1, page_size=page_size)
    decode_pool.allocator.alloc(decode_offset)
    prefill(PagedModelRunner(model, prefill_pool), reqs)
    for r in reqs:
        dst = decode_pool.allocator.alloc(len(r.pages))
        assert dst is not None
        dst = permute(dst)
        transfer(prefill_pool, decode_pool, r.pages, dst)
        # Freed prefill pages keep stale K/V that later requests must never read.
        prefill_pool.allocator.free(r.pages)
        r.pages = dst
    runner = PagedModelRunner(model, decode_pool)
    if batched_decode:
        decode_batched(runner, reqs)
        return
    for r in reqs:

        def alloc_page() -> int:
            page = decode_pool.allocator.alloc(1)
            assert page is not None
            return page[0]

        r.output = greedy_decode_from_pool(
            runner,
            rid=r.rid,
            pages=r.pages,
            seq_len=len(r.prompt),
            first_token=r.output[0],
            max_new_tokens=r.max_new_tokens,
            alloc_page=alloc_page,
            stop_token_ids=r.stop_token_ids,
            ignore_eos=r.ignore_eos,
        )


def reference(model: LlamaModel, r: Req) -> list[int]:
    return ReferenceModel(model).generate(
        r.prompt, r.max_new_tokens, stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos
    )


prompt_lengths = st.one_of(st.integers(1, 40), st.integers(1, 200), st.integers(200, 2500))


@st.composite
def requests(draw: st.DrawFn, vocab: int) -> Req:
    n = draw(prompt_lengths)
    # Budgets of at least n/12 keep a long prompt with page size 1 to a dozen chunks.
    floor = max(1, n // 12)
    return Req(
        rid=f"r{draw(st.integers(0, 10**6))}",
        prompt=random_prompt(n, draw(st.integers(0, 2**32)), vocab),
        max_new_tokens=draw(st.integers(1, 12)),
        chunk_budgets=draw(st.lists(st.integers(floor, max(floor, 600)), min_size=1, max_size=3)),
        stop_token_ids=tuple(draw(st.sets(st.integers(0, vocab - 1), max_size=40))),
        ignore_eos=draw(st.booleans()),
    )


@settings(max_examples=30)
@given(
    reqs=st.lists(requests(TINY.config.vocab_size), min_size=1, max_size=3),
    page_size=st.sampled_from([1, 16, 64]),
    decode_offset=st.integers(0, 7),
    batched_decode=st.booleans(),
    data=st.data(),
)
def test_disaggregated_equals_reference(
    reqs: list[Req], page_size: int, decode_offset: int, batched_decode: bool, data: st.DataObject
) -> None:
    for i, r in enumerate(reqs):
        r.rid = f"{r.rid}-{i}"

    def permute(pages: list[int]) -> list[int]:
        return data.draw(st.permutations(pages))

    disaggregated(TINY, reqs, page_size, decode_offset, permute, batched_decode)
    for r in reqs:
        assert r.output == reference(TINY, r), r.rid


def test_default_model_long_prompt_with_short_neighbour() -> None:
    model = LlamaModel(ModelConfig())
    vocab = model.config.vocab_size
    reqs = [
        Req("long", random_prompt(1500, 1, vocab), 6, [256, 512]),
        Req("short", random_prompt(37, 2, vocab), 9, [16]),
    ]
    disaggregated(model, reqs, 16, 3, lambda pages: pages[::-1], batched_decode=True)
    for r in reqs:
        assert len(r.output) == r.max_new_tokens
        assert r.output == reference(model, r)


def test_chunked_paged_kv_is_bit_identical_to_one_shot() -> None:
    prompt = random_prompt(300, 3, TINY.config.vocab_size)
    one_shot = TINY.make_pool(num_pages=10, page_size=64)
    chunked = TINY.make_pool(num_pages=40, page_size=16)
    first = PagedModelRunner(TINY, one_shot).forward(
        ForwardBatch((ForwardItem("a", prompt, 0, (9, 3, 5, 0, 7)),))
    )
    pages = list(range(39, 20, -1))
    runner = PagedModelRunner(TINY, chunked)
    for start in range(0, 300, 48):
        out = runner.forward(
            ForwardBatch((ForwardItem("a", prompt[start : start + 48], start, tuple(pages)),))
        )
    assert out == first
    kv_one_shot = one_shot.buffer[:, :, [9, 3, 5, 0, 7]].flatten(2, 3)[:, :, :300]
    kv_chunked = chunked.buffer[:, :, pages].flatten(2, 3)[:, :, :300]
    assert torch.equal(kv_one_shot, kv_chunked)


def test_a_page_table_naming_one_page_twice_changes_the_output() -> None:
    """The equality tests have teeth: losing one page of K/V gives different tokens. (Reordering
    pages would not: attention is a sum over keys, and the arithmetic is exact.)"""
    r = Req("a", random_prompt(200, 4, TINY.config.vocab_size), 12, [64])
    expected = reference(TINY, r)
    duplicated = lambda pages: [pages[0], pages[0], *pages[2:]]  # noqa: E731
    disaggregated(TINY, [r], 16, 0, duplicated, batched_decode=False)
    assert r.output[0] == expected[0]  # the first token comes from the prefill pool
    assert r.output != expected


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    prompt = random_prompt(64, 5, TINY.config.vocab_size)
    again = ReferenceModel(LlamaModel(ModelConfig.tiny())).generate(prompt, 16, ignore_eos=True)
    assert again == ReferenceModel(TINY).generate(prompt, 16, ignore_eos=True)
    other = LlamaModel(ModelConfig.tiny(seed=1))
    assert ReferenceModel(other).generate(prompt, 16, ignore_eos=True) != again


def test_generation_stops_after_the_first_stop_token() -> None:
    prompt = random_prompt(30, 6, TINY.config.vocab_size)
    ref = ReferenceModel(TINY)
    full = ref.generate(prompt, 20, ignore_eos=True)
    stop = full[5]
    cut = full.index(stop) + 1
    assert ref.generate(prompt, 20, stop_token_ids=[stop], ignore_eos=True) == full[:cut]
    assert ref.generate(prompt, 3, stop_token_ids=[stop], ignore_eos=True) == full[: min(3, cut)]


def test_eos_stops_unless_ignored() -> None:
    eos_model = LlamaModel(attrs.evolve(ModelConfig.tiny(), eos_token_id=0))
    prompt = random_prompt(30, 7, TINY.config.vocab_size)
    full = ReferenceModel(eos_model).generate(prompt, 20, ignore_eos=True)
    eos = full[3]
    eos_model = LlamaModel(attrs.evolve(ModelConfig.tiny(), eos_token_id=eos))
    out = ReferenceModel(eos_model).generate(prompt, 20)
    assert out == full[: full.index(eos) + 1] and out[-1] == eos


def test_greedy_ties_go_to_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]])
    assert greedy_token_ids(logits.double()).tolist() == [1, 0, 0]


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        (ForwardItem("x", [1, 2, 3], 0, (0,)), "need 2 pages"),
        (ForwardItem("x", [1, 2, 3], 0, (0, 99)), "page indices"),
        (ForwardItem("x", [], 0, (0,)), ">= 1 input token"),
        (ForwardItem("x", [1, 258], 0, (0,)), "token ids"),
        (ForwardItem("x", [1], 4096, tuple(range(32))), "max_position"),
    ],
)
def test_runner_rejects_bad_items(item: ForwardItem, problem: str) -> None:
    runner = PagedModelRunner(TINY, TINY.make_pool(num_pages=32, page_size=2))
    with pytest.raises(ModelInputError, match=problem) as info:
        runner.forward(ForwardBatch((ForwardItem("ok", [1], 0, (1,)), item)))
    assert info.value.rid == "x"


def test_runner_rejects_a_pool_of_another_shape() -> None:
    pool = KVPool(num_layers=2, num_pages=4, page_size=4, kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="make_pool"):
        PagedModelRunner(TINY, pool)
    # A device no model computes on is refused by name, before the pool's is compared.
    with pytest.raises(ValueError, match="device 'meta' holds no data"):
        PagedModelRunner(TINY, TINY.make_pool(num_pages=4, page_size=4), device="meta")


def test_empty_batch() -> None:
    assert (
        PagedModelRunner(TINY, TINY.make_pool(num_pages=1, page_size=1)).forward(ForwardBatch(()))
        == []
    )


def test_generate_rejects_what_does_not_fit() -> None:
    ref = ReferenceModel(TINY)
    with pytest.raises(ModelInputError, match="max_position"):
        ref.generate([1] * 4000, 100)
    with pytest.raises(ModelInputError, match="empty"):
        ref.generate([], 1)
    with pytest.raises(ModelInputError, match="max_new_tokens"):
        ref.generate([1], 0)


@pytest.mark.parametrize(("ids", "says"), [
    ("", "the prompt is empty; it needs at least one token"),
    ("1,99999", "token ids must be in 0..257, got 99999"),
    ("1,-1,300,2,400,500", "token ids must be in 0..257, got -1, 300, 400, ..."),
    ("1,,2", "--input-ids wants comma-separated integers, got '1,,2'"),
])
def test_pdlife_generate_says_what_is_wrong_with_the_prompt_alone(
    ids: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from scheduler.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["generate", "--input-ids", ids])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"pdlife generate: {says}\n"  # no request id of its own


@pytest.mark.parametrize(("flags", "says"), [
    (("--stop-token-ids", "3,999"), "--stop-token-ids: token ids must be in 0..257, got 999"),
    (("--max-new-tokens", "-3"), "--max-new-tokens must be >= 1, got -3"),
])
def test_pdlife_generate_names_its_flags(
    flags: tuple[str, ...], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from scheduler.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["generate", "--input-ids", "1,2", *flags])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"pdlife generate: {says}\n"


@pytest.mark.parametrize(("flags", "says"), [
    (("--dtype", "bfloat16"), "--dtype is a real model's: the reference model computes in fixed "
                              "point; drop it, or give --model"),
    (("--model", "smollm2", "--hidden", "128", "--seed", "3"),
     "--hidden, --seed are the reference model's; --model smollm2 brings its own shape and "
     "weights: drop them"),
])
def test_pdlife_generate_refuses_flags_of_the_other_kind_of_model(
    flags: tuple[str, ...], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were taken without effect."""
    from scheduler.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["generate", "--prompt", "hi", *flags])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"pdlife generate: {says}\n"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kv_heads": 3}, "heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"hidden": 0}, "hidden"),
        ({"hidden": 10_000}, "hidden"),
        ({"max_position": 1 << 18}, "max_position"),
        ({"dtype": torch.float16}, "dtype"),
        ({"eos_token_id": 258}, "eos_token_id"),
        ({"rope_theta": float("nan")}, "rope_theta"),
    ],
)
def test_config_validation_names_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        ModelConfig(**changes)  # type: ignore[arg-type]


def test_auto_device_is_cuda_exactly_when_available() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert TINY.to("cpu") is TINY
