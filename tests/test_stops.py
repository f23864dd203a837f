"""Stop strings and stop regexes (``scheduler.sample.stops``): the width of their matches, the
tail the decode side decodes, where the text is cut and what a stream may send, and the
refusal of a regex whose search runs past its budget."""

from __future__ import annotations

import re

import pytest

from lifecycle import SamplingParams
from scheduler.sample.stops import SEARCH_BUDGET_S, StopRegexTooSlow, Stops, regex_width


@pytest.mark.parametrize(("pattern", "width"), [
    ("abc", 3), (r"\d{3}", 3), (r"x{2,5}", 5), ("a|bcd", 3), (r"(?i)end", 3), (r"\n\n", 2),
    (r"\d+", None), (".*END", None), (r"a{1,70000}", None),
    # Assertions about the text around the match: a tail would answer them wrongly.
    ("^ 6", None), (r"\A 7", None), (r"(?<=8, )9", None), (r"5(?=, 6)", None), (r"\bend", None),
    (r"(x|(?!b)c)", None), ("(?m)^a", None), (r"x$", 1), (r"x\Z", 1),
])
def test_a_regex_width_is_its_widest_match_or_none_without_one(pattern: str,
                                                                    width: int | None) -> None:
    assert regex_width(re.compile(pattern)) == width


def test_the_tail_spans_four_tokens_a_character_of_the_widest_stop_and_one_more() -> None:
    output = list(range(40))
    stops = Stops.of(SamplingParams(8, stop=["abcd"], stop_regex=[r"\d{6}"]))
    assert stops.width == 6
    assert stops.tail_tokens(output) == output[-25:]  # 6 characters of up to 4 bytes, + 1
    assert stops.tail_tokens(output[:3]) == output[:3]
    unbounded = Stops.of(SamplingParams(8, stop=["abcd"], stop_regex=[r"x\d+"]))
    assert unbounded.width is None and unbounded.tail_tokens(output) == output
    assert not Stops.of(SamplingParams(8)) and Stops.of(SamplingParams(8, stop_regex="a"))


def test_a_match_names_the_stop_that_begins_first_where_the_text_is_cut(
) -> None:
    stops = Stops.of(SamplingParams(8, stop=["END"], stop_regex=[r"[0-9]{2}", r"to+"]))
    assert stops.matched("nothing here") is None
    assert stops.matched("a 42 END") == "[0-9]{2}"  # it begins first
    assert stops.matched("END 42") == "END"
    assert stops.matched("count 42") == "[0-9]{2}"
    assert stops.cut("go to 42 END") == 3  # "to" begins first
    assert stops.cut("nothing") == len("nothing")
    # Two on one tail: the one that begins first names the match, where the text is cut.
    both = Stops.of(SamplingParams(8, stop=["5"], stop_regex=[", 5"]))
    assert both.matched(" 4, 5") == ", 5" and both.cut(" 4, 5") == 2
    assert Stops.of(SamplingParams(8, stop_regex=["5", ", 5"])).matched(" 4, 5") == ", 5"
    assert Stops.of(SamplingParams(8, stop=["a"], stop_regex=["a"])).matched("xa") == "a"


def test_a_stream_sends_what_no_stop_can_still_claim() -> None:
    bounded = Stops.of(SamplingParams(8, stop=["STOP"], stop_regex=[r"\d{3}"]))
    assert bounded.settled("abcdef") == 3  # "def" may begin "STOP"
    assert bounded.settled("ab12") == 1
    assert bounded.settled("ab STOP more") == 3  # a match: up to it, and no further
    unbounded = Stops.of(SamplingParams(8, stop_regex=[r"x\d+"]))
    assert unbounded.settled("abcdef") == 0  # any text may still become a match's start
    assert unbounded.settled("ab x1 cd") == 3


@pytest.mark.filterwarnings("ignore:Possible nested set:FutureWarning")  # re on [[:foo:]]
@pytest.mark.parametrize(("pattern", "why"), [
    ("(a", "is not a regular expression"), ("a*", "matches the empty string"),
    ("", "matches the empty string"), ("(x|)", "matches the empty string"),
    # The engines read a pattern with both re (its width) and the regex module (the search):
    # what either refuses is refused here, not left to fail the engine.
    ("[[:foo:]]", "is not a regular expression: unknown property"),
    ("(?<=a+)b", "is not a regular expression: look-behind requires fixed-width pattern"),
    (r"\p{L}", r"is not a regular expression: bad escape \p"),
])
def test_a_stop_regex_that_cannot_end_an_answer_properly_is_refused(pattern: str,
                                                                     why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        SamplingParams(8, stop_regex=[pattern])


@pytest.mark.parametrize("pattern", [r"(a|a)+b", r"(?:a|a)*[^a]", r"(.|a)+[^a]"])
def test_a_stop_regex_that_backtracks_catastrophically_is_refused_not_searched_on(
        pattern: str) -> None:
    """Over 64 ``a``s each pattern has 2**64 ways to fail: ``re`` would search for ages holding
    the GIL. Every search stops at its budget and names the pattern; a short text is searched
    as ever."""
    stops = Stops.of(SamplingParams(8, stop=["END"], stop_regex=["x+y", pattern]))
    text = "a" * 64
    for search in (stops.matched, stops.cut, stops.settled):
        with pytest.raises(StopRegexTooSlow) as caught:
            search(text)
        assert caught.value.pattern == pattern
        assert str(caught.value).startswith(
            f"stop_regex {pattern!r} took too long on the output: searching its 64 characters "
            f"ran past the {SEARCH_BUDGET_S * 1000:.0f} ms a search may take")
    assert stops.matched("aab END") == pattern and stops.cut("aab END") == 0


@pytest.mark.parametrize("pattern", ["(?<=a+)b", "[[:foo:]]"])
def test_stops_of_a_record_built_around_its_checks_raise_value_error(pattern: str) -> None:
    """The engines refuse such a request (SamplingRefused, 400) instead of failing the pass:
    either parser's error is a ValueError here."""
    params = SamplingParams(8)
    object.__setattr__(params, "stop_regex", (pattern,))  # what the record's checks refuse
    with pytest.raises(ValueError, match="is not a regular expression this server can search"):
        Stops.of(params)
