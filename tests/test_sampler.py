"""The sampler room on hand-made logits: the seeded stream, greedy and its tie rule, the top-k,
top-p and min-p filters, the draw, masks, and the logprobs a row reports."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lifecycle import SamplingParams
from scheduler.model.fixed_point import greedy_token_ids
from scheduler.sample.logprobs import top_tokens
from scheduler.sample.sampler import RowSpec, sample
from scheduler.sample.stream import request_seed, splitmix64, uniform


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax (temperature 1) is ``probs``."""
    return torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs],
                        dtype=torch.float64)


def draw(logits: torch.Tensor, params: SamplingParams, seed: int = 0, position: int = 0,
         mask: torch.Tensor | None = None) -> int:
    return sample(logits[None], [RowSpec(params, seed, position, mask)])[0].token


def tokens_over_seeds(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    return {draw(logits, params, seed) for seed in range(n)}


def warm(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=1.0, **kw)  # type: ignore[arg-type]


# -- the stream ------------------------------------------------------------------------------


def test_the_stream_is_a_pure_function_of_seed_and_position() -> None:
    draws = [uniform(7, i) for i in range(1000)]
    assert draws == [uniform(7, i) for i in range(1000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == 1000
    assert [uniform(8, i) for i in range(10)] != draws[:10]
    # Roughly uniform: the mean of 1000 draws is within 5 standard errors of 1/2.
    assert abs(sum(draws) / 1000 - 0.5) < 5 * math.sqrt(1 / 12 / 1000)
    # The extremes of the seed range work; 53 bits of each draw are used.
    assert 0.0 <= uniform((1 << 64) - 1, 0) < 1.0
    assert all((u * 2**53).is_integer() for u in draws)
    with pytest.raises(ValueError, match="seed"):
        uniform(1 << 64, 0)


def test_splitmix64_matches_its_published_first_outputs() -> None:
    # splitmix64 seeded with 0: its state steps by the golden gamma, so output i is
    # splitmix64(i * gamma); the first value is the well-known 0xE220A8397B1DCDAF.
    assert splitmix64(0) == 0xE220A8397B1DCDAF


def test_a_request_without_a_seed_draws_from_its_bootstrap_room() -> None:
    assert request_seed(SamplingParams(seed=5), 99) == 5
    assert request_seed(SamplingParams(), 99) == 99


# -- greedy ----------------------------------------------------------------------------------


def test_greedy_takes_the_lowest_id_among_ties_as_the_reference_model_does() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    greedy = SamplingParams()
    got = [s.token for s in sample(logits, [RowSpec(greedy), RowSpec(greedy)])]
    assert got == [1, 0] == greedy_token_ids(logits).tolist()
    # The same rule on the slow path (logprobs asked) and under a mask.
    with_logprob = SamplingParams(return_logprob=True)
    assert sample(logits, [RowSpec(with_logprob)] * 2)[1].token == 0
    mask = torch.tensor([False, False, True, True])
    assert draw(logits[0], greedy, mask=mask) == 3
    assert draw(logits[1], greedy, mask=mask) == 2
    # top_k == 1 is greedy whatever the temperature.
    assert draw(logits[0], warm(top_k=1), seed=123) == 1


# -- the filters and the draw ----------------------------------------------------------------


def test_the_draw_is_the_first_token_whose_cumulative_mass_exceeds_u() -> None:
    probs = [0.2, 0.5, 0.3]  # order: 1 (0.5), 2 (0.3), 0 (0.2)
    logits = logits_of(probs)
    for seed in range(50):
        u = uniform(seed, 3)
        expected = 1 if u < 0.5 else 2 if u < 0.8 else 0
        assert draw(logits, warm(), seed, 3) == expected
    assert tokens_over_seeds(logits, warm()) == {0, 1, 2}


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = logits_of([0.1, 0.4, 0.2, 0.3])
    assert tokens_over_seeds(logits, warm(top_k=2)) == {1, 3}
    assert tokens_over_seeds(logits, warm(top_k=3)) == {1, 3, 2}


def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_it() -> None:
    logits = logits_of([0.5, 0.3, 0.2])
    assert tokens_over_seeds(logits, warm(top_p=0.5)) == {0}
    assert tokens_over_seeds(logits, warm(top_p=0.6)) == {0, 1}
    assert tokens_over_seeds(logits, warm(top_p=0.81)) == {0, 1, 2}
    # A tiny top_p still keeps one token; equal probabilities are ordered by id.
    assert tokens_over_seeds(logits, warm(top_p=1e-9)) == {0}
    assert tokens_over_seeds(logits_of([0.25] * 4), warm(top_p=0.5)) == {0, 1}


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_most_likely() -> None:
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    assert tokens_over_seeds(logits, warm(min_p=0.5)) == {0, 1}
    assert tokens_over_seeds(logits, warm(min_p=0.3)) == {0, 1, 2}
    assert tokens_over_seeds(logits, warm(min_p=1.0)) == {0}


def test_the_filters_together_keep_the_shortest_prefix_and_renormalise() -> None:
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    params = warm(top_k=3, top_p=0.65, min_p=0.1)  # top_k: 3, top_p: 2, min_p: 4 tokens
    for seed in range(100):
        u = uniform(seed, 0)
        # Kept: tokens 0 and 1, renormalised to 4/7 and 3/7.
        assert draw(logits, params, seed) == (0 if u * 0.7 < 0.4 else 1)


def test_temperature_sharpens_and_flattens() -> None:
    logits = logits_of([0.6, 0.4])
    cold = sum(draw(logits, SamplingParams(temperature=0.05), s) for s in range(300))
    hot = sum(draw(logits, SamplingParams(temperature=5.0), s) for s in range(300))
    assert cold < 5 < 100 < hot


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 9.9e-7])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature: float) -> None:
    # logits / temperature would overflow to inf, and the softmax of inf is NaN.
    logits = logits_of([0.1, 0.6, 0.3])
    params = SamplingParams(temperature=temperature, return_logprob=True)
    assert params.greedy
    got = sample(logits[None], [RowSpec(params, seed=3)])[0]
    assert got.token == 1 and got.logprob is not None
    assert got.logprob.logprob == pytest.approx(math.log(0.6))  # unscaled, as greedy's are


@pytest.mark.parametrize("bias", [1e308, -1e308])
def test_a_huge_logit_bias_wins_or_loses_without_overflowing(bias: float) -> None:
    logits = logits_of([0.5, 0.2, 0.3])
    params = SamplingParams(temperature=0.5, logit_bias={2: bias}, return_logprob=True,
                            top_logprobs_num=3)
    got = {sample(logits[None], [RowSpec(params, seed=s)])[0] for s in range(20)}
    assert {g.token for g in got} == ({2} if bias > 0 else {0, 1})
    float32_max = float(torch.finfo(torch.float32).max)  # the metadata row's first token
    for g in got:
        assert g.logprob is not None and abs(g.logprob.logprob) < float32_max
        assert all(abs(v) < float32_max for _, v in g.logprob.top)


def test_a_bias_does_not_bring_back_a_token_min_new_tokens_excludes() -> None:
    logits = logits_of([0.5, 0.2, 0.3])
    params = SamplingParams(temperature=0.5, logit_bias={2: 1e308})
    assert {sample(logits[None], [RowSpec(params, seed=s, banned=(2,))])[0].token
            for s in range(20)} <= {0, 1}


def test_a_mask_removes_tokens_and_an_empty_mask_is_not_applied() -> None:
    logits = logits_of([0.7, 0.1, 0.1, 0.1])
    mask = torch.tensor([False, True, False, True])
    assert tokens_over_seeds(logits, warm(), 200) == {0, 1, 2, 3}
    assert {draw(logits, warm(), s, mask=mask) for s in range(200)} == {1, 3}
    # Nothing allowed: the constraint will reject whatever comes; the row is not masked.
    assert draw(logits, SamplingParams(), mask=torch.zeros(4, dtype=torch.bool)) == 0


@given(
    values=st.lists(st.floats(-20, 20), min_size=2, max_size=40),
    data=st.data(),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 5),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, (1 << 64) - 1),
    position=st.integers(0, 1 << 20),
)
def test_the_token_is_allowed_kept_and_reproducible(
    values: list[float], data: st.DataObject, temperature: float, top_k: int, top_p: float,
    min_p: float, seed: int, position: int,
) -> None:
    n = len(values)
    allowed = data.draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(any))
    mask = torch.tensor(allowed)
    logits = torch.tensor(values, dtype=torch.float64)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            return_logprob=True)
    token = draw(logits, params, seed, position, mask)
    assert allowed[token]
    assert token == draw(logits, params, seed, position, mask)
    if top_k:  # among the top_k allowed tokens (probability desc, id asc)
        order = sorted((i for i in range(n) if allowed[i]), key=lambda i: (-values[i], i))
        assert token in order[:top_k]
    # min_p: its probability is at least min_p times the largest allowed one's.
    best = max(values[i] for i in range(n) if allowed[i])
    assert math.exp((values[token] - best) / temperature) >= min_p - 1e-9


# -- reported logprobs -----------------------------------------------------------------------


def test_logprobs_are_the_log_softmax_greedy_unscaled_sampled_scaled() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0], dtype=torch.float64)
    greedy = sample(logits[None], [RowSpec(SamplingParams(return_logprob=True,
                                                          top_logprobs_num=3))])[0]
    expected = torch.log_softmax(logits, -1)
    assert greedy.logprob is not None and greedy.token == 1
    assert greedy.logprob.logprob == pytest.approx(float(expected[1]))
    # Most likely first, ties to the lower id.
    assert [t for t, _ in greedy.logprob.top] == [1, 3, 2]
    assert [v for _, v in greedy.logprob.top] == pytest.approx(expected[[1, 3, 2]].tolist())
    params = SamplingParams(temperature=0.5, return_logprob=True, top_logprobs_num=2)
    hot = sample(logits[None], [RowSpec(params, seed=4)])[0]
    scaled = torch.log_softmax(logits / 0.5, -1)
    assert hot.logprob is not None
    assert hot.logprob.logprob == pytest.approx(float(scaled[hot.token]))
    assert [t for t, _ in hot.logprob.top] == [1, 3]
    assert [v for _, v in hot.logprob.top] == pytest.approx(scaled[[1, 3]].tolist())
    # Without return_logprob nothing is reported.
    assert sample(logits[None], [RowSpec(SamplingParams(temperature=0.5))])[0].logprob is None


def test_masked_tokens_get_no_probability_and_are_not_listed() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)
    params = SamplingParams(return_logprob=True, top_logprobs_num=3)
    got = sample(logits[None], [RowSpec(params, mask=torch.tensor([True, False, True]))])[0]
    assert got.token == 2 and got.logprob is not None
    assert got.logprob.logprob == pytest.approx(float(torch.log_softmax(logits[[0, 2]], -1)[1]))
    assert [t for t, _ in got.logprob.top] == [2, 0]


def test_top_tokens_break_ties_at_the_cut_to_the_lower_ids() -> None:
    rows = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [4.0, 0.0, 4.0, 4.0, 9.0]])
    assert top_tokens(rows, 2) == [((1, 3.0), (2, 3.0)), ((4, 9.0), (0, 4.0))]
    assert top_tokens(rows, 4) == [((1, 3.0), (2, 3.0), (3, 3.0), (0, 1.0)),
                                   ((4, 9.0), (0, 4.0), (2, 4.0), (3, 4.0))]
    assert top_tokens(rows, 0) == [(), ()]
    assert top_tokens(rows, 9)[0][-1] == (4, 0.0)


@given(st.lists(st.lists(st.integers(-3, 3), min_size=6, max_size=6), min_size=1, max_size=5),
       st.integers(1, 6))
def test_top_tokens_are_the_stable_descending_order(rows: list[list[int]], k: int) -> None:
    values = torch.tensor(rows, dtype=torch.float32)
    expected = [tuple((i, float(row[i])) for i in sorted(range(6), key=lambda i: (-row[i], i))[:k])
                for row in rows]
    assert top_tokens(values, k) == expected


def test_mixed_rows_sample_independently_of_their_batch() -> None:
    logits = torch.randn((4, 50), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    specs = [RowSpec(SamplingParams()), RowSpec(warm(top_p=0.9), seed=3, position=2),
             RowSpec(SamplingParams(return_logprob=True, top_logprobs_num=2)),
             RowSpec(warm(top_k=10), seed=8)]
    together = sample(logits, specs)
    alone = [sample(logits[i : i + 1], [spec])[0] for i, spec in enumerate(specs)]
    assert together == alone
    assert together[0].token == int(logits[0].argmax())
    with pytest.raises(ValueError, match="rows"):
        sample(logits, specs[:2])
